r"""Collectives between block layouts on partitions (``docs/theory.md#collectives``).

A *layout* is one block per worker of a :class:`~linop.partition.Partition`: a
:class:`~linop.partition.DistributedTensor` (blocks cut from one global array) or a
:class:`BlockGrid` (any block shapes, e.g. the copies that a broadcast makes). The nodes here
move data between layouts (:mod:`linop.repartition` adds the all-to-all, scatter and gather):

=================================  =========================================  ===================
node                               forward                                    adjoint
=================================  =========================================  ===================
Broadcast(x, P, "y")               every y block is a copy of its x block     SumReduce(x, P, "y")
SumReduce(x, P, "y")               every x block is the sum of its copies     Broadcast(x, P, "y")
AllReduce(x, axes)                 every block <- sum over its group (B R)    itself
AllGather(x, axes, "g")            every g block holds its group's x blocks   ReduceScatter
ReduceScatter(x, axes, "g")        every x block <- sum of its box in the g's AllGather
=================================  =========================================  ===================

All but :class:`AllReduce` are out of place: the source blocks are dropped and the
destination blocks are new (their names must differ). Blocks listed in ``others`` pass through
unchanged, so a collective can act inside a larger program space.

Every out-of-place node is defined by a :class:`Plan`: new blocks, *pieces* (a box of an old
block copied or added into a box of a new block) and dropped blocks. The plan expands into
the primitives (Allocate; Copy or SendRecv in place, or their adjoints that add; Deallocate),
and the interpreters' fast paths read the same plan.

Broadcasting of partitions
--------------------------
A source partition of shape ``s`` broadcasts to a destination partition of shape ``S`` as in
NumPy: ``s`` is left-padded with ones to the length of ``S`` and each of its extents equals the
destination's or is 1. Destination index ``j`` then takes its data from the source index
``i_d = j_d`` (equal extents) or ``i_d = 0`` (extent 1), the padded dimensions dropped. With
``transpose=True`` the source partition's shape (and index) is reversed first, as DistDL's
``transpose_src`` does for its affine layers.
"""

from __future__ import annotations

import functools
import operator
from abc import abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

from .errors import (
    BlockExistsError,
    BroadcastError,
    DecompositionError,
    GlobalShapeError,
    PartitionError,
    ShapeMismatchError,
)
from .movement import Copy, CopyAdjoint, SendRecv, SendRecvAdjoint
from .operator import Composition, Identity, LinearOperator
from .partition import DistributedTensor, Partition, grid_block_name, normalized_axes
from .primitives import Allocate, Deallocate
from .space import Block, Space

__all__ = [
    "AllGather",
    "AllReduce",
    "BlockGrid",
    "Broadcast",
    "BroadcastError",
    "GlobalShapeError",
    "Layout",
    "Piece",
    "Plan",
    "Planned",
    "ReduceScatter",
    "SumReduce",
    "broadcast_map",
    "gathered_layout",
    "reduction_groups",
]


# -- layouts ---------------------------------------------------------------------------------
@runtime_checkable
class Layout(Protocol):
    """One block per worker of a partition: what a collective moves data between.

    Both :class:`~linop.partition.DistributedTensor` and :class:`BlockGrid` are layouts.
    """

    name: str
    partition: Partition

    def block_name(self, index: Sequence[int]) -> str: ...

    def block(self, index: Sequence[int]) -> Block: ...

    @property
    def blocks(self) -> tuple[Block, ...]: ...

    @property
    def space(self) -> Space: ...


