"""The native rooted groups: :class:`~linop.collectives.Broadcast` (``Bcast`` per source
block) and :class:`~linop.collectives.SumReduce` (``Allreduce`` per target block), each on a
cached sub-communicator; under a worker map the copies a rank holds are filled or summed
locally around one collective over the group's distinct ranks."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ....collectives import Broadcast, SumReduce
from ....program import (
    FastPathStep,
    Step,
    batch,
    lower,
    lowering,
    lowering_mapping,
    lowering_rank,
    note_workers,
    per_worker,
    project,
)
from ....program.groups import CopyPairs, RootedRanks, mapped_ranks
from ....program.lowering_planned import held_blocks
from ....space import Block
from ...host_schedule import root_buffer, store_results
from ..context import subcommunicator
from ..datatypes import byte_type, mpi, predefined_type
from ..memory import new_array
from ..runtime import run_schedule
from ..steps import Call, OutOfPlaceBinding, RankStep
from .common import REDUCIBLE, Fallback, Projected, fallback

if TYPE_CHECKING:  # pragma: no cover - mpi4py is optional at run time
    from mpi4py.MPI import Intracomm

    from ...numpy import Workspace


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


def _refuses(
    reduce: bool, arrays: dict[str, np.ndarray], dtype: np.dtype, created: tuple[Block, ...]
) -> bool:
    """True when a rooted step cannot bind ``arrays`` out of place: a sum in a dtype MPI does
    not reduce, an array of another dtype or not C-contiguous, or an empty new block."""
    return (
        (reduce and dtype.char not in REDUCIBLE)
        or any(a.dtype != dtype or not a.flags.c_contiguous for a in arrays.values())
        or any(b.size == 0 for b in created)
    )


def _placeholders(created: tuple[Block, ...], dtype: np.dtype, dropped: tuple[str, ...]) -> OutOfPlaceBinding:
    """A dry binding: the results' names and shapes (untouched memory), nothing bound."""
    return OutOfPlaceBinding(
        results={b.name: np.empty(b.shape, dtype=dtype) for b in created}, dropped=dropped
    )


@dataclass
class _RankBroadcast(RankStep):
    groups: tuple[_Group, ...]
    rank: int
    dropped: tuple[str, ...]
    created: tuple[Block, ...]
    reduce: bool
    fallback: Fallback

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
        if _refuses(self.reduce, arrays, dtype, self.created):
            return None
        for group in self.groups:
            root_has_copy = bool(group.copy_on(group.ranks[0]))
            if self.reduce and (not root_has_copy or len(group.ranks) == 1):
                return None  # would need zeros or a copy made on every call
        if dry:
            return _placeholders(self.created, dtype, self.dropped)
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
        return _RankBroadcast(groups, rank, dropped, created, self.reduce, fallback(self.op, rank))


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
        fallback(op, rank),
    )
    workers = (max(tensor.partition.max_worker, copies.partition.max_worker),)
    return [FastPathStep(Projected(step, rank, workers))]


# -- broadcast and sum-reduce under a worker map --------------------------------------------------
@dataclass(frozen=True)
class _MappedGroup:
    """One group as a rank under a worker map takes part in it: the root block's name and
    shape, the group's distinct ranks (the root's rank first: the sub-communicator's root 0),
    whether this rank holds the root block, and the names of the copies it holds (in the
    group's order)."""

    root_name: str
    shape: tuple[int, ...]
    ranks: Sequence[int]
    is_root: bool
    copies: tuple[str, ...]


