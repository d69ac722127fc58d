"""The checked in-place call on torch.distributed against a bound plan: its local (Python)
work in CPU time, and (``ratios``) the whole call's time against the bound plan's and floors.

Run with ``python benchmarks/bench_torch_check_overhead.py`` (2 gloo processes on 127.0.0.1),
or ``python benchmarks/bench_torch_check_overhead.py ratios P`` (P gloo processes).

**Local work** (the default):
As ``bench_mpi_check_overhead.py`` does for MPI: after warm calls on both processes (the halo
exchange of a 256 x 256 float64 CPU tensor, width 1, grid 2 x 1; the checked call passes the
same tensor again each call), rank 0 makes the check's reduction return the vector it reduced
last (what every rank sent) without communicating, and the prepared phases of the checked
path and of the bound plan do nothing; it then times each call's CPU time
(``time.process_time``), minimum over repeats. Rank 1 waits at a barrier. What remains is the
local work per call: the checked call's, besides its collective, against the bound plan's.

**Ratios** (``ratios P``): the in-place halo exchange of ``N x N`` float64 (``BENCH_NS``,
default 2048 and 4096; 1-d grid ``P x 1`` and, on 4 processes, 2-d ``2 x 2``; widths 1 and 3:
row messages of 16 to 96 KB), every method timed in the same processes, in a random order per
sample (the same on every rank), each batch of ``BATCH`` calls after ``WARM`` untimed calls of
its own (the first calls after another method's calls on other buffers run slower). A sample's
time is the maximum over ranks of the batch's wall time (and of its CPU time,
``time.process_time``, which counts gloo's threads) per call; the table gives, per method, the
median of the per-sample ratios to ``bound`` (and ``checked`` against ``floor``):

- ``bound``: ``plan_for(op).bind(local)``, called;
- ``checked``: ``apply(op, local, inplace=True)``, the same tensor every call (the repeat);
- ``checked, dist.all_reduce``: the same with the check's reduction as it was before it was
  started on the group directly (``torch.distributed.all_reduce`` and the copies around it);
- ``floor``: the check's reduction alone, started on the group as the check starts it (a
  reducer of its own), then the bound call: what a checked call costs with no local work;
- ``all_reduce``: that reduction alone (without the bound call); ``all_reduce,
  dist.all_reduce``: the reduction as it was before (``torch.distributed.all_reduce`` of a copy);
- ``pairwise``: the same vector's maximum by recursive doubling of ``send``/``recv`` pairs
  (``log2 P`` rounds in the calling thread, against gloo's ring of ``2 (P - 1)`` steps run by the
  group's worker thread): a floor measured for reference, not what the check runs (a gloo
  point-to-point wait with a timeout closes the group's connections when it expires, which
  the check's deadline and the stall diagnosis's sliced waits cannot accept).
"""

from __future__ import annotations

import os
import random
import sys
import time
import timeit
from collections.abc import Callable
from statistics import median

import numpy as np
import torch
import torch.distributed as dist
from _gloo import launch

from linop.backends import torch_distributed as td
from linop.halo import HaloExchange
from linop.halo_geometry import Kernel, halo_geometry
from linop.partition import DistributedTensor, Partition

NUMBER, REPEATS = 2000, 9
SAMPLES = int(os.environ.get("BENCH_SAMPLES", "9"))
BATCH, WARM = 5, 2
PAIRWISE_TAG = 40_961  # above every program tag (linop.program.TAG_LIMIT)
_KEPT: list[torch.Tensor] = []  # the pairwise buffers, alive until the process ends (gloo aborts otherwise)


def main() -> None:
    rank = dist.get_rank()
    tensor = DistributedTensor("x", (256, 256), Partition((2, 1)))
    op = HaloExchange(halo_geometry(tensor, Kernel(3, padding=1)))
    (block,) = [b for b in op.domain if b.worker == rank]
    state = {block.name: torch.from_numpy(np.random.default_rng(rank).standard_normal(block.shape))}
    bound = td.plan_for(op).bind({block.name: state[block.name].clone()})

    def checked() -> None:
        td.apply(op, state, inplace=True)

    for _ in range(20):
        bound()
        checked()
    dist.barrier()
    if rank == 0:
        plan = td.plan_for(op)
        reducer = plan.context.reducer
        phases = [*(plan._prepared[1] if plan._prepared else []), *(bound._phases or [])]
        reducer.reduce = lambda timeout=None, doing=None: reducer.received  # as last reduced
        for phase in phases:
            phase.run = lambda timeout=None, doing=None: None
        print(f"local work per call, CPU time, min of {REPEATS} x {NUMBER} (collectives emptied):")
        for name, function in (("checked apply", checked), ("bound plan", bound)) * 2:
            best = min(timeit.repeat(function, number=NUMBER, repeat=REPEATS, timer=time.process_time))
            print(f"  {name:14s} {best / NUMBER * 1e6:7.2f} us", flush=True)
        del reducer.reduce
        for phase in phases:
            del phase.run
    dist.barrier()
    bound.free()


