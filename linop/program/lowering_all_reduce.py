"""The fast-path lowering of :class:`~linop.collectives.AllReduce`: its groups, per rank its
own (:class:`~linop.program.parts.AllReducePart`), under a worker map a rank's workers' groups
with their distinct ranks (:class:`~linop.program.parts.MappedAllReducePart`).

The global step lists every group of more than one member as ``(block, worker)`` pairs, in the
order of :func:`~linop.layout.reduction_groups`; it declines (the node runs its expansion) when
two members of a group share a worker. One rank's lowering names its own group by its box of
the partition (a :class:`~linop.partition.WorkerBox`: length, membership, a worker's position
and the runs of ranks ``MPI_Group_range_incl`` takes in O(ndim), never a list of the group's
members); a mapped rank's, the groups of its workers only, each group's distinct ranks as runs
(:func:`~linop.program.groups.sorted_mapped_ranks`)."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..collectives import AllReduce
from ..layout import held_by_group
from ..partition import Partition, WorkerBox
from .batching import batch
from .groups import sorted_mapped_ranks
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


def _group_box(partition: Partition, axes: tuple[int, ...], index: tuple[int, ...]) -> WorkerBox:
    """The workers of the group of grid index ``index``: the box of the indices that differ
    from it only along ``axes``, in C order along them (its group of
    :func:`~linop.layout.reduction_groups`, described: O(ndim) at any group size)."""
    return WorkerBox(partition, tuple(None if d in axes else k for d, k in enumerate(index)))


def _rank_all_reduce(op: AllReduce, rank: int) -> list[Step]:
    """The rank's group only: its block and the workers of the indices that differ from its
    own only along the axes (members in C order along them, as :func:`reduction_groups`),
    described by their box (:func:`_group_box`): O(ndim), not O(the group)."""
    partition = op.tensor.partition
    note_workers(partition.max_worker)
    if math.prod(partition.shape[a] for a in op.axes) <= 1 or not _nonempty(op.tensor):
        return []  # no group to reduce, on any rank
    entries: tuple[tuple[str, Sequence[int]], ...] = ()
    if partition.position(rank) is not None:
        index = partition.index(rank)
        block = op.tensor.block(index)
        if block.size:
            entries = ((block.name, _group_box(partition, op.axes, index)),)
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
        """The groups of the rank's workers only (each named by its box, as
        :func:`_rank_all_reduce` names a rank's own), in the global order of the groups (C
        order of the other coordinates), each with the rank's members in C order and the
        group's distinct ranks as runs (:func:`~linop.program.groups.sorted_mapped_ranks`):
        O(the rank's workers) and O(a group's runs), not O(a group's size), for a described
        map and partition whose groups are runs of consecutive workers (the reduced axes the
        last ones of the grid, as a batch norm's over (1, 1, s, s)); a group strided through
        the workers (a reduced axis before a kept one) has its members' ranks listed,
        O(a group's size)."""
        op, partition = self.op, self.op.tensor.partition
        mine = held_by_group(partition, op.axes, mapping.workers_on(rank))
        entries = []
        for key in sorted(mine):
            box = _group_box(partition, op.axes, mine[key][0])
            if len(box) < 2 or not op.tensor.block(box.grid_index(0)).size:
                continue
            held = sorted(mine[key], key=lambda index: [index[a] for a in op.axes])  # the box's order
            names = tuple(op.tensor.block_name(index) for index in held)
            entries.append((names, sorted_mapped_ranks(box, mapping)))
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
