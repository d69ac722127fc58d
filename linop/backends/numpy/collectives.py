"""Fast paths of the numpy interpreter for the collectives (proven equal to their expansions,
entry by entry, by the registry proof in tests/test_registry.py; their dtypes and aliasing are
pinned by tests/test_collectives_fastpaths.py).

One handler serves every :class:`~linop.collectives.PieceMover` node (broadcast, sum-reduce,
all-gather, reduce-scatter, repartition, scatter, gather): it reads the node's movement and does one
numpy copy (or add) per piece, instead of running Allocate / Copy / Deallocate nodes one by one.
A new block that is exactly one whole old block, used nowhere else, dropped and already of the
right dtype, is relabelled without a copy (as an out-of-place Move is); every other new block is
a fresh array, so no two blocks ever share a writable array. Dtypes follow the expansion: a new
block gets the common dtype of the interpreter's working dtype and of the blocks that feed it.

The all-reduce handler sums each group once and gives every member its own copy of the sum.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from ...collectives import AllReduce, PieceMover
from . import Workspace, handler

__all__: list[str] = []


@handler(PieceMover)
def _pieces(op: PieceMover, work: Workspace) -> None:
    movement = op.movement
    by_target: dict[str, list] = {block.name: [] for block in movement.created}
    for piece in movement.pieces:
        by_target[piece.target].append(piece)
    uses = Counter(piece.source for piece in movement.pieces)
    dropped = set(movement.dropped)
    results: dict[str, tuple[np.ndarray, bool]] = {}
    for block in movement.created:
        pieces = by_target[block.name]
        dtype = np.result_type(work.dtype, *(work.arrays[p.source].dtype for p in pieces))
        if len(pieces) == 1:
            piece = pieces[0]
            source = work.arrays[piece.source]
            if (
                piece.shape == block.shape == source.shape
                and uses[piece.source] == 1
                and piece.source in dropped
                and source.dtype == dtype
            ):
                results[block.name] = (source, piece.source in work.owned)
                continue
        if movement.adds and pieces and all(p.shape == block.shape for p in pieces):
            first = pieces[0]
            # np.array, not astype: indexing a 0-d block gives a scalar, and a block must stay an array
            out = np.array(work.arrays[first.source][first.source_index()], dtype=dtype)
            for piece in pieces[1:]:
                out += work.arrays[piece.source][piece.source_index()]
        else:
            covered = not movement.adds and sum(int(np.prod(p.shape)) for p in pieces) == int(
                np.prod(block.shape)
            )
            out = np.empty(block.shape, dtype=dtype) if covered else np.zeros(block.shape, dtype=dtype)
            for piece in pieces:
                source = work.arrays[piece.source][piece.source_index()]
                if movement.adds:
                    out[piece.target_index()] += source
                else:
                    out[piece.target_index()] = source
        results[block.name] = (out, True)
    for name in movement.dropped:
        work.drop(name)
    for name, (array, owned) in results.items():
        work.set(name, array, owned=owned)


@handler(AllReduce)
def _all_reduce(op: AllReduce, work: Workspace) -> None:
    for group in op.groups:
        names = [op.tensor.block_name(index) for index in group]
        arrays = [work.arrays[name] for name in names]
        if len(group) < 2 or arrays[0].size == 0:
            continue
        dtype = np.result_type(*arrays)
        total = arrays[0].astype(dtype, copy=True)
        for array in arrays[1:]:
            total += array
        work.set(names[0], total)
        for name in names[1:]:  # every worker holds its own copy of the sum
            work.set(name, total.copy())
