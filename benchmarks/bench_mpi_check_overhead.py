"""The checked call (``apply(op, state, comm=..., inplace=True)`` on the same arrays again)
against the bound plan: its local work, and its wall time at 64 KB, 1 MB and 8 MB messages.

Run with 2 or 4 ranks::

    mpiexec -n 2 python benchmarks/bench_mpi_check_overhead.py            # both parts
    mpiexec -n 4 python benchmarks/bench_mpi_check_overhead.py sizes      # wall times only
    mpiexec -n 2 python benchmarks/bench_mpi_check_overhead.py floors     # can the floor drop?

A checked call costs the bound plan's data movement, the check's collective (a 4-word digest of
the check vector: on two ranks one persistent exchange with the peer, else a persistent
``Allreduce``: :mod:`linop.backends.mpi.check`) and the local work around them.

``local`` (2 ranks): the local work alone, robustly on a shared machine. After warm calls on
both ranks (the halo exchange of a 256 x 256 float64 array, width 1, grid 2 x 1), rank 0
replaces the check's persistent requests (on two ranks the receive and the send) by ones whose
``Start`` and ``Test`` do nothing (the reduced digest already holds what every rank sent) and replaces the prepared calls of the
in-place binding and of the bound plan by one C call that does nothing, then times each call's
CPU time
(``time.process_time``: time this process ran, not time it waited for the processor), minimum
over repeats, and counts the Python function calls of one checked call under ``cProfile`` (a
figure that does not depend on the machine). Rank 1 only waits.

``floors`` (2 ranks): whether the floor itself can drop: the bound plan alone, a digest's
exchange with the peer at its least Python then the bound plan, and the same with the next
call's receive kept armed (started while this call's digest is in flight: the peer's digest
then always finds its receive posted, and only the send is started before the wait), timed
interleaved (:class:`Exchange`), with the checked call.

``sizes``: the halo exchange of a float64 array of 4096 columns cut in P x 1 blocks, halo width
h = 2, 32 and 256 (each message 64 KB, 1 MB and 8 MB), forward and adjoint, on the same array.
Timed interleaved sample by sample (a sample: a batch of calls, the maximum over ranks; medians
over samples): the bound plan, the checked ``apply`` (called as a loop writes it), and the
*floor*: the check's own
collective alone (the reducer's exchange of the 4-word digest on another duplicate of the
communicator: on two ranks a persistent send to the peer and receive from it, else a
persistent ``Allreduce``, completed as the check completes it, within the default deadline)
followed by the bound plan. The floor is what any call that agrees collectively before moving data
costs at least; checked / bound above floor / bound is the check's local work. The load
average is printed with the figures, and the ratios at the 10th and 25th percentiles of the
samples (on a loaded machine the samples a descheduling spared). ``BENCH_WIDTHS=2`` (a
comma-separated list) times those halo widths only; ``BENCH_SAMPLES`` sets the samples.
"""

from __future__ import annotations

import cProfile
import functools
import os
import pstats
import sys
import time
import timeit
from collections.abc import Callable
from statistics import median

import numpy as np
from _timing import interleaved_over_ranks
from mpi4py import MPI

from linop.backends import mpi as mpi_backend
from linop.backends.mpi.check import CheckReducer
from linop.backends.mpi.deadline import resolve_timeout, wait_all
from linop.halo import HaloExchange
from linop.halo_geometry import Kernel, halo_geometry
from linop.partition import DistributedTensor, Partition

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size
NUMBER, REPEATS = 20000, 15
COLUMNS = 4096
WIDTHS = {2: 100, 32: 20, 256: 4}  # halo width: calls per sample batch
if os.environ.get("BENCH_WIDTHS"):  # e.g. BENCH_WIDTHS=2 (64 KB only)
    WIDTHS = {int(h): WIDTHS[int(h)] for h in os.environ["BENCH_WIDTHS"].split(",")}
SAMPLES = int(os.environ.get("BENCH_SAMPLES", "61"))


class _Idle:
    """A persistent request that does nothing (the reduction's result is already in place); its
    methods are C functions, as mpi4py's are, so no Python frame is counted for them."""

    Start = Wait = staticmethod(tuple)  # mpi4py's names
    Test = staticmethod(functools.partial(bool, 1))  # a call under a deadline polls


_NOTHING = ((tuple, ()),)
"""The prepared calls that replace the bindings' in ``local``: one C call that does nothing."""


