"""torch.distributed (gloo) and MPI benchmark, CPU: the new distributed layers against hand-written ones.

Run with ``python benchmarks/bench_new_layers.py`` (spawns 4 processes, rendezvous on
127.0.0.1), or under ``torchrun --nproc-per-node 4 --master-addr 127.0.0.1 --master-port P``;
``mpiexec -n 4 python benchmarks/bench_new_layers.py --mpi`` runs the same cases on MPI: linop's
modules with ``comm=``, the hand-written layers with mpi4py's ``Isend``/``Irecv``,
``Allreduce``, ``Reduce``, ``Bcast`` and ``Alltoall`` on the tensors' memory.
Every case is one training step (forward and backward, the loss ``sum(y * G)`` of a fixed random
upstream gradient ``G``) of a float32 tensor (N, C, 2H, 2W) on a 2 x 2 spatial grid, so that
each process holds an N x C x H x W block (``BENCH_SIZES``: ``;``-separated ``N,C,H,W``,
default the small ``4,16,32,32`` and the medium ``8,16,128,128``). linop's module (``group=True``,
or ``comm=`` under MPI) runs against the same layer written by hand with plain torch.distributed calls:

- ``BatchNormModule(BatchNorm(x))`` (training mode, affine, running statistics) against an
  ``autograd.Function`` with one ``all_reduce`` of the per-channel (sum, sum of squares) in the
  forward and one of the two gradient sums (sum dy * x_hat, sum dy) in the backward, the affine
  parameters replicated on every process (their gradients are those sums);
- ``LossModule(Loss(x, "mse"))`` (mean over the global count, on rank 0) against a local
  ``mse_loss(..., reduction="sum")`` and an ``autograd.Function`` whose forward is a ``reduce``
  onto rank 0 and whose backward is the ``broadcast`` of the loss's gradient (the same messages);
- ``MaxPool(x, 3, stride=2, padding=1)`` against a hand-written halo (``isend``/``irecv`` of one
  row, then one column, from the lower neighbour; ``-inf`` at the global edges) and torch's
  ``max_pool2d``; the backward sends the halo's gradient back and adds it;
- ``Upsample(x, scale_factor=2, mode="bilinear")`` against a hand-written halo of one row and
  column on each side (none at the global edges) and torch's ``interpolate`` of the slab, cropped;
- ``Repartition`` from the 2 x 2 spatial grid to a split of the batch over the 4 processes
  against ``all_to_all_single`` of the block (already packed by destination: the batch is the
  leading axis) and an unpacking copy; its backward the reverse;
- ``ChainModule`` of conv 3 -> conv 3 -> average pool 2 (C -> C channels, padding 1: one fused
  halo of two rows and columns) against the same chain by hand: the fused halo exchanged with
  ``isend``/``irecv`` (zeros at the global edges), ``conv2d``, the intermediate's entries outside
  the global field zeroed, ``conv2d``, ``avg_pool2d``, and an ``all_reduce`` of the weights'
  gradients (``ChainModule.sum_gradients``).

Each hand-written step's outputs, input gradient and parameter gradients are checked against
linop's (``torch.allclose``, float32 tolerances) before timing: a difference stops the run.
The two steps are interleaved sample by sample (linop, hand, linop, hand, ...) in the same
processes, each sample a batch of steps after a barrier, its wall time and CPU time
(``time.process_time``) the maximum over the ranks; the table shows the medians and the median
of the per-sample ratios (linop / hand). Each process runs torch with one thread (4 processes on
a small machine). Nothing is asserted about speed; the machine may be shared: report its load
with the figures. ``BENCH_PROFILE=case`` (a case's name, e.g. ``bn``) profiles linop's step of
that case on every rank with cProfile after timing (``BENCH_PROFILE_CALLS`` steps, default 20)
and prints rank 0's top entries, after the Python calls per step of linop's step and of the
hand-written one (cProfile's count: the figure that does not depend on the machine's load);
``BENCH_PROFILE_CPU=1`` times that profile in CPU time (``time.process_time``): on
oversubscribed cores a wall-clock profile charges the turns of other processes to whatever
function this one was in when it was descheduled.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys
import time
from collections.abc import Callable
from statistics import median
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as functional
from _gloo import launch

from linop.partition import DistributedTensor, Partition

SAMPLES = int(os.environ.get("BENCH_SAMPLES", "11"))
SIZES = [
    tuple(int(n) for n in size.split(","))
    for size in os.environ.get("BENCH_SIZES", "4,16,32,32;8,16,128,128").split(";")
]
CASES = ("bn", "loss", "maxpool", "upsample", "repartition", "chain")
Step = Callable[[], Any]


# --- the engine the hand-written layers call: torch.distributed or mpi4py ------------------------


class Engine:
    """The few collective and point-to-point calls the hand-written layers make, on torch
    tensors (contiguous, CPU): torch.distributed (gloo) by default; mpi4py after :meth:`use_mpi`
    (the buffers are the tensors' memory, ``tensor.numpy()``). ``linop`` holds the keyword that
    runs linop's modules on the same processes (``group=True`` or ``comm=``)."""

    def __init__(self) -> None:
        self.comm: Any = None
        self.linop: dict[str, Any] = {"group": True}

    def use_mpi(self, comm: Any) -> None:
        self.comm, self.linop = comm, {"comm": comm}

    @property
    def name(self) -> str:
        return "MPI (mpi4py)" if self.comm is not None else "gloo"

    def rank(self) -> int:
        return int(self.comm.Get_rank()) if self.comm is not None else dist.get_rank()

    def size(self) -> int:
        return int(self.comm.Get_size()) if self.comm is not None else dist.get_world_size()

    def isend(self, t: torch.Tensor, peer: int) -> Any:
        if self.comm is None:
            return dist.isend(t, peer)
        return _Kept(self.comm.Isend(_memory(t), peer), t)

    def irecv(self, t: torch.Tensor, peer: int) -> Any:
        if self.comm is None:
            return dist.irecv(t, peer)
        return _Kept(self.comm.Irecv(_memory(t), peer), t)

    def all_reduce(self, t: torch.Tensor, maximum: bool = False) -> None:
        if self.comm is None:
            dist.all_reduce(t, op=dist.ReduceOp.MAX if maximum else dist.ReduceOp.SUM)
            return
        from mpi4py import MPI

        self.comm.Allreduce(MPI.IN_PLACE, _memory(t), op=MPI.MAX if maximum else MPI.SUM)

    def reduce(self, t: torch.Tensor, root: int) -> None:
        if self.comm is None:
            dist.reduce(t, root)
            return
        from mpi4py import MPI

        if self.rank() == root:
            self.comm.Reduce(MPI.IN_PLACE, _memory(t), op=MPI.SUM, root=root)
        else:
            self.comm.Reduce(_memory(t), None, op=MPI.SUM, root=root)

    def broadcast(self, t: torch.Tensor, root: int) -> None:
        if self.comm is None:
            dist.broadcast(t, root)
        else:
            self.comm.Bcast(_memory(t), root=root)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """Equal splits along the first axis."""
        if self.comm is None:
            dist.all_to_all_single(out, inp)
        else:
            self.comm.Alltoall(_memory(inp), _memory(out))

    def barrier(self) -> None:
        if self.comm is None:
            dist.barrier()
        else:
            self.comm.Barrier()


def _memory(t: torch.Tensor) -> Any:
    """The tensor's memory as a numpy array (for mpi4py's buffers)."""
    assert t.is_contiguous()
    return t.detach().numpy()


class _Kept:
    """An MPI request and the tensor whose memory it uses (alive until the wait)."""

    def __init__(self, request: Any, tensor: torch.Tensor) -> None:
        self.request, self.tensor = request, tensor

    def wait(self) -> None:
        self.request.Wait()


E = Engine()


# --- a hand-written halo along one dimension, differentiable ------------------------------------


class HandHalo(torch.autograd.Function):
    """Along dimension ``dim``: ``low`` entries received from the lower neighbour (its last
    ones) and ``high`` from the upper one (its first ones); where there is no neighbour, ``fill``
    entries of that width (``fill`` None: nothing). Backward: each received entry's gradient
    sent back to its owner and added to the entries it came from."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, dim: int, low: int, high: int, peers: tuple[Any, Any], fill: float | None
    ) -> torch.Tensor:
        lower, upper = peers
        ctx.dim, ctx.low, ctx.high, ctx.peers, ctx.fill = dim, low, high, peers, fill
        n = x.shape[dim]
        requests: list[Any] = []
        below, above = None, None
        if lower is not None and low:
            below = x.new_empty(_width(x.shape, dim, low))
            requests.append(E.irecv(below, lower))
        if lower is not None and high:
            requests.append(E.isend(x.narrow(dim, 0, high).contiguous(), lower))
        if upper is not None and high:
            above = x.new_empty(_width(x.shape, dim, high))
            requests.append(E.irecv(above, upper))
        if upper is not None and low:
            requests.append(E.isend(x.narrow(dim, n - low, low).contiguous(), upper))
        for request in requests:
            request.wait()
        if below is None and fill is not None and low:
            below = x.new_full(_width(x.shape, dim, low), fill)
        if above is None and fill is not None and high:
            above = x.new_full(_width(x.shape, dim, high), fill)
        ctx.sizes = (0 if below is None else low, 0 if above is None else high)
        ctx.received = (below is not None and lower is not None, above is not None and upper is not None)
        return torch.cat([t for t in (below, x, above) if t is not None], dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        dim, low, high = ctx.dim, ctx.low, ctx.high
        lower, upper = ctx.peers
        before, after = ctx.sizes
        n = grad.shape[dim] - before - after
        result = grad.narrow(dim, before, n).clone()
        requests: list[Any] = []
        added = []
        if lower is not None and low:
            requests.append(E.isend(grad.narrow(dim, 0, low).contiguous(), lower))
        if lower is not None and high:
            into = grad.new_empty(_width(grad.shape, dim, high))
            requests.append(E.irecv(into, lower))
            added.append((0, high, into))
        if upper is not None and high:
            requests.append(E.isend(grad.narrow(dim, before + n, high).contiguous(), upper))
        if upper is not None and low:
            into = grad.new_empty(_width(grad.shape, dim, low))
            requests.append(E.irecv(into, upper))
            added.append((n - low, low, into))
        for request in requests:
            request.wait()
        for start, width, into in added:
            result.narrow(dim, start, width).add_(into)
        return result, None, None, None, None, None


def _width(shape: torch.Size, dim: int, width: int) -> list[int]:
    out = list(shape)
    out[dim] = width
    return out


class Grid:
    """This process's place on the 2 x 2 spatial grid of a tensor (N, C, 2H, 2W): its grid
    index and its neighbours' ranks (None past the global edge), read from linop's layout."""

    def __init__(self, x: DistributedTensor, rank: int) -> None:
        where = {x.block(g).worker: (g[2], g[3]) for g in x.partition.indices()}
        rank_of = {v: k for k, v in where.items()}
        self.i, self.j = where[rank]
        self.rows = (rank_of.get((self.i - 1, self.j)), rank_of.get((self.i + 1, self.j)))
        self.cols = (rank_of.get((self.i, self.j - 1)), rank_of.get((self.i, self.j + 1)))
        self.rank_of = rank_of

    def halo(self, x: torch.Tensor, low: int, high: int, fill: float | None) -> torch.Tensor:
        """Rows, then columns (over the rows just received: the corners filled)."""
        rows = HandHalo.apply(x, 2, low, high, self.rows, fill)
        return HandHalo.apply(rows, 3, low, high, self.cols, fill)


# --- the cases: each returns (linop step, hand step, check) ----------------------------------------


def _data(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def _layout(size: tuple[int, int, int, int], name: str = "x") -> DistributedTensor:
    n, c, h, w = size
    return DistributedTensor(name, (n, c, 2 * h, 2 * w), Partition((1, 1, 2, 2)))


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.clone().requires_grad_()


def _close(
    a: torch.Tensor | None, b: torch.Tensor | None, what: str, rtol: float = 1e-4, atol: float = 1e-4
) -> None:
    assert a is not None and b is not None, f"{what}: a gradient is missing"
    a, b = a.detach(), b.detach()
    if a.shape != b.shape or not torch.allclose(a, b, rtol=rtol, atol=atol):
        error = float((a - b).abs().max()) if a.shape == b.shape else float("nan")
        raise AssertionError(
            f"rank {E.rank()}: {what} differ (shapes {tuple(a.shape)} {tuple(b.shape)}, max error {error})"
        )


class _HandBatchNorm(torch.autograd.Function):
    """Training-mode batch norm over (N, H, W) of every process's block: one all_reduce of the
    per-channel (sum, sum of squares) forward, one of (sum dy * x_hat, sum dy) backward."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, count: int, eps: float
    ) -> Any:
        sums = torch.cat([x.sum((0, 2, 3)), (x * x).sum((0, 2, 3))])
        E.all_reduce(sums)
        c = x.shape[1]
        mean = sums[:c] / count
        var = (sums[c:] / count - mean * mean).clamp_min(0)
        rstd = (var + eps).rsqrt()
        xhat = (x - mean[:, None, None]) * rstd[:, None, None]
        ctx.save_for_backward(xhat, rstd, weight)
        ctx.count = count
        return xhat * weight[:, None, None] + bias[:, None, None], mean, var

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor, *_: Any) -> Any:
        xhat, rstd, weight = ctx.saved_tensors
        c = xhat.shape[1]
        sums = torch.cat([(dy * xhat).sum((0, 2, 3)), dy.sum((0, 2, 3))])
        E.all_reduce(sums)
        dw, db = sums[:c], sums[c:]
        m = ctx.count
        scale = (weight * rstd)[:, None, None]
        dx = scale * (dy - db[:, None, None] / m - xhat * dw[:, None, None] / m)
        return dx, dw, db, None, None


