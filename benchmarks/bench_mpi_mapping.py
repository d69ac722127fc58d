"""Worker maps under MPI: 16 workers on 4 ranks against the same data one worker per rank.

Run with 4 ranks::

    mpiexec -n 4 python benchmarks/bench_mpi_mapping.py [--side 1024]

Each rank holds the same data in both layouts:

- ``halo``: a ``2s x 2s`` float64 global array with kernel 3, padding 1. Mapped: a 4 x 4 grid of
  workers, each rank holding a 2 x 2 square of them (``mapping=``; the halos between a rank's
  own workers are local copies); one worker per rank: a 2 x 2 grid. The rank boundaries, and so
  the bytes sent between ranks, are the same.
- ``all-reduce``: every block summed over the whole grid. Mapped: 16 workers of ``s/2 x s/2``
  blocks, four per rank (a rank's workers sum locally first, then one ``Allreduce`` of an
  ``s/2 x s/2`` block over the ranks, and the sum is copied into the four); one worker per
  rank: 4 workers of ``s x s`` blocks, the same entries per rank, reduced over the 4 ranks (no
  map): one ``Allreduce`` of four times the entries. (Before 2026-12-03 this side held
  ``s x s/2``, half the mapped rank's entries.)
- ``broadcast`` and ``sum-reduce``: an ``s/2 x s/2`` block on worker 0 copied to (or summed
  from) 16 workers, four per rank (``WorkerMap.blocked``: the rank receives the block with one
  ``Bcast`` and fills its four copies, or sums its four copies before one ``Allreduce``);
  one worker per rank: the same block to (from) 4 workers. The bytes between ranks are the
  same; the mapped rank also makes three local copies (adds) of the block, which its layout
  asks for. The ``p2p`` column is the mapped tree run as its point-to-point expansion (how
  a map ran these before the native path), its ratio against the native mapped run.

Both run as bound plans (``plan_for(op, mapping=...).bind(local)``), interleaved sample by
sample; a sample's time is the maximum over ranks; the table shows medians and the ratio
mapped / one worker per rank. Results are checked equal to the numpy interpreter first.
Nothing is asserted about speed.
"""

from __future__ import annotations

import argparse
from statistics import median

import numpy as np
from _timing import interleaved_over_ranks
from mpi4py import MPI

from linop import (
    AllReduce,
    BlockGrid,
    Broadcast,
    DistributedTensor,
    HaloExchange,
    Kernel,
    Partition,
    SumReduce,
    halo_geometry,
)
from linop.backends import mpi as mpi_backend
from linop.program import WorkerMap
from linop.program import lowering_rooted as rooted

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size


def squares_map() -> WorkerMap:
    """Worker (i, j) of a 4 x 4 grid on rank (i // 2) * 2 + j // 2: a 2 x 2 square per rank."""
    return WorkerMap([(w // 4 // 2) * 2 + (w % 4) // 2 for w in range(16)])


def bound(op, mapping):
    state = op.domain.random(1)
    mine = mapping.workers_on(RANK) if mapping is not None else (RANK,)
    local = {b.name: state[b.name] for b in op.domain if b.worker in mine}
    plan = mpi_backend.plan_for(op, comm=COMM, mapping=mapping)
    expected = op(state)
    got = plan.bind({k: v.copy() for k, v in local.items()})()
    for name, array in got.items():
        assert np.allclose(array, expected[name]), name
    return plan.bind(local)


def cases(side: int):
    mapping = squares_map()
    kernel = Kernel(3, padding=1)
    halo_mapped = HaloExchange(
        halo_geometry(DistributedTensor("x", (2 * side, 2 * side), Partition((4, 4))), kernel)
    )
    halo_plain = HaloExchange(
        halo_geometry(DistributedTensor("x", (2 * side, 2 * side), Partition((2, 2))), kernel)
    )
    half = side // 2
    reduce_mapped = AllReduce(BlockGrid.uniform("a", Partition((4, 4)), (half, half)), (0, 1))
    reduce_plain = AllReduce(BlockGrid.uniform("a", Partition((4,)), (side, side)), (0,))
    blocked = WorkerMap.blocked(16, SIZE)

    def rooted_case(kind, workers, name="c"):
        root = DistributedTensor("r", (half, half), Partition((1, 1)))
        return kind(root, Partition((workers, 1)), name)

    return {
        "halo exchange": (bound(halo_mapped, mapping), bound(halo_plain, None), None),
        "halo adjoint": (bound(halo_mapped.H, mapping), bound(halo_plain.H, None), None),
        "all-reduce": (bound(reduce_mapped, mapping), bound(reduce_plain, None), None),
        "broadcast": (
            bound(rooted_case(Broadcast, 16), blocked),
            bound(rooted_case(Broadcast, 4), None),
            point_to_point(lambda: bound(rooted_case(Broadcast, 16, "p"), blocked)),
        ),
        "sum-reduce": (
            bound(rooted_case(SumReduce, 16), blocked),
            bound(rooted_case(SumReduce, 4), None),
            point_to_point(lambda: bound(rooted_case(SumReduce, 16, "p"), blocked)),
        ),
    }


def point_to_point(build):
    """``build()`` with the native broadcast and sum-reduce under a map switched off (their
    lowering then declines, and the tree runs its point-to-point expansion), for comparison;
    the tree must differ from the native run's (another name), which the plan cache keeps."""
    runner = rooted._MappedRootedRunner
    native = runner.project_mapped
    del runner.project_mapped
    try:
        return build()
    finally:
        runner.project_mapped = native


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--side", type=int, default=1024, help="a rank's share is side x side entries")
    parser.add_argument("--samples", type=int, default=15)
    args = parser.parse_args()
    if SIZE != 4:
        raise SystemExit("run with 4 ranks: mpiexec -n 4 python benchmarks/bench_mpi_mapping.py")
    if RANK == 0:
        print(
            f"16 workers on 4 ranks (mapping=) against 4 workers, one per rank; {args.side}^2 float64 per rank"
        )
        print(
            f"{'case':16s} {'mapped':>12s} {'one per rank':>14s} {'ratio':>8s} {'p2p':>12s} {'p2p/mapped':>11s}"
        )
    for name, (mapped, plain, p2p) in cases(args.side).items():
        runs = {"mapped": mapped, "plain": plain} | ({"p2p": p2p} if p2p is not None else {})
        times = interleaved_over_ranks(runs, COMM, args.samples, 5)
        ratio = median(times["mapped"] / times["plain"])
        extra = ""
        if p2p is not None:
            extra = f" {median(times['p2p']) * 1e3:10.3f}ms {median(times['p2p'] / times['mapped']):10.2f}x"
        if RANK == 0:
            print(
                f"{name:16s} {median(times['mapped']) * 1e3:10.3f}ms {median(times['plain']) * 1e3:12.3f}ms "
                f"{ratio:8.2f}x{extra}",
                flush=True,
            )
        for run in runs.values():
            run.free()


if __name__ == "__main__":
    main()
