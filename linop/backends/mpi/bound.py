"""Bound plans: a :class:`~linop.backends.mpi.plan.DistributedPlan` fixed to the caller's arrays
for repeated application (a halo exchange in a time loop), see
:meth:`~linop.backends.mpi.plan.DistributedPlan.bind`.

Binding checks once, then compiles the rank's schedule for these arrays
(:mod:`linop.backends.mpi.compiled`): one flat list of prepared calls on the caller's arrays
and on result and scratch buffers built once (persistent point-to-point requests and
collectives, numpy copies, adds and clears on prebuilt views), so each call is one loop over
that list, nothing else. A schedule that cannot be compiled so (local kernels, sums, moves
under a worker map) runs the ordinary application (without its check) on each call. Every
rank compiles, or none does: the ranks agree first (one ``Allreduce``). Compiled, a phase's
small messages to (from) one peer (up to
:data:`~linop.backends.mpi.phase_recipe.BUNDLE_UP_TO` bytes together) move as one *bundle* when
both ends of the pair list the same bundles (:func:`~linop.backends.mpi.compiled.bundle_peers`,
at binding: one small message to and from each peer a rank exchanges with, nothing else, so
binding does not grow with the size of the job): a rank holding several workers of a map then
sends their thin strips to a peer as one message, not one per pair of workers. Bound with ``persistent=False`` (the caller's
choice, alike on every rank) nothing is compiled: the plan is only checked, and each call
runs the ordinary application. A state with integer
blocks is never compiled: each call runs the checked application, since whether an integer
result fits (``docs/theory.md#dtypes``) depends on the values of that call.

Out of place the caller may give the result arrays (``bind(..., out=)``,
:mod:`linop.backends.mpi.out_arrays`): a native collective writing a block whole writes it
there, any other block is copied there at the end of each call. Whether every rank compiles
and whether every rank's out arrays have the run's dtype are agreed in one ``Allreduce``.

The deadline (``bind(..., timeout=)``, else ``LINOP_TIMEOUT``, else 600 s:
:mod:`linop.backends.mpi.deadline`) bounds the first call: every rank meets first in a polled
nonblocking barrier (:func:`~linop.backends.mpi.deadline.arrive_within`), so that no rank
waits in a blocking call for one that never comes; the ranks that arrived name those that did
not (:class:`~linop.errors.PeerTimeoutError`) and the job is aborted. With
``bind(..., every_call=True)`` every call is bounded: a compiled schedule whose only blocking
calls are waits for its persistent requests (a halo exchange, in-place all-reduces) has those
waits polled within the deadline (:func:`~linop.backends.mpi.deadline.wait_all`: no more
messages; the ranks still waiting name the ones that never started theirs); any other meets in
the polled barrier on every call (one more collective per call). Both measured in
``benchmarks/bench_deadline.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ...errors import DistributedDtypeError, DistributedStateError, LinopError
from ...space import State
from ..host_thin import add_rows
from .compiled import CompiledRun, PreparedCall, bundle_peers, compile_schedule
from .datatypes import mpi
from .deadline import arrive_within, wait_all
from .guards import abort_for
from .out_arrays import Pool, copy_into, deliver, dtype_problem, placing, straight
from .plan import DistributedPlan

__all__ = ["BoundPlan"]


class BoundPlan:
    """A plan bound to fixed arrays for repeated application.

    Call it with no arguments: it applies the operator to the bound arrays and returns this
    rank's blocks of the range (in place: the bound arrays; out of place: result arrays built
    at binding when :attr:`persistent`, or the caller's given as :attr:`out`, overwritten by
    each call). ``free()`` releases the
    persistent requests. Anything raised during a call (``KeyboardInterrupt`` included) ends
    the job, as in :meth:`DistributedPlan.apply`.
    """

    def __init__(
        self,
        plan: DistributedPlan,
        arrays: dict[str, np.ndarray],
        dtype: np.dtype,
        inplace: bool = True,
        *,
        checked: bool = False,
        timeout: float | None = None,
        donate: bool = False,
        persistent: bool = True,
        every_call: bool = False,
        out: Mapping[str, np.ndarray] | None = None,
        refused: LinopError | None = None,
    ) -> None:
        self.plan = plan
        self._deadline = timeout  # the next call's deadline: the first call's, or every call's
        self.every_call = every_call and timeout is not None
        """Whether every call (not only the first) meets the other ranks within the deadline."""
        self.arrays = arrays
        self.dtype = dtype
        self.inplace = inplace
        self.checked = checked
        self.outputs: dict[str, np.ndarray] = {}
        self.out: dict[str, np.ndarray] = dict(out or {})
        """The caller's result arrays (``bind(..., out=)``, :mod:`linop.backends.mpi.out_arrays`)."""
        self.straight: frozenset[str] = frozenset()
        """The blocks of :attr:`out` written there by a collective, with no copy after it."""
        self._scratch: list[np.ndarray] = []  # arrays the requests write into, freed with them
        comm = plan.comm
        self._run: CompiledRun | None = None
        self._calls: list[PreparedCall] | None = None
        problem = dtype_problem(self.out, dtype, comm.Get_rank())
        # integer blocks: every call checks; persistent=False: nothing prebuilt (both the same
        # decision on every rank)
        compiling = not checked and persistent

        def compile_here(pool: Pool, **options: Any) -> CompiledRun | None:
            return compile_schedule(
                placing(plan.schedule, pool),
                arrays,
                comm,
                dtype,
                inplace=inplace,
                range_names=plan.range_names,
                donate=donate,
                **options,
            )

        dry_pool = Pool(self.out if problem is None else {})
        dry = compile_here(dry_pool, dry=True, bundle=True) if compiling else None
        # every rank compiles, or none does; the out arrays' dtypes, on every rank
        if _agree(comm, declined=compiling and dry is None, problem=problem, refused=refused) and compiling:
            assert dry is not None
            straight_in = straight(dry, dry_pool.taken)
            self._run = compile_here(Pool(straight_in), bundle=bundle_peers(comm, dry))
            if self._run is not None:
                deliver(self._run, self.out, straight_in)
                self.straight = frozenset(straight_in)
        if self._run is not None:
            self._calls = self._run.calls
            self.outputs = self._run.outputs
            self._scratch = self._run.scratch
        if self.every_call and timeout is not None:
            doing = f"a call of the bound plan of {plan.op}"
            bounded = None
            if self._calls is not None:
                busy = plan.context.reducer.busy  # none on an oversubscribed node

                def wait(requests: list[Any]) -> None:
                    wait_all(requests, comm, timeout, doing, busy=busy)

                bounded = polled_calls(self._calls, wait)
            # every rank polls, or every rank meets in the barrier (a root's blocking call may
            # be another rank's request): the ranks agree (one Allreduce)
            if comm.allreduce(bounded is not None, op=mpi().LAND):
                assert bounded is not None
                self._calls, self._deadline = bounded, None  # the waits carry the deadline

    @property
    def persistent(self) -> bool:
        """True when every call runs only the calls prepared at binding
        (:mod:`linop.backends.mpi.compiled`): persistent requests, collectives between prebuilt
        buffers, numpy copies, adds and clears on prebuilt views."""
        return self._calls is not None

    def __call__(self) -> State:
        if self._deadline is not None:
            self._arrive()
        calls = self._calls
        if calls is None:
            if self.checked:
                results = self.plan.apply(self.arrays, inplace=self.inplace)
                return copy_into(results, self.out) if self.out else results
            if not self.inplace:
                results = self.plan.run_out_of_place(self.arrays, self.dtype, self.dtype)
                return copy_into(results, self.out) if self.out else results
            self.plan.run_in_place(self.arrays, self.dtype, self.dtype)
            return self.arrays
        try:
            for function, arguments in calls:
                function(*arguments)
        except BaseException as error:
            abort_for(self.plan.comm, f"applying the bound plan of {self.plan.op}", error)
        return self.outputs if not self.inplace else self.arrays

    def _arrive(self) -> None:
        """The call within the deadline (the first, or every one with :attr:`every_call`): a
        polled barrier first (:func:`~linop.backends.mpi.deadline.arrive_within`), so no rank
        waits in a blocking call for one that never comes; a timeout ends the job."""
        timeout = self._deadline
        assert timeout is not None  # called only while a deadline is set
        doing = "a call" if self.every_call else "the first call"
        if not self.every_call:
            self._deadline = None
        try:
            arrive_within(
                self.plan.comm,
                timeout,
                f"{doing} of the bound plan of {self.plan.op}",
                busy=self.plan.context.reducer.busy,
            )
        except BaseException as error:
            abort_for(self.plan.comm, f"applying the bound plan of {self.plan.op}", error)

    @property
    def polled(self) -> bool:
        """Whether every call's waits are polled within the deadline (:attr:`every_call` on a
        compiled schedule that waits only for its requests), rather than preceded by a barrier."""
        return self.every_call and self._calls is not None and self._deadline is None

    def free(self) -> None:
        """Release the persistent requests and the arrays they write into."""
        if self._run is not None:
            self._run.free()
        self._run = None
        self._calls = None
        self._scratch = []