def case_bn(size: tuple[int, int, int, int], rank: int) -> tuple[Step, Step, Callable[[], None]]:
    from linop.frameworks.torch_norm import BatchNormModule
    from linop.layers import BatchNorm

    x = _layout(size)
    n, c, h, w = size
    rng = np.random.default_rng(0)
    weight0 = (1 + 0.1 * rng.standard_normal(c)).astype(np.float32)
    bias0 = (0.1 * rng.standard_normal(c)).astype(np.float32)
    module = BatchNormModule(
        BatchNorm(x, name="z"), weight=weight0, bias=bias0, dtype=torch.float32, **E.linop
    )
    (name,) = module.input_names
    (out_name,) = module.output_names
    data, upstream = _data(x.space[name].shape, rank + 1), _data(x.space[name].shape, rank + 11)
    ours, theirs = _leaf(data), _leaf(data)
    weight, bias = _leaf(torch.from_numpy(weight0)), _leaf(torch.from_numpy(bias0))
    count = n * 4 * h * w
    running = [torch.zeros(c), torch.ones(c)]
    momentum, eps = module.layer.momentum, module.layer.eps
    assert momentum is not None  # torch's default 0.1: a running average, not a cumulative one

    leaves = (ours, *module.parameters())  # as the hand-written step's fixed tuple

    def linop_step() -> torch.Tensor:
        for t in leaves:
            t.grad = None
        y = module({name: ours})[out_name]
        ((y * upstream).sum() + module.token.sum()).backward()
        return y

    def hand_step() -> torch.Tensor:
        for t in (theirs, weight, bias):
            t.grad = None
        y, mean, var = _HandBatchNorm.apply(theirs, weight, bias, count, eps)
        with torch.no_grad():  # torch's running statistics: the unbiased variance
            running[0].mul_(1 - momentum).add_(momentum * mean)
            running[1].mul_(1 - momentum).add_(momentum * var * count / (count - 1))
        (y * upstream).sum().backward()
        return y

    def check() -> None:
        _close(linop_step(), hand_step(), "batch norm outputs")
        _close(ours.grad, theirs.grad, "batch norm input gradients", atol=1e-3)
        for block_name, block in zip(module.parameter_names, module.blocks):
            assert block.grad is not None and block.shape == (2, c), (block_name, block.shape)
            assert weight.grad is not None and bias.grad is not None
            expected = torch.stack([weight.grad, bias.grad])
            _close(block.grad, expected, "batch norm parameter gradients", atol=1e-2)
        assert module.running_mean is not None and module.running_var is not None
        _close(module.running_mean, running[0], "running means")
        _close(module.running_var, running[1], "running variances")

    return linop_step, hand_step, check


