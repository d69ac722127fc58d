"""A tree compiled for one process group: :class:`TorchDistributedPlan`, and its bound form
:class:`BoundTorchPlan`.

Applying a plan checks collectively (:mod:`linop.backends.torch_distributed.check`), then
runs this rank's schedule (:mod:`linop.backends.torch_distributed.schedule`, run by
:mod:`linop.backends.torch_distributed.runtime`) on a copy-on-write workspace over numpy views
of the caller's CPU tensors, so caller tensors are never changed (unless ``inplace=True``).

Once the check has passed every rank is committed to the schedule. A rank that fails after it
(its own error, a lost peer) raises :class:`~linop.errors.RankFailedError` and shuts the group
down on itself (:class:`~linop.backends.torch_distributed.group.RunGuard`); its peers, blocked
on it, raise :class:`~linop.errors.RankFailedError` as soon as its process ends (their
connections to it close), not at the process group's timeout. Gloo cannot close a group's
connections while the process lives (``destroy_process_group``, ``abort`` and ``shutdown`` leave
the peers waiting, torch 2.13): a rank that catches the error must end its process. The group
is unusable afterwards. A failing *check* (a mismatched tree, a bad block) raises its typed error on every
rank before any data moves and leaves the group usable.
"""

from __future__ import annotations

import hashlib
import os
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np

from ... import dtypes
from ...errors import (
    DistributedOverflowError,
    IntegerOverflowError,
    ProcessGroupError,
    StateError,
    WorkerMapError,
)
from ...operator import LinearOperator
from ...program import RankPhase, WorkerMap, fingerprint
from ...program.executor_plan import ExecutorPlan
from ...program.mapped import compiled_for
from .. import array_api
from .. import numpy as numpy_backend
from ..entry_check.state import Refused
from ..host_fusion import fused
from ..host_schedule import cast_copies, outputs, read_only
from . import device as device_path
from .check import TorchEntryCheck
from .group import TIMEOUT_VARIABLE, GroupContext, resolve_timeout
from .runtime import AllToAll, PackedStep, new_target, packed_schedule, phase_operations, run_schedule
from .schedule import SUMMABLE, AllToAllStep, Compiled, agree_native

__all__ = ["TorchDistributedPlan", "BoundTorchPlan"]


def screened(local_state: Any, arrays: Any, *, inplace: bool) -> Any:
    """``arrays`` (what the check tests: numpy views or stand-ins of ``local_state``'s
    tensors) with a :class:`~linop.backends.entry_check.state.Refused` in place of each tensor
    the executor will not run on, as ``op.apply`` refuses it: a meta tensor (a shape and a dtype
    but no values), and in place, under grad mode, a tensor that requires a gradient (the write
    would change it behind autograd's back). The check then raises the same
    :class:`~linop.errors.DistributedStateError` on every rank. ``arrays`` itself when nothing
    is refused (the common case: no copy)."""
    if not isinstance(local_state, Mapping) or not isinstance(arrays, Mapping):
        return arrays
    import torch

    refused: dict[str, Refused] = {}
    grad = inplace and torch.is_grad_enabled()
    for name, value in local_state.items():
        if not isinstance(value, torch.Tensor):
            continue
        if value.is_meta:
            refused[name] = Refused(
                "is a meta tensor: it has a shape and a dtype but no values (materialize it, e.g. with "
                "torch.empty_like(t, device='cpu'), before applying the operator)"
            )
        elif grad and value.requires_grad:
            refused[name] = Refused(
                f"is a tensor that requires a gradient ({'a leaf' if value.is_leaf else 'not a leaf'}): "
                "writing it in place would change it behind autograd's back (op.apply refuses it too); "
                "apply out of place, detach it, or write under torch.no_grad()"
            )
    return {**arrays, **refused} if refused else arrays


