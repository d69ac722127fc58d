"""torch.distributed benchmark (gloo, CPU): linop's executor against hand-written torch code.

Run with ``python benchmarks/bench_torch_distributed.py`` (spawns 4 processes, rendezvous on
127.0.0.1), or under ``torchrun --nproc-per-node 4 --master-addr 127.0.0.1 --master-port P``.
Timed in the same processes, interleaved sample by sample (each sample a batch of calls, its
time the maximum over ranks; the table shows medians and the median of per-sample ratios):

- halo exchange of a 4096 x 4096 float64 array, 1-d (4 x 1) and 2-d (2 x 2) grids, halo widths
  1 and 3 (kernels 3 and 7, zero padding), in place:
  ``linop bound`` (``plan_for(op).bind(local)``: checked once, the phases prepared on the
  tensors' memory), ``linop apply`` (``apply(op, local, inplace=True)``: the entry check on
  every call) against ``hand`` (hand-written ``isend``/``irecv`` of packed strips into
  preallocated buffers; the 2-d exchange in two stages, rows then columns, which fills the
  corners); the row also gives ``linop apply`` against ``linop bound`` (what the entry check
  costs per call; ``apply`` passes the same tensor again each call, the case
  :mod:`linop.backends.entry_check.repeat` serves with the check's ``all_reduce`` and the kept
  phases only);
- repartition of a 4096 x 4096 float32 array from row to column shards: ``linop bound`` and
  ``linop apply`` (out of place) against ``hand`` (``all_to_all_single`` of the row block
  packed by a transpose into contiguous per-destination pieces) and ``DTensor.redistribute``
  (``Shard(0)`` to ``Shard(1)``);
- all-gather of a 4096 x 4096 float32 array sharded by rows, and its adjoint, the
  reduce-scatter: ``linop bound`` and ``linop apply`` (as the executor chooses: under gloo, on
  groups of at most ``GLOO_POINT_TO_POINT_GROUP`` ranks, the node's point-to-point program),
  ``linop native`` (``apply`` with the collectives forced: ``all_gather_into_tensor``,
  ``reduce_scatter_tensor``) and ``linop portable`` (the tree's point-to-point program under
  the identity worker map) against ``hand`` (the collective into a preallocated tensor);
- a convolution training step (forward and backward, 3 x 3 kernel, ``BENCH_LAYER`` =
  batch, channels, height, width, default 4 x 16 x 512 x 256, float32, rows sharded over the
  processes): ``linop`` (``LayerModule(Convolution(...), group=True)``: the input's halo
  exchanged by linop's tree, the parameters broadcast from their owners in the forward and
  their gradients summed back in the backward) against ``hand`` (the same layer written by
  hand: an ``autograd.Function`` exchanging the halo rows with ``isend``/``irecv`` and adding
  the halo gradients back in its backward, ``conv2d`` on the padded slab, and an
  ``all_reduce`` of the replicated parameters' gradients).

Every method's result is checked equal to linop's before timing. Nothing is asserted about
speed. The machine may be shared: report its load with the figures.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from statistics import median
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from _gloo import launch

from linop.backends import torch_distributed as td
from linop.halo import HaloExchange
from linop.halo_geometry import Kernel, halo_geometry
from linop.partition import DistributedTensor, Partition
from linop.repartition import Repartition

N = int(os.environ.get("BENCH_N", "4096"))
# BENCH_ONLY: a comma-separated subset of halo, repartition, gather, layer (default: all)
SAMPLES = int(os.environ.get("BENCH_SAMPLES", "15"))


def timed(methods: dict[str, Callable[[], object]], batch: int) -> dict[str, list[float]]:
    """Per method, per sample: the maximum over ranks of a batch's mean time per call."""
    times: dict[str, list[float]] = {name: [] for name in methods}
    for function in methods.values():
        function()
    for _ in range(SAMPLES):
        for name, function in methods.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(batch):
                function()
            elapsed = torch.tensor([(time.perf_counter() - start) / batch], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[name].append(float(elapsed))
    return times


def hand_halo(block: torch.Tensor, grid: tuple[int, int], rank: int, h: int) -> Callable[[], None]:
    """A hand-written in-place halo exchange of width ``h`` on linop's local layout (room for
    ``h`` halo or padding entries on every side; padding left as it is): packed strips,
    isend/irecv, dimension by dimension. Rows first, over the bulk columns; then columns, over
    the rows that hold data (bulk and the row halos just received): the corners are filled."""
    rows, cols = grid
    i, j = divmod(rank, cols)
    position = (i, j)
    counts = (rows, cols)
    strides = (cols, 1)
    stages = []
    for axis in (0, 1):
        other = 1 - axis
        extent_other = block.shape[other]
        if axis == 0:  # across the bulk of the other dimension
            span = slice(h, extent_other - h)
        else:  # over the rows holding data: bulk, and the halos of existing neighbours
            low = 0 if position[other] > 0 else h
            high = extent_other if position[other] < counts[other] - 1 else extent_other - h
            span = slice(low, high)
        extent = block.shape[axis]
        parts = []
        for direction in (-1, 1):
            neighbour = position[axis] + direction
            if not 0 <= neighbour < counts[axis]:
                continue
            peer = rank + direction * strides[axis]
            send = slice(h, 2 * h) if direction < 0 else slice(extent - 2 * h, extent - h)
            receive = slice(0, h) if direction < 0 else slice(extent - h, extent)
            index_send = (send, span) if axis == 0 else (span, send)
            index_recv = (receive, span) if axis == 0 else (span, receive)
            out = block[index_send].contiguous()
            into = torch.empty_like(out)
            parts.append((peer, index_send, index_recv, out, into))
        stages.append(parts)

    def exchange() -> None:
        for parts in stages:
            requests = []
            for peer, index_send, _, out, into in parts:
                out.copy_(block[index_send])
                requests.append(dist.irecv(into, peer))
                requests.append(dist.isend(out, peer))
            for request in requests:
                request.wait()
            for _, _, index_recv, _, into in parts:
                block[index_recv] = into

    return exchange


def halo_rows(grid: tuple[int, int], h: int, rank: int) -> list[str]:
    tensor = DistributedTensor("x", (N, N), Partition(grid))
    op = HaloExchange(halo_geometry(tensor, Kernel(2 * h + 1, padding=h)))
    (mine,) = [b for b in op.domain if b.worker == rank]
    rng = np.random.default_rng(rank)
    base = torch.from_numpy(rng.standard_normal(mine.shape))
    ours, checked, theirs = base.clone(), base.clone(), base.clone()
    # correctness first: one exchange each, the same values
    td.apply(op, {mine.name: checked}, inplace=True)
    hand = hand_halo(theirs, grid, rank, h)
    hand()
    equal = torch.equal(checked, theirs)
    step = td.plan_for(op).bind({mine.name: ours})
    times = timed(
        {
            "bound": step,
            "apply": lambda: td.apply(op, {mine.name: ours}, inplace=True),
            "hand": hand,
        },
        batch=5,
    )
    step.free()
    return _row(f"halo {grid[0]}x{grid[1]} h={h}", times, equal, base.numel() * 8)


def repartition_rows(rank: int, size: int) -> list[str]:
    rows = DistributedTensor("r", (N, N), Partition((size, 1)))
    columns = DistributedTensor("c", (N, N), Partition((1, size)))
    op = Repartition(rows, columns)
    (mine,) = [b for b in op.domain if b.worker == rank]
    (out,) = [b for b in op.range if b.worker == rank]
    rng = np.random.default_rng(rank)
    block = torch.from_numpy(rng.standard_normal(mine.shape).astype(np.float32))
    state = {mine.name: block}
    expected = td.apply(op, state)[out.name]
    piece = N // size
    received = torch.empty(size, N // size, piece, dtype=torch.float32)

    def hand() -> torch.Tensor:
        send = block.reshape(N // size, size, piece).transpose(0, 1).contiguous()  # per destination
        dist.all_to_all_single(received, send)
        return received.reshape(N, piece)  # piece j: rows of rank j, my columns: already in place

    equal = torch.equal(hand(), expected)
    step = td.plan_for(op).bind(state, inplace=False)
    equal = equal and torch.equal(step()[out.name], expected)
    methods: dict[str, Callable[[], Any]] = {
        "bound": step,
        "apply": lambda: td.apply(op, state),
        "hand": hand,
    }
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        mesh = init_device_mesh("cpu", (size,))
        dtensor = DTensor.from_local(block, mesh, [Shard(0)])
        redistributed = dtensor.redistribute(mesh, [Shard(1)]).to_local()
        equal = equal and torch.equal(redistributed, expected)
        methods["dtensor"] = lambda: dtensor.redistribute(mesh, [Shard(1)]).to_local()
    except Exception as error:
        if rank == 0:
            print(f"DTensor.redistribute not timed: {type(error).__name__}: {error}")
    times = timed(methods, batch=2)
    step.free()
    return _row(f"repartition rows->cols f32 {N}^2", times, equal, block.numel() * 4)


def gather_rows(rank: int, size: int) -> list[list[str]]:
    """All-gather of an ``N x N`` float32 array sharded by rows, and its adjoint, the
    reduce-scatter: linop as the executor chooses (bound and ``apply``), linop with the
    collectives forced (``all_gather_into_tensor`` / ``reduce_scatter_tensor``) and linop's
    portable point-to-point program (the same tree under the identity worker map), against the
    collective by hand into preallocated tensors."""
    from linop.collectives import AllGather

    op = AllGather(DistributedTensor("a", (N, N), Partition((size, 1))), 0, "g")
    identity = td.WorkerMap(list(range(size)))
    context = td.plan_context()
    chosen = context.native_gathers
    rows = []
    for tree, hand_call in ((op, dist.all_gather_into_tensor), (op.H, dist.reduce_scatter_tensor)):
        (mine,) = [b for b in tree.domain if b.worker == rank]
        (out,) = [b for b in tree.range if b.worker == rank]
        rng = np.random.default_rng(rank)
        block = torch.from_numpy(rng.integers(-8, 8, mine.shape).astype(np.float32))  # exact sums
        state = {mine.name: block}
        expected = td.apply(tree, state, mapping=identity)[out.name]
        received = torch.empty(out.shape, dtype=torch.float32)

        def hand(
            call: Any = hand_call, received: torch.Tensor = received, block: torch.Tensor = block
        ) -> torch.Tensor:
            call(received, block)
            return received

        step = td.plan_for(tree).bind(state, inplace=False)
        equal = torch.equal(hand(), expected) and torch.equal(step()[out.name], expected)
        equal = equal and torch.equal(td.apply(tree, state)[out.name], expected)

        def native(tree: Any = tree, state: Any = state) -> Any:
            context.native_gathers = True  # every rank alike, between calls
            try:
                return td.apply(tree, state)
            finally:
                context.native_gathers = chosen

        equal = equal and torch.equal(native()[out.name], expected)
        times = timed(
            {
                "bound": step,
                "apply": lambda tree=tree, state=state: td.apply(tree, state),
                "native": native,
                "portable": lambda tree=tree, state=state: td.apply(tree, state, mapping=identity),
                "hand": hand,
            },
            batch=2,
        )
        step.free()
        name = "all-gather" if tree is op else "reduce-scatter"
        rows.append(_row(f"{name} rows f32 {N}^2", times, equal, block.numel() * 4))
    return rows


class _HandHalo(torch.autograd.Function):
    """A hand-written halo exchange of ``h`` rows (dimension 2) between neighbouring ranks,
    zero rows at the global edges; backward: the halo rows' gradients sent back and added."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, h: int) -> torch.Tensor:
        rank, size = dist.get_rank(), dist.get_world_size()
        ctx.h = h
        shape = list(x.shape)
        shape[2] += 2 * h
        padded = x.new_zeros(shape)
        padded[:, :, h : h + x.shape[2]] = x
        top = [padded[:, :, :h].contiguous()] if rank > 0 else []
        bottom = [padded[:, :, -h:].contiguous()] if rank < size - 1 else []
        requests = []
        if rank > 0:
            requests.append(dist.irecv(top[0], rank - 1))
            requests.append(dist.isend(x[:, :, :h].contiguous(), rank - 1))
        if rank < size - 1:
            requests.append(dist.irecv(bottom[0], rank + 1))
            requests.append(dist.isend(x[:, :, -h:].contiguous(), rank + 1))
        for request in requests:
            request.wait()
        if top:
            padded[:, :, :h] = top[0]
        if bottom:
            padded[:, :, -h:] = bottom[0]
        return padded

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        rank, size = dist.get_rank(), dist.get_world_size()
        h = ctx.h
        result = grad[:, :, h:-h].clone()
        requests, received = [], []
        if rank > 0:
            into = torch.empty_like(result[:, :, :h])
            requests.append(dist.irecv(into, rank - 1))
            requests.append(dist.isend(grad[:, :, :h].contiguous(), rank - 1))
            received.append((slice(0, h), into))
        if rank < size - 1:
            into = torch.empty_like(result[:, :, -h:])
            requests.append(dist.irecv(into, rank + 1))
            requests.append(dist.isend(grad[:, :, -h:].contiguous(), rank + 1))
            received.append((slice(result.shape[2] - h, result.shape[2]), into))
        for request in requests:
            request.wait()
        for rows, into in received:
            result[:, :, rows] += into
        return result, None


def layer_rows(rank: int, size: int) -> list[str]:
    """A convolution step (forward + backward) of linop's LayerModule against the hand-written
    layer, the same input, parameters and loss; gradients compared before timing."""
    import torch.nn.functional as functional

    from linop.frameworks.torch_layers import LayerModule
    from linop.layers import Convolution

    batch, channels, height, width = (
        int(n) for n in os.environ.get("BENCH_LAYER", "4,16,512,256").split(",")
    )
    x = DistributedTensor("x", (batch, channels, height, width), Partition((1, 1, size, 1)))
    conv = Convolution(x, channels, Kernel(3, padding=1))
    rng = np.random.default_rng(0)
    weights = rng.standard_normal(conv.weights.global_shape).astype(np.float32)
    bias = rng.standard_normal(conv.bias.global_shape).astype(np.float32)
    layer = LayerModule(conv, weights=weights, bias=bias, group=True, dtype=torch.float32)
    (mine,) = [b for b in x.space if b.worker == rank]
    data = torch.from_numpy(np.random.default_rng(rank + 1).standard_normal(mine.shape).astype(np.float32))
    ours = data.clone().requires_grad_()
    theirs = data.clone().requires_grad_()
    weight = torch.from_numpy(weights).requires_grad_()
    offset = torch.from_numpy(bias).requires_grad_()

    def linop_step() -> dict[str, torch.Tensor]:
        for tensor in (ours, *layer.parameters()):
            tensor.grad = None
        out = layer({mine.name: ours})
        (sum((v * v).sum() for v in out.values()) + layer.token.sum()).backward()
        return out

    def hand_step() -> torch.Tensor:
        for tensor in (theirs, weight, offset):
            tensor.grad = None
        padded = _HandHalo.apply(theirs, 1)
        out = functional.conv2d(padded, weight, offset, padding=(0, 1))
        (out * out).sum().backward()
        for tensor in (weight, offset):
            dist.all_reduce(tensor.grad)
        return out

    ours_out, hand_out = linop_step(), hand_step()
    (name,) = ours_out
    equal = bool(
        torch.allclose(ours_out[name].detach(), hand_out.detach(), rtol=1e-4, atol=1e-3)
        and torch.allclose(ours.grad, theirs.grad, rtol=1e-3, atol=1e-2)
    )
    times = timed({"linop": linop_step, "hand": hand_step}, batch=1)
    return _row(f"conv step {batch}x{channels}x{height}x{width} f32", times, equal, data.numel() * 4)


def _row(name: str, times: dict[str, list[float]], equal: bool, nbytes: int) -> list[str]:
    hand = times["hand"]
    cells = [f"{name:<34}", f"{nbytes / 2**20:7.1f} MB", f"{median(hand) * 1e3:9.3f} ms"]
    for method in ("bound", "apply", "dtensor", "native", "portable", "linop"):
        if method in times:
            ratio = median(t / h for t, h in zip(times[method], hand))
            cells.append(f"{method} {median(times[method]) * 1e3:9.3f} ms ({ratio:5.2f}x)")
    if "apply" in times and "bound" in times:  # the entry check's cost per call: checked / bound
        ratio = median(a / b for a, b in zip(times["apply"], times["bound"]))
        cells.append(f"apply/bound {ratio:5.2f}x")
    cells.append("equal" if equal else "DIFFERENT")
    return cells


def main() -> None:
    rank, size = dist.get_rank(), dist.get_world_size()
    lines = []
    only = set(os.environ.get("BENCH_ONLY", "halo,repartition,gather,layer").split(","))
    grids = [(size, 1), (2, size // 2)] if size == 4 else [(size, 1)]
    if "halo" in only:
        for grid in grids:
            for h in (1, 3):
                lines.append(halo_rows(grid, h, rank))
    if "repartition" in only:
        lines.append(repartition_rows(rank, size))
    if "gather" in only:
        lines.extend(gather_rows(rank, size))
    if "layer" in only:
        lines.append(layer_rows(rank, size))
    if rank == 0:
        load = os.getloadavg()
        print(
            f"{size} processes, gloo, torch {torch.__version__}, {SAMPLES} samples; load {load[0]:.1f} {load[1]:.1f}"
        )
        print(
            "case | per-rank block | hand | linop bound (ratio) | linop apply (ratio) | DTensor (ratio)"
            " | linop apply, native collective (ratio) | linop portable program (ratio)"
            " | linop LayerModule step (ratio) | linop apply / linop bound (median per-sample ratio)"
        )
        for cells in lines:
            print(" | ".join(cells))


if __name__ == "__main__":
    launch(main, int(sys.argv[1]) if len(sys.argv) > 1 else 4)
