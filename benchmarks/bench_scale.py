"""Per-rank planning cost as the job grows: what one rank spends before moving a byte.

Every rank of an MPI job builds the same tree and plans its own part of it. This script runs,
in one process and without MPI, the stages that :func:`linop.backends.mpi.plan_for`
runs on each rank, for one interior rank of a ``s x s`` grid of ``P = s**2`` workers:

``build``
    the tree (the constructor, or ``.H`` of the forward tree for the adjoint cases);
``fingerprint``
    :func:`linop.program.fingerprint` (the digest every rank checks);
``lower``
    :func:`linop.program.lower_for` (the steps the rank takes part in: what
    :func:`~linop.program.compile_for_rank` lowers for a plan);
``batch``
    :func:`linop.program.batch` of those steps (phases of transfers);
``project``
    :func:`linop.program.project` onto the rank, at grid index ``(s//2, s//2)``;
``plan``
    the :class:`~linop.backends.mpi.plan.DistributedPlan` of that program on a test
    communicator that answers as rank ``(s//2) * s + s//2`` of P would (:class:`RankOfP`; its
    context made here, the program the stages above compiled);
``apply``
    the first checked call (:meth:`~linop.backends.mpi.plan.DistributedPlan.apply`, out of
    place, on zeros);
``bind``
    :meth:`~linop.backends.mpi.plan.DistributedPlan.bind` on the same arrays (the check, the
    compiled schedule, the bundles agreed with the rank's peers);
``call``
    one call of the bound plan.

The last four need mpi4py (skipped without it, and with ``--no-bind``, ``--global`` or
``--mapped``). The test communicator runs one rank's whole path in one process: its
point-to-point messages go to and come from ``MPI.PROC_NULL`` (real requests, no data), its
collectives run on ``MPI.COMM_SELF`` (this rank's share) or are skipped where their buffers
are sized for P ranks (``Alltoallv``, ``Allgather``, ...), and its object messages are answered
as a peer that compiled the same program would answer (see :class:`RankOfP`).

``--global`` measures the global program instead (:func:`~linop.program.lower`
of every rank's steps, batched, then projected), the route plans took before issue 13.

``--mapped K`` plans under a worker map of K workers per rank, P workers on P/K ranks
(``--map-kind blocked``, the default: consecutive workers together,
:meth:`~linop.program.WorkerMap.blocked`; ``round-robin``: worker w on rank w mod P/K,
:meth:`~linop.program.WorkerMap.round_robin`), for the rank holding the interior worker: a
first stage ``map`` builds the map (described: two numbers), ``fingerprint`` adds the map's
digest, ``lower`` is the rank's workers' part (:func:`~linop.program.lower_for_workers`) for
the trees that lower per worker (since issue 24: halo exchanges, collectives and repartitions)
and the global portable program for the others (``--global``: for all, the route before issue
24), and ``project`` projects under the map. ``--portable`` lowers without the MPI's mapped
fast paths (the program a torch.distributed rank runs under a map: broadcasts and all-reduces
as their expansions' point-to-point steps, planned from the rank's workers' part).

``--cpu`` times each stage by the process's CPU time (:func:`time.process_time`) instead of
the wall clock: on a shared machine the wall clock counts the time other processes held the
cores.

The cases (2-D grids, 8 x 8 local blocks, kernel 3, padding 1): ``HaloExchange``,
``halo_windows``, ``Broadcast 1 -> P``, ``Broadcast (1,s) -> (s,s)``, ``AllReduce axis 0`` (on a tensor and on a
``BlockGrid``: groups of s members), ``AllReduce axes (0,1)`` (one group of all P workers),
``AllReduce batch norm (1,1,s,s)`` ((3, c) blocks on a (1, 1, s, s) grid reduced over every axis
but the channel axis: the statistics of a batch norm on a spatial-only partition, one group of
P),
``Repartition (s,s) -> (2s,s/2)``, and ``AllGather axis 0`` (its adjoint a reduce-scatter), each
forward and adjoint. For every stage the script prints
seconds and the peak of traced memory (``tracemalloc``, a second pass: tracing slows Python,
so the times come from an untraced pass), and the growth exponent ``k`` of ``time ~ P**k``
fitted over the two largest P (least squares over all P with ``--fit all``).

Usage::

    python benchmarks/bench_scale.py                 # P = 4 ... 4096
    python benchmarks/bench_scale.py --max 16384     # the full table (minutes on a busy machine)
    python benchmarks/bench_scale.py --min 16384 --max 1048576   # P = 16,384, 65,536, 262,144, 1,048,576
    python benchmarks/bench_scale.py --case halo_windows --no-memory
    python benchmarks/bench_scale.py --min 16384 --max 1048576 --mapped 4 --map-kind round-robin
    python benchmarks/bench_scale.py --min 16384 --max 1048576 --mapped 4 --portable --cpu
    python benchmarks/bench_scale.py --proof         # exact adjoint proofs at 1e6 - 1.44e7 entries

``--proof`` times :func:`verify.exact_adjoint` (wall seconds and the process's peak resident
memory) on ``halo_windows`` of a 1000^2 and a 3795^2 (14.4 M entries) tensor on 2 x 2, kernel
3, padding 1, and on a 3163^2 (1e7 entries) repartition from 2 x 2 to 4 x 1.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import math
import pickle
import sys
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from linop import (
    AllGather,
    AllReduce,
    BlockGrid,
    Broadcast,
    DistributedTensor,
    HaloExchange,
    Kernel,
    LinearOperator,
    Partition,
    Repartition,
    halo_geometry,
    halo_windows,
)
from linop.layout import ProductShapes
from linop.program import (
    WorkerMap,
    batch,
    fingerprint,
    lower,
    lower_for,
    lower_for_workers,
    lower_portable,
    lowers_per_worker,
    project,
)

BLOCK = 8
STAGES = ("build", "fingerprint", "lower", "batch", "project")
BIND_STAGES = ("plan", "apply", "bind", "call")


def _grid(s: int) -> DistributedTensor:
    return DistributedTensor("x", (BLOCK * s, BLOCK * s), Partition((s, s)))


def halo_exchange(s: int) -> LinearOperator:
    return HaloExchange(halo_geometry(_grid(s), Kernel(3, padding=1)))


def windows(s: int) -> LinearOperator:
    return halo_windows(_grid(s), Kernel(3, padding=1))


def broadcast_one(s: int) -> LinearOperator:
    x = DistributedTensor("x", (BLOCK, BLOCK), Partition((1, 1)))
    return Broadcast(x, Partition((s, s)), "y")


def broadcast_row(s: int) -> LinearOperator:
    x = DistributedTensor("x", (BLOCK, BLOCK * s), Partition((1, s)))
    return Broadcast(x, Partition((s, s)), "y")


def allreduce(s: int) -> LinearOperator:
    return AllReduce(_grid(s), 0)


def allreduce_block_grid(s: int) -> LinearOperator:
    return AllReduce(BlockGrid.uniform("x", Partition((s, s)), (BLOCK, BLOCK)), 0)


def allreduce_whole(s: int) -> LinearOperator:
    """One group of all P workers: the s x s grid reduced over both axes."""
    return AllReduce(_grid(s), (0, 1))


CHANNELS = 16
"""The channels of the batch-norm case (not cut: one share of all of them per worker)."""


def allreduce_batch_norm(s: int) -> LinearOperator:
    """The batch-norm statistics' shape: (3, c) blocks on a (1, 1, s, s) grid (channels not
    cut), all-reduced over every axis but the channel axis: one group of all P workers (as
    :attr:`linop.layers.BatchNorm.totals_reduction` on a spatial-only partition)."""
    grid = Partition((1, 1, s, s))
    shapes = ProductShapes(grid.shape, ((3,), (CHANNELS,), None, None))
    return AllReduce(BlockGrid("t", grid, shapes), (0, 2, 3))


def allgather(s: int) -> LinearOperator:
    return AllGather(_grid(s), 0, "g")


def repartition(s: int) -> LinearOperator:
    y = DistributedTensor("y", (BLOCK * s, BLOCK * s), Partition((2 * s, max(s // 2, 1))))
    return Repartition(_grid(s), y)


CASES: dict[str, Callable[[int], LinearOperator]] = {
    "HaloExchange": halo_exchange,
    "halo_windows": windows,
    "Broadcast 1 -> P": broadcast_one,
    "Broadcast (1,s) -> (s,s)": broadcast_row,
    "AllReduce axis 0": allreduce,
    "AllReduce axis 0 (BlockGrid)": allreduce_block_grid,
    "AllReduce axes (0,1)": allreduce_whole,
    "AllReduce batch norm (1,1,s,s)": allreduce_batch_norm,
    "Repartition (s,s) -> (2s,s/2)": repartition,
    "AllGather axis 0": allgather,
}


_HANDLES = itertools.count(-1000, -1)
"""Handles of test communicators (``py2f``): negative, so never an MPI library's own."""


