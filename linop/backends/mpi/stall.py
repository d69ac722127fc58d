"""The stall diagnosis under MPI (the shared part, records and the watcher:
:mod:`linop.backends.stall_record`): a rank at the same call of a wrapper as its peers, but on
the other path.

The torch wrapper under MPI (:func:`linop.frameworks.torch_function.function` with ``comm=``)
binds its plan on the first call and runs later calls of the same dtypes on the bound plan (its
persistent requests, or the plan run straight, unchecked); a call with other dtypes rebinds,
through a collective (:func:`linop.backends.mpi.deadline.largest_within`, then the entry
check). When one rank alone changes its dtypes, it waits in that collective while its peers
wait in the bound data movement. Before, the rank that rebinds waited forever (that first
collective had no deadline), and with it every peer.

Here, as on a process group, but with messages instead of a store:

- the peer in its bound call (a blocking MPI wait: it cannot look at anything) has the
  watcher thread send its :class:`~linop.backends.stall_record.CallRecord` to up to
  :data:`~linop.backends.stall_record.READ_AT_ONCE` peers once the call has run
  :data:`~linop.backends.stall_record.GRACE` seconds (a small message with the reserved tag
  :func:`record_tag` on the plan's private communicator, as the deadline's notices use;
  needs ``MPI_THREAD_MULTIPLE``, mpi4py's default: at a lower thread level nothing is sent);
- the rank that rebinds waits polled within its deadline (:func:`~linop.backends.mpi.deadline.wait_all`,
  which after the grace period reads the records sent to it every
  :data:`~linop.backends.stall_record.TICK` seconds, :func:`check`): a record of the same
  call on the other path raises :class:`~linop.errors.PeerMismatchError` naming the peer and
  both sides' dtypes, and the job is aborted (``MPI_Abort``, as at the deadline), which ends
  the peer blocked in its bound call too. Every rank ends within seconds, not at the deadline.

Records nobody waits for (a slow peer's, sent to a rank that was only slow too) are read at
the start of a wrapper's call when the last reading is :data:`COLLECT_EVERY` seconds old (one
matched probe: about a microsecond, at most once a second) and kept, the latest per peer (a
record may arrive before this rank reaches the call it names): nothing piles up in MPI's
queue. The watcher makes MPI calls only while this rank waits in a bound call (never at exit).
"""

from __future__ import annotations

import time
import weakref
from typing import Any

from ...errors import PeerMismatchError
from ...program import TAG_LIMIT
from ..stall_record import GRACE, CallRecord, WatchedCall, active, begin, end
from .datatypes import mpi

__all__ = ["SENT", "check", "enter", "leave", "record_tag"]

SENT = [0]
"""How many records this process has sent (for tests)."""


def record_tag(comm: Any) -> int | None:
    """The reserved tag of the records: one below the deadline's notices' (the largest tag the
    MPI library allows); None where that is not above every tag of the schedules and of the
    bound plans' exchanges (:data:`linop.program.TAG_LIMIT` and below): no records are sent or
    read there, and a stall ends at the deadline."""
    from .deadline import notice_tag  # (deadline imports this module)

    tag = notice_tag(comm) - 1
    return tag if tag > TAG_LIMIT else None


def enter(plan: Any, kind: str, state: Any) -> WatchedCall:
    """Mark this process as in a call of ``plan`` (a
    :class:`~linop.backends.mpi.plan.DistributedPlan`) of ``kind`` (``checked`` or ``bound``)
    on ``state`` (its input tensors by name); pass the result to :func:`leave`."""
    threads = _THREADS[0]
    if threads is None:
        threads = _THREADS[0] = _threads_allowed()
    call = begin(plan, kind, state, _send if threads and kind == "bound" else _nothing)
    if call.started >= _COLLECTED[0] + COLLECT_EVERY:
        _COLLECTED[0] = call.started
        _collect(plan.context)
    return call


def leave(call: WatchedCall) -> None:
    """The call ended (returned or raised): unmark it."""
    end(call)


def check(comm: Any) -> None:
    """In a polled wait on ``comm`` (:func:`~linop.backends.mpi.deadline.wait_all`): when a
    wrapper's call on it has run past the grace period, read the records sent to this rank;
    raise :class:`~linop.errors.PeerMismatchError` when one is of the same call on the other
    path."""
    call = active()
    if call is None or call.plan.comm is not comm or time.monotonic() - call.started < GRACE:
        return
    mine = call.record()
    for member, theirs in list(_collect(call.context).items()):
        if mine.stalls_with(theirs):
            call.find(member, theirs)
    if call.found is not None:
        raise PeerMismatchError(call.found)


_LATEST: weakref.WeakKeyDictionary[Any, dict[int, CallRecord]] = weakref.WeakKeyDictionary()
"""Per communicator context that a wrapper has called on, the latest record each peer sent."""

COLLECT_EVERY = 1.0
"""Seconds between two readings of the records at the start of a call (see the module docstring)."""

_COLLECTED = [0.0]


_THREADS: list[bool | None] = [None]
"""Whether the watcher may send (:func:`_threads_allowed`), asked once: MPI's thread level is
fixed when it is initialized."""


def _threads_allowed() -> bool:
    return bool(mpi().Query_thread() >= mpi().THREAD_MULTIPLE)


def _nothing(call: WatchedCall) -> None:
    return None


def _collect(context: Any) -> dict[int, CallRecord]:
    """Read the records sent to this rank on ``context``'s communicator (each message taken
    whole by a matched probe, so the watcher and a polled wait never race for one) into the
    latest per peer; that table."""
    latest = _LATEST.setdefault(context, {})
    if getattr(context, "freed", False):
        return latest
    comm = context.comm
    module = mpi()
    tag = record_tag(comm)
    if tag is None:
        return latest
    status = module.Status()
    while True:
        message = comm.improbe(source=module.ANY_SOURCE, tag=tag, status=status)
        if message is None:
            return latest
        source = status.Get_source()
        text = message.recv()
        record = CallRecord.parse(text) if isinstance(text, str) else None
        if record is not None:
            latest[source] = record


def _send(call: WatchedCall) -> None:
    """The watcher's tick for a bound call past GRACE: send its record to the next window of
    peers, until every peer has it."""
    comm = call.plan.comm
    tag = record_tag(comm)
    if tag is None or call.turn >= call.size - 1:
        return
    if call.published is None:
        call.published = call.record()
    text = call.published.text()
    requests = [comm.isend(text, dest=member, tag=tag) for member in call.window()]
    SENT[0] += len(requests)
    for request in requests:
        request.wait()
