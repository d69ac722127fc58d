"""Bound plans: a :class:`~linop.backends.mpi_plan.DistributedPlan` fixed to the caller's arrays
for repeated application (a halo exchange in a time loop), see
:meth:`~linop.backends.mpi_plan.DistributedPlan.bind`.

Binding checks once, then turns the schedule into persistent requests on the caller's arrays
(and, out of place, on result arrays built once), so each call is ``Startall`` and ``Waitall``
and the local unpacks and clears, nothing else. A schedule that cannot be bound so runs the
ordinary application (without its check) on each call. Every rank binds persistently, or none
does: the ranks agree first (one ``Allreduce``). A state with integer blocks is never bound
persistently: each call runs the checked application, since whether an integer result fits
(``docs/theory.md#dtypes``) depends on the values of that call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ..program import RankPhase
from ..space import Region, State
from .mpi_datatypes import mpi, raw_spec, region_spec
from .mpi_deadline import arrive_within
from .mpi_guard import abort_for
from .mpi_plan import DistributedPlan, read_only
from .mpi_steps import Action, Call, RankStep

if TYPE_CHECKING:  # pragma: no cover - mpi4py is optional at run time
    from mpi4py.MPI import Intracomm

__all__ = ["BoundPlan"]

Phases = list[tuple[list[Any], list[Action]]]
"""Persistent phases: the requests started (and waited for) together, then local actions."""


class BoundPlan:
    """A plan bound to fixed arrays for repeated application.

    Call it with no arguments: it applies the operator to the bound arrays and returns this
    rank's blocks of the range (in place: the bound arrays; out of place: result arrays built
    at binding when :attr:`persistent`, overwritten by each call). ``free()`` releases the
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
    ) -> None:
        self.plan = plan
        self._first_timeout = timeout  # the first call's deadline (mpi_deadline), then None
        self.arrays = arrays
        self.dtype = dtype
        self.inplace = inplace
        self.checked = checked
        self.outputs: dict[str, np.ndarray] = {}
        self._scratch: list[np.ndarray] = []  # arrays the requests write into, freed with them
        comm = plan.comm
        self._phases: Phases | None = None
        if checked:  # integer blocks: every call checks (the same decision on every rank)
            pass
        elif inplace:
            possible = _persistent_phases(plan.schedule, arrays, comm, dtype, dry=True) is not None
            if comm.allreduce(possible, op=mpi().LAND):  # every rank binds, or none does
                self._phases = _persistent_phases(plan.schedule, arrays, comm, dtype, dry=False)
        else:
            possible = _persistent_out_of_place(plan.schedule, arrays, comm, dtype, dry=True) is not None
            if comm.allreduce(possible, op=mpi().LAND):
                bound = _persistent_out_of_place(plan.schedule, arrays, comm, dtype, dry=False)
                if bound is not None:
                    self._phases, self.outputs, self._scratch = bound
        self._startall = mpi().Prequest.Startall
        self._waitall = mpi().Request.Waitall

    @property
    def persistent(self) -> bool:
        """True when every call runs only MPI calls prepared at binding (persistent requests,
        broadcasts between prebuilt buffers) and local clears/adds."""
        return self._phases is not None

    def __call__(self) -> State:
        if self._first_timeout is not None:
            self._arrive_first()
        phases = self._phases
        if phases is None:
            if self.checked:
                return self.plan.apply(self.arrays, inplace=self.inplace)
            if not self.inplace:
                return self.plan.run_out_of_place(self.arrays, self.dtype, self.dtype)
            self.plan.run_in_place(self.arrays, self.dtype, self.dtype)
            return self.arrays
        try:
            startall, waitall = self._startall, self._waitall
            for requests, finish in phases:
                if requests:
                    startall(requests)
                    waitall(requests)
                for action in finish:
                    action()
        except BaseException as error:
            abort_for(self.plan.comm, f"applying the bound plan of {self.plan.op}", error)
        return self.outputs if not self.inplace else self.arrays

    def _arrive_first(self) -> None:
        """Every rank's first call, persistent or not, within the deadline: a polled barrier
        first (:func:`~linop.backends.mpi_deadline.arrive_within`), so no rank waits in a
        blocking call for one that never comes; a timeout ends the job."""
        timeout, self._first_timeout = self._first_timeout, None
        assert timeout is not None  # called only while the first call's deadline is set
        try:
            arrive_within(self.plan.comm, timeout, f"the first call of the bound plan of {self.plan.op}")
        except BaseException as error:
            abort_for(self.plan.comm, f"applying the bound plan of {self.plan.op}", error)

    def free(self) -> None:
        """Release the persistent requests and the arrays they write into."""
        for requests, _ in self._phases or ():
            for request in requests:
                request.Free()
        self._phases = None
        self._scratch = []


