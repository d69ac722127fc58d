"""Whole programs: a tree lowered, batched and (for one rank) projected.

:func:`compile_program` gives the global :class:`Program` (for inspection, accounting, plots,
and the projection of every rank); :func:`compile_for_rank` gives one rank's
:class:`RankProgram` without building the global program, in O(the rank's own work) for the
halo exchange, its shims and the collectives' fast paths (``docs/theory.md#cost-model``).
The two run together: the messages between two ranks and their tags are the same.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..operator import LinearOperator
from .batching import batch
from .lowering import lower, lower_for, workers_named
from .projection import project
from .steps import FastPathStep, Phase, ScheduleStep, Step
from .workers import WorkerMap

__all__ = ["Program", "RankProgram", "compile_program", "compile_for_rank"]


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


def compile_for_rank(op: LinearOperator, rank: int) -> RankProgram:
    """``rank``'s schedule of ``op``: its own steps lowered
    (:func:`~linop.program.lowering.lower_for`), batched and projected, without the global
    program. Runs with the schedules other ranks compile from the global program
    (:meth:`Program.for_rank`) and with each other: the messages between two ranks and their
    tags are the same."""
    steps, largest = lower_for(op, rank)
    batched = batch(steps)
    workers = (op.domain.max_worker, op.range.max_worker, largest)
    return RankProgram(project(batched, rank), max(workers))


def compile_program(op: LinearOperator) -> Program:
    """Lower and batch ``op`` (deterministic: the same on every rank)."""
    lowered = lower(op)
    workers = [op.domain.max_worker, op.range.max_worker]
    workers.extend(workers_named(lowered))
    steps = tuple(batch(lowered))
    return Program(steps, max(workers, default=0))
