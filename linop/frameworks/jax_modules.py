r"""The JAX layers (:mod:`~linop.frameworks.jax_layers`, :mod:`~linop.frameworks.jax_losses`,
:mod:`~linop.frameworks.jax_norm`) as `equinox <https://docs.kidger.site/equinox/>`_ modules:
the ``equinox`` extra (``pip install -e '.[equinox]'``).

Why equinox: it is small (one pure-Python wheel of under 200 kB on top of jax), and a module is a
plain pytree of its arrays, so a layer's parameters are leaves that ``jax.grad``, ``jax.jit``
and any optimizer see directly; no variable collections or graph state are needed, because the
layers' parameters are arrays and their functions are pure (flax.nnx would add its mutable
object graph for nothing).

Each module holds its parameters (initialized as torch does, or given) and the layer's function
built once for a mesh (a static field: not a leaf), and its ``__call__`` is that function:

.. math::

    \texttt{Convolution(layer, mesh)}(x) = f(x, w, b), \qquad
    \bar w, \bar b = \partial f^{*} \bar y

the backward being the function's (the adjoint trees' lowerings, JAX's derivative of the local
steps). :class:`BatchNorm` keeps its running statistics the equinox way, in an
``eqx.nn.State`` (``eqx.nn.make_with_state``): ``y, state = bn(x, state)`` in training (batch
statistics, and the running ones updated as torch does), ``bn(x, state, inference=True)``
(elementwise, no communication) in evaluation.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

from .extras import importing

with importing("equinox", __name__):  # the equinox extra: say so where it is missing
    import equinox as eqx

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from ..errors import LayerError
from ..layers import Affine as AffineLayer
from ..layers import AveragePool as AveragePoolLayer
from ..layers import BatchNorm as BatchNormLayer
from ..layers import Convolution as ConvolutionLayer
from ..layers import Interpolate as InterpolateLayer
from ..layers import Loss as LossLayer
from ..layers import MaxPoolJacobian
from . import jax_layers, jax_losses, jax_norm

__all__ = ["Affine", "AveragePool", "BatchNorm", "Convolution", "Interpolate", "Loss", "MaxPool"]


def _uniform(key: jax.Array | None, shape: tuple[int, ...], bound: float, dtype: Any, what: str) -> jax.Array:
    """torch's default initialization of a weight or bias: uniform on [-bound, bound]."""
    if key is None:
        raise LayerError(f"{what}: give key= (a jax.random key) or the parameter itself")
    return jax.random.uniform(key, shape, dtype, -bound, bound)


def _parameter(value: Any, shape: tuple[int, ...], dtype: Any, what: str) -> jax.Array:
    array = jnp.asarray(value, dtype)
    if tuple(array.shape) != shape:
        raise LayerError(f"{what} has shape {tuple(array.shape)}, expected {shape}")
    return array


class _Bilinear(eqx.Module):
    r"""A convolution or affine layer's module: ``weight``, ``bias`` (None without one) and the
    layer's function built by the subclass's ``builder`` for a mesh.

    Parameters
    ----------
    layer : linop.layers.Convolution or linop.layers.Affine
    mesh : jax.sharding.Mesh
        Worker w of the layer on device w.
    key : jax.Array, optional
        Draws ``weight`` and ``bias`` uniform on :math:`\pm 1/\sqrt{\text{fan in}}` (torch's
        default) when they are not given.
    weight, bias : array, optional
        The parameters, global.
    dtype : dtype
        Of the parameters (default float32).
    """

    weight: jax.Array
    bias: jax.Array | None
    function: Callable[..., jax.Array] = eqx.field(static=True)
    builder: ClassVar[Callable[..., Callable[..., jax.Array]]]  # the subclass's layer function

    def __init__(
        self,
        layer: ConvolutionLayer | AffineLayer,
        mesh: Mesh,
        *,
        key: jax.Array | None = None,
        weight: Any = None,
        bias: Any = None,
        dtype: Any = jnp.float32,
    ) -> None:
        what = type(self).__name__
        self.function = type(self).builder(layer, mesh)
        shape = tuple(layer.weights.global_shape)
        bound = 1.0 / math.sqrt(max(1, math.prod(shape[1:])))  # 1 / sqrt(fan_in), torch's
        keys = (None, None) if key is None else tuple(jax.random.split(key))
        self.weight = (
            _uniform(keys[0], shape, bound, dtype, what)
            if weight is None
            else _parameter(weight, shape, dtype, f"{what}: weight")
        )
        if layer.bias is None:
            if bias is not None:
                raise LayerError(f"{what}: a bias was given, but the layer was built with bias=False")
            self.bias = None
        else:
            rows = tuple(layer.bias.global_shape)
            self.bias = (
                _uniform(keys[1], rows, bound, dtype, what)
                if bias is None
                else _parameter(bias, rows, dtype, f"{what}: bias")
            )

    def __call__(self, x: Any) -> jax.Array:
        return self.function(x, self.weight, self.bias)


