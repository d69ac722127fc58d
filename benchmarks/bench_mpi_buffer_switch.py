"""What a large MPI call costs right after calls on other buffers: the order effect behind the
collectives benchmark's warm-ups (``benchmarks/bench_mpi_collectives.py``).

Run: ``mpiexec -n 2 python benchmarks/bench_mpi_buffer_switch.py [entries] [samples]``
(default 1M float64 entries, 8 MB; 31 samples).

Each sample times, for linop's bound broadcast (a persistent ``Bcast_init`` on its own arrays)
and for a blocking ``Bcast`` as bytes on a buffer of the benchmark's:

- a batch of 5 calls right after 5 ``Bcast`` calls on another buffer ("after other buffers"),
- the next batch of 5, right after the first ("after itself"),
- the same switch again with the call's buffer (the root's source included) first read by numpy
  on every rank ("after other buffers, read"), or rewritten with its own values ("after other
  buffers, written").

It prints the medians over samples (each the maximum over ranks) and the median over samples of
the ratio to "after itself". Here (the loaded 2-core machine, mpich wheel) the first two or three
calls after a switch were slower, for linop and the native call alike (1.17-1.59x); rewriting the
buffers with numpy first took most of it away (1.02-1.36x), reading them less reliably
(1.03-1.46x): the buffers' memory gone cold while other buffers were used, nothing of linop's
(``benchmarks/results/mpi_collectives_order_2026-12-06.txt``). A timed row that follows
rows on other buffers pays it, one that follows its own buffers does not.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

from linop.backends import mpi as mpi_backend
from linop.collectives import Broadcast
from linop.partition import DistributedTensor, Partition

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size
COUNT = int(sys.argv[1]) if len(sys.argv) > 1 else 1 << 20
SAMPLES = int(sys.argv[2]) if len(sys.argv) > 2 else 31
BATCH = 5


def batch(function: Callable[[], object]) -> float:
    """One call's time, the mean of a batch started after a barrier."""
    COMM.Barrier()
    start = time.perf_counter()
    for _ in range(BATCH):
        function()
    return (time.perf_counter() - start) / BATCH


def main() -> int:
    source = DistributedTensor("s", (COUNT,), Partition((1,)))
    broadcast = Broadcast(source, Partition((SIZE,)), "c")
    state = {"s[0]": np.random.default_rng(0).standard_normal(COUNT)} if RANK == 0 else {}
    bound = mpi_backend.plan_for(broadcast, comm=COMM).bind(state)
    outputs = bound()
    linop_memory = state["s[0]"] if RANK == 0 else outputs[f"c[{RANK}]"]
    mine = np.random.default_rng(1).standard_normal(COUNT)
    other = np.random.default_rng(2).standard_normal(COUNT)
    rows: dict[str, tuple[Callable[[], object], np.ndarray]] = {
        "linop bound": (bound, linop_memory),
        "Bcast as bytes": (lambda: COMM.Bcast([mine, mine.nbytes, MPI.BYTE], root=0), mine),
    }
    cases = (
        "after other buffers",
        "after itself",
        "after other buffers, read",
        "after other buffers, written",
    )
    times = {(row, case): np.empty(SAMPLES) for row in rows for case in cases}
    for sample in range(SAMPLES):
        for row, (function, memory) in rows.items():
            for case in (cases[0], cases[2], cases[3]):
                for _ in range(BATCH):
                    COMM.Bcast([other, other.nbytes, MPI.BYTE], root=0)
                if case == cases[2]:
                    memory.sum()
                elif case == cases[3]:
                    np.copyto(memory, memory + 0.0)
                times[row, case][sample] = batch(function)
                if case == cases[0]:
                    times[row, cases[1]][sample] = batch(function)
    for values in times.values():
        COMM.Allreduce(MPI.IN_PLACE, values, op=MPI.MAX)
    if RANK == 0:
        print(f"{COUNT * 8 / 2**20:.0f} MB broadcast on {SIZE} rank(s): {SAMPLES} samples x {BATCH} calls")
        for row in rows:
            for case in cases:
                values = times[row, case]
                ratio = float(np.median(values / times[row, cases[1]]))
                print(f"  {row:15s} {case:30s} {np.median(values) * 1e3:8.3f} ms   ratio {ratio:5.2f}x")
    bound.free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
