"""The fast-path lowering of :class:`~linop.collectives.AllReduce`: its groups, per rank its
own (:class:`~linop.program.parts.AllReducePart`), under a worker map a rank's workers' groups
with their distinct ranks (:class:`~linop.program.parts.MappedAllReducePart`).

The global step lists every group of more than one member as ``(block, worker)`` pairs, in the
order of :func:`~linop.layout.reduction_groups`; it declines (the node runs its expansion) when
two members of a group share a worker. One rank's lowering finds its own group from the
partition (O(a group's size)); a mapped rank's, the groups of its workers only."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

from ..collectives import AllReduce
from ..layout import group_of, held_by_group
from .batching import batch
from .lowering import (
    lower,
    lowering,
    lowering_mapping,
    lowering_rank,
    lowering_workers,
    note_workers,
    per_worker,
)
from .parts import AllReducePart, Fallback, MappedAllReducePart, Projected
from .projection import project
from .steps import FastPathStep, Step

__all__: list[str] = []


@dataclass
class _AllReduceRunner:
    op: AllReduce
    groups: tuple[tuple[tuple[str, int], ...], ...]
    workers: tuple[int, ...] = field(default=())

    def project(self, rank: int) -> AllReducePart:
        entries = tuple(
            (next(name for name, w in group if w == rank), tuple(w for _, w in group))
            for group in self.groups
            if any(w == rank for _, w in group)
        )
        return AllReducePart(entries, Fallback(self.op, rank))


def _nonempty(layout: Any) -> bool:
    """True when some block of a layout holds an entry."""
    if hasattr(layout, "sizes"):
        return all(sum(sizes) > 0 for sizes in layout.sizes)
    shapes = layout.shapes
    distinct = getattr(shapes, "distinct", None)  # described shapes: the few distinct ones
    return any(all(n > 0 for n in shape) for shape in (distinct() if distinct is not None else shapes))


def _group(op: AllReduce, index: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The group of grid index ``index``: the indices that differ from it only along the axes,
    in C order along them (as :func:`~linop.layout.reduction_groups`; its own group only)."""
    return group_of(op.tensor.partition, op.axes, index)


def _rank_all_reduce(op: AllReduce, rank: int) -> list[Step]:
    """The rank's group only: its block and the workers of the indices that differ from its
    own only along the axes (members in C order along them, as :func:`reduction_groups`)."""
    partition = op.tensor.partition
    note_workers(partition.max_worker)
    if math.prod(partition.shape[a] for a in op.axes) <= 1 or not _nonempty(op.tensor):
        return []  # no group to reduce, on any rank
    entries: tuple[tuple[str, tuple[int, ...]], ...] = ()
    if partition.position(rank) is not None:
        index = partition.index(rank)
        block = op.tensor.block(index)
        if block.size:
            members = tuple(partition.worker(member) for member in _group(op, index))
            entries = ((block.name, members),)
    step = AllReducePart(entries, Fallback(op, rank))
    return [FastPathStep(Projected(step, rank, (partition.max_worker,)))]


@dataclass
class _MappedAllReduceRunner:
    """The global all-reduce step under a worker map (:func:`~linop.program.lower_portable`):
    projected onto a rank through the map (``project_mapped``)."""

    op: AllReduce
    workers: tuple[int, ...] = field(default=())

    def project(self, rank: int) -> MappedAllReducePart:  # pragma: no cover - only projected under a map
        raise ValueError("a mapped all-reduce is projected under its map")

    def project_mapped(self, rank: int, mapping: Any) -> MappedAllReducePart | None:
        """The groups of the rank's workers only (each found from the partition, as
        :func:`_rank_all_reduce` finds a rank's own), in the global order of the groups (C
        order of the other coordinates): O(the rank's workers times a group's size)."""
        op, held = self.op, set(mapping.workers_on(rank))
        mine = held_by_group(op.tensor.partition, op.axes, held)
        entries = []
        for key in sorted(mine):
            blocks = [op.tensor.block(i) for i in _group(op, mine[key][0])]
            if len(blocks) < 2 or not blocks[0].size:
                continue
            names = tuple(b.name for b in blocks if b.worker in held)
            if names:
                ranks = tuple(sorted({mapping.rank_of(b.worker) for b in blocks}))
                entries.append((names, ranks))
        if not entries:
            return None

        def fallback() -> tuple[Any, ...]:
            return project(batch(lower(op.expand())), rank, mapping)

        return MappedAllReducePart(tuple(entries), functools.lru_cache(maxsize=1)(fallback))


@lowering(per_worker(AllReduce))
def _all_reduce(op: AllReduce) -> list[Step] | None:
    if lowering_mapping() is not None:  # a worker map: the group's workers on one rank sum locally
        if len(op.others) or math.prod(op.tensor.partition.shape[a] for a in op.axes) <= 1:
            return None
        partition = op.tensor.partition  # each rank projects its workers' groups only
        workers = (partition.max_worker,) if lowering_workers() is not None else tuple(partition.workers)
        note_workers(partition.max_worker)
        return [FastPathStep(_MappedAllReduceRunner(op, workers))]
    rank = lowering_rank()
    if rank is not None:
        return _rank_all_reduce(op, rank)
    groups = []
    for group in op.groups:
        members = tuple((op.tensor.block_name(i), op.tensor.block(i).worker) for i in group)
        if len({w for _, w in members}) != len(members):
            return None
        if len(members) > 1 and op.tensor.block(group[0]).size:
            groups.append(members)
    if not groups:
        return []
    workers = tuple(sorted({w for g in groups for _, w in g}))
    return [FastPathStep(_AllReduceRunner(op, tuple(groups), workers))]
