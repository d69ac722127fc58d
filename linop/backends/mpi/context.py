"""Communicator contexts of the MPI interpreter: one per user communicator.

A context holds a private duplicate of the user's communicator (linop's messages never meet
the user's), the sub-communicators the native collectives create inside that duplicate, and a
bounded cache of the plans compiled for it. It lives exactly as long as the user's
communicator: it is stored as an MPI attribute of that communicator under a keyval whose delete
callback frees the duplicate and its sub-communicators, so ``sub = comm.Dup(); ...;
sub.Free()`` in a loop leaks nothing. The predefined ``MPI.COMM_WORLD`` and ``MPI.COMM_SELF``
keep theirs until the process ends.

Bad ``comm`` arguments raise a typed error here, before any communication, on every rank that
passes them (:class:`CommunicatorArgumentError`, :class:`~linop.errors.CommunicatorError`).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from typing import Any

from ...errors import CommunicatorArgumentError, CommunicatorError
from ...program.cache import PLAN_CACHE_SIZE, PlanCache
from .check import CheckReducer, node_oversubscribed
from .datatypes import mpi
from .deadline import BUSY, arrive_within, resolve_timeout
from .guards import abort_on_failure
from .mpi_types import Comm, Intracomm

__all__ = [
    "PLAN_CACHE_SIZE",
    "CommunicatorArgumentError",
    "CommContext",
    "PlanCache",
    "busy_for",
    "context_for",
    "subcommunicator",
    "open_contexts",
    "open_subcommunicators",
]

_OPEN: dict[int, CommContext] = {}
"""The contexts not yet freed, by their private communicator's handle (how a native step,
which holds only the private communicator, finds its context's sub-communicators)."""


class CommContext:
    """linop's state for one user communicator (see the module docstring). Creating one is
    collective over the user's communicator (``MPI_Comm_dup``).

    It owns every cache that belongs to the communicator, all freed with it: the entry
    check's reducer (:attr:`reducer`), the sub-communicators of the native collectives
    (:attr:`subcomms`), and the plans (:attr:`plans`, and :attr:`mapped_plans` per worker map).
    """

    def __init__(self, user: Intracomm, timeout: Any = None) -> None:
        self._user = weakref.ref(user)
        deadline = resolve_timeout(timeout)  # a bad value raises here, before any communication
        with abort_on_failure(user, lambda: "duplicating the communicator"):
            if deadline is not None:  # MPI_Comm_dup has no deadline: every rank arrives first
                busy = 0.0 if node_oversubscribed() else BUSY  # (no reducer yet: the node's)
                arrive_within(
                    user, deadline, "the duplication of the communicator (its first plan)", busy=busy
                )
            self.comm: Intracomm = user.Dup()
            self.reducer = CheckReducer(self.comm)
            """The entry check's persistent collectives (created collectively, here; on two ranks
            the digest's is an exchange with the peer), shared by every plan on the communicator."""
        self.rank: int = self.comm.Get_rank()
        self.size: int = self.comm.Get_size()
        self.subcomms: dict[Any, Intracomm] = {}
        """The sub-communicators made inside :attr:`comm` (:func:`subcommunicator`), by ranks."""
        self.plans: PlanCache[Any] = PlanCache()
        self.mapped_plans: dict[Any, PlanCache[Any]] = {}  # per worker map (mpi_backend)
        self.freed = False
        _OPEN[self.comm.py2f()] = self

    @property
    def user(self) -> Intracomm | None:
        """The user's communicator (None once its Python object is gone)."""
        return self._user()

    def free(self) -> None:
        """Free the private duplicate and its sub-communicators, forget the plans; collective
        (called from the user communicator's delete callback, or at no other time)."""
        if self.freed:
            return
        self.freed = True
        _OPEN.pop(self.comm.py2f(), None)
        self.plans.clear()
        self.mapped_plans.clear()
        subcomms, self.subcomms = self.subcomms, {}
        for _, sub in sorted(subcomms.items()):
            sub.Free()
        self.reducer.free()
        self.comm.Free()


def busy_for(comm: Intracomm) -> float:
    """Seconds a wait on ``comm`` tests without yielding the core
    (:func:`~linop.backends.mpi.deadline.wait_all`'s ``busy``): the reducer's
    (:attr:`CheckReducer.busy <linop.backends.mpi.check.CheckReducer.busy>`, none on an
    oversubscribed node) when ``comm`` is a context's private communicator, else none where
    this node is known to be oversubscribed (:func:`~linop.backends.mpi.check.node_oversubscribed`),
    else :data:`~linop.backends.mpi.deadline.BUSY`."""
    owner = _OPEN.get(comm.py2f())
    if owner is not None:
        return owner.reducer.busy
    return 0.0 if node_oversubscribed() else BUSY


def open_contexts() -> int:
    """Number of contexts (private duplicates) not yet freed in this process."""
    return len(_OPEN)


def open_subcommunicators() -> int:
    """Number of sub-communicators of private duplicates not yet freed in this process."""
    return sum(len(context.subcomms) for context in _OPEN.values())


