"""The timing helper shared by the serial benchmark scripts.

The scripts run as ``python benchmarks/<script>.py``, which puts this directory on ``sys.path``;
they import the helper as ``from _timing import compare``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from statistics import median

__all__ = ["compare"]


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
