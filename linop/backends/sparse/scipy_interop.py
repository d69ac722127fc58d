"""Operators as scipy.sparse.linalg.LinearOperator over flattened states."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import scipy.sparse.linalg as spla

from ... import dtypes
from ...errors import OperandError, StateError
from ...operator import LinearOperator
from ...space import Space, as_array

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
    if not isinstance(op, LinearOperator):
        raise OperandError(f"aslinearoperator: op must be a LinearOperator, not {type(op).__name__}")
    return _Wrapped(op, dtypes.check_requested(dtype, what="aslinearoperator: dtype"))


class _Wrapped(spla.LinearOperator):
    """A linop operator seen by scipy; vectors of the wrong length get a StateError naming
    the space (scipy's own check says only "dimension mismatch")."""

    def __init__(self, op: LinearOperator, dtype: np.dtype) -> None:
        self.op, self.adjoint_op = op, op.H
        super().__init__(dtype=dtype, shape=op.shape)

    @staticmethod
    def _length(vector: object, space: Space, what: str) -> np.ndarray:
        array = as_array(
            vector,
            lambda reason: StateError(
                f"{what} needs a vector of length {space.size}, not {vector!r} ({reason})"
            ),
        )
        if array.dtype.kind not in "iufc":
            raise StateError(
                f"{what} needs a numeric vector, not {type(vector).__name__} of dtype {array.dtype}"
            )
        if not 1 <= array.ndim <= 2 or array.size != space.size or (array.ndim == 2 and array.shape[1] != 1):
            raise StateError(
                f"{what} needs a vector of length {space.size} (the space {space}), got shape {array.shape}"
            )
        return array

    def matvec(self, x: object) -> np.ndarray:
        return super().matvec(self._length(x, self.op.domain, "matvec"))

    def rmatvec(self, x: object) -> np.ndarray:
        return super().rmatvec(self._length(x, self.op.range, "rmatvec"))

    def _matvec(self, x: np.ndarray) -> np.ndarray:
        op = self.op
        return op.range.flatten(op(op.domain.unflatten(np.ravel(x))))

    def _rmatvec(self, x: np.ndarray) -> np.ndarray:
        op = self.adjoint_op
        return op.range.flatten(op(op.domain.unflatten(np.ravel(x))))