class Convolution(_Bilinear):
    """A :class:`~linop.layers.Convolution` on ``mesh`` with its parameters, weight ``(C_out,
    C_in, *k)`` and bias ``(C_out,)``: ``y = conv(x, w) + b``
    (:func:`~linop.frameworks.jax_layers.convolution`). Parameters as :class:`_Bilinear`'s:
    ``Convolution(layer, mesh, *, key=None, weight=None, bias=None, dtype=float32)``."""

    builder = staticmethod(jax_layers.convolution)


class Affine(_Bilinear):
    """An :class:`~linop.layers.Affine` layer on ``mesh`` with its parameters, weight ``(F_out,
    F_in)`` and bias ``(F_out,)``: ``y = x w^T + b`` (:func:`~linop.frameworks.jax_layers.affine`).
    Parameters as :class:`Convolution`'s."""

    builder = staticmethod(jax_layers.affine)


class _Stateless(eqx.Module):
    """A layer without parameters: its function of x."""

    function: Callable[[Any], jax.Array] = eqx.field(static=True)

    def __call__(self, x: Any) -> jax.Array:
        return self.function(x)


class AveragePool(_Stateless):
    """Average pooling (:func:`~linop.frameworks.jax_layers.average_pool`) on ``mesh``."""

    def __init__(self, layer: AveragePoolLayer | MaxPoolJacobian, mesh: Mesh) -> None:
        self.function = jax_layers.average_pool(layer, mesh)


class MaxPool(_Stateless):
    """Max pooling (:func:`~linop.frameworks.jax_layers.max_pool`) on ``mesh``."""

    def __init__(self, layer: AveragePoolLayer | MaxPoolJacobian, mesh: Mesh) -> None:
        self.function = jax_layers.max_pool(layer, mesh)


class Interpolate(_Stateless):
    """An interpolation (:func:`~linop.frameworks.jax_layers.interpolate`) on ``mesh``."""

    def __init__(self, layer: InterpolateLayer, mesh: Mesh) -> None:
        self.function = jax_layers.interpolate(layer, mesh)


class Loss(eqx.Module):
    """A loss (:func:`~linop.frameworks.jax_losses.loss`) on ``mesh``: ``loss(x, target)``."""

    function: Callable[[Any, Any], jax.Array] = eqx.field(static=True)

    def __init__(self, layer: LossLayer, mesh: Mesh) -> None:
        self.function = jax_losses.loss(layer, mesh)

    def __call__(self, x: Any, target: Any) -> jax.Array:
        return self.function(x, target)


class BatchNorm(eqx.Module):
    r"""Batch normalization (:func:`~linop.frameworks.jax_norm.batch_norm`) on ``mesh``, with
    ``weight`` and ``bias`` ``(C,)`` (ones and zeros, or None for ``affine=False``) and the
    running statistics in an ``eqx.nn.State``: build it with
    ``bn, state = eqx.nn.make_with_state(BatchNorm)(layer, mesh)``.

    ``bn(x, state)`` (training) normalizes with the batch statistics (their sums all-reduced by
    the layer's tree) and returns ``(y, state)`` with the running mean and variance updated as
    torch does: :math:`r \leftarrow (1 - \alpha) r + \alpha s` (``layer.updated_running``, the
    unbiased variance; :math:`\alpha` the momentum, or 1 / the number of batches for
    ``momentum=None``). ``bn(x, state, inference=True)`` (or a module built with
    ``inference=True``) normalizes with the running statistics: elementwise, no
    communication, the state unchanged.
    """

    weight: jax.Array | None
    bias: jax.Array | None
    index: eqx.nn.StateIndex
    inference: bool
    function: Callable[..., Any] = eqx.field(static=True)
    layer: BatchNormLayer = eqx.field(static=True)

    def __init__(
        self, layer: BatchNormLayer, mesh: Mesh, *, inference: bool = False, dtype: Any = jnp.float32
    ) -> None:
        self.function = jax_norm.batch_norm(layer, mesh)
        self.layer = layer
        c = layer.channels
        self.weight = jnp.ones(c, dtype) if layer.affine else None
        self.bias = jnp.zeros(c, dtype) if layer.affine else None
        self.inference = inference
        self.index = eqx.nn.StateIndex((jnp.zeros(c, dtype), jnp.ones(c, dtype), jnp.zeros((), jnp.int32)))

    def __call__(
        self, x: Any, state: eqx.nn.State, *, inference: bool | None = None
    ) -> tuple[jax.Array, eqx.nn.State]:
        layer = self.layer
        mean, var, batches = state.get(self.index)
        if self.inference if inference is None else inference:
            x = jnp.asarray(x)
            spread = (1, -1) + (1,) * (x.ndim - 2)
            y = (x - mean.reshape(spread)) * jax.lax.rsqrt(var.reshape(spread) + layer.eps)
            if self.weight is not None and self.bias is not None:
                y = y * self.weight.reshape(spread) + self.bias.reshape(spread)
            return y, state
        y, batch_mean, batch_var = self.function(x, self.weight, self.bias, with_statistics=True)
        batches = batches + 1
        factor = 1.0 / batches if layer.momentum is None else layer.momentum
        running = layer.updated_running(
            (mean, var), (jax.lax.stop_gradient(batch_mean), jax.lax.stop_gradient(batch_var)), factor
        )
        running = tuple(r.astype(mean.dtype) for r in running)
        return y, state.set(self.index, (*running, batches))
