"""The device path of the torch.distributed executor: run a rank's schedule on tensors where
they live (CUDA tensors with NCCL: no staging through host memory).

The host path (:mod:`~linop.backends.torch_distributed.runtime`) runs the numpy
interpreter's handlers on numpy views of CPU tensors; numpy cannot read device memory, so here
the same schedule runs with torch operations on a :class:`DeviceWorkspace` of tensors, with
the numpy workspace's copy-on-write semantics:

- local steps: the primitives and movement nodes (``Allocate``, ``Deallocate``, ``Clear``,
  ``Add``, ``Copy``, ``CopyAdjoint``, ``Move``) as torch indexing on the device, registered in
  the dispatch registry as the interpreter ``"torch-device"``; any other node runs through its
  expansion into those (a node with only a numpy kernel, such as a layer's local product,
  has none: :class:`~linop.errors.UnsupportedNodeError`);
- the algebra (scale, zero, sums) as torch arithmetic; phases as one ``batch_isend_irecv`` of
  device tensors; all-reduces, broadcasts and sum-reduces as ``all_reduce``, ``broadcast`` and
  ``reduce`` of device tensors.

The entry check reads only shapes, dtypes and the largest integer magnitude, which it takes
from the device tensors (:func:`check_stand_ins`), so it is the same check as on the host.

This path runs whenever the group's backend is NCCL or the blocks are not CPU tensors (blocks
of the unsigned dtypes torch has little arithmetic for, :data:`HOST_ONLY`, take the host path,
staged). It is
tested on the CPU with gloo (``LINOP_TORCH_DEVICE_PATH=1`` forces it for CPU tensors, the
launch of ``tests/test_torch_distributed.py`` runs the checks so); on a GPU with NCCL its test
is skipped where no GPU is present.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Final

import numpy as np

from ... import dispatch
from ...movement import Copy, CopyAdjoint, Move
from ...operator import LinearOperator
from ...primitives import Add, Allocate, Clear, Deallocate
from ...program import LocalMoves, RankBranches, RankPhase, RankZero, Scale
from ...space import Block, Region
from ..host_moves import add_back, relabel
from ..host_schedule import finish_phase, run_local_moves
from ..host_workspace import OwnedBlocks
from .group import GroupContext
from .schedule import AllReduceStep, AllToAllStep, BroadcastStep, GatherStep, ReduceScatterStep

__all__ = [
    "DeviceWorkspace",
    "DEVICE_RUNS",
    "FORCE_VARIABLE",
    "use_device_path",
    "check_stand_ins",
    "run_device_schedule",
]

FORCE_VARIABLE = "LINOP_TORCH_DEVICE_PATH"
"""Set to ``1`` to run CPU tensors through the device path too (for testing it without a GPU)."""

INTERPRETER = "torch-device"


def _host_only() -> frozenset[Any]:
    import torch

    return frozenset(getattr(torch, name) for name in ("uint16", "uint32", "uint64") if hasattr(torch, name))


HOST_ONLY = _host_only()
"""Dtypes that run on the host path even for device tensors (staged through host memory):
torch lacks arithmetic for them on most devices."""


def torch_dtype(dtype: np.dtype) -> Any:
    """numpy's dtype as torch's."""
    import torch

    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


def numpy_dtype(dtype: Any) -> np.dtype:
    """torch's dtype as numpy's."""
    import torch

    return torch.empty(0, dtype=dtype).numpy().dtype


def use_device_path(state: Any, context: GroupContext) -> bool:
    """Whether a call runs on the device path: an NCCL group, a block that is a tensor off the
    CPU, or :data:`FORCE_VARIABLE` set with torch tensors."""
    import torch

    if context.device.type != "cpu":
        return True
    if not isinstance(state, Mapping):
        return False
    tensors = [v for v in state.values() if isinstance(v, torch.Tensor)]
    if any(t.dtype in HOST_ONLY for t in tensors):  # torch has little arithmetic for them
        return False
    if any(t.device.type != "cpu" for t in tensors):
        return True
    return bool(tensors) and os.environ.get(FORCE_VARIABLE) == "1"


def check_stand_ins(state: Mapping[str, Any]) -> dict[str, Any]:
    """For the entry check: each tensor as a numpy array of its shape and dtype whose entries
    all equal the tensor's largest magnitude (one host entry, zero strides; blocks whose
    tensors share memory share their stand-in's memory too). Anything else as it is."""
    import torch

    out: dict[str, Any] = {}
    seen: dict[tuple[int, int], np.ndarray] = {}
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            out[name] = value
            continue
        try:
            dtype = numpy_dtype(value.dtype)
        except (TypeError, RuntimeError):
            out[name] = value  # the check names the block and its type
            continue
        largest = 0
        if value.numel() and dtype.kind in "iu":  # int64 on the device: abs of every integer dtype
            largest = int(value.detach().to(torch.int64).abs().max().item())
        storage = (value.untyped_storage().data_ptr(), value.device.index or 0)
        host = seen.get(storage)
        if host is None or host.dtype != dtype:
            host = seen[storage] = np.array([largest], dtype=dtype)
        else:
            host[0] = max(host[0], largest)
        stand_in = np.lib.stride_tricks.as_strided(host, value.shape, (0,) * value.dim()).view(StandIn)
        stand_in.overlapping = _overlaps_itself(value)
        out[name] = stand_in
    return out


