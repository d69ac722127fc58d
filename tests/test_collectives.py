"""Collectives as operators: exact adjoints over many shapes, docs/theory.md#collectives identities,
DistDL-style situations and typed errors."""

import numpy as np
import pytest
from collective_checks import assert_exact_adjoint, assert_same_operator, integer_state
from hypothesis import given, settings
from hypothesis import strategies as st

from linop import Block, BlockExistsError, Copy, Identity, LinopError, SendRecv, ShapeMismatchError, Space
from linop.collectives import AllGather, AllReduce, Broadcast, ReduceScatter, SumReduce
from linop.errors import BroadcastError, DecompositionError, GlobalShapeError, PartitionError
from linop.layout import BlockGrid, broadcast_map, gathered_layout, reduction_groups
from linop.operator import expand_all, walk
from linop.partition import DistributedTensor, Partition, intersect
from linop.repartition import Gather, Repartition, Scatter, overlaps
from verify.strategies_distributed import broadcast_setups, distributed_tensors, tensor_pairs

FAST = settings(max_examples=25, deadline=None)


def arange(shape):
    return np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape) + 1


# -- the example of the issue ------------------------------------------------------------------
def test_77x55_repartition_4x1_to_3x4_on_disjoint_workers_round_trips_and_is_proven():
    x = DistributedTensor("x", (77, 55), Partition.grid((4, 1)))
    y = DistributedTensor("y", (77, 55), Partition.grid((3, 4), first=4))
    assert not set(x.partition.workers) & set(y.partition.workers)
    forward = Repartition(x, y)
    backward = Repartition(y, x)
    array = arange((77, 55))
    moved = forward(x.scatter(array))
    assert np.array_equal(y.gather(moved), array)
    assert np.array_equal(x.gather(backward(moved)), array)
    assert_exact_adjoint(forward)
    assert_exact_adjoint(backward)
    assert forward.H == backward
    assert_same_operator(backward @ forward, Identity(x.space))


# -- repartition --------------------------------------------------------------------------------
@given(tensor_pairs())
@FAST
def test_repartition_has_an_exact_adjoint(pair):
    x, y = pair
    assert_exact_adjoint(Repartition(x, y))


@given(tensor_pairs())
@FAST
def test_repartition_moves_every_entry_and_its_reverse_restores_it(pair):
    x, y = pair
    array = arange(x.global_shape)
    forward = Repartition(x, y)
    moved = forward(x.scatter(array))
    assert np.array_equal(y.gather(moved), array)
    assert np.array_equal(x.gather(forward.H(moved)), array)


@given(tensor_pairs(max_dims=2, max_extent=5))
@FAST
def test_repartition_then_reverse_is_the_identity_matrix(pair):
    x, y = pair
    assert_same_operator(Repartition(y, x) @ Repartition(x, y), Identity(x.space))


def test_expansion_copies_within_a_worker_and_sends_across():
    x = DistributedTensor("x", (4,), Partition((2,), (0, 1)))
    y = DistributedTensor("y", (4,), Partition((2,), (0, 5)))
    nodes = list(walk(expand_all(Repartition(x, y))))
    kinds = {type(n).__name__ for n in nodes}
    assert {"Allocate", "Deallocate", "Add", "Clear"} <= kinds
    movements = [n for n in walk(Repartition(x, y).expand()) if isinstance(n, Copy)]
    assert sorted((type(m).__name__, m.src.worker, m.dst.worker) for m in movements) == [
        ("Copy", 0, 0),
        ("SendRecv", 1, 5),
    ]


@pytest.mark.parametrize(
    ("source", "destination"),
    [
        (Partition.grid((2, 2)), Partition((2, 3), (2, 3, 4, 5, 6, 7))),
        (Partition.grid((2, 2)), Partition.grid((2, 2), first=4)),
        (Partition((1, 2), (5, 9)), Partition((3, 1), (9, 2, 5))),
        (Partition((1, 1), (3,)), Partition((1, 1), (3,))),
        (Partition((1, 1), (3,)), Partition.grid((2, 3))),
        (Partition.grid((2, 3)), Partition((1, 1), (4,))),
        (Partition.grid((3, 2)), Partition((3, 2), (5, 4, 3, 2, 1, 0))),
    ],
    ids=[
        "overlapping",
        "disjoint",
        "inactive-workers",
        "sequential-identity",
        "scatter-like",
        "gather-like",
        "permuted",
    ],
)
@pytest.mark.parametrize("unbalanced", [False, True], ids=["balanced", "unbalanced"])
def test_distdl_situations(source, destination, unbalanced):
    shape = (5, 7)
    sizes = (
        ((5,) + (0,) * (source.shape[0] - 1), tuple(reversed(np_balanced(7, source.shape[1]))))
        if unbalanced
        else ()
    )
    x = DistributedTensor("x", shape, source, sizes)
    y = DistributedTensor("y", shape, destination)
    op = Repartition(x, y)
    assert_exact_adjoint(op)
    array = arange(shape)
    assert np.array_equal(y.gather(op(x.scatter(array))), array)
    assert_same_operator(op.H @ op, Identity(x.space))


