"""Cartesian partitions of workers and distributed tensors over them
(``docs/theory.md#distributed-primitives``, ``#layers``).

A :class:`Partition` arranges workers in a grid; two partitions may share workers, overlap or be
disjoint. A :class:`DistributedTensor` cuts a global array into one block per worker of a
partition, with a balanced decomposition by default (sizes differ by at most one, larger shares
first) or explicit per-dimension sizes. Empty blocks are normal: 5 entries over 8 workers leave
3 workers with nothing.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from .described import KeyedSequence, Offsets
from .errors import DecompositionError, LinopError, OperandError, PartitionError, RegionError
from .space import MAX_WORKER, Block, GridSpace, Region, Space, State, as_array, check_extents, strict_ints

__all__ = [
    "Partition",
    "WorkerRange",
    "WorkerBox",
    "DistributedTensor",
    "GlobalBox",
    "balanced_sizes",
    "MAX_LISTED_PARTS",
    "intersect",
    "grid_block_name",
    "normalized_axes",
]

GlobalBox = tuple[tuple[int, ...], tuple[int, ...]]
"""A box of global coordinates: (start, stop) per dimension."""


def _integers(values: Any, what: str, error: type[LinopError]) -> tuple[int, ...]:
    """``values`` as a tuple of ints (one integer stands for a 1-tuple); ``error`` naming
    ``what`` if they are not integers."""
    if isinstance(values, (bool, np.bool_)) or isinstance(values, (str, bytes)):
        raise error(f"{what} {values!r} must be integers")
    if isinstance(values, (int, np.integer)):
        return (operator.index(values),)
    if isinstance(values, np.ndarray) and values.ndim == 1 and values.dtype.kind in "iu":
        return tuple(values.tolist())  # integers already: converted at C speed, not one by one
    try:
        return strict_ints(values)
    except TypeError:
        raise error(f"{what} {values!r} must be integers (not bools)") from None


def normalized_axes(kind: str, axes: Sequence[int] | int, partition: Partition) -> tuple[int, ...]:
    """``axes`` of ``partition`` made non-negative, in the order given.

    Raises
    ------
    PartitionError
        If an axis is not an integer, out of range, or listed twice (the message starts with
        ``kind``).
    """
    normalized: list[int] = []
    for axis in _integers(axes, f"{kind}: axes", PartitionError):
        if not -partition.ndim <= axis < partition.ndim:
            raise PartitionError(f"{kind}: axis {axis} is out of range for partition {partition.shape}")
        axis %= partition.ndim
        if axis in normalized:
            raise PartitionError(f"{kind}: axis {axis} is listed twice")
        normalized.append(axis)
    return tuple(normalized)


def grid_block_name(name: str, index: Sequence[int]) -> str:
    """The name of a layout's block at a grid index: ``grid_block_name("x", (0, 1)) == "x[0,1]"``."""
    return f"{name}[{','.join(map(str, index))}]"


MAX_LISTED_PARTS = 2**24
"""The most parts :func:`balanced_sizes` lists (a tuple of that many sizes is 128 MB); a
count beyond it is refused with a typed error instead of exhausting memory."""


def balanced_sizes(length: int, parts: int) -> tuple[int, ...]:
    """Split ``length`` into ``parts`` sizes differing by at most one, larger ones first.

    >>> balanced_sizes(5, 3)
    (2, 2, 1)

    Raises
    ------
    DecompositionError
        If ``length`` is negative, ``parts`` is not positive or above
        :data:`MAX_LISTED_PARTS`, or either is not one integer.
    """
    lengths = _integers(length, "balanced_sizes: length", DecompositionError)
    counts = _integers(parts, "balanced_sizes: parts", DecompositionError)
    if len(lengths) != 1 or len(counts) != 1:
        raise DecompositionError(f"balanced_sizes takes one length and one count, not {lengths} and {counts}")
    length, parts = lengths[0], counts[0]
    if length < 0 or parts < 1:
        raise DecompositionError(f"cannot split length {length} into {parts} parts")
    if parts > MAX_LISTED_PARTS:
        raise DecompositionError(
            f"balanced_sizes lists every part's size: {parts} parts is more than {MAX_LISTED_PARTS}"
        )
    quotient, remainder = divmod(length, parts)
    return (quotient + 1,) * remainder + (quotient,) * (parts - remainder)


