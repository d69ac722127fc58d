"""One rank alone changes its input dtype after a wrapper has bound its plan (issue 41, item 4):
``python stall.py MODE`` on 2 gloo processes forked here (run by ``tests/test_stall_torchdist.py``,
which bounds the launch; no ``LINOP_TIMEOUT``: the default 600 s deadline holds).

Both ranks call the wrapper twice with float64 (the first call binds its plan through the
collective entry check, the second runs the bound plan unchecked); then, as controls, a slow
peer at a bound call and at a call that rebinds on every rank (float32), each exact; then the
changing rank alone calls with float64 (its wrapper rebinds: the checked path) while its peer
calls with float32 again (the bound path). Before the stall diagnosis both ranks waited until the deadline. Each rank must
raise a typed error naming the other rank and the dtypes (:class:`~linop.errors.PeerMismatchError`)
in seconds; prints ``STALL OK rank r: <message>``.

``MODE``: ``function`` (``linop.frameworks.torch_function.function(tree, group=True)`` of a
redistribute, out of place) or ``dtensor`` (``linop.frameworks.dtensor.redistribute_local``),
rank 0 changing; a trailing ``1``: rank 1 changing. ``failed`` / ``failed1``: instead, rank 0
(1) passes a misshapen tensor after binding (``StateError`` on it alone, ``FAILED OK rank r``);
its peer, in the bound call, must raise ``RankFailedError`` naming it once it ends, when the
store's host lives (rank 1 failing).
"""

from __future__ import annotations

import datetime
import os
import sys
import time
import traceback
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from rendezvous import held_port

from linop.backends.torch_distributed import stall
from linop.errors import LinopError
from linop.frameworks import dtensor
from linop.frameworks.torch_function import function
from linop.mesh_layout import Shard


def _layouts() -> tuple[Any, Any]:
    source = dtensor.mesh_layout((2,), [Shard(0)], (6, 3), name="a")
    return source, dtensor.mesh_layout((2,), [Shard(1)], (6, 3), name="b")


def _local(source: Any, rank: int, dtype: torch.dtype) -> torch.Tensor:
    shape = source.block_of(rank).shape
    return (torch.arange(shape[0] * shape[1], dtype=torch.float64).reshape(shape) + 10 * rank).to(dtype)


def run(rank: int, mode: str) -> None:
    source, destination = _layouts()
    tree = dtensor.redistribute_operator(source, destination)
    wrapped = function(tree, group=True)
    mine, theirs = source.block_of(rank).name, destination.block_of(rank).name

    def call(dtype: torch.dtype, *, check: bool = True) -> Any:
        local = _local(source, rank, dtype)
        if mode.startswith("dtensor"):
            result = dtensor.redistribute_local(local, source, destination)
        else:
            result = wrapped({mine: local})[theirs]
        if check:  # against the numpy interpreter on both ranks' blocks
            every = {source.block_of(r).name: _local(source, r, dtype).numpy() for r in (0, 1)}
            expected = tree.apply(every)[theirs]
            if not np.array_equal(result.detach().numpy(), expected):
                raise AssertionError(f"rank {rank}: {result} != {expected}")
        return result

    changing = 1 if mode.endswith("1") else 0
    call(torch.float64)  # binds (the entry check)
    call(torch.float64)  # the bound plan
    # the slow-peer controls in the first mode only (each costs 2 * GRACE + 0.5 s of sleep)
    controls = ((1, torch.float64), (0, torch.float32)) if mode == "function" else ((None, torch.float32),)
    for slow, dtype in controls:
        # a slow peer is no stall: at a bound call (float64 again), then at a call that rebinds
        # on every rank (float32): the waiting rank publishes its record and reads the peer's
        published = stall.PUBLISHED[0]
        if rank == slow:
            time.sleep(2 * stall.GRACE + 0.5)
        call(dtype)
        if slow is not None and rank != slow and stall.PUBLISHED[0] == published:
            raise AssertionError(f"rank {rank}: no record published while the peer was slow")
    if mode.startswith("failed"):  # after binding, the changing rank passes a misshapen tensor
        shape = source.block_of(rank).shape
        wrong = torch.zeros((shape[0] + 1, shape[1]), dtype=torch.float32)
        try:
            if rank == changing:
                wrapped({mine: wrong})
            else:
                call(torch.float32, check=False)
        except LinopError as error:
            print(f"FAILED OK rank {rank}: {type(error).__name__}: {error}", flush=True)
            return
        print(f"FAILED NO ERROR rank {rank}", flush=True)
        return
    try:
        call(torch.float64 if rank == changing else torch.float32, check=False)
    except LinopError as error:
        print(f"STALL OK rank {rank}: {type(error).__name__}: {error}", flush=True)
        return
    print(f"STALL NO ERROR rank {rank}", flush=True)


def process(rank: int, port: int, mode: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=120),
    )
    status = 0
    try:
        run(rank, mode)
    except BaseException:
        traceback.print_exc()
        status = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)  # the group is unusable after the error: end the process (the peer's cue)


if __name__ == "__main__":
    import torch.multiprocessing as mp

    mode = sys.argv[1]
    mp.start_processes(process, args=(held_port(), mode), nprocs=2, start_method="fork")