def np_balanced(length, parts):
    quotient, remainder = divmod(length, parts)
    return (quotient + 1,) * remainder + (quotient,) * (parts - remainder)


def test_sequential_identity_is_a_plain_relabel():
    x = DistributedTensor("x", (3, 2), Partition((1, 1), (4,)))
    y = DistributedTensor("y", (3, 2), Partition((1, 1), (4,)))
    op = Repartition(x, y)
    assert not any(isinstance(n, SendRecv) for n in walk(op.expand()))
    matrix = op.to_sparse().toarray()
    assert np.array_equal(matrix, np.eye(6, dtype=np.int64))


# -- scatter and gather ---------------------------------------------------------------------------
@given(distributed_tensors("x"), st.integers(0, 20))
@FAST
def test_scatter_and_gather_are_exact_inverse_adjoints(x, worker):
    root = Block("r", x.global_shape, worker)
    scatter = Scatter(root, x)
    assert_exact_adjoint(scatter)
    assert scatter.H == Gather(root, x)
    assert_same_operator(Gather(root, x) @ scatter, Identity(Space([root])))
    array = arange(x.global_shape)
    pieces = scatter({"r": array})
    assert np.array_equal(x.gather(pieces), array)
    assert np.array_equal(Gather(root, x)(pieces)["r"], array)


def test_scatter_is_a_repartition_from_one_worker():
    x = DistributedTensor("x", (5, 4), Partition((2, 2), (1, 2, 3, 4)))
    whole = DistributedTensor("a", (5, 4), Partition((1, 1), (3,)))
    root = whole.block((0, 0))
    assert_same_operator(Scatter(root, x), Repartition(whole, x))
    assert_same_operator(Gather(root, x), Repartition(x, whole))


# -- broadcast and sum-reduce --------------------------------------------------------------------------
@given(broadcast_setups())
@FAST
def test_broadcast_and_sum_reduce_have_exact_adjoints(setup):
    x, destination, transpose = setup
    broadcast = Broadcast(x, destination, "y", transpose)
    assert_exact_adjoint(broadcast)
    assert_exact_adjoint(SumReduce(x, destination, "y", transpose))
    assert broadcast.H == SumReduce(x, destination, "y", transpose)


@given(broadcast_setups())
@FAST
def test_every_copy_holds_its_source_block(setup):
    x, destination, transpose = setup
    broadcast = Broadcast(x, destination, "y", transpose)
    state = integer_state(x.space)
    copies = broadcast(state)
    for j in destination.indices():
        assert np.array_equal(
            copies[broadcast.copies.block_name(j)], state[x.block_name(broadcast.source_index(j))]
        )
        assert broadcast.copies.block(j).worker == destination.worker(j)


@given(broadcast_setups())
@FAST
def test_sum_reduce_after_broadcast_multiplies_by_the_number_of_copies(setup):
    x, destination, transpose = setup
    broadcast = Broadcast(x, destination, "y", transpose)
    state = integer_state(x.space)
    result = broadcast.H(broadcast(state))
    for index, count in broadcast.multiplicity.items():
        assert count >= 1
        name = x.block_name(index)
        assert np.array_equal(result[name], count * state[name])


def test_broadcast_map_pads_on_the_left_and_transposes():
    mapping = broadcast_map(Partition.grid((3,)), Partition.grid((2, 3)))
    assert mapping[(1, 2)] == (2,)
    mapping = broadcast_map(Partition.grid((3, 1)), Partition.grid((2, 3)), transpose=True)
    assert mapping[(1, 2)] == (2, 0) and mapping[(0, 0)] == (0, 0)
    mapping = broadcast_map(Partition.grid((1, 1)), Partition.grid((2, 2)))
    assert set(mapping.values()) == {(0, 0)}