@dataclass
class _RankMappedRooted(RankStep):
    """One rank's part of a broadcast or sum-reduce under a worker map, per group it takes
    part in (in the global order of the groups).

    Broadcast: the root's rank sends its block with one ``Bcast`` over the group's distinct
    ranks (none when the group lives on one rank); a rank's copies are the block it received
    (several copies on one rank share one read-only buffer, copied only by a later step that
    writes one, as the root's own copy is its source, read-only). Sum-reduce: a rank adds the copies it holds (zeros when it holds
    none), one ``Allreduce`` over the distinct ranks adds the ranks' partial sums, and the
    root's rank keeps the total as the root block. The same sums as the expansion's adds, in
    another order (exact for integers)."""

    groups: tuple[_MappedGroup, ...]
    dropped: tuple[str, ...]
    created: tuple[Block, ...]
    reduce: bool
    fallback: Any

    def run(self, work: Workspace, comm: Intracomm, dtype: np.dtype) -> None:
        if self.reduce and dtype.char not in REDUCIBLE:
            run_schedule(self.fallback(), work, comm, dtype)
            return
        lib = mpi()
        results: list[tuple[str, np.ndarray, bool]] = []
        for group in self.groups:  # blocking, in the global order of the groups
            sub = subcommunicator(comm, group.ranks) if len(group.ranks) > 1 else None
            if self.reduce:
                total = new_array(group.shape, dtype)
                _local_sum(total, [work.arrays[name] for name in group.copies])
                if sub is not None and total.size:
                    sub.Allreduce(lib.IN_PLACE, [total, predefined_type(dtype)], op=lib.SUM)
                if group.is_root:
                    results.append((group.root_name, total, True))
                continue
            if group.is_root:
                buffer, owned = root_buffer(work, group.root_name, dtype)
            else:
                buffer, owned = new_array(group.shape, dtype), True
            if sub is not None and buffer.size:
                sub.Bcast([buffer, buffer.nbytes, byte_type()], root=0)
            shared = owned and len(group.copies) == 1  # several copies: one read-only buffer
            results.extend((name, buffer, shared) for name in group.copies)
        store_results(work, self.dropped, results, self.created)

    def bind_out_of_place(
        self, arrays: dict[str, np.ndarray], comm: Intracomm, dtype: np.dtype, *, dry: bool = False
    ) -> OutOfPlaceBinding | None:
        """Per group one blocking collective between the bound arrays and result arrays built
        once, with the local copies or sums around it, or None when the dtype or layout does
        not allow it (``dry``: decide only, create nothing)."""
        if _refuses(self.reduce, arrays, dtype, self.created):
            return None
        if dry:
            return _placeholders(self.created, dtype, self.dropped)
        lib = mpi()
        calls: list[Call] = []
        results: dict[str, np.ndarray] = {}
        scratch: list[np.ndarray] = []
        for group in self.groups:
            sub = subcommunicator(comm, group.ranks) if len(group.ranks) > 1 else None
            if self.reduce:
                total = np.empty(group.shape, dtype=dtype)
                calls.append(functools.partial(_local_sum, total, [arrays[name] for name in group.copies]))
                if sub is not None and total.size:
                    calls.append(
                        functools.partial(
                            sub.Allreduce, lib.IN_PLACE, [total, predefined_type(dtype)], op=lib.SUM
                        )
                    )
                if group.is_root:
                    results[group.root_name] = total
                else:  # the calls write into it on every call: kept alive with the binding
                    scratch.append(total)
                continue
            buffer = arrays[group.root_name] if group.is_root else np.empty(group.shape, dtype=dtype)
            if sub is not None and buffer.size:
                calls.append(functools.partial(sub.Bcast, [buffer, buffer.nbytes, byte_type()], root=0))
            if group.is_root or len(group.copies) > 1:  # the root's source, or one buffer shared
                view = buffer.view()
                view.flags.writeable = False
                results.update((name, view) for name in group.copies)
                if not group.is_root:  # written by every call: kept alive with the binding
                    scratch.append(buffer)
            else:
                results[group.copies[0]] = buffer
        return OutOfPlaceBinding(calls, results, self.dropped, scratch)


def _local_sum(total: np.ndarray, copies: Sequence[np.ndarray]) -> None:
    """``total`` = the sum of ``copies`` (zeros when there is none)."""
    if not copies:
        total.fill(0)
    elif len(copies) == 1:
        np.copyto(total, copies[0])
    else:  # the first add writes the total: one pass over memory per copy after the first
        np.add(copies[0], copies[1], out=total)
        for other in copies[2:]:
            np.add(total, other, out=total)


