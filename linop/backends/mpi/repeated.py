"""The checked call on the same arrays again, in one step: :class:`RepeatedCall`.

A time loop calls ``apply(op, state, comm=comm, inplace=True)`` with the same arrays call after
call. What such a call must do is fixed by the previous passed call (the entry check's kept
:class:`~linop.backends.entry_check.repeat.Repeat` and the in-place binding it ran on): find
that ``state`` holds exactly the kept array, unchanged; reduce the kept check vector's digest
over the ranks (:mod:`linop.backends.mpi.check`: one persistent ``Allreduce`` of four words);
when every rank sent that digest, run the binding's prepared calls. :class:`RepeatedCall`
holds everything that depends only on what was kept, taken once, so that the repeated call is
those steps and nothing else: one Python frame below ``apply`` besides the MPI calls, the
array's weak reference, the reducer's wait (:meth:`CheckReducer.complete
<linop.backends.mpi.check.CheckReducer.complete>`) and the prepared calls (``benchmarks/bench_mpi_check_overhead.py``
measures its local work).

Soundness: the same as the path it shortens (:meth:`DistributedPlan.repeated
<linop.backends.mpi.plan.DistributedPlan.repeated>`, which builds it):

- before any communication, the state is compared with the kept array in every property the
  check's local verdict and the binding depend on (:meth:`Repeat.same
  <linop.backends.entry_check.repeat.Repeat.same>`, with one difference: the record is built
  only for a C-contiguous array, and a call finds the array C-contiguous with the kept shape
  instead of comparing its strides, which then place every element where the kept strides
  did; the strides of a dimension of length one, which numpy lets differ, address nothing),
  and the plan with what the record was built on (the kernels' version, which the kept vector
  says; the plan's deadline; the communicator not freed); else the call goes the general way,
  nothing communicated. Nothing else the record holds can go stale: the repeat's vector and
  outcome depend on the array's properties, the kernels' version and global facts only, and
  its binding is read at each call (empty once freed: then the ordinary run);
- the digest is reduced on every call, so a rank whose input differs (or which holds another
  tree, or calls the ordinary check) makes the reduced digest differ on every rank; then every
  rank reduces the whole vector (the second collective every rank makes) and decodes it
  (:meth:`MPIEntryCheck.again_differing <linop.backends.mpi.check.MPIEntryCheck.again_differing>`):
  an error on every rank, or another run dtype, run the ordinary way;
- no data moves before the reduced digest is known, and the binding runs only when it equals
  this rank's own (every rank sent this very vector).

The digest's ``Start`` comes straight after the local comparison. The plan keeps one record, of
the last repeat that passed the general way (:meth:`DistributedPlan.repeated`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...space import State
from .guards import abort_for

if TYPE_CHECKING:  # pragma: no cover - typing only
    from ..entry_check.repeat import Repeat
    from .plan import DistributedPlan

__all__ = ["RepeatedCall"]

_MISSING: Any = object()  # the state lacks the kept name: no array is it


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
        <linop.backends.mpi.plan.DistributedPlan.timeout>` as it is now (a call finds it
        unchanged, by identity, else goes the general way).
    """

    __slots__ = (
        "array",
        "context",
        "digest",
        "doing",
        "dtype",
        "entry",
        "given",
        "inplace",
        "kernels",
        "name",
        "plan",
        "reducer",
        "repeat",
        "seconds",
        "sent",
        "shape",
        "version",
    )

    def __init__(self, plan: DistributedPlan, repeat: Repeat, seconds: float | None) -> None:
        entry = plan.entry
        self.plan = plan
        self.entry = entry
        self.kernels = entry.kernels
        self.context = plan.context
        self.reducer = plan.context.reducer
        self.repeat = repeat
        self.version = repeat.version
        self.name, self.array = repeat.name, repeat.ref
        self.shape, self.dtype = repeat.shape, repeat.dtype
        self.inplace = repeat.inplace
        self.sent = repeat.sent
        self.digest = self.reducer.digest_for(repeat.sent)
        self.given = plan.timeout
        self.seconds = seconds
        self.doing = entry._doing()

    @classmethod
    def of(cls, plan: DistributedPlan, repeat: Repeat, seconds: float | None) -> RepeatedCall | None:
        """The record of ``repeat`` (a passed call of ``plan``), or None when its array is gone
        or not C-contiguous (such calls go the general way)."""
        array = repeat.ref()
        if array is None or not array.flags.c_contiguous:
            return None
        return cls(plan, repeat, seconds)

    def __call__(self, state: Any, inplace: bool) -> State | None:
        """The call, when ``state`` (and ``inplace``) pass exactly what the repeat kept and
        the record is current; None otherwise, with nothing communicated (the caller checks
        the call the general way). Collective when it answers."""
        if type(state) is not dict or len(state) != 1 or inplace is not self.inplace:
            return None
        array = state.get(self.name, _MISSING)
        if array is None or self.array() is not array:  # (None: also what a gone array's ref gives)
            return None
        if array.shape != self.shape or array.dtype is not self.dtype:
            return None
        flags = array.flags
        if not flags.c_contiguous or (inplace and not flags.writeable):
            return None
        if self.kernels.version != self.version or self.plan.timeout is not self.given:
            return None
        repeat = self.repeat
        reducer = self.reducer
        request = reducer.request  # None once the communicator is freed (and on one rank)
        plan = self.plan
        if request is not None:
            if reducer.digest_of is not self.sent:  # another plan's check since: this digest
                reducer.write_digest(self.sent, self.digest)
            seconds = self.seconds
            try:
                request.Start()
                binding = repeat.run  # (read while the reduction is in flight)
                reducer.complete(request, seconds, self.doing)
            except BaseException as error:  # PeerTimeoutError included: the missing ranks may never come
                abort_for(plan.comm, f"checking {plan.op}", error)
            if reducer.digest_received.tobytes() != self.digest:  # some rank sent another vector
                try:
                    outcome, agreed = self.entry.again_differing(repeat, seconds)
                except BaseException as error:
                    abort_for(plan.comm, f"checking {plan.op}", error)
                return plan.after_again(state, repeat, outcome, agreed, inplace)
        elif not reducer.single or self.context.freed:  # freed, or no persistent collectives
            return None
        else:
            binding = repeat.run
        repeat.hits += 1
        calls = binding.calls if binding is not None else None  # the in-place binding kept, if any
        if calls:  # the binding is live: its prepared calls
            try:
                for function, arguments in calls:
                    function(*arguments)
            except BaseException as error:  # the ranks are committed: see guards
                abort_for(plan.comm, f"applying {plan.op}", error)
            return state
        return plan.after_again(state, repeat, repeat.outcome, True, inplace)
