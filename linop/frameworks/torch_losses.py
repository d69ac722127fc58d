r"""Distributed losses (:class:`linop.layers.Loss`) as a PyTorch module.

Each process computes the sums of its blocks' elementwise terms with torch's own functional
loss (``reduction="sum"``; its autograd gives the local derivative), and the partial sums go
through the layer's sum-reduce tree as a :class:`~linop.frameworks.torch_function.TorchOperator`,
whose backward is the tree's adjoint, the broadcast of the loss's gradient:

.. math::

    L = s\, R\, p, \qquad \bar p = R^{*} (s \bar L) = B (s \bar L)

The root gets the loss; every other process gets a zero scalar tied into the same graph (the
call's token), so that ``loss.backward()`` on every process runs the collective backward: the
gradient a non-root process seeds is not used (the loss does not depend on it).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import LayerError, StateError
from ..layers.losses import Loss
from .torch_function import TorchOperator, engine_arguments
from .torch_placement import Placement, workers_of

__all__ = ["LossModule", "local_loss"]

Tensor = torch.Tensor


def local_loss(layer: Loss, x: Tensor, target: Tensor, reduction: str) -> Tensor:
    """torch's functional loss of ``layer.kind`` with ``layer``'s options on one block."""
    f = torch.nn.functional
    kind, options = layer.kind, layer.options
    if kind == "l1":
        return f.l1_loss(x, target, reduction=reduction)
    if kind == "mse":
        return f.mse_loss(x, target, reduction=reduction)
    if kind == "poisson_nll":
        return f.poisson_nll_loss(
            x,
            target,
            log_input=options["log_input"],
            full=options["full"],
            eps=options["eps"],
            reduction=reduction,
        )
    if kind == "bce":
        return f.binary_cross_entropy(x, target, reduction=reduction)
    if kind == "bce_with_logits":
        return f.binary_cross_entropy_with_logits(x, target, reduction=reduction)
    if kind == "kl_div":
        return f.kl_div(x, target, reduction=reduction, log_target=options["log_target"])
    raise LayerError(f"LossModule: unknown kind {kind!r}")  # pragma: no cover - Loss checked it


class LossModule(torch.nn.Module):
    """A distributed :class:`linop.layers.Loss` as an ``nn.Module``.

    ``module(x_blocks, target_blocks)`` takes this process's blocks of the prediction and the
    target (dicts by x's block names). With a reduction (``sum``, ``mean``, ``batchmean``) it
    returns a 0-d tensor: on the process of :attr:`root` the loss, equal to torch's loss of the
    gathered tensors; on every other process a zero scalar (not the loss) whose ``backward()``
    runs that process's part of the collective backward (call it on every process). With
    ``"none"`` it returns this process's blocks of the elementwise terms (by ``layer.y``'s
    names), no communication.

    Parameters
    ----------
    layer : Loss
    comm : mpi4py communicator, optional
        Run across its ranks.
    group : torch.distributed ProcessGroup or True, optional
        Run across the ranks of this process group (``True``: the world group); not with
        ``comm``.
    mapping : WorkerMap, sequence of int or dict of int to int, optional
        Across processes, the rank of each worker of x's partition and of the root (default
        worker ``w`` on rank ``w``), as the executors' ``mapping=``
        (:func:`linop.backends.mpi.plan_for`): this process passes the blocks of the workers
        on its rank, and the rank of the root worker gets the loss. Not used in one process.

    Attributes
    ----------
    input_names : tuple of str
        The blocks of x (and of the target) this process passes in.
    root : int
        The rank that gets the loss: the root worker's (``layer.root`` without a map).
    is_root : bool
        Whether this process gets the loss (always in one process).

    Raises
    ------
    LayerError
        If ``layer`` is not a Loss.
    WorkerMapError, WorkerMapMismatchError
        A bad ``mapping``, as :class:`~linop.frameworks.torch_windows.BlockModule`.
    """

    def __init__(self, layer: Loss, *, comm: Any = None, group: Any = None, mapping: Any = None) -> None:
        super().__init__()
        engine_arguments(comm, group)
        if not isinstance(layer, Loss):
            raise LayerError(f"LossModule takes a Loss layer, not {type(layer).__name__}")
        self.layer = layer
        tree = None if layer.reduction == "none" else layer.reduction_operator
        placement = Placement(mapping, comm, group, {*layer.x.space.workers, layer.root, *workers_of(tree)})
        self.placement = placement
        self.input_names = tuple(b.name for b in layer.x.blocks if placement.holds(b.worker))
        self.root = placement.rank_of(layer.root)
        self.is_root = placement.rank is None or placement.rank == self.root
        self.reduce = (
            None if tree is None else TorchOperator(tree, comm=comm, group=group, mapping=placement.map)
        )

    def forward(self, x: Mapping[str, Tensor], target: Mapping[str, Tensor]) -> Any:
        for what, state in (("input", x), ("target", target)):
            if not isinstance(state, Mapping) or set(state) != set(self.input_names):
                given = sorted(state) if isinstance(state, Mapping) else type(state).__name__
                raise StateError(
                    f"{self.layer.kind} loss: the {what} takes blocks {list(self.input_names)}, not {given}"
                )
            for name in self.input_names:
                expected = self.layer.x.space[name].shape
                if tuple(state[name].shape) != expected:
                    raise StateError(
                        f"{self.layer.kind} loss: the {what}'s block {name!r} has shape "
                        f"{tuple(state[name].shape)}, expected {expected}"
                    )
        layer = self.layer
        if self.reduce is None:
            return {
                layer.output_name(n): local_loss(layer, x[n], target[n], "none") for n in self.input_names
            }
        partials = {
            layer.partial_name(n): local_loss(layer, x[n], target[n], "sum").reshape(1)
            for n in self.input_names
        }
        if partials:  # one dtype for the tree (a float32 block next to a float64 one)
            dtype = functools.reduce(torch.promote_types, [t.dtype for t in partials.values()])
            partials = {n: t.to(dtype) for n, t in partials.items()}
        result = self.reduce(partials)
        token = self.reduce.token.sum()
        total = result.get(layer.total_name)
        if total is None:
            return token
        return total.reshape(()) * layer.scale + token.to(total.dtype)

    def extra_repr(self) -> str:
        layer = self.layer
        return f"{layer.kind}, reduction={layer.reduction!r}, root={layer.root}, {layer.x.space}"