class TorchDistributedPlan(ExecutorPlan[GroupContext]):
    """A tree compiled for one process group: this rank's schedules and the entry check.

    Built by :func:`linop.backends.torch_distributed.plan_for` (cached per group). Compiling is
    local; a tree the executor cannot compile, a group too small for it or a bad worker map is
    reported by the first application's check, on every rank alike.

    Attributes
    ----------
    domain_blocks : dict of str to Block
        The blocks of the domain this rank passes (its workers').
    range_names : tuple of str
        The names of the range blocks this rank gets back.
    native : bool
        Whether the plan runs native collectives (all-reduce, broadcast, sum-reduce,
        all-gather and reduce-scatter along one axis on sub-groups, ``all_to_all_single`` over
        the group) for dtypes they move; else the
        portable program. Before the first run: whether this rank's own part is native (the
        ranks agree at the first run).
    """

    def __init__(
        self, op: LinearOperator, context: GroupContext, mapping: WorkerMap | WorkerMapError | None = None
    ) -> None:
        super().__init__(op, context, mapping)
        self._compiled: Compiled | None = None
        self._agreed: tuple[tuple[int, ...], ...] | bool | None = False  # False: not agreed yet
        self._host_steps: tuple[tuple[Any, ...], tuple[Any, ...]] | None = None  # (schedule, fused)
        self._prepared: tuple[tuple[Any, ...], list[_PreparedPhase]] | None = None  # apply's, in place
        self._mapped_schedule: tuple[Any, ...] = ()
        self._again: _SameTensors | None = None  # the previous in-place call's tensors, kept
        self._doing_text: str | None = None
        tree = fingerprint(op)
        rank, size = context.rank, context.size
        problem = None
        if mapping is None:
            self.fingerprint = tree
            self._compiled = Compiled(op, rank, size, world=context.world)
            problem = self._compiled.problem
            if problem is None and self._compiled.max_worker >= size:
                problem = ProcessGroupError(
                    f"the tree names worker {self._compiled.max_worker} but the process group has {size} "
                    f"rank(s); launch at least {self._compiled.max_worker + 1} processes"
                )
            if problem is None:
                self.domain_blocks = {b.name: b for b in op.domain.owned(rank)}
                self.range_names = tuple(b.name for b in op.range.owned(rank))
        elif isinstance(mapping, WorkerMapError):
            self.fingerprint = hashlib.blake2b(tree + b"invalid map", digest_size=16).digest()
            problem = mapping
        else:
            compiled = compiled_for(op, mapping)  # the portable program: no table of calls
            self.fingerprint = compiled.fingerprint
            program, problem = compiled.for_rank(rank, size)
            if program is not None:
                self._mapped_schedule = program.schedule
                self.domain_blocks = compiled.domain_blocks(rank)
                self.range_names = compiled.range_names(rank)
        self.problem = problem
        self.entry = TorchEntryCheck(
            op,
            self.fingerprint,
            context,
            self.domain_blocks,
            problem,
            tree_fingerprint=tree,
            rank_of=mapping.rank_of if isinstance(mapping, WorkerMap) else None,
        )

    @property
    def native(self) -> bool:
        if self._compiled is None:
            return False
        if self._agreed is False:
            return self._compiled.native is not None
        return self._agreed is not None

    def schedule_for(self, dtype: np.dtype) -> tuple[Any, ...]:
        """This rank's schedule for a run in ``dtype`` (agreed by the check, so every rank
        chooses alike). The first run agrees, collectively, whether every rank's part is
        native (:func:`~linop.backends.torch_distributed.schedule.agree_native`) and creates
        the collectives' sub-groups, collectively over the world group, in one order."""
        compiled = self._compiled
        if compiled is None:
            return self._mapped_schedule
        if self._agreed is False:
            reducer = self.context.reducer
            self._agreed = agree_native(
                compiled.local_sets if compiled.native is not None else None,
                self.context.size,
                world=self.context.world,
                reduce_max=lambda values: reducer.all_reduce(values, "max"),
                gather=self.entry.agreement.allgather,
            )
            if isinstance(self._agreed, tuple):
                self.context.create_subgroups(self._agreed)
        if self._agreed is not None and compiled.native is not None and dtype.char in SUMMABLE:
            return compiled.native.schedule
        return compiled.portable().schedule

    def check(self, local_state: Any, *, inplace: bool = False, timeout: float | None = None) -> Any:
        """Collectively validate the tree and every rank's local state (numpy arrays); the
        agreed outcome (:class:`~linop.backends.entry_check.CheckOutcome`). ``timeout``: seconds
        (default ``$LINOP_TIMEOUT``, else none)."""
        return self.entry.run_within(local_state, resolve_timeout(timeout), inplace=inplace)

    # -- application -------------------------------------------------------------------------
    def apply(
        self, local_state: Mapping[str, Any], *, inplace: bool = False, timeout: float | None = None
    ) -> Any:
        """Apply the plan to this rank's blocks; collective. See
        :func:`linop.backends.torch_distributed.apply`."""
        if device_path.use_device_path(local_state, self.context):
            return self._apply_on_device(local_state, inplace=inplace, timeout=timeout)
        outcome = None
        again = self._again
        if inplace and again is not None and again.same(local_state):  # the same tensors again
            found = self._apply_again(again, timeout)
            if found is None:
                return local_state
            if found is not _CHECK:  # another rank's input differs: its outcome, decoded
                outcome = found
        entry = array_api.mpi_entry(local_state)  # CPU tensors: numpy views of their memory
        if outcome is None:
            outcome = self.check(
                screened(local_state, entry.arrays, inplace=inplace), inplace=inplace, timeout=timeout
            )
        run_dtype = outcome.result()
        arrays = {name: entry.arrays[name] for name in self.domain_blocks}
        if not inplace:
            return entry.result(
                self.run_out_of_place(cast_copies(arrays, outcome.cast), run_dtype), inplace=False
            )
        if outcome.cast is None and self._run_prepared(arrays, run_dtype):
            self._keep_again(local_state, entry, run_dtype)
            return entry.result(local_state, inplace=True)
        self.run_in_place(arrays, run_dtype, cast=outcome.cast)
        return entry.result(local_state, inplace=True)

    def _apply_again(self, again: _SameTensors, timeout: float | None) -> Any:
        """An in-place call passing the tensors of the previous one again (:class:`_SameTensors`):
        the check's collective on the kept check vector, then the kept prepared phases.

        Returns None when it ran; :data:`_CHECK`, before any communication, when the entry
        check's kept vector is stale (the caller checks in full); else the check's outcome,
        decoded afresh because another rank's input differs (the caller goes on with it, an
        error raised on every rank alike)."""
        repeat = self.entry.repeat(again.arrays, True)
        if repeat is None:  # the kernels settled a dtype since: the vector changes
            return _CHECK
        reducer = self.context.reducer
        seconds = resolve_timeout(timeout)
        reducer.timeout = seconds  # as TorchEntryCheck.run_within sets them
        reducer.doing = self._doing()
        outcome, agreed = self.entry.again(repeat, seconds)
        if not agreed or outcome.dtype is not again.dtype:
            return outcome
        with self.context.guard(self.op):
            for phase in again.phases:
                phase.run()
        return None

    def _doing(self) -> str:
        """What a deadline's error says the ranks were doing at the check (worded once)."""
        if self._doing_text is None:
            self._doing_text = f"the entry check of {self.op}"
        return self._doing_text

    def _keep_again(self, local_state: Any, entry: Any, dtype: np.dtype) -> None:
        """After an in-place call that ran prepared phases: keep what the next call passing the
        same tensors needs (:class:`_SameTensors`), when it is one CPU tensor read in place
        (no staged copy) and the entry check kept its repeat of the tensor's view."""
        library = entry.library
        if library is None or library.kind != "torch" or entry.staged or self._prepared is None:
            return
        if type(local_state) is not dict or len(local_state) != 1:
            return
        ((name, tensor),) = local_state.items()
        if self.entry.repeat(entry.arrays, True) is None:
            return
        self._again = _SameTensors(name, tensor, entry.arrays, self._prepared[1], dtype)

    def _run_prepared(self, arrays: dict[str, np.ndarray], dtype: np.dtype) -> bool:
        """Run an in-place halo-like schedule (:func:`_preparable`) on phases prepared for
        these very arrays, kept from the previous call on the same memory (same addresses,
        shapes, strides and dtypes: a time loop), else prepared now and kept; False when the
        schedule cannot be prepared (the caller then runs it unprepared). Every rank decides
        alike: the schedule and the run's dtype are agreed, and memory only changes which
        buffers this rank reuses. The kept phases hold views of the arrays (so their memory
        cannot be reused for another array while kept)."""
        key = tuple(
            (name, a.__array_interface__["data"][0], a.shape, a.strides, a.dtype.str)
            for name, a in arrays.items()
        )
        if self._prepared is not None and self._prepared[0] == key:
            phases = self._prepared[1]
        else:
            schedule = self.schedule_for(dtype)
            if not all(a.flags.writeable for a in arrays.values()) or not _preparable(
                schedule, arrays, dtype
            ):
                return False
            work = numpy_backend.Workspace(dict(arrays), set(arrays), dtype)
            phases = [_PreparedPhase(phase, work, self.context, dtype) for phase in schedule]
            self._prepared = (key, phases)
        with self.context.guard(self.op):
            for phase in phases:
                phase.run()
        return True

    # -- the device path (device.py): tensors stay where they are ------------------------------
    def _apply_on_device(
        self, local_state: Mapping[str, Any], *, inplace: bool, timeout: float | None
    ) -> Any:
        stand_ins = (
            device_path.check_stand_ins(local_state) if isinstance(local_state, Mapping) else local_state
        )
        outcome = self.check(
            screened(local_state, stand_ins, inplace=inplace), inplace=inplace, timeout=timeout
        )
        dtype = outcome.result()
        tensors = {name: local_state[name] for name in self.domain_blocks}
        return self.run_on_device(tensors, dtype, outcome.cast, inplace=inplace, state=local_state)

    def run_on_device(
        self,
        tensors: dict[str, Any],
        dtype: np.dtype,
        cast: np.dtype | None,
        *,
        inplace: bool,
        state: Any = None,
    ) -> Any:
        """Run (no check) on device tensors; out of place the range blocks as new tensors, in
        place the caller's tensors updated (``state`` returned). Collective."""
        import torch

        run = device_path.torch_dtype(dtype if cast is None else np.result_type(dtype, cast))
        where = next(iter(tensors.values())).device if tensors else self.context.device
        arrays = {name: t.detach() for name, t in tensors.items()}
        if cast is not None:
            arrays = {name: t.to(torch.promote_types(t.dtype, run)) for name, t in arrays.items()}
        work = device_path.DeviceWorkspace(
            dict(arrays), set(arrays) if inplace and cast is None else set(), run, where
        )
        with self.context.guard(self.op):
            device_path.run_device_schedule(
                self.schedule_for(dtype), work, self.context, device_path.torch_dtype(dtype)
            )
        if not inplace:
            return {
                name: work.arrays[name] if name in work.owned else work.arrays[name].clone()
                for name in self.range_names
            }
        if cast is not None:
            problem = None
            for name, target in tensors.items():
                result = work.arrays[name]
                info = torch.iinfo(target.dtype) if not target.dtype.is_floating_point else None
                if (
                    info is not None
                    and result.numel()
                    and (result.min() < info.min or result.max() > info.max)
                ):
                    problem = f"rank {self.context.rank}: block {name!r} does not fit {target.dtype} in place"
                    break
            problems = [p for p in self.entry.agreement.allgather(problem) if p is not None]
            if problems:
                raise DistributedOverflowError(problems[0])
        results = {name: work.arrays[name] for name in tensors}
        pending = {
            name: (r.clone() if any(r.data_ptr() == t.data_ptr() for t in tensors.values()) else r)
            for name, r in results.items()
            if r is not tensors[name]
        }
        with torch.no_grad():
            for name, result in pending.items():
                tensors[name].copy_(result)
        return state

    def host_steps_for(self, dtype: np.dtype) -> tuple[Any, ...]:
        """:meth:`schedule_for` as the host path runs it: consecutive movement steps fused
        (:func:`~linop.backends.host_fusion.fused`, once per schedule)."""
        schedule = self.schedule_for(dtype)
        cached = self._host_steps
        if cached is None or cached[0] is not schedule:
            cached = self._host_steps = (schedule, fused(schedule))
        return cached[1]

    def run_out_of_place(
        self, arrays: dict[str, np.ndarray], dtype: np.dtype, *, steps: tuple[Any, ...] | None = None
    ) -> dict[str, np.ndarray]:
        """Run (no check) on copy-on-write arrays; blocks passed through come back as read-only
        views. Collective. ``steps``: the host steps to run (a bound plan's, its collectives
        packed), default :meth:`host_steps_for`."""
        work = numpy_backend.Workspace(dict(arrays), set(), dtype)
        with self.context.guard(self.op):
            run_schedule(self.host_steps_for(dtype) if steps is None else steps, work, self.context, dtype)
        return outputs(work, self.range_names)

    def run_in_place(
        self, arrays: dict[str, np.ndarray], dtype: np.dtype, *, cast: np.dtype | None = None
    ) -> None:
        """Run (no check) on the caller's arrays and write back the blocks that ended in other
        arrays. With ``cast`` (an integer run widened), the ranks agree that every result fits
        its caller's array before any is written back. Collective."""
        work = numpy_backend.Workspace(cast_copies(arrays, cast), set(arrays), dtype)
        with self.context.guard(self.op):
            run_schedule(self.host_steps_for(dtype), work, self.context, dtype)
        if cast is not None:
            problem = None
            try:
                dtypes.fit_back(work.arrays, arrays)
            except IntegerOverflowError as error:
                problem = f"rank {self.context.rank}: {error}"
            problems = [p for p in self.entry.agreement.allgather(problem) if p is not None]
            if problems:
                raise DistributedOverflowError(problems[0])
        numpy_backend.write_back(arrays, work)

    def bind(
        self,
        local_state: Mapping[str, Any],
        *,
        inplace: bool | None = None,
        timeout: float | None = None,
        every_call: bool = False,
    ) -> BoundTorchPlan:
        """Prepare repeated application to these very tensors (or arrays); collective.

        The check runs once, here. In place (the default when domain equals range), a schedule
        of point-to-point phases of stores, adds and clears (a halo exchange) is prepared once:
        its operations on the caller's memory and its receive and packing buffers, so a call
        only starts the batches and finishes them; out of place, one ``all_to_all_single`` (a
        repartition, scatter, gather, all-gather) is prepared alike, into result tensors that
        every call overwrites. Any other schedule runs on each call without its check.
        ``timeout`` (default ``$LINOP_TIMEOUT``, else 600 s) bounds the check and the first call
        (:class:`~linop.errors.PeerTimeoutError` naming the ranks that never make that call, as
        on MPI): a prepared step's own waits, and, when a deadline was asked for (``timeout=``
        or ``$LINOP_TIMEOUT``, not the default), a barrier before the first run on every rank
        alike (one more collective, on the first call only). ``every_call=True`` (alike on every rank) bounds every call so: a
        step prepared on every rank has its waits take the deadline (``work.wait(timeout)``, no
        more messages), any other meets the others in that barrier on every call (one more
        collective per call); the ranks agree which at binding (one all-reduce).

        Out of place, a native plan's consecutive collectives over the whole group of one kind
        and root (a layer's weight and bias broadcasts, sum-reduces or all-reduces) run packed
        into one collective per call when every rank packs alike (one more all-reduce here,
        :func:`_agreed_packing`); :meth:`BoundTorchPlan.run_on` takes CPU tensors of the bound
        shapes and dtypes without the entry's per-call conversions.
        """
        if inplace is None:
            inplace = self.op.domain == self.op.range
        if device_path.use_device_path(local_state, self.context):
            stand_ins = (
                device_path.check_stand_ins(local_state) if isinstance(local_state, Mapping) else local_state
            )
            outcome = self.check(
                screened(local_state, stand_ins, inplace=inplace), inplace=inplace, timeout=timeout
            )
            return BoundTorchPlan(
                self,
                None,
                outcome.result(),
                inplace,
                outcome.cast,
                device_state=local_state,
                timeout=resolve_timeout(timeout),
                every_call=every_call,
                meet_first=_explicit(timeout),
            )
        entry = array_api.mpi_entry(local_state)
        outcome = self.check(
            screened(local_state, entry.arrays, inplace=inplace), inplace=inplace, timeout=timeout
        )
        dtype = outcome.result()
        return BoundTorchPlan(
            self,
            entry,
            dtype,
            inplace,
            outcome.cast,
            timeout=resolve_timeout(timeout),
            every_call=every_call,
            meet_first=_explicit(timeout),
        )


