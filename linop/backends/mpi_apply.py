"""The checked application of a plan, per call: :func:`checked_apply`.

Every call of :func:`linop.backends.mpi_backend.apply` runs the collective entry check
(:mod:`linop.backends.mpi_check`: one persistent ``Allreduce`` of a short vector, so that a
mismatched tree or a wrong local state fails on every rank together, before any data moves),
then the rank's schedule. This module keeps the per-call work beyond that check small:

- in place, a schedule made only of phases of point-to-point stores, adds and clears between
  blocks that exist before and after (a halo exchange and its adjoint) is compiled once per
  *layout* of the caller's arrays (names, shapes, strides, dtype) into the requests' datatypes
  and the pack, unpack and clear steps, the way :meth:`~linop.backends.mpi_plan.DistributedPlan.bind`
  compiles it once for fixed arrays. A call then only creates the nonblocking requests on the
  arrays it is given (subarray datatypes: the bulk is never copied; thin strips packed into
  scratch buffers owned here), waits, unpacks and clears. Nothing holds the caller's arrays
  between calls;
- every other call runs the plan's ordinary schedule (:meth:`DistributedPlan.run_in_place`,
  :meth:`DistributedPlan.run_out_of_place`) with the outcome of the check it already made.

What each path does to the caller's arrays is what :meth:`DistributedPlan.apply` does: out of
place they are never written (results are new arrays, or read-only views of blocks passed
through); in place the results are written into them.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import numpy.typing as npt

from ..space import Region, State
from .mpi_datatypes import PACK_BELOW, contiguous_run, mpi, raw_spec, subarray
from .mpi_guard import abort_for
from .mpi_schedule import RankPhase

if TYPE_CHECKING:  # pragma: no cover - mpi4py is optional at run time
    from mpi4py.MPI import Datatype, Intracomm

    from .mpi_plan import DistributedPlan

__all__ = ["checked_apply", "CompiledPhases", "compile_phases"]

Arrays = dict[str, np.ndarray]
Step = Callable[[Arrays], object]
"""A local step of a compiled phase, run on the call's arrays (a pack, unpack, add or clear)."""

_LAYOUTS_KEPT = 8  # compiled layouts per plan
_BYTE: Any = None


@dataclass(frozen=True)
class _Message:
    """One request of a compiled phase: the box ``arrays[name][index]`` as bytes when it is
    contiguous (``datatype`` None), ``[arrays[name], 1, datatype]`` when it is strided, or a
    scratch buffer (``name`` None) when it is packed."""

    peer: int
    tag: int
    name: str | None
    index: tuple[Any, ...] | None
    datatype: Datatype | None
    buffer: np.ndarray | None


@dataclass(frozen=True)
class _Phase:
    packs: tuple[Step, ...]
    receives: tuple[_Message, ...]
    sends: tuple[_Message, ...]
    finish: tuple[Step, ...]


class CompiledPhases:
    """An in-place schedule of point-to-point phases compiled for one layout of the arrays.

    :meth:`run` applies it to arrays of that layout; collective with the other ranks'
    schedules (the same messages as :func:`linop.backends.mpi_runtime.run_phase` sends)."""

    def __init__(self, phases: tuple[_Phase, ...]) -> None:
        self.phases = phases

    def post_first(self, arrays: Arrays, comm: Intracomm) -> list[Any]:
        """Pack the first phase's thin boxes and post its receives; return the receive
        requests (for :meth:`run`'s ``posted``). Local: nothing is sent."""
        _byte()
        first = self.phases[0]
        for pack in first.packs:
            pack(arrays)
        return [comm.Irecv(_spec(m, arrays), m.peer, m.tag) for m in first.receives]

    def run(self, arrays: Arrays, comm: Intracomm, posted: list[Any] | None = None) -> None:
        """Run every phase on ``arrays``: packs, then the receives and sends, one wait, then
        the unpacks, adds and clears. ``posted``: the first phase's receives and packs are
        done already (:meth:`post_first`)."""
        _byte()
        waitall = mpi().Request.Waitall
        irecv, isend = comm.Irecv, comm.Isend
        for i, phase in enumerate(self.phases):
            if i == 0 and posted is not None:
                requests = list(posted)
            else:
                for pack in phase.packs:
                    pack(arrays)
                requests = [irecv(_spec(m, arrays), m.peer, m.tag) for m in phase.receives]
            requests.extend(isend(_spec(m, arrays), m.peer, m.tag) for m in phase.sends)
            if requests:
                waitall(requests)
            for step in phase.finish:
                step(arrays)