_KEYVAL: int | None = None
_PREDEFINED: dict[int, CommContext] = {}


def _delete_context(comm: Comm, keyval: int, context: CommContext) -> None:
    """The keyval's delete callback: the user freed (or MPI deleted) the communicator."""
    context.free()


def _keyval() -> int:
    global _KEYVAL
    if _KEYVAL is None:
        _KEYVAL = mpi().Comm.Create_keyval(delete_fn=_delete_context)
    return _KEYVAL


def context_for(comm: Any, timeout: Any = None) -> CommContext:
    """The context of a user communicator (default ``MPI.COMM_WORLD``), created on first use
    (collective: a duplicate is made, within the deadline ``timeout`` seconds, default
    ``LINOP_TIMEOUT``: :func:`~linop.backends.mpi.deadline.arrive_within`).

    Raises
    ------
    CommunicatorArgumentError
        ``comm`` is not an mpi4py communicator (e.g. the string ``"world"``).
    CommunicatorError
        ``comm`` is ``MPI.COMM_NULL`` (freed, or this rank is not in it) or an
        intercommunicator.
    TimeoutArgumentError
        ``timeout`` is not a positive number of seconds (when a context is created).

    A rank that does not arrive at the duplication within the deadline makes every rank that
    did raise :class:`~linop.errors.PeerTimeoutError` naming it, then the job is aborted.
    """
    if comm is None:
        comm = mpi().COMM_WORLD
    last = _LAST
    if last is not None and comm is last[0] and not last[1].freed:
        return last[1]  # the communicator object of the previous call, not freed since
    context = _context_for(comm, timeout)
    _remember_last(comm, context)
    return context


_LAST: tuple[Any, CommContext] | None = None


def _remember_last(comm: Any, context: CommContext) -> None:
    global _LAST
    _LAST = (comm, context)


def _context_for(comm: Any, timeout: Any = None) -> CommContext:
    module = mpi()
    if comm is None:
        comm = module.COMM_WORLD
    if not isinstance(comm, module.Comm):
        raise CommunicatorArgumentError(
            f"comm must be an mpi4py communicator such as MPI.COMM_WORLD, not {type(comm).__name__} {comm!r}"
        )
    if comm == module.COMM_NULL:
        raise CommunicatorError("the communicator is MPI.COMM_NULL (freed, or this rank is not in it)")
    if not isinstance(comm, module.Intracomm) or comm.Is_inter():
        raise CommunicatorError(
            f"the MPI interpreter needs an intracommunicator, not {type(comm).__name__} (an intercommunicator)"
        )
    handle = comm.py2f()
    if comm == module.COMM_WORLD or comm == module.COMM_SELF:
        context = _PREDEFINED.get(handle)
        if context is None:
            context = _PREDEFINED[handle] = CommContext(comm, timeout)
        return context
    keyval = _keyval()
    context = comm.Get_attr(keyval)
    if context is None:
        context = CommContext(comm, timeout)
        comm.Set_attr(keyval, context)
    return context


@functools.lru_cache(maxsize=4)
def _in_order(size: int) -> tuple[int, ...]:
    """``0 .. size - 1``, built once per size (compared against on every collective call)."""
    return tuple(range(size))


def subcommunicator(comm: Intracomm, ranks: Sequence[int]) -> Intracomm:
    """The communicator of ``ranks`` (in that order) inside a context's private ``comm``,
    created once and freed with the context (:attr:`CommContext.subcomms`).

    Collective over ``ranks`` only (``MPI_Comm_create_group``); callers create the groups of a
    step in one global order, so no two ranks wait for each other in opposite orders. Ranks
    described by runs (:class:`~linop.program.groups.RootedRanks`) are included run by run
    (``MPI_Group_range_incl``): a group of P ranks costs O(runs) here, never a list of P.
    """
    size = comm.Get_size()
    triples = getattr(ranks, "triples", None)  # described ranks (linop.program.groups): runs
    runs = triples() if triples is not None else None
    if runs is not None:
        if len(ranks) == size and _whole(runs, size):
            return comm
    elif len(ranks) == size and ranks == _in_order(size):  # the whole communicator, in order
        return comm
    key: Any = ranks if runs is None else ("runs", runs)
    owner = _OPEN.get(comm.py2f())
    if owner is None:  # pragma: no cover - native steps run on a context's private communicator
        raise CommunicatorError("sub-communicators are made only inside a context's private communicator")
    table = owner.subcomms
    sub = table.get(key)
    if sub is None:
        whole = comm.Get_group()
        group = whole.Incl(list(ranks)) if runs is None else whole.Range_incl(list(runs))
        sub = comm.Create_group(group, tag=7)
        group.Free()
        whole.Free()
        table[key] = sub
    return sub


def _whole(runs: tuple[tuple[int, int, int], ...], size: int) -> bool:
    """True when ``(first, last, stride)`` runs list ranks ``0 .. size - 1`` in order."""
    expected = 0
    for first, last, stride in runs:
        if first != expected or (first != last and stride != 1):
            return False
        expected = last + 1
    return expected == size
