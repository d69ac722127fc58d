"""Fast paths of the sparse interpreter for the collectives (proven equal to their expansions,
entry by entry, by the registry proof in tests/test_registry.py; their dtypes and aliasing are
pinned by tests/test_collectives_fastpaths.py).

A collective's matrix is a 0/1 selection: the identity on pass-through blocks, plus a one at
(target entry, source entry) for every entry of every piece of its movement (copies and adds alike;
:class:`~linop.pieces.PieceMovement`). The all-reduce's matrix has, for each group, an identity
block between every two members. Both are built from index arrays in one step, instead of
multiplying one matrix per primitive of the expansion.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from ...collectives import AllReduce, PieceMover
from ...space import Space
from . import INDEX, handler, selection

__all__: list[str] = []


def _whole_positions(space: Space, names: list[str]) -> np.ndarray:
    if not names:
        return np.zeros(0, dtype=INDEX)
    return np.concatenate([space[name].flat_indices() for name in names]).astype(INDEX)


@handler(PieceMover)
def _pieces(op: PieceMover) -> sp.csr_array:
    domain, range_ = op.domain, op.range
    kept = [name for name in domain.names if name in range_]
    rows = [_whole_positions(range_, kept)]
    cols = [_whole_positions(domain, kept)]
    for piece in op.movement.pieces:
        rows.append(range_[piece.target][piece.target_index()].flat_indices().astype(INDEX))
        cols.append(domain[piece.source][piece.source_index()].flat_indices().astype(INDEX))
    return selection(np.concatenate(rows), np.concatenate(cols), (range_.size, domain.size))


@handler(AllReduce)
def _all_reduce(op: AllReduce) -> sp.csr_array:
    space = op.domain
    layout_names = {op.tensor.block_name(index) for group in op.groups for index in group}
    kept = [name for name in space.names if name not in layout_names]
    rows = [_whole_positions(space, kept)]
    cols = [_whole_positions(space, kept)]
    for group in op.groups:
        positions = [space[op.tensor.block_name(index)].flat_indices().astype(INDEX) for index in group]
        for row in positions:
            for col in positions:
                rows.append(row)
                cols.append(col)
    return selection(np.concatenate(rows), np.concatenate(cols), (space.size, space.size))
