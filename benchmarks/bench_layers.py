"""Layer benchmark: a feature-partitioned 2-D convolution under MPI against hand-written mpi4py.

Run with 4 ranks (a 2 x 2 partition of the image; 1 and 2 ranks use 1 x 1 and 2 x 1)::

    mpiexec -n 4 python benchmarks/bench_layers.py          # the layer under MPI
    python benchmarks/bench_layers.py --proof                # the exact proof at 1e6 entries

The layer: x of 1 x 16 x 1024 x 1024 float32, 16 output channels, kernel 3, padding 1
(``--small``: 1 x 4 x 256 x 256). Timed in the same run, interleaved sample by sample (median
over samples of the maximum over ranks):

- ``linop``: ``Convolution(x, 16, Kernel(3, padding=1)).input_operator(w)`` (halo windows and
  a LocalOperator per worker), checked once and bound (``plan_for(op).bind(local)``); the
  adjoint tree (the input gradient) likewise;
- ``hand``: hand-written mpi4py: the bulk copied into a preallocated padded buffer, the nested
  halo exchange (rows, then columns over the filled rows) with Isend/Irecv of packed strips,
  then the *same* local kernel (``linop.layers.kernels.correlate`` / ``correlate_adjoint``);
  the adjoint runs the kernel's adjoint, then sends the halos back and adds them.

Both results are checked equal (to float32 rounding) before timing. ``--proof`` times
``verify.exact_adjoint`` of the layer's data movement (its halo windows) on a 1e6-entry input
(1 x 4 x 500 x 500 on a 2 x 2 partition) in one process. Nothing is asserted about speed.
"""

from __future__ import annotations

import sys
import time
from statistics import median

import numpy as np

SMALL = "--small" in sys.argv
CHANNELS, SIDE = (4, 256) if SMALL else (16, 1024)
SAMPLES = 5 if SMALL else 7
GRIDS = {1: (1, 1), 2: (2, 1), 4: (2, 2)}


def proof() -> None:
    import verify
    from linop import DistributedTensor, HaloExchange, Kernel, Partition, halo_geometry
    from linop.layers import Convolution

    x = DistributedTensor("x", (1, 4, 500, 500), Partition((1, 1, 2, 2)))
    layer = Convolution(x, 4, Kernel(3, padding=1))
    cases = {
        "the layer's data movement (pad shim, halo exchange, trim shim)": layer.window_operator,
        "its halo exchange alone (in place on the local blocks)": HaloExchange(
            halo_geometry(x, layer.kernel)
        ),
    }
    print(f"exact adjoint proofs on a {x.global_shape} tensor (1e6 entries) on 2 x 2, kernel 3, padding 1:")
    for what, op in cases.items():
        start, cpu = time.perf_counter(), time.process_time()
        result = verify.exact_adjoint(op)
        elapsed, used = time.perf_counter() - start, time.process_time() - cpu
        assert result, result
        print(f"  {elapsed:6.2f} s wall, {used:6.2f} s cpu  {what} ({result.detail})")


def main() -> None:
    from mpi4py import MPI

    from linop import DistributedTensor, Kernel, Partition
    from linop.backends import mpi as mpi_backend
    from linop.layers import Convolution

    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    grid = GRIDS[size]
    x = DistributedTensor("x", (1, CHANNELS, SIDE, SIDE), Partition((1, 1, *grid)))
    layer = Convolution(x, CHANNELS, Kernel(3, padding=1))
    weights = np.random.default_rng(0).standard_normal(layer.weights.global_shape).astype(np.float32)
    forward = layer.input_operator(weights)
    adjoint = forward.H
    index = x.partition.index(rank)
    bulk = np.random.default_rng(rank + 1).standard_normal(x.block(index).shape).astype(np.float32)
    y_name = layer.y.block_name(index)
    dy = np.random.default_rng(rank + 7).standard_normal(layer.y.block(index).shape).astype(np.float32)
    run_forward = mpi_backend.plan_for(forward, comm=comm).bind({x.block_name(index): bulk})
    run_adjoint = mpi_backend.plan_for(adjoint, comm=comm).bind({y_name: dy})

    hand = HandConvolution(comm, grid, bulk, dy, weights)
    ours_y = run_forward()[y_name]
    assert np.allclose(ours_y, hand.forward(), rtol=1e-4, atol=1e-4), "forward differs from hand-written"
    ours_dx = run_adjoint()[x.block_name(index)]
    assert np.allclose(ours_dx, hand.adjoint(), rtol=1e-4, atol=1e-4), "adjoint differs from hand-written"

    methods = {
        "linop forward": run_forward,
        "hand forward": hand.forward,
        "linop adjoint": run_adjoint,
        "hand adjoint": hand.adjoint,
    }
    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(SAMPLES):
        for name, function in methods.items():
            comm.Barrier()
            start = time.perf_counter()
            function()
            times[name].append(time.perf_counter() - start)
    result = {}
    for name, values in times.items():
        array = np.array(values)
        comm.Allreduce(MPI.IN_PLACE, array, op=MPI.MAX)
        result[name] = float(median(array))
    if rank == 0:
        print(
            f"feature-partitioned convolution on {size} ranks ({grid[0]} x {grid[1]}): x 1 x {CHANNELS} x {SIDE} x {SIDE} "
            f"float32, {CHANNELS} output channels, kernel 3, padding 1; medians of {SAMPLES} samples, max over ranks"
        )
        for what in ("forward", "adjoint"):
            ours, theirs = result[f"linop {what}"], result[f"hand {what}"]
            print(
                f"  {what:8s} linop {ours * 1e3:9.1f} ms   hand {theirs * 1e3:9.1f} ms   ratio {ours / theirs:.3f}x"
            )


