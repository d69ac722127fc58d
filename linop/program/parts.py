"""The engine-neutral rank parts of the collectives' fast paths: what one rank does, as data.

A fast-path lowering (:mod:`linop.program.lowering_all_reduce`,
:mod:`linop.program.lowering_rooted`, :mod:`linop.program.lowering_gather`,
:mod:`linop.program.lowering_all_to_all`) emits a :class:`~linop.program.steps.FastPathStep`
whose runner gives each rank one of the frozen parts below (a closed union, :data:`Part`): its
groups with their ranks and roots, the blocks it gives and gets, its sends and receives per
peer. Every executor reads a part the same way and turns it into its own calls through a table
from part type to calls (the MPI executor's: :mod:`linop.backends.mpi.native`); an executor
without a row for a part runs the portable program (:func:`~linop.program.lower_portable`).

==============================  ====================================================================
part                            what the rank does (in the global order of the groups)
==============================  ====================================================================
:class:`AllReducePart`          per group it belongs to: sum its block with the group's, in place
:class:`MappedAllReducePart`    under a worker map, per group: sum its members' blocks locally, then
                                over the group's distinct ranks, and copy the sum back
:class:`RootedPart`             per group: the root's block copied whole into every copy
                                (broadcast), or the copies summed into the root's block (sum-reduce)
:class:`MappedRootedPart`       the same under a worker map, a rank's copies filled or summed
                                locally
:class:`LineGatherPart`         an all-gather or reduce-scatter along one line of equal shares
:class:`LineReduceScatterPart`  a reduce-scatter along one line of uneven shares (some empty)
:class:`AllToAllPart`           one all-to-all: boxes of its one old block sent to each peer, boxes
                                of its one new block received from each peer (with a bound on
                                any rank's boxes, alike on every rank)
==============================  ====================================================================

Each part that sums carries ``fallback``: the rank's schedule of the node's expansion, built on
first use, for dtypes an executor cannot sum natively. Parts are frozen dataclasses without
slots, so that ``vars(part)`` lists their fields (the fields are the description).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..operator import LinearOperator
from ..space import Block
from .batching import batch
from .lowering import lower
from .projection import project
from .steps import RankPart

__all__ = [
    "Fallback",
    "Projected",
    "PeerBox",
    "AllReducePart",
    "MappedAllReducePart",
    "RootedGroup",
    "RootedPart",
    "MappedRootedGroup",
    "MappedRootedPart",
    "LineGatherPart",
    "LineReduceScatterPart",
    "AllToAllPart",
    "Part",
]

PeerBox = tuple[int, tuple[int, ...], tuple[int, ...]]
"""One box of an all-to-all on one rank: (peer, start of the box in the block, its shape)."""


class Fallback:
    """A rank's schedule of a node's expansion, for dtypes an executor cannot sum natively:
    built on first use only (building it walks the whole expansion, O(P) or more per rank)."""

    __slots__ = ("_schedule", "op", "rank")

    def __init__(self, op: LinearOperator, rank: int) -> None:
        self.op, self.rank = op, rank
        self._schedule: tuple[Any, ...] | None = None

    def schedule(self) -> tuple[Any, ...]:
        if self._schedule is None:
            self._schedule = project(batch(lower(self.op.expand())), self.rank)
        return self._schedule


@dataclass
class Projected:
    """A fast path lowered for one rank (:func:`~linop.program.lower_for`): that rank's part,
    built without the other ranks' parts (a :class:`~linop.program.steps.FastPathRunner`)."""

    step: RankPart
    rank: int
    workers: tuple[int, ...]

    def project(self, rank: int) -> RankPart:
        if rank != self.rank:  # pragma: no cover - a rank's program is only projected onto it
            raise ValueError(f"a step lowered for rank {self.rank} projected onto rank {rank}")
        return self.step


@dataclass(frozen=True)
class AllReducePart(RankPart):
    r"""One rank's part of an all-reduce (:class:`~linop.collectives.AllReduce`): per group it
    belongs to, in the global order of the groups, ``(its block, the group's ranks)``; the rank
    replaces its block :math:`x_m` by :math:`\sum_{k \in \text{group}} x_k`. A rank's own
    lowering describes the ranks (a :class:`~linop.partition.WorkerBox` of the partition:
    length, membership and runs in O(ndim)); the global program lists them."""

    entries: tuple[tuple[str, Sequence[int]], ...]
    fallback: Fallback = field(compare=False, repr=False)


@dataclass(frozen=True)
class MappedAllReducePart(RankPart):
    """One rank's part of an all-reduce under a worker map: per group it holds a member of (in
    the global order of the groups), ``(its members' blocks, the group's distinct ranks)``. The
    rank sums its own members locally, then over the distinct ranks (no call when the group
    lives on this rank alone), and copies the sum back into every member it holds.
    ``fallback()`` gives the rank's schedule of the expansion under the map (cached). The
    distinct ranks are described (:class:`~linop.program.groups.MappedRanks`, increasing)."""

    entries: tuple[tuple[tuple[str, ...], Sequence[int]], ...]
    fallback: Callable[[], tuple[Any, ...]] = field(compare=False, repr=False)