def _explicit(timeout: float | None) -> bool:
    """Whether a deadline was asked for (``timeout=`` or ``$LINOP_TIMEOUT``), not the default:
    only then does a bound plan's first call meet in a barrier (one more collective); under
    the default, only the waits the call makes anyway take it."""
    return timeout is not None or bool(os.environ.get(TIMEOUT_VARIABLE, "").strip())


def _agreed_packing(plan: TorchDistributedPlan, dtype: np.dtype, *, host: bool) -> tuple[Any, ...] | None:
    """The plan's host steps with each run of collectives over the whole group of one kind and
    root packed into one (:func:`~linop.backends.torch_distributed.runtime.packed_schedule`: a
    layer's weight and bias broadcasts, sum-reduces or all-reduces), when every rank packs
    alike (one all-reduce of a digest of what each packs: collective, at binding, on every rank
    of a native plan bound out of place); else None (the steps as they are). ``host``: whether
    this rank runs the host path (the device path packs nothing: a rank on it disagrees)."""
    if host:
        packed, signature = packed_schedule(plan.host_steps_for(dtype), plan.context.size)
    else:
        packed, signature = (), ("the device path",)
    digest = int.from_bytes(hashlib.blake2b(repr(signature).encode(), digest_size=7).digest(), "big")
    reducer = plan.context.reducer
    if reducer is None:  # pragma: no cover - the check made it
        from .check import TorchReducer

        reducer = plan.context.reducer = TorchReducer(plan.context)
    highest = reducer.all_reduce(np.array([digest, -digest], dtype=np.int64), "max")
    if int(highest[0]) != -int(highest[1]) or not any(type(step) is PackedStep for step in packed):
        return None
    return packed