@dataclass(frozen=True)
class BlockGrid:
    """One block per worker of ``partition``, with explicit shapes.

    Block ``name[i,j]`` has shape ``shapes[k]`` (``k`` the position of ``(i, j)`` in C order of
    grid index) and lives on ``partition.worker((i, j))``. Naming follows
    :class:`~linop.partition.DistributedTensor`, so the two are interchangeable as layouts.

    Parameters
    ----------
    name : str
        Prefix of the block names.
    partition : Partition
    shapes : sequence of shapes
        One block shape per worker, in C order of grid index.

    Raises
    ------
    TypeError
        If ``partition`` is not a :class:`~linop.partition.Partition`.
    PartitionError
        If the number of shapes differs from the number of workers.
    DecompositionError
        If a block shape has a negative extent or is not a sequence of integers.
    """

    name: str
    partition: Partition
    shapes: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if not isinstance(self.partition, Partition):
            raise TypeError(
                f"block grid {self.name!r}: partition must be a Partition, not {type(self.partition).__name__}"
            )
        shapes = tuple(_block_shape(self.name, shape) for shape in self.shapes)
        if len(shapes) != self.partition.size:
            raise PartitionError(
                f"block grid {self.name!r}: {len(shapes)} block shapes for the "
                f"{self.partition.size} workers of partition {self.partition.shape}"
            )
        for shape in shapes:
            if any(n < 0 for n in shape):
                raise DecompositionError(f"block grid {self.name!r}: negative extent in block shape {shape}")
        object.__setattr__(self, "shapes", shapes)
        object.__setattr__(self, "_position", {index: k for k, index in enumerate(self.partition.indices())})

    @classmethod
    def uniform(cls, name: str, partition: Partition, shape: Sequence[int]) -> BlockGrid:
        """A grid whose blocks all have the same ``shape``."""
        return cls(name, partition, (tuple(shape),) * partition.size)

    @classmethod
    def of(cls, layout: Layout, name: str | None = None) -> BlockGrid:
        """The block shapes of another layout (optionally under a new name)."""
        shapes = tuple(layout.block(i).shape for i in layout.partition.indices())
        return cls(layout.name if name is None else name, layout.partition, shapes)

    def block_name(self, index: Sequence[int]) -> str:
        """Name of the block at a grid index, e.g. ``y[0,1]``."""
        return grid_block_name(self.name, index)

    def block(self, index: Sequence[int]) -> Block:
        """The block at a grid index."""
        index = tuple(index)
        try:
            shape = self.shapes[self._position[index]]  # type: ignore[attr-defined]
        except KeyError:
            raise PartitionError(f"index {index} is outside partition {self.partition.shape}") from None
        return Block(self.block_name(index), shape, self.partition.worker(index))

    @property
    def blocks(self) -> tuple[Block, ...]:
        """All blocks, in C order of grid index."""
        return tuple(self.block(i) for i in self.partition.indices())

    @property
    def space(self) -> Space:
        """The space of the grid's blocks."""
        return Space(self.blocks)

    def __str__(self) -> str:
        return f"{self.name} on {self.partition}"


def _block_shape(grid: str, shape: object) -> tuple[int, ...]:
    try:
        return tuple(operator.index(n) for n in shape)  # type: ignore[attr-defined]
    except TypeError:
        raise DecompositionError(
            f"block grid {grid!r}: block shape {shape!r} is not a tuple of integers"
        ) from None


def _union(kind: str, *groups: Iterable[Block]) -> Space:
    """One space of several groups of blocks, with a clear error for a repeated name."""
    seen: dict[str, Block] = {}
    for group in groups:
        for block in group:
            if block.name in seen:
                raise BlockExistsError(
                    f"{kind}: block name {block.name!r} is used twice (source, destination and "
                    "pass-through blocks must have different names)"
                )
            seen[block.name] = block
    return Space(seen.values())


def _require_tensor(kind: str, what: str, value: object) -> None:
    if not isinstance(value, DistributedTensor):
        raise TypeError(f"{kind}: {what} must be a DistributedTensor, not {type(value).__name__}")


def _require_name(kind: str, name: object) -> None:
    if not isinstance(name, str) or not name:
        raise TypeError(f"{kind}: name must be a non-empty string, not {name!r}")


def _check_layout(kind: str, layout: object, what: str) -> None:
    if not isinstance(layout, Layout):
        raise TypeError(
            f"{kind}: {what} must be a DistributedTensor or a BlockGrid, not {type(layout).__name__}"
        )


def _sorted_axes(kind: str, axes: Sequence[int] | int, partition: Partition) -> tuple[int, ...]:
    return tuple(sorted(normalized_axes(kind, axes, partition)))


