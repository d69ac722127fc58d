"""The checked in-place application's fast path: a schedule of phases compiled per layout.

Every call of :meth:`~linop.backends.mpi.plan.DistributedPlan.apply` (and so of
:func:`linop.backends.mpi.apply`) runs the collective entry check, then the rank's schedule.
In place, a schedule made only of phases of point-to-point stores, adds and clears between
blocks that exist before and after (a halo exchange and its adjoint) is compiled here once per
*layout* of the caller's arrays (names, shapes, strides, dtype) into the requests' datatypes and
the pack, unpack and clear steps, as each phase's recipe says
(:mod:`linop.backends.mpi.phase_recipe`), the way
:meth:`~linop.backends.mpi.plan.DistributedPlan.bind` compiles it once for fixed arrays. The
requests are persistent, made once per array object (views as bytes, subarray datatypes for
strided boxes: the bulk is never copied; thin strips packed into scratch buffers owned here) on
the arrays' memory *by address*, so they do not keep the caller's arrays alive: a finalizer
frees them with the array, and each call checks that its arrays are the bound objects with the
bound shape, strides and dtype (the collective check has validated the rest). A call then runs
the binding's prepared calls (packs, ``Startall``, ``Waitall``, unpacks and clears on views of
the bound memory, made by address too), as a bound plan does. Every other call runs the plan's
ordinary schedule.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...program import RankPhase
from ..host_phase import BUFFER, VIEW
from .datatypes import mpi, raw_spec
from .mpi_types import Intracomm
from .phase_recipe import phase_recipe

__all__ = ["InPlaceLayouts", "CompiledPhases", "compile_phases"]

Arrays = dict[str, np.ndarray]
Local = tuple[str, str, tuple[Any, ...], Any]
"""A local step of a compiled phase: (kind, block name, index, buffer), kind ``"pack"`` (the
box copied into the buffer before the requests start), ``"store"`` or ``"add"`` (the buffer
copied or added into the box after they complete) or ``"clear"`` (the box zeroed; no buffer)."""

_LAYOUTS_KEPT = 8  # compiled layouts per plan


PreparedRequest = tuple[int, Any, Any, Any, int, int]
"""One request of a compiled phase: (route, name, index, spec, peer, tag), the route as the
phase's recipe says (:mod:`linop.backends.mpi.phase_recipe`). ``VIEW``: the contiguous box
``arrays[name][index]`` as bytes; ``STRIDED``: ``[arrays[name], 1, spec]`` with ``spec`` its
subarray datatype; ``BUFFER``: ``spec`` is the whole buffer spec of a scratch buffer (a packed
thin box, or a receive added or stored after the wait)."""


@dataclass(frozen=True)
class _Phase:
    packs: tuple[Local, ...]
    receives: tuple[PreparedRequest, ...]
    sends: tuple[PreparedRequest, ...]
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
                    if kind == BUFFER:
                        requests.append(init(spec, peer, tag))
                        continue
                    array = arrays[name]
                    if kind == VIEW:
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

    def run(self) -> bool:
        """Run the prepared calls (as :meth:`CompiledPhases.run_bound`) when the binding is
        live; False when its requests have been freed (its array collected, or the binding
        evicted), and then nothing ran. The caller has made sure the arrays are the bound
        ones (an entry check's repeat: :mod:`linop.backends.entry_check.repeat`)."""
        if not self.requests:
            return False
        for function, arguments in self.calls:
            function(*arguments)
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
    """Compile an in-place schedule for the layout of ``arrays`` (each phase as its recipe
    says, :func:`~linop.backends.mpi.phase_recipe.phase_recipe`), or None when it has steps
    other than phases of stores, adds and clears between existing C-ordered blocks of the
    run's dtype (those run the ordinary runtime)."""
    if not schedule or not all(a.dtype == dtype and a.flags.c_contiguous and a.ndim for a in arrays.values()):
        return None
    phases = []
    for step in schedule:
        if type(step) is not RankPhase:
            return None
        if any(t.mode == "new" or t.target.name not in arrays for _, _, t in step.receives):
            return None
        if any(t.after == "drop" or t.source.name not in arrays for _, _, t in step.sends):
            return None
        recipe = phase_recipe(step, dtype, target=arrays.__getitem__, source=arrays.__getitem__)
        packs: list[Local] = []
        receives: list[PreparedRequest] = []
        sends: list[PreparedRequest] = []
        finish: list[Local] = []
        for m in recipe.receives:
            if m.route != BUFFER:
                receives.append((m.route, m.name, m.box, m.datatype, m.peer, m.tag))
                continue
            buffer = np.empty(m.transfer.shape, dtype)
            receives.append((BUFFER, None, None, raw_spec(buffer), m.peer, m.tag))
            finish.append(("add" if m.transfer.mode == "add" else "store", m.name, m.box, buffer))
        for m in recipe.sends:
            if m.route != BUFFER:
                sends.append((m.route, m.name, m.box, m.datatype, m.peer, m.tag))
                continue
            buffer = np.empty(m.transfer.shape, dtype)  # a thin box: packed before the requests start
            packs.append(("pack", m.name, m.box, buffer))
            sends.append((BUFFER, None, None, raw_spec(buffer), m.peer, m.tag))
        finish.extend(("clear", name, index, None) for name, index in recipe.clears)
        phases.append(_Phase(tuple(packs), tuple(receives), tuple(sends), tuple(finish)))
    return CompiledPhases(tuple(phases), comm)


class InPlaceLayouts:
    """The in-place schedules of one plan compiled per layout of the caller's arrays (None: not
    compilable), and the previous call's binding; owned by the plan
    (:attr:`~linop.backends.mpi.plan.DistributedPlan.layouts`)."""

    __slots__ = ("by_layout", "comm", "last", "schedule")

    def __init__(self, schedule: Sequence[Any], comm: Intracomm) -> None:
        self.schedule = schedule
        self.comm = comm
        self.by_layout: dict[tuple[Any, ...], CompiledPhases | None] = {}
        self.last: tuple[np.dtype, CompiledPhases, _Binding] | None = None
        """The run dtype, schedule and binding of the previous in-place call (on a dict)."""

    def run(self, arrays: Arrays, dtype: np.dtype, *, remember: bool) -> bool:
        """Run the schedule in place on ``arrays`` (this rank's blocks, checked) by its compiled
        phases when it compiles for their layout; False when it does not (the caller runs the
        ordinary runtime). ``remember``: keep this call's binding at hand for the next call
        (the caller's own dict). Collective."""
        last = self.last
        if last is not None and last[0] is dtype and last[2].holds(arrays):  # the previous call's arrays
            last[1].run_bound(arrays, last[2])
            return True
        compiled = self.compiled(arrays, dtype)
        if compiled is None:
            return False
        compiled.run(arrays)
        if compiled.last is not None and remember:
            self.last = (dtype, compiled, compiled.last)
        return True

    def compiled(self, arrays: Arrays, dtype: np.dtype) -> CompiledPhases | None:
        """The schedule compiled for the layout of ``arrays`` in ``dtype`` (compiled on first
        use; at most :data:`_LAYOUTS_KEPT` layouts kept), or None."""
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
        found = self.by_layout[key] = compile_phases(self.schedule, arrays, dtype, self.comm)
        return found