class HandConvolution:
    """The layer written directly with mpi4py and numpy (independent of linop's trees)."""

    def __init__(self, comm, grid, bulk, dy, weights) -> None:
        from linop.layers import kernels

        self.kernels = kernels
        self.comm, self.weights = comm, weights
        p0, p1 = grid
        self.i, self.j = divmod(comm.rank, p1)
        self.p0, self.p1 = p0, p1
        self.bulk, self.dy = bulk, dy
        n0, n1 = bulk.shape[-2:]
        self.n0, self.n1 = n0, n1
        self.padded = np.zeros((*bulk.shape[:-2], n0 + 2, n1 + 2), dtype=bulk.dtype)
        self.window = self.padded  # every worker's window is its whole local block here

    def _peer(self, i: int, j: int) -> int:
        return i * self.p1 + j

    def _stages(self):
        n0, n1 = self.n0, self.n1
        rows = []
        if self.i > 0:
            rows.append(
                (self._peer(self.i - 1, self.j), np.s_[..., 1:2, 1 : n1 + 1], np.s_[..., 0:1, 1 : n1 + 1])
            )
        if self.i < self.p0 - 1:
            rows.append(
                (
                    self._peer(self.i + 1, self.j),
                    np.s_[..., n0 : n0 + 1, 1 : n1 + 1],
                    np.s_[..., n0 + 1 : n0 + 2, 1 : n1 + 1],
                )
            )
        top, bottom = (0 if self.i > 0 else 1), (n0 + 2 if self.i < self.p0 - 1 else n0 + 1)
        cols = []
        if self.j > 0:
            cols.append(
                (self._peer(self.i, self.j - 1), np.s_[..., top:bottom, 1:2], np.s_[..., top:bottom, 0:1])
            )
        if self.j < self.p1 - 1:
            cols.append(
                (
                    self._peer(self.i, self.j + 1),
                    np.s_[..., top:bottom, n1 : n1 + 1],
                    np.s_[..., top:bottom, n1 + 1 : n1 + 2],
                )
            )
        return [s for s in (rows, cols) if s]

    def _exchange(self, stage, tag: int, back: bool) -> None:
        from mpi4py import MPI

        local = self.padded
        requests, received = [], []
        for peer, send, recv in stage:
            source = recv if back else send
            target = send if back else recv
            into = np.empty(local[target].shape, dtype=local.dtype)
            requests.append(self.comm.Irecv(into, peer, tag))
            received.append((target, into))
            requests.append(self.comm.Isend(np.ascontiguousarray(local[source]), peer, tag))
        MPI.Request.Waitall(requests)
        for target, into in received:
            if back:
                local[target] += into
            else:
                local[target] = into
        if back:
            for _, _, recv in stage:
                local[recv] = 0

    def forward(self) -> np.ndarray:
        self.padded[..., 1 : self.n0 + 1, 1 : self.n1 + 1] = self.bulk
        for stage in self._stages():
            self._exchange(stage, 0, back=False)
        return self.kernels.correlate(self.padded, self.weights, (1, 1), (1, 1))

    def adjoint(self) -> np.ndarray:
        self.padded[...] = self.kernels.correlate_adjoint(
            self.dy, self.weights, self.padded.shape[-2:], (1, 1), (1, 1)
        )
        for stage in reversed(self._stages()):
            self._exchange(stage, 1, back=True)
        return self.padded[..., 1 : self.n0 + 1, 1 : self.n1 + 1].copy()


if __name__ == "__main__":
    if "--proof" in sys.argv:
        proof()
    else:
        main()
