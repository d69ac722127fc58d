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

A call repeated on the same plan (a bound plan, a training loop) does the collectives and the
copies and little else: what a step needs that depends on the step alone (a broadcast's groups,
this rank's copy and the root's rank in the sub-group; an all-reduce's sub-group ranks; the runs
of consecutive collectives; a phase's recipe per layout of its blocks) is prepared on its first
run and kept on the group's context (:func:`prepared_step`; the sub-groups themselves are
looked up per call, the context holding them weakly). On gloo a phase's messages are started
straight on the process group (:func:`_post`). A bound plan may run its collectives over the
whole group packed (:class:`PackedStep`, :func:`packed_schedule`: a layer's weight and bias
movements, sum-reduces or gradient all-reduces as one collective), when its ranks agreed at
binding that they pack alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final, NamedTuple

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
    for first, end in _runs_of(schedule, context):
        if first > done:
            walk(schedule[done:first])
        _broadcasts_together(schedule[first:end], work, context, dtype)
        done = end
    if done < len(schedule):
        walk(schedule[done:] if done else schedule)


def _runs_of(schedule: Sequence[Any], context: GroupContext) -> list[tuple[int, int]]:
    """:func:`_broadcast_runs` of a schedule (a tuple a plan keeps), found once per schedule."""
    if type(schedule) is not tuple:
        return _broadcast_runs(schedule)
    return prepared_step(schedule, context, _broadcast_runs)


def prepared_step(step: Any, context: GroupContext, prepare: Callable[..., Any]) -> Any:
    """What ``prepare(step)`` (or ``prepare(step, context)`` for the collective steps) gives,
    computed on the step's first run on ``context`` and kept there (by the step's id, the step
    kept with it so that the id is never another's): everything a run needs that depends on
    the step alone (block names, shapes, the ranks of its sub-groups, a root's rank in its
    sub-group), so that a call does the collectives and the copies and nothing else. The
    sub-groups themselves are looked up per call (the context holds them weakly)."""
    kept = context.prepared_steps
    found = kept.get(id(step))
    if found is None or found[0] is not step:
        made = prepare(step) if prepare is _broadcast_runs else prepare(step, context)
        if len(kept) >= PREPARED_KEPT:  # the oldest goes (plans the cache evicted, say)
            kept.pop(next(iter(kept)))
        found = kept[id(step)] = (step, made)
    return found[1]


PREPARED_KEPT = 4096
"""Steps a context keeps prepared (:func:`prepared_step`), the first prepared going first beyond
it: a step evicted is prepared again on its next run (the plans' own cache is bounded too)."""


class _Rooted(NamedTuple):
    """One group of a :class:`BroadcastStep` as this rank runs it: the root's block and its
    shape, the sorted ranks of the sub-group (None for a group of one rank), the root's rank in
    the sub-group, the copy this rank holds (None if none) and whether it is the root."""

    root_name: str
    shape: tuple[int, ...]
    key: tuple[int, ...] | None
    source: int
    mine: str | None
    is_root: bool


class _RootedStep(NamedTuple):
    """A :class:`BroadcastStep` prepared (:func:`prepared_step`): its groups and the blocks
    this rank's part reads (:func:`_reads`)."""

    groups: tuple[_Rooted, ...]
    reads: frozenset[str]


def _prepare_rooted(step: BroadcastStep, context: GroupContext) -> _RootedStep:
    """The groups of ``step`` as this rank runs them (collective where it first makes a
    sub-group: at the step's first run, in the order every rank follows)."""
    groups = []
    for group in step.groups:
        root = group.ranks[0]
        ranks = tuple(group.ranks)
        key = tuple(sorted(ranks)) if len(ranks) > 1 else None
        source = root if key is None else context.rank_in(context.subgroup_of(key), root)
        mine = [name for name, w in group.copies if w == step.rank]
        groups.append(
            _Rooted(
                group.root_name, tuple(group.shape), key, source, mine[0] if mine else None, root == step.rank
            )
        )
    return _RootedStep(tuple(groups), frozenset(_reads(step)))


