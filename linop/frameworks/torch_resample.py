r"""Distributed interpolation as PyTorch modules: :class:`Interpolate` and :class:`Upsample`.

The layer is linear, one operator tree :math:`y = L W x` (:class:`linop.layers.Interpolate`:
the windows of the inputs each worker's outputs read, then the local interpolation), whose
adjoint ``verify`` proves. The module runs the same algorithm with the local step in torch:

.. math::

    \tilde x = W x, \qquad y_j = L_j \tilde x_j, \qquad
    \bar x = W^{*} \big(L_j^{T} \bar y_j\big)_j

The windows :math:`W x` are the layer's ``window_operator`` as a differentiable
:class:`~linop.frameworks.torch_function.TorchOperator` (its backward the adjoint halo exchange,
adding each window entry's gradient back into its owner); :math:`L_j` is the layer's per-axis
weights (:meth:`linop.layers.Interpolate.parts`) applied with ``index_select`` and products,
whose autograd is the transpose. The local step thus runs on the tensors' device and in their
dtype.

Fast path. Where torch's own interpolation of the worker's window is provably the same
arithmetic as torch's interpolation of the global field, the local step is
``torch.nn.functional.interpolate`` of the window followed by a crop (``_window_fast_path``).
Torch reads output o of an axis at :math:`\rho(o + 1/2) - 1/2` (clamped at 0; nearest:
:math:`\rho o`, nearest-exact :math:`\rho(o + 1/2)`, floored), or :math:`\rho o` with
``align_corners``, with :math:`\rho` 1 / the scale factor given, else m / n, or
(m - 1)/(n - 1) with ``align_corners``. The window, inputs a .. a + w - 1, interpolated with
the same :math:`\rho` (the same scale factor, or a size L with w / L or (w - 1)/(L - 1) equal
to it) reads at those coordinates minus a for its output :math:`c = o - a / \rho`, when
:math:`a / \rho` is an integer; so, per axis, the fast path needs (``_axis_fast_path``):
that shift an integer, the crop within the window's outputs, the window's map shifted equal
to the global map on the worker's outputs (the ends' clamps), and torch computing both maps
as the layer does. The nearest modes' maps follow torch's rounding in the data's dtype, so
equal maps are the same selection at any scale (x3, x1.5, ...). The linear modes' maps are
exact rationals, so there :math:`\rho` must be dyadic with few enough bits (``_exact_scale``)
that torch's coordinates and weights are exact in float32 and float64: scales 2^k and
2^-k, sizes m 2^k, and ``align_corners`` where n - 1 = 2^k (m - 1) (17 outputs from 9). Not
``align_corners`` at scale 2 (m - 1)/(2m - 1), nor linear scales 3 or 1.5: torch's global
coordinates are rounded, differently in a window, and those workers keep the general path
(exact weights, to torch's tolerances). A worker that fails any axis, or data of another
dtype, takes the general path; the others keep the fast one.

In one process the numpy interpreter moves the windows; across MPI ranks (``comm=``) or a
torch.distributed process group (``group=``) each process passes its own blocks of x and gets
its own blocks of y. The tests check the module against the whole tree's adjoint and against
``torch.nn.functional.interpolate``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from types import EllipsisType
from typing import Any

import torch

from ..errors import StateError
from ..layers import Interpolate as InterpolateLayer
from ..layers import resample_maps
from ..layers.resample_maps import AxisWeights
from ..partition import DistributedTensor
from .torch_windows import WindowModule

__all__ = ["Interpolate", "Upsample"]

_NUMPY_DTYPES = {torch.float32: "float32", torch.float64: "float64"}


class Interpolate(WindowModule):
    r"""``torch.nn.functional.interpolate`` of a distributed tensor, as a module: ``module(x)``
    takes this process's blocks of x (a dict of tensors) and returns its blocks of y.

    Parameters
    ----------
    x : DistributedTensor
        The input's layout (N, C, S_0, ...), any partition.
    size, scale_factor, mode, align_corners, recompute_scale_factor
        As ``torch.nn.functional.interpolate`` (modes nearest, nearest-exact, linear,
        bilinear, trilinear).
    name : str
        The output tensor's name (default ``"y"``).
    output_sizes : sequence, optional
        The output's shares per spatial dimension (None entries balanced).
    dtype : torch.dtype
        float64 (default) or float32: the data's dtype, whose rounding torch's nearest modes
        follow; a module of a nearest mode refuses data of the other floating dtype.
    comm, group, mapping
        As :class:`~linop.frameworks.torch_windows.BlockModule` (so are ``input_names``,
        ``output_names`` and ``token``): ``mapping`` places the workers of x's partition on
        the ranks, this process interpolating the output blocks of the workers on its rank.

    Attributes
    ----------
    layer : linop.layers.Interpolate
        The description (its ``operator`` is the tree run here).
    x, y : DistributedTensor

    Raises
    ------
    LayerError
        As :class:`linop.layers.Interpolate`.
    ProcessGroupArgumentError
        ``comm`` and ``group`` both given.
    WorkerMapError, WorkerMapMismatchError
        A bad ``mapping``, as :class:`~linop.frameworks.torch_windows.BlockModule`.
    """

    def __init__(
        self,
        x: DistributedTensor,
        size: int | Sequence[int] | None = None,
        scale_factor: float | Sequence[float] | None = None,
        mode: str = "nearest",
        align_corners: bool | None = None,
        recompute_scale_factor: bool | None = None,
        *,
        name: str = "y",
        output_sizes: Sequence[Sequence[int] | None] | None = None,
        dtype: torch.dtype = torch.float64,
        comm: Any = None,
        group: Any = None,
        mapping: Any = None,
    ) -> None:
        layer = InterpolateLayer(
            x,
            size=size,
            scale_factor=scale_factor,
            mode=mode,
            align_corners=align_corners,
            recompute_scale_factor=recompute_scale_factor,
            name=name,
            output_sizes=output_sizes,
            dtype=_NUMPY_DTYPES.get(dtype, dtype),
        )
        super().__init__(layer.window_operator, comm=comm, group=group, mapping=mapping)
        self.layer = layer
        self.dtype = dtype
        self.x, self.y = self.layer.x, self.layer.y
        self._products = [
            (
                self.y.block_name(g),
                self.layer.window_name(g),
                self.y.block(g).shape,
                tuple(_Axis.of(part) for part in self.layer.parts(g)),
                _window_fast_path(self.layer, g),
            )
            for g in self.placement.held(self.y.partition)  # this process's blocks alone
        ]
        self.output_names = tuple(name for name, *_ in self._products)

    def check(self, x: Mapping[str, torch.Tensor]) -> None:
        """Refuse what is no dict of blocks, and in a nearest mode data of the other floating
        dtype than the module's (torch's nearest entries depend on its rounding).

        Raises
        ------
        StateError
            Either.
        """
        super().check(x)
        if self.layer.mode.startswith("nearest"):
            for name, tensor in x.items():
                if (
                    tensor.is_floating_point()
                    and tensor.dtype in _NUMPY_DTYPES
                    and tensor.dtype != self.dtype
                ):
                    raise StateError(
                        f"Interpolate ({self.layer.mode}): block {name!r} is {tensor.dtype}, the module was built "
                        f"for {self.dtype} (torch's nearest entries depend on the dtype's rounding)"
                    )

    def local(self, window: torch.Tensor, parts: tuple[_Axis, ...], fast: _FastPath | None) -> torch.Tensor:
        """torch's interpolation of the window and a crop (the fast path), else the per-axis
        gathers and weights."""
        if fast is not None and window.dtype == self.dtype:
            return self._interpolate_window(window, fast)
        return _interpolate(window, parts)

    def _interpolate_window(self, window: torch.Tensor, fast: _FastPath) -> torch.Tensor:
        """torch's interpolation of the whole window, cropped to the worker's outputs."""
        linear = self.layer.mode not in ("nearest", "nearest-exact")
        align = bool(self.layer.align_corners) if linear else None
        if fast.scale_factors is not None:
            full = torch.nn.functional.interpolate(
                window,
                scale_factor=fast.scale_factors,
                mode=self.layer.mode,
                align_corners=align,
                recompute_scale_factor=False,
            )
        else:
            full = torch.nn.functional.interpolate(
                window, size=fast.sizes, mode=self.layer.mode, align_corners=align
            )
        slices = tuple(slice(c, c + n) for c, n in zip(fast.offsets, fast.lengths))
        crop: tuple[EllipsisType | slice, ...] = (Ellipsis, *slices)
        return full[crop]

    def extra_repr(self) -> str:
        layer = self.layer
        corners = (
            f", align_corners={layer.align_corners}" if layer.mode not in ("nearest", "nearest-exact") else ""
        )
        return f"{layer.mode}{corners}: {layer.x} -> {layer.y}"


@dataclass(frozen=True)
class _Axis:
    """One axis of a worker's local interpolation as tensors: the entries each output reads and
    their weights (``second`` None: one entry with weight 1)."""

    first: torch.Tensor
    second: torch.Tensor | None
    low: torch.Tensor
    high: torch.Tensor

    @classmethod
    def of(cls, part: AxisWeights) -> _Axis:
        single = part.single and bool((part.weight_first == 1).all())
        return cls(
            torch.tensor(part.first),
            None if single else torch.tensor(part.second),
            torch.tensor(part.weight_first, dtype=torch.float64),
            torch.tensor(part.weight_second, dtype=torch.float64),
        )


def _interpolate(window: torch.Tensor, axes: Sequence[_Axis]) -> torch.Tensor:
    """The window interpolated along its last ``len(axes)`` axes: per axis, the entries
    ``first`` times their weights plus the entries ``second`` times theirs (a gather alone
    where each output reads one entry with weight 1)."""
    dims = len(axes)
    real = window.real.dtype if window.is_complex() else window.dtype
    y = window
    for d, axis in enumerate(axes):
        dim = y.ndim - dims + d
        gathered = y.index_select(dim, axis.first.to(y.device))
        if axis.second is None:
            y = gathered
            continue
        shape = [1] * y.ndim
        shape[dim] = -1
        low = axis.low.to(device=y.device, dtype=real).reshape(shape)
        high = axis.high.to(device=y.device, dtype=real).reshape(shape)
        y = gathered * low + y.index_select(dim, axis.second.to(y.device)) * high
    return y


@dataclass(frozen=True)
class _FastPath:
    """A worker's local step as torch's interpolation of its window to ``sizes`` outputs (or
    with ``scale_factors``, the layer's own, when torch was given them), cropped to
    ``lengths`` outputs from ``offsets`` per spatial axis."""

    sizes: tuple[int, ...] | None
    scale_factors: tuple[float, ...] | None
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]


EXACT_BITS = 24
"""Significant bits a source coordinate may need for torch to compute it exactly in float32
(and so in float64): a dyadic scale p / 2^q times 2o + 1 (or o) below 2^24."""


def _exact_scale(scale: Fraction, outputs: int, align_corners: bool) -> bool:
    """Whether torch's linear source coordinates with this scale are exact for every output
    below ``outputs``: the scale dyadic (so torch's float scale is this number) and
    ``scale * (2o + 1)`` (``scale * o`` with ``align_corners``) within :data:`EXACT_BITS` bits."""
    q = scale.denominator
    if q & (q - 1):
        return False
    reach = outputs if align_corners else 2 * outputs + 1
    return scale.numerator * reach < 1 << EXACT_BITS


def _axis_fast_path(layer: InterpolateLayer, g: Sequence[int], d: int) -> tuple[int, int, int] | None:
    r"""Along spatial axis ``d``: the window's output length L in torch's local call, the
    offset of worker ``g``'s first output in it and its number of outputs; None where the
    local call is not torch's arithmetic on the global field.

    Torch reads output o at the source coordinate :math:`s(o) = \rho (o + 1/2) - 1/2`
    (clamped at 0), or :math:`\rho o` with ``align_corners``, where :math:`\rho` is 1 / the
    given scale factor, else m / n, or (m - 1)/(n - 1) with ``align_corners``. The window
    (inputs a .. a + w - 1) called with the same :math:`\rho` (the scale factor itself, or the
    size L with w / L or (w - 1)/(L - 1) equal to it) has :math:`s_w(c) = s(c + o_0) - a` for
    :math:`o_0 = a / \rho`, when that is an integer. In exact arithmetic, then, its output c
    is the global output :math:`c + o_0` except where a clamp differs (the global field's ends
    against the window's): the layer's maps, compared on the worker's outputs, decide that.
    torch computes in floating point: the nearest modes' maps follow its rounding in the data's
    dtype (:mod:`linop.layers.resample_maps`), so equal maps mean the same selection; the linear
    modes' maps are exact, so :math:`\rho` must be dyadic with few enough bits that torch's
    coordinates and weights are exact too (:func:`_exact_scale`), globally and in the window.
    """
    axis, given = layer.maps[d], layer.scales[d]
    row = layer.geometry.row(g, d + 2)
    m, n = axis.input_length, axis.output_length
    start, stop, a, w = row.output_start, row.output_stop, row.need_start, row.window_size
    linear = layer.mode in resample_maps.LINEAR_MODES
    align = bool(layer.align_corners) and linear
    if w < 1 or (align and (n < 2 or w < 2)):
        return None
    if align:
        rho = Fraction(m - 1, n - 1)
        length = resample_maps.scaled_length(w, given) if given is not None else 1 + (w - 1) / rho
        local = Fraction(w - 1, int(length) - 1) if length == int(length) and length > 1 else None
    else:
        rho = 1 / Fraction(given) if given is not None else Fraction(m, n)
        length = resample_maps.scaled_length(w, given) if given is not None else w / rho
        local = rho if given is not None else None
        if given is None and length == int(length) and length > 0:
            local = Fraction(w, int(length))
    shift = a / rho
    if local != rho or shift.denominator != 1 or length != int(length):
        return None
    if linear and not _exact_scale(rho, max(n, int(length)), align):
        return None
    length, offset, count = int(length), start - int(shift), stop - start
    if offset < 0 or offset + count > length:
        return None
    window = resample_maps.axis_map(layer.mode, w, length, given, align, layer.dtype)
    outputs = slice(offset, offset + count)
    if (
        tuple(i + a for i in window.first[outputs]) != axis.first[start:stop]
        or tuple(i + a for i in window.second[outputs]) != axis.second[start:stop]
        or window.weights[outputs] != axis.weights[start:stop]
    ):
        return None
    return length, offset, count


def _window_fast_path(layer: InterpolateLayer, g: Sequence[int]) -> _FastPath | None:
    """The fast path of worker ``g`` (see the module and :func:`_axis_fast_path`), or None
    where some axis is not provably torch's arithmetic on the global field."""
    axes = [_axis_fast_path(layer, g, d) for d in range(len(layer.maps))]
    if any(axis is None for axis in axes):
        return None
    sizes, offsets, lengths = zip(*(axis for axis in axes if axis is not None))
    given = layer.scales
    if all(s is not None for s in given):
        return _FastPath(None, tuple(float(s) for s in given if s is not None), offsets, lengths)
    return _FastPath(tuple(sizes), None, offsets, lengths)


class Upsample(Interpolate):
    """``torch.nn.Upsample`` of a distributed tensor: :class:`Interpolate` under torch's module
    name (the same parameters)."""
