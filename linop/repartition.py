r"""Repartition (all-to-all) of a distributed tensor, and its special cases scatter and gather
(``docs/theory.md#collectives``).

A repartition re-decomposes one global array from any partition and decomposition to any
other: overlapping, disjoint or identical worker sets, balanced or explicit sizes, empty
shares. Every entry of the global array lives in exactly one block before and exactly one
after, so the operator is a permutation: its adjoint is its inverse, the reverse repartition.

==============================  ==========================================  ======================
node                            forward                                     adjoint
==============================  ==========================================  ======================
Repartition(x, y)               y_j[box] = x_i[box] for every intersection  Repartition(y, x)
Scatter(root, x)                x_i = root[box of x_i]                      Gather(root, x)
Gather(root, x)                 root[box of x_i] = x_i                      Scatter(root, x)
==============================  ==========================================  ======================

Each expands (through :class:`~linop.pieces.PieceMovement`) into Allocate, one in-place Copy or
SendRecv per non-empty intersection, and Deallocate.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from .errors import GlobalShapeError, OperandError
from .layout import require_tensor
from .operator import LinearOperator
from .partition import DistributedTensor
from .pieces import NO_OTHERS, Piece, PieceMover, fields_of, make_piece, nonempty_pieces, origin
from .space import Block, Space

__all__ = ["Gather", "Repartition", "Scatter", "overlaps"]


def _boxes_overlap_1d(source: Sequence[int], target: Sequence[int]) -> list[list[tuple[int, int, int]]]:
    """For 1-d decompositions given by sizes: for each target part, the (source part, lo, hi)
    global intervals it shares with source parts (non-empty only)."""
    source_edges = np.cumsum((0, *source))
    target_edges = np.cumsum((0, *target))
    result: list[list[tuple[int, int, int]]] = []
    m = 0
    for k in range(len(target)):
        lo_t, hi_t = int(target_edges[k]), int(target_edges[k + 1])
        parts = []
        while m < len(source) and source_edges[m + 1] <= lo_t:
            m += 1
        n = m
        while n < len(source) and source_edges[n] < hi_t:
            lo, hi = max(lo_t, int(source_edges[n])), min(hi_t, int(source_edges[n + 1]))
            if lo < hi:
                parts.append((n, lo, hi))
            n += 1
        result.append(parts)
    return result


def _overlap_1d(
    source_edges: Sequence[int], target_edges: Sequence[int], k: int
) -> list[tuple[int, int, int]]:
    """For target part ``k`` of a 1-d decomposition given by its edges: the (source part, lo,
    hi) global intervals it shares with source parts (non-empty only), as
    :func:`_boxes_overlap_1d` lists them for every part, found by bisection (the part's own
    overlaps, whatever the number of parts)."""
    lo_t, hi_t = target_edges[k], target_edges[k + 1]
    last = len(source_edges) - 1
    n = bisect.bisect_right(source_edges, lo_t) - 1  # the first part ending after lo_t
    parts = []
    while n < last and source_edges[n] < hi_t:
        lo, hi = max(lo_t, source_edges[n]), min(hi_t, source_edges[n + 1])
        if lo < hi:
            parts.append((n, lo, hi))
        n += 1
    return parts


def _most_met(edges: Sequence[int], other: Sequence[int]) -> int:
    """The most parts of the 1-d decomposition with edges ``other`` that one part of the
    decomposition with edges ``edges`` meets (parts of size zero counted where they lie inside
    the part: an upper bound), at least 1 when there are parts."""
    if len(edges) < 2 or len(other) < 2:
        return 0
    lows, highs = np.asarray(edges[:-1]), np.asarray(edges[1:])
    starts, stops = np.asarray(other[:-1]), np.asarray(other[1:])
    met = np.searchsorted(starts, highs, side="left") - np.searchsorted(stops, lows, side="right")
    return max(int(met.max()), 1)


def overlaps(
    source: DistributedTensor, destination: DistributedTensor
) -> Iterator[tuple[tuple[int, ...], tuple[int, ...], tuple[tuple[int, ...], tuple[int, ...]]]]:
    """The non-empty intersections of two decompositions of one global shape.

    Yields ``(source index, destination index, global box)``, destinations in C order. Works
    dimension by dimension, so the cost is the number of intersections, not the product of
    the partition sizes.

    Raises
    ------
    GlobalShapeError
        If the global shapes differ.
    """
    if source.global_shape != destination.global_shape:
        raise GlobalShapeError(
            f"tensor {source.name!r} has global shape {source.global_shape} but tensor "
            f"{destination.name!r} has global shape {destination.global_shape}"
        )
    per_dim = [_boxes_overlap_1d(s, t) for s, t in zip(source.sizes, destination.sizes)]
    for j in destination.partition.indices():
        for combo in itertools.product(*(per_dim[d][k] for d, k in enumerate(j))):
            i = tuple(c[0] for c in combo)
            yield i, j, (tuple(c[1] for c in combo), tuple(c[2] for c in combo))


@dataclass(frozen=True, eq=True, repr=False)
class Repartition(PieceMover):
    r"""Re-decompose a distributed tensor onto another partition and decomposition.

    .. math::

        y_j\big|_{b} = x_i\big|_{b} \text{ for every non-empty } b = \mathrm{box}(x_i) \cap
        \mathrm{box}(y_j), \qquad T^* = T^{-1} = \text{Repartition}(y, x)

    Out of place: the source blocks are dropped, the destination blocks are new. A piece that
    stays on its worker is a Copy, any other a SendRecv.

    Parameters
    ----------
    source, destination : DistributedTensor
        Two decompositions of the same global shape, with different block names.
    others : Space, optional
        Blocks that pass through unchanged.

    Raises
    ------
    GlobalShapeError
        If the global shapes differ (names both tensors).
    BlockExistsError
        If a block name is used twice (source, destination, pass-through blocks).

    Examples
    --------
    Six entries from two balanced blocks to three unbalanced ones; the reverse repartition is
    both the adjoint and the inverse:

    >>> import numpy as np
    >>> import verify
    >>> from linop import DistributedTensor, Identity, Partition, Repartition
    >>> x = DistributedTensor("x", (6,), Partition((2,)))
    >>> y = DistributedTensor("y", (6,), Partition((3,)), sizes=((1, 2, 3),))
    >>> shuffle = Repartition(x, y)
    >>> shuffle(x.scatter(np.arange(6)))
    {'y[0]': array([0]), 'y[1]': array([1, 2]), 'y[2]': array([3, 4, 5])}
    >>> shuffle.H == Repartition(y, x)
    True
    >>> bool(verify.equal(shuffle.H @ shuffle, Identity(shuffle.domain)))
    True
    """

    source: DistributedTensor
    destination: DistributedTensor
    others: Space = NO_OTHERS

    def _setup(self) -> None:
        require_tensor("Repartition", "source", self.source)
        require_tensor("Repartition", "destination", self.destination)
        if self.source.global_shape != self.destination.global_shape:
            raise GlobalShapeError(
                f"Repartition {self.source.name!r} -> {self.destination.name!r}: global shapes "
                f"{self.source.global_shape} and {self.destination.global_shape} differ"
            )
        self._validate()

    def _forward_layouts(self) -> tuple[DistributedTensor, DistributedTensor]:
        return self.source, self.destination

    def _forward_pieces(self) -> tuple[Piece, ...]:
        items = []
        for i, j, (start, stop) in overlaps(self.source, self.destination):
            origin_i = self.source.box(i)[0]
            origin_j = self.destination.box(j)[0]
            items.append(
                make_piece(
                    self.source.block_name(i),
                    tuple(a - o for a, o in zip(start, origin_i)),
                    self.destination.block_name(j),
                    tuple(a - o for a, o in zip(start, origin_j)),
                    tuple(b - a for a, b in zip(start, stop)),
                )
            )
        return nonempty_pieces(items)

    def _edges(self) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
        """Per dimension, the edges of the source's and of the destination's parts (once)."""
        try:
            return object.__getattribute__(self, "_part_edges")
        except AttributeError:
            found = tuple(
                tuple(tuple(itertools.accumulate(sizes, initial=0)) for sizes in tensor.sizes)
                for tensor in (self.source, self.destination)
            )
            object.__setattr__(self, "_part_edges", found)
            return found  # type: ignore[return-value]

    def _piece(
        self, i: tuple[int, ...], j: tuple[int, ...], start: tuple[int, ...], stop: tuple[int, ...]
    ) -> Piece:
        origin_i, origin_j = self.source.box(i)[0], self.destination.box(j)[0]
        return Piece(
            self.source.block_name(i),
            tuple(a - o for a, o in zip(start, origin_i)),
            self.destination.block_name(j),
            tuple(a - o for a, o in zip(start, origin_j)),
            tuple(b - a for a, b in zip(start, stop)),
        )

    def pieces_into(self, j: Sequence[int]) -> tuple[Piece, ...]:
        """The pieces into destination block ``j``, in the order of :attr:`movement` (from the
        1-d overlaps of each dimension: the block's own work, not the job's)."""
        j = self.destination.partition.checked_index(j)
        sources, destinations = self._edges()
        return tuple(
            self._piece(tuple(c[0] for c in combo), j, tuple(c[1] for c in combo), tuple(c[2] for c in combo))
            for combo in itertools.product(
                *(_overlap_1d(sources[d], destinations[d], k) for d, k in enumerate(j))
            )
        )

    def pieces_from(self, i: Sequence[int]) -> tuple[Piece, ...]:
        """The pieces out of source block ``i``, in the order of :attr:`movement`."""
        i = self.source.partition.checked_index(i)
        sources, destinations = self._edges()
        return tuple(
            self._piece(i, tuple(c[0] for c in combo), tuple(c[1] for c in combo), tuple(c[2] for c in combo))
            for combo in itertools.product(
                *(_overlap_1d(destinations[d], sources[d], k) for d, k in enumerate(i))
            )
        )

    def most_overlaps(self) -> tuple[int, int]:
        """Upper bounds on the blocks one block meets: ``(most destination blocks one source
        block meets, most source blocks one destination block meets)``. Per dimension, the most
        parts of one decomposition that one part of the other meets (from the parts' edges); the
        products of these over the dimensions bound the products for any one block. The same on
        every worker (from the two decompositions alone), at a cost of the parts per dimension
        (:math:`O(\\sqrt{P})` on a square 2-d grid), computed once."""
        try:
            return object.__getattribute__(self, "_most_overlaps")
        except AttributeError:
            pass
        sources, destinations = self._edges()
        out, into = 1, 1
        for source, destination in zip(sources, destinations):
            out *= _most_met(source, destination)
            into *= _most_met(destination, source)
        object.__setattr__(self, "_most_overlaps", (out, into))
        return out, into

    def adjoint(self) -> LinearOperator:
        """T* = the reverse repartition (a permutation's transpose is its inverse)."""
        return Repartition(source=self.destination, destination=self.source, others=self.others)

    def __str__(self) -> str:
        return f"T[{self.source.name} -> {self.destination.name}]"


@dataclass(frozen=True, eq=True, repr=False)
class _RootGeometry(PieceMover):
    """The fields and geometry shared by :class:`Scatter` and its adjoint :class:`Gather`
    (declared once here; each builds the other from them by keyword)."""

    root: Block
    tensor: DistributedTensor
    others: Space = NO_OTHERS

    def _setup(self) -> None:
        kind = type(self).__name__
        if not isinstance(self.root, Block):
            raise OperandError(f"{kind}: root must be a Block, not {type(self.root).__name__}")
        require_tensor(kind, "tensor", self.tensor)
        if self.root.shape != self.tensor.global_shape:
            raise GlobalShapeError(
                f"{kind}: root block {self.root.name!r} has shape {self.root.shape} but tensor "
                f"{self.tensor.name!r} has global shape {self.tensor.global_shape}"
            )
        self._validate()

    def _scatter_piece(self, index: tuple[int, ...]) -> Piece | None:
        block = self.tensor.block(index)
        return make_piece(self.root, self.tensor.box(index)[0], block, origin(block), block.shape)

    def _forward_layouts(self) -> tuple[Block, DistributedTensor]:
        return self.root, self.tensor

    def _forward_pieces(self) -> tuple[Piece, ...]:
        return nonempty_pieces(self._scatter_piece(index) for index in self.tensor.partition.indices())

    def rank_pieces(self, worker: int) -> tuple[Piece, ...]:
        """The pieces of ``worker``'s blocks in movement order: every piece on the root's worker, the
        piece of its own block on any other (O(1) off the root)."""
        if worker == self.root.worker:
            pieces = self._forward_pieces()
        elif self.tensor.partition.position(worker) is not None:
            pieces = nonempty_pieces([self._scatter_piece(self.tensor.partition.index(worker))])
        else:
            pieces = ()
        return self._oriented(pieces)


@dataclass(frozen=True, eq=True, repr=False)
class Scatter(_RootGeometry):
    r"""Cut one block holding a whole global array into the blocks of a distributed tensor.

    .. math:: x_i = r\big|_{\mathrm{box}(x_i)}, \qquad S^* = S^{-1} = \text{Gather}

    The root block is dropped; the tensor's blocks are new (Copy on the root's worker,
    SendRecv to others). A special case of :class:`Repartition` from a one-worker partition.

    Parameters
    ----------
    root : Block
        The whole array, of shape ``tensor.global_shape``, on its worker.
    tensor : DistributedTensor
    others : Space, optional
        Blocks that pass through unchanged.

    Raises
    ------
    GlobalShapeError
        If the root's shape is not the tensor's global shape.

    Examples
    --------
    >>> import numpy as np
    >>> from linop import Block, DistributedTensor, Gather, Partition, Scatter
    >>> x = DistributedTensor("x", (6,), Partition((2,)))
    >>> scatter = Scatter(Block("whole", (6,), worker=0), x)
    >>> scatter({"whole": np.arange(6)})
    {'x[0]': array([0, 1, 2]), 'x[1]': array([3, 4, 5])}
    >>> scatter.H == Gather(Block("whole", (6,), worker=0), x)
    True
    """

    def adjoint(self) -> LinearOperator:
        """Scatter* = Gather (its inverse)."""
        return Gather(**fields_of(self))

    def __str__(self) -> str:
        return f"Sc[{self.root.name} -> {self.tensor.name}]"


@dataclass(frozen=True, eq=True, repr=False)
class Gather(_RootGeometry):
    r"""Assemble the blocks of a distributed tensor into one new block on the root's worker.

    .. math:: r\big|_{\mathrm{box}(x_i)} = x_i, \qquad G^* = G^{-1} = \text{Scatter}

    The fields mean what they mean for :class:`Scatter`: ``root`` is the new block.

    Parameters
    ----------
    root : Block
        The new block that receives the whole array, on its worker.
    tensor : DistributedTensor
        The blocks gathered (dropped afterwards).
    others : Space, optional
        Blocks that pass through unchanged.

    Raises
    ------
    GlobalShapeError
        As for :class:`Scatter`.

    Examples
    --------
    >>> import numpy as np
    >>> from linop import Block, DistributedTensor, Gather, Partition
    >>> x = DistributedTensor("x", (6,), Partition((2,)))
    >>> gather = Gather(Block("whole", (6,), worker=1), x)
    >>> gather(x.scatter(np.arange(6)))
    {'whole': array([0, 1, 2, 3, 4, 5])}
    """

    BACKWARD = True  # the scatter's pieces, from the blocks into the root

    def adjoint(self) -> LinearOperator:
        """Gather* = Scatter (its inverse)."""
        return Scatter(**fields_of(self))

    def __str__(self) -> str:
        return f"G[{self.tensor.name} -> {self.root.name}]"
