"""Any worker-to-rank map for the MPI interpreter: :class:`WorkerMap` and the schedules of a
rank that holds several workers.

By default worker ``w`` of a tree runs on rank ``w``. With a :class:`WorkerMap` (``mapping=``
of :func:`~linop.backends.mpi_backend.apply` and :func:`~linop.backends.mpi_backend.plan_for`)
worker ``w`` runs on rank ``mapping.rank_of(w)``: a rank may hold several workers (16 workers on
4 ranks: 4 workers each) or none, and its local state holds the blocks of all its workers.

A rank's schedule is the schedule of the *set* of workers it holds, projected from the global
program (:func:`compile_mapped`):

- the program is lowered without fast paths (:func:`~linop.backends.mpi_schedule.lower_portable`):
  halo exchanges, collectives and repartitions run their point-to-point expansion, whose steps
  name workers only (the fast paths assume worker == rank: native collectives on groups of
  ranks, one message per pair of workers). Correctness first: a collective whose group
  collapses onto fewer ranks runs as its expansion's transfers;
- a local step runs on the rank holding its worker;
- a transfer between two workers of one rank becomes a local copy, add or move
  (:class:`LocalMoves`, run after the messages of its phase: the transfers of a phase do not
  conflict, so their order is free);
- a transfer between workers on two ranks is a message between those ranks. Its tag counts the
  earlier messages between the same (source rank, destination rank) pair in the global program
  order, which both ends see, so the tags are unique and agreed.

Phases are the global program's phases, each rank running its part of them in program order,
so the schedules cannot deadlock (the earliest unfinished phase has every message posted on
both ends). The map is part of the tree's fingerprint: the entry check fails on every rank
alike when the ranks' maps differ (:class:`~linop.errors.WorkerMapMismatchError`), and when a
worker of the tree is unmapped or mapped to a rank the communicator does not have
(:class:`~linop.errors.WorkerMapError`). See ``docs/theory.md#distributed-primitives``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import LinopError, UnsupportedNodeError, WorkerMapError
from ..operator import LinearOperator
from ..space import Block, Space
from .mpi_context import PlanCache
from .mpi_schedule import (
    TAG_LIMIT,
    Branches,
    FastPathStep,
    Local,
    Phase,
    RankBranches,
    RankPhase,
    RankProgram,
    RankZero,
    Scale,
    Transfer,
    ZeroState,
    batch,
    fingerprint,
    lower_portable,
)

__all__ = ["WorkerMap", "LocalMoves", "MappedCompiled", "compile_mapped", "compiled_for", "run_local_moves"]


MAX_MAP_WORKERS = 1 << 24
"""The most workers :meth:`WorkerMap.round_robin` and :meth:`WorkerMap.blocked` build a map
for: a map is an explicit table, one entry per worker."""


def _counts(how: str, workers: object, ranks: object) -> tuple[int, int]:
    if not _natural(workers):
        raise WorkerMapError(f"WorkerMap.{how}: workers must be a non-negative integer, not {workers!r}")
    if int(workers) > MAX_MAP_WORKERS:  # type: ignore[call-overload]
        raise WorkerMapError(
            f"WorkerMap.{how}: {workers} workers is more than an explicit map holds "
            f"(at most MAX_MAP_WORKERS = {MAX_MAP_WORKERS})"
        )
    if not _natural(ranks) or int(ranks) < 1:  # type: ignore[call-overload]
        raise WorkerMapError(f"WorkerMap.{how}: ranks must be a positive integer, not {ranks!r}")
    return int(workers), int(ranks)  # type: ignore[call-overload]


class WorkerMap:
    """Which rank runs each worker of a tree: ``rank_of(w)``.

    Parameters
    ----------
    ranks : sequence of int (a 1-D numpy array included), or mapping of int to int
        ``ranks[w]`` is the rank of worker ``w`` (a sequence covers workers ``0 .. len - 1``;
        a mapping names its workers).

    Raises
    ------
    WorkerMapError
        A worker or rank that is not a non-negative integer (the message names the worker).

    Examples
    --------
    >>> WorkerMap.blocked(16, 4).workers_on(1)
    (4, 5, 6, 7)
    >>> WorkerMap.round_robin(16, 4).workers_on(1)
    (1, 5, 9, 13)
    """

    __slots__ = ("_by_rank", "_hash", "_pairs", "_ranks")

    def __init__(self, ranks: Sequence[int] | Mapping[int, int]) -> None:
        if isinstance(ranks, np.ndarray):  # a numpy array of ranks is a sequence of ranks too
            if ranks.ndim != 1:
                raise WorkerMapError(
                    f"a worker map given as an array must be 1-D (rank of worker w at index w), not of "
                    f"shape {ranks.shape}"
                )
            ranks = ranks.tolist()
        if isinstance(ranks, Mapping):
            items = list(ranks.items())
        elif isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence):
            raise WorkerMapError(
                f"a worker map is a sequence (rank of worker w at index w) or a dict of worker to rank, "
                f"not {type(ranks).__name__}"
            )
        else:
            items = list(enumerate(ranks))
        table: dict[int, int] = {}
        for worker, rank in items:
            if not _natural(worker):
                raise WorkerMapError(f"worker map: worker {worker!r} is not a non-negative integer")
            if not _natural(rank):
                raise WorkerMapError(f"worker map: worker {worker} maps to {rank!r}, not a non-negative rank")
            table[int(worker)] = int(rank)
        self._ranks = table
        self._pairs = tuple(sorted(table.items()))
        by_rank: dict[int, list[int]] = {}
        for worker, rank in self._pairs:
            by_rank.setdefault(rank, []).append(worker)
        self._by_rank = {rank: tuple(workers) for rank, workers in by_rank.items()}
        self._hash = hash(self._pairs)

    @classmethod
    def of(cls, mapping: WorkerMap | Sequence[int] | Mapping[int, int]) -> WorkerMap:
        """``mapping`` as a :class:`WorkerMap` (itself when it is one)."""
        return mapping if isinstance(mapping, WorkerMap) else cls(mapping)

    @classmethod
    def round_robin(cls, workers: int, ranks: int) -> WorkerMap:
        """Worker ``w`` on rank ``w % ranks``.

        Raises
        ------
        WorkerMapError
            ``workers`` is not a non-negative integer (at most :data:`MAX_MAP_WORKERS`) or
            ``ranks`` not a positive one.
        """
        workers, ranks = _counts("round_robin", workers, ranks)
        return cls([w % ranks for w in range(workers)])

    @classmethod
    def blocked(cls, workers: int, ranks: int) -> WorkerMap:
        """Consecutive workers together: worker ``w`` on rank ``w * ranks // workers``.

        Raises
        ------
        WorkerMapError
            ``workers`` is not a non-negative integer (at most :data:`MAX_MAP_WORKERS`) or
            ``ranks`` not a positive one.
        """
        workers, ranks = _counts("blocked", workers, ranks)
        return cls([w * ranks // workers for w in range(workers)])

    def rank_of(self, worker: int) -> int:
        """The rank of ``worker``.

        Raises
        ------
        WorkerMapError
            ``worker`` is not mapped.
        """
        rank = self._ranks.get(worker)
        if rank is None:
            raise WorkerMapError(f"worker {worker} of the tree is not in the worker map")
        return rank

    def workers_on(self, rank: int) -> tuple[int, ...]:
        """The workers that ``rank`` holds, in increasing order."""
        return self._by_rank.get(rank, ())

    @property
    def pairs(self) -> tuple[tuple[int, int], ...]:
        """(worker, rank) for every mapped worker, by worker."""
        return self._pairs

    def description(self) -> bytes:
        """The map as bytes (part of the tree's fingerprint under this map)."""
        return b"M" + np.asarray(self._pairs, dtype=np.int64).tobytes()

    def problem(self, workers: Iterable[int], size: int) -> WorkerMapError | None:
        """What is wrong with this map for a tree naming ``workers`` on ``size`` ranks (the
        smallest worker at fault is named), or None."""
        for worker in sorted(set(workers)):
            rank = self._ranks.get(worker)
            if rank is None:
                return WorkerMapError(f"worker {worker} of the tree is not in the worker map")
            if rank >= size:
                return WorkerMapError(
                    f"the worker map puts worker {worker} on rank {rank}, but the communicator has "
                    f"{size} rank(s)"
                )
        return None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WorkerMap) and self._pairs == other._pairs

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"WorkerMap({dict(self._pairs)!r})"


