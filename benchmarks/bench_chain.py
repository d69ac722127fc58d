"""Fused halo benchmark: a conv -> conv -> pool chain with one halo exchange against the same
chain layer by layer (one exchange per layer).

Run in one process (the numpy interpreter, all workers in turn) or under MPI::

    python benchmarks/bench_chain.py                 # counts, then the numpy interpreter
    mpiexec -n 4 python benchmarks/bench_chain.py    # counts, then the MPI executor (2 x 2)
    python benchmarks/bench_chain.py --small         # a quick run (smaller image, fewer samples)

The chain (``linop.layers.WindowChain``): x of 1 x 8 x 512 x 512 float64 (``--small``:
1 x 4 x 128 x 128) on a 2 x 2 partition (``mpiexec -n 2``: 2 x 1), a convolution 8 -> 8
(kernel 3, padding 1), another (kernel 3, padding 1), then an average pool (kernel 2,
stride 2). Fused: one exchange of the composed window (size 6, stride 2, padding 2, so a halo of
2 entries per side instead of 1 + 1), then the three stages on each enlarged window.
Layer by layer: ``Convolution``, ``Convolution``, ``AveragePool`` trees composed (the pool's
windows need no halo here). A training step's data movement is the forward and its adjoint
(the input gradient), so both are timed.

Printed: messages, bytes and dependent phases per forward (``linop.accounting.account`` of each
tree: the adjoint sends the same messages reversed), the redundant compute of the fused chain
(``WindowChain.redundancy``), then wall times (median over samples; under MPI, the maximum over
ranks of each sample; the two trees interleaved sample by sample) and CPU times in one process,
with fused / layered ratios. Both trees' outputs are checked equal before timing. Nothing is
asserted about speed.
"""

from __future__ import annotations

import sys
import time
from statistics import median

import numpy as np

from linop import DistributedTensor, Kernel, Partition
from linop.accounting import account
from linop.layers import ChainStage, WindowChain

SMALL = "--small" in sys.argv
CHANNELS, SIDE = (4, 128) if SMALL else (8, 512)
SAMPLES = 5 if SMALL else 11
GRIDS = {1: (1, 1), 2: (2, 1), 4: (2, 2)}


def build(grid: tuple[int, int]) -> WindowChain:
    rng = np.random.default_rng(0)
    x = DistributedTensor("x", (1, CHANNELS, SIDE, SIDE), Partition((1, 1, *grid)))
    stages = [
        ChainStage.conv(rng.standard_normal((CHANNELS, CHANNELS, 3, 3)), padding=1),
        ChainStage.conv(rng.standard_normal((CHANNELS, CHANNELS, 3, 3)), padding=1),
        ChainStage.avg(Kernel(2, stride=2)),
    ]
    return WindowChain(x, stages)


def counts(chain: WindowChain, fused, layered) -> None:
    grid = chain.x.partition.shape[2:]
    print(
        f"chain conv3 -> conv3 -> avgpool2/2 on x {chain.x.global_shape} float64, {grid[0]} x {grid[1]} "
        f"workers; fused window {chain.kernel.size[2:]}, stride {chain.kernel.stride[2:]}, padding "
        f"{chain.kernel.padding[2:]}"
    )
    a, b = account(fused), account(layered)
    print("  per forward (the adjoint sends the same messages back):")
    print(
        f"    messages  fused {a.total_messages:6d}   layered {b.total_messages:6d}   ratio {a.total_messages / max(b.total_messages, 1):.3f}"
    )
    print(
        f"    bytes     fused {a.total_bytes:6d}   layered {b.total_bytes:6d}   ratio {a.total_bytes / max(b.total_bytes, 1):.3f}"
    )
    print(f"    phases    fused {a.phases:6d}   layered {b.phases:6d}")
    for i, (computed, needed) in enumerate(chain.redundancy(), start=1):
        print(
            f"  intermediate field {i}: fused computes {computed} entries for {needed} "
            f"({100 * (computed - needed) / needed:.2f}% redundant)"
        )


