"""The local (Python) work of a checked in-place call against a bound plan's, in CPU time.

Run with 2 ranks::

    mpiexec -n 2 python benchmarks/bench_mpi_check_overhead.py

A checked call (``apply(op, state, comm=..., inplace=True)`` on the same arrays again) costs
the bound plan's work, the check's collective (one persistent ``Allreduce`` of a short
vector), and the local work around them: what :mod:`linop.backends.entry_check.repeat`
reduces. On a shared machine wall times of microsecond calls are mostly the scheduler's; this
script measures the local work alone, robustly: after warm calls on both ranks (the halo
exchange of a 256 x 256 float64 array, width 1, grid 2 x 1), rank 0 replaces the check's
persistent request by one whose ``Start`` and ``Wait`` do nothing (the reduced vector already
holds what every rank sent) and empties the prepared calls of the in-place binding and of the
bound plan, then times each call's CPU time (``time.process_time``: time this process ran,
not time it waited for the processor), minimum over repeats. Rank 1 only waits. Both lines
are the local work per call; their difference is what the checked call adds besides its
collective.
"""

from __future__ import annotations

import sys
import time
import timeit

import numpy as np
from mpi4py import MPI

from linop.backends import mpi as mpi_backend
from linop.halo import HaloExchange
from linop.halo_geometry import Kernel, halo_geometry
from linop.partition import DistributedTensor, Partition

COMM = MPI.COMM_WORLD
RANK = COMM.rank
NUMBER, REPEATS = 20000, 15


class _Idle:
    """A persistent request that does nothing (the reduction's result is already in place)."""

    def Start(self) -> None:  # noqa: N802 - mpi4py's name
        pass

    def Wait(self) -> None:  # noqa: N802 - mpi4py's name
        pass


def main() -> int:
    if COMM.size != 2:
        if RANK == 0:
            print("run with 2 ranks")
        return 1
    tensor = DistributedTensor("x", (256, 256), Partition((2, 1)))
    op = HaloExchange(halo_geometry(tensor, Kernel(3, padding=1)))
    (block,) = [b for b in op.domain if b.worker == RANK]
    state = {block.name: np.random.default_rng(RANK).standard_normal(block.shape)}
    other = {block.name: state[block.name].copy()}
    bound = mpi_backend.plan_for(op, comm=COMM).bind(other)
    for _ in range(20):
        bound()
        mpi_backend.apply(op, state, comm=COMM, inplace=True)
    COMM.Barrier()
    if RANK == 0:
        plan = mpi_backend.plan_for(op, comm=COMM)
        request = plan.context.reducer.request
        binding = plan.layouts.last[2] if plan.layouts.last is not None else None
        calls, bound_calls = (binding.calls if binding else None), bound._calls
        plan.context.reducer.request = _Idle()
        if binding is not None:
            binding.calls = []
        bound._calls = []

        def checked() -> None:
            mpi_backend.apply(op, state, comm=COMM, inplace=True)

        print(f"local work per call, CPU time, min of {REPEATS} x {NUMBER} (MPI calls emptied):")
        for name, function in (("checked apply", checked), ("bound plan", bound)) * 2:
            best = min(timeit.repeat(function, number=NUMBER, repeat=REPEATS, timer=time.process_time))
            print(f"  {name:14s} {best / NUMBER * 1e6:7.3f} us")
        last = getattr(plan.entry, "last", None)  # None before the repeat existed
        print(f"  calls served by the repeat: {last.hits if last is not None else 0}")
        plan.context.reducer.request = request
        if binding is not None:
            binding.calls = calls
        bound._calls = bound_calls
    COMM.Barrier()
    bound.free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
