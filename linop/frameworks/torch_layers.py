r"""Distributed layers (:mod:`linop.layers`) as PyTorch modules with learnable parameters.

A layer :math:`y = \mathcal{W}(\theta)\, x` (a convolution or an affine map, bias included) is
linear in its input for fixed parameters and linear in its parameters for a fixed input
(``docs/theory.md#layers``). Its two trees give the whole backward pass:

.. math::

    \bar x = A(\theta)^{*}\, \bar y \quad(\texttt{input\_operator}(W)\texttt{.H}), \qquad
    \bar\theta = P(x)^{*}\, \bar y \quad(\texttt{parameter\_operator}(\text{windows of } x)\texttt{.H})

and the forward is :math:`y = P(x)\,\theta`. The module holds this process's (this rank's)
blocks of the parameters as ``nn.Parameter``\ s, so any torch optimizer trains them.

In one process the trees run with the numpy interpreter; across MPI ranks (``comm=...``) each
rank passes its own input blocks and gets its own output blocks, and the trees run with the
MPI interpreter. The trees depend on the data (the input's windows, the weights), so they are
built, and planned, on each call; the input gradient needs the whole weight tensor on every
rank that computes with it, gathered from its owners on each backward (``allgather``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ..errors import StateError
from ..operator import LinearOperator
from ..space import State

__all__ = ["LayerModule"]


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().cpu().resolve_conj().resolve_neg().numpy()


class _Runner:
    """Runs trees with numpy (comm None) or across the ranks of ``comm``."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm

    def __call__(self, op: LinearOperator, state: State) -> State:
        if self.comm is None:
            return op.apply(state)
        from ..backends import mpi_backend

        return mpi_backend.apply(op, state, comm=self.comm)

    def local(self, space: Any) -> tuple[str, ...]:
        rank = 0 if self.comm is None else self.comm.rank
        return tuple(b.name for b in space if self.comm is None or b.worker == rank)


class _LayerFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, module: LayerModule, anchor: torch.Tensor, *tensors: torch.Tensor) -> Any:
        run, layer = module.runner, module.layer
        count = len(module.input_names)
        x = {n: _numpy(t) for n, t in zip(module.input_names, tensors[:count])}
        theta = {n: _numpy(t) for n, t in zip(module.parameter_names, tensors[count:])}
        windows = run(layer.window_operator, x)
        parameters = layer.parameter_operator(windows)
        y = run(parameters, theta)
        ctx.module, ctx.parameters, ctx.theta = module, parameters, theta
        ctx.inputs = [(t.dtype, t.shape) for t in tensors]
        outputs = tuple(torch.from_numpy(np.array(y[n])) for n in module.output_names)
        return (*outputs, torch.zeros(0, dtype=torch.float64))  # the last: the token

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        module = ctx.module
        run, layer = module.runner, module.layer
        g = {n: _numpy(t) for n, t in zip(module.output_names, grads[:-1])}
        theta_grad = run(ctx.parameters.H, g)
        weights = module.global_weights(ctx.theta)
        x_grad = run(layer.input_operator(weights).H, g)
        back = [x_grad[n] for n in module.input_names] + [theta_grad[n] for n in module.parameter_names]
        fitted = [torch.from_numpy(np.array(v)).to(dtype) for v, (dtype, _) in zip(back, ctx.inputs)]
        return (None, torch.zeros(0, dtype=torch.float64), *fitted)


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
    dtype : torch.dtype
        The parameters' dtype (default float64).

    Attributes
    ----------
    input_names, output_names, parameter_names : tuple of str
        The blocks this process passes in, gets back and holds as parameters.
    token : torch.Tensor
        An empty output of the last call. Under MPI the backward is collective: a rank that
        owns no output block (its loss cannot depend on the call) adds ``module.token.sum()``
        (zero) to its loss, so that its backward runs with the others'.
    """

    def __init__(
        self,
        layer: Any,
        *,
        weights: Any = None,
        bias: Any = None,
        comm: Any = None,
        dtype: torch.dtype = torch.float64,
    ) -> None:
        super().__init__()
        self.layer = layer
        self.comm = comm
        self.runner = _Runner(comm)
        self.input_names = self.runner.local(layer.x.space)
        self.output_names = self.runner.local(layer.y.space)
        self.parameter_names = self.runner.local(layer.parameter_space)
        weights = np.zeros(layer.weights.global_shape) if weights is None else np.asarray(weights)
        state = (
            layer.scatter_parameters(weights, np.zeros(layer.bias.global_shape) if bias is None else bias)
            if layer.bias is not None
            else layer.scatter_parameters(weights)
        )
        self.blocks = torch.nn.ParameterList(
            torch.nn.Parameter(torch.from_numpy(np.array(state[n], dtype=np.float64)).to(dtype))
            for n in self.parameter_names
        )
        self._anchor = torch.zeros(0, dtype=torch.float64, requires_grad=True)
        self.token = torch.zeros(0, dtype=torch.float64)

    def parameter_state(self) -> dict[str, torch.Tensor]:
        """This process's parameter blocks by name."""
        return dict(zip(self.parameter_names, self.blocks))

    def global_weights(self, theta: Mapping[str, np.ndarray]) -> np.ndarray:
        """The whole weight tensor from this process's blocks (all of them in one process;
        gathered from every rank's under MPI)."""
        names = {b.name for b in self.layer.weights.blocks}
        mine = {n: v for n, v in theta.items() if n in names}
        if self.comm is not None:
            for other in self.comm.allgather(mine):
                mine.update(other)
        return self.layer.weights.gather(mine)

    def forward(self, x: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if not isinstance(x, Mapping) or set(x) != set(self.input_names):
            given = sorted(x) if isinstance(x, Mapping) else type(x).__name__
            raise StateError(
                f"{type(self.layer).__name__} layer takes blocks {list(self.input_names)}, not {given}"
            )
        tensors = [x[n] for n in self.input_names] + list(self.blocks)
        *result, self.token = _LayerFunction.apply(self, self._anchor, *tensors)
        return dict(zip(self.output_names, result))

    def extra_repr(self) -> str:
        return f"{type(self.layer).__name__}: {self.layer.x.space} -> {self.layer.y.space}"
