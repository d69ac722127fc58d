"""Shared pieces of the collective algorithms: the error type, a builder of operator trees
step by step, chunk bounds and the fold that reduces any worker count to a power of two.

An algorithm is built as a list of data-movement steps on a *current space* that grows and
shrinks as receive buffers are allocated and dropped; :class:`Steps` keeps that space, picks
:class:`~linop.SendRecv` or :class:`~linop.Copy` by the workers at both ends, and returns the
composition (the first step applied first) as one operator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import AlgorithmError
from ..movement import Copy, Move, SendRecv
from ..operator import Composition, Identity, LinearOperator
from ..partition import balanced_sizes
from ..primitives import Add, Allocate, Deallocate
from ..space import Block, Region, Space

__all__ = ["AlgorithmError", "Fold", "Steps", "chunk_bounds", "fold"]


def chunk_bounds(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` of consecutive chunks of the given sizes."""
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return bounds


def balanced_bounds(length: int, parts: int) -> list[tuple[int, int]]:
    """Bounds of ``parts`` balanced chunks of ``length`` (sizes differ by at most one)."""
    return chunk_bounds(balanced_sizes(length, parts))


@dataclass(frozen=True)
class Fold:
    """How ``P`` workers reduce to ``p2 = 2**floor(log2 P)`` participants (MPICH's scheme).

    For ``i < rem = P - p2`` worker ``2i`` is folded into worker ``2i + 1``; the participants are
    the odd workers below ``2 rem`` and every worker from ``2 rem`` on. ``participants[k]`` is
    the rank of new rank ``k``; ``chunks[k]`` the range of original ranks it stands for.
    """

    size: int
    p2: int
    rem: int
    participants: tuple[int, ...]
    chunks: tuple[tuple[int, int], ...]

    @property
    def folded(self) -> tuple[tuple[int, int], ...]:
        """The pairs (folded worker ``2i``, its participant ``2i + 1``)."""
        return tuple((2 * i, 2 * i + 1) for i in range(self.rem))

    @property
    def rounds(self) -> int:
        """log2 p2."""
        return self.p2.bit_length() - 1


def fold(size: int) -> Fold:
    """The :class:`Fold` of ``size`` workers (no fold when ``size`` is a power of two)."""
    if size < 1:
        raise AlgorithmError(f"an algorithm needs at least one worker, not {size}")
    p2 = 1 << (size.bit_length() - 1)
    rem = size - p2
    participants = tuple([2 * i + 1 for i in range(rem)] + list(range(2 * rem, size)))
    chunks = tuple([(2 * i, 2 * i + 2) for i in range(rem)] + [(r, r + 1) for r in range(2 * rem, size)])
    return Fold(size, p2, rem, participants, chunks)


class Steps:
    """An operator tree built step by step on a current space.

    Each method appends one node acting on the current space and moves the current space to
    the node's range; :meth:`operator` returns the composition of all steps (the first step
    applied first), or the identity when there is none.
    """

    def __init__(self, space: Space) -> None:
        self.start = space
        self.space = space
        self.factors: list[LinearOperator] = []

    def region(self, name: str, bounds: tuple[int, int] | None = None, axis: int = 0) -> Region:
        """Block ``name`` of the current space, or its slice ``bounds`` along ``axis``."""
        whole = self.space[name]
        if bounds is None:
            return whole
        index = (slice(None),) * axis + (slice(*bounds),)
        return whole[index]

    def push(self, node: LinearOperator) -> None:
        """Append ``node`` (its domain must be the current space)."""
        self.factors.append(node)
        self.space = node.range

    def copy(self, src: Region, dst: Region | Block) -> None:
        """``dst <- src``: a SendRecv between workers, a Copy within one (out of place when
        ``dst`` is a new block)."""
        worker = dst.worker
        node = SendRecv(src, dst) if src.worker != worker else Copy(src, dst)
        self.push(node)

    def add(self, src: Region, dst: Region) -> None:
        """``dst <- dst + src`` (a message when the workers differ)."""
        self.push(Add(src, dst))

    def allocate(self, block: Block) -> None:
        """Bring a new block of zeros into scope."""
        self.push(Allocate(self.space, block))

    def drop(self, name: str) -> None:
        """Deallocate block ``name``."""
        self.push(Deallocate(self.space, name))

    def relabel(self, name: str, block: Block) -> None:
        """Rename block ``name`` to ``block`` (out-of-place move; a message if the worker changes)."""
        self.push(Move(self.space[name], block))

    def temporary(self, name: str) -> str:
        """``name``, checked to be free in the current space."""
        if name in self.space:
            raise AlgorithmError(f"temporary block name {name!r} is already used by the space")
        return name

    def operator(self) -> LinearOperator:
        """The composition of the steps (applied in the order they were added)."""
        if not self.factors:
            return Identity(self.start)
        return Composition(tuple(reversed(self.factors)))
