"""The fast-path lowering of the rooted groups, :class:`~linop.collectives.Broadcast` and
:class:`~linop.collectives.SumReduce`: per tensor block its whole-block copies, ``ranks[0]``
the root (:class:`~linop.program.parts.RootedPart`); under a worker map the groups of a rank's
workers with their distinct ranks and the copies it holds
(:class:`~linop.program.parts.MappedRootedPart`).

The global step declines (the node runs its expansion) when a piece is not a whole block or two
copies of one group share a worker. One rank's lowering finds its own groups (the block it
holds, the block its copy comes from) from the layouts, described (a 1 -> P group is never
listed); a mapped rank's, those of its workers only."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..collectives import Broadcast, SumReduce
from ..partition import WorkerBox
from ..space import Block
from .batching import batch
from .groups import CopyPairs, RootedRanks, mapped_ranks
from .lowering import lower, lowering, lowering_mapping, lowering_rank, note_workers, per_worker
from .lowering_pieces import held_blocks
from .parts import Fallback, MappedRootedGroup, MappedRootedPart, Projected, RootedGroup, RootedPart
from .projection import project
from .steps import FastPathStep, Step

__all__: list[str] = []


def _whole_groups(op: Broadcast | SumReduce, *, reduce: bool) -> tuple[RootedGroup, ...] | None:
    """Group a broadcast's or sum-reduce's pieces by their tensor block; None when a piece is
    not a whole block or two copies of one group share a worker."""
    domain, range_ = op.domain, op.range
    by_root: dict[str, list[tuple[str, int]]] = {}
    for piece in op.movement.pieces:
        root, copy = (piece.target, piece.source) if reduce else (piece.source, piece.target)
        root_block = (range_ if reduce else domain).block(root)
        copy_block = (domain if reduce else range_).block(copy)
        if any(piece.source_start) or any(piece.target_start) or piece.shape != root_block.shape:
            return None
        if copy_block.shape != root_block.shape:
            return None
        by_root.setdefault(root, []).append((copy, copy_block.worker))
    groups = []
    for root, copies in by_root.items():
        root_block = (range_ if reduce else domain).block(root)
        workers = [w for _, w in copies]
        if len(set(workers)) != len(workers):
            return None
        others = tuple(w for w in workers if w != root_block.worker)
        groups.append(RootedGroup(root, root_block.shape, (root_block.worker, *others), tuple(copies)))
    return tuple(groups)


@dataclass
class _BroadcastRunner:
    op: Broadcast | SumReduce
    groups: tuple[RootedGroup, ...]
    reduce: bool
    workers: tuple[int, ...] = field(default=())

    def project(self, rank: int) -> RootedPart:
        movement = self.op.movement
        space = self.op.domain
        dropped = tuple(n for n in movement.dropped if space.block(n).worker == rank)
        created = tuple(b for b in movement.created if b.worker == rank)
        groups = tuple(g for g in self.groups if rank in g.ranks)
        return RootedPart(groups, rank, dropped, created, self.reduce, Fallback(self.op, rank))


def _root_groups(
    op: Broadcast | SumReduce, roots: Iterable[tuple[int, ...]]
) -> Iterator[tuple[int, tuple[int, ...], Block, WorkerBox]]:
    """Per tensor block at a grid index of ``roots`` that moves something, its group: the flat
    index of its first copy (the global order of the groups), the root's index, the block, and
    its copies' workers (described: a 1 -> P group is never listed)."""
    tensor, copies = op.tensor, op.copies
    for root in roots:
        block = tensor.block(root)
        members = op.copy_box(root)
        if block.size and len(members):  # empty blocks move nothing: no group
            yield copies.partition.flat(members.grid_index(0)), root, block, members


def _rank_broadcast(op: Broadcast | SumReduce, rank: int, *, reduce: bool) -> list[Step]:
    """The rank's groups only (the source block it holds and the source block it copies), in
    the global order of the groups (that of their first copy), and its dropped and created
    blocks; every piece of a broadcast is a whole block, so the fast path always applies."""
    tensor, copies = op.tensor, op.copies
    note_workers(max(tensor.partition.max_worker, copies.partition.max_worker))
    roots: list[tuple[int, ...]] = []
    if copies.partition.position(rank) is not None:
        roots.append(op.source_index(copies.partition.index(rank)))
    if tensor.partition.position(rank) is not None:
        own = tensor.partition.index(rank)
        if own not in roots:
            roots.append(own)
    groups = [
        (
            first,
            RootedGroup(
                block.name, block.shape, RootedRanks(block.worker, members), CopyPairs(copies, members)
            ),
        )
        for first, _, block, members in _root_groups(op, roots)
    ]
    mine_x = tensor.space.owned(rank)
    mine_y = copies.space.owned(rank)
    dropped, created = (mine_y, mine_x) if reduce else (mine_x, mine_y)
    step = RootedPart(
        tuple(g for _, g in sorted(groups, key=lambda pair: pair[0])),
        rank,
        tuple(b.name for b in dropped),
        created,
        reduce,
        Fallback(op, rank),
    )
    workers = (max(tensor.partition.max_worker, copies.partition.max_worker),)
    return [FastPathStep(Projected(step, rank, workers))]


