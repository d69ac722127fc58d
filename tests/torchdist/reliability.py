"""The torch.distributed executor's edge (issue 41), on 2 gloo processes forked by
``torch.multiprocessing``: ``python reliability.py MODE`` (run by
``tests/test_reliability_torchdist.py``, which bounds the launch).

``MODE`` ``entry``: the entry check refuses a meta tensor and an in-place write into a tensor
that requires a gradient (on one rank; every rank raises the same
:class:`~linop.errors.DistributedStateError`, the group still usable), accepts ``timeout=inf``,
``1e300`` and ``LINOP_TIMEOUT=inf`` as no deadline (no ``OverflowError``), then, last,
``lift_group`` with a function that raises on rank 1: rank 1 raises a ``LiftError`` naming
itself and ends its process; rank 0, blocked in the function's collective, raises a
``LiftError`` naming rank 1 once that process has ended (not gloo's raw "Connection closed by
peer"). Each rank prints ``ENTRY OK rank r`` and ``LIFT OK rank r``.

``MODE`` ``bound``: both ranks bind an out-of-place all-reduce (a bound plan that is not
prepared) with ``timeout=3``; rank 1 never makes the first call and stays alive until rank 0
has raised (``$LINOP_CHECKS_MARKERS``): rank 0 must raise ``PeerTimeoutError`` naming the
deadline. Prints ``BOUND OK rank 0`` and ``BOUND ABSENT rank 1``.

``MODE`` ``every``, two cases on two groups (a group is unusable after either):

- on a sub-group of both ranks, a prepared in-place periodic halo exchange bound with
  ``timeout=3, every_call=True``, called once by both; rank 1 never makes the second call (it
  stays alive until rank 0 has raised): rank 0 must raise ``PeerTimeoutError`` naming rank 1
  and the deadline. Prints ``EVERY OK rank 0`` and ``EVERY ABSENT rank 1``;
- then, on the world group, an out-of-place all-reduce (not prepared: each call meets in a
  barrier) bound with ``timeout=60, every_call=True``, called once by both; rank 1 then kills
  itself (``SIGKILL``): rank 0's second call must raise ``PeerTimeoutError`` naming rank 1 as
  ended, from the closed connection, not from the deadline. Prints ``KILLED OK rank 0``.

``MODE`` ``teardown``: both ranks use linop on the world group (an apply, a prepared bound
plan, a gradient agreement, an autograd function's forward and backward), drop what they hold,
then ``destroy_process_group``: no thread of torch.distributed may run after it (gloo's worker
and transport threads, the store's server on rank 0), as without linop (before: linop's
contexts held the group, whose threads ran on to the interpreter's exit, where some 4-process
runs aborted with ``terminate called without an active exception``). Then each rank leaves
through the interpreter's whole teardown (no ``os._exit``) and prints ``TEARDOWN OK rank r``.

The ``every`` ranks are forked processes joined here (``torch.multiprocessing`` would end rank 0 as
soon as rank 1 dies); the launch prints ``EXIT CODES [0, -9]``.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rendezvous import held_port

from linop import Block, DistributedTensor, HaloExchange, Kernel, Partition, Space, halo_geometry
from linop.backends import torch_distributed as td
from linop.collectives import AllReduce, BlockGrid
from linop.errors import PeerTimeoutError

HANG_BOUND = 120.0
"""Seconds a rank waits for its peer's marker before it reports that the peer never raised."""


def _outcome(call: Any) -> str:
    try:
        call()
        return "no error"
    except Exception as error:
        return f"{type(error).__name__}: {error}"


def _agreed(message: str, rank: int) -> list[str]:
    gathered: list[Any] = [None, None]
    dist.all_gather_object(gathered, message)
    return gathered


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise AssertionError(f"rank {dist.get_rank()}: {what}")


def _all_reduce() -> AllReduce:
    return AllReduce(BlockGrid.uniform("r", Partition((2,)), (3,)), (0,))


def _mine(op: Any, rank: int, **options: Any) -> dict[str, torch.Tensor]:
    return {
        b.name: torch.arange(b.size, dtype=torch.float64).reshape(b.shape) + rank
        for b in op.domain.owned(rank)
    }


