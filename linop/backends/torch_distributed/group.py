"""Process groups for the torch.distributed executor: :class:`GroupContext`.

A context is made once per process group (:func:`context_for`) and holds what every call on
that group needs: this process's rank and the group's size, the device collectives run on
(the CPU for gloo, this process's CUDA device for NCCL), the entry check's reducer, the plan
caches, and the sub-groups of the native collectives, created once per set of ranks and cached
(:meth:`GroupContext.subgroup`).

``torch.distributed.new_group`` is collective over the whole *world* group, and every rank
must create its groups in the same order. The executor therefore uses native collectives only
on the world group, and creates their sub-groups after the entry check has passed (so every
rank holds the same tree), in the order of the tree's global program, which every rank
derives alike (:mod:`linop.backends.torch_distributed.schedule`).

The check's deadline: ``timeout=`` (seconds) of the public functions, else the environment
variable ``LINOP_TIMEOUT`` (seconds), else
:data:`~linop.backends.host_deadline.DEFAULT_SECONDS` (600 s, as on MPI; why, in
:mod:`linop.backends.host_deadline`); ``LINOP_TIMEOUT=off`` (``0``, ``none``), ``inf`` or a value
beyond :data:`~linop.backends.host_deadline.NO_DEADLINE_BEYOND`: no deadline of linop's, only
the process group's own timeout of ``init_process_group``.
"""

from __future__ import annotations

import atexit
import os
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np

from ...errors import PeerTimeoutError, ProcessGroupArgumentError, ProcessGroupError, RankFailedError
from ...program.cache import PlanCache
from ..host_deadline import ENVIRONMENT, deadline_seconds, environment_text, text_seconds
from . import stall
from .deadline import roll_call

__all__ = [
    "GroupContext",
    "RunGuard",
    "shutdown",
    "context_for",
    "resolve_timeout",
    "TIMEOUT_VARIABLE",
    "GATHERS_VARIABLE",
    "GLOO_POINT_TO_POINT_GROUP",
]

TIMEOUT_VARIABLE = ENVIRONMENT
"""The environment variable giving the default deadline (seconds) of the entry check."""


def resolve_timeout(timeout: float | None) -> float | None:
    """The deadline in seconds: ``timeout``, else ``$LINOP_TIMEOUT``, else
    :data:`~linop.backends.host_deadline.DEFAULT_SECONDS`; None (none) for ``off``, ``inf`` and values beyond :data:`~linop.backends.host_deadline.NO_DEADLINE_BEYOND` mean none
    (the rule of both host executors, :func:`~linop.backends.host_deadline.deadline_seconds`).

    Raises
    ------
    ProcessGroupArgumentError
        A timeout that is not a positive number (the variable's value named).
    """
    if timeout is None:
        text = environment_text(os.environ)
        try:
            timeout = text_seconds(text)
        except ValueError:
            raise ProcessGroupArgumentError(
                f"{TIMEOUT_VARIABLE}={text!r} is not a number of seconds (or 'off')"
            ) from None
        if timeout is None:
            return None
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float, np.integer, np.floating))
        or not timeout > 0
    ):
        raise ProcessGroupArgumentError(f"timeout must be a positive number of seconds, not {timeout!r}")
    return deadline_seconds(float(timeout))


GATHERS_VARIABLE = "LINOP_TORCH_GATHERS"
"""The environment variable choosing how all-gathers and reduce-scatters along one axis run
(of equal shares; the reduce-scatters of uneven shares follow the same rule, unmeasured):
``native`` (``all_gather_into_tensor`` / ``reduce_scatter_tensor``), ``point-to-point`` (the
node's point-to-point program), or ``auto`` / unset (the measured rule:
:data:`GLOO_POINT_TO_POINT_GROUP`). Set it alike on every rank."""

GLOO_POINT_TO_POINT_GROUP = 4
"""Under gloo (``auto``), a group of at most this many ranks gathers point-to-point: measured
on 4 processes (gloo, CPU, 4096 x 4096 float32 by rows), gloo's ``all_gather_into_tensor``
took 1.8x - 2.0x the time of the node's point-to-point program and ``reduce_scatter_tensor``
1.15x - 1.4x (``benchmarks/bench_torch_distributed.py``). Larger groups, which this machine
cannot measure, and NCCL use the collectives: a ring is bandwidth-optimal, and a rank plans its
part in O(1), where the point-to-point program is planned from the node's whole expansion."""


