"""What a deadline costs per call (issue 41), on 2 ranks, with tiny messages (where the cost shows).

- the checked call (``plan.apply``) with no deadline (``timeout=inf``: a blocking wait) against
  the default deadline (600 s: the entry check's reduction polled, :mod:`linop.backends.mpi.deadline`
  / ``work.wait(timeout)`` on torch.distributed);
- a bound plan's call bounded on its first call only against every call (``every_call=True``):
  a prepared halo exchange, and on torch.distributed also a bound plan that is not prepared
  (an out-of-place all-reduce: a barrier per call).

Per call: the median over samples of a batch's mean, each the maximum over ranks, wall and CPU
time (``time.process_time``; on a loaded machine the CPU figures are the ones to read). The
variants alternate within each sample.

Measured here (2026-12-06, 2 ranks, load about 4 from other work: provisional), median per call:

- MPI: a complete request, ``Wait`` 61 ns and ``wait_all`` 271 ns of CPU; the checked call
  5.2 us blocking, 5.9 us with the default deadline; a persistent halo exchange 1.2 us bound
  for the first call, 1.1 us with ``every_call=True`` (its waits polled);
- torch.distributed (gloo): the checked call 1.92 ms without a deadline, 1.67 ms with the
  default (within the noise); a prepared halo exchange 3.94 ms against 3.96 ms with
  ``every_call=True`` (its waits take the deadline); an out-of-place all-reduce that is not
  prepared 344 us against 689 us with ``every_call=True`` (the barrier per call).

    mpiexec -n 2 python benchmarks/bench_deadline.py mpi
    python benchmarks/bench_deadline.py torch          # 2 gloo processes on 127.0.0.1
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from statistics import median
from typing import Any

import numpy as np

SAMPLES = int(os.environ.get("BENCH_SAMPLES", "15"))
BATCH = int(os.environ.get("BENCH_BATCH", "400"))


def _ring(size: int) -> Any:
    from linop import Block, SendRecv, Space

    space = Space(Block(f"x{w}", (16,), w) for w in range(size))
    op = None
    for w in range(size):
        node = SendRecv(space[f"x{w}"][0:2], space[f"x{(w + 1) % size}"][-2:])
        op = node if op is None else node @ op
    return op


def _timed(
    variants: dict[str, Callable[[], Any]],
    barrier: Callable[[], None],
    maximum: Callable[[np.ndarray], np.ndarray],
) -> dict[str, tuple[float, float]]:
    samples: dict[str, list[np.ndarray]] = {name: [] for name in variants}
    for call in variants.values():
        for _ in range(20):
            call()
    for _ in range(SAMPLES):
        for name, call in variants.items():
            barrier()
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(BATCH):
                call()
            spent = np.array([time.perf_counter() - wall, time.process_time() - cpu]) / BATCH
            samples[name].append(maximum(spent))
    return {name: (median(s[0] for s in got), median(s[1] for s in got)) for name, got in samples.items()}


def _report(title: str, found: dict[str, tuple[float, float]]) -> None:
    print(title, flush=True)
    for name, (wall, cpu) in found.items():
        print(f"  {name:<44} wall {wall * 1e6:8.1f} us   cpu {cpu * 1e6:8.1f} us", flush=True)


def _floor(comm: Any) -> tuple[float, float]:
    """CPU seconds per call of a blocking ``Wait`` and of :func:`~linop.backends.mpi.deadline.wait_all`
    on a request that is complete already (an inactive persistent one): the deadline's added
    cost where no time is spent waiting for a peer, free of the machine's load."""
    from linop.backends.mpi.deadline import wait_all

    request = comm.Send_init(np.zeros(1), comm.rank, 0)
    reps = 200_000
    found = []
    for call in (request.Wait, lambda: wait_all([request], comm, 600.0, "x")):
        best = float("inf")
        for _ in range(5):
            cpu = time.process_time()
            for _ in range(reps):
                call()
            best = min(best, (time.process_time() - cpu) / reps)
        found.append(best)
    request.Free()
    return found[0], found[1]


