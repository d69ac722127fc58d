"""Fast paths of the MPI interpreter: native collectives and the halo exchange.

Each fast path is a *lowering* (:func:`linop.program.lowering`) that replaces a
node's expansion by steps that do the same thing with fewer, larger MPI calls; the tests under
``tests/mpi/`` prove each equal to the expansion, rank by rank.

=============================  ===============================================================
node                           MPI execution
=============================  ===============================================================
HaloStage (and its adjoint)    one phase of nonblocking point-to-point messages straight
                               between the local blocks (subarray datatypes: the bulk is never
                               copied); local pairs are plain copies (adjoint: adds and clears)
AllReduce                      ``Allreduce`` in place on a cached sub-communicator per group
                               (``Allreduce_init`` persistent requests in a bound plan)
Broadcast                      ``Bcast`` per source block on a cached sub-communicator, straight
                               from the source array (the root's copy is that array, uncopied)
SumReduce                      ``Allreduce`` per target block on a cached sub-communicator (on
                               this MPICH it reaches the sum faster than ``Reduce``); the
                               members other than the root discard their sum
other copying plans           one all-to-all when every worker gives and gets at most one block:
(repartition, scatter,         ``Alltoallw`` with subarray datatypes, or the boxes packed into one
gather, all-gather)            buffer for ``Alltoallv`` (contiguous boxes sent or received in
                               place), chosen per step by a measured rule (``alltoall_strategy``,
                               recorded as the step's ``strategy``); otherwise, and for adding
                               plans (reduce-scatter), the expansion: one phase of point-to-point
                               messages with subarray datatypes
=============================  ===============================================================

A collective fast path applies when every group has its members on distinct workers and moves
whole blocks; otherwise the lowering declines and the node runs through its expansion. Sums
run natively only for dtypes MPI can add (``REDUCIBLE``); other dtypes run the expansion, a
choice every rank makes alike because the run's dtype is agreed collectively. The collectives of
one step are blocking calls made in one global order of the groups, which cannot deadlock: the
first unfinished group in that order has all its members inside it.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ....collectives import AllGather, AllReduce, Broadcast, Planned, ReduceScatter, SumReduce
from ....halo import HaloExchange, HaloExchangeAdjoint, HaloStage, HaloStageAdjoint
from ....movement import Copy, CopyAdjoint, SendRecv, SendRecvAdjoint
from ....operator import LinearOperator
from ....partition import WorkerBox
from ....plan import Piece
from ....primitives import Allocate, Deallocate
from ....program import (
    FastPathStep,
    Local,
    Step,
    Transfer,
    batch,
    lower,
    lowering,
    lowering_mapping,
    lowering_rank,
    movement_footprint,
    note_workers,
    project,
)
from ....program.groups import CopyPairs, RootedRanks
from ....repartition import Gather, Repartition, Scatter
from ....space import Block, Region, Space
from ...host_schedule import root_buffer, store_results
from ..context import subcommunicator
from ..datatypes import byte_type, contiguous_run, element_type, mpi, predefined_type, subarray
from ..memory import new_array
from ..runtime import run_schedule
from ..steps import Action, Call, OutOfPlaceBinding, Persistent, RankStep

if TYPE_CHECKING:  # pragma: no cover - mpi4py is optional at run time
    from mpi4py.MPI import Intracomm

    from ...numpy import Workspace

__all__ = ["REDUCIBLE"]

REDUCIBLE = "bBhHiIlLqQfdFD"
"""Dtypes (numpy type characters) that the native sums use; others run the expansion."""


# -- halo exchange ---------------------------------------------------------------------------
@lowering(HaloStage)
def _halo_stage(op: HaloStage) -> list[Step]:
    """x_dst = x_src for every pair: remote pairs are messages, local pairs copies."""
    return _stage_steps(op.transfers, adjoint=False)


@lowering(HaloStageAdjoint)
def _halo_stage_adjoint(op: HaloStageAdjoint) -> list[Step]:
    """x_src += x_dst, x_dst = 0 for every pair (sent back where the pair spans two workers)."""
    return _stage_steps(op.transfers, adjoint=True)


@lowering(HaloExchange)
def _halo_exchange(op: HaloExchange) -> list[Step] | None:
    """One rank's lowering: the stages' steps it takes part in, from the geometry (its
    neighbours only, :meth:`~linop.halo.HaloExchange.worker_stages`); the global program
    lowers the stages themselves."""
    return _rank_exchange(op, adjoint=False)


@lowering(HaloExchangeAdjoint)
def _halo_exchange_adjoint(op: HaloExchangeAdjoint) -> list[Step] | None:
    """As :func:`_halo_exchange`: the adjoint stages in reverse order, H_{d-1}* first."""
    return _rank_exchange(op, adjoint=True)


def _rank_exchange(op: HaloExchange | HaloExchangeAdjoint, *, adjoint: bool) -> list[Step]:
    """The stages' steps in the order they run, each stage's messages of round its position
    in that order (the next stage's messages read or write what the previous one moved, on
    one end or the other: each rank starts a phase per stage, and posts a receive in the phase
    its sender sends it in). The global program: every stage whole; one rank's: its part."""
    rank = lowering_rank()
    if rank is None:
        stages = tuple(stage.transfers for stage in op.stages())
    else:
        partition = op.geometry.tensor.partition
        note_workers(partition.max_worker)
        if partition.position(rank) is None:
            return []
        stages = op.worker_stages(partition.index(rank))
    steps: list[Step] = []
    for depth, transfers in enumerate(reversed(stages) if adjoint else stages):
        steps.extend(_stage_steps(transfers, adjoint=adjoint, depth=depth))
    return steps


def _stage_steps(
    transfers: tuple[tuple[Region, Region], ...], *, adjoint: bool, depth: int = 0
) -> list[Step]:
    """The steps of one stage's transfers: messages (of round ``depth``) first, then the local
    pairs (as the lowerings of :class:`HaloStage` and :class:`HaloStageAdjoint` emit them)."""
    steps: list[Step] = []
    for s, d in transfers:
        if s.worker != d.worker:
            steps.append(
                Transfer(d, s, "add", "clear", depth) if adjoint else Transfer(s, d, "store", "keep", depth)
            )
    for s, d in transfers:
        if s.worker == d.worker:
            node = CopyAdjoint(s, d) if adjoint else Copy(s, d)
            steps.append(Local(node, s.worker, movement_footprint(node)))
    return steps


