"""Result arrays of the MPI interpreter's collectives: new arrays whose memory is recycled.

An out-of-place call must return new arrays. Under MPI, glibc hands large blocks (8 MB) back
to the system when they are freed and maps them afresh on the next allocation, so every new
result is page-faulted in while MPI writes it: measured here, an 8 MB ``Allreduce`` into a new
``np.empty`` array takes about twice as long as into a preallocated one (the same in a
single process, whose malloc keeps such blocks). :func:`new_array` gives arrays that are new
to the caller (nobody else holds them) over memory taken from a free list: the memory
returns to the list when the caller drops the array *and every view of it* (the array's
base is an owner object, and views keep it alive), never earlier. Small arrays are plain
``np.empty``.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["POOL_FROM", "KEEP_FREE", "HUGE_PAGE", "new_array", "free_buffers", "lasting_array"]

POOL_FROM = 1 << 17
"""Arrays of at least this many bytes (glibc's default mmap threshold) come from the pool."""

KEEP_FREE = 4
"""Free buffers kept per size; more are released to the system."""

HUGE_PAGE = 1 << 21
"""The size (and alignment) of a transparent huge page on x86-64 Linux."""

_FREE: dict[int, list[np.ndarray]] = {}


class _Owner:
    """The base of a pooled array: holds its buffer while any array over it lives."""

    __slots__ = ("__array_interface__", "__weakref__", "buffer")

    def __init__(self, buffer: np.ndarray, shape: tuple[int, ...], dtype: np.dtype) -> None:
        self.buffer = buffer
        self.__array_interface__: dict[str, Any] = {
            "shape": shape,
            "typestr": dtype.str,
            "descr": dtype.descr,
            "data": (buffer.ctypes.data, False),
            "strides": None,
            "version": 3,
        }


def _release(buffer: np.ndarray) -> None:
    free = _FREE.setdefault(buffer.nbytes, [])
    if len(free) < KEEP_FREE:
        free.append(buffer)


def new_array(shape: tuple[int, ...], dtype: npt.DTypeLike) -> np.ndarray:
    """A new C-ordered, writeable, uninitialised array (as ``np.empty``), its memory from the
    pool when it is large."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < POOL_FROM or dtype.hasobject or dtype.fields is not None:
        return np.empty(shape, dtype)
    free = _FREE.get(nbytes)
    buffer = free.pop() if free else np.empty(nbytes, dtype=np.uint8)
    owner = _Owner(buffer, tuple(shape), dtype)
    array = np.asarray(owner)
    weakref.finalize(owner, _release, buffer)
    return array


def free_buffers() -> int:
    """Buffers on the free list (for tests)."""
    return sum(len(free) for free in _FREE.values())


def lasting_array(shape: tuple[int, ...], dtype: npt.DTypeLike) -> np.ndarray:
    """A new C-ordered, writeable, uninitialised array for a bound plan's results and buffers
    (built once, written by every call), starting on a huge-page boundary when it spans at
    least one huge page (:data:`HUGE_PAGE`).

    numpy asks for huge pages on its large allocations (``madvise``), but a huge page backs
    only a whole aligned 2 MB of memory: an 8 MB ``np.empty`` starting anywhere has 3 of them
    (4 by chance). What the backing changes is the side that *reads* the buffer. Measured here
    (``benchmarks/bench_mpi_buffer_placement.py``: 2 ranks, 8 MB ``Bcast`` as bytes, rows
    interleaved in a random order per sample, each batch after calls of its own, median of
    per-sample ratios to ``np.empty`` buffers on both sides; five launches of 41-61 samples on
    the loaded 2-core machine, mpich wheel, THP ``madvise``): from a root buffer with no huge
    page (``MADV_NOHUGEPAGE``) 1.10-1.33x (CPU time 1.14-1.37x), from one wholly in huge pages
    0.91-1.03x (CPU 0.90-0.98x), leaving out one launch whose reference row was itself slow
    (there 1.02-1.08x and 0.82-0.83x, its other rows 0.80-0.88x); into a receiver's buffer
    aligned or not, with huge pages or none, 0.80-1.06x with no trend (the noise). No page
    faults per call on either side once touched (``getrusage`` minor faults). So a bound
    broadcast's result array gains nothing on the call that writes it, but a result or buffer
    that a later collective sends (a sum's share, a broadcast copy passed on) does; the
    alignment costs nothing (the array is a view into an allocation one huge page longer, and
    the slack is never touched: no memory behind it). The root of a broadcast sends the
    caller's array as it is, and a sum-reduce the caller's copies: their backing is the
    caller's, and it matters as much there (``benchmarks/bench_mpi_buffer_placement.py``, ops
    ``sumreduce`` and ``allreduce``, prints each buffer's share of huge pages beside its
    times)."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE or dtype.hasobject or dtype.fields is not None:
        return np.empty(shape, dtype)
    raw = np.empty(nbytes + HUGE_PAGE, dtype=np.uint8)
    start = -raw.ctypes.data % HUGE_PAGE
    return raw[start : start + nbytes].view(dtype).reshape(shape)