def _every_rank(context: GroupContext, flag: bool) -> bool:
    """Whether ``flag`` holds on every rank of the group (one all-reduce)."""
    reducer = context.reducer
    if reducer is None:  # pragma: no cover - the check made it
        from .check import TorchReducer

        reducer = context.reducer = TorchReducer(context)
    return bool(reducer.minimum(int(flag)))


_CHECK = object()
"""What :meth:`TorchDistributedPlan._apply_again` returns when the call must be checked in full."""


class _SameTensors:
    """The tensor of an in-place call that ran prepared phases, kept so that the next call
    passing it again runs the entry check's collective and those phases only (the torch side
    of :mod:`linop.backends.entry_check.repeat`).

    :meth:`same` compares what the kept numpy view, the check's local verdict and the prepared
    phases depend on: the same tensor object (held weakly: a new tensor at a collected one's
    ``id`` is never taken for it) under the same name in a one-key dict, at the same data
    pointer (``set_``, ``resize_`` or ``.data =`` move it), with the same shape, strides,
    dtype and device, no conjugate or negative bit (the view would be a copy), and not a
    tensor requiring a gradient under grad mode (refused in place, :func:`screened`). The
    kept view shares the tensor's memory and is never handed out, so its own flags cannot
    change; the phases hold views of that memory (so it is never reused while kept)."""

    __slots__ = (
        "arrays",
        "device",
        "dtype",
        "name",
        "phases",
        "pointer",
        "ref",
        "shape",
        "stride",
        "tensor_dtype",
        "torch",
    )

    def __init__(
        self, name: str, tensor: Any, arrays: dict[str, np.ndarray], phases: list[Any], dtype: np.dtype
    ) -> None:
        import torch

        self.torch = torch
        self.name = name
        self.ref: Any = weakref.ref(tensor)
        self.pointer = tensor.data_ptr()
        self.shape = tensor.shape
        self.stride = tensor.stride()
        self.tensor_dtype = tensor.dtype
        self.device = tensor.device
        self.arrays = arrays
        self.phases = phases
        self.dtype = dtype

    def same(self, state: Any) -> bool:
        """Whether ``state`` passes the kept tensor again, unchanged (see the class)."""
        if type(state) is not dict or len(state) != 1:
            return False
        tensor, kept = state.get(self.name), self.ref()  # kept: None once the tensor is collected
        if tensor is None or kept is not tensor:
            return False
        if tensor.data_ptr() != self.pointer or tensor.shape != self.shape or tensor.stride() != self.stride:
            return False
        if tensor.dtype is not self.tensor_dtype or tensor.device != self.device:
            return False
        if tensor.is_conj() or tensor.is_neg():
            return False
        return not (tensor.requires_grad and self.torch.is_grad_enabled())


