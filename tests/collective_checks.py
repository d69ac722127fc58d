"""Shared checks of the collectives tests: exact adjoints and equalities through the sparse
interpreter (integer matrices, no tolerance)."""

import numpy as np

from linop import LinearOperator, expand_all
from linop.backends.sparse import matrix_of


def assert_exact_adjoint(op: LinearOperator) -> None:
    """op.H maps range to domain, the matrix of its expansion is exactly the transpose of the
    matrix of op's expansion, both fast paths agree with the expansions, and op.H.H == op."""
    adjoint = op.H
    assert adjoint.domain == op.range, f"{op}: adjoint domain is not the range"
    assert adjoint.range == op.domain, f"{op}: adjoint range is not the domain"
    forward = matrix_of(op.expand())
    assert forward.dtype.kind == "i", f"{op}: data movement should give an integer matrix"
    backward = matrix_of(adjoint.expand())
    assert (op.to_sparse() != forward).nnz == 0, f"{op}: sparse fast path differs from the expansion"
    assert (adjoint.to_sparse() != backward).nnz == 0, (
        f"{adjoint}: sparse fast path differs from the expansion"
    )
    differing = (backward != forward.T).nnz
    assert differing == 0, f"{op}: adjoint matrix differs from the transpose in {differing} entries"
    assert adjoint.H == op, f"{op}: op.H.H is not structurally op"


def assert_same_operator(a: LinearOperator, b: LinearOperator) -> None:
    """Same spaces and exactly the same matrix: b's matrix equals both a's (through the sparse
    fast paths) and that of a's expansion into primitives (through none of them), so that a
    fast path shared by a and b cannot vouch for itself."""
    assert a.domain == b.domain, a.domain.difference(b.domain)
    assert a.range == b.range, a.range.difference(b.range)
    expected = b.to_sparse()
    differing = (a.to_sparse() != expected).nnz
    assert differing == 0, f"{a} and {b} differ in {differing} entries"
    differing = (matrix_of(expand_all(a)) != expected).nnz
    assert differing == 0, f"the expansion of {a} and {b} differ in {differing} entries"


def integer_state(space, seed=0):
    """A state of distinct integers (so that every misplaced entry shows)."""
    rng = np.random.default_rng(seed)
    values = rng.permutation(space.size).astype(np.int64) + 1
    return space.unflatten(values)
