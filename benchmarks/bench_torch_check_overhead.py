"""The local (Python) work of a checked in-place call on torch.distributed against a bound
plan's, in CPU time.

Run with ``python benchmarks/bench_torch_check_overhead.py`` (2 gloo processes on 127.0.0.1).

As ``bench_mpi_check_overhead.py`` does for MPI: after warm calls on both processes (the halo
exchange of a 256 x 256 float64 CPU tensor, width 1, grid 2 x 1; the checked call passes the
same tensor again each call), rank 0 makes the check's reduction return the vector it reduced
last (what every rank sent) without communicating, and the prepared phases of the checked
path and of the bound plan do nothing; it then times each call's CPU time
(``time.process_time``), minimum over repeats. Rank 1 waits at a barrier. What remains is the
local work per call: the checked call's, besides its collective, against the bound plan's.
"""

from __future__ import annotations

import sys
import time
import timeit

import numpy as np
import torch
import torch.distributed as dist
from _gloo import launch

from linop.backends import torch_distributed as td
from linop.halo import HaloExchange
from linop.halo_geometry import Kernel, halo_geometry
from linop.partition import DistributedTensor, Partition

NUMBER, REPEATS = 2000, 9


def main() -> None:
    rank = dist.get_rank()
    tensor = DistributedTensor("x", (256, 256), Partition((2, 1)))
    op = HaloExchange(halo_geometry(tensor, Kernel(3, padding=1)))
    (block,) = [b for b in op.domain if b.worker == rank]
    state = {block.name: torch.from_numpy(np.random.default_rng(rank).standard_normal(block.shape))}
    bound = td.plan_for(op).bind({block.name: state[block.name].clone()})

    def checked() -> None:
        td.apply(op, state, inplace=True)

    for _ in range(20):
        bound()
        checked()
    dist.barrier()
    if rank == 0:
        plan = td.plan_for(op)
        reducer = plan.context.reducer
        phases = [*(plan._prepared[1] if plan._prepared else []), *(bound._phases or [])]
        reducer.reduce = lambda timeout=None, doing=None: reducer.received  # as last reduced
        for phase in phases:
            phase.run = lambda timeout=None, doing=None: None
        print(f"local work per call, CPU time, min of {REPEATS} x {NUMBER} (collectives emptied):")
        for name, function in (("checked apply", checked), ("bound plan", bound)) * 2:
            best = min(timeit.repeat(function, number=NUMBER, repeat=REPEATS, timer=time.process_time))
            print(f"  {name:14s} {best / NUMBER * 1e6:7.2f} us", flush=True)
        del reducer.reduce
        for phase in phases:
            del phase.run
    dist.barrier()
    bound.free()


if __name__ == "__main__":
    launch(main, 2)
    sys.exit(0)
