"""One rank's program for the torch.distributed executor: native or portable.

Both come from the distributed program of :mod:`linop.backends.mpi_schedule`:

- **native** (the world group only): the global program with its fast paths
  (:func:`~linop.backends.mpi_schedule.compile_program`, the same on every rank), used when
  every fast path in it is an all-reduce, broadcast or sum-reduce. Each becomes one
  ``torch.distributed`` collective per group of ranks (:class:`AllReduceStep`,
  :class:`BroadcastStep`) on a sub-group; the ordered list of those groups' rank sets
  (:attr:`Compiled.rank_sets`) is what every rank creates, in that order, after the entry check
  (``new_group`` is collective over the world group);
- **portable** otherwise (halo exchanges, repartitions, scatters, gathers, any tree; any
  group; any worker-to-rank map): the program lowered without fast paths
  (:func:`~linop.backends.mpi_schedule.lower_portable`) and projected onto the rank by
  :mod:`linop.backends.mpi_mapping`: local steps, point-to-point phases (one
  ``batch_isend_irecv`` each) and local moves between two workers of one rank. It is exact for
  every tree.

The choice depends only on the tree and the group (and, for sums, the agreed run dtype), so
every rank makes it alike.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ...errors import LinopError, UnsupportedNodeError
from ...operator import LinearOperator
from ...space import Block
from .. import mpi_fastpaths
from ..mpi_mapping import WorkerMap, compiled_for
from ..mpi_schedule import Branches, FastPathStep, RankBranches, RankProgram, compile_program

__all__ = ["AllReduceStep", "BroadcastStep", "Compiled", "SUMMABLE", "native_program", "portable_program"]

SUMMABLE = "bBhilqfdFD"
"""Dtypes (numpy type characters) that the native sums use (gloo and NCCL add them); a run
in another dtype takes the portable program."""


@dataclass(frozen=True)
class AllReduceStep:
    """One rank's part of an all-reduce: ``all_reduce`` (sum, in place) of ``(block, world
    ranks of its group)`` per group it belongs to, in the global order of the groups."""

    entries: tuple[tuple[str, tuple[int, ...]], ...]


@dataclass(frozen=True)
class BroadcastStep:
    """One rank's part of a broadcast (``reduce=False``) or sum-reduce (``reduce=True``): per
    group (``ranks[0]`` the root, whole blocks), a ``broadcast`` from the root's block into new
    blocks of the copies, or a ``reduce`` of the copies into a new root block; then the blocks
    the node drops are dropped and those it creates but no group fills are zeros."""

    groups: tuple[Any, ...]  # mpi_fastpaths._Group: root_name, shape, ranks, copies
    rank: int
    dropped: tuple[str, ...]
    created: tuple[Block, ...]
    reduce: bool


_NATIVE_RUNNERS = (mpi_fastpaths._AllReduceRunner, mpi_fastpaths._BroadcastRunner)


def _rank_sets(steps: Iterable[Any], found: list[tuple[int, ...]]) -> bool:
    """Collect the rank sets of the native collectives in program order; False when a fast
    path other than an all-reduce, broadcast or sum-reduce occurs."""
    for step in steps:
        if isinstance(step, Branches):
            for term in step.terms:
                if not _rank_sets(term, found):
                    return False
        elif isinstance(step, FastPathStep):
            runner = step.runner
            if not isinstance(runner, _NATIVE_RUNNERS):
                return False
            if isinstance(runner, mpi_fastpaths._AllReduceRunner):
                sets = [tuple(w for _, w in group) for group in runner.groups]
            else:
                sets = [group.ranks for group in runner.groups]
            for ranks in sets:
                key = tuple(sorted(ranks))
                if len(key) > 1 and key not in found:
                    found.append(key)
    return True


def _translate(schedule: Iterable[Any]) -> tuple[Any, ...]:
    out: list[Any] = []
    for step in schedule:
        if isinstance(step, mpi_fastpaths._RankAllReduce):
            out.append(AllReduceStep(step.entries))
        elif isinstance(step, mpi_fastpaths._RankBroadcast):
            out.append(BroadcastStep(step.groups, step.rank, step.dropped, step.created, step.reduce))
        elif isinstance(step, RankBranches):
            out.append(RankBranches(tuple(_translate(term) for term in step.terms), step.names))
        else:
            out.append(step)
    return tuple(out)


def native_program(op: LinearOperator, rank: int) -> tuple[RankProgram, tuple[tuple[int, ...], ...]] | None:
    """``rank``'s native program and the rank sets of its collectives (every rank's, in the
    global order), or None when the tree has a fast path without a native torch collective."""
    program = compile_program(op)
    found: list[tuple[int, ...]] = []
    if not _rank_sets(program.steps, found):
        return None
    schedule = _translate(program.for_rank(rank))
    return RankProgram(schedule, program.alphas, program.max_worker), tuple(found)


def portable_program(
    op: LinearOperator, mapping: WorkerMap, rank: int, size: int
) -> tuple[RankProgram | None, LinopError | None]:
    """``rank``'s portable program under ``mapping`` on ``size`` ranks, or the error to raise
    on every rank (a worker unmapped or beyond the group)."""
    return compiled_for(op, mapping).for_rank(rank, size)


class Compiled:
    """A tree's programs for one rank of a group of ``size`` ranks (see the module docstring):
    the native one (None when the tree or group does not allow it) and the portable one
    (built on first use), or the error compiling raised.

    Attributes
    ----------
    max_worker : int
        The largest worker the tree names (the group must have more ranks).
    rank_sets : tuple of tuple of int
        The world ranks of every native collective's group, in the global program's order.
    """

    def __init__(self, op: LinearOperator, rank: int, size: int, *, world: bool) -> None:
        self.op, self.rank, self.size = op, rank, size
        self.native: RankProgram | None = None
        self.rank_sets: tuple[tuple[int, ...], ...] = ()
        self.problem: LinopError | None = None
        self._portable: RankProgram | None = None
        self.max_worker = max(op.domain.max_worker, op.range.max_worker)
        try:
            if world:
                found = native_program(op, rank)
                if found is not None:
                    self.native, self.rank_sets = found
                    self.max_worker = max(self.max_worker, self.native.max_worker)
            if self.native is None:
                mapped = compiled_for(op, WorkerMap(list(range(size))))
                if mapped.error is not None:
                    raise mapped.error
                self.max_worker = max([self.max_worker, *mapped.workers])
        except Exception as error:  # raised collectively by the entry check
            self.problem = (
                error
                if isinstance(error, LinopError)
                else UnsupportedNodeError(
                    f"the torch.distributed executor cannot compile {op}: {type(error).__name__}: {error}"
                )
            )

    def portable(self) -> RankProgram:
        """The portable program (worker ``w`` on rank ``w``; the group covers the workers)."""
        if self._portable is None:
            program, problem = portable_program(
                self.op, WorkerMap(list(range(self.size))), self.rank, self.size
            )
            if problem is not None:
                raise problem
            assert program is not None
            self._portable = program
        return self._portable
