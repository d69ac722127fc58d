"""dAD benchmark: all-reducing per-site gradients against gathering the factors, over N.

Run with 2 or 4 ranks (one site per rank)::

    mpiexec -n 2 python benchmarks/bench_dad.py
    mpiexec -n 4 python benchmarks/bench_dad.py

Each site holds activations A_s (N x h) and deltas D_s (N x h'); the summed weight gradient
G = sum_s A_s^T D_s (h x h', float64) is computed two exact ways, each as linop trees under the
MPI interpreter (checked once, then bound) and as hand-written mpi4py:

- ``reduce``: G_s = A_s^T D_s locally (a LocalOperator), then an all-reduce of h h' values;
- ``gather``: all-gather of A and of D (N (h + h') values per site), then [A]^T [D] on every
  site (S times the local flops of ``reduce``).

The model (values per site, docs/theory.md#outer-product-gradients) puts the crossover at
N* = h h' / (h + h'): gathering is cheaper below it. The table shows both strategies' times
(median over samples of the maximum over ranks), linop over hand-written ratios, and where
the measured crossover lies (the smallest N from which on ``reduce`` wins at every larger N). Results are checked equal to
numpy before timing; nothing is asserted about speed. ``--quick`` runs fewer N and samples.
"""

from __future__ import annotations

import sys
import time
from statistics import median

import numpy as np
from mpi4py import MPI

from linop.backends import mpi as mpi_backend
from linop.layers import dad

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size
QUICK = "--quick" in sys.argv
H_IN, H_OUT = 256, 256
SWEEP = (16, 64, 128, 256, 1024) if QUICK else (8, 16, 32, 64, 96, 128, 192, 256, 512, 1024, 2048)
SAMPLES = 7 if QUICK else 21


def bench(methods: dict, samples: int = SAMPLES) -> dict[str, float]:
    """Median over samples of the maximum over ranks of one call's time, methods interleaved."""
    times: dict[str, list[float]] = {name: [] for name in methods}
    for function in methods.values():
        function()
    for _ in range(samples):
        for name, function in methods.items():
            COMM.Barrier()
            start = time.perf_counter()
            function()
            times[name].append(time.perf_counter() - start)
    out = {}
    for name, values in times.items():
        array = np.array(values)
        COMM.Allreduce(MPI.IN_PLACE, array, op=MPI.MAX)
        out[name] = float(median(array))
    return out


def bound(op, local):
    """The tree checked once and bound to ``local`` (later calls run without the check)."""
    return mpi_backend.plan_for(op, comm=COMM).bind(local)


def measure(rng: np.random.Generator, n: int) -> dict[str, float]:
    """Both strategies at N = n, checked against numpy, then timed."""
    a_mine = rng.standard_normal((n, H_IN))
    d_mine = rng.standard_normal((n, H_OUT))
    d = dad.deltas(SIZE, n, H_OUT)
    placeholders = [a_mine if s == RANK else np.zeros((n, H_IN)) for s in range(SIZE)]
    reduce_tree = dad.allreduce_gradient(placeholders, d)
    factor_tree = dad.factor_gather(SIZE, n, H_IN)
    a_local = {f"A[{RANK},0]": a_mine}
    d_local = {f"D[{RANK},0]": d_mine}
    gathered_a = mpi_backend.apply(factor_tree, a_local, comm=COMM)[f"Ag[{RANK},0]"]
    activations = [gathered_a[s * n : (s + 1) * n] for s in range(SIZE)]
    gather_tree = dad.gathered_gradient(activations, d)

    # exact strategies agree with numpy (and each other) before timing
    full_a = np.concatenate(COMM.allgather(a_mine))
    full_d = np.concatenate(COMM.allgather(d_mine))
    expected = full_a.T @ full_d
    for tree in (reduce_tree, gather_tree):
        got = mpi_backend.apply(tree, d_local, comm=COMM)[f"G[{RANK}]"]
        assert np.allclose(got, expected, rtol=1e-10, atol=1e-9), tree

    run_reduce = bound(reduce_tree, d_local)
    run_factors = bound(factor_tree, a_local)
    run_gather_d = bound(gather_tree, d_local)
    g_buffer = np.empty((H_IN, H_OUT))
    a_buffer = np.empty((SIZE * n, H_IN))
    d_buffer = np.empty((SIZE * n, H_OUT))

    def hand_reduce():
        np.matmul(a_mine.T, d_mine, out=g_buffer)
        COMM.Allreduce(MPI.IN_PLACE, g_buffer)

    def hand_gather():
        COMM.Allgather(a_mine, a_buffer)
        COMM.Allgather(d_mine, d_buffer)
        np.matmul(a_buffer.T, d_buffer, out=g_buffer)

    times = bench(
        {
            "linop reduce": run_reduce,
            "linop gather": lambda: (run_factors(), run_gather_d()),
            "hand reduce": hand_reduce,
            "hand gather": hand_gather,
        }
    )
    return times


def main() -> None:
    rng = np.random.default_rng(RANK)
    rows = [(n, measure(rng, n)) for n in SWEEP]
    if RANK:
        return
    model = dad.crossover(H_IN, H_OUT)
    print(
        f"dAD on {SIZE} ranks, h = {H_IN}, h' = {H_OUT}, float64; model crossover N* = h h'/(h + h') = {model:g}"
    )
    print(f"values per site: reduce {H_IN * H_OUT}, gather N x {H_IN + H_OUT}")
    header = f"{'N':>6} {'linop reduce':>13} {'linop gather':>13} {'hand reduce':>12} {'hand gather':>12} {'ratio r/g':>10} {'ratio g/g':>10}  faster (linop / hand)"
    print(header)
    for n, t in rows:
        faster_linop = "gather" if t["linop gather"] < t["linop reduce"] else "reduce"
        faster_hand = "gather" if t["hand gather"] < t["hand reduce"] else "reduce"
        print(
            f"{n:>6} {t['linop reduce'] * 1e3:>11.3f}ms {t['linop gather'] * 1e3:>11.3f}ms "
            f"{t['hand reduce'] * 1e3:>10.3f}ms {t['hand gather'] * 1e3:>10.3f}ms "
            f"{t['linop reduce'] / t['hand reduce']:>9.2f}x {t['linop gather'] / t['hand gather']:>9.2f}x  "
            f"{faster_linop} / {faster_hand}"
        )
    for label, key in (("linop", "linop"), ("hand-written", "hand")):
        wins = [t[f"{key} reduce"] < t[f"{key} gather"] for _, t in rows]
        # the smallest N from which on the all-reduce wins at every larger N of the sweep
        measured = next((rows[k][0] for k in range(len(rows)) if all(wins[k:])), None)
        print(
            f"measured crossover ({label}): the all-reduce wins from N = {measured} on (model: N* = {model:g})"
        )


if __name__ == "__main__":
    main()