def intersect(a: GlobalBox, b: GlobalBox) -> GlobalBox | None:
    """The intersection of two boxes, or None when it holds no entry."""
    start = tuple(max(x, y) for x, y in zip(a[0], b[0]))
    stop = tuple(min(x, y) for x, y in zip(a[1], b[1]))
    if any(lo >= hi for lo, hi in zip(start, stop)):
        return None
    return start, stop


class WorkerRange(Sequence[int]):
    """The consecutive workers ``start, start + 1, ..., stop - 1`` of a partition, described
    rather than enumerated: O(1) memory, membership and position at any count. Equal to any
    sequence holding the same ids (a tuple, a list, a ``range``), and hashed as the tuple of
    them (so built only when hashed on its own; a :class:`Partition` hashes its description).
    """

    __slots__ = ("_hash", "_range")

    def __init__(self, start: int, stop: int) -> None:
        self._range = range(start, stop)
        self._hash: int | None = None

    @property
    def start(self) -> int:
        return self._range.start

    @property
    def stop(self) -> int:
        return self._range.stop

    def __len__(self) -> int:
        return len(self._range)

    def __getitem__(self, index: Any) -> Any:
        found = self._range[index]
        return tuple(found) if isinstance(index, slice) else found

    def __iter__(self) -> Iterator[int]:
        return iter(self._range)

    def __reversed__(self) -> Iterator[int]:
        return reversed(self._range)

    def __contains__(self, worker: object) -> bool:
        return worker in self._range

    def index(self, worker: Any, start: int = 0, stop: int | None = None) -> int:
        position = self._range.index(worker)
        if position < start or (stop is not None and position >= stop):
            raise ValueError(f"{worker} is not in the range")
        return position

    def count(self, worker: Any) -> int:
        return self._range.count(worker)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, WorkerRange):
            return self._range == other._range
        if isinstance(other, range):
            return self._range == other
        if isinstance(other, (tuple, list)):
            return len(other) == len(self._range) and all(a == b for a, b in zip(other, self._range))
        return NotImplemented

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(tuple(self._range))
        return self._hash

    def __repr__(self) -> str:
        if len(self._range) <= 32:
            return repr(tuple(self._range))
        return f"WorkerRange({self._range.start}, {self._range.stop})"


