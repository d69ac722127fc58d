"""Sparse fast paths of the halo shims: one selection matrix from the shim's links.

A shim moves one box per worker (the bulk into its local block, or the window out of it) and
drops or zero-fills the rest, so its matrix is 0/1 with a one per moved entry, built from index
arrays in one assembly: no product over whole spaces, linear in the number of entries. Proven equal to the
expansion in ``tests/test_registry.py``.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from ...halo import PadShim, PadShimAdjoint, TrimShim, TrimShimAdjoint
from ...space import Space
from . import INDEX, handler, selection

__all__: list[str] = []


def _box_positions(space: Space, name: str, box: tuple[slice, ...]) -> np.ndarray:
    """Flat positions in ``space`` of a box (slices with explicit bounds) of block ``name``,
    in C order."""
    shape = space.block(name).shape
    offset = space.offset(name)
    if not shape:
        return np.array([offset], dtype=INDEX)
    grids = np.ix_(*(np.arange(s.start, s.stop, dtype=INDEX) for s in box))
    strides = np.cumprod((1, *shape[::-1]), dtype=INDEX)[-2::-1]
    total = np.full((1,) * len(shape), offset, dtype=INDEX)
    for grid, stride in zip(grids, strides):
        total = total + grid * stride
    return total.ravel()


@handler(PadShim)
@handler(PadShimAdjoint)
@handler(TrimShim)
@handler(TrimShimAdjoint)
def _shim_matrix(op: PadShim) -> sp.csr_array:
    """The 0/1 matrix of the shim's links (:meth:`~linop.halo.PadShim.links`), in one assembly."""
    rows, cols = [], []
    for source, source_box, target, target_box in op.links():
        rows.append(_box_positions(op.range, target, target_box))
        cols.append(_box_positions(op.domain, source, source_box))
    if not rows:
        return sp.csr_array(op.shape, dtype=INDEX)
    return selection(np.concatenate(rows), np.concatenate(cols), op.shape)
