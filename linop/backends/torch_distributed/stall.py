"""The stall diagnosis: a rank at the same call as its peers, but on the other path.

A wrapper on a process group (:func:`linop.frameworks.torch_function.function` with
``group=``, :func:`linop.frameworks.dtensor.redistribute_local`) binds its plan on the first
call and runs later calls of the same dtypes on the bound plan, with no entry check; a call
with other dtypes rebinds, through the collective entry check. The choice is local: when one
rank alone changes its input's dtype, it enters the check's reduction while its peers run the
bound data movement, and neither completes. Before, both waited for the deadline (600 s by
default; forever with none).

The diagnosis costs nothing in the common path (a call that completes within :data:`GRACE`):

- :func:`enter` and :func:`leave` around each call of a wrapper mark, in this process, what it
  is in: a :class:`CallRecord` (the tree's fingerprint, the same on every rank; the call's
  number among the calls of that tree on that group, the same on every rank that keeps in
  step; its kind, ``checked`` or ``bound``; the inputs' dtypes and shapes), built only when
  published. A few attribute writes per call.
- A watcher thread (one per process, started by the first call, woken every :data:`TICK`
  seconds) publishes the record of a call that has run longer than :data:`GRACE` seconds in
  the default group's store (``linop/stall/<group>/<world rank>``), and reads the records of
  the group's other ranks (at most :data:`READ_AT_ONCE` per tick, in turn: never every rank
  of a huge job at once). A peer at the *same* call of the same tree in the other kind is
  proof of a stall (a slow peer, or one at an earlier call, is not: nothing is raised for it);
  the finding is kept on the call, and the record republished with ``seen``.
- A wait on the group that has a deadline or runs for a wrapper's call
  (:func:`wait`, which :meth:`GroupContext.wait <linop.backends.torch_distributed.group.GroupContext.wait>`
  calls: the entry check's reduction, a bound plan's guarded waits) waits in slices of
  :data:`TICK` (``work.wait(timeout)``, which gloo lets a rank repeat: the collective goes on)
  after the first :data:`GRACE`; once its call has a finding, and the peer has seen it too (or
  :data:`ACKNOWLEDGE` seconds passed), it shuts the group down on this rank and raises
  :class:`~linop.errors.PeerMismatchError` naming the peer and both sides' dtypes and shapes.
- A rank whose bound call is *not* guarded (a bound plan's later calls wait without a
  deadline unless bound with ``every_call=True``) cannot leave its wait on its own: gloo ends
  it only when the peer's process ends (its connections close; ``destroy_process_group`` does
  not close them). It ends then, and the wrapper raises :class:`~linop.errors.PeerMismatchError`
  from the watcher's finding instead of the bare :class:`~linop.errors.RankFailedError`. An
  uncaught error ends the peer's process at once, so both ranks end within seconds; a peer
  that catches its error and lives on holds this rank until it ends (as after any failure
  mid-call: end the job).

Only gloo waits are sliced (NCCL's ``wait(timeout)`` may abort the communicator): on NCCL the
deadline alone bounds such a stall. The store is the default group's: when its host (rank 0)
has ended, nothing is published or read (best effort), and the deadline applies.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
import weakref
from dataclasses import dataclass, replace
from typing import Any

from ...errors import PeerMismatchError

__all__ = [
    "ACKNOWLEDGE",
    "GRACE",
    "READ_AT_ONCE",
    "PUBLISHED",
    "RECORD_KEY",
    "TICK",
    "CallRecord",
    "enter",
    "finding",
    "leave",
    "wait",
]

GRACE = 1.0
"""Seconds a wrapper's call runs before its record is published and its peers' are read: far
above a call that completes (the check's reduction takes microseconds to milliseconds; a rank
descheduled on a loaded machine, tens of milliseconds), and short beside any deadline."""

TICK = 0.25
"""Seconds between two wake-ups of the watcher (and the slices of a watched wait after
:data:`GRACE`): a stall is found within ``GRACE + 2 * TICK`` of the later rank's call."""

ACKNOWLEDGE = 2.0
"""Seconds a rank that found a mismatch waits, at most, for the peer's record to say it has
seen it too, before shutting its group down (the store lives on rank 0: shut down first, it
could leave the peer unable to read the finding)."""

READ_AT_ONCE = 64
"""The most peer records the watcher reads per tick (in turn over the group's ranks)."""

