r"""Distributed losses (:class:`linop.layers.Loss`) as a PyTorch module.

Each process computes the sums of its blocks' elementwise terms with torch's own functional
loss (``reduction="sum"``; its autograd gives the local derivative), and the partial sums go
through the layer's sum-reduce tree in one autograd node of this module's (the tree's bound
plans of a :class:`~linop.frameworks.torch_function.TorchOperator` run untracked inside it),
whose backward is the tree's adjoint, the broadcast of the scaled gradient of the loss:

.. math::

    L = s\, R\, p, \qquad \bar p = R^{*} (s \bar L) = B (s \bar L)

The root gets the loss; every other process gets a zero scalar tied into the same graph (the
call's token), so that ``loss.backward()`` on every process runs the collective backward: the
gradient a non-root process seeds is not used (the loss does not depend on it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..errors import LayerError, StateError
from ..layers.losses import Loss
from .torch_function import (
    BoundCall,
    TorchOperator,
    collective_anchor,
    engine_arguments,
    fitted_gradient,
    owned_gradient,
    tensors_fit,
)
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
    token : torch.Tensor or None
        Across processes, after a backward under ``create_graph``: an empty output of that
        recorded backward (the broadcast), whose own backward (a sum-reduce) is collective. A
        process whose second-order loss does not depend on its input gradients adds
        ``module.token.sum()`` to that loss, so that it runs its part. None before.

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
        placement = Placement(
            mapping, comm, group, lambda: {*layer.x.space.workers, layer.root, *workers_of(tree)}
        )
        self.placement = placement
        self.input_names = tuple(layer.x.block_name(g) for g in placement.held(layer.x.partition))
        self.root = placement.rank_of(layer.root)
        self.is_root = placement.rank is None or placement.rank == self.root
        self.reduce = (
            None if tree is None else TorchOperator(tree, comm=comm, group=group, mapping=placement.map)
        )
        self._shapes = tuple(tuple(layer.x.space[n].shape) for n in self.input_names)
        self._partial_names = tuple(layer.partial_name(n) for n in self.input_names)
        self._total_name = "" if tree is None else layer.total_name
        self._anchor = collective_anchor(comm, group)  # ties every process's output to the graph
        self._scale = layer.scale
        # under MPI, the bound calls kept from one call to the next (_ReduceFunction)
        self._kept_reduce: _Kept | None = None
        self._kept_broadcast: _Kept | None = None
        self.token: Tensor | None = None

    def forward(self, x: Mapping[str, Tensor], target: Mapping[str, Tensor]) -> Any:
        names, shapes = self.input_names, self._shapes
        if not (
            type(x) is dict
            and type(target) is dict
            and len(x) == len(names)
            and len(target) == len(names)
            and all(
                type(x.get(n)) is Tensor
                and type(target.get(n)) is Tensor
                and x[n].shape == shape == target[n].shape
                for n, shape in zip(names, shapes)
            )
        ):
            self._check(x, target)
        layer = self.layer
        if self.reduce is None:
            return {
                layer.output_name(n): local_loss(layer, x[n], target[n], "none") for n in self.input_names
            }
        partials = [local_loss(layer, x[n], target[n], "sum") for n in self.input_names]
        return _ReduceFunction.apply(self, self._anchor, *partials)

    def _check(self, x: Any, target: Any) -> None:
        """The checks of a call's blocks (names and shapes) with their errors.

        Raises
        ------
        StateError
            The input or the target is not a dict of this process's blocks, or a block has
            another shape than the layer's.
        """
        for what, state in (("input", x), ("target", target)):
            if not isinstance(state, Mapping) or set(state) != set(self.input_names):
                given = sorted(state) if isinstance(state, Mapping) else type(state).__name__
                raise StateError(
                    f"{self.layer.kind} loss: the {what} takes blocks {list(self.input_names)}, not {given}"
                )
            for name, expected in zip(self.input_names, self._shapes):
                if tuple(state[name].shape) != expected:
                    raise StateError(
                        f"{self.layer.kind} loss: the {what}'s block {name!r} has shape "
                        f"{tuple(state[name].shape)}, expected {expected}"
                    )

    def extra_repr(self) -> str:
        layer = self.layer
        return f"{layer.kind}, reduction={layer.reduction!r}, root={layer.root}, {layer.x.space}"


class _Kept:
    """A bound call of the loss's tree or of its adjoint
    (:class:`~linop.frameworks.torch_function.BoundCall`) kept between calls, its buffers seen as
    0-d tensors in the module's order of the partial sums: the sum-reduce's inputs (the partial
    sums) and output (the total, on the root); the broadcast's input (the root's seed) and
    outputs (the partial sums' gradients). A call uses it while the binding is current and the
    call's tensors have its dtypes on the CPU (what the bound call was made for); else it takes
    the general path, which binds again where the dtypes changed."""

    __slots__ = ("call", "dtypes", "inputs", "outputs")

    def __init__(self, call: BoundCall, inputs: list[int], outputs: list[int]) -> None:
        self.call = call
        self.inputs = tuple(call.inputs[i].view(()) for i in inputs)
        self.outputs = tuple(call.outputs[i].view(()) for i in outputs)
        self.dtypes = tuple(call.dtypes[i] for i in inputs)

    @classmethod
    def of(
        cls, function: TorchOperator, inputs: tuple[str, ...], outputs: tuple[str, ...], *, adjoint: bool
    ) -> _Kept | None:
        """The current binding of ``function`` (``adjoint``: of its adjoint) with its buffers in
        the order of the names ``inputs`` and ``outputs`` (a subset of its outputs); None
        where there is none to keep."""
        call = function.bound_call(adjoint=adjoint)
        if call is None:
            return None
        given, got = function.names(adjoint=adjoint)
        return cls(call, [given.index(n) for n in inputs], [got.index(n) for n in outputs])

    def takes(self, tensors: tuple[Tensor, ...]) -> bool:
        """Whether the partial sums ``tensors`` (0-d, in this order) go through the kept
        binding (after the call's agreement on dtypes where a rank has no inputs: on the one
        dtype the tree gets them in, :func:`_promoted`)."""
        call = self.call
        if call.blind:
            dtype = _promoted(tensors)
            call.agree(() if dtype is None else (dtype,) * len(tensors))
        return call.current and tensors_fit(tensors, self.dtypes)  # 0-d: the shape is fixed


class _ReduceFunction(torch.autograd.Function):
    r"""forward(module, anchor, \*partials) -> :math:`L = s\,R\,p` on the root (the local
    sums :math:`p`, 0-d, reduced by the layer's tree run untracked), a zero scalar elsewhere
    (float64: the token every process's backward needs); backward
    :math:`\bar p = R^{*}(s \bar L)`, the broadcast of the root's scaled gradient (a non-root
    process's seed is not used).

    Under MPI, after the first call in each direction, the bound call is kept (:class:`_Kept`):
    the partial sums are copied into its buffers, the seed is scaled into its buffer (``out=``),
    and the loss and the gradients are read from its result buffers, with no per-call
    bookkeeping."""

    @staticmethod
    def forward(ctx: Any, module: LossModule, anchor: torch.Tensor | None, *partials: Tensor) -> Tensor:
        ctx.module = module
        ctx.fit = [(p.dtype, p.device) for p in partials]
        kept = module._kept_reduce
        if kept is not None and kept.takes(partials):
            for buffer, partial in zip(kept.inputs, partials):
                buffer.copy_(partial)
            kept.call()
            total = kept.outputs[0] if kept.outputs else None
        else:
            total = _reduced(module, partials)
        # the sum's dtype as every rank agreed it when the sum-reduce bound (a rank's own
        # partial sums may be of another dtype: the ranks' dtypes promote)
        ctx.tree = module.reduce.bound_dtype() if module.reduce is not None else None
        if total is None:
            ctx.total = None
            return torch.zeros((), dtype=torch.float64)
        ctx.total = (total.dtype, total.device)
        return total * module._scale  # a tensor of its own (the result buffer is refilled)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:
        module = ctx.module
        if ctx.tree is not None and module.reduce is not None:
            # the ranks other than the root have no input to the broadcast, so they cannot see
            # its dtype change: every rank drops a binding of another dtype than the forward's
            # agreed one, and all bind again together (the call's agreement on dtypes, with
            # nothing sent)
            module.reduce.unbind_unless(ctx.tree, adjoint=True)
        kept = module._kept_broadcast
        if not torch.is_grad_enabled() and kept is not None and kept.call.current:
            root = ctx.total is not None
            if kept.dtypes == ((ctx.total[0],) if root else ()) and (not root or grad.is_cpu):
                if root:  # s times the loss's gradient, straight into the broadcast's buffer
                    torch.mul(grad, module._scale, out=kept.inputs[0])
                kept.call()
                return (None, None, *[owned_gradient(view, *fit) for view, fit in zip(kept.outputs, ctx.fit)])
        return (None, None, *_broadcast(module, ctx, grad))


def _promoted(partials: tuple[Tensor, ...]) -> torch.dtype | None:
    """The one dtype of the sum-reduce's inputs on this process: its partial sums' promoted
    (a float32 block next to a float64 one: float64); None without any."""
    dtype = partials[0].dtype if partials else None
    for partial in partials[1:]:
        dtype = torch.promote_types(dtype, partial.dtype)  # type: ignore[arg-type]
    return dtype


def _reduced(module: LossModule, partials: tuple[Tensor, ...]) -> Tensor | None:
    """The sum-reduce of the partial sums (one dtype for the tree: a float32 block next to a
    float64 one promotes), through the bound call where there is one, else untracked (binding);
    the total's 0-d tensor on the root (a result buffer of the binding: consumed before the
    next call), None elsewhere. Keeps the binding for the next calls (:class:`_Kept`)."""
    function = module.reduce
    assert function is not None  # a reduction: the tree exists
    dtype = _promoted(partials)
    state = {
        name: (partial.detach() if partial.dtype == dtype else partial.detach().to(dtype)).reshape(1)
        for name, partial in zip(module._partial_names, partials)
    }
    inputs, outputs = function.names()
    views = function.bound_views([state[name] for name in inputs])  # the bound call, lean
    if views is None:
        total = function.untracked(state).get(module._total_name)
    else:
        total = dict(zip(outputs, views)).get(module._total_name)
    module._kept_reduce = _Kept.of(
        function, module._partial_names, tuple(n for n in outputs if n == module._total_name), adjoint=False
    )
    return None if total is None else total.reshape(())


def _broadcast(module: LossModule, ctx: Any, grad: Tensor) -> list[Tensor]:
    """The broadcast of the root's scaled seed: the partial sums' gradients, fitted to them
    (recorded under ``create_graph``; else through the bound call where there is one, or
    untracked, binding, and then kept for the next calls)."""
    function = module.reduce
    assert function is not None  # a reduction: the tree exists
    seed: tuple[Tensor, ...] = ()
    if ctx.total is not None:  # the root: s times the loss's gradient, the broadcast's block
        dtype, device = ctx.total
        seed = ((grad * module._scale).to(dtype=dtype, device=device).reshape(1),)
    inputs, outputs = function.names(adjoint=True)
    views = None
    if torch.is_grad_enabled():  # create_graph: the broadcast recorded too
        adjoint = dict(zip(outputs, function.adjoint_tensors(*seed)))
        if module._anchor is not None:  # its token, the module's now (for the next loss)
            module.__dict__["token"] = function.token
    else:
        views = function.bound_views(seed, adjoint=True)  # the bound call, lean
        if views is None:
            adjoint = function.untracked(dict(zip(inputs, seed)), adjoint=True)
        else:
            adjoint = dict(zip(outputs, views))
        module._kept_broadcast = _Kept.of(function, inputs, module._partial_names, adjoint=True)
    back = [adjoint[name] for name in module._partial_names]
    fitted = [fitted_gradient(gradient.reshape(()), *fit) for gradient, fit in zip(back, ctx.fit)]
    if views is not None:  # views of the result buffers: the gradients must own their memory
        fitted = [gradient.clone() for gradient in fitted]
    return fitted
