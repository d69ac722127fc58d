"""A small convolution training step: ``LayerModule`` against the same layer by hand, on MPI
and on torch.distributed (gloo), per-call constant in view.

Run with::

    mpiexec -n 4 python benchmarks/bench_layer_step.py          # MPI (comm=)
    python benchmarks/bench_layer_step.py --gloo                 # 4 gloo processes (group=)

The global input is ``BENCH_LAYER`` = batch, channels, height, width (default 2 x 8 x 64 x 64,
float32), its rows cut over the processes; a 3 x 3 convolution (padding 1) to as many
channels. One step: forward, the loss ``sum(y * y)``, backward, and the parameters' gradients
summed over the processes. ``hand``: an ``autograd.Function`` exchanging one halo row with each
neighbour (the backward adds the halo gradients back), ``conv2d``, and an all-reduce of the
weight and bias gradients (one call for both, packed), the replicated data-parallel layer.
``owners``: ``LayerModule(...)`` with the parameters on their owner (broadcast in the forward,
summed back in the backward); ``replicated``: ``LayerModule(..., replicate=True)``. Each in two
cases: the input requires a gradient (a layer inside a network) and it does not (the first
layer: the image); in the second, also built with ``input_gradient=False`` (``declared``: the
input said to be data once, so no call runs the agreement that decides whether any process
needs the input gradient).

``BENCH_BEFORE`` = the path of another ``torch_layers.py`` (say ``git show
main:linop/frameworks/torch_layers.py > /tmp/before.py``): its ``LayerModule`` is run too,
interleaved sample by sample with this tree's, so that a change is measured before and after
in the same processes on a loaded machine. Each sample is a batch of steps; its wall time is the
maximum over ranks of the batch's mean, and so is its CPU time (``time.process_time``) per step.
Printed: medians and the median of per-sample ratios to ``hand``. Every module's output,
input gradient and parameter gradients are checked against the hand-written layer's first.
Nothing is asserted about speed; the machine may be shared (its load is printed).
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import socket
import sys
import time
from collections.abc import Callable
from statistics import median
from typing import Any

import numpy as np
import torch

import linop.frameworks
from linop import DistributedTensor, Kernel, Partition
from linop.frameworks.torch_layers import LayerModule
from linop.layers import Convolution

SAMPLES = int(os.environ.get("BENCH_SAMPLES", "15"))
BATCH = int(os.environ.get("BENCH_BATCH", "10"))
SHAPE = tuple(int(n) for n in os.environ.get("BENCH_LAYER", "2,8,64,64").split(","))


def _before() -> Any:
    """The ``LayerModule`` of ``BENCH_BEFORE`` (None without it), imported inside
    ``linop.frameworks`` so that its relative imports resolve to this tree's modules."""
    path = os.environ.get("BENCH_BEFORE")
    if not path:
        return None
    spec = importlib.util.spec_from_file_location(f"{linop.frameworks.__name__}._before_layers", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.LayerModule


class Engine:
    """The few calls the hand-written layer needs, on MPI or torch.distributed."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        if comm is not None:
            self.rank, self.size = comm.rank, comm.size
        else:
            import torch.distributed as dist

            self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def swap(self, pairs: list[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        """Send each ``out`` to its peer and receive into ``into`` (contiguous)."""
        if self.comm is not None:
            from mpi4py import MPI

            requests = []
            for peer, out, into in pairs:
                requests.append(self.comm.Irecv(into.numpy(), source=peer))
                requests.append(self.comm.Isend(out.numpy(), dest=peer))
            MPI.Request.Waitall(requests)
            return
        import torch.distributed as dist

        works = []
        for peer, out, into in pairs:
            works.append(dist.irecv(into, peer))
            works.append(dist.isend(out, peer))
        for work in works:
            assert work is not None
            work.wait()

    def all_reduce(self, tensor: torch.Tensor) -> None:
        if self.comm is not None:
            from mpi4py import MPI

            self.comm.Allreduce(MPI.IN_PLACE, tensor.numpy())
        else:
            import torch.distributed as dist

            dist.all_reduce(tensor)

    def max(self, value: float) -> float:
        if self.comm is not None:
            from mpi4py import MPI

            return float(self.comm.allreduce(value, op=MPI.MAX))
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    def barrier(self) -> None:
        if self.comm is not None:
            self.comm.Barrier()
        else:
            import torch.distributed as dist

            dist.barrier()


def hand_layer(engine: Engine, weight: torch.Tensor, bias: torch.Tensor) -> Callable[..., Any]:
    """The hand-written step (see the module docstring)."""
    rank, size = engine.rank, engine.size

    class Halo(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            n, c, rows, cols = x.shape
            padded = x.new_zeros((n, c, rows + 2, cols))
            padded[:, :, 1:-1] = x
            pairs = []
            if rank > 0:
                pairs.append(
                    (rank - 1, x[:, :, :1].contiguous(), torch.empty((n, c, 1, cols), dtype=x.dtype))
                )
            if rank < size - 1:
                pairs.append(
                    (rank + 1, x[:, :, -1:].contiguous(), torch.empty((n, c, 1, cols), dtype=x.dtype))
                )
            engine.swap(pairs)
            for peer, _, into in pairs:
                padded[:, :, slice(0, 1) if peer < rank else slice(-1, None)] = into
            return padded

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            result = grad[:, :, 1:-1].clone()
            pairs = []
            if rank > 0:
                pairs.append((rank - 1, grad[:, :, :1].contiguous(), torch.empty_like(result[:, :, :1])))
            if rank < size - 1:
                pairs.append((rank + 1, grad[:, :, -1:].contiguous(), torch.empty_like(result[:, :, :1])))
            engine.swap(pairs)
            for peer, _, into in pairs:
                if peer < rank:
                    result[:, :, :1] += into
                else:
                    result[:, :, -1:] += into
            return result

    w, b = weight.clone().requires_grad_(), bias.clone().requires_grad_()

    def step(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
        w.grad = b.grad = None
        y = torch.nn.functional.conv2d(Halo.apply(x), w, b, padding=(0, 1))
        (y * y).sum().backward()
        assert w.grad is not None and b.grad is not None
        packed = torch.cat([w.grad.reshape(-1), b.grad])
        engine.all_reduce(packed)
        return y.detach(), x.grad, [packed[: w.numel()].reshape(w.shape), packed[w.numel() :]]

    return step


def module_step(module: Any) -> Callable[..., Any]:
    (x_name,), (y_name,) = module.input_names, module.output_names
    parameters = list(module.parameters())  # once: the hand-written step walks no module tree

    def step(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
        module.zero_grad()
        y = module({x_name: x})[y_name]
        ((y * y).sum() + module.token.sum()).backward()
        return y.detach(), x.grad, [p.grad for p in parameters]

    return step


def rows(engine: Engine, comm: Any, group: Any) -> list[str]:
    before = _before()
    x = DistributedTensor("x", SHAPE, Partition((1, 1, engine.size, 1)))
    layer = Convolution(x, SHAPE[1], Kernel(3, padding=1))
    assert layer.bias is not None  # built with a bias
    rng = np.random.default_rng(0)
    w = rng.standard_normal(layer.weights.global_shape).astype(np.float32)
    b = rng.standard_normal(layer.bias.global_shape).astype(np.float32)
    data = rng.standard_normal(SHAPE).astype(np.float32)
    kinds = {"after": LayerModule} if before is None else {"before": before, "after": LayerModule}
    (mine,) = [blk for blk in x.space if blk.worker == engine.rank]
    strip = torch.from_numpy(x.scatter(data)[mine.name])
    lines = []
    for grad in (True, False):
        # new modules for each case: a module that once computed an input gradient keeps doing so
        steps: dict[str, Callable[..., Any]] = {
            "hand": hand_layer(engine, torch.from_numpy(w), torch.from_numpy(b))
        }
        for label, kind in kinds.items():
            for replicate in (False, True):
                module = kind(
                    layer, weights=w, bias=b, comm=comm, group=group, dtype=torch.float32, replicate=replicate
                )
                steps[f"{'replicated' if replicate else 'owners'} {label}"] = module_step(module)
                if not grad and kind is LayerModule:  # the image: said once, no call asks
                    module = kind(
                        layer,
                        weights=w,
                        bias=b,
                        comm=comm,
                        group=group,
                        dtype=torch.float32,
                        replicate=replicate,
                        input_gradient=False,
                    )
                    steps[f"{'replicated' if replicate else 'owners'} {label} declared"] = module_step(module)

        def given(grad: bool = grad) -> torch.Tensor:
            return strip.detach().requires_grad_(grad)

        y0, g0, p0 = steps["hand"](given())
        same = True
        for step in steps.values():
            y1, g1, p1 = step(given())
            same &= bool(torch.allclose(y1, y0, rtol=1e-5, atol=1e-4))
            same &= (g1 is None) == (g0 is None) and (
                g1 is None or bool(torch.allclose(g1, g0, rtol=1e-5, atol=1e-4))
            )
            same &= all(
                torch.allclose(p, q, rtol=1e-4, atol=1e-3) for p, q in zip(p1, p0) if p.shape == q.shape
            )
        if engine.max(0.0 if same else 1.0):
            raise SystemExit("bench_layer_step: a module and the hand-written layer differ")
        wall: dict[str, list[float]] = {name: [] for name in steps}
        cpu: dict[str, list[float]] = {name: [] for name in steps}
        for step in steps.values():
            step(given())
        names, order = list(steps), np.random.default_rng(len(steps))  # alike on every rank
        for _ in range(SAMPLES):
            for index in order.permutation(len(names)):  # each batch after a step of its own
                name = names[index]
                step = steps[name]
                step(given())
                engine.barrier()
                start, start_cpu = time.perf_counter(), time.process_time()
                for _ in range(BATCH):
                    step(given())
                wall[name].append(engine.max((time.perf_counter() - start) / BATCH))
                cpu[name].append(engine.max((time.process_time() - start_cpu) / BATCH))
        hand_wall, hand_cpu = wall["hand"], cpu["hand"]
        cells = [
            f"input grad {'yes' if grad else 'no ':>3}",
            f"hand {median(hand_wall) * 1e3:6.2f} ms / cpu {median(hand_cpu) * 1e3:6.2f}",
        ]
        for name in steps:
            if name == "hand":
                continue
            ratio = median(a / h for a, h in zip(wall[name], hand_wall))
            ratio_cpu = median(a / h for a, h in zip(cpu[name], hand_cpu))
            cells.append(f"{name} {median(wall[name]) * 1e3:6.2f} ms {ratio:4.2f}x / cpu {ratio_cpu:4.2f}x")
        lines.append(" | ".join(cells))
    return lines


def report(engine: Engine, name: str, lines: list[str]) -> None:
    if engine.rank == 0:
        load = os.getloadavg()
        print(
            f"{name}, {engine.size} processes, {'x'.join(map(str, SHAPE))} float32, {SAMPLES} samples of {BATCH}"
            f" steps; load {load[0]:.1f} {load[1]:.1f}"
        )
        for line in lines:
            print(line)


def _process(rank: int, size: int, port: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=300),
    )
    try:
        engine = Engine(None)
        report(engine, "torch.distributed (gloo)", rows(engine, None, True))
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # past torch's own teardown, which may abort after the table (tests/torchdist/spawn.py)


if __name__ == "__main__":
    if "--gloo" in sys.argv[1:]:
        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_process, args=(4, port), nprocs=4)
    else:
        from mpi4py import MPI

        torch.set_num_threads(1)
        engine = Engine(MPI.COMM_WORLD)
        report(engine, "MPI", rows(engine, MPI.COMM_WORLD, None))
