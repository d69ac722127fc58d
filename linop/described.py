"""Sequences described by a rule rather than listed (a partition's workers, a grid's shapes).

A rank that plans its part of a tree names groups of a million workers by their rule; these
sequences give the entries one at a time, by position, in O(1) memory.
"""

from __future__ import annotations

import operator
from abc import abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar, TypeVar

__all__ = ["DescribedSequence"]

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