# -- helpers -----------------------------------------------------------------------------------
def _contiguous_owned(work: Workspace, name: str, dtype: np.dtype) -> np.ndarray:
    array = work.writable(name, dtype)
    if not array.flags.c_contiguous or array.dtype != dtype:
        array = np.ascontiguousarray(array, dtype=dtype)
        work.set(name, array)
    return array


class _Fallback:
    """A rank's schedule of a node's expansion, for dtypes MPI cannot reduce natively: built on
    first use only (building it walks the whole expansion, O(P) or more per rank)."""

    __slots__ = ("_schedule", "op", "rank")

    def __init__(self, op: LinearOperator, rank: int) -> None:
        self.op, self.rank = op, rank
        self._schedule: tuple[Any, ...] | None = None

    def schedule(self) -> tuple[Any, ...]:
        if self._schedule is None:
            self._schedule = project(batch(lower(self.op.expand())), self.rank)
        return self._schedule


def _fallback(op: LinearOperator, rank: int) -> _Fallback:
    return _Fallback(op, rank)


# -- all-reduce -------------------------------------------------------------------------------
@dataclass
class _RankAllReduce(RankStep):
    """One rank's part of an all-reduce: (block, group ranks) per group it belongs to."""

    entries: tuple[tuple[str, tuple[int, ...]], ...]
    fallback: _Fallback

    def run(self, work: Workspace, comm: Intracomm, dtype: np.dtype) -> None:
        if dtype.char not in REDUCIBLE:
            run_schedule(self.fallback.schedule(), work, comm, dtype)
            return
        lib = mpi()
        for name, ranks in self.entries:  # blocking, in the global order of the groups
            array = _contiguous_owned(work, name, dtype)
            subcommunicator(comm, ranks).Allreduce(lib.IN_PLACE, [array, predefined_type(dtype)], op=lib.SUM)

    def written(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.entries)

    def persistent(
        self, arrays: dict[str, np.ndarray], comm: Intracomm, dtype: np.dtype, *, dry: bool = False
    ) -> Persistent | None:
        """Persistent ``Allreduce_init`` requests on the caller's arrays, or None (``dry``:
        decide only, create nothing)."""
        if dtype.char not in REDUCIBLE or any(
            not arrays[name].flags.c_contiguous for name, _ in self.entries
        ):
            return None
        if dry:
            return Persistent()
        lib = mpi()
        requests = [
            subcommunicator(comm, ranks).Allreduce_init(
                lib.IN_PLACE, [arrays[name], predefined_type(dtype)], op=lib.SUM
            )
            for name, ranks in self.entries
        ]
        return Persistent(requests)


@dataclass
class _AllReduceRunner:
    op: AllReduce
    groups: tuple[tuple[tuple[str, int], ...], ...]
    workers: tuple[int, ...] = field(default=())

    def project(self, rank: int) -> _RankAllReduce:
        entries = tuple(
            (next(name for name, w in group if w == rank), tuple(w for _, w in group))
            for group in self.groups
            if any(w == rank for _, w in group)
        )
        return _RankAllReduce(entries, _fallback(self.op, rank))


@dataclass
class _Projected:
    """A fast path lowered for one rank (:func:`~linop.program.lower_for`):
    that rank's part, built without the other ranks' parts."""

    step: RankStep
    rank: int
    workers: tuple[int, ...]

    def project(self, rank: int) -> RankStep:
        if rank != self.rank:  # pragma: no cover - a rank's program is only projected onto it
            raise ValueError(f"a step lowered for rank {self.rank} projected onto rank {rank}")
        return self.step


def _nonempty(layout: Any) -> bool:
    """True when some block of a layout holds an entry."""
    if hasattr(layout, "sizes"):
        return all(sum(sizes) > 0 for sizes in layout.sizes)
    shapes = layout.shapes
    distinct = getattr(shapes, "distinct", None)  # described shapes: the few distinct ones
    return any(all(n > 0 for n in shape) for shape in (distinct() if distinct is not None else shapes))


def _rank_all_reduce(op: AllReduce, rank: int) -> list[Step]:
    """The rank's group only: its block and the workers of the indices that differ from its
    own only along the axes (members in C order along them, as :func:`reduction_groups`)."""
    partition = op.tensor.partition
    note_workers(partition.max_worker)
    if math.prod(partition.shape[a] for a in op.axes) <= 1 or not _nonempty(op.tensor):
        return []  # no group to reduce, on any rank
    entries: tuple[tuple[str, tuple[int, ...]], ...] = ()
    if partition.position(rank) is not None:
        index = partition.index(rank)
        block = op.tensor.block(index)
        if block.size:
            members = []
            for moving in itertools.product(*(range(partition.shape[a]) for a in op.axes)):
                member = list(index)
                for a, k in zip(op.axes, moving):
                    member[a] = k
                members.append(partition.worker(tuple(member)))
            entries = ((block.name, tuple(members)),)
    step = _RankAllReduce(entries, _fallback(op, rank))
    return [FastPathStep(_Projected(step, rank, (partition.max_worker,)))]


# -- all-reduce under a worker map ---------------------------------------------------------------
@dataclass
class _RankMappedAllReduce(RankStep):
    """One rank's part of an all-reduce under a worker map: per group it holds a member of (in
    the global order of the groups), its members' blocks and the distinct ranks of the group.
    The rank sums its own members locally, ``Allreduce`` runs on the sub-communicator of the
    distinct ranks (none when the group lives on this rank alone), and the sum is copied back
    into every member it holds."""

    entries: tuple[tuple[tuple[str, ...], tuple[int, ...]], ...]
    fallback: Any

    def run(self, work: Workspace, comm: Intracomm, dtype: np.dtype) -> None:
        if dtype.char not in REDUCIBLE:
            run_schedule(self.fallback(), work, comm, dtype)
            return
        for names, ranks in self.entries:  # blocking, in the global order of the groups
            arrays = [_contiguous_owned(work, name, dtype) for name in names]
            _reduce_members(arrays, ranks, comm, dtype)()

    def written(self) -> tuple[str, ...]:
        return tuple(name for names, _ in self.entries for name in names)

    def persistent(
        self, arrays: dict[str, np.ndarray], comm: Intracomm, dtype: np.dtype, *, dry: bool = False
    ) -> Persistent | None:
        """The local sums, blocking ``Allreduce`` calls and copies on the caller's arrays, in
        order (as one finishing action per group), or None for dtypes MPI cannot sum."""
        if dtype.char not in REDUCIBLE or any(
            not arrays[name].flags.c_contiguous for names, _ in self.entries for name in names
        ):
            return None
        if dry:
            return Persistent()
        finish = [
            _reduce_members([arrays[n] for n in names], ranks, comm, dtype) for names, ranks in self.entries
        ]
        return Persistent([], finish)


