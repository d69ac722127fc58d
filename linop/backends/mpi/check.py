"""The collective entry check on an MPI communicator: :class:`CheckReducer`.

The check itself (one reduction of a short vector deciding, on every rank alike, whether a call
may run and in which dtype) is shared with the torch.distributed executor and lives in
:mod:`linop.backends.entry_check`; here is its MPI engine: a persistent ``Allreduce`` per
communicator context, waited for within the call's deadline (:mod:`linop.backends.mpi.deadline`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import DistributedDtypeError, DistributedOverflowError
from ..entry_check import DTYPE_CHARS, VECTOR_LENGTH, CheckOutcome, EntryCheck
from .datatypes import mpi
from .deadline import wait_all
from .mpi_types import Intracomm

__all__ = [
    "DTYPE_CHARS",
    "VECTOR_LENGTH",
    "DistributedDtypeError",
    "DistributedOverflowError",
    "CheckOutcome",
    "CheckReducer",
    "EntryCheck",
]


class CheckReducer:
    """The one collective of the entry check on one private communicator: the maximum over
    ranks of a :data:`VECTOR_LENGTH` int64 vector, in buffers owned here.

    Created once per communicator context (collective, like the duplicate it belongs to) as
    a persistent ``Allreduce_init`` request, so each check costs one ``Start`` and one
    ``Wait`` (measured about half the latency of a blocking ``Allreduce`` on this MPICH);
    when the MPI library has no persistent collectives, a blocking ``Allreduce``. On one rank
    there is nothing to agree on: the vector is its own maximum. Every tree checked on the
    communicator shares it (calls are collective, so they never overlap). ``persistent=False``
    (a communicator without a context): a blocking ``Allreduce``, nothing created."""

    def __init__(self, comm: Intracomm, *, persistent: bool = True) -> None:
        self.comm = comm
        self.send = np.zeros(VECTOR_LENGTH, dtype=np.int64)
        self.received = np.zeros(VECTOR_LENGTH, dtype=np.int64)
        self.request: Any = None
        self._pending: Any = None  # the nonblocking reduction without a persistent request
        self.signature: Any = None  # what :attr:`send` holds (set by the check that wrote it)
        self.sent = b""  # :attr:`send` as bytes
        self.rank: int = comm.Get_rank()
        self.growth: dict[bytes, bool] = {}  # agreed per tree: see EntryCheck._growth_known
        self.single = comm.Get_size() == 1
        if persistent and not self.single:
            try:
                self.request = comm.Allreduce_init(self.send, self.received, op=mpi().MAX)
            except (NotImplementedError, AttributeError):  # pragma: no cover - MPI-4 here
                self.request = None

    def start(self) -> None:
        """Start reducing :attr:`send` (maximum over ranks) into :attr:`received`."""
        if self.single:
            np.copyto(self.received, self.send)
        elif self.request is not None:
            self.request.Start()
        else:  # pragma: no cover - MPI libraries without persistent collectives
            self._pending = self.comm.Iallreduce(self.send, self.received, op=mpi().MAX)

    def wait(self, timeout: float | None = None, doing: str = "the entry check") -> np.ndarray:
        """Complete the reduction started by :meth:`start`; return :attr:`received`. With a
        ``timeout`` (seconds) the reduction is polled, and ranks that do not arrive in time
        raise :class:`~linop.errors.PeerTimeoutError` (:mod:`linop.backends.mpi.deadline`)."""
        if self.single:
            return self.received
        request = self.request if self.request is not None else self._pending
        if timeout is None:
            request.Wait()
        else:
            wait_all([request], self.comm, timeout, doing)
        return self.received

    def reduce(self, timeout: float | None = None, doing: str = "the entry check") -> np.ndarray:
        """Reduce :attr:`send` (maximum over ranks) into :attr:`received` and return it
        (within ``timeout`` seconds, see :meth:`wait`)."""
        self.start()
        return self.wait(timeout, doing)

    def minimum(self, value: int) -> int:
        """The minimum over ranks of ``value`` (a blocking ``allreduce``)."""
        return int(self.comm.allreduce(value, op=mpi().MIN))

    def allgather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order (a blocking ``allgather``)."""
        return list(self.comm.allgather(value))

    def free(self) -> None:
        """Release the persistent request (before the communicator is freed)."""
        if self.request is not None:
            self.request.Free()
            self.request = None