def _native_gathers(backend: str, size: int) -> bool:
    """Whether the group's gathers run as the collectives (see :data:`GATHERS_VARIABLE`)."""
    text = os.environ.get(GATHERS_VARIABLE, "").strip().lower()
    if text in ("native", "point-to-point"):
        return text == "native"
    if text not in ("", "auto"):
        raise ProcessGroupArgumentError(
            f"{GATHERS_VARIABLE}={text!r}: expected 'native', 'point-to-point' or 'auto'"
        )
    return backend != "gloo" or size > GLOO_POINT_TO_POINT_GROUP


def _dist() -> Any:
    try:
        import torch.distributed as dist
    except ImportError as error:  # pragma: no cover - torch is installed where this runs
        raise ProcessGroupError(f"torch.distributed is not available: {error}") from error
    return dist


class GroupContext:
    """What the executor keeps per process group.

    The context holds its group, and the sub-groups it made, only weakly (as
    :data:`_CONTEXTS` does): they live as long as torch.distributed's own registry (or the
    caller) holds them, so that ``destroy_process_group`` ends their threads (gloo's worker and
    transport threads, the store's server on its host) at once, as it does without linop. Held
    strongly past it, they ran on to the interpreter's exit and were torn down there (the exit
    SIGABRT, ``terminate called without an active exception``, seen in some 4-process runs
    after every figure had printed; issue 41).

    Attributes
    ----------
    group : ProcessGroup
        The group every call of a plan runs on (:class:`~linop.errors.ProcessGroupError` once
        it has been destroyed and released).
    rank, size : int
        This process's rank in ``group`` and the group's size.
    world : bool
        Whether ``group`` is the default (world) group: only then are native collectives on
        sub-groups used.
    device : torch.device
        Where the group's collectives take their tensors (``cuda`` for NCCL, else the CPU).
    native_gathers : bool
        Whether the all-gathers and reduce-scatters along one axis run as the collectives
        (``all_gather_into_tensor``, ``reduce_scatter_tensor``; ``reduce_scatter`` for uneven
        shares), else as the nodes' point-to-point programs: from ``$LINOP_TORCH_GATHERS``, the backend and the size
        (:data:`GLOO_POINT_TO_POINT_GROUP`). The same on every rank; changing it is collective:
        do it alike on every rank, between calls.
    """

    def __init__(self, group: Any) -> None:
        import torch

        dist = _dist()
        self._group = _weak(group)
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.world = group is dist.distributed_c10d._get_default_group()
        self.backend = str(dist.get_backend(group))
        if self.backend == "nccl":  # NCCL moves CUDA tensors only
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        self._subgroups: dict[tuple[int, ...], Callable[[], Any]] = {}  # weak references
        self.native_gathers = _native_gathers(self.backend, self.size)
        self.plans: PlanCache[Any] = PlanCache()
        self.mapped_plans: dict[Any, PlanCache[Any]] = {}
        self.reducer: Any = None  # the entry check's (check.TorchReducer), made on first use
        self._scratch: dict[tuple[str, int, str], Any] = {}
        # per step of a schedule run here (by id, the step kept): what its collectives need,
        # computed on its first run (runtime.prepared_step)
        self.prepared_steps: dict[int, tuple[Any, Any]] = {}
        self.failed = False  # shut down after a failure mid-call (RunGuard)

    @property
    def group(self) -> Any:
        found = self._group()
        if found is None:
            raise ProcessGroupError(
                f"the process group of this plan (rank {self.rank} of {self.size}) has been destroyed "
                "(torch.distributed.destroy_process_group): make the plan again on a live group"
            )
        return found

    def subgroup(self, ranks: Sequence[int]) -> Any:
        """The process group of ``ranks`` (world ranks), created on first use and cached.

        Collective over the world group when it creates one: call only in an order every rank
        follows (:meth:`create_subgroups`)."""
        return self.subgroup_of(tuple(sorted(ranks)))

    def subgroup_of(self, key: tuple[int, ...]) -> Any:
        """:meth:`subgroup` of ``key``, the ranks already sorted (what a prepared step keeps:
        the group itself is held weakly, so it is looked up on each call)."""
        made = self._subgroups.get(key)
        found = None if made is None else made()
        if found is None:
            if made is not None:
                raise ProcessGroupError(
                    f"the sub-group of ranks {list(key)} that linop made on this group has been destroyed "
                    "(torch.distributed.destroy_process_group): make the plan again on a live group"
                )
            if len(key) == self.size:
                found = self.group
            else:
                found = _dist().new_group(ranks=list(key))
            self._subgroups[key] = _weak(found)
        return found

    def create_subgroups(self, rank_sets: tuple[tuple[int, ...], ...]) -> None:
        """Create the sub-groups of ``rank_sets`` not made yet, in that order, on every rank
        (the sets come from the global program, the same on every rank)."""
        for ranks in rank_sets:
            self.subgroup(ranks)

    def scratch(self, purpose: str, size: int, dtype: Any) -> Any:
        """A flat numpy buffer of ``size`` entries of ``dtype`` for ``purpose``, kept and reused
        by the next call asking alike (packing buffers of unbound runs: calls on a group never
        overlap, and no result is ever such a buffer); the 8 most recent are kept."""
        import numpy as np

        key = (purpose, size, np.dtype(dtype).str)
        found = self._scratch.pop(key, None)
        if found is None:
            found = np.empty(size, dtype)
            if len(self._scratch) >= 8:
                self._scratch.pop(next(iter(self._scratch)))
        self._scratch[key] = found
        return found

    def rank_in(self, sub: Any, rank: int) -> int:
        """The rank, in the sub-group ``sub`` (made by :meth:`subgroup`), of ``rank`` (a rank
        of this context's group): what ``group_src=`` and ``group_dst=`` take."""
        if sub is self.group:
            return rank
        dist = _dist()
        world = rank if self.world else dist.get_global_rank(self.group, rank)
        return int(dist.get_group_rank(sub, world))

    def guard(self, doing: Any) -> RunGuard:
        """A :class:`RunGuard` for running a call of ``doing`` (the operator; formatted only
        on failure) on this group."""
        return RunGuard(self, doing)

    def shut_down(self) -> None:
        """Destroy the group on this rank (after a failure mid-call): later calls on it raise
        ProcessGroupError. Its peers, blocked on this rank, fail when this process ends (gloo
        closes the connections only then)."""
        self.failed = True
        group = self._group()
        if group is None:  # destroyed already
            return
        _ABANDONED.append(group)  # kept: its last reference would wait for the unfinished collective
        _CONTEXTS.pop(id(group), None)
        try:
            dist = _dist()
            if dist.is_initialized():
                dist.destroy_process_group(None if self.world else group)
        except Exception:  # pragma: no cover - already torn down
            pass

    def arrive_within(self, timeout: float, doing: str) -> None:
        """Return once every rank of the group has called this (a barrier waited for within
        ``timeout`` seconds): before a collective step with no deadline of its own (the first
        call of a bound plan that is not prepared), so that no rank waits there for a missing
        one. Nothing to wait for on one rank.

        Raises
        ------
        PeerTimeoutError
            Not every rank arrived in time (the group cannot be used any more)."""
        if self.size > 1:
            self.wait(_dist().barrier(group=self.group, async_op=True), timeout, doing)

    def wait(self, work: Any, timeout: float | None, doing: str) -> None:
        """Wait for an asynchronous collective ``work``, within ``timeout`` seconds if given.

        Raises
        ------
        PeerTimeoutError
            The collective did not complete in time (the ranks that did not arrive named:
            :func:`~linop.backends.torch_distributed.deadline.roll_call`), or a peer's
            connection was lost; :class:`~linop.errors.PeerMismatchError` when a peer is at
            the same call of a wrapper on the other path (:mod:`.stall`).
        """
        try:  # in slices during a wrapper's call, so that a stall is named (stall.py)
            stall.wait(self, work, timeout)
        except RuntimeError as error:  # the ranks that did not arrive, or ended, named (a roll call)
            raise roll_call(self, timeout, doing, error) from error