RECORD_KEY = "linop/stall/{group}/{rank}"
"""The store key of a rank's record (its group's name, its world rank)."""

PUBLISHED = [0]
"""How many records this process has published (for tests)."""


@dataclass(frozen=True, slots=True)
class CallRecord:
    """What a rank is in, as published: ``identity`` (the tree's fingerprint, hex), ``call``
    (its number among this rank's calls of that tree on the group, from 1), ``kind``
    (``checked``: through the entry check, its inputs changed or first; ``bound``: the bound
    plan, no check), ``key`` (the inputs' dtypes and shapes), ``seen`` (this rank found a
    mismatch at this call)."""

    identity: str
    call: int
    kind: str
    key: str
    seen: bool = False

    def text(self) -> str:
        return f"{self.identity}|{self.call}|{self.kind}|{int(self.seen)}|{self.key}"

    @classmethod
    def parse(cls, text: str) -> CallRecord | None:
        """The record of ``text`` (None when it is not one)."""
        parts = text.split("|", 4)
        if len(parts) != 5 or not parts[1].isdigit() or parts[2] not in ("checked", "bound"):
            return None
        return cls(parts[0], int(parts[1]), parts[2], parts[4], parts[3] == "1")

    def describe(self) -> str:
        """The path and the inputs, in words."""
        if self.kind == "checked":
            return f"goes through the entry check (its inputs changed, or the first call) with {self.key}"
        return f"runs its bound plan (no entry check: its inputs unchanged) with {self.key}"


class _Call:
    """One call of a wrapper in progress (:func:`enter`): what the watcher publishes and
    what it found."""

    __slots__ = (
        "context",
        "found",
        "found_at",
        "kind",
        "number",
        "plan",
        "previous",
        "published",
        "settled",
        "started",
        "state",
    )

    def __init__(self, context: Any, plan: Any, kind: str, number: int, state: Any) -> None:
        self.context = context
        self.plan = plan
        self.kind = kind
        self.number = number
        self.state = state
        self.started = time.monotonic()
        self.previous = _ACTIVE[0]  # a call this one runs inside (restored at leave)
        self.published: CallRecord | None = None
        self.found: str | None = None  # the finding, worded
        self.found_at = 0.0
        self.settled = False  # the peers that differ have seen it too

    def record(self) -> CallRecord:
        if self.published is not None:
            return self.published
        key = ", ".join(
            f"{name} {str(getattr(t, 'dtype', '?')).removeprefix('torch.')} {tuple(getattr(t, 'shape', ()))}"
            for name, t in self.state.items()
        )
        return CallRecord(self.plan.fingerprint.hex(), self.number, self.kind, key or "no input blocks")


_ACTIVE: list[_Call | None] = [None]
"""The call this process is in (calls on process groups are collective: one at a time)."""

_NUMBERS: weakref.WeakKeyDictionary[Any, dict[bytes, int]] = weakref.WeakKeyDictionary()
"""Per group context, the number of calls of each tree (by fingerprint) so far."""


def enter(plan: Any, kind: str, state: Any) -> _Call:
    """Mark this process as in a call of ``plan`` (a
    :class:`~linop.backends.torch_distributed.TorchDistributedPlan`) of ``kind`` (``checked``
    or ``bound``) on ``state`` (its input tensors by name); pass the result to :func:`leave`.
    Starts the watcher on first use."""
    context = plan.context
    numbers = _NUMBERS.get(context)
    if numbers is None:
        numbers = _NUMBERS[context] = {}
    number = numbers.get(plan.fingerprint, 0) + 1
    numbers[plan.fingerprint] = number
    call = _Call(context, plan, kind, number, state)
    _ACTIVE[0] = call
    if _WATCHER[0] is None:
        _start_watcher()
    return call


def leave(call: _Call) -> None:
    """The call ended (returned or raised): unmark it, and withdraw its record if published."""
    if _ACTIVE[0] is call:
        _ACTIVE[0] = call.previous
    if call.published is not None:
        try:
            _store().delete_key(_key(call.context, call.context.rank))
        except Exception:  # the store's host ended
            pass


def finding(call: _Call) -> str | None:
    """The mismatch the watcher found for ``call`` (worded), or None."""
    return call.found


