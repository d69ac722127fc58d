"""What a rank is in, for the stall diagnosis of the wrappers' calls on several ranks: the
part shared by the torch.distributed engine (:mod:`linop.backends.torch_distributed.stall`)
and MPI (:mod:`linop.backends.mpi.stall`).

A wrapper (:func:`linop.frameworks.torch_function.function` with ``group=`` or ``comm=``)
binds its plan on the first call and runs later calls of the same dtypes on the bound plan,
with no entry check; a call with other dtypes rebinds, through a collective. The choice is
local: when one rank alone changes its input's dtype, it enters the collective while its
peers run the bound data movement, and neither completes. The diagnosis names it:

- :func:`begin` and :func:`end` around each call of a wrapper mark, in this process, what it
  is in (a :class:`WatchedCall`: a small object and a counter, about 1 us of CPU per call
  with the store lookup of :mod:`linop.backends.torch_distributed.stall`; nothing is sent);
- a watcher thread (one per process, started by the first call, woken every :data:`TICK`
  seconds) runs the engine's own step for a call that has run longer than :data:`GRACE`
  seconds: it publishes the call's :class:`CallRecord` (the tree's fingerprint, the same on
  every rank; the call's number among this rank's calls of that tree on that group or
  communicator, the same on every rank that keeps in step; its kind, ``checked`` or
  ``bound``; the inputs' dtypes and shapes) and reads the peers';
- a peer at the *same* call of the same tree in the other kind is proof of a stall (a slow
  peer, or one at another call, is not: nothing is raised for it), worded by :func:`words`;
  so is a ``failed`` record of that call (a rank that refused its input on its own there,
  published at once by :func:`linop.backends.torch_distributed.stall.failed`).
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "GRACE",
    "KINDS",
    "READ_AT_ONCE",
    "TICK",
    "CallRecord",
    "WatchedCall",
    "active",
    "begin",
    "end",
    "words",
]

GRACE = 1.0
"""Seconds a wrapper's call runs before its record is published and its peers' are read: far
above a call that completes (the check's reduction takes microseconds to milliseconds; a rank
descheduled on a loaded machine, tens of milliseconds), and short beside any deadline."""

TICK = 0.25
"""Seconds between two wake-ups of the watcher (and the slices of a watched wait after
:data:`GRACE`): a stall is found within about ``GRACE + 2 * TICK`` of the later rank's call."""

READ_AT_ONCE = 64
"""The most peers whose records one tick reads or sends to (in turn over the group's ranks):
never every rank of a huge job at once."""


@dataclass(frozen=True, slots=True)
class CallRecord:
    """What a rank is in, as published: ``identity`` (the tree's fingerprint, hex), ``call``
    (its number among this rank's calls of that tree on the group, from 1), ``kind``
    (``checked``: through a collective check, its inputs changed or first; ``bound``: the
    bound plan, no check; ``failed``: this rank raised an error of its own at the call, before
    any data moved), ``key`` (the inputs' dtypes and shapes; for ``failed``, the error),
    ``seen`` (this rank found a mismatch at this call)."""

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
        if len(parts) != 5 or not parts[1].isdigit() or parts[2] not in KINDS:
            return None
        return cls(parts[0], int(parts[1]), parts[2], parts[4], parts[3] == "1")

    def describe(self) -> str:
        """The path and the inputs, in words."""
        if self.kind == "checked":
            return f"goes through the entry check (its inputs changed, or the first call) with {self.key}"
        if self.kind == "failed":
            return f"raised {self.key} there on its own, before any data moved"
        return f"runs its bound plan (no entry check: its inputs unchanged) with {self.key}"

    def stalls_with(self, other: CallRecord) -> bool:
        """Whether ``other`` (a peer's record) proves a stall with this one: the same call of
        the same tree, on the other path."""
        return other.identity == self.identity and other.call == self.call and other.kind != self.kind


NO_INPUTS = "no input blocks"
"""A :class:`CallRecord`'s key for a rank with no input blocks of the tree (the torch wrappers'
calls of such a tree agree on dtypes first, :meth:`linop.frameworks.torch_function._Runner.agree`,
so such a rank is not left on its bound plan by a dtype change there)."""

KINDS = ("checked", "bound", "failed")
"""The kinds of a :class:`CallRecord`."""