def test_distdl_affine_weights_and_bias_pattern():
    """x on 1 x P_fi broadcasts to the weights' P_fo x P_fi; the sum-reduce of the partial
    outputs goes back to P_fo x 1 (transpose of a 1 x P_fo layout)."""
    p_fi, p_fo = 3, 2
    x = DistributedTensor("x", (4, 9), Partition((1, p_fi), (0, 1, 2)))
    p_w = Partition((p_fo, p_fi), (0, 1, 2, 3, 4, 5))
    to_weights = Broadcast(x, p_w, "xw")
    assert_exact_adjoint(to_weights)
    assert [b.shape for b in to_weights.copies.blocks] == [(4, 3)] * 6
    partial = BlockGrid.uniform("yw", p_w, (4, 5))
    y = DistributedTensor("y", (4, 10), Partition((1, p_fo), (0, 3)))
    reduce = SumReduce(BlockGrid.of(y), p_w, "yw", transpose=True)
    assert reduce.domain == partial.space
    assert_exact_adjoint(reduce)
    state = integer_state(partial.space)
    out = reduce(state)
    assert np.array_equal(out["y[0,1]"], state["yw[1,0]"] + state["yw[1,1]"] + state["yw[1,2]"])


# -- all-reduce ------------------------------------------------------------------------------------------
@given(broadcast_setups())
@FAST
def test_all_reduce_is_broadcast_after_sum_reduce_and_self_adjoint(setup):
    x, destination, transpose = setup
    broadcast = Broadcast(x, destination, "y", transpose)
    source_shape = x.partition.shape[::-1] if transpose else x.partition.shape
    padded = (1,) * (destination.ndim - len(source_shape)) + source_shape
    axes = tuple(d for d, n in enumerate(padded) if n == 1)
    all_reduce = AllReduce(broadcast.copies, axes)
    assert all_reduce.H is all_reduce
    assert_exact_adjoint(all_reduce)
    assert_same_operator(all_reduce, broadcast @ broadcast.H)


@given(distributed_tensors("x", balanced=True, max_extent=4), st.data())
@FAST
def test_all_reduce_sums_each_group(x, data):
    layout = BlockGrid.uniform("x", x.partition, (2,))
    axes = data.draw(st.sets(st.integers(0, x.partition.ndim - 1)).map(tuple))
    op = AllReduce(layout, axes)
    state = integer_state(layout.space)
    out = op(state)
    for group in op.groups:
        total = sum(state[layout.block_name(i)] for i in group)
        for i in group:
            assert np.array_equal(out[layout.block_name(i)], total)


# -- all-gather and reduce-scatter ------------------------------------------------------------------------
@given(distributed_tensors("x"), st.data())
@FAST
def test_all_gather_and_reduce_scatter_are_each_others_adjoint(x, data):
    axes = data.draw(st.sets(st.integers(0, x.ndim - 1)).map(tuple))
    gather = AllGather(x, axes, "g")
    assert_exact_adjoint(gather)
    assert_exact_adjoint(ReduceScatter(x, axes, "g"))
    assert gather.H == ReduceScatter(x, axes, "g")
    array = arange(x.global_shape)
    gathered = gather(x.scatter(array))
    for j in x.partition.indices():
        start, stop = x.box(j)
        box = tuple(
            slice(None) if d in gather.axes else slice(a, b) for d, (a, b) in enumerate(zip(start, stop))
        )
        assert np.array_equal(gathered[gather.gathered.block_name(j)], array[box])


def test_reduce_scatter_sums_over_the_group():
    x = DistributedTensor("x", (6, 2), Partition.grid((3, 1)))
    op = ReduceScatter(x, (0,), "g")
    state = integer_state(op.domain)
    out = op(state)
    total = state["g[0,0]"] + state["g[1,0]"] + state["g[2,0]"]
    for i in range(3):
        assert np.array_equal(out[f"x[{i},0]"], total[2 * i : 2 * i + 2])
    assert gathered_layout(x, (0,), "g").space == op.domain


@pytest.mark.parametrize(
    ("negative", "positive"), [((-1,), (1,)), ((-2, -1), (0, 1)), (-2, (0,))], ids=["-1", "-2,-1", "int"]
)
def test_geometry_helpers_accept_negative_axes(negative, positive):
    x = DistributedTensor("x", (5, 4), Partition.grid((2, 2)))
    assert reduction_groups(x.partition, negative) == reduction_groups(x.partition, positive)
    assert gathered_layout(x, negative, "g") == gathered_layout(x, positive, "g")