def _reduce_members(
    arrays: list[np.ndarray], ranks: tuple[int, ...], comm: Intracomm, dtype: np.dtype
) -> Any:
    """The action summing ``arrays`` (one rank's members of a group) into the first, then over
    ``ranks`` (its sub-communicator, when more than this rank), then copying the sum back."""
    total, others = arrays[0], arrays[1:]
    sub = subcommunicator(comm, ranks) if len(ranks) > 1 else None
    lib = mpi()
    mpi_type = predefined_type(dtype)

    def reduce() -> None:
        for other in others:
            np.add(total, other, out=total)
        if sub is not None:
            sub.Allreduce(lib.IN_PLACE, [total, mpi_type], op=lib.SUM)
        for other in others:
            np.copyto(other, total)

    return reduce


@dataclass
class _MappedAllReduceRunner:
    """The global all-reduce step under a worker map (:func:`~linop.program.lower_portable`):
    projected onto a rank through the map (``project_mapped``)."""

    op: AllReduce
    workers: tuple[int, ...] = field(default=())

    def project(self, rank: int) -> RankStep:  # pragma: no cover - only projected under a map
        raise ValueError("a mapped all-reduce is projected under its map")

    def project_mapped(self, rank: int, mapping: Any) -> _RankMappedAllReduce | None:
        op, held = self.op, set(mapping.workers_on(rank))
        entries = []
        for group in op.groups:
            blocks = [op.tensor.block(i) for i in group]
            if len(blocks) < 2 or not blocks[0].size:
                continue
            names = tuple(b.name for b in blocks if b.worker in held)
            if names:
                ranks = tuple(sorted({mapping.rank_of(b.worker) for b in blocks}))
                entries.append((names, ranks))
        if not entries:
            return None

        def fallback() -> tuple[Any, ...]:
            return project(batch(lower(op.expand())), rank, mapping)

        return _RankMappedAllReduce(tuple(entries), functools.lru_cache(maxsize=1)(fallback))


@lowering(AllReduce)
def _all_reduce(op: AllReduce) -> list[Step] | None:
    if lowering_mapping() is not None:  # a worker map: the group's workers on one rank sum locally
        if len(op.others) or math.prod(op.tensor.partition.shape[a] for a in op.axes) <= 1:
            return None
        workers = tuple(op.tensor.partition.workers)
        return [FastPathStep(_MappedAllReduceRunner(op, workers))]
    rank = lowering_rank()
    if rank is not None:
        return _rank_all_reduce(op, rank)
    groups = []
    for group in op.groups:
        members = tuple((op.tensor.block_name(i), op.tensor.block(i).worker) for i in group)
        if len({w for _, w in members}) != len(members):
            return None
        if len(members) > 1 and op.tensor.block(group[0]).size:
            groups.append(members)
    if not groups:
        return []
    workers = tuple(sorted({w for g in groups for _, w in g}))
    return [FastPathStep(_AllReduceRunner(op, tuple(groups), workers))]


# -- broadcast and sum-reduce ------------------------------------------------------------------
@dataclass(frozen=True)
class _Group:
    """One source block and its whole-block copies (broadcast), or one target block and the
    copies summed into it (sum-reduce). ``ranks[0]`` is the root."""

    root_name: str
    shape: tuple[int, ...]
    ranks: Sequence[int]
    copies: Sequence[tuple[str, int]]

    def copy_on(self, rank: int) -> list[str]:
        """The copies ``rank`` holds (none or one): from the description of a rank's own
        lowering (:class:`~linop.program.groups.CopyPairs`), else by a scan."""
        name_on = getattr(self.copies, "name_on", None)
        if name_on is not None:
            found = name_on(rank)
            return [] if found is None else [found]
        return [name for name, w in self.copies if w == rank]


def _whole_groups(op: Broadcast | SumReduce, *, reduce: bool) -> tuple[_Group, ...] | None:
    """Group a broadcast's or sum-reduce's pieces by their tensor block; None when a piece is
    not a whole block or two copies of one group share a worker."""
    domain, range_ = op.domain, op.range
    by_root: dict[str, list[tuple[str, int]]] = {}
    for piece in op.plan.pieces:
        root, copy = (piece.target, piece.source) if reduce else (piece.source, piece.target)
        root_block = (range_ if reduce else domain).block(root)
        copy_block = (domain if reduce else range_).block(copy)
        if any(piece.source_start) or any(piece.target_start) or piece.shape != root_block.shape:
            return None
        if copy_block.shape != root_block.shape:
            return None
        by_root.setdefault(root, []).append((copy, copy_block.worker))
    groups = []
    for root, copies in by_root.items():
        root_block = (range_ if reduce else domain).block(root)
        workers = [w for _, w in copies]
        if len(set(workers)) != len(workers):
            return None
        others = tuple(w for w in workers if w != root_block.worker)
        groups.append(_Group(root, root_block.shape, (root_block.worker, *others), tuple(copies)))
    return tuple(groups)