class _PreparedPhase:
    """One phase bound to fixed arrays: its operations, the packing before and the finishing
    after (receive buffers added or stored, sources cleared)."""

    def __init__(
        self, phase: RankPhase, work: numpy_backend.Workspace, context: GroupContext, dtype: np.dtype
    ):
        import torch
        import torch.distributed as dist

        self.context = context
        self.packs: list[tuple[np.ndarray, np.ndarray]] = []
        self.operations, finish = phase_operations(phase, work, context, dtype)
        for operation, (_, _, t) in zip(
            [op for op in self.operations if op.op is dist.isend],
            [s for s in phase.sends if not phase.empty(s[2])],
        ):
            source = work.arrays[t.source.name][phase.index(t.source)]
            if not np.shares_memory(operation.tensor.numpy(), source):  # a packed copy: refresh per call
                self.packs.append((operation.tensor.numpy(), source))
        self.unpacks: list[tuple[np.ndarray, np.ndarray, bool]] = []
        for t, buffer in finish:
            target = work.arrays[t.target.name][phase.index(t.target)]  # type: ignore[arg-type]
            self.unpacks.append((target, buffer, t.mode == "add"))
        self.clears = [
            work.arrays[t.source.name][phase.index(t.source)]
            for _, _, t in phase.sends
            if t.after == "clear" and not phase.empty(t)
        ]
        # on gloo the operations start straight on the process group, as batch_isend_irecv
        # starts them there (runtime._post), the complex ones as real views made once
        self.posts = [
            (
                operation.op is dist.isend,
                torch.view_as_real(operation.tensor) if operation.tensor.is_complex() else operation.tensor,
                operation.group_peer,
                operation.tag,
            )
            for operation in self.operations
        ]
        self.gloo = context.backend == "gloo"

    def run(self, timeout: float | None = None, doing: str = "the first call of a bound plan") -> None:
        """One exchange; ``timeout`` (seconds, a bound plan's first call or every one) bounds
        the wait.

        Raises
        ------
        PeerTimeoutError
            With ``timeout``: a peer did not take part in time."""
        import torch.distributed as dist

        for packed, source in self.packs:
            np.copyto(packed, source)
        if self.operations:
            if self.gloo:
                group = self.context.group
                send, receive = group.send, group.recv
                requests = [(send if out else receive)([t], peer, tag) for out, t, peer, tag in self.posts]
            else:
                requests = dist.batch_isend_irecv(self.operations)
            for request in requests:
                if timeout is None:
                    request.wait()
                else:
                    self.context.wait(request, timeout, doing)
        for target, buffer, add in self.unpacks:
            if add:
                target += buffer
            else:
                target[...] = buffer
        for source in self.clears:
            source[...] = 0


