"""The per-call cost of bound plans: small exchanges and collectives, against mpi4py, in one run.

Run with 1 or 4 ranks::

    mpiexec -n 1 python benchmarks/bench_mpi_bound.py
    mpiexec -n 4 python benchmarks/bench_mpi_bound.py

At these sizes the data moves in a few microseconds, so what a call costs beyond the
hand-written line is the Python around the MPI calls. Timed, interleaved sample by sample (a
sample: a batch of calls, its time the maximum over ranks; the best and the median sample are
printed, with the difference and ratio to the hand-written call):

- a halo exchange in place (64 x 64 float64 per rank, kernel 3, zero padding 1, 2 x 2 or
  ranks x 1 grid): ``plan_for(op).bind(state)`` against hand-written persistent requests on
  subarray datatypes (``Startall`` / ``Waitall``);
- halo windows out of place (:func:`linop.halo_windows`: the block copied into a window with
  room for its halo, then the exchange): the bound plan against numpy + persistent requests
  into a preallocated window;
- an all-reduce in place of 64 float64 per rank: the bound plan against ``Allreduce_init``;
- a broadcast of 64 float64 from rank 0 (out of place): the bound plan against ``Bcast`` into
  a preallocated buffer.

Where the time goes: for each bound plan, its prepared calls (``BoundPlan._calls``, see
:mod:`linop.backends.mpi.compiled`) are timed one by one with ``time.perf_counter_ns`` on rank 0
and printed with the loop's own share (the call's total minus the calls'). With
``BENCH_PROFILE=1`` rank 0 also prints a cProfile of 1000 calls of each. Results are checked
equal to the hand-written ones first. Nothing is asserted about speed.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import sys
import time
from statistics import median

import numpy as np
from _timing import interleaved_over_ranks
from mpi4py import MPI

from linop import halo_windows
from linop.backends import mpi as mpi_backend
from linop.collectives import AllReduce, BlockGrid, Broadcast
from linop.halo import HaloExchange
from linop.halo_geometry import Kernel, halo_geometry
from linop.partition import DistributedTensor, Partition

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size
N = 64
SAMPLES = int(os.environ.get("BENCH_SAMPLES", "31"))
BATCH = 200
GRID = (2, 2) if SIZE == 4 else (SIZE, 1)


def load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:  # pragma: no cover
        return "unknown"


class HandHalo:
    """The nested in-place halo exchange of a 2-d grid (h = 1) with persistent requests on
    subarray datatypes; ``window``: the block is first copied into the interior of ``out``."""

    def __init__(self, local: np.ndarray, grid: tuple[int, int], *, source: np.ndarray | None = None) -> None:
        self.local, self.source = local, source
        i, j = divmod(RANK, grid[1])
        self.types: list[MPI.Datatype] = []
        self.phases: list[list[MPI.Prequest]] = []
        rows, cols = local.shape
        for axis, (index, count) in enumerate(((i, grid[0]), (j, grid[1]))):
            requests = []
            for step, halo, edge in ((-1, 0, 1), (1, -1, -2)):
                k = index + step
                if not 0 <= k < count:
                    continue
                peer = (k * grid[1] + j) if axis == 0 else (i * grid[1] + k)
                n = (rows, cols)[axis]
                halo_box = self._box(axis, halo % n)
                edge_box = self._box(axis, edge % n)
                requests.append(COMM.Recv_init([local, 1, self._type(halo_box)], peer, 10 + axis))
                requests.append(COMM.Send_init([local, 1, self._type(edge_box)], peer, 10 + axis))
            self.phases.append(requests)

    def _box(self, axis: int, at: int) -> tuple[list[int], list[int]]:
        rows, cols = self.local.shape
        if axis == 0:  # a row over the bulk columns (1 .. cols - 2)
            return [1, cols - 2], [at, 1]
        return [rows, 1], [0, at]  # a column over every row (halo rows filled first)

    def _type(self, box: tuple[list[int], list[int]]) -> MPI.Datatype:
        sizes, starts = box
        datatype = MPI.DOUBLE.Create_subarray(list(self.local.shape), sizes, starts).Commit()
        self.types.append(datatype)
        return datatype

    def __call__(self) -> None:
        if self.source is not None:
            self.local.fill(0)
            self.local[1:-1, 1:-1] = self.source
        for requests in self.phases:
            if requests:
                MPI.Prequest.Startall(requests)
                MPI.Request.Waitall(requests)

    def free(self) -> None:
        for requests in self.phases:
            for request in requests:
                request.Free()
        for datatype in self.types:
            datatype.Free()


def breakdown(name: str, bound) -> None:
    """Rank 0: each prepared call's mean time, and the loop's own share."""
    calls = getattr(bound, "_calls", None)
    if calls is None:
        if RANK == 0:
            print(f"    {name}: not compiled (no prepared calls)")
        return
    totals = [0] * len(calls)
    repeats = 500
    COMM.Barrier()
    whole = time.perf_counter_ns()
    for _ in range(repeats):
        bound()
    whole = (time.perf_counter_ns() - whole) / repeats
    COMM.Barrier()
    for _ in range(repeats):
        for k, (function, arguments) in enumerate(calls):
            start = time.perf_counter_ns()
            function(*arguments)
            totals[k] += time.perf_counter_ns() - start
    if RANK == 0:
        print(f"    {name}: {len(calls)} prepared calls, a whole call {whole / 1e3:.2f} us:")
        for (function, _), total in zip(calls, totals):
            label = getattr(function, "__qualname__", None) or getattr(function, "func", function).__name__
            print(f"      {label:28s} {total / repeats / 1e3:8.2f} us")
        print(f"      {'(the loop and the call)':28s} {(whole - sum(totals) / repeats) / 1e3:8.2f} us")


def profile(name: str, function) -> None:
    if os.environ.get("BENCH_PROFILE") != "1":
        return
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(1000):
        function()
    profiler.disable()
    if RANK == 0:
        print(f"  cProfile of 1000 calls of {name}:")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(8)


def report(title: str, times: dict[str, np.ndarray], reference: str) -> None:
    if RANK:
        return
    print(f"  {title}:")
    best = float(times[reference].min())
    for name, t in times.items():
        extra = "" if name == reference else f"   +{(t.min() - best) * 1e6:6.2f} us, {t.min() / best:5.2f}x"
        print(f"    {name:16s} best {t.min() * 1e6:8.2f} us  median {median(t) * 1e6:8.2f} us{extra}")


def main() -> int:
    if RANK == 0:
        print(f"per-call cost of bound plans on {SIZE} rank(s), load average {load()}")
    tensor = DistributedTensor("x", (N * GRID[0], N * GRID[1]), Partition(GRID))
    geometry = halo_geometry(tensor, Kernel(3, padding=1))
    ok = True
    failed: list[str] = []

    # halo exchange in place
    op = HaloExchange(geometry)
    (block,) = [b for b in op.domain if b.worker == RANK]
    start = np.zeros(block.shape)  # the bulk random, the halo and padding rows and columns zero
    start[1:-1, 1:-1] = np.random.default_rng(RANK).standard_normal((block.shape[0] - 2, block.shape[1] - 2))
    ours, theirs = start.copy(), start.copy()
    bound = mpi_backend.plan_for(op, comm=COMM).bind({block.name: ours})
    hand = HandHalo(theirs, GRID)
    bound(), hand()
    ok &= bool(np.array_equal(ours, theirs)) or bool(failed.append("halo exchange"))
    times = interleaved_over_ranks({"linop bound": bound, "hand persistent": hand}, COMM, SAMPLES, BATCH)
    report(f"halo exchange in place, {block.shape} float64 per rank", times, "hand persistent")
    breakdown("the bound exchange", bound)
    profile("the bound exchange", bound)
    bound.free()
    hand.free()

    # halo windows out of place
    windows = halo_windows(tensor, Kernel(3, padding=1))
    (xb,) = [b for b in windows.domain if b.worker == RANK]
    (wb,) = [b for b in windows.range if b.worker == RANK]
    strip = np.random.default_rng(RANK).standard_normal(xb.shape)
    bound = mpi_backend.plan_for(windows, comm=COMM).bind({xb.name: strip})
    window = np.zeros(wb.shape)
    hand = HandHalo(window, GRID, source=strip)
    result = bound()[wb.name]
    hand()
    ok &= bool(np.array_equal(result, window)) or bool(failed.append("windows"))
    times = interleaved_over_ranks({"linop bound": bound, "hand persistent": hand}, COMM, SAMPLES, BATCH)
    report(f"halo windows out of place, {xb.shape} -> {wb.shape} float64", times, "hand persistent")
    breakdown("the bound windows", bound)
    profile("the bound windows", bound)
    bound.free()
    hand.free()

    # all-reduce in place
    layout = BlockGrid.uniform("a", Partition((SIZE,)), (64,))
    all_reduce = AllReduce(layout, (0,))
    (ab,) = [b for b in all_reduce.domain if b.worker == RANK]
    values = np.arange(64, dtype=np.float64) + RANK
    ours, theirs = values.copy(), values.copy()
    bound = mpi_backend.plan_for(all_reduce, comm=COMM).bind({ab.name: ours})
    request = COMM.Allreduce_init(MPI.IN_PLACE, theirs, op=MPI.SUM)

    def native() -> None:
        request.Start()
        request.Wait()

    bound(), native()
    ok &= bool(np.array_equal(ours, theirs)) or bool(failed.append("all-reduce"))
    times = interleaved_over_ranks({"linop bound": bound, "Allreduce_init": native}, COMM, SAMPLES, BATCH)
    report("all-reduce in place, 64 float64", times, "Allreduce_init")
    breakdown("the bound all-reduce", bound)
    profile("the bound all-reduce", bound)
    bound.free()
    request.Free()

    # broadcast out of place
    broadcast = Broadcast(DistributedTensor("s", (64,), Partition((1,))), Partition((SIZE,)), "c")
    local = {b.name: np.arange(64, dtype=np.float64) for b in broadcast.domain if b.worker == RANK}
    bound = mpi_backend.plan_for(broadcast, comm=COMM).bind(local)
    buffer = local[next(iter(local))].copy() if local else np.empty(64)

    def bcast() -> None:
        COMM.Bcast(buffer, root=0)

    result = bound()
    bcast()
    ok &= all(np.array_equal(v, buffer) for v in result.values()) or bool(failed.append("broadcast"))
    times = interleaved_over_ranks({"linop bound": bound, "Bcast": bcast}, COMM, SAMPLES, BATCH)
    report("broadcast from rank 0, 64 float64", times, "Bcast")
    breakdown("the bound broadcast", bound)
    profile("the bound broadcast", bound)
    bound.free()

    if not COMM.allreduce(ok, op=MPI.LAND):
        failures = COMM.allgather(failed)
        if RANK == 0:
            print(f"bench_mpi_bound: results DIFFER from the hand-written calls: {failures}")
        return 1
    if RANK == 0:
        print(f"load average after: {load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
