"""Fast paths of the halo exchange stages for the numpy and sparse interpreters.

A stage's copies commute (no destination meets a source or another destination), so the
interpreters run them without the send and receive buffers of the expansion:

- numpy, forward: ``x_dst = x_src`` for each transfer; adjoint: ``x_src += x_dst`` then
  ``x_dst = 0``. In place, only the halo-sized regions are touched: no local block is copied.
- sparse, forward: the identity with each destination row replaced by a one in its source
  column; adjoint: the identity without the destination diagonal, plus a one at (source row,
  destination column) for each transferred entry.

Each is proven equal to the expansion into primitives in ``tests/test_halo.py``.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from .backends.numpy_backend import Workspace
from .backends.numpy_backend import handler as numpy_handler
from .backends.sparse_backend import INDEX, selection
from .backends.sparse_backend import handler as sparse_handler
from .halo import HaloStage, HaloStageAdjoint

__all__: list[str] = []


@numpy_handler(HaloStage)
def _stage(op: HaloStage, work: Workspace) -> None:
    arrays = work.arrays
    for src, src_index, dst, dst_index in op.moves:
        source = arrays[src][src_index]
        work.writable(dst, source.dtype)[dst_index] = source


@numpy_handler(HaloStageAdjoint)
def _stage_adjoint(op: HaloStageAdjoint, work: Workspace) -> None:
    for src, src_index, dst, dst_index in op.moves:
        back = work.arrays[dst][dst_index]
        work.writable(src, back.dtype)[src_index] += back
        work.writable(dst)[dst_index] = 0


def _flat(op: HaloStage) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(source positions, destination positions, positions that are no destination)."""
    n = op.space.size
    if not op.transfers:
        empty = np.zeros(0, dtype=INDEX)
        return empty, empty, np.arange(n, dtype=INDEX)
    sources = np.concatenate([s.flat_indices() for s, _ in op.transfers]).astype(INDEX)
    destinations = np.concatenate([d.flat_indices() for _, d in op.transfers]).astype(INDEX)
    keep = np.ones(n, dtype=bool)
    keep[destinations] = False
    return sources, destinations, np.flatnonzero(keep).astype(INDEX)


@sparse_handler(HaloStage)
def _stage_matrix(op: HaloStage) -> sp.csr_array:
    sources, destinations, kept = _flat(op)
    rows, cols = np.concatenate([kept, destinations]), np.concatenate([kept, sources])
    return selection(rows, cols, op.shape)


@sparse_handler(HaloStageAdjoint)
def _stage_adjoint_matrix(op: HaloStageAdjoint) -> sp.csr_array:
    sources, destinations, kept = _flat(op)
    rows, cols = np.concatenate([kept, sources]), np.concatenate([kept, destinations])
    return selection(rows, cols, op.shape)
