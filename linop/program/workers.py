r"""Which rank runs each worker of a tree: :class:`WorkerMap`.

By default worker ``w`` of a tree runs on rank ``w``. Under a :class:`WorkerMap` worker ``w``
runs on rank ``mapping.rank_of(w)``: a rank may hold several workers (16 workers on 4 ranks: 4
workers each) or none, and its local state holds the blocks of all its workers. The projection
of a program onto a rank (:func:`~linop.program.projection.project`) takes the map.

A map is either *described* by a rule of two numbers, ``W`` workers on ``R`` ranks,

.. math::

    \text{blocked:}\quad r(w) = \lfloor w R / W \rfloor, \qquad
    \text{round robin:}\quad r(w) = w \bmod R, \qquad 0 \le w < W,

or an explicit table of every worker. A described map answers everything in O(1) (its workers
on one rank: in O(1) memory, :class:`~linop.described.Stride`), whatever ``W``; a table equal
to a rule (every table over ``0 .. W - 1`` that some :meth:`WorkerMap.blocked` or
:meth:`WorkerMap.round_robin` gives) is recognised when it is built and kept as the rule, so
that equal assignments are equal maps, with one hash and one digest (:meth:`WorkerMap.description`,
part of a tree's fingerprint under the map) however they were given.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal

import numpy as np

from ..described import Stride
from ..errors import WorkerMapError

__all__ = ["WorkerMap"]


MAX_MAP_WORKERS = 1 << 24
"""The most workers a map listed as a table holds (a sequence or dict given to
:class:`WorkerMap`, or what :meth:`WorkerMap.blocked` lists for a map of more ranks than
workers, each worker on a rank of its own, some ranks empty). Every other blocked and
round-robin map, and ``range(W)``, is described by its rule, of any size."""

Rule = tuple[Literal["blocked", "round_robin"], int, int]
"""A described map: (kind, workers, ranks), in the canonical form of :func:`_canonical`."""


MAX_DESCRIBED = (1 << 63) - 1
"""The most workers or ranks a described map counts (its description holds both as 64-bit
integers)."""


def _counts(how: str, workers: object, ranks: object) -> tuple[int, int]:
    if not _natural(workers):
        raise WorkerMapError(f"WorkerMap.{how}: workers must be a non-negative integer, not {workers!r}")
    if not _natural(ranks) or int(ranks) < 1:  # type: ignore[call-overload]
        raise WorkerMapError(f"WorkerMap.{how}: ranks must be a positive integer, not {ranks!r}")
    if max(int(workers), int(ranks)) > MAX_DESCRIBED:  # type: ignore[call-overload]
        raise WorkerMapError(
            f"WorkerMap.{how}: {workers} workers on {ranks} ranks is more than a map counts "
            f"(at most MAX_DESCRIBED = 2**63 - 1 of each)"
        )
    return int(workers), int(ranks)  # type: ignore[call-overload]


def _canonical(kind: str, workers: int, ranks: int) -> Rule | None:
    """The one rule of a blocked or round-robin map of ``workers >= 1`` on ``ranks`` (a map
    of one assignment has one rule: round robin on one rank is blocked on one rank, on
    ``ranks >= workers`` it is the identity, blocked on ``workers`` ranks), or None for a
    blocked map of more ranks than workers (listed: several such give one assignment)."""
    if kind == "round_robin":
        if ranks == 1 or ranks >= workers:
            return ("blocked", workers, min(ranks, workers))
        return ("round_robin", workers, ranks)
    return ("blocked", workers, ranks) if ranks <= workers else None


def _rule_of(table: dict[int, int]) -> Rule | None:
    """The rule of a table, when it is one: over workers ``0 .. W - 1`` with largest rank
    ``R - 1``, blocked on ``R <= W`` ranks or round robin on ``2 <= R < W`` (the canonical
    rules, each of one assignment); else None. O(W), once per table."""
    count = len(table)
    if not count or max(table) != count - 1:  # not the workers 0 .. W - 1
        return None
    ranks = max(table.values()) + 1
    if ranks > count:
        return None
    given = np.fromiter((table[w] for w in range(count)), np.int64, count)
    workers = np.arange(count, dtype=np.int64)
    if np.array_equal(given, workers * ranks // count):
        return ("blocked", count, ranks)
    if ranks >= 2 and ranks < count and np.array_equal(given, workers % ranks):
        return ("round_robin", count, ranks)
    return None


class WorkerMap:
    """Which rank runs each worker of a tree: ``rank_of(w)``.

    Parameters
    ----------
    ranks : sequence of int (a 1-D numpy array included), or mapping of int to int
        ``ranks[w]`` is the rank of worker ``w`` (a sequence covers workers ``0 .. len - 1``;
        a mapping names its workers). :meth:`blocked` and :meth:`round_robin` describe the
        regular maps without a table.

    Raises
    ------
    WorkerMapError
        A worker or rank that is not a non-negative integer (the message names the worker), or
        a table of more than :data:`MAX_MAP_WORKERS` workers (refused before it is listed;
        ``range(W)``, the identity, is described by its rule whatever ``W``).

    Notes
    -----
    Two maps are equal when they put the same workers on the same ranks: a described map
    equals the table of its assignment, with the same hash and :meth:`description`. A table
    that a rule gives is kept as that rule (found in O(its workers) when it is built).

    Examples
    --------
    >>> WorkerMap.blocked(16, 4).workers_on(1)
    (4, 5, 6, 7)
    >>> WorkerMap.round_robin(16, 4).workers_on(1)
    (1, 5, 9, 13)
    >>> WorkerMap([0, 0, 1, 1]) == WorkerMap.blocked(4, 2)
    True
    >>> WorkerMap.blocked(1 << 40, 1 << 38).rank_of(12345678901)
    3086419725
    """

    __slots__ = ("_by_rank", "_description", "_hash", "_pairs", "_ranks", "_rule")

    def __init__(self, ranks: Sequence[int] | Mapping[int, int]) -> None:
        self._description: bytes | None = None
        self._ranks: dict[int, int] = {}
        self._pairs: tuple[tuple[int, int], ...] = ()
        self._by_rank: dict[int, tuple[int, ...]] = {}
        if isinstance(ranks, range) and ranks.start == 0 and ranks.step == 1 and len(ranks):
            # worker w on rank w: the identity, described in O(1) whatever its length
            self._rule = _canonical("blocked", len(ranks), len(ranks))
            self._hash = hash(self._rule)
            return
        if isinstance(ranks, (Sequence, Mapping, np.ndarray)) and not isinstance(ranks, (str, bytes)):
            if len(ranks) > MAX_MAP_WORKERS:  # before a table of them is listed (a MemoryError)
                raise WorkerMapError(
                    f"a worker map listed as a table holds at most MAX_MAP_WORKERS = {MAX_MAP_WORKERS} "
                    f"workers, not {len(ranks)}: describe a regular map by its rule "
                    f"(WorkerMap.blocked(workers, ranks) or WorkerMap.round_robin(workers, ranks), any size)"
                )
        if isinstance(ranks, np.ndarray):  # a numpy array of ranks is a sequence of ranks too
            if ranks.ndim != 1:
                raise WorkerMapError(
                    f"a worker map given as an array must be 1-D (rank of worker w at index w), not of "
                    f"shape {ranks.shape}"
                )
            ranks = ranks.tolist()
        if isinstance(ranks, Mapping):
            items = list(ranks.items())
        elif isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence):
            raise WorkerMapError(
                f"a worker map is a sequence (rank of worker w at index w) or a dict of worker to rank, "
                f"not {type(ranks).__name__}"
            )
        else:
            items = list(enumerate(ranks))
        table: dict[int, int] = {}
        for worker, rank in items:
            if not _natural(worker):
                raise WorkerMapError(f"worker map: worker {worker!r} is not a non-negative integer")
            if not _natural(rank):
                raise WorkerMapError(f"worker map: worker {worker} maps to {rank!r}, not a non-negative rank")
            table[int(worker)] = int(rank)
        self._rule = _rule_of(table)
        if self._rule is not None:  # kept as its rule: equal to (and hashed as) the described map
            self._hash = hash(self._rule)
            return
        self._ranks = table
        self._pairs = tuple(sorted(table.items()))
        by_rank: dict[int, list[int]] = {}
        for worker, rank in self._pairs:
            by_rank.setdefault(rank, []).append(worker)
        self._by_rank = {rank: tuple(workers) for rank, workers in by_rank.items()}
        self._hash = hash(self._pairs)

    @classmethod
    def _described(cls, rule: Rule) -> WorkerMap:
        """The map of ``rule`` (canonical), in O(1)."""
        self = cls.__new__(cls)
        self._rule, self._description = rule, None
        self._ranks, self._pairs, self._by_rank = {}, (), {}
        self._hash = hash(rule)
        return self

    @classmethod
    def of(cls, mapping: WorkerMap | Sequence[int] | Mapping[int, int]) -> WorkerMap:
        """``mapping`` as a :class:`WorkerMap` (itself when it is one)."""
        return mapping if isinstance(mapping, WorkerMap) else cls(mapping)

    @classmethod
    def round_robin(cls, workers: int, ranks: int) -> WorkerMap:
        """Worker ``w`` on rank ``w % ranks``: described, O(1) whatever ``workers``.

        Raises
        ------
        WorkerMapError
            ``workers`` is not a non-negative integer or ``ranks`` not a positive one.
        """
        workers, ranks = _counts("round_robin", workers, ranks)
        if not workers:
            return cls(())
        rule = _canonical("round_robin", workers, ranks)
        assert rule is not None
        return cls._described(rule)

    @classmethod
    def blocked(cls, workers: int, ranks: int) -> WorkerMap:
        """Consecutive workers together: worker ``w`` on rank ``w * ranks // workers``:
        described, O(1) whatever ``workers`` when ``ranks <= workers``; a map of more ranks
        than workers is listed (each worker alone on its rank).

        Raises
        ------
        WorkerMapError
            ``workers`` is not a non-negative integer or ``ranks`` not a positive one, or a
            map of more ranks than workers would list more than :data:`MAX_MAP_WORKERS`.
        """
        workers, ranks = _counts("blocked", workers, ranks)
        if not workers:
            return cls(())
        rule = _canonical("blocked", workers, ranks)
        if rule is not None:
            return cls._described(rule)
        if workers > MAX_MAP_WORKERS:
            raise WorkerMapError(
                f"WorkerMap.blocked: {workers} workers on {ranks} ranks (more ranks than workers) is "
                f"an explicit table, at most MAX_MAP_WORKERS = {MAX_MAP_WORKERS} workers"
            )
        return cls([w * ranks // workers for w in range(workers)])

    @property
    def rule(self) -> Rule | None:
        """``(kind, workers, ranks)`` of a described map (``kind`` ``"blocked"`` or
        ``"round_robin"``, canonical: one rule per assignment), or None for a table."""
        return self._rule

    def _get(self, worker: Any) -> int | None:
        """The rank of ``worker``, or None when it is not mapped."""
        rule = self._rule
        if rule is None:
            return self._ranks.get(worker)
        kind, workers, ranks = rule
        if not _natural(worker) or worker >= workers:
            return None
        return int(worker) * ranks // workers if kind == "blocked" else int(worker) % ranks

    def rank_of(self, worker: int) -> int:
        """The rank of ``worker``.

        Raises
        ------
        WorkerMapError
            ``worker`` is not mapped.
        """
        rank = self._get(worker)
        if rank is None:
            raise WorkerMapError(f"worker {worker} of the tree is not in the worker map")
        return rank

    def workers_on(self, rank: int) -> Sequence[int]:
        """The workers that ``rank`` holds, in increasing order: a tuple, or for a described
        map a :class:`~linop.described.Stride` equal to it (O(1) memory). Blocked: the
        workers ``ceil(r W / R) <= w < ceil((r + 1) W / R)``; round robin: ``r, r + R, ...``."""
        rule = self._rule
        if rule is None:
            return self._by_rank.get(rank, ())
        kind, workers, ranks = rule
        if not _natural(rank) or rank >= ranks:
            return ()
        if kind == "blocked":
            return Stride(-(-rank * workers // ranks), -(-(rank + 1) * workers // ranks))
        return Stride(int(rank), workers, ranks)

    def __len__(self) -> int:
        """The number of workers mapped."""
        return self._rule[1] if self._rule is not None else len(self._pairs)

    def __iter__(self) -> Iterator[int]:
        """The workers mapped, in increasing order."""
        if self._rule is not None:
            return iter(range(self._rule[1]))
        return (worker for worker, _ in self._pairs)

    @property
    def dense(self) -> int:
        """``n`` when the map covers exactly the workers ``0 .. n - 1`` (as a sequence does),
        else -1."""
        if self._rule is not None:
            return self._rule[1]
        pairs = self._pairs
        if not pairs:
            return 0
        return len(pairs) if pairs[0][0] == 0 and pairs[-1][0] == len(pairs) - 1 else -1

    @property
    def largest_rank(self) -> int:
        """The largest rank a worker is mapped to (-1 for the empty map)."""
        if self._rule is not None:  # canonical: ranks <= workers, so rank R - 1 holds a worker
            return self._rule[2] - 1
        return max(self._by_rank, default=-1)

    @property
    def pairs(self) -> tuple[tuple[int, int], ...]:
        """(worker, rank) for every mapped worker, by worker (listed: O(workers) for a
        described map, which the planning of a rank never asks for).

        Raises
        ------
        WorkerMapError
            A described map of more than :data:`MAX_MAP_WORKERS` workers (too many to list).
        """
        if self._rule is not None:
            workers = self._rule[1]
            if workers > MAX_MAP_WORKERS:
                raise WorkerMapError(
                    f"{self!r} maps {workers} workers: too many to list as pairs (at most "
                    f"MAX_MAP_WORKERS = {MAX_MAP_WORKERS}); ask rank_of or workers_on instead"
                )
            return tuple((w, self.rank_of(w)) for w in range(workers))
        return self._pairs

    def description(self) -> bytes:
        """The map as bytes (part of the tree's fingerprint under this map): the rule's kind
        and two numbers for a described map (O(1)), every (worker, rank) pair for a table (its
        own O(workers), once per map). Equal maps have equal descriptions."""
        if self._description is None:
            if self._rule is not None:
                kind, workers, ranks = self._rule
                numbers = np.array([workers, ranks], np.int64).tobytes()
                self._description = (b"B" if kind == "blocked" else b"R") + numbers
            else:
                flat = np.array(self._pairs, np.int64).reshape(-1)
                self._description = b"M" + flat.tobytes()
        return self._description

    def problem(self, workers: Iterable[int], size: int) -> WorkerMapError | None:
        """What is wrong with this map for a tree naming ``workers`` on ``size`` ranks (the
        smallest worker at fault is named), or None."""
        for worker in sorted(set(workers)):
            rank = self._get(worker)
            if rank is None:
                return WorkerMapError(f"worker {worker} of the tree is not in the worker map")
            if rank >= size:
                return WorkerMapError(
                    f"the worker map puts worker {worker} on rank {rank}, but the communicator has "
                    f"{size} rank(s)"
                )
        return None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, WorkerMap):
            return NotImplemented
        return self._rule == other._rule and self._pairs == other._pairs

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        if self._rule is not None:
            kind, workers, ranks = self._rule
            return f"WorkerMap.{kind}({workers}, {ranks})"
        return f"WorkerMap({dict(self._pairs)!r})"


def _natural(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and bool(value >= 0)
