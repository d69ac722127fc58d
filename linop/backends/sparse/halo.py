"""Sparse fast paths of the halo exchange stages.

Forward: the identity with each destination row replaced by a one in its source column;
adjoint: the identity without the destination diagonal, plus a one at (source row, destination
column) for each transferred entry. Proven equal to the expansion into primitives in
``tests/test_halo.py``.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from ...halo import HaloStage, HaloStageAdjoint
from . import INDEX, handler, selection

__all__: list[str] = []


def _flat(op: HaloStage | HaloStageAdjoint) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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


@handler(HaloStage)
def _stage_matrix(op: HaloStage) -> sp.csr_array:
    sources, destinations, kept = _flat(op)
    rows, cols = np.concatenate([kept, destinations]), np.concatenate([kept, sources])
    return selection(rows, cols, op.shape)


@handler(HaloStageAdjoint)
def _stage_adjoint_matrix(op: HaloStageAdjoint) -> sp.csr_array:
    sources, destinations, kept = _flat(op)
    rows, cols = np.concatenate([kept, sources]), np.concatenate([kept, destinations])
    return selection(rows, cols, op.shape)
