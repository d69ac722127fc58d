"""The local work of a training step of the new layers on MPI, messages stubbed out: linop's
module against the hand-written layer of ``bench_new_layers.py``, in CPU time.

Run with ``mpiexec -n 4 python benchmarks/bench_layer_local_work.py`` (the 2 x 2 grid of
``bench_new_layers.py``; ``BENCH_SIZES`` as there, one size; ``BENCH_ONLY``: ``repartition``,
``bn``). Every case is first run with its messages and checked equal to the hand-written one
(``bench_new_layers``' check). Then each rank's MPI calls become no-ops (linop's: the bound
plans' requests' starts and waits dropped from their prepared calls; the hand-written: its
collectives and messages), so a step is the process's own work alone (packs, copies,
kernels, Python), which a loaded machine does not blur with the other ranks' turns at
busy-polled waits. Rank 0 alone times it (the other ranks wait in a sleeping poll), samples of
a batch of steps, the methods interleaved in a fresh random order each sample; the table shows
the median CPU time of each and the median and quartiles of the per-sample ratios. The stubbed
steps compute wrong values (nothing moves): only their time means anything. ``BENCH_PROFILE=1``
adds a cProfile of each method's stubbed steps. Nothing is asserted about speed.
"""

from __future__ import annotations

import os
import sys
import time
from statistics import median, quantiles
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(__file__))
import bench_new_layers as layers

COMM = MPI.COMM_WORLD
SAMPLES = int(os.environ.get("BENCH_SAMPLES", "31"))
BATCH = int(os.environ.get("BENCH_BATCH", "20"))


class _NoRequest:
    def Wait(self) -> None:  # noqa: N802 - mpi4py's name
        pass


class _NoComm:
    """A communicator whose messages and collectives do nothing."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm

    def Get_rank(self) -> int:  # noqa: N802 - mpi4py's names
        return int(self.comm.Get_rank())

    def Get_size(self) -> int:  # noqa: N802
        return int(self.comm.Get_size())

    def Irecv(self, *args: Any) -> _NoRequest:  # noqa: N802
        return _NoRequest()

    Isend = Irecv

    def Allreduce(self, *args: Any, **kwargs: Any) -> None:  # noqa: N802
        pass

    Reduce = Bcast = Alltoall = Allreduce


def _is_mpi(call: Any) -> bool:
    function = getattr(call, "func", call)
    owner = getattr(function, "__self__", None)
    return (isinstance(owner, type) and issubclass(owner, MPI.Request)) or isinstance(owner, MPI.Request)


def _stub_module(module: Any) -> None:
    """Drop the MPI calls of every bound plan the module keeps; stub its direct forms'."""
    functions = []
    if hasattr(module, "function"):
        functions.append(module.function)
    functions += list(getattr(module, "_functions", {}).values())
    for function in functions:
        for runner in (function._runner, function._runner.adjoint):
            bound = getattr(runner, "_bound", None)
            plan = getattr(bound, "_bound", None)
            if plan is not None and plan._calls is not None:
                plan._calls = [(f, a) for f, a in plan._calls if not _is_mpi(f)]


def _modules() -> list[Any]:
    import gc

    from linop.frameworks.torch_norm import BatchNormModule
    from linop.frameworks.torch_repartition import Repartition

    return [o for o in gc.get_objects() if type(o) in (Repartition, BatchNormModule)]


def main() -> None:
    torch.set_num_threads(1)
    rank = COMM.Get_rank()
    layers.E.use_mpi(COMM)
    (size,) = layers.SIZES[:1]
    only = os.environ.get("BENCH_ONLY", "repartition,bn").split(",")
    for case in only:
        before = {id(m) for m in _modules()}
        linop_step, hand_step, check = getattr(layers, f"case_{case}")(size, rank)
        check()
        ours = [m for m in _modules() if id(m) not in before]
        methods = {"linop": linop_step, "hand": hand_step}
        COMM.Barrier()
        for module in ours:
            _stub_module(module)
        layers.E.comm = _NoComm(COMM)
        if rank == 0:
            times = _timed(methods)
            _report(case, size, times)
            if os.environ.get("BENCH_PROFILE"):
                _profile(methods)
        layers.E.comm = COMM
        done = COMM.Ibarrier()  # the other ranks sleep meanwhile
        while not done.Test():
            time.sleep(0.005)


def _profile(methods: dict[str, Any], calls: int = 200) -> None:
    """cProfile (CPU time) of each method's stubbed steps, the top entries by own time."""
    import cProfile
    import io
    import pstats

    for name, function in methods.items():
        profiler = cProfile.Profile(time.process_time)
        profiler.enable()
        for _ in range(calls):
            function()
        profiler.disable()
        out = io.StringIO()
        stats = pstats.Stats(profiler, stream=out)
        print(f"{name}: {stats.total_calls / calls:.0f} Python calls per step")  # type: ignore[attr-defined]
        stats.sort_stats(os.environ.get("BENCH_PROFILE_SORT", "tottime")).print_stats(
            int(os.environ.get("BENCH_PROFILE_TOP", "18"))
        )
        print(out.getvalue())


def _timed(methods: dict[str, Any]) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in methods}
    names = list(methods)
    order = np.random.default_rng(1)
    for function in methods.values():
        function()
    for _ in range(SAMPLES):
        for index in order.permutation(len(names)):
            function = methods[names[index]]
            function()
            start = time.process_time()
            for _ in range(BATCH):
                function()
            times[names[index]].append((time.process_time() - start) / BATCH)
    return times


def _report(case: str, size: tuple[int, ...], times: dict[str, list[float]]) -> None:
    load = os.getloadavg()
    shape = "x".join(map(str, size))
    print(f"{case} {shape}, rank 0's local work (messages stubbed), CPU time, load {load[0]:.1f}")
    hand = times["hand"]
    for name, values in times.items():
        line = f"  {name:<18} {median(values) * 1e6:8.1f} us"
        for other, label in ((hand, "hand"), (times["linop"], "linop")):
            if values is other:
                continue
            ratios = [a / b for a, b in zip(values, other)]
            q = quantiles(ratios, n=4)
            line += f" | / {label} {median(ratios):.3f}x ({q[0]:.3f}-{q[2]:.3f})"
        print(line, flush=True)


if __name__ == "__main__":
    main()
