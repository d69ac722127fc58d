"""Naming the ranks that did not arrive (or ended) when a wait fails on a process group:
:func:`roll_call`.

A collective waited for within a deadline (``work.wait(timeout)``: the entry check's
``all_reduce``, the barrier before a bound plan's call, a prepared bound call's own waits) tells
a rank only that it timed out, not which peer is missing; a closed connection (a peer's process
ended: killed, or failed) does not name the peer either. As on MPI
(:mod:`linop.backends.mpi.deadline`, where the ranks send each other notices), each rank whose
deadline passed answers a roll call: it sets a key of the default group's store
(``linop/arrived/<group>/<world rank>``), then waits up to :data:`GRACE` seconds for the keys of
the group's other ranks (each of those that arrived reaches its own deadline at about the same
time; after a closed connection, each rank left alive does the same). The ranks whose keys
are missing are the ones named in the :class:`~linop.errors.PeerTimeoutError`: those that
never arrived (or arrived after the others gave up), or ended. Nothing of this runs before a
wait fails: it costs nothing on a call that completes.

Best effort: a store that cannot be reached (its host ended) gives the error without names;
it says who hosts the store (:func:`store_host`: world rank 0 under ``init_process_group``'s
TCP and environment-variable rendezvous, which has then most likely ended; torchrun's agent,
which outlives the ranks, when they use it). No other channel names ranks on a broken group
(gloo's errors name a peer's address only, and a second store would have a host too):
``docs/reliability.md`` records the decision.
The group is unusable after a timeout (a collective is left unfinished), so one roll call per
group suffices.
"""

from __future__ import annotations

import datetime
import os
import time
from typing import Any

from ...errors import PeerTimeoutError

__all__ = ["GRACE", "ARRIVED_KEY", "answered", "roll_call", "is_timeout", "store_host"]

GRACE = 2.0
"""Seconds a rank whose deadline passed waits for the other ranks' keys (as
:data:`linop.backends.mpi.deadline.GRACE`: on an oversubscribed machine a rank may sleep that
long)."""

ARRIVED_KEY = "linop/arrived/{group}/{rank}"
"""The store key a rank sets when its deadline passes (its group's name, its world rank)."""


def is_timeout(error: BaseException) -> bool:
    """Whether a failed wait ended at its deadline (gloo and NCCL say "timed out" or
    "timeout"), rather than at a peer's closed connection."""
    text = str(error).lower()
    return "timed out" in text or "timeout" in text


def answered(context: Any, doing: str) -> set[int] | None:
    """The roll call on ``context``'s group (a
    :class:`~linop.backends.torch_distributed.group.GroupContext`): this rank's key set, then
    the ranks of the group whose keys appear within :data:`GRACE` seconds (this one included;
    all of them ends the wait early); None when the store cannot be reached."""
    import torch.distributed as dist

    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(datetime.timedelta(seconds=GRACE + 3))  # the group is unusable: do not wait long
        group = getattr(context.group, "group_name", "") or "default"
        keys = {}
        for member in range(context.size):
            world = member if context.world else dist.get_global_rank(context.group, member)
            keys[member] = ARRIVED_KEY.format(group=group, rank=world)
        store.set(keys[context.rank], doing)
        arrived = {context.rank}
        end = time.monotonic() + GRACE
        while len(arrived) < context.size and time.monotonic() < end:
            time.sleep(0.05)
            arrived |= {
                member for member, key in keys.items() if member not in arrived and store.check([key])
            }
        return arrived
    except Exception:  # the store's host ended
        return None


def store_host() -> str:
    """Who hosts the default group's store, in words, for an error that could not reach it:
    torchrun's agent when the ranks use it (``TORCHELASTIC_USE_AGENT_STORE``), else world rank
    0 (``init_process_group``'s TCP and environment-variable rendezvous), which has then most
    likely ended."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").strip().lower() in ("1", "true"):
        return "its host, torchrun's agent, ended"
    return (
        "its host is world rank 0 (init_process_group's TCP and environment-variable rendezvous), "
        "which most likely ended"
    )


def roll_call(context: Any, timeout: float | None, doing: str, cause: BaseException) -> PeerTimeoutError:
    """The error of a wait on ``context``'s group that ended while ``doing``: at its deadline
    (``timeout`` seconds passed: :func:`is_timeout`), or at a peer's closed connection. The
    ranks that answer the roll call (:func:`answered`) are alive and stuck too; the others are
    named: they never arrived (a deadline), or ended (a closed connection)."""
    rank, size = context.rank, context.size
    first = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
    expired = timeout is not None and is_timeout(cause)
    arrived = answered(context, doing)
    where = "(the group cannot be used any more: end the job)"
    if expired:
        where = f"(timeout= or LINOP_TIMEOUT) {where}"
    if arrived is None:
        return PeerTimeoutError(
            f"rank {rank}: not every rank of the group of {size} reached {doing}"
            + (f" within {timeout:g} s" if expired else " (a peer's connection closed)")
            + f"; the group's store is unreachable, so the missing ranks cannot be named: {store_host()} "
            f"{where}: {first}"
        )
    missing = [member for member in range(size) if member not in arrived]
    if not missing:
        return PeerTimeoutError(
            f"rank {rank}: {doing} did not complete on the group of {size}"
            + (f" within {timeout:g} s" if expired else "")
            + f"; every rank reached it, but not together {where}: {first}"
        )
    if expired:
        return PeerTimeoutError(
            f"rank {rank}: rank(s) {missing} of the group of {size} did not arrive at {doing} within "
            f"{timeout:g} s; rank(s) "
            f"{sorted(arrived)} did {where}: {first}"
        )
    return PeerTimeoutError(
        f"rank {rank}: rank(s) {missing} of the group of {size} ended (their connections closed) before "
        f"{doing} completed; "
        f"rank(s) {sorted(arrived)} did not {where}: {first}"
    )