class _HandReduce(torch.autograd.Function):
    """The partial sums reduced onto rank 0 (a zero elsewhere); backward: rank 0's gradient
    broadcast."""

    @staticmethod
    def forward(ctx: Any, partial: torch.Tensor) -> torch.Tensor:
        total = partial.detach().clone()
        E.reduce(total, 0)
        return total if E.rank() == 0 else torch.zeros_like(total)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        E.broadcast(grad, 0)
        return grad


def case_loss(size: tuple[int, int, int, int], rank: int) -> tuple[Step, Step, Callable[[], None]]:
    from linop.frameworks.torch_losses import LossModule
    from linop.layers import Loss

    x = _layout(size)
    module = LossModule(Loss(x, "mse"), **E.linop)
    (name,) = module.input_names
    data, target = _data(x.space[name].shape, rank + 1), _data(x.space[name].shape, rank + 21)
    ours, theirs = _leaf(data), _leaf(data)
    scale = 1.0 / float(np.prod(x.global_shape))

    def linop_step() -> torch.Tensor:
        ours.grad = None
        value = module({name: ours}, {name: target})
        value.backward()
        return value.detach()

    def hand_step() -> torch.Tensor:
        theirs.grad = None
        value = (
            _HandReduce.apply(functional.mse_loss(theirs, target, reduction="sum").reshape(1)).reshape(())
            * scale
        )
        value.backward()
        return value.detach()

    def check() -> None:
        ours_value, hand_value = linop_step(), hand_step()
        if rank == 0:
            _close(ours_value.to(hand_value.dtype), hand_value, "losses", rtol=1e-5)
        _close(ours.grad, theirs.grad, "loss input gradients", rtol=1e-5, atol=1e-8)

    return linop_step, hand_step, check