def _byte() -> None:
    global _BYTE
    if _BYTE is None:
        _BYTE = mpi().BYTE


def withdraw(requests: list[Any]) -> None:
    """Cancel receives posted before the check and wait for them (no rank sent anything they
    could match: see :func:`checked_apply`)."""
    for request in requests:
        request.Cancel()
    mpi().Request.Waitall(requests)


def _spec(message: _Message, arrays: Arrays) -> list[Any]:
    if message.name is None:
        assert message.buffer is not None
        return raw_spec(message.buffer)
    if message.datatype is None:  # a contiguous box: its view, as bytes (as the runtime sends it)
        view = arrays[message.name][message.index]
        return [view, view.nbytes, _BYTE]
    return [arrays[message.name], 1, message.datatype]


def layout_of(arrays: Arrays) -> tuple[Any, ...]:
    """What a compiled schedule depends on: each block's name, shape, strides and dtype."""
    return tuple((name, a.shape, a.strides, a.dtype.char) for name, a in arrays.items())


def compile_phases(schedule: Sequence[Any], arrays: Arrays, dtype: np.dtype) -> CompiledPhases | None:
    """Compile an in-place schedule for the layout of ``arrays``, or None when it has steps
    other than phases of stores, adds and clears between existing C-ordered blocks of the
    run's dtype (those run the ordinary runtime)."""
    if not schedule or not all(a.dtype == dtype and a.flags.c_contiguous and a.ndim for a in arrays.values()):
        return None
    phases = []
    for step in schedule:
        if type(step) is not RankPhase:
            return None
        packs: list[Step] = []
        receives: list[_Message] = []
        sends: list[_Message] = []
        finish: list[Step] = []
        for peer, tag, t in step.receives:
            if t.mode == "new" or t.target.name not in arrays:
                return None
            if t.source.size == 0:
                continue
            region = cast(Region, t.target)
            target = arrays[region.name]
            direct = _direct(target, region, step.index(region)) if t.mode == "store" else None
            if direct is not None:
                receives.append(_Message(peer, tag, *direct))
                continue
            buffer = np.empty(t.shape, dtype)
            receives.append(_Message(peer, tag, None, None, None, buffer))
            finish.append(_unpack(region.name, step.index(region), buffer, add=t.mode == "add"))
        for peer, tag, t in step.sends:
            if t.after == "drop" or t.source.name not in arrays:
                return None
            source = arrays[t.source.name]
            if t.source.size:
                direct = _direct(source, t.source, step.index(t.source))
                if direct is not None:
                    sends.append(_Message(peer, tag, *direct))
                else:  # a thin box: packed into a buffer before the requests start
                    buffer = np.empty(t.shape, dtype)
                    packs.append(_pack(t.source.name, step.index(t.source), buffer))
                    sends.append(_Message(peer, tag, None, None, None, buffer))
            if t.after == "clear" and t.source.size:
                finish.append(_clear(t.source.name, step.index(t.source)))
        phases.append(_Phase(tuple(packs), tuple(receives), tuple(sends), tuple(finish)))
    return CompiledPhases(tuple(phases))


def _direct(
    array: np.ndarray, region: Region, index: tuple[Any, ...]
) -> tuple[str, tuple[Any, ...], Datatype | None, None] | None:
    """How a box of a C-ordered block moves without packing, as
    :func:`~linop.backends.mpi_datatypes.region_spec` decides: its view as bytes when it is
    contiguous, else its subarray datatype; None for a thin box (contiguous runs shorter than
    :data:`PACK_BELOW` bytes: packed)."""
    if array[index].flags.c_contiguous:
        return region.name, index, None, None
    extents = tuple(b - a for a, b in zip(region.start, region.stop))
    if contiguous_run(array.shape, extents, array.itemsize) < PACK_BELOW:
        return None
    return region.name, index, subarray(array.shape, region.start, extents, array.dtype), None


def _unpack(name: str, index: tuple[Any, ...], buffer: np.ndarray, *, add: bool) -> Step:
    if add:

        def added(arrays: Arrays) -> None:
            view = arrays[name][index]
            np.add(view, buffer, out=view)

        return added
    return lambda arrays: np.copyto(arrays[name][index], buffer)


def _pack(name: str, index: tuple[Any, ...], buffer: np.ndarray) -> Step:
    return lambda arrays: np.copyto(buffer, arrays[name][index])


