"""The training step of ``examples/train_spatial.py`` on 4 gloo processes against the same
network written by hand with torch.distributed.

Run with ``python benchmarks/bench_train.py`` (forks 4 processes, rendezvous on 127.0.0.1), or
under ``torchrun --nproc-per-node 4 --master-addr 127.0.0.1 --master-port P``.

- ``linop``: the example's :class:`SpatialModel` (images cut 2 x 2): one SGD step, forward
  and backward of every layer and the loss, every data movement a linop tree (the
  up-sampling's and max-pooling's halo windows; the convolutions' ``LayerModule`` with their
  parameters on their owners, broadcast in the forward and summed back in the backward; batch
  norm's all-reduces and parameter broadcast; the repartition to channel shares; the affine
  layers' sum-reductions; the loss's repartition to sample shares and sum-reduction);
  ``linop replicated``: the same with the convolutions' parameters replicated
  (``LayerModule(..., replicate=True)``: no broadcast, an all-reduce of their gradients, as
  the hand-written network does).
- ``hand``: the same network by hand: an ``autograd.Function`` exchanging the 2-d halo with
  ``isend``/``irecv`` (rows, then columns with the corners; the backward adds the halo
  gradients back in the reverse order); the up-sampling as a halo of 1 (the image's edges
  replicated) and ``F.interpolate`` on the padded block, cropped; ``conv2d`` on the padded
  block; batch norm with its per-channel sums ``all_reduce``-d (an autograd function whose
  backward all-reduces the gradient: 2 all-reduces forward, 2 backward) and its running
  statistics updated; ``max_pool2d`` on the block (even blocks: no halo); the first affine
  layer's partial products on each block's features (no repartition) ``dist.reduce``-d onto
  rank 0 (its backward a ``broadcast``), the second affine layer and the cross entropy on
  rank 0, and an ``all_reduce`` of the replicated convolution and batch norm parameters'
  gradients; ``torch.optim.SGD``.

Both start from the same weights, and their first steps' losses are checked equal (float64, to
1e-10) before timing. Timed in the same processes, interleaved sample by sample (each sample a
batch of steps, its time the maximum over ranks); the table shows medians and the median of
per-sample ratios, of wall and of CPU time. ``BENCH_RECORDED=1`` adds ``linop, images recorded``:
the example's model with autograd recording its up-sampling of the images
(``loss_of(..., input_gradient=True)``, as it did before ``loss`` said that the images need
no gradient: the first convolution then computes its input gradient). ``BENCH_TRAIN`` = ``batch,size`` pairs separated by ``;`` (default
``32,32;16,64``: images of 32 x 32 and 64 x 64, up-sampled to 64 x 64 and 128 x 128; the size
a multiple of 4), ``BENCH_SAMPLES`` (default 15), ``BENCH_DTYPE`` (default float32).
Nothing is asserted about speed. The machine may be shared: report its load with the figures.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from statistics import median
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812 - torch's conventional name
from _gloo import launch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import train_spatial as example

SAMPLES = int(os.environ.get("BENCH_SAMPLES", "15"))
RECORDED = os.environ.get("BENCH_RECORDED") == "1"
CASES = [
    tuple(int(n) for n in case.split(",")) for case in os.environ.get("BENCH_TRAIN", "32,32;16,64").split(";")
]
DTYPE = getattr(torch, os.environ.get("BENCH_DTYPE", "float32"))
LR, MOMENTUM = 0.01, 0.9
Tensor = torch.Tensor


def timed(
    methods: dict[str, Callable[[], object]], batch: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Per method, per sample: the maximum over ranks of a batch's mean wall time per call,
    and of its mean CPU time per call (``time.process_time``: this process's, its threads'
    included)."""
    times: dict[str, list[float]] = {name: [] for name in methods}
    cpu: dict[str, list[float]] = {name: [] for name in methods}
    for function in methods.values():
        function()
    for _ in range(SAMPLES):
        for name, function in methods.items():
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            for _ in range(batch):
                function()
            elapsed = torch.tensor(
                [(time.perf_counter() - start) / batch, (time.process_time() - start_cpu) / batch],
                dtype=torch.float64,
            )
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[name].append(float(elapsed[0]))
            cpu[name].append(float(elapsed[1]))
    return times, cpu


