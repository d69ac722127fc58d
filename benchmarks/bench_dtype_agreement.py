"""The per-call cost of the torch wrappers' agreement on dtypes, for a tree that leaves a rank
without input blocks (:meth:`linop.frameworks.torch_function._Runner.agree`).

Run with::

    mpiexec -n 2 python benchmarks/bench_dtype_agreement.py        # MPI (also -n 4)
    python benchmarks/bench_dtype_agreement.py gloo 2              # 2 gloo processes

Such a tree (a broadcast's ranks other than its root, a repartition onto more workers than it
starts from) starts each call with one all-reduce (``MAX``) of one flag, so that a rank without
inputs follows its peers' dtype change. Timed here, in the same processes and interleaved
sample by sample (a sample: a batch of ``BATCH`` calls after ``SETTLE`` untimed ones and a
barrier; its time the maximum over ranks of the batch's mean; medians over ``BENCH_SAMPLES``
samples, in an order drawn afresh per sample, the same on every rank; wall time and CPU time,
``time.process_time``, which counts gloo's threads), one forward and backward step (float64, the same dtype every call: the bound plans) of:

- ``broadcast``: a TorchOperator of a broadcast of a (2, 3) block from worker 0 to one copy per
  rank (the backward, a sum-reduce, gives every rank inputs: no agreement there);
- ``repartition``: a Repartition module of a (64, 32) tensor from one worker onto one per rank
  (its reverse gives every rank inputs: no agreement);
- ``windows``: a TorchOperator of a halo exchange's windows over every rank (every rank has
  inputs: no agreement; the control),

each as it runs now (``agreed``) and with the agreement switched off on its runner
(``unagreed``: ``_blind`` False, what main runs, which then stalls at a dtype change). The
difference is the agreement's cost per call; the control's two should match. The load average
is printed with the figures (the machine is shared).
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

from linop import Broadcast, DistributedTensor, Kernel, Partition, halo_windows

SAMPLES = int(os.environ.get("BENCH_SAMPLES", "15"))
BATCH, SETTLE = 20, 3


def _steps(size: int, rank: int, **engine: Any) -> dict[str, Callable[[], object]]:
    """Per tree and mode, one forward and backward step on this rank's blocks."""
    from linop.frameworks.torch_function import TorchOperator
    from linop.frameworks.torch_repartition import Repartition

    source = DistributedTensor("a", (64, 32), Partition((1, 1)))
    destination = DistributedTensor("b", (64, 32), Partition((size, 1)))
    trees: dict[str, Callable[[], Any]] = {
        "broadcast": lambda: TorchOperator(
            Broadcast(DistributedTensor("w", (2, 3), Partition((1, 1))), Partition((size, 1)), "c"), **engine
        ),
        "repartition": lambda: Repartition(source, destination, **engine),
        "windows": lambda: TorchOperator(
            halo_windows(DistributedTensor("u", (64, 32), Partition((size, 1))), Kernel(3, padding=1)),
            **engine,
        ),
    }
    steps: dict[str, Callable[[], object]] = {}
    for name, make in trees.items():
        for mode in ("agreed", "unagreed"):
            f = make()
            op = f.operator if name == "repartition" else f.op
            rng = np.random.default_rng(rank)
            x = {
                b.name: torch.from_numpy(rng.standard_normal(b.shape)).requires_grad_()
                for b in op.domain
                if b.worker == rank
            }

            def step(f: Any = f, x: dict[str, torch.Tensor] = x) -> None:
                y = f(x)
                (sum(v.sum() for v in y.values()) + f.token.sum()).backward()

            step()  # binds: the runner knows now whether a rank has no inputs
            runner = (f.function if name == "repartition" else f)._runner
            if mode == "unagreed":
                runner._blind = False  # main's behaviour (no agreement)
            steps[f"{name}, {mode}"] = step
    return steps


def _interleaved(
    steps: dict[str, Callable[[], object]], barrier: Callable[[], object], largest: Callable[[float], float]
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per step, each sample's wall and CPU time (``time.process_time``) per call: the maximum
    over the ranks of a batch's mean (see the module docstring)."""
    names = list(steps)
    order = np.random.default_rng(len(names))  # seeded alike on every rank
    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in names}
    for _ in range(SAMPLES):
        for index in order.permutation(len(names)):
            step = steps[names[index]]
            for _ in range(SETTLE):
                step()
            barrier()
            start, cpu = time.perf_counter(), time.process_time()
            for _ in range(BATCH):
                step()
            wall, cpu = (time.perf_counter() - start) / BATCH, (time.process_time() - cpu) / BATCH
            times[names[index]][0].append(largest(wall))
            times[names[index]][1].append(largest(cpu))
    return {name: (np.array(wall), np.array(cpu)) for name, (wall, cpu) in times.items()}


def _table(times: dict[str, tuple[np.ndarray, np.ndarray]], where: str) -> None:
    load = os.getloadavg()
    print(
        f"{where}; load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; {SAMPLES} samples of {BATCH} steps"
    )
    print(f"{'step (us per step)':<24} {'wall':>8} {'p25':>8} {'p75':>8} {'cpu':>8} {'p25':>8} {'p75':>8}")
    for name, (wall, cpu) in times.items():
        row = [f(v * 1e6) for v in (wall, cpu) for f in (median, _p25, _p75)]
        print(f"{name:<24} " + " ".join(f"{value:>8.1f}" for value in row))
    for tree in ("broadcast", "repartition", "windows"):
        (aw, ac), (uw, uc) = times[f"{tree}, agreed"], times[f"{tree}, unagreed"]
        print(
            f"{tree}: agreed - unagreed, wall median {median((aw - uw) * 1e6):.1f} us "
            f"(p25 {_p25((aw - uw) * 1e6):.1f}, p75 {_p75((aw - uw) * 1e6):.1f}), "
            f"cpu median {median((ac - uc) * 1e6):.1f} us "
            f"(p25 {_p25((ac - uc) * 1e6):.1f}, p75 {_p75((ac - uc) * 1e6):.1f}); "
            f"wall ratio {median(aw / uw):.3f}, cpu ratio {median(ac / uc):.3f}"
        )


def _p25(values: np.ndarray) -> float:
    return float(np.percentile(values, 25))


def _p75(values: np.ndarray) -> float:
    return float(np.percentile(values, 75))


def mpi_main() -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    steps = _steps(comm.size, comm.rank, comm=comm)
    times = _interleaved(steps, comm.Barrier, lambda value: comm.allreduce(value, op=MPI.MAX))
    if comm.rank == 0:
        _table(times, f"MPI, {comm.size} ranks")


def gloo_main() -> None:
    import torch.distributed as dist

    rank, size = dist.get_rank(), dist.get_world_size()
    steps = _steps(size, rank, group=True)

    def largest(value: float) -> float:
        tensor = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return float(tensor)

    times = _interleaved(steps, dist.barrier, largest)
    if rank == 0:
        _table(times, f"gloo, {size} processes")
        sys.stdout.flush()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "gloo":
        from _gloo import launch

        launch(gloo_main, int(sys.argv[2]) if len(sys.argv) > 2 else 2, start_method="fork")
    else:
        mpi_main()