class StandIn(np.ndarray):
    """A tensor's stand-in for the entry check: zero strides over one host entry, and whether
    the tensor's own entries overlap in memory (``overlapping``: an in-place call refuses it)."""

    overlapping: bool = False


def _overlaps_itself(tensor: Any) -> bool:
    """Whether two entries of ``tensor`` share memory, decided from its strides alone (as
    :func:`~linop.backends.numpy.overlaps_itself` decides for an array)."""
    from ..numpy import overlaps_itself

    itemsize = tensor.element_size()
    strides = tuple(s * itemsize for s in tensor.stride())
    # an array with the tensor's layout over a one-entry buffer: only its strides are read
    buffer = np.zeros(1, dtype=np.dtype((np.void, itemsize)))
    layout = np.lib.stride_tricks.as_strided(buffer, tensor.shape, strides)
    return bool(tensor.numel() > 1 and overlaps_itself(layout))


class DeviceWorkspace(OwnedBlocks[Any]):
    """The interpreter's working state on a device: tensors by block name, and which of them it
    owns (a tensor it does not own belongs to the caller and is copied before its first change).

    ``dtype`` is the torch dtype of new blocks; ``device`` where they are made."""

    __slots__ = ("device", "dtype")

    def __init__(self, arrays: dict[str, Any], owned: set[str], dtype: Any, device: Any) -> None:
        super().__init__(arrays, owned)
        self.dtype = dtype
        self.device = device

    def writable(self, name: str, dtype: Any = None) -> Any:
        import torch

        tensor = self.arrays[name]
        target = tensor.dtype if dtype is None else torch.promote_types(tensor.dtype, dtype)
        if name not in self.owned or target != tensor.dtype:
            tensor = tensor.to(dtype=target, copy=True)
            self.arrays[name] = tensor
            self.owned.add(name)
        return tensor

    def zeros(self, shape: tuple[int, ...]) -> Any:
        import torch

        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def borrowed(self) -> DeviceWorkspace:
        return DeviceWorkspace(dict(self.arrays), set(), self.dtype, self.device)


def _new_block(data: Any, dtype: Any) -> Any:
    """A new block: ``data`` copied in the run's dtype (where it is)."""
    return data.to(dtype=dtype, copy=True)


def _index(region: Region) -> tuple[Any, ...]:
    return (*region.index, Ellipsis)


def _widened(tensor: Any, dtype: Any) -> Any:
    import torch

    target = torch.promote_types(dtype, tensor.dtype)
    return tensor.to(target) if target != tensor.dtype else None