# -- broadcasting geometry -----------------------------------------------------------------------
def broadcast_map(
    source: Partition, destination: Partition, *, transpose: bool = False
) -> dict[tuple[int, ...], tuple[int, ...]]:
    """For every destination grid index, the source grid index whose data it receives.

    Parameters
    ----------
    source, destination : Partition
    transpose : bool, optional
        Reverse the source partition's shape (and its indices) before broadcasting.

    Raises
    ------
    BroadcastError
        If the source has more dimensions than the destination, or an extent of the (padded)
        source is neither 1 nor the destination's extent; the message names the dimension.

    Examples
    --------
    >>> broadcast_map(Partition((1, 2)), Partition((2, 2)))[(1, 0)]
    (0, 0)
    """
    shape = source.shape[::-1] if transpose else source.shape
    described = f"source partition shape {source.shape}" + (" (reversed)" if transpose else "")
    if len(shape) > destination.ndim:
        raise BroadcastError(
            f"{described} has {len(shape)} dimensions, more than destination partition "
            f"shape {destination.shape} ({destination.ndim})"
        )
    pad = destination.ndim - len(shape)
    padded = (1,) * pad + shape
    for d, (a, b) in enumerate(zip(padded, destination.shape)):
        if a not in (1, b):
            raise BroadcastError(
                f"{described} does not broadcast to destination partition shape {destination.shape}: "
                f"dimension {d} (after left-padding with ones) has extent {a}, neither 1 nor {b}"
            )
    mapping = {}
    for j in destination.indices():
        i = tuple(jd if a == b else 0 for jd, a, b in zip(j, padded, destination.shape))[pad:]
        mapping[j] = i[::-1] if transpose else i
    return mapping


def reduction_groups(partition: Partition, axes: Sequence[int] | int) -> list[list[tuple[int, ...]]]:
    """Grid indices grouped along ``axes``: indices that differ only on ``axes`` share a group.

    Groups come in C order of the other coordinates; members in C order along ``axes`` (the
    first member is the group's root).

    Raises
    ------
    PartitionError
        If an axis is out of range or listed twice.
    """
    axes = _sorted_axes("reduction_groups", axes, partition)
    groups: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    for index in partition.indices():
        key = tuple(i for d, i in enumerate(index) if d not in axes)
        groups.setdefault(key, []).append(index)
    return list(groups.values())


def gathered_layout(tensor: DistributedTensor, axes: Sequence[int] | int, name: str) -> BlockGrid:
    """The layout that :class:`AllGather` produces: block ``name[j]`` covers block ``j``'s box
    of ``tensor`` with every dimension in ``axes`` widened to the whole global extent.

    Raises
    ------
    PartitionError
        If an axis is out of range or listed twice.
    """
    axes = _sorted_axes("gathered_layout", axes, tensor.partition)
    shapes = []
    for index in tensor.partition.indices():
        start, stop = tensor.box(index)
        shapes.append(
            tuple(tensor.global_shape[d] if d in axes else b - a for d, (a, b) in enumerate(zip(start, stop)))
        )
    return BlockGrid(name, tensor.partition, tuple(shapes))


# -- plans: the shared definition of out-of-place collectives -------------------------------------
@dataclass(frozen=True, slots=True)
class Piece:
    """A box of an old block (``source``) that goes to a box of a new block (``target``)."""

    source: str
    source_start: tuple[int, ...]
    target: str
    target_start: tuple[int, ...]
    shape: tuple[int, ...]

    def source_index(self) -> tuple[slice, ...]:
        """The numpy index of the box inside the source block."""
        return tuple(slice(a, a + n) for a, n in zip(self.source_start, self.shape))

    def target_index(self) -> tuple[slice, ...]:
        """The numpy index of the box inside the target block."""
        return tuple(slice(a, a + n) for a, n in zip(self.target_start, self.shape))

    def reversed(self) -> Piece:
        """The same box travelling the other way (target to source): the piece of the dual."""
        return Piece(self.target, self.target_start, self.source, self.source_start, self.shape)


