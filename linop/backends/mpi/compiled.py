"""A rank's schedule compiled for fixed arrays into one flat list of prepared calls.

:meth:`~linop.backends.mpi.plan.DistributedPlan.bind` fixes the arrays a plan runs on; this
module runs the schedule once *symbolically* on them, at binding: it follows which array holds
each block after every step (the caller's arrays, and result or scratch buffers built here,
once), and writes down each step's work as ``(function, arguments)`` pairs on those very
arrays and their views:

- a phase (:class:`~linop.program.RankPhase`): persistent requests (``Recv_init`` /
  ``Send_init``) made once on the blocks' memory (subarray datatypes for strided boxes, thin
  strips packed into buffers owned here), then one ``Startall`` and one ``Waitall`` per call,
  then the unpacks, adds and clears (``np.copyto``, ``np.add(..., out=)``, ``ndarray.fill``;
  on a box with a thin last axis, a halo's column strip, their exact faster forms:
  :mod:`linop.backends.host_thin`).
  With bundles (with the peers that list the same ones, :func:`bundle_peers`), the small
  messages of a phase to (from) one peer, up to
  :data:`~linop.backends.mpi.phase_recipe.BUNDLE_UP_TO` bytes together, are one request on a
  struct datatype over their boxes and buffers at their absolute addresses
  (:func:`~linop.backends.mpi.phase_recipe.bundles`);
- the movement primitives (``Allocate``, ``Deallocate``, ``Copy``, ``CopyAdjoint``, ``Move``,
  ``Add``, ``Clear``), :class:`~linop.program.Scale` and :class:`~linop.program.RankZero`:
  numpy calls on prebuilt views, with the numpy interpreter's semantics
  (:mod:`linop.backends.numpy`), renames and drops resolved at binding;
- a fast-path part (:class:`~linop.backends.mpi.steps.RankStep`): its persistent collectives
  (:meth:`~linop.backends.mpi.steps.RankStep.persistent`,
  :meth:`~linop.backends.mpi.steps.RankStep.bind_out_of_place`), started in the global order of
  their groups; consecutive in-place ones that write disjoint blocks are all started, then
  waited for together (their latencies overlap); out-of-place ones made of persistent
  requests alone that say what they read (:meth:`~linop.backends.mpi.steps.RankStep.reads`:
  the sum-reduces of a layer's weight and bias gradients onto their owners) stay in flight
  until a step reads what they fill or is anything else (one ``Waitall`` then); others are
  waited for one at a time;
- a worker map's moves between two workers of this rank (:class:`~linop.program.LocalMoves`):
  copies, adds and clears between views, as the runtime runs them; those that follow a phase
  and touch nothing its transfers touch run between its start and its wait.

A call of the bound plan is then ``for function, arguments in calls: function(*arguments)``:
no lookup by block name, no dispatch on step types, no closure, no allocation.

The caller's arrays are never written out of place (unless the caller donates them, see
:meth:`~linop.backends.mpi.plan.DistributedPlan.bind`): a block is copied into a buffer built
here before its first change (the numpy interpreter's copy-on-write, as a prepared
``np.copyto`` at the same point of the call). In place, each block's result is copied back into
its caller's array when the run leaves it elsewhere (through a buffer when it lies in another
caller array, as :func:`~linop.backends.numpy.write_back` does).

A schedule with other steps (local kernels, sums) is not compiled
(:func:`compile_schedule` returns None); the bound plan then runs the ordinary schedule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ...movement import Copy, CopyAdjoint, Move
from ...primitives import Add, Allocate, Clear, Deallocate
from ...program import TAG_LIMIT, LocalMoves, RankPhase, RankZero, Scale
from ...space import Block, Region
from ..host_fusion import around
from ..host_phase import BUFFER, Message
from ..host_schedule import read_only
from ..host_thin import add_call, copy_call, fill_call
from ..host_workspace import OwnedBlocks
from .datatypes import BufferSpec, bundle_type, mpi, raw_spec
from .mpi_types import Intracomm
from .phase_recipe import bundles, direct_spec, phase_recipe
from .steps import RankStep

if TYPE_CHECKING:  # pragma: no cover - annotations only
    from .steps import OutOfPlaceBinding

__all__ = ["PreparedCall", "CompiledRun", "compile_schedule", "bundle_peers", "run_calls"]

PreparedCall = tuple[Callable[..., object], tuple[Any, ...]]
"""One prepared call of a compiled run: a function and its (fixed) arguments."""


@dataclass
class CompiledRun:
    """A schedule compiled for fixed arrays: the calls of one application, in order, and what
    they leave behind.

    Attributes
    ----------
    calls : list of PreparedCall
        The application, as ``function(*arguments)`` calls in order.
    outputs : dict
        Out of place: this rank's range blocks (buffers built at binding, overwritten by each
        call; a caller's block passed through as a read-only view). In place: empty (the
        results are in the caller's arrays).
    requests : list
        The persistent requests the calls start (freed by :meth:`free`).
    scratch : list of ndarray
        Arrays a fast path's collectives write into that are no result (kept alive here).
    bundles : list
        The bundles of two messages or more the phases send or receive (compiled with bundles;
        a dry run lists those it would make) as ``(peer, sending, tags)``, for
        :func:`bundle_peers`.
    peers : set of int
        The ranks the phases exchange messages that move entries with (both ends of such a
        message list each other), for :func:`bundle_peers`.
    datatypes : list
        The bundles' struct datatypes (freed by :meth:`free`).
    """

    calls: list[PreparedCall] = field(default_factory=list)
    outputs: dict[str, np.ndarray] = field(default_factory=dict)
    requests: list[Any] = field(default_factory=list)
    scratch: list[np.ndarray] = field(default_factory=list)
    bundles: list[tuple[int, bool, tuple[int, ...]]] = field(default_factory=list)
    peers: set[int] = field(default_factory=set)
    datatypes: list[Any] = field(default_factory=list)

    def free(self) -> None:
        """Release the persistent requests and the bundles' datatypes; the calls and their
        buffers are dropped."""
        for request in self.requests:
            request.Free()
        for datatype in self.datatypes:
            datatype.Free()
        self.requests = []
        self.datatypes = []
        self.calls = []
        self.scratch = []


def run_calls(calls: Sequence[PreparedCall]) -> None:
    """Run a compiled application: every prepared call, in order."""
    for function, arguments in calls:
        function(*arguments)


class _DeclinedError(Exception):
    """A step the compiler does not handle: the schedule runs uncompiled."""


def _index(region: Region) -> tuple[Any, ...]:
    return (*region.index, Ellipsis)  # a view even for integer indices


class _Compiler(OwnedBlocks[np.ndarray]):
    """The symbolic run: which array holds each block now, and which of them are owned (built
    here, or the caller's in place) rather than borrowed (the caller's, out of place)."""

    def __init__(
        self,
        arrays: dict[str, np.ndarray],
        comm: Intracomm,
        dtype: np.dtype,
        *,
        inplace: bool,
        dry: bool,
        donate: bool = False,
        bundle: bool | AbstractSet[int] = False,
    ):
        super().__init__(dict(arrays), set(arrays) if inplace else set())
        self.bundle = bundle
        """The peers a phase's messages to (from) move to (from) as bundles: True for every
        peer (a dry run listing the bundles it would make), else a set of ranks (False or
        empty: none)."""
        if donate:  # the plan's to write (a read-only array stays the caller's: copied first)
            self.owned = {name for name, array in arrays.items() if array.flags.writeable}
        self.comm = comm
        self.dtype = dtype
        self.dry = dry
        self.run = CompiledRun()
        self.calls = self.run.calls
        self._startall = mpi().Prequest.Startall
        self._waitall = mpi().Request.Waitall
        self._testall = mpi().Request.Testall
        # the whole-block fill of a block just allocated, or the clearing of a region just
        # copied back, as (block name, position in calls): the next step may drop or narrow it
        self._zeroed: tuple[str, int] | None = None
        self._cleared: tuple[str, int] | None = None
        # out-of-place persistent collectives started and not yet waited for, and the blocks
        # they fill (:meth:`fast_path`); any other step waits for them first (:meth:`settle`)
        self._in_flight: list[Any] = []
        self._landing: set[str] = set()

    def settle(self) -> None:
        """Wait for the collectives still in flight (one ``Waitall``), before a step that
        may touch their memory."""
        if self._in_flight:
            self.calls.append(self._wait_for(list(self._in_flight)))
            self._in_flight.clear()
            self._landing.clear()

    # -- the workspace, symbolically (numpy_backend.Workspace's rules) ------------------------
    def buffer(self, shape: tuple[int, ...]) -> np.ndarray:
        return np.zeros(shape, dtype=self.dtype)  # untouched pages until first written

    def writable(self, name: str) -> np.ndarray:
        array = self.arrays[name]
        if name not in self.owned:  # the caller's: copied before its first change
            copy = self.buffer(array.shape)
            self.calls.append(copy_call(copy, array))
            self.arrays[name] = array = copy
            self.owned.add(name)
        return array

    def overwritten(self, region: Region) -> np.ndarray:
        if region.is_whole and region.name not in self.owned:
            array = self.arrays[region.name] = self.buffer(self.arrays[region.name].shape)
            self.owned.add(region.name)
            return array
        return self.writable(region.name)

    def view(self, region: Region | Block) -> np.ndarray:
        array = self.arrays[region.name]
        return array[_index(region)] if isinstance(region, Region) else array

    # -- steps ----------------------------------------------------------------------------------
    def step(self, step: Any) -> None:
        kind = type(step)
        handler = _HANDLERS.get(kind)
        if handler is not None:
            self.settle()
            handler(self, step)
        elif isinstance(step, RankStep):
            self.fast_path(step)
        else:
            raise _DeclinedError(kind.__name__)

    def allocate(self, op: Allocate) -> None:
        array = self.buffer(op.block.shape)
        self.calls.append(fill_call(array))
        self.set(op.block.name, array)
        self._zeroed = (op.block.name, len(self.calls) - 1)

    def _fresh(self, region: Region) -> bool:
        """Whether ``region``'s block was allocated by the last call (its zeros not yet
        read or written): a write of the region then needs zeros only around it, which
        replace the whole fill (:func:`~linop.backends.host_fusion.around`)."""
        if self._zeroed != (region.name, len(self.calls) - 1):
            return False
        array = self.arrays[region.name]
        self.calls[-1:] = [fill_call(array[box]) for box in around(array.shape, region.start, region.stop)]
        self._zeroed = None
        return True

    def deallocate(self, op: Deallocate) -> None:
        array = self.arrays[op.name]
        if self._cleared == (op.name, len(self.calls) - 1) and not any(
            np.may_share_memory(array, other) for name, other in self.arrays.items() if name != op.name
        ):  # zeros that nothing reads: the block is dropped, and its buffer refilled before use
            self.calls.pop()
        self.drop(op.name)

    def copy(self, op: Copy) -> None:
        source = self.view(op.src)
        if isinstance(op.dst, Block):
            array = self.buffer(source.shape)
            self.calls.append(copy_call(array, source))
            self.set(op.dst.name, array)
        else:
            fresh = op.dst.name != op.src.name and self._fresh(op.dst)
            target = (self.arrays[op.dst.name] if fresh else self.overwritten(op.dst))[_index(op.dst)]
            self.calls.append(copy_call(target, source))

    def copy_adjoint(self, op: CopyAdjoint) -> None:
        back = self.view(op.dst)
        if op.src.name != op.dst.name and self._fresh(op.src):  # zeros plus back: back
            self.calls.append(copy_call(self.arrays[op.src.name][_index(op.src)], back))
        else:
            target = self.writable(op.src.name)[_index(op.src)]
            self.calls.append(add_call(target, back))
        if isinstance(op.dst, Block):
            self.drop(op.dst.name)
        elif op.dst.size:
            self.calls.append(fill_call(self.writable(op.dst.name)[_index(op.dst)]))
            self._cleared = (op.dst.name, len(self.calls) - 1)

    def move(self, op: Move) -> None:
        if isinstance(op.dst, Block):
            owned = op.src.name in self.owned
            self.set(op.dst.name, self.drop(op.src.name), owned=owned)
            return
        source = self.view(op.src)
        self.calls.append(copy_call(self.overwritten(op.dst)[_index(op.dst)], source))
        if op.src.size:
            self.calls.append(fill_call(self.writable(op.src.name)[_index(op.src)]))

    def add(self, op: Add) -> None:
        source = self.view(op.src)
        target = self.writable(op.dst.name)[_index(op.dst)]
        self.calls.append(add_call(target, source))

    def clear(self, op: Clear) -> None:
        if op.region.size:
            self.calls.append(fill_call(self.writable(op.region.name)[_index(op.region)]))

    def scale(self, step: Scale) -> None:
        for name in list(self.arrays):
            array = self.arrays[name]
            if np.result_type(array, step.alpha) != array.dtype:
                raise _DeclinedError("a scaling that widens the dtype")
            array = self.writable(name)
            self.calls.append((np.multiply, (array, step.alpha, array)))

    def zero(self, step: RankZero) -> None:
        self.arrays.clear()
        self.owned.clear()
        for block in step.blocks:
            array = self.buffer(block.shape)
            self.calls.append(fill_call(array))
            self.set(block.name, array)

    def phase(self, phase: RankPhase, during: LocalMoves | None = None) -> None:
        """The phase's recipe (:func:`~linop.backends.mpi.phase_recipe.phase_recipe`),
        prepared: persistent requests made once (one per bundle with the peers that list the
        same bundles, :func:`bundle_peers`), packs before each start, then the unpacks, adds
        and clears.
        ``during``: local moves that touch nothing the phase's transfers touch
        (:func:`_independent`), prepared between the start and the wait (while the messages
        are in flight)."""
        calls = self.calls
        recipe = phase_recipe(phase, self.dtype, target=self.writable, source=self.arrays.__getitem__)
        receives: list[BufferSpec | None] = []  # per message (None: a new block of size 0)
        finish: list[PreparedCall] = []
        created: list[tuple[str, np.ndarray]] = []
        for message in recipe.receives:
            t = message.transfer
            if message.route != BUFFER:
                spec: BufferSpec | None = direct_spec(self.arrays[message.name], message)
            else:
                buffer = self.buffer(t.shape)
                spec = raw_spec(buffer)
                if t.mode == "new":
                    created.append((message.name, buffer))
                    if not buffer.size:
                        spec = None
                else:
                    view = self.arrays[message.name][message.box]
                    finish.append(add_call(view, buffer) if t.mode == "add" else copy_call(view, buffer))
            receives.append(spec)
        sends: list[BufferSpec | None] = []
        for message in recipe.sends:
            array = self.arrays[message.name]
            if message.route != BUFFER:
                spec = direct_spec(array, message)
            else:  # a thin box (or another dtype): packed into a buffer before each start
                buffer = self.buffer(message.transfer.shape)
                calls.append(copy_call(buffer, array[message.box]))
                spec = raw_spec(buffer)
            sends.append(spec)
        requests = self._requests(recipe.receives, receives, sending=False)
        requests += self._requests(recipe.sends, sends, sending=True)
        if requests:
            self.run.requests.extend(requests)
            calls.append((self._startall, (requests,)))
        if during is not None:
            self.local_moves(during, progress=requests)
        if requests:
            calls.append((self._waitall, (requests,)))
        calls.extend(finish)
        for name, buffer in created:
            self.set(name, buffer)
        for name, index in recipe.clears:
            calls.append(fill_call(self.writable(name)[index]))
        for name in recipe.drops:
            self.drop(name)

    def _requests(
        self, messages: tuple[Message, ...], specs: list[BufferSpec | None], *, sending: bool
    ) -> list[Any]:
        """The persistent requests of one direction of a phase: a message each, or, with a
        peer of :attr:`bundle`, one per bundle (:func:`~linop.backends.mpi.phase_recipe.bundles`:
        its messages' specs as one struct datatype at absolute addresses, under the smallest
        tag); the bundles of two messages or more are noted in :attr:`CompiledRun.bundles`, the
        peers of the messages that move entries in :attr:`CompiledRun.peers`."""
        init = self.comm.Send_init if sending else self.comm.Recv_init
        groups = [[p] for p in range(len(messages))]
        if self.bundle is True:
            groups = bundles(messages, self.dtype.itemsize)
        elif self.bundle:
            agreed = self.bundle
            groups = [
                alone
                for group in bundles(messages, self.dtype.itemsize)
                for alone in ([group] if messages[group[0]].peer in agreed else [[p] for p in group])
            ]
        requests: list[Any] = []
        for group in groups:
            parts = [specs[p] for p in group if specs[p] is not None]
            if not parts:
                continue
            first = messages[group[0]]
            self.run.peers.add(first.peer)
            if len(parts) > 1:
                self.run.bundles.append((first.peer, sending, tuple(messages[p].tag for p in group)))
            if self.dry:
                continue
            if len(parts) == 1:
                requests.append(init(parts[0], first.peer, first.tag))
                continue
            datatype = bundle_type(cast(list[BufferSpec], parts))
            self.run.datatypes.append(datatype)
            requests.append(init([mpi().BOTTOM, 1, datatype], first.peer, first.tag))
        return requests

    def local_moves(self, step: LocalMoves, progress: list[Any] | None = None) -> None:
        """:func:`~linop.backends.host_schedule.run_local_moves` (a worker map's moves between
        two workers of this rank), prepared: copies, adds and clears between views.
        ``progress``: the requests of a phase in flight, tested after each move (MPICH moves
        a message above its eager size only inside MPI calls, so that a peer does not wait
        for these copies to end)."""
        for position, t in enumerate(step.transfers):
            if progress and position:  # between two moves (the wait follows the last)
                self.calls.append((self._testall, (progress,)))
            data = self.view(t.source)
            if t.mode == "new":
                array = self.buffer(data.shape)
                self.calls.append(copy_call(array, data))
                self.set(t.target.name, array)
            else:
                region = cast(Region, t.target)
                target = self.writable(region.name)[_index(region)]
                if t.mode == "add":
                    self.calls.append(add_call(target, data))
                else:
                    self.calls.append(copy_call(target, data))
            if t.after == "clear":
                if t.source.size:
                    self.calls.append(fill_call(self.writable(t.source.name)[_index(t.source)]))
            elif t.after == "drop":
                self.drop(t.source.name)

    def fast_path(self, step: RankStep) -> None:
        """A native collective bound out of place, into result buffers its binding builds (in
        place ones are bound in runs, :meth:`in_place_paths`)."""
        assert step.written() is None, "in-place collectives are bound by in_place_paths"
        binding = step.bind_out_of_place(dict(self.arrays), self.comm, self.dtype, dry=self.dry)
        if binding is None:
            raise _DeclinedError(type(step).__name__)
        reads = step.reads()
        requests = [call for call in binding.calls if not callable(call)]
        if reads is not None and requests and len(requests) == len(binding.calls):
            # persistent requests alone, reading no block a collective in flight fills: started
            # now, waited for with the next ones (their latencies overlap; when to wait is this
            # rank's own business: every rank starts the same requests in the same order)
            if not self._landing.isdisjoint(reads):
                self.settle()
            for request in requests:
                self.run.requests.append(request)
                self.calls.append((request.Start, ()))
                self._in_flight.append(request)
            self._landing.update(binding.results)
            self._adopt(binding)
            return
        self.settle()
        for call in binding.calls:
            if callable(call):  # a blocking collective call
                self.calls.append((call, ()))
            else:
                self.run.requests.append(call)
                self.calls.append((call.Start, ()))
                self.calls.append((call.Wait, ()))
        self._adopt(binding)

    def _adopt(self, binding: OutOfPlaceBinding) -> None:
        """The state after an out-of-place binding: its scratch kept, its inputs dropped, its
        results set."""
        self.run.scratch.extend(binding.scratch)
        self.run.requests.extend(binding.requests)
        for name in binding.dropped:
            self.drop(name)
        for name, array in binding.results.items():
            self.set(name, array, owned=bool(array.flags.writeable))

    def in_place_paths(self, steps: Sequence[RankStep]) -> None:
        """Consecutive native collectives bound in place, each writing blocks no other of them
        touches (:func:`_in_place_runs`): their persistent requests started in the global order
        of their groups, then waited for together, so that their latencies overlap (two small
        all-reduces, a layer's weight and bias gradients: measured 0.5-0.65 of one after the
        other on 4 ranks here); one after the other when one has local actions after its
        requests."""
        self.settle()
        prepared = []
        for step in steps:
            written = step.written()
            assert written is not None  # in-place steps only
            arrays = {name: self.writable(name) for name in written}
            found = step.persistent(arrays, self.comm, self.dtype, dry=self.dry)
            if found is None:
                raise _DeclinedError(type(step).__name__)
            prepared.append(found)
        if any(found.finish for found in prepared):
            for found in prepared:  # one at a time, in the global order
                for request in found.requests:
                    self.run.requests.append(request)
                    self.calls.append((request.Start, ()))
                    self.calls.append((request.Wait, ()))
                self.calls.extend((action, ()) for action in found.finish)
            return
        requests = [request for found in prepared for request in found.requests]
        self.run.requests.extend(requests)
        self.calls.extend((request.Start, ()) for request in requests)  # in the global order
        if requests:
            self.calls.append(self._wait_for(requests))

    def _wait_for(self, requests: list[Any]) -> PreparedCall:
        """The wait for persistent collectives started together: the request's own ``Wait``
        when there is one (a persistent ``Bcast_init`` waited for by ``Waitall`` of one took
        1.3x of the same with ``Wait``, CPU time too, 8 MB on 2 and 4 ranks here), else one
        ``Waitall``."""
        if len(requests) == 1:
            return (requests[0].Wait, ())
        return (self._waitall, (requests,))

    # -- the end of a run ---------------------------------------------------------------------
    def outputs(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        result = {}
        for name in names:
            if name not in self.arrays:
                raise _DeclinedError(f"no block {name!r} at the end")
            array = self.arrays[name]
            result[name] = array if name in self.owned else read_only(array)
        return result

    def write_back(self, callers: dict[str, np.ndarray]) -> None:
        """Each caller array gets its block's result (through a buffer when the result lies in
        another caller's array, which may be written before it is read)."""
        pending = []
        for name, target in callers.items():
            if name not in self.arrays:
                raise _DeclinedError(f"no block {name!r} at the end")
            result = self.arrays[name]
            if result is target:
                continue
            if any(np.may_share_memory(result, other) for other in callers.values()):
                copy = self.buffer(result.shape)
                self.calls.append(copy_call(copy, result))
                result = copy
            pending.append((target, result))
        self.calls.extend(copy_call(target, result) for target, result in pending)


