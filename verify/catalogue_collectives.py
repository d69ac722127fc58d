"""Catalogue, ``docs/theory.md#collectives`` and ``#collective-algorithms``: the collective
nodes of :mod:`linop.collectives` and :mod:`linop.repartition`.

Each node carries its adjoint rule (Broadcast.H is a SumReduce, Repartition.H the reverse
repartition, ...); the ``adjoint`` entries prove each rule equal to the conjugate transpose of
the node's expansion, and the ``equal`` entries prove the section's relations between nodes:
all-reduce is a broadcast after a sum-reduce, a sum-reduce after a broadcast counts copies, a
repartition followed by its reverse is the identity, scatter is a repartition from one worker,
and the ring all-reduce (reduce-scatter, then all-gather) is the all-reduce.
"""

from __future__ import annotations

from linop import Identity, LinearOperator
from linop.collectives import AllGather, AllReduce, BlockGrid, Broadcast, ReduceScatter, SumReduce
from linop.partition import DistributedTensor, Partition
from linop.repartition import Gather, Repartition, Scatter

from .catalogue import Entry, adjoint_entry, equal_entry

__all__ = ["ENTRIES"]

SECTION = "collectives"


# -- broadcast, sum-reduce, all-reduce: x on a 1 x 3 partition, copies on 2 x 3 ---------------------
def _x() -> DistributedTensor:
    return DistributedTensor("x", (2, 5), Partition((1, 3), (0, 1, 2)))


def _copies_partition() -> Partition:
    return Partition((2, 3), (0, 1, 2, 3, 4, 5))


def _broadcast() -> Broadcast:
    return Broadcast(_x(), _copies_partition(), "y")


def _sum_reduce() -> SumReduce:
    return SumReduce(_x(), _copies_partition(), "y")


def _broadcast_transposed() -> Broadcast:
    """x on 3 x 1, reversed to 1 x 3 (DistDL's transpose_src), to 2 x 3."""
    x = DistributedTensor("x", (5, 2), Partition((3, 1), (4, 1, 0)))
    return Broadcast(x, _copies_partition(), "y", transpose=True)


def _all_reduce_forms() -> tuple[LinearOperator, LinearOperator]:
    broadcast = _broadcast()
    return AllReduce(broadcast.copies, (0,)), broadcast @ broadcast.H


def _sum_reduce_after_broadcast() -> tuple[LinearOperator, LinearOperator]:
    broadcast = _broadcast()
    return broadcast.H @ broadcast, 2 * Identity(_x().space)


# -- repartition, scatter, gather ----------------------------------------------------------------------
def _source() -> DistributedTensor:
    """An unbalanced source with an empty share."""
    return DistributedTensor("x", (5, 4), Partition((3, 1), (0, 1, 2)), sizes=((3, 0, 2), (4,)))


def _destination() -> DistributedTensor:
    """A disjoint worker set."""
    return DistributedTensor("y", (5, 4), Partition((2, 2), (3, 4, 5, 6)))


def _repartition() -> Repartition:
    return Repartition(_source(), _destination())


def _repartition_round_trip() -> tuple[LinearOperator, LinearOperator]:
    forward = _repartition()
    return forward.H @ forward, Identity(_source().space)


def _repartition_inverse_round_trip() -> tuple[LinearOperator, LinearOperator]:
    forward = _repartition()
    return forward @ forward.H, Identity(_destination().space)


def _repartition_overlapping() -> Repartition:
    x = DistributedTensor("x", (4, 6), Partition((2, 2), (0, 1, 2, 3)))
    y = DistributedTensor("y", (4, 6), Partition((1, 3), (2, 3, 4)), sizes=((4,), (1, 0, 5)))
    return Repartition(x, y)


def _root() -> tuple[BlockGrid, DistributedTensor]:
    x = DistributedTensor("x", (5, 3), Partition((2, 2), (0, 1, 2, 3)))
    return BlockGrid("r", Partition((1, 1), (1,)), ((5, 3),)), x


def _scatter() -> Scatter:
    root, x = _root()
    return Scatter(root.blocks[0], x)


def _gather_after_scatter() -> tuple[LinearOperator, LinearOperator]:
    scatter = _scatter()
    return scatter.H @ scatter, Identity(scatter.domain)


def _scatter_is_repartition() -> tuple[LinearOperator, LinearOperator]:
    root, x = _root()
    whole = DistributedTensor("r", (5, 3), root.partition)
    return Scatter(root.blocks[0], x), Repartition(whole, x)


def _gather() -> Gather:
    root, x = _root()
    return Gather(root.blocks[0], x)


# -- all-gather and reduce-scatter ---------------------------------------------------------------------
def _gathered() -> DistributedTensor:
    return DistributedTensor("x", (5, 2), Partition((3, 1), (0, 1, 2)))


def _all_gather() -> AllGather:
    return AllGather(_gathered(), (0,), "g")