def test_geometry_helpers_reject_bad_axes():
    x = DistributedTensor("x", (5, 4), Partition.grid((2, 2)))
    with pytest.raises(PartitionError, match="reduction_groups: axis 2 is out of range"):
        reduction_groups(x.partition, (2,))
    with pytest.raises(PartitionError, match="gathered_layout: axis 1 is listed twice"):
        gathered_layout(x, (1, -1), "g")


# -- pass-through blocks ----------------------------------------------------------------------------
def test_other_blocks_pass_through_unchanged():
    others = Space([Block("z", (2, 2), 7)])
    x = DistributedTensor("x", (4,), Partition.grid((2,)))
    y = DistributedTensor("y", (4,), Partition.grid((4,), first=2))
    for op in [
        Repartition(x, y, others),
        Broadcast(x, Partition.grid((3, 2)), "c", others=others),
        AllGather(x, (0,), "g", others),
        AllReduce(BlockGrid.uniform("u", Partition.grid((3,)), (2,)), (0,), others),
        Scatter(Block("r", (4,), 1), x, others),
    ]:
        assert "z" in op.domain and "z" in op.range
        assert_exact_adjoint(op)
        state = integer_state(op.domain)
        assert np.array_equal(op(state)["z"], state["z"])


# -- typed errors -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("make", "error", "fragment"),
    [
        (
            lambda: Broadcast(
                DistributedTensor("x", (4, 4), Partition.grid((2, 2))), Partition.grid((3, 2)), "y"
            ),
            BroadcastError,
            r"dimension 0 .* has extent 2, neither 1 nor 3",
        ),
        (
            lambda: Broadcast(
                DistributedTensor("x", (4, 4), Partition.grid((1, 2))), Partition.grid((2,)), "y"
            ),
            BroadcastError,
            "has 2 dimensions, more than destination",
        ),
        (
            lambda: Broadcast(
                DistributedTensor("x", (4, 4), Partition.grid((3, 1))), Partition.grid((3, 2)), "y", True
            ),
            BroadcastError,
            r"\(reversed\) does not broadcast",
        ),
        (
            lambda: Repartition(
                DistributedTensor("x", (4, 4), Partition.grid((2, 1))),
                DistributedTensor("y", (4, 5), Partition.grid((1, 2))),
            ),
            GlobalShapeError,
            r"'x' -> 'y': global shapes \(4, 4\) and \(4, 5\) differ",
        ),
        (
            lambda: Repartition(
                DistributedTensor("x", (4,), Partition.grid((2,))),
                DistributedTensor("x", (4,), Partition.grid((1,))),
            ),
            BlockExistsError,
            r"block name 'x\[0\]' is used twice",
        ),
        (
            lambda: Scatter(Block("r", (3, 3)), DistributedTensor("x", (3, 4), Partition.grid((1, 2)))),
            GlobalShapeError,
            r"root block 'r' has shape \(3, 3\) but tensor 'x' has global shape \(3, 4\)",
        ),
        (
            lambda: AllReduce(DistributedTensor("x", (5,), Partition.grid((2,))), (0,)),
            ShapeMismatchError,
            r"block 'x\[1\]' has shape \(2,\) but block 'x\[0\]'",
        ),
        (
            lambda: AllReduce(BlockGrid.uniform("u", Partition.grid((2,)), (1,)), (1,)),
            PartitionError,
            "axis 1 is out of range for partition",
        ),
        (
            lambda: AllGather(DistributedTensor("x", (4, 4), Partition.grid((2, 2))), (0, -2), "g"),
            PartitionError,
            "axis 0 is listed twice",
        ),
        (
            lambda: Broadcast(DistributedTensor("x", (4,), Partition.grid((1,))), Partition.grid((2,)), "x"),
            BlockExistsError,
            "is used twice",
        ),
        (
            lambda: BlockGrid("b", Partition.grid((2,)), ((1,),)),
            PartitionError,
            "1 block shapes for the 2 workers",
        ),
        (
            lambda: BlockGrid("b", Partition.grid((2,)), (1, 1)),
            DecompositionError,
            "block grid 'b': block shape 1 is not a tuple of integers",
        ),
        (
            lambda: AllReduce(BlockGrid.uniform("u", Partition.grid((2,)), (1,)), 0.5),
            PartitionError,
            r"AllReduce: axes 0.5 must be integers",
        ),
    ],
    ids=[
        "shapes-do-not-broadcast",
        "source-rank-too-high",
        "transposed-does-not-broadcast",
        "global-shapes-disagree",
        "same-block-names",
        "root-shape",
        "all-reduce-group-shapes",
        "axis-out-of-range",
        "axis-twice",
        "broadcast-same-name",
        "grid-shape-count",
        "grid-shape-not-a-tuple",
        "axis-not-an-integer",
    ],
)
def test_bad_collectives_get_typed_errors(make, error, fragment):
    with pytest.raises(error, match=fragment) as info:
        make()
    assert isinstance(info.value, LinopError)


