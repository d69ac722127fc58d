r"""A chain of sliding-window layers with one halo exchange: the fused halo (docs/theory.md#layers).

A chain of stages (convolutions with fixed weights, average and max pooling), each a sliding
window with kernel :math:`k_i`, stride :math:`s_i`, padding :math:`p_i`, dilation :math:`d_i`
and extent :math:`e_i = d_i (k_i - 1) + 1`, is a sliding window itself. Output :math:`o` of
stage i reads entries :math:`[o s_i - p_i,\ o s_i - p_i + e_i)` of its input field, so output
:math:`o` of stages :math:`i \dots L` reads the entries

.. math::

    [\,o S_i - P_i,\ o S_i - P_i + E_i), \qquad
    S_i = s_i S_{i+1}, \quad P_i = p_i + s_i P_{i+1}, \quad E_i = s_i (E_{i+1} - 1) + e_i

(:math:`S_{L+1} = 1`, :math:`P_{L+1} = 0`, :math:`E_{L+1} = 1`; unrolled,
:math:`P_1 = p_1 + s_1 (p_2 + s_2 (p_3 + \dots))` and the fused halo is the sum of the stages'
halos, each scaled by the strides before it). The fused kernel :math:`(E_1, S_1, P_1)` with
dilation 1 has the chain's output length (for integers, :math:`\lfloor \lfloor a / s_1 \rfloor
/ s_2 \rfloor = \lfloor a / (s_1 s_2) \rfloor`), so one halo exchange :math:`W = T H E` of it
(:func:`linop.halo_windows`) gives each worker the receptive field of its share of the chain's
output, and the stages applied one after the other to that window, with no padding, give it:

.. math::

    y = L_L M_L \cdots L_2 M_2 L_1\, W x, \qquad
    x^{*} = W^{*} L_1^{*} M_2 L_2^{*} \cdots M_L L_L^{*}\, y

The window of field :math:`i-1` on a worker with outputs :math:`[o_0, o_1)` starts at
:math:`o_0 S_i - P_i`, a multiple of :math:`s_{i-1}` away from the previous one's, so every
stage is a valid (unpadded) window on it. :math:`M_i` is the boundary of stage i's padding:
an intermediate field's padding lies at the field's *global* boundary, not at a worker's, so
the entries of the enlarged window that lie outside :math:`[0, n_{i-1})` (computed from the
input's zero padding, generally not zero) are set to zero (:math:`M_i` is a 0/1 diagonal, its
own adjoint), and a max pool treats them as minus infinity
(:func:`~linop.layers.kernels.max_selection`'s ``real`` entries). On an interior worker
every :math:`M_i` is the identity: the fused window then holds real data only.

The price is redundant compute: neighbouring workers both compute the intermediate entries
their enlarged windows share (:meth:`WindowChain.redundancy` counts them), in exchange for one
exchange instead of L (fewer messages, :func:`linop.accounting.account`). The layer-by-layer
chain (:meth:`WindowChain.layered_operator`: :class:`Convolution`, :class:`AveragePool`,
:class:`MaxPoolJacobian` trees composed) is the reference the tests prove it equal to.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from ..halo import halo_windows
from ..halo_geometry import Kernel, halo_geometry, output_length
from ..operator import Composition, LinearOperator
from ..partition import DistributedTensor, grid_block_name
from ..space import Block, Space
from . import kernels
from .base import LayerError, LocalStep, local_stage, require_shape, require_tensor
from .conv import Convolution
from .pooling import AveragePool, MaxPoolJacobian

__all__ = ["ChainStage", "WindowChain", "fused_window"]

Kind = Literal["conv", "avg", "max"]
_LAYER = "WindowChain"


@dataclass(frozen=True, eq=False)
class ChainStage:
    """One sliding-window stage of a chain: a convolution with fixed ``weights`` ``(C_out, C_in,
    *k)`` or an average or max pool, over the spatial dimensions (``kernel`` without leading
    dimensions). Build it with :meth:`conv`, :meth:`avg` or :meth:`max`."""

    kind: Kind
    kernel: Kernel
    weights: np.ndarray | None = field(default=None, repr=False)

    @classmethod
    def conv(
        cls,
        weights: Any,
        *,
        stride: int | Sequence[int] = 1,
        padding: int | Sequence[int] = 0,
        dilation: int | Sequence[int] = 1,
        boundary: str | Sequence[str] = "zero",
    ) -> ChainStage:
        """A convolution (cross-correlation, no bias) with ``weights`` ``(C_out, C_in, *k)``."""
        array = np.array(weights)
        if array.ndim < 3:
            raise LayerError(f"{_LAYER}: convolution weights {array.shape} need (C_out, C_in, k...) axes")
        array.flags.writeable = False
        return cls("conv", Kernel(array.shape[2:], stride, padding, dilation, boundary), array)

    @classmethod
    def avg(cls, kernel: Kernel | int) -> ChainStage:
        """An average pool (zero padding counts, the mean over every tap)."""
        return cls("avg", kernel if isinstance(kernel, Kernel) else Kernel(kernel))

    @classmethod
    def max(cls, kernel: Kernel | int) -> ChainStage:
        """A max pool (zero padding counts as minus infinity)."""
        return cls("max", kernel if isinstance(kernel, Kernel) else Kernel(kernel))


def fused_window(kernels_: Sequence[Kernel], ndim: int) -> Kernel:
    r"""The one sliding window of a chain of resolved ``ndim``-dimensional kernels applied in
    order: per dimension extent :math:`E_1`, stride :math:`S_1` and padding :math:`P_1` of the
    module docstring (dilation 1), with the first kernel's boundary mode.

    >>> from linop import Kernel
    >>> print(fused_window([Kernel(3, padding=1), Kernel(3, padding=1), Kernel(2, stride=2)], 1))
    Kernel(size=(6,), stride=(2,), padding=(2,))

    Raises
    ------
    LayerError
        If no kernel is given.
    """
    if not kernels_:
        raise LayerError(f"{_LAYER}: a chain needs at least one stage")
    resolved = [k.resolve(ndim) for k in kernels_]
    stride, padding, size = _composites(resolved, ndim)[0]
    return Kernel(size, stride, padding, (1,) * ndim, resolved[0].boundary)


Composite = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


def _composites(resolved: Sequence[Kernel], ndim: int) -> list[Composite]:
    """(S_i, P_i, E_i) per dimension of stages i .. L, for every i (first stage first)."""
    stride, padding, size = [1] * ndim, [0] * ndim, [1] * ndim
    backwards: list[Composite] = []
    for k in reversed(resolved):
        for d in range(ndim):
            s = k.stride[d]  # type: ignore[index]
            size[d] = s * (size[d] - 1) + k.extent(d)
            padding[d] = k.padding[d] + s * padding[d]  # type: ignore[index]
            stride[d] = s * stride[d]
        backwards.append((tuple(stride), tuple(padding), tuple(size)))
    return backwards[::-1]


@dataclass(frozen=True)
class _Field:
    """Stage i's input window on one worker: its spatial start (global field coordinates) and
    shape, the field's channels, and which entries are real (inside the global field)."""

    start: tuple[int, ...]
    shape: tuple[int, ...]
    channels: int
    real: np.ndarray


