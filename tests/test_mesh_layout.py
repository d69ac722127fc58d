"""Mesh layouts (DTensor's placements as linop layouts) and Redistribute between any two, in one
process with the numpy interpreter: exact in integers against the global array, exact adjoints,
torch's own shard boxes, typed errors."""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import verify
from linop import GlobalShapeError, LinopError, OperandError, PlacementError, StateError
from linop.mesh_layout import MeshLayout, Partial, Replicate, Shard, as_placement, chunk_sizes
from linop.program import fingerprint
from linop.redistribute import Redistribute, RedistributeCopies, RedistributeSums
from verify.strategies_mesh import layout_pairs, placements


def check_redistribute(source: MeshLayout, destination: MeshLayout, seed: int = 0) -> Redistribute:
    """Redistribute source -> destination is exact on a random integer array (random partial
    terms), replicas agree, and its adjoint is exact; returns the tree."""
    rng = np.random.default_rng(seed)
    tree = Redistribute(source, destination)
    data = rng.integers(-50, 50, source.global_shape)
    out = tree(source.scatter(data, rng=rng))
    assert np.array_equal(destination.gather(out), data)  # gather also checks that replicas agree
    proof = verify.exact_adjoint(tree)
    assert proof, proof
    return tree


# -- layouts ------------------------------------------------------------------------------
def test_chunk_sizes_follow_torch_chunk():
    torch = pytest.importorskip("torch")
    for length, parts in itertools.product(range(0, 13), range(1, 6)):
        chunks = [c.shape[0] for c in torch.chunk(torch.empty(length), parts)] if length else []
        assert chunk_sizes(length, parts) == tuple(chunks + [0] * (parts - len(chunks)))
    assert chunk_sizes(77, 4) == (20, 20, 20, 17)


@settings(max_examples=40)
@given(
    st.lists(st.integers(1, 3), min_size=1, max_size=3).flatmap(
        lambda mesh: st.tuples(
            st.just(tuple(mesh)),
            st.lists(st.integers(0, 9), min_size=1, max_size=3).flatmap(
                lambda shape: st.tuples(st.just(tuple(shape)), placements(len(mesh), len(shape)))
            ),
        )
    )
)
def test_boxes_equal_torch_dtensor_boxes(case):
    """Every block's box, nested shards included, is the one DTensor computes."""
    pytest.importorskip("torch")
    from torch.distributed.tensor import Partial as TorchPartial
    from torch.distributed.tensor import Replicate as TorchReplicate
    from torch.distributed.tensor import Shard as TorchShard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    mesh, (shape, ours) = case
    layout = MeshLayout.from_placements(mesh, ours, shape)
    theirs = [
        TorchShard(p.dim)
        if isinstance(p, Shard)
        else TorchReplicate()
        if isinstance(p, Replicate)
        else TorchPartial()
        for p in ours
    ]
    for c in layout.partition.indices():
        local, offset = _compute_local_shape_and_global_offset(shape, mesh, list(c), theirs)
        start, stop = layout.box(c)
        assert tuple(local) == tuple(b - a for a, b in zip(start, stop))
        assert all(o == a for o, a, n in zip(offset, start, local) if n)  # empty pieces: any offset


def test_torch_placements_convert():
    pytest.importorskip("torch")
    from torch.distributed.tensor import Partial as TorchPartial
    from torch.distributed.tensor import Replicate as TorchReplicate
    from torch.distributed.tensor import Shard as TorchShard

    assert as_placement(TorchShard(1)) == Shard(1)
    assert as_placement(TorchReplicate()) == Replicate()
    assert as_placement(TorchPartial()) == Partial()
    with pytest.raises(PlacementError, match="mesh dimension 2"):
        as_placement(TorchPartial("max"), 2)


def test_nested_shards_cut_in_mesh_order():
    layout = MeshLayout.from_placements((2, 3), [Shard(0), Shard(0)], (11, 2))
    # 11 -> 6/5, then 6 -> 2/2/2 and 5 -> 2/2/1
    assert layout.sizes[0] == (2, 2, 2, 2, 2, 1)
    assert layout.box((1, 2)) == ((10, 0), (11, 2))
    explicit = layout.with_placements(layout.placements, {0: (0, 1, 2, 3, 4, 1)})
    assert explicit.box((1, 1)) == ((6, 0), (10, 2))


