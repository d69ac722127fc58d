r"""Distributed batch normalization (:class:`linop.layers.BatchNorm`) as a PyTorch module.

The module runs the layer's algorithm on this process's blocks (its local kernels on torch
tensors) and its trees through :class:`~linop.frameworks.torch_function.TorchOperator`: in
one process on the numpy interpreter, across MPI ranks (``comm=``) or a torch.distributed
process group (``group=``) on bound plans compiled once. A training step makes two
collectives (three on the two-pass path), as a hand-written layer does. On the gather path
(:attr:`linop.layers.BatchNorm.statistics_path`, the default for channel groups of up to
:data:`~linop.layers.batchnorm.GATHER_LIMIT` workers) the forward is one all-reduce A over
each channel's workers of the moments blocks
(:attr:`linop.layers.BatchNorm.moments_reduction`): every worker's local mean and variance in
its slot, combined without cancellation (Chan et al.), and the owners' θ, so that A also does
the parameters' broadcast M:

.. math::

    (\mu_j, v_j)_{j \in G},\ \tilde\theta = A(\ldots), \quad
    \mu = \tfrac1m \textstyle\sum_j m_j \mu_j, \quad
    \sigma^2 = \tfrac1m \sum_j m_j (v_j + (\mu_j - \mu)^2), \quad
    y = \tilde w\, (x - \mu)(\sigma^2 + \epsilon)^{-1/2} + \tilde b.

Its bytes grow with the group, :math:`(2|G| + 2) \times c` per worker; on the two-pass path
(larger groups) the forward is two all-reduces of O(c) whatever :math:`|G|`: the per-channel sums with θ
riding along (:attr:`~linop.layers.BatchNorm.totals_reduction`, 3 x c), giving μ and
:math:`\tilde\theta`, then the centred sums of squares :math:`\sum (x - \mu)^2`
(:attr:`~linop.layers.BatchNorm.statistics_reduction`, 1 x c), giving :math:`\sigma^2`.

The backward is one all-reduce, :math:`g = A \tilde g = M M^* \tilde g` of the per-worker
:math:`\tilde g = (\sum \bar y \hat x, \sum \bar y)`: the input gradient reads g, and each
owner's block of g is its parameter gradient :math:`M^*\tilde g`. With ``replicate=True``
every process holds the copies :math:`\tilde\theta` of its blocks as parameters (the forward
moves none) and each gets :math:`M M^* \tilde g`, the gradient of the shared parameter, so
replicas updated alike stay equal. In evaluation the forward moves only the parameters
(owners: M) and the backward sums their copies' gradients (owners: :math:`M^*`; replicated:
:math:`M M^*`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NoReturn

import numpy as np
import torch

from ..errors import LayerError, StateError
from ..layers.base import share_slices
from ..layers.batchnorm import BatchNorm
from .torch_function import TorchOperator, anchor, engine_arguments
from .torch_placement import Placement, workers_of

__all__ = ["BatchNormModule"]

Tensor = torch.Tensor


class _BatchNormFunction(torch.autograd.Function):
    """forward(module, anchor, *x blocks, *parameter blocks) -> (*y blocks, token)."""

    @staticmethod
    def forward(ctx: Any, module: BatchNormModule, anchor: Tensor, *tensors: Tensor) -> Any:
        layer = module.layer
        count = len(module.input_names)
        x = dict(zip(module.input_names, tensors[:count]))
        dtype = tensors[0].dtype if count else torch.float64
        held = {n: t.to(dtype) for n, t in zip(module.parameter_names, tensors[count:])}
        batch = module.training or not layer.track_running_stats
        copies = held if module.replicate else None
        if batch:
            owned = held if layer.affine and not module.replicate else None
            statistics, moved = layer.statistics(x, module.run, owned)
            copies = copies if moved is None else moved
            if module.training and layer.track_running_stats:
                module.update_running(statistics)
        else:
            statistics = {n: module.running_of(n, dtype) for n in x}
            if layer.affine and not module.replicate:
                copies = module.run(module.movement, held)
        outputs, saved = layer.normalized(x, statistics, copies if layer.affine else None)
        ctx.module, ctx.saved, ctx.batch = module, saved, batch
        ctx.dtypes = [t.dtype for t in tensors]
        result = tuple([outputs[n] for n in module.output_names])
        return (*result, torch.zeros(0, dtype=torch.float64))  # the last: the token

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grads: Tensor) -> Any:
        module = ctx.module
        layer = module.layer
        dy = {x_name: g for x_name, g in zip(module.input_names, grads[:-1])}
        dx, copies = layer.input_gradient(dy, ctx.saved, batch_statistics=ctx.batch, run=module.run)
        theta_grads: list[Tensor] = []
        if layer.affine:
            if module.replicate:  # every copy gets M M* of the partials (all-reduced already in training)
                theta = copies if ctx.batch else module.run(module.gradient_reduction, copies)
            elif ctx.batch:  # all-reduced: the owner's copy of each group is M* of the partials
                theta = {n: copies[c] for n, c in zip(module.parameter_names, module.owner_copies)}
            else:
                theta = module.run(module.gradient_sum, copies)
            theta_grads = [theta[n] for n in module.parameter_names]
        gradients = [dx[n] for n in module.input_names] + theta_grads
        fitted = [g.to(dtype) for g, dtype in zip(gradients, ctx.dtypes)]
        return (None, None, *fitted)  # the module; the anchor: no gradient (see anchor())


class BatchNormModule(torch.nn.Module):
    """A distributed :class:`linop.layers.BatchNorm` as an ``nn.Module``: ``module(x_blocks)``
    returns this process's y blocks; train and eval modes as torch's ``BatchNorm{1,2,3}d``.

    Parameters
    ----------
    layer : BatchNorm
    weight, bias : array, optional
        The global initial (C,) affine parameters (default ones and zeros, torch's); each
        owner keeps its blocks.
    comm : mpi4py communicator, optional
        Run across its ranks (every rank builds the same layer and calls collectively).
    group : torch.distributed ProcessGroup or True, optional
        Run across the ranks of this process group (``True``: the world group); not with
        ``comm``.
    dtype : torch.dtype
        The parameters' and running statistics' dtype (default float64).
    replicate : bool
        Hold the parameter *copies* of this process's blocks (the range of the layer's
        ``parameter_movement`` M, blocks ``name_theta_copy[...]``) instead of the blocks it
        owns: the forward moves no parameters, and the backward gives every copy the summed
        gradient of its channels, :math:`M M^* \tilde g`, as a data-parallel code does. Copies
        stay equal while every process applies the same update. Default False: the owners
        hold the blocks, the training forward moves them in its one all-reduce and the
        backward's all-reduce leaves their gradient on the owners.
    mapping : WorkerMap, sequence of int or dict of int to int, optional
        Across processes, the rank of each worker of the layer (x's partition and the
        parameters' owners; default worker ``w`` on rank ``w``), as the executors'
        ``mapping=`` (:func:`linop.backends.mpi.plan_for`), passed to every tree the module
        runs: this process passes the x blocks, and holds the parameter blocks, of the
        workers on its rank. Not used in one process.

    Attributes
    ----------
    input_names, output_names : tuple of str
        The blocks of x this process passes in and of y it gets back (found from this
        rank's workers, not by a pass over x's blocks).
    statistics_trees : tuple of LinearOperator
        The trees of a training forward's statistics, by the layer's
        :attr:`~linop.layers.BatchNorm.statistics_path` (only these are compiled: one
        all-reduce on the gather path, two on the two-pass path).
    parameter_names : tuple of str
        The parameter blocks (rows w, b; shape (2, c)) this process holds (owned blocks, or
        with ``replicate`` its copies), in :attr:`blocks` (an ``nn.ParameterList``).
    channels : tuple of int
        The channel groups (indices along P_c) of this process's blocks; the buffers
        ``running_mean`` and ``running_var`` hold their channels, concatenated in this order
        (all C channels in one process: torch's buffers).
    num_batches_tracked : torch.Tensor
        Training batches seen (torch's buffer).
    token : torch.Tensor
        An empty output of the last call: a process that owns no output block adds
        ``module.token.sum()`` (zero) to its loss so that its backward runs with the others'.

    Raises
    ------
    LayerError
        If ``layer`` is not a BatchNorm.
    WorkerMapError, WorkerMapMismatchError
        A bad ``mapping``, as :class:`~linop.frameworks.torch_windows.BlockModule`.
    """

    layer: BatchNorm
    running_mean: Tensor | None
    running_var: Tensor | None
    num_batches_tracked: Tensor | None

    def __init__(
        self,
        layer: BatchNorm,
        *,
        weight: Any = None,
        bias: Any = None,
        comm: Any = None,
        group: Any = None,
        dtype: torch.dtype = torch.float64,
        replicate: bool = False,
        mapping: Any = None,
    ) -> None:
        super().__init__()
        engine_arguments(comm, group)
        if not isinstance(layer, BatchNorm):
            raise LayerError(f"BatchNormModule takes a BatchNorm layer, not {type(layer).__name__}")
        self.layer = layer
        self.comm, self.group = comm, group
        movement = layer.parameter_movement if layer.affine else None
        self.statistics_trees = layer.statistics_trees
        placement = Placement(  # the workers the map must place: listed only for a map
            mapping,
            comm,
            group,
            lambda: {
                *layer.x.space.workers,
                *workers_of(*self.statistics_trees, layer.gradient_reduction, movement),
            },
        )

        def function(op: Any) -> TorchOperator:
            return TorchOperator(op, comm=comm, group=group, mapping=placement.map)

        self._functions: dict[int, TorchOperator] = {}
        self.replicate = bool(replicate) and layer.affine
        self.gradient_reduction = layer.gradient_reduction
        owners = layer.affine and not self.replicate
        self.movement = layer.parameter_movement if owners else None
        self.gradient_sum = layer.parameter_gradient_reduction if owners else None
        for tree in (*self.statistics_trees, self.gradient_reduction, self.movement, self.gradient_sum):
            if tree is not None:
                self._functions[id(tree)] = function(tree)
        self.input_names = tuple(layer.x.block_name(j) for j in placement.held(layer.x.partition))
        self.output_names = tuple(layer.y.block_name(layer.index(n)) for n in self.input_names)
        self.channels = tuple(sorted({layer.channel(n) for n in self.input_names}))
        slices = share_slices(layer.channel_sizes)
        self._offsets: dict[int, slice] = {}
        start = 0
        for c in self.channels:
            size = slices[c].stop - slices[c].start
            self._offsets[c] = slice(start, start + size)
            start += size
        # worked out once, so that a call derives no names, shapes or offsets
        self._input_shapes = tuple((n, layer.x.space[n].shape) for n in self.input_names)
        self._parts = {n: self._offsets[layer.channel(n)] for n in self.input_names}
        firsts = {layer.channel(n): n for n in reversed(self.input_names)}  # each channel's first block
        self._running_parts = tuple((n, self._offsets[c]) for c, n in sorted(firsts.items()))
        if layer.parameters is not None:
            state = layer.scatter_parameters(weight, bias)
            held = layer.copies if self.replicate else layer.parameters
            if self.replicate:
                state = layer.parameter_movement(state)
            self.parameter_names = tuple(held.block_name(j) for j in placement.held(held.partition))
            self.owner_copies = (
                () if self.replicate else tuple(layer.owner_copy(n) for n in self.parameter_names)
            )
            self.blocks = torch.nn.ParameterList(
                torch.nn.Parameter(torch.from_numpy(np.array(state[n])).to(dtype))
                for n in self.parameter_names
            )
        else:
            if weight is not None or bias is not None:
                raise LayerError("BatchNormModule: weight or bias given to a layer built with affine=False")
            self.parameter_names = ()
            self.owner_copies = ()
            self.blocks = torch.nn.ParameterList()
        if layer.track_running_stats:
            self.register_buffer("running_mean", torch.zeros(start, dtype=dtype))
            self.register_buffer("running_var", torch.ones(start, dtype=dtype))
            self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))
        else:
            self.register_buffer("running_mean", None)
            self.register_buffer("running_var", None)
            self.register_buffer("num_batches_tracked", None)
        self._anchor = anchor()
        self.token = torch.zeros(0, dtype=torch.float64)

    def run(self, op: Any, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Run one of the layer's trees on this process's blocks (collective across ranks)."""
        return self._functions[id(op)].untracked(state)

    def running_of(self, block: str, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The running (mean, var) of the channel group of x's block ``block``."""
        mean, var = self._buffers["running_mean"], self._buffers["running_var"]
        assert mean is not None and var is not None
        part = self._parts[block] if block in self._parts else self._offsets[self.layer.channel(block)]
        return mean[part].to(dtype), var[part].to(dtype)

    def update_running(self, statistics: Mapping[str, tuple[Tensor, Tensor]]) -> None:
        """Fold a training batch's statistics (by x's block) into the running ones (torch's
        rule; every worker of a channel computes the same update from the same all-reduced
        sums)."""
        buffers = self._buffers
        running_mean, running_var = buffers["running_mean"], buffers["running_var"]
        batches = buffers["num_batches_tracked"]
        assert running_mean is not None and running_var is not None and batches is not None
        batches.add_(1)
        momentum = self.layer.momentum
        factor = self.layer.running_factor(int(batches)) if momentum is None else momentum
        if set(statistics) == set(self._parts):  # this process's blocks: one update per channel
            parts: Any = self._running_parts
        else:
            done: set[int] = set()
            parts = []
            for name in statistics:
                c = self.layer.channel(name)
                if c not in done:
                    done.add(c)
                    parts.append((name, self._offsets[c]))
        grad = torch.is_grad_enabled()  # off already inside the module's forward
        if grad:
            torch.set_grad_enabled(False)
        try:
            for name, part in parts:
                running = (running_mean[part], running_var[part])
                batch = statistics[name]
                if running_mean.dtype == running_var.dtype == batch[0].dtype == batch[1].dtype:
                    self.layer.update_running_in_place(running, batch, factor)  # no copies back
                    continue
                new_mean, new_var = self.layer.updated_running(running, batch, factor)
                running_mean[part] = new_mean
                running_var[part] = new_var
        finally:
            if grad:
                torch.set_grad_enabled(True)

    def parameter_state(self) -> dict[str, Tensor]:
        """This process's parameter blocks by name ((2, c): rows w and b)."""
        return dict(zip(self.parameter_names, self.blocks))

    def owned_state(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """Of a state by :attr:`parameter_names` (the parameters, or their gradients), the
        blocks of the owners by parameter block name: itself, or with ``replicate`` the owners'
        copies renamed (for :meth:`linop.layers.BatchNorm.gather_parameters`)."""
        if not self.replicate:
            return dict(state)
        parameters = self.layer.parameters
        assert parameters is not None  # replicate needs affine
        copies = {self.layer.owner_copy(n): n for n in parameters.space.names}
        return {copies[n]: v for n, v in state.items() if n in copies}

    def forward(self, x: Mapping[str, Tensor]) -> dict[str, Tensor]:
        if not (type(x) is dict or isinstance(x, Mapping)) or len(x) != len(self.input_names):
            self._refuse(x)
        tensors = []
        for name, expected in self._input_shapes:
            tensor = x.get(name)
            if tensor is None:
                self._refuse(x)
            if tensor.shape != expected:
                raise StateError(
                    f"BatchNorm layer: block {name!r} has shape {tuple(tensor.shape)}, expected {expected}"
                )
            tensors.append(tensor)
        held: Any = self._modules["blocks"]  # the ParameterList, without nn.Module's __getattr__
        blocks = held._parameters.values()
        *result, token = _BatchNormFunction.apply(self, self._anchor, *tensors, *blocks)
        self.__dict__["token"] = token
        return dict(zip(self.output_names, result))

    def _refuse(self, x: Any) -> NoReturn:
        given = sorted(x) if isinstance(x, Mapping) else type(x).__name__
        raise StateError(f"BatchNorm layer takes blocks {list(self.input_names)}, not {given}")

    def extra_repr(self) -> str:
        layer = self.layer
        return (
            f"{layer.x.space} -> {layer.y.space}, eps={layer.eps}, momentum={layer.momentum}, "
            f"affine={layer.affine}, track_running_stats={layer.track_running_stats}, "
            f"replicate={self.replicate}"
        )
