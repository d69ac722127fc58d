r"""Collectives between block layouts on partitions (``docs/theory.md#collectives``).

The nodes here move data between layouts (:mod:`linop.layout`: a
:class:`~linop.partition.DistributedTensor` or a :class:`~linop.layout.BlockGrid`);
:mod:`linop.repartition` adds the all-to-all, scatter and gather:

===========================  ============================================  ======================
node                         forward                                       adjoint
===========================  ============================================  ======================
Broadcast(x, P, "y")         every y block is a copy of its x block        SumReduce(x, P, "y")
SumReduce(x, P, "y")         every x block is the sum of its copies        Broadcast(x, P, "y")
AllReduce(x, axes)           every block <- sum over its group (B R)       itself
AllGather(x, axes, "g")      every g block holds its group's x blocks      ReduceScatter
ReduceScatter(x, axes, "g")  every x block <- sum of its box in the g's    AllGather
===========================  ============================================  ======================

All but :class:`AllReduce` are out of place: the source blocks are dropped and the
destination blocks are new (their names must differ). Blocks listed in ``others`` pass through
unchanged, so a collective can act inside a larger program space. Each out-of-place node is
defined by a :class:`~linop.pieces.PieceMovement` (:mod:`linop.pieces`), which expands into the
primitives and which the interpreters' fast paths read. A node and its adjoint share their
fields, declared once in a common base, and build each other by keyword.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from .errors import OperandError, ShapeMismatchError
from .layout import (
    BlockGrid,
    BroadcastRule,
    Layout,
    ProductShapes,
    broadcast_map,
    check_layout,
    gathered_layout,
    group_of,
    reduction_groups,
    require_name,
    require_tensor,
    sorted_axes,
    union_space,
)
from .movement import Copy, CopyAdjoint, SendRecv, SendRecvAdjoint
from .operator import Composition, Identity, LinearOperator, SameSpace
from .partition import DistributedTensor, Partition, WorkerBox
from .pieces import NO_OTHERS, JoinedSpace, Piece, PieceMover, fields_of, make_piece, nonempty_pieces, origin
from .space import Space

__all__ = [
    "AllGather",
    "AllReduce",
    "BlockGrid",
    "Broadcast",
    "Layout",
    "PieceMover",
    "ReduceScatter",
    "SumReduce",
    "broadcast_map",
    "gathered_layout",
    "reduction_groups",
]


# -- broadcast and sum-reduce ----------------------------------------------------------------------
@dataclass(frozen=True, eq=True, repr=False)
class _BroadcastGeometry(PieceMover):
    """The fields and geometry shared by :class:`Broadcast` and its adjoint :class:`SumReduce`
    (declared once here; each builds the other from them by keyword)."""

    tensor: Layout
    partition: Partition
    name: str
    transpose: bool = False
    others: Space = NO_OTHERS
    _rule: BroadcastRule = field(init=False, repr=False, compare=False)
    _copies: BlockGrid = field(init=False, repr=False, compare=False)

    def _setup(self) -> None:
        kind = type(self).__name__
        check_layout(kind, self.tensor, "tensor")
        if not isinstance(self.partition, Partition):
            raise OperandError(f"{kind}: partition must be a Partition, not {type(self.partition).__name__}")
        require_name(kind, self.name)
        object.__setattr__(self, "transpose", bool(self.transpose))
        rule = BroadcastRule(self.tensor.partition, self.partition, self.transpose)
        object.__setattr__(self, "_rule", rule)
        shapes: Sequence[tuple[int, ...]] | None = _copy_shapes(self.tensor, rule)
        if shapes is None:  # listed: the map's source of every copy (O(P), described cases aside)
            mapping = broadcast_map(self.tensor.partition, self.partition, transpose=self.transpose)
            source_shapes = {i: self.tensor.block(i).shape for i in dict.fromkeys(mapping.values())}
            shapes = tuple(source_shapes[mapping[j]] for j in self.partition.indices())
        object.__setattr__(self, "_copies", BlockGrid(self.name, self.partition, shapes))
        self._validate()

    @property
    def copies(self) -> BlockGrid:
        """The layout of the copies: ``name[j]`` on worker ``partition.worker(j)``."""
        return self._copies

    def source_index(self, index: Sequence[int]) -> tuple[int, ...]:
        """The tensor's grid index whose block is copied to copy ``index``."""
        return self._rule.source_index(self.partition.checked_index(index))

    def copy_box(self, index: Sequence[int]) -> WorkerBox:
        """The workers of the copies of the tensor block at ``index`` (in C order of their copy
        index), described by their box of the copies' partition, not listed."""
        return WorkerBox(self.partition, self._rule.copy_box(self.tensor.partition.checked_index(index)))

    def _forward_layouts(self) -> tuple[Layout, Layout]:
        return self.tensor, self.copies

    def _forward_pieces(self) -> tuple[Piece, ...]:
        """Each copy's whole block from its source block."""
        items = []
        for j in self.partition.indices():
            block = self.tensor.block(self.source_index(j))
            items.append(
                make_piece(block, origin(block), self.copies.block_name(j), origin(block), block.shape)
            )
        return nonempty_pieces(items)

    def copies_of(self, index: Sequence[int]) -> tuple[tuple[int, ...], ...]:
        """The copy indices that receive the tensor block at ``index``, in C order (listed from
        :meth:`copy_box`: the inverse of :meth:`source_index`)."""
        box = self.copy_box(index)
        return tuple(box.grid_index(k) for k in range(len(box)))

    @property
    def multiplicity(self) -> dict[tuple[int, ...], int]:
        """For each tensor grid index, the number of copies of its block."""
        counts = {i: 0 for i in self.tensor.partition.indices()}
        for j in self.partition.indices():
            counts[self.source_index(j)] += 1
        return counts