# -- local steps on the device (registered for the dispatch interpreter "torch-device") -----
@dispatch.register(INTERPRETER, Allocate)
def _allocate(op: Allocate, work: DeviceWorkspace) -> None:
    work.set(op.block.name, work.zeros(op.block.shape))


@dispatch.register(INTERPRETER, Deallocate)
def _deallocate(op: Deallocate, work: DeviceWorkspace) -> None:
    work.drop(op.name)


@dispatch.register(INTERPRETER, Clear)
def _clear(op: Clear, work: DeviceWorkspace) -> None:
    if op.region.size:
        work.writable(op.region.name)[_index(op.region)] = 0


@dispatch.register(INTERPRETER, Add)
def _add(op: Add, work: DeviceWorkspace) -> None:
    source = work.arrays[op.src.name][_index(op.src)]
    work.writable(op.dst.name, source.dtype)[_index(op.dst)] += source


@dispatch.register(INTERPRETER, Copy)
def _copy(op: Copy, work: DeviceWorkspace) -> None:
    import torch

    source = work.arrays[op.src.name][_index(op.src)]
    if isinstance(op.dst, Block):
        work.set(op.dst.name, source.to(dtype=torch.promote_types(work.dtype, source.dtype), copy=True))
    else:
        work.writable(op.dst.name, source.dtype)[_index(op.dst)] = source


@dispatch.register(INTERPRETER, CopyAdjoint)
def _copy_adjoint(op: CopyAdjoint, work: DeviceWorkspace) -> None:
    add_back(op, work, _index)


@dispatch.register(INTERPRETER, Move)
def _move(op: Move, work: DeviceWorkspace) -> None:
    if isinstance(op.dst, Block):
        relabel(work, op.src.name, op.dst.name, lambda block: _widened(block, work.dtype))
        return
    source = work.arrays[op.src.name][_index(op.src)].clone()
    work.writable(op.dst.name, source.dtype)[_index(op.dst)] = source
    if op.src.size:
        work.writable(op.src.name)[_index(op.src)] = 0


# -- the schedule --------------------------------------------------------------------------------
def run_device_schedule(
    schedule: Sequence[Any], work: DeviceWorkspace, context: GroupContext, dtype: Any
) -> None:
    """Run a rank's schedule on device tensors (``dtype``: the run's torch dtype); collective."""
    import torch

    for step in schedule:
        kind = type(step)
        if kind is RankPhase:
            _phase(step, work, context, dtype)
        elif isinstance(step, LinearOperator):
            dispatch.dispatch(INTERPRETER, step, work)
        elif kind is Scale:
            for name, tensor in list(work.arrays.items()):
                scaled = tensor * step.alpha
                if name in work.owned and scaled.dtype == tensor.dtype:
                    tensor.copy_(scaled)
                else:
                    work.set(name, scaled)
        elif kind is RankZero:
            work.arrays.clear()
            work.owned.clear()
            for block in step.blocks:
                work.set(block.name, work.zeros(block.shape))
        elif kind is RankBranches:
            results = []
            for term in step.terms:
                branch = work.borrowed()
                run_device_schedule(term, branch, context, dtype)
                results.append(branch.arrays)
            work.arrays.clear()
            work.owned.clear()
            for name in step.names:
                total = results[0][name].clone()
                for other in results[1:]:
                    total = total + other[name]
                work.set(name, total)
        elif kind is LocalMoves:
            run_local_moves(step, work, dtype, new=_new_block)
        else:
            run = DEVICE_RUNS.get(kind)
            if run is None:  # pragma: no cover - the schedules hold nothing else
                raise TypeError(f"the torch.distributed device path cannot run the step {step!r}")
            run(step, work, context, dtype)
    del torch


def _all_reduce(step: AllReduceStep, work: DeviceWorkspace, context: GroupContext, dtype: Any) -> None:
    import torch.distributed as dist

    for name, ranks in step.entries:  # blocking, in the global order of the groups
        tensor = work.writable(name, dtype).contiguous()
        work.set(name, tensor)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=context.subgroup(ranks))


