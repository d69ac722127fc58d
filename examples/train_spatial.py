r"""A spatially parallel convolutional classifier trained with linop, and the same network in
plain ``torch.nn`` on one process: the two learn the same weights and running statistics,
step by step.

Run it on 4 processes (the images cut 2 x 2 over them)::

    python -m torch.distributed.run --nproc-per-node 4 --master-addr 127.0.0.1 \
        --master-port 29513 examples/train_spatial.py --plot docs/images/train_loss.png

or on one process (``python examples/train_spatial.py``): the sequential reference, and the
distributed model on a 2 x 2 grid held whole by the process (linop's numpy interpreter).

The network (:data:`NETWORK`, one line per layer; both models are built from it)::

    x (N, 1, S, S) on 1 x 1 x P_0 x P_1      the image cut over the processes
    up-sample x2, bilinear                   Upsample: output-driven shares, uneven halos
    conv 5x5, 6 channels                     LayerModule(Convolution): halo + torch conv2d
    batch norm -> relu                       BatchNormModule: statistics all-reduced over
                                             the workers of each channel (here all of them)
    max-pool 2                               MaxPool: halo windows + torch max_pool2d
    conv 3x3, 12 channels -> batch norm -> relu -> max-pool 2
    repartition: channels over the workers   Repartition module, to 1 x P x 1 x 1
    flatten                                  each worker's channels: torch's flatten order
    affine -> 32 -> tanh                     LayerModule(Affine): partial products,
                                             sum-reduced onto worker 0
    affine -> 4 classes                      on worker 0
    loss: cross entropy, mean over batch     the logits repartitioned to sample shares on
                                             every worker (the classes whole on each),
                                             log_softmax there, LossModule(Loss("kl_div",
                                             "batchmean")) against the one-hot labels: the
                                             local sums sum-reduced onto worker 0

What runs where: every data movement is a linop tree, run through torch autograd (its backward
the tree's adjoint): the up-sampling's and max-pooling's halo windows
(:mod:`linop.frameworks.torch_resample`, :mod:`linop.frameworks.torch_pooling`); the
convolutions' halo windows, weight broadcasts and gradient sums
(:class:`~linop.frameworks.torch_layers.LayerModule`); batch norm's all-reduces of the
statistics and of the gradient sums, and its parameters' broadcast
(:class:`~linop.frameworks.torch_norm.BatchNormModule`); the repartitions
(:mod:`linop.frameworks.torch_repartition`); the affine layers' and the loss's
sum-reductions (:class:`~linop.frameworks.torch_losses.LossModule`). The arithmetic is
torch's own on each block (the bilinear weights, conv2d, the normalization, relu,
max_pool2d, linear, tanh, log_softmax, kl_div).

Cross entropy is the KL divergence from the one-hot labels (``batchmean``) of the
log-softmax: the reference uses ``F.cross_entropy``; the two agree to rounding.

Every process draws the same data set (:func:`shapes`, deterministic: no download) and keeps
the blocks of its own workers; a real loader would read only its boxes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812 - torch's conventional name

from linop import DistributedTensor, Kernel, Partition
from linop.frameworks.torch_function import TorchOperator
from linop.frameworks.torch_layers import LayerModule
from linop.frameworks.torch_losses import LossModule
from linop.frameworks.torch_norm import BatchNormModule
from linop.frameworks.torch_pooling import MaxPool
from linop.frameworks.torch_repartition import Repartition
from linop.frameworks.torch_resample import Upsample as UpsampleModule
from linop.layers import Affine, AveragePool, Convolution
from linop.layers import BatchNorm as BatchNormLayer
from linop.layers import Loss as LossLayer

Tensor = torch.Tensor
Blocks = dict[str, Tensor]

CLASSES = 4
"""Square outline, plus sign, disk, diagonal cross (:func:`shapes`)."""


# -- data -------------------------------------------------------------------------------------------
def shapes(count: int, size: int, *, seed: int = 0, noise: float = 0.3) -> tuple[np.ndarray, np.ndarray]:
    """``count`` images (count, 1, size, size) of the :data:`CLASSES` shapes at random places and
    sizes, with Gaussian noise, and their labels: deterministic for a seed (numpy's PCG64)."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, CLASSES, count)
    rows, cols = np.mgrid[0:size, 0:size].astype(np.float64)
    images = np.empty((count, 1, size, size))
    for i, label in enumerate(labels):
        radius = rng.uniform(0.2, 0.35) * size
        ci, cj = rng.uniform(radius, size - radius, 2)
        di, dj = rows - ci, cols - cj
        width = max(1.0, size / 12)
        if label == 0:  # square outline
            edge = np.maximum(abs(di), abs(dj))
            picture = abs(edge - radius) < width
        elif label == 1:  # plus sign
            picture = ((abs(di) < width) & (abs(dj) < radius)) | ((abs(dj) < width) & (abs(di) < radius))
        elif label == 2:  # disk
            picture = di**2 + dj**2 < radius**2
        else:  # diagonal cross
            picture = ((abs(di - dj) < width) | (abs(di + dj) < width)) & (
                np.maximum(abs(di), abs(dj)) < radius
            )
        images[i, 0] = picture + noise * rng.standard_normal((size, size))
    return images, labels


# -- the network, as a small spec -------------------------------------------------------------------
@dataclass(frozen=True)
class Upsample:
    """Up-sampling by an integer ``factor`` (torch's ``Upsample``; ``align_corners=False`` for
    the linear modes)."""

    factor: int
    mode: str = "bilinear"


@dataclass(frozen=True)
class Conv:
    """A convolution: ``out`` channels, a ``size`` x ``size`` kernel, padding keeping the size."""

    out: int
    size: int


@dataclass(frozen=True)
class BatchNorm:
    """Batch normalization over the channels (torch's ``BatchNorm2d``: affine, running
    statistics)."""

    eps: float = 1e-5
    momentum: float = 0.1


@dataclass(frozen=True)
class ReLU:
    """max(x, 0) on every entry."""


@dataclass(frozen=True)
class Tanh:
    """tanh on every entry."""


@dataclass(frozen=True)
class Pool:
    """Pooling over ``size`` x ``size`` windows with stride ``size``: ``"max"`` (linop's
    :class:`~linop.frameworks.torch_pooling.MaxPool`) or ``"avg"`` (the windows of
    :class:`~linop.layers.AveragePool` and torch's ``avg_pool2d``)."""

    kind: str
    size: int


@dataclass(frozen=True)
class Regroup:
    """A repartition (the identity on one process): the channels cut over every worker, each
    image whole on its worker, so a flatten there gives torch's flatten order."""


@dataclass(frozen=True)
class Flatten:
    """(N, C, H, W) -> (N, C H W)."""


@dataclass(frozen=True)
class Dense:
    """An affine layer with ``out`` output features."""

    out: int


Layer = Upsample | Conv | BatchNorm | ReLU | Tanh | Pool | Regroup | Flatten | Dense

NETWORK: tuple[Layer, ...] = (
    Upsample(2, "bilinear"),
    Conv(6, 5),
    BatchNorm(),
    ReLU(),
    Pool("max", 2),
    Conv(12, 3),
    BatchNorm(),
    ReLU(),
    Pool("max", 2),
    Regroup(),
    Flatten(),
    Dense(32),
    Tanh(),
    Dense(CLASSES),
)
"""The example's network (LeNet-5's shape, with up-sampling and batch norm)."""


def reference_layer(layer: Layer, shape: tuple[int, ...], dtype: torch.dtype) -> torch.nn.Module:
    """The plain torch module of ``layer`` for inputs of ``shape`` (one process)."""
    if isinstance(layer, Upsample):
        corners = None if layer.mode.startswith("nearest") else False
        return torch.nn.Upsample(scale_factor=layer.factor, mode=layer.mode, align_corners=corners)
    if isinstance(layer, Conv):
        return torch.nn.Conv2d(shape[1], layer.out, layer.size, padding=layer.size // 2, dtype=dtype)
    if isinstance(layer, BatchNorm):
        return torch.nn.BatchNorm2d(shape[1], eps=layer.eps, momentum=layer.momentum, dtype=dtype)
    if isinstance(layer, ReLU):
        return torch.nn.ReLU()
    if isinstance(layer, Tanh):
        return torch.nn.Tanh()
    if isinstance(layer, Pool):
        pool = torch.nn.AvgPool2d if layer.kind == "avg" else torch.nn.MaxPool2d
        return pool(layer.size, stride=layer.size)
    if isinstance(layer, Regroup):
        return torch.nn.Identity()
    if isinstance(layer, Flatten):
        return torch.nn.Flatten()
    if isinstance(layer, Dense):
        return torch.nn.Linear(shape[1], layer.out, dtype=dtype)
    raise TypeError(f"no reference builder for {layer!r}")


def reference_model(
    spec: Sequence[Layer], input_shape: tuple[int, ...], *, seed: int, dtype: torch.dtype
) -> torch.nn.Sequential:
    """The network in plain torch.nn, initialized by torch's default rules after
    ``torch.manual_seed(seed)``: its weights are also the distributed model's initial ones."""
    torch.manual_seed(seed)
    layers = []
    shape = input_shape
    for layer in spec:
        module = reference_layer(layer, shape, dtype)
        layers.append(module)
        with torch.no_grad():
            shape = tuple(module.eval()(torch.zeros(shape, dtype=dtype)).shape)
        module.train()
    return torch.nn.Sequential(*layers)


def reference_state(model: torch.nn.Sequential) -> list[np.ndarray]:
    """Copies of every layer's parameters (weight, bias) and, after a batch norm's, its running
    mean and variance, in the layers' order: what :meth:`SpatialModel.global_state` gathers."""
    arrays: list[np.ndarray] = []
    for module in model:
        arrays += [p.detach().numpy().copy() for p in module.parameters()]
        if isinstance(module, torch.nn.BatchNorm2d):
            assert module.running_mean is not None and module.running_var is not None
            arrays += [module.running_mean.numpy().copy(), module.running_var.numpy().copy()]
    return arrays


def reference_loss(logits: Tensor, labels: Tensor) -> Tensor:
    return F.cross_entropy(logits, labels)


# -- the distributed model ------------------------------------------------------------------------
def grid_for(processes: int) -> tuple[int, int]:
    """The 2-d grid of workers an image is cut over: as square as the count allows."""
    rows = max(r for r in range(1, math.isqrt(processes) + 1) if processes % r == 0)
    return processes // rows, rows


MAPPINGS = ("identity", "reversed", "transposed")
"""The worker maps of the command line's ``--mapping`` (:func:`mapping_for`)."""


def mapping_for(name: str, grid: tuple[int, int]) -> tuple[int, ...] | None:
    """The rank of each worker of ``grid`` (row-major: worker ``w`` at ``divmod(w, grid[1])``)
    for ``--mapping name``: ``identity``, worker ``w`` on rank ``w`` (None: the modules'
    default); ``reversed``, on rank ``P - 1 - w`` (worker 0, the root of the affine layers'
    and the loss's sums, on the last rank); ``transposed``, the grid's workers numbered
    column by column (worker ``(i, j)`` on rank ``j P_0 + i``)."""
    rows, cols = grid
    if name == "identity":
        return None
    if name == "reversed":
        return tuple(range(rows * cols - 1, -1, -1))
    if name == "transposed":
        return tuple(j * rows + i for i in range(rows) for j in range(cols))
    raise ValueError(f"no worker map {name!r}: one of {MAPPINGS}")


def gather(tensor: DistributedTensor | None, state: Mapping[str, np.ndarray]) -> np.ndarray:
    """The global array of ``tensor`` from a state holding (at least) its blocks."""
    assert tensor is not None  # the layers are built with a bias
    return tensor.gather({name: state[name] for name in tensor.space.names})


class Stage(torch.nn.Module):
    """One layer of the distributed model: this process's blocks of ``x`` in, of ``y`` out."""

    x: DistributedTensor
    y: DistributedTensor

    def tokens(self) -> list[Tensor]:
        """The empty outputs of this stage's last linop calls (see :meth:`SpatialModel.loss`)."""
        return []

    def local_state(self) -> dict[str, np.ndarray]:
        """This process's blocks of the stage's parameters and statistics, by name."""
        return {}

    def global_state(self, state: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """The stage's global arrays in :func:`reference_state`'s order, from the union of
        every process's :meth:`local_state`."""
        return []


class WrappedStage(Stage):
    """A stage that is one linop module (``module``): its forward and its token are the
    module's."""

    module: Any

    def forward(self, blocks: Blocks) -> Blocks:
        return self.module(blocks)

    def tokens(self) -> list[Tensor]:
        return [self.module.token]

    def parameter_blocks(self) -> dict[str, np.ndarray]:
        """Copies of this process's blocks of the module's parameters, by name."""
        return {n: p.detach().numpy().copy() for n, p in self.module.parameter_state().items()}


class ModuleStage(WrappedStage):
    """A linop module that maps this process's blocks of x to its blocks of y (up-sampling,
    max-pooling, a repartition); its ``token`` is the stage's."""

    def __init__(self, module: Any) -> None:
        super().__init__()
        self.module = module
        self.x = module.source if isinstance(module, Repartition) else module.x
        self.y = module.destination if isinstance(module, Repartition) else module.y


class ConvStage(WrappedStage):
    """A :class:`~linop.layers.Convolution` as a :class:`LayerModule` (halo, weight broadcast,
    torch conv2d per block, gradient sums)."""

    def __init__(
        self,
        x: DistributedTensor,
        layer: Conv,
        name: str,
        reference: Any,
        group: Any,
        dtype: torch.dtype,
        replicate: bool = False,
        mapping: Any = None,
    ) -> None:
        super().__init__()
        conv = Convolution(x, layer.out, Kernel(layer.size, padding=layer.size // 2), name=name)
        self.x, self.y, self.layer = x, conv.y, conv
        self.module = LayerModule(
            conv,
            weights=reference.weight.detach().numpy(),
            bias=reference.bias.detach().numpy(),
            group=group,
            mapping=mapping,
            dtype=dtype,
            replicate=replicate,
        )

    def local_state(self) -> dict[str, np.ndarray]:
        return self.parameter_blocks()

    def global_state(self, state: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        if self.module.replicate:
            raise ValueError("the global parameters are gathered from their owners' blocks: replicate=False")
        return [gather(self.layer.weights, state), gather(self.layer.bias, state)]


class BatchNormStage(WrappedStage):
    """A :class:`~linop.layers.BatchNorm` as a :class:`BatchNormModule`: (w; b) on the workers
    of the first batch-and-feature block of each channel share, broadcast to the others; the
    running statistics on every process that holds a block of the channel."""

    def __init__(
        self,
        x: DistributedTensor,
        layer: BatchNorm,
        name: str,
        reference: Any,
        group: Any,
        dtype: torch.dtype,
        mapping: Any = None,
    ) -> None:
        super().__init__()
        norm = BatchNormLayer(x, eps=layer.eps, momentum=layer.momentum, name=name)
        self.x, self.y, self.layer, self.name = x, norm.y, norm, name
        self.module = BatchNormModule(
            norm,
            weight=reference.weight.detach().numpy(),
            bias=reference.bias.detach().numpy(),
            group=group,
            mapping=mapping,
            dtype=dtype,
        )
        edges = np.cumsum([0, *norm.channel_sizes])
        self.channel_slices = [slice(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:])]

    def local_state(self) -> dict[str, np.ndarray]:
        state = self.parameter_blocks()
        module = self.module
        assert module.running_mean is not None and module.running_var is not None
        start = 0
        for c in module.channels:  # the buffers hold this process's channel groups, in this order
            size = self.channel_slices[c].stop - self.channel_slices[c].start
            for key, buffer in (("mean", module.running_mean), ("var", module.running_var)):
                state[f"{self.name}.running_{key}[{c}]"] = buffer[start : start + size].numpy().copy()
            start += size
        return state

    def global_state(self, state: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        w, b = self.layer.gather_parameters(state)
        running = [
            np.concatenate(
                [state[f"{self.name}.running_{key}[{c}]"] for c in range(len(self.channel_slices))]
            )
            for key in ("mean", "var")
        ]
        return [w, b, *running]


class PoolStage(Stage):
    """Average pooling as halo windows (the window tree of :class:`~linop.layers.AveragePool`,
    moved by linop) and torch's ``avg_pool2d`` on each window."""

    def __init__(
        self,
        x: DistributedTensor,
        layer: Pool,
        name: str,
        holds: Callable[[int], bool],
        group: Any,
        mapping: Any,
    ) -> None:
        super().__init__()
        pool = AveragePool(x, Kernel(layer.size, stride=layer.size), name=name)
        self.x, self.y = x, pool.y
        self.windows = TorchOperator(pool.window_operator, group=group, mapping=mapping)
        self.size = layer.size
        self.names = [
            (pool.window_name(g), pool.y.block(g).name)
            for g in x.partition.indices()
            if holds(pool.y.block(g).worker)
        ]

    def forward(self, blocks: Blocks) -> Blocks:
        windows = self.windows(blocks)
        return {out: F.avg_pool2d(windows[window], self.size, stride=self.size) for window, out in self.names}

    def tokens(self) -> list[Tensor]:
        return [self.windows.token]


class PointwiseStage(Stage):
    """An activation on every block where it lies."""

    def __init__(self, x: DistributedTensor, function: Callable[[Tensor], Tensor]) -> None:
        super().__init__()
        self.x = self.y = x
        self.function = function

    def forward(self, blocks: Blocks) -> Blocks:
        return {name: self.function(block) for name, block in blocks.items()}


class FlattenStage(Stage):
    r"""(N, C, H, W) on 1 x P_c x P_0 x P_1 -> (N, F) on 1 x (P_c P_0 P_1): each worker's block
    flattened where it lies (no data moves). The features come in block order: :attr:`order`
    lists, for each feature here, its index in torch's flatten, so a weight matrix ``W`` of the
    reference is ``W[:, order]`` here. After a :class:`Regroup` (the channels cut, the images
    whole) the order is torch's: ``order`` is the identity."""

    def __init__(self, x: DistributedTensor, name: str) -> None:
        super().__init__()
        if x.partition.shape[0] != 1:
            raise ValueError(f"flatten needs the batch whole: partition {x.partition.shape}")
        self.x = x
        index = np.arange(math.prod(x.global_shape[1:])).reshape(x.global_shape[1:])
        boxes = [x.box(g) for g in x.partition.indices()]
        pieces = [
            index[tuple(slice(lo, hi) for lo, hi in zip(start[1:], stop[1:]))].ravel()
            for start, stop in boxes
        ]
        self.order = np.concatenate(pieces)
        workers = tuple(x.partition.worker(g) for g in x.partition.indices())
        sizes = ((x.global_shape[0],), tuple(p.size for p in pieces))
        self.y = DistributedTensor(
            name, (x.global_shape[0], self.order.size), Partition((1, len(workers)), workers), sizes
        )
        self.names = {x.block(g).name: self.y.block((0, k)).name for k, g in enumerate(x.partition.indices())}

    def forward(self, blocks: Blocks) -> Blocks:
        return {self.names[name]: block.reshape(block.shape[0], -1) for name, block in blocks.items()}


class DenseStage(WrappedStage):
    """An :class:`~linop.layers.Affine` layer as a :class:`LayerModule`: each worker multiplies
    its features, the partial outputs sum-reduced onto worker 0."""

    def __init__(
        self,
        x: DistributedTensor,
        layer: Dense,
        name: str,
        reference: Any,
        order: np.ndarray | None,
        group: Any,
        dtype: torch.dtype,
        mapping: Any = None,
    ) -> None:
        super().__init__()
        affine = Affine(x, layer.out, name=name)
        self.x, self.y, self.layer = x, affine.y, affine
        identity = order is None or np.array_equal(order, np.arange(order.size))
        self.order = None if identity else order
        weights = reference.weight.detach().numpy()
        self.module = LayerModule(
            affine,
            weights=weights if self.order is None else weights[:, self.order],
            bias=reference.bias.detach().numpy(),
            group=group,
            mapping=mapping,
            dtype=dtype,
        )

    def local_state(self) -> dict[str, np.ndarray]:
        return self.parameter_blocks()

    def global_state(self, state: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        weights = gather(self.layer.weights, state)
        if self.order is not None:  # back to torch's flatten order
            weights = weights[:, np.argsort(self.order)]
        return [weights, gather(self.layer.bias, state)]


class LossStage(torch.nn.Module):
    r"""The mean cross entropy of logits held by one worker:

    .. math::

        z' = T z \quad (\text{Repartition: sample shares on every worker, the classes whole}),
        \qquad \ell = \tfrac1N\, R \Big(\sum_{n \in j} \mathrm{KL}\big(e_{c_n} \,\|\,
        \log\operatorname{softmax}(z'_n)\big)\Big)_j

    the log-softmax on each worker's samples (each row holds every class), the KL divergence
    from the one-hot labels :math:`e_{c_n}` (that is :math:`-\log\operatorname{softmax}(z'_n)_{c_n}`)
    summed locally and sum-reduced onto worker 0 by :class:`LossModule` (``batchmean``: divided
    by N). Backward: the broadcast :math:`R^*` of the loss's gradient, the local derivatives,
    then :math:`T^{*} = T^{-1}`."""

    def __init__(
        self, logits: DistributedTensor, workers: int, group: Any, dtype: torch.dtype, mapping: Any = None
    ) -> None:
        super().__init__()
        samples, classes = logits.global_shape
        self.shares = DistributedTensor("scores", (samples, classes), Partition((workers, 1)))
        self.spread = Repartition(logits, self.shares, group=group, mapping=mapping)
        loss = LossLayer(self.shares, "kl_div", reduction="batchmean")
        self.module = LossModule(loss, group=group, mapping=mapping)
        self.dtype = dtype

    def forward(self, logits: Blocks, labels: Tensor) -> tuple[Tensor | None, Tensor]:
        """The loss (on worker 0's process; None elsewhere) and the scalar to call ``backward()``
        on (the loss, or a zero tied to the collective backward)."""
        scores = self.spread(logits)
        logp = {name: torch.log_softmax(block, dim=1) for name, block in scores.items()}
        one_hot = F.one_hot(labels, self.shares.global_shape[1]).numpy()
        targets = {
            name: torch.from_numpy(block).to(self.dtype)
            for name, block in self.shares.scatter(one_hot).items()
            if name in logp
        }
        value = self.module(logp, targets)
        return (value if self.module.is_root else None), value

    def tokens(self) -> list[Tensor]:
        return [self.spread.token]


class SpatialModel(torch.nn.Module):
    """:data:`NETWORK` (or any spec of its layer kinds) on images cut over a grid of workers.

    Parameters
    ----------
    spec : sequence of layers
    reference : torch.nn.Sequential
        The same network in one piece (:func:`reference_model`): its weights are the initial
        ones, each process keeping its blocks.
    batch, size : int
        The global batch (N, 1, size, size): the distributed tensors have fixed shapes.
    grid : (int, int)
        The workers along the image's rows and columns (row-major: worker ``w`` is the image's
        block ``divmod(w, grid[1])``, and the ``w``-th share of every later partition).
    group : torch.distributed process group, True or None
        None: one process holds every worker's blocks (linop's numpy interpreter).
    mapping : sequence of int, optional
        Under a process group, the rank of each worker (``mapping[w]``; default worker ``w`` on
        rank ``w``): passed as ``mapping=`` to every linop module and tree, and this process
        keeps the blocks of the workers on its rank (:func:`mapping_for` gives the
        command line's). Not used in one process.
    dtype : torch.dtype
        The parameters' and activations' dtype.
    replicate : bool
        The convolutions' parameters replicated on every process, their gradients all-reduced
        (``LayerModule(..., replicate=True)``) instead of held by their owners, broadcast in the
        forward and summed back in the backward (the default; :meth:`global_state` needs it).
    """

    def __init__(
        self,
        spec: Sequence[Layer],
        reference: torch.nn.Sequential,
        *,
        batch: int,
        size: int,
        grid: tuple[int, int],
        group: Any = None,
        dtype: torch.dtype = torch.float64,
        replicate: bool = False,
        mapping: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        self.group = group
        self.replicate = replicate
        self.rank = None if group is None else torch.distributed.get_rank()
        self.mapping = None if group is None or mapping is None else tuple(mapping)
        self.dtype = dtype
        self.workers = grid[0] * grid[1]
        self.x = DistributedTensor("x", (batch, 1, size, size), Partition((1, 1, *grid)))
        stages: list[Stage] = []
        x, order = self.x, None
        for i, (layer, twin) in enumerate(zip(spec, reference)):
            stage = self.stage(layer, x, f"y{i}", twin, order)
            order = stage.order if isinstance(stage, FlattenStage) else None
            stages.append(stage)
            x = stage.y
        self.stages = torch.nn.ModuleList(stages)
        # the stages before the first layer kind with parameters (from the spec, the same on
        # every process: a process may hold none of a layer's parameter blocks)
        self.leading = next(
            (k for k, layer in enumerate(spec) if isinstance(layer, Conv | BatchNorm | Dense)), len(spec)
        )
        self.loss_stage = LossStage(x, self.workers, group, dtype, self.mapping)

    def holds(self, worker: int) -> bool:
        """Whether this process holds ``worker``'s blocks (every worker's in one process)."""
        return self.rank is None or self.rank_of(worker) == self.rank

    def rank_of(self, worker: int) -> int:
        """The rank of ``worker`` (under a process group)."""
        return worker if self.mapping is None else self.mapping[worker]

    def stage(self, layer: Layer, x: DistributedTensor, name: str, twin: Any, order: Any) -> Stage:
        """The distributed module of one spec entry (the place a new layer kind gets its line)."""
        group, dtype, mapping = self.group, self.dtype, self.mapping
        if isinstance(layer, Upsample):
            corners = None if layer.mode.startswith("nearest") else False
            return ModuleStage(
                UpsampleModule(
                    x,
                    scale_factor=layer.factor,
                    mode=layer.mode,
                    align_corners=corners,
                    name=name,
                    dtype=dtype,
                    group=group,
                    mapping=mapping,
                )
            )
        if isinstance(layer, Conv):
            return ConvStage(x, layer, name, twin, group, dtype, self.replicate, mapping)
        if isinstance(layer, BatchNorm):
            return BatchNormStage(x, layer, name, twin, group, dtype, mapping)
        if isinstance(layer, ReLU):
            return PointwiseStage(x, torch.relu)
        if isinstance(layer, Tanh):
            return PointwiseStage(x, torch.tanh)
        if isinstance(layer, Pool) and layer.kind == "max":
            return ModuleStage(MaxPool(x, layer.size, name=name, group=group, mapping=mapping))
        if isinstance(layer, Pool):
            return PoolStage(x, layer, name, self.holds, group, mapping)
        if isinstance(layer, Regroup):
            channels = DistributedTensor(name, x.global_shape, Partition((1, self.workers, 1, 1)))
            return ModuleStage(Repartition(x, channels, group=group, mapping=mapping))
        if isinstance(layer, Flatten):
            return FlattenStage(x, name)
        if isinstance(layer, Dense):
            return DenseStage(x, layer, name, twin, order, group, dtype, mapping)
        raise TypeError(f"no distributed builder for {layer!r}")

    def mine(self, tensor: DistributedTensor, array: np.ndarray) -> Blocks:
        """This process's blocks of a global array (every block in one process)."""
        blocks = tensor.scatter(array)
        return {
            b.name: torch.from_numpy(blocks[b.name]).to(self.dtype)
            for b in tensor.space
            if self.holds(b.worker)
        }

    def forward(self, blocks: Blocks, *, input_gradient: bool = True) -> Blocks:
        """This process's blocks of the logits. ``input_gradient=False`` (the images are data:
        say so alike on every process) runs the stages before the first one with parameters
        (the up-sampling) without recording autograd: see :meth:`loss_of`."""
        stages: list[Stage] = list(self.stages)  # type: ignore[arg-type]  # a ModuleList of stages
        lead = 0 if input_gradient else self.leading
        with torch.no_grad():
            for stage in stages[:lead]:
                blocks = stage(blocks)
        for stage in stages[lead:]:
            blocks = stage(blocks)
        return blocks

    def loss(self, images: np.ndarray, labels: np.ndarray) -> tuple[Tensor | None, Tensor]:
        """The mean loss of a batch (see :meth:`loss_of`) from its global images (data: no
        gradient with respect to them)."""
        return self.loss_of(self.mine(self.x, images), labels, input_gradient=False)

    def loss_of(
        self, blocks: Blocks, labels: np.ndarray, *, input_gradient: bool = True
    ) -> tuple[Tensor | None, Tensor]:
        """The mean loss (on worker 0's process; None elsewhere) of this process's blocks of
        the images, and the scalar this process calls ``backward()`` on: the loss, or zero,
        plus every linop call's empty *token*, so that every process runs the backward of every
        call (they are collective), including the calls whose outputs it holds none of. The
        backward meets the collectives in the same order on every process: the reverse of the
        forward's, since autograd's ready queue runs the node created last first and every
        process creates the calls' nodes in the same order.

        ``input_gradient=False``: no process needs the gradient with respect to the images
        (a training step), which every process must say alike. The leading stages without
        parameters (the up-sampling) then run without recording autograd. Recorded, their
        outputs would require a gradient on every process whatever the images do (a linop
        call's anchor, which keeps its backward collective, requires one), so the first
        convolution would compute its input gradient, the costliest product of the step
        (one input channel), and the up-sampling's adjoint halo would move it, for nothing.
        The hand-written network never records them: its images need no gradient."""
        logits = self(blocks, input_gradient=input_gradient)
        loss, value = self.loss_stage(logits, torch.from_numpy(labels))
        stages: list[Stage] = list(self.stages)  # type: ignore[arg-type]  # a ModuleList of stages
        tokens = [t for stage in stages for t in stage.tokens()] + self.loss_stage.tokens()
        anchor = sum((t.sum() for t in tokens), torch.zeros((), dtype=torch.float64))
        return loss, anchor + value

    def global_state(self) -> list[np.ndarray]:
        """Every layer's global weights and bias, and every batch norm's running mean and
        variance, in :func:`reference_state`'s order (torch's flatten order for an affine
        layer after a flatten): collective under a process group."""
        stages: list[Stage] = list(self.stages)  # type: ignore[arg-type]  # a ModuleList of stages
        state: dict[str, np.ndarray] = {}
        for stage in stages:
            state.update(stage.local_state())
        if self.group is not None:
            everyone: list[Any] = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(everyone, state)
            state = {}
            for part in everyone:  # a channel's running statistics: the first holder's (all equal)
                state.update({name: array for name, array in part.items() if name not in state})
        return [array for stage in stages for array in stage.global_state(state)]


def compiled_loss(model: SpatialModel, **options: Any) -> Callable[..., Any]:
    """``model.loss`` under ``torch.compile(**options)``, linop's calls left out of the graphs.

    Every linop call (a module of linop's: :class:`LayerModule`, :class:`BatchNormModule`,
    :class:`MaxPool`; a :class:`TorchOperator`: the halo windows, repartitions and the loss's
    sum-reduction) is run eagerly (``torch.compiler.disable``): a graph break at each of them, so torch compiles
    the arithmetic between them (the bilinear weights, relu, max_pool2d, flatten, tanh,
    log_softmax, kl_div) and autograd runs linop's backward as in eager mode. Without it
    dynamo traces into linop's Python (the interpreters, numpy views, locks) and breaks the
    graph there anyway, many times, after a long trace.
    """
    for module in model.modules():
        if type(module).__module__.startswith("linop."):
            module.forward = torch.compiler.disable(module.forward)  # type: ignore[method-assign]
        for value in vars(module).values():
            if isinstance(value, TorchOperator):
                value.tensors = torch.compiler.disable(value.tensors)  # type: ignore[method-assign]
    return torch.compile(model.loss, **options)


# -- training ---------------------------------------------------------------------------------------
@dataclass
class History:
    """Per step: the loss before the update and (when recorded) the state after it: the
    weights, biases and batch norms' running statistics (:func:`reference_state`'s order)."""

    losses: list[float]
    weights: list[list[np.ndarray]]
    times: list[float] = field(default_factory=list)  # when each step started (perf_counter)


def batches(images: np.ndarray, labels: np.ndarray, batch: int, steps: int):
    """``steps`` batches cycling over the data set in order."""
    count = len(labels) // batch
    for step in range(steps):
        k = step % count
        yield images[k * batch : (k + 1) * batch], labels[k * batch : (k + 1) * batch]


def train_reference(
    model: torch.nn.Sequential, data, *, lr: float, momentum: float, record: bool, dtype: torch.dtype
) -> History:
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    history = History([], [])
    for images, labels in data:
        optimizer.zero_grad()
        loss = reference_loss(model(torch.from_numpy(images).to(dtype)), torch.from_numpy(labels))
        loss.backward()
        optimizer.step()
        history.losses.append(loss.item())
        if record:
            history.weights.append(reference_state(model))
    return history


def train_distributed(
    model: SpatialModel,
    data,
    *,
    lr: float,
    momentum: float,
    record: bool,
    step_loss: Callable[..., Any] | None = None,
) -> History:
    """SGD on each process's parameter blocks (each block on one process: plain SGD, momentum
    included, is the reference's update entry by entry)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    compute = step_loss or model.loss
    history = History([], [])
    for images, labels in data:
        history.times.append(time.perf_counter())
        optimizer.zero_grad()
        loss, anchor = compute(images, labels)
        anchor.backward()
        optimizer.step()
        if loss is not None:
            history.losses.append(loss.item())
        if record:
            history.weights.append(model.global_state())
    return history


def plot(path: str, distributed: Sequence[float], reference: Sequence[float], processes: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 3.5), dpi=120)
    steps = np.arange(1, len(reference) + 1)
    axes.plot(steps, reference, color="black", linewidth=2.5, label="torch.nn, 1 process")
    axes.plot(
        steps,
        distributed,
        "o",
        color="tab:orange",
        markersize=3,
        label=f"linop, {processes} processes (images cut {' x '.join(map(str, grid_for(processes)))})",
    )
    axes.set_xlabel("SGD step")
    axes.set_ylabel("cross-entropy loss")
    axes.set_yscale("log")
    axes.legend()
    gap = max(abs(a - b) for a, b in zip(distributed, reference))
    axes.set_title(f"Up-sample/conv/BN/max-pool net, float64: max loss gap {gap:.1e}", fontsize=9)
    figure.tight_layout()
    figure.savefig(path)


def arguments(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument(
        "--size", type=int, default=16, help="image side (pixels; the network up-samples it x2)"
    )
    parser.add_argument("--samples", type=int, default=512, help="data set size")
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    parser.add_argument(
        "--mapping",
        choices=MAPPINGS,
        default="identity",
        help="which rank holds each worker's blocks (the modules' mapping=): worker w on rank w, "
        "on rank P - 1 - w, or the grid numbered column by column",
    )
    parser.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        metavar="BACKEND",
        help="run the distributed model's loss under torch.compile (backend: default inductor)",
    )
    parser.add_argument("--plot", help="write both loss curves to this PNG (needs matplotlib)")
    parser.add_argument(
        "--record", help="write every step's losses and gathered weights to this .npz (rank 0)"
    )
    parser.add_argument(
        "--timeout", type=float, default=120, help="seconds for the process group's rendezvous"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = arguments(argv)
    dtype = getattr(torch, args.dtype)
    group = None
    if "WORLD_SIZE" in os.environ:  # under torchrun
        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
        group = True
    processes = torch.distributed.get_world_size() if group else 1
    rank = torch.distributed.get_rank() if group else 0
    grid = grid_for(processes if group else 4)  # one process: a 2 x 2 grid held whole
    images, labels = shapes(args.samples, args.size, seed=args.seed)
    shape = (args.batch, 1, args.size, args.size)
    reference = reference_model(NETWORK, shape, seed=args.seed, dtype=dtype)
    mapping = mapping_for(args.mapping, grid) if group else None
    model = SpatialModel(
        NETWORK,
        reference,
        batch=args.batch,
        size=args.size,
        grid=grid,
        group=group,
        dtype=dtype,
        mapping=mapping,
    )
    step_loss = compiled_loss(model, backend=args.compile) if args.compile else None
    record = args.record is not None
    mine = train_distributed(
        model,
        batches(images, labels, args.batch, args.steps),
        lr=args.lr,
        momentum=args.momentum,
        record=record,
        step_loss=step_loss,
    )
    seconds = time.perf_counter() - mine.times[0]  # from the first step (the optimizer built)
    later = (time.perf_counter() - mine.times[1]) / (args.steps - 1) if args.steps > 1 else seconds
    if group:
        losses = [mine.losses]  # known on worker 0's process (the loss's root): to rank 0
        torch.distributed.broadcast_object_list(losses, src=model.rank_of(0))
        mine.losses = losses[0]
        torch.distributed.destroy_process_group()
    if rank != 0:
        return
    alone = train_reference(
        reference,
        batches(images, labels, args.batch, args.steps),
        lr=args.lr,
        momentum=args.momentum,
        record=record,
        dtype=dtype,
    )
    gap = max(abs(a - b) for a, b in zip(mine.losses, alone.losses))
    where = f"{processes} processes" if group else "1 process, 4 workers"
    where += f", grid {grid[0]} x {grid[1]}" + (
        "" if mapping is None else f", workers on ranks {list(mapping)}"
    )
    print(
        f"linop ({where}): {args.steps} steps in {seconds:.2f} s"
        f" (the first binds the plans; {1000 * later:.1f} ms a step after it)"
    )
    for step in sorted({0, args.steps // 2, args.steps - 1}):
        print(
            f"step {step:4d}: loss {mine.losses[step]:.12f} (torch.nn, 1 process: {alone.losses[step]:.12f})"
        )
    print(f"largest loss difference: {gap:.2e}")
    if record:
        arrays: dict[str, Any] = {"losses": np.array(mine.losses), "reference_losses": np.array(alone.losses)}
        for prefix, history in (("w", mine), ("r", alone)):  # w: linop's, r: the reference's
            arrays.update(
                {f"{prefix}{s}_{k}": w for s, step in enumerate(history.weights) for k, w in enumerate(step)}
            )
        np.savez(args.record, **arrays)
        print(json.dumps({"recorded": args.record, "steps": len(mine.losses)}))
    if args.plot:
        plot(args.plot, mine.losses, alone.losses, processes if group else 1)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
