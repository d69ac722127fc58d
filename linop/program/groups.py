"""Groups of workers described, not enumerated: what one rank plans of a collective.

A broadcast from one block to P copies, or a reduction of P blocks onto one, is a group of P
workers. A rank that plans its part names the group by a rule (a
:class:`~linop.partition.WorkerBox` of the copies' partition and the root's worker) and
never lists its members: length, membership, the position of a worker, and the runs of
consecutive ranks that ``MPI_Group_range_incl`` takes all cost O(ndim).

:class:`RootedRanks`
    the ranks of a group, root first (the order of the sub-communicator a native collective
    runs on: the root is rank 0 there), then the members in C order without the root;
:class:`CopyPairs`
    the (block name, worker) of each copy of a layout in a box, in C order;
:class:`MappedRanks`
    under a worker map, the distinct ranks of a group's workers, root's first
    (:func:`mapped_ranks`: runs of ranks found from runs of workers under a described map).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from ..described import KeyedSequence, TupleLike
from ..partition import WorkerBox

__all__ = ["CopyPairs", "MappedRanks", "RootedRanks", "listed_ranks", "mapped_ranks", "sorted_mapped_ranks"]


class RootedRanks(KeyedSequence[int]):
    """``(root, *(w for w in members if w != root))``, described.

    Parameters
    ----------
    root : int
        The root's worker (first).
    members : WorkerBox
        The other workers of the group (the root may be one of them: it is listed once).

    Examples
    --------
    >>> from linop import Partition
    >>> from linop.partition import WorkerBox
    >>> ranks = RootedRanks(5, WorkerBox(Partition((3, 4)), (None, 1)))
    >>> tuple(ranks), ranks.triples()
    ((5, 1, 9), ((5, 5, 1), (1, 1, 4), (9, 9, 4)))
    """

    __slots__ = ("_len", "_root_at", "members", "root")
    _MISSING = "rank {position} of a group of {length}"

    def __init__(self, root: int, members: WorkerBox) -> None:
        self.root, self.members = int(root), members
        at = members.position_of(self.root)
        self._root_at = len(members) if at is None else at  # the root's place among the members
        self._len = len(members) + (at is None)

    def _at(self, position: int) -> int:
        if position == 0:
            return self.root
        return self.members[position - 1 if position <= self._root_at else position]

    def __iter__(self) -> Iterator[int]:
        yield self.root
        for w in self.members:
            if w != self.root:
                yield w

    def __contains__(self, worker: object) -> bool:
        return worker == self.root or worker in self.members

    def triples(self) -> tuple[tuple[int, int, int], ...]:
        """The ranks as ``(first, last, stride)`` runs, in order: the root's, then the
        members' runs with the root taken out."""
        out = [(self.root, self.root, 1)]
        for first, last, stride in self.members.triples():
            r = self.root
            if first <= r <= last and (r - first) % stride == 0:
                if r > first:
                    out.append((first, r - stride, stride))
                if r < last:
                    out.append((r + stride, last, stride))
            else:
                out.append((first, last, stride))
        return tuple(out)

    def key(self) -> tuple[Any, ...]:
        """A hashable description (a sub-communicator cache key)."""
        return ("rooted", self.root, self.members.key())

    def __repr__(self) -> str:
        return f"RootedRanks({self.root}, {self.members!r})"