# -- the hand-written network ---------------------------------------------------------------------
class HaloExchange2d(torch.autograd.Function):
    """The block padded by ``h`` on each side of its two last dimensions, the padding filled
    from the neighbours of a ``rows x cols`` grid of ranks (zeros at the image's edges): rows
    first, then columns over the full padded height (which carries the corners). Backward:
    the adjoint, columns first, each halo's gradient added into the neighbour's interior."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, h: int, grid: tuple[int, int]) -> Tensor:
        ctx.h, ctx.grid = h, grid
        padded = F.pad(x, (h, h, h, h))
        _rows(padded, h, grid, adjoint=False)
        _columns(padded, h, grid, adjoint=False)
        return padded

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        h, grid = ctx.h, ctx.grid
        grad = grad.clone()
        _columns(grad, h, grid, adjoint=True)
        _rows(grad, h, grid, adjoint=True)
        return grad[..., h:-h, h:-h].contiguous(), None, None


def _neighbours(grid: tuple[int, int]) -> tuple[int, int, int, int]:
    """The ranks above, below, left and right of this one (-1: none), rank = i * cols + j."""
    rank = dist.get_rank()
    i, j = divmod(rank, grid[1])
    up = rank - grid[1] if i > 0 else -1
    down = rank + grid[1] if i < grid[0] - 1 else -1
    left = rank - 1 if j > 0 else -1
    right = rank + 1 if j < grid[1] - 1 else -1
    return up, down, left, right


def _swap(pairs: list[tuple[int, Tensor, Tensor]]) -> list[Tensor]:
    """Send each ``out`` to its peer and receive into a new tensor shaped like ``into``."""
    requests, received = [], []
    for peer, out, into in pairs:
        buffer = torch.empty_like(into)
        received.append(buffer)
        requests.append(dist.irecv(buffer, peer))
        requests.append(dist.isend(out.contiguous(), peer))
    for request in requests:
        assert request is not None  # isend and irecv return their work
        request.wait()
    return received


def _rows(padded: Tensor, h: int, grid: tuple[int, int], *, adjoint: bool) -> None:
    up, down, _, _ = _neighbours(grid)
    inner = slice(h, padded.shape[-1] - h)
    top_halo, bottom_halo = slice(0, h), slice(padded.shape[-2] - h, padded.shape[-2])
    top_rows, bottom_rows = slice(h, 2 * h), slice(padded.shape[-2] - 2 * h, padded.shape[-2] - h)
    sides = [(up, top_rows, top_halo), (down, bottom_rows, bottom_halo)]
    sides = [side for side in sides if side[0] >= 0]
    if not adjoint:  # my edge rows into the neighbour's halo
        got = _swap(
            [(peer, padded[..., mine, inner], padded[..., halo, inner]) for peer, mine, halo in sides]
        )
        for (_, _, halo), rows in zip(sides, got):
            padded[..., halo, inner] = rows
    else:  # my halo's gradient added into the neighbour's edge rows
        got = _swap(
            [(peer, padded[..., halo, inner], padded[..., mine, inner]) for peer, mine, halo in sides]
        )
        for (_, mine, _), rows in zip(sides, got):
            padded[..., mine, inner] += rows


def _columns(padded: Tensor, h: int, grid: tuple[int, int], *, adjoint: bool) -> None:
    _, _, left, right = _neighbours(grid)
    width = padded.shape[-1]
    sides = [
        (left, slice(h, 2 * h), slice(0, h)),
        (right, slice(width - 2 * h, width - h), slice(width - h, width)),
    ]
    sides = [side for side in sides if side[0] >= 0]
    if not adjoint:
        got = _swap([(peer, padded[..., mine], padded[..., halo]) for peer, mine, halo in sides])
        for (_, _, halo), columns in zip(sides, got):
            padded[..., halo] = columns
    else:
        got = _swap([(peer, padded[..., halo], padded[..., mine]) for peer, mine, halo in sides])
        for (_, mine, _), columns in zip(sides, got):
            padded[..., mine] += columns


class ReduceToRoot(torch.autograd.Function):
    """The sum over ranks onto rank 0 (``dist.reduce``); backward: ``broadcast`` from rank 0."""

    @staticmethod
    def forward(ctx: Any, partial: Tensor) -> Tensor:
        total = partial.clone()
        dist.reduce(total, 0)
        return total

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        grad = grad.clone()
        dist.broadcast(grad, 0)
        return grad


class AllReduceSum(torch.autograd.Function):
    """The sum over ranks on every rank (``dist.all_reduce``); backward: the same."""

    @staticmethod
    def forward(ctx: Any, partial: Tensor) -> Tensor:
        total = partial.clone()
        dist.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


def _replicate_edges(padded: Tensor, grid: tuple[int, int]) -> Tensor:
    """The halo of width 1 at the image's edges (where the exchange left zeros) replaced by
    the edge rows and columns: rows first, so the corners are the edge's corner entries."""
    up, down, left, right = _neighbours(grid)
    if up < 0:
        padded = torch.cat([padded[..., 1:2, :], padded[..., 1:, :]], dim=-2)
    if down < 0:
        padded = torch.cat([padded[..., :-1, :], padded[..., -2:-1, :]], dim=-2)
    if left < 0:
        padded = torch.cat([padded[..., 1:2], padded[..., 1:]], dim=-1)
    if right < 0:
        padded = torch.cat([padded[..., :-1], padded[..., -2:-1]], dim=-1)
    return padded