class _BoundTensorViews:
    """:meth:`BoundTorchPlan.run_on`'s fast path for CPU tensors: what the entry
    (:func:`~linop.backends.array_api.mpi_entry`) does per call, reduced to what a dict of
    plain CPU tensors of the bound shapes and dtypes needs, decided at binding (their torch
    shapes and dtypes kept): a numpy view of each (detached; no copy), and the results back as
    tensors sharing the arrays the run made. Anything else (another container, a missing
    block, a conjugate or negative bit, another device, shape or dtype) takes the general path,
    which words the error."""

    __slots__ = ("entry", "expected", "torch")

    def __init__(self, arrays: dict[str, np.ndarray], entry: Any) -> None:
        import torch

        self.torch = torch
        self.entry = entry
        self.expected = {
            name: (torch.Size(array.shape), torch.from_numpy(np.empty(0, array.dtype)).dtype)
            for name, array in arrays.items()
        }

    def views(self, state: Any) -> dict[str, np.ndarray] | None:
        """Numpy views of ``state``'s tensors, or None when the general path must take it."""
        if type(state) is not dict or len(state) != len(self.expected):
            return None
        tensor_type = self.torch.Tensor
        arrays = {}
        for name, (shape, dtype) in self.expected.items():
            tensor = state.get(name)
            if not isinstance(tensor, tensor_type) or tensor.shape != shape or tensor.dtype != dtype:
                return None
            if tensor.device.type != "cpu" or tensor.is_conj() or tensor.is_neg():
                return None
            arrays[name] = tensor.detach().numpy()
        return arrays

    def results(
        self,
        work: numpy_backend.Workspace,
        names: tuple[str, ...],
        state: Mapping[str, Any],
        arrays: dict[str, np.ndarray],
    ) -> dict[str, Any]:
        """The range blocks as tensors: an array the run made, shared (``torch.from_numpy``);
        a caller's block passed through, as the general path gives it
        (:meth:`~linop.backends.array_api.MPIEntry.result`: the caller's tensor itself)."""
        from_numpy = self.torch.from_numpy
        results: dict[str, Any] = {}
        passed: dict[str, np.ndarray] = {}
        for name in names:
            array = work.arrays[name]
            if name in work.owned and array.flags.writeable and min(array.strides, default=0) >= 0:
                results[name] = from_numpy(array)
            else:
                passed[name] = array if name in work.owned else read_only(array)
        if passed:
            entry = array_api.MPIEntry(state, arrays, self.entry.library)
            results.update(entry.result(passed, inplace=False))
            return {name: results[name] for name in names}
        return results