def _natural(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and bool(value >= 0)


@dataclass(frozen=True, slots=True)
class LocalMoves:
    """Transfers between two workers of one rank, run as local copies, adds or moves
    (:func:`run_local_moves`) with a transfer's semantics: ``target`` gets (``"new"``,
    ``"store"``) or adds (``"add"``) ``source`` in the run's dtype; then ``source`` is kept,
    cleared or dropped."""

    transfers: tuple[Transfer, ...]


def run_local_moves(step: LocalMoves, work: Any, dtype: np.dtype) -> None:
    """Run ``step`` on the workspace ``work`` (a :class:`~linop.backends.numpy_backend.Workspace`)."""
    for t in step.transfers:
        source_index = (*t.source.index, Ellipsis)
        data = work.arrays[t.source.name][source_index]
        if t.mode == "new":
            work.set(t.target.name, np.array(data, dtype=dtype))
        else:
            target_index = (*t.target.index, Ellipsis)  # type: ignore[union-attr]
            target = work.writable(t.target.name, dtype)
            if t.mode == "add":
                target[target_index] += data
            else:
                target[target_index] = data
        if t.after == "clear":
            if t.source.size:
                work.writable(t.source.name)[source_index] = 0
        elif t.after == "drop":
            work.drop(t.source.name)


def _space_workers(space: Space) -> Iterable[int]:
    return (block.worker for block in space.blocks)


def _tree_workers(op: LinearOperator, steps: Iterable[Any], found: set[int]) -> set[int]:
    """Every worker the program names (its spaces' blocks, local steps, transfers' ends)."""
    for step in steps:
        if isinstance(step, Local):
            found.add(step.worker)
        elif isinstance(step, Transfer):
            found.add(step.src_worker)
            found.add(step.dst_worker)
        elif isinstance(step, ZeroState):
            found.update(_space_workers(step.space))
        elif isinstance(step, Branches):
            found.update(_space_workers(step.space))
            for term in step.terms:
                _tree_workers(op, term, found)
    return found


def _owned(space: Space, mapping: WorkerMap, rank: int) -> tuple[Block, ...]:
    mine = set(mapping.workers_on(rank))
    return tuple(block for block in space.blocks if block.worker in mine)


def project_mapped(steps: Iterable[Any], mapping: WorkerMap, rank: int) -> tuple[Any, ...]:
    """``rank``'s schedule of a batched portable program under ``mapping`` (see the module
    docstring): its workers' local steps, its messages with tags counted per pair of ranks in
    program order, and its transfers between its own workers as :class:`LocalMoves`."""
    return _project(steps, mapping, rank, {})


def _project(
    steps: Iterable[Any], mapping: WorkerMap, rank: int, counts: dict[tuple[int, int], int]
) -> tuple[Any, ...]:
    out: list[Any] = []
    rank_of = mapping.rank_of
    for step in steps:
        if isinstance(step, Local):
            if rank_of(step.worker) == rank:
                out.append(step.node)
        elif isinstance(step, (Phase, Transfer)):
            receives, sends, local = [], [], []
            for t in step.transfers if isinstance(step, Phase) else (step,):
                src, dst = rank_of(t.src_worker), rank_of(t.dst_worker)
                if src == dst:
                    if src == rank:
                        local.append(t)
                    continue
                pair = (src, dst)
                count = counts.get(pair, 0)
                counts[pair] = count + 1
                if dst == rank:
                    receives.append((src, count % TAG_LIMIT, t))
                elif src == rank:
                    sends.append((dst, count % TAG_LIMIT, t))
            if receives or sends:
                out.append(RankPhase(tuple(receives), tuple(sends)))
            if local:
                out.append(LocalMoves(tuple(local)))
        elif isinstance(step, Scale):
            out.append(step)
        elif isinstance(step, ZeroState):
            out.append(RankZero(_owned(step.space, mapping, rank)))
        elif isinstance(step, Branches):
            names = tuple(b.name for b in _owned(step.space, mapping, rank))
            terms = tuple(_project(term, mapping, rank, counts) for term in step.terms)
            out.append(RankBranches(terms, names))
        elif isinstance(step, FastPathStep):  # pragma: no cover - lower_portable declines them
            raise UnsupportedNodeError(f"a fast-path step {step!r} cannot run under a worker map")
        else:  # pragma: no cover - lowering emits nothing else
            raise TypeError(f"unknown step {step!r}")
    return tuple(out)


class MappedCompiled:
    """A tree compiled under one worker map: its fingerprint (the tree's and the map's), the
    global portable program, the workers it names, and per rank the schedule (or the error
    compiling or validating raised)."""

    def __init__(self, op: LinearOperator, mapping: WorkerMap) -> None:
        self.op = op
        self.mapping = mapping
        self.tree_fingerprint = fingerprint(op)
        digest = hashlib.blake2b(self.tree_fingerprint + mapping.description(), digest_size=16)
        self.fingerprint = digest.digest()
        self.steps: tuple[Any, ...] = ()
        self.workers: set[int] = set()
        self.error: LinopError | None = None
        try:
            lowered = lower_portable(op)
            found: set[int] = set(_space_workers(op.domain))
            found.update(_space_workers(op.range))
            self.workers = _tree_workers(op, lowered, found)
            self.steps = tuple(batch(lowered))
        except Exception as error:  # raised collectively by the entry check
            self.error = (
                error
                if isinstance(error, LinopError)
                else UnsupportedNodeError(
                    f"the MPI interpreter cannot compile {op}: {type(error).__name__}: {error}"
                )
            )
        self.ranks: dict[tuple[int, int], tuple[RankProgram | None, LinopError | None]] = {}

    def for_rank(self, rank: int, size: int) -> tuple[RankProgram | None, LinopError | None]:
        """``rank``'s program on a communicator of ``size`` ranks, or the error to raise."""
        key = (rank, size)
        found = self.ranks.get(key)
        if found is None:
            problem = self.error or self.mapping.problem(self.workers, size)
            program = None
            if problem is None:
                schedule = project_mapped(self.steps, self.mapping, rank)
                program = RankProgram(schedule, (), max(self.workers, default=0))
            found = self.ranks[key] = (program, problem)
        return found

    def domain_blocks(self, rank: int) -> dict[str, Block]:
        """The domain blocks ``rank`` holds (of all its workers), in domain order."""
        return {b.name: b for b in _owned(self.op.domain, self.mapping, rank)}

    def range_names(self, rank: int) -> tuple[str, ...]:
        """The names of the range blocks ``rank`` holds, in range order."""
        return tuple(b.name for b in _owned(self.op.range, self.mapping, rank))


_COMPILED: dict[WorkerMap, PlanCache[MappedCompiled]] = {}
_MAPS_KEPT = 8


def compiled_for(op: LinearOperator, mapping: WorkerMap) -> MappedCompiled:
    """The compilation of ``op`` under ``mapping``, kept once per process (a few maps, a few
    trees each)."""
    cache = _COMPILED.get(mapping)
    if cache is None:
        if len(_COMPILED) >= _MAPS_KEPT:
            _COMPILED.pop(next(iter(_COMPILED)))
        cache = _COMPILED[mapping] = PlanCache()
    found = cache.get(op)
    if found is None:
        found = cache.put(op, MappedCompiled(op, mapping))
    return found


def compile_mapped(op: LinearOperator, mapping: WorkerMap, rank: int, size: int) -> RankProgram:
    """``rank``'s program of ``op`` under ``mapping`` on ``size`` ranks.

    Raises
    ------
    WorkerMapError
        A worker of the tree is unmapped or on a rank ``>= size``.
    """
    program, problem = compiled_for(op, mapping).for_rank(rank, size)
    if problem is not None:
        raise problem
    assert program is not None
    return program
