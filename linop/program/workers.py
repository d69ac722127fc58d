"""Which rank runs each worker of a tree: :class:`WorkerMap`.

By default worker ``w`` of a tree runs on rank ``w``. Under a :class:`WorkerMap` worker ``w``
runs on rank ``mapping.rank_of(w)``: a rank may hold several workers (16 workers on 4 ranks: 4
workers each) or none, and its local state holds the blocks of all its workers. The projection
of a program onto a rank (:func:`~linop.program.projection.project`) takes the map.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import WorkerMapError

__all__ = ["WorkerMap"]


MAX_MAP_WORKERS = 1 << 24
"""The most workers :meth:`WorkerMap.round_robin` and :meth:`WorkerMap.blocked` build a map
for: a map is an explicit table, one entry per worker."""


def _counts(how: str, workers: object, ranks: object) -> tuple[int, int]:
    if not _natural(workers):
        raise WorkerMapError(f"WorkerMap.{how}: workers must be a non-negative integer, not {workers!r}")
    if int(workers) > MAX_MAP_WORKERS:  # type: ignore[call-overload]
        raise WorkerMapError(
            f"WorkerMap.{how}: {workers} workers is more than an explicit map holds "
            f"(at most MAX_MAP_WORKERS = {MAX_MAP_WORKERS})"
        )
    if not _natural(ranks) or int(ranks) < 1:  # type: ignore[call-overload]
        raise WorkerMapError(f"WorkerMap.{how}: ranks must be a positive integer, not {ranks!r}")
    return int(workers), int(ranks)  # type: ignore[call-overload]


class WorkerMap:
    """Which rank runs each worker of a tree: ``rank_of(w)``.

    Parameters
    ----------
    ranks : sequence of int (a 1-D numpy array included), or mapping of int to int
        ``ranks[w]`` is the rank of worker ``w`` (a sequence covers workers ``0 .. len - 1``;
        a mapping names its workers).

    Raises
    ------
    WorkerMapError
        A worker or rank that is not a non-negative integer (the message names the worker).

    Examples
    --------
    >>> WorkerMap.blocked(16, 4).workers_on(1)
    (4, 5, 6, 7)
    >>> WorkerMap.round_robin(16, 4).workers_on(1)
    (1, 5, 9, 13)
    """

    __slots__ = ("_by_rank", "_description", "_hash", "_pairs", "_ranks")

    def __init__(self, ranks: Sequence[int] | Mapping[int, int]) -> None:
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
        self._ranks = table
        self._pairs = tuple(sorted(table.items()))
        by_rank: dict[int, list[int]] = {}
        for worker, rank in self._pairs:
            by_rank.setdefault(rank, []).append(worker)
        self._by_rank = {rank: tuple(workers) for rank, workers in by_rank.items()}
        self._hash = hash(self._pairs)
        self._description: bytes | None = None

    @classmethod
    def of(cls, mapping: WorkerMap | Sequence[int] | Mapping[int, int]) -> WorkerMap:
        """``mapping`` as a :class:`WorkerMap` (itself when it is one)."""
        return mapping if isinstance(mapping, WorkerMap) else cls(mapping)

    @classmethod
    def round_robin(cls, workers: int, ranks: int) -> WorkerMap:
        """Worker ``w`` on rank ``w % ranks``.

        Raises
        ------
        WorkerMapError
            ``workers`` is not a non-negative integer (at most :data:`MAX_MAP_WORKERS`) or
            ``ranks`` not a positive one.
        """
        workers, ranks = _counts("round_robin", workers, ranks)
        return cls([w % ranks for w in range(workers)])

    @classmethod
    def blocked(cls, workers: int, ranks: int) -> WorkerMap:
        """Consecutive workers together: worker ``w`` on rank ``w * ranks // workers``.

        Raises
        ------
        WorkerMapError
            ``workers`` is not a non-negative integer (at most :data:`MAX_MAP_WORKERS`) or
            ``ranks`` not a positive one.
        """
        workers, ranks = _counts("blocked", workers, ranks)
        return cls([w * ranks // workers for w in range(workers)])

    def rank_of(self, worker: int) -> int:
        """The rank of ``worker``.

        Raises
        ------
        WorkerMapError
            ``worker`` is not mapped.
        """
        rank = self._ranks.get(worker)
        if rank is None:
            raise WorkerMapError(f"worker {worker} of the tree is not in the worker map")
        return rank

    def workers_on(self, rank: int) -> tuple[int, ...]:
        """The workers that ``rank`` holds, in increasing order."""
        return self._by_rank.get(rank, ())

    @property
    def dense(self) -> int:
        """``n`` when the map covers exactly the workers ``0 .. n - 1`` (as a sequence does),
        else -1."""
        pairs = self._pairs
        if not pairs:
            return 0
        return len(pairs) if pairs[0][0] == 0 and pairs[-1][0] == len(pairs) - 1 else -1

    @property
    def largest_rank(self) -> int:
        """The largest rank a worker is mapped to (-1 for the empty map)."""
        return max(self._by_rank, default=-1)

    @property
    def pairs(self) -> tuple[tuple[int, int], ...]:
        """(worker, rank) for every mapped worker, by worker."""
        return self._pairs

    def description(self) -> bytes:
        """The map as bytes (part of the tree's fingerprint under this map)."""
        if self._description is None:  # the map's own O(workers), once per map
            flat = np.fromiter(itertools.chain.from_iterable(self._pairs), np.int64, 2 * len(self._pairs))
            self._description = b"M" + flat.tobytes()
        return self._description

    def problem(self, workers: Iterable[int], size: int) -> WorkerMapError | None:
        """What is wrong with this map for a tree naming ``workers`` on ``size`` ranks (the
        smallest worker at fault is named), or None."""
        for worker in sorted(set(workers)):
            rank = self._ranks.get(worker)
            if rank is None:
                return WorkerMapError(f"worker {worker} of the tree is not in the worker map")
            if rank >= size:
                return WorkerMapError(
                    f"the worker map puts worker {worker} on rank {rank}, but the communicator has "
                    f"{size} rank(s)"
                )
        return None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WorkerMap) and self._pairs == other._pairs

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"WorkerMap({dict(self._pairs)!r})"


def _natural(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and bool(value >= 0)
