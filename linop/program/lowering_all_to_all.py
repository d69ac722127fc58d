"""The fast-path lowering of the copying movements (repartition, scatter, gather, all-gather)
whose every worker gives at most one block and gets at most one, each pair of workers sharing
at most one piece: one all-to-all, per rank its one old block's boxes sent to each peer and its
one new block's boxes received from each peer (:class:`~linop.program.parts.AllToAllPart`);
and the dispatch of any :class:`~linop.collectives.PieceMover` node (:func:`lower_pieces`): other movements
run their expansion (for one rank, its own steps of it; for a mapped rank's workers, their part,
:func:`~linop.program.lowering_pieces.workers_part`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..collectives import PieceMover
from ..pieces import Piece
from ..repartition import Gather, Repartition, Scatter
from ..space import Block
from .lowering import lowering, lowering_rank, note_workers, per_worker
from .lowering_pieces import piece_steps, workers_part
from .parts import AllToAllPart, Projected
from .steps import FastPathStep, Step

__all__ = ["lower_pieces", "global_alltoallw", "alltoallw_step", "layout_pieces", "noted_layouts"]


@dataclass
class _AlltoallwRunner:
    op: PieceMover
    by_worker: dict[int, tuple[str | None, Block | None]]
    workers: tuple[int, ...] = field(default=())
    most_messages: int | None = None
    """The bound of :attr:`~linop.program.parts.AllToAllPart.most_messages` (a repartition's, as
    a rank's own lowering gives it; None for other movements)."""

    def project(self, rank: int) -> AllToAllPart:
        """Every rank takes part (the all-to-all is collective over all of them)."""
        source, target = self.by_worker.get(rank, (None, None))
        sends, receives = [], []
        domain, range_ = self.op.domain, self.op.range
        for piece in self.op.movement.pieces:
            from_worker = domain.block(piece.source).worker
            to_worker = range_.block(piece.target).worker
            if from_worker == rank:
                sends.append((to_worker, piece.source_start, piece.shape))
            if to_worker == rank:
                receives.append((from_worker, piece.target_start, piece.shape))
        shape = domain.block(source).shape if source is not None else ()
        return AllToAllPart(source, shape, target, tuple(sends), tuple(receives), self.most_messages)


def _rank_repartition(op: Repartition, rank: int) -> list[Step] | None:
    """A repartition without pass-through blocks always qualifies for the all-to-all (every
    worker holds at most one block of each tensor, and two blocks meet in at most one box):
    the rank's sends and receives from the 1-d overlaps of its own blocks, and the bound on any
    rank's boxes from the two decompositions (:meth:`~linop.repartition.Repartition.most_overlaps`:
    a rank sends from one block and receives into one)."""
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
    step = AllToAllPart(name, shape, target, sends, receives, sum(op.most_overlaps()))
    workers = (max(source.partition.max_worker, destination.partition.max_worker),)
    return [FastPathStep(Projected(step, rank, workers))]


def alltoallw_step(op: PieceMover, rank: int, pieces: tuple[Piece, ...], largest: int) -> FastPathStep:
    """The rank's all-to-all from the pieces of its blocks (in movement order): its one old
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
    step = AllToAllPart(
        old.name if old is not None else None,
        old.shape if old is not None else (),
        new[0] if new else None,
        sends,
        receives,
    )
    return FastPathStep(Projected(step, rank, (largest,)))


def _rank_root(op: Scatter | Gather, rank: int) -> list[Step] | None:
    """A scatter or gather without pass-through blocks is one all-to-all (the root's worker
    gives or gets its one block, every other worker one piece): the root's worker sends or
    receives every piece, any other rank its own."""
    if len(op.others) or not op.root.ndim:
        return None
    largest = max(op.tensor.partition.max_worker, op.root.worker)
    note_workers(largest)
    return [alltoallw_step(op, rank, op.rank_pieces(rank), largest)]


def layout_pieces(op: PieceMover, rank: int) -> tuple[Piece, ...] | None:
    """The pieces of ``rank``'s blocks (:meth:`~linop.pieces.PieceMover.rank_pieces`) of a movement
    between two layouts without pass-through blocks, or None for any other movement."""
    if len(op.others):
        return None
    return op.rank_pieces(rank)


def noted_layouts(op: PieceMover) -> tuple[Any, Any] | None:
    """The two layouts of a movement, its largest worker noted; None over a 0-d partition."""
    source, target = op.layouts()
    if not source.partition.ndim:
        return None
    note_workers(max(source.partition.max_worker, target.partition.max_worker))
    return source, target


def _rank_pieces(op: PieceMover, rank: int, pieces: tuple[Piece, ...]) -> list[Step] | None:
    """A movement between two layouts, for one rank, from the pieces of its blocks: the rank's
    steps of the expansion (allocate its new block, its pieces in movement order, drop its old
    block), each on a space of its two blocks."""
    if noted_layouts(op) is None:
        return None
    return piece_steps(op, op.range.owned(rank), pieces, op.domain.owned(rank))


@lowering(per_worker(Repartition))
def _repartition(op: Repartition) -> list[Step] | None:
    """One all-to-all (see :func:`lower_pieces`); one rank's lowering from the overlaps of its
    own blocks (:func:`_rank_repartition`); a mapped rank's, its workers' part of the
    expansion (:func:`~linop.program.lowering_pieces.workers_part`)."""
    part = workers_part(op)
    if part is not None:
        return part
    rank = lowering_rank()
    return global_alltoallw(op) if rank is None else _rank_repartition(op, rank)


@lowering(per_worker(Scatter))
@lowering(per_worker(Gather))
def _scatter_gather(op: Scatter | Gather) -> list[Step] | None:
    """One all-to-all (see :func:`lower_pieces`); one rank's lowering from its own pieces
    (:func:`_rank_root`); a mapped rank's, its workers' part of the expansion
    (:func:`~linop.program.lowering_pieces.workers_part`)."""
    part = workers_part(op)
    if part is not None:
        return part
    rank = lowering_rank()
    return global_alltoallw(op) if rank is None else _rank_root(op, rank)


# -- the dispatch of any movement ----------------------------------------------------------------
@lowering(PieceMover)
def lower_pieces(op: PieceMover) -> list[Step] | None:
    """A copying movement where every worker gives at most one block and gets at most one, and
    each pair of workers shares at most one piece: one all-to-all
    (:class:`~linop.program.parts.AllToAllPart`). Other movements run their expansion (for one rank: its own steps of
    it, :func:`_rank_pieces`, when the movement is between two layouts)."""
    rank = lowering_rank()
    if rank is not None:
        pieces = layout_pieces(op, rank)
        if pieces is not None:
            return _rank_pieces(op, rank, pieces)
    return global_alltoallw(op)


def global_alltoallw(op: PieceMover) -> list[Step] | None:
    """The all-to-all step of a movement that qualifies (see :func:`lower_pieces`), or None."""
    movement = op.movement
    if movement.adds:
        return None
    domain, range_ = op.domain, op.range
    by_worker: dict[int, list[Any]] = {}
    for name in movement.dropped:
        block = domain.block(name)
        entry = by_worker.setdefault(block.worker, [None, None])
        if entry[0] is not None or block.ndim == 0:
            return None
        entry[0] = name
    for block in movement.created:
        entry = by_worker.setdefault(block.worker, [None, None])
        if entry[1] is not None or block.ndim == 0:
            return None
        entry[1] = block
    pairs = set()
    dropped, created = set(movement.dropped), {b.name for b in movement.created}  # once, not per piece
    for piece in movement.pieces:
        if piece.source not in dropped or piece.target not in created:
            return None
        pair = (domain.block(piece.source).worker, range_.block(piece.target).worker)
        if pair in pairs:
            return None
        pairs.add(pair)
    workers = tuple(sorted(by_worker))
    # the bound a rank's own lowering gives (the same, whichever route a rank takes)
    most = sum(op.most_overlaps()) if isinstance(op, Repartition) and not len(op.others) else None
    return [FastPathStep(_AlltoallwRunner(op, {w: tuple(e) for w, e in by_worker.items()}, workers, most))]
