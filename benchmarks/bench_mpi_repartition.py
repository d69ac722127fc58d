"""MPI repartition benchmark: linop's bound repartition against hand-written mpi4py, in one run.

Run with 4 ranks (2 work too)::

    mpiexec -n 4 python benchmarks/bench_mpi_repartition.py

An N x N float32 array moves from one grid of blocks to another (rows to columns, rows to a
2 x 2 grid, a 2 x 2 grid to rows). Timed, interleaved sample by sample:

- ``linop auto``: ``plan_for(Repartition(x, y)).bind(state)``: checked once, then the all-to-all
  its plan chose (:func:`linop.backends.mpi.native.all_to_all.alltoall_strategy`, printed);
- ``linop packed`` / ``linop subarray``: the same, bound with the choice forced
  (``all_to_all.ALLTOALL_STRATEGY``);
- ``hand packed``: hand-written mpi4py: every box copied into one send buffer, one
  ``Alltoallv``, every box copied out of one receive buffer (buffers preallocated);
- ``hand subarray``: hand-written mpi4py: one ``Alltoallw`` with a subarray datatype per box,
  straight between the blocks.

Each sample times a batch of calls; a sample's time is the maximum over ranks; the table shows
the best and the median sample, and ratios over ``hand packed``. The load average is printed
with the figures. Every result is checked equal to the hand-written one first (integer values
in float32, exact). Nothing is asserted about speed.
"""

from __future__ import annotations

import os
import sys
from statistics import median

import numpy as np
from _timing import interleaved_over_ranks
from mpi4py import MPI

from linop.backends import mpi as mpi_backend
from linop.backends.mpi.native import all_to_all
from linop.partition import DistributedTensor, Partition
from linop.repartition import Repartition

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size
SIZES = [int(n) for n in os.environ.get("BENCH_SIZES", "1024 4096").split()]
SAMPLES = int(os.environ.get("BENCH_SAMPLES", "21"))
LAYOUTS = {
    4: [((4, 1), (1, 4)), ((4, 1), (2, 2)), ((2, 2), (4, 1))],
    2: [((2, 1), (1, 2))],
}


# -- hand-written (independent of linop) ----------------------------------------------------------
def bounds(n: int, parts: int, k: int) -> tuple[int, int]:
    """Rows (or columns) of part ``k`` of ``n`` cut into ``parts`` near-equal parts."""
    base, extra = divmod(n, parts)
    start = k * base + min(k, extra)
    return start, start + base + (k < extra)