@dataclass
class _RankBroadcast(RankStep):
    groups: tuple[_Group, ...]
    rank: int
    dropped: tuple[str, ...]
    created: tuple[Block, ...]
    reduce: bool
    fallback: _Fallback

    def _mine(self) -> list[list[str]]:
        """Per group, the copies this rank holds: found once (a 1 -> P group lists P copies),
        not on every call."""
        found = self.__dict__.get("_mine_of_groups")
        if found is None:
            found = [group.copy_on(self.rank) for group in self.groups]
            self.__dict__["_mine_of_groups"] = found
        return found

    def run(self, work: Workspace, comm: Intracomm, dtype: np.dtype) -> None:
        if self.reduce and dtype.char not in REDUCIBLE:
            run_schedule(self.fallback.schedule(), work, comm, dtype)
            return
        lib = mpi()
        results: list[tuple[str, np.ndarray, bool]] = []
        for group, mine in zip(self.groups, self._mine()):  # blocking, in the global order of the groups
            sub = subcommunicator(comm, group.ranks) if len(group.ranks) > 1 else None
            is_root = group.ranks[0] == self.rank
            if self.reduce:
                self._reduce(group, sub, mine, is_root, work, dtype, results, lib)
            else:
                self._broadcast(group, sub, mine, is_root, work, dtype, results)
        store_results(work, self.dropped, results, self.created)

    def bind_out_of_place(
        self, arrays: dict[str, np.ndarray], comm: Intracomm, dtype: np.dtype, *, dry: bool = False
    ) -> OutOfPlaceBinding | None:
        """Blocking ``Bcast`` calls / persistent ``Allreduce_init`` requests between the bound input
        arrays and result arrays built once, or None when the dtype or layout does not allow
        it (``dry``: decide only, create nothing).

        The binding's results map each new block this rank owns to its array (the root's own
        broadcast copy is a read-only view of its source)."""
        if self.reduce and dtype.char not in REDUCIBLE:
            return None
        if any(a.dtype != dtype or not a.flags.c_contiguous for a in arrays.values()):
            return None
        for group in self.groups:
            root_has_copy = bool(group.copy_on(group.ranks[0]))
            if self.reduce and (not root_has_copy or len(group.ranks) == 1):
                return None  # would need zeros or a copy made on every call
        if any(b.size == 0 for b in self.created):
            return None
        if dry:  # the results' names and shapes (placeholders: untouched memory)
            names = {b.name: np.empty(b.shape, dtype=dtype) for b in self.created}
            return OutOfPlaceBinding(results=names, dropped=self.dropped)
        lib = mpi()
        requests: list[Call] = []
        results: dict[str, np.ndarray] = {}
        scratch: list[np.ndarray] = []
        for group, mine in zip(self.groups, self._mine()):
            sub = subcommunicator(comm, group.ranks) if len(group.ranks) > 1 else None
            is_root = group.ranks[0] == self.rank
            if not self.reduce:
                if is_root:
                    buffer = arrays[group.root_name]
                    if mine:
                        view = buffer.view()
                        view.flags.writeable = False
                        results[mine[0]] = view
                else:
                    buffer = np.empty(group.shape, dtype=dtype)
                    results[mine[0]] = buffer
                if sub is not None:
                    # a blocking Bcast: measured faster than a persistent Bcast_init here
                    requests.append(
                        functools.partial(sub.Bcast, [buffer, buffer.nbytes, byte_type()], root=0)
                    )
                continue
            total = np.empty(group.shape, dtype=dtype)
            mpi_type = predefined_type(dtype)
            assert sub is not None  # a group of one was declined above
            requests.append(sub.Allreduce_init([arrays[mine[0]], mpi_type], [total, mpi_type], op=lib.SUM))
            if is_root:
                results[group.root_name] = total
            else:  # the request writes into it on every call: kept alive with the binding
                scratch.append(total)
        return OutOfPlaceBinding(requests, results, self.dropped, scratch)

    def _broadcast(
        self,
        group: _Group,
        sub: Intracomm | None,
        mine: list[str],
        is_root: bool,
        work: Workspace,
        dtype: np.dtype,
        results: list[tuple[str, np.ndarray, bool]],
    ) -> None:
        """Root: send its block as it is (it also becomes the root's own copy, uncopied);
        others: receive into a new block."""
        if is_root:
            buffer, owned = root_buffer(work, group.root_name, dtype)
            if mine:
                results.append((mine[0], buffer, owned))
        else:
            buffer = new_array(group.shape, dtype)  # recycled memory: no page faults per call
            results.append((mine[0], buffer, True))
        if sub is not None and buffer.size:
            sub.Bcast([buffer, buffer.nbytes, byte_type()], root=0)

    def _reduce(
        self,
        group: _Group,
        sub: Intracomm | None,
        mine: list[str],
        is_root: bool,
        work: Workspace,
        dtype: np.dtype,
        results: list[tuple[str, np.ndarray, bool]],
        lib: Any,
    ) -> None:
        """Every member adds its copy with ``Allreduce``: on this MPICH it reaches the sum
        faster than ``Reduce`` (see benchmarks/bench_mpi_collectives.py); non-roots discard it."""
        mpi_type = predefined_type(dtype)
        total = new_array(group.shape, dtype)  # recycled memory: no page faults per call
        if mine:
            send = work.arrays[mine[0]]
            if send.dtype != dtype or not send.flags.c_contiguous:
                send = np.ascontiguousarray(send, dtype=dtype)
        else:  # the root holds no copy: it contributes zeros
            total.fill(0)
            send = None
        if sub is not None and total.size:
            if send is None:
                sub.Allreduce(lib.IN_PLACE, [total, mpi_type], op=lib.SUM)
            else:
                sub.Allreduce([send, mpi_type], [total, mpi_type], op=lib.SUM)
        elif send is not None:
            np.copyto(total, send)
        if is_root:
            results.append((group.root_name, total, True))


@dataclass
class _BroadcastRunner:
    op: Broadcast | SumReduce
    groups: tuple[_Group, ...]
    reduce: bool
    workers: tuple[int, ...] = field(default=())

    def project(self, rank: int) -> _RankBroadcast:
        plan = self.op.plan
        space = self.op.domain
        dropped = tuple(n for n in plan.dropped if space.block(n).worker == rank)
        created = tuple(b for b in plan.created if b.worker == rank)
        groups = tuple(g for g in self.groups if rank in g.ranks)
        return _RankBroadcast(groups, rank, dropped, created, self.reduce, _fallback(self.op, rank))


def _rank_broadcast(op: Broadcast | SumReduce, rank: int, *, reduce: bool) -> list[Step]:
    """The rank's groups only (the source block it holds and the source block it copies), in
    the global order of the groups (that of their first copy), and its dropped and created
    blocks; every piece of a broadcast is a whole block, so the fast path always applies."""
    tensor, copies = op.tensor, op.copies
    note_workers(max(tensor.partition.max_worker, copies.partition.max_worker))
    roots: list[tuple[int, ...]] = []
    if copies.partition.position(rank) is not None:
        roots.append(op.source_index(copies.partition.index(rank)))
    if tensor.partition.position(rank) is not None:
        own = tensor.partition.index(rank)
        if own not in roots:
            roots.append(own)
    groups = []
    for root in roots:
        block = tensor.block(root)
        members = op.copy_box(root)  # described: a 1 -> P group is never listed
        if not block.size or not len(members):  # empty blocks move nothing: no group
            continue
        ranks = RootedRanks(block.worker, members)
        first = copies.partition.flat(members.grid_index(0))
        groups.append((first, _Group(block.name, block.shape, ranks, CopyPairs(copies, members))))
    mine_x = tensor.space.owned(rank)
    mine_y = copies.space.owned(rank)
    dropped, created = (mine_y, mine_x) if reduce else (mine_x, mine_y)
    step = _RankBroadcast(
        tuple(g for _, g in sorted(groups, key=lambda pair: pair[0])),
        rank,
        tuple(b.name for b in dropped),
        created,
        reduce,
        _fallback(op, rank),
    )
    workers = (max(tensor.partition.max_worker, copies.partition.max_worker),)
    return [FastPathStep(_Projected(step, rank, workers))]