@dataclass
class _MappedRootedRunner:
    """The global broadcast or sum-reduce step under a worker map
    (:func:`~linop.program.lower_portable`): projected onto a rank through the map
    (``project_mapped``), from the groups of the rank's workers only."""

    op: Broadcast | SumReduce
    reduce: bool
    workers: tuple[int, ...] = field(default=())

    def project(self, rank: int) -> MappedRootedPart:  # pragma: no cover - only projected under a map
        raise ValueError("a mapped broadcast or sum-reduce is projected under its map")

    def project_mapped(self, rank: int, mapping: Any) -> MappedRootedPart | None:
        """The groups the rank's workers take part in (the block a worker holds, the block a
        worker's copy comes from: as :func:`_rank_broadcast` finds a rank's own), in the
        global order of the groups (that of their first copy), and the rank's dropped and
        created blocks: O(the rank's workers and the sizes of their groups)."""
        op, held = self.op, mapping.workers_on(rank)
        mine = set(held)
        tensor, copies = op.tensor, op.copies
        roots: set[tuple[int, ...]] = set()
        held_copies: dict[tuple[int, ...], list[tuple[int, str]]] = {}  # per root: (position, name)
        for worker in held:
            if (position := copies.partition.position(worker)) is not None:
                index = copies.partition.index(worker)
                root = op.source_index(index)
                roots.add(root)
                held_copies.setdefault(root, []).append((position, copies.block_name(index)))
            if tensor.partition.position(worker) is not None:
                roots.add(tensor.partition.index(worker))
        found = []
        for first, root, block, members in _root_groups(op, roots):
            ranks = mapped_ranks(block.worker, members, mapping)  # described runs of ranks
            names = tuple(name for _, name in sorted(held_copies.get(root, ())))  # in C order
            group = MappedRootedGroup(block.name, block.shape, ranks, ranks[0] == rank, names)
            found.append((first, group))
        groups = tuple(group for _, group in sorted(found, key=lambda pair: pair[0]))
        workers = frozenset(mine)
        sources, targets = (copies, tensor) if self.reduce else (tensor, copies)
        dropped = tuple(b.name for b in held_blocks(sources, workers))
        created = tuple(held_blocks(targets, workers))
        if not groups and not dropped and not created:
            return None

        def fallback() -> tuple[Any, ...]:
            return project(batch(lower(op.expand())), rank, mapping)

        return MappedRootedPart(
            groups, dropped, created, self.reduce, functools.lru_cache(maxsize=1)(fallback)
        )


def _lower_broadcast(op: Broadcast | SumReduce, *, reduce: bool) -> list[Step] | None:
    if lowering_mapping() is not None:  # a worker map: a rank's copies filled or summed locally
        largest = max(op.tensor.partition.max_worker, op.copies.partition.max_worker)
        note_workers(largest)  # every piece is a whole block: the fast path always applies
        return [FastPathStep(_MappedRootedRunner(op, reduce, (largest,)))]
    rank = lowering_rank()
    if rank is not None:
        return _rank_broadcast(op, rank, reduce=reduce)
    groups = _whole_groups(op, reduce=reduce)
    if groups is None:
        return None
    workers = {w for g in groups for w in g.ranks}
    workers |= {b.worker for b in op.movement.created} | {
        op.domain.block(n).worker for n in op.movement.dropped
    }
    return [FastPathStep(_BroadcastRunner(op, groups, reduce, tuple(sorted(workers))))]


@lowering(per_worker(Broadcast))
def _broadcast(op: Broadcast) -> list[Step] | None:
    return _lower_broadcast(op, reduce=False)


@lowering(per_worker(SumReduce))
def _sum_reduce(op: SumReduce) -> list[Step] | None:
    return _lower_broadcast(op, reduce=True)
