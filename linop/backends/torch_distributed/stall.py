"""The stall diagnosis on a process group: a rank at the same call as its peers, but on the
other path (the shared part, records and the watcher: :mod:`linop.backends.stall_record`).

A wrapper on a process group (:func:`linop.frameworks.torch_function.function` with
``group=``, :func:`linop.frameworks.dtensor.redistribute_local`) binds its plan on the first
call and runs later calls of the same dtypes on the bound plan, with no entry check; a call
with other dtypes rebinds, through the collective entry check. The choice is local: when one
rank alone changes its input's dtype, it enters the check's reduction while its peers run the
bound data movement, and neither completes. Before, both waited for the deadline (600 s by
default; forever with none).

The diagnosis sends nothing in the common path (a call that completes within
:data:`~linop.backends.stall_record.GRACE`, 1 s):

- :func:`enter` and :func:`leave` around each call of a wrapper mark, in this process, what it
  is in: a :class:`~linop.backends.stall_record.CallRecord` (the tree's fingerprint, the same on every rank; the call's
  number among the calls of that tree on that group, the same on every rank that keeps in
  step; its kind, ``checked`` or ``bound``; the inputs' dtypes and shapes), built only when
  published: about 1 us of CPU per call (0.95 us measured for :func:`enter` and
  :func:`leave`, beside about 150 us for a small wrapper call on one process).
- A watcher thread (one per process, started by the first call, woken every 0.25 s,
  :data:`~linop.backends.stall_record.TICK`) publishes the record of a call that has run
  longer than the grace period in the default group's store
  (``linop/stall/<group>/<world rank>``, :data:`RECORD_KEY`), and reads the records of the
  group's other ranks (at most :data:`~linop.backends.stall_record.READ_AT_ONCE`, 64, per
  tick, in turn: never every rank of a huge job at once). A peer at the *same* call of the same tree in the other kind is
  proof of a stall (a slow peer, or one at an earlier call, is not: nothing is raised for it);
  the finding is kept on the call, and the record republished with ``seen``.
- A wait on the group that has a deadline or runs for a wrapper's call
  (:func:`wait`, which :meth:`GroupContext.wait <linop.backends.torch_distributed.group.GroupContext.wait>`
  calls: the entry check's reduction, a bound plan's guarded waits) waits in slices of a
  tick (``work.wait(timeout)``, which gloo lets a rank repeat: the collective goes on) after
  the grace period; once its call has a finding, and the peer has seen it too (or
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

A rank that refuses its input on its own in a wrapper's call after binding (its local checks,
a bound call's shape check) publishes a ``failed`` record of that call at once (:func:`failed`),
which its peer, blocked in the bound call, reads when its wait ends at the closed connection
(:func:`finding` with ``look=True``; the call holds the store for that): the peer's
:class:`~linop.errors.RankFailedError` names the rank and its error, where the store's host
outlives the refusing rank.

Only gloo waits are sliced (NCCL's ``wait(timeout)`` may abort the communicator): on NCCL the
deadline alone bounds such a stall. The store is the default group's: when its host (rank 0)
has ended, nothing is published or read (best effort), and the deadline applies.
"""

from __future__ import annotations

import datetime
import time
import weakref
from dataclasses import replace
from typing import Any

from ...errors import PeerMismatchError, RankFailedError
from ..stall_record import GRACE, TICK, CallRecord, WatchedCall, active, begin, end

__all__ = ["ACKNOWLEDGE", "PUBLISHED", "RECORD_KEY", "enter", "failed", "finding", "leave", "wait"]

ACKNOWLEDGE = 2.0
"""Seconds a rank that found a mismatch waits, at most, for the peer's record to say it has
seen it too, before shutting its group down (the store lives on rank 0: shut down first, it
could leave the peer unable to read the finding)."""

RECORD_KEY = "linop/stall/{group}/{rank}"
"""The store key of a rank's record (its group's name, its world rank)."""

PUBLISHED = [0]
"""How many records this process has published (for tests)."""


def enter(plan: Any, kind: str, state: Any) -> WatchedCall:
    """Mark this process as in a call of ``plan`` (a
    :class:`~linop.backends.torch_distributed.TorchDistributedPlan`) of ``kind`` (``checked``
    or ``bound``) on ``state`` (its input tensors by name); pass the result to :func:`leave`."""
    call = begin(plan, kind, state, _diagnose)
    call.transport = _held(call.context)
    return call


def leave(call: WatchedCall) -> None:
    """The call ended (returned or raised): unmark it, and withdraw its record if published."""
    end(call)
    if call.published is not None:
        try:
            call.transport.delete_key(_key(call.context, call.rank))
        except Exception:  # the store's host ended
            pass
    call.transport = None


