r"""Distributed layers (:mod:`linop.layers`) as JAX functions of global arrays, for ``jit``,
``grad`` and ``vmap``.

Each builder takes a layer description and a device :class:`~jax.sharding.Mesh` (worker w of
the layer on device w of the mesh, its axes linearized in order) and returns a pure function
of global arrays. Inside, the layer moves data with its own linop trees, lowered by
:func:`~linop.frameworks.jax_sharded.sharded` into ``shard_map`` collectives, and computes with
``jax.lax`` on each device (:mod:`linop.frameworks.jax_stages`). For a convolution or an affine
map (``docs/theory.md#layers``):

.. math::

    \tilde x = W x, \quad \tilde\theta = M \theta, \quad
    \tilde y_d = L(\tilde x_d, \tilde\theta_d) \text{ on device } d, \quad y = R\, \tilde y

with :math:`W` the layer's ``window_operator`` (the halo exchange, and the broadcast of the
input over output-channel workers), :math:`M` its ``parameter_movement``, :math:`R` its
``output_reduction`` and :math:`L` ``lax.conv_general_dilated`` or a matrix product. The
backward is

.. math::

    \bar{\tilde y} = R^{*} \bar y, \quad (\bar{\tilde x}_d, \bar{\tilde\theta}_d) =
    \partial L^{*} \bar{\tilde y}_d, \quad \bar x = W^{*} \bar{\tilde x}, \quad
    \bar\theta = M^{*} \bar{\tilde\theta}

where the adjoints :math:`W^{*}, M^{*}, R^{*}` are the lowerings of linop's adjoint trees
(the transpose rule of the lowered primitive) and :math:`\partial L^{*}` is JAX's own.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from .extras import importing

with importing("jax", __name__):  # the jax extra: say so where it is missing
    import jax

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh

from ..errors import LayerError
from ..layers import Affine, AveragePool, Convolution, Interpolate, MaxPoolJacobian
from .jax_stages import Tree, fit, join, layout_of, local_map, placement, require_global, require_layer, split

__all__ = ["affine", "average_pool", "convolution", "interpolate", "max_pool"]


class _Bilinear:
    """A convolution or affine layer on a mesh: its three movement trees lowered once, and the
    per-device product ``product(window, weight, bias) -> partial`` (batch-free: one device's
    row, leading axis dropped)."""

    def __init__(
        self, layer: Convolution | Affine, mesh: Mesh, product: Callable[[jax.Array, jax.Array], jax.Array]
    ) -> None:
        what = type(layer).__name__
        axes, devices = placement(mesh)
        self.layer, self.name = layer, what
        self.windows = Tree(layer.window_operator, mesh, axes)
        self.movement = Tree(layer.parameter_movement, mesh, axes)
        reduction = layer.output_reduction
        self.reduction = None if reduction is None else Tree(reduction, mesh, axes)
        partials = [layer.partial_block(j) for j in layer.work_indices()]
        self.partials = self.reduction.domain if self.reduction is not None else layout_of(partials, devices)
        if len(self.partials.slots) != 1 or len(self.windows.range.slots) != 1:
            raise LayerError(
                f"{what}: each device must hold at most one work block (the work partition {layer.work.shape} "
                f"places several on one device)"
            )
        windows, parameters = self.windows.range.slot_of(), self.movement.range.slot_of()
        operands = {
            (windows[w][0], parameters[t][0], None if b is None else parameters[b][0])
            for w, t, b in (layer.local_operands(j) for j in layer.work_indices())
        }
        names = {(w, t) for w, t, _ in operands}
        biases = {b for _, _, b in operands if b is not None}
        if len(names) != 1 or len(biases) > 1:
            raise LayerError(
                f"{what}: the work blocks do not fall into one slot per operand: {sorted(operands)}"
            )
        ((self.window_slot, self.weight_slot),) = names
        self.bias_slot = next(iter(biases), None)
        shape = self.partials.slots[0].shape

        def local(window: jax.Array, weight: jax.Array, *bias: jax.Array) -> jax.Array:
            y = product(window[0], weight[0])
            if bias:
                b = bias[0][0]
                y = y + b.reshape((1, -1) + (1,) * (y.ndim - 2))
            return fit(y, shape, lead=0)[None]

        self.local = local_map(local, mesh, axes, 3 if self.bias_slot is not None else 2)

    def __call__(self, x: Any, weights: Any, bias: Any = None) -> jax.Array:
        layer, what = self.layer, self.name
        x = require_global(what, "x", x, layer.x.global_shape)
        weights = require_global(what, "weights", weights, layer.weights.global_shape)
        state = split(layer.weights, weights)
        if layer.bias is not None:
            if bias is None:
                bias = jnp.zeros(layer.bias.global_shape, weights.dtype)
            state.update(split(layer.bias, require_global(what, "bias", bias, layer.bias.global_shape)))
        elif bias is not None:
            raise LayerError(f"{what}: a bias was given, but the layer was built with bias=False")
        dtype = jnp.result_type(x, *state.values())
        windows = self.windows.slots({k: v.astype(dtype) for k, v in split(layer.x, x).items()})
        copies = self.movement.slots({k: v.astype(dtype) for k, v in state.items()})
        operands = [windows[self.window_slot], copies[self.weight_slot]]
        if self.bias_slot is not None:
            operands.append(copies[self.bias_slot])
        partial = {self.partials.names[0]: self.local(*operands)}
        if self.reduction is not None:
            blocks = self.reduction.blocks(self.reduction(partial))
        else:
            blocks = self.windows.blocks(partial, self.partials)
        return join(layer.y, blocks)


def convolution(layer: Convolution, mesh: Mesh) -> Callable[..., jax.Array]:
    r"""The convolution (cross-correlation) ``layer`` on ``mesh`` as a JAX function
    ``f(x, weights, bias=None) -> y`` of global arrays: x ``(N, C_in, *S)``, weights
    ``(C_out, C_in, *k)``, bias ``(C_out,)`` (zeros when None and the layer has one), y
    ``(N, C_out, *n)``. It equals

    ``lax.conv_general_dilated(x, weights, stride, [(p, p), ...], rhs_dilation=dilation) + bias``

    (zero boundary; other boundaries fill the padding as the layer's halo tree does), and its
    derivative is linop's: the halo exchange's adjoint for the input gradient, the weights'
    broadcast's adjoint (a sum-reduction) for the weight gradient. Any partition of the layer:
    spatial, input- and output-channel.

    Raises
    ------
    MeshError
        If ``mesh`` is not a Mesh, or has fewer devices than the layer's workers.
    LayerError
        If an array has the wrong shape (when called), or a device holds two work blocks.
    """
    require_layer("convolution", layer, Convolution)
    stride = tuple(layer.kernel.stride[2:])  # type: ignore[index]
    dilation = tuple(layer.kernel.dilation[2:])  # type: ignore[index]

    def product(window: jax.Array, weight: jax.Array) -> jax.Array:
        return lax.conv_general_dilated(window, weight, stride, "VALID", rhs_dilation=dilation)

    return _Bilinear(layer, mesh, product)


def affine(layer: Affine, mesh: Mesh) -> Callable[..., jax.Array]:
    r"""The affine ``layer`` on ``mesh`` as a JAX function ``f(x, weights, bias=None) -> y`` of
    global arrays: x ``(N, F_in)``, weights ``(F_out, F_in)``, bias ``(F_out,)``, y ``(N,
    F_out)`` :math:`= x W^{T} + b`. The input's broadcast over output-feature workers and the
    partial outputs' sum over input-feature workers are linop trees; their adjoints give the
    gradients' sums.

    Raises
    ------
    MeshError, LayerError
        As :func:`convolution`.
    """
    require_layer("affine", layer, Affine)

    def product(x: jax.Array, weight: jax.Array) -> jax.Array:
        return x @ weight.T

    return _Bilinear(layer, mesh, product)


class _Pooling:
    """A pooling layer on a mesh: the halo tree lowered once, then ``lax.reduce_window`` on
    each device's window (padding entries that are not the tensor's own masked to -inf for
    max pooling)."""

    def __init__(self, layer: AveragePool | MaxPoolJacobian, mesh: Mesh, kind: str) -> None:
        axes, devices = placement(mesh)
        self.layer, self.kind = layer, kind
        self.windows = Tree(layer.window_operator, mesh, axes)
        self.outputs = layout_of(list(layer.y.blocks), devices)
        (slot,) = self.windows.range.slots
        (out,) = self.outputs.slots
        self.window_slot = slot.name
        kernel = layer.kernel
        size = tuple(kernel.size[2:])  # type: ignore[index]
        stride = tuple(kernel.stride[2:])  # type: ignore[index]
        dilation = tuple(kernel.dilation[2:])  # type: ignore[index]
        shape = out.shape
        self.mask: np.ndarray | None = None
        if kind == "max":  # which entries of each device's window are x's own (the rest: -inf)
            grid = {layer.window_name(g): g for g in layer.x.partition.indices()}
            selection = (
                layer if isinstance(layer, MaxPoolJacobian) else MaxPoolJacobian(layer.x, layer.kernel)
            )
            mask = np.zeros((devices, 1, 1, *slot.shape[2:]), dtype=bool)
            for d, block in enumerate(slot.blocks):
                if block is not None and 0 not in block.shape:
                    real = np.broadcast_to(selection.real_entries(grid[block.name]), block.shape)
                    index: tuple[Any, ...] = (d, 0, 0, *(slice(0, n) for n in block.shape[2:]))
                    mask[index] = real[0, 0]
            self.mask = mask
        window_dims = (1, 1, *size)
        strides = (1, 1, *stride)
        dilations = (1, 1, *dilation)
        taps = int(np.prod(size))

        def local(window: jax.Array, *mask: jax.Array) -> jax.Array:
            x = window[0]
            if mask:
                x = jnp.where(mask[0][0], x, -jnp.inf)
                if any(d != 1 for d in dilation):  # JAX has no vjp of a dilated max window
                    y = _tap_max(x, size, stride, dilation)
                else:  # a Python scalar init: lax recognises the max monoid and differentiates it
                    y = lax.reduce_window(x, -np.inf, lax.max, window_dims, strides, "VALID")
            else:
                y = lax.reduce_window(
                    x, 0.0, lax.add, window_dims, strides, "VALID", window_dilation=dilations
                )
                y = y / taps
            return fit(y, shape, lead=0)[None]

        self.local = local_map(local, mesh, axes, 2 if self.mask is not None else 1)

    def __call__(self, x: Any) -> jax.Array:
        layer = self.layer
        name = "max_pool" if self.kind == "max" else "average_pool"
        x = require_global(name, "x", x, layer.x.global_shape)
        if self.kind == "max" and not jnp.issubdtype(x.dtype, jnp.floating):
            raise LayerError(f"max_pool: x has dtype {x.dtype}; max pooling pads with -inf, a float dtype")
        windows = self.windows.slots(split(layer.x, x))
        operands = [windows[self.window_slot]]
        if self.mask is not None:
            operands.append(jnp.asarray(self.mask))
        partial = {self.outputs.names[0]: self.local(*operands)}
        return join(layer.y, self.windows.blocks(partial, self.outputs))


def _tap_max(
    x: jax.Array, size: tuple[int, ...], stride: tuple[int, ...], dilation: tuple[int, ...]
) -> jax.Array:
    """The largest entry of each (dilated, strided) window over the trailing axes of ``x``, as
    the running maximum of one strided slice per tap (differentiable: each output's gradient
    goes to its largest entry, split on exact ties)."""
    dims = len(size)
    out = [(n - d * (k - 1) - 1) // s + 1 for n, k, s, d in zip(x.shape[-dims:], size, stride, dilation)]
    best = None
    for tap in itertools.product(*(range(k) for k in size)):
        index = tuple(
            slice(t * d, t * d + (o - 1) * s + 1, s) for t, d, o, s in zip(tap, dilation, out, stride)
        )
        key = (Ellipsis, *index)
        value = x[key]
        best = value if best is None else jnp.maximum(best, value)
    assert best is not None
    return best


def average_pool(layer: AveragePool | MaxPoolJacobian, mesh: Mesh) -> Callable[[Any], jax.Array]:
    r"""Average pooling over ``layer``'s windows on ``mesh``: a JAX function ``f(x) -> y`` of
    global arrays, x ``(N, C, *S)``, y ``(N, C, *n)``, the mean of each window with its zero
    padding counted (``count_include_pad``):

    ``lax.reduce_window(x, 0, lax.add, (1, 1, *k), (1, 1, *stride), [(0, 0), (0, 0), (p, p),
    ...], window_dilation=(1, 1, *dilation)) / prod(k)``.

    Linear: its vjp is the window tree's adjoint after ``reduce_window``'s.

    Raises
    ------
    MeshError, LayerError
        As :func:`convolution`.
    """
    require_layer("average_pool", layer, AveragePool, MaxPoolJacobian)
    return _Pooling(layer, mesh, "average")


def max_pool(layer: AveragePool | MaxPoolJacobian, mesh: Mesh) -> Callable[[Any], jax.Array]:
    r"""Max pooling over ``layer``'s windows on ``mesh``: ``f(x) -> y``, the largest entry of
    each window, zero padding counting as :math:`-\infty` (as in ``lax.reduce_window(x, -inf,
    lax.max, ...)`` with that padding, and torch); a periodic or reflecting boundary fills the
    padding with x's own entries. Its vjp is JAX's (the selection of each window's largest
    entry, :class:`~linop.layers.MaxPoolJacobian`'s adjoint on the windows) followed by the
    window tree's adjoint.

    Raises
    ------
    MeshError, LayerError
        As :func:`convolution`; a LayerError for an x of a non-float dtype (when called).
    """
    require_layer("max_pool", layer, AveragePool, MaxPoolJacobian)
    return _Pooling(layer, mesh, "max")


class _Interpolation:
    """An interpolation on a mesh: the window tree lowered once, then per device and spatial
    axis two gathers weighted by that device's tables (stacked constants: its outputs' two
    source entries in its window and their weights, zero-padded to the slot)."""

    def __init__(self, layer: Interpolate, mesh: Mesh) -> None:
        axes, devices = placement(mesh)
        self.layer = layer
        self.windows = Tree(layer.window_operator, mesh, axes)
        self.outputs = layout_of(list(layer.y.blocks), devices)
        (slot,) = self.windows.range.slots
        (out,) = self.outputs.slots
        self.window_slot = slot.name
        grid = {layer.window_name(g): g for g in layer.x.partition.indices()}
        dims = layer.dims
        tables: list[np.ndarray] = []
        for d in range(dims):
            length = out.shape[2 + d]
            first = np.zeros((devices, length), np.int32)
            second = np.zeros((devices, length), np.int32)
            weights = np.zeros((devices, 2, length), np.float64)
            for device, block in enumerate(slot.blocks):
                if block is None:
                    continue
                part = layer.parts(grid[block.name])[d]
                n = part.first.size
                first[device, :n], second[device, :n] = part.first, part.second
                weights[device, 0, :n], weights[device, 1, :n] = part.weight_first, part.weight_second
            tables += [first, second, weights]
        self.tables = tables
        shape = out.shape

        def local(window: jax.Array, *tables: jax.Array) -> jax.Array:
            x = window[0]
            for d in range(dims):
                first, second, weights = (t[0] for t in tables[3 * d : 3 * d + 3])
                axis = 2 + d
                spread = (1,) * axis + (-1,) + (1,) * (dims - d - 1)
                low, high = (weights[k].astype(x.dtype).reshape(spread) for k in (0, 1))
                x = jnp.take(x, first, axis=axis) * low + jnp.take(x, second, axis=axis) * high
            return fit(x, shape, lead=0)[None]

        self.local = local_map(local, mesh, axes, 1 + len(tables))

    def __call__(self, x: Any) -> jax.Array:
        layer = self.layer
        x = require_global("interpolate", "x", x, layer.x.global_shape)
        windows = self.windows.slots(split(layer.x, x))
        y = self.local(windows[self.window_slot], *(jnp.asarray(t) for t in self.tables))
        return join(layer.y, self.windows.blocks({self.outputs.names[0]: y}, self.outputs))


def interpolate(layer: Interpolate, mesh: Mesh) -> Callable[[Any], jax.Array]:
    r"""The interpolation ``layer`` (torch's ``interpolate``: nearest, nearest-exact, linear,
    bilinear, trilinear, ``align_corners``) on ``mesh``: a JAX function ``f(x) -> y`` of
    global arrays, x ``(N, C, *S)``, y ``(N, C, *n)``. Per spatial axis each output is
    :math:`y_i = \lambda_i x_{a_i} + \mu_i x_{b_i}` (the layer's maps); upsampling in the
    ``"bilinear"`` and ``"nearest-exact"`` modes equals ``jax.image.resize`` with ``"linear"``
    and ``"nearest"``. Linear: its vjp is the gathers' (scatter-adds) followed by the window
    tree's adjoint.

    Raises
    ------
    MeshError, LayerError
        As :func:`convolution`.
    """
    require_layer("interpolate", layer, Interpolate)
    return _Interpolation(layer, mesh)
