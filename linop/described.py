"""Sequences described by a rule rather than listed (a partition's workers, a grid's shapes).

A rank that plans its part of a tree names groups of a million workers by their rule; these
sequences give the entries one at a time, by position, in O(1) memory.
"""

from __future__ import annotations

import operator
from abc import abstractmethod
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar, TypeVar, cast

__all__ = ["DescribedSequence", "KeyedSequence", "TupleLike", "Offsets", "Stride"]

T = TypeVar("T")


class DescribedSequence(Sequence[T]):
    """A sequence whose ``k``-th entry a rule computes: subclasses set ``_len`` and give
    :meth:`_at`; indexing, negative positions, slices (as tuples) and the bounds check are
    here. ``_MISSING`` words the ``IndexError`` (``{position}``, ``{length}``)."""

    __slots__ = ()
    _len: int
    _MISSING: ClassVar[str] = "entry {position} of a sequence of {length}"

    @abstractmethod
    def _at(self, position: int) -> T:
        """The entry at ``0 <= position < len(self)``."""

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, position: Any) -> Any:
        if isinstance(position, slice):
            return tuple(self._at(k) for k in range(*position.indices(self._len)))
        position = operator.index(position)
        if position < 0:
            position += self._len
        if not 0 <= position < self._len:
            raise IndexError(self._MISSING.format(position=position, length=self._len))
        return self._at(position)


class KeyedSequence(DescribedSequence[T]):
    """A described sequence with a hashable description, :meth:`key`: equal to one of its own
    class with the same key (or the same entries) and to a listed sequence (``_LISTED``) with
    the same entries; hashed by its key (two equal ones of its class hash alike; a listed
    sequence does not)."""

    __slots__ = ()
    _LISTED: ClassVar[tuple[type, ...]] = (tuple, list)

    @abstractmethod
    def key(self) -> tuple[Any, ...]:
        """A hashable description (equal descriptions, equal sequences)."""

    def __eq__(self, other: object) -> bool:
        if isinstance(other, type(self)):
            return self.key() == other.key() or tuple(self) == tuple(other)
        if isinstance(other, self._LISTED):
            listed = cast("Sequence[Any]", other)
            return len(listed) == self._len and all(a == b for a, b in zip(self, listed))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.key())


class TupleLike(DescribedSequence[T]):
    """A described sequence equal to, and hashed and printed as, the tuple of its entries."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return repr(tuple(self))


class Offsets(TupleLike[int]):
    """The offsets of consecutive parts of given sizes: ``0, s0, s0 + s1, ...`` (``len(sizes)``
    entries, the start of each part; with ``total=True`` one more, the sum of all).

    Balanced sizes (:func:`~linop.partition.balanced_sizes`: ``q + 1`` repeated ``r`` times,
    then ``q``) are recognised without copying them, and their offsets computed, ``k q +
    min(k, r)``, in O(1) memory; other sizes are summed once into a tuple. Sorted, so
    :mod:`bisect` searches it. Equal to the tuple of its entries.

    Examples
    --------
    >>> tuple(Offsets((3, 3, 2, 2), total=True))
    (0, 3, 6, 8, 10)
    >>> Offsets((1, 0, 4)) == (0, 1, 1)
    True
    """

    __slots__ = ("_len", "_listed", "_quotient", "_remainder")
    _MISSING = "offset {position} of {length}"

    def __init__(self, sizes: Sequence[int], *, total: bool = False) -> None:
        count = len(sizes)
        self._len = count + 1 if total else count
        self._listed: tuple[int, ...] | None = None
        self._quotient = self._remainder = 0
        first, last = (sizes[0], sizes[-1]) if count else (0, 0)
        if count and first == last and sizes.count(first) == count:
            self._quotient = last
        elif count and first == last + 1 and sizes.count(first) + sizes.count(last) == count:
            remainder = sizes.count(first)
            if sizes.index(last) == remainder:  # every larger part first
                self._quotient, self._remainder = last, remainder
            else:
                self._listed = self._sum(sizes)
        else:
            self._listed = self._sum(sizes)

    @staticmethod
    def _sum(sizes: Sequence[int]) -> tuple[int, ...]:
        running, out = 0, [0]
        for size in sizes:
            running += size
            out.append(running)
        return tuple(out)

    def _at(self, position: int) -> int:
        if self._listed is not None:
            return self._listed[position]
        return position * self._quotient + min(position, self._remainder)


class Stride(TupleLike[int]):
    """The integers ``start, start + step, ...`` below ``stop`` (``step > 0``): a ``range``
    that is equal to, and hashed and printed as, the tuple of its entries (a worker map's
    workers on one rank, :meth:`~linop.program.WorkerMap.workers_on`).

    Examples
    --------
    >>> Stride(1, 16, 4) == (1, 5, 9, 13)
    True
    >>> 9 in Stride(1, 16, 4), 8 in Stride(1, 16, 4)
    (True, False)
    """

    __slots__ = ("_len", "_start", "_step")
    _MISSING = "entry {position} of a stride of {length}"

    def __init__(self, start: int, stop: int, step: int = 1) -> None:
        if step < 1:
            raise ValueError(f"Stride: step must be positive, not {step}")
        self._start, self._step = start, step
        self._len = max(0, -(-(stop - start) // step))

    def _at(self, position: int) -> int:
        return self._start + position * self._step

    def __contains__(self, value: object) -> bool:
        if not isinstance(value, int):
            return any(value == entry for entry in self)
        offset = value - self._start
        return 0 <= offset < self._len * self._step and offset % self._step == 0

    def __iter__(self) -> Iterator[int]:
        return iter(range(self._start, self._start + self._len * self._step, self._step))
