r"""Distributed interpolation (up- and down-sampling) as an operator tree, output-driven.

Interpolation is linear (:mod:`linop.layers.resample_maps`): per spatial dimension a matrix
:math:`W_d` with at most two entries per row, the operator their tensor product. On a
partition P (any extents, batch and channels included) each worker owns a share of the
*output* (balanced unless given); the input entries its outputs read form one range per
dimension, ``need = [min first, max second + 1)`` over its outputs, which in general is not
the worker's bulk: the halos are uneven (wider on one side, absent on the other, or spanning
entries the worker does not read, which the window trims). The layer is

.. math::

    y = L\, W x, \qquad x^{*} = W^{*} L^{*} y

with :math:`W` = pad shim, halo exchange and trim shim of a
:class:`~linop.halo_geometry.HaloGeometry` whose rows are these need ranges (the exchange
reads only the rows, so the sliding-window machinery moves interpolation's windows, corners
and multi-hop halos included), and :math:`L` one :class:`~linop.local.LocalOperator` per worker
applying :math:`W_d` restricted to its outputs and window, dimension by dimension
(:func:`~linop.layers.resample_maps.apply_axis`), its adjoint the transposes.

The rows are listed (one per worker and dimension), not described by a rule as a
sliding-window kernel's are, so every rank holds all of them and finds the workers that read
its entries by scanning its dimension's rows: planning costs O(workers along a dimension) per
rank, where a convolution's costs O(1).

:meth:`Interpolate.integer_operator` is the same tree with every dimension's weights scaled by
their common denominator (integers), so that ``verify`` proves it exactly; :attr:`operator`
rounds the same rational weights once to floating point.
"""

from __future__ import annotations

import itertools
import operator as _operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import LinopError
from ..halo import HaloExchange, pad_shim, trim_shim
from ..halo_geometry import DimGeometry, HaloGeometry, Kernel
from ..operator import Composition, LinearOperator
from ..partition import DistributedTensor, balanced_sizes, grid_block_name
from . import resample_maps
from .base import LayerError, require_tensor, window_stage
from .resample_maps import AxisMap, AxisWeights

__all__ = ["Interpolate", "need_row"]

EXACT_LIMIT = 1 << 31
"""The largest common denominator :meth:`Interpolate.integer_operator` scales to (products of
integer weights and small integer data stay exact in int64 and float64)."""


def need_row(
    dim: int, index: int, length: int, output: tuple[int, int], bulk: tuple[int, int], need: tuple[int, int]
) -> DimGeometry:
    """A halo geometry row for an explicit needed range ``need`` inside ``[0, length)`` (no
    padding): the widths of ``docs/theory.md#halo-geometry`` for a worker owning the inputs
    ``bulk`` and the outputs ``output`` (an empty output needs nothing: ``need = [i0, i0)``)."""
    (o0, o1), i0 = output, bulk[0]
    n0, n1 = need if o1 > o0 else (i0, i0)
    if o1 > o0 and not 0 <= n0 < n1 <= length:
        raise LayerError(f"dimension {dim}: worker {index} needs [{n0}, {n1}), outside [0, {length})")
    return DimGeometry.of_need(dim, index, length, output, bulk, (n0, n1))


def _per_dimension(value: Any, dims: int, what: str) -> tuple[Any, ...]:
    if isinstance(value, (str, bytes)):
        raise LayerError(f"Interpolate: {what} must be a number or a sequence of numbers, not {value!r}")
    if isinstance(value, Sequence) or isinstance(value, np.ndarray):
        values = tuple(value)
        if len(values) != dims:
            raise LayerError(
                f"Interpolate: {what} {values} has {len(values)} entries for {dims} spatial dimensions"
            )
        return values
    return (value,) * dims


def _offsets(sizes: Sequence[int]) -> tuple[int, ...]:
    return tuple(itertools.accumulate(sizes, initial=0))


