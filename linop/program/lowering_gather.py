"""The fast-path lowering of :class:`~linop.collectives.AllGather` and
:class:`~linop.collectives.ReduceScatter` along one axis of equal shares: one collective per
line of the partition (:class:`~linop.program.parts.LineGatherPart`, a rank's line described);
other all-gathers as one all-to-all (:mod:`linop.program.lowering_all_to_all`), other
reduce-scatters as their expansion; a mapped rank's, its workers' part of the expansion
(:func:`~linop.program.lowering_pieces.workers_part`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..collectives import AllGather, ReduceScatter
from ..partition import WorkerBox
from ..space import Block
from .lowering import lowering, lowering_rank, note_workers, per_worker
from .lowering_all_to_all import alltoallw_step, global_alltoallw, layout_pieces, lower_pieces, noted_layouts
from .lowering_pieces import workers_part
from .parts import Fallback, LineGatherPart, Projected
from .steps import FastPathStep, Step

__all__: list[str] = []


def _gather_line(op: AllGather | ReduceScatter) -> int | None:
    """The one axis of an all-gather or reduce-scatter whose native path applies (no
    pass-through blocks, one axis, equal shares along it, more than one member), or None."""
    tensor = op.tensor
    if len(op.others) or len(op.axes) != 1 or not tensor.ndim:
        return None
    (axis,) = op.axes
    sizes = tensor.sizes[axis]
    if len(sizes) < 2 or len(set(sizes)) != 1:
        return None
    return axis


def _rank_gather(op: AllGather | ReduceScatter, rank: int, axis: int) -> LineGatherPart:
    """The rank's part: its own block, its gathered block, its line described."""
    tensor, gathered = op.tensor, op.gathered
    reduce = isinstance(op, ReduceScatter)
    source: str | None = None
    target: Block | None = None
    members: WorkerBox | tuple[int, ...] = ()
    if tensor.partition.position(rank) is not None:
        index = tensor.partition.index(rank)
        mine, whole = tensor.block(index), gathered.block(index)
        source, target = (whole.name, mine) if reduce else (mine.name, whole)
        members = WorkerBox(tensor.partition, tuple(None if d == axis else i for d, i in enumerate(index)))
    return LineGatherPart(source, target, members, axis, reduce, Fallback(op, rank))


@dataclass
class _GatherRunner:
    op: AllGather | ReduceScatter
    axis: int
    workers: tuple[int, ...] = field(default=())

    def project(self, rank: int) -> LineGatherPart:
        return _rank_gather(self.op, rank, self.axis)


def _native_gather(op: AllGather | ReduceScatter) -> list[Step] | None:
    """The step of an all-gather or reduce-scatter along one line of equal shares (one
    collective per line; a rank plans its own line only), or None for any other."""
    axis = _gather_line(op)
    if axis is None:
        return None
    partition = op.tensor.partition
    rank = lowering_rank()
    if rank is None:
        return [FastPathStep(_GatherRunner(op, axis, tuple(partition.workers)))]
    note_workers(partition.max_worker)
    return [FastPathStep(Projected(_rank_gather(op, rank, axis), rank, (partition.max_worker,)))]


@lowering(per_worker(ReduceScatter))
def _reduce_scatter(op: ReduceScatter) -> list[Step] | None:
    """Along one line of equal shares (:func:`_native_gather`); else as any movement
    (:func:`~linop.program.lowering_all_to_all.lower_pieces`); a mapped rank's, its workers'
    part of the expansion (:func:`~linop.program.lowering_pieces.workers_part`)."""
    part = workers_part(op)
    if part is not None:
        return part
    native = _native_gather(op)
    return native if native is not None else lower_pieces(op)


@lowering(per_worker(AllGather))
def _all_gather(op: AllGather) -> list[Step] | None:
    """Along one line of equal shares (:func:`_native_gather`); else one all-to-all (see
    :func:`~linop.program.lowering_all_to_all.lower_pieces`); for one rank, from the pieces of its
    blocks: each worker gives its one block and gets its one gathered block, one piece per pair
    of workers, as the whole movement shows; a mapped rank's, its workers' part of the expansion
    (:func:`~linop.program.lowering_pieces.workers_part`)."""
    part = workers_part(op)
    if part is not None:
        return part
    native = _native_gather(op)
    if native is not None:
        return native
    rank = lowering_rank()
    if rank is not None:
        pieces = layout_pieces(op, rank)
        if pieces is not None:
            layouts = noted_layouts(op)
            if layouts is None:
                return None
            largest = max(layouts[0].partition.max_worker, layouts[1].partition.max_worker)
            return [alltoallw_step(op, rank, pieces, largest)]
    return global_alltoallw(op)