def _prepare_all_reduce(
    step: AllReduceStep, context: GroupContext
) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The blocks of ``step`` and the sorted ranks of each one's sub-group."""
    return tuple((name, tuple(sorted(ranks))) for name, ranks in step.entries)


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
    steps: Sequence[BroadcastStep | AllReduceStep | PackedStep],
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
        if isinstance(step, AllReduceStep):
            reads: Any = (name for name, _ in step.entries)
        elif isinstance(step, PackedStep):
            reads = _packed_run(step, context, work).reads
        else:
            reads = prepared_step(step, context, _prepare_rooted).reads
        if in_flight and not landing.isdisjoint(reads):
            for request in in_flight:
                request.wait()
            in_flight.clear()
            landing.clear()
        if isinstance(step, PackedStep):
            landing.update(_run_packed(step, work, context, dtype, in_flight))
        elif isinstance(step, AllReduceStep):
            landing.update(_all_reduce(step, work, context, dtype, in_flight))
        else:
            landing.update(_broadcast(step, work, context, dtype, in_flight))
    for request in in_flight:
        request.wait()


@dataclass(frozen=True)
class PackedStep:
    """Consecutive broadcast, sum-reduce or all-reduce steps of one group each, over the whole
    group, of one kind and root (a layer's weight and bias movements or gradient sums), run as
    one collective of their blocks packed one after the other: ``kind`` is ``"broadcast"``,
    ``"reduce"`` or ``"all-reduce"``, ``root`` the root's rank (0 for an all-reduce). In the
    maths the same maps as the steps, side by side (each block's entries move and add as in its
    own collective). Made by :func:`packed_schedule` for a bound plan, whose ranks agreed on
    it at binding (:meth:`~linop.backends.torch_distributed.plan.BoundTorchPlan`)."""

    steps: tuple[BroadcastStep | AllReduceStep, ...]
    kind: str
    root: int


def _packable(step: Any, size: int) -> tuple[str, int] | None:
    """``(kind, root)`` of a step of one group over the whole group of ``size`` ranks, else None."""
    if type(step) is AllReduceStep:
        if len(step.entries) == 1 and len(step.entries[0][1]) == size:
            return "all-reduce", 0
        return None
    if type(step) is BroadcastStep and len(step.groups) == 1:
        group = step.groups[0]
        ranks = tuple(group.ranks)
        if len(ranks) == size and len(set(ranks)) == size:
            return ("reduce" if step.reduce else "broadcast"), ranks[0]
    return None


def packed_schedule(schedule: tuple[Any, ...], size: int) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """``schedule`` with each run of two or more consecutive steps :func:`_packable` alike (one
    kind, one root), none reading a block an earlier one of the run makes, replaced by one
    :class:`PackedStep`; and what the ranks must agree on before running it: the sequence of
    this rank's collectives over the whole group of one group each (kind, root, how many are
    packed together), equal on every rank exactly when they pack alike (every rank takes part
    in each of them, in the global order, so the i-th is the same node everywhere)."""
    out: list[Any] = []
    signature: list[Any] = []
    position = 0
    while position < len(schedule):
        step = schedule[position]
        found = _packable(step, size)
        end = position + 1
        if found is not None:
            made: set[str] = set(_landing(step))
            while end < len(schedule) and _packable(schedule[end], size) == found:
                following = schedule[end]
                if not made.isdisjoint(_reads(following)):
                    break
                made.update(_landing(following))
                end += 1
        if end - position >= 2:
            assert found is not None
            out.append(PackedStep(tuple(schedule[position:end]), *found))
        else:
            out.append(step)
        if found is not None:  # the i-th collective over the whole group is the same node everywhere
            signature.append((*found, end - position))
        position = end
    return tuple(out), tuple(signature)