class WatchedCall:
    """One call of a wrapper in progress (:func:`begin`): what the watcher publishes, and
    what it found (:attr:`found`, worded, and when)."""

    __slots__ = (
        "context",
        "found",
        "found_at",
        "found_failed",
        "kind",
        "number",
        "plan",
        "previous",
        "published",
        "rank",
        "settled",
        "size",
        "started",
        "state",
        "step",
        "transport",
        "turn",
    )

    def __init__(
        self, plan: Any, kind: str, number: int, state: Any, step: Callable[[WatchedCall], None]
    ) -> None:
        self.context = plan.context
        self.plan = plan
        self.rank, self.size = int(plan.context.rank), int(plan.context.size)
        self.kind = kind
        self.number = number
        self.state = state
        self.step = step  # the engine's tick for this call past GRACE
        self.started = time.monotonic()
        self.previous = _ACTIVE[0]  # a call this one runs inside (restored at end)
        self.published: CallRecord | None = None
        self.found: str | None = None
        self.found_at = 0.0
        self.found_failed = False  # the finding is a peer's own error (not a mismatch)
        self.settled = False  # the peers that differ have seen the finding too
        self.turn = 0  # where the next tick's window of peers starts
        self.transport: Any = None  # the engine's, held for the call (the torch store)

    def record(self) -> CallRecord:
        """This call's record (the published one once published)."""
        if self.published is not None:
            return self.published
        key = ", ".join(
            f"{name} {str(getattr(t, 'dtype', '?')).removeprefix('torch.')} {tuple(getattr(t, 'shape', ()))}"
            for name, t in self.state.items()
        )
        return CallRecord(self.plan.fingerprint.hex(), self.number, self.kind, key or NO_INPUTS)

    def window(self) -> list[int]:
        """The next :data:`READ_AT_ONCE` peers, in turn (the ranks other than this one, from
        where the last window ended; no list of every rank)."""
        count = self.size - 1
        if count <= 0:
            return []
        start = self.turn % count
        self.turn += READ_AT_ONCE
        picks = ((start + i) % count for i in range(min(READ_AT_ONCE, count)))
        return [peer if peer < self.rank else peer + 1 for peer in picks]

    def find(self, member: int, theirs: CallRecord) -> None:
        """Keep the finding that peer ``member`` is at this call on the other path."""
        if self.found is None:
            self.found = words(self, self.record(), member, theirs)
            self.found_at = time.monotonic()
            self.found_failed = theirs.kind == "failed"


_ACTIVE: list[WatchedCall | None] = [None]
"""The call this process is in (calls on a group or communicator are collective: one at a time)."""

_NUMBERS: weakref.WeakKeyDictionary[Any, dict[bytes, int]] = weakref.WeakKeyDictionary()
"""Per group or communicator context, the number of calls of each tree (by fingerprint) so far."""


def active() -> WatchedCall | None:
    """The wrapper's call this process is in, if any."""
    return _ACTIVE[0]


def begin(plan: Any, kind: str, state: Any, step: Callable[[WatchedCall], None]) -> WatchedCall:
    """Mark this process as in a call of ``plan`` (its ``context`` and ``fingerprint`` are
    read) of ``kind`` (``checked`` or ``bound``) on ``state`` (its input tensors by name);
    ``step`` is what the watcher runs for it each tick past :data:`GRACE`. Pass the result to
    :func:`end`. Starts the watcher on first use."""
    context = plan.context
    numbers = _NUMBERS.get(context)
    if numbers is None:
        numbers = _NUMBERS[context] = {}
    number = numbers.get(plan.fingerprint, 0) + 1
    numbers[plan.fingerprint] = number
    call = WatchedCall(plan, kind, number, state, step)
    _ACTIVE[0] = call
    if _WATCHER[0] is None:
        _start_watcher()
    return call


def end(call: WatchedCall) -> None:
    """The call ended (returned or raised): unmark it."""
    if _ACTIVE[0] is call:
        _ACTIVE[0] = call.previous


def words(call: WatchedCall, mine: CallRecord, member: int, theirs: CallRecord) -> str:
    """The finding that rank ``member`` is at ``call`` on the other path (or failed there), in
    words."""
    where = (
        f"rank {call.rank}: rank {member} is at the same call of {call.plan.op} on the {call.size} ranks "
        f"(call {mine.call} of this tree) but {theirs.describe()}, where this rank {mine.describe()}: "
    )
    if theirs.kind == "failed":
        return where + "this rank's call cannot complete (the ranks cannot be used any more: end the job)"
    blind = member if theirs.key == NO_INPUTS else call.rank if mine.key == NO_INPUTS else None
    if blind is not None and theirs.kind != mine.kind:
        return where + (
            f"rank {blind} has no input blocks of this tree, so it cannot see its peers' inputs change "
            "dtype after its binding, and this call ran without the ranks' agreement on dtypes that the "
            "torch wrappers make at each call of such a tree, so neither path can complete; keep one "
            "dtype for this tree where it is bound outside those calls (the ranks cannot be used any "
            "more: end the job)"
        )
    return where + (
        "one rank alone changed its inputs' dtypes after the wrapper bound its plan, and neither path "
        "can complete; pass the same dtypes on every rank (the ranks cannot be used any more: end the job)"
    )


# -- the watcher ------------------------------------------------------------------------------

_WATCHER: list[threading.Thread | None] = [None]
_STOP = threading.Event()


def _start_watcher() -> None:
    thread = threading.Thread(target=_watch, name="linop-stall-watch", daemon=True)
    _WATCHER[0] = thread
    thread.start()
    atexit.register(_stop_watcher)  # after the engines' own (MPI's finalization): runs before them


def _stop_watcher() -> None:
    _STOP.set()
    thread = _WATCHER[0]
    if thread is not None and thread is not threading.current_thread():
        thread.join(timeout=2 * TICK)


def _forget_watcher() -> None:  # in a forked child: the parent's thread is not there
    _WATCHER[0] = None
    _ACTIVE[0] = None


os.register_at_fork(after_in_child=_forget_watcher)


def _watch() -> None:
    while not _STOP.wait(TICK):
        call = _ACTIVE[0]
        if call is None or time.monotonic() - call.started < GRACE:
            continue
        try:
            call.step(call)
        except Exception:  # best effort: the store's host ended, the group was destroyed
            pass
