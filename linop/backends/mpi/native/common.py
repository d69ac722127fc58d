"""What several native MPI fast paths share: the dtypes MPI sums natively, a block made
contiguous in place, the lazily built expansion a step falls back to, and a step lowered for
one rank."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ....operator import LinearOperator
from ....program import batch, lower, project
from ..steps import RankStep

if TYPE_CHECKING:  # pragma: no cover - mpi4py is optional at run time
    from ...numpy import Workspace

__all__ = ["REDUCIBLE"]

REDUCIBLE = "bBhHiIlLqQfdFD"
"""Dtypes (numpy type characters) that the native sums use; others run the expansion."""


def contiguous_owned(work: Workspace, name: str, dtype: np.dtype) -> np.ndarray:
    array = work.writable(name, dtype)
    if not array.flags.c_contiguous or array.dtype != dtype:
        array = np.ascontiguousarray(array, dtype=dtype)
        work.set(name, array)
    return array


class Fallback:
    """A rank's schedule of a node's expansion, for dtypes MPI cannot reduce natively: built on
    first use only (building it walks the whole expansion, O(P) or more per rank)."""

    __slots__ = ("_schedule", "op", "rank")

    def __init__(self, op: LinearOperator, rank: int) -> None:
        self.op, self.rank = op, rank
        self._schedule: tuple[Any, ...] | None = None

    def schedule(self) -> tuple[Any, ...]:
        if self._schedule is None:
            self._schedule = project(batch(lower(self.op.expand())), self.rank)
        return self._schedule


def fallback(op: LinearOperator, rank: int) -> Fallback:
    return Fallback(op, rank)


@dataclass
class Projected:
    """A fast path lowered for one rank (:func:`~linop.program.lower_for`):
    that rank's part, built without the other ranks' parts."""

    step: RankStep
    rank: int
    workers: tuple[int, ...]

    def project(self, rank: int) -> RankStep:
        if rank != self.rank:  # pragma: no cover - a rank's program is only projected onto it
            raise ValueError(f"a step lowered for rank {self.rank} projected onto rank {rank}")
        return self.step
