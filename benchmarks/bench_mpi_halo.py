"""MPI halo-exchange benchmark: linop's in-place exchange against hand-written mpi4py.

Run with 2 or 4 ranks::

    mpiexec -n 2 python benchmarks/bench_mpi_halo.py
    mpiexec -n 4 python benchmarks/bench_mpi_halo.py

A 4096 x 4096 float64 global array is cut over a 2 x 1 grid (2 ranks) or 2 x 2 and 4 x 1 grids
(4 ranks); each rank holds its block with room for its halo (kernel 2h + 1, zero padding h,
halo widths h = 1 and 3). Timed, in the same run and interleaved sample by sample:

- ``linop bound``: ``plan_for(HaloExchange(...)).bind(local)``: checked once, then persistent
  requests on the caller's arrays (subarray datatypes, nothing packed, nothing copied);
- ``linop apply``: ``mpi_backend.apply(op, local, inplace=True)``: the collective safety check
  (one small Allreduce) and the schedule on every call;
- ``hand packed``: hand-written mpi4py, strips packed into preallocated buffers, Irecv/Isend;
- ``hand subarray``: hand-written mpi4py with persistent requests on subarray datatypes;
- pylops-mpi's ``MPIHalo`` (and ``DistributedArray.add_ghost_cells`` on 1-d grids) when the
  package is importable (it copies each rank's whole block into a new array on every call).

Each sample times a batch of calls; a sample's time is the maximum over ranks; the table shows
medians. Ratios are linop over the *fastest* hand-written exchange of the same run. The adjoint
(halos sent back and added into their owners' bulk) is timed the same way. Nothing is asserted
about speed; the results are checked equal to the hand-written exchange before timing.
"""

from __future__ import annotations

import os
import sys
from statistics import median

import numpy as np
from _timing import interleaved_over_ranks
from mpi4py import MPI

from linop.backends import mpi as mpi_backend
from linop.halo import HaloExchange
from linop.halo_geometry import Kernel, halo_geometry
from linop.partition import DistributedTensor, Partition

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size
N = int(os.environ.get("BENCH_N", "4096"))
"""The global size (``BENCH_N=1024``: on 2 x 2, rows of 4 KB, the smallest messages the checked
apply is meant to stay within 1.5x of mpi4py for)."""
GRIDS = {1: [(1, 1)], 2: [(2, 1)], 3: [(3, 1)], 4: [(2, 2), (4, 1)]}
SAMPLES = 41
BATCH = 10


def bench(methods: dict, samples: int = SAMPLES, batch: int = BATCH) -> dict[str, float]:
    """Median over samples of the maximum over ranks of one call's time, methods interleaved."""
    return {name: median(t) for name, t in interleaved_over_ranks(methods, COMM, samples, batch).items()}