def serial() -> None:
    chain = build((2, 2))
    fused, layered = chain.operator, chain.layered_operator()
    counts(chain, fused, layered)
    x = chain.x.scatter(np.random.default_rng(1).standard_normal(chain.x.global_shape))
    dy = chain.y.scatter(np.random.default_rng(2).standard_normal(chain.y.global_shape))
    out_f, out_l = chain.y.gather(fused(x)), chain.y.gather(layered(x))
    assert np.allclose(out_f, out_l, rtol=1e-12, atol=1e-12), "fused and layered outputs differ"
    adjoint_f, adjoint_l = fused.H, layered.H
    assert np.allclose(chain.x.gather(adjoint_f(dy)), chain.x.gather(adjoint_l(dy)), rtol=1e-12, atol=1e-12)
    methods = {
        "fused forward": lambda: fused(x),
        "layered forward": lambda: layered(x),
        "fused adjoint": lambda: adjoint_f(dy),
        "layered adjoint": lambda: adjoint_l(dy),
    }
    wall: dict[str, list[float]] = {name: [] for name in methods}
    cpu: dict[str, list[float]] = {name: [] for name in methods}
    for function in methods.values():
        function()
    for _ in range(SAMPLES):
        for name, function in methods.items():
            start, used = time.perf_counter(), time.process_time()
            function()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - used)
    print(f"numpy interpreter, one process (all 4 workers in turn); medians of {SAMPLES} samples:")
    for what in ("forward", "adjoint"):
        f_wall, l_wall = median(wall[f"fused {what}"]), median(wall[f"layered {what}"])
        f_cpu, l_cpu = median(cpu[f"fused {what}"]), median(cpu[f"layered {what}"])
        print(
            f"  {what:8s} wall fused {f_wall * 1e3:8.1f} ms  layered {l_wall * 1e3:8.1f} ms  ratio {f_wall / l_wall:.3f}x"
            f"   cpu fused {f_cpu * 1e3:8.1f} ms  layered {l_cpu * 1e3:8.1f} ms  ratio {f_cpu / l_cpu:.3f}x"
        )


def distributed() -> None:
    from mpi4py import MPI

    from linop.backends import mpi as mpi_backend

    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    chain = build(GRIDS[size])
    fused, layered = chain.operator, chain.layered_operator()
    if rank == 0:
        counts(chain, fused, layered)
    index = chain.x.partition.index(rank)
    x_name, y_name = chain.x.block_name(index), chain.y.block_name(index)
    bulk = np.random.default_rng(rank + 1).standard_normal(chain.x.block(index).shape)
    dy = np.random.default_rng(rank + 7).standard_normal(chain.y.block(index).shape)
    runs = {
        "fused forward": mpi_backend.plan_for(fused, comm=comm).bind({x_name: bulk}),
        "layered forward": mpi_backend.plan_for(layered, comm=comm).bind({x_name: bulk}),
        "fused adjoint": mpi_backend.plan_for(fused.H, comm=comm).bind({y_name: dy}),
        "layered adjoint": mpi_backend.plan_for(layered.H, comm=comm).bind({y_name: dy}),
    }
    same = np.allclose(
        runs["fused forward"]()[y_name], runs["layered forward"]()[y_name], rtol=1e-12, atol=1e-12
    )
    same &= np.allclose(
        runs["fused adjoint"]()[x_name], runs["layered adjoint"]()[x_name], rtol=1e-12, atol=1e-12
    )
    assert comm.allreduce(bool(same), op=MPI.LAND), "fused and layered results differ"
    wall: dict[str, list[float]] = {name: [] for name in runs}
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    for function in runs.values():
        function()
    for _ in range(SAMPLES):
        for name, function in runs.items():
            comm.Barrier()
            start, used = time.perf_counter(), time.process_time()
            function()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - used)
    result = {}
    for name in runs:
        w, c = np.array(wall[name]), np.array(cpu[name])
        comm.Allreduce(MPI.IN_PLACE, w, op=MPI.MAX)
        comm.Allreduce(MPI.IN_PLACE, c, op=MPI.MAX)
        result[name] = (float(median(w)), float(median(c)))
    if rank == 0:
        print(
            f"MPI executor, {size} ranks, bound plans; medians of {SAMPLES} samples of the maximum over ranks:"
        )
        for what in ("forward", "adjoint"):
            (fw, fc), (lw, lc) = result[f"fused {what}"], result[f"layered {what}"]
            print(
                f"  {what:8s} wall fused {fw * 1e3:8.1f} ms  layered {lw * 1e3:8.1f} ms  ratio {fw / lw:.3f}x"
                f"   cpu fused {fc * 1e3:8.1f} ms  layered {lc * 1e3:8.1f} ms  ratio {fc / lc:.3f}x"
            )


def main() -> None:
    try:
        from mpi4py import MPI

        size = MPI.COMM_WORLD.size
    except ImportError:
        size = 1
    if size > 1:
        distributed()
    else:
        serial()


if __name__ == "__main__":
    main()
