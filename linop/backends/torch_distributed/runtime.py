"""Run one rank's schedule on a process group (host memory): :func:`run_schedule`.

The workspace is the numpy interpreter's (:class:`~linop.backends.numpy.Workspace`)
over numpy views of the caller's CPU tensors (no copy), so local steps run the numpy
interpreter's handlers and the algebra steps (scale, zero, sums) its functions, as in the MPI
runtime (:mod:`linop.backends.mpi.runtime`). Messages travel as tensors sharing the arrays'
memory (``torch.from_numpy``):

- :class:`~linop.program.RankPhase`: every receive and send of the phase in one
  ``torch.distributed.batch_isend_irecv`` (tags from the program), one wait, then the adds,
  stores and clears that needed a buffer. A receive lands straight in the target box when it
  is contiguous; a send goes straight from the source box when it is;
- :class:`~linop.backends.torch_distributed.schedule.AllReduceStep`: ``all_reduce`` in place
  on the block; :class:`~linop.backends.torch_distributed.schedule.BroadcastStep`:
  ``broadcast`` from the root's block, or ``reduce`` into a new root block, on the cached
  sub-group of its ranks (consecutive ones, a layer's weight and bias movements, started
  together with ``async_op`` and waited for at the end of the run, or before a step that
  reads a block one of them fills); :class:`~linop.backends.torch_distributed.schedule.AllToAllStep`:
  one ``all_to_all_single`` over the group (:class:`AllToAll`: the boxes packed in peer order,
  or sent from and received into the blocks' own memory where the boxes lie one after the
  other there); :class:`~linop.backends.torch_distributed.schedule.GatherStep`: one
  ``all_gather_into_tensor`` or ``reduce_scatter_tensor`` on the cached sub-group of the line
  (straight into the gathered block when its shares lead and the line is in rank order), or,
  on small gloo groups, where it is faster, the node's point-to-point phases;
  :class:`~linop.backends.torch_distributed.schedule.ReduceScatterStep`: one ``reduce_scatter``
  of the gathered block's uneven shares on the line's sub-group (the same rule for small gloo
  groups).

Every message travels in the run's dtype, agreed by every rank in the entry check.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Final

import numpy as np

from ...program import RankPhase, Transfer
from .. import numpy as numpy_backend
from ..host_phase import BUFFER, contiguous_route, phase_recipe
from ..host_schedule import (
    Started,
    finish_phase,
    root_buffer,
    run_on_engine,
    shares_by_member,
    store_results,
    uneven_shares_by_member,
)
from .group import GroupContext
from .schedule import AllReduceStep, AllToAllStep, BroadcastStep, GatherStep, ReduceScatterStep

__all__ = ["RUNS", "run_schedule", "run_phase", "phase_operations", "AllToAll"]


def _tensor(array: np.ndarray) -> Any:
    import torch

    return torch.from_numpy(array)


def run_schedule(
    schedule: Sequence[Any], work: numpy_backend.Workspace, context: GroupContext, dtype: np.dtype
) -> None:
    """Run a rank's schedule on ``work`` (:func:`~linop.backends.host_schedule.run_rank_schedule`:
    phases by :func:`run_phase`, the native collectives here); collective with the other ranks'
    schedules."""

    def walk(steps: Sequence[Any]) -> None:
        run_on_engine(steps, work, dtype, context, start=start_phase, part=_run_part)

    done = 0
    for first, end in _broadcast_runs(schedule):
        if first > done:
            walk(schedule[done:first])
        _broadcasts_together(schedule[first:end], work, context, dtype)
        done = end
    if done < len(schedule):
        walk(schedule[done:] if done else schedule)


def _broadcast_runs(schedule: Sequence[Any]) -> list[tuple[int, int]]:
    """The ``(first, end)`` positions of the runs of two or more consecutive broadcast,
    sum-reduce or all-reduce steps (a layer's weight and bias movements or gradient sums)."""
    runs = []
    position = 0
    while position < len(schedule):
        end = position
        while end < len(schedule) and type(schedule[end]) in _TOGETHER:
            end += 1
        if end - position >= 2:
            runs.append((position, end))
        position = max(end, position + 1)
    return runs


def _broadcasts_together(
    steps: Sequence[BroadcastStep | AllReduceStep],
    work: numpy_backend.Workspace,
    context: GroupContext,
    dtype: np.dtype,
) -> None:
    """Consecutive broadcast / sum-reduce / all-reduce steps with their collectives in flight together:
    each started (``async_op``) in the global order, the waits at the end (their latencies
    overlap), or before a step that reads a block an earlier one is still filling. A rank may
    wait for a collective later than another rank does: the same collectives in the same
    order on every rank, so they match alike."""
    in_flight: list[Any] = []
    landing: set[str] = set()
    for step in steps:
        if in_flight and not landing.isdisjoint(_reads(step)):
            for request in in_flight:
                request.wait()
            in_flight.clear()
            landing.clear()
        if isinstance(step, AllReduceStep):
            landing.update(_all_reduce(step, work, context, dtype, in_flight))
        else:
            landing.update(_broadcast(step, work, context, dtype, in_flight))
    for request in in_flight:
        request.wait()


def _reads(step: BroadcastStep | AllReduceStep) -> set[str]:
    """The blocks this rank's part of a broadcast (the roots it holds), sum-reduce (its
    copies) or all-reduce (its blocks, summed in place) reads."""
    if type(step) is AllReduceStep:
        return {name for name, _ in step.entries}
    assert isinstance(step, BroadcastStep)
    if step.reduce:
        return {name for group in step.groups for name, w in group.copies if w == step.rank}
    return {group.root_name for group in step.groups if group.ranks[0] == step.rank}


def phase_operations(
    phase: RankPhase, work: numpy_backend.Workspace, context: GroupContext, dtype: np.dtype
) -> tuple[list[Any], list[tuple[Transfer, np.ndarray]]]:
    """The point-to-point operations of a phase (receives first) and the receive buffers to
    finish afterwards (``(transfer, buffer)``: new blocks, adds, stores into boxes that are not
    contiguous or not in the run's dtype): the host kit's recipe
    (:func:`~linop.backends.host_phase.phase_recipe`) under torch's rule, a box moves straight
    when it is one contiguous, writeable run (:func:`~linop.backends.host_phase.contiguous_route`)."""
    import torch.distributed as dist

    group = context.group
    recipe = phase_recipe(
        phase, dtype, lambda name: work.writable(name, dtype), work.arrays.__getitem__, contiguous_route
    )
    operations: list[Any] = []
    finish: list[tuple[Transfer, np.ndarray]] = []
    for message in recipe.receives:
        if message.route == BUFFER:
            buffer = np.empty(message.transfer.shape, dtype)
            finish.append((message.transfer, buffer))
        else:
            buffer = work.arrays[message.name][message.box]
        if buffer.size:  # a new block of size 0: no message
            operations.append(
                dist.P2POp(dist.irecv, _tensor(buffer), group=group, tag=message.tag, group_peer=message.peer)
            )
    for message in recipe.sends:
        data = work.arrays[message.name][message.box]
        if message.route == BUFFER:
            data = np.array(data, dtype=dtype, order="C")
        operations.append(
            dist.P2POp(dist.isend, _tensor(data), group=group, tag=message.tag, group_peer=message.peer)
        )
    return operations, finish


def run_phase(
    phase: RankPhase, work: numpy_backend.Workspace, context: GroupContext, dtype: np.dtype
) -> None:
    """One ``batch_isend_irecv`` of the phase's receives and sends, one wait, then the finish."""
    start_phase(phase, work, context, dtype)()


def start_phase(
    phase: RankPhase, work: numpy_backend.Workspace, context: GroupContext, dtype: np.dtype
) -> Started:
    """Start the phase's receives and sends (one ``batch_isend_irecv``) and return it started:
    calling it waits, then finishes; a :class:`~linop.program.RankOverlap`'s local work runs
    in between."""
    import torch.distributed as dist

    operations, finish = phase_operations(phase, work, context, dtype)
    requests = dist.batch_isend_irecv(operations) if operations else []
    # the process group's own threads move the messages: progress() has nothing to do
    return Started(requests, lambda: finish_phase(phase, work, finish, dtype), wait=_wait_each)


def _wait_each(requests: list[Any]) -> None:
    for request in requests:
        request.wait()


def _run_part(step: Any, work: numpy_backend.Workspace, context: GroupContext, dtype: np.dtype) -> None:
    run = RUNS.get(type(step))
    if run is None:  # pragma: no cover - the schedules hold nothing else
        raise TypeError(f"the torch.distributed runtime cannot run the step {step!r}")
    run(step, work, context, dtype)


def _owned_contiguous(work: numpy_backend.Workspace, name: str, dtype: np.dtype) -> np.ndarray:
    array = work.writable(name, dtype)
    if not array.flags.c_contiguous or array.dtype != dtype:
        array = np.ascontiguousarray(array, dtype=dtype)
        work.set(name, array)
    return array


def _all_reduce(
    step: AllReduceStep,
    work: numpy_backend.Workspace,
    context: GroupContext,
    dtype: np.dtype,
    in_flight: list[Any] | None = None,
) -> list[str]:
    """Sum each block in place (in the global order of the groups), blocking, or with
    ``in_flight`` started only (as :func:`_broadcast`); the names of the blocks it sums."""
    import torch.distributed as dist

    for name, ranks in step.entries:
        array = _owned_contiguous(work, name, dtype)
        request = dist.all_reduce(
            _tensor(array),
            op=dist.ReduceOp.SUM,
            group=context.subgroup(ranks),
            async_op=in_flight is not None,
        )
        if in_flight is not None:
            in_flight.append(request)
    return [name for name, _ in step.entries]


_TOGETHER = (BroadcastStep, AllReduceStep)


def _broadcast(
    step: BroadcastStep,
    work: numpy_backend.Workspace,
    context: GroupContext,
    dtype: np.dtype,
    in_flight: list[Any] | None = None,
) -> list[str]:
    """Run the step (its collectives in the global order of its groups), blocking, or with
    ``in_flight`` started only (their works appended: the results are filled once waited for);
    the names of the blocks it stores."""
    import torch.distributed as dist

    started = in_flight is not None
    results: list[tuple[str, np.ndarray, bool]] = []
    for group in step.groups:
        root = group.ranks[0]
        sub = context.subgroup(group.ranks) if len(group.ranks) > 1 else None
        mine = [name for name, w in group.copies if w == step.rank]
        is_root = root == step.rank
        if not step.reduce:
            if is_root:
                buffer, owned = root_buffer(work, group.root_name, dtype)
                if mine:
                    results.append((mine[0], buffer, owned))
            else:
                buffer = np.empty(group.shape, dtype)
                results.append((mine[0], buffer, True))
            if sub is not None and buffer.size:
                request = dist.broadcast(
                    _tensor(buffer), group=sub, group_src=context.rank_in(sub, root), async_op=started
                )
                if in_flight is not None:
                    in_flight.append(request)
            continue
        if mine:  # reduce works in place: never on the caller's array
            total = np.array(work.arrays[mine[0]], dtype=dtype, order="C")
        else:  # the root holds no copy: it contributes zeros
            total = np.zeros(group.shape, dtype)
        if sub is not None and total.size:
            request = dist.reduce(
                _tensor(total),
                op=dist.ReduceOp.SUM,
                group=sub,
                group_dst=context.rank_in(sub, root),
                async_op=started,
            )
            if in_flight is not None:
                in_flight.append(request)
        if is_root:
            results.append((group.root_name, total, True))
    store_results(work, step.dropped, results, step.created)
    return [name for name, _, _ in results]


def _gather(step: GatherStep, work: numpy_backend.Workspace, context: GroupContext, dtype: np.dtype) -> None:
    """One ``all_gather_into_tensor`` (``step.reduce`` False) or ``reduce_scatter_tensor``
    (True) on the line's sub-group, or the node's point-to-point program where that is faster
    (:attr:`GroupContext.native_gathers`); a line of one member copies."""
    import torch.distributed as dist

    if 1 < len(step.members) and not context.native_gathers:
        run_schedule(step.fallback.schedule(), work, context, dtype)
        return
    if step.source is None or step.target is None:
        return
    send = work.arrays[step.source]
    if send.dtype != dtype or not send.flags.c_contiguous or not send.flags.writeable:
        send = np.array(send, dtype=dtype, order="C")
    receive = np.empty(step.target.shape, dtype)
    count = len(step.members)
    if count == 1:
        np.copyto(receive, send)
    elif receive.size:
        sub = context.subgroup(step.members)
        if step.reduce:  # the gathered block as [member, share], in the sub-group's rank order
            lined = shares_by_member(send, step.axis, count)
            if not step.in_order:
                ordered = np.empty_like(lined)
                ordered[list(step.positions)] = lined
                lined = ordered
            dist.reduce_scatter_tensor(
                _tensor(receive.reshape(-1)), _tensor(lined.reshape(-1)), op=dist.ReduceOp.SUM, group=sub
            )
        else:
            direct = step.in_order and math.prod(receive.shape[: step.axis]) == 1  # shares lead
            gathered = receive if direct else np.empty((count, *send.shape), dtype)
            dist.all_gather_into_tensor(_tensor(gathered.reshape(-1)), _tensor(send.reshape(-1)), group=sub)
            if not direct:
                lined = gathered if step.in_order else gathered[list(step.positions)]
                shares_by_member(receive, step.axis, count, out=lined)
    work.drop(step.source)
    work.set(step.target.name, receive)


def _reduce_scatter(
    step: ReduceScatterStep, work: numpy_backend.Workspace, context: GroupContext, dtype: np.dtype
) -> None:
    """One ``reduce_scatter`` of the gathered block's uneven shares (views of it, listed in the
    sub-group's rank order) into the rank's block, on the line's sub-group; or the node's
    point-to-point program where that is faster (:attr:`GroupContext.native_gathers`)."""
    import torch.distributed as dist

    if step.source is None or step.target is None:  # outside the layout: no step of the node
        return
    if not context.native_gathers:
        run_schedule(step.fallback.schedule(), work, context, dtype)
        return
    gathered = work.arrays[step.source]
    writeable = gathered.dtype == dtype and gathered.flags.writeable  # torch.from_numpy wants it so
    lined, counts = uneven_shares_by_member(
        gathered if writeable else gathered.astype(dtype), step.axis, step.shares
    )
    listed: list[Any] = [None] * len(counts)
    for k, share in enumerate(np.split(lined, np.cumsum(counts)[:-1])):
        listed[step.positions[k]] = _tensor(share)  # the sub-group's rank order
    total = np.empty(step.target.shape, dtype)
    if lined.size:  # the gathered block's shape is the same on every member of the line
        dist.reduce_scatter(
            _tensor(total.reshape(-1)), listed, op=dist.ReduceOp.SUM, group=context.subgroup(step.members)
        )
    work.drop(step.source)
    work.set(step.target.name, total)


def _consecutive(array: np.ndarray, boxes: list[tuple[int, np.ndarray]]) -> int | None:
    """The offset (in entries) in ``array``'s memory where the ``boxes`` (non-empty views of
    it, in peer order) begin, when they lie there one after the other; else None."""
    if not array.flags.c_contiguous:
        return None
    base = array.__array_interface__["data"][0]
    first: int | None = None
    expected = 0
    for _, view in boxes:
        if not view.flags.c_contiguous:
            return None
        offset = (view.__array_interface__["data"][0] - base) // array.itemsize
        if first is None:
            first = expected = offset
        if offset != expected:
            return None
        expected += view.size
    return 0 if first is None else first


class AllToAll:
    """One :class:`~linop.backends.torch_distributed.schedule.AllToAllStep` prepared on fixed
    arrays: ``source`` (the rank's old block, C-contiguous in the run's dtype, or None) and
    ``target`` (its new block, or None). :meth:`run` packs the boxes that need it, makes one
    ``all_to_all_single`` over the group, and unpacks; a bound plan keeps the object and runs
    it on every call (the buffers made once), an unbound run makes one per call, its packing
    buffers reused from the group's (``scratch=True``, :meth:`GroupContext.scratch`).

    Boxes that lie one after the other in the block's memory (the rows of a row-sharded block)
    are sent from it, or received into it, with no copy."""

    def __init__(
        self,
        step: AllToAllStep,
        source: np.ndarray | None,
        target: np.ndarray | None,
        dtype: np.dtype,
        context: GroupContext,
        *,
        scratch: bool = False,
    ) -> None:
        size = context.size
        self.wait_on = context
        self.context = context if scratch else None
        self.group = context.group
        self.packs: list[tuple[np.ndarray, np.ndarray]] = []  # (buffer piece, box) before
        self.unpacks: list[tuple[np.ndarray, np.ndarray]] = []  # (box, buffer piece) after
        self.send_splits = [0] * size
        self.receive_splits = [0] * size
        sends = [] if source is None else self._boxes(source, step.sends, self.send_splits)
        receives = [] if target is None else self._boxes(target, step.receives, self.receive_splits)
        self.send = self._buffer(source, sends, dtype, self.packs, outgoing=True)
        self.receive = self._buffer(target, receives, dtype, self.unpacks, outgoing=False)

    @staticmethod
    def _boxes(array: np.ndarray, boxes: tuple[Any, ...], splits: list[int]) -> list[tuple[int, np.ndarray]]:
        found = []
        for peer, start, shape in sorted(boxes, key=lambda box: box[0]):
            view = array[tuple(slice(a, a + n) for a, n in zip(start, shape))]
            if view.size:
                splits[peer] = view.size
                found.append((peer, view))
        return found

    def _buffer(
        self,
        array: np.ndarray | None,
        boxes: list[tuple[int, np.ndarray]],
        dtype: np.dtype,
        copies: list[tuple[np.ndarray, np.ndarray]],
        *,
        outgoing: bool,
    ) -> Any:
        total = sum(view.size for _, view in boxes)
        offset = None
        if array is not None and (array.flags.writeable or not outgoing):
            offset = _consecutive(array, boxes)
        if array is not None and offset is not None:
            return _tensor(array.reshape(-1)[offset : offset + total])
        if self.context is not None:  # an unbound run: the group's packing buffer, reused
            flat = self.context.scratch("send" if outgoing else "receive", total, dtype)
        else:
            flat = np.empty(total, dtype)
        at = 0
        for _, view in boxes:
            piece = flat[at : at + view.size].reshape(view.shape)
            copies.append((piece, view) if outgoing else (view, piece))
            at += view.size
        return _tensor(flat)

    def run(self, timeout: float | None = None, doing: str = "the first call of a bound plan") -> None:
        """Pack, exchange, unpack; collective over the group. ``timeout`` (seconds, a bound
        plan's first call or every one, ``doing``) bounds the wait
        (:class:`~linop.errors.PeerTimeoutError`)."""
        import torch.distributed as dist

        for into, source in self.packs:
            np.copyto(into, source)
        if timeout is None:
            dist.all_to_all_single(
                self.receive, self.send, self.receive_splits, self.send_splits, group=self.group
            )
        else:
            work = dist.all_to_all_single(
                self.receive,
                self.send,
                self.receive_splits,
                self.send_splits,
                group=self.group,
                async_op=True,
            )
            self.wait_on.wait(work, timeout, doing)
        for into, source in self.unpacks:
            np.copyto(into, source)


def new_target(step: AllToAllStep, dtype: np.dtype) -> np.ndarray | None:
    """The array of the step's new block (zeros where no box arrives), or None."""
    if step.target is None:
        return None
    make = np.empty if step.covered else np.zeros
    return make(step.target.shape, dtype)


def _all_to_all(
    step: AllToAllStep, work: numpy_backend.Workspace, context: GroupContext, dtype: np.dtype
) -> None:
    source = None
    if step.source is not None:
        source = work.arrays[step.source]
        if source.dtype != dtype or not source.flags.c_contiguous:
            source = np.ascontiguousarray(source, dtype=dtype)
    target = new_target(step, dtype)
    AllToAll(step, source, target, dtype, context, scratch=True).run()
    if step.source is not None:
        work.drop(step.source)
    if step.target is not None:
        assert target is not None
        work.set(step.target.name, target)


RUNS: Final[Mapping[type, Callable[..., object]]] = (  # (step, work, context, dtype); some return names
    MappingProxyType(
        {
            AllReduceStep: _all_reduce,
            BroadcastStep: _broadcast,
            AllToAllStep: _all_to_all,
            GatherStep: _gather,
            ReduceScatterStep: _reduce_scatter,
        }
    )
)
"""Torch step (a row of :data:`~linop.backends.torch_distributed.schedule.CALLS`) -> how the host
path runs it on numpy views of the blocks."""