def _preparable(schedule: tuple[Any, ...], arrays: dict[str, np.ndarray], dtype: np.dtype) -> bool:
    """Whether an in-place schedule can be prepared once: point-to-point phases only, of
    stores and adds into boxes of existing blocks and keeps and clears of their sources, on
    arrays of the run's dtype (so no step replaces an array)."""
    if not all(type(step) is RankPhase for step in schedule):
        return False
    if any(a.dtype != dtype for a in arrays.values()):
        return False
    for phase in schedule:
        for _, _, t in (*phase.receives, *phase.sends):
            if t.mode == "new" or t.after == "drop":
                return False
    return True


def _prepared_exchange(
    schedule: tuple[Any, ...], arrays: dict[str, np.ndarray], plan: TorchDistributedPlan, dtype: np.dtype
) -> tuple[AllToAll, dict[str, np.ndarray]] | None:
    """An out-of-place schedule of one ``all_to_all_single`` (a repartition, scatter, gather or
    all-gather) prepared once on the bound source array and a result array made here, which
    every call overwrites; None for any other schedule (or a source not C-contiguous in the
    run's dtype)."""
    if len(schedule) != 1 or type(schedule[0]) is not AllToAllStep:
        return None
    step = schedule[0]
    source = None if step.source is None else arrays.get(step.source)
    if step.source is not None and (source is None or source.dtype != dtype or not source.flags.c_contiguous):
        return None
    names = set() if step.target is None else {step.target.name}
    if set(plan.range_names) != names or set(arrays) != ({step.source} - {None}):
        return None
    target = new_target(step, dtype)
    results = {} if target is None or step.target is None else {step.target.name: target}
    return AllToAll(step, source, target, dtype, plan.context), results


