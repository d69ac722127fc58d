"""A deadline for the collectives at the MPI interpreter's entry: no rank waits forever for
a peer that never arrives.

Every application starts with a collective (the entry check's ``Allreduce``,
:mod:`linop.backends.mpi.check`; a bound plan's first call, :mod:`linop.backends.mpi.bound`;
the first plan on a communicator duplicates it, :mod:`linop.backends.mpi.context`).
A rank that never makes the call (it crashed elsewhere, took another branch, waits for input)
would leave every other rank blocked there. With a deadline the collective is completed by
polling (``Test``) instead of waiting (:func:`wait_all`: one ``Test`` at once, then
:data:`SPIN` seconds of ``Test`` calls, then sleeps growing from :data:`FIRST_PAUSE` to
:data:`LONGEST_PAUSE` between tests, so that a call whose peers arrive within a tenth of a
second costs about what a blocking wait does, and a longer wait holds no core); when the deadline passes, the rank
sends a short *notice* to every other rank on the private communicator (a reserved tag), and a
rank still polling that receives one gives up too and sends its own. After a short grace period
(:data:`GRACE` seconds) for the notices of the others, each rank that arrived knows which
ranks arrived, and raises :class:`~linop.errors.PeerTimeoutError` naming the others; the
interpreter then aborts the job (``MPI_Abort``, as :func:`~linop.backends.mpi.guards.guard`
does), since the missing rank may never return.

The deadline is ``timeout=`` (seconds) of ``apply`` / ``apply_mpi`` / ``plan_for``, else the
environment variable :data:`ENVIRONMENT` (read once per process, at the first use), else
:data:`~linop.backends.host_deadline.DEFAULT_SECONDS` (600 s: why, in
:mod:`linop.backends.host_deadline`); ``LINOP_TIMEOUT=off`` (``0``, ``none``), ``inf`` or any
value beyond :data:`NO_DEADLINE_BEYOND` means none (a blocking wait, no polling). A collective
with no deadline of its own (``MPI_Comm_dup``, the first call of a bound plan that runs the
ordinary application) is preceded by :func:`arrive_within`, a polled barrier with the same
deadline. The duplication's barrier and its notices run on the user's communicator (linop's
private one does not exist yet; the notices use the reserved tag, and a timeout ends the job
anyway).
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

import numpy as np

from ...errors import PeerTimeoutError, TimeoutArgumentError
from .. import stall_record as stall
from ..host_deadline import (
    DEFAULT_SECONDS,
    ENVIRONMENT,
    NO_DEADLINE_BEYOND,
    deadline_seconds,
    environment_text,
    text_seconds,
)
from ..stall_record import TICK
from . import stall as mpi_stall
from .datatypes import mpi
from .mpi_types import Intracomm

__all__ = [
    "DEFAULT_SECONDS",
    "ENVIRONMENT",
    "BUSY",
    "FIRST_PAUSE",
    "GRACE",
    "LONGEST_PAUSE",
    "SPIN",
    "NO_DEADLINE_BEYOND",
    "PeerTimeoutError",
    "arrive_within",
    "largest_within",
    "notice_tag",
    "deadline_seconds",
    "resolve_timeout",
    "wait_all",
]

GRACE = 2.0
"""Seconds a rank whose deadline passed waits for the other ranks' notices before naming the
ranks that did not arrive (generous: on an oversubscribed machine a rank may sleep that long)."""

SPIN = 0.1
"""Seconds :func:`wait_all` calls ``Test`` in a loop before its first sleep: as a blocking
``Wait`` does (MPICH's blocking waits poll the progress engine), so that a call whose peers
arrive within it (a 2-4 rank ``Allreduce`` took 2-20 us here; ranks a little apart, or
descheduled on a loaded machine, milliseconds) completes as soon as under a blocking wait.
Measured on the loaded machine (``benchmarks/bench_deadline.py``): spinning 1 ms, then sleeping,
made a checked call 3x slower than the blocking wait, a sleeping rank waking only
milliseconds later there; a wait longer than this holds no core."""

BUSY = 5e-5
"""Seconds of the spin without yielding the core (the latency of a reduction whose peers are
running: a few microseconds); then each test follows a ``sched_yield``."""

FIRST_PAUSE = 5e-5
"""Seconds of :func:`wait_all`'s first sleep after :data:`SPIN` (each next one twice as long)."""

LONGEST_PAUSE = 1e-3
"""The longest sleep of :func:`wait_all` between two tests: a call waiting for a late peer
completes at most this long after the peer arrives, and costs little CPU meanwhile."""

_UNSET = object()
_default: Any = _UNSET


def _parse(value: Any, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = text_seconds(value)
        except ValueError:
            raise TimeoutArgumentError(
                f"{what} must be a number of seconds (or off), not {value!r}"
            ) from None
        if value is None:
            return None
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise TimeoutArgumentError(
            f"{what} must be a number of seconds or None, not {type(value).__name__} {value!r}"
        )
    seconds = float(value)
    if math.isnan(seconds) or seconds <= 0:
        raise TimeoutArgumentError(
            f"{what} must be positive seconds (or None for no deadline), not {value!r}"
        )
    return deadline_seconds(seconds)


def resolve_timeout(timeout: Any) -> float | None:
    """The deadline in seconds for a call given ``timeout`` (None: the default of
    :data:`ENVIRONMENT`, read once per process, else :data:`DEFAULT_SECONDS`), or None for no
    deadline.

    Raises
    ------
    TimeoutArgumentError
        ``timeout`` (or the environment variable) is not a positive number of seconds.
    """
    global _default
    if timeout is not None:
        return _parse(timeout, "timeout=")
    if _default is _UNSET:
        _default = _parse(environment_text(os.environ), f"the environment variable {ENVIRONMENT}")
    return _default


def notice_tag(comm: Intracomm) -> int:
    """The reserved tag of the notices: the largest tag the MPI library allows (above every
    tag of the schedules, :data:`linop.program.TAG_LIMIT`)."""
    upper = comm.Get_attr(mpi().TAG_UB)
    return int(upper) if upper else 32767


def wait_all(requests: list[Any], comm: Intracomm, timeout: float, doing: str, *, busy: float = BUSY) -> None:
    """Complete ``requests`` (started collectives or transfers on ``comm``) within
    ``timeout`` seconds, or raise :class:`PeerTimeoutError` naming the ranks of ``comm`` that
    did not arrive (on every rank that did, within :data:`GRACE` of each other).

    Polled (see the module docstring): one ``Test`` per request at once (complete: nothing
    more), then ``Test`` calls for :data:`SPIN` seconds, after the first ``busy`` seconds
    (default :data:`BUSY`) each after ``sched_yield`` (as MPICH's blocking waits do on an
    oversubscribed machine), then sleeps growing from :data:`FIRST_PAUSE` to
    :data:`LONGEST_PAUSE` between tests, the peers' notices probed before each sleep.

    ``busy=0`` yields from the first test on: for a caller that knows that this node holds
    more ranks than cores (:attr:`CheckReducer.busy <linop.backends.mpi.check.CheckReducer.busy>`),
    where a busy spin keeps the peer that must arrive off the core (measured on 4 ranks over 2
    cores: the entry check's reduction took 60 us with the busy start, 10 us under MPICH's
    ``Wait``)."""
    # one request at a time: MPICH 5.0's Testall fails on persistent collectives
    pending = [request for request in requests if not request.Test()]
    if not pending:
        return
    clock = time.monotonic
    now = clock()
    end = now + timeout
    spin_end = now + SPIN
    busy_end = now + busy
    if len(pending) == 1:  # the common case (the check's reduction, a barrier): no list
        test = pending[0].Test
        while not test():
            now = clock()
            if now >= spin_end:
                break
            if now >= busy_end:
                os.sched_yield()  # to a peer descheduled on this core (no cost on an idle one)
        else:
            return
    else:
        while True:
            pending = [request for request in pending if not request.Test()]
            if not pending:
                return
            now = clock()
            if now >= spin_end:
                break
            if now >= busy_end:
                os.sched_yield()
    module = mpi()
    tag = notice_tag(comm)
    pause = FIRST_PAUSE
    watched = stall.active() is not None  # a wrapper's call: a peer's record may name a stall
    read_at = now
    while True:
        if comm.Iprobe(module.ANY_SOURCE, tag) or clock() >= end:
            _give_up(comm, tag, timeout, doing)
        if watched and clock() >= read_at:
            mpi_stall.check(comm)  # PeerMismatchError: a peer at this call on its bound plan
            read_at = clock() + TICK
        time.sleep(pause)
        pause = min(2 * pause, LONGEST_PAUSE)
        pending = [request for request in pending if not request.Test()]
        if not pending:
            return


def arrive_within(comm: Intracomm, timeout: float, doing: str, *, busy: float = BUSY) -> None:
    """Return once every rank of ``comm`` has called this (a nonblocking barrier, polled by
    :func:`wait_all`, ``busy`` as there), or raise :class:`PeerTimeoutError` naming the ranks
    that did not arrive within ``timeout`` seconds. For a blocking collective with no deadline
    of its own (the communicator's duplication, a bound plan's first call): after it no rank
    waits there for a missing one. Nothing to wait for on one rank."""
    if comm.Get_size() > 1:
        wait_all([comm.Ibarrier()], comm, timeout, doing, busy=busy)


def largest_within(
    comm: Intracomm, value: int, timeout: float | None, doing: str, *, busy: float | None = None
) -> int:
    """The largest ``value`` over the ranks of ``comm`` (an ``Iallreduce``), waited for within
    ``timeout`` seconds by :func:`wait_all` (None: a blocking ``Allreduce``): for a small
    agreement that is the first collective of a call (the torch wrapper's decision how to bind
    new dtypes, :class:`linop.frameworks.torch_function.BoundTensors`), so that a rank whose
    peers never join it (they run a bound plan: one rank alone changed its dtypes) raises
    :class:`PeerTimeoutError` at the deadline instead of waiting forever, and
    :class:`~linop.errors.PeerMismatchError` within seconds when a peer's record says so
    (:mod:`linop.backends.mpi.stall`; polled then even with no deadline). ``busy``: as
    :func:`wait_all`'s; None: the communicator's (:func:`~linop.backends.mpi.context.busy_for`:
    none on an oversubscribed node, where the peer that must arrive may share this core)."""
    sent = np.array([value], dtype=np.int64)
    received = np.zeros(1, dtype=np.int64)
    if comm.Get_size() == 1 or (timeout is None and stall.active() is None):
        comm.Allreduce(sent, received, op=mpi().MAX)
    else:  # polled: within the deadline, and reading the peers' records of a wrapper's call
        if busy is None:
            from .context import busy_for  # (the context module imports this one)

            busy = busy_for(comm)
        wait_all(
            [comm.Iallreduce(sent, received, op=mpi().MAX)],
            comm,
            math.inf if timeout is None else timeout,
            doing,
            busy=busy,
        )
    return int(received[0])


def _give_up(comm: Intracomm, tag: int, timeout: float, doing: str) -> None:
    module = mpi()
    rank, size = comm.Get_rank(), comm.Get_size()
    notice = np.zeros(1, dtype=np.int8)
    for other in range(size):  # eager, tiny: they complete without their receiver
        if other != rank:
            comm.Isend(notice, dest=other, tag=tag)
    arrived = {rank}
    status = module.Status()
    grace_end = time.monotonic() + GRACE
    received = np.zeros(1, dtype=np.int8)
    while len(arrived) < size and time.monotonic() < grace_end:
        while comm.Iprobe(module.ANY_SOURCE, tag, status):
            source = status.Get_source()
            comm.Recv(received, source=source, tag=tag)
            arrived.add(source)
        time.sleep(1e-3)
    missing = [r for r in range(size) if r not in arrived]
    if not missing:  # every rank gave up (each near its own deadline): no single culprit
        raise PeerTimeoutError(
            f"rank {rank}: {doing} did not complete within {timeout:g} s (timeout= or {ENVIRONMENT}); "
            f"every rank reached it, but not together"
        )
    raise PeerTimeoutError(
        f"rank {rank}: rank(s) {missing} did not arrive at {doing} within {timeout:g} s (timeout= or "
        f"{ENVIRONMENT}); rank(s) {sorted(arrived)} did"
    )