class AgreedRefusalError(Exception):
    """What :func:`_agree` raises: :attr:`error`, which every rank raises together (the caller
    re-raises it; any other exception at binding ends the job)."""

    def __init__(self, error: LinopError) -> None:
        super().__init__(str(error))
        self.error = error


def _agree(comm: Any, *, declined: bool, problem: str | None, refused: LinopError | None = None) -> bool:
    """Whether no rank ``declined`` to compile, agreed with one small ``Allreduce``: the largest
    over the ranks of ``4 (P - r) + k`` for a rank ``r`` with a problem (``k = 2``: its
    ``bind(out=)`` was ``refused`` before the check, with that error; ``k = 1``: its out
    arrays' dtype is not the run's, ``problem`` says why), else of ``declined``. With a problem
    on some rank, :class:`AgreedRefusalError` on every rank: the refusing rank's own error on it,
    :class:`~linop.errors.DistributedDtypeError` with the ``problem`` on a rank that has one,
    and on the others the error of that kind naming the first such rank."""
    size, rank = comm.Get_size(), comm.Get_rank()
    kind = 2 if refused is not None else 1 if problem else 0
    mine = 4 * (size - rank) + kind if kind else int(declined)
    agreed = int(comm.allreduce(mine, op=mpi().MAX))
    if agreed < 4:
        return not agreed
    first, first_kind = size - agreed // 4, agreed % 4
    error: LinopError
    if refused is not None:
        error = refused
    elif problem:
        error = DistributedDtypeError(problem)
    elif first_kind == 2:
        error = DistributedStateError(
            f"rank {rank}: rank {first} refused its bind(out=) arrays (see that rank's error); nothing was bound"
        )
    else:
        error = DistributedDtypeError(
            f"rank {first}: bind(out=): the out arrays do not have the run's dtype (see that rank's error)"
        )
    raise AgreedRefusalError(error)