class WorkerBox(KeyedSequence[int]):
    """The workers of a box of a partition's grid indices, described rather than enumerated:
    per grid dimension a fixed coordinate, or None for every coordinate. In C order of the
    grid index; O(ndim) memory, length, membership and position at any count.

    A broadcast's copies of one source block, a reduction's group along some axes: the rank
    that plans such a group names it by its box, never by the list of its members.

    Examples
    --------
    >>> box = WorkerBox(Partition((3, 4)), (None, 1))
    >>> tuple(box), 5 in box, box.index(9), box.triples()
    ((1, 5, 9), True, 2, ((1, 9, 4),))
    """

    __slots__ = ("_counts", "_fixed", "_free", "_len", "_partition")
    _MISSING = "member {position} of a box of {length} workers"
    _LISTED = (tuple, list, range, WorkerRange)

    def __init__(self, partition: Partition, fixed: Sequence[int | None]) -> None:
        fixed = tuple(fixed)
        if len(fixed) != partition.ndim or any(
            f is not None and not 0 <= f < n for f, n in zip(fixed, partition.shape)
        ):
            raise PartitionError(f"box {fixed} is not a box of partition {partition.shape}")
        self._partition, self._fixed = partition, fixed
        self._free = tuple(d for d, f in enumerate(fixed) if f is None)
        self._counts = tuple(partition.shape[d] for d in self._free)
        self._len = math.prod(self._counts)

    @property
    def partition(self) -> Partition:
        return self._partition

    @property
    def fixed(self) -> tuple[int | None, ...]:
        """Per grid dimension, the fixed coordinate or None (every coordinate)."""
        return self._fixed

    def grid_index(self, position: int) -> tuple[int, ...]:
        """The grid index of the box's ``position``-th member (C order)."""
        index = list(self._fixed)
        for d, n in zip(reversed(self._free), reversed(self._counts)):
            position, index[d] = divmod(position, n)
        return tuple(index)  # type: ignore[arg-type]

    def _at(self, position: int) -> int:
        return self._partition.worker(self.grid_index(position))

    def __iter__(self) -> Iterator[int]:
        for k in range(self._len):
            yield self._partition.worker(self.grid_index(k))

    def position_of(self, worker: object) -> int | None:
        """The position of ``worker`` in the box (C order), or None when it is not a member."""
        flat = self._partition.position(worker)  # type: ignore[arg-type]
        if flat is None:
            return None
        index = self._partition.index(worker)  # type: ignore[arg-type]
        if any(f is not None and f != i for f, i in zip(self._fixed, index)):
            return None
        position = 0
        for d, n in zip(self._free, self._counts):
            position = position * n + index[d]
        return position

    def __contains__(self, worker: object) -> bool:
        return self.position_of(worker) is not None

    def index(self, worker: Any, start: int = 0, stop: int | None = None) -> int:
        position = self.position_of(worker)
        if position is None or position < start or (stop is not None and position >= stop):
            raise ValueError(f"worker {worker} is not in the box")
        return position

    def count(self, worker: Any) -> int:
        return int(worker in self)

    def triples(self) -> tuple[tuple[int, int, int], ...]:
        """The members as ``(first, last, stride)`` runs in order (what ``MPI_Group_range_incl``
        takes): adjacent free dimensions of consecutive workers merge into one run, so a row, a
        column or a whole grid is one triple; a partition of listed workers gives one per member."""
        partition = self._partition
        if not self._len:
            return ()
        if getattr(partition, "_first", None) is None:
            return tuple((w, w, 1) for w in self)
        strides = partition._strides
        runs: list[tuple[int, int]] = []  # (count, stride) of each merged free dimension
        previous = None
        for d, n in zip(self._free, self._counts):
            if previous is not None and previous == d - 1 and runs:
                count, _ = runs[-1]
                runs[-1] = (count * n, strides[d])
            else:
                runs.append((n, strides[d]))
            previous = d
        start = partition.worker(tuple(0 if f is None else f for f in self._fixed))
        *outer, (count, stride) = runs if runs else [(1, 1)]
        out = []
        for digits in itertools.product(*(range(n) for n, _ in outer)):
            first = start + sum(k * st for k, (_, st) in zip(digits, outer))
            out.append((first, first + (count - 1) * stride, stride))
        return tuple(out)

    def key(self) -> tuple[Any, ...]:
        """A hashable description (equal boxes of equal partitions, equal keys)."""
        return (self._partition.description(), self._fixed)

    def __repr__(self) -> str:
        return f"WorkerBox({self._partition.shape}, {self._fixed})"