def _clear(name: str, index: tuple[Any, ...]) -> Step:
    return lambda arrays: arrays[name][index].fill(0)


class _PlanLayouts:
    """The compiled in-place schedules of one plan, by layout (None: not compilable)."""

    __slots__ = ("by_layout",)

    def __init__(self) -> None:
        self.by_layout: dict[tuple[Any, ...], CompiledPhases | None] = {}

    def compiled(self, plan: DistributedPlan, arrays: Arrays, dtype: np.dtype) -> CompiledPhases | None:
        key = (layout_of(arrays), dtype.char)
        try:
            return self.by_layout[key]
        except KeyError:
            pass
        if len(self.by_layout) >= _LAYOUTS_KEPT:
            self.by_layout.clear()
        found = self.by_layout[key] = compile_phases(plan.schedule, arrays, dtype)
        return found


_LAYOUTS: weakref.WeakKeyDictionary[DistributedPlan, _PlanLayouts] = weakref.WeakKeyDictionary()


def checked_apply(
    plan: DistributedPlan,
    state: Any,
    *,
    inplace: bool = False,
    dtype: npt.DTypeLike | None = None,
) -> State:
    """Check collectively, then apply ``plan`` to this rank's blocks: what
    :meth:`DistributedPlan.apply` does, with the cheap in-place path described in the module
    docstring. Collective.

    Raises
    ------
    TreeMismatchError, CommunicatorError, DistributedStateError, UnsupportedNodeError
        On every rank together, before any data moves.
    """
    if plan.context.freed:
        plan.agree(state, inplace=inplace, dtype=dtype)  # raises the freed communicator's error
    comm = plan.comm
    layouts = _LAYOUTS.get(plan) if inplace else None
    posted: list[Any] = []
    speculative: list[CompiledPhases] = []

    def speculate(mine: list[np.ndarray]) -> bool:
        """Post the first phase's receives of the compiled schedule these arrays had on an
        earlier call, if any (the run's dtype is then most likely theirs)."""
        first = mine[0].dtype
        if layouts is None or any(a.dtype != first for a in mine):
            return False
        arrays = dict(zip(plan.domain_blocks, mine))
        compiled = layouts.by_layout.get((layout_of(arrays), first.char))
        if compiled is None:
            return False
        posted.extend(compiled.post_first(arrays, comm))
        speculative.append(compiled)
        return True

    try:
        pending = plan.entry.begin(state, inplace=inplace, dtype=dtype, speculate=speculate)
        outcome = plan.entry.end(pending)
        if posted and (outcome.error is not None or not outcome.uniform):
            withdraw(posted)  # the run may not match them: nobody has sent anything yet
            posted = []
        if outcome.error is None and outcome.speculated and not outcome.uniform:
            comm.Barrier()  # every rank withdrew such receives before any rank sends
    except BaseException as error:  # a rank failing here would leave the others waiting
        abort_for(comm, f"checking {plan.op}", error)
    run_dtype = outcome.result()
    arrays = {name: state[name] for name in plan.domain_blocks}
    if inplace:
        cast_to = outcome.cast
        if cast_to is None:
            if not plan.schedule:
                return state
            layouts = _LAYOUTS.get(plan)
            if layouts is None:
                layouts = _LAYOUTS[plan] = _PlanLayouts()
            try:  # uniform: the run's dtype is the arrays', so the speculation's schedule is it
                compiled = speculative[0] if posted else layouts.compiled(plan, arrays, run_dtype)
                if compiled is not None:
                    compiled.run(arrays, comm, posted or None)
                    return state
            except BaseException as error:  # the ranks are committed: see mpi_guard
                abort_for(plan.comm, f"applying {plan.op}", error)
        alloc = np.dtype(dtype) if dtype is not None else run_dtype
        failure = plan.run_in_place(arrays, run_dtype, alloc, cast=cast_to)
        if failure is not None:
            raise failure
        return state
    alloc = np.dtype(dtype) if dtype is not None else run_dtype
    return plan.run_out_of_place(_widened(arrays, outcome.cast), run_dtype, alloc)


def _widened(arrays: Arrays, cast_to: np.dtype | None) -> Arrays:
    """The arrays to run on: the caller's, or copies widened to ``cast_to`` (as the numpy
    interpreter does, :func:`linop.dtypes.prepare_numpy`)."""
    if cast_to is None:
        return dict(arrays)
    return {name: a.astype(np.result_type(a.dtype, cast_to)) for name, a in arrays.items()}
