"""The native all-gather (``Allgather``) and reduce-scatter (``Reduce_scatter_block``)
along one axis of equal shares, one call per line of the partition; other all-gathers and
reduce-scatters run as any plan (:mod:`~linop.backends.mpi.native.all_to_all`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ....collectives import AllGather, ReduceScatter
from ....partition import WorkerBox
from ....program import FastPathStep, Step, lowering, lowering_rank, note_workers, per_worker
from ....program.lowering_planned import workers_part
from ....space import Block
from ...host_schedule import shares_by_member
from ..context import subcommunicator
from ..datatypes import byte_type, mpi, predefined_type
from ..runtime import run_schedule
from ..steps import RankStep
from .all_to_all import alltoallw_step, global_alltoallw, layout_pieces, noted_layouts, planned
from .common import REDUCIBLE, Fallback, Projected, fallback

if TYPE_CHECKING:  # pragma: no cover - mpi4py is optional at run time
    from mpi4py.MPI import Intracomm

    from ...numpy import Workspace


@dataclass
class _RankGather(RankStep):
    """One rank's part of an all-gather (``Allgather``) or reduce-scatter
    (``Reduce_scatter_block``) along one axis whose shares are equal: its group is a line of
    the partition, described (:class:`~linop.partition.WorkerBox`), and the member at
    coordinate ``k`` owns entries ``[k n, (k + 1) n)`` of the gathered block along ``axis``.

    ``source`` is the block the rank gives (its tensor block; a gathered block for the
    reduce-scatter) and ``target`` the block it gets; ``line`` is None on a rank outside
    the layout or whose group has one member (then the step copies or sums locally)."""

    source: str | None
    target: Block | None
    members: Sequence[int]
    axis: int
    reduce: bool
    fallback: Fallback

    def run(self, work: Workspace, comm: Intracomm, dtype: np.dtype) -> None:
        if self.reduce and dtype.char not in REDUCIBLE:
            run_schedule(self.fallback.schedule(), work, comm, dtype)
            return
        if self.source is None or self.target is None:
            return
        send = work.arrays[self.source]
        if send.dtype != dtype or not send.flags.c_contiguous:
            send = np.ascontiguousarray(send, dtype=dtype)
        count = len(self.members)
        lib = mpi()
        sub = subcommunicator(comm, self.members)
        if self.reduce:  # the gathered block as [member, share] in C order, then summed
            lined = shares_by_member(send, self.axis, count)
            receive = np.empty(self.target.shape, dtype=dtype)
            mpi_type = predefined_type(dtype)
            if receive.size:
                sub.Reduce_scatter_block([lined, mpi_type], [receive, mpi_type], op=lib.SUM)
        else:
            receive = np.empty(self.target.shape, dtype=dtype)
            lined_shape = (count, *send.shape)
            direct = math.prod(receive.shape[: self.axis]) == 1  # the shares are contiguous
            gathered = receive if direct else np.empty(lined_shape, dtype=dtype)
            if receive.size:
                sub.Allgather([send, send.nbytes, byte_type()], [gathered, send.nbytes, byte_type()])
            if not direct:
                shares_by_member(receive, self.axis, count, out=gathered)
        work.drop(self.source)
        work.set(self.target.name, receive)


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


def _rank_gather(op: AllGather | ReduceScatter, rank: int, axis: int) -> _RankGather:
    """The rank's native gather step: its own block, its gathered block, its line described."""
    tensor, gathered = op.tensor, op.gathered
    reduce = isinstance(op, ReduceScatter)
    source: str | None = None
    target: Block | None = None
    members: Sequence[int] = ()
    if tensor.partition.position(rank) is not None:
        index = tensor.partition.index(rank)
        mine, whole = tensor.block(index), gathered.block(index)
        source, target = (whole.name, mine) if reduce else (mine.name, whole)
        members = WorkerBox(tensor.partition, tuple(None if d == axis else i for d, i in enumerate(index)))
    return _RankGather(source, target, members, axis, reduce, fallback(op, rank))


@dataclass
class _GatherRunner:
    op: AllGather | ReduceScatter
    axis: int
    workers: tuple[int, ...] = field(default=())

    def project(self, rank: int) -> _RankGather:
        return _rank_gather(self.op, rank, self.axis)


def _native_gather(op: AllGather | ReduceScatter) -> list[Step] | None:
    """The native step of an all-gather or reduce-scatter along one line of equal shares (one
    ``Allgather`` / ``Reduce_scatter_block`` per line, on its sub-communicator; a rank plans
    its own line only), or None for any other (the ``Alltoallw`` or the expansion)."""
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
    """Natively along one line of equal shares (:func:`_native_gather`); else as any plan
    (:func:`~linop.backends.mpi.native.all_to_all.planned`); a mapped rank's, its workers'
    part of the expansion (:func:`~linop.program.lowering_planned.workers_part`)."""
    part = workers_part(op)
    if part is not None:
        return part
    native = _native_gather(op)
    return native if native is not None else planned(op)


@lowering(per_worker(AllGather))
def _all_gather(op: AllGather) -> list[Step] | None:
    """Natively along one line of equal shares (:func:`_native_gather`); else one
    ``Alltoallw`` (see :func:`~linop.backends.mpi.native.all_to_all.planned`); for one rank, from the pieces of its blocks:
    each worker gives its one block and gets its one gathered block, one piece per pair of
    workers, as the whole plan shows; a mapped rank's, its workers' part of the expansion
    (:func:`~linop.program.lowering_planned.workers_part`)."""
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
