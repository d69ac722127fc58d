"""Any worker-to-rank map for the MPI interpreter: the schedules of a rank that holds several
workers (the map itself: :class:`~linop.program.WorkerMap`).

By default worker ``w`` of a tree runs on rank ``w``. With a :class:`WorkerMap` (``mapping=``
of :func:`~linop.backends.mpi.apply` and :func:`~linop.backends.mpi.plan_for`)
worker ``w`` runs on rank ``mapping.rank_of(w)``: a rank may hold several workers (16 workers on
4 ranks: 4 workers each) or none, and its local state holds the blocks of all its workers.

A rank's schedule is the schedule of the *set* of workers it holds, projected from the global
program (:func:`compile_mapped`) by :func:`~linop.program.project` under the map:

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
    fingerprint,
    lower_portable,
    owned_blocks,
    project,
)
from ...space import Block, Space
from .context import PlanCache

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
    """A tree compiled under one worker map: its fingerprint (the tree's and the map's), the
    global portable program, the workers it names, and per rank the schedule (or the error
    compiling or validating raised)."""

    def __init__(self, op: LinearOperator, mapping: WorkerMap, *, native: bool = True) -> None:
        self.op = op
        self.mapping = mapping
        self.tree_fingerprint = fingerprint(op)
        digest = hashlib.blake2b(self.tree_fingerprint + mapping.description(), digest_size=16)
        self.fingerprint = digest.digest()
        self.steps: tuple[Any, ...] = ()
        self.workers: set[int] = set()
        self.error: LinopError | None = None
        try:
            # native: the MPI fast paths that run under a map (another engine takes none)
            lowered = lower_portable(op, mapping if native else None)
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
                schedule = project(self.steps, rank, self.mapping)
                program = RankProgram(schedule, max(self.workers, default=0))
            found = self.ranks[key] = (program, problem)
        return found

    def domain_blocks(self, rank: int) -> dict[str, Block]:
        """The domain blocks ``rank`` holds (of all its workers), in domain order."""
        return {b.name: b for b in owned_blocks(self.op.domain, rank, self.mapping)}

    def range_names(self, rank: int) -> tuple[str, ...]:
        """The names of the range blocks ``rank`` holds, in range order."""
        return tuple(b.name for b in owned_blocks(self.op.range, rank, self.mapping))


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
