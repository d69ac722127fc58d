r"""Per-dimension maps of interpolation, with torch's semantics, and their numpy kernels.

Interpolation along one dimension of input length m and output length n is a matrix
:math:`W \in \mathbb{Q}^{n \times m}` with at most two entries per row: output o reads the
input entries ``first[o]`` and ``second[o]`` with weights :math:`1 - \lambda_o` and
:math:`\lambda_o`. Over several dimensions the operator is the tensor product of the
dimensions' matrices (applied one dimension after the other), and its adjoint the product of
the transposes:

.. math::

    y = (W_{d-1} \otimes \cdots \otimes W_0)\, x, \qquad
    x^{*} = (W_{d-1}^{T} \otimes \cdots \otimes W_0^{T})\, y

The source coordinates follow ``torch.nn.functional.interpolate`` (torch 2.x, CPU):

``"nearest"``
    ``src = min(floor(o * scale), m - 1)``, with ``scale = 1 / scale_factor`` when a scale
    factor is given, else ``m / n``, computed as torch's CPU kernel does: in the data's dtype
    (float32 or float64), the product rounded to float32 before the floor. The rounding decides
    the entry where ``o * scale`` is near an integer (``m = 2, n = 82, o = 41``: entry 1 for
    float64 data, as the exact rational says; entry 0 in float32), so the map depends on the
    dtype the layer is built for (checked against torch on every ``m < 24``, ``n < 60`` and
    fourteen scale factors, both dtypes: ``tests/test_interpolate.py``).
``"nearest-exact"``
    ``src = min(floor((o + 1/2) scale), m - 1)``, in the same arithmetic (the centred
    coordinate in double, then the data's dtype, then float32).
``"linear"`` (linear, bilinear, trilinear)
    ``src = o (m - 1) / (n - 1)`` with ``align_corners`` (0 when n = 1), else
    ``src = max(scale (o + 1/2) - 1/2, 0)``; ``first = min(floor(src), m - 1)``,
    :math:`\lambda = \min(src - first, 1)`, ``second = first + 1`` unless ``first`` is the last
    entry. Here the weights are exact rationals (:class:`fractions.Fraction`; the scale of a
    float scale factor is the exact reciprocal of that float), rounded once to the data's dtype;
    torch rounds the source coordinate in its compute dtype, so the two agree to a few units in
    the last place. A weight that is zero is dropped (``second = first``), so the halo holds only
    entries that are read.

:func:`apply_axis` and :func:`apply_axis_adjoint` are the kernels along one axis (any leading
probe axes; object arrays for symbols).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import scipy.sparse as sp

from ..errors import LayerError

__all__ = [
    "AxisMap",
    "AxisWeights",
    "LINEAR_MODES",
    "MODES",
    "axis_map",
    "axis_weights",
    "apply_axis",
    "apply_axis_adjoint",
    "scaled_length",
]

LINEAR_MODES = {"linear": 1, "bilinear": 2, "trilinear": 3}
"""The linear modes and the number of spatial dimensions torch takes each for."""
MODES = ("nearest", "nearest-exact", *LINEAR_MODES)
"""The modes :class:`~linop.layers.Interpolate` implements."""


@dataclass(frozen=True)
class AxisMap:
    """Interpolation along one dimension: output ``o`` is ``(1 - weights[o]) x[first[o]] +
    weights[o] x[second[o]]`` (``weights`` exact rationals; 0 and ``second == first`` for the
    nearest modes).

    Attributes
    ----------
    input_length, output_length : int
    first, second : tuple of int
        The input entries each output reads (``first <= second``, both non-decreasing in o
        where the weights are non-zero).
    weights : tuple of Fraction
        :math:`\\lambda_o`, the weight of ``second[o]`` (in [0, 1)).
    """

    input_length: int
    output_length: int
    first: tuple[int, ...]
    second: tuple[int, ...]
    weights: tuple[Fraction, ...]

    def need(self, start: int, stop: int) -> tuple[int, int]:
        """The input range ``[a, b)`` the outputs ``[start, stop)`` read (non-empty outputs)."""
        return min(self.first[start:stop]), max(self.second[start:stop]) + 1

    @property
    def denominator(self) -> int:
        """The least common denominator of the weights (1 for the nearest modes)."""
        return math.lcm(1, *(w.denominator for w in self.weights))


def scaled_length(length: int, scale_factor: float) -> int:
    """torch's output length for a scale factor: ``floor(length * scale_factor)`` in double."""
    return math.floor(float(length) * float(scale_factor))


def _nearest_sources(
    m: int, n: int, scale_factor: float | None, exact: bool, dtype: np.dtype | type
) -> np.ndarray:
    """torch's nearest (``exact``: nearest-exact) source entries, in its arithmetic for data of
    ``dtype`` (float32 or float64): the scale in that dtype, the source coordinate rounded to
    float32 before the floor (torch's ``floorf``)."""
    real = np.dtype(dtype).type
    outputs = np.arange(n)
    if scale_factor is not None and scale_factor > 0:
        scale = real(1.0 / scale_factor)
    else:
        scale = real(m) / real(n)
    if exact:  # (o + 1/2) scale - 1/2 in double, clamped at 0, then + 1/2 in the data's dtype
        centred = np.maximum((outputs + 0.5) * np.float64(scale) - 0.5, 0.0)
        source = centred.astype(real) + real(0.5)
    else:
        source = outputs.astype(real) * scale
    return np.minimum(np.floor(source.astype(np.float32)).astype(np.int64), m - 1)


def _linear_source(o: int, m: int, n: int, scale_factor: float | None, align_corners: bool) -> Fraction:
    if align_corners:
        return Fraction(o * (m - 1), n - 1) if n > 1 else Fraction(0)
    if scale_factor is not None and scale_factor > 0:
        scale = 1 / Fraction(scale_factor)
    else:
        scale = Fraction(m, n)
    return max(scale * (2 * o + 1) / 2 - Fraction(1, 2), Fraction(0))


