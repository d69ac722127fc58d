r"""Distributed losses (:class:`linop.layers.Loss`) as JAX functions of global arrays.

Each device sums the elementwise terms of its block into a partial :math:`p_d` (``shard_map``,
the padding of its slot masked out), the layer's reduction tree :math:`R` (a
:class:`~linop.SumReduce` onto the root, lowered by
:func:`~linop.frameworks.jax_sharded.sharded`) adds the partials, and the scale s (1, one over
the global count, or one over the global batch) gives the loss:

.. math::

    L = s\, R\, p, \qquad \bar x_d = s\, (R^{*} \bar L)_d\, \partial_x \ell(x_d, t_d)

:math:`R^{*}` (the broadcast of the loss's gradient to every device) is the lowering of linop's
adjoint tree, :math:`\partial_x \ell` JAX's derivative of the terms.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from .extras import importing

with importing("jax", __name__):  # the jax extra: say so where it is missing
    import jax

import jax.numpy as jnp
from jax.sharding import Mesh

from ..layers import Loss
from ..layers.losses import elementwise
from .jax_stages import (
    Tree,
    block_mask,
    layout_of,
    local_map,
    placement,
    require_global,
    require_layer,
    split,
)

__all__ = ["loss", "terms"]


def terms(kind: str, x: jax.Array, t: jax.Array, options: Mapping[str, Any]) -> jax.Array:
    r"""The elementwise terms :math:`\ell(x, t)` of a loss kind (:data:`linop.layers.losses.KINDS`),
    in jnp: :func:`linop.layers.losses.elementwise`'s table read with ``jax.numpy``."""
    return elementwise(kind, x, t, options, jnp)


class _Loss:
    def __init__(self, layer: Loss, mesh: Mesh) -> None:
        axes, devices = placement(mesh)
        self.layer = layer
        self.reduction = Tree(layer.reduction_operator, mesh, axes)
        (total,) = self.reduction.range.slots
        self.total_slot = total.name
        self.inputs = layout_of(list(layer.x.blocks), devices)
        (slot,) = self.inputs.slots
        (partials,) = self.reduction.domain.slots
        self.partial_slot = partials.name
        self.extents = slot.extents()
        kind, options, shape = layer.kind, dict(layer.options), slot.shape

        def local(x: jax.Array, t: jax.Array, extents: jax.Array) -> jax.Array:
            values = terms(kind, x[0], t[0], options)
            # padding out of the sum (where, not a product: a term of padding may be inf or nan)
            return jnp.sum(jnp.where(block_mask(extents[0], shape), values, 0.0)).reshape(1, 1)

        self.local = local_map(local, mesh, axes, 3)

    def __call__(self, x: Any, target: Any) -> jax.Array:
        layer = self.layer
        x = require_global("loss", "x", x, layer.x.global_shape)
        target = require_global("loss", "target", target, layer.x.global_shape)
        dtype = jnp.result_type(x, target, jnp.float32)
        x, target = x.astype(dtype), target.astype(dtype)
        if layer.reduction == "none":  # the terms on x's layout: no communication
            return terms(layer.kind, x, target, layer.options)
        pack = self.reduction.function.pack
        (xs,) = pack(split(layer.x, x), self.inputs).values()
        (ts,) = pack(split(layer.x, target), self.inputs).values()
        partial = self.local(xs, ts, jnp.asarray(self.extents))
        total = self.reduction({self.partial_slot: partial})[self.total_slot]
        root = next(d for d, b in enumerate(self.reduction.range.slots[0].blocks) if b is not None)
        scale = layer.scale if not math.isnan(layer.scale) else jnp.nan
        return total[root, 0] * scale


def loss(layer: Loss, mesh: Mesh) -> Callable[[Any, Any], jax.Array]:
    r"""The loss ``layer`` on ``mesh`` as a JAX function ``f(x, target)`` of global arrays of
    x's global shape: a scalar (``"sum"``, ``"mean"`` over the global count of entries,
    ``"batchmean"`` over the global batch), or the elementwise terms (``"none"``, computed where
    x lies: no communication). The kinds and options are :class:`~linop.layers.Loss`'s (torch's
    semantics); e.g. ``mse`` with ``"mean"`` is ``jnp.mean((x - target) ** 2)`` and
    ``bce_with_logits`` is ``-jnp.mean(t * jax.nn.log_sigmoid(x) + (1 - t) *
    jax.nn.log_sigmoid(-x))``. Differentiable in both arguments.

    Raises
    ------
    MeshError
        If ``mesh`` is not a Mesh or has fewer devices than x's workers.
    LayerError
        If ``layer`` is not a Loss; an array of the wrong shape (when called).
    """
    require_layer("loss", layer, Loss)
    return _Loss(layer, mesh)
