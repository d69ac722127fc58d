r"""Fit the alpha-beta-gamma model on the running MPI (``docs/theory.md#cost-model``).

:func:`calibrate` measures, in a few seconds:

- **alpha and beta** by ping-pong between ranks 0 and 1: the one-way time t(m) of an m-byte
  message is half a round trip (median over samples of a batch of round trips each); alpha = t(8 B) and beta the slope
  between the smallest and the largest size (a two-point fit, robust to the noise of a shared
  machine where least squares is pulled by outliers);
- **gamma** by timing ``numpy.add(a, b, out=a)`` on large float64 arrays: seconds per byte
  added.

With ``interpreter=True`` the ping-pong runs through linop instead: a bound plan of a
:class:`~linop.SendRecv` tree and its adjoint on the MPI interpreter, so alpha includes the
interpreter's per-phase overhead (what the variants pay when they run as trees), and the model
gets a fourth parameter, ``delta``: the time of one local step (a bound plan of one-entry adds),
the interpreter's fixed cost per add, copy, allocation or drop. The model is
computed on rank 0 and broadcast, so every rank returns the same :class:`CostModel`. Needs
mpi4py (the ``mpi`` extra) and at least two ranks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from statistics import median
from typing import Any

import numpy as np

from ..accounting import CostModel
from ..errors import CalibrationError
from ..progress import Progress, ProgressOption

__all__ = ["CalibrationError", "calibrate", "local_step_time", "ping_pong", "reduction_rate"]


def _world(comm: Any) -> Any:
    if comm is not None:
        return comm
    from mpi4py import MPI

    return MPI.COMM_WORLD


def ping_pong(
    comm: Any,
    nbytes: int,
    repeats: int = 20,
    *,
    batch: int = 10,
    interpreter: bool = False,
    tick: Callable[[], None] | None = None,
) -> float:
    """One-way time (s) of an ``nbytes`` message between ranks 0 and 1: the median over
    ``repeats`` samples of ``batch`` round trips each, halved (collective over ``comm``; ranks
    other than 0 and 1 only wait). Rank 0's result is the measurement; ``tick()`` is called
    after each sample (progress)."""
    rank = comm.Get_rank()
    count = max(1, nbytes // 8)
    buffer = np.zeros(count)
    if interpreter:
        run = _interpreter_round_trip(comm, count)
    else:

        def run() -> None:
            if rank == 0:
                comm.Send(buffer, dest=1, tag=11)
                comm.Recv(buffer, source=1, tag=12)
            elif rank == 1:
                comm.Recv(buffer, source=0, tag=11)
                comm.Send(buffer, dest=0, tag=12)

    run()  # warm-up
    run()
    samples = []
    for _ in range(repeats):
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(batch):
            run()
        samples.append((time.perf_counter() - start) / (2 * batch))
        if tick is not None:
            tick()
    return float(median(samples))


def _interpreter_round_trip(comm: Any, count: int) -> Any:
    """A bound plan that sends a block from worker 0 to worker 1 and back (two phases)."""
    from ..backends import mpi as mpi_backend
    from ..movement import SendRecv
    from ..space import Block, Space

    space = Space([Block("a", (count,), 0), Block("b", (count,), 1)])
    there = SendRecv(space["a"], space["b"])
    back = SendRecv(space["b"], space["a"])
    tree = back @ there
    rank = comm.Get_rank()
    state = {b.name: np.zeros(count) for b in space if b.worker == rank}
    return mpi_backend.plan_for(tree, comm=comm).bind(state, inplace=True)


def reduction_rate(nbytes: int = 1 << 22, repeats: int = 7) -> float:
    """Seconds per byte of ``numpy.add(a, b, out=a)`` on float64 arrays of ``nbytes``."""
    count = max(1, nbytes // 8)
    a, b = np.ones(count), np.ones(count)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.add(a, b, out=a)
        samples.append(time.perf_counter() - start)
    return float(median(samples)) / (count * 8)


def calibrate(
    comm: Any = None,
    *,
    sizes: Sequence[int] = (8, 1 << 20),
    repeats: int = 20,
    interpreter: bool = False,
    progress: ProgressOption = None,
) -> CostModel:
    """Measure alpha, beta and gamma on ``comm`` (default ``MPI.COMM_WORLD``); collective.

    Parameters
    ----------
    comm : mpi4py communicator, optional
    sizes : (small, large) message sizes in bytes
        alpha is the one-way time of the small size, beta the slope up to the large one.
    repeats : int
        Round trips per size (the median is used).
    interpreter : bool
        Ping-pong through the MPI interpreter (a bound plan of send-receives) instead of raw
        ``Send``/``Recv``.
    progress : None, bool or callable
        Progress on rank 0, one step per timed sample (the ping-pongs, the reduction rate and,
        with ``interpreter=True``, the local steps), :mod:`linop.progress`: None (default)
        reports on stderr only once calibration has run 2 s, True always, False never; a
        callable is called as ``progress(done, total, what)`` instead. Ctrl-C between MPI calls
        writes rank 0's line saying how far it got and re-raises the ``KeyboardInterrupt``
        (inside the interpreter's bound plans it aborts the job, as any failure there does).

    Returns
    -------
    CostModel
        The same on every rank.

    Raises
    ------
    CalibrationError
        With fewer than two ranks, or sizes that are not two increasing byte counts.
    """
    comm = _world(comm)
    if comm.Get_size() < 2:
        raise CalibrationError(
            f"calibration needs at least two ranks to ping-pong, the communicator has {comm.Get_size()}"
        )
    small, large = (int(s) for s in sizes)
    if not 0 < small < large:
        raise CalibrationError(f"calibration sizes must be two increasing byte counts, not {tuple(sizes)}")
    large_repeats = max(3, repeats // 4)
    total = repeats + large_repeats + 1 + (repeats if interpreter else 0)
    rank0 = comm.Get_rank() == 0
    with Progress("calibrate", total, "samples", progress=progress, report=rank0) as report:
        report.update(0, f"alpha: {small}-byte ping-pong")
        t_small = ping_pong(comm, small, repeats, interpreter=interpreter, tick=report.advance)
        report.update(report.done, f"beta: {large}-byte ping-pong")
        t_large = ping_pong(comm, large, large_repeats, batch=2, interpreter=interpreter, tick=report.advance)
        report.update(report.done, "gamma: reduction rate")
        gamma = reduction_rate()
        report.advance(1, "delta: local steps" if interpreter else None)
        delta = local_step_time(comm, repeats, tick=report.advance) if interpreter else 0.0
    fitted = None
    if comm.Get_rank() == 0:
        beta = max(t_large - t_small, 0.0) / (large - small)
        alpha = max(t_small - beta * small, 0.0)
        fitted = (alpha, beta, gamma, delta)
    alpha, beta, gamma, delta = comm.bcast(fitted, root=0)
    return CostModel(alpha, beta, gamma, delta)


def local_step_time(
    comm: Any, repeats: int = 20, steps: int = 20, *, tick: Callable[[], None] | None = None
) -> float:
    """Seconds per local step of the MPI interpreter: a bound plan of ``steps`` one-entry adds
    on worker 0, timed on rank 0 (collective over ``comm``); ``tick()`` after each sample."""
    from ..backends import mpi as mpi_backend
    from ..operator import Composition
    from ..primitives import Add
    from ..space import Block, Space

    space = Space([Block("a", (1,), 0), Block("b", (1,), 0)])
    tree = Composition(tuple(Add(space["a"], space["b"]) for _ in range(steps)))
    state = {b.name: np.zeros(1) for b in space if b.worker == comm.Get_rank()}
    run = mpi_backend.plan_for(tree, comm=comm).bind(state, inplace=True)
    run()
    samples = []
    for _ in range(repeats):
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(5):
            run()
        samples.append((time.perf_counter() - start) / (5 * steps))
        if tick is not None:
            tick()
    return float(median(samples))