class RunGuard:
    """``with context.guard(doing):`` around a schedule's run, after the entry check: any
    error inside (this rank's, or a peer's lost connection or timeout) shuts the group down on
    this rank, so that no later call uses it, and raises :class:`~linop.errors.RankFailedError`
    (chained from the error; a :class:`~linop.errors.PeerTimeoutError` of a first bound call,
    ``KeyboardInterrupt`` and other non-``Exception`` errors are re-raised as they are, after
    the shutdown). The peers blocked on this rank raise the same typed error once this process
    ends (their connections to it close); the group cannot be used afterwards."""

    __slots__ = ("context", "doing")

    def __init__(self, context: GroupContext, doing: Any) -> None:
        self.context, self.doing = context, doing

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> Literal[False]:
        if error is None:
            return False
        context = self.context
        context.shut_down()
        if not isinstance(error, Exception) or isinstance(error, (RankFailedError, PeerTimeoutError)):
            return False
        cause = str(error).splitlines()[0] if str(error) else ""
        raise RankFailedError(
            f"rank {context.rank}: the call of {self.doing} failed after the entry check ({type(error).__name__}: "
            f"{cause}); the process group of {context.size} has been shut down on this rank; its peers "
            f"fail once this process ends: end the job"
        ) from error


_ABANDONED: list[Any] = []
"""The groups shut down after a failure mid-call (:meth:`GroupContext.shut_down`), held on
purpose. Released, the group's last reference would join gloo's threads, which wait inside the
unfinished collective until the group's own timeout (``init_process_group``'s: 30 minutes by
default), so the rank would raise its deadline's error only then. Such a job is ending (the
error says so); groups released normally are still ended at ``destroy_process_group``.
"""

