"""The timing helpers shared by the benchmark scripts.

The scripts run as ``python benchmarks/<script>.py`` (or under ``mpiexec``), which puts this
directory on ``sys.path``; they import the helpers as ``from _timing import compare`` (serial)
and ``from _timing import interleaved_over_ranks`` (MPI).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from statistics import median
from typing import Any

import numpy as np

__all__ = ["compare", "interleaved_over_ranks"]


def compare(
    ours: Callable[[], object], theirs: Callable[[], object], repeats: int
) -> tuple[float, float, float]:
    """Median times of ``ours()`` and ``theirs()`` and the median of their per-sample ratios.

    The two run alternately (after one warm-up call each), so that load from other processes
    on a shared machine hits both alike.
    """
    ours()
    theirs()
    mine, hand, ratios = [], [], []
    for _ in range(repeats):
        start = time.perf_counter()
        ours()
        middle = time.perf_counter()
        theirs()
        end = time.perf_counter()
        mine.append(middle - start)
        hand.append(end - middle)
        ratios.append((middle - start) / (end - middle))
    return median(mine), median(hand), median(ratios)


def interleaved_over_ranks(
    methods: dict[str, Callable[[], object]],
    comm: Any,
    samples: int,
    batch: int,
    warmups: int = 1,
    settle: int = 2,
) -> dict[str, np.ndarray]:
    """Per method, the time of one call in each sample: the maximum over the ranks of ``comm``
    of a batch's mean. Methods are interleaved within each sample (after ``warmups`` calls
    each), in an order drawn afresh for each sample (the same on every rank), and each timed
    batch follows ``settle`` untimed calls of its own and a barrier, so that load hits every
    method alike and no method is timed on its first calls after another's: the first calls
    on buffers that other calls used last can take 1.2-1.6x (8 MB MPI collectives,
    ``bench_mpi_buffer_switch.py``), which a fixed order charges to the same method each time."""
    from mpi4py import MPI

    times: dict[str, list[float]] = {name: [] for name in methods}
    for function in methods.values():
        for _ in range(warmups):
            function()
    names = list(methods)
    order = np.random.default_rng(len(names))  # seeded alike on every rank
    for _ in range(samples):
        for index in order.permutation(len(names)):
            name = names[index]
            function = methods[name]
            for _ in range(settle):
                function()
            comm.Barrier()
            start = time.perf_counter()
            for _ in range(batch):
                function()
            times[name].append((time.perf_counter() - start) / batch)
    result = {}
    for name, values in times.items():
        array = np.array(values)
        comm.Allreduce(MPI.IN_PLACE, array, op=MPI.MAX)
        result[name] = array
    return result
