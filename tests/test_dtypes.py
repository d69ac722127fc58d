"""The dtype policy of linop/dtypes.py (docs/theory.md#dtypes): on random trees and integer
states at the edges of their dtypes, the numpy interpreter gives the exact matrix product, or an
IntegerOverflowError exactly when the bound G * M reaches 2**62."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from linop import IntegerOverflowError, Space
from linop.dtypes import SAFE_INTEGER, cast_dtype, growth, largest_magnitude
from verify import strategies as lst

INTEGER_DTYPES = [np.int8, np.uint8, np.int16, np.int32, np.int64, np.uint64]


@st.composite
def integer_cases(draw):
    space = draw(lst.spaces(max_blocks=3))
    op = draw(lst.operators(space, max_leaves=4))
    dtype = np.dtype(draw(st.sampled_from(INTEGER_DTYPES)))
    info = np.iinfo(dtype)
    edge = st.sampled_from([info.min, info.max, 0, 1, info.max // 2])
    state = {
        b.name: np.array(draw(st.lists(edge, min_size=b.size, max_size=b.size)), dtype=dtype).reshape(b.shape)
        for b in op.domain
    }
    return op, state


def _exact(op, state):
    vector = (
        op.domain.flatten({n: a.astype(object) for n, a in state.items()}) if state else np.zeros(0, object)
    )
    matrix = op.to_sparse().toarray().astype(object)
    return matrix.dot(vector) if vector.size else np.zeros(op.range.size, dtype=object)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(integer_cases())
def test_integer_runs_are_exact_or_refused_by_the_bound(case):
    op, state = case
    if op.to_sparse().dtype.kind not in "iu":
        return  # a float scalar makes an inexact run: covered by the fuzz campaign
    g, _ = growth(op)
    bound = g * largest_magnitude(state.values())
    try:
        result = op(state)
    except IntegerOverflowError:
        assert bound >= SAFE_INTEGER
        return
    got = [int(v) for name in op.range.names for v in np.asarray(result[name]).ravel()]
    assert got == [int(v) for v in _exact(op, state)], (op, state, result)


@pytest.mark.parametrize(
    ("dtypes", "largest", "expected"),
    [
        ([np.uint8], 100, None),
        ([np.uint8], 200, np.int64),
        ([np.int8, np.int16], 100, np.int16),
        ([np.int64], 2**62, IntegerOverflowError),
        ([np.int64], 2**61, None),
        ([np.float32], 10**30, None),
        ([np.float32, np.int8], 100, np.float32),
    ],
    ids=[
        "uint8-fits",
        "uint8-widened",
        "int8-to-run-int16",
        "int64-overflow",
        "int64-fits",
        "float-nothing",
        "mixed-to-float",
    ],
)
def test_cast_dtype_follows_the_table(dtypes, largest, expected):
    space = Space([("a", (2,)), ("b", (2,))])
    from linop import Add

    op = Add(space["a"], space["b"])  # G = 2
    if expected is IntegerOverflowError:
        with pytest.raises(IntegerOverflowError, match="beyond int64"):
            cast_dtype(op, [np.dtype(d) for d in dtypes], largest)
        return
    got = cast_dtype(op, [np.dtype(d) for d in dtypes], largest)
    assert got == (None if expected is None else np.dtype(expected))


def _halo_trees():
    from linop import DistributedTensor, HaloExchange, Kernel, Partition, halo_geometry

    for grid in [(2, 2), (3, 1), (1, 4), (3, 3)]:
        tensor = DistributedTensor("x", (7, 9), Partition(grid))
        for size, padding, stride in [(3, 1, 1), (5, 2, 1), (3, 0, 2), (5, 1, 2)]:
            exchange = HaloExchange(halo_geometry(tensor, Kernel(size, padding=padding, stride=stride)))
            yield from (exchange, exchange.H, exchange.H @ exchange, exchange + 2 * exchange.H)


def _collective_trees():
    from linop import AllGather, AllReduce, BlockGrid, Broadcast, DistributedTensor, Partition

    for grid in [(2, 2), (3, 1), (1, 4), (3, 3)]:
        tensor = DistributedTensor("x", (7, 9), Partition(grid))
        reduce = Broadcast(DistributedTensor("y", (3,), Partition((1,))), Partition(grid), "c").H
        yield from (AllGather(tensor, 1, "g"), AllGather(tensor, (0, 1), "g").H, reduce, reduce @ reduce.H)
        yield AllReduce(BlockGrid.uniform("b", Partition(grid), (2,)), (0, 1))


@pytest.mark.parametrize("trees", [_halo_trees, _collective_trees], ids=["halo", "collectives"])
def test_the_structural_bound_holds_and_is_tight_on_single_nodes(trees):
    """growth_bound is never below the exact row sum of the matrix, and equals it on these
    trees (single nodes, their adjoints, sums and products with an adjoint)."""
    from linop.dtypes import growth_bound

    for op in trees():
        exact, _ = _exact_growth(op)
        bound, _ = growth_bound(op)
        assert bound >= exact, (op, bound, exact)
        assert bound == exact, (op, bound, exact)


def _exact_growth(op):
    matrix = abs(op.to_sparse().astype(np.float64))
    return int(np.asarray(matrix.sum(axis=1)).max(initial=0.0)), False


def _large_all_reduce():
    from linop import AllReduce, DistributedTensor, Partition

    # 1024 blocks of 64 entries, groups of 16 along axis 0: beyond EXACT_GROWTH_ENTRIES
    return AllReduce(DistributedTensor("x", (16, 64 * 64), Partition((16, 64))), 0)


def test_a_large_tree_is_bounded_without_its_matrix(monkeypatch):
    """The int8 / int16 decisions of a large all-reduce (groups of 16) come from its structure:
    its matrix is never formed (to_sparse raises), sums that fit run in the blocks' dtype
    and sums that would overflow are refused the narrow dtype (widened), exactly at the
    edge G * M = dtype max."""
    from linop import LinearOperator
    from linop.dtypes import EXACT_GROWTH_ENTRIES

    op = _large_all_reduce()
    assert op.domain.size + op.range.size > EXACT_GROWTH_ENTRIES

    def no_matrix(self):
        raise AssertionError("the global matrix was formed")

    monkeypatch.setattr(LinearOperator, "to_sparse", no_matrix)
    assert growth(op) == (16, False)
    int8, int16 = np.dtype(np.int8), np.dtype(np.int16)
    assert cast_dtype(op, [int8], 127 // 16) is None  # 16 * 7 = 112 fits int8
    assert cast_dtype(op, [int8], 8) == np.int64  # 16 * 8 = 128 would overflow: refused
    assert cast_dtype(op, [int16], 32767 // 16) is None
    assert cast_dtype(op, [int16], 32767 // 16 + 1) == np.int64


def test_the_bound_is_what_keeps_a_large_int8_sum_exact(monkeypatch):
    """Run by the numpy interpreter, the large all-reduce of int8 eights gives 128 everywhere
    (widened, exact); the control, a bound claiming G = 1, lets the sum run in int8 and it
    wraps to -128: the bound, not luck, keeps the result exact."""
    import linop.dtypes

    op = _large_all_reduce()
    state = {b.name: np.full(b.shape, 8, dtype=np.int8) for b in op.domain}
    result = op(state)
    assert all(int(a.min()) == int(a.max()) == 128 for a in result.values())
    monkeypatch.setattr(linop.dtypes, "growth", lambda tree: (1, False))
    wrapped = op(state)
    assert all(int(a.min()) == -128 for a in wrapped.values())
