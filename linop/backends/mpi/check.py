"""The collective entry check on an MPI communicator: :class:`CheckReducer`, :class:`MPIEntryCheck`.

The check itself (one reduction of a short vector deciding, on every rank alike, whether a call
may run and in which dtype) is shared with the torch.distributed executor and lives in
:mod:`linop.backends.entry_check`; here is its MPI engine: persistent ``Allreduce`` requests
per communicator context, completed within the call's deadline
(:mod:`linop.backends.mpi.deadline`).

The common case costs one collective of four int64 words
-------------------------------------------------------------

In a loop every rank sends the same check vector call after call (:data:`VECTOR_LENGTH` int64
words: the tree's fingerprint, the dtypes present, the flags, :mod:`.vector
<linop.backends.entry_check.vector>`). What the check needs from its collective is the maximum
over ranks of that vector; when every rank sends the same vector that maximum *is* the vector.
So the reducer first reduces only a 128-bit digest of it (blake2b of the vector's bytes,
computed when the vector changes, not per call), as two int64 words ``d`` and their bitwise
complements ``~d`` (maximum over ranks: ``max d`` and ``~min d``). The reduced words equal
this rank's own words exactly when every rank's digest equals this rank's; the reduced words
are the same on every rank, so *every* rank reaches the same verdict:

- all equal (the common case): every rank sent this very vector (up to a collision of a
  128-bit digest, the same assumption the tree's own 128-bit fingerprint already makes), so
  the maximum is this rank's vector, and the check decodes it with no second collective;
- not all equal: every rank sees it, and every rank then reduces the full vector (a second
  persistent ``Allreduce``), decoded as before: an error on every rank, or another run dtype.

On two ranks the digest's reduction is one exchange with the peer (persistent ``Recv_init`` and
``Send_init`` of the four words on a reserved tag, :func:`digest_tag`): there the peer *is*
every other rank, the maximum of two digests equals this rank's exactly when the peer's digest
does, and each rank compares the peer's words with its own, so both reach the same verdict, as
from the ``Allreduce``; measured on the (loaded) development machine, the exchange before a
64 KB halo exchange's bound plan costs 0.13-0.25 us less than the persistent ``Allreduce`` of
the same words (MPICH's persistent collectives run a schedule): 0.9-1.0 us against 1.1-1.2 us.
(Exchanging through a shared-memory window instead gave nothing more: the rest is the wait for
the peer, which the two ranks' halo exchanges leave apart.)
Each exchange completes both its messages before the next starts, and every exchange on the
communicator is its one reducer's (one per context), so the two ranks' exchanges pair in order
(MPI's messages between two ranks on one tag do not overtake each other), as collectives do.
The whole vector is still reduced by an ``Allreduce``. A rank whose peer makes another call
meanwhile (a collective, or a plan's messages, which use other tags) is not matched by it,
and meets the deadline as it would at the ``Allreduce``.

So every rank makes the same sequence of collectives, whatever any rank holds, and no rank
moves data before all ranks know that every rank holds the same tree, a compatible state and
the same run dtype: a mismatch can neither hang a rank nor give a wrong answer. A call whose
ranks differ by design (an integer run: each rank's largest magnitude differs) pays the
second collective.

Why not a check over a rank's peers only
----------------------------------------

A check over only the ranks a plan exchanges with (a neighbourhood collective) would cost one
latency of a neighbour exchange, but it is not sound on its own: if rank B agrees with A but not
with C, B must raise while A, having agreed with all of its own peers, goes on and waits for
B's data forever; and the run dtype is a global fact (the common dtype of every rank's blocks).
Making the verdict reach every rank needs as many rounds as the peer graph's diameter, which an
``Allreduce`` (``log P`` rounds per rank, a few words each: per-rank work that grows with the
logarithm of P only) already bounds. The reduction is therefore global, and as small as the
guarantee allows. (On two ranks the peer is the whole rest of the communicator: the exchange
above is that global reduction, not a neighbourhood's.)

Waiting within the deadline
---------------------------

With a deadline the reduction is polled (``Test``), not waited for (a blocking ``Wait`` would
never return if a peer never came): :data:`SPINS` tests, then
:func:`~linop.backends.mpi.deadline.wait_all` with the rest of its policy and the deadline.
When this node holds more ranks than cores (oversubscribed: the peers share this rank's cores),
a busy poll keeps the peer that must arrive off the core: measured on 4 ranks over 2 cores,
:func:`~linop.backends.mpi.deadline.wait_all`'s busy start made the check's reduction 60 us
instead of 10 us (MPICH's ``Wait``). There the reducer makes no busy tests and has
:func:`~linop.backends.mpi.deadline.wait_all` yield the core from its first test
(:attr:`CheckReducer.busy`). Without a deadline the reduction is waited for (``Wait``).
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import numpy as np

from ...errors import DistributedDtypeError, DistributedOverflowError
from ...program import TAG_LIMIT
from ..entry_check import DTYPE_CHARS, VECTOR_LENGTH, CheckOutcome, EntryCheck
from ..entry_check.repeat import Repeat
from .datatypes import mpi
from .deadline import BUSY, notice_tag, wait_all
from .mpi_types import Intracomm

__all__ = [
    "DTYPE_CHARS",
    "VECTOR_LENGTH",
    "DIGEST_LENGTH",
    "DIGESTS_KEPT",
    "DistributedDtypeError",
    "DistributedOverflowError",
    "CheckOutcome",
    "CheckReducer",
    "EntryCheck",
    "MPIEntryCheck",
    "SPINS",
    "digest_tag",
    "node_oversubscribed",
    "oversubscribed",
]

DIGEST_LENGTH = 4
"""Int64 words of the common case's collective: a 128-bit digest of the check vector (two
words) and their complements."""

DIGESTS_KEPT = 64
"""Digests the reducer keeps, by vector (a vector per tree, dtype and flags in use)."""

SPINS = 64
"""Tests of the check's reduction before :func:`~linop.backends.mpi.deadline.wait_all` takes
over (on a node with a core per rank): a 2-rank reduction completes within about ten here, so
the common case makes no other call; a later peer meets wait_all's own policy."""


