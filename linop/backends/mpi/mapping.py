"""Any worker-to-rank map for the MPI interpreter: the schedules of a rank that holds several
workers (the map itself: :class:`~linop.program.WorkerMap`).

By default worker ``w`` of a tree runs on rank ``w``. With a :class:`WorkerMap` (``mapping=``
of :func:`~linop.backends.mpi.apply` and :func:`~linop.backends.mpi.plan_for`)
worker ``w`` runs on rank ``mapping.rank_of(w)``: a rank may hold several workers (16 workers on
4 ranks: 4 workers each) or none, and its local state holds the blocks of all its workers.

A rank's schedule is the schedule of the *set* of workers it holds, projected from the global
program (:func:`compile_mapped`) by :func:`~linop.program.project` under the map. A tree whose
nodes lower per worker (:func:`~linop.program.lowers_per_worker`: halo exchanges, their shims,
local operators, the overlapped exchange, the all-reduce, broadcast and sum-reduce, the
repartition, scatter, gather, all-gather and reduce-scatter, and the one-step primitives, under
the algebra) is compiled by each rank from its workers' part only
(:func:`~linop.program.compile_for_rank` with the map, O(their own work; a collective's: the
groups of its workers)): the messages per peer, their tags and the local steps of the global
projection (the same phases too for one exchange; with several, or where the global batching
orders a local step after a phase, a rank may group its steps otherwise, as without a map).
Other trees project the global program, built once per process:

- the program is lowered without fast paths (:func:`~linop.program.lower_portable`):
  halo exchanges, collectives and repartitions run their point-to-point expansion, whose steps
  name workers only (the fast paths assume worker == rank: native collectives on groups of
  ranks, one message per pair of workers). Correctness first: a collective whose group
  collapses onto fewer ranks runs as its expansion's transfers;
- a local step runs on the rank holding its worker;
- a transfer between two workers of one rank becomes a local copy, add or move
  (:class:`~linop.program.LocalMoves`, run after the messages of its phase: the transfers of a phase do not
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
from collections.abc import Iterable
from typing import Any

import numpy as np

from ...errors import LinopError, UnsupportedNodeError
from ...operator import LinearOperator
from ...program import (
    Branches,
    Local,
    LocalMoves,
    RankProgram,
    Transfer,
    WorkerMap,
    ZeroState,
    batch,
    compile_for_rank,
    fingerprint,
    lower_portable,
    lowers_per_worker,
    owned_blocks,
    project,
)
from ...space import Block, Space
from .context import PlanCache
from .native import mpi_schedule

__all__ = ["MappedCompiled", "compile_mapped", "compiled_for", "run_local_moves"]


def run_local_moves(step: LocalMoves, work: Any, dtype: np.dtype) -> None:
    """Run ``step`` on the workspace ``work`` (a :class:`~linop.backends.numpy.Workspace`)."""
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


class MappedCompiled:
    """A tree compiled under one worker map: its fingerprint (the tree's and the map's digest,
    :meth:`~linop.program.WorkerMap.description`: O(1) for a described map) and per rank the
    schedule (or the error compiling or validating raised).

    A tree whose nodes all lower per worker (:func:`~linop.program.lowers_per_worker`) is
    compiled per rank from its workers' part only (:func:`~linop.program.compile_for_rank` with the map), and validated against the map
    from the largest worker it names when the map covers ``0 .. n - 1`` on ranks below the
    communicator's size; other trees (and other maps) use the global portable program, built
    once per process: :attr:`steps`, :attr:`workers` and :attr:`error`, on first use."""

    def __init__(self, op: LinearOperator, mapping: WorkerMap, *, native: bool = True) -> None:
        self.op = op
        self.mapping = mapping
        self.native = native
        self.tree_fingerprint = fingerprint(op)
        digest = hashlib.blake2b(self.tree_fingerprint + mapping.description(), digest_size=16)
        self.fingerprint = digest.digest()
        self.per_worker = lowers_per_worker(op)
        """Whether each rank compiles its workers' part only (decided from the tree alone)."""
        self._global: tuple[tuple[Any, ...], set[int], LinopError | None] | None = None
        self.ranks: dict[tuple[int, int], tuple[RankProgram | None, LinopError | None]] = {}

    def _compiled_globally(self) -> tuple[tuple[Any, ...], set[int], LinopError | None]:
        if self._global is None:
            steps: tuple[Any, ...] = ()
            workers: set[int] = set()
            error: LinopError | None = None
            try:
                # native: the MPI fast paths that run under a map (another engine takes none)
                lowered = lower_portable(self.op, self.mapping if self.native else None)
                found: set[int] = set(_space_workers(self.op.domain))
                found.update(_space_workers(self.op.range))
                workers = _tree_workers(self.op, lowered, found)
                steps = tuple(batch(lowered))
            except Exception as caught:  # raised collectively by the entry check
                error = _compile_error(self.op, caught)
            self._global = (steps, workers, error)
        return self._global

    @property
    def steps(self) -> tuple[Any, ...]:
        """The global portable program, batched."""
        return self._compiled_globally()[0]

    @property
    def workers(self) -> set[int]:
        """Every worker the tree names (of the global portable program)."""
        return self._compiled_globally()[1]

    @property
    def error(self) -> LinopError | None:
        """The error compiling the global portable program raised, or None."""
        return self._compiled_globally()[2]

    def for_rank(self, rank: int, size: int) -> tuple[RankProgram | None, LinopError | None]:
        """``rank``'s program on a communicator of ``size`` ranks, or the error to raise."""
        key = (rank, size)
        found = self.ranks.get(key)
        if found is None:
            found = self.ranks[key] = (
                self._rank_part(rank, size) if self.per_worker else self._projected(rank, size)
            )
        return found

    def _projected(self, rank: int, size: int) -> tuple[RankProgram | None, LinopError | None]:
        """The rank's projection of the global portable program."""
        problem = self.error or self.mapping.problem(self.workers, size)
        if problem is not None:
            return None, problem
        schedule = project(self.steps, rank, self.mapping)
        return RankProgram(self._calls(schedule), max(self.workers, default=0)), None

    def _calls(self, schedule: tuple[Any, ...]) -> tuple[Any, ...]:
        """The schedule as the MPI runtime runs it: with the mapped fast paths (``native``),
        each part replaced by its MPI step (:func:`~linop.backends.mpi.native.mpi_schedule`);
        another engine's portable schedule (no part in it) as it is."""
        return mpi_schedule(schedule) if self.native else schedule

    def _rank_part(self, rank: int, size: int) -> tuple[RankProgram | None, LinopError | None]:
        """The rank's program compiled from its workers' part (the same schedule)."""
        try:
            program = compile_for_rank(self.op, rank, self.mapping, mapped_fast_paths=self.native)
            program = RankProgram(self._calls(program.schedule), program.max_worker)
        except Exception as caught:  # raised collectively by the entry check
            return None, _compile_error(self.op, caught)
        mapping = self.mapping
        if program.max_worker < mapping.dense and mapping.largest_rank < size:
            return program, None  # every worker the tree names is mapped, on a rank below size
        problem = self.error or mapping.problem(self.workers, size)  # which worker: the whole tree
        return (None, problem) if problem is not None else (program, None)

    def domain_blocks(self, rank: int) -> dict[str, Block]:
        """The domain blocks ``rank`` holds (of all its workers), in domain order."""
        return {b.name: b for b in owned_blocks(self.op.domain, rank, self.mapping)}

    def range_names(self, rank: int) -> tuple[str, ...]:
        """The names of the range blocks ``rank`` holds, in range order."""
        return tuple(b.name for b in owned_blocks(self.op.range, rank, self.mapping))


def _compile_error(op: LinearOperator, error: Exception) -> LinopError:
    return (
        error
        if isinstance(error, LinopError)
        else UnsupportedNodeError(f"the MPI interpreter cannot compile {op}: {type(error).__name__}: {error}")
    )


_COMPILED: dict[tuple[WorkerMap, bool], PlanCache[MappedCompiled]] = {}
_MAPS_KEPT = 8


def compiled_for(op: LinearOperator, mapping: WorkerMap, *, native: bool = True) -> MappedCompiled:
    """The compilation of ``op`` under ``mapping``, kept once per process (a few maps, a few
    trees each). ``native``: with the MPI fast paths that run under a map (an all-reduce's
    workers on one rank summed locally first); False for an executor of another engine, whose
    program holds point-to-point steps only."""
    key = (mapping, native)
    cache = _COMPILED.get(key)
    if cache is None:
        if len(_COMPILED) >= _MAPS_KEPT:
            _COMPILED.pop(next(iter(_COMPILED)))
        cache = _COMPILED[key] = PlanCache()
    found = cache.get(op)
    if found is None:
        found = cache.put(op, MappedCompiled(op, mapping, native=native))
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
