"""A rank that never arrives at a call must not leave the others waiting forever: run by
tests/test_mpi.py as ``timeout_case.py apply`` (``apply_mpi(..., timeout=)`` under
:func:`~linop.backends.mpi.guard`), ``timeout_case.py bound`` (the deadline from
``LINOP_TIMEOUT``, a persistent bound plan's first call, under ``python -m mpi4py``),
``timeout_case.py unbound`` (the same for a bound plan that is not persistent: its first call
runs the ordinary application), ``timeout_case.py dup`` (``apply_mpi(..., timeout=)`` as the
first use of the communicator, whose duplication ``MPI_Comm_dup`` is collective) or
``timeout_case.py every`` (a persistent bound plan bound with ``timeout=`` and
``every_call=True``, its waits polled: rank 1 makes the first call and skips the second) or
``timeout_case.py every-barrier`` (the same on integer blocks: a bound plan that is not
compiled, whose every call meets in a polled barrier first).

Except in ``dup``, every rank first applies once together (so the communicator's duplicate
exists); then rank 1 skips the next call and sleeps. The other ranks must end by the deadline
with ``PeerTimeoutError`` naming rank 1, and the job must be aborted (rank 1 included).
"""

from __future__ import annotations

import sys
import time

import numpy as np
from mpi4py import MPI

from linop import Block, SendRecv, Space
from linop.backends.mpi import guard, plan_for

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size
MISSING = 1
TIMEOUT = 2.0

space = Space(Block(f"x{w}", (16,), w) for w in range(SIZE))
op = None
for w in range(SIZE):
    node = SendRecv(space[f"x{w}"][0:2], space[f"x{(w + 1) % SIZE}"][-2:])
    op = node if op is None else node @ op
local = {f"x{RANK}": np.arange(16.0)}


def main(mode: str) -> None:
    if mode == "apply":
        op.apply_mpi(local, comm=COMM, inplace=True, timeout=TIMEOUT)  # every rank: fine
        if RANK == MISSING:
            time.sleep(120)  # never arrives (the abort ends it)
        print(f"rank {RANK} calls at {time.time()}", flush=True)
        op.apply_mpi(local, comm=COMM, inplace=True, timeout=TIMEOUT)
    elif mode == "dup":  # rank 1 misses the first call on the communicator: its duplication
        if RANK == MISSING:
            time.sleep(120)
        print(f"rank {RANK} calls at {time.time()}", flush=True)
        op.apply_mpi(local, comm=COMM, inplace=True, timeout=TIMEOUT)
    elif mode.startswith("every"):  # every call of a bound plan within the deadline: rank 1 skips the second
        polled = mode == "every"
        arrays = local if polled else {name: array.astype(np.int64) for name, array in local.items()}
        bound = plan_for(op, comm=COMM).bind(arrays, inplace=True, timeout=TIMEOUT, every_call=True)
        assert bound.every_call and bound.persistent == polled and bound.polled == polled
        bound()  # every rank: fine
        if RANK == MISSING:
            time.sleep(120)
        print(f"rank {RANK} calls at {time.time()}", flush=True)
        bound()
        COMM.Barrier()
    else:  # the deadline from LINOP_TIMEOUT (set by the launcher), a bound plan's first call
        persistent = mode == "bound"
        # integer blocks are never compiled: each call of that bound plan runs the checked apply
        arrays = local if persistent else {name: array.astype(np.int64) for name, array in local.items()}
        bound = plan_for(op, comm=COMM).bind(arrays, inplace=True)
        assert bound.persistent == persistent
        if RANK == MISSING:
            time.sleep(120)
        print(f"rank {RANK} calls at {time.time()}", flush=True)
        bound()
        COMM.Barrier()  # a rank whose call completed (no message from rank 1) waits here
    print(f"rank {RANK} finished (it should not have)", flush=True)


if sys.argv[1] in ("apply", "dup", "every", "every-barrier"):
    with guard():
        main(sys.argv[1])
else:
    main(sys.argv[1])
