"""Random operator trees (depth up to 6): exact adjoints, and the numpy interpreter against the
exact matrix in float32, float64 and complex128, without touching the input."""

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from linop import expand_all
from verify import strategies as lst

TREES = lst.operators(max_depth=6, max_leaves=10)
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(TREES)
def test_derived_adjoint_is_the_exact_conjugate_transpose(op):
    matrix = op.to_sparse()
    assert (op.H.to_sparse() != matrix.conj().T).nnz == 0
    assert op.H.H == op


@SETTINGS
@given(TREES)
def test_expansion_into_primitives_has_the_same_matrix(op):
    assert (expand_all(op).to_sparse() != op.to_sparse()).nnz == 0


@SETTINGS
@given(TREES, st.sampled_from([np.float32, np.float64, np.complex128]), st.integers(0, 2**32 - 1))
def test_numpy_interpreter_equals_the_sparse_matvec_and_leaves_its_input_alone(op, dtype, seed):
    state = op.domain.random(seed, dtype)
    before = {name: array.copy() for name, array in state.items()}
    result = op(state)
    matrix = op.to_sparse()
    expected = op.range.unflatten(matrix @ op.domain.flatten(before).astype(np.complex128))
    tolerance = 1e-4 if dtype == np.float32 else 1e-12
    for name in op.range.names:
        scale = 1 + np.abs(expected[name]).max(initial=0)
        assert np.abs(result[name] - expected[name]).max(initial=0) <= tolerance * scale * 10
    assert all(np.array_equal(state[name], before[name]) for name in state)