@dataclass(frozen=True)
class Plan:
    """An out-of-place data movement: allocate ``created``, move ``pieces``, drop ``dropped``.

    With ``adds=False`` each piece is *copied* into its target (targets are disjoint; a source
    box may be copied several times). With ``adds=True`` each piece is *added* into its target
    and its source box cleared (the adjoint of a copy); targets may receive several pieces.
    Either way the matrix is the identity on pass-through blocks plus a one at (target entry,
    source entry) for every entry of every piece.
    """

    created: tuple[Block, ...]
    pieces: tuple[Piece, ...]
    dropped: tuple[str, ...]
    adds: bool = False

    def expand(self, domain: Space) -> LinearOperator:
        """The plan as primitives on ``domain``: Allocate, in-place Copy / SendRecv (or their
        adjoints, which add), Deallocate; SendRecv wherever the two blocks' workers differ."""
        factors: list[LinearOperator] = []
        space = domain
        for block in self.created:
            node: LinearOperator = Allocate(space, block)
            factors.append(node)
            space = node.range
        for piece in self.pieces:
            old = space[piece.source][piece.source_index()]
            new = space[piece.target][piece.target_index()]
            remote = old.worker != new.worker
            if self.adds:
                factors.append(SendRecvAdjoint(new, old) if remote else CopyAdjoint(new, old))
            else:
                factors.append(SendRecv(old, new) if remote else Copy(old, new))
        for name in self.dropped:
            node = Deallocate(space, name)
            factors.append(node)
            space = node.range
        if not factors:
            return Identity(domain)
        return Composition(tuple(reversed(factors)))


def _whole(block: Block) -> tuple[int, ...]:
    return (0,) * block.ndim


def _piece(source: Block | str, source_start, target: Block | str, target_start, shape) -> Piece | None:
    shape = tuple(shape)
    if any(n == 0 for n in shape):
        return None
    return Piece(
        source if isinstance(source, str) else source.name,
        tuple(source_start),
        target if isinstance(target, str) else target.name,
        tuple(target_start),
        shape,
    )


def _nonempty_pieces(items: Iterable[Piece | None]) -> tuple[Piece, ...]:
    return tuple(p for p in items if p is not None)


class Planned(LinearOperator):
    """Base of the out-of-place collectives: a node defined by a :class:`Plan`.

    Subclasses provide ``_setup`` (validation, called after construction), ``_sources`` and
    ``_targets`` (the blocks they consume and produce) and ``_pieces``; ``ADDS`` says whether the
    pieces are added (the adjoint of a copy) or copied. ``others`` are pass-through blocks.
    Interpreters may register one fast path for this base class and serve every subclass.
    """

    others: Space
    ADDS: ClassVar[bool] = False

    def __post_init__(self) -> None:
        self._setup()

    @abstractmethod
    def _setup(self) -> None:
        """Check the fields, then :meth:`_validate` the spaces."""

    @abstractmethod
    def _sources(self) -> tuple[Block, ...]:
        """The blocks the operator consumes."""

    @abstractmethod
    def _targets(self) -> tuple[Block, ...]:
        """The blocks the operator produces."""

    @abstractmethod
    def _pieces(self) -> tuple[Piece, ...]:
        """The boxes that travel from consumed to produced blocks."""

    def _validate(self) -> None:
        if not isinstance(self.others, Space):
            raise TypeError(
                f"{type(self).__name__}: others must be a Space, not {type(self.others).__name__}"
            )
        kind = type(self).__name__
        _union(kind, self._sources(), self._targets(), self.others)
        object.__setattr__(self, "_domain", _union(kind, self.others, self._sources()))
        object.__setattr__(self, "_range", _union(kind, self.others, self._targets()))

    @property
    def domain(self) -> Space:
        return self._domain  # type: ignore[attr-defined]

    @property
    def range(self) -> Space:
        return self._range  # type: ignore[attr-defined]

    @functools.cached_property
    def plan(self) -> Plan:
        """The node's plan (computed once): create the targets, move the pieces, drop the
        sources."""
        return Plan(self._targets(), self._pieces(), tuple(b.name for b in self._sources()), adds=self.ADDS)

    def expand(self) -> LinearOperator:
        """The plan in primitives (see :meth:`Plan.expand`)."""
        return self.plan.expand(self.domain)


_NO_OTHERS = Space()