_HANDLERS: dict[type, Callable[[_Compiler, Any], None]] = {
    RankPhase: _Compiler.phase,
    Allocate: _Compiler.allocate,
    Deallocate: _Compiler.deallocate,
    Copy: _Compiler.copy,
    CopyAdjoint: _Compiler.copy_adjoint,
    Move: _Compiler.move,
    Add: _Compiler.add,
    Clear: _Compiler.clear,
    Scale: _Compiler.scale,
    RankZero: _Compiler.zero,
    LocalMoves: _Compiler.local_moves,
}


def compile_schedule(
    schedule: Sequence[Any],
    arrays: dict[str, np.ndarray],
    comm: Intracomm,
    dtype: np.dtype,
    *,
    inplace: bool,
    range_names: Sequence[str],
    dry: bool = False,
    donate: bool = False,
    bundle: bool | AbstractSet[int] = False,
) -> CompiledRun | None:
    """Compile a rank's schedule for the fixed ``arrays`` (this rank's domain blocks, every one
    of the run's dtype), or None when it holds a step not compiled here (see the module
    docstring). ``dry``: only decide, create no MPI request (collective initializations are
    made by every member or none: the ranks agree on the dry outcome first). ``donate``: out of
    place, the arrays are the plan's to write (no copy before a block's first change; a result
    may be one of them), see :meth:`~linop.backends.mpi.plan.DistributedPlan.bind`.
    ``bundle``: the peers (True: every peer, for a dry run) a phase's messages to (from) move
    to (from) as bundles (:func:`bundle_peers` first: both ends of a pair must bundle alike)."""
    if not all(array.dtype == dtype for array in arrays.values()):
        return None
    compiler = _Compiler(arrays, comm, dtype, inplace=inplace, dry=dry, donate=donate, bundle=bundle)
    try:
        position = 0
        while position < len(schedule):
            step = schedule[position]
            following = schedule[position + 1] if position + 1 < len(schedule) else None
            if type(step) is RankPhase and type(following) is LocalMoves and _independent(step, following):
                compiler.settle()
                compiler.phase(step, during=following)  # a worker map's copies while messages fly
                position += 2
                continue
            run = _in_place_runs(schedule, position)
            if run:
                compiler.in_place_paths(run)
                position += len(run)
                continue
            compiler.step(step)
            position += 1
        if inplace:
            compiler.settle()
            compiler.write_back(arrays)
        else:
            compiler.settle()
            compiler.run.outputs = compiler.outputs(range_names)
    except _DeclinedError:
        compiler.run.free()  # the requests made before the declined step (point-to-point only)
        return None
    return compiler.run


