"""One rank's construction of a layer's movements and module at scale: a movement with
pass-through blocks next to a grid of copies is validated and given its spaces without
listing the grid (:class:`~linop.pieces.JoinedSpace`), the spaces equal, hash and order as the
listed ones, bad trees raise the errors they raised, and a convolution's or an affine layer's
module at P = 65,536 lists no block space of P blocks."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import numpy as np
import pytest

from linop import (
    AllReduce,
    BlockExistsError,
    Broadcast,
    DistributedTensor,
    Identity,
    Kernel,
    OperandError,
    Partition,
    PartitionError,
    Space,
)
from linop.collectives import BlockGrid, SumReduce
from linop.layers import Affine, Convolution
from linop.layers.base import partial_sums_reduction
from linop.pieces import JoinedSpace, joined
from linop.program import fingerprint
from linop.space import GridSpace

LARGE = 1000
"""A space of more blocks than this is a listing of the grid (the cases below have 16,384 or
65,536; the others a few)."""


@pytest.fixture
def listings(monkeypatch):
    """The sizes of the spaces that list their blocks (a plain space built, or a grid or
    joined space listed on first use), above LARGE blocks."""
    seen: list[int] = []
    original = Space._adopt

    def counted(self, ordered):
        if len(ordered) > LARGE:
            seen.append(len(ordered))
        return original(self, ordered)

    monkeypatch.setattr(Space, "_adopt", counted)
    return seen


def _grids():
    w = DistributedTensor("y_w", (4, 24), Partition((2, 3))).space
    b = DistributedTensor("y_b", (4,), Partition((2,), (7, 9))).space
    x = DistributedTensor("x", (6, 6), Partition((3, 2), (5, 4, 3, 2, 1, 0))).space
    few = Space([("z", (2,), 1), ("a1", (1,), 8)])
    inner = Space([("y_w[0,1]x", (3,), 2)])  # sorts inside y_w's names: the parts interleave
    return w, b, x, few, inner


@pytest.mark.parametrize(
    "parts", [("w", "b"), ("b", "w"), ("w", "few"), ("few", "x", "b"), ("w", "inner"), ("x", "w", "b")]
)
def test_a_joined_space_is_the_space_of_its_parts_blocks(parts):
    named = dict(zip(("w", "b", "x", "few", "inner"), _grids()))
    spaces = tuple(named[p] for p in parts)
    listed = Space([block for space in spaces for block in space])
    joined_space = JoinedSpace(spaces)
    assert hash(joined_space) == hash(listed)  # before it is listed (the hash from the parts)
    assert joined_space == listed and listed == joined_space
    assert len(joined_space) == len(listed) and joined_space.size == listed.size
    assert joined_space.max_worker == listed.max_worker
    assert tuple(joined_space.workers) == tuple(listed.workers)
    for worker in range(12):
        assert joined_space.owned(worker) == listed.owned(worker)
    for block in listed:
        assert block.name in joined_space and joined_space.block(block.name) == block
    assert "nothing" not in joined_space
    assert joined_space.blocks == listed.blocks and joined_space.names == listed.names
    assert joined_space.offset(listed.names[-1]) == listed.offset(listed.names[-1])
    assert JoinedSpace(tuple(reversed(spaces))) == joined_space  # the same parts, any order
    assert joined_space != Space(listed.blocks[1:])
    assert pickle.loads(pickle.dumps(JoinedSpace(spaces))) == listed  # its slots filled as it pickles


def test_joined_gives_a_part_alone_a_plain_union_or_a_joined_space():
    w, b, x, few, _ = _grids()
    assert joined("T", Space(), w) is w
    assert isinstance(joined("T", few, Space([("q", (1,))])), Space)
    both = joined("T", w, b)
    assert isinstance(both, JoinedSpace) and both.parts == (w, b)
    assert joined("T", both, x).parts == (w, b, x)  # flattened


def _copies_with_others(s: int):
    """A broadcast of a 4 x 4 tensor to an s x s grid of copies, and a bias tensor passing
    through (a layer's weights and bias, as Convolution.parameter_movement has them)."""
    weights = DistributedTensor("w", (4, 4), Partition((1, 1)))
    bias = DistributedTensor("b", (4,), Partition((1,)))
    return weights, bias, Partition((s, s))


def test_a_movement_with_pass_through_blocks_next_to_a_grid_lists_none(listings):
    """P = 65,536 copies: the broadcast, its adjoint and a second broadcast passing the first's
    copies through are checked and given their spaces without a list of the P copies."""
    weights, bias, copies = _copies_with_others(256)
    first = Broadcast(weights, copies, "wt", others=bias.space)
    assert isinstance(first.range, JoinedSpace)
    adjoint = first.H
    assert isinstance(adjoint, SumReduce) and adjoint.domain == first.range
    second = Broadcast(bias, copies, "bt", others=first.copies.space)
    tree = second @ first
    assert tree.domain == Space([*weights.blocks, *bias.blocks])
    assert len(tree.range) == 2 * 256 * 256
    assert listings == []


def test_bad_pass_through_blocks_raise_the_errors_they_raised():
    weights, bias, copies = _copies_with_others(4)
    clash = Space([("wt[1,2]", (4, 4), 0)])  # a copy's name
    with pytest.raises(BlockExistsError, match="wt\\[1,2\\]"):
        Broadcast(weights, copies, "wt", others=clash)
    with pytest.raises(BlockExistsError, match="w\\[0,0\\]"):  # a source block's name
        Broadcast(weights, copies, "wt", others=Space([("w[0,0]", (4, 4), 0)]))
    with pytest.raises(BlockExistsError, match="wt\\["):  # a grid of the copies' prefix
        Broadcast(weights, copies, "wt", others=BlockGrid.uniform("wt", Partition((2, 2)), (4, 4)).space)
    with pytest.raises(BlockExistsError, match="wt\\["):  # a joined space holding a copy
        Broadcast(weights, copies, "wt", others=joined("T", bias.space, clash))
    with pytest.raises(BlockExistsError):  # the copies named as the source
        Broadcast(weights, copies, "w", others=bias.space)
    with pytest.raises(OperandError, match="others must be a Space"):
        Broadcast(weights, copies, "wt", others=[("q", (1,))])
    large = Space([(f"q{k}", (1,), 0) for k in range(20)] + [("wt[0,0]", (4, 4), 0)])
    with pytest.raises(BlockExistsError, match="wt\\[0,0\\]"):  # too many to look up: listed
        Broadcast(weights, copies, "wt", others=large)


@pytest.mark.parametrize("p_co", [1, 2])
def test_a_convolution_s_parameter_movement_at_scale_lists_no_grid(p_co, listings):
    x = DistributedTensor("x", (2, 4, 1024, 1024), Partition((1, 1, 128, 128)))
    layer = Convolution(x, 4, Kernel(3, padding=1), workers=Partition((1, p_co, 1, 128, 128)))
    movement = layer.parameter_movement
    assert movement.domain == layer.parameter_space
    assert len(movement.range) == 2 * p_co * 128 * 128  # the weight and the bias copies
    assert movement.H.domain == movement.range
    assert layer.window_operator.domain == x.space
    assert listings == []


@pytest.mark.parametrize("p_co", [1, 2])
def test_a_convolution_s_replicated_gradient_sum_at_scale_lists_no_grid(p_co, listings):
    """``copy_gradient_sum`` (LayerModule(..., replicate=True)) of P = 16,384 workers: its
    grids described, each all-reduce's pass-through the other grid's space, none listed."""
    x = DistributedTensor("x", (2, 4, 1024, 1024), Partition((1, 1, 128, 128)))
    layer = Convolution(x, 4, Kernel(3, padding=1), workers=Partition((1, p_co, 1, 128, 128)))
    total = layer.copy_gradient_sum
    assert len(total.domain) == 2 * p_co * 128 * 128 and total.range == total.domain
    assert listings == []


@pytest.mark.parametrize("p_co", [1, 2])
@pytest.mark.parametrize("bias", [True, False])
def test_a_convolution_s_movements_are_the_listed_ones(p_co, bias):
    """The described pieces (the bias copies' workers, the windows' grid, the spaces) are
    the blocks and workers the listed construction gave, and the movement is exact."""
    x = DistributedTensor("x", (2, 4, 12, 10), Partition((1, 1, 3, 2), (5, 6, 7, 8, 9, 10)))
    pw = Partition((1, p_co, 1, 3, 2), tuple(range(5, 5 + 6 * p_co)))
    layer = Convolution(x, 3, Kernel(3, padding=1), workers=pw, bias=bias)
    movement = layer.parameter_movement
    expected: list = []  # the sources dropped, the copies made
    for j in pw.indices():
        _, co, ci, *s = j
        expected.append(("wt" + str(list(j)).replace(" ", ""), (layer.co_sizes[co], 4, 3, 3), pw.worker(j)))
        if bias and ci == 0:
            expected.append((f"bt[{','.join(map(str, (*s, co)))}]", (layer.co_sizes[co],), pw.worker(j)))
    assert movement.range == Space(expected)
    state = layer.parameter_space.random(0)
    out = movement(state)
    for j in pw.indices():
        _, co, _, *s = j
        weight, bias_name = layer.local_operands(j)[1:]
        np.testing.assert_array_equal(out[weight], state[layer.weights.block_name((co, 0, 0, 0))])
        if bias_name is not None:
            np.testing.assert_array_equal(out[bias_name], state[layer.bias.block_name((co,))])
    if layer.broadcasts_input:  # the windows' grid and the copies' workers, as listed before
        broadcast = layer.window_operator.factors[0]
        shapes = tuple(layer.geometry.window_shape(g) for g in x.partition.indices())
        listed = BlockGrid(broadcast.tensor.name, x.partition, shapes)
        assert broadcast.tensor.space == listed.space and broadcast.tensor.blocks == listed.blocks
        grid = (p_co, 1, 1, 3, 2)
        workers = tuple(pw.worker((0, co, ci, *s)) for co, _, ci, *s in np.ndindex(*grid))
        assert broadcast.partition == Partition(grid, workers)


def test_an_affine_layer_s_spaces_are_the_listed_ones():
    x = DistributedTensor("x", (2, 12), Partition((1, 3), (4, 5, 6)))
    for bias in (True, False):
        layer = Affine(x, 4, bias=bias)
        blocks = [*layer.weights.blocks, *(layer.bias.blocks if bias else ())]
        assert layer.parameter_space == Space(blocks) and hash(layer.parameter_space) == hash(Space(blocks))
        reduction = layer.output_reduction
        partials = Space(layer.partial_block(j) for j in layer.work_indices())
        assert reduction.domain == partials and reduction.range == layer.y.space


@pytest.mark.parametrize("held", [[(0, 1)], [(0, 0), (0, 2)], []])
def test_scatter_parameters_cuts_the_held_blocks_alone(held):
    x = DistributedTensor("x", (2, 12), Partition((1, 3)))
    layer = Affine(x, 4)
    rng = np.random.default_rng(1)
    w, b = rng.standard_normal(layer.weights.global_shape), rng.standard_normal(layer.bias.global_shape)
    whole = layer.scatter_parameters(w, b)
    mine = layer.scatter_parameters(w, b, held=lambda partition: [g[: partition.ndim] for g in held])
    names = {layer.weights.block_name(g) for g in held} | {layer.bias.block_name(g[:1]) for g in held}
    assert set(mine) == names
    for name in names:
        np.testing.assert_array_equal(mine[name], whole[name])
    with pytest.raises(Exception, match="weights"):
        layer.scatter_parameters(w[:, 1:], b, held=lambda partition: [])


def _rank_of_p(s: int):
    pytest.importorskip("torch")
    pytest.importorskip("mpi4py")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_scale_layers

    return bench_scale_layers.rank_of_p((s // 2) * s + s // 2, s * s)


@pytest.mark.parametrize("case", ["conv", "affine", "affine-replicate"])
def test_a_layer_module_of_many_workers_lists_no_block_space(case, listings):
    """P = 65,536 (the interior rank of a test communicator): the module's construction lists
    no space of P blocks (the parameter movement, its adjoint, the reduction, the parameters
    cut, the fingerprints, an affine layer's reduction)."""
    from linop.frameworks.torch_layers import LayerModule

    s = 256
    comm = _rank_of_p(s)
    if case == "conv":
        x = DistributedTensor("x", (2, 4, 8 * s, 8 * s), Partition((1, 1, s, s)))
        layer = Convolution(x, 4, Kernel(3, padding=1))
    else:
        x = DistributedTensor("x", (2, 8 * s * s), Partition((1, s * s)))
        layer = Affine(x, 4)
    # replicated, an affine layer's copies are its blocks (an identity movement): cut alone
    module = LayerModule(layer, comm=comm, replicate=case == "affine-replicate")
    rank = (s // 2) * s + s // 2
    # the fingerprint of an affine layer's Identity(W, b) describes the joined (W, b) by its
    # parts (W's rule, b's one block) and its reduction's P workers are a range: none listed
    assert listings == []
    if case == "conv":  # the parameters live on worker 0; this rank computes one output block
        assert module.parameter_names == () and module.output_names == (f"y[0,0,{s // 2},{s // 2}]",)
    else:  # its weight block (the bias on worker 0); the output is reduced onto worker 0
        assert module.parameter_names == (f"y_w[0,{rank}]",) and module.output_names == ()
        assert isinstance(layer.parameter_space, JoinedSpace)
        assert isinstance(layer.weights.space, GridSpace)


def test_a_partition_of_an_integer_array_is_the_partition_of_its_ints():
    """The bias copies' workers with P_co > 1 come as an integer array (checked at C speed):
    the partition, and the errors, are those of the tuple of the same ints."""
    from linop import PartitionError

    for workers in ([5, 4, 3, 2, 1, 0], [0, 1, 2, 3, 4, 5], [9, 2, 7, 4, 5, 6]):
        given = Partition((2, 3), np.array(workers, dtype=np.int32))
        assert given == Partition((2, 3), tuple(workers)) and all(type(w) is int for w in given.workers)
    for bad, match in (([0, 0, 1, 2, 3, 4], "listed twice"), ([-1, 0, 1, 2, 3, 4], ">= 0")):
        with pytest.raises(PartitionError, match=match):
            Partition((2, 3), np.array(bad))
    for bad in (np.ones(6, dtype=bool), np.zeros(6), np.zeros((2, 3), dtype=int)):
        with pytest.raises(PartitionError, match="must be integers"):
            Partition((2, 3), bad)


@pytest.mark.parametrize("order", [("w", "b"), ("b", "w"), ("few", "x", "b"), ("x", "w", "b", "few")])
def test_a_joined_space_fingerprints_by_its_parts_in_any_order(order):
    """Equal joined spaces (the same parts given in any order, or one part a joined space of
    two) fingerprint alike; a different part, a different block or another form of tree
    differ. Whether a union is joined or listed is decided by its parts' types alone
    (:func:`joined`: a grid among them), which the layouts fix on every rank, so a joined and
    a listed space of the same blocks never stand at the same place of two ranks' trees."""
    named = dict(zip(("w", "b", "x", "few", "inner"), _grids()))
    spaces = [named[p] for p in order]
    prints = {
        fingerprint(Identity(JoinedSpace(tuple(ordering))))
        for ordering in (spaces, spaces[::-1], spaces[1:] + spaces[:1])
    }
    nested = JoinedSpace((JoinedSpace(tuple(spaces[:2])), *spaces[2:]))
    prints.add(fingerprint(Identity(nested)))
    assert len(prints) == 1
    other = JoinedSpace((*spaces[:-1], named["inner"]))
    assert fingerprint(Identity(other)) not in prints
    assert fingerprint(Identity(JoinedSpace((*spaces, Space())))) in prints  # an empty part holds nothing
    moved = Space([("z", (3,), 1), ("a1", (1,), 8)])  # "few" with a block of another shape
    changed = [moved if p == "few" else named[p] for p in order]
    if "few" in order:
        assert fingerprint(Identity(JoinedSpace(tuple(changed)))) not in prints
    listed = Space([block for space in spaces for block in space])
    assert isinstance(joined("T", *spaces), JoinedSpace)  # the form by the parts' types
    assert fingerprint(Identity(listed)) not in prints  # (the listed form: never on the same place)


def test_a_joined_space_s_fingerprint_lists_no_grid(listings):
    x = DistributedTensor("x", (2, 8 * 65536), Partition((1, 65536)))
    layer = Affine(x, 4)
    assert isinstance(layer.parameter_space, JoinedSpace)
    one = fingerprint(Identity(layer.parameter_space))
    again = Affine(DistributedTensor("x", (2, 8 * 65536), Partition((1, 65536))), 4)
    assert fingerprint(Identity(JoinedSpace(tuple(reversed(again.parameter_space.parts))))) == one
    assert fingerprint(Identity(Affine(x, 5).parameter_space)) != one
    assert listings == []


def test_an_all_reduce_s_grid_and_pass_through_blocks_are_joined(listings):
    """AllReduce(others=) of a grid next to another grid or a few blocks: its space joined, no
    grid listed (P = 65,536), equal to the listed union; a repeated name raises as before."""
    weights = DistributedTensor("w", (4, 8 * 65536), Partition((1, 65536)))
    bias = DistributedTensor("b", (4, 256), Partition((1, 256)))
    reduce = AllReduce(weights, 1, others=bias.space)
    assert isinstance(reduce.space, JoinedSpace) and reduce.domain == reduce.range == reduce.space
    assert listings == []
    small = DistributedTensor("w", (4, 12), Partition((1, 3)))
    few = Space([("q", (2,), 1)])
    for others in (few, bias.space, joined("T", bias.space, few)):
        described = AllReduce(small, 1, others=others)
        assert described.space == Space([*small.blocks, *others.blocks])
        state = described.space.random(3)
        out = described(state)
        np.testing.assert_array_equal(out["w[0,2]"], state["w[0,0]"] + state["w[0,1]"] + state["w[0,2]"])
        passed = "q" if others is few else "b[0,0]"
        np.testing.assert_array_equal(out[passed], state[passed])
    for clash in (
        Space([("w[0,1]", (4, 4), 1)]),
        small.space,
        joined("T", bias.space, Space([("w[0,2]", (4, 4), 2)])),
    ):
        with pytest.raises(BlockExistsError, match=r"AllReduce: block name 'w\[0,[0-2]\]'"):
            AllReduce(small, 1, others=clash)


def test_partial_sums_over_a_range_of_workers_are_those_over_their_tuple():
    """The reduction given its consecutive workers as a range (none listed) is the one given
    the tuple; a wrong count or a negative id raises the same PartitionError."""
    y = DistributedTensor("y", (2, 4), Partition((1, 1), (5,)))
    for workers in (range(5, 9), range(0, 4)):
        assert partial_sums_reduction(y, (4, 1), workers, Space()) == partial_sums_reduction(
            y, (4, 1), tuple(workers), Space()
        )
    for bad in (range(5, 8), range(-1, 3)):
        with pytest.raises(PartitionError) as described:
            partial_sums_reduction(y, (4, 1), bad, Space())
        with pytest.raises(PartitionError) as listed:
            partial_sums_reduction(y, (4, 1), tuple(bad), Space())
        assert str(described.value) == str(listed.value)


def test_an_affine_layer_s_reduction_checks_no_list_of_its_workers(monkeypatch):
    """P = 65,536 consecutive workers: the output reduction's partition is given them as a
    range (described), not as P ints checked one by one."""
    import linop.partition

    checked: list[int] = []
    original = linop.partition.strict_ints

    def counted(values):
        result = original(values)
        if len(result) > LARGE:
            checked.append(len(result))
        return result

    x = DistributedTensor("x", (2, 8 * 65536), Partition((1, 65536)))
    layer = Affine(x, 4)
    monkeypatch.setattr(linop.partition, "strict_ints", counted)
    reduction = layer.output_reduction
    assert reduction is not None and len(reduction.domain) == 65536
    assert checked == []
