r"""One JAX kernel for every worker of a layer (:class:`~linop.kernel_template.KernelTemplate`),
so that the lowering onto JAX devices (:func:`~linop.frameworks.jax_sharded.sharded`) runs the
layer's local kernels as ONE program on every device instead of a ``lax.switch`` (the plan's
``KernelOp.mode`` says ``"spmd"``).

Each template is padding-consistent (:mod:`linop.kernel_template`): on blocks zero-padded at
their far ends, and parameters zero-padded likewise, the leading corner of each result is the
worker's own.

- the affine input kernel, parameters W: :math:`x \mapsto x W^{T}`, adjoint
  :math:`y \mapsto y \bar W`;
- the affine parameter kernel, parameters x: :math:`(W, b) \mapsto x W^{T} + b`, adjoint
  :math:`y \mapsto (y^{T} \bar x, \sum_n y_n)`;
- average pooling, no parameters: the windows' means (``lax.reduce_window``), adjoint by
  ``jax.linear_transpose``;
- max pooling's selection, parameters the selected positions i: :math:`y_p = x_{i_p}`,
  adjoint :math:`x_{i_p} \mathrel{+}= y_p`;
- interpolation, parameters the tables of each axis: :math:`y_i = \lambda_i x_{a_i} + \mu_i
  x_{b_i}` per axis, adjoint by ``jax.linear_transpose``.

The convolution's templates live with its kernels (:mod:`linop.layers.kernels`); the affine
layer gives its own (:mod:`linop.layers.affine`). Pooling and interpolation build their trees
in their own modules: :func:`templated` gives the local kernels of such a tree their templates
afterwards (the same numpy kernels, the same tree; only the JAX form added), reading each
worker's parameters from the layer's public description (the selection by running the
worker's numpy kernel on the positions of its window). JAX is imported only when a template
runs.

- batch norm's training Jacobian, parameters the saved :math:`\hat x` and scale s:
  :math:`t \mapsto (t, (\sum t \hat x; \sum t))` and :math:`(t, g) \mapsto s (t - g_1/m -
  \hat x g_0/m)` (:func:`batch_norm_templates`; :meth:`~linop.layers.BatchNorm.jacobian` gives
  its kernels these, the per-channel sums between them one all-reduce).

Not here: a :class:`~linop.layers.Loss`'s trees hold no local kernel (its reduction is data
movement; the JAX function computes the terms itself).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..kernel_template import KernelTemplate
from ..local import LocalOperator
from ..operator import Composition, LinearOperator
from ..partition import grid_block_name
from .base import LayerError

__all__ = [
    "affine_input_template",
    "batch_norm_templates",
    "affine_parameter_template",
    "average_pool_template",
    "interpolation_template",
    "selection_template",
    "templated",
]


def _fit(y: Any, shape: Sequence[int]) -> Any:
    """``y`` cut or zero-padded to ``shape`` (its leading corner kept)."""
    import jax.numpy as jnp

    if tuple(y.shape) == tuple(shape):
        return y
    y = y[tuple(slice(0, min(a, b)) for a, b in zip(y.shape, shape))]
    return jnp.pad(y, [(0, b - a) for a, b in zip(y.shape, shape)])


# -- affine -------------------------------------------------------------------------------------
def _affine_input_forward(params: tuple[Any, ...], x: Any, *, shapes: tuple[tuple[int, ...], ...]) -> Any:
    return _fit(x @ params[0].T, shapes[0])


def _affine_input_adjoint(params: tuple[Any, ...], y: Any, *, shapes: tuple[tuple[int, ...], ...]) -> Any:
    import jax.numpy as jnp

    return _fit(y @ jnp.conj(params[0]), shapes[0])


def affine_input_template(weights: np.ndarray) -> KernelTemplate:
    """The affine layer's input kernel :math:`x \\mapsto x W^{T}` of a worker's ``weights``
    ``(F_out, F_in)`` share (padded rows and columns of W are zero: padding-consistent)."""
    return KernelTemplate(_affine_input_forward, _affine_input_adjoint, (np.asarray(weights),), "affine")


@functools.cache
def _affine_parameter_functions(with_bias: bool) -> tuple[Callable[..., Any], Callable[..., Any]]:
    def forward(
        params: tuple[Any, ...], w: Any, b: Any = None, *, shapes: tuple[tuple[int, ...], ...]
    ) -> Any:
        y = _fit(params[0] @ w.T, shapes[0])
        return y + b[None, :] if with_bias else y

    def adjoint(params: tuple[Any, ...], y: Any, *, shapes: tuple[tuple[int, ...], ...]) -> Any:
        import jax.numpy as jnp

        dw = _fit(y.T @ jnp.conj(params[0]), shapes[0])
        return (dw, _fit(jnp.sum(y, axis=0), shapes[1])) if with_bias else dw

    return forward, adjoint


def affine_parameter_template(x: np.ndarray, with_bias: bool) -> KernelTemplate:
    """The affine layer's parameter kernel :math:`(W, b) \\mapsto x W^{T} + b` for a worker's
    fixed input block ``x`` ``(N, F_in)``."""
    forward, adjoint = _affine_parameter_functions(bool(with_bias))
    return KernelTemplate(forward, adjoint, (np.asarray(x),), ("affine_w", bool(with_bias)))


# -- pooling --------------------------------------------------------------------------------------
@functools.cache
def _average_functions(
    size: tuple[int, ...], stride: tuple[int, ...], dilation: tuple[int, ...]
) -> tuple[Callable[..., Any], Callable[..., Any]]:
    taps = int(np.prod(size))

    def mean(x: Any, shape: tuple[int, ...]) -> Any:
        from jax import lax

        total = lax.reduce_window(
            x, np.zeros((), x.dtype), lax.add, (1, 1, *size), (1, 1, *stride), "VALID",
            window_dilation=(1, 1, *dilation),
        )  # fmt: skip
        return _fit(total / taps, shape)

    def forward(params: tuple[Any, ...], x: Any, *, shapes: tuple[tuple[int, ...], ...]) -> Any:
        return mean(x, shapes[0])

    def adjoint(params: tuple[Any, ...], y: Any, *, shapes: tuple[tuple[int, ...], ...]) -> Any:
        import jax

        window = jax.ShapeDtypeStruct(shapes[0], y.dtype)
        (x,) = jax.linear_transpose(lambda v: mean(v, tuple(y.shape)), window)(y)
        return x

    return forward, adjoint


def average_pool_template(
    size: Sequence[int], stride: Sequence[int], dilation: Sequence[int]
) -> KernelTemplate:
    """Average pooling of a window (``lax.reduce_window`` over the spatial axes, the sum over
    the number of taps), the same on every worker: no parameters."""
    forward, adjoint = _average_functions(tuple(size), tuple(stride), tuple(dilation))
    return KernelTemplate(forward, adjoint, (), ("average_pool", tuple(size), tuple(stride), tuple(dilation)))


def _select_forward(params: tuple[Any, ...], x: Any, *, shapes: tuple[tuple[int, ...], ...]) -> Any:
    positions = params[0]
    return _fit(x[tuple(positions[k] for k in range(positions.shape[0]))], shapes[0])


def _select_adjoint(params: tuple[Any, ...], y: Any, *, shapes: tuple[tuple[int, ...], ...]) -> Any:
    import jax.numpy as jnp

    positions = params[0]
    index = tuple(positions[k] for k in range(positions.shape[0]))
    return jnp.zeros(shapes[0], y.dtype).at[index].add(y)


def selection_template(flat: np.ndarray, window: Sequence[int]) -> KernelTemplate:
    """The selection :math:`y_p = x_{i_p}` of a worker (max pooling's Jacobian): ``flat`` the
    flat indices into its ``window`` shape (one per output), kept as one coordinate array per
    axis (``(ndim, *out)``, int32) so that they index a padded window alike; the adjoint adds
    each output into its entry."""
    flat = np.asarray(flat)
    coordinates = np.stack(np.unravel_index(flat.reshape(-1), tuple(window))).reshape(
        len(window), *flat.shape
    )
    return KernelTemplate(_select_forward, _select_adjoint, (coordinates.astype(np.int32),), "select")


# -- interpolation ----------------------------------------------------------------------------------
@functools.cache
def _interpolation_functions(dims: int) -> tuple[Callable[..., Any], Callable[..., Any]]:
    def resample(params: tuple[Any, ...], x: Any, shape: tuple[int, ...]) -> Any:
        import jax.numpy as jnp

        for d in range(dims):
            first, second, weights = params[3 * d : 3 * d + 3]
            axis = x.ndim - dims + d
            spread = (1,) * axis + (-1,) + (1,) * (dims - d - 1)
            dtype = jnp.result_type(x, weights)
            low, high = (weights[k].astype(dtype).reshape(spread) for k in (0, 1))
            x = jnp.take(x, first, axis=axis) * low + jnp.take(x, second, axis=axis) * high
        return _fit(x, shape)

    def forward(params: tuple[Any, ...], x: Any, *, shapes: tuple[tuple[int, ...], ...]) -> Any:
        return resample(params, x, shapes[0])

    def adjoint(params: tuple[Any, ...], y: Any, *, shapes: tuple[tuple[int, ...], ...]) -> Any:
        import jax
        import jax.numpy as jnp

        window = jax.ShapeDtypeStruct(shapes[0], jnp.result_type(y, params[2]))
        (x,) = jax.linear_transpose(lambda v: resample(params, v, tuple(y.shape)), window)(y)
        return x

    return forward, adjoint


def _narrow(weights: np.ndarray) -> np.ndarray:
    """Integer weights (an exact tree's) as int32 where they fit: JAX's integers without x64."""
    if weights.dtype.kind in "iu" and (weights.size == 0 or int(np.abs(weights).max()) < 2**31):
        return weights.astype(np.int32)
    return weights


def interpolation_template(parts: Sequence[Any]) -> KernelTemplate:
    """A worker's interpolation (:meth:`~linop.layers.Interpolate.parts`: per spatial axis
    its outputs' two entries in its window and their weights): per axis :math:`y_i =
    \\lambda_i x_{a_i} + \\mu_i x_{b_i}` by two gathers; the adjoint its transpose."""
    params: list[np.ndarray] = []
    for part in parts:
        params += [
            np.asarray(part.first, np.int32),
            np.asarray(part.second, np.int32),
            _narrow(np.stack([np.asarray(part.weight_first), np.asarray(part.weight_second)])),
        ]
    forward, adjoint = _interpolation_functions(len(parts))
    return KernelTemplate(forward, adjoint, tuple(params), ("interpolate", len(parts)))


# -- batch norm ------------------------------------------------------------------------------------
def _channel_sums(t: Any, xhat: Any) -> Any:
    r""":math:`(\sum t \hat x;\, \sum t)` per channel of a block (N, c, ...): a (2, c) array."""
    import jax.numpy as jnp

    axes = (0, *range(2, t.ndim))
    return jnp.stack([(t * xhat).sum(axis=axes), t.sum(axis=axes)])


def _along_channels(values: Any, ndim: int) -> Any:
    """A per-channel vector (c,) as (1, c, 1, ...) against a block of ``ndim`` dimensions."""
    return values.reshape((1, values.shape[-1], *(1,) * (ndim - 2)))


@functools.cache
def _batch_norm_functions(
    count: int,
) -> tuple[tuple[Callable[..., Any], ...], tuple[Callable[..., Any], ...]]:
    def gather(params: tuple[Any, ...], t: Any, *, shapes: tuple[tuple[int, ...], ...]) -> Any:
        xhat = _fit(params[0], t.shape)
        return _fit(t, shapes[0]), _fit(_channel_sums(t, xhat), shapes[1])

    def gather_adjoint(
        params: tuple[Any, ...], t: Any, g: Any, *, shapes: tuple[tuple[int, ...], ...]
    ) -> Any:
        xhat = _fit(params[0], t.shape)
        g = _fit(g, (2, t.shape[1]))
        return _fit(t + xhat * _along_channels(g[0], t.ndim) + _along_channels(g[1], t.ndim), shapes[0])

    def combine(params: tuple[Any, ...], t: Any, g: Any, *, shapes: tuple[tuple[int, ...], ...]) -> Any:
        xhat, scale = _fit(params[0], t.shape), _fit(params[1], (t.shape[1],))
        g = _fit(g, (2, t.shape[1]))
        mean = _along_channels(g[1], t.ndim) / count
        slope = _along_channels(g[0], t.ndim) / count
        return _fit(_along_channels(scale, t.ndim) * (t - mean - xhat * slope), shapes[0])

    def combine_adjoint(params: tuple[Any, ...], y: Any, *, shapes: tuple[tuple[int, ...], ...]) -> Any:
        xhat, scale = _fit(params[0], y.shape), _fit(params[1], (y.shape[1],))
        u = _along_channels(scale, y.ndim) * y
        return _fit(u, shapes[0]), _fit(-_channel_sums(u, xhat) / count, shapes[1])

    return (gather, gather_adjoint), (combine, combine_adjoint)


def batch_norm_templates(
    xhat: np.ndarray, scale: np.ndarray, count: int
) -> tuple[KernelTemplate, KernelTemplate]:
    r"""A worker's two kernels of the batch-norm training Jacobian
    (:meth:`~linop.layers.BatchNorm.jacobian`), on its saved normalized block ``xhat``
    (N, c, ...) and per-channel ``scale`` :math:`s = w (\sigma^2 + \epsilon)^{-1/2}` (c,),
    ``count`` m the entries of one channel:

    - ``gather`` :math:`t \mapsto (t, (\sum t \hat x; \sum t))`, adjoint
      :math:`(t, g) \mapsto t + \hat x g_0 + g_1`;
    - ``combine`` :math:`(t, g) \mapsto s (t - g_1 / m - \hat x g_0 / m)`, adjoint
      :math:`y \mapsto (s y, -(\sum s y \hat x; \sum s y) / m)`.

    Padding-consistent: a block zero-padded beyond its entries adds nothing to a per-channel
    sum (its padded channels meet zero :math:`\hat x` and zero s), and every output entry
    inside the block reads only the block's own entries and channels."""
    (gather, gather_adjoint), (combine, combine_adjoint) = _batch_norm_functions(int(count))
    xhat = np.asarray(xhat)
    return (
        KernelTemplate(gather, gather_adjoint, (xhat,), ("batch_norm_gather", int(count))),
        KernelTemplate(
            combine, combine_adjoint, (xhat, np.asarray(scale)), ("batch_norm_combine", int(count))
        ),
    )


# -- a layer's tree with its templates --------------------------------------------------------------
def _rewrite(
    op: LinearOperator, template_of: Callable[[LocalOperator], KernelTemplate | None]
) -> LinearOperator:
    if isinstance(op, LocalOperator):
        template = template_of(op)
        if template is None:
            return op
        return dataclasses.replace(op, kernel=op.kernel.with_template(template))
    if isinstance(op, Composition):
        return Composition(tuple(_rewrite(f, template_of) for f in op.factors))
    return op


def templated(layer: Any, op: LinearOperator, *, scales: Sequence[int] | None = None) -> LinearOperator:
    """``op``, a tree of ``layer`` (an :class:`~linop.layers.AveragePool`'s ``operator``, a
    :class:`~linop.layers.MaxPoolJacobian`'s ``at(...)``, an
    :class:`~linop.layers.Interpolate`'s ``operator``, or their adjoints), with each of the
    layer's local kernels given its JAX template: the same tree (the same numpy kernels,
    ``op == templated(layer, op)`` in value), whose kernels JAX devices run as one program.
    ``scales``: an Interpolate tree's integer scales (``layer.denominators`` for
    ``integer_operator()``), None for its float weights.

    Raises
    ------
    LayerError
        If ``layer`` is none of those.
    """
    from .interpolate import Interpolate
    from .pooling import AveragePool, MaxPoolJacobian

    if not isinstance(layer, AveragePool | MaxPoolJacobian | Interpolate):
        raise LayerError(
            f"templated() takes an AveragePool, MaxPoolJacobian or Interpolate, not {type(layer).__name__}"
        )
    label = "interp" if isinstance(layer, Interpolate) else layer.label
    workers = {grid_block_name(label, g): tuple(g) for g in layer.x.partition.indices()}
    kernel: Any = getattr(layer, "kernel", None)

    def template_of(node: LocalOperator) -> KernelTemplate | None:
        g = workers.get(node.name)
        if g is None:
            return None
        if isinstance(layer, Interpolate):
            return interpolation_template(layer.parts(g, scales))
        size, stride, dilation = (tuple(v[2:]) for v in (kernel.size, kernel.stride, kernel.dilation))
        if isinstance(layer, AveragePool):
            return average_pool_template(size, stride, dilation)
        # the selection: the worker's own numpy kernel run on its window's positions
        window = tuple(layer.geometry.window_shape(g))
        positions = np.arange(int(np.prod(window)), dtype=np.int64).reshape(window)
        forward = node.kernel.call  # the numpy forward (adjointed nodes share the kernel)
        (flat,) = _as_tuple(forward([positions], adjoint=False))
        return selection_template(np.asarray(flat), window)

    return _rewrite(op, template_of)


def _as_tuple(result: Any) -> tuple[Any, ...]:
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)