def _copy_shapes(tensor: Layout, rule: BroadcastRule) -> ProductShapes | None:
    """The shapes of a broadcast's copies as a product rule (the copy at destination index
    ``j`` has its source block's shape), or None when they are not one (a transposed route, a
    block grid of listed shapes that differ)."""
    counts = rule.destination.shape
    if isinstance(tensor, DistributedTensor):
        source: ProductShapes | None = ProductShapes(tensor.partition.shape, tensor.sizes)
    elif isinstance(tensor, BlockGrid) and isinstance(tensor.shapes, ProductShapes):
        source = tensor.shapes
    elif (
        isinstance(tensor, BlockGrid)
        and len(tensor.shapes)
        and tensor.shapes.count(tensor.shapes[0]) == len(tensor.shapes)
    ):
        source = ProductShapes.uniform(tensor.partition.shape, tensor.shapes[0])
    else:
        source = None
    if source is None:
        return None
    if rule.transpose and any(e is not None for e in source.extents):
        return None  # the reshaped route mixes the dimensions: listed
    extents: list[tuple[int, ...] | None] = [None] * rule.pad
    for d in range(rule.pad, len(counts)):
        e = source.extents[d - rule.pad] if not rule.transpose else None
        if e is not None and rule.padded[d] != counts[d]:  # broadcast along d: the one block's extent
            e = (e[0],) * counts[d]
        extents.append(e)
    return ProductShapes(counts, extents, source.tail)


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
        Route as DistDL's ``transpose_src``: the source grid reshaped to its reversed shape
        (workers in C order), see :func:`~linop.layout.broadcast_map`.
    others : Space, optional
        Blocks that pass through unchanged.

    Raises
    ------
    BroadcastError
        If the partition shapes do not broadcast.
    BlockExistsError
        If a block name is used twice (source, copies, pass-through blocks).

    Examples
    --------
    One block on worker 0, broadcast to a partition of three workers; the adjoint sums the
    three copies back, so ``R B = 3 I``:

    >>> import numpy as np
    >>> import verify
    >>> from linop import Broadcast, DistributedTensor, Identity, Partition
    >>> x = DistributedTensor("x", (2,), Partition((1,)))
    >>> broadcast = Broadcast(x, Partition((3,)), "y")
    >>> copies = broadcast({"x[0]": np.array([1, 2])})
    >>> copies
    {'y[0]': array([1, 2]), 'y[1]': array([1, 2]), 'y[2]': array([1, 2])}
    >>> [block.worker for block in broadcast.range.blocks]
    [0, 1, 2]
    >>> print(broadcast.H, broadcast.H(copies))
    R[y -> x] {'x[0]': array([3, 6])}
    >>> bool(verify.equal(broadcast.H @ broadcast, 3 * Identity(broadcast.domain)))
    True
    """

    def adjoint(self) -> LinearOperator:
        """B* = R: the sum-reduce of the copies back onto the tensor."""
        return SumReduce(**fields_of(self))

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

    Parameters
    ----------
    tensor, partition, name, transpose, others
        As for :class:`Broadcast`.

    Raises
    ------
    BroadcastError, BlockExistsError
        As for :class:`Broadcast`.

    Examples
    --------
    >>> import numpy as np
    >>> from linop import DistributedTensor, Partition, SumReduce
    >>> x = DistributedTensor("x", (2,), Partition((1,)))
    >>> reduce = SumReduce(x, Partition((3,)), "y")
    >>> reduce.domain.names, reduce.range.names
    (('y[0]', 'y[1]', 'y[2]'), ('x[0]',))
    >>> reduce({f"y[{j}]": np.array([j, 10 * j]) for j in range(3)})
    {'x[0]': array([ 3, 30])}
    """

    ADDS = BACKWARD = True  # the copies' pieces added back: the adjoint of copies

    def adjoint(self) -> LinearOperator:
        """R* = B."""
        return Broadcast(**fields_of(self))

    def __str__(self) -> str:
        return f"R[{self.name} -> {self.tensor.name}]"


