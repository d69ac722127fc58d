"""The MPI calls of the all-reduce's parts (:mod:`linop.program.lowering_all_reduce` plans
them): ``Allreduce`` in place per group on a cached sub-communicator (``Allreduce_init``
persistent requests in a bound plan), and under a worker map local sums around one
``Allreduce`` over the group's distinct ranks.

The group's ranks are used for one thing only: the sub-communicator
(:func:`~linop.backends.mpi.context.subcommunicator`); no peer, tag or message is derived from
them here (MPI's ``Allreduce`` picks its own algorithm and partners inside the library). A
rank's own part describes its group (a :class:`~linop.partition.WorkerBox`, or under a map
:class:`~linop.program.groups.MappedRanks`): a group of every rank in order is the
communicator itself (no sub-communicator), another is included run by run
(``MPI_Group_range_incl``, O(runs) arguments), never listed rank by rank in Python.
``MPI_Comm_create_group`` is then O(|G|) inside the MPI library, once per group and
communicator (cached with the context)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ....program.parts import AllReducePart, MappedAllReducePart
from ..context import subcommunicator
from ..datatypes import mpi, predefined_type
from ..runtime import run_schedule
from ..steps import Action, Persistent, RankStep
from .common import REDUCIBLE, contiguous_owned

if TYPE_CHECKING:  # pragma: no cover - mpi4py is optional at run time
    from mpi4py.MPI import Intracomm

    from ...numpy import Workspace

__all__ = ["rank_all_reduce", "rank_mapped_all_reduce"]


@dataclass
class _RankAllReduce(RankStep):
    """One rank's part of an all-reduce (:class:`~linop.program.parts.AllReducePart`)."""

    part: AllReducePart

    def run(self, work: Workspace, comm: Intracomm, dtype: np.dtype) -> None:
        if dtype.char not in REDUCIBLE:
            run_schedule(self.part.fallback.schedule(), work, comm, dtype)
            return
        lib = mpi()
        for name, ranks in self.part.entries:  # blocking, in the global order of the groups
            array = contiguous_owned(work, name, dtype)
            subcommunicator(comm, ranks).Allreduce(lib.IN_PLACE, [array, predefined_type(dtype)], op=lib.SUM)

    def written(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.part.entries)

    def persistent(
        self, arrays: dict[str, np.ndarray], comm: Intracomm, dtype: np.dtype, *, dry: bool = False
    ) -> Persistent | None:
        """Persistent ``Allreduce_init`` requests on the caller's arrays, or None (``dry``:
        decide only, create nothing)."""
        entries = self.part.entries
        if dtype.char not in REDUCIBLE or any(not arrays[name].flags.c_contiguous for name, _ in entries):
            return None
        if dry:
            return Persistent()
        lib = mpi()
        requests = [
            subcommunicator(comm, ranks).Allreduce_init(
                lib.IN_PLACE, [arrays[name], predefined_type(dtype)], op=lib.SUM
            )
            for name, ranks in entries
        ]
        return Persistent(requests)


def rank_all_reduce(part: AllReducePart) -> RankStep:
    """The MPI step of an all-reduce part."""
    return _RankAllReduce(part)


@dataclass
class _RankMappedAllReduce(RankStep):
    """One rank's part of an all-reduce under a worker map
    (:class:`~linop.program.parts.MappedAllReducePart`): per group, the rank's members summed
    locally, ``Allreduce`` on the sub-communicator of the distinct ranks (none when the group
    lives on this rank alone), the sum copied back into every member it holds."""

    part: MappedAllReducePart

    def run(self, work: Workspace, comm: Intracomm, dtype: np.dtype) -> None:
        if dtype.char not in REDUCIBLE:
            run_schedule(self.part.fallback(), work, comm, dtype)
            return
        for names, ranks in self.part.entries:  # blocking, in the global order of the groups
            arrays = [contiguous_owned(work, name, dtype) for name in names]
            _reduce_members(arrays, ranks, comm, dtype)()

    def written(self) -> tuple[str, ...]:
        return tuple(name for names, _ in self.part.entries for name in names)

    def persistent(
        self, arrays: dict[str, np.ndarray], comm: Intracomm, dtype: np.dtype, *, dry: bool = False
    ) -> Persistent | None:
        """The local sums, blocking ``Allreduce`` calls and copies on the caller's arrays, in
        order (as one finishing action per group), or None for dtypes MPI cannot sum."""
        entries = self.part.entries
        if dtype.char not in REDUCIBLE or any(
            not arrays[name].flags.c_contiguous for names, _ in entries for name in names
        ):
            return None
        if dry:
            return Persistent()
        finish = [_reduce_members([arrays[n] for n in names], ranks, comm, dtype) for names, ranks in entries]
        return Persistent([], finish)


def _reduce_members(
    arrays: list[np.ndarray], ranks: Sequence[int], comm: Intracomm, dtype: np.dtype
) -> Action:
    """The action summing ``arrays`` (one rank's members of a group) into the first, then over
    ``ranks`` (its sub-communicator, when more than this rank), then copying the sum back."""
    total, others = arrays[0], arrays[1:]
    sub = subcommunicator(comm, ranks) if len(ranks) > 1 else None
    lib = mpi()
    mpi_type = predefined_type(dtype)

    def reduce() -> None:
        for other in others:
            np.add(total, other, out=total)
        if sub is not None:
            sub.Allreduce(lib.IN_PLACE, [total, mpi_type], op=lib.SUM)
        for other in others:
            np.copyto(other, total)

    return reduce


def rank_mapped_all_reduce(part: MappedAllReducePart) -> RankStep:
    """The MPI step of a mapped all-reduce part."""
    return _RankMappedAllReduce(part)
