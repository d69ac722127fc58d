"""The checked apply against the bound plan and native MPI, in the same run.

Run with 2 or 4 ranks::

    mpiexec -n 2 python benchmarks/bench_mpi_apply.py
    mpiexec -n 4 python benchmarks/bench_mpi_apply.py

``mpi_backend.apply(op, state, comm=...)`` checks every call collectively (a mismatched tree
fails on every rank with a typed error, never a hang); a bound plan
(``plan_for(op, comm).bind(state)``) checks once and then runs persistent requests. Timed,
interleaved sample by sample:

- the halo exchange of a 4096 x 4096 float64 array (grid 2 x 1 on 2 ranks, 2 x 2 and 4 x 1 on
  4; kernel 3 and 7, zero padding 1 and 3), forward and adjoint: ``apply(..., inplace=True)``
  against the bound plan, both on the same array (in place: both write the halos into the
  caller's array; neither copies the bulk; the bound plan uses requests made once at
  binding, apply checks every call collectively and then starts persistent requests it made
  on its first call with that array);
- 8 MB float64 all-reduce in place: ``apply(..., inplace=True)`` against the bound plan
  (persistent ``Allreduce_init``) and ``Allreduce(IN_PLACE)``, all three on the same array;
- 8 MB broadcast from rank 0: ``apply`` (new result blocks, as an out-of-place call must
  return) against the bound plan (result arrays built once, overwritten by each call) and
  ``Bcast`` into a preallocated buffer;
- 8 MB sum-reduce onto rank 0: ``apply`` (a new result block) against ``Allreduce`` into a
  preallocated array (and the bound plan).

``BENCH_N`` sets the halo exchange's array size (default 4096: messages of 32 KB at h=1 and 96 KB
at h=3 on 2 ranks; 256 gives 2-6 KB, where the check's collective is most of a call).

For the halo exchange a third line times a bare persistent ``Allreduce`` of the check's digest
followed by the bound plan: the floor of any application that checks every call collectively
before moving data (a halo exchange is itself a latency of a few microseconds, about one
small collective's). Each sample times a batch of calls; a sample's time is the maximum over
ranks; the table shows medians and the ratios apply / reference. Nothing is asserted about speed; results are checked
equal to the references first. The load average is printed with the figures.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from statistics import median

import numpy as np
from _timing import interleaved_over_ranks
from mpi4py import MPI

from linop.backends import mpi as mpi_backend
from linop.backends.mpi.check import DIGEST_LENGTH
from linop.collectives import AllReduce, BlockGrid, Broadcast
from linop.halo import HaloExchange
from linop.halo_geometry import Kernel, halo_geometry
from linop.partition import DistributedTensor, Partition

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size
N = int(os.environ.get("BENCH_N", "4096"))  # the halo exchange's array: N x N float64
COUNT = 1 << 20  # 8 MB of float64
GRIDS = {1: [(1, 1)], 2: [(2, 1)], 3: [(3, 1)], 4: [(2, 2), (4, 1)]}
SAMPLES = int(os.environ.get("BENCH_SAMPLES", "41"))


def bench(methods: dict[str, Callable[[], object]], batch: int) -> dict[str, float]:
    """Median over samples of the maximum over ranks of one call's time, methods interleaved."""
    samples = interleaved_over_ranks(methods, COMM, SAMPLES, batch, warmups=2)
    return {name: float(median(t)) for name, t in samples.items()}


def report(title: str, times: dict[str, float], pairs: list[tuple[str, str]], unit: str = "us") -> None:
    if RANK:
        return
    scale = 1e6 if unit == "us" else 1e3
    print(f"  {title}:")
    for name, value in times.items():
        print(f"    {name:34s} {value * scale:10.1f} {unit}")
    for name, reference in pairs:
        print(f"    ratio {name} / {reference}: {times[name] / times[reference]:.2f}x")


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


class CheckFloor:
    """A bare persistent ``Allreduce`` (maximum) of a vector the size of the entry check's common
    case (its digest, :data:`~linop.backends.mpi.check.DIGEST_LENGTH` words), then the bound
    plan: what any application that checks collectively before moving data costs at least (no
    Python around either)."""

    def __init__(self, bound: Callable[[], object]) -> None:
        self.bound = bound
        self.comm = COMM.Dup()
        self.send = np.zeros(DIGEST_LENGTH, dtype=np.int64)
        self.received = np.empty_like(self.send)
        self.request = self.comm.Allreduce_init(self.send, self.received, op=MPI.MAX)

    def __call__(self) -> None:
        self.request.Start()
        self.request.Wait()
        self.bound()

    def free(self) -> None:
        self.request.Free()
        self.comm.Free()


def halo(ok: list[bool]) -> None:
    for grid in GRIDS.get(SIZE, []):
        for h in (1, 3):
            tensor = DistributedTensor("x", (N, N), Partition(grid))
            op = HaloExchange(halo_geometry(tensor, Kernel(2 * h + 1, padding=h)))
            (block,) = [b for b in op.domain if b.worker == RANK]
            start = np.random.default_rng(RANK).standard_normal(block.shape)
            applied = {block.name: start.copy()}
            bound_state = {block.name: start.copy()}
            bound = mpi_backend.plan_for(op, comm=COMM).bind(bound_state)
            adjoint = mpi_backend.plan_for(op.H, comm=COMM).bind(bound_state)
            bound()
            mpi_backend.apply(op, applied, comm=COMM, inplace=True)
            adjoint()
            mpi_backend.apply(op.H, applied, comm=COMM, inplace=True)
            ok.append(bool(np.array_equal(applied[block.name], bound_state[block.name])))
            bound.free()
            adjoint.free()
            # timed on the same array (placement changes the time of a message)
            bound = mpi_backend.plan_for(op, comm=COMM).bind(applied)
            adjoint = mpi_backend.plan_for(op.H, comm=COMM).bind(applied)
            adjoint_op = op.H
            floors = CheckFloor(bound), CheckFloor(adjoint)
            before = load()
            forward, backward = (
                bench(
                    {
                        "bound plan": plan,
                        "apply (checked, in place)": lambda tree=tree, applied=applied: mpi_backend.apply(
                            tree, applied, comm=COMM, inplace=True
                        ),
                        "floor: check Allreduce + bound": floor,
                    },
                    batch=20,
                )
                for plan, tree, floor in ((bound, op, floors[0]), (adjoint, adjoint_op, floors[1]))
            )
            for floor in floors:
                floor.free()
            bound.free()
            adjoint.free()
            pair = [
                ("apply (checked, in place)", "bound plan"),
                ("floor: check Allreduce + bound", "bound plan"),
            ]
            report(f"halo {grid[0]}x{grid[1]} h={h} forward (load {before} -> {load()})", forward, pair)
            report(f"halo {grid[0]}x{grid[1]} h={h} adjoint", backward, pair)


