"""Projection: the steps of a batched program that one rank takes part in, as rank steps.

A program names workers; a rank runs the workers a worker map gives it (by default worker
``w`` on rank ``w``). :func:`project` keeps, for one rank:

- the local steps of its workers (the node, run on the rank's blocks);
- its part of each phase, a :class:`~linop.program.steps.RankPhase`: the messages it receives
  and sends, each with the peer rank and a tag;
- under a map, the transfers between two of its own workers as a
  :class:`~linop.program.steps.LocalMoves` (run after the messages of its phase: the transfers
  of a phase do not conflict, so their order is free);
- scales, its blocks of a zero state, each term of a sum projected;
- its part of a fast-path step (under a map, only of a step whose runner projects under one:
  ``project_mapped(rank, mapping)``).
- a phase with local work in flight (:attr:`~linop.program.steps.Phase.during`) as a
  :class:`~linop.program.steps.RankOverlap`: its part of the phase and its workers' nodes.

A message's tag counts the earlier messages between the same (source rank, destination rank)
pair in program order (modulo :data:`TAG_LIMIT`), so both ends derive it from the transfers
they take part in, however each groups its transfers into phases.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..errors import UnsupportedNodeError
from ..pieces import JoinedSpace
from ..space import Block, GridSpace, Space, natural_key
from .steps import (
    Branches,
    FastPathStep,
    Local,
    LocalMoves,
    Phase,
    RankBranches,
    RankOverlap,
    RankPhase,
    RankZero,
    Scale,
    ScheduleStep,
    Step,
    Transfer,
    ZeroState,
)
from .workers import WorkerMap

__all__ = ["TAG_LIMIT", "project", "owned_blocks"]

TAG_LIMIT = 32767
"""The largest tag MPI guarantees; tags repeat beyond it, which the messages' ordering (the
non-overtaking rule of MPI, of TCP and of every executor's point-to-point channel) makes safe."""


def owned_blocks(space: Space, rank: int, mapping: WorkerMap | None = None) -> tuple[Block, ...]:
    """The blocks of ``space`` that ``rank`` holds (of all its workers under ``mapping``)."""
    if mapping is None:
        return space.owned(rank)
    workers = mapping.workers_on(rank)
    if isinstance(space, GridSpace):  # one block per worker of a partition: its own, in grid order
        position = space.partition.position
        mine = sorted((p, w) for w in workers if (p := position(w)) is not None)
        return tuple(block for _, w in mine for block in space.owned(w))
    if isinstance(space, JoinedSpace):  # described parts: each worker's blocks asked for alone
        found = {block.name: block for w in workers for block in space.owned(w)}
        return tuple(sorted(found.values(), key=lambda block: natural_key(block.name)))
    held = set(workers)
    return tuple(block for block in space.blocks if block.worker in held)


def project(steps: Iterable[Step], rank: int, mapping: WorkerMap | None = None) -> tuple[ScheduleStep, ...]:
    """The steps of a batched program that ``rank`` takes part in (see the module docstring).

    Parameters
    ----------
    steps : iterable of Step
        A batched program: the global one, or the rank's own from
        :func:`~linop.program.lowering.lower_for` batched (the same messages with the same tags).
    rank : int
        The rank.
    mapping : WorkerMap, optional
        Which rank runs each worker; None (the default) is the identity map, worker ``w`` on
        rank ``w``.

    Raises
    ------
    UnsupportedNodeError
        Under a map, a fast-path step whose runner does not project under one (lower with
        :func:`~linop.program.lowering.lower_portable`).
    """
    return _project(steps, rank, mapping, {})


def _project(
    steps: Iterable[Step], rank: int, mapping: WorkerMap | None, counts: dict[tuple[int, int], int]
) -> tuple[ScheduleStep, ...]:
    out: list[ScheduleStep] = []
    rank_of = None if mapping is None else _remembered(mapping.rank_of)
    for step in steps:
        if isinstance(step, Local):
            if (step.worker if rank_of is None else rank_of(step.worker)) == rank:
                out.append(step.node)
        elif isinstance(step, (Phase, Transfer)):
            receives, sends, local = [], [], []
            for t in step.transfers if isinstance(step, Phase) else (step,):
                if rank_of is None:
                    src, dst = t.src_worker, t.dst_worker
                else:
                    src, dst = rank_of(t.src_worker), rank_of(t.dst_worker)
                    if src == dst:
                        if src == rank:
                            local.append(t)
                        continue
                if src != rank and dst != rank:
                    continue  # another pair's message: its count is never read here
                pair = (src, dst)
                count = counts.get(pair, 0)
                counts[pair] = count + 1
                if dst == rank:
                    receives.append((src, count % TAG_LIMIT, t))
                else:
                    sends.append((dst, count % TAG_LIMIT, t))
            during = () if isinstance(step, Transfer) else _during(step, rank, rank_of)
            rank_phase = RankPhase(tuple(receives), tuple(sends)) if receives or sends else None
            if during:
                out.append(RankOverlap(rank_phase, during))
            elif rank_phase is not None:
                out.append(rank_phase)
            if local:
                out.append(LocalMoves(tuple(local)))
        elif isinstance(step, Scale):
            out.append(step)
        elif isinstance(step, ZeroState):
            out.append(RankZero(owned_blocks(step.space, rank, mapping)))
        elif isinstance(step, Branches):
            names = tuple(b.name for b in owned_blocks(step.space, rank, mapping))
            terms = tuple(_project(term, rank, mapping, counts) for term in step.terms)
            out.append(RankBranches(terms, names))
        elif isinstance(step, FastPathStep):
            if mapping is not None:
                project_mapped = getattr(step.runner, "project_mapped", None)
                if project_mapped is None:
                    raise UnsupportedNodeError(f"a fast-path step {step!r} cannot run under a worker map")
                mine = project_mapped(rank, mapping)
            else:
                mine = step.runner.project(rank)
            if mine is not None:
                out.append(mine)
        else:  # pragma: no cover - lowering emits nothing else
            raise TypeError(f"unknown step {step!r}")
    return tuple(out)


def _remembered(rank_of: Any) -> Any:
    """``rank_of``, each worker's rank asked once (a run of messages names one worker often)."""
    ranks: dict[int, int] = {}

    def remembered(worker: int) -> int:
        rank = ranks.get(worker)
        if rank is None:
            rank = ranks[worker] = rank_of(worker)
        return rank

    return remembered


def _during(phase: Phase, rank: int, rank_of: Any) -> tuple[Any, ...]:
    """The nodes of the phase's in-flight local steps that ``rank`` runs."""
    return tuple(
        local.node
        for local in phase.during
        if (local.worker if rank_of is None else rank_of(local.worker)) == rank
    )