def _persistent_out_of_place(
    schedule: Sequence[Any],
    arrays: dict[str, np.ndarray],
    comm: Intracomm,
    dtype: np.dtype,
    *,
    dry: bool = False,
) -> tuple[Phases, dict[str, np.ndarray], list[np.ndarray]] | None:
    """Persistent collectives for a schedule of one native broadcast or sum-reduce, writing
    into prebuilt result arrays: the phases, the results and the scratch arrays the calls
    write into (kept with the binding); None when the schedule cannot be bound so (``dry``:
    decide only)."""
    if len(schedule) != 1 or not isinstance(schedule[0], RankStep):
        return None
    binding = schedule[0].bind_out_of_place(arrays, comm, dtype, dry=dry)
    if binding is None:
        return None
    outputs = {name: read_only(a) for name, a in arrays.items() if name not in binding.dropped}
    outputs.update(binding.results)
    # one collective at a time, in the global order of the groups (a callable is a blocking
    # collective call, a request a persistent one)
    return [_one_call(call) for call in binding.calls], outputs, binding.scratch


def _one_call(call: Call) -> tuple[list[Any], list[Action]]:
    return ([], [call]) if callable(call) else ([call], [])


def _persistent_phases(
    schedule: Sequence[Any],
    arrays: dict[str, np.ndarray],
    comm: Intracomm,
    dtype: np.dtype,
    *,
    dry: bool = False,
) -> Phases | None:
    """Persistent requests and post-actions for each phase, or None when the schedule has
    steps other than phases of in-place stores/adds between existing blocks and rank steps
    that bind in place (native all-reduces). ``dry``: only decide, create nothing (collective
    initializations must be made by every member or none, so the ranks agree first)."""
    if not all(array.dtype == dtype for array in arrays.values()):
        return None
    phases: Phases = []
    for step in schedule:
        if isinstance(step, RankStep):
            prepared = step.persistent(arrays, comm, dtype, dry=dry)
            if prepared is None:
                return None
            # collectives on several sub-communicators: one at a time, in the global order
            phases.extend(([request], []) for request in prepared.requests)
            phases.append(([], prepared.finish))
            continue
        if not isinstance(step, RankPhase):
            return None
        requests: list[Any] = []
        finish: list[Action] = []
        for peer, tag, t in step.receives:
            if t.mode == "new" or t.target.name not in arrays:
                return None
            if t.source.size == 0:
                continue
            target = arrays[t.target.name]
            region = cast(Region, t.target)  # a box of an existing block (not "new")
            spec = region_spec(target, region) if t.mode == "store" else None
            if spec is None:
                buffer = np.empty(t.shape, dtype)
                spec = raw_spec(buffer)
                finish.append(_unpack(target, region.index, buffer, add=t.mode == "add"))
            if not dry:
                requests.append(comm.Recv_init(spec, peer, tag))
        packs: list[Action] = []
        for peer, tag, t in step.sends:
            if t.after == "drop" or t.source.name not in arrays:
                return None
            source = arrays[t.source.name]
            if t.source.size:
                spec = region_spec(source, t.source)
                if spec is None:  # a thin box: packed into a buffer before each start
                    buffer = np.empty(t.shape, dtype)
                    packs.append(_packer(source, t.source.index, buffer))
                    spec = raw_spec(buffer)
                if not dry:
                    requests.append(comm.Send_init(spec, peer, tag))
            if t.after == "clear" and t.source.size:
                finish.append(_clearer(source, t.source.index))
        if packs:
            phases.append(([], packs))
        phases.append((requests, finish))
    return phases


def _unpack(target: np.ndarray, index: tuple[Any, ...], buffer: np.ndarray, *, add: bool) -> Action:
    key: tuple[Any, ...] = (*index, Ellipsis)
    view = target[key]
    if add:
        return lambda: np.add(view, buffer, out=view)
    return lambda: np.copyto(view, buffer)


def _packer(source: np.ndarray, index: tuple[Any, ...], buffer: np.ndarray) -> Action:
    key: tuple[Any, ...] = (*index, Ellipsis)
    view = source[key]
    return lambda: np.copyto(buffer, view)


def _clearer(array: np.ndarray, index: tuple[Any, ...]) -> Action:
    key: tuple[Any, ...] = (*index, Ellipsis)
    view = array[key]
    return lambda: view.fill(0)