def run_mpi() -> None:
    from mpi4py import MPI

    from linop.backends.mpi import plan_for

    comm = MPI.COMM_WORLD
    if comm.rank == 0:
        wait, polled = _floor(MPI.COMM_SELF)
        print(
            f"a complete request, CPU per call (best of 5 x 200000): Wait {wait * 1e9:.0f} ns, "
            f"wait_all {polled * 1e9:.0f} ns (+{(polled - wait) * 1e9:.0f} ns)",
            flush=True,
        )
    comm.Barrier()
    op = _ring(comm.size)
    local = {f"x{comm.rank}": np.arange(16.0)}
    plan = plan_for(op, comm=comm)

    def maximum(values: np.ndarray) -> np.ndarray:
        out = np.empty_like(values)
        comm.Allreduce(values, out, op=MPI.MAX)
        return out

    checked = _timed(
        {
            "checked, no deadline (blocking Wait)": lambda: plan.apply(
                local, inplace=True, timeout=float("inf")
            ),
            "checked, default deadline (polled)": lambda: plan.apply(local, inplace=True, timeout=600),
        },
        comm.Barrier,
        maximum,
    )
    first = plan.bind(local, inplace=True, timeout=600)
    every = plan.bind(dict(local), inplace=True, timeout=600, every_call=True)
    bound = _timed({"bound, first call only": first, "bound, every_call=True": every}, comm.Barrier, maximum)
    if comm.rank == 0:
        print(f"MPI, {comm.size} ranks, load {os.getloadavg()[0]:.1f}; {SAMPLES} samples of {BATCH} calls")
        _report("checked call", checked)
        _report("bound halo exchange (persistent)", bound)


def _torch_main() -> None:
    import torch
    import torch.distributed as dist

    from linop.backends import torch_distributed as td
    from linop.collectives import AllReduce, BlockGrid
    from linop.partition import Partition

    rank, size = dist.get_rank(), dist.get_world_size()
    op = _ring(size)
    local = {f"x{rank}": torch.arange(16.0, dtype=torch.float64)}
    plan = td.plan_for(op)

    def maximum(values: np.ndarray) -> np.ndarray:
        tensor = torch.from_numpy(values.copy())
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor.numpy()

    checked = _timed(
        {
            "checked, no deadline": lambda: plan.apply(local, inplace=True, timeout=float("inf")),
            "checked, default deadline": lambda: plan.apply(local, inplace=True, timeout=600),
        },
        dist.barrier,
        maximum,
    )
    first = plan.bind(local, inplace=True, timeout=600)
    every = plan.bind({k: v.clone() for k, v in local.items()}, inplace=True, timeout=600, every_call=True)
    assert first.prepared and every.prepared
    prepared = _timed(
        {"prepared, first call only": first, "prepared, every_call=True": every}, dist.barrier, maximum
    )
    reduce = AllReduce(BlockGrid.uniform("r", Partition((size,)), (64,)), (0,))
    mine = {b.name: torch.ones(b.shape, dtype=torch.float64) for b in reduce.domain.owned(rank)}
    plain = td.plan_for(reduce).bind(mine, inplace=False, timeout=600)
    barrier = td.plan_for(reduce).bind(mine, inplace=False, timeout=600, every_call=True)
    assert not plain.prepared
    unprepared = _timed(
        {"not prepared, first call only": plain, "not prepared, every_call=True (barrier)": barrier},
        dist.barrier,
        maximum,
    )
    if rank == 0:
        print(
            f"torch.distributed (gloo), {size} processes, load {os.getloadavg()[0]:.1f}; {SAMPLES} x {BATCH}"
        )
        _report("checked call", checked)
        _report("bound halo exchange (prepared)", prepared)
        _report("bound all-reduce out of place (not prepared)", unprepared)


if __name__ == "__main__":
    if sys.argv[1:] == ["mpi"]:
        run_mpi()
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import torch
        from _gloo import launch

        torch.set_num_threads(1)
        launch(_torch_main, 2, start_method="fork")