def _checked(op: object, state: dict[str, np.ndarray]) -> Callable[[], object]:
    """The checked call as a loop writes it (a ``functools.partial`` with keywords would add
    the merge of its keywords, about 0.1 us here, to every call)."""
    apply = mpi_backend.apply

    def checked() -> object:
        return apply(op, state, comm=COMM, inplace=True)

    return checked


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def local_work() -> None:
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
        reducer = plan.context.reducer
        request, send = reducer.request, getattr(reducer, "digest_send", None)
        binding = plan.layouts.last[2] if plan.layouts.last is not None else None
        calls, bound_calls = (binding.calls if binding else None), bound._calls
        reducer.request = _Idle()
        if send is not None:  # two ranks: the digest's send to the peer (since 2026-12-06)
            reducer.digest_send = _Idle()
        if binding is not None:
            binding.calls = list(_NOTHING)
        bound._calls = list(_NOTHING)

        checked = _checked(op, state)

        print(
            f"local work per call, CPU time, min of {REPEATS} x {NUMBER} (MPI calls emptied; load {load()}):"
        )
        for name, function in (("checked apply", checked), ("bound plan", bound)) * 2:
            best = min(timeit.repeat(function, number=NUMBER, repeat=REPEATS, timer=time.process_time))
            print(f"  {name:14s} {best / NUMBER * 1e6:7.3f} us")
        for name, function in (("checked apply", checked), ("bound plan", bound)):
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(1000):
                function()
            profile.disable()
            counted = sum(entry[1] for entry in pstats.Stats(profile).stats.values())  # type: ignore[attr-defined]
            print(f"  {name:14s} {(counted - 1) / 1000:5.1f} function calls per call (cProfile)")
        last = getattr(plan.entry, "last", None)  # None before the repeat existed
        print(f"  calls served by the repeat: {last.hits if last is not None else 0}")
        reducer.request = request
        if send is not None:
            reducer.digest_send = send
        if binding is not None:
            binding.calls = calls
        bound._calls = bound_calls
    COMM.Barrier()
    bound.free()


class Floor:
    """The check's collective alone (the digest's exchange of a
    :class:`~linop.backends.mpi.check.CheckReducer` of its own, on a duplicate communicator,
    completed as the check completes it), then ``then``."""

    def __init__(self, then: object) -> None:
        self.then = then
        self.reducer = CheckReducer(COMM.Dup())
        self.request = self.reducer.request
        self.seconds = resolve_timeout(None)
        self.complete = getattr(self.reducer, "complete", None) or self._complete_before
        """The reducer's completion (before 2026-12-06: its private ``_complete``)."""

    def _complete_before(self, request: object, seconds: float | None, doing: str) -> None:
        complete = getattr(self.reducer, "_complete", None)
        if complete is not None:
            complete(request, seconds, doing)
        else:  # before the digest (its check vector's reduction), for comparisons
            wait_all([request], self.reducer.comm, seconds, doing)

    def __call__(self) -> None:
        exchange = getattr(self.reducer, "exchange_digest", None)  # (since 2026-12-06)
        if exchange is not None:
            exchange(self.seconds, "the floor")
        else:
            self.request.Start()
            self.complete(self.request, self.seconds, "the floor")
        if self.then is not None:
            self.then()  # type: ignore[operator]

    def free(self) -> None:
        self.reducer.free()
        self.reducer.comm.Free()


def sizes() -> None:
    if RANK == 0:
        print(
            f"halo exchange, {COLUMNS} columns, grid {SIZE}x1, on {SIZE} rank(s): median of {SAMPLES} samples, "
            f"max over ranks; deadline {resolve_timeout(None)} s; load {load()}"
        )
    rows = 1024 * SIZE
    for h, batch in WIDTHS.items():
        tensor = DistributedTensor("x", (rows, COLUMNS), Partition((SIZE, 1)))
        op = HaloExchange(halo_geometry(tensor, Kernel(2 * h + 1, padding=h)))
        (block,) = [b for b in op.domain if b.worker == RANK]
        state = {block.name: np.random.default_rng(RANK).standard_normal(block.shape)}
        reference = {block.name: state[block.name].copy()}
        for tree in (op, op.H):  # correctness first: the checked call equals the bound plan
            mpi_backend.apply(tree, state, comm=COMM, inplace=True)
            once = mpi_backend.plan_for(tree, comm=COMM).bind(reference)
            once()
            once.free()
        if not COMM.allreduce(bool(np.array_equal(state[block.name], reference[block.name])), op=MPI.LAND):
            if RANK == 0:
                print(f"  h={h}: the checked call DIFFERS from the bound plan")
            return
        for direction, tree in (("forward", op), ("adjoint", op.H)):
            bound = mpi_backend.plan_for(tree, comm=COMM).bind(state)
            floor, alone = Floor(bound), Floor(None)
            before = load()
            times = interleaved_over_ranks(
                {
                    "bound plan": bound,
                    "checked apply": _checked(tree, state),
                    "floor: collective + bound": floor,
                    "the collective alone": alone,
                },
                COMM,
                SAMPLES,
                batch,
                warmups=3,
            )
            bound.free()
            floor.free()
            alone.free()
            if RANK == 0:
                reference_time = median(times["bound plan"])
                kb = h * COLUMNS * 8 // 1024
                print(f"  {kb} KB messages, {direction} (load {before} -> {load()}):")
                for name, values in times.items():
                    ratio = median(values) / reference_time
                    print(f"    {name:27s} {median(values) * 1e6:10.1f} us   {ratio:5.2f}x bound")
                per_sample = np.asarray(times["checked apply"]) / np.asarray(times["bound plan"])
                print(f"    checked / bound, median of per-sample ratios: {median(per_sample):.2f}x")
                low = [
                    np.percentile(times[name], q) / np.percentile(times["bound plan"], q)
                    for name in ("checked apply", "floor: collective + bound")
                    for q in (10, 25)
                ]
                print(  # the low percentiles: what a loaded machine's descheduling spares most
                    f"    checked / bound at the 10th, 25th percentiles: {low[0]:.2f}x, {low[1]:.2f}x; "
                    f"floor: {low[2]:.2f}x, {low[3]:.2f}x"
                )