def _lower_broadcast(op: Broadcast | SumReduce, *, reduce: bool) -> list[Step] | None:
    rank = lowering_rank()
    if rank is not None:
        return _rank_broadcast(op, rank, reduce=reduce)
    groups = _whole_groups(op, reduce=reduce)
    if groups is None:
        return None
    workers = {w for g in groups for w in g.ranks}
    workers |= {b.worker for b in op.plan.created} | {op.domain.block(n).worker for n in op.plan.dropped}
    return [FastPathStep(_BroadcastRunner(op, groups, reduce, tuple(sorted(workers))))]


@lowering(Broadcast)
def _broadcast(op: Broadcast) -> list[Step] | None:
    return _lower_broadcast(op, reduce=False)


@lowering(SumReduce)
def _sum_reduce(op: SumReduce) -> list[Step] | None:
    return _lower_broadcast(op, reduce=True)


# -- planned out-of-place moves (repartition, scatter, gather, all-gather) -------------------------
Box = tuple[int, tuple[int, ...], tuple[int, ...]]
"""One piece of an all-to-all on one rank: (peer, start of the box in the block, its shape)."""

ALLTOALL_STRATEGY = "auto"
"""How an all-to-all of a copying plan moves its boxes: ``"auto"`` (each step's own choice,
:attr:`_RankAlltoall.strategy`, made by :func:`alltoall_strategy` when it is planned),
``"packed"`` or ``"subarray"`` (forced for every step run or bound after it is set: for
measurements and tests)."""

PACKED_RUNS_BELOW = 2048
"""The measured rule of :func:`alltoall_strategy`, in entries of one contiguous run of a box:
a step packs by hand (one buffer, ``Alltoallv``) when some box it sends or receives is strided
with runs shorter than this; with longer runs the subarray datatypes (``Alltoallw``) move the
data without an extra copy. When every box is contiguous the packed path copies nothing
(``Alltoallv`` straight between the blocks). Measured with ``benchmarks/bench_mpi_repartition.py``
on this MPICH (shared memory, 4 ranks on 2 cores, float32, at load averages of 22-28: best
samples): runs of 2 KB packed 1.20x faster than subarray datatypes, runs of 4 KB 0.95-1.13x
(a draw), runs of 8 KB 0.70-0.94x (the datatypes faster); an earlier quiet-machine measurement
at 4 KB runs (4096 x 4096 float32 rows to columns) found packing 1.17-1.34x faster."""


