r"""Distributed batch normalization (:class:`linop.layers.BatchNorm`) as a JAX function of
global arrays, with training-mode (batch) statistics.

On any partition of x (batch, channels and features cut, unevenly), the statistics of channel c
are sums over the devices that share it, each an all-reduce of per-device partial sums: the
layer's :attr:`~linop.layers.BatchNorm.statistics_reduction` (an
:class:`~linop.AllReduce` tree lowered by :func:`~linop.frameworks.jax_sharded.sharded`). With
m the global count per channel and :math:`A` that all-reduce,

.. math::

    \mu = \tfrac1m A\Big(\sum_{\text{local}} x\Big), \quad
    \sigma^2 = \tfrac1m A\Big(\sum_{\text{local}} (x - \mu)^2\Big), \quad
    y = w\,(x - \mu)(\sigma^2 + \epsilon)^{-1/2} + b

the parameters :math:`(w; b)` reaching every device of their channel by the layer's
:attr:`~linop.layers.BatchNorm.parameter_movement` :math:`M` (a broadcast tree). The backward is
JAX's derivative of the local steps and, for the trees, the lowerings of their adjoints:
:math:`A^{*} = A` (so the input gradient's two channel sums are all-reduces) and :math:`M^{*}`,
the sum of the copies' gradients onto the owners.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .extras import importing

with importing("jax", __name__):  # the jax extra: say so where it is missing
    import jax

import jax.numpy as jnp
from jax.sharding import Mesh

from ..errors import LayerError
from ..layers import BatchNorm
from ..layers.base import share_slices
from .jax_stages import (
    Tree,
    block_mask,
    join,
    layout_of,
    local_map,
    placement,
    require_global,
    require_layer,
    split,
)

__all__ = ["batch_norm"]


def _per_channel(values: jax.Array, ndim: int) -> jax.Array:
    """A (c,) row spread over a block (N, c, ...) of ``ndim`` axes."""
    return values.reshape((1, -1) + (1,) * (ndim - 2))


class _BatchNorm:
    def __init__(self, layer: BatchNorm, mesh: Mesh) -> None:
        axes, devices = placement(mesh)
        self.layer = layer
        self.reduction = Tree(layer.statistics_reduction, mesh, axes)
        self.movement = Tree(layer.parameter_movement, mesh, axes) if layer.affine else None
        self.inputs = layout_of(list(layer.x.blocks), devices)
        self.outputs = layout_of(list(layer.y.blocks), devices)
        (slot,) = self.inputs.slots
        (sums,) = self.reduction.domain.slots
        self.sums_slot = sums.name
        self.extents = slot.extents()
        shape, ndim, count = slot.shape, layer.x.ndim, layer.count
        axes_summed = tuple(a for a in range(ndim) if a != 1)
        channels = sums.shape[1]

        def local_sums(x: jax.Array, extents: jax.Array) -> jax.Array:
            real = block_mask(extents[0], shape)
            return jnp.sum(jnp.where(real, x[0], 0), axis=axes_summed)[:channels].reshape(1, 1, channels)

        def local_squares(x: jax.Array, extents: jax.Array, totals: jax.Array) -> jax.Array:
            real = block_mask(extents[0], shape)
            mean = _per_channel(_fit_channels(totals[0, 0] / count, shape[1]), ndim)
            centred = jnp.where(real, x[0] - mean, 0)
            return jnp.sum(centred * centred, axis=axes_summed)[:channels].reshape(1, 1, channels)

        eps = layer.eps

        def local_normalize(
            x: jax.Array, totals: jax.Array, squares: jax.Array, *theta: jax.Array
        ) -> jax.Array:
            mean = _per_channel(_fit_channels(totals[0, 0] / count, shape[1]), ndim)
            var = _per_channel(_fit_channels(squares[0, 0] / count, shape[1]), ndim)
            y = (x[0] - mean) * jax.lax.rsqrt(var + eps)
            if theta:
                w, b = (_per_channel(_fit_channels(theta[0][0, k], shape[1]), ndim) for k in (0, 1))
                y = y * w + b
            return y[None]

        self.local_sums = local_map(local_sums, mesh, axes, 2)
        self.local_squares = local_map(local_squares, mesh, axes, 3)
        self.local_normalize = local_map(local_normalize, mesh, axes, 4 if layer.affine else 3)

    def __call__(self, x: Any, weight: Any = None, bias: Any = None, *, with_statistics: bool = False) -> Any:
        layer = self.layer
        x = require_global("batch_norm", "x", x, layer.x.global_shape)
        if layer.count < 2:
            raise LayerError(
                f"batch_norm: expected more than 1 value per channel when training, x has shape "
                f"{layer.x.global_shape}"
            )
        dtype = jnp.result_type(x, jnp.float32)
        (xs,) = self.reduction.function.pack(split(layer.x, x.astype(dtype)), self.inputs).values()
        extents = jnp.asarray(self.extents)
        totals = self.reduction({self.sums_slot: self.local_sums(xs, extents)})[self.sums_slot]
        squares = self.reduction({self.sums_slot: self.local_squares(xs, extents, totals)})[self.sums_slot]
        operands = [xs, totals, squares]
        if self.movement is not None:
            c = layer.channels
            w = jnp.ones(c, dtype) if weight is None else require_global("batch_norm", "weight", weight, (c,))
            b = jnp.zeros(c, dtype) if bias is None else require_global("batch_norm", "bias", bias, (c,))
            theta = jnp.stack([w, b]).astype(dtype)
            assert layer.parameters is not None  # affine
            state = {
                layer.parameters.block_name((0, k, *(0,) * layer.dims)): theta[:, part]
                for k, part in enumerate(share_slices(layer.channel_sizes))
            }
            (copies,) = self.movement.slots(state).values()
            operands.append(copies)
        elif weight is not None or bias is not None:
            raise LayerError(
                "batch_norm: a weight or bias was given, but the layer was built with affine=False"
            )
        y = self.local_normalize(*operands)
        y = join(layer.y, self.reduction.blocks({self.outputs.names[0]: y}, self.outputs))
        if not with_statistics:
            return y
        return y, self._per_channel(totals), self._per_channel(squares)

    def _per_channel(self, sums: jax.Array) -> jax.Array:
        """The global (C,) row of all-reduced per-channel sums over m (each channel share read
        from its owner's block, every device of the group holding the same)."""
        layer = self.layer
        blocks = self.reduction.blocks({self.sums_slot: sums})
        rows = [
            blocks[layer.sums.block_name((0, k, *(0,) * layer.dims))][0]
            for k in range(len(layer.channel_sizes))
        ]
        return jnp.concatenate(rows) / layer.count


def _fit_channels(values: jax.Array, channels: int) -> jax.Array:
    """A row of per-channel values cut or zero-padded to the slot's ``channels``."""
    if values.shape[0] >= channels:
        return values[:channels]
    return jnp.pad(values, (0, channels - values.shape[0]))


def batch_norm(layer: BatchNorm, mesh: Mesh) -> Callable[..., jax.Array]:
    r"""Batch normalization with batch statistics (training mode) on ``mesh``: a JAX function
    ``f(x, weight=None, bias=None) -> y`` of global arrays, x and y ``(N, C, ...)``, weight and
    bias ``(C,)`` (defaults ones and zeros; none for ``affine=False``):

    ``y = (x - mean) / sqrt(var + eps) * weight + bias``, mean and the biased var over every
    axis but 1 (``jax.nn.standardize(x, axis=(0, 2, ...), epsilon=eps)``), as torch's
    ``BatchNorm`` in training. The running statistics are not kept (a pure function):
    ``f(x, weight, bias, with_statistics=True)`` returns ``(y, mean, var)`` (global (C,) rows,
    the biased variance) for the caller's update (``layer.updated_running`` is torch's, and
    works on jnp arrays); evaluation with running statistics is elementwise, no communication.

    Raises
    ------
    MeshError
        If ``mesh`` is not a Mesh or has fewer devices than x's workers.
    LayerError
        If ``layer`` is not a BatchNorm; when called, an array of the wrong shape, parameters
        given to a layer without them, or a channel of fewer than 2 entries.
    """
    require_layer("batch_norm", layer, BatchNorm)
    return _BatchNorm(layer, mesh)