def _reduce_scatter() -> ReduceScatter:
    return ReduceScatter(_gathered(), (0,), "g")


def _reduce_scatter_empty_share() -> ReduceScatter:
    """Shares 1, 1, 1, 0 along the axis (3 rows over 4 workers): the uneven line of the
    reduce-scatter's fast path (:class:`~linop.program.parts.LineReduceScatterPart`), one
    member with nothing to receive."""
    return ReduceScatter(DistributedTensor("x", (3, 2), Partition((4, 1), (0, 1, 2, 3))), (0,), "g")


def _reduce_scatter_after_all_gather() -> tuple[LinearOperator, LinearOperator]:
    gather = _all_gather()
    return gather.H @ gather, 3 * Identity(_gathered().space)


def _ring_all_reduce() -> tuple[LinearOperator, LinearOperator]:
    gather = _all_gather()
    return gather @ gather.H, AllReduce(gather.gathered, (0,))


def _all_gather_is_gather_then_broadcast() -> tuple[LinearOperator, LinearOperator]:
    x = DistributedTensor("x", (3, 4), Partition((2, 2), (0, 1, 2, 3)))
    root = BlockGrid("r", Partition((1, 1), (2,)), ((3, 4),))
    return AllGather(x, (0, 1), "g"), Broadcast(root, x.partition, "g") @ Gather(root.blocks[0], x)


ENTRIES: list[Entry] = [
    adjoint_entry(
        "node-broadcast-adjoint", SECTION, "B* = R: Broadcast.H is the SumReduce", _broadcast, size_free=True
    ),
    adjoint_entry(
        "node-sum-reduce-adjoint",
        SECTION,
        "R* = B: SumReduce.H is the Broadcast",
        _sum_reduce,
        size_free=True,
    ),
    adjoint_entry(
        "node-broadcast-transposed-adjoint",
        SECTION,
        "B* = R with the source partition's shape reversed (DistDL transpose_src)",
        _broadcast_transposed,
        size_free=True,
    ),
    equal_entry(
        "node-all-reduce-is-broadcast-sum-reduce",
        SECTION,
        "all-reduce = B R",
        _all_reduce_forms,
        size_free=True,
    ),
    adjoint_entry(
        "node-all-reduce-self-adjoint",
        SECTION,
        "(B R)* = R* B* = B R",
        lambda: _all_reduce_forms()[0],
        size_free=True,
    ),
    equal_entry(
        "node-sum-reduce-after-broadcast",
        SECTION,
        "R B = k I: each block comes back k times (k copies)",
        _sum_reduce_after_broadcast,
        size_free=True,
    ),
    adjoint_entry(
        "node-repartition-adjoint",
        SECTION,
        "all-to-all: T* = the reverse repartition (unbalanced source, disjoint workers)",
        _repartition,
    ),
    adjoint_entry(
        "node-repartition-overlapping-adjoint",
        SECTION,
        "T* = the reverse repartition (overlapping workers, empty share)",
        _repartition_overlapping,
    ),
    equal_entry(
        "node-repartition-round-trip", SECTION, "T* T = I: the reverse undoes it", _repartition_round_trip
    ),
    equal_entry(
        "node-repartition-inverse", SECTION, "T T* = I: T* is T's inverse", _repartition_inverse_round_trip
    ),
    adjoint_entry("node-scatter-adjoint", SECTION, "scatter* = gather", _scatter),
    adjoint_entry("node-gather-adjoint", SECTION, "gather* = scatter", _gather),
    equal_entry("node-gather-after-scatter", SECTION, "gather scatter = I", _gather_after_scatter),
    equal_entry(
        "node-scatter-is-repartition",
        SECTION,
        "scatter = repartition from a one-worker partition",
        _scatter_is_repartition,
    ),
    adjoint_entry("node-all-gather-adjoint", SECTION, "AG* = RS (reduce-scatter)", _all_gather),
    adjoint_entry("node-reduce-scatter-adjoint", SECTION, "RS* = AG (all-gather)", _reduce_scatter),
    adjoint_entry(
        "node-reduce-scatter-empty-share-adjoint",
        SECTION,
        "RS* = AG over uneven shares, one of them empty",
        _reduce_scatter_empty_share,
    ),
    equal_entry(
        "node-reduce-scatter-after-all-gather",
        SECTION,
        "RS AG = P I over a group of P workers",
        _reduce_scatter_after_all_gather,
    ),
    equal_entry(
        "node-all-gather-is-gather-then-broadcast",
        SECTION,
        "AG = B G: gather to one worker, broadcast the whole",
        _all_gather_is_gather_then_broadcast,
    ),
    equal_entry(
        "node-ring-all-reduce",
        "collective-algorithms",
        "all-reduce = AG RS (pipeline/ring: reduce-scatter, then all-gather)",
        _ring_all_reduce,
    ),
]