def box_of(n: int, grid: tuple[int, int], rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The global rows and columns of ``rank``'s block (C order of the grid)."""
    i, j = divmod(rank, grid[1])
    return bounds(n, grid[0], i), bounds(n, grid[1], j)


def overlaps(n: int, mine: tuple[int, int], grid: tuple[int, int], rank: int, other: tuple[int, int]):
    """Per peer: the overlap of ``rank``'s block in ``mine`` with the peer's block in ``other``,
    as slices local to ``rank``'s block (None where they do not meet)."""
    (r0, r1), (c0, c1) = box_of(n, mine, rank)
    result = []
    for peer in range(SIZE):
        (s0, s1), (d0, d1) = box_of(n, other, peer)
        a, b, c, d = max(r0, s0), min(r1, s1), max(c0, d0), min(c1, d1)
        result.append((slice(a - r0, b - r0), slice(c - c0, d - c0)) if a < b and c < d else None)
    return result


class HandPacked:
    """Pack every box into one buffer, ``Alltoallv``, unpack every box."""

    def __init__(self, source: np.ndarray, target: np.ndarray, n: int, old, new) -> None:
        self.source, self.target = source, target
        self.sends = overlaps(n, old, new, RANK, new)
        self.receives = overlaps(n, new, old, RANK, old)
        self.send_buffer, self.send_spec, self.send_views = self._side(self.sends, source)
        self.receive_buffer, self.receive_spec, self.receive_views = self._side(self.receives, target)

    @staticmethod
    def _side(boxes, block):
        counts = [0 if b is None else block[b].size for b in boxes]
        displacements = list(np.cumsum([0, *counts[:-1]]))
        buffer = np.empty(sum(counts), dtype=block.dtype)
        views = [
            (block[b], buffer[d : d + c].reshape(block[b].shape))
            for b, c, d in zip(boxes, counts, displacements)
            if b is not None
        ]
        return buffer, (counts, [int(d) for d in displacements]), views

    def __call__(self) -> None:
        for block_view, packed in self.send_views:
            np.copyto(packed, block_view)
        COMM.Alltoallv(
            [self.send_buffer, self.send_spec, MPI.FLOAT], [self.receive_buffer, self.receive_spec, MPI.FLOAT]
        )
        for block_view, packed in self.receive_views:
            np.copyto(block_view, packed)


class HandSubarray:
    """One ``Alltoallw`` with a subarray datatype per box."""

    def __init__(self, source: np.ndarray, target: np.ndarray, n: int, old, new) -> None:
        self.source, self.target = source, target
        self.types: list[MPI.Datatype] = []
        self.send = self._side(overlaps(n, old, new, RANK, new), source)
        self.receive = self._side(overlaps(n, new, old, RANK, old), target)

    def _side(self, boxes, block):
        counts, types = [], []
        for b in boxes:
            if b is None:
                counts.append(0)
                types.append(MPI.FLOAT)
                continue
            datatype = MPI.FLOAT.Create_subarray(
                list(block.shape), [s.stop - s.start for s in b], [s.start for s in b]
            ).Commit()
            self.types.append(datatype)
            counts.append(1)
            types.append(datatype)
        return [block, (counts, [0] * SIZE), types]

    def __call__(self) -> None:
        COMM.Alltoallw(self.send, self.receive)

    def free(self) -> None:
        for datatype in self.types:
            datatype.Free()


# -- the benchmark ------------------------------------------------------------------------------
def load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:  # pragma: no cover
        return "unknown"


def bound_with(plan, state, strategy: str):
    old = all_to_all.ALLTOALL_STRATEGY
    all_to_all.ALLTOALL_STRATEGY = strategy
    try:
        return plan.bind(state)
    finally:
        all_to_all.ALLTOALL_STRATEGY = old


def main() -> int:
    if RANK == 0:
        print(f"repartition of an N x N float32 array on {SIZE} ranks; load average {load()}")
        print("  best / median of samples (max over ranks), ratio of the best over hand packed's")
    for n in SIZES:
        for old, new in LAYOUTS.get(SIZE, []):
            x = DistributedTensor("x", (n, n), Partition(old))
            y = DistributedTensor("y", (n, n), Partition(new))
            op = Repartition(x, y)
            (xb,) = [b for b in op.domain if b.worker == RANK]
            (yb,) = [b for b in op.range if b.worker == RANK]
            (r0, r1), (c0, c1) = box_of(n, old, RANK)
            values = (np.arange(n * n, dtype=np.int64).reshape(n, n) % 65521).astype(np.float32)
            source = values[r0:r1, c0:c1].copy()
            plan = mpi_backend.plan_for(op, comm=COMM)
            bounds_ = {s: bound_with(plan, {xb.name: source}, s) for s in ("auto", "packed", "subarray")}
            hand_targets = {k: np.zeros(yb.shape, np.float32) for k in ("packed", "subarray")}
            packed = HandPacked(source, hand_targets["packed"], n, old, new)
            subarray = HandSubarray(source, hand_targets["subarray"], n, old, new)
            packed()
            subarray()
            (t0, t1), (u0, u1) = box_of(n, new, RANK)
            expected = values[t0:t1, u0:u1]
            same = all(np.array_equal(t, expected) for t in hand_targets.values())
            same &= all(np.array_equal(b()[yb.name], expected) for b in bounds_.values())
            if not COMM.allreduce(same, op=MPI.LAND):
                if RANK == 0:
                    print(f"  {old} -> {new}: results DIFFER")
                return 1
            methods = {f"linop {s}": b for s, b in bounds_.items()}
            methods |= {"hand packed": packed, "hand subarray": subarray}
            batch = max(1, (1 << 24) // (n * n))
            times = interleaved_over_ranks(methods, COMM, SAMPLES, batch)
            if RANK == 0:
                chosen = [s.strategy for s in plan.schedule if hasattr(s, "strategy")]
                reference = float(times["hand packed"].min())
                print(f"  N={n} {old} -> {new} (linop auto chose {chosen}):")
                for name, t in times.items():
                    print(
                        f"    {name:14s} {t.min() * 1e3:8.3f} ms {median(t) * 1e3:8.3f} ms"
                        f"   {t.min() / reference:5.2f}x"
                    )
            for b in bounds_.values():
                b.free()
            subarray.free()
    if RANK == 0:
        print(f"load average after: {load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