_CONTEXTS: dict[int, tuple[Callable[[], Any], GroupContext]] = {}
"""The context of each group, by the group's ``id``, with a weak reference to the group (the
entry goes when the group does)."""


class _Strong:
    """A strong reference with a weak reference's call (``ref()``), for what takes no weak
    reference (``GroupMember.NON_GROUP_MEMBER``)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __call__(self) -> Any:
        return self.value


def _weak(group: Any) -> Callable[[], Any]:
    try:
        return weakref.ref(group)
    except TypeError:
        return _Strong(group)


def _remember(group: Any, context: GroupContext) -> None:
    """Keep ``context`` for ``group`` while the group lives."""
    key = id(group)

    def forget(ref: Any) -> None:
        entry = _CONTEXTS.get(key)
        if entry is not None and entry[0] is ref:
            del _CONTEXTS[key]

    try:
        ref: Callable[[], Any] = weakref.ref(group, forget)
    except TypeError:
        ref = _Strong(group)
    _CONTEXTS[key] = (ref, context)


def shutdown() -> int:
    """Destroy the process groups linop created (the native collectives' sub-groups of every
    context, :meth:`GroupContext.subgroup`) and forget every context; the number destroyed.

    Local, no communication: a destroyed gloo or NCCL group stops its own threads. Run at
    interpreter exit (``atexit``), before torch's own teardown, so that no thread of a group
    linop made is left to the interpreter's teardown (the contexts hold groups only weakly:
    the user's ``destroy_process_group`` ends their threads at once; held strongly, they ran
    to the exit, where some 4-process runs ended with ``terminate called without an active
    exception``); callable earlier too, on every rank once it is done with linop's plans (a plan
    made before must not be called after it; new ones make new contexts). The groups the user made,
    the world group included, are the user's to destroy. Nothing to do when torch.distributed
    is not initialized (never, or already destroyed: destroying the world group destroys
    every group)."""
    contexts = list(_CONTEXTS.values())
    _CONTEXTS.clear()
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is installed where contexts exist
        return 0
    if not dist.is_initialized():
        return 0
    destroyed = 0
    for _, context in contexts:
        group = context._group()
        made = [
            sub
            for sub in (ref() for ref in context._subgroups.values())
            if sub is not None and sub is not group
        ]
        context._subgroups.clear()
        for sub in made:
            try:
                dist.destroy_process_group(sub)
                destroyed += 1
            except Exception:  # already gone with its parent: nothing left to stop
                pass
    return destroyed


atexit.register(shutdown)


def context_for(group: Any = None) -> GroupContext:
    """The context of ``group`` (None or True: the world group), made once per group.

    Raises
    ------
    ProcessGroupError
        torch.distributed is not initialized, or this process is not a member of ``group``.
    ProcessGroupArgumentError
        ``group`` is not a process group.
    """
    dist = _dist()
    non_member = dist.GroupMember.NON_GROUP_MEMBER  # what new_group gives the ranks off the group
    if isinstance(group, int) and not isinstance(group, bool) and group == non_member:
        raise ProcessGroupError(
            f"this rank (world rank {dist.get_rank()}) is not a member of the group: "
            "torch.distributed.new_group gave it GroupMember.NON_GROUP_MEMBER; call linop only on the "
            "ranks of the group"
        )
    if group is not None and group is not True and not isinstance(group, dist.ProcessGroup):
        raise ProcessGroupArgumentError(
            f"group= takes a torch.distributed ProcessGroup (or True / None for the world group), "
            f"not {type(group).__name__}"
        )
    if not dist.is_initialized():
        raise ProcessGroupError(
            "torch.distributed is not initialized: call torch.distributed.init_process_group(...) "
            "first (for example under torchrun), then pass group= (default: the world group)"
        )
    if group is None or group is True:
        group = dist.distributed_c10d._get_default_group()
    found = _CONTEXTS.get(id(group))
    if found is not None and found[0]() is group:
        return found[1]
    if dist.get_rank(group) < 0:
        raise ProcessGroupError(
            f"this rank (world rank {dist.get_rank()}) is not a member of the group it was given: "
            "call linop only on the ranks of the group"
        )
    context = GroupContext(group)
    _remember(group, context)
    return context