def test_scatter_gather_and_replicas():
    layout = MeshLayout.from_placements((2, 2), [Replicate(), Partial()], (3, 4))
    data = np.arange(12).reshape(3, 4)
    state = layout.scatter(data, rng=np.random.default_rng(1))
    assert np.array_equal(state["x[0,1]"], state["x[1,1]"])  # replicas of one partial term
    assert np.array_equal(state["x[0,0]"] + state["x[0,1]"], data)
    assert np.array_equal(layout.gather(state), data)
    state["x[1,0]"] = state["x[1,0]"] + 1
    with pytest.raises(StateError, match=r"'x\[0,0\]' and 'x\[1,0\]' differ"):
        layout.gather(state)


def test_tensor_and_back():
    layout = MeshLayout.from_placements((2, 2), [Shard(1), Replicate()], (4, 6), {1: (1, 5)})
    tensor = layout.tensor()
    assert tensor.partition.shape == (1, 2) and tensor.partition.workers == (0, 2)
    assert tensor.sizes == ((4,), (1, 5))
    back = MeshLayout.from_distributed_tensor(tensor)
    assert back.placements == (Replicate(), Shard(1)) and back.sizes == tensor.sizes
    assert [b.worker for b in back.blocks] == [0, 2]


# -- redistribute -------------------------------------------------------------------------
def test_uneven_rows_to_columns_where_dtensor_is_wrong():
    """Rows 10/30/7/30 (public thread pytorch#144109) and 77 = 20/20/20/17 over 4, to columns
    and back, exactly."""
    rows = MeshLayout.from_placements((4,), [Shard(0)], (77, 9), {0: (10, 30, 7, 30)}, name="r")
    columns = rows.with_placements([Shard(1)], name="c")
    chunked = rows.with_placements([Shard(0)], name="k")
    assert [b.shape[1] for b in columns.blocks] == [3, 3, 3, 0]
    assert [b.shape[0] for b in chunked.blocks] == [20, 20, 20, 17]
    for a, b in [(rows, columns), (columns, rows), (rows, chunked), (chunked, columns)]:
        tree = check_redistribute(a, b)
        assert isinstance(tree.expand(), RedistributeCopies)


def test_every_placement_pair_on_a_2d_mesh():
    """All pairs of placements of a 2-d tensor on a 2 x 2 mesh (LINOP_LONG=1: a 2 x 3 mesh,
    both tensor dimensions), the first mesh dimension's rows uneven where it alone shards."""
    long = os.environ.get("LINOP_LONG") == "1"
    kinds = [Shard(0), *([Shard(1)] if long else []), Replicate(), Partial()]
    mesh, shape = ((2, 3), (3, 5)) if long else ((2, 2), (3, 2))
    for a, b in itertools.product(itertools.product(kinds, repeat=2), repeat=2):
        uneven = a[0] == Shard(0) and a[1] != Shard(0)
        source = MeshLayout.from_placements(mesh, a, shape, {0: (1, 2)} if uneven else None, name="a")
        check_redistribute(source, source.with_placements(b, name="b"))


@settings(max_examples=40)
@given(layout_pairs(), st.integers(0, 2**16))
def test_redistribute_is_exact_for_drawn_layouts(pair, seed):
    source, destination = pair
    tree = check_redistribute(source, destination, seed)
    assert tree.H == Redistribute(
        destination.dual(), source.dual(), None if tree.middle is None else tree.middle.dual()
    )
    assert verify.equal(tree.H, tree.H.expand())
    assert len(fingerprint(tree)) == 16


def test_partial_to_replicate_goes_through_a_sharded_layout():
    source = MeshLayout.from_placements((4,), [Partial()], (6, 3), name="p")
    tree = check_redistribute(source, source.with_placements([Replicate()], name="r"))
    sums, copies = tree.stages()
    assert isinstance(sums, RedistributeSums) and isinstance(copies, RedistributeCopies)
    assert sums.destination.placements == (Shard(0),)  # reduce-scatter, then all-gather
    assert tree.H.stages()[0].destination == sums.destination.dual()


def test_replicate_to_shard_moves_nothing_between_workers():
    source = MeshLayout.from_placements((2, 2), [Replicate(), Shard(1)], (5, 6), name="a")
    tree = check_redistribute(source, source.with_placements([Shard(0), Shard(1)], name="b"))
    blocks = {b.name: b.worker for b in (*tree.domain.blocks, *tree.range.blocks)}
    assert all(blocks[p.source] == blocks[p.target] for p in tree.expand().movement.pieces)


