"""MPI datatypes of the MPI interpreter: element types, subarrays and buffer specs of regions.

Data moves between identical machines, so an entry travels as its predefined MPI type when MPI
has one (the datatype engine moves those fastest) and as ``itemsize`` raw bytes otherwise. A
box of a C-ordered block moves straight from or into the block: a contiguous box as it is, a
strided one through a cached subarray datatype, unless its contiguous runs are shorter than
:data:`PACK_BELOW` bytes (thin column strips), which are faster packed with numpy.

mpi4py is imported only when a function of this module runs (:func:`mpi`).
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from typing import Any

import numpy as np

from ...space import Region
from .mpi_types import Datatype

__all__ = [
    "PACK_BELOW",
    "SUBARRAY_CACHE_SIZE",
    "cached_subarrays",
    "BufferSpec",
    "mpi",
    "element_type",
    "predefined_type",
    "byte_type",
    "subarray",
    "contiguous_run",
    "region_spec",
    "raw_spec",
    "bundle_type",
]

BufferSpec = list[Any]
"""An mpi4py buffer specification: ``[array, count, datatype]``."""

PACK_BELOW = 512
"""Boxes whose contiguous runs are shorter than this many bytes (thin column strips) are
packed with numpy into a contiguous buffer: measured faster here than MPI's datatype engine
walking thousands of tiny runs. Longer runs move through subarray datatypes, unpacked."""

_MPI: Any = None
_ELEMENTS: dict[str, Datatype] = {}
_SUBARRAYS: OrderedDict[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], str], Datatype] = (
    OrderedDict()
)
_RETIRED: list[Datatype] = []  # evicted, still referenced elsewhere (a compiled schedule): freed later

SUBARRAY_CACHE_SIZE = 1024
"""Subarray datatypes kept (least recently used evicted first, as the plan cache does). An
evicted datatype is freed (``MPI_Type_free``) once nothing else holds it: a compiled schedule
or bound plan that still uses one keeps it alive until it is dropped."""


def mpi() -> Any:
    """The mpi4py ``MPI`` module, imported on first use.

    Raises
    ------
    ImportError
        If mpi4py is not installed (with the install command in the message).
    """
    global _MPI
    if _MPI is None:
        try:
            from mpi4py import MPI
        except ImportError as error:  # pragma: no cover - the test environment has mpi4py
            raise ImportError("the MPI interpreter needs mpi4py: pip install 'linop-adjoint[mpi]'") from error
        _MPI = MPI
    return _MPI


def element_type(dtype: np.dtype) -> Datatype:
    """The MPI datatype of one entry of ``dtype``: its predefined type when MPI has one of the
    right size, else ``itemsize`` contiguous bytes (committed once, cached)."""
    element = _ELEMENTS.get(dtype.char)
    if element is None:
        module = mpi()
        try:
            element = module.Datatype.fromcode(dtype.char)
        except (KeyError, ValueError):
            element = None
        if element is None or element.Get_size() != dtype.itemsize:
            element = module.BYTE.Create_contiguous(dtype.itemsize).Commit()
        _ELEMENTS[dtype.char] = element
    return element


def predefined_type(dtype: np.dtype) -> Datatype:
    """The predefined MPI datatype of ``dtype`` (reductions need one; see
    :data:`linop.backends.mpi.native.common.REDUCIBLE` for the dtypes that have one)."""
    return mpi().Datatype.fromcode(dtype.char)


def byte_type() -> Datatype:
    """``MPI.BYTE``."""
    return mpi().BYTE


def subarray(
    shape: tuple[int, ...], start: tuple[int, ...], sub: tuple[int, ...], dtype: np.dtype
) -> Datatype:
    """The committed subarray datatype of the box ``start : start + sub`` of a C-ordered array
    of ``shape`` and ``dtype`` (created once, cached)."""
    key = (shape, start, sub, dtype.char)
    datatype = _SUBARRAYS.get(key)
    if datatype is None:
        datatype = element_type(dtype).Create_subarray(list(shape), list(sub), list(start)).Commit()
        _SUBARRAYS[key] = datatype
        if len(_SUBARRAYS) > SUBARRAY_CACHE_SIZE:
            _evict()
    else:
        _SUBARRAYS.move_to_end(key)
    return datatype


def _evict() -> None:
    """Drop the least recently used subarray datatypes beyond :data:`SUBARRAY_CACHE_SIZE`, and
    free every dropped one that nothing else references any more (CPython reference counts:
    the list below and the loop variable are the only holders then)."""
    while len(_SUBARRAYS) > SUBARRAY_CACHE_SIZE:
        _RETIRED.append(_SUBARRAYS.popitem(last=False)[1])
    kept = []
    while _RETIRED:
        datatype = _RETIRED.pop()
        if sys.getrefcount(datatype) <= 2:  # this variable and getrefcount's argument
            datatype.Free()
        else:
            kept.append(datatype)
        del datatype
    _RETIRED.extend(kept)


def cached_subarrays() -> int:
    """How many subarray datatypes the cache holds (at most :data:`SUBARRAY_CACHE_SIZE`)."""
    return len(_SUBARRAYS)


def contiguous_run(shape: tuple[int, ...], extents: tuple[int, ...], itemsize: int) -> int:
    """Bytes in one contiguous run of a box of ``extents`` in a C-ordered array of ``shape``."""
    run = itemsize
    for n, e in zip(reversed(shape), reversed(extents)):
        run *= e
        if e != n:
            break
    return run


def region_spec(array: np.ndarray, region: Region, index: tuple[Any, ...] | None = None) -> BufferSpec | None:
    """An MPI buffer spec for ``array[region.index]`` without copying, or None when the box
    is better (or can only be) packed into a buffer. ``index``: the region's numpy index with
    a trailing ``Ellipsis``, when the caller has it at hand."""
    key: tuple[Any, ...] = (*region.index, Ellipsis) if index is None else index
    view = array[key]  # a view even for integer indices
    if view.flags.c_contiguous:
        return [view, view.nbytes, mpi().BYTE]
    if array.flags.c_contiguous:
        extents = tuple(b - a for a, b in zip(region.start, region.stop))
        if contiguous_run(array.shape, extents, array.itemsize) < PACK_BELOW:
            return None
        return [array, 1, subarray(array.shape, region.start, extents, array.dtype)]
    return None


def raw_spec(array: np.ndarray) -> BufferSpec:
    """The buffer spec of a whole contiguous array as bytes."""
    return [array, array.nbytes, mpi().BYTE]


def bundle_type(specs: list[BufferSpec]) -> Datatype:
    """One committed datatype naming the data of several buffer specs ``[array, count,
    datatype]`` in order, at their arrays' absolute addresses (a struct: used with
    ``MPI.BOTTOM`` as the buffer, ``[MPI.BOTTOM, 1, bundle]``). The caller keeps the arrays
    alive while the type is used, and frees it (``Free()``)."""
    module = mpi()
    displacements = [int(spec[0].__array_interface__["data"][0]) for spec in specs]
    return module.Datatype.Create_struct(
        [spec[1] for spec in specs], displacements, [spec[2] for spec in specs]
    ).Commit()