class _GroupOfP:
    """An MPI group as :class:`RankOfP` makes them: the rank's position in it and its size."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def Incl(self, ranks: list[int]) -> _GroupOfP:  # noqa: N802 - mpi4py's spelling
        position = ranks.index(self.rank) if self.rank in ranks else -1
        return _GroupOfP(position, len(ranks))

    def Range_incl(self, runs: list[tuple[int, int, int]]) -> _GroupOfP:  # noqa: N802
        position, size = -1, 0
        for first, last, stride in runs:
            if position < 0 and first <= self.rank <= last and (self.rank - first) % stride == 0:
                position = size + (self.rank - first) // stride
            size += (last - first) // stride + 1
        return _GroupOfP(position, size)

    def Free(self) -> None:  # noqa: N802
        pass


class RankOfP:
    """A test communicator that answers as rank ``rank`` of a job of ``size`` ranks would, in
    one process: one rank's whole path (plan, checked call, bind, bound call) at any P.

    - point-to-point messages (``Isend``, ``Irecv``, ``Send_init``, ``Recv_init``) are real
      requests to and from ``MPI.PROC_NULL``: they complete at once and move no data;
    - collectives of fixed-size buffers (``Allreduce``, ``Allreduce_init``, ``Bcast_init``,
      ``Ibarrier``) run on ``MPI.COMM_SELF`` (the rank's own share; a broadcast's root is
      this rank); those whose buffers are sized for the group (``Alltoallv``, ``Alltoallw``,
      ``Allgather``, ``Reduce_scatter_block``) and blocking broadcasts are skipped (their
      arguments, built by linop, are what they cost here);
    - object collectives answer as every rank agreeing would (``allreduce`` gives this rank's
      value, ``allgather`` it ``size`` times) and ``alltoall`` as peers that compiled the
      same program (what this rank tells a peer about messages it sends, the peer says about
      messages it receives: the bundle agreement before issue 39);
    - an object message to a peer (``isend``) is pickled (to ``PROC_NULL``), and ``recv`` from
      that peer gives it back, unpickled: a peer that compiled the same program tells this
      rank what this rank tells it (the bundles between them, :func:`~linop.backends.mpi.
      compiled.bundle_peers`).

    :attr:`traffic` counts the bytes of the object messages and collectives (pickled), the
    measure of what binding exchanges; sub-communicators (``Create_group``) are test
    communicators of the group's size.
    """

    def __init__(self, rank: int, size: int) -> None:
        from mpi4py import MPI

        self.MPI = MPI
        self.rank, self.size = rank, size
        self.handle = next(_HANDLES)
        self.traffic = 0
        self._told: dict[int, bytes] = {}

    def _count(self, value: Any) -> bytes:
        data = pickle.dumps(value)
        self.traffic += len(data)
        return data

    def Get_rank(self) -> int:  # noqa: N802 - mpi4py's spelling
        return self.rank

    def Get_size(self) -> int:  # noqa: N802
        return self.size

    def py2f(self) -> int:
        return self.handle

    def Is_inter(self) -> bool:  # noqa: N802
        return False

    def Dup(self) -> RankOfP:  # noqa: N802
        return RankOfP(self.rank, self.size)

    def Free(self) -> None:  # noqa: N802
        pass

    def Abort(self, status: int = 1) -> None:  # noqa: N802
        raise SystemExit(f"bench_scale: the test communicator was aborted ({status})")

    def Get_attr(self, key: Any) -> Any:  # noqa: N802
        return self.MPI.COMM_SELF.Get_attr(key)

    def Get_group(self) -> _GroupOfP:  # noqa: N802
        return _GroupOfP(self.rank, self.size)

    def Create_group(self, group: _GroupOfP, tag: int = 0) -> RankOfP:  # noqa: N802
        return RankOfP(group.rank, group.size)

    # -- object collectives and messages ------------------------------------------------------
    def allreduce(self, value: Any, op: Any = None) -> Any:
        self._count(value)
        return value

    def allgather(self, value: Any) -> list[Any]:
        self._count(value)
        return [value] * self.size

    def alltoall(self, told: list[list[tuple[bool, Any]]]) -> list[list[tuple[bool, Any]]]:
        self._count(told)
        return pickle.loads(self._count([[(not sending, rest) for sending, rest in items] for items in told]))

    def isend(self, value: Any, dest: int, tag: int = 0) -> Any:
        self._told[dest] = self._count(value)
        return self.MPI.COMM_SELF.isend(value, self.MPI.PROC_NULL, tag)

    def recv(self, buf: Any = None, source: int = 0, tag: int = 0) -> Any:
        data = self._told.pop(source)
        self.traffic += len(data)
        return pickle.loads(data)

    # -- point to point: to and from nobody ---------------------------------------------------
    def Isend(self, buf: Any, dest: int, tag: int = 0) -> Any:  # noqa: N802
        return self.MPI.COMM_SELF.Isend(buf, self.MPI.PROC_NULL, tag)

    def Irecv(self, buf: Any, source: int, tag: int = 0) -> Any:  # noqa: N802
        return self.MPI.COMM_SELF.Irecv(buf, self.MPI.PROC_NULL, tag)

    def Send_init(self, buf: Any, dest: int, tag: int = 0) -> Any:  # noqa: N802
        return self.MPI.COMM_SELF.Send_init(buf, self.MPI.PROC_NULL, tag)

    def Recv_init(self, buf: Any, source: int, tag: int = 0) -> Any:  # noqa: N802
        return self.MPI.COMM_SELF.Recv_init(buf, self.MPI.PROC_NULL, tag)

    def Iprobe(self, *args: Any, **kwargs: Any) -> bool:  # noqa: N802
        return False

    # -- collectives: this rank's share -------------------------------------------------------
    def Ibarrier(self) -> Any:  # noqa: N802
        return self.MPI.COMM_SELF.Ibarrier()

    def Allreduce(self, send: Any, receive: Any, op: Any = None) -> None:  # noqa: N802
        self.MPI.COMM_SELF.Allreduce(send, receive, op=op or self.MPI.SUM)

    def Allreduce_init(self, send: Any, receive: Any, op: Any = None) -> Any:  # noqa: N802
        return self.MPI.COMM_SELF.Allreduce_init(send, receive, op=op or self.MPI.SUM)

    def Iallreduce(self, send: Any, receive: Any, op: Any = None) -> Any:  # noqa: N802
        return self.MPI.COMM_SELF.Iallreduce(send, receive, op=op or self.MPI.SUM)

    def Bcast_init(self, buf: Any, root: int = 0) -> Any:  # noqa: N802
        return self.MPI.COMM_SELF.Bcast_init(buf, 0)

    def Bcast(self, buf: Any, root: int = 0) -> None:  # noqa: N802
        pass

    def Alltoallv(self, send: Any, receive: Any) -> None:  # noqa: N802
        pass

    def Alltoallw(self, send: Any, receive: Any) -> None:  # noqa: N802
        pass

    def Allgather(self, send: Any, receive: Any) -> None:  # noqa: N802
        pass

    def Reduce_scatter_block(self, send: Any, receive: Any, op: Any = None) -> None:  # noqa: N802
        pass


def _mpi_available() -> bool:
    try:
        import mpi4py.MPI  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class Measured:
    seconds: dict[str, float]
    peak_mb: dict[str, float]
    schedule_steps: int


GLOBAL = False
"""Measure the global program (``--global``) instead of the rank's own."""

