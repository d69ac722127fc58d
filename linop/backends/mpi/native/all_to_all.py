"""The native all-to-all of copying plans (repartition, scatter, gather, all-gather):
``Alltoallw`` with subarray datatypes or boxes packed for ``Alltoallv``, chosen per step by a
measured rule (:func:`alltoall_strategy`); and the dispatch of any
:class:`~linop.collectives.Planned` node (:func:`planned`)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ....collectives import Planned
from ....plan import Piece
from ....program import FastPathStep, Step, lowering, lowering_rank, note_workers, per_worker
from ....program.lowering_planned import planned_steps, workers_part
from ....repartition import Gather, Repartition, Scatter
from ....space import Block
from ..datatypes import contiguous_run, element_type, mpi, subarray
from ..steps import Action, Call, OutOfPlaceBinding, RankStep
from .common import Projected

if TYPE_CHECKING:  # pragma: no cover - mpi4py is optional at run time
    from mpi4py.MPI import Intracomm

    from ...numpy import Workspace

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
    return [FastPathStep(Projected(step, rank, workers))]


def alltoallw_step(op: Planned, rank: int, pieces: tuple[Piece, ...], largest: int) -> FastPathStep:
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
    return FastPathStep(Projected(step, rank, (largest,)))


def _rank_root(op: Scatter | Gather, rank: int) -> list[Step] | None:
    """A scatter or gather without pass-through blocks is one ``Alltoallw`` (the root's worker
    gives or gets its one block, every other worker one piece): the root's worker sends or
    receives every piece, any other rank its own."""
    if len(op.others) or not op.root.ndim:
        return None
    largest = max(op.tensor.partition.max_worker, op.root.worker)
    note_workers(largest)
    return [alltoallw_step(op, rank, op.rank_pieces(rank), largest)]


def layout_pieces(op: Planned, rank: int) -> tuple[Piece, ...] | None:
    """The pieces of ``rank``'s blocks (:meth:`~linop.plan.Planned.rank_pieces`) of a plan
    between two layouts without pass-through blocks, or None for any other plan."""
    if len(op.others) or op.layouts() is None:
        return None
    return op.rank_pieces(rank)


def noted_layouts(op: Planned) -> tuple[Any, Any] | None:
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
    if noted_layouts(op) is None:
        return None
    return planned_steps(op, op.range.owned(rank), pieces, op.domain.owned(rank))


@lowering(per_worker(Repartition))
def _repartition(op: Repartition) -> list[Step] | None:
    """One ``Alltoallw`` (see :func:`planned`); one rank's lowering from the overlaps of its
    own blocks (:func:`_rank_repartition`); a mapped rank's, its workers' part of the
    expansion (:func:`~linop.program.lowering_planned.workers_part`)."""
    part = workers_part(op)
    if part is not None:
        return part
    rank = lowering_rank()
    return global_alltoallw(op) if rank is None else _rank_repartition(op, rank)


@lowering(per_worker(Scatter))
@lowering(per_worker(Gather))
def _scatter_gather(op: Scatter | Gather) -> list[Step] | None:
    """One ``Alltoallw`` (see :func:`planned`); one rank's lowering from its own pieces
    (:func:`_rank_root`); a mapped rank's, its workers' part of the expansion
    (:func:`~linop.program.lowering_planned.workers_part`)."""
    part = workers_part(op)
    if part is not None:
        return part
    rank = lowering_rank()
    return global_alltoallw(op) if rank is None else _rank_root(op, rank)


# -- the dispatch of any plan ----------------------------------------------------------------
@lowering(Planned)
def planned(op: Planned) -> list[Step] | None:
    """A copying plan where every worker gives at most one block and gets at most one, and
    each pair of workers shares at most one piece: one ``Alltoallw`` with subarray datatypes
    (nothing packed by hand). Other plans run their expansion (for one rank: its own steps of
    it, :func:`_rank_planned`, when the plan is between two layouts)."""
    rank = lowering_rank()
    if rank is not None:
        pieces = layout_pieces(op, rank)
        if pieces is not None:
            return _rank_planned(op, rank, pieces)
    return global_alltoallw(op)


def global_alltoallw(op: Planned) -> list[Step] | None:
    """The ``Alltoallw`` step of a plan that qualifies (see :func:`planned`), or None."""
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