def entry(rank: int) -> None:
    op = _all_reduce()
    name = next(iter(_mine(op, rank)))
    # a meta tensor on rank 1: every rank raises the same typed error naming rank 1
    mine = _mine(op, rank)
    if rank == 1:
        mine[name] = torch.empty(mine[name].shape, dtype=torch.float64, device="meta")
    for inplace in (False, True):
        message = _outcome(lambda inplace=inplace: td.apply(op, mine, inplace=inplace))
        gathered = _agreed(message, rank)
        _require(len(set(gathered)) == 1, f"the ranks disagree on the meta tensor: {gathered}")
        _require(
            message.startswith("DistributedStateError: rank 1: block") and "meta tensor" in message,
            f"the meta tensor was not refused: {message}",
        )
    # in place into a leaf that requires a gradient, on rank 0: refused on every rank
    leaf = _mine(op, rank)
    if rank == 0:
        leaf[name].requires_grad_(True)
    message = _outcome(lambda: td.apply(op, leaf, inplace=True))
    gathered = _agreed(message, rank)
    _require(len(set(gathered)) == 1, f"the ranks disagree on the leaf: {gathered}")
    _require("rank 0: block" in message and "requires a gradient" in message, f"leaf not refused: {message}")
    bind = _outcome(lambda: td.plan_for(op).bind(leaf, inplace=True))
    _require("requires a gradient" in bind, f"bind of the leaf not refused: {bind}")
    # controls: out of place it is read detached; in place under no_grad it is written
    expected = (np.arange(3.0) * 2 + 1).reshape(3)
    result = td.apply(op, leaf)
    _require(np.array_equal(result[name].detach().numpy(), expected), f"out of place: {result}")
    with torch.no_grad():
        td.apply(op, leaf, inplace=True)
    _require(np.array_equal(leaf[name].detach().numpy(), expected), f"in place under no_grad: {leaf}")
    # no deadline: inf, 1e300 and LINOP_TIMEOUT=inf
    for timeout in (float("inf"), 1e300):
        result = td.apply(op, _mine(op, rank), timeout=timeout)
        _require(np.array_equal(result[name].numpy(), expected), f"timeout={timeout}: {result}")
        bound = td.plan_for(op).bind(_mine(op, rank), inplace=False, timeout=timeout)
        _require(np.array_equal(bound()[name].numpy(), expected), f"bound, timeout={timeout}")
    os.environ["LINOP_TIMEOUT"] = "inf"
    result = td.apply(op, _mine(op, rank))
    del os.environ["LINOP_TIMEOUT"]
    _require(np.array_equal(result[name].numpy(), expected), f"LINOP_TIMEOUT=inf: {result}")
    print(f"ENTRY OK rank {rank}", flush=True)
    lift_failure(rank)


def lift_failure(rank: int) -> None:
    """The last case of ``entry``: the group is unusable afterwards."""
    from verify.errors import LiftError
    from verify.lift_group import lift_group

    space = Space([Block("x0", (2,), worker=0), Block("x1", (2,), worker=1)])

    def forward(x: torch.Tensor) -> torch.Tensor:
        if rank == 1 and x.abs().sum() > 0 and x[1] != 0:
            raise ValueError("rank 1 fails on purpose")
        y = x.clone()
        dist.all_reduce(y)
        return y

    try:
        lift_group(forward, space, space, adjoint=forward, label="summed")
    except LiftError as error:
        message = str(error)
        _require("rank 1" in message and ("raised ValueError" in message or "failed" in message), message)
        if rank == 1:
            _require("rank 1 fails on purpose" in message, message)
        _require("Connection closed" not in message.split(":")[0], message)
        print(f"LIFT OK rank {rank}: {message}", flush=True)
        return
    raise AssertionError(f"rank {rank}: no LiftError")


def bound(rank: int) -> None:
    op = _all_reduce()
    step = td.plan_for(op).bind(_mine(op, rank), inplace=False, timeout=3)
    _require(not step.prepared, "the bound all-reduce is prepared: the case needs one that is not")
    markers = Path(os.environ["LINOP_CHECKS_MARKERS"])
    if rank == 1:
        give_up = time.monotonic() + HANG_BOUND
        while not (markers / "rank0").exists():
            if time.monotonic() > give_up:
                print("BOUND NEVER RAISED", flush=True)
                return
            time.sleep(0.05)
        print("BOUND ABSENT rank 1", flush=True)
        return
    try:
        step()
    except PeerTimeoutError as error:
        _require("within 3 s" in str(error) and "rank 0" in str(error), str(error))
        (markers / "rank0").write_text("raised")
        print(f"BOUND OK rank 0: {error}", flush=True)
        return
    raise AssertionError("no PeerTimeoutError without rank 1")


def _stay_until_marked(markers: Path, label: str) -> None:
    give_up = time.monotonic() + HANG_BOUND
    while not (markers / "rank0").exists():
        if time.monotonic() > give_up:
            print(f"{label} NEVER RAISED", flush=True)
            return
        time.sleep(0.05)
    print(f"{label} ABSENT rank 1", flush=True)