def test_the_oracle_catches_a_wrong_layout():
    """Control: reading the output with another layout of the same block shapes is caught."""
    source = MeshLayout.from_placements((2, 2), [Shard(0), Replicate()], (4, 4), name="a")
    data = np.arange(16).reshape(4, 4)
    out = Redistribute(source, source.with_placements([Shard(0), Shard(1)], name="b"))(source.scatter(data))
    wrong = source.with_placements([Shard(1), Shard(0)], name="b")
    assert not np.array_equal(wrong.gather(out), data)


# -- typed errors -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("build", "match"),
    [
        (
            lambda: MeshLayout.from_placements((2, 2), [Shard(0)], (4,)),
            r"1 placements for the 2 dimensions of mesh \(2, 2\)",
        ),
        (lambda: MeshLayout.from_placements((2,), [Shard(2)], (4, 4)), r"mesh dimension 0 is Shard\(2\)"),
        (lambda: MeshLayout.from_placements((2,), ["S0"], (4,)), "mesh dimension 0: placement 'S0'"),
        (
            lambda: MeshLayout.from_placements((2,), [Shard(0)], (4,), {0: (1, 2)}),
            r"tensor dimension 0 sizes \(1, 2\) add up to 3",
        ),
        (
            lambda: MeshLayout.from_placements((2,), [Shard(0)], (4, 3), {1: (1, 2)}),
            "tensor dimension 1, which no mesh dimension shards",
        ),
        (
            lambda: MeshLayout.from_placements((2, 2), [Shard(0), Shard(0)], (4,), {0: (2, 2)}),
            "cut into 4 pieces",
        ),
        (lambda: MeshLayout.from_placements((2,), [Shard(0)], (4,), {0: (5, -1)}), "negative size"),
        (lambda: MeshLayout.from_placements((0,), [Shard(0)], (4,)), "extent below 1"),
    ],
)
def test_layout_errors_name_the_dimension(build, match):
    with pytest.raises(PlacementError, match=match):
        build()


def test_redistribute_errors():
    a = MeshLayout.from_placements((2,), [Shard(0)], (4,), name="a")
    with pytest.raises(GlobalShapeError, match=r"\(4,\).*\(5,\)"):
        Redistribute(a, MeshLayout.from_placements((2,), [Shard(0)], (5,), name="b"))
    with pytest.raises(PlacementError, match=r"mesh \(2,\).*mesh \(1, 2\)"):
        Redistribute(a, MeshLayout.from_placements((1, 2), [Replicate(), Shard(0)], (4,), name="b"))
    with pytest.raises(PlacementError, match="different ranks"):
        Redistribute(a, MeshLayout.from_placements((2,), [Shard(0)], (4,), ranks=(1, 0), name="b"))
    with pytest.raises(OperandError, match="both named 'a'"):
        Redistribute(a, a)
    with pytest.raises(PlacementError, match="partial terms summed"):
        RedistributeCopies(a.with_placements([Partial()], name="p"), a.with_placements([Shard(0)], name="b"))
    with pytest.raises(LinopError, match="MeshLayout"):
        Redistribute(a, "b")  # type: ignore[arg-type]


# -- the torch side, in one process ------------------------------------------------------------
def test_torch_mesh_layout_and_placements_round_trip():
    pytest.importorskip("torch")
    from torch.distributed.tensor import Replicate as TorchReplicate
    from torch.distributed.tensor import Shard as TorchShard

    from linop.frameworks.dtensor import mesh_layout, torch_placements

    layout = mesh_layout((2, 2), [TorchShard(0), TorchReplicate()], (5, 3), {0: (4, 1)})
    assert layout == MeshLayout.from_placements((2, 2), [Shard(0), Replicate()], (5, 3), {0: (4, 1)})
    assert torch_placements(layout) == (TorchShard(0), TorchReplicate())
    assert mesh_layout((2, 2), torch_placements(layout), (5, 3), {0: (4, 1)}) == layout


def test_redistribute_local_checks_the_group_first():
    """The process group is checked before the local tensor (issue 40: a wrapper's group
    mistakes first): without an initialized group the error says so, even for a local tensor
    of the wrong shape. The wrong shape itself is named on a real group by
    tests/test_framework_edges.py ("a wrong local shape on rank 1")."""
    torch = pytest.importorskip("torch")
    from linop.errors import ProcessGroupError
    from linop.frameworks.dtensor import redistribute_local

    rows = MeshLayout.from_placements((4,), [Shard(0)], (77, 9), {0: (10, 30, 7, 30)})
    with pytest.raises(ProcessGroupError, match="init_process_group"):
        redistribute_local(torch.zeros(20, 9), rows, [Shard(1)])  # torch.chunk's rows, not the layout's