# -- broadcast and sum-reduce ----------------------------------------------------------------------
class _BroadcastGeometry(Planned):
    tensor: Layout
    partition: Partition
    name: str
    transpose: bool
    others: Space

    def _setup(self) -> None:
        kind = type(self).__name__
        _check_layout(kind, self.tensor, "tensor")
        if not isinstance(self.partition, Partition):
            raise TypeError(f"{kind}: partition must be a Partition, not {type(self.partition).__name__}")
        _require_name(kind, self.name)
        object.__setattr__(self, "transpose", bool(self.transpose))
        mapping = broadcast_map(self.tensor.partition, self.partition, transpose=self.transpose)
        object.__setattr__(self, "_map", mapping)
        shapes = tuple(self.tensor.block(mapping[j]).shape for j in self.partition.indices())
        object.__setattr__(self, "_copies", BlockGrid(self.name, self.partition, shapes))
        self._validate()

    @property
    def copies(self) -> BlockGrid:
        """The layout of the copies: ``name[j]`` on worker ``partition.worker(j)``."""
        return self._copies  # type: ignore[attr-defined]

    def source_index(self, index: Sequence[int]) -> tuple[int, ...]:
        """The tensor's grid index whose block is copied to copy ``index``."""
        return self._map[tuple(index)]  # type: ignore[attr-defined]

    def _copy_pieces(self) -> tuple[Piece, ...]:
        items = []
        for j in self.partition.indices():
            block = self.tensor.block(self.source_index(j))
            items.append(_piece(block, _whole(block), self.copies.block_name(j), _whole(block), block.shape))
        return _nonempty_pieces(items)

    @property
    def multiplicity(self) -> dict[tuple[int, ...], int]:
        """For each tensor grid index, the number of copies of its block."""
        counts = {i: 0 for i in self.tensor.partition.indices()}
        for j in self.partition.indices():
            counts[self.source_index(j)] += 1
        return counts


@dataclass(frozen=True, eq=True, repr=False)
class Broadcast(_BroadcastGeometry):
    r"""Copy every block of a layout to the workers of a partition it broadcasts to.

    .. math::

        y_j = x_{\beta(j)} \quad (\text{every } j \text{ of } P_y), \qquad
        B = \begin{bmatrix} I \\ I \\ \vdots \end{bmatrix} \text{ per source block}, \qquad
        B^* = R: \; x_i = \sum_{j : \beta(j) = i} y_j

    where :math:`\beta` is :func:`broadcast_map`. Out of place: the ``tensor`` blocks are dropped,
    the copies ``name[j]`` are new. A copy on the source's own worker is a Copy, any other a
    SendRecv.

    Parameters
    ----------
    tensor : DistributedTensor or BlockGrid
        The source layout x, on a partition that broadcasts to ``partition``.
    partition : Partition
        The destination partition P_y.
    name : str
        Prefix of the copies' block names (must differ from the tensor's).
    transpose : bool, optional
        Reverse the source partition's shape first (DistDL's ``transpose_src``).
    others : Space, optional
        Blocks that pass through unchanged.

    Raises
    ------
    BroadcastError
        If the partition shapes do not broadcast.
    BlockExistsError
        If a block name is used twice (source, copies, pass-through blocks).
    """

    tensor: Layout
    partition: Partition
    name: str
    transpose: bool = False
    others: Space = _NO_OTHERS

    def _sources(self) -> tuple[Block, ...]:
        return self.tensor.blocks

    def _targets(self) -> tuple[Block, ...]:
        return self.copies.blocks

    def _pieces(self) -> tuple[Piece, ...]:
        return self._copy_pieces()

    def adjoint(self) -> LinearOperator:
        """B* = R: the sum-reduce of the copies back onto the tensor."""
        return SumReduce(self.tensor, self.partition, self.name, self.transpose, self.others)

    def __str__(self) -> str:
        return f"B[{self.tensor.name} -> {self.name}]"


