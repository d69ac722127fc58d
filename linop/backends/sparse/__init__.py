"""The sparse interpreter: an operator tree as an exact scipy.sparse matrix.

Rows and columns follow the canonical flattening of the range and domain spaces
(:meth:`linop.Space.flatten`). Data movement gives integer matrices, so ``A.H`` can be proven
equal to ``A``'s transpose entry by entry, with no tolerance. Every primitive's matrix is built
from index arrays (no Python loop per entry).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import scipy.sparse as sp

from ... import dispatch, dtypes
from ...errors import DtypeError
from ...movement import Copy, CopyAdjoint, Move
from ...operator import Composition, Identity, LinearOperator, Scaled, Sum, Zero
from ...primitives import Add, Allocate, Clear, Deallocate
from ...space import Block, Space

__all__ = ["to_sparse", "handler", "embedding", "selection"]

INDEX = np.int64
"""Integer dtype of data-movement matrices."""

SAFE_INTEGER = 2.0**62
"""Bound on the entries an integer product, sum or scaling may reach; beyond it the matrices
are converted to float64 first (int64 arithmetic would wrap around silently)."""

Handler = Callable[[Any], sp.csr_array]
H = TypeVar("H", bound=Handler)


def handler(node_type: type) -> Callable[[H], H]:
    """Register the sparse handler of a node type in the dispatch registry
    (:mod:`linop.dispatch`)."""
    return dispatch.register("sparse", node_type)


def to_sparse(op: LinearOperator, dtype: npt.DTypeLike | None = None) -> sp.csr_array:
    """The matrix of ``op`` as CSR, shape (range.size, domain.size).

    ``dtype`` converts the entries (``docs/theory.md#dtypes``); a conversion that would change
    an entry (a non-integer or too large entry to an integer dtype, complex to real) is refused.

    Raises
    ------
    DtypeError
        If ``dtype`` is not a numeric dtype scipy.sparse holds, or the entries do not fit it.
    """
    if dtype is not None:
        dtype = dtypes.check_requested(dtype, what="to_sparse: dtype")
    matrix = matrix_of(op)
    if dtype is not None and dtype != matrix.dtype:
        if matrix.dtype.kind == "c" and dtype.kind != "c":
            if matrix.imag.count_nonzero():
                raise DtypeError(f"to_sparse: the matrix of {op} has complex entries; dtype {dtype} is real")
            matrix = matrix.real.tocsr()
        try:
            converted = matrix.astype(dtype)
        except (TypeError, ValueError) as error:
            raise DtypeError(f"to_sparse: scipy.sparse cannot hold dtype {dtype} ({error})") from None
        if dtype.kind in "iu" or (matrix.dtype.kind == "c" and dtype.kind != "c"):
            with np.errstate(invalid="ignore", over="ignore"):
                changed = (converted.astype(matrix.dtype) - matrix).count_nonzero()
            if changed:
                raise DtypeError(
                    f"to_sparse: the matrix of {op} has {matrix.dtype} entries that dtype {dtype} "
                    "cannot hold exactly"
                )
        matrix = converted
    return matrix


def matrix_of(op: LinearOperator) -> sp.csr_array:
    """The matrix of one node, through its handler or its expansion."""
    matrix: sp.csr_array = dispatch.dispatch("sparse", op)
    return matrix


def selection(rows: np.ndarray, cols: np.ndarray, shape: tuple[int, int]) -> sp.csr_array:
    """The 0/1 matrix with ones at (rows[i], cols[i])."""
    data = np.ones(len(rows), dtype=INDEX)
    return sp.csr_array((data, (rows, cols)), shape=shape)


def _positions(space: Space, names: tuple[str, ...]) -> np.ndarray:
    """Flat positions of whole blocks, in the given order."""
    if not names:
        return np.zeros(0, dtype=INDEX)
    return np.concatenate(
        [np.arange(space.offset(n), space.offset(n) + space.block(n).size, dtype=INDEX) for n in names]
    )


def embedding(small: Space, big: Space) -> sp.csr_array:
    """The matrix that places each block of ``small`` at its position in ``big``."""
    names = small.names
    return selection(_positions(big, names), _positions(small, names), (big.size, small.size))


def _keep_all_but(space: Space, removed: np.ndarray) -> sp.csr_array:
    keep = np.ones(space.size, dtype=bool)
    keep[removed] = False
    index = np.flatnonzero(keep)
    return selection(index, index, (space.size, space.size))


@handler(Identity)
def _identity(op: Identity) -> sp.csr_array:
    return sp.eye_array(op.space.size, dtype=INDEX, format="csr")


@handler(Zero)
def _zero(op: Zero) -> sp.csr_array:
    return sp.csr_array(op.shape, dtype=INDEX)


def _largest(matrix: sp.sparray) -> float:
    """The largest magnitude of an entry, in float64 (no integer overflow)."""
    return float(np.abs(matrix.data.astype(np.float64)).max(initial=0.0))


def _largest_row_sum(matrix: sp.sparray) -> float:
    """The largest sum of magnitudes along a row, in float64."""
    magnitudes = abs(matrix.astype(np.float64))
    return float(np.asarray(magnitudes.sum(axis=1)).max(initial=0.0))


def _row_sum_bound(matrix: sp.sparray) -> float:
    """An upper bound of :func:`_largest_row_sum` for an integer CSR matrix, from the largest
    entry and the most entries in a row, with no conversion of the matrix: for the 0/1
    selection matrices of data movement it is the exact row sum (``docs/theory.md#dtypes``)."""
    data = matrix.data
    if not data.size:
        return 0.0
    largest = max(abs(int(data.max())), abs(int(data.min())))
    return float(largest * int(np.diff(matrix.indptr).max()))


def _overflows(left: sp.sparray, right: sp.sparray) -> bool:
    """True when ``left @ right`` of integer matrices might reach :data:`SAFE_INTEGER`: the cheap
    bound first, the exact row sums only when the bound does not settle it."""
    if left.format != "csr":
        left = left.tocsr()
    if _row_sum_bound(left) * _largest(right) < SAFE_INTEGER:
        return False
    return _largest_row_sum(left) * _largest(right) >= SAFE_INTEGER


def _integer(*matrices: sp.sparray) -> bool:
    return all(m.dtype.kind in "iu" for m in matrices)


@handler(Composition)
def _composition(op: Composition) -> sp.csr_array:
    matrix = matrix_of(op.factors[-1])
    for factor in reversed(op.factors[:-1]):
        left = matrix_of(factor)
        if _integer(left, matrix) and _overflows(left, matrix):
            left, matrix = left.astype(np.float64), matrix.astype(np.float64)
        matrix = left @ matrix
    return matrix.tocsr()


@handler(Sum)
def _sum(op: Sum) -> sp.csr_array:
    total = matrix_of(op.terms[0])
    for term in op.terms[1:]:
        matrix = matrix_of(term)
        if _integer(total, matrix) and _largest(total) + _largest(matrix) >= SAFE_INTEGER:
            total, matrix = total.astype(np.float64), matrix.astype(np.float64)
        total = total + matrix
    return total.tocsr()


@handler(Scaled)
def _scaled(op: Scaled) -> sp.csr_array:
    matrix = matrix_of(op.operator)
    if _integer(matrix) and isinstance(op.alpha, numbers.Integral):
        # a matrix without entries too: numpy refuses an int beyond int64 against int64 data
        if abs(int(op.alpha)) * max(_largest(matrix), 1.0) >= SAFE_INTEGER:
            matrix = matrix.astype(np.float64)
    return (matrix * op.alpha).tocsr()


@handler(Allocate)
def _allocate(op: Allocate) -> sp.csr_array:
    return embedding(op.domain, op.range)


@handler(Deallocate)
def _deallocate(op: Deallocate) -> sp.csr_array:
    return embedding(op.range, op.domain).T.tocsr()


@handler(Clear)
def _clear(op: Clear) -> sp.csr_array:
    return _keep_all_but(op.domain, op.region.flat_indices())


@handler(Add)
def _add(op: Add) -> sp.csr_array:
    n = op.domain.size
    diagonal = np.arange(n, dtype=INDEX)
    rows = np.concatenate([diagonal, op.dst.flat_indices()])
    cols = np.concatenate([diagonal, op.src.flat_indices()])
    return selection(rows, cols, (n, n))


# -- fast paths: one selection matrix each (proven equal to the expansions in the tests) -----
def _movement(
    domain: Space, range_: Space, kept: np.ndarray, links: tuple[np.ndarray, np.ndarray]
) -> sp.csr_array:
    """Identity on the blocks shared by domain and range, except the domain entries that
    ``kept`` masks out, plus ones at ``links`` (range rows, domain columns)."""
    shared = tuple(n for n in domain.names if n in range_)
    rows = _positions(range_, shared)
    cols = _positions(domain, shared)
    mask = kept[cols]
    rows = np.concatenate([rows[mask], links[0]])
    cols = np.concatenate([cols[mask], links[1]])
    return selection(rows, cols, (range_.size, domain.size))


@handler(Copy)
def _copy(op: Copy) -> sp.csr_array:
    keep, target = _destination(op, op.range)
    return _movement(op.domain, op.range, keep, (target, op.src.flat_indices()))


@handler(CopyAdjoint)
def _copy_adjoint(op: CopyAdjoint) -> sp.csr_array:
    keep, back = _destination(op, op.domain)
    return _movement(op.domain, op.range, keep, (op.src.flat_indices(), back))


def _destination(op: Copy | CopyAdjoint, holder: Space) -> tuple[np.ndarray, np.ndarray]:
    """The domain entries the identity keeps (all but an in-place destination's) and the
    destination's flat positions: in place, in the regions' space; a new block, in ``holder``
    (the side that has it: the copy's range, its adjoint's domain)."""
    keep = np.ones(op.domain.size, dtype=bool)
    if isinstance(op.dst, Block):
        return keep, holder[op.dst.name].flat_indices()
    where = op.dst.flat_indices()
    keep[where] = False
    return keep, where


@handler(Move)
def _move(op: Move) -> sp.csr_array:
    keep = np.ones(op.domain.size, dtype=bool)
    source = op.src.flat_indices()
    keep[source] = False
    if isinstance(op.dst, Block):
        target = op.range[op.dst.name].flat_indices()
    else:
        target = op.dst.flat_indices()
        keep[target] = False
    return _movement(op.domain, op.range, keep, (target, source))