_TENSOR = DistributedTensor("x", (4,), Partition.grid((2,)))


@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        (lambda: Repartition(_TENSOR, "y"), "Repartition: destination must be a DistributedTensor, not str"),
        (lambda: Scatter("r", _TENSOR), "Scatter: root must be a Block, not str"),
        (lambda: Gather(Block("r", (4,)), (4,)), "Gather: tensor must be a DistributedTensor, not tuple"),
        (lambda: AllGather(BlockGrid.of(_TENSOR), 0, "g"), "AllGather: tensor must be a DistributedTensor"),
        (lambda: ReduceScatter(_TENSOR, 0, ""), "ReduceScatter: name must be a non-empty string"),
        (lambda: Broadcast(_TENSOR, (2,), "y"), "Broadcast: partition must be a Partition, not tuple"),
        (lambda: SumReduce(_TENSOR, Partition((2,)), 3), "SumReduce: name must be a non-empty string, not 3"),
        (lambda: AllReduce(_TENSOR.space, 0), "AllReduce: tensor must be a DistributedTensor or a BlockGrid"),
        (
            lambda: Repartition(_TENSOR, _TENSOR, others=["z"]),
            "Repartition: others must be a Space, not list",
        ),
    ],
    ids=[
        "repartition-destination",
        "scatter-root",
        "gather-tensor",
        "all-gather-block-grid",
        "reduce-scatter-empty-name",
        "broadcast-partition",
        "sum-reduce-name",
        "all-reduce-space",
        "others-not-a-space",
    ],
)
def test_arguments_of_the_wrong_type_are_named(make, fragment):
    with pytest.raises(TypeError, match=fragment):
        make()


def test_a_block_grid_needs_a_partition():
    with pytest.raises(TypeError, match="block grid 'b': partition must be a Partition, not tuple"):
        BlockGrid("b", (2,), ((1,), (1,)))


def test_a_wrong_adjoint_is_caught_by_the_exact_check():
    x = DistributedTensor("x", (4, 4), Partition.grid((1, 2)))
    partition = Partition.grid((2, 2), first=3)

    class DoubledAdjoint(Broadcast):
        def adjoint(self):
            return 2 * SumReduce(self.tensor, self.partition, self.name)

    class ForgotTheTranspose(Broadcast):
        def adjoint(self):
            return SumReduce(self.tensor, self.partition, self.name, not self.transpose)

    for wrong in (DoubledAdjoint(x, partition, "y"), ForgotTheTranspose(x, partition, "y")):
        assert wrong.H.domain == wrong.range
        with pytest.raises(AssertionError, match="differs from the transpose"):
            assert_exact_adjoint(wrong)


@given(tensor_pairs())
@FAST
def test_overlaps_are_exactly_the_nonempty_box_intersections(pair):
    x, y = pair
    brute = {
        (i, j, box)
        for i in x.partition.indices()
        for j in y.partition.indices()
        if (box := intersect(x.box(i), y.box(j))) is not None
    }
    assert set(overlaps(x, y)) == brute
    assert len(list(overlaps(x, y))) == len(brute)


def test_broadcast_onto_its_own_partition_is_a_local_relabel():
    x = DistributedTensor("x", (3, 4), Partition((1, 2), (6, 2)))
    op = Broadcast(x, x.partition, "y")
    assert not any(isinstance(n, SendRecv) for n in walk(op.expand()))
    assert np.array_equal(op.to_sparse().toarray(), np.eye(12, dtype=np.int64))
    assert [b.worker for b in op.copies.blocks] == [6, 2]


def test_copies_on_shared_workers_stay_local_and_others_are_sent():
    x = DistributedTensor("x", (2, 6), Partition((1, 2), (0, 1)))
    op = Broadcast(x, Partition((2, 2), (0, 1, 2, 3)), "y")
    moves = sorted(
        (type(n).__name__, n.src.worker, n.dst.worker) for n in walk(op.expand()) if isinstance(n, Copy)
    )
    assert moves == [("Copy", 0, 0), ("Copy", 1, 1), ("SendRecv", 0, 2), ("SendRecv", 1, 3)]
