"""Collective algorithms on the MPI interpreter: measured time, modeled time, the native MPI
collective, and whether the chooser's pick is within 1.2x of the best measured variant.

Run: ``mpiexec -n 2 python benchmarks/bench_algorithms.py`` (or ``-n 4``; ``--quick`` for
fewer sizes and samples).

First the alpha-beta-gamma model is fitted twice on this run (``linop.algorithms.calibrate``):
*raw* (ping-pong with ``Send``/``Recv``, numpy adds) and *interp* (the ping-pong as a linop
send-receive tree on the MPI interpreter, so alpha includes the interpreter's cost per phase).
Then, for all-reduce, broadcast and all-gather, for every message size from 8 B to 8 MB (float64
entries; the size is one worker's buffer: the all-reduce vector, the broadcast block, the
gathered vector) and every variant: the measured time (a bound plan of the variant's tree, the
best over interleaved samples of the maximum over ranks), the modeled times under both models (the accounting of
the schedule the interpreter runs), and the native MPI call's time. Each size ends with the
chooser's pick under each model and its measured time over the best measured variant's (when
that exceeds 1.2x, the two are measured again head to head, alternating, with twice the samples,
and that ratio counts: on a shared machine one sweep can be disturbed by other processes).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

from linop.accounting import account_schedule
from linop.algorithms import problem
from linop.algorithms.calibrate import calibrate
from linop.algorithms.chooser import choose
from linop.backends import mpi as mpi_backend

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size
WITHIN = 1.2


def measure(methods: dict, samples: int, budget: float = 0.01) -> dict[str, float]:
    """Per method, the best over samples of the maximum over ranks of one call's time. The
    methods run interleaved, sample by sample (a batch of calls each, sized to last about
    ``budget`` seconds), so that load from other processes hits every method alike; the best
    sample is the one least disturbed by it."""
    batches = {}
    for name, function in methods.items():
        function()
        COMM.Barrier()
        start = time.perf_counter()
        function()
        once = COMM.allreduce(time.perf_counter() - start, op=MPI.MAX)
        batches[name] = max(1, min(200, int(budget / max(once, 1e-7))))
    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(samples):
        for name, function in methods.items():
            COMM.Barrier()
            start = time.perf_counter()
            for _ in range(batches[name]):
                function()
            times[name].append((time.perf_counter() - start) / batches[name])
    best = {}
    for name, values in times.items():
        array = np.array(values)
        COMM.Allreduce(MPI.IN_PLACE, array, op=MPI.MAX)
        best[name] = float(array.min())
    return best


def native_call(collective: str, count: int):
    """The native MPI collective doing the same job on preallocated buffers."""
    if collective == "allreduce":
        buffer = np.zeros(count)
        return lambda: COMM.Allreduce(MPI.IN_PLACE, buffer)
    if collective == "broadcast":
        buffer = np.zeros(count)
        return lambda: COMM.Bcast(buffer, root=0)
    shares = [count // SIZE + (1 if r < count % SIZE else 0) for r in range(SIZE)]
    mine, gathered = np.zeros(shares[RANK]), np.zeros(count)
    return lambda: COMM.Allgatherv(mine, [gathered, shares])


def bound_variant(op, collective: str):
    """A bound plan of ``op`` on this rank's blocks (zeros: repeated in-place sums stay finite)."""
    state = {b.name: np.zeros(b.shape) for b in op.domain if b.worker == RANK}
    inplace = collective == "allreduce"
    return mpi_backend.plan_for(op, comm=COMM).bind(state, inplace=inplace)


def run(collective: str, sizes: list[int], samples: int, models: dict) -> list[tuple[str, bool]]:
    if RANK == 0:
        print(f"\n{collective} on {SIZE} ranks (times in us; modeled: raw / interp)")
        print(f"  {'bytes':>8}  {'variant':26s} {'measured':>10} {'raw':>9} {'interp':>9} {'native':>9}")
    verdicts = []
    for nbytes in sizes:
        count = max(1, nbytes // 8)
        case = problem(collective, SIZE, count)
        methods, modeled = {}, {}
        for name, op in case.variants().items():
            methods[name] = bound_variant(op, collective)
            accounting = account_schedule(op)
            modeled[name] = {label: accounting.time(model) for label, model in models.items()}
        methods["native"] = native_call(collective, count)
        measured = measure(methods, samples)
        native = measured.pop("native")
        best = min(measured, key=measured.get)
        if RANK == 0:
            for name in measured:
                mark = " *" if name == best else ""
                print(
                    f"  {nbytes:>8}  {name:26s} {measured[name] * 1e6:10.1f} {modeled[name]['raw'] * 1e6:9.1f} "
                    f"{modeled[name]['interp'] * 1e6:9.1f} {native * 1e6:9.1f}{mark}"
                )
        for label, model in models.items():
            pick = choose(collective, SIZE, count * 8, model).variant
            ratio = measured[pick] / measured[best]
            note = ""
            if ratio > WITHIN:  # confirm head to head: on a loaded machine one sweep can mislead
                again = measure({pick: methods[pick], best: methods[best]}, 2 * samples)
                ratio = again[pick] / again[best]
                note = " (head to head)"
            verdicts.append((f"{collective} {nbytes} B {label}", ratio <= WITHIN))
            if RANK == 0:
                ok = "ok" if ratio <= WITHIN else "MISS"
                print(
                    f"  {'':8}  chooser ({label}): {pick} = {ratio:.2f}x the best measured ({best}){note} {ok}"
                )
    return verdicts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and samples")
    args = parser.parse_args()
    sizes = [8, 512, 32768, 1 << 21] if args.quick else [8, 64, 512, 4096, 32768, 1 << 18, 1 << 21, 1 << 23]
    samples = 3 if args.quick else 9
    if SIZE < 2:
        if RANK == 0:
            print("bench_algorithms needs at least 2 ranks (mpiexec -n 2 ...)")
        return 0
    models = {"raw": calibrate(COMM), "interp": calibrate(COMM, interpreter=True)}
    if RANK == 0:
        for label, model in models.items():
            print(f"fitted model ({label}): {model}")
    verdicts = []
    for collective in ("allreduce", "broadcast", "allgather"):
        verdicts.extend(run(collective, sizes, samples, models))
    if RANK == 0:
        for label in models:
            mine = [ok for what, ok in verdicts if what.endswith(label)]
            print(
                f"chooser ({label} model) within {WITHIN}x of the best measured: {sum(mine)} of {len(mine)} cases"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
