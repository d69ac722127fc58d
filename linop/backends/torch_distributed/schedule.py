"""One rank's program for the torch.distributed executor: native or portable.

Both come from the distributed program of :mod:`linop.program`:

- **native** (the world group only): the global program with its fast paths
  (:func:`~linop.program.compile_program`, the same on every rank), used when
  every fast path in it is an all-reduce, broadcast or sum-reduce. Each becomes one
  ``torch.distributed`` collective per group of ranks (:class:`AllReduceStep`,
  :class:`BroadcastStep`) on a sub-group; the ordered list of those groups' rank sets
  (:attr:`Compiled.rank_sets`) is what every rank creates, in that order, after the entry check
  (``new_group`` is collective over the world group);
- **portable** otherwise (halo exchanges, repartitions, scatters, gathers, any tree; any
  group; any worker-to-rank map): the program lowered without fast paths
  (:func:`~linop.program.lower_portable`) and projected onto the rank by
  :mod:`linop.backends.mpi.mapping`: local steps, point-to-point phases (one
  ``batch_isend_irecv`` each) and local moves between two workers of one rank. It is exact for
  every tree.

The choice depends only on the tree and the group (and, for sums, the agreed run dtype), so
every rank makes it alike.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ...collectives import AllReduce, Broadcast, SumReduce
from ...errors import LinopError, UnsupportedNodeError
from ...operator import LinearOperator
from ...program import Branches, FastPathStep, RankProgram, WorkerMap, compile_program, project
from ...space import Block
from ..mpi import fastpaths as mpi_fastpaths  # noqa: F401 - registers the fast paths' lowerings
from ..mpi.mapping import compiled_for

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

    groups: tuple[Any, ...]  # the MPI lowering's groups: root_name, shape, ranks, copies
    rank: int
    dropped: tuple[str, ...]
    created: tuple[Block, ...]
    reduce: bool


@dataclass(frozen=True)
class _AllReduceRunner:
    """The global all-reduce step for torch: its groups ((block, worker) per member)."""

    groups: tuple[tuple[tuple[str, int], ...], ...]
    workers: tuple[int, ...]

    def rank_sets(self) -> list[tuple[int, ...]]:
        return [tuple(w for _, w in group) for group in self.groups]

    def project(self, rank: int) -> AllReduceStep | None:
        entries = tuple(
            (next(name for name, w in group if w == rank), tuple(w for _, w in group))
            for group in self.groups
            if any(w == rank for _, w in group)
        )
        return AllReduceStep(entries) if entries else None


@dataclass(frozen=True)
class _BroadcastRunner:
    """The global broadcast or sum-reduce step for torch: its whole-block groups."""

    op: Broadcast | SumReduce
    groups: tuple[Any, ...]
    workers: tuple[int, ...]

    def rank_sets(self) -> list[tuple[int, ...]]:
        return [tuple(group.ranks) for group in self.groups]

    def project(self, rank: int) -> BroadcastStep | None:
        plan, space = self.op.plan, self.op.domain
        dropped = tuple(n for n in plan.dropped if space.block(n).worker == rank)
        created = tuple(b for b in plan.created if b.worker == rank)
        groups = tuple(g for g in self.groups if rank in g.ranks)
        if not (dropped or created or groups):
            return None
        return BroadcastStep(groups, rank, dropped, created, isinstance(self.op, SumReduce))


def _native(runner: Any) -> Any:
    """The torch runner of an MPI fast path's runner (from its node and groups), or None when
    torch has no native collective for it."""
    op = getattr(runner, "op", None)
    if isinstance(op, AllReduce):
        return _AllReduceRunner(tuple(runner.groups), tuple(runner.workers))
    if isinstance(op, (Broadcast, SumReduce)):
        return _BroadcastRunner(op, tuple(runner.groups), tuple(runner.workers))
    return None


def _replace(steps: Iterable[Any], found: list[tuple[int, ...]]) -> list[Any] | None:
    """The global steps with every fast path replaced by its torch runner, collecting the rank
    sets of their groups in program order; None when some fast path has no native collective."""
    out: list[Any] = []
    for step in steps:
        if isinstance(step, Branches):
            terms = []
            for term in step.terms:
                replaced = _replace(term, found)
                if replaced is None:
                    return None
                terms.append(tuple(replaced))
            out.append(Branches(tuple(terms), step.space))
        elif isinstance(step, FastPathStep):
            runner = _native(step.runner)
            if runner is None:
                return None
            for ranks in runner.rank_sets():
                key = tuple(sorted(ranks))
                if len(key) > 1 and key not in found:
                    found.append(key)
            out.append(FastPathStep(runner))
        else:
            out.append(step)
    return out


def native_program(op: LinearOperator, rank: int) -> tuple[RankProgram, tuple[tuple[int, ...], ...]] | None:
    """``rank``'s native program and the rank sets of its collectives (every rank's, in the
    global order), or None when the tree has a fast path without a native torch collective."""
    program = compile_program(op)
    found: list[tuple[int, ...]] = []
    steps = _replace(program.steps, found)
    if steps is None:
        return None
    return RankProgram(project(steps, rank), program.max_worker), tuple(found)


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
