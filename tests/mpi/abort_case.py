"""A rank that fails *during* execution (after the collective check passed) must end the job,
never leave its peers waiting: run by tests/test_mpi.py under ``mpiexec -n 2``.

A test-only node lowers to a step that raises on rank 1, followed by a send-receive from rank
1 to rank 0: rank 0 would wait forever for that message if rank 1 just raised.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from helpers import Opaque  # tests/mpi is this script's directory
from mpi4py import MPI

from linop import Block, SendRecv, Space
from linop.backends import mpi as mpi_backend
from linop.backends.mpi.steps import RankStep
from linop.program import FastPathStep, lowering


@dataclass(frozen=True, eq=True, repr=False)
class Faulty(Opaque):
    """Lowered (below) to a step that raises on rank 1."""


class _Raise(RankStep):
    workers = (0, 1)

    def project(self, rank: int):
        return self if rank == 1 else None

    def run(self, work, comm, dtype) -> None:
        raise RuntimeError("a local kernel failed on rank 1")


@lowering(Faulty)
def _faulty(op: Faulty):
    return [FastPathStep(_Raise())]


space = Space([Block("a", (4,), 0), Block("b", (4,), 1)])
op = SendRecv(space["b"], space["a"]) @ Faulty(space)
rank = MPI.COMM_WORLD.rank
local = {"a": np.zeros(4)} if rank == 0 else {"b": np.ones(4)}
mpi_backend.apply(op, local)
print(f"rank {rank} finished (it should not have)", flush=True)
