"""The fast-path lowering of :class:`~linop.collectives.AllGather` and
:class:`~linop.collectives.ReduceScatter` along one axis of equal shares: one collective per
line of the partition (:class:`~linop.program.parts.LineGatherPart`, a rank's line described);
a reduce-scatter along one axis of uneven shares likewise
(:class:`~linop.program.parts.LineReduceScatterPart`, the shares listed: O(the line)); other
all-gathers as one all-to-all (:mod:`linop.program.lowering_all_to_all`), other
reduce-scatters as their expansion; a mapped rank's, its workers' part of the expansion
(:func:`~linop.program.lowering_pieces.workers_part`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..collectives import AllGather, ReduceScatter
from ..partition import WorkerBox
from .lowering import lowering, lowering_rank, note_workers, per_worker
from .lowering_all_to_all import alltoallw_step, global_alltoallw, layout_pieces, lower_pieces, noted_layouts
from .lowering_pieces import workers_part
from .parts import Fallback, LineGatherPart, LineReduceScatterPart, Projected
from .steps import FastPathStep, Step

__all__: list[str] = []


def _one_line(op: AllGather | ReduceScatter) -> int | None:
    """The one axis of an all-gather or reduce-scatter along a line (no pass-through blocks,
    one axis, more than one member), or None."""
    tensor = op.tensor
    if len(op.others) or len(op.axes) != 1 or not tensor.ndim:
        return None
    (axis,) = op.axes
    return axis if len(tensor.sizes[axis]) > 1 else None


def _gather_line(op: AllGather | ReduceScatter) -> int | None:
    """The one axis of an all-gather or reduce-scatter whose native path applies (a line,
    :func:`_one_line`, of equal shares), or None."""
    axis = _one_line(op)
    if axis is None or len(set(op.tensor.sizes[axis])) != 1:
        return None
    return axis


def _uneven_line(op: ReduceScatter) -> int | None:
    """The one axis of a reduce-scatter along a line (:func:`_one_line`) of uneven shares, or
    None."""
    axis = _one_line(op)
    if axis is None or len(set(op.tensor.sizes[axis])) == 1:
        return None
    return axis


def _line_of(op: AllGather | ReduceScatter, rank: int, axis: int) -> tuple[tuple[int, ...], WorkerBox] | None:
    """The rank's grid index and its line along ``axis`` (described), or None on a rank outside
    the layout."""
    partition = op.tensor.partition
    if partition.position(rank) is None:
        return None
    index = partition.index(rank)
    return index, WorkerBox(partition, tuple(None if d == axis else i for d, i in enumerate(index)))


def _rank_gather(op: AllGather | ReduceScatter, rank: int, axis: int) -> LineGatherPart:
    """The rank's part: its own block, its gathered block, its line described."""
    reduce = isinstance(op, ReduceScatter)
    line = _line_of(op, rank, axis)
    if line is None:
        return LineGatherPart(None, None, (), axis, reduce, Fallback(op, rank))
    index, members = line
    mine, whole = op.tensor.block(index), op.gathered.block(index)
    source, target = (whole.name, mine) if reduce else (mine.name, whole)
    return LineGatherPart(source, target, members, axis, reduce, Fallback(op, rank))


def _rank_uneven(op: ReduceScatter, rank: int, axis: int) -> LineReduceScatterPart:
    """The rank's part of a reduce-scatter of uneven shares: its gathered block, its own
    block, its line described and the line's shares (listed: O(the line))."""
    shares = tuple(op.tensor.sizes[axis])
    line = _line_of(op, rank, axis)
    if line is None:
        return LineReduceScatterPart(None, None, (), axis, shares, Fallback(op, rank))
    index, members = line
    gathered = op.gathered.block_name(index)
    return LineReduceScatterPart(gathered, op.tensor.block(index), members, axis, shares, Fallback(op, rank))


PartOf = Callable[[Any, int, int], "LineGatherPart | LineReduceScatterPart"]
"""A rank's part of a node along one line: ``part_of(op, rank, axis)``."""


@dataclass
class _GatherRunner:
    op: AllGather | ReduceScatter
    axis: int
    part_of: PartOf
    workers: tuple[int, ...] = field(default=())

    def project(self, rank: int) -> LineGatherPart | LineReduceScatterPart:
        return self.part_of(self.op, rank, self.axis)


def _line_step(op: AllGather | ReduceScatter, axis: int | None, part_of: PartOf) -> list[Step] | None:
    """The step of a collective along one line (one collective per line; a rank plans its own
    line only), or None when ``axis`` is None (the node is not one)."""
    if axis is None:
        return None
    partition = op.tensor.partition
    rank = lowering_rank()
    if rank is None:
        return [FastPathStep(_GatherRunner(op, axis, part_of, tuple(partition.workers)))]
    note_workers(partition.max_worker)
    return [FastPathStep(Projected(part_of(op, rank, axis), rank, (partition.max_worker,)))]


def _native_gather(op: AllGather | ReduceScatter) -> list[Step] | None:
    """An all-gather or reduce-scatter along one line of equal shares
    (:class:`~linop.program.parts.LineGatherPart`), or None for any other."""
    return _line_step(op, _gather_line(op), _rank_gather)


def _native_uneven(op: ReduceScatter) -> list[Step] | None:
    """A reduce-scatter along one line of uneven shares
    (:class:`~linop.program.parts.LineReduceScatterPart`), or None for any other."""
    return _line_step(op, _uneven_line(op), _rank_uneven)


@lowering(per_worker(ReduceScatter))
def _reduce_scatter(op: ReduceScatter) -> list[Step] | None:
    """Along one line of equal shares (:func:`_native_gather`) or uneven ones
    (:func:`_native_uneven`); else as any movement
    (:func:`~linop.program.lowering_all_to_all.lower_pieces`); a mapped rank's, its workers'
    part of the expansion (:func:`~linop.program.lowering_pieces.workers_part`)."""
    part = workers_part(op)
    if part is not None:
        return part
    native = _native_gather(op)
    if native is None:
        native = _native_uneven(op)
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
