r"""Operator trees as PyTorch autograd functions and modules.

For a tree :math:`A` (a linear map of states), the wrapped function computes

.. math::

    y = A x \quad\text{(forward: an interpreter)}, \qquad
    \bar x = A^{*} \bar y \quad\text{(backward: the adjoint tree ``op.H``)}

which is PyTorch's vector-Jacobian product of a linear map, complex inputs included
(PyTorch's convention for complex gradients is the conjugate Wirtinger derivative, whose
backward for :math:`y = A x` is :math:`A^H \bar y`). The backward is itself the wrapped
adjoint, so it is differentiable again: :math:`A^{**} = A` gives double backward
(``gradgradcheck``). The adjoint is derived by rules (``docs/theory.md#adjoint-test``), so no
gradient here is a numerical approximation.

In one process the interpreter is numpy (``op.apply``). Across MPI ranks (``comm=...``) each
rank passes only its own blocks; forward and backward each run a plan compiled once and bound
once (:meth:`linop.backends.mpi.plan.DistributedPlan.bind`, which checks collectively), so a
training loop pays no per-call planning or checking. Across the ranks of a ``torch.distributed``
process group (``group=...``, ``group=True`` for the world group) the same holds with the
torch.distributed executor's plans (:meth:`linop.backends.torch_distributed.TorchDistributedPlan.bind`,
then :meth:`~linop.backends.torch_distributed.BoundTorchPlan.run_on` on each call's tensors). Where binding prebuilt persistent
requests (broadcasts, sum-reduces, all-reduces) the plan is bound once on buffers the runner
owns (:class:`BoundTensors`; in place where domain equals range) and each call copies the
incoming tensors into them, runs the prepared calls and copies the results out; for large
blocks (:data:`STRAIGHT_FROM`), and where nothing was prebuilt, each call runs the plan straight
on the tensors' memory (shapes checked locally: a wrong shape is a :class:`StateError` on that
rank).

On a process group the wrappers raise the executor's typed errors
(:func:`linop.backends.torch_distributed.apply`'s), checked before their own: a group smaller
than the tree is :class:`~linop.errors.ProcessGroupError` on every rank, as is a rank that is
not a member of the group (``new_group``'s ``NON_GROUP_MEMBER``); on the first call a rank
whose blocks are missing or extra goes through the executor's collective entry check, so that
every rank raises the same :class:`~linop.errors.DistributedStateError` naming it. An error a
wrapper raises on one rank alone is reported to the group's store first
(:func:`linop.backends.torch_distributed.check.report_failure`): a peer left waiting raises
:class:`~linop.errors.RankFailedError` naming that rank and its error, not a timeout.

Under MPI every rank must take part in every forward and backward call (they are
collective): every rank's loss must depend on the outputs of each call it makes. An empty
*anchor* tensor that requires a gradient is passed to every call, so a rank that owns no input
block still runs the backward; a rank that owns no output block adds the call's empty *token*
output (``f.token.sum()``, zero) to its loss. A backward recorded under ``create_graph`` is
such a call too (the adjoint tree's), whose backward is collective again: after it ``f.token``
is its token, which a rank adds to its second-order loss alike.
"""

from __future__ import annotations

import importlib
import warnings
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

import numpy as np

try:
    import torch
except ModuleNotFoundError as error:  # the torch extra is not installed: say which
    from .extras import missing_extra

    raise missing_extra(error, "torch", __name__) from error

from ..errors import (
    DtypeError,
    LinopError,
    MPIError,
    PeerMismatchError,
    ProcessGroupArgumentError,
    RankFailedError,
    StateError,
)
from ..operator import LinearOperator

__all__ = [
    "TorchOperator",
    "OperatorModule",
    "function",
    "apply",
    "anchor",
    "collective_anchor",
    "fitted_gradient",
]


def anchor() -> torch.Tensor:
    """An autograd anchor: an empty tensor that requires a gradient, passed to a module's own
    autograd node (its ``Function``) so that the node, and its outputs' (and token's) place in
    the graph, exist even when no other input needs a gradient, and its backward runs.

    It only ties the node into the graph: the node's backward returns None in its place (no
    gradient), so nothing is allocated or accumulated for it and ``anchor.grad`` stays None
    (the tests of TorchOperator, LayerModule and BatchNormModule check it)."""
    return torch.zeros(0, dtype=torch.float64, requires_grad=True)


def collective_anchor(comm: Any, group: Any) -> torch.Tensor | None:
    """For a module that is its own autograd node: under MPI (``comm``) or a process group
    (``group``), where every call is collective, an :func:`anchor`, so that every process's
    outputs (and token) are tied to the graph, blocks or none, and its backward runs; None in
    one process."""
    distributed = comm is not None or (group is not None and group is not False)
    return anchor() if distributed else None


