"""Operators as scipy.sparse.linalg.LinearOperator over flattened states."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import scipy.sparse.linalg as spla

from ..operator import LinearOperator

__all__ = ["aslinearoperator"]


def aslinearoperator(op: LinearOperator, dtype: npt.DTypeLike = np.float64) -> spla.LinearOperator:
    """Wrap ``op`` as a scipy LinearOperator on flattened vectors (canonical order).

    ``matvec`` applies ``op`` and ``rmatvec`` applies ``op.H``, both with the numpy
    interpreter, so iterative solvers (``scipy.sparse.linalg.lsqr``, ...) can use any tree.

    Parameters
    ----------
    op : LinearOperator
    dtype : dtype
        The dtype scipy reports for the operator (it must be given: trees hold no data).
    """
    adjoint = op.H

    def matvec(vector: np.ndarray) -> np.ndarray:
        return op.range.flatten(op(op.domain.unflatten(np.ravel(vector))))

    def rmatvec(vector: np.ndarray) -> np.ndarray:
        return op.domain.flatten(adjoint(op.range.unflatten(np.ravel(vector))))

    return spla.LinearOperator(op.shape, matvec=matvec, rmatvec=rmatvec, dtype=np.dtype(dtype))