def _box_index(start: tuple[int, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(a, a + n) for a, n in zip(start, shape))


def _contiguous_offset(block: tuple[int, ...], start: tuple[int, ...], shape: tuple[int, ...]) -> int | None:
    """The offset (in entries) of a box that is one contiguous run of a C-ordered block of
    shape ``block``, or None when it is strided."""
    if contiguous_run(block, shape, 1) != math.prod(shape):
        return None
    return int(np.ravel_multi_index(start, block)) if math.prod(shape) else 0


def _shortest_strided_run(block: tuple[int, ...], boxes: tuple[Box, ...]) -> int | None:
    """Entries in the shortest contiguous run of the strided boxes, None when every box is
    contiguous."""
    runs = [
        contiguous_run(block, shape, 1)
        for _, start, shape in boxes
        if _contiguous_offset(block, start, shape) is None
    ]
    return min(runs) if runs else None


def alltoall_strategy(
    source_shape: tuple[int, ...],
    target_shape: tuple[int, ...],
    sends: tuple[Box, ...],
    receives: tuple[Box, ...],
) -> str:
    """``"packed"`` (boxes copied into one buffer, ``Alltoallv``, copied out) when some box is
    strided with contiguous runs shorter than :data:`PACKED_RUNS_BELOW` entries, or when no box
    is strided, else ``"subarray"`` (``Alltoallw`` with a subarray datatype per box): the measured
    rule (see :data:`PACKED_RUNS_BELOW`). A box contiguous in its block is never copied by
    either: the packed path sends or receives it in place when every box of that side is."""
    runs = [
        r
        for r in (_shortest_strided_run(source_shape, sends), _shortest_strided_run(target_shape, receives))
        if r is not None
    ]
    if runs and min(runs) >= PACKED_RUNS_BELOW:
        return "subarray"
    return "packed"


@dataclass
class _RankAlltoall(RankStep):
    """One rank's part of an all-to-all: boxes of its one source block sent to each peer, boxes
    of its one new block received from each peer (at most one box per peer each way). Moved by
    ``Alltoallw`` with a subarray datatype per box, or packed by hand into one buffer for
    ``Alltoallv`` (:attr:`strategy`, chosen by :func:`alltoall_strategy` from the boxes,
    overridden by :data:`ALLTOALL_STRATEGY`); both move the same entries."""

    source: str | None
    source_shape: tuple[int, ...]
    target: Block | None
    sends: tuple[Box, ...]
    receives: tuple[Box, ...]
    strategy: str = ""
    """``"packed"`` or ``"subarray"``: the measured rule's choice for these boxes."""

    def __post_init__(self) -> None:
        if not self.strategy:
            target_shape = self.target.shape if self.target is not None else ()
            self.strategy = alltoall_strategy(self.source_shape, target_shape, self.sends, self.receives)

    def chosen(self) -> str:
        """The strategy a run uses now: :attr:`strategy` unless :data:`ALLTOALL_STRATEGY` forces one."""
        return self.strategy if ALLTOALL_STRATEGY == "auto" else ALLTOALL_STRATEGY

    def run(self, work: Workspace, comm: Intracomm, dtype: np.dtype) -> None:
        if self.source is not None:
            send = work.arrays[self.source]
            if send.dtype != dtype or not send.flags.c_contiguous:
                send = np.ascontiguousarray(send, dtype=dtype)
        else:
            send = np.empty(0, dtype=dtype)
        receive = np.zeros(self.target.shape if self.target is not None else 0, dtype=dtype)
        for call in self._calls(send, receive, comm, dtype, self.chosen()):
            call()
        if self.source is not None:
            work.drop(self.source)
        if self.target is not None:
            work.set(self.target.name, receive)

    def bind_out_of_place(
        self, arrays: dict[str, np.ndarray], comm: Intracomm, dtype: np.dtype, *, dry: bool = False
    ) -> OutOfPlaceBinding | None:
        """The all-to-all from the bound source block into a result block built once (the
        packing buffers too): blocking collective calls on prebuilt arguments, and the packs
        and unpacks as prepared copies between prebuilt views."""
        send = arrays[self.source] if self.source is not None else np.empty(0, dtype=dtype)
        if send.dtype != dtype or not send.flags.c_contiguous:
            return None
        results: dict[str, np.ndarray] = {}
        receive = np.zeros(self.target.shape if self.target is not None else 0, dtype=dtype)
        if self.target is not None:
            results[self.target.name] = receive
        dropped = (self.source,) if self.source is not None else ()
        if dry:
            return OutOfPlaceBinding(results=results, dropped=dropped)
        calls: list[Call] = list(self._calls(send, receive, comm, dtype, self.chosen()))
        return OutOfPlaceBinding(calls, results, dropped)

    def _calls(
        self, send: np.ndarray, receive: np.ndarray, comm: Intracomm, dtype: np.dtype, strategy: str
    ) -> list[Action]:
        """The calls of one all-to-all from ``send`` into ``receive``, prepared."""
        if strategy == "subarray":
            return [self._alltoallw(send, receive, comm, dtype)]
        size = comm.Get_size()
        entry = element_type(dtype)
        calls: list[Action] = []
        send_side = _packed_side(send, self.sends, size, dtype, pack=True)
        receive_side = _packed_side(receive, self.receives, size, dtype, pack=False)
        calls.extend(send_side.copies)
        calls.append(
            functools.partial(
                comm.Alltoallv,
                [send_side.buffer, (send_side.counts, send_side.displacements), entry],
                [receive_side.buffer, (receive_side.counts, receive_side.displacements), entry],
            )
        )
        calls.extend(receive_side.copies)
        return calls

    def _alltoallw(self, send: np.ndarray, receive: np.ndarray, comm: Intracomm, dtype: np.dtype) -> Action:
        lib = mpi()
        size = comm.Get_size()
        send_counts, send_types = [0] * size, [lib.BYTE] * size
        for peer, start, shape in self.sends:
            send_counts[peer], send_types[peer] = 1, subarray(send.shape, start, shape, dtype)
        receive_counts, receive_types = [0] * size, [lib.BYTE] * size
        for peer, start, shape in self.receives:
            receive_counts[peer], receive_types[peer] = 1, subarray(receive.shape, start, shape, dtype)
        zeros = [0] * size
        return functools.partial(
            comm.Alltoallw,
            [send, (send_counts, zeros), send_types],
            [receive, (receive_counts, zeros), receive_types],
        )


@dataclass
class _PackedSide:
    """One side of a packed all-to-all: the buffer MPI reads or writes, the count and
    displacement (in entries) of each peer's box in it, and the copies into it (sends) or out
    of it (receives); no copies when every box is contiguous in the block (the block is the
    buffer)."""

    buffer: np.ndarray
    counts: list[int]
    displacements: list[int]
    copies: list[Action]


def _packed_side(
    block: np.ndarray, boxes: tuple[Box, ...], size: int, dtype: np.dtype, *, pack: bool
) -> _PackedSide:
    counts, displacements = [0] * size, [0] * size
    offsets = [_contiguous_offset(block.shape, start, shape) for _, start, shape in boxes]
    if all(offset is not None for offset in offsets):  # straight from or into the block
        for (peer, _, shape), offset in zip(boxes, offsets):
            counts[peer], displacements[peer] = math.prod(shape), cast(int, offset)
        return _PackedSide(block.reshape(-1) if block.ndim else block.reshape(1), counts, displacements, [])
    buffer = np.empty(sum(math.prod(shape) for _, _, shape in boxes), dtype=dtype)
    copies: list[Action] = []
    offset = 0
    for peer, start, shape in boxes:
        n = math.prod(shape)
        counts[peer], displacements[peer] = n, offset
        packed = buffer[offset : offset + n].reshape(shape)
        view = block[_box_index(start, shape)]
        copies.append(
            functools.partial(np.copyto, packed, view) if pack else functools.partial(np.copyto, view, packed)
        )
        offset += n
    return _PackedSide(buffer, counts, displacements, copies)


@dataclass
class _AlltoallwRunner:
    op: Planned
    by_worker: dict[int, tuple[str | None, Block | None]]
    workers: tuple[int, ...] = field(default=())

    def project(self, rank: int) -> _RankAlltoall:
        """Every rank of the communicator takes part (``Alltoallw`` is collective)."""
        source, target = self.by_worker.get(rank, (None, None))
        sends, receives = [], []
        domain, range_ = self.op.domain, self.op.range
        for piece in self.op.plan.pieces:
            from_worker = domain.block(piece.source).worker
            to_worker = range_.block(piece.target).worker
            if from_worker == rank:
                sends.append((to_worker, piece.source_start, piece.shape))
            if to_worker == rank:
                receives.append((from_worker, piece.target_start, piece.shape))
        shape = domain.block(source).shape if source is not None else ()
        return _RankAlltoall(source, shape, target, tuple(sends), tuple(receives))


def _rank_repartition(op: Repartition, rank: int) -> list[Step] | None:
    """A repartition without pass-through blocks always qualifies for ``Alltoallw`` (every
    worker holds at most one block of each tensor, and two blocks meet in at most one box):
    the rank's sends and receives from the 1-d overlaps of its own blocks."""
    source, destination = op.source, op.destination
    if len(op.others) or not source.ndim:
        return None
    note_workers(max(source.partition.max_worker, destination.partition.max_worker))
    name: str | None = None
    shape: tuple[int, ...] = ()
    target: Block | None = None
    sends: tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...] = ()
    receives: tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...] = ()
    if source.partition.position(rank) is not None:
        i = source.partition.index(rank)
        block = source.block(i)
        name, shape = block.name, block.shape
        sends = tuple(
            (destination.space.block(p.target).worker, p.source_start, p.shape) for p in op.pieces_from(i)
        )
    if destination.partition.position(rank) is not None:
        j = destination.partition.index(rank)
        target = destination.block(j)
        receives = tuple(
            (source.space.block(p.source).worker, p.target_start, p.shape) for p in op.pieces_into(j)
        )
    step = _RankAlltoall(name, shape, target, sends, receives)
    workers = (max(source.partition.max_worker, destination.partition.max_worker),)
    return [FastPathStep(_Projected(step, rank, workers))]


