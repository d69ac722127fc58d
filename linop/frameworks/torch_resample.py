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
That holds, per spatial axis, when the mode is a nearest mode or a linear mode without
``align_corners``, and the scale torch uses is :math:`2^{-k}` exactly (a scale factor
:math:`2^k`, or an output length :math:`2^k` times the input's): then the source coordinates
(``o * 2^-k``, ``(o + 1/2) 2^-k`` and ``2^-k (o + 1/2) - 1/2``) are exact in float32 and
float64 (for fewer than :math:`2^{22}` outputs per axis, which the construction requires), so
output :math:`o = o' + c` of the global field, :math:`o' = 2^k a` with :math:`a` the window's
start, reads input :math:`a + i` with the weights with which the window's output :math:`c`
reads its entry :math:`i`. The construction checks this against the layer's own maps (the
window's map, shifted, equals the global map on the worker's outputs) and that the crop lies
within the window's outputs; a worker that fails either, or data of another dtype, takes the
general path. (With ``align_corners`` the coordinate is a product by
:math:`(m - 1)/(n - 1)`, rounded differently on the window: no fast path.)

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
from .torch_function import TorchOperator, engine_arguments, process_rank

__all__ = ["Interpolate", "Upsample"]

_NUMPY_DTYPES = {torch.float32: "float32", torch.float64: "float64"}


class Interpolate(torch.nn.Module):
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
    comm : mpi4py communicator, optional
        Run across its ranks.
    group : torch.distributed ProcessGroup or True, optional
        Run across the ranks of this process group (``True``: the world group).

    Attributes
    ----------
    layer : linop.layers.Interpolate
        The description (its ``operator`` is the tree run here).
    x, y : DistributedTensor
    input_names, output_names : tuple of str
        The blocks this process passes in and gets back.
    token : torch.Tensor
        An empty output of the last call, for a process that owns no block of y (it adds
        ``module.token.sum()`` to its loss so that its collective backward runs).

    Raises
    ------
    LayerError
        As :class:`linop.layers.Interpolate`.
    ProcessGroupArgumentError
        ``comm`` and ``group`` both given.
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
    ) -> None:
        super().__init__()
        engine_arguments(comm, group)
        self.layer = InterpolateLayer(
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
        self.dtype = dtype
        self.x, self.y = self.layer.x, self.layer.y
        self.windows = TorchOperator(self.layer.window_operator, comm=comm, group=group)
        self.input_names = self.windows.inputs
        rank = process_rank(comm, group)
        self._products: list[tuple[str, str, tuple[_Axis, ...], tuple[int, ...], _FastPath | None]] = [
            (
                self.y.block_name(g),
                self.layer.window_name(g),
                tuple(_Axis.of(part) for part in self.layer.parts(g)),
                self.y.block(g).shape,
                _window_fast_path(self.layer, g),
            )
            for g in self.x.partition.indices()
            if rank is None or self.y.block(g).worker == rank
        ]
        self.output_names = tuple(name for name, *_ in self._products)

    @property
    def token(self) -> torch.Tensor:
        """The empty output of the last call (see the class)."""
        return self.windows.token

    def forward(self, x: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.layer.mode.startswith("nearest") and isinstance(x, Mapping):
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
        windows = self.windows(x)
        result = {}
        for out, window_name, parts, shape, fast in self._products:
            window = windows[window_name]
            if 0 in shape:  # no output here: an empty block, still tied to the windows' graph
                result[out] = window.reshape(-1)[:0].reshape(shape)
                continue
            if fast is not None and window.dtype == self.dtype:
                result[out] = self._interpolate_window(window, fast)
            else:
                result[out] = _interpolate(window, parts)
        return result

    def _interpolate_window(self, window: torch.Tensor, fast: _FastPath) -> torch.Tensor:
        """torch's interpolation of the whole window, cropped to the worker's outputs."""
        linear = self.layer.mode not in ("nearest", "nearest-exact")
        full = torch.nn.functional.interpolate(
            window,
            scale_factor=fast.scale_factors,
            mode=self.layer.mode,
            align_corners=False if linear else None,
            recompute_scale_factor=False,
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
    """A worker's local step as torch's interpolation of its window with ``scale_factors``
    (powers of two), cropped to ``lengths`` outputs from ``offsets`` per spatial axis."""

    scale_factors: tuple[float, ...]
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]


def _power_of_two(ratio: Fraction) -> int | None:
    """k where ``ratio`` is exactly 2**k with k >= 0, else None."""
    if ratio.denominator != 1 or ratio.numerator < 1:
        return None
    k = ratio.numerator.bit_length() - 1
    return k if ratio.numerator == 1 << k else None


def _window_fast_path(layer: InterpolateLayer, g: Sequence[int]) -> _FastPath | None:
    """The fast path of worker ``g`` (see the module), or None where it is not provably torch's
    arithmetic on the global field: ``align_corners``, a scale that is not 2**-k, a crop outside
    the window's outputs, or a window map that differs from the global one."""
    if layer.align_corners and layer.mode not in ("nearest", "nearest-exact"):
        return None
    factors, offsets, lengths = [], [], []
    for d, (axis, given) in enumerate(zip(layer.maps, layer.scales)):
        row = layer.geometry.row(g, d + 2)
        m, n = axis.input_length, axis.output_length
        ratio = Fraction(given) if given is not None else Fraction(n, m)
        k = _power_of_two(ratio)
        if k is None or n != m << k or n >= 1 << 22:
            return None
        start, stop, a, w = row.output_start, row.output_stop, row.need_start, row.window_size
        offset, count = start - (a << k), stop - start
        if offset < 0 or offset + count > w << k or w < 1:
            return None
        local = resample_maps.axis_map(layer.mode, w, w << k, float(1 << k), False, layer.dtype)
        window_outputs = slice(offset, offset + count)
        if (
            tuple(i + a for i in local.first[window_outputs]) != axis.first[start:stop]
            or tuple(i + a for i in local.second[window_outputs]) != axis.second[start:stop]
            or local.weights[window_outputs] != axis.weights[start:stop]
        ):
            return None
        factors.append(float(1 << k))
        offsets.append(offset)
        lengths.append(count)
    return _FastPath(tuple(factors), tuple(offsets), tuple(lengths))


class Upsample(Interpolate):
    """``torch.nn.Upsample`` of a distributed tensor: :class:`Interpolate` under torch's module
    name (the same parameters)."""