def wait(context: Any, work: Any, timeout: float | None) -> None:
    """Wait for ``work`` (a collective on ``context``'s group) as ``work.wait(timeout)`` does,
    in slices while a wrapper's call on the group is in progress (gloo), so that a finding of
    the watcher ends it: then the group is shut down on this rank and
    :class:`~linop.errors.PeerMismatchError` raised. The ``RuntimeError`` of a timeout or a
    lost connection is raised as ``work.wait`` raises it (the caller names the ranks)."""
    call = _ACTIVE[0]
    if call is None or call.context is not context or context.backend != "gloo":
        if timeout is None:
            work.wait()
        else:
            work.wait(datetime.timedelta(seconds=timeout))
        return
    clock = time.monotonic
    end = None if timeout is None else clock() + timeout
    while True:
        now = clock()
        step = max(call.started + GRACE - now, TICK)
        if end is not None:
            step = min(step, end - now)
        try:
            work.wait(datetime.timedelta(seconds=max(step, 1e-3)))
            return
        except RuntimeError as failure:
            text = str(failure).lower()
            if "timed out" not in text and "timeout" not in text:
                raise  # a lost connection
            if end is not None and clock() >= end:
                raise
        found = call.found
        if found is not None and (call.settled or clock() >= call.found_at + ACKNOWLEDGE):
            context.shut_down()  # a collective is left unfinished: the group is unusable
            raise PeerMismatchError(found)


# -- the watcher ------------------------------------------------------------------------------

_WATCHER: list[threading.Thread | None] = [None]
_STOP = threading.Event()


def _start_watcher() -> None:
    thread = threading.Thread(target=_watch, name="linop-stall-watch", daemon=True)
    _WATCHER[0] = thread
    thread.start()


def _forget_watcher() -> None:  # in a forked child: the parent's thread is not there
    _WATCHER[0] = None
    _ACTIVE[0] = None


os.register_at_fork(after_in_child=_forget_watcher)


def _watch() -> None:
    turn = 0
    while not _STOP.wait(TICK):
        call = _ACTIVE[0]
        if call is None or time.monotonic() - call.started < GRACE:
            continue
        try:
            turn = _diagnose(call, turn)
        except Exception:  # best effort: the store's host ended, the group was destroyed
            pass


def _store() -> Any:
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


def _world_rank(context: Any, member: int) -> int:
    import torch.distributed as dist

    return member if context.world else int(dist.get_global_rank(context.group, member))


def _key(context: Any, member: int) -> str:
    group = getattr(context.group, "group_name", "") or "default"
    return RECORD_KEY.format(group=group, rank=_world_rank(context, member))


def _diagnose(call: _Call, turn: int) -> int:
    """One tick for a call past :data:`GRACE`: publish its record (once, and again with
    ``seen`` after a finding), read up to :data:`READ_AT_ONCE` peers' records; the next turn."""
    context = call.context
    store = _store()
    mine = call.record()
    if call.published is None:
        store.set(_key(context, context.rank), mine.text())
        call.published = mine
        PUBLISHED[0] += 1
    peers = [member for member in range(context.size) if member != context.rank]
    if not peers:
        return turn
    start = turn % len(peers)
    window = (peers[start:] + peers[:start])[:READ_AT_ONCE]
    differing: list[tuple[int, CallRecord]] = []
    for member in window:
        key = _key(context, member)
        if not store.check([key]):
            continue
        theirs = CallRecord.parse(store.get(key).decode())
        if theirs is None or theirs.identity != mine.identity or theirs.call != mine.call:
            continue  # another call (a slow peer, or an earlier one): no proof of anything
        if theirs.kind != mine.kind:
            differing.append((member, theirs))
    if differing and call.found is None:
        member, theirs = differing[0]
        call.found = _words(call, mine, member, theirs)
        call.found_at = time.monotonic()
        call.published = replace(mine, seen=True)
        store.set(_key(context, context.rank), call.published.text())
    if differing and all(theirs.seen for _, theirs in differing):
        call.settled = True
    return turn + len(window)


def _words(call: _Call, mine: CallRecord, member: int, theirs: CallRecord) -> str:
    rank = call.context.rank
    return (
        f"rank {rank}: rank {member} is at the same call of {call.plan.op} on the group of {call.context.size} "
        f"(call {mine.call} of this tree) but {theirs.describe()}, where this rank {mine.describe()}: "
        "one rank alone changed its inputs' dtypes or shapes after the wrapper bound its plan, and neither "
        "path can complete; pass the same dtypes on every rank (the group cannot be used any more: end "
        "the job)"
    )
