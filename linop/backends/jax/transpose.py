r"""The transpose rule shared by linop's linear JAX primitives (:data:`~linop.backends.jax.shard.
sharded_p` and :mod:`linop.frameworks.jax_function`'s ``operator_p``): the cotangents go
through the primitive of the adjoint tree :math:`A^{*}` (derived by linop's rules), as

.. math::

    A^{T} \bar y = \overline{A^{*}\, \overline{\bar y}}

(conjugations only where a cotangent is complex; for real data :math:`A^{T} = A^{*}`), each
result cast back to its primal's dtype (a real input's cotangent is the real part) and None
for an input that is not differentiated (a defined primal)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
from jax.interpreters import ad

__all__ = ["transpose_by_adjoint"]


def transpose_by_adjoint(
    cotangents: Sequence[Any], primals: Sequence[Any], adjoint: Callable[[list[Any]], Sequence[Any]]
) -> list[Any]:
    """JAX's transpose of a linear primitive given ``adjoint`` (the adjoint primitive bound on
    a list of cotangents, one dtype), as the module says."""
    # jax types a Zero's aval as AbstractValue; a Zero of an array primal holds a ShapedArray
    dense = [
        jnp.zeros(ct.aval.shape, ct.aval.dtype) if type(ct) is ad.Zero else ct  # type: ignore[attr-defined]
        for ct in cotangents
    ]
    complex_ = any(jnp.iscomplexobj(ct) for ct in dense)
    if complex_:
        dense = [jnp.conj(ct) for ct in dense]
    if dense:
        common = jnp.result_type(*dense)
        dense = [ct.astype(common) for ct in dense]
    result: list[Any] = []
    for value, primal in zip(adjoint(dense), primals):
        if not ad.is_undefined_primal(primal):  # an input not differentiated: no cotangent
            result.append(None)
            continue
        aval = primal.aval
        if complex_:
            value = jnp.conj(value)
        if jnp.iscomplexobj(value) and not jnp.issubdtype(aval.dtype, jnp.complexfloating):
            value = jnp.real(value)  # a real input's cotangent is the real part
        result.append(value.astype(aval.dtype))
    return result
