r"""The sequential numpy kernels of the layers, each with its adjoint (docs/theory.md#layers).

Arrays are laid out ``(batch, channel, *spatial)``; the spatial input of a kernel is a window
(already padded and trimmed by the halo exchange, :func:`linop.halo_windows`), so the kernels
use no padding. Every function accepts extra *leading* axes (a batch of probes, for the sparse
interpreter) before ``(batch, channel, ...)``. The work is done by
``numpy.lib.stride_tricks.sliding_window_view`` and ``tensordot`` / ``einsum``; the only Python
loops run over the kernel's taps (k^d of them), never over entries.

==================================  ===================================================================
kernel                              maths (per spatial output position p, tap t)
==================================  ===================================================================
:func:`correlate`                   y[n, o, p] = sum_{c, t} w[o, c, t] x[n, c, s p + d t]
:func:`correlate_adjoint`           x[n, c, s p + d t] += sum_o conj(w[o, c, t]) y[n, o, p]  (adjoint in x)
:func:`weight_correlate`            the same y as a function of w for fixed x
:func:`weight_correlate_adjoint`    dw[o, c, t] = sum_{n, p} y[n, o, p] x[n, c, s p + d t]
:func:`average_pool`                y[n, c, p] = mean_t x[n, c, s p + d t]
:func:`average_pool_adjoint`        x[n, c, s p + d t] += y[n, c, p] / (number of taps)
:func:`max_selection`               the flat index of the first maximum of each window (fixed input)
==================================  ===================================================================

:func:`jax_correlate_pair` and :func:`jax_weight_correlate_pair` are the convolutions' pairs in
jnp (``jax.lax.conv_general_dilated`` and its transpose), on one window without probe axes, so
that a :class:`~linop.layers.Convolution` runs inside ``jit`` on JAX devices (JAX is imported
only when they run).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from types import EllipsisType

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..kernel_template import KernelTemplate

__all__ = [
    "output_shape",
    "windows_view",
    "correlate",
    "correlate_adjoint",
    "weight_correlate",
    "weight_correlate_adjoint",
    "average_pool",
    "average_pool_adjoint",
    "max_selection",
    "select",
    "select_adjoint",
    "jax_correlate_pair",
    "jax_correlate_template",
    "jax_weight_correlate_template",
    "jax_weight_correlate_pair",
]

#: A basic numpy index (slices, ``...``, new axes), built as a named tuple before subscripting: mypy
#: infers ``tuple[object, ...]`` for a mixed tuple display and flags ``x[(..., *s)]`` as 3.11 syntax.
Index = tuple[slice | EllipsisType | None, ...]


def output_shape(
    window: Sequence[int], size: Sequence[int], stride: Sequence[int], dilation: Sequence[int]
) -> tuple[int, ...]:
    """Spatial output shape of a sliding window over an unpadded ``window`` shape (0 where it
    does not fit)."""
    out = []
    for m, k, s, d in zip(window, size, stride, dilation):
        span = m - d * (k - 1) - 1
        out.append(span // s + 1 if span >= 0 else 0)
    return tuple(out)


def windows_view(
    x: np.ndarray, size: Sequence[int], stride: Sequence[int], dilation: Sequence[int]
) -> np.ndarray:
    """A read-only view ``(..., *out, *size)`` of the windows over the last ``len(size)`` axes of
    ``x``: entry ``[..., p, t]`` is ``x[..., s p + d t]``. Empty output axes give an empty view."""
    dims = len(size)
    spatial = x.shape[x.ndim - dims :]
    out = output_shape(spatial, size, stride, dilation)
    extents = [d * (k - 1) + 1 for k, d in zip(size, dilation)]
    lead = x.shape[: x.ndim - dims]
    if 0 in out or any(m < e for m, e in zip(spatial, extents)):
        return np.zeros((*lead, *out, *size), dtype=x.dtype)
    view = sliding_window_view(x, extents, axis=tuple(range(x.ndim - dims, x.ndim)))
    index: Index = (
        Ellipsis,
        *tuple(slice(None, None, s) for s in stride),
        *tuple(slice(None, None, d) for d in dilation),
    )
    view = view[index]
    positions = tuple(slice(0, n) for n in out)
    trimmed: Index = (Ellipsis, *positions, *(slice(None),) * dims)
    return view[trimmed]


def _spatial_letters(dims: int) -> tuple[str, str]:
    return "pqrs"[:dims], "ijkl"[:dims]


def correlate(x: np.ndarray, w: np.ndarray, stride: Sequence[int], dilation: Sequence[int]) -> np.ndarray:
    """``y = w (*) x``: cross-correlation of ``x (..., N, C, *window)`` with ``w (O, C, *k)``,
    giving ``(..., N, O, *out)``."""
    dims = w.ndim - 2
    view = windows_view(x, w.shape[2:], stride, dilation)  # (..., N, C, *out, *k)
    # contract C and the taps: tensordot over the last axes of view (C, taps) and w (C, taps)
    moved = np.moveaxis(view, x.ndim - dims - 1, -dims - 1)  # (..., N, *out, C, *k)
    y = np.tensordot(moved, w, axes=(list(range(moved.ndim - dims - 1, moved.ndim)), list(range(1, w.ndim))))
    return np.moveaxis(y, -1, x.ndim - dims - 1)  # (..., N, O, *out)


def _tap_slices(
    tap: Sequence[int], out: Sequence[int], stride: Sequence[int], dilation: Sequence[int]
) -> tuple[slice, ...]:
    return tuple(slice(t * d, t * d + s * (n - 1) + 1, s) for t, n, s, d in zip(tap, out, stride, dilation))


def correlate_adjoint(
    y: np.ndarray, w: np.ndarray, window: Sequence[int], stride: Sequence[int], dilation: Sequence[int]
) -> np.ndarray:
    """The adjoint of :func:`correlate` in ``x``: ``y (..., N, O, *out)`` to ``x (..., N, C,
    *window)``.

    ``x[i] = sum_t conj(w[t]) y[p]`` over ``s p + d t = i`` is itself one correlation (so it
    costs what the forward costs): ``y`` spread out by the stride (zeros between), padded by
    ``d (k - 1)`` on both sides, correlated at dilation ``d`` with the flipped, channel-swapped,
    conjugated kernel. Entries beyond the last one a window reads stay zero.
    """
    dims = w.ndim - 2
    out = y.shape[y.ndim - dims :]
    lead = y.shape[: y.ndim - dims]  # (..., N, O)
    dtype = np.result_type(y.dtype, w.dtype)
    x = np.zeros((*lead[:-1], w.shape[1], *window), dtype=dtype)
    if 0 in out:
        return x
    size = w.shape[2:]
    reach = [d * (k - 1) for k, d in zip(size, dilation)]
    spread = np.zeros(
        (*lead, *((n - 1) * s + 1 + 2 * r for n, s, r in zip(out, stride, reach))), dtype=y.dtype
    )
    spaced: Index = (Ellipsis, *(slice(r, r + (n - 1) * s + 1, s) for n, s, r in zip(out, stride, reach)))
    spread[spaced] = y
    reverse: Index = (slice(None), slice(None), *(slice(None, None, -1),) * dims)
    flipped = np.swapaxes(w[reverse], 0, 1).conj()
    full = correlate(spread, flipped, (1,) * dims, dilation)  # (..., N, C, (n-1)s + 1 + d(k-1) ...)
    covered: Index = (
        Ellipsis,
        *(slice(0, min(m, e)) for m, e in zip(window, full.shape[full.ndim - dims :])),
    )
    x[covered] = full[covered]
    return x


def weight_correlate(
    x: np.ndarray, w: np.ndarray, stride: Sequence[int], dilation: Sequence[int]
) -> np.ndarray:
    """``y = w (*) x`` as a function of ``w (..., O, C, *k)`` for a fixed ``x (N, C, *window)``,
    giving ``(..., N, O, *out)``."""
    dims = x.ndim - 2
    size = w.shape[w.ndim - dims :]
    view = windows_view(x, size, stride, dilation)  # (N, C, *out, *k)
    out_letters, tap_letters = _spatial_letters(dims)
    spec = f"nc{out_letters}{tap_letters},...oc{tap_letters}->...no{out_letters}"
    return np.einsum(spec, view, w, optimize=True)


def weight_correlate_adjoint(
    x: np.ndarray, y: np.ndarray, size: Sequence[int], stride: Sequence[int], dilation: Sequence[int]
) -> np.ndarray:
    """The adjoint of :func:`weight_correlate`: ``y (..., N, O, *out)`` to ``dw (..., O, C, *k)``
    (conjugating ``x`` for complex data)."""
    dims = x.ndim - 2
    view = windows_view(x, size, stride, dilation)
    out_letters, tap_letters = _spatial_letters(dims)
    spec = f"nc{out_letters}{tap_letters},...no{out_letters}->...oc{tap_letters}"
    return np.einsum(spec, view.conj(), y, optimize=True)


def average_pool(
    x: np.ndarray, size: Sequence[int], stride: Sequence[int], dilation: Sequence[int]
) -> np.ndarray:
    """Mean of each window over the last ``len(size)`` axes."""
    view = windows_view(x, size, stride, dilation)
    dims = len(size)
    taps = int(np.prod(size))
    total = view.sum(axis=tuple(range(view.ndim - dims, view.ndim)))
    return total / taps


def average_pool_adjoint(
    y: np.ndarray, window: Sequence[int], size: Sequence[int], stride: Sequence[int], dilation: Sequence[int]
) -> np.ndarray:
    """The adjoint of :func:`average_pool`: each output's value divided by the number of taps
    added to every entry of its window."""
    dims = len(size)
    out = y.shape[y.ndim - dims :]
    taps = int(np.prod(size))
    share = y / taps
    x = np.zeros((*y.shape[: y.ndim - dims], *window), dtype=share.dtype)
    if 0 in out:
        return x
    for tap in itertools.product(*(range(k) for k in size)):
        taken: Index = (Ellipsis, *_tap_slices(tap, out, stride, dilation))
        x[taken] += share
    return x


def max_selection(
    x: np.ndarray,
    size: Sequence[int],
    stride: Sequence[int],
    dilation: Sequence[int],
    real: np.ndarray | None = None,
) -> np.ndarray:
    """For each window of ``x`` (the last ``len(size)`` axes), the flat index into ``x`` of its
    first largest entry: the Jacobian of max pooling at ``x`` selects these entries.

    ``real`` (a boolean array of ``x``'s trailing shape, or broadcastable to ``x``) marks the
    entries that are the tensor's own; the others are padding, which max pooling treats as
    minus infinity (as torch and DistDL do): a window's largest *real* entry is selected, and
    padding only when the window holds no real entry."""
    dims = len(size)
    positions = np.arange(x.size).reshape(x.shape)
    view = windows_view(x, size, stride, dilation)
    where = windows_view(positions, size, stride, dilation)
    taps = int(np.prod(size))
    if view.size == 0:
        return np.zeros(view.shape[: view.ndim - dims], dtype=np.int64)
    flat_view = view.reshape(*view.shape[: view.ndim - dims], taps)
    flat_where = where.reshape(*where.shape[: where.ndim - dims], taps)
    if real is None:
        best = np.argmax(flat_view, axis=-1)
    else:
        mask = windows_view(np.broadcast_to(real, x.shape), size, stride, dilation)
        flat_mask = mask.reshape(flat_view.shape)
        # the largest real entry: the first real tap holding the largest value among real taps
        lowest = np.min(flat_view, axis=-1, keepdims=True)
        candidates = np.where(flat_mask, flat_view, lowest)
        top = np.max(candidates, axis=-1, keepdims=True)
        chosen = flat_mask & (flat_view == top)
        best = np.where(chosen.any(axis=-1), np.argmax(chosen, axis=-1), np.argmax(flat_view, axis=-1))
    return np.take_along_axis(flat_where, best[..., None], axis=-1)[..., 0].astype(np.int64)


def select(x: np.ndarray, indices: np.ndarray, shape: Sequence[int]) -> np.ndarray:
    """``x.reshape(..., -1)[..., indices]``: the entries ``indices`` (flat into the last axes of
    ``shape``), keeping leading probe axes."""
    lead = x.shape[: x.ndim - len(shape)]
    return x.reshape(*lead, -1)[..., indices.reshape(-1)].reshape(*lead, *indices.shape)


def select_adjoint(y: np.ndarray, indices: np.ndarray, shape: Sequence[int]) -> np.ndarray:
    """The adjoint of :func:`select`: each ``y`` entry added into position ``indices`` of zeros
    of ``shape``."""
    lead = y.shape[: y.ndim - indices.ndim]
    size = int(np.prod(shape))
    if indices.size == 0:  # a worker without output (its reshape below would be ambiguous)
        return np.zeros((*lead, *shape), dtype=y.dtype)
    flat = y.reshape(-1, indices.size)
    out = np.zeros((flat.shape[0], size), dtype=y.dtype)
    # numpy's stubs type ufunc.at's indices as one integer array, not a tuple of index parts
    np.add.at(out, (slice(None), indices.reshape(-1)), flat)  # type: ignore[arg-type]
    return out.reshape(*lead, *shape)


# -- the same kernels in jnp, for JAX devices (linop.frameworks.jax_sharded) ----------------------
def _jax_correlate(x, w, stride: Sequence[int], dilation: Sequence[int]):
    """:func:`correlate` of one ``x (N, C, *window)`` by ``jax.lax.conv_general_dilated``
    (no padding: the window is already padded by the halo exchange)."""
    import jax.numpy as jnp
    from jax import lax

    x, w = jnp.asarray(x), jnp.asarray(w)
    out = output_shape(x.shape[2:], w.shape[2:], stride, dilation)
    dtype = jnp.result_type(x, w)
    if 0 in out or 0 in x.shape[:2] or 0 in w.shape[:2]:
        return jnp.zeros((x.shape[0], w.shape[0], *out), dtype)
    y = lax.conv_general_dilated(
        x.astype(dtype), w.astype(dtype), tuple(stride), "VALID", rhs_dilation=tuple(dilation)
    )
    inside: Index = (Ellipsis, *(slice(0, n) for n in out))
    return y[inside] if y.shape[2:] != out else y


def _jax_correlate_adjoint(y, w, window: Sequence[int], stride: Sequence[int], dilation: Sequence[int]):
    """:func:`correlate_adjoint` of one ``y (N, O, *out)``: ``y`` spread by the stride
    (``lhs_dilation``), padded by ``d (k - 1)``, correlated at dilation ``d`` with the flipped,
    channel-swapped, conjugated kernel (one ``conv_general_dilated``, integers included), cut or
    zero-padded to ``window``."""
    import jax.numpy as jnp
    from jax import lax

    y, w = jnp.asarray(y), jnp.asarray(w)
    dims = w.ndim - 2
    dtype = jnp.result_type(y, w)
    out = y.shape[2:]
    if 0 in out or 0 in y.shape[:2] or 0 in w.shape[:2]:
        return jnp.zeros((y.shape[0], w.shape[1], *window), dtype)
    reach = [d * (k - 1) for k, d in zip(w.shape[2:], dilation)]
    reverse: Index = (slice(None), slice(None), *(slice(None, None, -1),) * dims)
    flipped = jnp.conj(jnp.swapaxes(w[reverse], 0, 1))
    full = lax.conv_general_dilated(
        y.astype(dtype),
        flipped.astype(dtype),
        (1,) * dims,
        [(r, r) for r in reach],
        lhs_dilation=tuple(stride),
        rhs_dilation=tuple(dilation),
    )
    covered: Index = (Ellipsis, *(slice(0, min(m, e)) for m, e in zip(window, full.shape[2:])))
    full = full[covered]
    return jnp.pad(full, [(0, 0), (0, 0), *((0, m - e) for m, e in zip(window, full.shape[2:]))])


def _jax_weight_correlate_adjoint(x, y, size: Sequence[int], stride: Sequence[int], dilation: Sequence[int]):
    """:func:`weight_correlate_adjoint`: ``dw[o, c, t] = sum_{n, p} y[n, o, p] conj(x[n, c, s p +
    d t])``, one ``conv_general_dilated`` of ``x`` (batch C, features N) by ``y`` (features N
    in, O out) at window stride ``d`` and kernel dilation ``s``."""
    import jax.numpy as jnp
    from jax import lax

    x, y = jnp.asarray(x), jnp.asarray(y)
    dims = x.ndim - 2
    dtype = jnp.result_type(x, y)
    if 0 in y.shape or 0 in x.shape:
        return jnp.zeros((y.shape[1], x.shape[1], *size), dtype)
    order = (1, 0, *range(2, dims + 2))
    dw = lax.conv_general_dilated(
        jnp.conj(x).astype(dtype),
        y.astype(dtype),
        tuple(dilation),
        "VALID",
        rhs_dilation=tuple(stride),
        dimension_numbers=lax.ConvDimensionNumbers(order, order, order),
    )
    taps: Index = (slice(None), slice(None), *(slice(0, k) for k in size))
    return dw[taps]


def jax_correlate_pair(
    weights: np.ndarray, window: Sequence[int], stride: Sequence[int], dilation: Sequence[int]
) -> tuple[Callable, Callable]:
    """The jnp pair of :func:`correlate` and :func:`correlate_adjoint` for fixed ``weights``
    ``(O, C, *k)``, on one window ``(N, C, *window)`` and one output ``(N, O, *out)`` (no leading
    probe axes: linop maps them over batch axes): ``lax.conv_general_dilated`` forward, its
    transpose (a convolution with ``lhs_dilation``) adjoint."""
    weights = np.asarray(weights)

    def forward(x):
        return _jax_correlate(x, weights, stride, dilation)

    def adjoint(y):
        return _jax_correlate_adjoint(y, weights, window, stride, dilation)

    return forward, adjoint


@functools.cache
def _correlate_template_functions(
    stride: tuple[int, ...], dilation: tuple[int, ...]
) -> tuple[Callable, Callable]:
    """The template callables of :func:`jax_correlate_template` (one pair per stride and
    dilation, so that workers' templates share them)."""

    def forward(params, x, *, shapes):
        y = _jax_correlate(x, params[0], stride, dilation)
        return _fit(y, shapes[0])

    def adjoint(params, y, *, shapes):
        return _fit(_jax_correlate_adjoint(y, params[0], shapes[0][2:], stride, dilation), shapes[0])

    return forward, adjoint


def _fit(y, shape: Sequence[int]):
    """``y`` cut or zero-padded to ``shape`` (its leading corner kept)."""
    import jax.numpy as jnp

    if tuple(y.shape) == tuple(shape):
        return y
    y = y[tuple(slice(0, min(a, b)) for a, b in zip(y.shape, shape))]
    return jnp.pad(y, [(0, b - a) for a, b in zip(y.shape, shape)])


def jax_correlate_template(
    weights: np.ndarray, stride: Sequence[int], dilation: Sequence[int]
) -> KernelTemplate:
    """:func:`jax_correlate_pair` as a :class:`~linop.kernel_template.KernelTemplate`: the
    worker's ``weights`` its parameters, one forward and adjoint for every worker of a layer
    (a correlation is padding-consistent: on a window zero-padded at its far end and weights
    zero-padded in their channels, the leading corner of the output is the worker's own; the
    adjoint likewise), so that JAX devices run the layer's kernels as one program."""
    forward, adjoint = _correlate_template_functions(tuple(stride), tuple(dilation))
    return KernelTemplate(
        forward, adjoint, (np.asarray(weights),), ("correlate", tuple(stride), tuple(dilation))
    )


@functools.cache
def _weight_template_functions(
    size: tuple[int, ...], stride: tuple[int, ...], dilation: tuple[int, ...], with_bias: bool
) -> tuple[Callable, Callable]:
    """The template callables of :func:`jax_weight_correlate_template`."""

    def forward(params, w, b=None, *, shapes):
        y = _fit(_jax_correlate(params[0], w, stride, dilation), shapes[0])
        if with_bias:
            spread: Index = (None, slice(None), *(None,) * (y.ndim - 2))
            y = y + b[spread]
        return y

    def adjoint(params, y, *, shapes):
        import jax.numpy as jnp

        dw = _fit(_jax_weight_correlate_adjoint(params[0], y, size, stride, dilation), shapes[0])
        if not with_bias:
            return dw
        return dw, _fit(jnp.sum(y, axis=(0, *range(2, y.ndim))), shapes[1])

    return forward, adjoint


def jax_weight_correlate_template(
    window: np.ndarray, size: Sequence[int], stride: Sequence[int], dilation: Sequence[int], with_bias: bool
) -> KernelTemplate:
    """:func:`jax_weight_correlate_pair` of a given ``window`` as a
    :class:`~linop.kernel_template.KernelTemplate` (the window its parameter: padding-consistent,
    a window zero-padded at its far end or in its channels leaves the leading corner of the
    output and of the weight gradient unchanged), so that JAX devices run the layer's
    parameter kernels as one program."""
    forward, adjoint = _weight_template_functions(
        tuple(size), tuple(stride), tuple(dilation), bool(with_bias)
    )
    key = ("weight_correlate", tuple(size), tuple(stride), tuple(dilation), bool(with_bias))
    return KernelTemplate(forward, adjoint, (np.asarray(window),), key)


def jax_weight_correlate_pair(
    window: np.ndarray | None,
    size: Sequence[int],
    stride: Sequence[int],
    dilation: Sequence[int],
    with_bias: bool,
    label: str,
) -> tuple[Callable, Callable]:
    """The jnp pair of :func:`weight_correlate` (``y = w (*) x`` as a function of ``w (O, C,
    *k)`` and of the bias ``b (O,)`` when ``with_bias``, added at every output position) and of
    its adjoint, for the fixed input ``window (N, C, *window)``; a LayerError naming ``label``
    when the window was not given."""

    def fixed() -> np.ndarray:
        if window is None:
            from ..errors import LayerError

            raise LayerError(f"{label}: the input window of this worker was not given to parameter_operator")
        return window

    def forward(w, b=None):
        y = _jax_correlate(fixed(), w, stride, dilation)
        if with_bias:
            spread: Index = (None, slice(None), *(None,) * (y.ndim - 2))
            y = y + b[spread]
        return y

    def adjoint(y):
        import jax.numpy as jnp

        dw = _jax_weight_correlate_adjoint(fixed(), y, size, stride, dilation)
        if not with_bias:
            return dw
        return dw, jnp.sum(y, axis=(0, *range(2, y.ndim)))

    return forward, adjoint
