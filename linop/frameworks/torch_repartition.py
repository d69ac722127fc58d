r"""A repartition between two layouts of one tensor, as a PyTorch module: :class:`Repartition`.

Between two layers whose partitions differ (a convolution on spatial workers, an affine map on
feature workers), the tensor is re-decomposed: :class:`linop.Repartition` :math:`T`, a
permutation of the entries, so :math:`T^{*} = T^{-1}` is the reverse repartition. The module is
that tree as one autograd node per call: forward :math:`y = T x`, backward
:math:`\bar x = T^{*} \bar y` (the reverse repartition of the gradient), each the tree's (or
its adjoint's) bound plan run untracked inside the node (recorded by autograd under
``create_graph``, so the backward is differentiable again).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..partition import DistributedTensor
from ..repartition import Repartition as RepartitionOperator
from .torch_function import BoundCall, fitted_gradient, owned_gradient, tensors_fit
from .torch_windows import BlockModule

__all__ = ["Repartition"]


class Repartition(BlockModule):
    r"""Re-decompose a distributed tensor from ``source``'s layout to ``destination``'s:
    ``module(x)`` takes this process's blocks of ``source`` (a dict of tensors) and returns its
    blocks of ``destination``; gradients flow back through the reverse repartition.

    Parameters
    ----------
    source, destination : DistributedTensor
        Two layouts of the same global shape (any partitions and shares, empty ones
        included), with different names.
    comm, group, mapping
        As :class:`~linop.frameworks.torch_windows.BlockModule` (so are ``input_names``,
        ``output_names``, ``token`` and ``function``): ``mapping`` places the workers of both
        partitions on the ranks (one map for both: this process passes the source blocks and
        gets back the destination blocks of the workers on its rank).

    Attributes
    ----------
    operator : linop.Repartition
        The tree run here (``operator.H``: the reverse repartition).

    Raises
    ------
    GlobalShapeError, BlockExistsError
        As :class:`linop.Repartition`.
    WorkerMapError, WorkerMapMismatchError
        A bad ``mapping``, as :class:`~linop.frameworks.torch_windows.BlockModule`.
    """

    def __init__(
        self,
        source: DistributedTensor,
        destination: DistributedTensor,
        *,
        comm: Any = None,
        group: Any = None,
        mapping: Any = None,
    ) -> None:
        operator = RepartitionOperator(source, destination)
        super().__init__(operator, comm=comm, group=group, mapping=mapping)
        self.source, self.destination = source, destination
        self.operator = operator
        # under MPI, the bound calls kept from one call to the next, forward and reverse (_Kept)
        self._kept: list[_Kept | None] = [None, None]

    def forward(self, x: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self._outputs(_RepartitionFunction.apply(self, self._anchor, *self.tensors_of(x)))

    def extra_repr(self) -> str:
        return f"{self.source} -> {self.destination}"


class _RepartitionFunction(torch.autograd.Function):
    r"""forward(module, anchor, \*x blocks) -> (\*y blocks, token): :math:`y = T x`, the tree's
    bound plan run untracked; backward :math:`\bar x = T^{*} \bar y`, its adjoint's (recorded
    under ``create_graph``)."""

    @staticmethod
    def forward(ctx: Any, module: Repartition, anchor: torch.Tensor | None, *tensors: torch.Tensor) -> Any:
        ctx.module = module
        ctx.fit = [(t.dtype, t.device) for t in tensors]
        return (*_moved(module, tensors), torch.zeros(0, dtype=torch.float64))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        module = ctx.module
        kept = module._kept[1]
        grads = grads[:-1]  # the token's is not used
        if kept is not None and not torch.is_grad_enabled():
            ordered = [grads[i] for i in kept.order] if kept.order is not None else grads
            if kept.takes(ordered):  # the reverse repartition through the kept binding
                kept.fill(ordered)
                back = kept.outputs
                if kept.back is not None:
                    back = tuple([back[i] for i in kept.back])
                return (None, None, *[owned_gradient(view, *fit) for view, fit in zip(back, ctx.fit)])
        function = module.function
        inputs, outputs = function.names(adjoint=True)
        given = dict(zip(module.output_names, grads))
        ordered = [given[name] for name in inputs]
        if torch.is_grad_enabled():  # create_graph: the reverse repartition recorded too
            adjoint = dict(zip(outputs, function.adjoint_tensors(*ordered)))
            if module._anchor is not None:  # its token, the module's now (for the next loss)
                module.__dict__["_token"] = function.token
        else:
            adjoint = dict(zip(outputs, _moved(module, ordered, adjoint=True)))
        fitted = [fitted_gradient(adjoint[name], *fit) for name, fit in zip(module.input_names, ctx.fit)]
        return (None, None, *fitted)  # the anchor's gradient: none (it only ties the graph)


class _Kept:
    """Under MPI, a direction's bound call (:class:`~linop.frameworks.torch_function.BoundCall`)
    kept from one call to the next: a call whose tensors have its dtypes and its buffers'
    shapes, on the CPU, while the binding is current, is copied into its buffers and run with
    no per-call bookkeeping (else the general path, which binds again where dtypes changed).
    ``order``: the positions, among the tensors the module has (its output blocks' gradients,
    in :attr:`~Repartition.output_names` order), of the direction's inputs (None: the same);
    ``back``: the positions, among the direction's outputs, of the module's input blocks'
    gradients (None: the same)."""

    __slots__ = ("back", "call", "order", "outputs", "shapes")

    def __init__(self, call: BoundCall, order: list[int] | None, back: list[int] | None) -> None:
        self.call = call
        self.outputs = call.outputs
        self.shapes = tuple(buffer.shape for buffer in call.inputs)
        self.order = order
        self.back = back

    @classmethod
    def of(cls, module: Repartition, adjoint: bool) -> _Kept | None:
        """The function's current binding in that direction, or None where there is none."""
        function = module.function
        call = function.bound_call(adjoint=adjoint)
        if call is None:
            return None
        if not adjoint:
            return cls(call, None, None)
        inputs, outputs = function.names(adjoint=True)
        order = [module.output_names.index(name) for name in inputs]
        back = [outputs.index(name) for name in module.input_names]
        return cls(
            call,
            None if order == list(range(len(module.output_names))) else order,
            None if back == list(range(len(outputs))) else back,
        )

    def takes(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether ``tensors`` (the direction's inputs, in order) go through the kept binding
        (after the call's agreement on dtypes where a rank has no inputs:
        :meth:`~linop.frameworks.torch_function.BoundCall.agree`)."""
        call = self.call
        if call.blind:
            call.agree([t.dtype for t in tensors])
        return call.current and tensors_fit(tensors, call.dtypes, self.shapes)

    def fill(self, tensors: Sequence[torch.Tensor]) -> None:
        """Copy ``tensors`` into the binding's buffers and run it (:attr:`outputs` then hold the
        results, until the next call)."""
        for buffer, tensor in zip(self.call.inputs, tensors):
            buffer.copy_(tensor)
        self.call()


def _moved(
    module: Repartition, tensors: Sequence[torch.Tensor], *, adjoint: bool = False
) -> tuple[torch.Tensor, ...]:
    """The tree (``adjoint=True``: the reverse repartition) on this process's blocks, in the
    order of the direction's inputs: its output blocks in their order, tensors of their own,
    untracked. Under MPI through the binding's result buffers, copied: the kept bound call
    (:class:`_Kept`) where it takes the tensors, else
    (:meth:`~linop.frameworks.torch_function.TorchOperator.bound_views`: the bound call without
    the untracked call's bookkeeping) where the binding allows, then kept; else untracked."""
    kept = None if adjoint else module._kept[0]  # the backward tries its kept call itself
    if kept is not None and kept.takes(tensors):
        kept.fill(tensors)
        return tuple([view.clone() for view in kept.outputs])
    function = module.function
    views = function.bound_views(tensors, adjoint=adjoint) if module.comm is not None else None
    if views is not None:
        result = tuple([view.clone() for view in views])
    else:
        inputs, outputs = function.names(adjoint=adjoint)
        moved = function.untracked(dict(zip(inputs, tensors)), adjoint=adjoint)
        result = tuple([moved[name] for name in outputs])
    held = module._kept[adjoint]
    if module.comm is not None and (held is None or not held.call.current):  # (else still kept)
        module._kept[adjoint] = _Kept.of(module, adjoint)
    return result