@dataclass
class _MappedRootedRunner:
    """The global broadcast or sum-reduce step under a worker map
    (:func:`~linop.program.lower_portable`): projected onto a rank through the map
    (``project_mapped``), from the groups of the rank's workers only."""

    op: Broadcast | SumReduce
    reduce: bool
    workers: tuple[int, ...] = field(default=())

    def project(self, rank: int) -> RankStep:  # pragma: no cover - only projected under a map
        raise ValueError("a mapped broadcast or sum-reduce is projected under its map")

    def project_mapped(self, rank: int, mapping: Any) -> _RankMappedRooted | None:
        """The groups the rank's workers take part in (the block a worker holds, the block a
        worker's copy comes from: as :func:`_rank_broadcast` finds a rank's own), in the
        global order of the groups (that of their first copy), and the rank's dropped and
        created blocks: O(the rank's workers and the sizes of their groups)."""
        op, held = self.op, mapping.workers_on(rank)
        mine = set(held)
        tensor, copies = op.tensor, op.copies
        roots: set[tuple[int, ...]] = set()
        held_copies: dict[tuple[int, ...], list[tuple[int, str]]] = {}  # per root: (position, name)
        for worker in held:
            if (position := copies.partition.position(worker)) is not None:
                index = copies.partition.index(worker)
                root = op.source_index(index)
                roots.add(root)
                held_copies.setdefault(root, []).append((position, copies.block_name(index)))
            if tensor.partition.position(worker) is not None:
                roots.add(tensor.partition.index(worker))
        found = []
        for root in roots:
            block = tensor.block(root)
            members = op.copy_box(root)  # described: a 1 -> P group is never listed
            if not block.size or not len(members):  # empty blocks move nothing: no group
                continue
            ranks = mapped_ranks(block.worker, members, mapping)  # described runs of ranks
            names = tuple(name for _, name in sorted(held_copies.get(root, ())))  # in C order
            first = copies.partition.flat(members.grid_index(0))
            group = _MappedGroup(block.name, block.shape, ranks, ranks[0] == rank, names)
            found.append((first, group))
        groups = tuple(group for _, group in sorted(found, key=lambda pair: pair[0]))
        workers = frozenset(mine)
        sources, targets = (copies, tensor) if self.reduce else (tensor, copies)
        dropped = tuple(b.name for b in held_blocks(sources, workers))
        created = tuple(held_blocks(targets, workers))
        if not groups and not dropped and not created:
            return None

        def fallback() -> tuple[Any, ...]:
            return project(batch(lower(op.expand())), rank, mapping)

        return _RankMappedRooted(
            groups, dropped, created, self.reduce, functools.lru_cache(maxsize=1)(fallback)
        )


def _lower_broadcast(op: Broadcast | SumReduce, *, reduce: bool) -> list[Step] | None:
    if lowering_mapping() is not None:  # a worker map: a rank's copies filled or summed locally
        largest = max(op.tensor.partition.max_worker, op.copies.partition.max_worker)
        note_workers(largest)  # every piece is a whole block: the fast path always applies
        return [FastPathStep(_MappedRootedRunner(op, reduce, (largest,)))]
    rank = lowering_rank()
    if rank is not None:
        return _rank_broadcast(op, rank, reduce=reduce)
    groups = _whole_groups(op, reduce=reduce)
    if groups is None:
        return None
    workers = {w for g in groups for w in g.ranks}
    workers |= {b.worker for b in op.plan.created} | {op.domain.block(n).worker for n in op.plan.dropped}
    return [FastPathStep(_BroadcastRunner(op, groups, reduce, tuple(sorted(workers))))]


@lowering(per_worker(Broadcast))
def _broadcast(op: Broadcast) -> list[Step] | None:
    return _lower_broadcast(op, reduce=False)


@lowering(per_worker(SumReduce))
def _sum_reduce(op: SumReduce) -> list[Step] | None:
    return _lower_broadcast(op, reduce=True)