def axis_map(
    mode: str,
    input_length: int,
    output_length: int,
    scale_factor: float | None,
    align_corners: bool,
    dtype: np.dtype | type = np.float64,
) -> AxisMap:
    """The map of one dimension (``scale_factor``: the one torch would pass, None when the
    output length is given or recomputed; ``dtype``: the data's, float32 or float64, whose
    rounding torch's nearest modes follow).

    Raises
    ------
    LayerError
        For an unknown mode, or an empty input with a non-empty output.
    """
    m, n = int(input_length), int(output_length)
    if mode not in MODES:
        raise LayerError(f"Interpolate: mode {mode!r} is not one of {MODES}")
    if n > 0 and m == 0:
        raise LayerError(f"Interpolate: an empty input dimension cannot give {n} outputs")
    if n == 0:
        return AxisMap(m, 0, (), (), ())
    if mode in ("nearest", "nearest-exact"):
        exact = mode == "nearest-exact"
        sources = tuple(int(s) for s in _nearest_sources(m, n, scale_factor, exact, dtype))
        return AxisMap(m, n, sources, sources, (Fraction(0),) * n)
    first, second, weights = [], [], []
    for o in range(n):
        source = _linear_source(o, m, n, scale_factor, align_corners)
        i0 = min(math.floor(source), m - 1)
        weight = min(source - i0, Fraction(1))
        i1 = i0 + 1 if i0 < m - 1 else i0
        if weight == 0 or i1 == i0:  # one entry read, with weight 1
            i1, weight = i0, Fraction(0)
        first.append(i0)
        second.append(i1)
        weights.append(weight)
    return AxisMap(m, n, tuple(first), tuple(second), tuple(weights))


@dataclass(frozen=True)
class AxisWeights:
    """One worker's part of an :class:`AxisMap`: its outputs' entries in its window's local
    coordinates and the two weights of each, as numbers (floats, or integers scaled by a
    common denominator)."""

    window: int
    first: np.ndarray
    second: np.ndarray
    weight_first: np.ndarray
    weight_second: np.ndarray

    @property
    def single(self) -> bool:
        """Every output reads one entry with weight 1 (a selection)."""
        return bool(np.array_equal(self.first, self.second))


def axis_weights(
    axis: AxisMap, start: int, stop: int, window_start: int, window: int, scale: int | None
) -> AxisWeights:
    """The weights of outputs ``[start, stop)`` in the window that starts at input entry
    ``window_start``: floats (``scale`` None) or integers ``scale * weight`` (exact; ``scale`` a
    multiple of the map's denominator)."""
    lam = axis.weights[start:stop]
    first = np.asarray(axis.first[start:stop], dtype=np.int64) - window_start
    second = np.asarray(axis.second[start:stop], dtype=np.int64) - window_start
    if scale is None:
        high = np.array([float(w) for w in lam], dtype=np.float64)
        low = np.array([float(1 - w) for w in lam], dtype=np.float64)
    else:
        high = np.array([int(w * scale) for w in lam], dtype=np.int64)
        low = np.array([int((1 - w) * scale) for w in lam], dtype=np.int64)
    for array in (first, second, high, low):
        array.flags.writeable = False
    return AxisWeights(window, first, second, low, high)


def _numbers(weights: np.ndarray, data: np.ndarray) -> np.ndarray:
    """The weights in the data's dtype where the data is inexact (float32 data stays float32),
    else as they are (float64 for integer data under float weights, int64 for integer ones)."""
    if data.dtype.kind in "fc":
        return weights.astype(np.empty(0, data.dtype).real.dtype)
    return weights


def _spread(weights: np.ndarray, axis: int, ndim: int) -> np.ndarray:
    shape = [1] * ndim
    shape[axis] = -1
    return weights.reshape(shape)


def apply_axis(x: np.ndarray, axis: int, part: AxisWeights) -> np.ndarray:
    """Interpolate ``x`` along ``axis`` (a negative axis: counted from the end)."""
    axis = axis % x.ndim
    first = np.take(x, part.first, axis=axis)
    if part.single and not np.any(part.weight_first != 1):
        return first
    low = _spread(_numbers(part.weight_first, x), axis, x.ndim)
    high = _spread(_numbers(part.weight_second, x), axis, x.ndim)
    return first * low + np.take(x, part.second, axis=axis) * high


def apply_axis_adjoint(y: np.ndarray, axis: int, part: AxisWeights) -> np.ndarray:
    """The adjoint of :func:`apply_axis`: each output, times its weights, added into the two
    entries of the window it read (the weights are real: no conjugation)."""
    axis = axis % y.ndim
    moved = np.moveaxis(y, axis, 0)
    count = moved.shape[0]
    flat = moved.reshape(count, -1)
    low, high = _numbers(part.weight_first, y), _numbers(part.weight_second, y)
    if y.dtype == object:
        out = np.zeros((part.window, flat.shape[1]), dtype=object)
        np.add.at(out, part.first, flat * low[:, None])
        np.add.at(out, part.second, flat * high[:, None])
    else:
        rows = np.concatenate([part.first, part.second])
        cols = np.concatenate([np.arange(count), np.arange(count)])
        values = np.concatenate([low, high])
        transpose = sp.csr_array((values, (rows, cols)), shape=(part.window, count))
        out = np.asarray(transpose @ flat)
        if out.dtype != np.result_type(flat.dtype, values.dtype):
            out = out.astype(np.result_type(flat.dtype, values.dtype))
    return np.moveaxis(out.reshape(part.window, *moved.shape[1:]), 0, axis)
