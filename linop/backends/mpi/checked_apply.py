"""The checked application of a plan, per call: :func:`checked_apply`.

Every call of :func:`linop.backends.mpi.apply` runs the collective entry check
(:mod:`linop.backends.mpi.check`: one persistent ``Allreduce`` of a short vector, so that a
mismatched tree or a wrong local state fails on every rank together, before any data moves),
then the rank's schedule. This module keeps the per-call work beyond that check small:

- in place, a schedule made only of phases of point-to-point stores, adds and clears between
  blocks that exist before and after (a halo exchange and its adjoint) is compiled once per
  *layout* of the caller's arrays (names, shapes, strides, dtype) into the requests' datatypes
  and the pack, unpack and clear steps, the way :meth:`~linop.backends.mpi.plan.DistributedPlan.bind`
  compiles it once for fixed arrays. The requests are persistent, made once per array object
  (views as bytes, subarray datatypes for strided boxes: the bulk is never copied; thin strips
  packed into scratch buffers owned here) on the arrays' memory *by address*, so they do not
  keep the caller's arrays alive: a finalizer frees them with the array, and each call checks
  that its arrays are the bound objects with the bound shape, strides and dtype (the
  collective check has validated the rest). A call then runs the binding's prepared calls
  (packs, ``Startall``, ``Waitall``, unpacks and clears on views of the bound memory, made by
  address too), as a bound plan does;
- every other call runs the plan's ordinary schedule (:meth:`DistributedPlan.run_in_place`,
  :meth:`DistributedPlan.run_out_of_place`) with the outcome of the check it already made.

What each path does to the caller's arrays is what :meth:`DistributedPlan.apply` does: out of
place they are never written (results are new arrays, or read-only views of blocks passed
through); in place the results are written into them.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import numpy.typing as npt

from ...program import RankPhase
from ...space import Region, State
from .datatypes import PACK_BELOW, contiguous_run, mpi, raw_spec, subarray
from .guards import abort_for

if TYPE_CHECKING:  # pragma: no cover - mpi4py is optional at run time
    from mpi4py.MPI import Datatype, Intracomm

    from .plan import DistributedPlan

__all__ = ["checked_apply", "CompiledPhases", "compile_phases"]

Arrays = dict[str, np.ndarray]
Local = tuple[str, str, tuple[Any, ...], Any]
"""A local step of a compiled phase: (kind, block name, index, buffer), kind ``"pack"`` (the
box copied into the buffer before the requests start), ``"store"`` or ``"add"`` (the buffer
copied or added into the box after they complete) or ``"clear"`` (the box zeroed; no buffer)."""

_LAYOUTS_KEPT = 8  # compiled layouts per plan


_VIEW, _BUFFER, _STRIDED = 0, 1, 2  # how a message's buffer is named on each call
Message = tuple[int, Any, Any, Any, int, int]
"""One request of a compiled phase: (kind, name, index, spec, peer, tag). ``_VIEW``: the
contiguous box ``arrays[name][index]`` as bytes; ``_STRIDED``: ``[arrays[name], 1, spec]``
with ``spec`` its subarray datatype; ``_BUFFER``: ``spec`` is the whole buffer spec of a
scratch buffer (a packed thin box)."""


@dataclass(frozen=True)
class _Phase:
    packs: tuple[Local, ...]
    receives: tuple[Message, ...]
    sends: tuple[Message, ...]
    finish: tuple[Local, ...]


class CompiledPhases:
    """An in-place schedule of point-to-point phases compiled for one layout of the arrays.

    :meth:`run` applies it to arrays of that layout; collective with the other ranks'
    schedules (the same messages as :func:`linop.backends.mpi.runtime.run_phase` sends).
    The requests are persistent, made once per array object (:class:`_Binding`) on the
    arrays' memory by address, so they do not keep the arrays alive: they are freed when an
    array is, or when more than :data:`BINDINGS_KEPT` arrays have been seen."""

    def __init__(self, phases: tuple[_Phase, ...], comm: Intracomm) -> None:
        global _PERSISTENT
        self.phases = phases
        self.comm = comm
        self.bindings: dict[tuple[int, ...], _Binding] = {}
        self.last: _Binding | None = None  # the binding of the previous call
        _PERSISTENT = (mpi().Prequest.Startall, mpi().Request.Waitall)

    def run(self, arrays: Arrays) -> None:
        """Run every phase on ``arrays``: packs, then start the receives and sends and wait
        for them, then the unpacks, adds and clears."""
        binding = self.last
        if binding is None or not binding.holds(arrays):
            key = tuple(id(a) for a in arrays.values())
            binding = self.bindings.get(key)
            if binding is None or not binding.holds(arrays):
                binding = self._bind(key, arrays)
            self.last = binding
        self.run_bound(arrays, binding)

    def run_bound(self, arrays: Arrays, binding: _Binding) -> None:
        """:meth:`run` with the binding of these arrays at hand: its prepared calls (packs,
        ``Startall``, ``Waitall``, unpacks and clears on views of the bound memory), in order."""
        for function, arguments in binding.calls:
            function(*arguments)

    def _bind(self, key: tuple[int, ...], arrays: Arrays) -> _Binding:
        old = self.bindings.pop(key, None)
        if old is not None:
            old.free()
        while len(self.bindings) >= BINDINGS_KEPT:
            self.bindings.pop(next(iter(self.bindings))).free()
        self.last = None
        binding = self.bindings[key] = _Binding(self, key, arrays)
        return binding

    def forget(self, key: tuple[int, ...], binding: _Binding) -> None:
        """Drop a binding whose array is gone (its requests are freed)."""
        if self.bindings.get(key) is binding:
            del self.bindings[key]
        if self.last is binding:
            self.last = None


BINDINGS_KEPT = 4
"""Array objects with persistent requests per compiled layout (a time loop alternating a few
buffers reuses theirs)."""

_PERSISTENT: tuple[Any, Any] = (None, None)


class _Binding:
    """The persistent requests of a compiled schedule on one set of array objects.

    Made by address (``MPI.buffer.fromaddress``), so the requests do not hold the arrays:
    a finalizer on each array frees them when it is collected. :meth:`holds` tells whether
    the arrays of a call are still those objects with the same memory layout."""

    def __init__(self, owner: CompiledPhases, key: tuple[int, ...], arrays: Arrays) -> None:
        comm = owner.comm
        lib = mpi()
        self.names = tuple(arrays)
        self.refs = [weakref.ref(a) for a in arrays.values()]
        self.layout = [(a.shape, a.strides, a.dtype.char) for a in arrays.values()]
        self.requests: list[list[Any]] = []
        for phase in owner.phases:
            requests = []
            for init, messages in ((comm.Recv_init, phase.receives), (comm.Send_init, phase.sends)):
                for kind, name, index, spec, peer, tag in messages:
                    if kind == _BUFFER:
                        requests.append(init(spec, peer, tag))
                        continue
                    array = arrays[name]
                    if kind == _VIEW:
                        view = array[index]
                        memory = lib.buffer.fromaddress(_address(view), view.nbytes)
                        requests.append(init([memory, view.nbytes, lib.BYTE], peer, tag))
                    else:
                        memory = lib.buffer.fromaddress(_address(array), array.nbytes)
                        requests.append(init([memory, 1, spec], peer, tag))
            self.requests.append(requests)
        self.calls = _prepared_calls(owner.phases, self.requests, arrays)
        for array in arrays.values():
            weakref.finalize(array, _forget, weakref.ref(owner), key, weakref.ref(self))

    def holds(self, arrays: Arrays) -> bool:
        """The arrays are the bound objects, with the bound shapes, strides and dtypes (and
        the binding is live)."""
        if not self.requests:
            return False
        if len(self.refs) == 1:  # the common case, without the loop
            (array,) = arrays.values()
            shape, strides, char = self.layout[0]
            return (
                self.refs[0]() is array
                and array.strides == strides
                and array.shape == shape
                and array.dtype.char == char
            )
        if tuple(arrays) != self.names:  # the same objects under other names are not the same
            return False
        for ref, (shape, strides, char), array in zip(self.refs, self.layout, arrays.values()):
            if ref() is not array or array.strides != strides or array.dtype.char != char:
                return False
            if array.shape != shape:
                return False
        return True

    def free(self) -> None:
        """Release the persistent requests (inactive: every call waits for them)."""
        for requests in self.requests:
            for request in requests:
                request.Free()
        self.requests = []
        self.calls = []


def _prepared_calls(phases: tuple[_Phase, ...], requests: list[list[Any]], arrays: Arrays) -> list[Any]:
    """One call's work on these arrays, as ``(function, arguments)`` pairs: each phase's packs,
    ``Startall`` and ``Waitall`` of its requests, its unpacks, adds and clears. The boxes are
    views of the arrays' memory by address (:func:`_memory_view`), which do not keep the arrays
    alive (a binding is freed with its arrays)."""
    startall, waitall = _PERSISTENT
    bases = {name: _memory_view(array) for name, array in arrays.items()}
    calls: list[Any] = []
    for phase, started in zip(phases, requests):
        for _, name, index, buffer in phase.packs:
            calls.append((np.copyto, (buffer, bases[name][index])))
        if started:
            calls.append((startall, (started,)))
            calls.append((waitall, (started,)))
        for kind, name, index, buffer in phase.finish:
            view = bases[name][index]
            if kind == "store":
                calls.append((np.copyto, (view, buffer)))
            elif kind == "add":
                calls.append((np.add, (view, buffer, view)))
            else:
                calls.append((view.fill, (0,)))
    return calls


def _memory_view(array: np.ndarray) -> np.ndarray:
    """A writeable array over the memory of a C-ordered ``array`` that holds no reference to it."""
    if not array.size:  # no memory to name: no box of it moves anything
        return np.empty(array.shape, dtype=array.dtype)
    memory = mpi().buffer.fromaddress(_address(array), array.nbytes)
    return np.frombuffer(memory, dtype=array.dtype).reshape(array.shape)


def _forget(owner: Any, key: tuple[int, ...], binding: Any) -> None:
    """An array of a binding was collected: free the binding's requests."""
    found, compiled = binding(), owner()
    if found is None:
        return
    found.free()
    if compiled is not None:
        compiled.forget(key, found)


