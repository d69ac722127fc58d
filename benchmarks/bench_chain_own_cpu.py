"""MPI, CPU: the chain step of ``bench_new_layers.py`` (``ChainModule`` conv 3 -> conv 3 ->
average pool 2, forward, backward and ``sum_gradients``, against the same chain written by hand)
in *own* CPU time: each step's CPU time less the time spent in its MPI waits.

Run with ``mpiexec -n 4 python benchmarks/bench_chain_own_cpu.py`` (``BENCH_SIZES`` as there,
one size; ``BENCH_STEPS`` steps per sample, default 200; ``BENCH_SAMPLES``, default 5).

Why: on 4 processes over 2 shared cores the waits (MPICH polls: they count as CPU time) take
most of a step, and a loaded machine moves them between the two steps; the work each step does
itself is what a change of linop's per-call work changes. The waits are timed around linop's
bound ``Waitall`` calls and ``ChainModule``'s all-reduce, and around the hand-written step's
request waits and all-reduces, with ``time.process_time``. The two steps alternate step by step
(linop, hand, hand, linop, ...), so that a change of load reaches both alike; each sample is
the median over the ranks of each step's mean, and of the per-rank ratios. Printed too: the
Python calls per step of each (cProfile's count, which does not depend on the load). Nothing is
asserted about speed.
"""

from __future__ import annotations

import cProfile
import gc
import os
import pstats
import sys
import time
from collections.abc import Callable
from pathlib import Path
from statistics import median
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_new_layers as layers
import torch
from mpi4py import MPI

STEPS = int(os.environ.get("BENCH_STEPS", "200"))
SAMPLES = int(os.environ.get("BENCH_SAMPLES", "5"))
clock = time.process_time
waited = [0.0]


def _timed_wait(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` with its CPU time added to ``waited``."""

    def wait(*arguments: Any, **keywords: Any) -> Any:
        start = clock()
        try:
            return function(*arguments, **keywords)
        finally:
            waited[0] += clock() - start

    return wait


def _time_the_waits() -> None:
    """Wrap every wait of both steps (after their first call: the bound plans exist)."""
    from linop.backends.mpi.bound import BoundPlan
    from linop.frameworks.torch_chain import ChainModule

    waitall = _timed_wait(MPI.Request.Waitall)
    for plan in [obj for obj in gc.get_objects() if type(obj) is BoundPlan]:
        if plan._calls is not None:
            plan._calls[:] = [
                (waitall, a) if getattr(f, "__name__", "") == "Waitall" else (f, a) for f, a in plan._calls
            ]
    ChainModule._all_reduce = _timed_wait(ChainModule._all_reduce)  # type: ignore[method-assign]
    layers._Kept.wait = _timed_wait(layers._Kept.wait)  # type: ignore[method-assign]
    layers.Engine.all_reduce = _timed_wait(layers.Engine.all_reduce)  # type: ignore[method-assign]


def _calls_per_step(step: Callable[[], Any], steps: int = 20) -> float:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    return float(pstats.Stats(profiler).total_calls) / steps  # type: ignore[attr-defined]


def main() -> None:
    comm = MPI.COMM_WORLD
    layers.E.use_mpi(comm)
    torch.set_num_threads(1)
    (size,) = layers.SIZES[:1]
    steps: dict[str, Callable[[], Any]] = {}
    steps["linop"], steps["hand"], check = layers.case_chain(size, comm.rank)  # type: ignore[arg-type]
    check()  # equal results first
    counts = {name: _calls_per_step(step) for name, step in steps.items()}
    _time_the_waits()
    rows = []
    for _ in range(SAMPLES):
        own = dict.fromkeys(steps, 0.0)
        for i in range(STEPS):
            for name in ("linop", "hand") if i % 2 == 0 else ("hand", "linop"):
                waited[0] = 0.0
                start = clock()
                steps[name]()
                own[name] += clock() - start - waited[0]
        mine = comm.allgather((own["linop"] / STEPS, own["hand"] / STEPS))
        rows.append(
            (
                median(a for a, _ in mine) * 1e3,
                median(b for _, b in mine) * 1e3,
                median(a / b for a, b in mine),
            )
        )
    if comm.rank == 0:
        load = os.getloadavg()
        shape = "x".join(map(str, size))
        print(
            f"chain {shape} per process, 4 MPI ranks, load {load[0]:.1f}: own CPU ms/step (MPI waits out), "
            f"medians over ranks; Python calls per step linop {counts['linop']:.0f}, hand {counts['hand']:.0f}"
        )
        for linop, hand, ratio in rows:
            print(f"  linop {linop:7.3f}  hand {hand:7.3f}  linop/hand {ratio:.3f}")
        print(f"  median linop/hand {median(r for *_, r in rows):.3f}", flush=True)


if __name__ == "__main__":
    main()