def pairwise_maximum(group: object, rank: int, size: int, vector: torch.Tensor, other: torch.Tensor) -> None:
    """``vector``'s maximum over a group of a power-of-two size, in place, by recursive
    doubling of ``send``/``recv`` pairs (the ``pairwise`` floor)."""
    distance = 1
    while distance < size:
        peer = rank ^ distance
        receiving = group.recv([other], peer, PAIRWISE_TAG)  # type: ignore[attr-defined]
        sending = group.send([vector], peer, PAIRWISE_TAG)  # type: ignore[attr-defined]
        receiving.wait()
        sending.wait()
        torch.maximum(vector, other, out=vector)
        distance <<= 1


def ratio_case(n: int, grid: tuple[int, int], h: int) -> str:
    """One row of ``ratios``: every method against the bound plan (see the module docstring)."""
    from linop.backends.torch_distributed.check import TorchReducer

    rank, size = dist.get_rank(), dist.get_world_size()
    tensor = DistributedTensor("x", (n, n), Partition(grid))
    op = HaloExchange(halo_geometry(tensor, Kernel(2 * h + 1, padding=h)))
    (mine,) = [b for b in op.domain if b.worker == rank]
    base = torch.from_numpy(np.random.default_rng(rank).standard_normal(mine.shape))
    checked_tensor, bound_tensor = base.clone(), base.clone()
    state = {mine.name: checked_tensor}
    bound = td.plan_for(op).bind({mine.name: bound_tensor})
    td.apply(op, state, inplace=True)
    bound()
    equal = torch.equal(checked_tensor, bound_tensor)
    context = td.plan_context()
    reducer = context.reducer
    own = TorchReducer(context)  # the floor's reduction: its own buffers, the check's untouched
    own.send[:] = rank
    before = TorchReducer(context)  # the same, through torch.distributed.all_reduce as before
    before.send[:] = rank
    before._maximum = None
    vector, other = (
        torch.zeros(own.send.size, dtype=torch.int64),
        torch.zeros(own.send.size, dtype=torch.int64),
    )
    maximum = reducer._maximum

    def checked() -> None:
        td.apply(op, state, inplace=True)

    def checked_before() -> None:  # every rank alike, between calls
        reducer._maximum = None
        try:
            td.apply(op, state, inplace=True)
        finally:
            reducer._maximum = maximum

    def floor() -> None:
        own.reduce()
        bound()

    def pairwise() -> None:
        vector.fill_(rank)
        pairwise_maximum(context.group, rank, size, vector, other)

    methods: dict[str, Callable[[], object]] = {
        "bound": bound,
        "checked": checked,
        "checked, dist.all_reduce": checked_before,
        "floor": floor,
        "all_reduce": own.reduce,
        "all_reduce, dist.all_reduce": before.reduce,
    }
    if size & (size - 1) == 0:
        methods["pairwise"] = pairwise
        _KEPT.extend((vector, other))
    wall: dict[str, list[float]] = {name: [] for name in methods}
    cpu: dict[str, list[float]] = {name: [] for name in methods}
    order = random.Random(n * 31 + h * 7 + grid[0])  # the same order on every rank
    for _ in range(SAMPLES):
        names = list(methods)
        order.shuffle(names)
        for name in names:
            function = methods[name]
            for _ in range(WARM):
                function()
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            for _ in range(BATCH):
                function()
            spent = torch.tensor(
                [(time.perf_counter() - start) / BATCH, (time.process_time() - start_cpu) / BATCH],
                dtype=torch.float64,
            )
            dist.all_reduce(spent, op=dist.ReduceOp.MAX)
            wall[name].append(float(spent[0]))
            cpu[name].append(float(spent[1]))
    bound.free()
    message = n // grid[1] * h * 8
    cells = [
        f"{n}^2 {grid[0]}x{grid[1]} h={h} ({message // 1024} KB rows)",
        f"bound {median(wall['bound']) * 1e3:6.2f} ms",
    ]
    for name in methods:
        if name != "bound":
            by_wall = median(a / b for a, b in zip(wall[name], wall["bound"]))
            by_cpu = median(a / b for a, b in zip(cpu[name], cpu["bound"]))
            cells.append(f"{name} {median(wall[name]) * 1e3:6.2f} ms {by_wall:5.2f}x (cpu {by_cpu:5.2f}x)")
    by_floor = median(a / b for a, b in zip(wall["checked"], wall["floor"]))
    cells.append(f"checked / floor {by_floor:5.2f}x")
    cells.append("equal" if equal else "DIFFERENT")
    return " | ".join(cells)


def ratios() -> None:
    rank, size = dist.get_rank(), dist.get_world_size()
    grids = [(size, 1), *([(2, size // 2)] if size == 4 else [])]
    sizes = [int(n) for n in os.environ.get("BENCH_NS", "2048,4096").split(",")]
    lines = [ratio_case(n, grid, h) for n in sizes for grid in grids for h in (1, 3)]
    if rank == 0:
        print(
            f"{size} processes, gloo, torch {torch.__version__}, {SAMPLES} samples; load {os.getloadavg()[0]:.1f}"
        )
        print(
            "case | bound (wall median) | method: wall median, median per-sample ratio to bound (wall; cpu)"
        )
        print("\n".join(lines), flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["ratios"]:
        launch(ratios, int(sys.argv[2]) if len(sys.argv) > 2 else 4)
    else:
        launch(main, 2)
    sys.exit(0)