def _phase(phase: RankPhase, work: DeviceWorkspace, context: GroupContext, dtype: Any) -> None:
    import torch
    import torch.distributed as dist

    group = context.group
    operations = []
    finish = []
    for peer, tag, t in phase.receives:
        if t.mode != "new" and phase.empty(t):
            continue
        buffer = torch.empty(t.shape, dtype=dtype, device=work.device)
        if buffer.numel():
            operations.append(dist.P2POp(dist.irecv, buffer, group=group, tag=tag, group_peer=peer))
        finish.append((t, buffer))
    for peer, tag, t in phase.sends:
        if phase.empty(t):
            continue
        data = work.arrays[t.source.name][phase.index(t.source)].to(dtype=dtype).contiguous()
        operations.append(dist.P2POp(dist.isend, data, group=group, tag=tag, group_peer=peer))
    if operations:
        for request in dist.batch_isend_irecv(operations):
            request.wait()
    finish_phase(phase, work, finish, dtype)


def _broadcast(step: BroadcastStep, work: DeviceWorkspace, context: GroupContext, dtype: Any) -> None:
    import torch
    import torch.distributed as dist

    results: list[tuple[str, Any]] = []
    for group in step.groups:
        root = group.ranks[0]
        sub = context.subgroup(group.ranks) if len(group.ranks) > 1 else None
        mine = [name for name, w in group.copies if w == step.rank]
        if not step.reduce:
            if root == step.rank:
                buffer = work.arrays[group.root_name].to(dtype=dtype, copy=True).contiguous()
            else:
                buffer = torch.empty(group.shape, dtype=dtype, device=work.device)
            if sub is not None and buffer.numel():
                dist.broadcast(buffer, group=sub, group_src=context.rank_in(sub, root))
            if mine:
                results.append((mine[0], buffer))
            continue
        if mine:
            total = work.arrays[mine[0]].to(dtype=dtype, copy=True).contiguous()
        else:
            total = torch.zeros(group.shape, dtype=dtype, device=work.device)
        if sub is not None and total.numel():
            dist.reduce(total, op=dist.ReduceOp.SUM, group=sub, group_dst=context.rank_in(sub, root))
        if root == step.rank:
            results.append((group.root_name, total))
    for name in step.dropped:
        work.drop(name)
    for name, tensor in results:
        work.set(name, tensor)
    for block in step.created:
        if block.name not in work.arrays:
            work.set(block.name, work.zeros(block.shape))