_STORES: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
"""Per group context, a weak reference to the default store and the record keys of its ranks:
a call holds the store (so that a wait ended by a peer's closed connection can still read the
peer's record after the group was shut down), and only the call: the store's server on its
host ends with ``destroy_process_group`` as without linop."""


def _held(context: Any) -> Any:
    """The default store for a call on ``context`` (None where there is none)."""
    found = _STORES.get(context)
    store = None if found is None else found[0]()
    if store is None:
        try:
            store = _store()
            _STORES[context] = (weakref.ref(store), [_key(context, member) for member in range(context.size)])
        except Exception:  # not initialized, or no weak reference to it
            return None
    return store


def failed(plan: Any, error: BaseException, call: WatchedCall | None = None) -> None:
    """Publish at once that this rank raises ``error`` on its own at ``call`` of ``plan`` (by
    default its next call: a wrapper's local check before the call; after binding its peers
    are in the bound call, and cannot be told otherwise), so that a peer's watcher names this
    rank and its error. The record stays (the peer may read it late; it names this call
    only). Best effort."""
    if call is None:
        call = begin(plan, "failed", {}, _nothing)
        end(call)
    text = str(error).splitlines()[0] if str(error) else ""
    record = CallRecord(plan.fingerprint.hex(), call.number, "failed", f"{type(error).__name__}: {text}")
    try:
        store = _held(call.context)
        if store is not None:
            store.set(_key(call.context, call.rank), record.text())
    except Exception:  # the store's host ended
        pass


def _nothing(call: WatchedCall) -> None:
    return None


def finding(call: WatchedCall, *, look: bool = False) -> str | None:
    """The mismatch the watcher found for ``call`` (worded), or None; ``look``: read the
    peers' records now if it found none (after a wait that ended early, at a peer's closed
    connection: a peer that failed on its own left its record, readable while the store's
    host lives)."""
    if call.found is None and look:
        try:
            _diagnose(call)
        except Exception:  # the store's host ended
            pass
    return call.found


def wait(context: Any, work: Any, timeout: float | None) -> None:
    """Wait for ``work`` (a collective on ``context``'s group) as ``work.wait(timeout)`` does,
    in slices while a wrapper's call on the group is in progress (gloo), so that a finding of
    the watcher ends it: then the group is shut down on this rank and
    :class:`~linop.errors.PeerMismatchError` raised. The ``RuntimeError`` of a timeout or a
    lost connection is raised as ``work.wait`` raises it (the caller names the ranks)."""
    call = active()
    if call is None or call.context is not context or context.backend != "gloo":
        if timeout is None:
            work.wait()
        else:
            work.wait(datetime.timedelta(seconds=timeout))
        return
    clock = time.monotonic
    end_at = None if timeout is None else clock() + timeout
    while True:
        now = clock()
        step = max(call.started + GRACE - now, TICK)
        if end_at is not None:
            step = min(step, end_at - now)
        try:
            work.wait(datetime.timedelta(seconds=max(step, 1e-3)))
            return
        except RuntimeError as failure:
            text = str(failure).lower()
            if "timed out" not in text and "timeout" not in text:
                raise  # a lost connection
            if end_at is not None and clock() >= end_at:
                raise
        found = call.found
        if found is not None and call.found_failed:  # a peer's own error: it waits for nothing
            context.shut_down()
            raise RankFailedError(found)
        if found is not None and (call.settled or clock() >= call.found_at + ACKNOWLEDGE):
            context.shut_down()  # a collective is left unfinished: the group is unusable
            raise PeerMismatchError(found)


def _store() -> Any:
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


def _world_rank(context: Any, member: int) -> int:
    import torch.distributed as dist

    return member if context.world else int(dist.get_global_rank(context.group, member))


def _key(context: Any, member: int) -> str:
    found = _STORES.get(context)
    if found is not None:
        return str(found[1][member])
    group = getattr(context.group, "group_name", "") or "default"
    return RECORD_KEY.format(group=group, rank=_world_rank(context, member))


def _diagnose(call: WatchedCall) -> None:
    """The watcher's tick for a call past GRACE: publish its record (once, and again with
    ``seen`` after a finding), read the next window of peers' records."""
    context = call.context
    store = call.transport if call.transport is not None else _store()
    mine = call.record()
    if call.published is None:
        store.set(_key(context, call.rank), mine.text())
        call.published = mine
        PUBLISHED[0] += 1
    differing: list[tuple[int, CallRecord]] = []
    for member in call.window():
        key = _key(context, member)
        if not store.check([key]):
            continue
        theirs = CallRecord.parse(store.get(key).decode())
        if theirs is not None and mine.stalls_with(theirs):
            differing.append((member, theirs))
    if differing and call.found is None:
        call.find(*differing[0])
        call.published = replace(mine, seen=True)
        store.set(_key(context, call.rank), call.published.text())
    if differing and all(theirs.seen or theirs.kind == "failed" for _, theirs in differing):
        call.settled = True
