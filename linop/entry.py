"""The entry point ``op(state)``: which interpreter runs a state of which array library.

This is the top floor of linop: it may reach both the interpreters (``linop.backends``) and the
framework adapters (``linop.frameworks``), always lazily (``import linop`` loads neither).

- A state of numpy arrays (and plain Python values) runs straight on the numpy interpreter.
- A state of another array library's arrays (PyTorch tensors, JAX arrays, CuPy arrays, any
  ``__array_namespace__`` object) is viewed as numpy arrays through array-api-compat
  (:mod:`linop.backends.array_api`), run, and returned in its own library.
- A torch state with a tensor that requires a gradient (while grad mode is on) goes to
  :func:`linop.frameworks.torch_function.apply`, a state holding JAX tracers (inside
  ``jax.grad``, ``jax.jit``, ...) to :func:`linop.frameworks.jax_function.apply`: both run the
  same interpreter forward and the adjoint tree backward.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy.typing as npt

from .errors import StateError

if TYPE_CHECKING:  # pragma: no cover - types only
    from .operator import LinearOperator

__all__ = ["apply"]


def apply(
    op: LinearOperator,
    state: Mapping[str, Any],
    *,
    inplace: bool = False,
    dtype: npt.DTypeLike | None = None,
) -> dict[str, Any]:
    """``op(state)``; see :meth:`linop.LinearOperator.apply`. The result's blocks are arrays of
    the state's library (numpy: a :data:`~linop.space.State`).

    Raises
    ------
    StateError
        In place on a state that needs differentiation (a block requires a gradient).
    """
    from .backends import array_api
    from .backends import numpy as numpy_backend

    library = array_api.library_of(state) if isinstance(state, Mapping) else None
    if library is None:  # numpy: the fast path
        return numpy_backend.apply_numpy(op, state, inplace=inplace, dtype=dtype)
    if array_api.needs_autodiff(state, library):
        if inplace:
            raise StateError(
                "in-place application cannot be differentiated: a block requires a gradient "
                "(detach it, or apply out of place)"
            )
        if library.kind == "torch":
            from .frameworks import torch_function

            return torch_function.apply(op, state, dtype=dtype)
        from .frameworks import jax_function

        return jax_function.apply(op, state, dtype=dtype)
    return array_api.apply(op, state, library, numpy_backend.apply_numpy, inplace=inplace, dtype=dtype)
