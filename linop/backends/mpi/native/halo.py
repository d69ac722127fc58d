"""The native halo exchange: :class:`~linop.halo.HaloStage` and
:class:`~linop.halo.HaloExchange` (and their adjoints) as point-to-point messages between the
local blocks and local copies."""

from __future__ import annotations

from ....halo import HaloExchange, HaloExchangeAdjoint, HaloStage, HaloStageAdjoint
from ....movement import Copy, CopyAdjoint
from ....program import Local, Step, Transfer, lowering, lowering_rank, movement_footprint, note_workers
from ....space import Region


@lowering(HaloStage)
def _halo_stage(op: HaloStage) -> list[Step]:
    """x_dst = x_src for every pair: remote pairs are messages, local pairs copies."""
    return _stage_steps(op.transfers, adjoint=False)


@lowering(HaloStageAdjoint)
def _halo_stage_adjoint(op: HaloStageAdjoint) -> list[Step]:
    """x_src += x_dst, x_dst = 0 for every pair (sent back where the pair spans two workers)."""
    return _stage_steps(op.transfers, adjoint=True)


@lowering(HaloExchange)
def _halo_exchange(op: HaloExchange) -> list[Step] | None:
    """One rank's lowering: the stages' steps it takes part in, from the geometry (its
    neighbours only, :meth:`~linop.halo.HaloExchange.worker_stages`); the global program
    lowers the stages themselves."""
    return _rank_exchange(op, adjoint=False)


@lowering(HaloExchangeAdjoint)
def _halo_exchange_adjoint(op: HaloExchangeAdjoint) -> list[Step] | None:
    """As :func:`_halo_exchange`: the adjoint stages in reverse order, H_{d-1}* first."""
    return _rank_exchange(op, adjoint=True)


def _rank_exchange(op: HaloExchange | HaloExchangeAdjoint, *, adjoint: bool) -> list[Step]:
    """The stages' steps in the order they run, each stage's messages of round its position
    in that order (the next stage's messages read or write what the previous one moved, on
    one end or the other: each rank starts a phase per stage, and posts a receive in the phase
    its sender sends it in). The global program: every stage whole; one rank's: its part."""
    rank = lowering_rank()
    if rank is None:
        stages = tuple(stage.transfers for stage in op.stages())
    else:
        partition = op.geometry.tensor.partition
        note_workers(partition.max_worker)
        if partition.position(rank) is None:
            return []
        stages = op.worker_stages(partition.index(rank))
    steps: list[Step] = []
    for depth, transfers in enumerate(reversed(stages) if adjoint else stages):
        steps.extend(_stage_steps(transfers, adjoint=adjoint, depth=depth))
    return steps


def _stage_steps(
    transfers: tuple[tuple[Region, Region], ...], *, adjoint: bool, depth: int = 0
) -> list[Step]:
    """The steps of one stage's transfers: messages (of round ``depth``) first, then the local
    pairs (as the lowerings of :class:`HaloStage` and :class:`HaloStageAdjoint` emit them)."""
    steps: list[Step] = []
    for s, d in transfers:
        if s.worker != d.worker:
            steps.append(
                Transfer(d, s, "add", "clear", depth) if adjoint else Transfer(s, d, "store", "keep", depth)
            )
    for s, d in transfers:
        if s.worker == d.worker:
            node = CopyAdjoint(s, d) if adjoint else Copy(s, d)
            steps.append(Local(node, s.worker, movement_footprint(node)))
    return steps
