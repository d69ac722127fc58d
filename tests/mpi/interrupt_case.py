"""SIGINT to one rank while every rank loops over ``apply_mpi`` must end the whole job (the
interrupted rank aborts it from inside linop), never leave the others waiting: run by
tests/test_mpi.py as ``interrupt_case.py DIR apply`` (``apply_mpi`` each time) or ``... DIR
bound`` (a bound plan), which sends the signal to one rank once every rank has written its pid.

The loop spends nearly all its time inside linop, where the interrupt lands and linop's own
abort path ends the job. The blocks are large enough (2 MB moved per rank and call, about a
millisecond) that the call's boundary is a small target, but not none: Python raises a pending
KeyboardInterrupt at its next check, which can be the entry of ``apply_mpi`` itself, before
any of linop's guarded sections, where an error is the program's own (README: "When a rank
fails"). The opt-in excepthook ends the job then, and the test checks that the interrupt did
not come from inside linop.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

from linop import Block, SendRecv, Space
from linop.backends.mpi import install_excepthook, plan_for

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size
install_excepthook()  # an interrupt at the call boundary: the program's own error

space = Space(Block(f"x{w}", (2048, 512), w) for w in range(SIZE))
op = None
for w in range(SIZE):  # every worker's first rows to the next worker's last rows
    node = SendRecv(space[f"x{w}"][0:512, :], space[f"x{(w + 1) % SIZE}"][-512:, :])
    op = node if op is None else node @ op
local = {f"x{RANK}": np.random.default_rng(RANK).standard_normal((2048, 512))}
if sys.argv[2] == "bound":  # persistent requests: the bound call's own abort path
    step = plan_for(op, comm=COMM).bind(local)
else:

    def step() -> None:
        op.apply_mpi(local, comm=COMM, inplace=True)


step()  # compiled and checked once before the pid is out
pending = Path(sys.argv[1], f"rank{RANK}.tmp")
pending.write_text(str(os.getpid()))
pending.replace(pending.with_suffix(""))  # atomic: the launcher never reads half a pid
while True:
    step()