def _landing(step: BroadcastStep | AllReduceStep) -> set[str]:
    """The blocks a step's collective fills on this rank."""
    if type(step) is AllReduceStep:
        return {name for name, _ in step.entries}
    assert isinstance(step, BroadcastStep)
    group = step.groups[0]
    if step.reduce:
        return {group.root_name}
    return {name for name, w in group.copies if w == step.rank}


def _run_packed(
    packed: PackedStep,
    work: numpy_backend.Workspace,
    context: GroupContext,
    dtype: np.dtype,
    in_flight: list[Any] | None = None,
) -> list[str]:
    """One collective for the packed steps (see :class:`PackedStep`), blocking or started
    (``in_flight``, as :func:`_broadcast`); the names of the blocks it fills. Every block goes
    into a buffer of the run (the caller's arrays are only read): a broadcast's root packs its
    blocks, the copies are views of the received buffer; a sum-reduce packs each rank's copies
    (zeros where it holds none), the root's blocks are views of the summed buffer; an
    all-reduce packs and sums the blocks, which become views of the buffer."""
    import torch.distributed as dist

    run = _packed_run(packed, context, work)
    buffer = np.empty(run.total, dtype)
    arrays = work.arrays
    views = []
    for read, _, shape, begin, end in run.pieces:
        view = buffer[begin:end].reshape(shape)
        views.append(view)
        if read is not None:
            view[...] = arrays[read]
        elif run.zeros:
            view[...] = 0
    if run.total:
        tensor = _tensor(buffer)
        started = in_flight is not None
        if packed.kind == "all-reduce":
            request = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=context.group, async_op=started)
        elif packed.kind == "broadcast":
            request = dist.broadcast(tensor, group=context.group, group_src=packed.root, async_op=started)
        else:
            request = dist.reduce(
                tensor, op=dist.ReduceOp.SUM, group=context.group, group_dst=packed.root, async_op=started
            )
        if in_flight is not None:
            in_flight.append(request)
    if packed.kind == "all-reduce":
        for (_, write, _, _, _), view in zip(run.pieces, views):
            assert write is not None  # an all-reduce's every piece is a block of this rank
            work.set(write, view)
        return run.filled
    for step, (_, write, _, _, _), view in zip(packed.steps, run.pieces, views):
        assert isinstance(step, BroadcastStep)
        store_results(work, step.dropped, [] if write is None else [(write, view, True)], step.created)
    return run.filled


class _PackedRun(NamedTuple):
    """A :class:`PackedStep` as this rank runs it (:func:`_prepare_packed_run`): per step, the
    block read into the buffer (None: none), the block its piece becomes (None: none), the
    piece's shape and its entries ``[begin, end)`` in the buffer; the buffer's size, whether
    pieces read from no block are zeros (a sum-reduce), the blocks the collective fills and the
    blocks its steps read on this rank."""

    pieces: tuple[tuple[str | None, str | None, tuple[int, ...], int, int], ...]
    total: int
    zeros: bool
    filled: list[str]
    reads: frozenset[str]


def _packed_run(packed: PackedStep, context: GroupContext, work: numpy_backend.Workspace) -> _PackedRun:
    """``packed`` as this rank runs it, prepared on its first run (:func:`prepared_step`): the
    one preparation of a packed step, whether its reads or its pieces are asked first."""
    return prepared_step(packed, context, lambda step, _: _prepare_packed_run(step, context, work))


