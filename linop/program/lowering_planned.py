r"""A worker set's part of a movement plan's expansion (:class:`~linop.plan.Planned`: repartition,
scatter, gather, all-gather, reduce-scatter), built from the pieces of its own blocks.

The expansion of a plan (:meth:`~linop.plan.MovementPlan.expand`) allocates the new blocks,
moves the pieces in plan order, and drops the old blocks. The steps that a set of workers
:math:`W` takes part in are

.. math::

    \mathrm{Allocate}(b) \text{ for the new blocks } b \text{ of } W, \qquad
    \text{the pieces } p \in \bigcup_{w \in W} \mathrm{pieces}(w)
    \text{ in plan order}, \qquad
    \mathrm{Deallocate}(a) \text{ for the old blocks } a \text{ of } W,

where :math:`\mathrm{pieces}(w)` are the pieces from or into ``w``'s blocks, found without the
whole plan (:meth:`~linop.plan.Planned.rank_pieces`, or the overlaps of a repartition's own
blocks). Each worker's pieces come in plan order; their union is put in plan order by the
node's *plan key* (:func:`plan_key`), a total order equal to the position in
:attr:`~linop.plan.Planned.plan`. So a rank under a worker map
(:func:`~linop.program.lowering.lower_for_workers`) plans its workers' part in O(their pieces),
and for one rank (:func:`planned_steps`, the same steps for one worker) the MPI fast paths'
fallback builds its own part.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from ..collectives import AllGather, ReduceScatter
from ..movement import Copy, CopyAdjoint, SendRecv, SendRecvAdjoint
from ..operator import LinearOperator
from ..plan import Piece, Planned
from ..primitives import Allocate, Deallocate
from ..repartition import Gather, Repartition, Scatter
from ..space import Block, Space
from .lowering import lower, lowering_workers, note_workers
from .steps import Step

__all__ = ["planned_steps", "workers_part", "plan_key", "held_blocks"]

PieceKey = Callable[[Piece], tuple[Any, ...]]


def planned_steps(
    op: Planned, created: Iterable[Block], pieces: Iterable[Piece], dropped: Iterable[Block]
) -> list[Step]:
    """The expansion's steps of some workers: allocate their new blocks ``created``, move
    ``pieces`` (in plan order), drop their old blocks ``dropped`` (each step on a space of
    its own blocks only)."""
    domain, range_ = op.domain, op.range
    steps: list[Step] = []
    for block in created:
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
    for block in dropped:
        steps.extend(lower(Deallocate(Space([block]), block.name)))
    return steps


def _index_of(layout: Any, space: Space, name: str) -> tuple[int, ...]:
    """The grid index of block ``name`` of ``layout`` (its worker's index in the partition)."""
    return layout.partition.index(space.block(name).worker)


def plan_key(op: Planned) -> PieceKey | None:
    """The order of ``op``'s plan as a key of its pieces, or None for a node whose plan order
    is not known here (then no worker set plans its part alone).

    - repartition: destination blocks in C order, then source blocks in C order
      (:func:`~linop.repartition.overlaps`): key ``(j, i)``;
    - scatter and gather: the tensor's blocks in C order: key ``(i,)``;
    - all-gather and reduce-scatter: groups in C order of the other coordinates, then the
      gathered block ``j`` and the tensor block ``i`` in C order along the axes
      (:func:`~linop.layout.reduction_groups`): key ``(j off the axes, j on them, i on them)``.
    """
    domain, range_ = op.domain, op.range
    if isinstance(op, Repartition):
        source, destination = op.source, op.destination
        return lambda p: (_index_of(destination, range_, p.target), _index_of(source, domain, p.source))
    if isinstance(op, Scatter):
        return lambda p: _index_of(op.tensor, range_, p.target)
    if isinstance(op, Gather):
        return lambda p: _index_of(op.tensor, domain, p.source)
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
    """The blocks of one side of a plan (a layout, or a single block) on ``workers``, in the
    layout's order (its partition's: one block per worker)."""
    if isinstance(side, Block):
        return [side] if side.worker in workers else []
    partition = side.partition
    found = sorted((position, w) for w in workers if (position := partition.position(w)) is not None)
    return [side.block(partition.index(w)) for _, w in found]


def _worker_pieces(op: Planned, worker: int) -> tuple[Piece, ...] | None:
    """The pieces from or into ``worker``'s blocks, in plan order (without the whole plan)."""
    if isinstance(op, Repartition):
        source, destination = op.source.partition, op.destination.partition
        pieces: tuple[Piece, ...] = ()
        if source.position(worker) is not None:
            pieces += op.pieces_from(source.index(worker))
        if destination.position(worker) is not None:
            pieces += op.pieces_into(destination.index(worker))
        return pieces
    return op.rank_pieces(worker)


def workers_part(op: Planned) -> list[Step] | None:
    """Inside :func:`~linop.program.lowering.lower_for_workers`, the portable steps of ``op``
    that the workers of :func:`~linop.program.lowering.lowering_workers` take part in, in
    program order (their largest worker noted); None elsewhere, and for a plan with
    pass-through blocks, not between two layouts or of unknown order (then the node lowers
    whole and its steps are filtered)."""
    workers = lowering_workers()
    if workers is None or len(op.others):
        return None
    layouts, key = op.layouts(), plan_key(op)
    if layouts is None or key is None:
        return None
    source, target = layouts
    mine: set[Piece] = set()
    for worker in workers:
        pieces = _worker_pieces(op, worker)
        if pieces is None:
            return None
        mine.update(pieces)
    note_workers(
        max(side.worker if isinstance(side, Block) else side.partition.max_worker for side in layouts)
    )
    return planned_steps(
        op, held_blocks(target, workers), sorted(mine, key=key), held_blocks(source, workers)
    )