@dataclass(frozen=True, eq=True, repr=False)
class SumReduce(_BroadcastGeometry):
    r"""Sum the copies of every block of a layout back onto it: the adjoint of :class:`Broadcast`.

    .. math::

        x_i = \sum_{j : \beta(j) = i} y_j, \qquad R = [\, I \; I \; \cdots \,] \text{ per target
        block}, \qquad R^* = B

    The fields mean exactly what they mean for :class:`Broadcast` (``SumReduce(x, P, "y")`` is
    ``Broadcast(x, P, "y").H``): the domain holds the copies ``name[j]`` on ``partition``, the
    range the blocks of ``tensor``. Out of place: the copies are dropped.

    Raises
    ------
    BroadcastError, BlockExistsError
        As for :class:`Broadcast`.
    """

    tensor: Layout
    partition: Partition
    name: str
    transpose: bool = False
    others: Space = _NO_OTHERS
    ADDS = True  # the pieces are added back: the adjoint of copies

    def _sources(self) -> tuple[Block, ...]:
        return self.copies.blocks

    def _targets(self) -> tuple[Block, ...]:
        return self.tensor.blocks

    def _pieces(self) -> tuple[Piece, ...]:
        return tuple(p.reversed() for p in self._copy_pieces())

    def adjoint(self) -> LinearOperator:
        """R* = B."""
        return Broadcast(self.tensor, self.partition, self.name, self.transpose, self.others)

    def __str__(self) -> str:
        return f"R[{self.name} -> {self.tensor.name}]"


# -- all-reduce -------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=True, repr=False)
class AllReduce(LinearOperator):
    r"""Sum the blocks of every group along ``axes``, and give every member the sum (in place).

    .. math::

        x_j \leftarrow \sum_{k \in G(j)} x_k, \qquad A = B R, \qquad A^* = R^* B^* = B R = A

    where :math:`G(j)` is the group of grid indices that differ from ``j`` only on ``axes``
    (:func:`reduction_groups`). The expansion reduces onto each group's first member (receive-
    sends that add, :class:`~linop.SendRecvAdjoint`) and broadcasts back
    (:class:`~linop.SendRecv`), the tree-free linear form of ``docs/theory.md#collectives``.

    Parameters
    ----------
    tensor : DistributedTensor or BlockGrid
        The layout; blocks of one group must have the same shape.
    axes : int or sequence of int
        Partition axes to reduce over (none: the identity).
    others : Space, optional
        Blocks that pass through unchanged.

    Raises
    ------
    PartitionError
        If an axis is out of range or repeated.
    ShapeMismatchError
        If two blocks of one group differ in shape (names both).
    """

    tensor: Layout
    axes: tuple[int, ...] = ()
    others: Space = _NO_OTHERS

    def __post_init__(self) -> None:
        _check_layout("AllReduce", self.tensor, "tensor")
        axes = _sorted_axes("AllReduce", self.axes, self.tensor.partition)
        object.__setattr__(self, "axes", axes)
        groups = reduction_groups(self.tensor.partition, axes)
        for group in groups:
            root = self.tensor.block(group[0])
            for index in group[1:]:
                member = self.tensor.block(index)
                if member.shape != root.shape:
                    raise ShapeMismatchError(
                        f"AllReduce over axes {axes}: block {member.name!r} has shape {member.shape} but "
                        f"block {root.name!r} of the same group has shape {root.shape}"
                    )
        object.__setattr__(self, "_groups", groups)
        space = _union("AllReduce", self.tensor.blocks, self.others)
        object.__setattr__(self, "_space", space)

    @property
    def groups(self) -> list[list[tuple[int, ...]]]:
        """The reduction groups of grid indices (first member is the root)."""
        return self._groups  # type: ignore[attr-defined]

    @property
    def domain(self) -> Space:
        return self._space  # type: ignore[attr-defined]

    @property
    def range(self) -> Space:
        return self._space  # type: ignore[attr-defined]

    def expand(self) -> LinearOperator:
        """Per group: root += member, member <- 0 (reduce); then member <- root (broadcast)."""
        space = self.domain
        reduce: list[LinearOperator] = []
        spread: list[LinearOperator] = []
        for group in self.groups:
            root = space[self.tensor.block_name(group[0])]
            for index in group[1:]:
                member = space[self.tensor.block_name(index)]
                if member.size == 0:
                    continue
                remote = member.worker != root.worker
                reduce.append(SendRecvAdjoint(root, member) if remote else CopyAdjoint(root, member))
                spread.append(SendRecv(root, member) if remote else Copy(root, member))
        factors = reduce + spread
        if not factors:
            return Identity(space)
        return Composition(tuple(reversed(factors)))

    def adjoint(self) -> LinearOperator:
        """(B R)* = B R: self-adjoint."""
        return self

    def __str__(self) -> str:
        return f"BR[{self.tensor.name}; axes {list(self.axes)}]"