def _window_case(
    module: Any,
    x: DistributedTensor,
    y: DistributedTensor,
    rank: int,
    hand_forward: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[Step, Step, Callable[[], None]]:
    (name,) = module.input_names
    (out_name,) = module.output_names
    data = _data(x.space[name].shape, rank + 1)
    upstream = _data(y.space[out_name].shape, rank + 31)
    ours, theirs = _leaf(data), _leaf(data)

    def linop_step() -> torch.Tensor:
        ours.grad = None
        y = module({name: ours})[out_name]
        ((y * upstream).sum() + module.token.sum()).backward()
        return y

    def hand_step() -> torch.Tensor:
        theirs.grad = None
        y = hand_forward(theirs)
        (y * upstream).sum().backward()
        return y

    def check() -> None:
        _close(linop_step(), hand_step(), "outputs")
        _close(ours.grad, theirs.grad, "input gradients")

    return linop_step, hand_step, check


def case_maxpool(size: tuple[int, int, int, int], rank: int) -> tuple[Step, Step, Callable[[], None]]:
    from linop.frameworks.torch_pooling import MaxPool

    x = _layout(size)
    module = MaxPool(x, 3, stride=2, padding=1, name="p", **E.linop)
    grid = Grid(x, rank)
    # kernel 3, stride 2, padding 1 on even shares: the outputs of a block read one entry
    # before it (the lower neighbour's last, or the padding) and none after it
    return _window_case(
        module, x, module.y, rank, lambda t: functional.max_pool2d(grid.halo(t, 1, 0, float("-inf")), 3, 2)
    )


def case_upsample(size: tuple[int, int, int, int], rank: int) -> tuple[Step, Step, Callable[[], None]]:
    from linop.frameworks.torch_resample import Upsample

    x = _layout(size)
    module = Upsample(x, scale_factor=2, mode="bilinear", name="u", dtype=torch.float32, **E.linop)
    grid = Grid(x, rank)
    _, _, h, w = size
    top = 2 if grid.rows[0] is not None else 0
    left = 2 if grid.cols[0] is not None else 0

    def hand(t: torch.Tensor) -> torch.Tensor:
        # one entry on each side from the neighbours (none past the global edges: torch clamps
        # there as on the whole field); the slab's interpolation, cropped to this block's outputs
        slab = grid.halo(t, 1, 1, None)
        y = functional.interpolate(slab, scale_factor=2, mode="bilinear", align_corners=False)
        return y[:, :, top : top + 2 * h, left : left + 2 * w]

    return _window_case(module, x, module.y, rank, hand)


class _HandRepartition(torch.autograd.Function):
    """From the 2 x 2 spatial blocks to batch shares: ``all_to_all_single`` of the block (the
    batch leading: packed by destination already) and an unpacking copy; backward the reverse."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, places: list[tuple[int, int]], size: int) -> torch.Tensor:
        n, c, h, w = x.shape
        ctx.places, ctx.size = places, size
        received = x.new_empty(size, n // size, c, h, w)
        E.all_to_all(received, x.contiguous())
        out = x.new_empty(n // size, c, 2 * h, 2 * w)
        for source, (i, j) in enumerate(places):
            out[:, :, i * h : (i + 1) * h, j * w : (j + 1) * w] = received[source]
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        share, c, h2, w2 = grad.shape
        h, w = h2 // 2, w2 // 2
        send = grad.new_empty(ctx.size, share, c, h, w)
        for source, (i, j) in enumerate(ctx.places):
            send[source] = grad[:, :, i * h : (i + 1) * h, j * w : (j + 1) * w]
        received = grad.new_empty(ctx.size * share, c, h, w)
        E.all_to_all(received, send)
        return received, None, None


def case_repartition(size: tuple[int, int, int, int], rank: int) -> tuple[Step, Step, Callable[[], None]]:
    from linop.frameworks.torch_repartition import Repartition

    x = _layout(size)
    world = E.size()
    b = DistributedTensor("b", x.global_shape, Partition((world, 1, 1, 1)))
    module = Repartition(x, b, **E.linop)
    # the hand-written one assumes batch share d on rank d; each source rank's spatial place
    assert all(b.block((d, 0, 0, 0)).worker == d for d in range(world))
    grid = Grid(x, rank)
    places = [next(p for p, r in grid.rank_of.items() if r == source) for source in range(world)]
    return _window_case(module, x, b, rank, lambda t: _HandRepartition.apply(t, places, world))


def case_chain(size: tuple[int, int, int, int], rank: int) -> tuple[Step, Step, Callable[[], None]]:
    from linop.frameworks.torch_chain import ChainModule
    from linop.halo_geometry import Kernel
    from linop.layers.chain import ChainStage, WindowChain

    x = _layout(size)
    _, c, h, w = size
    rng = np.random.default_rng(0)
    kernels = [(rng.standard_normal((c, c, 3, 3)) / (3 * np.sqrt(c))).astype(np.float32) for _ in range(2)]
    chain = WindowChain(
        x,
        [
            ChainStage.conv(kernels[0], padding=1),
            ChainStage.conv(kernels[1], padding=1),
            ChainStage.avg(Kernel(2, stride=2)),
        ],
        name="pooled",
    )
    module = ChainModule(chain, dtype=torch.float32, **E.linop)
    grid = Grid(x, rank)
    weights = [_leaf(torch.from_numpy(k)) for k in kernels]
    # the intermediate field after the first convolution covers one entry past the block on
    # each side; past a global edge that entry is the second convolution's zero padding
    mask = torch.ones(1, 1, h + 2, w + 2)
    if grid.rows[0] is None:
        mask[:, :, 0] = 0
    if grid.rows[1] is None:
        mask[:, :, -1] = 0
    if grid.cols[0] is None:
        mask[:, :, :, 0] = 0
    if grid.cols[1] is None:
        mask[:, :, :, -1] = 0

    def hand(t: torch.Tensor) -> torch.Tensor:
        slab = grid.halo(t, 2, 2, 0.0)
        first = functional.conv2d(slab, weights[0]) * mask
        return functional.avg_pool2d(functional.conv2d(first, weights[1]), 2)

    linop_step, hand_step, check = _window_case(module, x, chain.y, rank, hand)

    def linop_train() -> torch.Tensor:
        for t in module.weights:
            t.grad = None
        y = linop_step()
        module.sum_gradients()
        return y

    def hand_train() -> torch.Tensor:
        for t in weights:
            t.grad = None
        y = hand_step()
        for t in weights:
            assert t.grad is not None
            E.all_reduce(t.grad)
        return y

    def check_all() -> None:
        _close(linop_train(), hand_train(), "chain outputs")
        for a, b in zip(module.weights, weights):
            _close(a.grad, b.grad, "chain weight gradients", rtol=1e-3, atol=1e-2)
        check()

    return linop_train, hand_train, check_all


# --- timing -------------------------------------------------------------------------------------


def timed(methods: dict[str, Step], batch: int) -> dict[str, tuple[list[float], list[float]]]:
    """Per method, per sample: (wall, cpu) of a batch's mean per call, each the maximum over
    the ranks; the methods interleaved within each sample in an order drawn afresh (alike on
    every rank), each batch after one untimed call of its own and a barrier (no method timed
    on its first call after another's, which touches other buffers)."""
    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in methods}
    for function in methods.values():
        function()
    names, order = list(methods), np.random.default_rng(len(methods))
    for _ in range(SAMPLES):
        for index in order.permutation(len(names)):
            name = names[index]
            function = methods[name]
            function()
            E.barrier()
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(batch):
                function()
            elapsed = torch.tensor(
                [(time.perf_counter() - wall) / batch, (time.process_time() - cpu) / batch],
                dtype=torch.float64,
            )
            E.all_reduce(elapsed, maximum=True)
            times[name][0].append(float(elapsed[0]))
            times[name][1].append(float(elapsed[1]))
    return times


def _row(case: str, size: tuple[int, ...], times: dict[str, tuple[list[float], list[float]]]) -> str:
    (ours_wall, ours_cpu), (hand_wall, hand_cpu) = times["linop"], times["hand"]
    wall_ratio = median(a / b for a, b in zip(ours_wall, hand_wall))
    cpu_ratio = median(a / b for a, b in zip(ours_cpu, hand_cpu))
    shape = "x".join(str(s) for s in size)
    return (
        f"{case:<12} {shape:<12} | wall linop {median(ours_wall) * 1e3:8.3f} ms  hand {median(hand_wall) * 1e3:8.3f} ms"
        f"  ratio {wall_ratio:5.2f}x | cpu linop {median(ours_cpu) * 1e3:8.3f} ms  hand {median(hand_cpu) * 1e3:8.3f} ms"
        f"  ratio {cpu_ratio:5.2f}x | equal"
    )


def main() -> None:
    torch.set_num_threads(1)
    rank, size = E.rank(), E.size()
    if size != 4:
        raise SystemExit("bench_new_layers.py runs on 4 processes (a 2 x 2 grid)")
    only = os.environ.get("BENCH_ONLY", ",".join(CASES)).split(",")
    profile = os.environ.get("BENCH_PROFILE")
    makers = {name: globals()[f"case_{name}"] for name in CASES}
    if rank == 0:
        load = os.getloadavg()
        print(
            f"{size} processes, {E.name}, torch {torch.__version__}, 1 thread each, float32, 2 x 2 spatial grid; "
            f"{SAMPLES} samples; load {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}",
            flush=True,
        )
        print(
            "case         per-process  | medians of the maximum over ranks (linop / hand: median of per-sample ratios)"
        )
    for block in SIZES:
        batch = 5 if np.prod(block) <= 2**18 else 1
        for case in only:
            linop_step, hand_step, check = makers[case](block, rank)
            check()  # equal results first: an AssertionError stops the run
            times = timed({"linop": linop_step, "hand": hand_step}, batch)
            if rank == 0:
                print(_row(case, block, times), flush=True)
            if profile == case:
                _profile(linop_step, rank, int(os.environ.get("BENCH_PROFILE_CALLS", "20")), hand_step)
    E.barrier()  # every rank done before the group goes
    if rank == 0:
        load = os.getloadavg()
        print(f"load at the end {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")


def _profile(step: Step, rank: int, calls: int = 20, hand: Step | None = None) -> None:
    """cProfile of ``calls`` steps on every rank (collective), printed by rank 0, with the
    Python calls per step of linop's and (``hand``) the hand-written step: a figure that does
    not depend on the machine or its load."""
    counts = []
    for timed_step in (hand, step):
        if timed_step is None:
            continue
        profiler = (
            cProfile.Profile(time.process_time) if os.environ.get("BENCH_PROFILE_CPU") else cProfile.Profile()
        )
        E.barrier()
        profiler.enable()
        for _ in range(calls):
            timed_step()
        profiler.disable()
        counts.append(pstats.Stats(profiler).total_calls / calls)  # type: ignore[attr-defined]
    if rank == 0:
        hand_count = f", hand-written {counts[0]:.0f}" if hand is not None else ""
        print(f"Python calls per step on rank 0: linop {counts[-1]:.0f}{hand_count}", flush=True)
        out = io.StringIO()
        stats = pstats.Stats(profiler, stream=out).sort_stats("cumulative")
        stats.print_stats(35)
        out2 = io.StringIO()
        tops = pstats.Stats(profiler, stream=out2).sort_stats("tottime")
        tops.print_stats(25)
        tops.print_callers(8)  # who calls the costliest functions
        print(f"cProfile of {calls} linop steps on rank 0:\n{out.getvalue()}\n{out2.getvalue()}", flush=True)


if __name__ == "__main__":
    if "--mpi" in sys.argv:  # under mpiexec -n 4: linop's modules with comm=, the hand-written with mpi4py
        from mpi4py import MPI

        E.use_mpi(MPI.COMM_WORLD)
        main()
    else:
        launch(main, 4)