def fitted_gradient(gradient: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``gradient`` as the gradient of an input of ``dtype`` on ``device``: the real part for
    a real input (the gradient of a real input is the real part of a complex one), converted
    only where its dtype or device differ."""
    if gradient.is_complex() and not dtype.is_complex:
        gradient = gradient.real
    if gradient.dtype != dtype or gradient.device != device:
        gradient = gradient.to(dtype=dtype, device=device)
    return gradient


def owned_gradient(view: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """:func:`fitted_gradient` of ``view``, a binding's result buffer that the next call
    overwrites, in memory of its own: copied only where fitting it made no new tensor."""
    gradient = fitted_gradient(view, dtype, device)
    return gradient.clone() if gradient.data_ptr() == view.data_ptr() else gradient


def engine_arguments(comm: Any, group: Any) -> None:
    """Reject ``comm=`` (MPI) and ``group=`` (torch.distributed) given together.

    Raises
    ------
    ProcessGroupArgumentError
        When both are given.
    """
    if comm is not None and group is not None and group is not False:
        raise ProcessGroupArgumentError(
            "pass comm= (an mpi4py communicator: MPI) or group= (a torch.distributed process group), not both"
        )


def process_rank(comm: Any, group: Any) -> int | None:
    """This process's rank in ``comm`` or ``group`` (None in one process)."""
    if comm is not None:
        return int(comm.rank)
    if group is not None and group is not False:
        from ..backends import torch_distributed

        return torch_distributed.plan_context(group).rank
    return None


class _Runner:
    """Runs one tree on tensors: in one process through the numpy interpreter, or across
    ranks through a bound MPI plan or a bound torch.distributed plan. ``inputs`` / ``outputs``
    are the block names this process passes in and gets back, in the spaces' order."""

    def __init__(
        self, op: LinearOperator, comm: Any = None, dtype: Any = None, mapping: Any = None, group: Any = None
    ) -> None:
        engine_arguments(comm, group)
        self.op = op
        self.comm = comm
        self.group = None if group is False else group
        self.dtype = dtype
        self.mapping = mapping
        self._adjoint: _Runner | None = None
        self.torch_plan: Any = None
        if self.group is not None:
            from ..backends import torch_distributed

            self.plan = None
            self.torch_plan = torch_distributed.plan_for(op, group=self.group, mapping=mapping)
            self.inputs = tuple(self.torch_plan.domain_blocks)
            self.outputs = self.torch_plan.range_names
        elif comm is None:
            self.plan = None
            self.inputs = op.domain.names
            self.outputs = op.range.names
        else:
            from ..backends import mpi as mpi_backend

            self.plan = mpi_backend.plan_for(op, comm=comm, mapping=mapping)
            self.inputs = tuple(self.plan.domain_blocks)
            self.outputs = self.plan.range_names
        self._bound: Any = None
        self._bound_dtypes: tuple[Any, ...] = ()
        self._in_place: tuple[dict[str, Any], Any] | None = None  # run_in_place's buffers, binding
        # whether some rank has no input blocks of the tree (agreed at the first binding; None
        # before): then each call starts with the ranks' agreement on dtypes (agree)
        self._blind: bool | None = None
        self._agreed = False  # this call's agreement is made (by an earlier step of the call)

    @property
    def adjoint(self) -> _Runner:
        if self._adjoint is None:
            self._adjoint = _Runner(self.op.H, self.comm, self.dtype, self.mapping, self.group)
            self._adjoint._adjoint = self
        return self._adjoint

    def agree(self, changed: bool) -> None:
        """The call's agreement on dtypes, for a tree that leaves some rank without input blocks
        (a broadcast's ranks other than its root, a repartition onto more workers): such a
        rank cannot see its peers' inputs change dtype, so every rank says whether its inputs'
        dtypes differ from its binding's (``changed``; a rank without inputs: never), in one
        all-reduce (``MAX``) of that flag on the tree's communicator or group, and where any
        does, every rank frees its binding: the call binds again on every rank, for the dtype
        the ranks agree on then.

        Once per call on every rank, whichever path the call takes: the first of a kept call's
        test (:meth:`BoundCall.agree`), :meth:`TorchOperator.bound_views` and the general path
        makes it, the others find it made (until the call runs);
        :meth:`TorchOperator.unbind_unless` stands for it where every rank knows the dtype.
        Nothing, and nothing sent, for a tree whose every rank has inputs (each rank sees its
        own change: today's rebinding), before the first binding (every rank binds), or
        in one process."""
        if not self._blind or self._agreed or self._bound is None:
            return
        self._agreed = True
        doing = f"agreeing whether the inputs of {self.op} changed dtype (a rank has no input blocks of it)"
        if self.torch_plan is not None:
            changed = bool(_group_max(self.torch_plan, int(changed), doing))
        else:
            changed = bool(_comm_max(self.plan, int(changed), doing))
        if changed:
            self._unbind()

    def _unbind(self) -> None:
        """Free the binding: the next call binds again (collective)."""
        bound, self._bound = self._bound, None
        self._bound_dtypes = ()
        if bound is not None:
            bound.free()

    def refuse(self, error: LinopError, state: Any) -> NoReturn:
        """Raise ``error``, found by a wrapper's own check of this call's ``state`` on this rank.

        On a process group the executor's errors come first: when the plan has a problem (a
        group smaller than the tree, a bad map), or before the first binding (when every peer
        is in the plan's entry check), the state goes through that collective check, which
        raises the same typed error on every rank; otherwise ``error`` is reported to the
        group's store (:func:`~linop.backends.torch_distributed.check.report_failure`) so that
        a peer left waiting names this rank and its error."""
        self._agreed = False  # the call ends here
        plan = self.torch_plan
        if plan is not None:
            from ..backends.torch_distributed.check import report_failure

            if plan.problem is not None or (self._bound is None and self._in_place is None):
                # raises the agreed error on every rank: this rank's refusal is in it
                plan.check(self._refused_state(plan, error, state)).result()
            from ..backends.torch_distributed import stall

            report_failure(error)
            stall.failed(plan, error)  # the peers, in their bound call, name this rank and error
        raise error

    def _refused_state(self, plan: Any, error: LinopError, state: Any) -> dict[str, Any]:
        """``state`` as the entry check reads it, with this rank's refusal in it: each value
        that is not a tensor, or else the first input, is a
        :class:`~linop.backends.entry_check.state.Refused` carrying ``error`` (unless the
        check finds a problem with ``state`` itself: it words it), so that the check fails on
        every rank, naming this one (a numpy array passes the check, and a
        peer would go on to wait for this rank in the data movement)."""
        from ..backends.entry_check.state import Refused

        given = state if isinstance(state, Mapping) else {}
        arrays: dict[str, Any] = {
            name: _host_view(v.detach()) if isinstance(v, torch.Tensor) else Refused(f"is refused: {error}")
            for name, v in given.items()
        }
        if any(isinstance(v, Refused) for v in arrays.values()) or not self.inputs:
            return arrays
        if plan.entry.local.problem(arrays, False) is None:  # else the check words it itself
            arrays[self.inputs[0]] = Refused(f"is refused: {error}")
        return arrays

    def run(self, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        if self.torch_plan is not None:
            return self._run_group(tensors)
        state = {name: tensor.detach() for name, tensor in zip(self.inputs, tensors)}
        if self.plan is None:
            result: Mapping[str, Any] = self.op.apply(state, dtype=self.dtype)  # torch in, torch out
            inputs = {t.data_ptr() for t in state.values() if t.numel()}
            return tuple(_fresh(result[name], inputs) for name in self.outputs)
        return self._run_bound(state)

    def _run_group(self, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """On a process group: bind (the check, once per dtypes) on the first call's tensors,
        then run on each call's tensors without the check (shapes and dtypes tested locally)."""
        stall = _stall("torch_distributed")
        state: dict[str, torch.Tensor] = {}
        dtypes = []
        inputs = set()
        for name, tensor in zip(self.inputs, tensors):
            tensor = state[name] = tensor.detach()
            dtypes.append(tensor.dtype)
            if tensor.numel():
                inputs.add(tensor.data_ptr())
        bind = self._bound is None or tuple(dtypes) != self._bound_dtypes
        call = stall.enter(self.torch_plan, "checked" if bind else "bound", state)
        try:
            if self._blind:  # a rank has no inputs: the ranks agree whether to bind again
                self.agree(bind)
                self._agreed = False
                if self._bound is None and not bind:
                    bind = True
                    call.kind = "checked"
            if bind:
                if self._bound is not None:
                    self._bound.free()
                    self._bound = None  # a failed binding leaves none
                self._bound = self.torch_plan.bind(state, inplace=False)
                self._bound_dtypes = tuple(dtypes)
                if self._blind is None:  # the first binding: does some rank have no inputs?
                    self._blind = bool(
                        _group_max(self.torch_plan, int(not self.inputs), f"binding {self.op}")
                    )
                result = self._bound()
            else:
                result = self._bound.run_on(state)
        except LinopError as error:
            self._explain(error, bind, call, stall)
        finally:
            stall.leave(call)
        outputs = []
        for name in self.outputs:
            value = result[name]
            if not isinstance(value, torch.Tensor):
                value = _as_tensor(value)
            outputs.append(_fresh(value, inputs) if inputs else value)
        return tuple(outputs)

    def _explain(self, error: LinopError, bind: bool, call: Any, stall: Any) -> NoReturn:
        """Raise ``error`` of a call on a process group, or, when the wait ended because a
        peer's process did (an unguarded bound call), the error that says why."""
        if not bind and isinstance(error, StateError) and not isinstance(error, MPIError):
            stall.failed(self.torch_plan, error, call)  # refused here alone (run_on): peers told
        found = stall.finding(call, look=isinstance(error, RankFailedError))
        if found is None or (isinstance(error, (PeerMismatchError, RankFailedError)) and str(error) == found):
            raise error
        raise (RankFailedError if call.found_failed else PeerMismatchError)(found) from error

    def run_in_place(self, buffers: dict[str, torch.Tensor]) -> None:
        """On a process group, apply the tree (domain equal to range) in place to ``buffers``
        (this process's blocks, CPU tensors): bound on them on the first call and whenever
        another dict is given (collective then: the entry check), then each call runs the bound
        plan on their memory (a halo exchange's prepared phases)."""
        assert self.torch_plan is not None  # only on a process group
        stall = _stall("torch_distributed")
        in_place = self._in_place
        bind = in_place is None or in_place[0] is not buffers
        call = stall.enter(self.torch_plan, "checked" if bind else "bound", buffers)
        try:
            if bind:
                if in_place is not None:
                    in_place[1].free()
                    self._in_place = None  # a failed binding leaves none
                in_place = self._in_place = (buffers, self.torch_plan.bind(buffers, inplace=True))
            assert in_place is not None  # (kept, or bound just now)
            in_place[1]()
        except LinopError as error:
            self._explain(error, bind, call, stall)
        finally:
            stall.leave(call)

    def bound_tensors(self, dtypes: Sequence[torch.dtype]) -> BoundTensors:
        """This runner's MPI plan bound on buffers it owns, for inputs of these dtypes (in the
        order of :attr:`inputs`); collective on the first call for given dtypes, then the same
        object until the dtypes change (the previous binding is then freed)."""
        bound = self._bound
        if bound is None or tuple(dtypes) != self._bound_dtypes:
            if bound is not None:
                bound.free()
            assert self.plan is not None  # only under MPI
            bound = self._bound = BoundTensors(self.plan, self.inputs, self.outputs, dtypes)
            self._bound_dtypes = tuple(dtypes)
            if self._blind is None:  # the first binding: does some rank have no inputs?
                size = self.plan.comm.Get_size()
                self._blind = size > 1 and bool(
                    _comm_max(self.plan, int(not self.inputs), f"binding {self.op}")
                )
        return bound

    def _run_bound(self, state: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        stall = _stall("mpi")
        dtypes = tuple([t.dtype for t in state.values()])
        rebind = self._bound is None or dtypes != self._bound_dtypes
        call = stall.enter(self.plan, "checked" if rebind else "bound", state)
        try:
            if self._blind:  # a rank has no inputs: the ranks agree whether to bind again
                self.agree(rebind)
                self._agreed = False
                if self._bound is None:
                    call.kind = "checked"
            return self._run_bound_call(state, dtypes)
        finally:
            stall.leave(call)

    def _run_bound_call(
        self, state: dict[str, torch.Tensor], dtypes: tuple[torch.dtype, ...]
    ) -> tuple[torch.Tensor, ...]:
        tensors = tuple(state.values())
        bound = self.bound_tensors(dtypes)
        device = tensors[0].device if tensors else _HOST
        if not bound.persistent:
            # Nothing was prebuilt on the staging buffers (the bind decision is the same on
            # every rank): run the checked-once plan straight on the tensors' memory.
            views = {name: _host_view(tensor) for name, tensor in state.items()}
            bound.check_shapes(views.values())
            result = bound.plan.run_out_of_place(views, bound.dtype, bound.dtype)
            return tuple(
                _on(torch.from_numpy(array if array.flags.writeable else np.array(array)), device)
                for array in (result[name] for name in self.outputs)
            )
        outputs = bound.run(tensors)  # the same buffers on every call: copied out
        if device.type == "cpu":
            return tuple([tensor.clone() for tensor in outputs])
        return tuple([tensor.clone().to(device) for tensor in outputs])


class BoundTensors:
    """A tree's bound MPI plan (:meth:`linop.backends.mpi.plan.DistributedPlan.bind`) on
    buffers it owns, seen from torch.

    :meth:`run` copies the given tensors into the bound domain buffers (:attr:`inputs`, torch
    tensors sharing their memory), runs the plan's prepared calls, and returns :attr:`outputs`:
    torch tensors sharing memory with the plan's result arrays, *overwritten by the next call*
    (a caller that keeps a result past it copies it first). Only a :attr:`persistent` binding
    (every call runs only prepared calls) is run so; otherwise the caller runs the plan on its
    tensors (the plan of :attr:`plan`, its dtype :attr:`dtype`). Blocks of
    :data:`STRAIGHT_FROM` bytes or more on some rank are only checked at binding, never bound
    persistently: their copies in and out would cost more than the calls they save.

    Parameters
    ----------
    plan : linop.backends.mpi.plan.DistributedPlan
    inputs, outputs : sequence of str
        This rank's domain and range blocks, in the order tensors are passed and returned.
    dtypes : sequence of torch.dtype
        The inputs' dtypes (the binding is for these).
    """

    def __init__(
        self, plan: Any, inputs: Sequence[str], outputs: Sequence[str], dtypes: Sequence[torch.dtype]
    ) -> None:
        self.plan = plan
        blocks = plan.domain_blocks
        self.names = tuple(inputs)
        self.arrays = {
            name: np.zeros(blocks[name].shape, dtype=_numpy_dtype(dtype))
            for name, dtype in zip(inputs, dtypes)
        }
        # collective, as are the binding and the decision to rebind below
        if _runs_straight(plan, self.arrays.values()):
            bound = plan.bind(self.arrays, inplace=False, persistent=False)  # checked once, no buffers
        else:
            # The buffers are this object's own, refilled on each call, so the plan may
            # overwrite them: in place where domain equals range (no copy into result arrays),
            # else donated (no copy of a block before its first change).
            bound = plan.bind(self.arrays, donate=True)
            if bound.inplace and not bound.persistent:
                bound.free()
                bound = plan.bind(self.arrays, inplace=False, donate=True)
        self._bound = bound
        self.dtype = bound.dtype
        self.persistent = bool(bound.persistent)
        self.inputs = tuple(torch.from_numpy(self.arrays[name]) for name in inputs)
        self.outputs: tuple[torch.Tensor, ...] = ()
        if self.persistent:
            results = bound.arrays if bound.inplace else bound.outputs
            self.outputs = tuple(_as_view(results[name]) for name in outputs)
        self._call = self._bound.__call__

    def check_shapes(self, arrays: Any) -> None:
        """Raise :class:`StateError` unless the arrays (in the order of the inputs) have the
        domain's shapes on this rank."""
        for name, array, buffer in zip(self.names, arrays, self.inputs):
            if tuple(array.shape) != tuple(buffer.shape):
                raise StateError(
                    f"rank {self.plan.context.rank}: block {name!r} has shape {tuple(array.shape)}, the "
                    f"domain expects {tuple(buffer.shape)}"
                )

    def run(self, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Copy ``tensors`` into the bound buffers (never writing them), run the plan, and
        return :attr:`outputs` (persistent bindings only).

        Raises
        ------
        StateError
            If a tensor's shape is not its block's on this rank.
        """
        for buffer, tensor in zip(self.inputs, tensors):
            if tensor.shape != buffer.shape:
                self.check_shapes(tensors)
            buffer.copy_(tensor.detach())  # conjugate and negative bits resolved, any device
        self._call()
        return self.outputs

    def free(self) -> None:
        """Release the bound plan's persistent requests."""
        self._bound.free()


def tensors_fit(
    tensors: Sequence[torch.Tensor], dtypes: Sequence[torch.dtype], shapes: Sequence[Any] | None = None
) -> bool:
    """Whether ``tensors`` go into a binding's buffers as they are: as many as ``dtypes``, each
    a CPU tensor of its dtype (and of its shape in ``shapes``, where given)."""
    if len(tensors) != len(dtypes):
        return False
    if shapes is None:
        for tensor, dtype in zip(tensors, dtypes):
            if tensor.dtype != dtype or not tensor.is_cpu:
                return False
        return True
    for tensor, dtype, shape in zip(tensors, dtypes, shapes):
        if tensor.dtype != dtype or tensor.shape != shape or not tensor.is_cpu:
            return False
    return True


class BoundCall:
    """A runner's persistent MPI binding (:class:`BoundTensors`) as a call a module that is its
    own autograd node keeps from one call to the next (:meth:`TorchOperator.bound_call`): it
    fills :attr:`inputs` itself (straight, with ``copy_`` or ``out=``), calls this object (the
    bound call :meth:`TorchOperator.bound_views` makes, marked for the stall diagnosis alike),
    and reads :attr:`outputs` (*overwritten by the next call*) before the next.

    It stays valid while :attr:`current` (the runner has not bound again: new dtypes free the
    binding it holds); a caller tests that, and that its tensors fit (:func:`tensors_fit`:
    :attr:`dtypes` and the buffers' shapes), before each use, after :meth:`agree` when
    :attr:`blind` (a rank without inputs: the ranks agree on each call's dtypes before any
    uses the binding).

    Attributes
    ----------
    inputs, outputs : tuple of torch.Tensor
        The binding's domain buffers and result buffers (in the order of the runner's inputs
        and outputs, :meth:`TorchOperator.names`).
    dtypes : tuple of torch.dtype
        The inputs' dtypes the binding is for.
    """

    __slots__ = ("_call", "_plan", "_runner", "_state", "bound", "dtypes", "inputs", "outputs")

    def __init__(self, runner: _Runner, bound: BoundTensors) -> None:
        self._runner = runner
        self.bound = bound
        self.inputs = bound.inputs
        self.outputs = bound.outputs
        self.dtypes = runner._bound_dtypes
        self._plan = runner.plan
        # what the stall record reads of a call's state: names, dtypes and shapes, which the
        # buffers share with every tensor a caller may copy into them
        self._state = dict(zip(runner.inputs, bound.inputs))
        self._call = bound._call

    @property
    def current(self) -> bool:
        """Whether this is still the runner's binding (no rebinding since)."""
        return self._runner._bound is self.bound

    @property
    def blind(self) -> bool:
        """Whether some rank has no input blocks of the tree (each call then starts with the
        ranks' agreement on dtypes: :meth:`agree`)."""
        return bool(self._runner._blind)

    def agree(self, dtypes: Sequence[torch.dtype]) -> None:
        """The call's agreement on dtypes (:meth:`_Runner.agree`), ``dtypes`` being those of
        the inputs the tree gets this call, in the order of the runner's inputs: for a
        :attr:`blind` tree, before :attr:`current` is read. Collective."""
        runner = self._runner
        runner.agree(tuple(dtypes) != runner._bound_dtypes)

    def agree_on(self, changed: bool) -> None:
        """:meth:`agree` where the caller compared the dtypes itself: ``changed``, whether this
        rank's inputs differ from the binding's :attr:`dtypes`. Collective for a blind tree."""
        self._runner.agree(changed)

    def ran(self) -> None:
        """Mark this call run where the caller runs other calls in its place (a kept path on
        another binding): the tree's next call agrees again."""
        self._runner._agreed = False

    def __call__(self) -> None:
        self._runner._agreed = False  # the call runs
        stall = _stall("mpi")
        call = stall.enter(self._plan, "bound", self._state)
        try:
            self._call()
        finally:
            stall.leave(call)


STRAIGHT_FROM = 1 << 21
"""Bytes of one rank's domain and range blocks (2 MiB) from which a bound tree runs straight on
each call's tensors (the plan checked once, run by the host interpreter on their memory, the
results fresh arrays) instead of copying them into buffers bound with persistent requests and
the results out: on any rank, then on every rank. Measured on 4 processes on 2 cores: the
window stage of a convolution of 4 x 16 x 256 x 256 float32 per process
(``benchmarks/bench_overlap.py``), forward and backward, 34-36 ms bound, 21-23 ms straight
(15-16 ms hand-written); the halo windows of ``benchmarks/bench_mpi_torch.py``, of the
hand-written ones, 1.23-1.35x bound and 1.10-1.35x straight at N = 1024, 1.35-1.38x bound and
0.93-0.98x straight at N = 4096. Below it the bound plan's smaller per-call constant wins (its
small convolution layers)."""


def _runs_straight(plan: Any, arrays: Any) -> bool:
    """Whether any rank's blocks reach :data:`STRAIGHT_FROM` bytes (collective: the first of
    a binding, within the plan's deadline; a rank alone whose dtypes changed meets its peers
    here while they run their bound plan: at the deadline it names them and aborts the job,
    as the entry check does, instead of waiting forever)."""
    itemsize = max((a.itemsize for a in arrays), default=8)
    entries = sum(int(np.prod(b.shape)) for b in plan.domain_blocks.values())
    entries += sum(int(np.prod(plan.op.range.block(name).shape)) for name in plan.range_names)
    doing = f"binding {plan.op} for new dtypes (every rank rebinds when its dtypes change)"
    return bool(_comm_max(plan, int(entries * itemsize >= STRAIGHT_FROM), doing))


def _comm_max(plan: Any, value: int, doing: str) -> int:
    """The largest ``value`` over the ranks of an MPI plan's communicator, within the plan's
    deadline (else the job is aborted: the missing ranks may never come)."""
    from ..backends.mpi.deadline import largest_within
    from ..backends.mpi.guards import abort_for

    try:
        return largest_within(plan.comm, value, plan.deadline(), doing)
    except BaseException as error:  # PeerTimeoutError included: the missing ranks may never come
        abort_for(plan.comm, doing, error)


def _group_max(plan: Any, value: int, doing: str) -> int:
    """The largest ``value`` over the ranks of a torch.distributed plan's group (one
    all-reduce through the entry check's reducer, within the default deadline; its typed
    errors: :class:`~linop.errors.PeerTimeoutError`, :class:`~linop.errors.RankFailedError`)."""
    context = plan.context
    if context.size == 1:
        return value
    from ..backends.torch_distributed.group import resolve_timeout

    reducer = context.reducer
    if reducer is None:  # pragma: no cover - the entry check made it
        from ..backends.torch_distributed.check import TorchReducer

        reducer = context.reducer = TorchReducer(context)
    reducer.timeout = resolve_timeout(None)
    reducer.doing = doing
    return int(reducer.all_reduce(np.array([value], dtype=np.int64), "max")[0])


def _stall(engine: str) -> Any:
    """The stall module of an executor (``"torch_distributed"`` or ``"mpi"``), imported on
    its first call only: a call's marks without an import statement's work on every call."""
    found = _STALLS.get(engine)
    if found is None:
        found = _STALLS[engine] = importlib.import_module(f"..backends.{engine}.stall", __package__)
    return found


_STALLS: dict[str, Any] = {}
"""The executors' stall modules, once imported (:func:`_stall`)."""


def _as_view(array: np.ndarray) -> torch.Tensor:
    """A torch tensor sharing the memory of a bound result array (read-only when the result
    lies in another buffer: the tensor is then only read)."""
    if array.flags.writeable:
        return torch.from_numpy(array)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


_HOST = torch.device("cpu")


def _as_tensor(value: Any) -> torch.Tensor:
    """A result block as a tensor (a rank that passes no block gets numpy arrays back)."""
    if isinstance(value, torch.Tensor):
        return value
    return torch.from_numpy(np.array(value))


def _host_view(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's values as a numpy array: its own memory for a plain CPU tensor, else a host
    copy with the conjugate / negative bits resolved."""
    if tensor.device.type == "cpu" and not tensor.is_conj() and not tensor.is_neg():
        return tensor.numpy()
    return tensor.cpu().resolve_conj().resolve_neg().numpy()


def _on(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    return tensor if device.type == "cpu" else tensor.to(device)


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """numpy's dtype for ``dtype``; a :class:`~linop.errors.DtypeError` naming it where numpy
    has none (``torch.bfloat16``, the float8 types): the MPI executor runs on numpy arrays."""
    try:
        return torch.empty(0, dtype=dtype).numpy().dtype
    except TypeError as error:
        raise DtypeError(
            f"{dtype} has no numpy dtype, and the MPI executor moves numpy arrays: convert the "
            "tensors (for example to float32) before the call"
        ) from error


def _fresh(tensor: torch.Tensor, inputs: set[int]) -> torch.Tensor:
    """A result that owns its memory: blocks passed through unchanged come back from the
    interpreter as the (detached) input tensors, which an autograd Function must not return
    as new results (a later in-place change of one would change the other)."""
    return tensor.clone() if tensor.numel() and tensor.data_ptr() in inputs else tensor


class _OperatorFunction(torch.autograd.Function):
    """forward(runner, anchor, owner, *inputs) = A x; backward = A^* applied through the adjoint
    runner, by this same Function, so that the backward is differentiable. Under MPI or a
    process group (``anchor`` given) the last output is the call's token; a backward recorded
    under ``create_graph`` is itself such a call, and its token becomes ``owner.token`` (the
    :class:`TorchOperator` whose call this is): a process whose second-order loss does not
    depend on the recorded adjoint adds it, so that the adjoint's own backward, collective,
    runs on every process."""

    @staticmethod
    def forward(
        ctx: Any,
        runner: _Runner,
        anchor: torch.Tensor | None,
        owner: TorchOperator | None,
        *tensors: torch.Tensor,
    ) -> Any:
        ctx.runner = runner
        ctx.anchor = anchor
        ctx.owner = None if owner is None else weakref.ref(owner)  # its token may hold this node: no cycle
        ctx.inputs = [(t.dtype, t.device, t.shape) for t in tensors]
        outputs = runner.run(tensors)
        if anchor is not None:  # under MPI: the token, an empty output every rank can use
            outputs = (*outputs, torch.zeros(0, dtype=torch.float64))
        return outputs if len(outputs) != 1 else outputs[0]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        adjoint = ctx.runner.adjoint
        if ctx.anchor is not None:
            grads = grads[:-1]  # the token's
        owner = None if ctx.owner is None else ctx.owner()
        back = _OperatorFunction.apply(adjoint, ctx.anchor, owner, *grads)
        if not isinstance(back, tuple):
            back = (back,)
        if ctx.anchor is not None:
            *back, token = back
            if owner is not None and torch.is_grad_enabled():  # create_graph: the recorded adjoint's
                owner.token = token
        fitted = [fitted_gradient(g, dtype, device) for g, (dtype, device, _shape) in zip(back, ctx.inputs)]
        return (None, None, None, *fitted)  # the anchor's gradient: none (it only ties the graph)


class TorchOperator:
    """A tree as a differentiable PyTorch function of states (dicts of tensors).

    ``f(state)`` returns ``op(state)`` as tensors; gradients flow back through ``op.H``. Under
    MPI (``comm`` given) every rank passes its own blocks and gets its own blocks back.

    Parameters
    ----------
    op : LinearOperator
    comm : mpi4py communicator, optional
        Run across its ranks (every rank must build the same tree and call collectively).
    dtype : dtype, optional
        Dtype of blocks the tree allocates (numpy's or torch's); default the inputs' dtype.
    mapping : WorkerMap, sequence or dict, optional
        Under MPI or a process group, the rank of each worker (default worker ``w`` on rank
        ``w``; see :func:`linop.backends.mpi.plan_for`).
    group : torch.distributed ProcessGroup or True, optional
        Run across the ranks of this process group (``True``: the world group) with the
        torch.distributed executor (:mod:`linop.backends.torch_distributed`).

    Raises
    ------
    ProcessGroupArgumentError
        Both ``comm`` and ``group`` given, or ``group`` not a process group.
    ProcessGroupError
        This rank is not a member of ``group``; or, at the first call on every rank, ``group``
        has fewer ranks than the tree's workers (as the executor's ``apply`` raises it).
    DistributedStateError
        At the first call on a process group, some rank's blocks are missing, extra or wrongly
        shaped: on every rank, naming that rank (the executor's entry check).
    StateError
        A call's state is not a dict of this process's blocks (on a process group after the
        first call: reported to the group's store first, see the module docstring).

    Attributes
    ----------
    inputs, outputs : tuple of str
        The block names this process passes in and gets back (all of them in one process;
        this rank's under MPI), in the order of :meth:`tensors`.
    """

    def __init__(
        self,
        op: LinearOperator,
        *,
        comm: Any = None,
        dtype: Any = None,
        mapping: Any = None,
        group: Any = None,
    ) -> None:
        if isinstance(dtype, torch.dtype):
            dtype = _numpy_dtype(dtype)
        self.op = op
        self.comm = comm
        self.mapping = mapping
        self._runner = _Runner(op, comm, dtype, mapping, group)
        self.group = self._runner.group
        self.inputs = self._runner.inputs
        self.outputs = self._runner.outputs
        self._anchor = collective_anchor(comm, self.group)
        self.token = torch.zeros(0, dtype=torch.float64)

    @property
    def H(self) -> TorchOperator:  # noqa: N802 - the conventional name
        """The adjoint, wrapped alike."""
        return TorchOperator(
            self.op.H, comm=self.comm, dtype=self._runner.dtype, mapping=self.mapping, group=self.group
        )

    @property
    def group_problem(self) -> LinopError | None:
        """On a process group, why the tree cannot run on it (a group smaller than the tree, a
        bad map: what the first call raises on every rank); None where it can, or off a group."""
        plan = self._runner.torch_plan
        return None if plan is None else plan.problem

    def refuse(self, error: LinopError, state: Any) -> NoReturn:
        """Raise ``error``, found by a caller's own check of the state it was about to pass:
        on a process group through the executor's collective check first when the peers are in
        it (the first call, or a problem of the group), else reported to the group's store (see
        the module docstring)."""
        self._runner.refuse(error, state)

    def untracked(
        self, state: Mapping[str, torch.Tensor], *, adjoint: bool = False
    ) -> dict[str, torch.Tensor]:
        """``op(state)`` (or ``op.H(state)`` with ``adjoint=True``) on this process's tensors,
        without recording autograd: for code that is itself an autograd node and runs trees
        inside its forward and backward (:class:`linop.frameworks.torch_layers.LayerModule`).
        Under MPI it is collective, on the same bound plans as the tracked calls.

        Raises
        ------
        StateError
            If a block of this process's domain is missing from ``state``.
        """
        runner = self._runner.adjoint if adjoint else self._runner
        plan = runner.torch_plan
        try:
            tensors = [state[name] for name in runner.inputs]
        except (KeyError, TypeError):
            tensors = None
        if tensors is None or (plan is not None and plan.problem is not None):
            missing = [name for name in runner.inputs if name not in state]
            runner.refuse(StateError(f"state for {runner.op}: missing block(s) {missing}"), state)
        return dict(zip(runner.outputs, runner.run(tensors)))

    def bound_tensors(self, dtypes: Sequence[torch.dtype], *, adjoint: bool = False) -> BoundTensors | None:
        """Under MPI, the tree's (``adjoint=True``: its adjoint's) plan bound on buffers this
        function owns, for inputs of these dtypes in the order of the runner's inputs
        (:class:`BoundTensors`; collective when it binds); None in one process or on a process
        group. The untracked and tracked calls of this function use the same binding.

        For a tree that leaves some rank without input blocks (:meth:`blind`) this is also the
        call's agreement on dtypes (:meth:`_Runner.agree`: collective), so a caller asks for
        the binding once per call, on every rank, and runs it at once."""
        runner = self._runner.adjoint if adjoint else self._runner
        if runner.plan is None:
            return None
        if runner._blind:
            runner.agree(tuple(dtypes) != runner._bound_dtypes)
            runner._agreed = False  # the caller runs the call now
        return runner.bound_tensors(dtypes)

    def mark_agreed(self, *, adjoint: bool = False) -> None:
        """Under MPI, count this call's agreement on dtypes as made, for a caller that made it
        through :meth:`bound_tensors` and runs the call through :meth:`untracked` (a binding
        that is not persistent), so that the call makes one, not two."""
        runner = self._runner.adjoint if adjoint else self._runner
        runner._agreed = bool(runner._blind)

    def blind(self, *, adjoint: bool = False) -> bool:
        """Under MPI or on a process group, whether the tree (``adjoint=True``: its adjoint)
        leaves some rank without input blocks, as the ranks agreed at its first binding (False
        before it): each of its calls then starts with the ranks' agreement on dtypes."""
        runner = self._runner.adjoint if adjoint else self._runner
        return bool(runner._blind)

    def bound_views(
        self, tensors: Sequence[torch.Tensor], *, adjoint: bool = False
    ) -> tuple[torch.Tensor, ...] | None:
        """Under MPI, the tree (``adjoint=True``: its adjoint) on ``tensors`` (in the order of
        its inputs, :meth:`names`) through the persistent binding an earlier call made for
        their dtypes, when there is one and every tensor is a CPU tensor of its block's shape:
        the results are the binding's result buffers (:attr:`BoundTensors.outputs`),
        *overwritten by the next call* (a caller consumes or copies them first). Otherwise
        None, and nothing is run: the caller takes :meth:`untracked` (for a tree that leaves a
        rank without inputs, after the call's agreement on dtypes made here, which that call
        finds made: :meth:`_Runner.agree`). The call is the bound call :meth:`untracked` makes
        (marked for the stall diagnosis alike), less its per-call bookkeeping and the copies
        of the results."""
        runner = self._runner.adjoint if adjoint else self._runner
        if runner.plan is None:
            return None
        if runner._blind:
            runner.agree(tuple([t.dtype for t in tensors]) != runner._bound_dtypes)
        bound = runner._bound
        if bound is None or not bound.persistent:
            return None
        if not tensors_fit(tensors, runner._bound_dtypes, [buffer.shape for buffer in bound.inputs]):
            return None
        runner._agreed = False  # the call runs
        stall = _stall("mpi")
        call = stall.enter(runner.plan, "bound", dict(zip(runner.inputs, tensors)))
        try:
            return bound.run(tensors)
        finally:
            stall.leave(call)

    def bound_call(self, *, adjoint: bool = False) -> BoundCall | None:
        """Under MPI, the persistent binding an earlier call of the tree (``adjoint=True``: of
        its adjoint) made, as a :class:`BoundCall` a module keeps and runs on its own buffers
        while it is :attr:`~BoundCall.current`; None where there is none (one process, a process
        group, no call yet, a binding that runs straight on each call's tensors)."""
        runner = self._runner.adjoint if adjoint else self._runner
        bound = runner._bound
        if runner.plan is None or bound is None or not bound.persistent:
            return None
        return BoundCall(runner, bound)

    def bound_dtype(self, *, adjoint: bool = False) -> np.dtype | None:
        """Under MPI or on a process group, the dtype the tree's (``adjoint=True``: its
        adjoint's) current binding runs in, agreed by every rank when it bound (None where
        there is none, and in one process)."""
        runner = self._runner.adjoint if adjoint else self._runner
        bound = runner._bound
        return None if bound is None else np.dtype(bound.dtype)

    def unbind_unless(self, dtype: np.dtype | torch.dtype, *, adjoint: bool = False) -> None:
        """Under MPI or on a process group, free the tree's (``adjoint=True``: its adjoint's)
        binding unless it runs in ``dtype``, so that its next call binds again (collective
        then); that call makes no agreement on dtypes of its own (:meth:`_Runner.agree`).
        For a module whose ranks all know a call's dtype while some have no input to the
        tree (a broadcast's ranks other than its root): every rank calls this alike, before
        the call, with a dtype every rank agrees on (another binding's :meth:`bound_dtype`),
        and the ranks bind again together, with nothing sent. Nothing happens in one
        process."""
        runner = self._runner.adjoint if adjoint else self._runner
        bound = runner._bound
        if bound is None:
            return
        if isinstance(dtype, torch.dtype):
            dtype = _numpy_dtype(dtype)
        if np.dtype(bound.dtype) != dtype:
            runner._unbind()
        runner._agreed = bool(runner._blind)  # every rank decided alike: the call's agreement

    def names(self, *, adjoint: bool = False) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The block names this process passes in and gets back, of the tree or its adjoint."""
        runner = self._runner.adjoint if adjoint else self._runner
        return runner.inputs, runner.outputs

    def tensors(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Apply to tensors given positionally in the order of :attr:`inputs`; the results in
        the order of :attr:`outputs` (for ``gradcheck`` and other positional APIs)."""
        runner = self._runner
        if len(tensors) != len(self.inputs):
            runner.refuse(
                StateError(
                    f"{self.op} takes {len(self.inputs)} tensor(s) {list(self.inputs)} here, not {len(tensors)}"
                ),
                dict(zip(self.inputs, tensors)),
            )
        for name, tensor in zip(self.inputs, tensors):
            if not isinstance(tensor, torch.Tensor):
                runner.refuse(
                    StateError(f"block {name!r} must be a torch tensor, not {type(tensor).__name__}"),
                    dict(zip(self.inputs, tensors)),
                )
        result = _OperatorFunction.apply(self._runner, self._anchor, self, *tensors)
        result = result if isinstance(result, tuple) else (result,)
        if self._anchor is not None:
            *result, self.token = result
        return tuple(result)

    def state_tensors(self, state: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The tensors of ``state`` in the order of :attr:`inputs`, after the checks a call makes
        before any communication (for a module that is its own autograd node and runs this
        function :meth:`untracked` inside it).

        Raises
        ------
        StateError
            ``state`` is not a dict of tensors keyed by this process's block names (on a process
            group reported first, see :meth:`refuse`).
        """
        if not isinstance(state, Mapping):
            self._runner.refuse(
                StateError(
                    f"a state must be a dict of tensors keyed by block name, not {type(state).__name__}"
                ),
                state,
            )
        missing = [name for name in self.inputs if name not in state]
        extra = [name for name in state if name not in self.inputs]
        if missing or extra:
            self._runner.refuse(
                StateError(
                    f"state for {self.op}: missing block(s) {missing}, unexpected block(s) {extra}"
                    + (
                        " (across ranks pass only this rank's blocks)"
                        if self.comm is not None or self.group is not None
                        else ""
                    )
                ),
                state,
            )
        tensors = tuple(state[name] for name in self.inputs)
        for name, tensor in zip(self.inputs, tensors):
            if not isinstance(tensor, torch.Tensor):
                self._runner.refuse(
                    StateError(f"block {name!r} must be a torch tensor, not {type(tensor).__name__}"),
                    dict(state),
                )
        return tensors

    def run_in_place(self, buffers: dict[str, torch.Tensor], *, adjoint: bool = False) -> None:
        """On a process group, apply the tree (``adjoint=True``: its adjoint), whose domain is
        its range (a halo exchange), in place to ``buffers``: this process's blocks, CPU
        tensors a module owns and passes again on every call. The plan is bound on them on the
        first call and whenever another dict is passed (collective then, with the entry
        check's errors on every rank), then each call runs the bound plan on their memory
        without recording autograd (prepared once: a halo exchange's phases start straight on
        the group). Errors as the other calls on a process group.

        Raises
        ------
        StateError
            Off a process group (MPI and one process have no such binding here).
        """
        runner = self._runner.adjoint if adjoint else self._runner
        if runner.torch_plan is None:
            raise StateError(f"run_in_place runs {self.op} on a process group only")
        runner.run_in_place(buffers)

    def binding(self, *, adjoint: bool = False) -> Any:
        """The tree's (``adjoint=True``: its adjoint's) current binding, an opaque object that
        a new binding replaces (None before the first, in one process, and once freed): a
        caller keeps what it built on it while this stays the same object."""
        return (self._runner.adjoint if adjoint else self._runner)._bound

    def largest(self, value: int, doing: str) -> int:
        """Under MPI, the largest ``value`` over the ranks of the tree's communicator, within
        its plan's deadline (else the job is aborted, naming ``doing``: collective); ``value``
        in one process or on a process group."""
        plan = self._runner.plan
        return value if plan is None else _comm_max(plan, value, doing)

    def agree_changed(self, changed: bool, *, adjoint: bool = False) -> bool:
        """On a process group, whether any rank says ``changed`` (one all-reduce, ``MAX``, on
        the tree's group: collective). For a caller that keeps blocks per dtype for a tree run
        in place (:meth:`run_in_place`) which leaves some rank without blocks: that rank cannot
        see its peers' calls change dtype, so every rank says whether its own did, on every
        call, and all bind again together. ``changed`` itself elsewhere (nothing sent)."""
        runner = self._runner.adjoint if adjoint else self._runner
        plan = runner.torch_plan
        if plan is None:
            return changed
        doing = f"agreeing whether the blocks of {self.op} change dtype (a rank has none of them)"
        return bool(_group_max(plan, int(changed), doing))

    def adjoint_tensors(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``op.H`` of tensors given in the order of the adjoint's inputs (:meth:`names` with
        ``adjoint=True``), on this function's own adjoint runner (its bound plans), recorded by
        autograd when grad mode is on: the differentiable backward of a module that is its own
        autograd node, under ``create_graph``.

        Under MPI or a process group the call is collective, and so is its backward (``op``
        again, in a second-order backward): its empty token becomes :attr:`token`, as a
        forward call's does, for the module to pass on (a process whose second-order loss does
        not depend on this call's outputs adds ``token.sum()`` to it, so that it runs that
        backward with its peers instead of leaving them waiting)."""
        result = _OperatorFunction.apply(self._runner.adjoint, self._anchor, self, *tensors)
        result = result if isinstance(result, tuple) else (result,)
        if self._anchor is None:
            return tuple(result)
        *outputs, self.token = result
        return tuple(outputs)

    def __call__(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return dict(zip(self.outputs, self.tensors(*self.state_tensors(state))))

    def __repr__(self) -> str:
        if self.group is not None:
            where = f", on {self._runner.torch_plan.context.size} torch.distributed rank(s)"
        else:
            where = "" if self.comm is None else f", on {self.comm.size} MPI rank(s)"
        return f"TorchOperator({self.op}{where})"


def function(
    op: LinearOperator, *, comm: Any = None, dtype: Any = None, mapping: Any = None, group: Any = None
) -> TorchOperator:
    """Wrap ``op`` as a differentiable function of dicts of tensors; see :class:`TorchOperator`
    (``comm=``: across MPI ranks; ``group=``: across a torch.distributed process group)."""
    return TorchOperator(op, comm=comm, dtype=dtype, mapping=mapping, group=group)


def apply(
    op: LinearOperator, state: Mapping[str, torch.Tensor], *, dtype: Any = None
) -> dict[str, torch.Tensor]:
    """``op(state)`` for tensors, differentiable (what ``op(state)`` does when a tensor
    requires a gradient)."""
    return TorchOperator(op, dtype=dtype)(state)


class OperatorModule(torch.nn.Module):
    """A tree as an ``nn.Module``: ``module(state)`` is ``op(state)``, differentiable.

    It holds no parameters of its own (a tree holds no data); compose it with modules that
    do. Under MPI (``comm`` given) or on a process group (``group`` given) the forward and
    backward plans are compiled once, at construction, and bound on the first call.
    """

    def __init__(
        self,
        op: LinearOperator,
        *,
        comm: Any = None,
        dtype: Any = None,
        mapping: Any = None,
        group: Any = None,
    ) -> None:
        super().__init__()
        self.function = TorchOperator(op, comm=comm, dtype=dtype, mapping=mapping, group=group)

    @property
    def op(self) -> LinearOperator:
        """The wrapped tree."""
        return self.function.op

    def forward(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.function(state)

    def extra_repr(self) -> str:
        return str(self.op)