# -- hand-written exchanges (independent of linop) --------------------------------------------
class HandExchange:
    """The nested halo exchange of a 2-d grid written directly with mpi4py.

    Dimension 0 first: the bulk's first/last h rows (bulk columns) go to the neighbours' halo
    rows; then dimension 1: the bulk's first/last h columns, over every row that holds data
    (bulk and the halo rows just filled), go to the neighbours' halo columns. Corners arrive in
    two hops, exactly as in linop's nested exchange.
    """

    def __init__(self, local: np.ndarray, grid: tuple[int, int], h: int, *, subarray: bool) -> None:
        self.local, self.h = local, h
        p0, p1 = grid
        i, j = divmod(RANK, p1)
        n0, n1 = local.shape[0] - 2 * h, local.shape[1] - 2 * h
        bulk_cols = slice(h, h + n1)
        rows = slice(h if i == 0 else 0, n0 + h if i == p0 - 1 else n0 + 2 * h)
        self.stages = []
        # (peer, send box, receive box) per neighbour, per dimension
        dim0 = []
        if i > 0:
            dim0.append(((i - 1) * p1 + j, (slice(h, 2 * h), bulk_cols), (slice(0, h), bulk_cols)))
        if i < p0 - 1:
            dim0.append(
                ((i + 1) * p1 + j, (slice(n0, n0 + h), bulk_cols), (slice(n0 + h, n0 + 2 * h), bulk_cols))
            )
        dim1 = []
        if j > 0:
            dim1.append((i * p1 + j - 1, (rows, slice(h, 2 * h)), (rows, slice(0, h))))
        if j < p1 - 1:
            dim1.append((i * p1 + j + 1, (rows, slice(n1, n1 + h)), (rows, slice(n1 + h, n1 + 2 * h))))
        self.stages = [s for s in (dim0, dim1) if s]
        self.subarray = subarray
        self._build()

    def _build(self) -> None:
        local = self.local
        self.forward, self.backward = [], []
        for stage in self.stages:
            if self.subarray:
                fw, bw = [], []
                for peer, send, recv in stage:
                    fw.append(COMM.Recv_init([local, 1, _subarray(local, recv)], peer, 0))
                    fw.append(COMM.Send_init([local, 1, _subarray(local, send)], peer, 0))
                    buffer = np.empty(local[send].shape)
                    bw.append((COMM.Recv_init(buffer, peer, 1), local[send], buffer))
                    bw.append(
                        (COMM.Send_init([local, 1, _subarray(local, recv)], peer, 1), local[recv], None)
                    )
                self.forward.append(fw)
                self.backward.append(bw)
            else:
                items = [
                    (peer, local[send], local[recv], np.empty(local[send].shape), np.empty(local[recv].shape))
                    for peer, send, recv in stage
                ]
                self.forward.append(items)
                self.backward.append(items)

    def free(self) -> None:
        if self.subarray:
            for stage in self.forward:
                for request in stage:
                    request.Free()
            for stage in self.backward:
                for request, _, _ in stage:
                    request.Free()

    def __call__(self) -> None:
        for stage in self.forward:
            if self.subarray:
                MPI.Prequest.Startall(stage)
                MPI.Request.Waitall(stage)
                continue
            requests = []
            for peer, _, _, _, into in stage:
                requests.append(COMM.Irecv(into, peer, 0))
            for peer, send_view, _, out, _ in stage:
                np.copyto(out, send_view)
                requests.append(COMM.Isend(out, peer, 0))
            MPI.Request.Waitall(requests)
            for _, _, recv_view, _, into in stage:
                np.copyto(recv_view, into)

    def adjoint(self) -> None:
        for stage in reversed(self.backward):
            if self.subarray:
                requests = [r for r, _, _ in stage]
                MPI.Prequest.Startall(requests)
                MPI.Request.Waitall(requests)
                for _, view, buffer in stage:
                    if buffer is not None:
                        np.add(view, buffer, out=view)
                for _, view, buffer in stage:
                    if buffer is None:
                        view.fill(0)
                continue
            requests = []
            for peer, _, _, into, _ in stage:  # the neighbour's halo comes back into our edge
                requests.append(COMM.Irecv(into, peer, 0))
            for peer, _, recv_view, _, out in stage:
                np.copyto(out, recv_view)
                requests.append(COMM.Isend(out, peer, 0))
            MPI.Request.Waitall(requests)
            for _, send_view, recv_view, into, _ in stage:
                np.add(send_view, into, out=send_view)
                recv_view.fill(0)


_TYPES: dict = {}


def _subarray(array: np.ndarray, box: tuple[slice, slice]) -> MPI.Datatype:
    key = (array.shape, tuple((s.start, s.stop) for s in box))
    if key not in _TYPES:
        sizes = [s.stop - s.start for s in box]
        starts = [s.start for s in box]
        _TYPES[key] = MPI.DOUBLE.Create_subarray(list(array.shape), sizes, starts).Commit()
    return _TYPES[key]


# -- pylops-mpi --------------------------------------------------------------------------------
def pylops_methods(grid: tuple[int, int], h: int, bulk: np.ndarray) -> dict:
    try:
        import pylops_mpi
    except ImportError:
        return {}
    methods = {}
    halo = pylops_mpi.MPIHalo(dims=(N, N), halo=h, proc_grid_shape=grid, comm=COMM, dtype=np.float64)
    x = pylops_mpi.DistributedArray(
        global_shape=N * N, local_shapes=COMM.allgather(bulk.size), base_comm=COMM, dtype=np.float64
    )
    x.local_array[:] = bulk.ravel()
    y = halo.matvec(x)
    methods["pylops-mpi MPIHalo"] = lambda: halo.matvec(x)
    methods["pylops-mpi MPIHalo adjoint"] = lambda: halo.rmatvec(y)
    if grid[1] == 1:
        column = pylops_mpi.DistributedArray(
            global_shape=(N, N),
            local_shapes=COMM.allgather(bulk.shape),
            base_comm=COMM,
            axis=0,
            dtype=np.float64,
        )
        column.local_array[:] = bulk
        methods["pylops-mpi add_ghost_cells"] = lambda: column.add_ghost_cells(h, h)
    return methods