def digest_tag(comm: Intracomm) -> int | None:
    """The reserved tag of the digest's exchange on two ranks: two below the deadline's notices'
    (:func:`~linop.backends.mpi.deadline.notice_tag`; one below is the stall records',
    :func:`linop.backends.mpi.stall.record_tag`); None where that is not above every tag of the
    schedules (:data:`linop.program.TAG_LIMIT`): the ``Allreduce`` then."""
    tag = notice_tag(comm) - 2
    return tag if tag > TAG_LIMIT else None


_FOUND: list[bool] = []
"""What :func:`oversubscribed` found first in this process (for :func:`node_oversubscribed`)."""

LAUNCHER_LOCAL_RANKS = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE")
"""The environment variables in which MPICH's and Open MPI's launchers give the number of the
job's processes on this node (:func:`node_oversubscribed`)."""


def _cores() -> set[int]:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))  # pragma: no cover - Linux here


def oversubscribed(comm: Intracomm) -> bool:
    """Whether the ranks of ``comm`` on this node outnumber the cores they may run on (the union
    of their CPU affinities); collective over ``comm``. False where the MPI library cannot say."""
    module = mpi()
    try:
        local = comm.Split_type(module.COMM_TYPE_SHARED)
    except (NotImplementedError, AttributeError):  # pragma: no cover - MPI-3 here
        return False
    try:
        union: set[int] = set()
        for found in local.allgather(sorted(_cores())):
            union.update(found)
        more = local.Get_size() > len(union)
    finally:
        local.Free()
    if not _FOUND:
        _FOUND.append(more)
    return more


def node_oversubscribed() -> bool:
    """Whether this node holds more of the job's ranks than cores, as far as this process
    knows without communicating (for a wait that comes before any reducer of its
    communicator: the duplication's barrier, :mod:`linop.backends.mpi.context`): what
    :func:`oversubscribed` found first in this process (the first communicator's reducer), else
    the launcher's count of the job's processes on this node (:data:`LAUNCHER_LOCAL_RANKS`)
    against the cores this process may run on (ranks pinned to a core each read as
    oversubscribed: such a wait then yields from its first test, which costs nothing where the
    core is idle), else False."""
    if _FOUND:
        return _FOUND[0]
    for name in LAUNCHER_LOCAL_RANKS:
        text = os.environ.get(name, "")
        if text.isdigit():
            return int(text) > len(_cores())
    return False


