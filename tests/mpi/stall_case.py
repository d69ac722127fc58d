"""One rank alone changes its input dtype after the torch wrapper under MPI bound its plan
(issue 41, item 4): ``mpiexec -n 2 python tests/mpi/stall_case.py CHANGING`` (run by
``tests/test_stall_mpi.py``, which bounds the launch; no ``LINOP_TIMEOUT``: the default 600 s
deadline holds).

Both ranks call ``function(tree, comm=)`` twice with float64 (the first call binds, the
second runs the bound plan); then, as controls, a slow peer at a bound call (float64 again, one
rank 2.5 s late: the waiting rank sends its record) and at a call that rebinds on every rank
(float32, the other rank late: both through the check), each exact and each printing
``SLOW OK rank r``; then rank ``CHANGING`` alone calls with float64 while its peer calls with
float32 again. The rank that rebinds must abort the job with ``PeerMismatchError`` naming its
peer within seconds (before: it waited forever, the binding's first collective had no
deadline).
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch
from mpi4py import MPI

from linop.backends.mpi import stall
from linop.frameworks.torch_function import function
from linop.mesh_layout import MeshLayout, Shard
from linop.redistribute import Redistribute


def main(changing: int) -> None:
    comm = MPI.COMM_WORLD
    rank = comm.rank
    source = MeshLayout.from_placements((2,), [Shard(0)], (6, 3), name="a")
    destination = MeshLayout.from_placements((2,), [Shard(1)], (6, 3), name="b")
    tree = Redistribute(source, destination)
    wrapped = function(tree, comm=comm)
    mine, theirs = source.block_of(rank).name, destination.block_of(rank).name

    def local(r: int, dtype: torch.dtype) -> torch.Tensor:
        shape = source.block_of(r).shape
        return (torch.arange(shape[0] * shape[1], dtype=torch.float64).reshape(shape) + 10 * r).to(dtype)

    def call(dtype: torch.dtype) -> None:
        result = wrapped({mine: local(rank, dtype)})[theirs]
        every = {source.block_of(r).name: local(r, dtype).numpy() for r in (0, 1)}
        if not np.array_equal(result.detach().numpy(), tree.apply(every)[theirs]):
            raise AssertionError(f"rank {rank}: {result}")

    call(torch.float64)
    call(torch.float64)
    for slow, dtype in ((1, torch.float64), (0, torch.float32)):
        sent = stall.SENT[0]
        if rank == slow:
            time.sleep(2.5)
        call(dtype)
        if dtype == torch.float64 and rank != slow and stall.SENT[0] == sent:
            raise AssertionError(f"rank {rank}: no record sent while the peer was slow")
        print(f"SLOW OK rank {rank}", flush=True)
    wrapped({mine: local(rank, torch.float64 if rank == changing else torch.float32)})
    print(f"rank {rank} finished (it should not have)", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]))