def _in_place_runs(schedule: Sequence[Any], position: int) -> list[RankStep]:
    """The native collectives bound in place from ``position`` on, each writing blocks none of
    the earlier ones writes (an in-place collective reads only what it writes), or an empty
    list when the step there is not one."""
    run: list[RankStep] = []
    touched: set[str] = set()
    for step in schedule[position:]:
        written = step.written() if isinstance(step, RankStep) else None
        if written is None or not touched.isdisjoint(written):
            break
        run.append(step)
        touched.update(written)
    return run


def _independent(phase: RankPhase, moves: LocalMoves) -> bool:
    """Whether the local moves that follow a phase touch nothing its transfers touch (neither
    footprint conflicts with the other, :meth:`~linop.program.Footprint.conflicts`): they may
    then run while its messages are in flight, with the same result as after them."""
    messages = [t.footprint for _, _, t in (*phase.receives, *phase.sends)]
    for t in moves.transfers:
        local = t.footprint
        if any(local.conflicts(other) or other.conflicts(local) for other in messages):
            return False
    return True


def bundle_peers(comm: Intracomm, run: CompiledRun) -> frozenset[int]:
    """The peers this rank bundles its messages with: those that list the same bundles
    between them as this rank (:attr:`CompiledRun.bundles` of a dry run with bundles, whose
    :attr:`CompiledRun.peers` are the ranks it exchanges messages with). Collective over
    those peers only: one small message to and from each (its bundles with that peer), so
    binding costs O(the rank's own peers and bundles), whatever the size of the job.

    The ends derive their bundles from their own phases, which may group the transfers
    between them otherwise (:mod:`linop.program`: a rank's own batching may merge phases);
    each end compares the same two lists of bundles, written alike on both as
    ``(sending rank, receiving rank, tags)`` and sorted, so both decide alike whether the
    pair bundles; a pair that does not moves each message alone, other pairs are unaffected.
    Both ends of a message list each other among their peers (its transfer moves entries on
    both), so every message posted here is received.

    The messages carry tag :data:`~linop.program.TAG_LIMIT`, which no message of a schedule
    carries (their tags are counts modulo it), unless that is also the library's largest tag
    (the deadline's notices, :mod:`linop.backends.mpi.deadline`): then tag 0, as nothing of a
    schedule is in flight at binding (the check before it is collective)."""
    rank = comm.Get_rank()
    mine: dict[int, list[tuple[int, int, tuple[int, ...]]]] = {peer: [] for peer in run.peers}
    for peer, sending, tags in run.bundles:
        mine[peer].append((rank, peer, tags) if sending else (peer, rank, tags))
    if not mine:
        return frozenset()
    upper = comm.Get_attr(mpi().TAG_UB)
    tag = TAG_LIMIT if upper and int(upper) > TAG_LIMIT else 0  # else the notices' tag is TAG_LIMIT
    order = sorted(mine)
    for peer in order:
        mine[peer].sort()
    sent = [comm.isend(mine[peer], dest=peer, tag=tag) for peer in order]
    agreed = frozenset(peer for peer in order if comm.recv(source=peer, tag=tag) == mine[peer])
    mpi().Request.waitall(sent)
    return agreed
