"""The native all-reduce: ``Allreduce`` per group on a cached sub-communicator, and under a
worker map local sums first (:class:`~linop.collectives.AllReduce`)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ....collectives import AllReduce
from ....layout import group_of, held_by_group
from ....program import (
    FastPathStep,
    Step,
    batch,
    lower,
    lowering,
    lowering_mapping,
    lowering_rank,
    lowering_workers,
    note_workers,
    per_worker,
    project,
)
from ..context import subcommunicator
from ..datatypes import mpi, predefined_type
from ..runtime import run_schedule
from ..steps import Persistent, RankStep
from .common import REDUCIBLE, Fallback, Projected, contiguous_owned, fallback

if TYPE_CHECKING:  # pragma: no cover - mpi4py is optional at run time
    from mpi4py.MPI import Intracomm

    from ...numpy import Workspace


@dataclass
class _RankAllReduce(RankStep):
    """One rank's part of an all-reduce: (block, group ranks) per group it belongs to."""

    entries: tuple[tuple[str, tuple[int, ...]], ...]
    fallback: Fallback

    def run(self, work: Workspace, comm: Intracomm, dtype: np.dtype) -> None:
        if dtype.char not in REDUCIBLE:
            run_schedule(self.fallback.schedule(), work, comm, dtype)
            return
        lib = mpi()
        for name, ranks in self.entries:  # blocking, in the global order of the groups
            array = contiguous_owned(work, name, dtype)
            subcommunicator(comm, ranks).Allreduce(lib.IN_PLACE, [array, predefined_type(dtype)], op=lib.SUM)

    def written(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.entries)

    def persistent(
        self, arrays: dict[str, np.ndarray], comm: Intracomm, dtype: np.dtype, *, dry: bool = False
    ) -> Persistent | None:
        """Persistent ``Allreduce_init`` requests on the caller's arrays, or None (``dry``:
        decide only, create nothing)."""
        if dtype.char not in REDUCIBLE or any(
            not arrays[name].flags.c_contiguous for name, _ in self.entries
        ):
            return None
        if dry:
            return Persistent()
        lib = mpi()
        requests = [
            subcommunicator(comm, ranks).Allreduce_init(
                lib.IN_PLACE, [arrays[name], predefined_type(dtype)], op=lib.SUM
            )
            for name, ranks in self.entries
        ]
        return Persistent(requests)


@dataclass
class _AllReduceRunner:
    op: AllReduce
    groups: tuple[tuple[tuple[str, int], ...], ...]
    workers: tuple[int, ...] = field(default=())

    def project(self, rank: int) -> _RankAllReduce:
        entries = tuple(
            (next(name for name, w in group if w == rank), tuple(w for _, w in group))
            for group in self.groups
            if any(w == rank for _, w in group)
        )
        return _RankAllReduce(entries, fallback(self.op, rank))


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
    step = _RankAllReduce(entries, fallback(op, rank))
    return [FastPathStep(Projected(step, rank, (partition.max_worker,)))]


# -- all-reduce under a worker map ---------------------------------------------------------------
@dataclass
class _RankMappedAllReduce(RankStep):
    """One rank's part of an all-reduce under a worker map: per group it holds a member of (in
    the global order of the groups), its members' blocks and the distinct ranks of the group.
    The rank sums its own members locally, ``Allreduce`` runs on the sub-communicator of the
    distinct ranks (none when the group lives on this rank alone), and the sum is copied back
    into every member it holds."""

    entries: tuple[tuple[tuple[str, ...], tuple[int, ...]], ...]
    fallback: Any

    def run(self, work: Workspace, comm: Intracomm, dtype: np.dtype) -> None:
        if dtype.char not in REDUCIBLE:
            run_schedule(self.fallback(), work, comm, dtype)
            return
        for names, ranks in self.entries:  # blocking, in the global order of the groups
            arrays = [contiguous_owned(work, name, dtype) for name in names]
            _reduce_members(arrays, ranks, comm, dtype)()

    def written(self) -> tuple[str, ...]:
        return tuple(name for names, _ in self.entries for name in names)

    def persistent(
        self, arrays: dict[str, np.ndarray], comm: Intracomm, dtype: np.dtype, *, dry: bool = False
    ) -> Persistent | None:
        """The local sums, blocking ``Allreduce`` calls and copies on the caller's arrays, in
        order (as one finishing action per group), or None for dtypes MPI cannot sum."""
        if dtype.char not in REDUCIBLE or any(
            not arrays[name].flags.c_contiguous for names, _ in self.entries for name in names
        ):
            return None
        if dry:
            return Persistent()
        finish = [
            _reduce_members([arrays[n] for n in names], ranks, comm, dtype) for names, ranks in self.entries
        ]
        return Persistent([], finish)


def _reduce_members(
    arrays: list[np.ndarray], ranks: tuple[int, ...], comm: Intracomm, dtype: np.dtype
) -> Any:
    """The action summing ``arrays`` (one rank's members of a group) into the first, then over
    ``ranks`` (its sub-communicator, when more than this rank), then copying the sum back."""
    total, others = arrays[0], arrays[1:]
    sub = subcommunicator(comm, ranks) if len(ranks) > 1 else None
    lib = mpi()
    mpi_type = predefined_type(dtype)

    def reduce() -> None:
        for other in others:
            np.add(total, other, out=total)
        if sub is not None:
            sub.Allreduce(lib.IN_PLACE, [total, mpi_type], op=lib.SUM)
        for other in others:
            np.copyto(other, total)

    return reduce


@dataclass
class _MappedAllReduceRunner:
    """The global all-reduce step under a worker map (:func:`~linop.program.lower_portable`):
    projected onto a rank through the map (``project_mapped``)."""

    op: AllReduce
    workers: tuple[int, ...] = field(default=())

    def project(self, rank: int) -> RankStep:  # pragma: no cover - only projected under a map
        raise ValueError("a mapped all-reduce is projected under its map")

    def project_mapped(self, rank: int, mapping: Any) -> _RankMappedAllReduce | None:
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

        return _RankMappedAllReduce(tuple(entries), functools.lru_cache(maxsize=1)(fallback))


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
