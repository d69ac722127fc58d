"""The lowering of the halo exchange: :class:`~linop.halo.HaloStage` and
:class:`~linop.halo.HaloExchange` (and their adjoints) as transfers between the local blocks
(one per remote pair, of the round of its stage) and local copies (the pairs within one
worker), for the global program, one rank (its neighbours only) or a mapped rank's workers.

Engine-neutral: it emits only :class:`~linop.program.steps.Transfer` and
:class:`~linop.program.steps.Local` steps, which every executor runs (the MPI executor's
phases move them with subarray datatypes straight between the blocks)."""

from __future__ import annotations

from ..halo import HaloExchange, HaloExchangeAdjoint, HaloStage, HaloStageAdjoint
from ..movement import Copy, CopyAdjoint
from ..partition import Partition
from ..space import Region
from .lowering import lowering, lowering_rank, lowering_workers, movement_footprint, note_workers, per_worker
from .steps import Local, Step, Transfer

__all__: list[str] = []


@lowering(per_worker(HaloStage))
def _halo_stage(op: HaloStage) -> list[Step]:
    """x_dst = x_src for every pair: remote pairs are messages, local pairs copies."""
    return _stage_steps(_stage_part(op), adjoint=False)


@lowering(per_worker(HaloStageAdjoint))
def _halo_stage_adjoint(op: HaloStageAdjoint) -> list[Step]:
    """x_src += x_dst, x_dst = 0 for every pair (sent back where the pair spans two workers)."""
    return _stage_steps(_stage_part(op), adjoint=True)


def _stage_part(op: HaloStage | HaloStageAdjoint) -> tuple[tuple[Region, Region], ...]:
    """The stage's pairs; for one rank or a mapped rank's workers, those they take part in, in
    the stage's order (the pairs are listed: a scan of their workers, no step built for the
    others')."""
    rank, workers = lowering_rank(), lowering_workers()
    if rank is not None:
        workers = frozenset((rank,))
    if workers is None:
        return op.transfers
    note_workers(op.space.max_worker)
    return tuple(pair for pair in op.transfers if pair[0].worker in workers or pair[1].worker in workers)


@lowering(per_worker(HaloExchange))
def _halo_exchange(op: HaloExchange) -> list[Step] | None:
    """One rank's lowering: the stages' steps it takes part in, from the geometry (its
    neighbours only, :meth:`~linop.halo.HaloExchange.worker_stages`); the global program
    lowers the stages themselves."""
    return _rank_exchange(op, adjoint=False)


@lowering(per_worker(HaloExchangeAdjoint))
def _halo_exchange_adjoint(op: HaloExchangeAdjoint) -> list[Step] | None:
    """As :func:`_halo_exchange`: the adjoint stages in reverse order, H_{d-1}* first."""
    return _rank_exchange(op, adjoint=True)


def _rank_exchange(op: HaloExchange | HaloExchangeAdjoint, *, adjoint: bool) -> list[Step]:
    """The stages' steps in the order they run, each stage's messages of round its position
    in that order (the next stage's messages read or write what the previous one moved, on
    one end or the other: each rank starts a phase per stage, and posts a receive in the phase
    its sender sends it in). The global program: every stage whole; one rank's: its part; a
    mapped rank's: its workers' part (:func:`_workers_stages`)."""
    rank, workers = lowering_rank(), lowering_workers()
    if workers is not None:
        note_workers(op.geometry.tensor.partition.max_worker)
        stages = _workers_stages(op, workers)
    elif rank is None:
        stages = _numbered_stages(op)
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


def _numbered_stages(op: HaloExchange | HaloExchangeAdjoint) -> tuple[tuple[tuple[Region, Region], ...], ...]:
    """Every stage's transfers, the empty stages that :meth:`~linop.halo.HaloExchange.stages`
    leaves out included (as :meth:`~linop.halo.HaloExchange.worker_stages` lists them), so that
    a stage's round is the same in the global program and in a rank's (the nested stage H_d is
    the d-th; the direct exchange has one stage, H)."""
    count = 1 if op.variant == "direct" else op.geometry.ndim
    stages: list[tuple[tuple[Region, Region], ...]] = [() for _ in range(count)]
    for stage in op.stages():
        stages[int(stage.label[1:] or 0)] = stage.transfers
    return tuple(stages)


def _workers_stages(
    op: HaloExchange | HaloExchangeAdjoint, workers: frozenset[int]
) -> tuple[tuple[tuple[Region, Region], ...], ...]:
    """The transfers of each forward stage that some worker of ``workers`` takes part in, in
    the stage's order (:func:`~linop.halo.nested_transfers`, :func:`~linop.halo.direct_transfers`:
    by receiver in grid order, each receiver's in its own order), from the workers' own shares
    (:meth:`~linop.halo.HaloExchange.worker_stages`) and, where two of them send to one receiver
    of another rank, that receiver's share (its neighbours only: O(the workers' own work)).

    A receiver of ``workers`` lists all it receives in its share; a receiver elsewhere gets from
    each of ``workers`` what that worker's share lists, and when several send to it, the order
    among them is the receiver's own list's."""
    partition: Partition = op.geometry.tensor.partition
    indices = sorted(partition.index(w) for w in workers if partition.position(w) is not None)
    if not indices:
        return ()
    if len(indices) == 1:
        return op.worker_stages(indices[0])
    shares = {index: op.worker_stages(index) for index in indices}
    stages: list[tuple[tuple[Region, Region], ...]] = []
    for k in range(len(shares[indices[0]])):
        senders: dict[int, set[int]] = {}  # receiver -> the workers that send to it
        for index in indices:
            for s, d in shares[index][k]:
                senders.setdefault(d.worker, set()).add(s.worker)
        found: list[tuple[Region, Region]] = []
        for receiver in sorted(senders, key=partition.index):
            index = partition.index(receiver)
            if receiver in workers:  # all it receives: its own share lists them in order
                listed = shares[index][k]
            elif len(senders[receiver]) == 1:  # from one worker: in that worker's share's order
                listed = shares[partition.index(next(iter(senders[receiver])))][k]
            else:  # from several: their order is the receiver's
                listed = op.worker_stages(index)[k]
            found.extend(
                (s, d)
                for s, d in listed
                if d.worker == receiver and (receiver in workers or s.worker in workers)
            )
        stages.append(tuple(found))
    return tuple(stages)


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