class BoundTorchPlan:
    """A plan bound to fixed tensors (or arrays) of this rank (:meth:`TorchDistributedPlan.bind`):
    calling it applies the operator to their current values, with no further check, and
    returns this rank's range blocks (in place: the caller's dict, its tensors updated).

    Attributes
    ----------
    prepared : bool
        Whether the call runs operations prepared once: phases on the caller's memory (in
        place, point-to-point stores, adds and clears: a halo exchange), or one
        ``all_to_all_single`` from the bound tensors into result tensors made at binding and
        overwritten by every call (out of place: a repartition, scatter, gather, all-gather;
        copy a result to keep it past the next call; :meth:`run_on` returns new tensors).
    dtype : numpy dtype
        The run's dtype, agreed when binding.
    every_call : bool
        Whether every call, not only the first, is bounded by the deadline
        (:meth:`TorchDistributedPlan.bind`).
    """

    def __init__(
        self,
        plan: TorchDistributedPlan,
        entry: Any,
        dtype: np.dtype,
        inplace: bool,
        cast: Any,
        *,
        device_state: Mapping[str, Any] | None = None,
        timeout: float | None = None,
        every_call: bool = False,
        meet_first: bool = True,
    ) -> None:
        self.plan = plan
        self.entry = entry
        self.dtype = dtype
        self.inplace = inplace
        self.cast = cast
        self.freed = False
        self._deadline = timeout  # the next call's deadline: the first call's, or every call's
        self.every_call = every_call and timeout is not None
        self._phases: list[_PreparedPhase] | None = None
        self._exchange: tuple[AllToAll, dict[str, np.ndarray]] | None = None
        self.device_state = device_state
        self._first = meet_first  # whether the first call meets in a barrier (a deadline given)
        self._tensors: _BoundTensorViews | None = None  # run_on's fast path (CPU tensors)
        self._steps: tuple[Any, ...] | None = None  # the host steps with collectives packed, agreed
        if device_state is not None:  # the device path: each call runs on the bound tensors
            self.arrays: dict[str, Any] = {name: device_state[name] for name in plan.domain_blocks}
        else:
            self.arrays = {name: entry.arrays[name] for name in plan.domain_blocks}
            schedule = plan.schedule_for(dtype)
            if inplace and cast is None and _preparable(schedule, self.arrays, dtype):
                work = numpy_backend.Workspace(dict(self.arrays), set(self.arrays), dtype)
                self._phases = [_PreparedPhase(phase, work, plan.context, dtype) for phase in schedule]
            elif not inplace and cast is None:
                self._exchange = _prepared_exchange(schedule, self.arrays, plan, dtype)
            library = entry.library
            if (
                cast is None
                and library is not None
                and library.kind == "torch"
                and library.device.type == "cpu"
            ):
                self._tensors = _BoundTensorViews(self.arrays, entry)
        if not inplace and cast is None and dtype.char in SUMMABLE and plan.context.size > 1:
            # alike on every rank, whichever path it takes (a rank passing no tensor takes the
            # host path where the others take the device path): the agreed schedule, then one
            # all-reduce on whether every rank packs alike (never on the device path)
            plan.schedule_for(dtype)
            if plan.native:
                self._steps = _agreed_packing(plan, dtype, host=device_state is None)
        # whether every call meets in a barrier: decided alike on every rank (a rank may be
        # prepared where another is not: a scatter's root and the others), one all-reduce here
        self._meet_every = self.every_call and (
            plan.context.size > 1 and not _every_rank(plan.context, self.prepared)
        )

    @property
    def prepared(self) -> bool:
        return self._phases is not None or self._exchange is not None

    def __call__(self) -> Any:
        if self.freed:
            raise StateError(f"this bound plan of {self.plan.op} has been freed; bind the plan again")
        timeout = self._deadline
        doing = "a call of a bound plan" if self.every_call else "the first call of a bound plan"
        if not self.every_call:
            self._deadline = None
        first, self._first = self._first, False
        # the first call, and every one that is not prepared on every rank, meets in a barrier
        # first (every rank alike: a step prepared on one rank only is no wait of its own to bound)
        if timeout is not None and (first or self._meet_every):
            with self.plan.context.guard(self.plan.op):
                self.plan.context.arrive_within(timeout, doing)
        if self.device_state is not None:
            return self.plan.run_on_device(
                self.arrays, self.dtype, self.cast, inplace=self.inplace, state=self.device_state
            )
        self.entry.stage_in()
        if self._phases is not None:
            with self.plan.context.guard(self.plan.op):
                for phase in self._phases:
                    phase.run(timeout, doing)
            return self.entry.result(self.entry.state, inplace=True)
        if self._exchange is not None:
            exchange, results = self._exchange
            with self.plan.context.guard(self.plan.op):
                exchange.run(timeout, doing)
            return self.entry.result(dict(results), inplace=False)
        if self.inplace:
            self.plan.run_in_place(self.arrays, self.dtype, cast=self.cast)
            return self.entry.result(self.entry.state, inplace=True)
        result = self.plan.run_out_of_place(
            cast_copies(self.arrays, self.cast), self.dtype, steps=self._steps
        )
        return self.entry.result(result, inplace=False)

    def run_on(self, local_state: Mapping[str, Any]) -> Any:
        """Apply out of place to other tensors of the bound shapes and dtypes, without the
        check (for training loops whose inputs are new tensors on each call).

        Raises
        ------
        StateError
            A block missing, or of another shape or dtype than bound (on this rank only:
            decided before any communication, from what every rank bound alike).
        """
        if self.device_state is not None:
            tensors = {}
            for name, bound in self.arrays.items():
                tensor = local_state.get(name) if isinstance(local_state, Mapping) else None
                if tensor is None or tensor.shape != bound.shape or tensor.dtype != bound.dtype:
                    raise StateError(
                        f"rank {self.plan.context.rank}: block {name!r} is not a tensor of shape "
                        f"{tuple(bound.shape)} and dtype {bound.dtype} as bound"
                    )
                tensors[name] = tensor
            return self.plan.run_on_device(tensors, self.dtype, self.cast, inplace=False)
        if self._tensors is not None:
            arrays = self._tensors.views(local_state)
            if arrays is not None:  # CPU tensors of the bound shapes and dtypes: no entry's work
                work = numpy_backend.Workspace(dict(arrays), set(), self.dtype)
                with self.plan.context.guard(self.plan.op):
                    steps = self._steps if self._steps is not None else self.plan.host_steps_for(self.dtype)
                    run_schedule(steps, work, self.plan.context, self.dtype)
                return self._tensors.results(work, self.plan.range_names, local_state, arrays)
        entry = array_api.mpi_entry(local_state)
        arrays = {}
        for name, bound in self.arrays.items():
            array = entry.arrays.get(name) if isinstance(entry.arrays, Mapping) else None
            if not isinstance(array, np.ndarray) or array.shape != bound.shape or array.dtype != bound.dtype:
                got = (
                    "missing"
                    if array is None
                    else f"{getattr(array, 'shape', '?')} {getattr(array, 'dtype', '?')}"
                )
                raise StateError(
                    f"rank {self.plan.context.rank}: block {name!r} is {got}; this bound plan of "
                    f"{self.plan.op} takes {bound.shape} {bound.dtype}"
                )
            arrays[name] = array
        result = self.plan.run_out_of_place(cast_copies(arrays, self.cast), self.dtype, steps=self._steps)
        return entry.result(result, inplace=False)

    def free(self) -> None:
        """Release the prepared operations and buffers (a later call raises StateError)."""
        self._phases = None
        self._exchange = None
        self.arrays = {}
        self.freed = True