class CopyPairs(Sequence[tuple[str, int]]):
    """``(layout.block_name(j), worker of j)`` for every index ``j`` of a box of a layout's
    partition, in C order, described.

    Parameters
    ----------
    layout : a layout (:class:`~linop.layout.Layout`)
        Names the blocks.
    box : WorkerBox
        A box of ``layout.partition``.
    """

    __slots__ = ("box", "layout")

    def __init__(self, layout: Any, box: WorkerBox) -> None:
        self.layout, self.box = layout, box

    def __len__(self) -> int:
        return len(self.box)

    def __getitem__(self, position: Any) -> Any:
        if isinstance(position, slice):
            return tuple(self[k] for k in range(*position.indices(len(self))))
        if position < 0:
            position += len(self)
        if not 0 <= position < len(self):
            raise IndexError(f"copy {position} of {len(self)}")
        index = self.box.grid_index(position)
        return self.layout.block_name(index), self.box.partition.worker(index)

    def name_on(self, worker: int) -> str | None:
        """The name of the copy on ``worker``, or None (a box holds one block per worker)."""
        position = self.box.position_of(worker)
        return None if position is None else self.layout.block_name(self.box.grid_index(position))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, CopyPairs) and (self.layout.name, self.box.key()) == (
            other.layout.name,
            other.box.key(),
        ):
            return True
        if isinstance(other, (CopyPairs, tuple, list)):
            return len(other) == len(self) and all(a == tuple(b) for a, b in zip(self, other))
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self.layout.name, self.box.key()))

    def __repr__(self) -> str:
        return f"CopyPairs({self.layout.name!r}, {self.box!r})"


class MappedRanks(TupleLike[int]):
    r"""The distinct ranks that a worker map puts a group's workers on: the root's rank first
    (rank 0 of the group's sub-communicator), then the others in increasing order, held as
    runs of consecutive ranks (:meth:`triples`, what ``MPI_Group_range_incl`` takes).

    Built by :func:`mapped_ranks`; equal to (and hashed as) the tuple of its ranks.

    Examples
    --------
    >>> ranks = MappedRanks(2, ((0, 1), (3, 7)))
    >>> tuple(ranks), ranks.triples()
    ((2, 0, 1, 3, 4, 5, 6, 7), ((2, 2, 1), (0, 1, 1), (3, 7, 1)))
    """

    __slots__ = ("_len", "_offsets", "intervals", "root")
    _MISSING = "rank {position} of a group of {length}"

    def __init__(self, root: int, intervals: tuple[tuple[int, int], ...]) -> None:
        self.root, self.intervals = root, intervals  # disjoint, increasing, the root in none
        self._offsets = tuple(
            itertools.accumulate((last - first + 1 for first, last in intervals), initial=1)
        )
        self._len = self._offsets[-1]

    def _at(self, position: int) -> int:
        if position == 0:
            return self.root
        k = bisect.bisect_right(self._offsets, position) - 1
        return self.intervals[k][0] + position - self._offsets[k]

    def __iter__(self) -> Iterator[int]:
        yield self.root
        for first, last in self.intervals:
            yield from range(first, last + 1)

    def triples(self) -> tuple[tuple[int, int, int], ...]:
        """The ranks as ``(first, last, 1)`` runs in order, the root's first."""
        return ((self.root, self.root, 1), *((first, last, 1) for first, last in self.intervals))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, MappedRanks):
            return self.root == other.root and self.intervals == other.intervals
        return super().__eq__(other)

    __hash__ = TupleLike.__hash__


def listed_ranks(ranks: Sequence[int]) -> tuple[int, ...]:
    """The entries of ``ranks`` as a tuple, in order: from its runs where described
    (``triples()``: each run a :class:`range`, listed in C, about 30 times faster than
    iterating a :class:`~linop.partition.WorkerBox` member by member), else by iterating.
    O(len(ranks)): for an engine whose groups take a list (``torch.distributed.new_group``).

    Examples
    --------
    >>> from linop import Partition
    >>> from linop.partition import WorkerBox
    >>> listed_ranks(WorkerBox(Partition((3, 4)), (None, 1)))
    (1, 5, 9)
    """
    triples = getattr(ranks, "triples", None)
    if triples is None:
        return tuple(ranks)
    return tuple(
        itertools.chain.from_iterable(range(first, last + 1, stride) for first, last, stride in triples())
    )