# -- all-gather and reduce-scatter --------------------------------------------------------------------
class _GatherGeometry(Planned):
    tensor: DistributedTensor
    axes: tuple[int, ...]
    name: str
    others: Space

    def _setup(self) -> None:
        kind = type(self).__name__
        _require_tensor(kind, "tensor", self.tensor)
        _require_name(kind, self.name)
        axes = _sorted_axes(kind, self.axes, self.tensor.partition)
        object.__setattr__(self, "axes", axes)
        object.__setattr__(self, "_gathered", gathered_layout(self.tensor, axes, self.name))
        self._validate()

    @property
    def gathered(self) -> BlockGrid:
        """The gathered layout ``name[j]`` (see :func:`gathered_layout`)."""
        return self._gathered  # type: ignore[attr-defined]

    def _gather_pieces(self) -> tuple[Piece, ...]:
        """x_i (whole) -> g_j at x_i's offset along ``axes``, for every j and i of one group."""
        items = []
        for group in reduction_groups(self.tensor.partition, self.axes):
            for j in group:
                for i in group:
                    block = self.tensor.block(i)
                    start = self.tensor.box(i)[0]
                    offset = tuple(start[d] if d in self.axes else 0 for d in range(self.tensor.ndim))
                    items.append(
                        _piece(block, _whole(block), self.gathered.block_name(j), offset, block.shape)
                    )
        return _nonempty_pieces(items)


@dataclass(frozen=True, eq=True, repr=False)
class AllGather(_GatherGeometry):
    r"""Give every worker of a group along ``axes`` the whole group's part of a tensor.

    .. math::

        g_j = \big[\, x_i \,\big]_{i \in G(j)} \text{ (assembled along axes)}, \qquad
        AG^* = RS: \; x_i = \sum_{j \in G(i)} g_j\big|_{\text{box of } x_i}

    Block ``name[j]`` of the gathered layout covers the global box of ``tensor`` block ``j``
    with every dimension in ``axes`` widened to the whole global extent; it lives on the same
    worker as block ``j``. Out of place: the tensor's blocks are dropped.

    Parameters
    ----------
    tensor : DistributedTensor
    axes : int or sequence of int
        Partition axes (= tensor dimensions) to gather along.
    name : str
        Prefix of the gathered blocks' names.
    others : Space, optional
        Blocks that pass through unchanged.
    """

    tensor: DistributedTensor
    axes: tuple[int, ...]
    name: str
    others: Space = _NO_OTHERS

    def _sources(self) -> tuple[Block, ...]:
        return self.tensor.blocks

    def _targets(self) -> tuple[Block, ...]:
        return self.gathered.blocks

    def _pieces(self) -> tuple[Piece, ...]:
        return self._gather_pieces()

    def adjoint(self) -> LinearOperator:
        """AG* = RS."""
        return ReduceScatter(self.tensor, self.axes, self.name, self.others)

    def __str__(self) -> str:
        return f"AG[{self.tensor.name} -> {self.name}; axes {list(self.axes)}]"


@dataclass(frozen=True, eq=True, repr=False)
class ReduceScatter(_GatherGeometry):
    r"""Sum the gathered blocks of every group and give each worker its own box: the adjoint of
    :class:`AllGather`.

    .. math:: x_i = \sum_{j \in G(i)} g_j\big|_{\text{box of } x_i}, \qquad RS^* = AG

    The fields mean exactly what they mean for :class:`AllGather`: the domain holds the
    gathered blocks ``name[j]``, the range the tensor's blocks. Out of place.
    """

    tensor: DistributedTensor
    axes: tuple[int, ...]
    name: str
    others: Space = _NO_OTHERS
    ADDS = True  # the pieces are added back: the adjoint of copies

    def _sources(self) -> tuple[Block, ...]:
        return self.gathered.blocks

    def _targets(self) -> tuple[Block, ...]:
        return self.tensor.blocks

    def _pieces(self) -> tuple[Piece, ...]:
        return tuple(p.reversed() for p in self._gather_pieces())

    def adjoint(self) -> LinearOperator:
        """RS* = AG."""
        return AllGather(self.tensor, self.axes, self.name, self.others)

    def __str__(self) -> str:
        return f"RS[{self.name} -> {self.tensor.name}; axes {list(self.axes)}]"
