r"""Distributed layers (:mod:`linop.layers`) as PyTorch modules with learnable parameters.

A layer :math:`y = R\,\big(L(\tilde x, \tilde\theta)\big)` (a convolution or an affine map,
bias included) moves data three times and computes once (``docs/theory.md#layers``):

.. math::

    \tilde x = W x \quad(\texttt{window\_operator}), \qquad
    \tilde\theta = M \theta \quad(\texttt{parameter\_movement}), \qquad
    \tilde y_j = L_j(\tilde x_j, \tilde\theta_j), \qquad y = R\, \tilde y
    \quad(\texttt{output\_reduction})

where each worker's :math:`L_j` is bilinear: ``conv{1,2,3}d`` or ``linear`` on its window and
its parameter copies. The backward pass is therefore

.. math::

    \bar{\tilde y} = R^{*} \bar y, \qquad
    (\bar{\tilde x}_j, \bar{\tilde\theta}_j) = \partial L_j^{*}\, \bar{\tilde y}_j, \qquad
    \bar x = W^{*} \bar{\tilde x}, \qquad \bar\theta = M^{*} \bar{\tilde\theta}

The three movements are operator trees, run (and their adjoints derived by rules) by linop; the
local products run in torch (its own kernels and their backward), so that the compute is
torch's own and what the module adds to a hand-written torch + mpi4py layer is the per-call
cost of running the movements' plans (``benchmarks/bench_mpi_torch.py``). The movements' trees are built once, at
construction; under MPI (``comm=...``) each is compiled once and bound on first use, forward and
adjoint, so a training loop pays no per-call planning. The layer's ``input_operator`` and
``parameter_operator`` are the same algorithm with numpy kernels, as whole trees: those are what
``verify`` proves, and the tests check the module against them and against torch's own layers.

When no process's input needs a gradient (a network's first layer: the image) the backward
skips :math:`\bar{\tilde x}` and :math:`W^{*}` on every process alike, as an agreement started
in the forward decides (:meth:`LayerModule.input_gradient_agreement`), or as the module was
told once for all calls (``input_gradient=False``: no agreement); an identity movement
(an affine layer's windows and parameter copies) passes its blocks through without an executor.

The module holds this process's (this rank's) blocks of the parameters as ``nn.Parameter``\ s,
so any torch optimizer trains them.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

try:
    import torch
except ModuleNotFoundError as error:  # the torch extra is not installed: say which
    from .extras import missing_extra

    raise missing_extra(error, "torch", __name__) from error

from ..errors import LayerError, StateError
from ..layers import Affine, Convolution, kernels
from ..operator import Identity
from .torch_agreement import Agreement, start_agreement
from .torch_function import TorchOperator, anchor, engine_arguments
from .torch_placement import Placement, workers_of

__all__ = ["LayerModule"]

Tensor = torch.Tensor

_CONVOLUTIONS = {1: torch.nn.functional.conv1d, 2: torch.nn.functional.conv2d, 3: torch.nn.functional.conv3d}


@dataclass(frozen=True)
class LocalProduct:
    r"""The product each worker computes, :math:`\tilde y_j = L(\tilde x_j, \tilde\theta_j)`,
    bilinear in (window, parameters), and its vector-Jacobian product.

    ``forward(window, weight, bias)`` gives the partial output (``bias`` may be None);
    ``backward(grad, window, weight, bias, input_gradient=True)`` gives the gradients of the
    three operands (with ``input_gradient=False`` the window's is not computed: None)
    (PyTorch's convention, complex included: :math:`L(\cdot, \theta)^* \bar y` and
    :math:`L(x, \cdot)^* \bar y`), None for an absent bias.
    """

    forward: Callable[[Tensor, Tensor, Tensor | None], Tensor]
    backward: Callable[..., tuple[Tensor | None, Tensor, Tensor | None]]


def _linear_backward(
    grad: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, input_gradient: bool = True
) -> tuple[Tensor | None, Tensor, Tensor | None]:
    # y = x W^T + b: dx = g conj(W), dW = g^T conj(x), db = sum of g over the samples
    dx = grad @ weight.conj() if input_gradient else None
    return dx, grad.mT @ x.conj(), None if bias is None else grad.sum(0)


def _autograd_backward(
    forward: Callable[[Tensor, Tensor, Tensor | None], Tensor],
    grad: Tensor,
    window: Tensor,
    weight: Tensor,
    bias: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    leaves = [t.detach().requires_grad_() for t in (window, weight, bias) if t is not None]
    with torch.enable_grad():
        out = forward(leaves[0], leaves[1], leaves[2] if bias is not None else None)
    grads = torch.autograd.grad(out, leaves, grad)
    return grads[0], grads[1], grads[2] if bias is not None else None


def _convolution(dims: int, stride: tuple[int, ...], dilation: tuple[int, ...]) -> LocalProduct:
    convolve = _CONVOLUTIONS[dims]
    zeros = [0] * dims

    def forward(window: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        if 0 in weight.shape[:2]:
            # an empty channel share (unbalanced shares, more workers than channels): torch
            # refuses no output channels and gives an empty output for no input channels,
            # where the product is the bias alone
            out = kernels.output_shape(tuple(window.shape[2:]), tuple(weight.shape[2:]), stride, dilation)
            y = window.new_zeros((window.shape[0], weight.shape[0], *out))
            return y if bias is None else y + bias.reshape(-1, *(1,) * dims)
        return convolve(window, weight, bias, stride, 0, dilation)

    def backward(
        grad: Tensor, window: Tensor, weight: Tensor, bias: Tensor | None, input_gradient: bool = True
    ) -> tuple[Tensor | None, Tensor, Tensor | None]:
        if 0 in weight.shape[:2]:  # the product above: the bias alone, or nothing
            bias_grad = None if bias is None else grad.sum(dim=(0, *range(2, grad.ndim)))
            return (torch.zeros_like(window) if input_gradient else None), torch.zeros_like(weight), bias_grad
        if window.is_complex():  # torch convolves complex data as real ones: autograd knows how
            return _autograd_backward(forward, grad, window, weight, bias)
        # torch's own convolution backward (what autograd runs for real data), called directly
        dx, dw, db = torch.ops.aten.convolution_backward.default(
            grad,
            window,
            weight,
            None if bias is None else list(bias.shape),
            list(stride),
            zeros,
            list(dilation),
            False,
            zeros,
            1,
            [input_gradient, True, bias is not None],
        )
        return dx if input_gradient else None, dw, db if bias is not None else None

    return LocalProduct(forward, backward)


def local_product(layer: Any) -> LocalProduct:
    """The torch product each worker of ``layer`` applies to its window and parameter copies.

    Raises
    ------
    LayerError
        For a layer type without a torch product, or a convolution over more than 3 spatial
        dimensions (torch has ``conv1d`` to ``conv3d``).
    """
    if isinstance(layer, Affine):
        return LocalProduct(torch.nn.functional.linear, _linear_backward)
    if isinstance(layer, Convolution):
        if layer.dims not in _CONVOLUTIONS:
            raise LayerError(
                f"LayerModule: a convolution over {layer.dims} spatial dimensions has no torch kernel "
                "(conv1d to conv3d); run its trees with linop's numpy kernels instead"
            )
        stride = tuple(layer.kernel.stride[2:])  # type: ignore[index]
        dilation = tuple(layer.kernel.dilation[2:])  # type: ignore[index]
        return _convolution(layer.dims, stride, dilation)
    raise LayerError(f"LayerModule takes a Convolution or an Affine layer, not {type(layer).__name__}")


_CONVOLUTION_INPUT_GRADIENTS = {
    1: torch.nn.grad.conv1d_input,  # type: ignore[attr-defined]
    2: torch.nn.grad.conv2d_input,  # type: ignore[attr-defined]
    3: torch.nn.grad.conv3d_input,  # type: ignore[attr-defined]
}

OVERLAP_MIN_INTERIOR = 0.5
"""The overlap rule of :class:`LayerModule` (``overlap=None``; the default is ``False``): overlap the halo exchange when the
module runs across processes, the layer does not broadcast its input, the exchange moves
messages (a spatial dimension is cut) and on every worker the interior holds at least this
share of the outputs (below it the boundary strips' extra, smaller products cost more than the
hidden exchange saves)."""


def overlap_pays(layer: Any, distributed: bool) -> bool:
    """The rule of :data:`OVERLAP_MIN_INTERIOR` for ``layer`` (the same on every process: it
    reads the layer only)."""
    if not distributed or not isinstance(layer, Convolution) or not layer.overlappable:
        return False
    if all(n == 1 for n in layer.spatial):
        return False
    return layer.interior_fraction() >= OVERLAP_MIN_INTERIOR


def _as_tensor(array: np.ndarray) -> Tensor:
    """A torch view of a (possibly read-only) kernel operand: the products only read it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


class _PieceProducts:
    r"""The torch products of an overlapped convolution's pieces (each worker's interior and
    boundary strips, :func:`linop.layers.overlap_split.overlapped_products`), with the state of
    the current call.

    Called as the tree's :data:`~linop.layers.overlap_split.PieceKernels`: ``products(j,
    window_shape)`` gives piece :math:`p`'s forward and adjoint,

    .. math::

        y_p = w_j \star x_p, \qquad \bar x_p = w_j \star^{*} \bar y_p

    (the correlation of the piece's window :math:`x_p` with the weight copy :math:`w_j` of the
    current call, :attr:`weights`). The forward keeps each window it sees in :attr:`saved` (a
    reference, no copy: the tree hands each piece a window block of its own, consumed by the
    product). The adjoint, given the forward's windows back in :attr:`saved`, computes with
    :math:`\bar x_p` in the same torch call the piece's share of the weight gradient and adds it
    into :attr:`gradients`: the pieces cut the outputs into disjoint boxes, so

    .. math::

        \bar w_j = \sum_p x_p \star' \bar y_p

    is the gradient of the whole product, got with no pass of its own over the output
    gradient and the window (one ``convolution_backward`` for both costs less than two).
    Without a saved window (the adjoint run alone) it computes :math:`\bar x_p` only.
    """

    def __init__(self, layer: Convolution) -> None:
        self.layer = layer
        self.weights: dict[str, Tensor] = {}
        self.saved: dict[int, Tensor] | None = None
        self.gradients: dict[str, Tensor] = {}
        self._pieces = 0

    def __call__(
        self, j: Sequence[int], window: tuple[int, ...]
    ) -> tuple[Callable[..., Any], Callable[..., Any]]:
        layer = self.layer
        dims = layer.dims
        stride = list(layer.kernel.stride[2:])  # type: ignore[index]
        dilation = list(layer.kernel.dilation[2:])  # type: ignore[index]
        zeros = [0] * dims
        convolve, input_gradient = _CONVOLUTIONS[dims], _CONVOLUTION_INPUT_GRADIENTS[dims]
        weight_name = layer.local_operands(j)[1]
        key, self._pieces = self._pieces, self._pieces + 1

        def forward(x: np.ndarray) -> np.ndarray:
            weight = self.weights[weight_name]
            tensor = _as_tensor(np.ascontiguousarray(x))
            if self.saved is not None:
                self.saved[key] = tensor
            return convolve(tensor, weight.to(tensor.dtype), None, stride, 0, dilation).numpy()

        def adjoint(y: np.ndarray) -> np.ndarray:
            weight = self.weights[weight_name]
            grad = _as_tensor(np.ascontiguousarray(y))
            weight = weight.to(grad.dtype)
            seen = None if self.saved is None else self.saved.get(key)
            if seen is None or 0 in weight.shape[:2]:
                size = (*grad.shape[: grad.ndim - dims - 1], weight.shape[1], *window)
                return input_gradient(size, weight, grad, stride, 0, dilation).numpy()
            dx, dw, _ = torch.ops.aten.convolution_backward.default(
                grad, seen, weight, None, stride, zeros, dilation, False, zeros, 1, [True, True, False]
            )
            total = self.gradients.get(weight_name)
            self.gradients[weight_name] = dw if total is None else total.add_(dw)
            return dx.numpy()

        return forward, adjoint


_ANSWERED = {flag: Agreement(flag) for flag in (False, True)}
"""The agreements answered without asking (declared, decided locally, or yes once and for all),
shared by every call: an answered :class:`~linop.frameworks.torch_agreement.Agreement` never
changes."""


def _promoted(operands: dict[str, Tensor]) -> dict[str, Tensor]:
    """The operands in their common dtype (the same dict when they already share one)."""
    dtypes = {t.dtype for t in operands.values()}
    if len(dtypes) <= 1:
        return operands
    common = functools.reduce(torch.promote_types, dtypes)
    return {name: tensor.to(common) for name, tensor in operands.items()}


class _LayerFunction(torch.autograd.Function):
    """forward(module, recording, anchor, *x blocks, *parameter blocks) -> (*y blocks, token);
    ``recording``: grad mode was on at the call (a backward may follow).

    The backward computes the input gradient (the local products' :math:`\bar{\tilde x}` and
    :math:`W^{*}`) only when some process's input blocks need one: the forward starts the
    agreement (:mod:`linop.frameworks.torch_agreement`, no blocking call), the backward reads
    it, so that every process takes the same path."""

    @staticmethod
    def forward(
        ctx: Any, module: LayerModule, recording: bool, anchor: torch.Tensor, *tensors: torch.Tensor
    ) -> Any:
        count = len(module.input_names)
        if recording:  # a backward may follow (grad mode on when the module was called)
            ctx.agreement = module.input_gradient_agreement(any(ctx.needs_input_grad[3 : 3 + count]))
        else:
            ctx.agreement = _ANSWERED[True]
        parameters = dict(zip(module.parameter_names, tensors[count:]))
        # the windows and parameter copies are kept for the backward: in memory of their own
        copies = (
            parameters
            if module.copies is None
            else module.copies.run(parameters, known=module.parameters_dtype)
        )
        if module.overlapped is None:
            windows = module.windows.run(dict(zip(module.input_names, tensors[:count])))
            operands = _promoted({**windows, **copies})
            forward = module.product.forward
            partials = {
                partial: forward(operands[window], operands[weight], None if bias is None else operands[bias])
                for partial, (window, weight, bias) in module.products
            }
        else:  # the halo exchange overlapped with the interior products (the tree runs them)
            dtypes = [t.dtype for t in (*tensors[:count], *copies.values())]
            common = functools.reduce(torch.promote_types, dtypes) if dtypes else torch.float64
            operands = {name: tensor.to(common) for name, tensor in copies.items()}
            pieces = module.pieces
            assert pieces is not None  # built with the overlapped stage
            pieces.weights.update(operands)
            pieces.saved = {}  # the pieces' windows, kept for the backward's weight gradient
            given = {n: t.to(common) for n, t in zip(module.input_names, tensors[:count])}
            try:
                results = module.overlapped.run(given)
            finally:
                ctx.windows, pieces.saved = pieces.saved, None
            ctx.dtype = common
            partials = {}
            for partial, (_, _, bias) in module.products:
                y = results[partial]  # a new tensor of the tree's: the bias is added in place
                if bias is not None:
                    y.add_(operands[bias].reshape(-1, *(1,) * (y.ndim - 2)))
                partials[partial] = y
        outputs = module.reduction.run(partials) if module.reduction is not None else partials
        ctx.module, ctx.operands = module, operands
        # the operands an identity movement passed through are the caller's tensors, not copies:
        # their versions now, checked by the backward (torch's rule for saved tensors)
        ctx.versions = [
            (name, operands[name], operands[name]._version)
            for name in module._passed_through
            if name in operands
        ]
        ctx.dtypes = [t.dtype for t in tensors]
        result = tuple(outputs[n] for n in module.output_names)
        return (*result, torch.zeros(0, dtype=torch.float64))  # the last: the token

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        """The backward, once differentiable: as ``torch.autograd.function.once_differentiable``
        makes it (under ``create_graph=True``, a second differentiation raises), without that
        wrapper's ``no_grad`` block where autograd already runs it with gradients off (every
        backward without ``create_graph``)."""
        if torch.is_grad_enabled():
            return _once_differentiable_backward(ctx, *grads)
        return _layer_backward(ctx, *grads)


def _layer_backward(ctx: Any, *grads: torch.Tensor) -> Any:
    """The body of :meth:`_LayerFunction.backward` (run with gradients off)."""
    module = ctx.module
    given = dict(zip(module.output_names, grads[:-1]))
    if module.reduction is not None:  # read before the stage's next call: not copied
        given, _ = module.reduction.lend(given, adjoint=True)
    # the same answer on every process (an OR over them): skip on all or on none
    input_gradient = ctx.agreement.result()
    operands = ctx.operands
    for name, tensor, version in ctx.versions:
        if tensor._version != version:
            raise StateError(
                f"{type(module.layer).__name__} layer: block {name!r} was changed in place after the "
                "forward; its backward needs the forward's values (clone it before changing it)"
            )
    back: dict[str, torch.Tensor] = {}
    if module.pieces is None:
        for partial, (window, weight, bias) in module.products:
            local = module.product.backward(
                given[partial],
                operands[window],
                operands[weight],
                None if bias is None else operands[bias],
                input_gradient=input_gradient,
            )
            for name, gradient in zip((window, weight, bias), local):
                if name is not None and gradient is not None:
                    back[name] = back[name] + gradient if name in back else gradient
    else:  # the overlapped tree's adjoint (the adjoint exchange in flight) gives the input
        # gradient, and its pieces the weight gradient (_PieceProducts)
        pieces = module.pieces
        pieces.weights.update({n: operands[n] for n in pieces.weights})
        pieces.saved, pieces.gradients = ctx.windows, {}
        try:
            x_grad = module.overlapped.run(
                {n: given[n].to(ctx.dtype) for n in module.partial_names}, adjoint=True
            )
        finally:
            back, pieces.saved, pieces.gradients = pieces.gradients, None, {}
        for partial, (_, _, bias) in module.products:
            if bias is not None:
                grad = given[partial]
                total = grad.sum(dim=(0, *range(2, grad.ndim))).to(ctx.dtype)
                back[bias] = back[bias] + total if bias in back else total
    for name, tensor in operands.items():  # an operand no product of this process uses
        if name not in back and (input_gradient or name not in module.windows.outputs):
            back[name] = torch.zeros_like(tensor)
    if module.pieces is None and input_gradient:
        x_grad = module.windows.run(back, adjoint=True)
    theta_grad = (
        module.copies.run(back, adjoint=True) if module.copies is not None else module.copy_sum.run(back)
    )
    gradients = [x_grad[n] if input_gradient else None for n in module.input_names]
    gradients += [theta_grad[n] for n in module.parameter_names]
    fitted = [g if g is None or g.dtype == dtype else g.to(dtype) for g, dtype in zip(gradients, ctx.dtypes)]
    return (None, None, None, *fitted)  # module, recording; the anchor: no gradient (see anchor())


_once_differentiable_backward = torch.autograd.function.once_differentiable(_layer_backward)
"""The backward under ``create_graph=True`` (gradients on), marked so that a second
differentiation raises."""


class _Stage:
    """A movement tree on this process's tensors, forward and adjoint (bound once each under
    MPI, on buffers the stage owns), called without recording autograd: the layer's Function
    is the autograd node.

    An :class:`~linop.Identity` (an affine layer's input windows and parameter copies: each
    block already lives where it is used) moves nothing: its blocks pass through, the
    tensors themselves (shapes checked on this process), with no call into an executor and no
    communication, the same on every process."""

    def __init__(self, op: Any, comm: Any, group: Any = None, mapping: Any = None) -> None:
        self.function = TorchOperator(op, comm=comm, group=group, mapping=mapping)
        self.inputs, self.outputs = self.function.inputs, self.function.outputs
        self._names = {flag: self.function.names(adjoint=flag) for flag in (False, True)}
        self.identity = isinstance(op, Identity)
        self._shapes = {name: torch.Size(op.domain.block(name).shape) for name in self.inputs}
        # per direction: the last binding and its dtypes (a call with the same dtypes reuses it)
        self._bound: dict[bool, tuple[list[torch.dtype], Any]] = {}

    def _passed(self, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The identity's results: the given tensors (detached), their shapes checked."""
        for name in self.inputs:
            tensor = tensors.get(name)
            if tensor is None or tensor.shape != self._shapes[name]:
                got = "missing" if tensor is None else f"of shape {tuple(tensor.shape)}"
                self.function.refuse(
                    StateError(f"block {name!r} is {got}; the layer takes {tuple(self._shapes[name])}"),
                    tensors,
                )
        return {name: tensors[name].detach() for name in self.inputs}

    def lend(
        self, tensors: Mapping[str, Tensor], *, adjoint: bool = False, known: torch.dtype | None = None
    ) -> tuple[dict[str, Tensor], bool]:
        """The results, and whether they are the bound plan's own buffers (under MPI, a
        persistent binding): those are overwritten by the stage's next call in the same
        direction, so they are read before it or copied. ``known``: the dtype the tree runs in,
        as every rank knows it (the module's parameters'): a tree that leaves a rank without
        inputs then drops a binding of another dtype on every rank alike, with nothing sent,
        instead of the ranks' agreement on each call."""
        if self.identity:
            return self._passed(tensors), False
        if known is not None and self.function.blind(adjoint=adjoint):
            self.function.unbind_unless(known, adjoint=adjoint)  # this call's agreement
        inputs, outputs = self._names[adjoint]
        ordered = [tensors[name] for name in inputs]
        dtypes = [t.dtype for t in ordered]
        last = self._bound.get(adjoint)
        if last is not None and last[0] == dtypes and not self.function.blind(adjoint=adjoint):
            bound = last[1]
        else:  # collective when it binds (the first call, or new dtypes: the same on every rank);
            # a tree leaving a rank without inputs (a parameter's copies off its owner) asks on
            # every call: the ranks agree on its dtypes then, which that rank cannot see
            bound = self.function.bound_tensors(dtypes, adjoint=adjoint)
            self._bound[adjoint] = (dtypes, bound)
        if bound is None or not bound.persistent:
            if bound is not None:  # this call's agreement (a blind tree) made above
                self.function.mark_agreed(adjoint=adjoint)
            return self.function.untracked(tensors, adjoint=adjoint), False
        return dict(zip(outputs, bound.run(ordered))), True

    def run(
        self, tensors: Mapping[str, Tensor], *, adjoint: bool = False, known: torch.dtype | None = None
    ) -> dict[str, Tensor]:
        """The results, in memory of their own (``known``: as :meth:`lend`)."""
        results, lent = self.lend(tensors, adjoint=adjoint, known=known)
        return {name: tensor.clone() for name, tensor in results.items()} if lent else results

    def run_adjoint(self, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The adjoint's results, in memory of their own."""
        return self.run(tensors, adjoint=True)


def _group_fits(module: LayerModule) -> None:
    """Raise, on a process group, the executor's error of a stage that cannot run on it (a
    group smaller than the layer's workers: :class:`~linop.errors.ProcessGroupError`). It
    follows from the layer and the group's size alone, the same on every rank that builds the
    module, so every rank raises it here, before any call."""
    stages = (module.overlapped, module.windows, module.copies, module.copy_sum, module.reduction)
    for stage in stages:
        problem = None if stage is None else stage.function.group_problem
        if problem is not None:
            raise problem


class LayerModule(torch.nn.Module):
    """A distributed layer (:class:`linop.layers.Convolution` or :class:`linop.layers.Affine`)
    as an ``nn.Module``: ``module(x_state)`` returns this process's output blocks, and the
    weights (and bias) blocks this process owns are its parameters.

    Parameters
    ----------
    layer : Convolution or Affine
    weights, bias : array, optional
        The global initial parameters (default: zeros); each process keeps its own blocks.
    comm : mpi4py communicator, optional
        Run across its ranks (every rank builds the same layer and calls collectively).
    group : torch.distributed ProcessGroup or True, optional
        Run across the ranks of this process group instead (``True``: the world group), with
        the torch.distributed executor's bound plans (:mod:`linop.backends.torch_distributed`);
        not together with ``comm``.
    dtype : torch.dtype
        The parameters' dtype (default float64).
    overlap : bool or None
        Overlap the halo exchange with the interior products (a convolution): the exchange's
        messages are started, each worker's interior (the outputs that need no halo) is
        computed while they are in flight, then the boundary strips; the backward likewise
        with the adjoint exchange (:meth:`linop.layers.Convolution.overlapped_products`, the
        same operator as the plain tree). False (the default): on a 2-core machine with 2 and
        4 processes (4 x 16 x 256 x 256 float32 per process, ``benchmarks/bench_overlap.py``)
        the halo messages are about a millisecond of a step of a hundred or more, no core is
        free to move them while the interior runs, and an overlapped step takes 15-20% longer
        than a plain one (more, smaller torch calls), for a hand-written mpi4py + torch layer
        alike, so it is opt-in. None: by the rule of :func:`overlap_pays` (across processes, a cut
        spatial dimension, a large enough interior, a real dtype, not NCCL), for machines where
        the exchange can progress while the interior computes.
    replicate : bool
        Hold the parameter *copies* each process computes with (the range of the layer's
        ``parameter_movement`` M) instead of the blocks it owns. The forward then moves no
        parameters, and the backward gives every copy the summed gradient of its block,
        :math:`M M^* \bar{\tilde\theta}` (``copy_gradient_sum``, all-reduces), as a data-parallel
        code does: copies stay equal as long as every process applies the same update to them.
        Default False: the owners hold the blocks, the forward broadcasts them and the
        backward sums the gradients onto the owners (:math:`M^*`).
    input_gradient : bool or None
        Whether the backward computes the input's gradient (the local :math:`\bar{\tilde x}`
        and the adjoint window movement :math:`W^{*}`). None (the default): decided on each
        call, alike on every process, from whether any process's input blocks need one (an
        agreement started in the forward: one small non-blocking all-reduce per call until
        one says yes, see :meth:`input_gradient_agreement`). False: never, the input is data
        (a network's first layer: the image), declared alike on every process, so no call
        asks; a call whose input blocks require a gradient while autograd records is refused
        (:class:`~linop.errors.LayerError`) rather than given none. True: always, no call asks.
        Across processes, the outputs of a linop call recorded by autograd (an up-sampling of
        the images, say) require a gradient on every process whatever its inputs do (its
        anchor, which keeps the backward collective): a layer fed by them computes its input
        gradient unless such data-only calls run under ``torch.no_grad()``, alike on every
        process (``examples/train_spatial.py``, ``SpatialModel.loss``).
    mapping : WorkerMap, sequence of int or dict of int to int, optional
        Across processes, the rank of each worker of the layer (default worker ``w`` on rank
        ``w``; a rank may hold several workers or none), as the executors' ``mapping=``
        (:func:`linop.backends.mpi.plan_for`), passed to every movement the module runs:
        this process passes the input blocks, holds the parameter blocks, computes the local
        products and gets back the output blocks of the workers on its rank
        (:class:`~linop.frameworks.torch_placement.Placement`). Not used in one process.

    Attributes
    ----------
    input_names, output_names, parameter_names : tuple of str
        The blocks this process passes in, gets back and holds as parameters.
    token : torch.Tensor
        An empty output of the last call. Under MPI the backward is collective: a rank that
        owns no output block (its loss cannot depend on the call) adds ``module.token.sum()``
        (zero) to its loss, so that its backward runs with the others'.

    Raises
    ------
    LayerError
        For a layer without a torch product (see :func:`local_product`).
    ProcessGroupError
        On a process group: this rank is not a member of it, or it has fewer ranks than the
        layer's workers (on every rank, when the module is built).
    ProcessGroupArgumentError
        Both ``comm`` and ``group`` given, or ``group`` not a process group.
    WorkerMapError
        Across processes, a malformed ``mapping``, or one that leaves a worker of the layer
        out or names a rank the communicator or group lacks (on every rank given it, when the
        module is built).
    WorkerMapMismatchError
        The ranks were given different maps (at the first call, on every rank: the
        executor's entry check).
    """

    def __init__(
        self,
        layer: Any,
        *,
        weights: Any = None,
        bias: Any = None,
        comm: Any = None,
        dtype: torch.dtype = torch.float64,
        replicate: bool = False,
        group: Any = None,
        overlap: bool | None = False,
        input_gradient: bool | None = None,
        mapping: Any = None,
    ) -> None:
        super().__init__()
        engine_arguments(comm, group)
        if input_gradient is not None and not isinstance(input_gradient, bool):
            raise LayerError(f"LayerModule: input_gradient is True, False or None, not {input_gradient!r}")
        self.input_gradient = input_gradient
        self.layer = layer
        self.comm = comm
        self.group = group
        self.replicate = bool(replicate)
        self.product = local_product(layer)
        real = not dtype.is_complex
        if overlap is None:  # not under NCCL: the device path runs no local operators
            device = (
                group is not None
                and torch.distributed.get_backend(None if group is True else group) == "nccl"
            )
            overlap = real and not device and overlap_pays(layer, comm is not None or group is not None)
        elif overlap and not (isinstance(layer, Convolution) and layer.overlappable and real):
            raise LayerError(
                "LayerModule: overlap=True needs a convolution that does not broadcast its input, in a real dtype"
            )
        self.overlap = bool(overlap)
        reduction = layer.output_reduction
        placement = Placement(
            mapping,
            comm,
            group,
            lambda: {
                *workers_of(layer.window_operator, layer.parameter_movement, reduction),
                *layer.y.space.workers,
            },
        )
        mapping = placement.map
        self.pieces: _PieceProducts | None = None  # the overlapped products and their state
        self.overlapped: _Stage | None = None  # forward, and adjoint for the input gradient
        if self.overlap:
            self.pieces = _PieceProducts(layer)
            self.overlapped = _Stage(layer.overlapped_products(self.pieces), comm, group, mapping)
        self.windows = _Stage(layer.window_operator, comm, group, mapping)
        movement = layer.parameter_movement
        self.copies = None if self.replicate else _Stage(movement, comm, group, mapping)
        self.copy_sum = _Stage(layer.copy_gradient_sum, comm, group, mapping) if self.replicate else None
        self.reduction = None if reduction is None else _Stage(reduction, comm, group, mapping)
        if group is not None:
            _group_fits(self)
        self.input_names = self.windows.inputs
        held = self.copy_sum if self.copy_sum is not None else self.copies
        assert held is not None  # one of the two, by replicate
        self.parameter_names = held.inputs
        self.output_names = (
            self.reduction.outputs
            if self.reduction is not None
            else tuple(layer.y.block_name(g) for g in placement.held(layer.y.partition))
        )
        self.products: list[tuple[str, tuple[str, str, str | None]]] = [
            (layer.partial_block(j).name, layer.local_operands(j)) for j in placement.held(layer.work)
        ]
        self.partial_names = tuple(partial for partial, _ in self.products)
        self.window_names = tuple(operands[0] for _, operands in self.products)
        if self.pieces is not None:
            for _, (_, weight, _) in self.products:
                self.pieces.weights.setdefault(weight, torch.zeros(0))
        weights = np.zeros(layer.weights.global_shape) if weights is None else np.asarray(weights)
        # the blocks this process holds, cut alone (every block where the copies are computed
        # by the movement; an identity movement's copies are the blocks themselves)
        computed = self.replicate and not isinstance(movement, Identity)
        own = None if computed else placement.held
        state = (
            layer.scatter_parameters(
                weights, np.zeros(layer.bias.global_shape) if bias is None else bias, held=own
            )
            if layer.bias is not None
            else layer.scatter_parameters(weights, held=own)
        )
        if computed:  # every process computes the copies it holds (numpy, no communication)
            state = movement(state)
        self.blocks = torch.nn.ParameterList(
            torch.nn.Parameter(torch.from_numpy(np.array(state[n])).to(dtype)) for n in self.parameter_names
        )
        # the parameters' dtype on every process, those holding none included: module.to(),
        # .float(), .double() cast it with them, so the copies off the parameters' owners
        # follow a cast with nothing sent (_Stage.lend's ``known``)
        self.register_buffer("_parameters_dtype", torch.zeros(0, dtype=dtype), persistent=False)
        self._passed_through = tuple(
            name
            for stage in (self.windows, self.copies)
            if stage is not None and stage.identity
            for name in stage.outputs
        )
        """The operands an identity movement passes through (the caller's own tensors, whose
        versions a forward records for its backward to check)."""
        self._inputs = frozenset(self.input_names)
        self._anchor = anchor()
        self.token = torch.zeros(0, dtype=torch.float64)
        self._agreement: Agreement | None = None  # the last call's (input_gradient_agreement)
        self._input_gradient_always = False  # an agreement said yes: no more asking

    @property
    def parameters_dtype(self) -> torch.dtype:
        """The parameters' dtype, known on every process (those holding no parameter block
        included): it follows ``module.to()``, ``.float()`` and ``.double()``."""
        mark = self._buffers["_parameters_dtype"]
        assert mark is not None  # registered at construction
        return mark.dtype

    def input_gradient_agreement(self, local: bool) -> Agreement:
        """Whether some process's input blocks need a gradient (``local``: this one's), as
        the backward reads it: the OR over the processes, started here without waiting
        (:func:`~linop.frameworks.torch_agreement.start_agreement`; collective, in the forward
        every process calls).

        Once an agreement said yes, every later call computes the input gradient without
        asking (a gradient computed where none is needed is correct, only wasted; the
        decision is the same on every process, which all read the same answers): a layer
        inside a network pays one agreement, on its first call, and the first layer (whose
        input, the image, never needs a gradient) one small non-blocking all-reduce per call,
        against the adjoint window movement and the local input gradients it skips. The
        previous call's agreement is read first (waited for if no backward has: every
        process started it), so at most one is in flight. Overlapped (the input gradient and
        the weight gradient come from one adjoint tree): always yes, nothing started. With
        identity windows (an affine layer that does not broadcast its input) :math:`W^{*}`
        moves nothing between processes and each process's input gradient comes from its own
        products alone: ``local`` decides, nothing started (so in one process too). Built
        with ``input_gradient=True`` or ``False``: that, nothing started."""
        if self._input_gradient_always or self.overlapped is not None:
            return _ANSWERED[True]
        if self.input_gradient is not None:  # declared alike on every process: nothing to ask
            return _ANSWERED[self.input_gradient]
        group = None if self.group is False else self.group
        if self.windows.identity or (self.comm is None and group is None):  # in one process: local
            return _ANSWERED[bool(local)]
        # (the module's own attributes written straight, past nn.Module.__setattr__'s tests)
        previous = self._agreement
        if previous is not None and previous.result():
            self.__dict__["_agreement"], self.__dict__["_input_gradient_always"] = None, True
            return _ANSWERED[True]
        agreement = self.__dict__["_agreement"] = start_agreement(local, comm=self.comm, group=group)
        return agreement

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of the parameters, as :meth:`torch.nn.Module.zero_grad` does;
        when the module holds its blocks alone (no parameter or submodule added by a
        subclass), without nn.Module's walk over its submodules."""
        if set_to_none and not self._parameters and self._modules.keys() == {"blocks"}:
            for parameter in self.blocks._parameters.values():
                if parameter is not None:
                    parameter.grad = None
            return
        super().zero_grad(set_to_none)

    def parameter_state(self) -> dict[str, torch.Tensor]:
        """This process's parameter blocks by name."""
        return dict(zip(self.parameter_names, self.blocks))

    def forward(self, x: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if (type(x) is not dict or x.keys() != self._inputs) and (
            not isinstance(x, Mapping) or set(x) != self._inputs
        ):
            given = sorted(x) if isinstance(x, Mapping) else type(x).__name__
            raise StateError(
                f"{type(self.layer).__name__} layer takes blocks {list(self.input_names)}, not {given}"
            )
        if self.input_gradient is False and torch.is_grad_enabled():
            needing = [n for n in self.input_names if x[n].requires_grad]
            if needing:
                self.windows.function.refuse(
                    LayerError(
                        f"{type(self.layer).__name__} layer built with input_gradient=False: input block(s) "
                        f"{needing} require a gradient (detach them, or build it with input_gradient=None)"
                    ),
                    x,
                )
        # the blocks straight from the ParameterList's dict (its iterator indexes one by one)
        blocks = self.blocks._parameters.values()
        *result, token = _LayerFunction.apply(
            self, torch.is_grad_enabled(), self._anchor, *[x[n] for n in self.input_names], *blocks
        )
        self.__dict__["token"] = token  # a plain attribute (what nn.Module.__setattr__ would do)
        return dict(zip(self.output_names, result))

    def extra_repr(self) -> str:
        return f"{type(self.layer).__name__}: {self.layer.x.space} -> {self.layer.y.space}"