@dataclass(frozen=True)
class Partition:
    """A Cartesian grid of workers.

    Parameters
    ----------
    shape : tuple of int
        Grid shape, e.g. ``(2, 3)``.
    workers : sequence of int, optional
        The worker ids in C order of grid index; default ``0 .. prod(shape) - 1``. Consecutive
        ids are kept as a :class:`WorkerRange` (described, not enumerated: a partition of 2^30
        workers costs what one of 4 does).

    Raises
    ------
    PartitionError
        If a worker is listed twice, the count does not match the shape, an id is negative, or
        the shape or the ids are not integers.

    Examples
    --------
    >>> p = Partition((2, 2), workers=(4, 5, 6, 7))
    >>> p.worker((1, 0)), p.index(5)
    (6, (0, 1))
    """

    shape: tuple[int, ...]
    workers: Sequence[int] = ()
    _first: int | None = field(init=False, repr=False, compare=False)  # consecutive ids from it, or None
    _strides: tuple[int, ...] = field(init=False, repr=False, compare=False)  # of the C-order grid

    def __post_init__(self) -> None:
        shape = _integers(self.shape, "partition shape", PartitionError)
        if any(n < 1 for n in shape):
            raise PartitionError(f"partition shape {shape} has an extent below 1")
        object.__setattr__(self, "shape", shape)
        count = math.prod(shape)
        if count > MAX_WORKER + 1:
            raise PartitionError(
                f"partition shape {shape} has {count} workers, more than the {MAX_WORKER + 1} ranks MPI counts"
            )
        given = self.workers
        if isinstance(given, WorkerRange) or (
            isinstance(given, range) and given.step == 1 and len(given) > 0
        ):
            workers: Sequence[int] = range(given.start, given.stop)  # described, not enumerated
        else:
            workers = _integers(given, f"partition {shape}: workers", PartitionError) or range(count)
        if len(workers) != count:
            raise PartitionError(f"partition of shape {shape} needs {count} workers, got {len(workers)}")
        first = workers[0]
        in_bounds = 0 <= first <= MAX_WORKER + 1 - count
        if isinstance(workers, range) and not in_bounds:  # named without listing the range
            if first < 0:
                raise PartitionError(f"partition {shape}: worker ids must be >= 0, got {first}")
            raise PartitionError(f"partition {shape}: worker ids must be <= {MAX_WORKER}, got {workers[-1]}")
        consecutive = in_bounds and (
            isinstance(workers, range) or workers == tuple(range(first, first + count))
        )
        if consecutive:
            # consecutive workers are kept described: O(1) memory at any P, and equal
            # partitions compare equal however their workers were given
            workers = WorkerRange(first, first + count)
        object.__setattr__(self, "_first", first if consecutive else None)
        valid = consecutive or (
            len(set(workers)) == count and 0 <= min(workers) and max(workers) <= MAX_WORKER
        )
        seen: set[int] = set()
        for w in () if valid else workers:  # only to name the offending id
            if w < 0:
                raise PartitionError(f"partition {shape}: worker ids must be >= 0, got {w}")
            if w > MAX_WORKER:
                raise PartitionError(f"partition {shape}: worker ids must be <= {MAX_WORKER}, got {w}")
            if w in seen:
                raise PartitionError(f"worker {w} is listed twice in partition {shape}")
            seen.add(w)
        object.__setattr__(self, "workers", workers)
        strides, step = [], 1
        for n in reversed(shape):
            strides.append(step)
            step *= n
        object.__setattr__(self, "_strides", tuple(reversed(strides)))

    @classmethod
    def grid(cls, shape: Sequence[int] | int, *, first: int = 0) -> Partition:
        """A partition of consecutive workers ``first, first + 1, ...`` in C order."""
        shape = _integers(shape, "partition shape", PartitionError)
        if isinstance(first, (bool, np.bool_)) or not isinstance(first, (int, np.integer)):
            raise PartitionError(f"partition grid: the first worker must be an int, not {first!r}")
        count = math.prod(shape)
        if count > MAX_WORKER + 1 or any(n < 1 for n in shape):
            return cls(shape)  # the constructor names the problem
        return cls(shape, range(first, first + count))

    @property
    def ndim(self) -> int:
        """Number of grid dimensions."""
        return len(self.shape)

    @property
    def size(self) -> int:
        """Number of workers."""
        return len(self.workers)

    def indices(self) -> Iterator[tuple[int, ...]]:
        """All grid indices, in C order."""
        return itertools.product(*(range(n) for n in self.shape))

    def checked_index(self, index: Sequence[int]) -> tuple[int, ...]:
        """``index`` as a tuple, if it is a grid index of this partition.

        Raises
        ------
        PartitionError
            If it has the wrong length or an entry outside ``0 .. shape[d] - 1``.
        """
        if (
            type(index) is tuple
            and len(index) == len(self.shape)
            and all(type(i) is int and 0 <= i < n for i, n in zip(index, self.shape))
        ):  # the common case, checked without conversions (planning asks once per worker)
            return index
        index = _integers(index, f"partition {self.shape}: index", PartitionError)
        if len(index) != self.ndim or not all(0 <= i < n for i, n in zip(index, self.shape)):
            raise PartitionError(f"index {index} is outside partition {self.shape}")
        return index

    def worker(self, index: Sequence[int]) -> int:
        """The worker at a grid index."""
        index = self.checked_index(index)
        return self.workers[self.flat(index)]

    def flat(self, index: tuple[int, ...]) -> int:
        """The C-order position of a (checked) grid index."""
        return sum(i * s for i, s in zip(index, self._strides))

    def index(self, worker: int) -> tuple[int, ...]:
        """The grid index of a worker."""
        flat = self.position(worker)
        if flat is None:
            raise PartitionError(f"worker {worker} is not in partition {self.shape} {self.workers}")
        return tuple(int(i) for i in np.unravel_index(flat, self.shape)) if self.ndim else ()

    def position(self, worker: int) -> int | None:
        """The C-order position of ``worker`` in the grid, or None when it is not a member
        (a table built on first use: O(1) per call afterwards)."""
        if not isinstance(worker, (int, np.integer)):
            return None
        first = self._first
        if first is not None:  # consecutive workers: no table
            position = int(worker) - first
            return position if 0 <= position < len(self.workers) else None
        try:
            table = object.__getattribute__(self, "_positions")
        except AttributeError:
            table = dict(zip(self.workers, range(len(self.workers))))  # (built at C speed)
            object.__setattr__(self, "_positions", table)
        return table.get(worker)

    def description(self) -> bytes:
        """The partition as bytes for a fingerprint: its shape and its workers, consecutive
        ones as the first id alone (so that the digest of a P-worker grid costs O(1)), others
        as one buffer of int64 (built once)."""
        try:
            return object.__getattribute__(self, "_description")
        except AttributeError:
            pass
        first = self._first
        workers = (
            b"C%d" % first if first is not None else b"L" + np.asarray(self.workers, dtype=np.int64).tobytes()
        )
        text = f"P{self.shape}".encode() + workers
        object.__setattr__(self, "_description", text)
        return text

    @property
    def max_worker(self) -> int:
        """The largest worker id."""
        first = self._first
        if first is not None:
            return first + len(self.workers) - 1
        try:
            return object.__getattribute__(self, "_max")
        except AttributeError:
            object.__setattr__(self, "_max", max(self.workers))
            return self.max_worker

    def __contains__(self, worker: object) -> bool:
        return worker in self.workers

    def __hash__(self) -> int:
        # the description, not the workers: O(1) for consecutive workers
        return hash(self.description())

    def subpartitions(self, axes: Sequence[int]) -> list[Partition]:
        """The partitions along ``axes``: workers grouped by their coordinates on the other axes.

        Each group is a partition of shape ``(shape[a] for a in axes)``, its workers in C order
        of the coordinates along ``axes`` taken in the order given (so ``[1, 0]`` transposes);
        groups come in C order of the remaining coordinates.

        Raises
        ------
        PartitionError
            If an axis is out of range or listed twice.
        """
        axes = normalized_axes("subpartitions", axes, self)
        others = tuple(a for a in range(self.ndim) if a not in axes)
        groups = []
        for fixed in itertools.product(*(range(self.shape[a]) for a in others)):
            members = []
            for moving in itertools.product(*(range(self.shape[a]) for a in axes)):
                index = [0] * self.ndim
                for a, i in zip(others, fixed):
                    index[a] = i
                for a, i in zip(axes, moving):
                    index[a] = i
                members.append(self.worker(index))
            groups.append(Partition(tuple(self.shape[a] for a in axes), tuple(members)))
        return groups

    def __str__(self) -> str:
        return f"P{self.shape}{list(self.workers)}"