def _alltoallw_step(op: Planned, rank: int, pieces: tuple[Piece, ...], largest: int) -> FastPathStep:
    """The rank's ``Alltoallw`` from the pieces of its blocks (in plan order): its one old
    block's boxes sent, its one new block's boxes received."""
    domain, range_ = op.domain, op.range
    (old,), new = domain.owned(rank) or (None,), range_.owned(rank)
    sends = tuple(
        (range_.block(p.target).worker, p.source_start, p.shape)
        for p in pieces
        if domain.block(p.source).worker == rank
    )
    receives = tuple(
        (domain.block(p.source).worker, p.target_start, p.shape)
        for p in pieces
        if range_.block(p.target).worker == rank
    )
    step = _RankAlltoall(
        old.name if old is not None else None,
        old.shape if old is not None else (),
        new[0] if new else None,
        sends,
        receives,
    )
    return FastPathStep(_Projected(step, rank, (largest,)))


def _rank_root(op: Scatter | Gather, rank: int) -> list[Step] | None:
    """A scatter or gather without pass-through blocks is one ``Alltoallw`` (the root's worker
    gives or gets its one block, every other worker one piece): the root's worker sends or
    receives every piece, any other rank its own."""
    if len(op.others) or not op.root.ndim:
        return None
    largest = max(op.tensor.partition.max_worker, op.root.worker)
    note_workers(largest)
    return [_alltoallw_step(op, rank, op.rank_pieces(rank), largest)]


def _layout_pieces(op: Planned, rank: int) -> tuple[Piece, ...] | None:
    """The pieces of ``rank``'s blocks (:meth:`~linop.plan.Planned.rank_pieces`) of a plan
    between two layouts without pass-through blocks, or None for any other plan."""
    if len(op.others) or op.layouts() is None:
        return None
    return op.rank_pieces(rank)


def _noted_layouts(op: Planned) -> tuple[Any, Any] | None:
    """The two layouts of a plan, its largest worker noted; None over a 0-d partition."""
    source, target = op.layouts()  # type: ignore[misc]
    if not source.partition.ndim:
        return None
    note_workers(max(source.partition.max_worker, target.partition.max_worker))
    return source, target


def _rank_planned(op: Planned, rank: int, pieces: tuple[Piece, ...]) -> list[Step] | None:
    """A plan between two layouts, for one rank, from the pieces of its blocks: the rank's
    steps of the expansion (allocate its new block, its pieces in plan order, drop its old
    block), each on a space of its two blocks."""
    if _noted_layouts(op) is None:
        return None
    domain, range_ = op.domain, op.range
    steps: list[Step] = []
    for block in range_.owned(rank):
        steps.extend(lower(Allocate(Space(), block)))
    for p in pieces:
        space = Space([domain.block(p.source), range_.block(p.target)])
        old_box, new_box = space[p.source][p.source_index()], space[p.target][p.target_index()]
        remote = old_box.worker != new_box.worker
        node: LinearOperator
        if op.ADDS:
            node = SendRecvAdjoint(new_box, old_box) if remote else CopyAdjoint(new_box, old_box)
        else:
            node = SendRecv(old_box, new_box) if remote else Copy(old_box, new_box)
        steps.extend(lower(node))
    for block in domain.owned(rank):
        steps.extend(lower(Deallocate(Space([block]), block.name)))
    return steps


@lowering(Repartition)
def _repartition(op: Repartition) -> list[Step] | None:
    """One ``Alltoallw`` (see :func:`_planned`); one rank's lowering from the overlaps of its
    own blocks (:func:`_rank_repartition`)."""
    rank = lowering_rank()
    return _global_alltoallw(op) if rank is None else _rank_repartition(op, rank)


@lowering(Scatter)
@lowering(Gather)
def _scatter_gather(op: Scatter | Gather) -> list[Step] | None:
    """One ``Alltoallw`` (see :func:`_planned`); one rank's lowering from its own pieces
    (:func:`_rank_root`)."""
    rank = lowering_rank()
    return _global_alltoallw(op) if rank is None else _rank_root(op, rank)


# -- all-gather and reduce-scatter along one axis of equal shares -------------------------------
@dataclass
class _RankGather(RankStep):
    """One rank's part of an all-gather (``Allgather``) or reduce-scatter
    (``Reduce_scatter_block``) along one axis whose shares are equal: its group is a line of
    the partition, described (:class:`~linop.partition.WorkerBox`), and the member at
    coordinate ``k`` owns entries ``[k n, (k + 1) n)`` of the gathered block along ``axis``.

    ``source`` is the block the rank gives (its tensor block; a gathered block for the
    reduce-scatter) and ``target`` the block it gets; ``line`` is None on a rank outside
    the layout or whose group has one member (then the step copies or sums locally)."""

    source: str | None
    target: Block | None
    members: Sequence[int]
    axis: int
    reduce: bool
    fallback: _Fallback

    def run(self, work: Workspace, comm: Intracomm, dtype: np.dtype) -> None:
        if self.reduce and dtype.char not in REDUCIBLE:
            run_schedule(self.fallback.schedule(), work, comm, dtype)
            return
        if self.source is None or self.target is None:
            return
        send = work.arrays[self.source]
        if send.dtype != dtype or not send.flags.c_contiguous:
            send = np.ascontiguousarray(send, dtype=dtype)
        count = len(self.members)
        lib = mpi()
        sub = subcommunicator(comm, self.members)
        if self.reduce:  # the gathered block as [member, share] in C order, then summed
            lined = _by_member(send, self.axis, count)
            receive = np.empty(self.target.shape, dtype=dtype)
            mpi_type = predefined_type(dtype)
            if receive.size:
                sub.Reduce_scatter_block([lined, mpi_type], [receive, mpi_type], op=lib.SUM)
        else:
            receive = np.empty(self.target.shape, dtype=dtype)
            lined_shape = (count, *send.shape)
            direct = math.prod(receive.shape[: self.axis]) == 1  # the shares are contiguous
            gathered = receive if direct else np.empty(lined_shape, dtype=dtype)
            if receive.size:
                sub.Allgather([send, send.nbytes, byte_type()], [gathered, send.nbytes, byte_type()])
            if not direct:
                _by_member(receive, self.axis, count, out=gathered)
        work.drop(self.source)
        work.set(self.target.name, receive)


