"""The numpy and sparse fast paths of the collectives keep dtypes as the expansions do (mixed
dtypes included), never mutate inputs, never let two blocks share a writable array and write
in-place results into the caller's arrays; and the catalogue entries of
verify.catalogue_collectives hold. That each fast path equals its expansion, entry by entry, is
proven for every handler of the registry in tests/test_registry.py."""

import numpy as np
import pytest
from collective_checks import assert_exact_adjoint, assert_same_operator, integer_state
from hypothesis import example, given, settings
from hypothesis import strategies as st

from linop import Block, Clear
from linop.backends.numpy import apply
from linop.backends.sparse import matrix_of
from linop.collectives import AllGather, AllReduce, BlockGrid, Broadcast, ReduceScatter, SumReduce
from linop.operator import expand_all
from linop.partition import DistributedTensor, Partition
from linop.repartition import Gather, Repartition, Scatter
from verify.catalogue_collectives import ENTRIES
from verify.strategies_distributed import collectives

FAST = settings(max_examples=20, deadline=None)


def _same_states(a, b):
    assert set(a) == set(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert np.array_equal(a[name], b[name]), name


@given(collectives(), st.integers(0, 2**31))
@FAST
def test_mixed_dtypes_promote_as_the_expansion_does(op, seed):
    state = integer_state(op.domain, seed)
    names = op.domain.names
    mixed = {
        n: (a.astype(np.int32) if k % 2 else a.astype(np.float32)) for k, (n, a) in enumerate(state.items())
    }
    assert set(mixed) == set(names)
    _same_states(op(mixed), apply(expand_all(op), mixed))
    _same_states(op.apply(mixed, dtype=np.float64), apply(expand_all(op), mixed, dtype=np.float64))


@given(collectives(), st.integers(0, 2**31))
@example(AllReduce(BlockGrid.uniform("u", Partition.grid((2, 2)), (3,)), (0,)), 0)
@example(Broadcast(DistributedTensor("x", (4,), Partition.grid(2)), Partition.grid((3, 2)), "y").H, 0)
@FAST
def test_inputs_are_never_mutated_and_results_share_no_writable_memory(op, seed):
    state = integer_state(op.domain, seed)
    before = {n: a.copy() for n, a in state.items()}
    result = op(state)
    writable = [n for n, a in result.items() if a.flags.writeable]
    for k, name in enumerate(writable):
        assert not any(np.shares_memory(result[name], a) for a in state.values()), name
        for other in writable[k + 1 :]:
            assert not np.shares_memory(result[name], result[other]), (name, other)
    for array in result.values():  # writing the result must not reach the input
        if array.flags.writeable and array.size:
            array[...] = -1
    _same_states(state, before)


@given(collectives(), st.integers(0, 2**31), st.booleans())
@FAST
def test_in_place_round_trips_write_the_matrix_result_into_the_callers_arrays(op, seed, separate):
    """op.H op (and op itself where it is in place) applied with inplace=True: relabelled and
    summed blocks land in the caller's own arrays, which may be views of one buffer."""
    tree = op if op.domain == op.range else op.H @ op
    state = integer_state(tree.domain, seed)
    expected = tree.domain.unflatten(tree.to_sparse() @ tree.domain.flatten(state))
    arrays = (
        {n: a.copy() for n, a in state.items()}
        if separate
        else tree.domain.unflatten(tree.domain.flatten(state))
    )
    before = dict(arrays)
    assert tree.apply(arrays, inplace=True) is arrays
    for name in tree.range.names:
        assert arrays[name] is before[name], name
        assert np.array_equal(arrays[name], expected[name]), name


def test_relabelled_blocks_are_not_written_through():
    x = DistributedTensor("x", (4, 2), Partition((2, 1), (0, 1)))
    y = DistributedTensor("y", (4, 2), Partition((2, 1), (0, 1)))
    repartition = Repartition(x, y)
    clear = Clear(repartition.range["y[0,0]"])
    state = integer_state(x.space)
    before = state["x[0,0]"].copy()
    out = (clear @ repartition)(state)
    assert np.array_equal(state["x[0,0]"], before)
    assert not out["y[0,0]"].any()


def test_all_reduce_shares_no_writable_array_between_members():
    layout = BlockGrid.uniform("u", Partition.grid((3,)), (2,))
    reduce = AllReduce(layout, (0,))
    state = integer_state(layout.space)
    total = state["u[0]"] + state["u[1]"] + state["u[2]"]
    out = (Clear(reduce.range["u[1]"]) @ reduce)(state)
    assert np.array_equal(out["u[0]"], total) and np.array_equal(out["u[2]"], total)
    assert not out["u[1]"].any()


def test_all_reduce_members_are_independent_inside_sums_and_scalings():
    # Each member owns its result: scaling one member of the sum must not scale another.
    tensor = DistributedTensor("x", (4,), Partition.grid(2))
    op = AllReduce(tensor, (0,))
    tree = op - 3 * op
    state = integer_state(tree.domain, 3)
    by_matrix = tree.domain.unflatten(matrix_of(tree) @ tree.domain.flatten(state))
    result = apply(tree, state)
    for name in tree.range.names:
        assert np.array_equal(result[name], by_matrix[name])
    plain = apply(op, state)
    assert not np.shares_memory(plain["x[0]"], plain["x[1]"])


def test_all_reduce_in_place_writes_into_the_callers_arrays():
    layout = BlockGrid.uniform("u", Partition.grid((2, 2)), (3,))
    state = integer_state(layout.space)
    arrays = {n: a.copy() for n, a in state.items()}
    AllReduce(layout, (1,)).apply(arrays, inplace=True)
    assert np.array_equal(arrays["u[0,1]"], state["u[0,0]"] + state["u[0,1]"])
    assert np.array_equal(arrays["u[1,0]"], state["u[1,0]"] + state["u[1,1]"])


_SCALAR = DistributedTensor("x", (), Partition(()))


@pytest.mark.parametrize(
    "make",
    [
        lambda: Broadcast(_SCALAR, Partition((3,)), "y"),
        lambda: SumReduce(_SCALAR, Partition((3, 2)), "y"),
        lambda: AllReduce(BlockGrid.uniform("u", Partition((3,)), ()), (0,)),
        lambda: Repartition(_SCALAR, DistributedTensor("y", (), Partition((), (3,)))),
        lambda: Scatter(Block("r", (), 2), _SCALAR),
        lambda: Gather(Block("r", (), 2), _SCALAR),
        lambda: AllGather(_SCALAR, (), "g"),
        lambda: ReduceScatter(_SCALAR, (), "g"),
    ],
    ids=[
        "broadcast",
        "sum-reduce",
        "all-reduce",
        "repartition",
        "scatter",
        "gather",
        "all-gather",
        "reduce-scatter",
    ],
)
@pytest.mark.parametrize("scale", [1, 3], ids=["plain", "scaled"])
def test_scalar_blocks_stay_arrays_and_match_the_matrix(make, scale):
    """0-d blocks (a rank-0 tensor on a rank-0 partition): every result is a 0-d array, also
    where several copies are summed, so that a scaling after the node is not lost."""
    op = scale * make()
    state = integer_state(op.domain, 5)
    expected = op.range.unflatten(op.to_sparse() @ op.domain.flatten(state))
    fast = op(state)
    _same_states(fast, apply(expand_all(op), state))
    for name in op.range.names:
        assert isinstance(fast[name], np.ndarray) and fast[name].shape == (), name
        assert np.array_equal(fast[name], expected[name]), name


@pytest.mark.parametrize(
    "make",
    [
        lambda: Broadcast(DistributedTensor("x", (3,), Partition((1,), (0,))), Partition((1,), (0,)), "y"),
        lambda: SumReduce(DistributedTensor("x", (3,), Partition((1,), (0,))), Partition((1,), (0,)), "y"),
        lambda: ReduceScatter(DistributedTensor("x", (3,), Partition((1,), (0,))), (0,), "g"),
        lambda: Gather(Block("r", (3,), 0), DistributedTensor("x", (3,), Partition((1,), (0,)))),
    ],
    ids=["broadcast-one-copy", "sum-reduce-one-copy", "reduce-scatter-one-member", "gather-one-block"],
)
def test_one_to_one_moves_relabel_without_copying(make):
    op = make()
    (name,) = op.domain.names
    (target,) = op.range.names
    array = np.arange(3.0)
    out = op({name: array})
    assert np.shares_memory(out[target], array)
    assert not out[target].flags.writeable


@pytest.mark.parametrize("entry", ENTRIES, ids=[e.name for e in ENTRIES])
def test_catalogue_entries_hold(entry):
    built = entry.build()
    if entry.kind == "adjoint":
        assert_exact_adjoint(*built)
    else:
        assert_same_operator(*built)


def test_catalogue_covers_every_node_and_section_two_identity():
    names = {e.name for e in ENTRIES}
    for required in [
        "node-broadcast-adjoint",
        "node-sum-reduce-adjoint",
        "node-all-reduce-is-broadcast-sum-reduce",
        "node-all-reduce-self-adjoint",
        "node-repartition-round-trip",
        "node-all-gather-adjoint",
        "node-reduce-scatter-adjoint",
        "node-scatter-adjoint",
        "node-gather-adjoint",
    ]:
        assert required in names