class Exchange:
    """The digest's exchange with the peer on two ranks at its least Python: a persistent send
    and receive of four words on a duplicate communicator, started and tested inline (no
    deadline's bookkeeping), then ``then``. ``armed=True``: two receives on two buffers, taking
    turns, the next one started while this one's digest is in flight, so that the peer's digest
    always finds its receive posted and no receive is started before the send (what a reducer
    that keeps its next receive armed between calls would cost)."""

    def __init__(self, then: Callable[[], object], armed: bool) -> None:
        self.then, self.armed = then, armed
        self.comm = COMM.Dup()
        peer, tag = 1 - RANK, 7
        self.digest = np.arange(4, dtype=np.int64)
        self.buffers = [np.zeros(4, dtype=np.int64) for _ in range(2 if armed else 1)]
        self.send = self.comm.Send_init(self.digest, peer, tag)
        self.receives = [self.comm.Recv_init(buffer, peer, tag) for buffer in self.buffers]
        self.turn = 0
        if armed:
            self.receives[0].Start()

    def __call__(self) -> None:
        send, turn = self.send, self.turn
        send.Start()
        if self.armed:
            self.receives[1 - turn].Start()  # the next call's, while this one's is in flight
            self.turn = 1 - turn
        else:
            self.receives[0].Start()
        receive = self.receives[turn]
        while not receive.Test():
            pass
        if not send.Test():
            send.Wait()
        self.then()

    def free(self) -> None:
        if self.armed:  # the armed receive: cancelled (the peer sends nothing more)
            pending = self.receives[self.turn]
            pending.Cancel()
            pending.Wait()
        for request in (self.send, *self.receives):
            request.Free()
        self.comm.Free()


def floors() -> None:
    """On two ranks, 64 KB forward (``BENCH_WIDTHS``: other widths): the bound plan, the
    exchange of a digest then the bound plan (:class:`Exchange`), the same with the next
    receive kept armed, and the checked call; interleaved, medians of per-sample ratios to
    the bound plan."""
    if SIZE != 2:
        if RANK == 0:
            print("floors: run with 2 ranks")
        return
    if RANK == 0:
        print(f"floors: halo exchange, {COLUMNS} columns, 2 ranks, {SAMPLES} samples; load {load()}")
    for h, batch in (WIDTHS if os.environ.get("BENCH_WIDTHS") else {2: WIDTHS.get(2, 100)}).items():
        tensor = DistributedTensor("x", (2048, COLUMNS), Partition((2, 1)))
        op = HaloExchange(halo_geometry(tensor, Kernel(2 * h + 1, padding=h)))
        (block,) = [b for b in op.domain if b.worker == RANK]
        state = {block.name: np.random.default_rng(RANK).standard_normal(block.shape)}
        bound = mpi_backend.plan_for(op, comm=COMM).bind(state)
        posted, armed = Exchange(bound, armed=False), Exchange(bound, armed=True)
        times = interleaved_over_ranks(
            {
                "bound plan": bound,
                "exchange + bound": posted,
                "armed exchange + bound": armed,
                "checked apply": _checked(op, state),
            },
            COMM,
            SAMPLES,
            batch,
            warmups=3,
        )
        for exchange in (posted, armed):
            exchange.free()
        bound.free()
        if RANK == 0:
            reference = np.asarray(times["bound plan"])
            print(f"  {h * COLUMNS * 8 // 1024} KB messages, forward (load {load()}):")
            for name, values in times.items():
                ratio = median(np.asarray(values) / reference)
                print(
                    f"    {name:24s} {median(values) * 1e6:10.1f} us   {ratio:5.3f}x bound (median per sample)"
                )
            armed_to_posted = np.asarray(times["armed exchange + bound"]) / np.asarray(
                times["exchange + bound"]
            )
            print(f"    armed / not armed, median per sample: {median(armed_to_posted):.3f}")


def main() -> int:
    which = sys.argv[1:] or ["local", "sizes"]
    if "floors" in which:
        floors()
    if "local" in which:
        if SIZE == 2:
            local_work()
        elif RANK == 0:
            print("local: run with 2 ranks")
    if "sizes" in which:
        sizes()
    return 0


if __name__ == "__main__":
    sys.exit(main())