def _by_member(array: np.ndarray, axis: int, count: int, out: np.ndarray | None = None) -> np.ndarray:
    """``array`` (a gathered block) as ``[member, share]``: axis ``axis`` cut into ``count``
    equal shares and the member's index moved first (a copy unless the shares lead). With
    ``out`` (that arrangement), the reverse: ``out`` written back into ``array``."""
    shape = array.shape
    split = (*shape[:axis], count, shape[axis] // count, *shape[axis + 1 :])
    lined = np.moveaxis(array.reshape(split), axis, 0)
    if out is not None:
        lined[...] = out
        return array
    return np.ascontiguousarray(lined)


def _gather_line(op: AllGather | ReduceScatter) -> int | None:
    """The one axis of an all-gather or reduce-scatter whose native path applies (no
    pass-through blocks, one axis, equal shares along it, more than one member), or None."""
    tensor = op.tensor
    if len(op.others) or len(op.axes) != 1 or not tensor.ndim:
        return None
    (axis,) = op.axes
    sizes = tensor.sizes[axis]
    if len(sizes) < 2 or len(set(sizes)) != 1:
        return None
    return axis


def _rank_gather(op: AllGather | ReduceScatter, rank: int, axis: int) -> _RankGather:
    """The rank's native gather step: its own block, its gathered block, its line described."""
    tensor, gathered = op.tensor, op.gathered
    reduce = isinstance(op, ReduceScatter)
    source: str | None = None
    target: Block | None = None
    members: Sequence[int] = ()
    if tensor.partition.position(rank) is not None:
        index = tensor.partition.index(rank)
        mine, whole = tensor.block(index), gathered.block(index)
        source, target = (whole.name, mine) if reduce else (mine.name, whole)
        members = WorkerBox(tensor.partition, tuple(None if d == axis else i for d, i in enumerate(index)))
    return _RankGather(source, target, members, axis, reduce, _fallback(op, rank))


@dataclass
class _GatherRunner:
    op: AllGather | ReduceScatter
    axis: int
    workers: tuple[int, ...] = field(default=())

    def project(self, rank: int) -> _RankGather:
        return _rank_gather(self.op, rank, self.axis)


def _native_gather(op: AllGather | ReduceScatter) -> list[Step] | None:
    """The native step of an all-gather or reduce-scatter along one line of equal shares (one
    ``Allgather`` / ``Reduce_scatter_block`` per line, on its sub-communicator; a rank plans
    its own line only), or None for any other (the ``Alltoallw`` or the expansion)."""
    axis = _gather_line(op)
    if axis is None:
        return None
    partition = op.tensor.partition
    rank = lowering_rank()
    if rank is None:
        return [FastPathStep(_GatherRunner(op, axis, tuple(partition.workers)))]
    note_workers(partition.max_worker)
    return [FastPathStep(_Projected(_rank_gather(op, rank, axis), rank, (partition.max_worker,)))]


@lowering(ReduceScatter)
def _reduce_scatter(op: ReduceScatter) -> list[Step] | None:
    """Natively along one line of equal shares (:func:`_native_gather`); else as any plan
    (:func:`_planned`)."""
    native = _native_gather(op)
    return native if native is not None else _planned(op)


@lowering(AllGather)
def _all_gather(op: AllGather) -> list[Step] | None:
    """Natively along one line of equal shares (:func:`_native_gather`); else one
    ``Alltoallw`` (see :func:`_planned`); for one rank, from the pieces of its blocks:
    each worker gives its one block and gets its one gathered block, one piece per pair of
    workers, as the whole plan shows."""
    native = _native_gather(op)
    if native is not None:
        return native
    rank = lowering_rank()
    if rank is not None:
        pieces = _layout_pieces(op, rank)
        if pieces is not None:
            layouts = _noted_layouts(op)
            if layouts is None:
                return None
            largest = max(layouts[0].partition.max_worker, layouts[1].partition.max_worker)
            return [_alltoallw_step(op, rank, pieces, largest)]
    return _global_alltoallw(op)


@lowering(Planned)
def _planned(op: Planned) -> list[Step] | None:
    """A copying plan where every worker gives at most one block and gets at most one, and
    each pair of workers shares at most one piece: one ``Alltoallw`` with subarray datatypes
    (nothing packed by hand). Other plans run their expansion (for one rank: its own steps of
    it, :func:`_rank_planned`, when the plan is between two layouts)."""
    rank = lowering_rank()
    if rank is not None:
        pieces = _layout_pieces(op, rank)
        if pieces is not None:
            return _rank_planned(op, rank, pieces)
    return _global_alltoallw(op)


def _global_alltoallw(op: Planned) -> list[Step] | None:
    """The ``Alltoallw`` step of a plan that qualifies (see :func:`_planned`), or None."""
    plan = op.plan
    if plan.adds:
        return None
    domain, range_ = op.domain, op.range
    by_worker: dict[int, list[Any]] = {}
    for name in plan.dropped:
        block = domain.block(name)
        entry = by_worker.setdefault(block.worker, [None, None])
        if entry[0] is not None or block.ndim == 0:
            return None
        entry[0] = name
    for block in plan.created:
        entry = by_worker.setdefault(block.worker, [None, None])
        if entry[1] is not None or block.ndim == 0:
            return None
        entry[1] = block
    pairs = set()
    dropped, created = set(plan.dropped), {b.name for b in plan.created}  # once, not per piece
    for piece in plan.pieces:
        if piece.source not in dropped or piece.target not in created:
            return None
        pair = (domain.block(piece.source).worker, range_.block(piece.target).worker)
        if pair in pairs:
            return None
        pairs.add(pair)
    workers = tuple(sorted(by_worker))
    return [FastPathStep(_AlltoallwRunner(op, {w: tuple(e) for w, e in by_worker.items()}, workers))]
