"""Whole programs: a tree lowered, batched and (for one rank) projected.

:func:`compile_program` gives the global :class:`Program` (for inspection, accounting, plots,
and the projection of every rank); :func:`compile_for_rank` gives one rank's
:class:`RankProgram` without building the global program, in O(the rank's own work) for the
halo exchange, its shims and the collectives' fast paths (``docs/theory.md#cost-model``).
The two run together: the messages between two ranks and their tags are the same. Under a
worker map, :func:`compile_for_rank` lowers only the rank's workers' part
(:func:`~linop.program.lowering.lower_for_workers`, O(their own work)) of a tree whose nodes
lower per worker (:func:`~linop.program.lowering.lowers_per_worker`); other trees are projected
from the global portable program (:func:`mapped_global_program`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import RankError
from ..operator import LinearOperator
from .batching import batch
from .lowering import lower, lower_for, lower_for_workers, lower_portable, lowers_per_worker, workers_named
from .projection import project
from .steps import FastPathStep, Phase, ScheduleStep, Step
from .workers import WorkerMap

__all__ = ["Program", "RankProgram", "compile_program", "compile_for_rank", "mapped_global_program"]


@dataclass(frozen=True)
class Program:
    """A compiled tree: its global batched steps and the largest worker it names."""

    steps: tuple[Step, ...]
    max_worker: int

    def for_rank(self, rank: int, mapping: WorkerMap | None = None) -> tuple[ScheduleStep, ...]:
        """The rank's schedule (:func:`~linop.program.projection.project`)."""
        return project(self.steps, rank, mapping)

    @property
    def phases(self) -> int:
        """Number of communication phases and fast-path steps at the top level (sums not counted)."""
        return sum(isinstance(s, (Phase, FastPathStep)) for s in self.steps)


@dataclass(frozen=True)
class RankProgram:
    """One rank's compiled tree: its schedule and the largest worker the whole tree names
    (:func:`compile_for_rank`)."""

    schedule: tuple[ScheduleStep, ...]
    max_worker: int


def _require_rank(rank: object, size: object) -> None:
    """``rank`` a non-negative integer (below ``size`` when given)."""
    if size is not None and (
        isinstance(size, bool) or not isinstance(size, (int, np.integer)) or int(size) < 1
    ):
        raise RankError(f"compile_for_rank: size must be a positive number of ranks, not {size!r}")
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank < 0:
        raise RankError(f"compile_for_rank: rank must be a non-negative integer, not {rank!r}")
    if size is not None and rank >= size:
        raise RankError(
            f"compile_for_rank: rank {rank} is not one of the {size} rank(s) 0 .. {int(size) - 1}"
        )


def compile_for_rank(
    op: LinearOperator,
    rank: int,
    mapping: WorkerMap | None = None,
    *,
    mapped_fast_paths: bool = True,
    size: int | None = None,
) -> RankProgram:
    """``rank``'s schedule of ``op``: its own steps lowered
    (:func:`~linop.program.lowering.lower_for`), batched and projected, without the global
    program. Runs with the schedules other ranks compile from the global program
    (:meth:`Program.for_rank`) and with each other: the messages between two ranks and their
    tags are the same.

    Under ``mapping`` the steps of the workers the map puts on ``rank`` are lowered portably
    (:func:`~linop.program.lowering.lower_for_workers`), batched and projected under the map:
    the messages per peer, their tags and the local steps of the global portable program's
    projection (:func:`mapped_global_program`), since each pair of ranks sees the transfers
    between their workers in global program order. The phases are the same for one exchange;
    with several, a rank may group its messages into fewer phases (a conflict between other
    ranks' steps splits a global phase), which the executor contract allows.
    ``mapped_fast_paths``: lower with the fast paths that project under a map (the
    ``mapping`` given to :func:`~linop.program.lowering.lower_portable`); False for none.
    Collectives and repartitions lower per worker too (their mapped fast paths project the
    groups of the rank's workers; their expansions are built from the pieces of its workers'
    blocks, :mod:`~linop.program.lowering_pieces`). A tree with a node that does not lower
    per worker (:func:`~linop.program.lowering.lowers_per_worker`) takes the global route,
    :func:`mapped_global_program`.

    ``size`` (optional): the number of ranks, when the caller knows it; ``rank`` must then be
    below it. A rank beyond every worker is otherwise valid (it holds none: an empty schedule).

    Raises
    ------
    RankError
        ``rank`` is not a non-negative integer (or not below ``size``).
    """
    _require_rank(rank, size)
    rank = int(rank)
    if mapping is None:
        steps, largest = lower_for(op, rank)
    else:
        lowering_map = mapping if mapped_fast_paths else None
        if not lowers_per_worker(op):  # the global route (the same decision on every rank)
            return mapped_global_program(op, rank, mapping, mapped_fast_paths=mapped_fast_paths)
        steps, largest = lower_for_workers(op, mapping.workers_on(rank), lowering_map)
    batched = batch(steps)
    workers = (op.domain.max_worker, op.range.max_worker, largest)
    return RankProgram(project(batched, rank, mapping), max(workers))


def mapped_global_program(
    op: LinearOperator, rank: int, mapping: WorkerMap, *, mapped_fast_paths: bool = True
) -> RankProgram:
    """``rank``'s schedule of ``op`` under ``mapping`` projected from the whole portable
    program (O(the tree), on every rank): the route for trees with a node that does not lower
    per worker (:func:`~linop.program.lowering.lowers_per_worker`), and the reference the
    per-worker route equals."""
    lowered = lower_portable(op, mapping if mapped_fast_paths else None)
    workers = [op.domain.max_worker, op.range.max_worker, *workers_named(lowered)]
    return RankProgram(project(batch(lowered), rank, mapping), max(workers))


def compile_program(op: LinearOperator) -> Program:
    """Lower and batch ``op`` (deterministic: the same on every rank)."""
    lowered = lower(op)
    workers = [op.domain.max_worker, op.range.max_worker]
    workers.extend(workers_named(lowered))
    steps = tuple(batch(lowered))
    return Program(steps, max(workers, default=0))