# -- main ----------------------------------------------------------------------------------------
def main() -> int:
    if RANK == 0:
        print(
            f"halo exchange of a {N} x {N} float64 array on {SIZE} rank(s); median of {SAMPLES} samples "
            f"x {BATCH} calls, max over ranks"
        )
    for grid in GRIDS.get(SIZE, []):
        for h in (1, 3):
            tensor = DistributedTensor("x", (N, N), Partition(grid))
            op = HaloExchange(halo_geometry(tensor, Kernel(2 * h + 1, padding=h)))
            (block,) = [b for b in op.domain if b.worker == RANK]
            rng = np.random.default_rng(RANK)
            start = rng.standard_normal(block.shape)
            arrays = {name: start.copy() for name in ("bound", "apply", "packed", "subarray")}
            bound = mpi_backend.plan_for(op, comm=COMM).bind({block.name: arrays["bound"]})
            adjoint_bound = mpi_backend.plan_for(op.H, comm=COMM).bind({block.name: arrays["bound"]})
            packed = HandExchange(arrays["packed"], grid, h, subarray=False)
            subarray = HandExchange(arrays["subarray"], grid, h, subarray=True)
            # correctness first: one forward and one adjoint, all four agree
            bound(), packed(), subarray()
            mpi_backend.apply(op, {block.name: arrays["apply"]}, comm=COMM, inplace=True)
            same = all(np.array_equal(arrays["bound"], arrays[k]) for k in ("apply", "packed", "subarray"))
            adjoint_bound(), packed.adjoint(), subarray.adjoint()
            mpi_backend.apply(op.H, {block.name: arrays["apply"]}, comm=COMM, inplace=True)
            same = same and all(
                np.allclose(arrays["bound"], arrays[k], rtol=1e-14, atol=1e-14)
                for k in ("apply", "packed", "subarray")
            )
            if not COMM.allreduce(same, op=MPI.LAND):
                if RANK == 0:
                    print(f"  grid {grid} h={h}: results DIFFER from the hand-written exchange")
                return 1
            local = {block.name: arrays["apply"]}
            forward = bench(
                {
                    "linop bound": bound,
                    "linop apply": lambda op=op, local=local: mpi_backend.apply(
                        op, local, comm=COMM, inplace=True
                    ),
                    "hand packed": packed,
                    "hand subarray": subarray,
                }
            )
            adjoint_op = op.H
            backward = bench(
                {
                    "linop bound": adjoint_bound,
                    "linop apply": lambda op=adjoint_op, local=local: mpi_backend.apply(
                        op, local, comm=COMM, inplace=True
                    ),
                    "hand packed": packed.adjoint,
                    "hand subarray": subarray.adjoint,
                }
            )
            h_lo, h_hi = h, h
            bulk = start[h_lo : start.shape[0] - h_hi, h_lo : start.shape[1] - h_hi].copy()
            others = bench(pylops_methods(grid, h, bulk), samples=7, batch=2)
            bound.free()
            adjoint_bound.free()
            subarray.free()
            if RANK == 0:
                report(grid, h, "forward", forward, others, "MPIHalo", "add_ghost_cells")
                report(grid, h, "adjoint", backward, others, "MPIHalo adjoint")
    return 0


def report(grid, h, direction, times, others, *pylops_keys) -> None:
    fastest_name = min(("hand packed", "hand subarray"), key=times.get)
    fastest = times[fastest_name]
    print(f"  grid {grid[0]}x{grid[1]}, h={h}, {direction}:")
    for name, value in times.items():
        note = f"ratio {value / fastest:5.2f}x vs {fastest_name}" if name.startswith("linop") else ""
        print(f"    {name:15s} {value * 1e6:10.1f} us   {note}")
    for key in pylops_keys:
        full = f"pylops-mpi {key}"
        if full in others:
            print(
                f"    {full:29s} {others[full] * 1e6:10.1f} us   linop bound is "
                f"{others[full] / times['linop bound']:7.0f}x faster"
            )


if __name__ == "__main__":
    sys.exit(main())