def collectives(ok: list[bool]) -> None:
    rng = np.random.default_rng(RANK)
    # all-reduce in place
    layout = BlockGrid.uniform("a", Partition((SIZE,)), (COUNT,))
    all_reduce = AllReduce(layout, (0,))
    start = rng.standard_normal(COUNT) / SIZE
    mine, native = {f"a[{RANK}]": start.copy()}, start.copy()
    mpi_backend.apply(all_reduce, mine, comm=COMM, inplace=True)
    COMM.Allreduce(MPI.IN_PLACE, native)
    ok.append(bool(np.allclose(mine[f"a[{RANK}]"], native, rtol=1e-12, atol=1e-12)))
    # timed on one zero array (sums stay finite; placement changes the time of an 8 MB call)
    mine[f"a[{RANK}]"].fill(0)
    native = mine[f"a[{RANK}]"]
    bound = mpi_backend.plan_for(all_reduce, comm=COMM).bind(mine)
    before = load()
    times = bench(
        {
            "bound plan (persistent)": bound,
            "apply (checked, in place)": lambda: mpi_backend.apply(all_reduce, mine, comm=COMM, inplace=True),
            "Allreduce(IN_PLACE)": lambda: COMM.Allreduce(MPI.IN_PLACE, native),
        },
        batch=5,
    )
    bound.free()
    report(
        f"all-reduce 8 MB in place (load {before} -> {load()})",
        times,
        [
            ("apply (checked, in place)", "bound plan (persistent)"),
            ("apply (checked, in place)", "Allreduce(IN_PLACE)"),
        ],
        unit="ms",
    )
    # broadcast
    source = DistributedTensor("s", (COUNT,), Partition((1,)))
    broadcast = Broadcast(source, Partition((SIZE,)), "c")
    root_state = {"s[0]": rng.standard_normal(COUNT)} if RANK == 0 else {}
    buffer = root_state["s[0]"].copy() if RANK == 0 else np.empty(COUNT)
    COMM.Bcast(buffer, root=0)
    ok.append(bool(np.array_equal(mpi_backend.apply(broadcast, root_state, comm=COMM)[f"c[{RANK}]"], buffer)))
    bound_broadcast = mpi_backend.plan_for(broadcast, comm=COMM).bind(root_state)
    before = load()
    times = bench(
        {
            "bound plan (prebuilt results)": bound_broadcast,
            "apply (checked, new blocks)": lambda: mpi_backend.apply(broadcast, root_state, comm=COMM),
            "Bcast, preallocated": lambda: COMM.Bcast(buffer, root=0),
        },
        batch=5,
    )
    bound_broadcast.free()
    report(
        f"broadcast 8 MB (load {before} -> {load()})",
        times,
        [
            ("apply (checked, new blocks)", "bound plan (prebuilt results)"),
            ("apply (checked, new blocks)", "Bcast, preallocated"),
        ],
        unit="ms",
    )
    # sum-reduce
    reduce = broadcast.H
    copies = {f"c[{RANK}]": rng.standard_normal(COUNT)}
    total = np.empty(COUNT)
    COMM.Allreduce(copies[f"c[{RANK}]"], total)
    result = mpi_backend.apply(reduce, copies, comm=COMM)
    if RANK == 0:
        ok.append(bool(np.allclose(result["s[0]"], total, rtol=1e-12, atol=1e-12)))
    bound_reduce = mpi_backend.plan_for(reduce, comm=COMM).bind(copies)
    before = load()
    times = bench(
        {
            "bound plan (prebuilt result)": bound_reduce,
            "apply (checked, new block)": lambda: mpi_backend.apply(reduce, copies, comm=COMM),
            "Allreduce, preallocated": lambda: COMM.Allreduce(copies[f"c[{RANK}]"], total),
        },
        batch=5,
    )
    bound_reduce.free()
    report(
        f"sum-reduce 8 MB onto rank 0 (load {before} -> {load()})",
        times,
        [
            ("apply (checked, new block)", "Allreduce, preallocated"),
            ("apply (checked, new block)", "bound plan (prebuilt result)"),
        ],
        unit="ms",
    )


def main() -> int:
    if RANK == 0:
        print(
            f"checked apply vs bound plan on {SIZE} rank(s); median of {SAMPLES} samples, max over ranks; "
            f"load average (1, 5, 15 min) {load()}"
        )
    ok: list[bool] = []
    which = sys.argv[1:] or ["halo", "collectives"]
    if "halo" in which:
        halo(ok)
    if "collectives" in which:
        collectives(ok)
    same = COMM.allreduce(all(ok), op=MPI.LAND)
    if RANK == 0 and not same:
        print("  RESULTS DIFFER")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