def _prepare_packed_run(
    packed: PackedStep, context: GroupContext, work: numpy_backend.Workspace
) -> _PackedRun:
    """The pieces of ``packed`` on this rank (an all-reduce's shapes read from its blocks on the
    first run: the tree fixes them)."""
    rank = context.rank
    pieces: list[tuple[str | None, str | None, tuple[int, ...]]] = []  # (read, write, shape)
    if packed.kind == "all-reduce":
        for step in packed.steps:
            name = step.entries[0][0]  # type: ignore[union-attr]
            pieces.append((name, name, tuple(work.arrays[name].shape)))
    else:
        for step in packed.steps:
            group = step.groups[0]  # type: ignore[union-attr]
            mine = prepared_step(step, context, _prepare_rooted).groups[0].mine
            shape = tuple(group.shape)
            root = group.root_name if rank == packed.root else None
            if packed.kind == "broadcast":  # the root sends its blocks, every rank gets its copy
                pieces.append((root, mine, shape))
            else:  # every rank sends its copy (zeros where none), the root gets its blocks
                pieces.append((mine, root, shape))
    placed = []
    at = 0
    for read, write, shape in pieces:
        count = math.prod(shape)
        placed.append((read, write, shape, at, at + count))
        at += count
    filled = [write for _, write, _ in pieces if write is not None]
    reads = frozenset(name for inner in packed.steps for name in _reads(inner))
    return _PackedRun(tuple(placed), at, packed.kind == "reduce", filled, reads)


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
    messages, finish = _phase_messages(phase, work, context, dtype)
    operations = [
        dist.P2POp(dist.isend if sending else dist.irecv, tensor, group=group, tag=tag, group_peer=peer)
        for sending, tensor, peer, tag in messages
    ]
    return operations, finish


def _phase_messages(
    phase: RankPhase, work: numpy_backend.Workspace, context: GroupContext, dtype: np.dtype
) -> tuple[list[tuple[bool, Any, int, int]], list[tuple[Transfer, np.ndarray]]]:
    """:func:`phase_operations` as ``(is a send, tensor, group peer, tag)`` tuples."""
    recipe = _recipe(phase, work, context, dtype)
    messages: list[tuple[bool, Any, int, int]] = []
    finish: list[tuple[Transfer, np.ndarray]] = []
    arrays = work.arrays
    for message in recipe.receives:
        if message.route == BUFFER:
            buffer = np.empty(message.transfer.shape, dtype)
            finish.append((message.transfer, buffer))
        else:
            buffer = arrays[message.name][message.box]
        if buffer.size:  # a new block of size 0: no message
            messages.append((False, _tensor(buffer), message.peer, message.tag))
    for message in recipe.sends:
        data = arrays[message.name][message.box]
        if message.route == BUFFER:
            data = np.array(data, dtype=dtype, order="C")
        messages.append((True, _tensor(data), message.peer, message.tag))
    return messages, finish


def _phase_blocks(
    phase: RankPhase, context: GroupContext
) -> tuple[tuple[str, ...], tuple[str, ...], dict[Any, Any]]:
    """What :func:`_recipe` keeps per phase: the blocks its receives store or add into (in
    posting order), every block its messages name, and the recipes made so far by layout."""
    targets = tuple(t.target.name for _, _, t in phase.receives if t.mode != "new" and not phase.empty(t))
    names = dict.fromkeys((*targets, *(t.source.name for _, _, t in phase.sends if not phase.empty(t))))
    return targets, tuple(names), {}


def _recipe(phase: RankPhase, work: numpy_backend.Workspace, context: GroupContext, dtype: np.dtype) -> Any:
    """The phase's recipe (:func:`~linop.backends.host_phase.phase_recipe`) on ``work``, made once
    per layout of the blocks it names (shape, strides, dtype and whether writeable: all the
    recipe's routes depend on) and kept on the context: a repeated call (a bound plan, a
    training loop) only makes the receive targets writable, as the recipe would, and looks it
    up."""
    targets, names, recipes = prepared_step(phase, context, _phase_blocks)
    for name in targets:  # copy-on-write, as phase_recipe's target() does, in its order
        work.writable(name, dtype)
    arrays = work.arrays
    key = (
        dtype.str,
        *[(a.shape, a.strides, a.dtype.str, a.flags.writeable) for a in map(arrays.__getitem__, names)],
    )
    recipe = recipes.get(key)
    if recipe is None:
        recipe = phase_recipe(
            phase, dtype, lambda name: work.writable(name, dtype), arrays.__getitem__, contiguous_route
        )
        if len(recipes) < _RECIPES_KEPT:
            recipes[key] = recipe
    return recipe


