"""A user exception on one rank between two ``apply_mpi`` calls, under linop's guard, must end
the whole job within seconds: run by tests/test_mpi.py as ``guard_case.py with`` (the context
manager) or ``guard_case.py excepthook`` (:func:`install_excepthook`).

Without a guard the raising rank would sit in ``MPI_Finalize`` while the others wait forever
in their next ``apply_mpi``.
"""

from __future__ import annotations

import sys
import time

import numpy as np
from mpi4py import MPI

from linop import Block, SendRecv, Space
from linop.backends.mpi import guard, install_excepthook

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size
FAULTY = SIZE - 1

space = Space(Block(f"x{w}", (16,), w) for w in range(SIZE))
op = None
for w in range(SIZE):
    node = SendRecv(space[f"x{w}"][0:2], space[f"x{(w + 1) % SIZE}"][-2:])
    op = node if op is None else node @ op
local = {f"x{RANK}": np.arange(16.0)}


def main() -> None:
    for step in range(100_000):
        op.apply_mpi(local, comm=COMM, inplace=True)
        if RANK == FAULTY and step == 5:
            print(f"raising at {time.time()}", flush=True)
            raise ValueError(f"user code failed on rank {RANK}")


if sys.argv[1] == "with":
    with guard():
        main()
else:
    install_excepthook()
    main()
print(f"rank {RANK} finished (it should not have)", flush=True)
