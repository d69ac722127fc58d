"""Layouts: one block per worker of a partition, and how the layouts of a collective map onto
each other (``docs/theory.md#collectives``).

A *layout* is what a collective moves data between: a :class:`~linop.partition.DistributedTensor`
(blocks cut from one global array) or a :class:`BlockGrid` (any block shapes, e.g. the copies a
broadcast makes). The broadcasting geometry says which source block feeds each destination block
(:func:`broadcast_map`), which blocks reduce together (:func:`reduction_groups`) and what an
all-gather produces (:func:`gathered_layout`). The validators at the end are shared by the
collective nodes (:mod:`linop.collectives`, :mod:`linop.repartition`).

Broadcasting of partitions
--------------------------
A source partition of shape ``s`` broadcasts to a destination partition of shape ``S`` as in
NumPy: ``s`` is left-padded with ones to the length of ``S`` and each of its extents equals the
destination's or is 1. Destination index ``j`` then takes its data from the source index
``i_d = j_d`` (equal extents) or ``i_d = 0`` (extent 1), the padded dimensions dropped. With
``transpose=True`` the source partition's shape (and index) is reversed first.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from .described import DescribedSequence
from .errors import BlockExistsError, BroadcastError, DecompositionError, OperandError, PartitionError
from .partition import DistributedTensor, Partition, grid_block_name, normalized_axes
from .space import Block, GridSpace, Space

__all__ = [
    "BlockGrid",
    "BroadcastRule",
    "ProductShapes",
    "Layout",
    "broadcast_map",
    "check_layout",
    "gathered_layout",
    "group_of",
    "held_by_group",
    "reduction_groups",
    "require_name",
    "require_tensor",
    "sorted_axes",
    "union_space",
]


# -- layouts ---------------------------------------------------------------------------------
@runtime_checkable
class Layout(Protocol):
    """One block per worker of a partition: what a collective moves data between.

    Both :class:`~linop.partition.DistributedTensor` and :class:`BlockGrid` are layouts
    (frozen dataclasses: their members are read-only).
    """

    @property
    def name(self) -> str: ...

    @property
    def partition(self) -> Partition: ...

    def block_name(self, index: Sequence[int]) -> str: ...

    def block(self, index: Sequence[int]) -> Block: ...

    @property
    def blocks(self) -> tuple[Block, ...]: ...

    @property
    def space(self) -> Space: ...


class ProductShapes(DescribedSequence[tuple[int, ...]]):
    """The block shapes of a grid described by a product rule, not listed: O(ndim) memory and
    look-up at any number of workers.

    The block at grid index ``g`` has shape ``(extents[d][g[d]] for every d whose extents
    are not None) + tail``: a dimension with extents gives the block one axis whose extent
    depends on the coordinate there; a dimension with None gives it none (the block is the
    same all along it); ``tail`` is appended to every shape. A uniform grid is all None with
    the shape as its tail; an all-gather's gathered blocks and a broadcast's copies are
    products too.

    It is a sequence of shapes in C order of grid index (``shapes[k]``), equal to the tuple of
    them; it hashes by its length and first, middle and last shapes, which is what a
    :class:`BlockGrid` hashes whatever form its shapes take.

    Examples
    --------
    >>> shapes = ProductShapes((2, 3), ((4, 5), None))
    >>> len(shapes), shapes[4], shapes == ((4,), (4,), (4,), (5,), (5,), (5,))
    (6, (5,), True)
    """

    __slots__ = ("_counts", "_extents", "_len", "_strides", "_tail")
    _MISSING = "shape {position} of a grid of {length} blocks"

    def __init__(
        self,
        counts: Sequence[int],
        extents: Sequence[Sequence[int] | None],
        tail: Sequence[int] = (),
    ) -> None:
        self._counts = tuple(int(n) for n in counts)
        self._extents = tuple(None if e is None else tuple(e) for e in extents)
        self._tail = tuple(tail)
        if len(self._extents) != len(self._counts) or any(
            e is not None and len(e) != n for e, n in zip(self._extents, self._counts)
        ):
            raise PartitionError(
                f"product shapes: per-dimension extents {self._extents} do not match the grid {self._counts}"
            )
        strides, step = [], 1
        for n in reversed(self._counts):
            strides.append(step)
            step *= n
        self._strides = tuple(reversed(strides))
        self._len = step

    @classmethod
    def uniform(cls, counts: Sequence[int], shape: Sequence[int]) -> ProductShapes:
        """Every block of a grid of ``counts`` of one ``shape``."""
        return cls(counts, (None,) * len(counts), shape)

    @property
    def counts(self) -> tuple[int, ...]:
        """The grid's shape."""
        return self._counts

    @property
    def extents(self) -> tuple[tuple[int, ...] | None, ...]:
        """Per grid dimension, the extent of each coordinate, or None."""
        return self._extents

    @property
    def tail(self) -> tuple[int, ...]:
        """The extents appended to every shape."""
        return self._tail

    def at(self, index: Sequence[int]) -> tuple[int, ...]:
        """The shape at a grid index."""
        return tuple(e[i] for e, i in zip(self._extents, index) if e is not None) + self._tail

    def _at(self, position: int) -> tuple[int, ...]:
        return self.at(tuple((position // s) % n for s, n in zip(self._strides, self._counts)))

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        per = [e if e is not None else (None,) * n for e, n in zip(self._extents, self._counts)]
        for row in itertools.product(*per):
            yield tuple(n for n in row if n is not None) + self._tail

    def distinct(self) -> tuple[tuple[int, ...], ...]:
        """The distinct shapes (a product of the distinct extents per dimension: a few)."""
        per = [tuple(dict.fromkeys(e)) if e is not None else (None,) for e in self._extents]
        return tuple(
            dict.fromkeys(
                tuple(n for n in row if n is not None) + self._tail for row in itertools.product(*per)
            )
        )

    def total(self) -> int:
        """The sum of the entries of every shape (the grid space's size)."""
        total = math.prod(self._tail)
        for e, n in zip(self._extents, self._counts):
            total *= n if e is None else sum(e)
        return total

    def uniform_along(self, axes: Iterable[int]) -> bool:
        """True when the shape does not change along any of ``axes``."""
        return all(len(set(self._extents[a] or ())) <= 1 for a in axes)

    def count(self, shape: Any) -> int:
        if self.distinct() == (shape,):
            return self._len
        return sum(1 for s in self if s == shape)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ProductShapes):
            if (self._counts, self._extents, self._tail) == (other._counts, other._extents, other._tail):
                return True
            return self._len == other._len and all(a == b for a, b in zip(self, other))
        if isinstance(other, (tuple, list)):
            return len(other) == self._len and all(a == tuple(b) for a, b in zip(self, other))
        return NotImplemented

    def __hash__(self) -> int:
        return shapes_hash(self)

    def __repr__(self) -> str:
        return f"ProductShapes({self._counts!r}, {self._extents!r}, {self._tail!r})"


def shapes_hash(shapes: Sequence[tuple[int, ...]]) -> int:
    """The hash of a grid's block shapes, in any form (a tuple, :class:`ProductShapes`): its
    length and its first, middle and last shapes."""
    n = len(shapes)
    return hash((n, shapes[0], shapes[n // 2], shapes[n - 1])) if n else hash(())


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
    shapes : sequence of shapes, or ProductShapes
        One block shape per worker, in C order of grid index (a :class:`ProductShapes`
        describes them by a product rule without listing them).

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
    shapes: Sequence[tuple[int, ...]]

    def __post_init__(self) -> None:
        if not isinstance(self.partition, Partition):
            raise OperandError(
                f"block grid {self.name!r}: partition must be a Partition, not {type(self.partition).__name__}"
            )
        checked: dict[object, tuple[int, ...]] = {}  # shapes repeat (a broadcast's copies): check each once

        def check(shape: object) -> tuple[int, ...]:
            if type(shape) is tuple:
                found = checked.get(shape)
                if found is None:
                    found = checked[shape] = _block_shape(self.name, shape)
                return found
            return _block_shape(self.name, shape)

        given = self.shapes
        if isinstance(given, ProductShapes):  # described: each distinct shape checked once
            if given.counts != self.partition.shape:
                raise PartitionError(
                    f"block grid {self.name!r}: shapes described for a grid {given.counts}, not for "
                    f"partition {self.partition.shape}"
                )
            for shape in given.distinct():
                checked_shape = _block_shape(self.name, shape)
                if any(n < 0 for n in checked_shape):
                    raise DecompositionError(
                        f"block grid {self.name!r}: negative extent in block shape {checked_shape}"
                    )
                Block(grid_block_name(self.name, (0,) * self.partition.ndim), checked_shape)
            return
        if type(given) is tuple and given and type(given[0]) is tuple and given.count(given[0]) == len(given):
            shapes = given if check(given[0]) is given[0] else (check(given[0]),) * len(given)  # uniform
        else:
            shapes = tuple(map(check, given))
        if len(shapes) != self.partition.size:
            raise PartitionError(
                f"block grid {self.name!r}: {len(shapes)} block shapes for the "
                f"{self.partition.size} workers of partition {self.partition.shape}"
            )
        for shape in (
            shapes[:1] if len(shapes) and shapes.count(shapes[0]) == len(shapes) else dict.fromkeys(shapes)
        ):
            if any(n < 0 for n in shape):
                raise DecompositionError(f"block grid {self.name!r}: negative extent in block shape {shape}")
            # the name and sizes as Block checks them, once per distinct shape (blocks are then
            # built without a second check)
            Block(grid_block_name(self.name, (0,) * self.partition.ndim), shape)
        object.__setattr__(self, "shapes", shapes)

    @classmethod
    def uniform(cls, name: str, partition: Partition, shape: Sequence[int]) -> BlockGrid:
        """A grid whose blocks all have the same ``shape`` (described: :class:`ProductShapes`)."""
        if not isinstance(partition, Partition):
            return cls(name, partition, ())  # the constructor names the problem
        return cls(name, partition, ProductShapes.uniform(partition.shape, _block_shape(name, shape)))

    def __hash__(self) -> int:
        # the shapes by length and three of them, so a tuple and a described form that are
        # equal hash alike (and P shapes are never hashed one by one)
        return hash((self.name, self.partition, shapes_hash(self.shapes)))

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
        index = self.partition.checked_index(index)  # its C-order position: no table of P indices
        shape = self.shapes[self.partition.flat(index)]
        return Block.trusted(self.block_name(index), shape, self.partition.worker(index))  # validated here

    @property
    def blocks(self) -> tuple[Block, ...]:
        """All blocks, in C order of grid index."""
        return tuple(self.block(i) for i in self.partition.indices())

    @property
    def space(self) -> Space:
        """The space of the grid's blocks (described by the partition and the shapes:
        :class:`~linop.space.GridSpace`). Shapes that are a product with one extent per grid
        dimension and nothing appended give the grid space of those extents, the rule a
        distributed tensor's or a halo window's space has: equal to it by rule, no shape listed."""
        shapes = self.shapes
        if isinstance(shapes, ProductShapes) and not shapes.tail:
            extents = tuple(e for e in shapes.extents if e is not None)
            if len(extents) == len(shapes.extents):
                return GridSpace(self.name, self.partition, extents=extents)
        return GridSpace(self.name, self.partition, shapes=shapes)

    def __str__(self) -> str:
        return f"{self.name} on {self.partition}"


def _block_shape(grid: str, shape: object) -> tuple[int, ...]:
    try:
        return tuple(operator.index(n) for n in shape)  # type: ignore[attr-defined]
    except TypeError:
        raise DecompositionError(
            f"block grid {grid!r}: block shape {shape!r} is not a tuple of integers"
        ) from None


def union_space(kind: str, *groups: Iterable[Block]) -> Space:
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


def require_tensor(kind: str, what: str, value: object) -> None:
    """Raise an OperandError (a TypeError) naming node ``kind`` unless ``value`` is a distributed tensor."""
    if not isinstance(value, DistributedTensor):
        raise OperandError(f"{kind}: {what} must be a DistributedTensor, not {type(value).__name__}")


def require_name(kind: str, name: object) -> None:
    """Raise an OperandError (a TypeError) naming node ``kind`` unless ``name`` is a non-empty string."""
    if not isinstance(name, str) or not name:
        raise OperandError(f"{kind}: name must be a non-empty string, not {name!r}")


def check_layout(kind: str, layout: object, what: str) -> None:
    """Raise an OperandError (a TypeError) naming node ``kind`` unless ``layout`` is a :class:`Layout`."""
    if isinstance(layout, (DistributedTensor, BlockGrid)):
        return  # (the protocol's isinstance reads every member: a tensor's blocks, all P of them)
    if not isinstance(layout, Layout):
        raise OperandError(
            f"{kind}: {what} must be a DistributedTensor or a BlockGrid, not {type(layout).__name__}"
        )


def sorted_axes(kind: str, axes: Sequence[int] | int, partition: Partition) -> tuple[int, ...]:
    """The partition axes ``axes`` normalized (negative ones wrapped, checked) and sorted."""
    return tuple(sorted(normalized_axes(kind, axes, partition)))


# -- broadcasting geometry -----------------------------------------------------------------------


class BroadcastRule:
    """:func:`broadcast_map` described, not tabulated: the source index of any destination
    index and the box of destination indices that copy any source index, in O(ndim) each.

    Raises
    ------
    BroadcastError
        As :func:`broadcast_map` (the shapes do not broadcast; the message names the dimension).
    """

    __slots__ = ("destination", "pad", "padded", "reshaped", "source", "transpose")

    def __init__(self, source: Partition, destination: Partition, transpose: bool = False) -> None:
        for what, partition in (("source", source), ("destination", destination)):
            if not isinstance(partition, Partition):
                raise OperandError(
                    f"broadcast_map: the {what} must be a Partition, not {type(partition).__name__}"
                )
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
        self.source, self.destination, self.transpose = source, destination, bool(transpose)
        self.reshaped, self.pad, self.padded = shape, pad, padded

    def source_index(self, index: Sequence[int]) -> tuple[int, ...]:
        """The source grid index whose block destination ``index`` copies."""
        pad, padded = self.pad, self.padded
        reshaped = tuple(index[d] if padded[d] != 1 else 0 for d in range(pad, len(padded)))
        if not self.transpose:
            return reshaped
        if not self.reshaped:
            return ()
        position = int(np.ravel_multi_index(reshaped, self.reshaped))
        return tuple(int(n) for n in np.unravel_index(position, self.source.shape))

    def copy_box(self, index: Sequence[int]) -> tuple[int | None, ...]:
        """The destination indices that copy source ``index``: per destination dimension its
        fixed coordinate, or None for every coordinate (a box: see
        :class:`~linop.partition.WorkerBox`)."""
        index = tuple(index)
        if self.transpose and self.reshaped:
            position = int(np.ravel_multi_index(index, self.source.shape))
            index = tuple(int(n) for n in np.unravel_index(position, self.reshaped))
        box: list[int | None] = [None] * self.pad
        for d in range(self.pad, len(self.padded)):
            a, b = self.padded[d], self.destination.shape[d]
            box.append(index[d - self.pad] if a == b else None)
        return tuple(box)


def broadcast_map(
    source: Partition, destination: Partition, *, transpose: bool = False
) -> dict[tuple[int, ...], tuple[int, ...]]:
    """For every destination grid index, the source grid index whose data it receives.

    Parameters
    ----------
    source, destination : Partition
    transpose : bool, optional
        Route as DistDL's ``transpose_src`` does: the source partition is *reshaped* to its
        reversed shape, its workers keeping their C order, and broadcast from there. Source
        index ``i`` (C-order position ``k`` in ``source.shape``) acts as index
        ``unravel(k, reversed(source.shape))``; its block keeps its own shape. This is not
        ``np.transpose`` of the grid (which would also reverse each index): on a 2 x 3 source
        the two differ (see the Examples).

    Raises
    ------
    BroadcastError
        If the source has more dimensions than the destination, or an extent of the (padded)
        source is neither 1 nor the destination's extent; the message names the dimension.

    Examples
    --------
    >>> broadcast_map(Partition((1, 2)), Partition((2, 2)))[(1, 0)]
    (0, 0)

    With ``transpose=True`` a 2 x 3 source acts as a 3 x 2 grid filled in C order, so
    destination (0, 1) of a 3 x 2 partition reads source position 1, index (0, 1) (a
    transpose of the grid would read (1, 0)):

    >>> routes = broadcast_map(Partition((2, 3)), Partition((3, 2)), transpose=True)
    >>> [routes[j] for j in [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]]
    [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    """
    rule = BroadcastRule(source, destination, transpose)
    shape, pad, padded = rule.reshaped, rule.pad, rule.padded
    # per dimension, the source coordinate of each destination coordinate; their product
    # runs in the destination's C order
    coordinates = [range(b) if a == b else [0] * b for a, b in zip(padded, destination.shape)]
    sources: Iterator[tuple[int, ...]] = itertools.product(*coordinates)
    if pad:  # the padded dimensions name no source coordinate
        sources = (i[pad:] for i in sources)
    if not transpose:
        return dict(zip(destination.indices(), sources))
    mapping = {}
    for j, i in zip(destination.indices(), sources):
        # the position in the reshaped grid names the source block in C order
        position = int(np.ravel_multi_index(i, shape)) if shape else 0
        mapping[j] = tuple(int(n) for n in np.unravel_index(position, source.shape)) if shape else ()
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
    axes = sorted_axes("reduction_groups", axes, partition)
    groups: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    for index in partition.indices():
        key = tuple(i for d, i in enumerate(index) if d not in axes)
        groups.setdefault(key, []).append(index)
    return list(groups.values())


def group_of(partition: Partition, axes: Sequence[int], index: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The group of grid index ``index`` along ``axes`` (sorted, valid): the indices that differ
    from it only on ``axes``, in C order along them (its group of :func:`reduction_groups`,
    built alone: O(group size), not the grid's)."""
    members = []
    for moving in itertools.product(*(range(partition.shape[a]) for a in axes)):
        member = list(index)
        for a, k in zip(axes, moving):
            member[a] = k
        members.append(tuple(member))
    return members


def held_by_group(
    partition: Partition, axes: Sequence[int], workers: Iterable[int]
) -> dict[tuple[int, ...], list[tuple[int, ...]]]:
    """The grid indices of ``workers`` (those in ``partition``) by their group along ``axes``:
    keyed by the coordinates off the axes (the groups' order of :func:`reduction_groups` is
    the keys' sorted order), each group's indices in the order of ``workers``. O(the workers),
    not the grid's."""
    held: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    for worker in workers:
        if partition.position(worker) is not None:
            index = partition.index(worker)
            held.setdefault(tuple(k for d, k in enumerate(index) if d not in axes), []).append(index)
    return held


def gathered_layout(tensor: DistributedTensor, axes: Sequence[int] | int, name: str) -> BlockGrid:
    """The layout that :class:`AllGather` produces: block ``name[j]`` covers block ``j``'s box
    of ``tensor`` with every dimension in ``axes`` widened to the whole global extent.

    Raises
    ------
    PartitionError
        If an axis is out of range or listed twice.
    """
    axes = sorted_axes("gathered_layout", axes, tensor.partition)
    # per dimension, the extent of each grid coordinate (the whole extent along ``axes``): the
    # shapes described by their product rule, not listed
    extents = [
        (n,) * len(sizes) if d in axes else sizes
        for d, (n, sizes) in enumerate(zip(tensor.global_shape, tensor.sizes))
    ]
    return BlockGrid(name, tensor.partition, ProductShapes(tensor.partition.shape, extents))
