"""A tree compiled under a worker-to-rank map, per rank, for any executor: :class:`MappedCompiled`.

By default worker ``w`` of a tree runs on rank ``w``. Under a :class:`~linop.program.WorkerMap`
worker ``w`` runs on rank ``mapping.rank_of(w)``: a rank may hold several workers (16 workers on
4 ranks: 4 workers each) or none, and its local state holds the blocks of all its workers.

A rank's schedule is the schedule of the *set* of workers it holds. A tree whose nodes lower
per worker (:func:`~linop.program.lowers_per_worker`: halo exchanges, their shims, local
operators, the overlapped exchange, the collectives and repartitions, and the one-step
primitives, under the algebra) is compiled by each rank from its workers' part only
(:func:`~linop.program.compile_for_rank` with the map, O(their own work)): the messages per
peer, their tags and the local steps of the global projection. Other trees project the global
portable program (:func:`~linop.program.lower_portable`), built once per process:

- a local step runs on the rank holding its worker;
- a transfer between two workers of one rank becomes a local copy, add or move
  (:class:`~linop.program.LocalMoves`, run after the messages of its phase);
- a transfer between workers on two ranks is a message between those ranks, its tag counting
  the earlier messages between the same pair in the global program order.

An executor passes its table of calls (``calls``: a rank's schedule -> the schedule its runtime
runs, e.g. the MPI executor's ``mpi_schedule``) to lower with the fast paths that project under
a map (the mapped parts of :mod:`linop.program.parts`); without one (None) the program has
point-to-point steps only, which every executor runs. The map is part of the fingerprint, so an
executor's entry check fails on every rank alike when the ranks' maps differ.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from typing import Any

from ..errors import LinopError, UnsupportedNodeError
from ..operator import LinearOperator
from ..space import Block, Space
from .batching import batch
from .cache import PlanCache, cache_in
from .compile import RankProgram, compile_for_rank
from .fingerprinting import fingerprint
from .lowering import lower_portable, lowers_per_worker
from .projection import owned_blocks, project
from .steps import Branches, Local, Transfer, ZeroState
from .workers import WorkerMap

__all__ = ["Calls", "MappedCompiled", "compiled_for"]

Calls = Callable[[tuple[Any, ...]], tuple[Any, ...]]
"""An executor's table applied to a rank's schedule: each fast-path part replaced by its calls."""


def _space_workers(space: Space) -> Iterable[int]:
    return (block.worker for block in space.blocks)


def _tree_workers(steps: Iterable[Any], found: set[int]) -> set[int]:
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
                _tree_workers(term, found)
    return found


class MappedCompiled:
    """A tree compiled under one worker map: its fingerprint (the tree's and the map's digest,
    :meth:`~linop.program.WorkerMap.description`: O(1) for a described map) and per rank the
    schedule (or the error compiling or validating raised).

    A tree whose nodes all lower per worker (:func:`~linop.program.lowers_per_worker`) is
    compiled per rank from its workers' part only (:func:`~linop.program.compile_for_rank`
    with the map), and validated against the map from the largest worker it names when the map
    covers ``0 .. n - 1`` on ranks below the group's size; other trees (and other maps) use the
    global portable program, built once per process: :attr:`steps`, :attr:`workers` and
    :attr:`error`, on first use.

    ``calls``: the executor's table (see the module docstring); with it the program keeps the
    fast paths that run under a map, each part replaced by its calls; None: point-to-point
    steps only."""

    def __init__(self, op: LinearOperator, mapping: WorkerMap, *, calls: Calls | None = None) -> None:
        self.op = op
        self.mapping = mapping
        self.calls = calls
        self.tree_fingerprint = fingerprint(op)
        digest = hashlib.blake2b(self.tree_fingerprint + mapping.description(), digest_size=16)
        self.fingerprint = digest.digest()
        self.per_worker = lowers_per_worker(op)
        """Whether each rank compiles its workers' part only (decided from the tree alone)."""
        self._global: tuple[tuple[Any, ...], set[int], LinopError | None] | None = None
        self.ranks: dict[tuple[int, int], tuple[RankProgram | None, LinopError | None]] = {}

    @property
    def native(self) -> bool:
        """Whether the program keeps the fast paths that run under a map (an executor's table)."""
        return self.calls is not None

    def _compiled_globally(self) -> tuple[tuple[Any, ...], set[int], LinopError | None]:
        if self._global is None:
            steps: tuple[Any, ...] = ()
            workers: set[int] = set()
            error: LinopError | None = None
            try:
                lowered = lower_portable(self.op, self.mapping if self.native else None)
                found: set[int] = set(_space_workers(self.op.domain))
                found.update(_space_workers(self.op.range))
                workers = _tree_workers(lowered, found)
                steps = tuple(batch(lowered))
            except Exception as caught:  # raised collectively by the entry check
                error = compile_error(self.op, caught)
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
        """``rank``'s program on a group of ``size`` ranks, or the error to raise."""
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
        """The schedule as the executor runs it: each part replaced by its calls (``calls``);
        a portable schedule (no part in it) as it is."""
        return schedule if self.calls is None else self.calls(schedule)

    def _rank_part(self, rank: int, size: int) -> tuple[RankProgram | None, LinopError | None]:
        """The rank's program compiled from its workers' part (the same schedule)."""
        try:
            program = compile_for_rank(self.op, rank, self.mapping, mapped_fast_paths=self.native)
            program = RankProgram(self._calls(program.schedule), program.max_worker)
        except Exception as caught:  # raised collectively by the entry check
            return None, compile_error(self.op, caught)
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


def compile_error(op: LinearOperator, error: Exception) -> LinopError:
    """``error`` raised compiling ``op``, as the typed error an entry check reports."""
    return (
        error
        if isinstance(error, LinopError)
        else UnsupportedNodeError(
            f"linop cannot compile {op} for distributed runs: {type(error).__name__}: {error}"
        )
    )


_COMPILED: dict[tuple[WorkerMap, Calls | None], PlanCache[MappedCompiled]] = {}
_MAPS_KEPT = 8


def compiled_for(op: LinearOperator, mapping: WorkerMap, *, calls: Calls | None = None) -> MappedCompiled:
    """The compilation of ``op`` under ``mapping`` with the executor's table ``calls`` (None:
    the portable program), kept once per process (a few maps and tables, a few trees each)."""
    cache = cache_in(_COMPILED, (mapping, calls), _MAPS_KEPT)
    return cache.kept(op, lambda: MappedCompiled(op, mapping, calls=calls))