def _all_to_all(step: AllToAllStep, work: DeviceWorkspace, context: GroupContext, dtype: Any) -> None:
    """One ``all_to_all_single`` over the group: the boxes of the old block packed in peer
    order (one ``torch.cat``), received into one buffer and stored into the new block."""
    import torch
    import torch.distributed as dist

    def box(start: tuple[int, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
        return tuple(slice(a, a + n) for a, n in zip(start, shape))

    size = context.size
    send_splits, receive_splits = [0] * size, _splits(step, size)
    pieces = []
    if step.source is not None:
        source = work.arrays[step.source]
        for peer, start, shape in sorted(step.sends, key=lambda b: b[0]):
            piece = source[box(start, shape)]
            if piece.numel():
                send_splits[peer] = piece.numel()
                pieces.append(piece.reshape(-1).to(dtype=dtype))
    send = torch.cat(pieces) if pieces else torch.empty(0, dtype=dtype, device=work.device)
    receive = torch.empty(sum(receive_splits), dtype=dtype, device=work.device)
    dist.all_to_all_single(receive, send, receive_splits, send_splits, group=context.group)
    if step.source is not None:
        work.drop(step.source)
    if step.target is not None:
        target = torch.zeros(step.target.shape, dtype=dtype, device=work.device)
        at = 0
        for _, start, shape in sorted(step.receives, key=lambda b: b[0]):
            count = 1
            for n in shape:
                count *= n
            if count:
                target[box(start, shape)] = receive[at : at + count].reshape(shape)
                at += count
        work.set(step.target.name, target)


def _gather(step: GatherStep, work: DeviceWorkspace, context: GroupContext, dtype: Any) -> None:
    """One ``all_gather_into_tensor`` or ``reduce_scatter_tensor`` on the line's sub-group,
    on device: the shares arranged ``[member, share]`` in the sub-group's rank order; or the
    node's point-to-point program where that is faster (:attr:`GroupContext.native_gathers`)."""
    import torch
    import torch.distributed as dist

    if 1 < len(step.members) and not context.native_gathers:
        run_device_schedule(step.fallback.schedule(), work, context, dtype)
        return
    if step.source is None or step.target is None:
        return
    send = work.arrays[step.source].to(dtype=dtype).contiguous()
    count, axis = len(step.members), step.axis
    receive = torch.empty(step.target.shape, dtype=dtype, device=work.device)
    if count > 1 and receive.numel():
        gathered_shape = tuple(send.shape if step.reduce else receive.shape)
        split = (*gathered_shape[:axis], count, gathered_shape[axis] // count, *gathered_shape[axis + 1 :])
        order = torch.tensor(step.positions, device=work.device)
    if count == 1:
        receive.copy_(send)
    elif receive.numel() and step.reduce:
        lined = torch.movedim(send.reshape(split), axis, 0)
        ordered = torch.empty_like(lined, memory_format=torch.contiguous_format)
        ordered[order] = lined
        dist.reduce_scatter_tensor(
            receive.view(-1), ordered.view(-1), op=dist.ReduceOp.SUM, group=context.subgroup(step.members)
        )
    elif receive.numel():
        gathered = torch.empty((count, *send.shape), dtype=dtype, device=work.device)
        dist.all_gather_into_tensor(gathered.view(-1), send.view(-1), group=context.subgroup(step.members))
        torch.movedim(receive.view(split), axis, 0).copy_(gathered[order])
    work.drop(step.source)
    work.set(step.target.name, receive)


def _reduce_scatter(
    step: ReduceScatterStep, work: DeviceWorkspace, context: GroupContext, dtype: Any
) -> None:
    """One ``reduce_scatter`` on the line's sub-group, on device: the gathered block cut into
    its uneven shares along the axis (each made contiguous), listed in the sub-group's rank
    order; or the node's point-to-point program where that is faster
    (:attr:`GroupContext.native_gathers`)."""
    import torch
    import torch.distributed as dist

    if not context.native_gathers:
        run_device_schedule(step.fallback.schedule(), work, context, dtype)
        return
    if step.source is None or step.target is None:
        return
    send = work.arrays[step.source].to(dtype=dtype)
    receive = torch.empty(step.target.shape, dtype=dtype, device=work.device)
    if send.numel():  # the gathered block's shape is the same on every member of the line
        pieces = torch.split(send, list(step.shares), dim=step.axis)
        listed: list[Any] = [None] * len(pieces)
        for k, piece in enumerate(pieces):
            listed[step.positions[k]] = piece.contiguous()
        dist.reduce_scatter(receive, listed, op=dist.ReduceOp.SUM, group=context.subgroup(step.members))
    work.drop(step.source)
    work.set(step.target.name, receive)


def _splits(step: AllToAllStep, size: int) -> list[int]:
    """The number of entries received from each peer."""
    splits = [0] * size
    for peer, _, shape in step.receives:
        count = 1
        for n in shape:
            count *= n
        splits[peer] = count
    return splits


DEVICE_RUNS: Final[Mapping[type, Callable[[Any, DeviceWorkspace, GroupContext, Any], None]]] = (
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
"""Torch step (a row of :data:`~linop.backends.torch_distributed.schedule.CALLS`) -> how the
device path runs it on the tensors where they are."""