def _address(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


def layout_of(arrays: Arrays) -> tuple[Any, ...]:
    """What a compiled schedule depends on: each block's name, shape, strides and dtype."""
    return tuple((name, a.shape, a.strides, a.dtype.char) for name, a in arrays.items())


def compile_phases(
    schedule: Sequence[Any], arrays: Arrays, dtype: np.dtype, comm: Intracomm
) -> CompiledPhases | None:
    """Compile an in-place schedule for the layout of ``arrays``, or None when it has steps
    other than phases of stores, adds and clears between existing C-ordered blocks of the
    run's dtype (those run the ordinary runtime)."""
    if not schedule or not all(a.dtype == dtype and a.flags.c_contiguous and a.ndim for a in arrays.values()):
        return None
    phases = []
    for step in schedule:
        if type(step) is not RankPhase:
            return None
        packs: list[Local] = []
        receives: list[Message] = []
        sends: list[Message] = []
        finish: list[Local] = []
        for peer, tag, t in step.receives:
            if t.mode == "new" or t.target.name not in arrays:
                return None
            if t.source.size == 0:
                continue
            region = cast(Region, t.target)
            target = arrays[region.name]
            direct = _direct(target, region, step.index(region)) if t.mode == "store" else None
            if direct is not None:
                receives.append((*direct, peer, tag))
                continue
            buffer = np.empty(t.shape, dtype)
            receives.append((_BUFFER, None, None, raw_spec(buffer), peer, tag))
            finish.append(("add" if t.mode == "add" else "store", region.name, step.index(region), buffer))
        for peer, tag, t in step.sends:
            if t.after == "drop" or t.source.name not in arrays:
                return None
            source = arrays[t.source.name]
            if t.source.size:
                direct = _direct(source, t.source, step.index(t.source))
                if direct is not None:
                    sends.append((*direct, peer, tag))
                else:  # a thin box: packed into a buffer before the requests start
                    buffer = np.empty(t.shape, dtype)
                    packs.append(("pack", t.source.name, step.index(t.source), buffer))
                    sends.append((_BUFFER, None, None, raw_spec(buffer), peer, tag))
            if t.after == "clear" and t.source.size:
                finish.append(("clear", t.source.name, step.index(t.source), None))
        phases.append(_Phase(tuple(packs), tuple(receives), tuple(sends), tuple(finish)))
    return CompiledPhases(tuple(phases), comm)


def _direct(
    array: np.ndarray, region: Region, index: tuple[Any, ...]
) -> tuple[int, str, tuple[Any, ...], Datatype | None] | None:
    """How a box of a C-ordered block moves without packing, as
    :func:`~linop.backends.mpi.datatypes.region_spec` decides: its view as bytes when it is
    contiguous, else its subarray datatype; None for a thin box (contiguous runs shorter than
    :data:`PACK_BELOW` bytes: packed)."""
    if array[index].flags.c_contiguous:
        return _VIEW, region.name, index, None
    extents = tuple(b - a for a, b in zip(region.start, region.stop))
    if contiguous_run(array.shape, extents, array.itemsize) < PACK_BELOW:
        return None
    return _STRIDED, region.name, index, subarray(array.shape, region.start, extents, array.dtype)


class _PlanLayouts:
    """The compiled in-place schedules of one plan, by layout (None: not compilable)."""

    __slots__ = ("by_layout", "last")

    def __init__(self) -> None:
        self.by_layout: dict[tuple[Any, ...], CompiledPhases | None] = {}
        self.last: tuple[np.dtype, CompiledPhases, _Binding] | None = None
        """The run dtype, schedule and binding of the previous in-place call (on a dict)."""

    def compiled(self, plan: DistributedPlan, arrays: Arrays, dtype: np.dtype) -> CompiledPhases | None:
        if len(arrays) == 1:  # the common case: one block, the layout read cheaply
            (array,) = arrays.values()
            key: tuple[Any, ...] = (array.shape, array.strides, array.dtype.char, dtype.char)
        else:
            key = (layout_of(arrays), dtype.char)
        try:
            return self.by_layout[key]
        except KeyError:
            pass
        if len(self.by_layout) >= _LAYOUTS_KEPT:
            self.by_layout.clear()
            self.last = None
        found = self.by_layout[key] = compile_phases(plan.schedule, arrays, dtype, plan.comm)
        return found


def checked_apply(
    plan: DistributedPlan,
    state: Any,
    *,
    inplace: bool = False,
    dtype: npt.DTypeLike | None = None,
    timeout: Any = None,
) -> State:
    """Check collectively, then apply ``plan`` to this rank's blocks: what
    :meth:`DistributedPlan.apply` does, with the cheap in-place path described in the module
    docstring. Collective; ``timeout`` as in :meth:`DistributedPlan.check`.

    Raises
    ------
    TreeMismatchError, CommunicatorError, DistributedStateError, UnsupportedNodeError
        On every rank together, before any data moves.
    """
    if plan.context.freed:
        plan.agree(state, inplace=inplace, dtype=dtype)  # raises the freed communicator's error
    seconds = plan.deadline(timeout)
    try:
        outcome = plan.entry.run(state, inplace=inplace, dtype=dtype, timeout=seconds)
    except BaseException as error:  # a rank failing here would leave the others waiting
        abort_for(plan.comm, f"checking {plan.op}", error)
    if outcome.error is not None:
        raise outcome.error
    run_dtype = outcome.dtype
    assert run_dtype is not None
    if inplace and outcome.cast is None:  # the previous call's arrays again: run their requests
        layouts = plan.entry.extension
        last = layouts.last if layouts is not None else None
        if last is not None and last[0] is run_dtype and last[2].holds(state):
            try:
                last[1].run_bound(state, last[2])
            except BaseException as error:  # the ranks are committed: see mpi_guard
                abort_for(plan.comm, f"applying {plan.op}", error)
            return state
    if inplace:
        cast_to = outcome.cast
        if cast_to is None:
            if not plan.schedule:
                return state
            layouts = plan.entry.extension
            if layouts is None:
                layouts = plan.entry.extension = _PlanLayouts()
            # the check passed: a dict holds exactly this rank's blocks (any mapping: copied)
            arrays = state if type(state) is dict else {name: state[name] for name in plan.domain_blocks}
            try:
                compiled = layouts.compiled(plan, arrays, run_dtype)
                if compiled is not None:
                    compiled.run(arrays)
                    if compiled.last is not None and arrays is state:
                        layouts.last = (run_dtype, compiled, compiled.last)
                    return state
            except BaseException as error:  # the ranks are committed: see mpi_guard
                abort_for(plan.comm, f"applying {plan.op}", error)
        arrays = {name: state[name] for name in plan.domain_blocks}
        alloc = np.dtype(dtype) if dtype is not None else run_dtype
        failure = plan.run_in_place(arrays, run_dtype, alloc, cast=cast_to)
        if failure is not None:
            raise failure
        return state
    arrays = {name: state[name] for name in plan.domain_blocks}
    alloc = np.dtype(dtype) if dtype is not None else run_dtype
    return plan.run_out_of_place(_widened(arrays, outcome.cast), run_dtype, alloc)


def _widened(arrays: Arrays, cast_to: np.dtype | None) -> Arrays:
    """The arrays to run on: the caller's, or copies widened to ``cast_to`` (as the numpy
    interpreter does, :func:`linop.dtypes.prepare_numpy`)."""
    if cast_to is None:
        return dict(arrays)
    return {name: a.astype(np.result_type(a.dtype, cast_to)) for name, a in arrays.items()}
