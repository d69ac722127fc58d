r"""Operator trees as JAX functions, with their transpose registered.

A tree :math:`A` becomes one JAX primitive, ``linop_operator``, whose parameter is the tree:

- evaluation runs the numpy interpreter on the host (eagerly, or under ``jax.jit`` through
  ``jax.pure_callback``);
- its JVP is the primitive itself on the tangents (the map is linear:
  :math:`\dot y = A \dot x`);
- its transpose is the primitive of the adjoint tree:
  :math:`A^{T} \bar y = \overline{A^{*}\,\overline{\bar y}}` (JAX transposes without
  conjugating; for real data movement :math:`A^T = A^*` = ``op.H``, derived by rules and proven
  exactly, ``docs/theory.md#adjoint-test``).

So ``jax.grad``, ``jax.vjp``, ``jax.linear_transpose``, ``jax.jit`` and
``jax.test_util.check_grads`` (any order, forward and reverse) work on trees, and ``vmap``
maps the primitive over the batch, one application per element.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

from .extras import importing

with importing("jax", __name__):  # the jax extra: say so where it is missing
    import jax

import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from ..backends.jax.integers import integer_cast
from ..backends.jax.transpose import transpose_by_adjoint
from ..dtypes import check_block_dtype
from ..errors import StateError
from ..operator import LinearOperator

__all__ = ["JaxOperator", "function", "apply", "operator_p"]

operator_p = Primitive("linop_operator")
"""The primitive: ``operator_p.bind(*arrays, op=tree, dtype=dtype)`` gives the range blocks of
``tree`` (in ``tree.range`` order) for the domain blocks (in ``tree.domain`` order)."""
operator_p.multiple_results = True


def _host_apply(op: LinearOperator, dtype: Any, arrays: Sequence[Any]) -> list[np.ndarray]:
    state = {name: np.asarray(array) for name, array in zip(op.domain.names, arrays)}
    result = op.apply(state, dtype=dtype)
    return [np.asarray(result[name]) for name in op.range.names]


@lru_cache(maxsize=256)
def _output_dtypes(
    op: LinearOperator, dtype: Any, inputs: tuple[np.dtype, ...], x64: bool
) -> tuple[np.dtype, ...]:
    """The dtype of each range block, as the interpreters give it for every value of the input
    dtypes (JAX fixes it before the values are known), then as JAX holds it (64-bit only with
    x64, ``x64`` the mode; a key of the cache): a run on zeros gives the dtypes of a run in the blocks' own dtypes, and an integer
    run that a sum may overflow is widened, or refused, as the interpreters decide for the
    largest entries the input dtypes hold (:func:`~linop.backends.jax.integers.integer_cast`)."""
    cast = integer_cast(op, inputs)
    zeros = [np.zeros(block.shape, dtype=d) for block, d in zip(op.domain, inputs)]
    found = [array.dtype for array in _host_apply(op, dtype, zeros)]
    if cast is not None:  # the interpreter casts every block to it first
        found = [np.result_type(d, cast) for d in found]
    return tuple(jax.dtypes.canonicalize_dtype(d) for d in found)


def _x64() -> bool:
    """Whether JAX holds 64-bit types now (``jax_enable_x64``, also inside ``jax.enable_x64``)."""
    return bool(jax.config.read("jax_enable_x64"))


def _avals(op: LinearOperator, dtype: Any, arrays: Sequence[Any]) -> list[jax.ShapeDtypeStruct]:
    dtypes = _output_dtypes(op, dtype, tuple(np.dtype(a.dtype) for a in arrays), _x64())
    return [jax.ShapeDtypeStruct(block.shape, d) for block, d in zip(op.range, dtypes)]


def _impl(*arrays: Any, op: LinearOperator, dtype: Any) -> list[jax.Array]:
    avals = _avals(op, dtype, arrays)
    return [jnp.asarray(r, dtype=a.dtype) for r, a in zip(_host_apply(op, dtype, arrays), avals)]


def _abstract_eval(*arrays: Any, op: LinearOperator, dtype: Any) -> list[Any]:
    return [jax.core.ShapedArray(a.shape, a.dtype) for a in _avals(op, dtype, arrays)]


def _lowered(*arrays: Any, op: LinearOperator, dtype: Any) -> list[Any]:
    avals = _avals(op, dtype, arrays)

    def host(*values: Any) -> list[np.ndarray]:
        return [r.astype(a.dtype, copy=False) for r, a in zip(_host_apply(op, dtype, values), avals)]

    return jax.pure_callback(host, avals, *arrays)


def _transpose(cotangents: Any, *primals: Any, op: LinearOperator, dtype: Any) -> list[Any]:
    def adjoint(cotangents: list[Any]) -> Any:
        return operator_p.bind(*cotangents, op=op.H, dtype=dtype)

    return transpose_by_adjoint(cotangents, primals, adjoint)


def _batched(arguments: Sequence[Any], axes: Sequence[Any], *, op: LinearOperator, dtype: Any) -> Any:
    size = next(a.shape[d] for a, d in zip(arguments, axes) if d is not None)
    moved = [
        jnp.broadcast_to(a, (size, *a.shape)) if d is None else jnp.moveaxis(a, d, 0)
        for a, d in zip(arguments, axes)
    ]
    outputs = jax.lax.map(lambda xs: tuple(operator_p.bind(*xs, op=op, dtype=dtype)), tuple(moved))
    return list(outputs), [0] * len(outputs)


operator_p.def_impl(_impl)
operator_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(operator_p, mlir.lower_fun(_lowered, multiple_results=True))
ad.deflinear2(operator_p, _transpose)
batching.primitive_batchers[operator_p] = _batched


class JaxOperator:
    """A tree as a JAX function of states (dicts of arrays), differentiable and jittable.

    ``f(state)`` returns ``op(state)`` as JAX arrays; ``f.arrays(*arrays)`` takes and returns
    arrays positionally (``op.domain`` / ``op.range`` order).

    Parameters
    ----------
    op : LinearOperator
    dtype : dtype, optional
        Dtype of blocks the tree allocates; default the inputs' dtype.
    """

    def __init__(self, op: LinearOperator, *, dtype: Any = None) -> None:
        self.op = op
        self.dtype = None if dtype is None else np.dtype(dtype)
        self.inputs = op.domain.names
        self.outputs = op.range.names

    @property
    def H(self) -> JaxOperator:  # noqa: N802 - the conventional name
        """The adjoint, wrapped alike."""
        return JaxOperator(self.op.H, dtype=self.dtype)

    def arrays(self, *arrays: Any) -> tuple[jax.Array, ...]:
        """Apply to arrays in the order of :attr:`inputs`; results in the order of :attr:`outputs`."""
        if len(arrays) != len(self.inputs):
            raise StateError(
                f"{self.op} takes {len(self.inputs)} array(s) {list(self.inputs)}, not {len(arrays)}"
            )
        for name, array in zip(self.inputs, arrays):
            dtype = getattr(array, "dtype", None)
            check_block_dtype(name, np.dtype(dtype) if dtype is not None else np.asarray(array).dtype)
        values = [jnp.asarray(a) for a in arrays]
        for name, block, value in zip(self.inputs, self.op.domain, values):
            if value.shape != block.shape:
                raise StateError(f"block {name!r} has shape {value.shape}, the space expects {block.shape}")
        return tuple(operator_p.bind(*values, op=self.op, dtype=self.dtype))

    def __call__(self, state: Mapping[str, Any]) -> dict[str, jax.Array]:
        if not isinstance(state, Mapping):
            raise StateError(
                f"a state must be a dict of arrays keyed by block name, not {type(state).__name__}"
            )
        missing = [name for name in self.inputs if name not in state]
        extra = [name for name in state if name not in self.inputs]
        if missing or extra:
            raise StateError(f"state for {self.op}: missing block(s) {missing}, unexpected block(s) {extra}")
        return dict(zip(self.outputs, self.arrays(*(state[name] for name in self.inputs))))

    def __repr__(self) -> str:
        return f"JaxOperator({self.op})"


def function(op: LinearOperator, *, dtype: Any = None) -> JaxOperator:
    """Wrap ``op`` as a JAX function of dicts of arrays; see :class:`JaxOperator`."""
    return JaxOperator(op, dtype=dtype)


def apply(op: LinearOperator, state: Mapping[str, Any], *, dtype: Any = None) -> dict[str, jax.Array]:
    """``op(state)`` for JAX arrays and tracers (what ``op(state)`` does inside ``jax.grad``,
    ``jax.jit``, ...)."""
    return JaxOperator(op, dtype=dtype)(state)