class HandNetwork(torch.nn.Module):
    """:data:`example.NETWORK` on a 2 x 2 grid of ranks, written by hand (image side a multiple
    of 4: even blocks at every layer, pooling windows on their own block)."""

    def __init__(self, reference: torch.nn.Sequential, size: int, grid: tuple[int, int]) -> None:
        super().__init__()
        layers: list[Any] = list(reference)
        _, conv1, norm1, _, _, conv2, norm2, _, _, _, _, dense1, _, dense2 = layers
        rank = dist.get_rank()
        self.grid, self.rank = grid, rank
        self.rows = slice(rank // grid[1] * size // grid[0], (rank // grid[1] + 1) * size // grid[0])
        self.cols = slice(rank % grid[1] * size // grid[1], (rank % grid[1] + 1) * size // grid[1])
        self.entries = [(2 * size) ** 2, size**2]  # per channel and sample at each batch norm
        copy = lambda t: torch.nn.Parameter(t.detach().clone())  # noqa: E731
        self.w1, self.b1, self.w2, self.b2 = (
            copy(t) for t in (conv1.weight, conv1.bias, conv2.weight, conv2.bias)
        )
        self.g1, self.h1, self.g2, self.h2 = (
            copy(t) for t in (norm1.weight, norm1.bias, norm2.weight, norm2.bias)
        )
        self.norms = [(self.g1, self.h1, norm1), (self.g2, self.h2, norm2)]
        self.running = [(norm.running_mean.clone(), norm.running_var.clone()) for norm in (norm1, norm2)]
        # the first affine layer's columns of this rank's features (torch's flatten order of its block)
        channels = conv2.out_channels
        side = size // 2  # up-sampled x2, pooled twice
        index = np.arange(channels * side * side).reshape(channels, side, side)
        i, j = divmod(rank, grid[1])
        rows, cols = side // grid[0], side // grid[1]
        mine = index[:, i * rows : (i + 1) * rows, j * cols : (j + 1) * cols].ravel()
        self.w3 = copy(dense1.weight[:, torch.from_numpy(mine)])
        self.b3 = copy(dense1.bias) if rank == 0 else None
        self.w4: torch.nn.Parameter | None = copy(dense2.weight) if rank == 0 else None
        self.b4: torch.nn.Parameter | None = copy(dense2.bias) if rank == 0 else None
        self.replicated = [self.w1, self.b1, self.w2, self.b2, self.g1, self.h1, self.g2, self.h2]

    def batch_norm(self, x: Tensor, k: int) -> Tensor:
        """Training-mode batch norm of the global batch: the per-channel sums all-reduced."""
        weight, bias, norm = self.norms[k]
        m = x.shape[0] * self.entries[k]
        mean = AllReduceSum.apply(x.sum((0, 2, 3))) / m
        centred = x - mean[None, :, None, None]
        var = AllReduceSum.apply((centred * centred).sum((0, 2, 3))) / m
        with torch.no_grad():
            running_mean, running_var = self.running[k]
            running_mean.mul_(1 - norm.momentum).add_(norm.momentum * mean)
            running_var.mul_(1 - norm.momentum).add_(norm.momentum * var * m / (m - 1))
        scale = (weight * torch.rsqrt(var + norm.eps))[None, :, None, None]
        return centred * scale + bias[None, :, None, None]

    def loss(self, images: np.ndarray, labels: np.ndarray) -> tuple[Tensor | None, Tensor]:
        x = torch.from_numpy(images[:, :, self.rows, self.cols]).to(self.w1.dtype)
        padded = _replicate_edges(HaloExchange2d.apply(x, 1, self.grid), self.grid)
        x = F.interpolate(padded, scale_factor=2, mode="bilinear", align_corners=False)[..., 2:-2, 2:-2]
        x = F.conv2d(HaloExchange2d.apply(x, 2, self.grid), self.w1, self.b1)
        x = F.max_pool2d(torch.relu(self.batch_norm(x, 0)), 2)
        x = F.conv2d(HaloExchange2d.apply(x, 1, self.grid), self.w2, self.b2)
        x = F.max_pool2d(torch.relu(self.batch_norm(x, 1)), 2)
        hidden = ReduceToRoot.apply(x.reshape(x.shape[0], -1) @ self.w3.T)
        if self.rank != 0:
            return None, hidden.sum() * 0  # the reduce's backward (a broadcast) runs here too
        assert self.w4 is not None  # rank 0 holds the second affine layer
        logits = F.linear(torch.tanh(hidden + self.b3), self.w4, self.b4)
        loss = F.cross_entropy(logits, torch.from_numpy(labels))
        return loss, loss

    def sum_gradients(self) -> None:
        for parameter in self.replicated:  # replicated: the data-parallel sum
            dist.all_reduce(parameter.grad)


class Recorded(torch.nn.Module):
    """The example's model, its images' up-sampling recorded by autograd (``BENCH_RECORDED``)."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def loss(self, images: np.ndarray, labels: np.ndarray) -> tuple[Tensor | None, Tensor]:
        return self.model.loss_of(self.model.mine(self.model.x, images), labels, input_gradient=True)


def training_step(
    model: Any, optimizer: Any, images: np.ndarray, labels: np.ndarray, hand: bool
) -> float | None:
    optimizer.zero_grad()
    loss, anchor = model.loss(images, labels)
    anchor.backward()
    if hand:
        model.sum_gradients()
    optimizer.step()
    return None if loss is None else loss.item()


def case_row(batch: int, size: int) -> list[str]:
    rank, processes = dist.get_rank(), dist.get_world_size()
    grid = example.grid_for(processes)
    images, labels = example.shapes(batch, size, seed=1)
    models: dict[str, tuple[Any, Any]] = {}
    for name, dtype in (("check", torch.float64), ("run", DTYPE)):
        reference = example.reference_model(example.NETWORK, (batch, 1, size, size), seed=0, dtype=dtype)
        spatial = functools.partial(
            example.SpatialModel,
            example.NETWORK,
            reference,
            batch=batch,
            size=size,
            grid=grid,
            group=True,
            dtype=dtype,
        )
        ours, twin = spatial(), spatial(replicate=True)
        hand = HandNetwork(reference, size, grid)
        variants: list[tuple[str, Any]] = [("linop", ours), ("linop replicated", twin), ("hand", hand)]
        if RECORDED:
            variants.append(("linop, images recorded", Recorded(spatial())))
        for label, model in variants:
            models[f"{name} {label}"] = (model, torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM))
    labels_run = ["linop", "linop replicated", *(["linop, images recorded"] if RECORDED else []), "hand"]
    mine = labels_run[:-1]
    losses: dict[str, list[Any]] = {}
    for label in labels_run:
        model, optimizer = models[f"check {label}"]
        losses[label] = [training_step(model, optimizer, images, labels, label == "hand") for _ in range(2)]
    equal = rank != 0 or all(
        abs(a - b) <= 1e-10 for label in mine for a, b in zip(losses[label], losses["hand"])
    )

    def step(label: str) -> Callable[[], object]:
        model, optimizer = models[f"run {label}"]
        return lambda: training_step(model, optimizer, images, labels, label == "hand")

    times, cpu = timed({label: step(label) for label in labels_run}, batch=3)
    hand_times, hand_cpu = times["hand"], cpu["hand"]
    cells = [
        f"batch {batch}, {size} x {size} images (up-sampled: {2 * size}), {str(DTYPE).removeprefix('torch.')}",
        f"{median(hand_times) * 1e3:8.2f} ms / cpu {median(hand_cpu) * 1e3:8.2f} ms",
    ]
    for label in mine:
        ratio = median(t / h for t, h in zip(times[label], hand_times))
        ratio_cpu = median(t / h for t, h in zip(cpu[label], hand_cpu))
        cells.append(f"{median(times[label]) * 1e3:8.2f} ms ({ratio:4.2f}x) / cpu {ratio_cpu:4.2f}x")
    cells.append("equal" if equal else "DIFFERENT")
    return cells


def main() -> None:
    rows = [case_row(batch, size) for batch, size in CASES]
    if dist.get_rank() == 0:
        load = os.getloadavg()
        print(
            f"{dist.get_world_size()} processes, gloo, torch {torch.__version__}, {SAMPLES} samples of 3 steps;"
            f" load {load[0]:.1f} {load[1]:.1f}"
        )
        print(
            "case | hand step (wall / CPU) | linop step (wall ratio / CPU ratio)"
            " | linop, replicated convolutions (wall ratio / CPU ratio)"
            + (" | linop, images recorded (wall ratio / CPU ratio)" if RECORDED else "")
            + " | first steps' losses"
        )
        for cells in rows:
            print(" | ".join(cells))


if __name__ == "__main__":
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # torch._dynamo imported before the fork
    launch(main, 4, start_method="fork")