@dataclass(frozen=True)
class DistributedTensor:
    """A global array of ``global_shape`` cut into one block per worker of ``partition``.

    Block ``name[i,j]`` (grid index (i, j)) holds the global box
    ``[offset_d(i_d), offset_d(i_d) + sizes[d][i_d])`` in each dimension d and lives on worker
    ``partition.worker((i, j))``.

    Parameters
    ----------
    name : str
        Prefix of the block names.
    global_shape : tuple of int
    partition : Partition
        Must have one grid dimension per tensor dimension.
    sizes : sequence of sequences of int, optional
        Explicit per-dimension sizes (unbalanced decomposition); default balanced.

    Raises
    ------
    TypeError
        If ``partition`` is not a :class:`Partition`.
    PartitionError
        If the partition's rank differs from the tensor's.
    DecompositionError
        If the global shape or the sizes are not integers, or explicit sizes have the wrong
        count, are negative, or do not add up to the global extent of their dimension.

    Examples
    --------
    >>> import numpy as np
    >>> from linop import DistributedTensor, Partition
    >>> tensor = DistributedTensor("x", (5, 4), Partition((2, 2)))
    >>> tensor.space.names
    ('x[0,0]', 'x[0,1]', 'x[1,0]', 'x[1,1]')
    >>> block = tensor.block((1, 0))
    >>> block.name, block.shape, block.worker, tensor.box((1, 0))
    ('x[1,0]', (2, 2), 2, ((3, 0), (5, 2)))
    >>> state = tensor.scatter(np.arange(20).reshape(5, 4))
    >>> state["x[1,0]"]
    array([[12, 13],
           [16, 17]])
    >>> bool((tensor.gather(state) == np.arange(20).reshape(5, 4)).all())
    True

    Unbalanced shares are given per dimension:

    >>> DistributedTensor("y", (5,), Partition((2,)), sizes=((1, 4),)).block((1,)).shape
    (4,)
    """

    name: str
    global_shape: tuple[int, ...]
    partition: Partition
    sizes: tuple[tuple[int, ...], ...] = ()
    _offsets: tuple[Offsets, ...] = field(init=False, repr=False, compare=False)  # of the blocks

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise DecompositionError(
                f"a distributed tensor's name must be a non-empty string, not {self.name!r}"
            )
        shape = _integers(self.global_shape, f"tensor {self.name!r}: global shape", DecompositionError)
        check_extents(shape, f"tensor {self.name!r}", "global shape", DecompositionError)
        object.__setattr__(self, "global_shape", shape)
        if not isinstance(self.partition, Partition):
            raise OperandError(
                f"tensor {self.name!r}: partition must be a Partition, not {type(self.partition).__name__}"
            )
        if self.partition.ndim != len(shape):
            raise PartitionError(
                f"tensor {self.name!r} has rank {len(shape)} but partition {self.partition.shape} "
                f"has rank {self.partition.ndim}"
            )
        if isinstance(self.sizes, (str, bytes)) or not isinstance(self.sizes, (Sequence, np.ndarray)):
            raise DecompositionError(
                f"tensor {self.name!r}: sizes must be one sequence of ints per dimension, not {self.sizes!r}"
            )
        if len(self.sizes) == 0:
            sizes = tuple(balanced_sizes(n, p) for n, p in zip(shape, self.partition.shape))
        else:
            if len(self.sizes) != len(shape):
                raise DecompositionError(
                    f"tensor {self.name!r}: sizes given for {len(self.sizes)} dimensions, tensor has {len(shape)}"
                )
            sizes = tuple(
                _integers(dim, f"tensor {self.name!r}: dimension {d} sizes", DecompositionError)
                for d, dim in enumerate(self.sizes)
            )
            for d, (dim_sizes, n, p) in enumerate(zip(sizes, shape, self.partition.shape)):
                if len(dim_sizes) != p:
                    raise DecompositionError(
                        f"tensor {self.name!r}: dimension {d} has {len(dim_sizes)} sizes for {p} workers"
                    )
                if any(s < 0 for s in dim_sizes):
                    raise DecompositionError(
                        f"tensor {self.name!r}: dimension {d} has a negative size {dim_sizes}"
                    )
                if sum(dim_sizes) != n:
                    raise DecompositionError(
                        f"tensor {self.name!r}: dimension {d} sizes {dim_sizes} add up to {sum(dim_sizes)}, "
                        f"not the global extent {n}"
                    )
        object.__setattr__(self, "sizes", sizes)
        # balanced sizes: offsets by their rule (O(1) memory), others summed once
        object.__setattr__(self, "_offsets", tuple(Offsets(dim) for dim in sizes))

    @property
    def ndim(self) -> int:
        """Number of tensor dimensions."""
        return len(self.global_shape)

    def block_name(self, index: Sequence[int]) -> str:
        """Name of the block at a grid index, e.g. ``x[0,1]``."""
        return grid_block_name(self.name, index)

    def box(self, index: Sequence[int]) -> GlobalBox:
        """The global box held by the block at a grid index."""
        index = self.partition.checked_index(index)
        offsets = self._offsets
        start = tuple(offsets[d][i] for d, i in enumerate(index))
        stop = tuple(s + self.sizes[d][i] for d, (s, i) in enumerate(zip(start, index)))
        return start, stop

    def block(self, index: Sequence[int]) -> Block:
        """The block at a grid index."""
        index = self.partition.checked_index(index)
        shape = tuple(self.sizes[d][i] for d, i in enumerate(index))
        # the sizes and the workers are validated by the constructors: no second check
        return Block.trusted(self.block_name(index), shape, self.partition.worker(index))

    @cached_property
    def blocks(self) -> tuple[Block, ...]:
        """All blocks, in C order of grid index (built once per tensor)."""
        return tuple(self.block(i) for i in self.partition.indices())

    @cached_property
    def space(self) -> Space:
        """The space of the tensor's blocks (built once per tensor; described by the partition
        and the sizes, its blocks built only when asked for: :class:`~linop.space.GridSpace`)."""
        return GridSpace(self.name, self.partition, extents=self.sizes)

    def region(self, index: Sequence[int], box: GlobalBox, space: Space | None = None) -> Region:
        """The part of a global ``box`` held by block ``index`` as a region of ``space``
        (default the tensor's space).

        Raises
        ------
        RegionError
            If ``box`` does not lie inside that block's box.
        """
        start, stop = self.box(index)
        try:
            lower, upper = (_integers(corner, "box corner", RegionError) for corner in box)
        except (TypeError, ValueError):  # not a pair of corners
            raise RegionError(
                f"tensor {self.name!r}: a global box is a (start, stop) pair of corners, not {box!r}"
            ) from None
        inside = len(lower) == len(upper) == self.ndim and all(
            s <= a <= b <= e for a, b, s, e in zip(lower, upper, start, stop)
        )
        if not inside:
            raise RegionError(
                f"tensor {self.name!r}: global box {box} is not inside the box {(start, stop)} "
                f"of block {self.block_name(index)!r}"
            )
        space = self.space if space is None else space
        whole = space[self.block_name(index)]
        return whole[tuple(slice(a - s, b - s) for a, b, s in zip(box[0], box[1], start))]

    def scatter(self, array: Any, indices: Iterable[Sequence[int]] | None = None) -> State:
        """Cut a global array into a state of the tensor's space (copies); with ``indices``,
        only the blocks at those grid indices (a process's own: no loop over all P)."""
        given = array
        array = as_array(
            given,
            lambda reason: DecompositionError(
                f"tensor {self.name!r}: cannot scatter {given!r}, not an array ({reason})"
            ),
        )
        if array.shape != self.global_shape:
            raise DecompositionError(
                f"tensor {self.name!r}: array of shape {array.shape} does not match global shape {self.global_shape}"
            )
        state: State = {}
        for index in self.partition.indices() if indices is None else indices:
            start, stop = self.box(index)
            # np.array, not .copy(): indexing a 0-d array gives a scalar, and a block must stay an array
            state[self.block_name(index)] = np.array(array[tuple(slice(a, b) for a, b in zip(start, stop))])
        return state

    def gather(self, state: Mapping[str, Any]) -> np.ndarray:
        """Assemble a state of the tensor's space into one global array."""
        arrays = self.space.check_state(state)
        dtype = np.result_type(*arrays.values()) if arrays else np.float64
        out = np.zeros(self.global_shape, dtype=dtype)
        for index in self.partition.indices():
            start, stop = self.box(index)
            out[tuple(slice(a, b) for a, b in zip(start, stop))] = arrays[self.block_name(index)]
        return out

    def __str__(self) -> str:
        return f"{self.name}{list(self.global_shape)} on {self.partition}"
