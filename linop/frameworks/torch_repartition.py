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
from .torch_function import fitted_gradient
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
        function = module.function
        grads = grads[:-1]  # the token's is not used
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


def _moved(
    module: Repartition, tensors: Sequence[torch.Tensor], *, adjoint: bool = False
) -> tuple[torch.Tensor, ...]:
    """The tree (``adjoint=True``: the reverse repartition) on this process's blocks, in the
    order of the direction's inputs: its output blocks in their order, tensors of their own,
    untracked. Under MPI through the binding's result buffers, copied
    (:meth:`~linop.frameworks.torch_function.TorchOperator.bound_views`: the bound call without
    the untracked call's bookkeeping), where the binding allows; else untracked."""
    function = module.function
    views = function.bound_views(tensors, adjoint=adjoint) if module.comm is not None else None
    if views is not None:
        return tuple([view.clone() for view in views])
    inputs, outputs = function.names(adjoint=adjoint)
    result = function.untracked(dict(zip(inputs, tensors)), adjoint=adjoint)
    return tuple([result[name] for name in outputs])