_RECIPES_KEPT = 4
"""Recipes kept per phase (one per layout of its blocks; a bound plan has one)."""


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

    messages, finish = _phase_messages(phase, work, context, dtype)
    requests = _post(messages, context) if messages else []
    # the process group's own threads move the messages: progress() has nothing to do
    return Started(requests, lambda: finish_phase(phase, work, finish, dtype), wait=_wait_each)


def _post(messages: list[tuple[bool, Any, int, int]], context: GroupContext) -> list[Any]:
    """Start a phase's messages (:func:`_phase_messages`, receives first): on gloo straight on
    the process group, as ``batch_isend_irecv`` does there (gloo does not coalesce: it starts
    each ``isend`` / ``irecv`` in turn), without its per-operation checks, which the recipe's
    tensors pass (CPU tensors, peers ranks of the group); else ``batch_isend_irecv``."""
    import torch
    import torch.distributed as dist

    group = context.group
    if context.backend != "gloo":
        return list(
            dist.batch_isend_irecv(
                [
                    dist.P2POp(
                        dist.isend if sending else dist.irecv, tensor, group=group, tag=tag, group_peer=peer
                    )
                    for sending, tensor, peer, tag in messages
                ]
            )
        )
    send, receive = group.send, group.recv
    requests = []
    for sending, tensor, peer, tag in messages:
        if tensor.is_complex():  # as isend and irecv send complex data
            tensor = torch.view_as_real(tensor)
        requests.append((send if sending else receive)([tensor], peer, tag))
    return requests


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

    entries = prepared_step(step, context, _prepare_all_reduce)
    for name, key in entries:
        array = _owned_contiguous(work, name, dtype)
        request = dist.all_reduce(
            _tensor(array),
            op=dist.ReduceOp.SUM,
            group=context.subgroup_of(key),
            async_op=in_flight is not None,
        )
        if in_flight is not None:
            in_flight.append(request)
    return [name for name, _ in entries]


_TOGETHER = (BroadcastStep, AllReduceStep, PackedStep)


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
    for root_name, shape, key, source, mine, is_root in prepared_step(step, context, _prepare_rooted).groups:
        if not step.reduce:
            if is_root:
                buffer, owned = root_buffer(work, root_name, dtype)
                if mine is not None:
                    results.append((mine, buffer, owned))
            else:
                assert mine is not None  # a rank of the group that is not its root holds a copy
                buffer = np.empty(shape, dtype)
                results.append((mine, buffer, True))
            if key is not None and buffer.size:
                request = dist.broadcast(
                    _tensor(buffer), group=context.subgroup_of(key), group_src=source, async_op=started
                )
                if in_flight is not None:
                    in_flight.append(request)
            continue
        if mine is not None:  # reduce works in place: never on the caller's array
            total = np.array(work.arrays[mine], dtype=dtype, order="C")
        else:  # the root holds no copy: it contributes zeros
            total = np.zeros(shape, dtype)
        if key is not None and total.size:
            request = dist.reduce(
                _tensor(total),
                op=dist.ReduceOp.SUM,
                group=context.subgroup_of(key),
                group_dst=source,
                async_op=started,
            )
            if in_flight is not None:
                in_flight.append(request)
        if is_root:
            results.append((root_name, total, True))
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
            PackedStep: _run_packed,
            BroadcastStep: _broadcast,
            AllToAllStep: _all_to_all,
            GatherStep: _gather,
            ReduceScatterStep: _reduce_scatter,
        }
    )
)
"""Torch step (a row of :data:`~linop.backends.torch_distributed.schedule.CALLS`) -> how the host
path runs it on numpy views of the blocks."""