# -- all-reduce -------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=True, repr=False)
class AllReduce(SameSpace):
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

    Examples
    --------
    >>> import numpy as np
    >>> from linop import AllReduce, DistributedTensor, Partition
    >>> t = DistributedTensor("t", (4,), Partition((2,)))
    >>> allreduce = AllReduce(t, 0)
    >>> allreduce({"t[0]": np.array([1, 2]), "t[1]": np.array([10, 20])})
    {'t[0]': array([11, 22]), 't[1]': array([11, 22])}
    >>> allreduce.H == allreduce
    True
    """

    tensor: Layout
    axes: tuple[int, ...] = ()
    others: Space = NO_OTHERS
    _space: Space = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_layout("AllReduce", self.tensor, "tensor")
        axes = sorted_axes("AllReduce", self.axes, self.tensor.partition)
        object.__setattr__(self, "axes", axes)
        if not _equal_along(self.tensor, axes):
            for group in self.groups:
                root = self.tensor.block(group[0])
                for index in group[1:]:
                    member = self.tensor.block(index)
                    if member.shape != root.shape:
                        raise ShapeMismatchError(
                            f"AllReduce over axes {axes}: block {member.name!r} has shape {member.shape} but "
                            f"block {root.name!r} of the same group has shape {root.shape}"
                        )
        if isinstance(self.others, Space) and len(self.others):
            # the tensor's grid and the pass-through blocks, joined without listing either
            # when they share no name by their rules (else listed, a repeated name raising)
            space = JoinedSpace.union("AllReduce", self.tensor.space, self.others)
        elif not isinstance(self.others, Space):
            space = union_space("AllReduce", self.tensor.blocks, self.others)
        else:  # the tensor's own space, described by its rule
            space = self.tensor.space
        object.__setattr__(self, "_space", space)

    @property
    def groups(self) -> list[list[tuple[int, ...]]]:
        """The reduction groups of grid indices (first member is the root; listed on first
        use: a rank's planning describes its own group from the partition instead)."""
        try:
            return object.__getattribute__(self, "_groups")
        except AttributeError:
            groups = reduction_groups(self.tensor.partition, self.axes)
            object.__setattr__(self, "_groups", groups)
            return groups

    @property
    def space(self) -> Space:
        """The tensor's blocks and the pass-through ones: domain and range."""
        return self._space

    def expand(self) -> LinearOperator:
        """Per group: root += member, member <- 0 (reduce); then member <- root (broadcast)."""
        reduce: list[LinearOperator] = []
        spread: list[LinearOperator] = []
        for group in self.groups:
            self.group_moves(group[0], group[1:], reduce, spread)
        factors = reduce + spread
        if not factors:
            return Identity(self.domain)
        return Composition(tuple(reversed(factors)))

    def group_moves(
        self,
        root_index: tuple[int, ...],
        members: Iterable[tuple[int, ...]],
        reduce: list[LinearOperator],
        spread: list[LinearOperator],
    ) -> None:
        """The expansion's moves of one group's ``members`` (grid indices, without the root),
        appended in order: to ``reduce`` each non-empty member's ``root += member, member <- 0``
        (a send-receive's adjoint, or a copy's on one worker), to ``spread`` its
        ``member <- root``."""
        space = self.domain
        root = space[self.tensor.block_name(root_index)]
        for index in members:
            member = space[self.tensor.block_name(index)]
            if member.size == 0:
                continue
            remote = member.worker != root.worker
            reduce.append(SendRecvAdjoint(root, member) if remote else CopyAdjoint(root, member))
            spread.append(SendRecv(root, member) if remote else Copy(root, member))

    def adjoint(self) -> LinearOperator:
        """(B R)* = B R: self-adjoint."""
        return self

    def __str__(self) -> str:
        return f"BR[{self.tensor.name}; axes {list(self.axes)}]"


def _equal_along(layout: Layout, axes: tuple[int, ...]) -> bool:
    """True when a distributed tensor's blocks have equal extents along ``axes`` (so every
    reduction group's blocks have one shape), decided from the sizes without building blocks;
    False for other layouts or unequal sizes (the caller then compares block by block). A
    block grid whose blocks all have one shape is equal along any axes."""
    if not isinstance(layout, DistributedTensor):
        shapes = getattr(layout, "shapes", None)
        if isinstance(shapes, ProductShapes):  # described: decided from its rule
            return shapes.uniform_along(axes)
        return type(shapes) is tuple and len(shapes) > 0 and shapes.count(shapes[0]) == len(shapes)
    return all(len(set(layout.sizes[d])) == 1 for d in axes)


# -- all-gather and reduce-scatter --------------------------------------------------------------------
@dataclass(frozen=True, eq=True, repr=False)
class _GatherGeometry(PieceMover):
    """The fields and geometry shared by :class:`AllGather` and its adjoint
    :class:`ReduceScatter` (declared once here; each builds the other from them by keyword)."""

    tensor: DistributedTensor
    axes: tuple[int, ...]
    name: str
    others: Space = NO_OTHERS
    _gathered: BlockGrid = field(init=False, repr=False, compare=False)

    def _setup(self) -> None:
        kind = type(self).__name__
        require_tensor(kind, "tensor", self.tensor)
        require_name(kind, self.name)
        axes = sorted_axes(kind, self.axes, self.tensor.partition)
        object.__setattr__(self, "axes", axes)
        object.__setattr__(self, "_gathered", gathered_layout(self.tensor, axes, self.name))
        self._validate()

    @property
    def gathered(self) -> BlockGrid:
        """The gathered layout ``name[j]`` (see :func:`gathered_layout`)."""
        return self._gathered

    def _gather_piece(self, i: tuple[int, ...], j: tuple[int, ...]) -> Piece | None:
        """x_i (whole) -> g_j at x_i's offset along ``axes`` (None when x_i is empty)."""
        block = self.tensor.block(i)
        start = self.tensor.box(i)[0]
        offset = tuple(start[d] if d in self.axes else 0 for d in range(self.tensor.ndim))
        return make_piece(block, origin(block), self.gathered.block_name(j), offset, block.shape)

    def _forward_layouts(self) -> tuple[Layout, Layout]:
        return self.tensor, self.gathered

    def _forward_pieces(self) -> tuple[Piece, ...]:
        """x_i (whole) -> g_j at x_i's offset along ``axes``, for every j and i of one group."""
        return nonempty_pieces(
            self._gather_piece(i, j)
            for group in reduction_groups(self.tensor.partition, self.axes)
            for j in group
            for i in group
        )

    def rank_pieces(self, worker: int) -> tuple[Piece, ...]:
        """The pieces of ``worker``'s group that start or end at its blocks, in movement order: into
        its gathered block from every member, and from its block to every other member's (the
        group only: O(group size), not the job's)."""
        partition = self.tensor.partition
        if partition.position(worker) is None:
            return ()
        own = partition.index(worker)
        group = group_of(partition, self.axes, own)
        pieces = nonempty_pieces(
            self._gather_piece(i, j) for j in group for i in (group if j == own else [own])
        )
        return self._oriented(pieces)


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

    Raises
    ------
    PartitionError
        If an axis is out of range or repeated.
    BlockExistsError
        If a block name is used twice.

    Examples
    --------
    >>> import numpy as np
    >>> import verify
    >>> from linop import AllGather, DistributedTensor, Partition
    >>> t = DistributedTensor("t", (4,), Partition((2,)))
    >>> gather = AllGather(t, 0, "g")
    >>> gather(t.scatter(np.arange(4)))
    {'g[0]': array([0, 1, 2, 3]), 'g[1]': array([0, 1, 2, 3])}
    >>> print(gather.H, bool(verify.exact_adjoint(gather)))
    RS[g -> t; axes [0]] True
    """

    def adjoint(self) -> LinearOperator:
        """AG* = RS."""
        return ReduceScatter(**fields_of(self))

    def __str__(self) -> str:
        return f"AG[{self.tensor.name} -> {self.name}; axes {list(self.axes)}]"


@dataclass(frozen=True, eq=True, repr=False)
class ReduceScatter(_GatherGeometry):
    r"""Sum the gathered blocks of every group and give each worker its own box: the adjoint of
    :class:`AllGather`.

    .. math:: x_i = \sum_{j \in G(i)} g_j\big|_{\text{box of } x_i}, \qquad RS^* = AG

    The fields mean exactly what they mean for :class:`AllGather`: the domain holds the
    gathered blocks ``name[j]``, the range the tensor's blocks. Out of place.

    Parameters
    ----------
    tensor, axes, name, others
        As for :class:`AllGather`.

    Raises
    ------
    PartitionError, BlockExistsError
        As for :class:`AllGather`.

    Examples
    --------
    >>> import numpy as np
    >>> from linop import DistributedTensor, Partition, ReduceScatter
    >>> t = DistributedTensor("t", (4,), Partition((2,)))
    >>> scatter = ReduceScatter(t, 0, "g")
    >>> scatter({"g[0]": np.array([1, 2, 3, 4]), "g[1]": np.array([10, 20, 30, 40])})
    {'t[0]': array([11, 22]), 't[1]': array([33, 44])}
    """

    ADDS = BACKWARD = True  # the gathered pieces added back: the adjoint of copies

    def adjoint(self) -> LinearOperator:
        """RS* = AG."""
        return AllGather(**fields_of(self))

    def __str__(self) -> str:
        return f"RS[{self.name} -> {self.tensor.name}; axes {list(self.axes)}]"