@dataclass(frozen=True)
class RootedGroup:
    """One source block and its whole-block copies (broadcast), or one target block and the
    copies summed into it (sum-reduce). ``ranks[0]`` is the root; ``copies`` are
    ``(name, worker)`` pairs (described for a rank's own lowering,
    :class:`~linop.program.groups.CopyPairs`)."""

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


@dataclass(frozen=True)
class RootedPart(RankPart):
    """One rank's part of a broadcast (``reduce=False``) or sum-reduce (``reduce=True``): the
    groups it takes part in (in the global order of the groups), the blocks it drops and the
    new blocks it creates."""

    groups: tuple[RootedGroup, ...]
    rank: int
    dropped: tuple[str, ...]
    created: tuple[Block, ...]
    reduce: bool
    fallback: Fallback = field(compare=False, repr=False)


@dataclass(frozen=True)
class MappedRootedGroup:
    """One group as a rank under a worker map takes part in it: the root block's name and
    shape, the group's distinct ranks (the root's rank first), whether this rank holds the root
    block, and the names of the copies it holds (in the group's order)."""

    root_name: str
    shape: tuple[int, ...]
    ranks: Sequence[int]
    is_root: bool
    copies: tuple[str, ...]


@dataclass(frozen=True)
class MappedRootedPart(RankPart):
    """One rank's part of a broadcast or sum-reduce under a worker map, per group it takes part
    in (in the global order of the groups). Broadcast: the root's rank sends its block to the
    group's other ranks, and a rank's copies are the block it received. Sum-reduce: a rank adds
    the copies it holds (zeros when none), the ranks' partial sums are added over the group's
    distinct ranks, and the root's rank keeps the total as the root block: the expansion's sums
    in another order (exact for integers). ``fallback()`` as in :class:`MappedAllReducePart`."""

    groups: tuple[MappedRootedGroup, ...]
    dropped: tuple[str, ...]
    created: tuple[Block, ...]
    reduce: bool
    fallback: Callable[[], tuple[Any, ...]] = field(compare=False, repr=False)


@dataclass(frozen=True)
class LineGatherPart(RankPart):
    """One rank's part of an all-gather (``reduce=False``) or reduce-scatter (``reduce=True``)
    along one axis whose shares are equal: its group is a line of the partition, ``members``
    (described, :class:`~linop.partition.WorkerBox`), and the member at coordinate ``k`` owns
    entries ``[k n, (k + 1) n)`` of the gathered block along ``axis``.

    ``source`` is the block the rank gives (its tensor block; a gathered block for the
    reduce-scatter) and ``target`` the block it gets; both None on a rank outside the layout."""

    source: str | None
    target: Block | None
    members: Sequence[int]
    axis: int
    reduce: bool
    fallback: Fallback = field(compare=False, repr=False)


@dataclass(frozen=True)
class LineReduceScatterPart(RankPart):
    r"""One rank's part of a reduce-scatter along one axis whose shares are uneven (some may be
    empty): its group is a line of the partition, ``members`` (described,
    :class:`~linop.partition.WorkerBox`), in coordinate order, and member ``k`` owns the entries
    :math:`[o_k, o_k + n_k)` of the gathered block along ``axis``, where
    :math:`n_k` = ``shares[k]`` and :math:`o_k = n_0 + \dots + n_{k-1}`.

    Forward: member ``k`` receives :math:`x_k = \sum_{j \in \text{line}} g_j[o_k : o_k + n_k]`
    (along ``axis``; every other axis whole); ``source`` is the rank's gathered block
    :math:`g_j` (dropped) and ``target`` its block :math:`x_k` (created); both None on a rank
    outside the layout. The adjoint is the all-gather of the same shares, another node (which
    runs as one all-to-all, :class:`AllToAllPart`)."""

    source: str | None
    target: Block | None
    members: Sequence[int]
    axis: int
    shares: tuple[int, ...]
    fallback: Fallback = field(compare=False, repr=False)


@dataclass(frozen=True)
class AllToAllPart(RankPart):
    """One rank's part of an all-to-all (a copying plan whose every worker gives at most one
    block and gets at most one): boxes of its one old block ``source`` (of shape
    ``source_shape``) sent to each peer, boxes of its one new block ``target`` received from
    each peer (at most one box per peer each way); the rank drops ``source`` and creates
    ``target``.

    ``most_messages`` bounds the boxes (sent plus received, its own included) of *any* rank of
    the all-to-all, computed alike on every rank from the plan's geometry (for a repartition,
    :meth:`~linop.repartition.Repartition.most_overlaps`), so that every rank takes the same
    path where an executor chooses between a collective call and point-to-point messages with
    each rank's own peers; None where no such bound is known (a root talking to every rank)."""

    source: str | None
    source_shape: tuple[int, ...]
    target: Block | None
    sends: tuple[PeerBox, ...]
    receives: tuple[PeerBox, ...]
    most_messages: int | None = None


Part = (
    AllReducePart
    | MappedAllReducePart
    | RootedPart
    | MappedRootedPart
    | LineGatherPart
    | LineReduceScatterPart
    | AllToAllPart
)
"""The closed union of the collectives' rank parts: an executor's table has a row per type."""