class WindowChain:
    r"""A chain of sliding-window stages over a distributed tensor, with one fused halo exchange.

    Parameters
    ----------
    x : DistributedTensor
        Input (N, C, S_0, ...) on 1 x P_c x P_0 x ... (any shares); P_c must be 1 when a stage
        is a convolution (its channel reduction is not local).
    stages : sequence of ChainStage
        Applied in order; the first may have any boundary mode, the later ones pad with zeros
        (their padding is at an intermediate field's global boundary).
    name : str, optional
        Name of the output tensor (default ``"y"``); the layer-by-layer reference names its
        intermediate fields ``name + "_1"``, ``name + "_2"``, ...

    Attributes
    ----------
    x, y : DistributedTensor
        Input and output (y on x's partition, its spatial shares balanced, as each layer's).
    kernel : Kernel
        The fused window (:func:`fused_window`), resolved with identity batch and channel axes.
    window_shares : tuple
        The output shares the fused geometry is built with (x's batch and channel shares,
        balanced spatial ones), as :func:`~linop.halo_windows` takes them.
    geometry : HaloGeometry
        Its halo geometry over x.
    lengths : tuple of tuple of int
        The spatial shape of every field: x's, then each stage's output.
    channels : tuple of int
        The channels of every field.

    Raises
    ------
    LayerError
        No stage, a partitioned batch, channels partitioned under a convolution, weights whose
        input channels do not match, a later stage padding other than with zeros, or a field
        that comes out empty.
    """

    def __init__(self, x: DistributedTensor, stages: Sequence[ChainStage], *, name: str = "y") -> None:
        self.x = require_tensor(_LAYER, "x", x)
        dims = x.ndim - 2
        if dims < 1:
            raise LayerError(f"{_LAYER}: x {x.global_shape} needs (batch, channel, spatial...) dimensions")
        if x.partition.shape[0] != 1:
            raise LayerError(
                f"{_LAYER}: the batch dimension of x's partition {x.partition.shape} must have extent 1"
            )
        self.stages = tuple(stages)
        if not self.stages or not all(isinstance(s, ChainStage) for s in self.stages):
            raise LayerError(f"{_LAYER}: stages must be a non-empty sequence of ChainStage, not {stages!r}")
        if x.partition.shape[1] != 1 and any(s.kind == "conv" for s in self.stages):
            raise LayerError(
                f"{_LAYER}: a convolution sums over channels; x's channels must not be partitioned "
                f"(partition {x.partition.shape})"
            )
        self.dims = dims
        spatial = [s.kernel.resolve(dims) for s in self.stages]
        channels, lengths = [x.global_shape[1]], [tuple(x.global_shape[2:])]
        for i, (stage, k) in enumerate(zip(self.stages, spatial)):
            if i > 0 and any(b != "zero" for b in k.boundary):
                raise LayerError(
                    f"{_LAYER}: stage {i} pads with {k.boundary}; only the first stage may pad other than "
                    "with zeros (a later one pads an intermediate field at its global boundary)"
                )
            if stage.kind == "conv":
                if stage.weights is None or stage.weights.shape[2:] != tuple(k.size):  # type: ignore[arg-type]
                    shape = None if stage.weights is None else stage.weights.shape
                    raise LayerError(
                        f"{_LAYER}: stage {i} is a convolution with weights {shape} for a kernel of size "
                        f"{k.size}; build it with ChainStage.conv"
                    )
                if stage.weights.shape[1] != channels[-1]:
                    raise LayerError(
                        f"{_LAYER}: stage {i}'s weights {stage.weights.shape} take {stage.weights.shape[1]} "
                        f"channels, but its input has {channels[-1]}"
                    )
                channels.append(stage.weights.shape[0])
            else:
                channels.append(channels[-1])
            out = tuple(
                output_length(m, k.size[d], k.stride[d], k.padding[d], k.dilation[d])  # type: ignore[index]
                for d, m in enumerate(lengths[-1])
            )
            if 0 in out:
                raise LayerError(f"{_LAYER}: stage {i} ({k}) leaves no output of its input {lengths[-1]}")
            lengths.append(out)
        self._spatial = tuple(spatial)
        self.channels, self.lengths = tuple(channels), tuple(lengths)
        self.kernel = Kernel(*_identity_leading(fused_window(spatial, dims))).resolve(x.ndim)
        self.window_shares: tuple[tuple[int, ...] | None, ...] = (x.sizes[0], x.sizes[1], *(None,) * dims)
        self.geometry = halo_geometry(x, self.kernel, output_sizes=self.window_shares)
        assert tuple(self.geometry.output_shape[2:]) == lengths[-1], (self.geometry.output_shape, lengths)
        out_sizes = list(self.geometry.output_sizes)
        if channels[-1] != channels[0]:
            out_sizes[1] = (channels[-1],)
        self.name = name
        self.y = DistributedTensor(
            name, (x.global_shape[0], channels[-1], *lengths[-1]), x.partition, sizes=tuple(out_sizes)
        )
        self._window_name = f"{x.name}_window"

    # -- the fused tree -------------------------------------------------------------------------
    @property
    def window_operator(self) -> LinearOperator:
        """The one halo exchange x -> the fused windows (exact 0/1 data movement)."""
        return halo_windows(
            self.x, self.kernel, window_name=self._window_name, output_sizes=self.window_shares
        )

    def window_name(self, g: Sequence[int]) -> str:
        """Name of worker ``g``'s fused window."""
        return grid_block_name(self._window_name, g)

    def fields(self, g: Sequence[int]) -> tuple[_Field, ...]:
        """Every stage's input window on worker ``g`` (empty shapes without output)."""
        rows = self.geometry.worker_rows(g)[2:]
        channel_share = self.geometry.window_shape(g)[1]
        result = []
        for i, (s_, p_, e_) in enumerate(_composites(self._spatial, self.dims)):
            start, shape = [], []
            for d, row in enumerate(rows):
                o0, o1 = row.output_start, row.output_stop
                start.append(o0 * s_[d] - p_[d])
                shape.append((o1 - o0 - 1) * s_[d] + e_[d] if o1 > o0 else 0)
            real = np.ones(shape, dtype=bool)
            for d in range(self.dims):
                if i == 0 and self._spatial[0].boundary[d] != "zero":
                    continue  # the first stage's wrapping padding holds x's own entries
                coords = np.arange(start[d], start[d] + shape[d])
                inside = (coords >= 0) & (coords < self.lengths[i][d])
                real &= inside.reshape([-1 if a == d else 1 for a in range(self.dims)])
            channels = channel_share if self.x.partition.shape[1] > 1 else self.channels[i]
            result.append(_Field(tuple(start), tuple(shape), channels, real))
        return tuple(result)

    def output_block(self, g: Sequence[int]) -> Block:
        out = self.y.block(g)
        return Block(out.name, out.shape, out.worker)

    def _steps(self, selections: Mapping[str, list[np.ndarray | None]] | None) -> list[LocalStep]:
        steps = []
        for g in self.x.partition.indices():
            name = self.window_name(g)
            chosen = None if selections is None else selections.get(name)
            fields = self.fields(g)
            forward, adjoint = _chain_kernels(self, fields, self.output_block(g).shape, chosen, name)
            steps.append(
                LocalStep((name,), (self.output_block(g),), forward, adjoint, grid_block_name("chain", g))
            )
        return steps

    @property
    def operator(self) -> LinearOperator:
        r"""The fused tree x -> y, :math:`L_L M_L \cdots L_1 W` (every stage linear).

        Raises
        ------
        LayerError
            If a stage is a max pool (use :meth:`at`).
        """
        if any(s.kind == "max" for s in self.stages):
            raise LayerError(f"{_LAYER}: a max pool is not linear; take its Jacobian with at(windows)")
        moving = self.window_operator
        return local_stage(moving.range, self._steps(None)) @ moving

    def local_operator(self, windows: Space) -> LinearOperator:
        """The local stage alone, from the fused windows (the blocks of ``windows`` named as
        :meth:`window_name`; other blocks pass through) to y (linear stages only)."""
        if any(s.kind == "max" for s in self.stages):
            raise LayerError(f"{_LAYER}: a max pool is not linear; take its Jacobian with at(windows)")
        return local_stage(windows, self._steps(None))

    def _selections(self, windows: Mapping[str, Any]) -> dict[str, list[np.ndarray | None]]:
        found = {}
        for g in self.x.partition.indices():
            name = self.window_name(g)
            if name not in windows:
                continue
            window = require_shape(_LAYER, f"window {name!r}", windows[name], self.geometry.window_shape(g))
            found[name] = _trace(self, self.fields(g), np.asarray(window))[1]
        return found

    def at(self, windows: Mapping[str, Any]) -> LinearOperator:
        """The Jacobian of the chain at the input whose fused windows are ``windows``
        (``window_operator(x0)``, or the blocks of it this rank holds): every max pool a
        selection of the entries its window of x0's intermediate field holds largest.

        Raises
        ------
        LayerError
            If a window has the wrong shape, or a missing one is needed.
        """
        moving = self.window_operator
        return local_stage(moving.range, self._steps(self._selections(windows))) @ moving

    def forward(self, state: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """The chain's output (max pools included) from x's blocks ``state``: one exchange,
        then the stages on each fused window."""
        windows = self.window_operator(state)
        result = {}
        for g in self.x.partition.indices():
            block = self.output_block(g)
            window = np.asarray(windows[self.window_name(g)])
            if 0 in block.shape:
                result[block.name] = np.zeros(block.shape, dtype=window.dtype)
            else:
                result[block.name] = _trace(self, self.fields(g), window)[0]
        return result

    # -- cost of the fusion ---------------------------------------------------------------------
    def redundancy(self) -> tuple[tuple[int, int], ...]:
        """Per intermediate field (the outputs of stages 1 .. L-1): (entries the fused chain
        computes over all workers, entries of the global field). The difference is the
        redundant compute: the overlaps of neighbouring enlarged windows, and the entries
        beyond the global boundary that the mask then zeroes."""
        computed = [0] * (len(self.stages) - 1)
        for g in self.x.partition.indices():
            for i, f in enumerate(self.fields(g)[1:]):
                computed[i] += int(np.prod(f.shape)) * f.channels * self.x.global_shape[0]
        needed = [
            self.x.global_shape[0] * c * int(np.prod(n))
            for c, n in zip(self.channels[1:-1], self.lengths[1:-1])
        ]
        return tuple(zip(computed, needed))

    # -- the layer-by-layer reference -----------------------------------------------------------
    def layers(self) -> list[Convolution | AveragePool | MaxPoolJacobian]:
        """The layer-by-layer chain: one layer description per stage, each with its own halo
        exchange, the fields named ``name_1``, ``name_2``, ... and the last ``name``."""
        result: list[Convolution | AveragePool | MaxPoolJacobian] = []
        tensor = self.x
        for i, stage in enumerate(self.stages):
            out = self.name if i == len(self.stages) - 1 else f"{self.name}_{i + 1}"
            layer: Convolution | AveragePool | MaxPoolJacobian
            if stage.kind == "conv":
                assert stage.weights is not None
                layer = Convolution(tensor, stage.weights.shape[0], stage.kernel, bias=False, name=out)
            elif stage.kind == "avg":
                layer = AveragePool(tensor, stage.kernel, name=out)
            else:
                layer = MaxPoolJacobian(tensor, stage.kernel, name=out)
            result.append(layer)
            tensor = layer.y
        return result

    def layered_operator(self) -> LinearOperator:
        """The layer-by-layer tree x -> y (every stage linear): the layers' trees composed,
        one halo exchange each."""
        if any(s.kind == "max" for s in self.stages):
            raise LayerError(f"{_LAYER}: a max pool is not linear; take its Jacobian with layered_at(state)")
        return self.layered_at({})

    def layered_at(self, state: Mapping[str, Any]) -> LinearOperator:
        """The layer-by-layer Jacobian at x0 (x's blocks ``state``; needed where a stage is a
        max pool, whose selection is taken on its own windows of x0's intermediate field)."""
        factors: list[LinearOperator] = []
        current = dict(state)
        for stage, layer in zip(self.stages, self.layers()):
            if isinstance(layer, Convolution):
                assert stage.weights is not None
                op = layer.input_operator(stage.weights)
            elif isinstance(layer, AveragePool):
                op = layer.operator
            else:
                op = layer.at(layer.window_operator(current))
            factors.append(op)
            if current:
                current = op(current)
        return factors[0] if len(factors) == 1 else Composition(tuple(reversed(factors)))


def _identity_leading(k: Kernel) -> tuple[Any, ...]:
    """The fused kernel's parameters with identity batch and channel axes in front."""
    return (
        (1, 1, *k.size),  # type: ignore[misc]
        (1, 1, *k.stride),  # type: ignore[misc]
        (0, 0, *k.padding),  # type: ignore[misc]
        (1, 1, *k.dilation),  # type: ignore[misc]
        ("zero", "zero", *k.boundary),
    )


def _parts(k: Kernel) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    return tuple(k.size), tuple(k.stride), tuple(k.dilation)  # type: ignore[arg-type]


def _masked(v: np.ndarray, real: np.ndarray) -> np.ndarray:
    """``v`` with the entries outside the global field (``real`` False, trailing axes) zero."""
    if real.all():
        return v
    return np.where(real, v, np.zeros((), dtype=v.dtype))


def _trace(
    chain: WindowChain, fields: Sequence[_Field], window: np.ndarray
) -> tuple[np.ndarray, list[np.ndarray | None]]:
    """The chain applied to one worker's fused window (max pools by value), and the selection
    of every max pool (None for the other stages)."""
    v, selections = window, []
    for i, (stage, k, f) in enumerate(zip(chain.stages, chain._spatial, fields)):
        if i > 0:
            v = _masked(v, f.real)
        size, stride, dilation = _parts(k)
        if stage.kind == "conv":
            assert stage.weights is not None
            v, chosen = kernels.correlate(v, stage.weights, stride, dilation), None
        elif stage.kind == "avg":
            v, chosen = kernels.average_pool(v, size, stride, dilation), None
        else:
            chosen = kernels.max_selection(v, size, stride, dilation, f.real)
            v = kernels.select(v, chosen, v.shape)
        selections.append(chosen)
    return v, selections


def _chain_kernels(
    chain: WindowChain,
    fields: Sequence[_Field],
    out_shape: tuple[int, ...],
    selections: list[np.ndarray | None] | None,
    name: str,
):
    """The linear local kernel of one worker and its adjoint (any leading probe axes)."""
    batch = chain.x.global_shape[0]
    window_shape = (batch, fields[0].channels, *fields[0].shape)
    empty = 0 in out_shape

    def chosen(i: int) -> np.ndarray:
        picked = None if selections is None else selections[i]
        if picked is None:
            raise LayerError(f"{_LAYER}: the window {name!r} of x0 was not given to at()")
        return picked

    def stage(i: int) -> tuple[Callable[[np.ndarray], np.ndarray], Callable[[np.ndarray], np.ndarray]]:
        """Stage i's map on its input field and that map's adjoint."""
        kind, weights, f = chain.stages[i].kind, chain.stages[i].weights, fields[i]
        size, stride, dilation = _parts(chain._spatial[i])
        if kind == "conv":
            assert weights is not None
            return (
                lambda v: kernels.correlate(v, weights, stride, dilation),
                lambda u: kernels.correlate_adjoint(u, weights, f.shape, stride, dilation),
            )
        if kind == "avg":
            return (
                lambda v: kernels.average_pool(v, size, stride, dilation),
                lambda u: kernels.average_pool_adjoint(u, f.shape, size, stride, dilation),
            )
        shape = (batch, f.channels, *f.shape)
        return (
            lambda v: kernels.select(v, chosen(i), shape),
            lambda u: kernels.select_adjoint(u, chosen(i), shape),
        )

    def forward(x: np.ndarray) -> np.ndarray:
        lead = x.shape[: x.ndim - len(window_shape)]
        if empty:
            return np.zeros((*lead, *out_shape), dtype=x.dtype)
        v = x
        for i, f in enumerate(fields[: len(chain.stages)]):
            if i > 0:
                v = _masked(v, f.real)
            v = stage(i)[0](v)
        return v

    def adjoint(y: np.ndarray) -> np.ndarray:
        lead = y.shape[: y.ndim - len(out_shape)]
        if empty:
            return np.zeros((*lead, *window_shape), dtype=y.dtype)
        u = y
        for i in reversed(range(len(chain.stages))):
            u = stage(i)[1](u)
            if i > 0:
                u = _masked(u, fields[i].real)
        return u

    return forward, adjoint
