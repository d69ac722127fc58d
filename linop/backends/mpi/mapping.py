"""Any worker-to-rank map for the MPI interpreter (the map itself:
:class:`~linop.program.WorkerMap`).

By default worker ``w`` of a tree runs on rank ``w``. With a :class:`WorkerMap` (``mapping=``
of :func:`~linop.backends.mpi.apply` and :func:`~linop.backends.mpi.plan_for`) worker ``w``
runs on rank ``mapping.rank_of(w)``: a rank may hold several workers or none, and its local
state holds the blocks of all its workers. A rank's schedule is the program's
(:class:`linop.program.mapped.MappedCompiled`: compiled per rank from its workers' part when
every node lowers per worker, else projected from the global portable program), with the MPI's
table of calls (:func:`~linop.backends.mpi.native.mpi_schedule`): the all-reduce, broadcast and
sum-reduce run one collective over a group's distinct ranks, the rest point to point (a
transfer between two workers of one rank as a local move).

Phases are the global program's phases, each rank running its part of them in program order,
so the schedules cannot deadlock (the earliest unfinished phase has every message posted on
both ends). The map is part of the tree's fingerprint: the entry check fails on every rank
alike when the ranks' maps differ (:class:`~linop.errors.WorkerMapMismatchError`), and when a
worker of the tree is unmapped or mapped to a rank the communicator does not have
(:class:`~linop.errors.WorkerMapError`). See ``docs/theory.md#distributed-primitives``.
"""

from __future__ import annotations

from ...operator import LinearOperator
from ...program import RankProgram, WorkerMap
from ...program.mapped import MappedCompiled
from ...program.mapped import compiled_for as program_compiled_for
from .native import mpi_schedule

__all__ = ["MappedCompiled", "compile_mapped", "compiled_for"]


def compiled_for(op: LinearOperator, mapping: WorkerMap, *, native: bool = True) -> MappedCompiled:
    """The compilation of ``op`` under ``mapping`` (:func:`linop.program.mapped.compiled_for`),
    kept once per process. ``native``: with the MPI fast paths that run under a map (an
    all-reduce's workers on one rank summed locally first), each part turned into its MPI step
    (:func:`~linop.backends.mpi.native.mpi_schedule`); False: the portable program."""
    return program_compiled_for(op, mapping, calls=mpi_schedule if native else None)


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