class Interpolate:
    r"""Distributed ``torch.nn.functional.interpolate`` (nearest, nearest-exact, linear,
    bilinear, trilinear) of x (N, C, S_0, ...) on any partition, as one linear tree
    :math:`y = L W x`.

    Parameters
    ----------
    x : DistributedTensor
        Input (N, C, S_0, ...), 1 or more spatial dimensions (the linear modes: as many as
        torch takes them for, 1, 2 or 3), any partition and shares (batch and channels
        included: they keep x's shares, no halo along them).
    size : int or sequence of int, optional
        Output spatial shape (one of ``size`` and ``scale_factor``).
    scale_factor : float or sequence of float, optional
        Multiplier of each spatial length: the output length is ``floor(length *
        scale_factor)``, and the source coordinates use ``1 / scale_factor`` (torch's rule)
        unless ``recompute_scale_factor``.
    mode : str
        ``"nearest"`` (default), ``"nearest-exact"``, ``"linear"``, ``"bilinear"``,
        ``"trilinear"``.
    align_corners : bool, optional
        For the linear modes (default False), as in torch.
    recompute_scale_factor : bool, optional
        As in torch: with a scale factor, compute the source coordinates from the output
        length instead.
    name : str
        The output tensor's name (default ``"y"``).
    output_sizes : sequence, optional
        One entry per spatial dimension: None (balanced) or the output's shares over that
        dimension's workers (empty shares allowed).
    dtype : numpy dtype
        float64 (default) or float32: the data's dtype, whose rounding torch's nearest modes
        follow when they pick an entry (:mod:`linop.layers.resample_maps`); the linear modes
        do not depend on it.

    Attributes
    ----------
    x, y : DistributedTensor
        Input and output (y on x's partition).
    maps : tuple of AxisMap
        The map of each spatial dimension.
    scales : tuple of float or None
        The scale factor each dimension's source coordinates use (None: from the lengths,
        when ``size`` is given or ``recompute_scale_factor``).
    geometry : HaloGeometry
        Each worker's window (rows built from the maps' need ranges).

    Raises
    ------
    LayerError
        Both or neither of ``size`` and ``scale_factor``, an unknown mode, a linear mode for
        the wrong number of dimensions, ``align_corners`` with a nearest mode, an output
        length below 1, a dtype other than float32 and float64, or a name taken by x's blocks.
    """

    layer = "Interpolate"

    def __init__(
        self,
        x: DistributedTensor,
        *,
        size: int | Sequence[int] | None = None,
        scale_factor: float | Sequence[float] | None = None,
        mode: str = "nearest",
        align_corners: bool | None = None,
        recompute_scale_factor: bool | None = None,
        name: str = "y",
        output_sizes: Sequence[Sequence[int] | None] | None = None,
        dtype: Any = np.float64,
    ) -> None:
        layer = self.layer
        self.x = require_tensor(layer, "x", x)
        dims = x.ndim - 2
        if dims < 1:
            raise LayerError(f"{layer}: x {x.global_shape} needs (batch, channel, spatial...) dimensions")
        if mode not in resample_maps.MODES:
            raise LayerError(f"{layer}: mode {mode!r} is not one of {resample_maps.MODES}")
        linear = mode in resample_maps.LINEAR_MODES
        if linear and resample_maps.LINEAR_MODES[mode] != dims:
            raise LayerError(
                f"{layer}: mode {mode!r} interpolates {resample_maps.LINEAR_MODES[mode]} spatial dimension(s); "
                f"x {x.global_shape} has {dims}"
            )
        if align_corners is not None and not linear:
            raise LayerError(f"{layer}: align_corners is for the linear modes, not {mode!r}")
        if (size is None) == (scale_factor is None):
            raise LayerError(
                f"{layer}: give one of size and scale_factor (size={size!r}, scale_factor={scale_factor!r})"
            )
        if recompute_scale_factor and size is not None:
            raise LayerError(f"{layer}: recompute_scale_factor is for a scale_factor, not a size")
        spatial = x.global_shape[2:]
        scales: tuple[float | None, ...]
        if size is not None:
            lengths = []
            for entry in _per_dimension(size, dims, "size"):
                try:
                    lengths.append(_operator.index(entry))
                except TypeError:
                    raise LayerError(f"{layer}: size {size!r} must hold integers") from None
            scales = (None,) * dims
        else:
            factors = tuple(float(f) for f in _per_dimension(scale_factor, dims, "scale_factor"))
            if any(not f > 0 for f in factors):
                raise LayerError(f"{layer}: scale_factor {scale_factor!r} must be positive")
            lengths = [resample_maps.scaled_length(m, f) for m, f in zip(spatial, factors)]
            scales = (None,) * dims if recompute_scale_factor else factors
        for d, n in enumerate(lengths):
            if n < 1:
                raise LayerError(
                    f"{layer}: spatial dimension {d} of length {spatial[d]} gives {n} outputs; at least 1 is needed"
                )
        try:
            self.dtype = np.dtype(dtype)
        except TypeError:
            raise LayerError(f"{layer}: dtype {dtype!r} is not a numpy dtype") from None
        if self.dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
            raise LayerError(f"{layer}: dtype {self.dtype} must be float32 or float64")
        self.mode, self.dims, self.scales = mode, dims, scales
        self.align_corners = bool(align_corners)
        self.maps: tuple[AxisMap, ...] = tuple(
            resample_maps.axis_map(mode, m, n, s, self.align_corners, self.dtype)
            for m, n, s in zip(spatial, lengths, scales)
        )
        self._window_name, self._local_name = f"{x.name}_window", f"{x.name}_local"
        if name in (x.name, self._window_name, self._local_name):
            raise LayerError(f"{layer}: the output name {name!r} is taken by x's blocks")
        given = (None,) * dims if output_sizes is None else tuple(output_sizes)
        if len(given) != dims:
            raise LayerError(
                f"{layer}: output_sizes {output_sizes!r} needs one entry per spatial dimension ({dims})"
            )
        try:
            sizes = (
                x.sizes[0],
                x.sizes[1],
                *(
                    balanced_sizes(n, p) if entry is None else tuple(entry)
                    for n, p, entry in zip(lengths, x.partition.shape[2:], given)
                ),
            )
            self.y = DistributedTensor(name, (*x.global_shape[:2], *lengths), x.partition, sizes=sizes)
        except (LinopError, TypeError) as error:  # the decomposition's checks, as the layer's
            raise LayerError(f"{layer}: output_sizes {output_sizes!r}: {error}") from None
        self.geometry = HaloGeometry(x, Kernel(1).resolve(x.ndim), self.y.global_shape, self._rows())
        self._trees: dict[Any, LinearOperator] = {}

    def _rows(self) -> tuple[tuple[DimGeometry, ...], ...]:
        x, y = self.x, self.y
        rows = []
        for d in range(x.ndim):
            inputs, outputs = _offsets(x.sizes[d]), _offsets(y.sizes[d])
            row = []
            for g in range(x.partition.shape[d]):
                bulk, output = (inputs[g], inputs[g + 1]), (outputs[g], outputs[g + 1])
                need = bulk if d < 2 or output[1] == output[0] else self.maps[d - 2].need(*output)
                row.append(need_row(d, g, x.global_shape[d], output, bulk, need))
            rows.append(tuple(row))
        return tuple(rows)

    # -- trees ----------------------------------------------------------------------------------
    @property
    def window_operator(self) -> LinearOperator:
        r"""The data movement x -> each worker's window of the inputs its outputs read,
        :math:`W = T H E` (exact 0/1)."""
        geometry = self.geometry
        return Composition(
            (
                trim_shim(geometry, local_name=self._local_name, window_name=self._window_name),
                HaloExchange(geometry, "nested", self._local_name),
                pad_shim(geometry, local_name=self._local_name),
            )
        )

    def window_name(self, g: Sequence[int]) -> str:
        """The name of worker ``g``'s window."""
        return grid_block_name(self._window_name, g)

    def parts(self, g: Sequence[int], scales: Sequence[int] | None = None) -> tuple[AxisWeights, ...]:
        """Worker ``g``'s weights per spatial dimension, in its window's coordinates (floats,
        or integers scaled by ``scales``)."""
        parts = []
        for d, axis in enumerate(self.maps):
            row = self.geometry.row(g, d + 2)
            parts.append(
                resample_maps.axis_weights(
                    axis,
                    row.output_start,
                    row.output_stop,
                    row.need_start,
                    row.window_size,
                    None if scales is None else scales[d],
                )
            )
        return tuple(parts)

    def local_operator(self, scales: Sequence[int] | None = None) -> LinearOperator:
        r"""The local kernels :math:`L` alone, from the windows to y: one
        :class:`~linop.local.LocalOperator` per worker (floats, or integers scaled by
        ``scales``: see :meth:`integer_operator`)."""
        return window_stage(
            self.window_operator.range,
            self.x.partition,
            self.y,
            self.window_name,
            lambda g, out: _kernels(self.parts(g, scales), out.shape, self.geometry.window_shape(g)),
            "interp",
        )

    def _tree(self, scales: Sequence[int] | None) -> LinearOperator:
        key = None if scales is None else tuple(scales)
        if key not in self._trees:
            self._trees[key] = self.local_operator(scales) @ self.window_operator
        return self._trees[key]

    @property
    def operator(self) -> LinearOperator:
        """The tree x -> y, the weights rounded to floating point (the data's dtype when it is
        inexact, float64 otherwise)."""
        return self._tree(None)

    @property
    def denominators(self) -> tuple[int, ...]:
        """Each spatial dimension's common denominator of the weights (1 for nearest)."""
        return tuple(axis.denominator for axis in self.maps)

    def integer_operator(self) -> tuple[LinearOperator, int]:
        """The same tree with integer weights, and its scale D: ``integer_operator()[0] == D *
        operator`` exactly in rationals (each dimension's weights times its denominator, D their
        product), for exact proofs.

        Raises
        ------
        LayerError
            If D exceeds :data:`EXACT_LIMIT` (a float scale factor whose reciprocal is not a
            small rational).
        """
        scales = self.denominators
        total = int(np.prod([int(s) for s in scales], dtype=object))
        if total > EXACT_LIMIT:
            raise LayerError(
                f"{self.layer}: the weights' common denominator {total} exceeds {EXACT_LIMIT}: no exact integer tree"
            )
        return self._tree(scales), total


def _kernels(parts: tuple[AxisWeights, ...], out_shape: tuple[int, ...], window: tuple[int, ...]):
    dims = len(parts)

    def forward(x: np.ndarray) -> np.ndarray:
        lead = x.shape[: x.ndim - len(window)]
        if 0 in out_shape or 0 in x.shape:
            dtype = x.dtype if x.dtype.kind in "fcO" else np.result_type(x.dtype, parts[0].weight_first.dtype)
            return np.zeros((*lead, *out_shape), dtype=dtype)
        for d, part in enumerate(parts):
            x = resample_maps.apply_axis(x, d - dims, part)
        return x

    def adjoint(y: np.ndarray) -> np.ndarray:
        lead = y.shape[: y.ndim - len(out_shape)]
        if 0 in out_shape or 0 in y.shape:
            dtype = y.dtype if y.dtype.kind in "fcO" else np.result_type(y.dtype, parts[0].weight_first.dtype)
            return np.zeros((*lead, *window), dtype=dtype)
        for d in reversed(range(dims)):
            y = resample_maps.apply_axis_adjoint(y, d - dims, parts[d])
        return y

    return forward, adjoint
