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
