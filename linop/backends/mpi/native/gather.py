"""The MPI calls of the all-gather's and reduce-scatter's part along one line of equal shares
(:mod:`linop.program.lowering_gather` plans it): ``Allgather`` and ``Reduce_scatter_block``
on the line's sub-communicator; and of the reduce-scatter's part along one line of uneven
shares: ``Reduce_scatter`` (its counts per member) on the line's sub-communicator."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ....program.parts import LineGatherPart, LineReduceScatterPart
from ...host_schedule import shares_by_member, uneven_shares_by_member
from ..context import subcommunicator
from ..datatypes import byte_type, mpi, predefined_type
from ..runtime import run_schedule
from ..steps import RankStep
from .common import REDUCIBLE

if TYPE_CHECKING:  # pragma: no cover - mpi4py is optional at run time
    from mpi4py.MPI import Intracomm

    from ...numpy import Workspace

__all__ = ["rank_gather", "rank_reduce_scatter"]


@dataclass
class _RankGather(RankStep):
    """One rank's part of an all-gather (``Allgather``) or reduce-scatter
    (``Reduce_scatter_block``) along one line (:class:`~linop.program.parts.LineGatherPart`);
    on a rank outside the layout it does nothing."""

    part: LineGatherPart

    def run(self, work: Workspace, comm: Intracomm, dtype: np.dtype) -> None:
        part = self.part
        if part.reduce and dtype.char not in REDUCIBLE:
            run_schedule(part.fallback.schedule(), work, comm, dtype)
            return
        if part.source is None or part.target is None:
            return
        send = work.arrays[part.source]
        if send.dtype != dtype or not send.flags.c_contiguous:
            send = np.ascontiguousarray(send, dtype=dtype)
        count = len(part.members)
        lib = mpi()
        sub = subcommunicator(comm, part.members)
        if part.reduce:  # the gathered block as [member, share] in C order, then summed
            lined = shares_by_member(send, part.axis, count)
            receive = np.empty(part.target.shape, dtype=dtype)
            mpi_type = predefined_type(dtype)
            if receive.size:
                sub.Reduce_scatter_block([lined, mpi_type], [receive, mpi_type], op=lib.SUM)
        else:
            receive = np.empty(part.target.shape, dtype=dtype)
            lined_shape = (count, *send.shape)
            direct = math.prod(receive.shape[: part.axis]) == 1  # the shares are contiguous
            gathered = receive if direct else np.empty(lined_shape, dtype=dtype)
            if receive.size:
                sub.Allgather([send, send.nbytes, byte_type()], [gathered, send.nbytes, byte_type()])
            if not direct:
                shares_by_member(receive, part.axis, count, out=gathered)
        work.drop(part.source)
        work.set(part.target.name, receive)


def rank_gather(part: LineGatherPart) -> RankStep:
    """The MPI step of a line gather's part."""
    return _RankGather(part)


@dataclass
class _RankReduceScatter(RankStep):
    r"""One rank's part of a reduce-scatter along one line of uneven shares
    (:class:`~linop.program.parts.LineReduceScatterPart`): one ``Reduce_scatter`` on the line's
    sub-communicator (whose ranks are the members in coordinate order), the gathered block sent
    member by member (:func:`~linop.backends.host_schedule.uneven_shares_by_member`: a view
    when the shares lead), member :math:`k` receiving :math:`\sum_j g_j[o_k : o_k + n_k]`
    (``shares[k]`` entries along the axis times the other axes, none for an empty share). A
    dtype MPI cannot sum runs the node's expansion; a rank outside the layout does nothing."""

    part: LineReduceScatterPart

    def run(self, work: Workspace, comm: Intracomm, dtype: np.dtype) -> None:
        part = self.part
        if dtype.char not in REDUCIBLE:
            run_schedule(part.fallback.schedule(), work, comm, dtype)
        elif part.source is not None and part.target is not None:
            gathered = work.arrays[part.source].astype(dtype, copy=False)
            lined, counts = uneven_shares_by_member(gathered, part.axis, part.shares)
            mine = np.empty(part.target.shape, dtype=dtype)
            if lined.size:  # the gathered block's shape is the same on every member of the line
                kind = predefined_type(dtype)
                line = subcommunicator(comm, part.members)
                line.Reduce_scatter([lined, kind], [mine, kind], recvcounts=counts, op=mpi().SUM)
            work.drop(part.source)
            work.set(part.target.name, mine)


def rank_reduce_scatter(part: LineReduceScatterPart) -> RankStep:
    """The MPI step of an uneven reduce-scatter's part."""
    return _RankReduceScatter(part)