def mapped_ranks(root: int, members: Sequence[int], mapping: Any) -> MappedRanks:
    r"""The ranks of a group whose root block is on worker ``root`` and whose other workers are
    ``members`` (the root's worker may be among them), under the worker map ``mapping``.

    For a described map (:attr:`~linop.program.WorkerMap.rule`) and members described by runs
    of consecutive workers (:meth:`~linop.partition.WorkerBox.triples`) each run's ranks are
    one or two runs, found in O(1): under a blocked map consecutive workers
    :math:`a .. b` are on ranks :math:`\lfloor aR/W \rfloor .. \lfloor bR/W \rfloor` (every
    one: with :math:`R \le W` consecutive workers' ranks differ by at most one), under round
    robin on :math:`a \bmod R .. b \bmod R` (wrapping, all of them when :math:`b - a + 1 \ge
    R`). Other members are listed (O(the group)).

    Raises
    ------
    WorkerMapError
        A worker of the group is not mapped.
    """
    root_rank = mapping.rank_of(root)
    intervals: list[tuple[int, int]] = []
    for first, last in _merged_spans(members, mapping):  # the root's rank taken out (it comes first)
        if first <= root_rank <= last:
            intervals.extend(
                span for span in ((first, root_rank - 1), (root_rank + 1, last)) if span[0] <= span[1]
            )
        else:
            intervals.append((first, last))
    return MappedRanks(root_rank, tuple(intervals))


def sorted_mapped_ranks(members: Sequence[int], mapping: Any) -> MappedRanks:
    r"""The distinct ranks that ``mapping`` puts the workers ``members`` on, in increasing
    order (a group without a root: an all-reduce's), as runs: O(the runs of ``members``) for
    members described by runs of consecutive workers (:meth:`~linop.partition.WorkerBox.triples`
    with stride 1) under a described map (as :func:`mapped_ranks`), else O(the members): a
    strided run's ranks are listed (under a blocked or round-robin map they need not be
    consecutive). Equal to ``tuple(sorted({rank_of(w) for w in members}))``.

    Raises
    ------
    WorkerMapError
        A worker of the group is not mapped.

    Examples
    --------
    >>> from linop import Partition
    >>> from linop.partition import WorkerBox
    >>> from linop.program import WorkerMap
    >>> ranks = sorted_mapped_ranks(WorkerBox(Partition((4, 4)), (None, None)), WorkerMap.blocked(16, 4))
    >>> tuple(ranks), ranks.triples()
    ((0, 1, 2, 3), ((0, 0, 1), (1, 3, 1)))
    """
    merged = _merged_spans(members, mapping)
    if not merged:
        raise ValueError("an empty group has no ranks")
    (first, last), rest = merged[0], merged[1:]
    return MappedRanks(first, ((first + 1, last), *rest) if last > first else tuple(rest))


def _merged_spans(members: Sequence[int], mapping: Any) -> list[tuple[int, int]]:
    """The ranks of ``members`` under ``mapping`` as disjoint increasing spans ``(first, last)``
    (merged where they touch): from runs where described, else by listing the members."""
    spans = _described_spans(members, mapping)
    if spans is None:  # listed
        spans = [(r, r) for r in {mapping.rank_of(w) for w in members}]
    merged: list[tuple[int, int]] = []
    for first, last in sorted(spans):
        if merged and first <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], last))
        else:
            merged.append((first, last))
    return merged


def _described_spans(members: Sequence[int], mapping: Any) -> list[tuple[int, int]] | None:
    """The rank spans of members described by runs under a described map, or None."""
    rule, triples = mapping.rule, getattr(members, "triples", None)
    if rule is None or triples is None:
        return None
    kind, workers, ranks = rule
    spans: list[tuple[int, int]] = []
    for first, last, stride in triples():
        if last >= workers:
            return None  # an unmapped worker: listed, so rank_of names it
        if first != last and stride != 1:
            spans.extend((r, r) for r in {mapping.rank_of(w) for w in range(first, last + 1, stride)})
        elif kind == "blocked":
            spans.append((first * ranks // workers, last * ranks // workers))
        elif last - first + 1 >= ranks:
            spans.append((0, ranks - 1))
        elif first % ranks <= last % ranks:
            spans.append((first % ranks, last % ranks))
        else:
            spans.extend(((first % ranks, ranks - 1), (0, last % ranks)))
    return spans
