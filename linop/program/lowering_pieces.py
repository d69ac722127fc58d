r"""A worker set's part of a piece movement's expansion (:class:`~linop.pieces.PieceMover`: repartition,
scatter, gather, all-gather, reduce-scatter, broadcast, sum-reduce), built from the pieces of its
own blocks, and of the all-reduce's expansion, built from its own groups.

The expansion of a movement (:meth:`~linop.pieces.PieceMovement.expand`) allocates the new blocks,
moves the pieces in movement order, and drops the old blocks. The steps that a set of workers
:math:`W` takes part in are

.. math::

    \mathrm{Allocate}(b) \text{ for the new blocks } b \text{ of } W, \qquad
    \text{the pieces } p \in \bigcup_{w \in W} \mathrm{pieces}(w)
    \text{ in movement order}, \qquad
    \mathrm{Deallocate}(a) \text{ for the old blocks } a \text{ of } W,

where :math:`\mathrm{pieces}(w)` are the pieces from or into ``w``'s blocks, found without the
whole movement (:meth:`~linop.pieces.PieceMover.rank_pieces`, the overlaps of a repartition's own
blocks, a broadcast's copies of its own blocks). Each worker's pieces come with their *order
key* (:func:`piece_order`), a total order equal to the position in
:attr:`~linop.pieces.PieceMover.movement`, and their union is put in that order. A piece between two
workers is a :class:`~linop.program.steps.Transfer` built straight from the piece's boxes
(what lowering its :class:`~linop.SendRecv` or :class:`~linop.SendRecvAdjoint` gives, with no
node built per piece); a piece within one worker is its copy node, run there.

The all-reduce's expansion (:meth:`~linop.collectives.AllReduce.expand`) reduces every group
onto its root, then broadcasts back: :math:`W`'s part is, over the groups of its workers in
the order of :func:`~linop.layout.reduction_groups`, the members' receive-sends that add
(root or member in :math:`W`), then their sends back in the same order.

So a rank under a worker map (:func:`~linop.program.lowering.lower_for_workers`) plans its
workers' part in O(their pieces): the collectives' fast-path lowerings
(:mod:`linop.program.lowering_all_to_all`, :mod:`linop.program.lowering_gather`) call :func:`workers_part`
first, and for an executor without the mapped fast paths (torch.distributed, the portable MPI
program) a broadcast, sum-reduce or all-reduce whose fast path cannot run under the map runs
its expansion, whose part is registered here
(:func:`~linop.program.lowering.expansion_part`). For one rank (:func:`piece_steps`, the
same steps for one worker) the dispatch of any movement
(:func:`~linop.program.lowering_all_to_all.lower_pieces`) builds one rank's part of the expansion.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Any

from ..collectives import AllGather, AllReduce, Broadcast, ReduceScatter, SumReduce
from ..layout import group_of, held_by_group
from ..movement import Copy, CopyAdjoint
from ..operator import LinearOperator
from ..pieces import Piece, PieceMover, make_piece, origin
from ..primitives import Allocate, Deallocate
from ..repartition import Gather, Repartition, Scatter
from ..space import Block, GridSpace, Region, Space
from .lowering import expansion_part, lower, lowering_workers, note_workers
from .steps import Step, Transfer

__all__ = ["piece_steps", "workers_part", "piece_order", "held_blocks", "all_reduce_part"]

PieceKey = Callable[[Piece], tuple[Any, ...]]
KeyedPiece = tuple[tuple[Any, ...], Piece]
"""A piece and its order key (:func:`piece_order`)."""


def piece_steps(
    op: PieceMover, created: Iterable[Block], pieces: Iterable[Piece], dropped: Iterable[Block]
) -> list[Step]:
    """The expansion's steps of some workers: allocate their new blocks ``created``, move
    ``pieces`` (in movement order), drop their old blocks ``dropped``.

    A piece between two workers is the transfer its :class:`~linop.SendRecv` lowers to
    (``x_new[box] = x_old[box]``, kept) or, for a movement that adds, its
    :class:`~linop.SendRecvAdjoint`'s (``x_new[box] += x_old[box]``, then ``x_old[box] = 0``),
    its two regions boxes of the node's domain and range; a piece within one worker is its
    :class:`~linop.Copy` (or :class:`~linop.CopyAdjoint`) on a space of its two blocks."""
    domain, range_ = op.domain, op.range
    mode, after = ("add", "clear") if op.ADDS else ("store", "keep")
    steps = _allocated(created)
    region = Region._checked  # the boxes of a movement's pieces lie inside their blocks
    for p in pieces:
        source, target = domain.block(p.source), range_.block(p.target)
        if source.worker != target.worker:
            start, shape = p.source_start, p.shape
            old = region(domain, p.source, start, tuple([a + n for a, n in zip(start, shape)]), ())
            start = p.target_start
            new = region(range_, p.target, start, tuple([a + n for a, n in zip(start, shape)]), ())
            steps.append(Transfer(old, new, mode, after))
        else:
            steps.extend(_local_piece(op, p, source, target))
    steps.extend(_dropped(dropped))
    return steps


def _allocated(created: Iterable[Block]) -> list[Step]:
    steps: list[Step] = []
    for block in created:
        steps.extend(lower(Allocate(Space(), block)))
    return steps


def _dropped(dropped: Iterable[Block]) -> list[Step]:
    steps: list[Step] = []
    for block in dropped:
        steps.extend(lower(Deallocate(Space([block]), block.name)))
    return steps


def _local_piece(op: PieceMover, p: Piece, source: Block, target: Block) -> list[Step]:
    """A piece within one worker: its copy (or, for a movement that adds, its adjoint copy) on a
    space of its two blocks, run on that worker."""
    space = Space([source, target])
    old_box, new_box = space[p.source][p.source_index()], space[p.target][p.target_index()]
    node: LinearOperator = CopyAdjoint(new_box, old_box) if op.ADDS else Copy(old_box, new_box)
    return lower(node)


def _index_of(layout: Any, space: Space, name: str) -> tuple[int, ...]:
    """The grid index of block ``name`` of ``layout`` (its worker's index in the partition)."""
    return layout.partition.index(space.block(name).worker)


def piece_order(op: PieceMover) -> PieceKey | None:
    """The order of ``op``'s movement as a key of its pieces, or None for a node whose movement order
    is not known here (then no worker set plans its part alone).

    - repartition: destination blocks in C order, then source blocks in C order
      (:func:`~linop.repartition.overlaps`): key ``(j, i)``;
    - scatter and gather: the tensor's blocks in C order: key ``(i,)``;
    - all-gather and reduce-scatter: groups in C order of the other coordinates, then the
      gathered block ``j`` and the tensor block ``i`` in C order along the axes
      (:func:`~linop.layout.reduction_groups`): key ``(j off the axes, j on them, i on them)``;
    - broadcast and sum-reduce: the copies in C order (one piece each): key ``(j,)``.
    """
    domain, range_ = op.domain, op.range
    if isinstance(op, Repartition):
        source, destination = op.source, op.destination
        return lambda p: (_index_of(destination, range_, p.target), _index_of(source, domain, p.source))
    if isinstance(op, Scatter):
        return lambda p: _index_of(op.tensor, range_, p.target)
    if isinstance(op, Gather):
        return lambda p: _index_of(op.tensor, domain, p.source)
    if isinstance(op, Broadcast):
        return lambda p: (_index_of(op.copies, range_, p.target),)
    if isinstance(op, SumReduce):
        return lambda p: (_index_of(op.copies, domain, p.source),)
    if isinstance(op, (AllGather, ReduceScatter)):
        axes = set(op.axes)
        tensor, gathered = op.tensor, op.gathered
        adds = op.ADDS  # reduce-scatter: the all-gather's pieces reversed, in the same order

        def key(p: Piece) -> tuple[Any, ...]:
            into, out_of = (p.source, p.target) if adds else (p.target, p.source)
            j = _index_of(gathered, domain if adds else range_, into)
            i = _index_of(tensor, range_ if adds else domain, out_of)
            off = tuple(k for d, k in enumerate(j) if d not in axes)
            return (off, tuple(j[d] for d in sorted(axes)), tuple(i[d] for d in sorted(axes)))

        return key
    return None


def held_blocks(side: Any, workers: frozenset[int]) -> list[Block]:
    """The blocks of one side of a movement (a layout, or a single block) on ``workers``, in the
    layout's order (its partition's: one block per worker)."""
    if isinstance(side, Block):
        return [side] if side.worker in workers else []
    partition = side.partition
    found = sorted((position, w) for w in workers if (position := partition.position(w)) is not None)
    return [side.block(partition.index(w)) for _, w in found]


def _worker_pieces(op: PieceMover, worker: int) -> tuple[Piece, ...] | None:
    """The pieces from or into ``worker``'s blocks, in movement order (without the whole movement)."""
    if isinstance(op, Repartition):
        source, destination = op.source.partition, op.destination.partition
        pieces: tuple[Piece, ...] = ()
        if source.position(worker) is not None:
            pieces += op.pieces_from(source.index(worker))
        if destination.position(worker) is not None:
            pieces += op.pieces_into(destination.index(worker))
        return pieces
    return op.rank_pieces(worker)


def _broadcast_keyed(op: Broadcast | SumReduce, worker: int) -> list[KeyedPiece]:
    """A broadcast's or sum-reduce's pieces of ``worker``'s blocks with their order keys: the
    piece into (or out of) its copy, and those of the copies of its tensor block (a root's:
    as many as its copies)."""
    copies, tensor = op.copies, op.tensor
    found: list[tuple[tuple[int, ...], Block]] = []
    if copies.partition.position(worker) is not None:
        j = copies.partition.index(worker)
        found.append((j, tensor.block(op.source_index(j))))
    if tensor.partition.position(worker) is not None:
        i = tensor.partition.index(worker)
        block = tensor.block(i)
        found.extend((j, block) for j in op.copies_of(i))
    keyed: list[KeyedPiece] = []
    for j, block in found:
        piece = make_piece(block, origin(block), copies.block_name(j), origin(block), block.shape)
        if piece is not None:
            keyed.append(((j,), piece.reversed() if op.ADDS else piece))
    return keyed


def _keyed_pieces(op: PieceMover, worker: int) -> list[KeyedPiece] | None:
    """The pieces from or into ``worker``'s blocks with their order keys, or None when the node
    cannot tell them alone."""
    if isinstance(op, (Broadcast, SumReduce)):
        return _broadcast_keyed(op, worker)
    key = piece_order(op)
    pieces = _worker_pieces(op, worker)
    if key is None or pieces is None:
        return None
    return [(key(p), p) for p in pieces]


def workers_part(op: PieceMover) -> list[Step] | None:
    """Inside :func:`~linop.program.lowering.lower_for_workers`, the portable steps of ``op``
    that the workers of :func:`~linop.program.lowering.lowering_workers` take part in, in
    program order (their largest worker noted); None elsewhere, and for a movement with
    pass-through blocks, not between two layouts or of unknown order (then the node lowers
    whole and its steps are filtered)."""
    workers = lowering_workers()
    return None if workers is None else _pieces_part(op, workers)


@expansion_part(PieceMover)
def _pieces_part(op: PieceMover, workers: frozenset[int]) -> list[Step] | None:
    """``workers``' steps of a movement's expansion (see :func:`workers_part`)."""
    if len(op.others):
        return None
    source, target = layouts = op.layouts()
    if isinstance(op, (AllGather, ReduceScatter)):
        return _gather_part(op, workers)
    mine: dict[tuple[Any, ...], Piece] = {}  # by order key: a piece between two of them once
    for worker in workers:
        keyed = _keyed_pieces(op, worker)
        if keyed is None:
            return None
        mine.update(keyed)
    note_workers(
        max(side.worker if isinstance(side, Block) else side.partition.max_worker for side in layouts)
    )
    pieces = [mine[key] for key in sorted(mine)]
    return piece_steps(op, held_blocks(target, workers), pieces, held_blocks(source, workers))


def _gather_part(op: AllGather | ReduceScatter, workers: frozenset[int]) -> list[Step]:
    r"""``workers``' steps of an all-gather's (or reduce-scatter's) expansion, group by group.

    In a group (the members :math:`m_0, m_1, \ldots` of :func:`~linop.layout.group_of`, in C
    order along the axes) the all-gather copies every member's block :math:`x_i` whole into
    every member's gathered block at :math:`x_i`'s offset along the axes,
    :math:`g_j[\mathrm{off}_i] = x_i`, in movement order: ``j`` then ``i`` in member order (the
    reduce-scatter: :math:`x_i \mathrel{+}= g_j[\mathrm{off}_i],\ g_j[\mathrm{off}_i] = 0`, in
    the same order). ``workers`` take part in the pieces into their gathered blocks (a run over
    every member) and out of their blocks (one into each other member's). Each member's
    geometry (names, shape, offset, whole region) is read once, not once per piece, and a
    piece between two workers is its transfer, built straight from those boxes: the steps
    :func:`piece_steps` gives for the pieces of :meth:`~linop.pieces.PieceMover.rank_pieces` in
    movement order (:func:`piece_order`), at a fraction of the cost per piece."""
    tensor, gathered, axes, adds = op.tensor, op.gathered, op.axes, op.ADDS
    partition = tensor.partition
    note_workers(partition.max_worker)
    tensor_space, gathered_space = (op.range, op.domain) if adds else (op.domain, op.range)
    held = held_by_group(partition, axes, workers)  # per group: the members held
    mode, after = ("add", "clear") if adds else ("store", "keep")
    region = Region._checked  # boxes inside their blocks (the movement's pieces)
    # per axis, each coordinate's offset: where its blocks go in a gathered block
    offsets = {d: (0, *itertools.accumulate(tensor.sizes[d])) for d in axes}
    zeros = (0,) * tensor.ndim
    steps = _allocated(held_blocks(tensor if adds else gathered, workers))
    for off in sorted(held):  # groups in C order of the other coordinates
        members = group_of(partition, axes, held[off][0])
        mine = set(held[off])
        blocks, wholes, names, starts, stops, filled = [], [], [], [], [], []
        for m in members:
            block = _block_at(tensor_space, tensor, m)
            start = tuple([offsets[d][m[d]] if d in offsets else 0 for d in range(len(m))])
            blocks.append(block)
            wholes.append(region(tensor_space, block.name, zeros, block.shape, ()))
            names.append(gathered.block_name(m))  # its worker: the member's (one partition)
            starts.append(start)
            stops.append(tuple([a + n for a, n in zip(start, block.shape)]))
            filled.append(0 not in block.shape)  # an empty block moves nothing
        held_positions = [k for k, m in enumerate(members) if m in mine]
        every = range(len(members))
        for k, j in enumerate(members):  # into g_j: from every member, or from the held ones
            target_worker, name = blocks[k].worker, names[k]
            for i in every if j in mine else held_positions:
                if not filled[i]:
                    continue
                box = region(gathered_space, name, starts[i], stops[i], ())
                block = blocks[i]
                if block.worker != target_worker:  # its two workers known: not read from the spaces
                    steps.append(
                        Transfer(box, wholes[i], mode, after, 0, (target_worker, block.worker))
                        if adds
                        else Transfer(wholes[i], box, mode, after, 0, (block.worker, target_worker))
                    )
                    continue
                piece = Piece(block.name, zeros, name, starts[i], block.shape)
                gathered_block = gathered_space.block(name)
                if adds:
                    steps.extend(_local_piece(op, piece.reversed(), gathered_block, block))
                else:
                    steps.extend(_local_piece(op, piece, block, gathered_block))
    steps.extend(_dropped(held_blocks(gathered if adds else tensor, workers)))
    return steps


def _block_at(space: Space, layout: Any, index: tuple[int, ...]) -> Block:
    """The block of ``layout`` at grid ``index`` in ``space`` (a grid space of the layout's
    partition makes it from the index and keeps it by name, without reading the name back)."""
    if isinstance(space, GridSpace) and space.partition == layout.partition:
        return space.block_of(index)
    return space.block(layout.block_name(index))


@expansion_part(AllReduce)
def all_reduce_part(op: AllReduce, workers: frozenset[int]) -> list[Step]:
    r"""``workers``' steps of the all-reduce's expansion (:meth:`~linop.collectives.AllReduce.expand`):
    over the groups of their blocks in the order of :func:`~linop.layout.reduction_groups`,
    each member's :math:`x_{\mathrm{root}} \mathrel{+}= x_m,\ x_m = 0` (a receive-send that
    adds) where the root or the member is theirs; then, in the same order, each such member's
    :math:`x_m = x_{\mathrm{root}}` (:meth:`~linop.collectives.AllReduce.group_moves`, as the
    expansion builds them). O(their groups' size)."""
    tensor = op.tensor
    partition = tensor.partition
    note_workers(partition.max_worker)
    axes = op.axes
    held = held_by_group(partition, axes, workers)  # per group: the members held
    reduce: list[LinearOperator] = []
    spread: list[LinearOperator] = []
    for off in sorted(held):  # the C order of the other coordinates: reduction_groups'
        first = held[off][0]
        root_index = tuple(0 if d in axes else k for d, k in enumerate(first))
        if partition.worker(root_index) in workers:  # the root's: every member, in C order
            members = group_of(partition, axes, first)[1:]
        else:  # only the members held, in C order along the axes
            members = sorted(i for i in held[off] if i != root_index)
        op.group_moves(root_index, members, reduce, spread)
    steps: list[Step] = []
    for node in reduce + spread:
        steps.extend(lower(node))
    return steps