_LOCAL_CALLS = (np.copyto, np.add, np.multiply, add_rows)


def polled_calls(calls: list[PreparedCall], wait: Callable[[list[Any]], None]) -> list[PreparedCall] | None:
    """``calls`` (a compiled schedule) with each wait for persistent requests (``Waitall``, a
    request's ``Wait``) replaced by ``wait(requests)`` (a wait polled within a deadline); None
    when a call may block otherwise (a blocking collective, anything not known to be local or
    nonblocking): then only a barrier bounds the call."""
    module = mpi()
    request_class = module.Request
    bounded: list[PreparedCall] = []
    for call, given in calls:
        function: Callable[..., object] = call
        arguments = given
        if isinstance(call, functools.partial) and not call.keywords:
            function, arguments = call.func, (*call.args, *given)
        owner = getattr(function, "__self__", None)
        name = getattr(function, "__name__", "")
        is_class = isinstance(owner, type) and issubclass(owner, request_class)
        if (is_class and name == "Waitall") or (isinstance(owner, request_class) and name == "Wait"):
            requests = list(arguments[0]) if is_class else [owner]
            bounded.append((wait, (requests,)))
        elif (is_class and name in ("Startall", "Testall")) or (
            isinstance(owner, request_class) and name == "Start"
        ):
            bounded.append((function, arguments))
        elif function in _LOCAL_CALLS or isinstance(owner, np.ndarray):
            bounded.append((function, arguments))
        else:
            return None
    return bounded
