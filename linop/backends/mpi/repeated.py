"""The checked call on the same arrays again, in one step: :class:`RepeatedCall`.

A time loop calls ``apply(op, state, comm=comm, inplace=True)`` with the same arrays call after
call. What such a call must do is fixed by the previous passed call (the entry check's kept
:class:`~linop.backends.entry_check.repeat.Repeat` and the in-place binding it ran on): find
that ``state`` holds exactly the kept array, unchanged; reduce the kept check vector's digest
over the ranks (:mod:`linop.backends.mpi.check`: one persistent ``Allreduce`` of four words);
when every rank sent that digest, run the binding's prepared calls. :class:`RepeatedCall`
takes everything that depends only on what was kept once, and its :attr:`~RepeatedCall.call`
is one function with all of it bound as local names (no attribute chains, no other Python
frame): the comparisons, the digest's ``Start``, its completion, the prepared calls
(``benchmarks/bench_mpi_check_overhead.py`` measures its local work).

Soundness: the same as the path it shortens (:meth:`DistributedPlan.repeated
<linop.backends.mpi.plan.DistributedPlan.repeated>`, which builds it):

- before any communication, the state is compared with the kept array in every property the
  check's local verdict and the binding depend on (:meth:`Repeat.same
  <linop.backends.entry_check.repeat.Repeat.same>`, with one difference: the record is built
  only for a C-contiguous array, and a call finds the array C-contiguous with the kept shape
  instead of comparing its strides, which then place every element where the kept strides
  did; the strides of a dimension of length one, which numpy lets differ, address nothing),
  and the plan with what the record was built on (the kernels' version, which the kept vector
  says, when some kernel is probed: else it never changes; the communicator not freed; the
  plan's deadline: setting :attr:`DistributedPlan.timeout
  <linop.backends.mpi.plan.DistributedPlan.timeout>` drops the record); else the call goes
  the general way, nothing communicated. Nothing else the record holds can go stale: the
  repeat's vector and outcome depend on the array's properties, the kernels' version and
  global facts only, and its binding is read at each call (empty once freed: then the ordinary
  run);
- the digest is reduced on every call, so a rank whose input differs (or which holds another
  tree, or calls the ordinary check) makes the reduced digest differ on every rank; then every
  rank reduces the whole vector (the second collective every rank makes) and decodes it
  (:meth:`MPIEntryCheck.again_differing <linop.backends.mpi.check.MPIEntryCheck.again_differing>`):
  an error on every rank, or another run dtype, run the ordinary way;
- no data moves before the reduced digest is known, and the binding runs only when it equals
  this rank's own (every rank sent this very vector).

Two things here repeat code of other modules, on purpose: the comparisons of
:meth:`Repeat.same <linop.backends.entry_check.repeat.Repeat.same>` (with the difference
above) and the completion of :meth:`CheckReducer.complete
<linop.backends.mpi.check.CheckReducer.complete>` (its tests, then
:func:`~linop.backends.mpi.deadline.wait_all` with the reducer's policy). Calling them instead
was measured (CPU time, the MPI calls emptied as in ``bench_mpi_check_overhead.py local``, on
the loaded development machine): 0.56 us of local work a call inline, 0.60 us through
``complete``, 0.67 us through ``Repeat.same`` (a frame, and the strides' tuple compared), at
64 KB messages about 2% of the bound plan's time each, the margin of the checked call's target
(1.3x); ``tests/mpi/test_repeat.py`` runs each change the comparisons catch through both paths,
with a control blind to it on each.

The digest's ``Start`` comes straight after the local comparison; the binding is read while the
reduction is in flight (its prepared calls can change only when the binding is freed, by its
arrays' collection, which the state's reference prevents, or by the plan's next ordinary run). The plan keeps one record, of the last repeat that passed the general
way (:meth:`DistributedPlan.repeated`).

What the record can outlive, and why none of it gives a wrong answer:

- another repeat (a call on other arrays since, which the entry check now keeps): the record
  still answers only calls on its own array, compared in full at each call, and its outcome
  and vector depend on nothing that call changed; it stays, and answers the next call on its
  array in one step; its binding, if evicted or freed since, is empty, and the call runs the
  ordinary way;
- a failed call (another rank's input refused, or another run dtype agreed, through
  :meth:`MPIEntryCheck.again_differing <linop.backends.mpi.check.MPIEntryCheck.again_differing>`):
  nothing the record holds or compares changes, and every later call reduces the digest again;
- a changed deadline: :attr:`DistributedPlan.timeout
  <linop.backends.mpi.plan.DistributedPlan.timeout>`'s setter drops it (``LINOP_TIMEOUT`` is
  read once per process; a call's own ``timeout=`` never goes through the record);
- the communicator freed: the call finds the reduction's request gone and answers None; the
  general way raises :class:`~linop.errors.CommunicatorError` and drops the record;
- its array collected: the identity test can never pass again; :attr:`RepeatedCall.watch`'s
  callback drops the record, which would otherwise hold the repeat and its freed binding
  until another repeated call replaced it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ...space import State
from .deadline import wait_all
from .guards import abort_for

if TYPE_CHECKING:  # pragma: no cover - typing only
    from ..entry_check.repeat import Repeat
    from .plan import DistributedPlan

__all__ = ["OneStep", "RepeatedCall"]

OneStep = Callable[[Any, bool], "State | None"]
"""The repeated call: ``call(state, inplace)``, the result, or None with nothing communicated."""


class RepeatedCall:
    """The repeated call of one plan on one kept repeat (see the module docstring).

    Parameters
    ----------
    plan : DistributedPlan
        The plan (its entry check keeps ``repeat``).
    repeat : Repeat
        The kept call: its array, its check vector (as the entry check prepared it) and outcome.
    seconds : float or None
        The deadline of the check's reduction, resolved from the plan's :attr:`timeout
        <linop.backends.mpi.plan.DistributedPlan.timeout>` as it is now (setting it drops the
        record).

    Attributes
    ----------
    call : callable
        ``call(state, inplace)``: the call, when ``state`` (and ``inplace``) pass exactly what
        the repeat kept and the record is current; None otherwise, with nothing communicated
        (the caller checks the call the general way). Collective when it answers.
    """

    __slots__ = ("__weakref__", "call", "plan", "repeat", "seconds", "watch")

    def __init__(self, plan: DistributedPlan, repeat: Repeat, seconds: float | None) -> None:
        self.plan = plan
        self.repeat = repeat
        self.seconds = seconds
        self.call: OneStep = _one_step(plan, repeat, seconds)
        self.watch: Any = None
        """A weak reference to the repeat's array whose callback drops this record from the plan
        when the array is collected (:meth:`of`)."""

    @classmethod
    def of(cls, plan: DistributedPlan, repeat: Repeat, seconds: float | None) -> RepeatedCall | None:
        """The record of ``repeat`` (a passed call of ``plan``), or None when its array is gone
        or not C-contiguous, or the communicator has no persistent reduction (freed, or an MPI
        library without persistent collectives): such calls go the general way."""
        array = repeat.ref()
        if array is None or not array.flags.c_contiguous:
            return None
        reducer = plan.context.reducer
        if reducer.request is None and not reducer.single:
            return None
        record = cls(plan, repeat, seconds)
        record.watch = weakref.ref(array, _dropper(plan, record))
        return record

    def __call__(self, state: Any, inplace: bool) -> State | None:
        """:attr:`call` (for a caller holding the record)."""
        return self.call(state, inplace)


def _dropper(plan: DistributedPlan, record: RepeatedCall) -> Callable[[Any], None]:
    """The callback of :attr:`RepeatedCall.watch`: the array is gone, so the record can never
    answer again; the plan lets it go if it still holds it (both held weakly here: the
    callback keeps neither alive)."""
    plan_ref, record_ref = weakref.ref(plan), weakref.ref(record)

    def gone(_: Any) -> None:
        holder, kept = plan_ref(), record_ref()
        if holder is not None and kept is not None and holder.fast_record is kept:
            holder.drop_fast()

    return gone


def _one_step(plan: DistributedPlan, repeat: Repeat, seconds: float | None) -> OneStep:
    """The function of :attr:`RepeatedCall.call`: every name it reads bound here, once."""
    entry = plan.entry
    context = plan.context
    reducer = context.reducer
    comm = plan.comm
    kernels, version, probing = entry.kernels, repeat.version, entry.kernels.probing
    name, ref, shape, dtype = repeat.name, repeat.ref, repeat.shape, repeat.dtype
    kept_inplace = repeat.inplace
    after_again = plan.after_again
    request = reducer.request  # None on one rank
    if request is None:

        def alone(state: Any, inplace: bool) -> State | None:
            """One rank: nothing to agree on; the comparisons, then the binding."""
            if type(state) is not dict or len(state) != 1 or inplace is not kept_inplace:
                return None
            array = state.get(name)
            if array is None or ref() is not array:
                return None
            if array.shape != shape or array.dtype is not dtype:
                return None
            flags = array.flags
            if not flags.c_contiguous or (inplace and not flags.writeable):
                return None
            if (probing and kernels.version != version) or context.freed:
                return None
            repeat.hits += 1
            return after_again(state, repeat, repeat.outcome, True, inplace)

        return alone

    sent = repeat.sent
    digest = reducer.digest_for(sent)
    received = reducer.digest_arrived  # (a bytearray: compared with bytes, no copy)
    start, test, wait = request.Start, request.Test, request.Wait
    send = reducer.digest_send  # two ranks: the digest is sent to the peer, received from it
    send_start: Any = send.Start if send is not None else None
    send_test: Any = send.Test if send is not None else None
    send_wait: Any = send.Wait if send is not None else None
    spins, busy = reducer.spins, reducer.busy
    doing = entry._doing()

    def call(state: Any, inplace: bool) -> State | None:
        if type(state) is not dict or len(state) != 1 or inplace is not kept_inplace:
            return None
        array = state.get(name)
        if array is None or ref() is not array:  # (None: also what a gone array's ref gives)
            return None
        if array.shape != shape or array.dtype is not dtype:
            return None
        flags = array.flags
        if not flags.c_contiguous or (inplace and not flags.writeable):
            return None
        if probing and kernels.version != version:
            return None
        if reducer.request is not request:  # freed with the communicator
            return None
        if reducer.digest_of is not sent:  # another plan's check since: this digest
            reducer.write_digest(sent, digest)
        try:
            if send is not None:  # (sent first: the peer's wait ends sooner)
                send_start()
            start()
            # while the digest is in flight: the local work that needs no verdict
            repeat.hits += 1  # (undone below when the ranks disagree)
            binding = repeat.run
            calls = binding.calls if binding is not None else None  # the in-place binding's, if any
            sent_now = send is None or send_test()  # four words: sent at once, as a rule
            if seconds is None:
                wait()
                if not sent_now:
                    send_wait()
            else:  # CheckReducer.complete, inline (see the module docstring)
                for _ in spins:
                    if test():
                        break
                else:
                    wait_all([request], comm, seconds, doing, busy=busy)
                if not sent_now and not send_test():
                    wait_all([send], comm, seconds, doing, busy=busy)
        except BaseException as error:  # PeerTimeoutError included: the missing ranks may never come
            abort_for(comm, f"checking {plan.op}", error)
        if received != digest:  # some rank sent another vector
            repeat.hits -= 1
            try:
                outcome, agreed = entry.again_differing(repeat, seconds)
            except BaseException as error:
                abort_for(comm, f"checking {plan.op}", error)
            return after_again(state, repeat, outcome, agreed, inplace)
        if calls:  # the binding is live: its prepared calls
            try:
                for function, arguments in calls:
                    function(*arguments)
            except BaseException as error:  # the ranks are committed: see guards
                abort_for(comm, f"applying {plan.op}", error)
            return state
        return after_again(state, repeat, repeat.outcome, True, inplace)

    return call
