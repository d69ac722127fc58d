"""Spaces of named blocks, and regions (boxes) inside those blocks.

A program's memory is one vector cut into named blocks (``docs/theory.md#memory-and-blocks``). A
:class:`Space` is the set of such blocks, each with a shape and the worker that owns it; a
*state* of a space is a plain ``dict[str, numpy.ndarray]`` keyed by block name. A
:class:`Region` is a box inside one block, the "subset x_a" of the theory.

Canonical order
---------------
A space keeps its blocks sorted by name in *natural* order (runs of digits compare as
numbers, so ``"x2" < "x10"``). Two spaces holding the same blocks are therefore equal
whatever order they were built in, and :meth:`Space.flatten` lays a state out as one vector
in exactly this order, each block raveled in C order. The sparse interpreter uses the same
layout, so the row and column of every matrix entry are known.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
import operator
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from .errors import (
    BlockError,
    BlockExistsError,
    DtypeError,
    LinopError,
    RegionError,
    SpaceMismatchError,
    StateError,
    UnknownBlockError,
)

__all__ = [
    "Block",
    "Space",
    "GridSpace",
    "grid_index",
    "Region",
    "State",
    "natural_key",
    "closest_name",
    "did_you_mean",
    "MAX_SIZE",
    "check_extents",
    "as_array",
    "strict_ints",
    "MAX_WORKER",
]

State = dict[str, np.ndarray]

_Frozen = TypeVar("_Frozen")
"""A state of a space: one array per block name."""

_DIGITS = re.compile(r"(\d+)")

MAX_SIZE = 2**63 - 1
"""The most entries a block (or a space, a tensor) may hold: flat positions are int64."""

MAX_WORKER = 2**31 - 1
"""The largest worker id: workers are MPI ranks, which are C ints."""


def check_extents(shape: tuple[int, ...], owner: str, noun: str, error: type[LinopError]) -> None:
    """Raise ``error`` (naming ``owner``'s ``noun``) when ``shape`` has a negative extent or more
    entries than int64 counts."""
    if any(n < 0 for n in shape):
        raise error(f"{owner}: negative extent in {noun} {shape}")
    if math.prod(shape) > MAX_SIZE:
        raise error(f"{owner}: {noun} {shape} has {math.prod(shape)} entries, more than int64 counts")


def closest_name(name: str, candidates: Iterable[str]) -> str | None:
    """The one of ``candidates`` closest to ``name`` (:func:`difflib.get_close_matches`), or None
    when none is close: the block a misspelt key stands for.

    Examples
    --------
    >>> closest_name("bb", ["a", "b", "c"])
    'b'
    >>> closest_name("weight", ["a", "b"]) is None
    True
    """
    import difflib  # only when a name is wrong: it is not needed on import

    close = difflib.get_close_matches(str(name), [str(c) for c in candidates], n=1, cutoff=0.5)
    return close[0] if close else None


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """``"; did you mean 'b'?"`` for the closest of ``candidates`` to ``name``, or ``""``.

    Examples
    --------
    >>> did_you_mean("bb", ["a", "b", "c"])
    "; did you mean 'b'?"
    """
    close = closest_name(name, candidates)
    return "" if close is None else f"; did you mean {close!r}?"


def _is_integer(value: Any) -> bool:
    """An int or numpy integer, but not a bool (True is not the extent 1)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _strict_index(value: Any) -> int:
    """``operator.index(value)``, refusing bools (TypeError)."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError("a bool is not an integer here")
    return operator.index(value)


def strict_ints(values: Any) -> tuple[int, ...]:
    """``values`` as a tuple of ints: TypeError when they are not a sequence of integers (a
    bool is not one)."""
    return tuple(_strict_index(v) for v in values)


@functools.lru_cache(maxsize=1 << 16)
def natural_key(name: str) -> tuple[Any, ...]:
    """Sort key comparing runs of digits as numbers: ``"x2" < "x10"``; names that compare equal
    so (``"x1"``, ``"x01"``) are ordered by the plain string. Cached: spaces are rebuilt block by
    block along an expansion, with the same names each time."""
    parts = _DIGITS.split(name)
    return (tuple(int(p) if i % 2 else p for i, p in enumerate(parts)), name)


def as_array(value: Any, fail: Callable[[str], LinopError]) -> np.ndarray:
    """``np.asarray(value)``; when numpy cannot make one array of it (ragged nested lists,
    unconvertible objects), the error ``fail(reason)`` (numpy's reason) is raised instead."""
    try:
        return np.asarray(value)
    except (TypeError, ValueError) as error:
        raise fail(str(error)) from None


def _unchecked(cls: type[_Frozen], **fields: Any) -> _Frozen:
    """An instance of the frozen dataclass ``cls`` with ``fields`` set as given, without its
    ``__init__`` and checks (for fields the caller has validated)."""
    item = object.__new__(cls)
    for field_name, value in fields.items():
        object.__setattr__(item, field_name, value)
    return item


def _block_key(block: Block) -> tuple[Any, ...]:
    return natural_key(block.name)


@dataclass(frozen=True, slots=True)
class Block:
    """A named block of memory: its shape and the worker (rank) that owns it.

    Parameters
    ----------
    name : str
        Unique name of the block within a space.
    shape : tuple of int
        Shape of the block; zero extents (empty blocks) are allowed.
    worker : int, optional
        The worker that owns the block (rank under MPI). Default 0.

    Raises
    ------
    BlockError
        If the name is not a non-empty string, the shape is not a tuple of non-negative ints
        (an int is taken as a 1-d shape), the block has more entries than int64 counts, or the
        worker is not an int in ``0 .. MAX_WORKER``.

    Examples
    --------
    >>> from linop import Block
    >>> block = Block("x", (4, 6), worker=1)
    >>> block.size, block.ndim
    (24, 2)
    >>> Block("y", 3).shape
    (3,)
    """

    name: str
    shape: tuple[int, ...]
    worker: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise BlockError(f"a block name must be a non-empty string, not {self.name!r}")
        shape = (self.shape,) if _is_integer(self.shape) or isinstance(self.shape, bool) else self.shape
        try:
            shape = strict_ints(shape)
        except TypeError:
            raise BlockError(
                f"block {self.name!r}: shape must be a tuple of ints, not {self.shape!r}"
            ) from None
        check_extents(shape, f"block {self.name!r}", "shape", BlockError)
        object.__setattr__(self, "shape", shape)
        try:
            worker = _strict_index(self.worker)
        except TypeError:
            raise BlockError(f"block {self.name!r}: worker must be an int, not {self.worker!r}") from None
        if not 0 <= worker <= MAX_WORKER:
            raise BlockError(f"block {self.name!r}: worker must be in 0 .. {MAX_WORKER}, not {worker}")
        object.__setattr__(self, "worker", worker)

    @classmethod
    def trusted(cls, name: str, shape: tuple[int, ...], worker: int) -> Block:
        """A block from fields the caller has validated (a layout's rule: a non-empty name,
        a tuple of non-negative ints, a partition's worker), without a second check."""
        return _unchecked(cls, name=name, shape=shape, worker=worker)

    @property
    def size(self) -> int:
        """Number of entries."""
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return len(self.shape)

    def __repr__(self) -> str:
        worker = f", worker={self.worker}" if self.worker else ""
        return f"Block({self.name!r}, {self.shape}{worker})"


BlockLike = Block | tuple


def _as_block(item: BlockLike) -> Block:
    if isinstance(item, Block):
        return item
    if isinstance(item, tuple) and 2 <= len(item) <= 3:
        return Block(*item)
    raise BlockError(f"expected a Block or a (name, shape[, worker]) tuple, not {item!r}")


class Space:
    """An ordered set of named blocks (canonical natural order by name).

    A state of the space is a ``dict`` from block name to array; the space flattens it into one
    vector (blocks in this order, each raveled in C order), the layout of the exact matrices
    (``docs/theory.md#memory-and-blocks``).

    Parameters
    ----------
    blocks : iterable of Block or (name, shape[, worker]) tuples
        The blocks, in any order; the space keeps them in natural order of their names.

    Raises
    ------
    BlockExistsError
        If two blocks share a name.
    BlockError
        If a tuple does not make a valid :class:`Block`.

    Examples
    --------
    >>> space = Space([("y", (2,), 1), ("x", (2, 3))])
    >>> space.names
    ('x', 'y')
    >>> space["x"][:, 1:]
    x[0:2, 1:3]
    >>> space.size, space.offset("y")
    (8, 6)
    """

    __slots__ = ("_blocks", "_by_name", "_hash", "_offsets")

    def __init__(self, blocks: Iterable[BlockLike] = ()) -> None:
        by_name: dict[str, Block] = {}
        try:
            if isinstance(blocks, (str, bytes, Mapping)):
                raise TypeError
            items = list(blocks)
        except TypeError:  # not iterable (a 0-d array claims to be)
            raise BlockError(f"a space takes an iterable of blocks, not {type(blocks).__name__}") from None
        for item in items:
            block = _as_block(item)
            if block.name in by_name:
                raise BlockExistsError(f"block {block.name!r} appears twice in a space")
            by_name[block.name] = block
        self._adopt(tuple(sorted(by_name.values(), key=_block_key)))

    def _adopt(self, ordered: tuple[Block, ...]) -> None:
        """Take ``ordered`` (canonical order, unique names) as this space's blocks."""
        self._blocks = ordered
        self._by_name = {b.name: b for b in ordered}
        self._offsets: dict[str, int] | None = None  # built on first use
        self._hash = _space_hash(len(ordered), ordered.__getitem__)

    @classmethod
    def _from_ordered(cls, ordered: tuple[Block, ...]) -> Space:
        space = cls.__new__(cls)
        space._adopt(ordered)
        return space

    def _offset_table(self) -> dict[str, int]:
        if self._offsets is None:
            offsets, total = {}, 0
            for b in self._blocks:
                offsets[b.name] = total
                total += b.size
            if total > MAX_SIZE:
                raise BlockError(f"the space's blocks hold {total} entries, more than int64 counts")
            self._offsets = offsets
        return self._offsets

    # -- structure -------------------------------------------------------------------
    @property
    def blocks(self) -> tuple[Block, ...]:
        """The blocks, in canonical order."""
        return self._blocks

    @property
    def names(self) -> tuple[str, ...]:
        """The block names, in canonical order."""
        return tuple(self._by_name)

    @property
    def size(self) -> int:
        """Total number of entries: the length of a flattened state."""
        return sum(b.size for b in self._blocks)

    @property
    def workers(self) -> Sequence[int]:
        """The workers that own at least one block, sorted."""
        return tuple(sorted({b.worker for b in self._blocks}))

    def owned(self, worker: int) -> tuple[Block, ...]:
        """The blocks ``worker`` owns, in canonical order."""
        return tuple(b for b in self._blocks if b.worker == worker)

    @property
    def max_worker(self) -> int:
        """The largest worker that owns a block (-1 for the empty space)."""
        return max((b.worker for b in self._blocks), default=-1)

    def block(self, name: str) -> Block:
        """The block called ``name``."""
        try:
            return self._by_name[name]
        except (KeyError, TypeError):  # TypeError: an unhashable name
            raise UnknownBlockError(
                f"unknown block {name!r}; the space holds {list(self._by_name)}"
            ) from None

    def offset(self, name: str) -> int:
        """Position of block ``name``'s first entry in a flattened state."""
        self.block(name)
        return self._offset_table()[name]

    def __getitem__(self, name: str) -> Region:
        block = self.block(name)
        return Region._checked(self, name, (0,) * block.ndim, block.shape, ())

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __iter__(self) -> Iterator[Block]:
        return iter(self._blocks)

    def __len__(self) -> int:
        return len(self._blocks)

    def with_block(self, block: BlockLike) -> Space:
        """This space plus one more block (error if the name exists)."""
        block = _as_block(block)
        if block.name in self._by_name:
            raise BlockExistsError(f"cannot add block {block.name!r}: the space already holds it")
        at = bisect.bisect(self._blocks, natural_key(block.name), key=_block_key)
        return Space._from_ordered((*self._blocks[:at], block, *self._blocks[at:]))

    def without(self, name: str) -> Space:
        """This space minus block ``name`` (error if it does not exist)."""
        self.block(name)
        return Space._from_ordered(tuple(b for b in self._blocks if b.name != name))

    def __eq__(self, other: object) -> bool:
        if self is other:  # the common case along a tree: O(1) instead of O(P)
            return True
        if not isinstance(other, Space):
            return NotImplemented
        return self._hash == other._hash and (self._blocks is other._blocks or self._blocks == other._blocks)

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"Space({list(self._blocks)!r})"

    def __str__(self) -> str:
        parts = []
        for b in self._blocks:
            shape = "x".join(map(str, b.shape)) or "scalar"
            parts.append(f"{b.name}:{shape}@{b.worker}")
        return "{" + ", ".join(parts) + "}"

    def _repr_html_(self) -> str:
        """Jupyter: a table of the blocks (name, shape, size, worker); see :mod:`linop.display`."""
        from .display import space_html

        return space_html(self)

    def difference(self, other: Space) -> str | None:
        """Describe the first block in which two spaces differ, or None if equal."""
        for name in sorted(set(self.names) | set(other.names), key=natural_key):
            mine, theirs = self._by_name.get(name), other._by_name.get(name)
            if mine != theirs:
                if mine is None:
                    return f"block {name!r} is missing on the left ({theirs!r} on the right)"
                if theirs is None:
                    return f"block {name!r} is missing on the right ({mine!r} on the left)"
                return f"block {name!r} differs: {mine!r} versus {theirs!r}"
        return None

    def require_equal(self, other: Space, what: str) -> None:
        """Raise :class:`SpaceMismatchError` naming the first differing block."""
        if self == other:  # the common case, without sorting names for a description
            return
        diff = self.difference(other)
        if diff is not None:
            raise SpaceMismatchError(f"{what}: {diff}")

    # -- states ----------------------------------------------------------------------
    def check_state(self, state: Mapping[str, Any]) -> State:
        """Validate a state against this space and return it as a dict of arrays.

        Raises
        ------
        StateError
            If a block is missing, extra, or has the wrong shape.
        """
        if not isinstance(state, Mapping):
            raise StateError(
                f"a state must be a dict of arrays keyed by block name, not {type(state).__name__}"
            )
        missing = [n for n in self._by_name if n not in state]
        extra = [n for n in state if n not in self._by_name]
        if missing:
            found = ""
            if extra:  # a misspelt key: name it and the block it stands for
                shown = closest_name(missing[0], extra) or extra[0]
                hint = did_you_mean(shown, missing)
                found = f"; the state has {shown!r}, which the space does not hold{hint}"
            raise StateError(f"state is missing block {missing[0]!r} (missing: {missing}){found}")
        if extra:
            hint = did_you_mean(extra[0], self._by_name)
            raise StateError(f"state has block {extra[0]!r} that the space does not hold{hint}")
        arrays: State = {}
        for name, block in self._by_name.items():
            value = state[name]
            if isinstance(value, np.ndarray):
                array = value
            else:
                try:
                    array = np.asarray(value)
                except (TypeError, ValueError) as error:
                    raise StateError(f"block {name!r} is not an array ({error})") from None
            if array.shape != block.shape:
                raise StateError(f"block {name!r} has shape {array.shape}, the space expects {block.shape}")
            arrays[name] = array
        return arrays

    def zeros(self, dtype: npt.DTypeLike = np.float64) -> State:
        """A state of zeros (``dtype``: a numeric dtype, or object; else a DtypeError)."""
        dtype = _state_dtype(dtype, "zeros")
        return {b.name: np.zeros(b.shape, dtype=dtype) for b in self._blocks}

    def random(
        self, rng: np.random.Generator | int | None = None, dtype: npt.DTypeLike = np.float64
    ) -> State:
        """A random state: standard normal entries (real and imaginary parts for complex
        dtypes), or integers in [-9, 9] for integer dtypes."""
        rng = np.random.default_rng(rng)
        dtype = _state_dtype(dtype, "random")
        state: State = {}
        for b in self._blocks:
            if dtype.kind in "iu":
                low = 0 if dtype.kind == "u" else -9
                state[b.name] = rng.integers(low, 10, size=b.shape).astype(dtype)
            elif dtype.kind == "c":
                parts = rng.standard_normal((2, *b.shape))
                state[b.name] = (parts[0] + 1j * parts[1]).astype(dtype)
            elif dtype.kind == "f":
                state[b.name] = rng.standard_normal(b.shape).astype(dtype)
            else:
                raise DtypeError(f"cannot draw random entries of dtype {dtype}")
        return state

    def inner(self, x: Mapping[str, Any], y: Mapping[str, Any]) -> Any:
        """The inner product sum(conj(x) * y) over all blocks (conjugate-linear in x)."""
        x, y = self.check_state(x), self.check_state(y)
        total: Any = 0
        for name in self._by_name:
            total = total + np.vdot(x[name], y[name])
        return total

    def flatten(self, state: Mapping[str, Any]) -> np.ndarray:
        """One vector: the blocks in canonical order, each raveled in C order."""
        arrays = self.check_state(state)
        if not arrays:
            return np.zeros(0)
        return np.concatenate([arrays[n].ravel() for n in self._by_name])

    def unflatten(self, vector: npt.ArrayLike) -> State:
        """Inverse of :meth:`flatten` (the blocks are views into ``vector``)."""
        vector = as_array(
            vector, lambda reason: StateError(f"expected a vector of length {self.size} ({reason})")
        )
        if vector.ndim != 1 or vector.shape[0] != self.size:
            raise StateError(f"expected a vector of length {self.size}, got shape {vector.shape}")
        offsets = self._offset_table()
        return {
            b.name: vector[offsets[b.name] : offsets[b.name] + b.size].reshape(b.shape) for b in self._blocks
        }


def _space_hash(length: int, block_at: Callable[[int], Block]) -> int:
    """The hash of a space of ``length`` blocks (``block_at(k)``: the k-th in canonical order):
    its length and its first, middle and last blocks, so that a space described by a rule
    (:class:`GridSpace`) hashes as its blocks do without building them all."""
    if not length:
        return hash(())
    return hash((length, block_at(0), block_at(length // 2), block_at(length - 1)))


class GridPartition(Protocol):
    """What :class:`GridSpace` reads of a :class:`~linop.partition.Partition`."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def workers(self) -> Sequence[int]: ...

    @property
    def size(self) -> int: ...

    @property
    def max_worker(self) -> int: ...

    def position(self, worker: int) -> int | None: ...

    def description(self) -> bytes: ...


def grid_index(name: object, prefix: str, shape: Sequence[int]) -> tuple[int, ...] | None:
    """The grid index of ``shape`` that the block name ``name`` spells, ``prefix[i0,i1,...]``
    (as :func:`~linop.partition.grid_block_name` writes it: ASCII digits, no leading zeros,
    no spaces), or None when ``name`` is no such name or the index lies outside ``shape``: a
    block found from its name alone, with no table of the grid's blocks.

    >>> grid_index("x[1,0]", "x", (2, 3)), grid_index("x[01,0]", "x", (2, 3)), grid_index("x[2,0]", "x", (2, 3))
    ((1, 0), None, None)
    """
    if type(name) is not str or not name.startswith(prefix + "[") or not name.endswith("]"):
        return None
    body = name[len(prefix) + 1 : -1]
    parts = body.split(",") if body else []
    if len(parts) != len(shape) or not all(
        p.isascii() and p.isdigit() and (p == "0" or p[0] != "0") for p in parts
    ):
        return None  # not the canonical spelling of a grid index
    index = tuple(int(p) for p in parts)
    return index if all(i < n for i, n in zip(index, shape)) else None


class GridSpace(Space):
    """A space of one block ``prefix[i,j,...]`` per worker of a partition, described by a rule
    instead of a list of blocks (``docs/theory.md#memory-and-blocks``).

    The block at grid index ``g`` (C-order position ``k``) lives on ``partition.workers[k]`` and
    has shape ``(extents[0][g_0], extents[1][g_1], ...)`` (a product rule: a distributed
    tensor's blocks, a halo geometry's local blocks and windows) or ``shapes[k]`` (one shape per
    worker: a block grid). Natural order of such names is C order of the grid index, so the
    space is the :class:`Space` of those blocks and compares, hashes and flattens as it does.
    Looking up a block, its membership, its length, size and workers cost O(1) or O(ndim) (no
    block is built but those asked for); anything that needs every block (iteration,
    ``names``, flattening, states) builds them once, as a plain space would hold them.

    Parameters
    ----------
    prefix : str
        The blocks' name prefix.
    partition : Partition
        The grid of workers.
    extents : sequence of sequences of int, optional
        Per dimension, the extent of each grid coordinate (product rule).
    shapes : sequence of shapes, optional
        One shape per worker in C order of grid index (a tuple, or a rule such as
        :class:`~linop.layout.ProductShapes`; exactly one of ``extents`` and ``shapes``).

    The caller (a layout's constructor) has validated the rule: non-negative int extents with
    one entry per grid coordinate, or one shape per worker.

    Examples
    --------
    >>> from linop import Partition, Space
    >>> from linop.space import GridSpace
    >>> grid = GridSpace("x", Partition((2, 2)), extents=((2, 1), (3, 3)))
    >>> grid.block("x[1,0]"), len(grid), grid.size
    (Block('x[1,0]', (1, 3), worker=2), 4, 18)
    >>> grid == Space(grid.blocks), "x[2,0]" in grid
    (True, False)
    """

    __slots__ = ("_description", "_extents", "_head", "_made", "_partition", "_prefix", "_shapes", "_strides")

    def __init__(
        self,
        prefix: str,
        partition: GridPartition,
        *,
        extents: Sequence[Sequence[int]] | None = None,
        shapes: Sequence[tuple[int, ...]] | None = None,
    ) -> None:
        if (extents is None) == (shapes is None):
            raise BlockError("a grid space takes either per-dimension extents or one shape per worker")
        self._prefix, self._head, self._partition = prefix, prefix + "[", partition
        self._extents, self._shapes = extents, shapes
        self._made: dict[str, Block] = {}
        self._description: bytes | None = None
        strides, step = [], 1
        for n in reversed(partition.shape):
            strides.append(step)
            step *= n
        self._strides = tuple(reversed(strides))
        self._hash = _space_hash(partition.size, self._block_at)

    def __getattr__(self, name: str) -> Any:
        # the slots of a plain space (every block) are filled on first use only
        if name in ("_blocks", "_by_name", "_offsets"):
            self._adopt(tuple(self._block_at(k) for k in range(self._partition.size)))
            return object.__getattribute__(self, name)
        raise AttributeError(name)

    # -- the rule --------------------------------------------------------------------------
    @property
    def prefix(self) -> str:
        """The blocks' name prefix."""
        return self._prefix

    @property
    def partition(self) -> GridPartition:
        """The grid of workers."""
        return self._partition

    def _index(self, position: int) -> tuple[int, ...]:
        return tuple((position // s) % n for s, n in zip(self._strides, self._partition.shape))

    def _make(self, index: tuple[int, ...], position: int) -> Block:
        name = f"{self._head}{','.join(map(str, index))}]"
        block = self._made.get(name)
        if block is None:
            if self._extents is not None:
                shape = tuple(e[i] for e, i in zip(self._extents, index))
            else:
                shape = self._shapes[position]  # type: ignore[index]
            block = self._made[name] = Block.trusted(name, shape, self._partition.workers[position])
        return block

    def _block_at(self, position: int) -> Block:
        return self._make(self._index(position), position)

    def _position_of(self, name: object) -> int | None:
        """The C-order position of the block called ``name``, or None when there is none."""
        index = grid_index(name, self._prefix, self._partition.shape)
        return None if index is None else sum(i * s for i, s in zip(index, self._strides))

    def block_of(self, index: tuple[int, ...]) -> Block:
        """The block at grid ``index`` (a checked tuple of ints)."""
        return self._make(index, sum(i * s for i, s in zip(index, self._strides)))

    # -- what a space answers, without building every block --------------------------------
    def block(self, name: str) -> Block:
        """The block called ``name``."""
        found = self._made.get(name) if type(name) is str else None
        if found is not None:
            return found
        position = self._position_of(name)
        if position is None:
            return super().block(name)  # raises UnknownBlockError
        return self._block_at(position)

    def __contains__(self, name: object) -> bool:
        return (type(name) is str and name in self._made) or self._position_of(name) is not None

    def __len__(self) -> int:
        return self._partition.size

    @property
    def size(self) -> int:
        """Total number of entries."""
        if self._extents is not None:
            return math.prod(sum(e) for e in self._extents)
        shapes: Sequence[tuple[int, ...]] = self._shapes or ()
        total = getattr(shapes, "total", None)  # shapes described by a rule (ProductShapes)
        if total is not None:
            return int(total())
        return sum(math.prod(shape) for shape in shapes)

    @property
    def workers(self) -> Sequence[int]:
        """The workers of the partition, sorted (consecutive ones described, not enumerated)."""
        workers = self._partition.workers
        consecutive = getattr(self._partition, "_first", None) is not None  # sorted already
        return workers if consecutive else tuple(sorted(workers))

    @property
    def max_worker(self) -> int:
        """The largest worker of the partition."""
        return self._partition.max_worker

    def owned(self, worker: int) -> tuple[Block, ...]:
        """The block ``worker`` owns, if any."""
        position = self._partition.position(worker)
        return () if position is None else (self._block_at(position),)

    def offset(self, name: str) -> int:
        """Position of block ``name``'s first entry in a flattened state."""
        self.block(name)
        return self._offset_table()[name]

    def same_rule(self, other: GridSpace) -> bool:
        """True when ``other`` is described by the same prefix, partition and rule."""
        return (
            self._prefix == other._prefix
            and self._partition == other._partition
            and self._extents == other._extents
            and self._shapes == other._shapes
        )

    def _shape_list(self) -> Sequence[tuple[int, ...]]:
        if self._shapes is not None:
            return self._shapes
        return tuple(itertools.product(*self._extents))  # type: ignore[misc]

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if isinstance(other, GridSpace):
            if self._hash != other._hash:
                return False
            if self.same_rule(other):
                return True
            if self._prefix != other._prefix or self._partition != other._partition:
                return False  # different names or workers (every grid space holds a block)
            return self._shape_list() == other._shape_list()
        return super().__eq__(other)

    def __hash__(self) -> int:
        return self._hash

    def description(self) -> bytes:
        """The rule as bytes: prefix, partition and shapes (what a fingerprint reads)."""
        if self._description is not None:
            return self._description
        rule = repr(self._extents) if self._extents is not None else repr(self._shapes)
        text = f"G{self._prefix!r}".encode() + self._partition.description() + rule.encode()
        self._description = text
        return text


def _state_dtype(dtype: npt.DTypeLike, what: str) -> np.dtype:
    try:
        result = np.dtype(dtype)
    except (TypeError, ValueError):
        raise DtypeError(f"{what}: {dtype!r} is not a numpy dtype") from None
    if result.kind not in "iufcO":
        raise DtypeError(f"{what}: dtype {result} is not numeric")
    return result


def _normalize_index(
    key: Any, shape: tuple[int, ...], what: str
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[bool, ...]]:
    """Turn a basic index into (start, stop, indexed by an integer) per dimension of ``shape``."""
    key = key if isinstance(key, tuple) else (key,)
    ellipses = [i for i, k in enumerate(key) if k is Ellipsis]
    if len(ellipses) > 1:
        raise RegionError(f"{what}: at most one Ellipsis in an index")
    if ellipses:
        at = ellipses[0]
        fill = len(shape) - (len(key) - 1)
        key = key[:at] + (slice(None),) * max(fill, 0) + key[at + 1 :]
    if len(key) > len(shape):
        raise RegionError(f"{what}: {len(key)} indices for {len(shape)} dimensions")
    key = key + (slice(None),) * (len(shape) - len(key))
    starts, stops, integers = [], [], []
    for dim, (k, n) in enumerate(zip(key, shape)):
        if isinstance(k, slice):
            if k.step is not None and _int_index(k.step, what, dim) != 1:
                raise RegionError(f"{what}: dimension {dim} has step {k.step}; regions are boxes with step 1")
            start = 0 if k.start is None else _int_index(k.start, what, dim)
            stop = n if k.stop is None else _int_index(k.stop, what, dim)
            start = start + n if start < 0 else start
            stop = stop + n if stop < 0 else stop
            if not 0 <= start <= stop <= n:
                raise RegionError(
                    f"{what}: slice {k.start}:{k.stop} is out of bounds for dimension {dim} of extent {n}"
                )
        else:
            i = _int_index(k, what, dim)
            if not -n <= i < n:
                raise RegionError(f"{what}: index {i} is out of bounds for dimension {dim} of extent {n}")
            start = i + n if i < 0 else i
            stop = start + 1
        starts.append(start)
        stops.append(stop)
        integers.append(not isinstance(k, slice))
    return tuple(starts), tuple(stops), tuple(integers)


def _int_index(value: Any, what: str, dim: int) -> int:
    try:
        return _strict_index(value)
    except TypeError:
        raise RegionError(
            f"{what}: dimension {dim}: only integers and slices make a region, not {value!r}"
        ) from None


@dataclass(frozen=True)
class Region:
    """A box inside one block of a space: the subset x_a of ``docs/theory.md#memory-and-blocks``.

    Made by indexing a space: ``space["x"]`` is the whole block and ``space["x"][1:3, :]`` a
    box of it. Only basic indices make regions: integers, slices with step 1, and one
    Ellipsis. Negative indices count from the end. As in numpy, an integer index drops its
    dimension from the region's shape (``space["x"][0]`` of a 4 x 6 block has shape (6,));
    indexing a region indexes *within* it, like a numpy view.

    Parameters
    ----------
    space : Space
        The space the region belongs to.
    name : str
        The block the box lies in.
    start, stop : tuple of int
        The box in block coordinates, one entry per block dimension.
    dropped : tuple of int, optional
        Block dimensions indexed by an integer (extent 1, absent from ``shape``).

    Raises
    ------
    RegionError
        If the box is not inside the block or a dropped dimension is not of extent 1 (and, when
        indexing, for an index that is not basic or is out of range).
    UnknownBlockError
        If the space holds no block ``name``.

    Examples
    --------
    >>> from linop import Space
    >>> space = Space([("x", (4, 6))])
    >>> box = space["x"][1:3, 2:]
    >>> box.shape, box.start, box.stop
    ((2, 4), (1, 2), (3, 6))
    >>> space["x"][0].shape, space["x"][-1, ::1].start
    ((6,), (3, 0))
    >>> box[0, 1:]
    x[1, 3:6]
    """

    space: Space
    name: str
    start: tuple[int, ...]
    stop: tuple[int, ...]
    dropped: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        """Validate a region built directly (indexing a space builds checked regions itself).

        Raises
        ------
        RegionError
            If the box is not inside the block (``0 <= start <= stop <= shape``), the corners
            are not integers of the block's rank, or a dropped dimension is not of extent 1.
        UnknownBlockError
            If the space holds no block ``name``.
        """
        if not isinstance(self.space, Space):
            raise RegionError(f"a region needs a Space, not {type(self.space).__name__}")
        block = self.space.block(self.name)
        if (
            not self.dropped
            and type(self.start) is tuple
            and type(self.stop) is tuple
            and len(self.start) == len(self.stop) == block.ndim
            and all(type(a) is int and type(b) is int for a, b in zip(self.start, self.stop))
            and all(0 <= a <= b <= n for a, b, n in zip(self.start, self.stop, block.shape))
        ):  # the common case (halo plans build thousands of boxes): plain ints inside the block
            return
        what = f"region of block {self.name!r} {block.shape}"
        corners = []
        for label, corner in (("start", self.start), ("stop", self.stop), ("dropped", self.dropped)):
            try:
                corners.append(tuple(_strict_index(v) for v in corner))
            except TypeError:
                raise RegionError(f"{what}: {label} {corner!r} must be a tuple of ints") from None
        start, stop, dropped = corners
        if len(start) != block.ndim or len(stop) != block.ndim:
            raise RegionError(f"{what}: start {start} and stop {stop} need {block.ndim} entries each")
        for dim, (a, b, n) in enumerate(zip(start, stop, block.shape)):
            if not 0 <= a <= b <= n:
                raise RegionError(f"{what}: dimension {dim} range {a}:{b} is not inside 0:{n}")
        if list(dropped) != sorted(set(dropped)) or any(
            not 0 <= d < block.ndim or stop[d] - start[d] != 1 for d in dropped
        ):
            raise RegionError(
                f"{what}: dropped dimensions {dropped} must be distinct, sorted and of extent 1"
            )
        object.__setattr__(self, "start", start)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "dropped", dropped)

    @classmethod
    def _checked(
        cls, space: Space, name: str, start: tuple[int, ...], stop: tuple[int, ...], dropped: tuple[int, ...]
    ) -> Region:
        """A region whose fields the caller has already validated (no second check)."""
        return _unchecked(cls, space=space, name=name, start=start, stop=stop, dropped=dropped)

    @property
    def block(self) -> Block:
        """The block that holds this region."""
        return self.space.block(self.name)

    @property
    def worker(self) -> int:
        """The worker that owns the region's block."""
        return self.block.worker

    @cached_property
    def shape(self) -> tuple[int, ...]:
        """Extent of the box along the dimensions that are not dropped."""
        return tuple(b - a for d, (a, b) in enumerate(zip(self.start, self.stop)) if d not in self.dropped)

    @cached_property
    def size(self) -> int:
        """Number of entries in the box."""
        return math.prod(self.shape)

    @cached_property
    def index(self) -> tuple[int | slice, ...]:
        """The numpy index of the box inside its block (integers for dropped dimensions)."""
        return tuple(
            a if d in self.dropped else slice(a, b) for d, (a, b) in enumerate(zip(self.start, self.stop))
        )

    @cached_property
    def is_whole(self) -> bool:
        """True when the region is its whole block."""
        return self.stop == self.block.shape and not any(self.start) and not self.dropped

    def __getitem__(self, key: Any) -> Region:
        start, stop, integers = _normalize_index(key, self.shape, f"region {self!r}")
        visible = [d for d in range(len(self.start)) if d not in self.dropped]
        new_start, new_stop = list(self.start), list(self.stop)
        dropped = set(self.dropped)
        for d, a, b, integer in zip(visible, start, stop, integers):
            new_start[d], new_stop[d] = self.start[d] + a, self.start[d] + b
            if integer:
                dropped.add(d)
        return Region._checked(
            self.space, self.name, tuple(new_start), tuple(new_stop), tuple(sorted(dropped))
        )

    def overlaps(self, other: Region) -> bool:
        """True when both regions share at least one entry."""
        if self.name != other.name or self.size == 0 or other.size == 0:
            return False
        return all(
            max(a0, b0) < min(a1, b1)
            for a0, a1, b0, b1 in zip(self.start, self.stop, other.start, other.stop)
        )

    def in_space(self, space: Space) -> Region:
        """The same box, in another space that holds the same block."""
        if space.block(self.name) != self.block:
            raise SpaceMismatchError(
                f"region {self!r}: block {self.name!r} is {space.block(self.name)!r} in the target space"
            )
        return Region._checked(space, self.name, self.start, self.stop, self.dropped)

    def flat_indices(self) -> np.ndarray:
        """Positions of the region's entries in the space's flattened state (C order)."""
        strides = np.cumprod((1, *self.block.shape[::-1]))[-2::-1] if self.block.ndim else ()
        grids = np.ix_(*(np.arange(a, b) * s for a, b, s in zip(self.start, self.stop, strides)))
        offset = self.space.offset(self.name)
        if not grids:
            return np.array([offset])
        return (functools.reduce(np.add, grids) + offset).ravel()

    def __repr__(self) -> str:
        if self.is_whole:
            return self.name
        parts = (
            str(a) if d in self.dropped else f"{a}:{b}" for d, (a, b) in enumerate(zip(self.start, self.stop))
        )
        return f"{self.name}[{', '.join(parts)}]"