MAPPED = 0
"""Workers per rank of a worker map (``--mapped K``); 0 for none."""

MAP_KIND = "blocked"
"""The worker map of ``--mapped``: ``"blocked"`` or ``"round-robin"`` (``--map-kind``)."""

PORTABLE = False
"""Under ``--mapped``, lower without the mapped fast paths (``--portable``)."""

CLOCK: Callable[[], float] = time.perf_counter
"""The clock of the timings: the wall clock, or the process's CPU time (``--cpu``)."""

BIND = True
"""Also plan, call, bind and call bound on a test communicator (not with ``--no-bind``,
``--global`` or ``--mapped``, nor without mpi4py)."""


def _stage_names() -> tuple[str, ...]:
    names = ("map", *STAGES) if MAPPED else STAGES
    return (*names, *BIND_STAGES) if BIND else names


def _stages(build: Callable[[int], LinearOperator], s: int, adjoint: bool) -> list[tuple[str, Callable]]:
    """The stages as thunks sharing one dict of intermediate results."""
    found: dict[str, Any] = {}
    interior = (s // 2) * s + s // 2
    found["rank"], found["mapping"] = interior, None

    def worker_map() -> None:
        ranks = max(1, s * s // MAPPED)
        kind = WorkerMap.blocked if MAP_KIND == "blocked" else WorkerMap.round_robin
        found["mapping"] = mapping = kind(s * s, ranks)
        found["rank"] = mapping.rank_of(interior)

    def tree() -> None:
        op = build(s)
        found["op"] = op.H if adjoint else op

    def digest() -> None:
        mapping = found["mapping"]
        found["fp"] = fingerprint(found["op"]) + (b"" if mapping is None else mapping.description())

    def lowered() -> None:
        op: LinearOperator = found["op"]
        mapping, rank = found["mapping"], found["rank"]
        if mapping is None:
            found["lowered"] = lower(op) if GLOBAL else lower_for(op, rank)[0]
        elif GLOBAL or not lowers_per_worker(op):
            found["lowered"] = lower_portable(op, None if PORTABLE else mapping)
        else:
            lowering_map = None if PORTABLE else mapping
            found["lowered"] = lower_for_workers(op, mapping.workers_on(rank), lowering_map)[0]

    def projected() -> None:
        found["schedule"] = project(found["batched"], found["rank"], found["mapping"])

    def planned() -> None:
        found["plan"] = plan_on_rank_of_p(found["op"], found["fp"], found["schedule"], found["rank"], s * s)

    def applied() -> None:
        plan = found["plan"]
        found["state"] = state = zeros_of(plan)
        found["applied"] = plan.apply(state)

    def bound() -> None:
        found["bound"] = found["plan"].bind(found["state"])

    def called() -> None:
        found["called"] = found["bound"]()

    stages: list[tuple[str, Callable]] = [("map", worker_map)] if MAPPED else []
    binding: list[tuple[str, Callable]] = (
        [("plan", planned), ("apply", applied), ("bind", bound), ("call", called)] if BIND else []
    )
    return [
        *stages,
        ("build", tree),
        ("fingerprint", digest),
        ("lower", lowered),
        ("batch", lambda: found.__setitem__("batched", batch(found["lowered"]))),
        ("project", projected),
        *binding,
        ("", lambda: found.__setitem__("steps", len(found["schedule"]))),
    ], found  # type: ignore[return-value]


def plan_on_rank_of_p(op: LinearOperator, digest: bytes, schedule: tuple, rank: int, size: int) -> Any:
    """The :class:`~linop.backends.mpi.plan.DistributedPlan` of ``op`` on rank ``rank`` of a
    test communicator of ``size`` ranks (:class:`RankOfP`, its context made here), from the
    fingerprint and schedule compiled already (as :func:`~linop.backends.mpi.plan_for`
    would compile them, its fast-path parts turned into MPI steps: kept in its program cache
    first)."""
    from linop.backends.mpi import plan as mpi_plan
    from linop.backends.mpi.context import CommContext
    from linop.backends.mpi.native import mpi_schedule
    from linop.program import RankProgram

    compiled = mpi_plan.Compiled.__new__(mpi_plan.Compiled)
    compiled.fingerprint = digest
    compiled.ranks = {rank: (RankProgram(mpi_schedule(schedule), size - 1), None)}
    mpi_plan._PROGRAMS.put(op, compiled)
    return mpi_plan.DistributedPlan(op, CommContext(RankOfP(rank, size)))  # type: ignore[arg-type]


def zeros_of(plan: Any) -> dict[str, Any]:
    """Zeros (float64) for the plan's rank's domain blocks."""
    import numpy as np

    return {name: np.zeros(block.shape) for name, block in plan.domain_blocks.items()}


def release(found: dict[str, Any]) -> None:
    """Free what the binding stages made (requests, the test communicator's context)."""
    bound, plan = found.get("bound"), found.get("plan")
    if bound is not None:
        bound.free()
    if plan is not None:
        plan.context.free()


def measure(build: Callable[[int], LinearOperator], s: int, adjoint: bool, memory: bool) -> Measured:
    seconds: dict[str, float] = {}
    stages, found = _stages(build, s, adjoint)
    gc.collect()
    for name, run in stages:
        start = CLOCK()
        run()
        if name:
            seconds[name] = CLOCK() - start
    steps = int(found["steps"])
    release(found)
    peaks: dict[str, float] = {}
    if memory:
        del found
        stages, found = _stages(build, s, adjoint)
        gc.collect()
        tracemalloc.start()
        for name, run in stages:
            tracemalloc.reset_peak()
            run()
            if name:
                peaks[name] = tracemalloc.get_traced_memory()[1] / 1e6
        tracemalloc.stop()
        release(found)
    return Measured(seconds, peaks, steps)


def exponent(sizes: list[int], values: list[float], fit: str) -> float:
    """Least-squares slope of log(value) against log(P) (the two largest P unless ``fit='all'``)."""
    pairs = [(math.log(p), math.log(max(v, 1e-7))) for p, v in zip(sizes, values)]
    if fit != "all":
        pairs = pairs[-2:]
    if len(pairs) < 2:
        return float("nan")
    mx = sum(x for x, _ in pairs) / len(pairs)
    my = sum(y for _, y in pairs) / len(pairs)
    den = sum((x - mx) ** 2 for x, _ in pairs)
    return sum((x - mx) * (y - my) for x, y in pairs) / den


def proofs() -> None:
    import resource

    import verify

    def windows_of(n: int) -> LinearOperator:
        return halo_windows(DistributedTensor("x", (n, n), Partition((2, 2))), Kernel(3, padding=1))

    def repartition_of(n: int) -> LinearOperator:
        x = DistributedTensor("x", (n, n), Partition((2, 2)))
        return Repartition(x, DistributedTensor("y", (n, n), Partition((4, 1))))

    cases = [
        ("halo_windows, 1e6 entries", windows_of, 1000),
        ("repartition 2x2 -> 4x1, 1e7 entries", repartition_of, 3163),
        ("halo_windows, 14.4 M entries", windows_of, 3795),
    ]
    print("exact adjoint proofs (verify.exact_adjoint), wall seconds and peak RSS of the process:")
    for what, build, n in cases:
        op = build(n)
        start = time.perf_counter()
        proof = verify.exact_adjoint(op)
        elapsed = time.perf_counter() - start
        assert proof, proof
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3
        print(f"  {what:40s} {elapsed:7.2f} s   peak RSS so far {peak:7.0f} MB")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--max", type=int, default=4096, help="largest P (a power of 4); default 4096")
    parser.add_argument("--min", type=int, default=4, help="smallest P; default 4")
    parser.add_argument("--case", action="append", help="run only these cases (repeatable; substring)")
    parser.add_argument("--no-adjoint", action="store_true", help="forward trees only")
    parser.add_argument("--no-memory", action="store_true", help="skip the traced-memory pass")
    parser.add_argument("--fit", choices=("last", "all"), default="last")
    parser.add_argument("--proof", action="store_true", help="time the exact adjoint proofs instead")
    parser.add_argument("--global", dest="whole", action="store_true", help="the global program's route")
    parser.add_argument("--mapped", type=int, default=0, metavar="K", help="K workers per rank under a map")
    parser.add_argument(
        "--map-kind", choices=("blocked", "round-robin"), default="blocked", help="the map of --mapped"
    )
    parser.add_argument("--portable", action="store_true", help="under --mapped: no mapped fast paths")
    parser.add_argument(
        "--cpu", action="store_true", help="time by the process's CPU time, not the wall clock"
    )
    parser.add_argument(
        "--no-bind", action="store_true", help="skip the plan, apply, bind and call stages (mpi4py)"
    )
    args = parser.parse_args()
    global GLOBAL, MAPPED, MAP_KIND, PORTABLE, CLOCK, BIND
    GLOBAL, MAPPED, MAP_KIND, PORTABLE = args.whole, args.mapped, args.map_kind, args.portable
    BIND = not (args.no_bind or args.whole or args.mapped) and _mpi_available()
    CLOCK = time.process_time if args.cpu else time.perf_counter
    if args.proof:
        proofs()
        return
    sides = [s for s in (2**k for k in range(1, 11)) if args.min <= s * s <= args.max]
    cases = {n: f for n, f in CASES.items() if not args.case or any(c in n for c in args.case)}
    summary: list[tuple[str, int, float, float]] = []
    for build in cases.values():  # warm-up: the interpreters' handler modules load on first use
        measure(build, 2, True, memory=False)
    for name, build in cases.items():
        for adjoint in (False,) if args.no_adjoint else (False, True):
            label = f"{name}{' (adjoint)' if adjoint else ''}"
            print(f"\n{label}")
            names = _stage_names()
            header = "      P " + "".join(f"{stage:>13}" for stage in names) + "      total   peak MB  steps"
            print(header)
            sizes, totals, per_stage = [], [], {stage: [] for stage in names}
            for s in sides:
                m = measure(build, s, adjoint, not args.no_memory)
                total = sum(m.seconds.values())
                peak = max(m.peak_mb.values(), default=float("nan"))
                cells = "".join(
                    f"{m.seconds[stage]:8.4f}s/{m.peak_mb.get(stage, float('nan')):3.0f}M"
                    if not args.no_memory
                    else f"{m.seconds[stage]:12.4f}s"
                    for stage in names
                )
                print(f"{s * s:7d} {cells} {total:9.3f}s {peak:9.1f} {m.schedule_steps:6d}", flush=True)
                sizes.append(s * s)
                totals.append(total)
                for stage in names:
                    per_stage[stage].append(m.seconds[stage])
                summary.append((label, s * s, total, peak))
            fits = "".join(f"{exponent(sizes, per_stage[stage], args.fit):13.2f}" for stage in names)
            print(f"      k {fits} {exponent(sizes, totals, args.fit):9.2f}   (time ~ P**k)")
    largest = max(s * s for s in sides)
    print(f"\nsummary at P = {largest}: seconds / peak MB per rank (all stages)")
    for label, p, total, peak in summary:
        if p == largest:
            print(f"  {label:42s} {total:8.3f} s  {peak:8.1f} MB")


if __name__ == "__main__":
    try:
        main()  # each row is printed (flushed) as soon as it is measured: the progress
    except KeyboardInterrupt:
        print("\nbench_scale: interrupted (Ctrl-C); the rows above are complete", file=sys.stderr)
        sys.exit(130)