class CheckReducer:
    """The collectives of the entry check on one private communicator: the maximum over ranks
    of a :data:`VECTOR_LENGTH` int64 vector, in buffers owned here, reduced through its digest
    first (the module docstring: :meth:`unanimous`).

    Created once per communicator context (collective, like the duplicate it belongs to) as
    two persistent ``Allreduce_init`` requests (the digest's, of :data:`DIGEST_LENGTH` words,
    and the whole vector's; on two ranks the digest's is a persistent receive from the peer and
    send to it instead: the module docstring), so each check costs its ``Start`` and its
    completion (measured about half the latency of a blocking ``Allreduce`` on this MPICH);
    when the MPI library has no persistent collectives, ``Iallreduce``. On one rank there is nothing to agree on: the
    vector is its own maximum. Every tree checked on the communicator shares it (calls are
    collective, so they never overlap). ``persistent=False`` (a communicator without a
    context): nonblocking reductions, nothing created."""

    def __init__(self, comm: Intracomm, *, persistent: bool = True) -> None:
        self.comm = comm
        self.send = np.zeros(VECTOR_LENGTH, dtype=np.int64)
        self.received = np.zeros(VECTOR_LENGTH, dtype=np.int64)
        self.digest = np.zeros(DIGEST_LENGTH, dtype=np.int64)
        """A digest of a check vector and its complement (what the common case reduces)."""
        self.digest_arrived = bytearray(DIGEST_LENGTH * 8)
        """The received (reduced) digest's memory: compared with a digest's bytes as it is (a
        ``bytearray`` equals ``bytes`` in one ``memcmp``, no copy made)."""
        self.digest_received = np.frombuffer(self.digest_arrived, dtype=np.int64)
        """:attr:`digest_arrived` as int64 words, the buffer the collective writes."""
        self.digest_of: bytes | None = None
        """The vector bytes that :attr:`digest` holds the digest of (by identity: the bytes
        object a check keeps), which a caller that writes the digest alone
        (:meth:`write_digest`) may leave other than :attr:`sent`."""
        self.digest_bytes = b""
        """:attr:`digest` as bytes."""
        self._digest_memory = self.digest.data.cast("B")
        self._digests: dict[bytes, bytes] = {}  # by vector bytes: the digest's
        self.request: Any = None
        """The digest's persistent reduction (on two ranks: the receive of the peer's digest
        into :attr:`digest_received`); None on one rank and once freed."""
        self.digest_send: Any = None
        """On two ranks, the send of :attr:`digest` to the peer (started with :attr:`request`);
        else None."""
        self.vector_request: Any = None  # the whole vector's
        self.signature: Any = None  # what :attr:`send` holds (set by the check that wrote it)
        self.sent = b""  # :attr:`send` as bytes (set with it)
        self.rank: int = comm.Get_rank()
        self.growth: dict[bytes, bool] = {}  # agreed per tree: see EntryCheck._growth_known
        self.single = comm.Get_size() == 1
        self.oversubscribed = False if self.single else oversubscribed(comm)
        """More ranks than cores on this node: polls yield the core from the first test."""
        self.spins = range(0 if self.oversubscribed else SPINS)
        """The tests of a reduction before the slower wait (:meth:`complete`): :data:`SPINS`,
        none when oversubscribed (a range, iterated as it is)."""
        self.busy = 0.0 if self.oversubscribed else BUSY
        """Seconds :func:`~linop.backends.mpi.deadline.wait_all` tests without yielding the
        core, here and for the plans on this communicator (none when oversubscribed)."""
        if persistent and not self.single:
            tag = digest_tag(comm) if comm.Get_size() == 2 else None
            if tag is not None:  # two ranks: one exchange with the peer (the module docstring)
                peer = 1 - self.rank
                self.request = comm.Recv_init(self.digest_received, peer, tag)
                self.digest_send = comm.Send_init(self.digest, peer, tag)
            try:
                op = mpi().MAX
                if self.request is None:
                    self.request = comm.Allreduce_init(self.digest, self.digest_received, op=op)
                self.vector_request = comm.Allreduce_init(self.send, self.received, op=op)
            except (NotImplementedError, AttributeError):  # pragma: no cover - MPI-4 here
                self.free()

    def unanimous(self, timeout: float | None = None, doing: str = "the entry check") -> bool:
        """Whether every rank's :attr:`send` holds what this rank's does (its bytes are
        :attr:`sent`): one reduction of :data:`DIGEST_LENGTH` words, the same verdict on every
        rank. When not, the whole vector is reduced into :attr:`received` (a second collective,
        :meth:`reduce_whole`, which every rank makes, as every rank sees the disagreement).
        ``timeout`` (seconds, or None for none) and ``doing``: see :meth:`complete`. Collective."""
        if self.single:
            return True
        if self.digest_of is not self.sent:
            self.write_digest(self.sent, self.digest_for(self.sent))
        self.exchange_digest(timeout, doing)
        if self.digest_arrived == self.digest_bytes:
            return True
        self.reduce_whole(timeout, doing)
        return False

    def exchange_digest(self, timeout: float | None = None, doing: str = "the entry check") -> None:
        """The digest's collective: :attr:`digest` reduced into :attr:`digest_received` (on two
        ranks: sent to the peer, and the peer's received). ``timeout`` and ``doing``: see
        :meth:`complete`. Collective."""
        send = self.digest_send
        if send is None:
            self._reduce_max(self.request, self.digest, self.digest_received, timeout, doing)
            return
        send.Start()  # (sent first: the peer's wait ends sooner)
        self.request.Start()
        self.complete(self.request, timeout, doing)
        self.complete(send, timeout, doing)

    def reduce_whole(self, timeout: float | None = None, doing: str = "the entry check") -> None:
        """The second collective, once the digests' reduction has found that the ranks' vectors
        differ (on every rank alike): :attr:`send` reduced whole into :attr:`received`."""
        self._reduce_max(self.vector_request, self.send, self.received, timeout, doing)

    def _reduce_max(
        self, request: Any, send: np.ndarray, received: np.ndarray, timeout: float | None, doing: str
    ) -> None:
        """``send``'s maximum over the ranks into ``received``: the persistent ``request``
        started (or, without one, an ``Iallreduce``), then :meth:`complete`."""
        if request is None:  # pragma: no cover - MPI libraries without persistent collectives
            request = self.comm.Iallreduce(send, received, op=mpi().MAX)
        else:
            request.Start()
        self.complete(request, timeout, doing)

    def digest_for(self, sent: bytes) -> bytes:
        """The digest of the vector whose bytes are ``sent`` and its complement, as the bytes
        of :attr:`digest` (kept per vector: plans that take turns on the communicator, a
        forward and its adjoint in a loop, hash once each)."""
        found = self._digests.get(sent)
        if found is None:
            if len(self._digests) >= DIGESTS_KEPT:
                self._digests.clear()
            words = np.frombuffer(hashlib.blake2b(sent, digest_size=16).digest(), dtype=np.int64)
            found = self._digests[sent] = np.concatenate([words, ~words]).tobytes()
        return found

    def write_digest(self, sent: bytes, digest: bytes) -> None:
        """Put ``digest`` (:meth:`digest_for` ``sent``) in the digest's send buffer."""
        self._digest_memory[:] = digest
        self.digest_of, self.digest_bytes = sent, digest

    def complete(self, request: Any, timeout: float | None, doing: str) -> None:
        """Complete a started reduction: a blocking ``Wait`` without a deadline; with one,
        :attr:`spins` tests, then :func:`~linop.backends.mpi.deadline.wait_all` (yielding the
        core after :attr:`busy` seconds; it raises :class:`~linop.errors.PeerTimeoutError`
        naming the ranks that did not arrive within ``timeout`` seconds at ``doing``)."""
        if timeout is None:
            request.Wait()
            return
        test = request.Test
        for _ in self.spins:
            if test():
                return
        wait_all([request], self.comm, timeout, doing, busy=self.busy)

    def reduce(self, timeout: float | None = None, doing: str = "the entry check") -> np.ndarray:
        """Reduce :attr:`send` (maximum over ranks) into :attr:`received` and return it: the
        digest first (:meth:`unanimous`; ``timeout`` and ``doing``: see :meth:`complete`)."""
        if self.unanimous(timeout, doing):
            np.copyto(self.received, self.send)  # every rank sent this very vector
        return self.received

    def minimum(self, value: int) -> int:
        """The minimum over ranks of ``value`` (a blocking ``allreduce``)."""
        return int(self.comm.allreduce(value, op=mpi().MIN))

    def allgather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order (a blocking ``allgather``)."""
        return list(self.comm.allgather(value))

    def free(self) -> None:
        """Release the persistent requests (before the communicator is freed)."""
        for request in (self.request, self.digest_send, self.vector_request):
            if request is not None:
                request.Free()
        self.request = self.digest_send = self.vector_request = None


class MPIEntryCheck(EntryCheck):
    """The entry check on a :class:`CheckReducer`: in the common case (every rank sends the
    same vector) the reduced vector is this rank's own, known from the digest's collective
    alone (:meth:`CheckReducer.unanimous`), so nothing is copied or compared but the digest."""

    agreement: CheckReducer

    def _exchange(self, timeout: float | None) -> tuple[np.ndarray, bytes]:
        reducer = self.agreement
        if reducer.unanimous(timeout, self._doing_text or self._doing()):
            return reducer.send, reducer.sent  # the maximum of equal vectors: this one
        reduced = reducer.received
        return reduced, reduced.tobytes()

    def again_differing(self, repeat: Repeat, timeout: float | None = None) -> tuple[CheckOutcome, bool]:
        """The rest of :meth:`again <linop.backends.entry_check.EntryCheck.again>` after a
        digest's reduction that a caller started itself (the plan's repeated call,
        :mod:`linop.backends.mpi.repeated`) has found that the ranks' vectors differ: the
        repeat's whole vector reduced (the second collective, which every rank makes) and
        decoded, the same on every rank."""
        self.load(repeat.signature, repeat.sent, repeat.vector)  # the caller wrote the digest alone
        reducer = self.agreement
        reducer.reduce_whole(timeout, self._doing_text or self._doing())
        reduced = reducer.received
        return self._again_decided(repeat, reduced, reduced.tobytes())
