r"""Consecutive movement steps of a rank's schedule run as one on host memory: the same state
after them, in fewer passes over the blocks.

A rank's schedule (:mod:`linop.program`) spells out what the tree means; run one node at a time
by the numpy interpreter's handlers, some neighbours do work the next one throws away. With
:math:`A_b` an allocation, :math:`C` a copy, :math:`C^*` its adjoint (add back, then clear) and
:math:`D_a` a drop:

- :math:`C_{s \to b[r]}\, A_b`: the zeros of :math:`b` are written only around :math:`r`
  (:func:`around`; none when :math:`r` is all of :math:`b`), then :math:`s` is copied in: one
  write of :math:`b`, not two (:class:`AllocateAndCopy`);
- :math:`C^*_{b \to a[r]}\, A_b` (the whole new block): :math:`0 + a[r] = a[r]`, so :math:`b`
  is a copy of :math:`a[r]`, not zeros then a sum (:class:`AllocateAndCopyBack`), and
- :math:`D_a\, C^*_{t \to a[r]}`: :math:`a[r]` is cleared just before :math:`a` is dropped, so
  it is dropped without the clear (:class:`AddBackAndDrop`; also the tail of the previous
  rule when :math:`D_a` follows it, and then, when :math:`a` was allocated earlier in the
  schedule, :math:`b` is the view :math:`a[r]` of memory nothing else holds: no copy at all).

In an overlapped convolution's tree (:mod:`linop.layers.overlap_split`) these are the padded
block's and the interior window's fills and the adjoint's copy of the bulk out of the padded
gradient: whole passes over the layer's blocks. Each fused step writes the same values in the
same dtype as the steps it replaces (``tests/test_host_fusion.py`` proves it entry by entry on
integers), except that :math:`0 + (-0.0)` is :math:`+0.0` where the copy keeps :math:`-0.0`.

:func:`fused` rewrites a schedule once per plan, on its first run; phases, fast-path parts and
every other step are kept as they are, and the nodes run during a phase's messages
(:class:`~linop.program.RankOverlap`) are fused among themselves (:class:`HostOverlap`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from ..movement import Copy, CopyAdjoint
from ..operator import LinearOperator
from ..primitives import Allocate, Deallocate
from ..program import RankOverlap, RankPhase
from ..space import Block, Region
from . import numpy as numpy_backend

__all__ = [
    "FusedStep",
    "AllocateAndCopy",
    "AllocateAndCopyBack",
    "AddBackAndDrop",
    "HostOverlap",
    "around",
    "fused",
    "run_node",
]


def around(shape: tuple[int, ...], start: tuple[int, ...], stop: tuple[int, ...]) -> list[tuple[slice, ...]]:
    """The block of ``shape`` outside the box ``[start, stop)``, as disjoint boxes (at most two
    per dimension: dimension 0's span the block, dimension 1's the box's extent along 0, ...);
    empty ones left out."""
    boxes = []
    for d, n in enumerate(shape):
        head = tuple(slice(a, b) for a, b in zip(start[:d], stop[:d]))
        tail = (slice(None),) * (len(shape) - d - 1)
        for a, b in ((0, start[d]), (stop[d], n)):
            if b > a and all(s.stop > s.start for s in head):
                boxes.append((*head, slice(a, b), *tail))
    return boxes


def _entries(work: numpy_backend.Workspace, place: Region | Block) -> np.ndarray:
    """A region's entries (a view) or a whole block's array, as the workspace holds them."""
    array = work.arrays[place.name]
    return array[place.index] if isinstance(place, Region) else array


class FusedStep(ABC):
    """Consecutive nodes of a schedule (:attr:`nodes`: the step's fields that are nodes, in
    order) run as one (:meth:`run`), with the same result."""

    @property
    def nodes(self) -> tuple[LinearOperator, ...]:
        values = (getattr(self, f.name) for f in fields(self))  # type: ignore[arg-type]  # subclasses are dataclasses
        return tuple(v for v in values if isinstance(v, LinearOperator))

    @abstractmethod
    def run(self, work: numpy_backend.Workspace) -> None:
        """Leave ``work`` as running :attr:`nodes` one by one would."""


@dataclass(frozen=True)
class AllocateAndCopy(FusedStep):
    """``A[b]`` then ``C[s -> b[r]]``: ``b`` built empty, zeros written around ``r``, ``s``
    copied into ``r``."""

    allocate: Allocate
    copy: Copy

    def run(self, work: numpy_backend.Workspace) -> None:
        region = self.copy.dst
        assert isinstance(region, Region)
        source = work.arrays[self.copy.src.name][self.copy.src.index]
        block = self.allocate.block
        array = np.empty(block.shape, dtype=np.result_type(work.dtype, source.dtype))
        for box in around(block.shape, region.start, region.stop):
            array[box] = 0
        array[region.index] = source
        work.set(block.name, array)


@dataclass(frozen=True)
class AllocateAndCopyBack(FusedStep):
    """``A[b]`` then ``C*[b <- a[r]]`` (then ``D[a]`` when ``drop``): ``b`` a copy of ``a[r]``;
    ``a[r]`` cleared, or ``a`` dropped. With ``lend`` (``a`` was allocated earlier in the
    schedule, so its memory is the run's alone) and ``a`` dropped, ``b`` is ``a[r]`` itself, a
    view, when it has the run's dtype: no copy."""

    allocate: Allocate
    copy_back: CopyAdjoint
    drop: Deallocate | None = None
    lend: bool = False

    def run(self, work: numpy_backend.Workspace) -> None:
        read = self.copy_back.dst
        back = _entries(work, read)
        dtype = np.result_type(work.dtype, back.dtype)
        lent = self.lend and back.dtype == dtype and read.name in work.owned
        work.set(self.allocate.block.name, back if lent else np.array(back, dtype=dtype))
        if isinstance(read, Block) or self.drop is not None:
            work.drop(read.name)
        elif read.size:
            work.writable(read.name)[read.index] = 0


@dataclass(frozen=True)
class AddBackAndDrop(FusedStep):
    """``C*[t <- a[r]]`` then ``D[a]``: ``a[r]`` added into ``t``, ``a`` dropped uncleared."""

    copy_back: CopyAdjoint
    drop: Deallocate

    def run(self, work: numpy_backend.Workspace) -> None:
        op = self.copy_back
        back = _entries(work, op.dst)
        work.writable(op.src.name, back.dtype)[op.src.index] += back
        work.drop(op.dst.name)


@dataclass(frozen=True)
class HostOverlap:
    """A :class:`~linop.program.RankOverlap` whose nodes in flight are fused: the same
    ``phase``, and ``during`` as nodes or fused steps."""

    phase: RankPhase | None
    during: tuple[Any, ...]


def _whole(region: Region | Block, name: str) -> bool:
    return region.name == name and (isinstance(region, Block) or region.is_whole)


def _fuse_at(steps: Sequence[Any], i: int, allocated: set[str]) -> tuple[Any, int] | None:
    """The fused step starting at ``steps[i]`` and how many steps it takes, or None;
    ``allocated``: the blocks allocated before it (their memory is the run's own)."""
    first = steps[i]
    second = steps[i + 1] if i + 1 < len(steps) else None
    third = steps[i + 2] if i + 2 < len(steps) else None
    if type(first) is Allocate:
        name = first.block.name
        if (
            type(second) is Copy
            and isinstance(second.dst, Region)
            and second.dst.name == name
            and second.src.name != name
        ):
            return AllocateAndCopy(first, second), 2
        if type(second) is CopyAdjoint and _whole(second.src, name) and second.dst.name != name:
            read = second.dst
            if isinstance(read, Region) and type(third) is Deallocate and third.name == read.name:
                return AllocateAndCopyBack(first, second, third, lend=read.name in allocated), 3
            return AllocateAndCopyBack(first, second), 2
    if (
        type(first) is CopyAdjoint
        and isinstance(first.dst, Region)
        and type(second) is Deallocate
        and second.name == first.dst.name
        and first.src.name != first.dst.name
    ):
        return AddBackAndDrop(first, second), 2
    return None


def fused(schedule: Sequence[Any], allocated: set[str] | None = None) -> tuple[Any, ...]:
    """``schedule`` with its runs of fusable movement nodes as :class:`FusedStep` s, and each
    :class:`~linop.program.RankOverlap` as a :class:`HostOverlap` of fused nodes; the same
    tuple when nothing fuses. ``allocated``: the blocks allocated before it (followed, and
    updated, as :func:`_note_allocations` says)."""
    out: list[Any] = []
    changed = False
    allocated = set() if allocated is None else allocated
    i = 0
    while i < len(schedule):
        step = schedule[i]
        found = _fuse_at(schedule, i, allocated)
        if found is not None:
            out.append(found[0])
            _note_allocations(found[0].nodes, allocated)
            i += found[1]
            changed = True
            continue
        if type(step) is RankOverlap:
            during = fused(step.during, allocated)  # follows the allocations in flight too
            if during is not step.during:
                step = HostOverlap(step.phase, during)
                changed = True
        else:
            _note_allocations((step,), allocated)
        out.append(step)
        i += 1
    return tuple(out) if changed else tuple(schedule)


def _note_allocations(steps: Sequence[Any], allocated: set[str]) -> None:
    """Follow which blocks hold memory of the run's own since their allocation: a node that
    brings in a block (a copy or move into a new one, a kernel's result) may bring in the
    caller's memory, so that name is forgotten; a step that is no node forgets them all."""
    for step in steps:
        if type(step) is Allocate:
            allocated.add(step.block.name)
        elif isinstance(step, FusedStep):
            _note_allocations(step.nodes, allocated)
        elif isinstance(step, (RankOverlap, HostOverlap)):
            _note_allocations(step.during, allocated)
        elif isinstance(step, LinearOperator):
            allocated.difference_update(n for n in step.range.names if n not in step.domain.names)
        elif type(step) is not RankPhase:
            allocated.clear()


def run_node(node: Any, work: numpy_backend.Workspace) -> None:
    """Run a node of a schedule, or a fused step, on ``work``."""
    if isinstance(node, FusedStep):
        node.run(work)
    else:
        numpy_backend.run(node, work)