def every(rank: int) -> None:
    sub = dist.new_group([0, 1])
    tensor = DistributedTensor("t", (8,), Partition((2,)))
    op = HaloExchange(halo_geometry(tensor, Kernel(3, padding=1, boundary="periodic")))
    mine = {b.name: np.arange(float(b.size)).reshape(b.shape) + rank for b in op.domain.owned(rank)}
    step = td.plan_for(op, group=sub).bind(mine, timeout=3, every_call=True)
    _require(step.prepared and step.every_call, "the bound halo exchange is not prepared for every call")
    step()  # both ranks: fine
    markers = Path(os.environ["LINOP_CHECKS_MARKERS"])
    if rank == 1:
        _stay_until_marked(markers, "EVERY")
    else:
        try:
            step()
            raise AssertionError("no PeerTimeoutError without rank 1")
        except PeerTimeoutError as error:
            message = str(error)
            _require(
                "rank(s) [1] of the group of 2 did not arrive at a call of a bound plan" in message, message
            )
            _require("within 3 s" in message, message)
            (markers / "rank0").write_text("raised")
            print(f"EVERY OK rank 0: {error}", flush=True)
    killed(rank)


def killed(rank: int) -> None:
    import signal

    op = _all_reduce()
    step = td.plan_for(op).bind(_mine(op, rank), inplace=False, timeout=60, every_call=True)
    _require(not step.prepared and step.every_call, "the case needs a bound plan that is not prepared")
    step()  # both ranks: fine
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        step()
    except PeerTimeoutError as error:
        message = str(error)
        _require("rank(s) [1] of the group of 2 ended" in message, message)
        _require("within" not in message, f"the deadline, not the closed connection: {message}")
        print(f"KILLED OK rank 0: {error}", flush=True)
        return
    raise AssertionError("no PeerTimeoutError without rank 1")


TORCH_THREADS = ("gloo", "pt_gloo", "pt_tcpstore")
"""Name prefixes of torch.distributed's threads (``/proc/self/task/*/comm``)."""


def _torch_threads() -> list[str]:
    found = []
    for task in os.listdir("/proc/self/task"):
        try:
            name = Path(f"/proc/self/task/{task}/comm").read_text().strip()
        except OSError:  # ended meanwhile
            continue
        if name.startswith(TORCH_THREADS):
            found.append(name)
    return sorted(found)


def _use_linop(rank: int) -> None:
    from linop.frameworks.torch_agreement import start_agreement
    from linop.frameworks.torch_function import function

    op = _all_reduce()
    td.apply(op, _mine(op, rank))
    tensor = DistributedTensor("t", (8,), Partition((2,)))
    halo = HaloExchange(halo_geometry(tensor, Kernel(3, padding=1, boundary="periodic")))
    mine = {b.name: np.arange(float(b.size)).reshape(b.shape) for b in halo.domain.owned(rank)}
    step = td.plan_for(halo).bind(mine)
    _require(step.prepared, "the bound halo exchange is not prepared")
    step()
    _require(start_agreement(rank == 0, group=True).result(), "the agreement")
    x = {b.name: torch.ones(b.shape, dtype=torch.float64, requires_grad=True) for b in op.domain.owned(rank)}
    y = function(op, group=True)(x)
    sum(t.sum() for t in y.values()).backward()


def teardown(rank: int) -> None:
    if not _torch_threads():
        raise AssertionError(f"rank {rank}: no torch.distributed thread to watch: {_torch_threads()}")
    _use_linop(rank)
    dist.destroy_process_group()
    left = _torch_threads()
    if left:
        raise AssertionError(
            f"rank {rank}: threads of torch.distributed run after destroy_process_group: {left}"
        )
    print(f"TEARDOWN OK rank {rank}", flush=True)


def process(rank: int, port: int, mode: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        # far beyond the launch's bound: a rank that waits for the group's own timeout rather
        # than linop's deadline (a shut-down group whose release joins gloo's threads inside
        # the unfinished barrier) leaves its peer unmarked, and the case fails
        timeout=datetime.timedelta(seconds=3600),
    )
    if mode == "teardown":  # leaves through the interpreter's teardown
        teardown(rank)
        return
    {"entry": entry, "bound": bound, "every": every}[mode](rank)
    sys.stdout.flush()
    os._exit(0)  # both modes leave the group unusable: no teardown


def _forked(mode: str) -> None:
    """Both ranks as forked processes joined here: a rank killed leaves the other running."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    port = held_port()
    ranks = [context.Process(target=process, args=(rank, port, mode)) for rank in range(2)]
    for one in ranks:
        one.start()
    for one in ranks:
        one.join(HANG_BOUND)
    for one in ranks:
        if one.is_alive():
            one.kill()
    print(f"EXIT CODES {[one.exitcode for one in ranks]}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "every":
        _forked(sys.argv[1])
    else:
        mp.start_processes(process, args=(held_port(), sys.argv[1]), nprocs=2, start_method="fork")
