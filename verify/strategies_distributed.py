"""Hypothesis strategies for partitions, decompositions and distributed tensors.

Re-exported by :mod:`verify.strategies`. Everything drawn is small (a few workers, a few
entries per dimension) so that exact sparse proofs stay fast, and valid: worker ids are
distinct within a partition, explicit sizes add up to the global extent (empty shares
included), and paired tensors share their global shape.

==================================  ===============================================================
strategy                            draws
==================================  ===============================================================
``partition_shapes()``              grid shapes such as ``(2, 1, 3)``
``partitions()``                    a :class:`~linop.partition.Partition` on distinct worker ids
``decompositions(shape, grid)``     per-dimension sizes: balanced or explicit, empty shares allowed
``distributed_tensors()``           a :class:`~linop.partition.DistributedTensor`
``tensor_pairs()``                  two tensors of one global shape (names ``x``, ``y``) on any
                                    partitions: same, overlapping or disjoint worker sets
``broadcast_setups()``              ``(tensor, destination partition, transpose)`` that broadcast
``collectives()``                   a collective node or its adjoint on drawn tensors
==================================  ===============================================================
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hypothesis import strategies as st

from linop import (
    AllGather,
    AllReduce,
    Block,
    BlockGrid,
    Broadcast,
    LinearOperator,
    Repartition,
    Scatter,
    SumReduce,
)
from linop.collectives import PieceMover, ReduceScatter
from linop.partition import DistributedTensor, Partition, balanced_sizes
from linop.repartition import Gather

from .node_examples import examples_for
from .strategy_cache import built_once

__all__ = [
    "broadcast_setups",
    "collectives",
    "COLLECTIVE_KINDS",
    "decompositions",
    "distributed_tensors",
    "partition_shapes",
    "partitions",
    "tensor_pairs",
]

MAX_WORKER = 16
"""Worker ids are drawn from ``0 .. MAX_WORKER - 1``."""


@built_once
def partition_shapes(*, min_dims: int = 1, max_dims: int = 3, max_extent: int = 3) -> st.SearchStrategy:
    """Grid shapes of ``min_dims .. max_dims`` dimensions, extents ``1 .. max_extent``."""
    return st.lists(st.integers(1, max_extent), min_size=min_dims, max_size=max_dims).map(tuple)


@built_once
@st.composite
def partitions(
    draw: st.DrawFn,
    shape: Sequence[int] | None = None,
    *,
    min_dims: int = 1,
    max_dims: int = 3,
    max_extent: int = 3,
    workers: Sequence[int] | None = None,
) -> Partition:
    """A partition of ``shape`` (drawn if not given) on distinct workers drawn from ``workers``
    (default ``0 .. MAX_WORKER - 1``), in a random order."""
    if shape is None:
        shape = draw(partition_shapes(min_dims=min_dims, max_dims=max_dims, max_extent=max_extent))
    shape = tuple(shape)
    count = 1
    for n in shape:
        count *= n
    pool = list(range(max(MAX_WORKER, count))) if workers is None else list(workers)
    chosen = draw(st.permutations(pool))[:count]
    return Partition(shape, tuple(chosen))


@built_once
@st.composite
def decompositions(
    draw: st.DrawFn, global_shape: Sequence[int], grid: Sequence[int], *, balanced: bool | None = None
) -> tuple[tuple[int, ...], ...]:
    """Per-dimension sizes of ``global_shape`` over a grid: balanced (larger shares first), or
    explicit (any non-negative sizes adding up to the extent, empty shares included). With
    ``balanced=None`` each dimension is either."""
    sizes = []
    for n, parts in zip(global_shape, grid):
        use_balanced = draw(st.booleans()) if balanced is None else balanced
        if use_balanced:
            sizes.append(balanced_sizes(n, parts))
            continue
        cuts = sorted(draw(st.lists(st.integers(0, n), min_size=parts - 1, max_size=parts - 1)))
        edges = (0, *cuts, n)
        sizes.append(tuple(b - a for a, b in zip(edges, edges[1:])))
    return tuple(sizes)


@built_once
@st.composite
def distributed_tensors(
    draw: st.DrawFn,
    name: str = "x",
    *,
    partition: Partition | None = None,
    global_shape: Sequence[int] | None = None,
    max_extent: int = 6,
    balanced: bool | None = None,
    max_dims: int = 3,
) -> DistributedTensor:
    """A distributed tensor: a partition (drawn unless given), a global shape (extents
    ``0 .. max_extent``, drawn unless given) and a decomposition (see :func:`decompositions`)."""
    if partition is None:
        rank = len(global_shape) if global_shape is not None else None
        if rank is None:
            partition = draw(partitions(max_dims=max_dims))
        else:
            partition = draw(partitions(min_dims=rank, max_dims=rank))
    if global_shape is None:
        global_shape = tuple(draw(st.integers(0, max_extent)) for _ in range(partition.ndim))
    sizes = draw(decompositions(global_shape, partition.shape, balanced=balanced))
    return DistributedTensor(name, tuple(global_shape), partition, sizes)


@built_once
@st.composite
def tensor_pairs(
    draw: st.DrawFn, *, max_dims: int = 3, max_extent: int = 6, balanced: bool | None = None
) -> tuple[DistributedTensor, DistributedTensor]:
    """Two decompositions ``x`` and ``y`` of one global shape, each on its own partition of
    the same rank; the worker sets are independent draws, so they may coincide, overlap or be
    disjoint."""
    rank = draw(st.integers(1, max_dims))
    global_shape = tuple(draw(st.integers(0, max_extent)) for _ in range(rank))
    x = draw(
        distributed_tensors(
            "x",
            partition=draw(partitions(min_dims=rank, max_dims=rank)),
            global_shape=global_shape,
            balanced=balanced,
        )
    )
    y = draw(
        distributed_tensors(
            "y",
            partition=draw(partitions(min_dims=rank, max_dims=rank)),
            global_shape=global_shape,
            balanced=balanced,
        )
    )
    return x, y


@built_once
@st.composite
def broadcast_setups(
    draw: st.DrawFn, *, max_dims: int = 3, max_extent: int = 3
) -> tuple[DistributedTensor, Partition, bool]:
    """A source tensor ``x``, a destination partition that its partition broadcasts to
    (NumPy rules, left-padded with ones), and whether the source shape is reversed first."""
    destination = draw(partitions(max_dims=max_dims, max_extent=max_extent))
    transpose = draw(st.booleans())
    rank = draw(st.integers(1, destination.ndim))
    shape = tuple(n if draw(st.booleans()) else 1 for n in destination.shape[destination.ndim - rank :])
    if transpose:
        shape = shape[::-1]
    source = draw(partitions(shape))
    tensor = draw(distributed_tensors("x", partition=source, max_extent=4))
    return tensor, destination, transpose


# -- examples per node type, for the registry proof (tests/test_registry.py) ----------------
COLLECTIVE_KINDS = ("repartition", "broadcast", "allreduce", "allgather", "scatter")
"""The kinds :func:`collectives` draws (its ``kinds=``)."""


@built_once
@st.composite
def collectives(
    draw: st.DrawFn, kinds: Sequence[str] = COLLECTIVE_KINDS, adjoint: bool | None = None
) -> LinearOperator:
    """A collective node (or its adjoint) on drawn tensors: repartition, broadcast,
    all-reduce, all-gather, scatter; empty shares, unbalanced sizes and any workers included.

    ``kinds`` (a subset of :data:`COLLECTIVE_KINDS`) draws only those; ``adjoint`` True or
    False draws only adjoints (sum-reduce, reduce-scatter, gather, ...) or only forward nodes,
    None either."""
    unknown = sorted(set(kinds) - set(COLLECTIVE_KINDS))
    if unknown or not kinds:
        raise ValueError(f"collectives(): kinds {list(kinds)}; the kinds are {list(COLLECTIVE_KINDS)}")
    kind = draw(st.sampled_from(tuple(kinds)))
    op: LinearOperator
    if kind == "repartition":
        x, y = draw(tensor_pairs())
        op = Repartition(x, y)
    elif kind in ("broadcast", "allreduce"):
        x, destination, transpose = draw(broadcast_setups())
        op = Broadcast(x, destination, "y", transpose)
        if kind == "allreduce":
            axes = draw(st.sets(st.integers(0, destination.ndim - 1)).map(tuple))
            shape = draw(st.lists(st.integers(0, 2), min_size=0, max_size=2).map(tuple))
            op = AllReduce(BlockGrid.uniform("u", destination, shape), axes)
    elif kind == "allgather":
        x = draw(distributed_tensors("x"))
        axes = draw(st.sets(st.integers(0, x.ndim - 1)).map(tuple))
        op = AllGather(x, axes, "g")
    else:
        x = draw(distributed_tensors("x"))
        op = Scatter(Block("r", x.global_shape, draw(st.integers(0, 20))), x)
    return op.H if (draw(st.booleans()) if adjoint is None else adjoint) else op


def _collectives_of(
    node_type: type, kinds: tuple[str, ...], adjoint: bool | None
) -> Callable[[], st.SearchStrategy[LinearOperator]]:
    """The examples of ``node_type``: the collectives of ``kinds`` that are one (drawn as such,
    not filtered out of every kind: the filter is a check)."""

    def factory() -> st.SearchStrategy[LinearOperator]:
        return collectives(kinds, adjoint).filter(lambda op: isinstance(op, node_type))

    return factory


for _node_type, _kinds, _adjoint in (
    (PieceMover, COLLECTIVE_KINDS, None),
    (AllReduce, ("allreduce",), None),
    (Broadcast, ("broadcast",), False),
    (SumReduce, ("broadcast",), True),
    (Repartition, ("repartition",), None),
    (AllGather, ("allgather",), False),
    (ReduceScatter, ("allgather",), True),
):
    examples_for(_node_type)(_collectives_of(_node_type, _kinds, _adjoint))


@examples_for(Scatter)
@examples_for(Gather)
def _scatters() -> st.SearchStrategy[LinearOperator]:
    """Scatters and gathers whose root is among the workers ``0 .. MAX_WORKER - 1`` (read when
    drawn), as well as far away (:func:`collectives`)."""

    @st.composite
    def near(draw: st.DrawFn) -> LinearOperator:
        x = draw(distributed_tensors("x"))
        op = Scatter(Block("r", x.global_shape, draw(st.integers(0, MAX_WORKER - 1))), x)
        return op.H if draw(st.booleans()) else op

    return st.one_of(near(), collectives(("scatter",)))
