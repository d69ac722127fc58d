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

One rewrite moves a step earlier: :math:`D_a\, C^*_{b \to a[r]}\, A_b` after a run of phases
that read and write :math:`a` only inside :math:`r` or only outside it, ``a`` not made by them
(:class:`HoistedCopyBack`, :func:`hoisted`). The copy of :math:`a[r]` into :math:`b` is done
before the phases, which then add into and send from :math:`b` where they named :math:`a[r]`,
and keep the strips outside :math:`r` on :math:`a`, uncleared, since :math:`a` is dropped
after them and no transfer reads a strip twice. When ``a`` is the caller's memory (the
incoming gradient of a halo window, whose adjoint adds the halo strips back to their owners),
the phases no longer make it the run's own by copying it whole to add into its core or to clear
its strips: the one copy left is the core's, which the result needs anyway.

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
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np

from ..movement import Copy, CopyAdjoint
from ..operator import LinearOperator
from ..primitives import Allocate, Deallocate
from ..program import RankOverlap, RankPhase, Transfer
from ..space import Block, Region, Space
from . import numpy as numpy_backend

__all__ = [
    "AddIntoCopy",
    "FusedStep",
    "AllocateAndCopy",
    "AllocateAndCopyBack",
    "AddBackAndDrop",
    "HoistedCopyBack",
    "HostOverlap",
    "around",
    "fused",
    "hoisted",
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


Box = tuple[tuple[int, ...], ...]
"""A box's corners (start, stop)."""


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in zip(box[0], box[1]))


@dataclass(frozen=True)
class HoistedCopyBack(FusedStep):
    """``A[b]`` then ``C*[b <- a[r]]`` moved before the phases that :func:`hoisted` rewrote:
    ``b`` a copy of ``a[r]``. Nothing reads ``a[r]`` after it (the phases name ``b`` there, and
    ``a`` is dropped after them), so ``a[r]`` is not cleared. With ``own`` (the phases write
    into ``a`` outside ``r``) ``a`` becomes an array of the run's own holding only what is read
    again: its entries outside ``r`` copied, the boxes ``zeros`` inside ``r`` (where receives
    that straddle ``r`` land, :class:`AddIntoCopy`) zero, the rest of ``r`` left unwritten."""

    allocate: Allocate
    copy_back: CopyAdjoint
    own: bool = False
    zeros: tuple[Box, ...] = ()

    def run(self, work: numpy_backend.Workspace) -> None:
        read = self.copy_back.dst
        assert isinstance(read, Region)
        array = work.arrays[read.name]
        dtype = np.result_type(work.dtype, array.dtype)
        work.set(self.allocate.block.name, np.array(array[read.index], dtype=dtype))
        if self.own:
            kept = np.empty(array.shape, dtype=dtype)
            for box in around(array.shape, read.start, read.stop):
                kept[box] = array[box]
            for zero in self.zeros:
                kept[_slices(zero)] = 0
            work.set(read.name, kept)


@dataclass(frozen=True)
class AddIntoCopy(FusedStep):
    """After a phase whose receive straddled ``r``: the part that landed inside ``r`` of ``a``
    (``source``, zero before the phase) added into ``b`` (``target``, the same entries) and
    cleared, as :math:`C^*_{b \to a[r]}` would have carried it."""

    source: Region
    target: Region

    def run(self, work: numpy_backend.Workspace) -> None:
        array = work.writable(self.source.name)
        part = array[self.source.index]
        work.writable(self.target.name, part.dtype)[self.target.index] += part
        part[...] = 0


def _box(region: Region | Block) -> Box | None:
    """A region's corners; None for a whole block or one with dropped dimensions."""
    if isinstance(region, Block) or region.dropped:
        return None
    return region.start, region.stop


def _inside(box: Box, outer: Box) -> bool:
    return all(a0 <= a and b <= b0 for a, b, a0, b0 in zip(box[0], box[1], outer[0], outer[1]))


def _apart(box: Box, other: Box) -> bool:
    return any(b <= a0 or b0 <= a for a, b, a0, b0 in zip(box[0], box[1], other[0], other[1]))


def _meet(box: Box, other: Box) -> Box:
    return tuple(map(max, box[0], other[0])), tuple(map(min, box[1], other[1]))


@dataclass
class _Run:
    """What :func:`hoisted` learns of the phases before a copy back of ``read`` into ``block``
    (walked backwards): the strips outside ``read`` they send, whether they write outside it,
    and the straddling receives' boxes inside it."""

    read: Region
    block: Block
    sent: list[Box]
    writes: bool = False
    zeros: list[Box] | None = None

    def moved(self, box: Box) -> Region:
        """``box`` of ``read``'s block as the same entries of ``block``."""
        start = tuple(a - a0 for a, a0 in zip(box[0], self.read.start))
        stop = tuple(b - a0 for b, a0 in zip(box[1], self.read.start))
        return Region(Space([self.block]), self.block.name, start, stop)


def _moved_phase(phase: RankPhase, run: _Run) -> tuple[RankPhase, list[Any], _Run] | None:
    """``phase`` with its transfers' boxes of ``run.read``'s block inside ``read`` named in
    ``block`` (``read``'s copy), the steps that follow it (:class:`AddIntoCopy` for each
    receive that straddles ``read``), and what ``run`` knows with this phase added; None when
    a transfer names ``block``, makes or drops ``read``'s block, or sends a box straddling it."""
    read, name = run.read, run.read.name
    core = (read.start, read.stop)
    learned = _Run(read, run.block, list(run.sent), run.writes, list(run.zeros or []))
    after: list[Any] = []

    def rewritten(t: Transfer, receive: bool) -> Transfer | None:
        region = t.target if receive else t.source
        if run.block.name in (t.source.name, t.target.name):
            return None
        if region.name != name:
            return t
        box = _box(region)
        if box is None or (receive and t.mode == "new") or (not receive and t.after == "drop"):
            return None
        if _inside(box, core):
            assert isinstance(region, Region)
            return replace(t, target=learned.moved(box)) if receive else replace(t, source=learned.moved(box))
        if not receive:
            if not _apart(box, core):
                return None
            learned.sent.append(box)
            return t
        learned.writes = True
        if not _apart(box, core):  # straddles: the part inside is added into the copy after the phase
            part = _meet(box, core)
            assert learned.zeros is not None
            learned.zeros.append(part)
            after.append(AddIntoCopy(Region(read.space, name, *part), learned.moved(part)))
        return t

    receives, sends = [], []
    for peer, tag, t in phase.receives:
        new = rewritten(t, True)
        if new is None:
            return None
        receives.append((peer, tag, new))
    for peer, tag, t in phase.sends:
        new = rewritten(t, False)
        if new is None:
            return None
        sends.append((peer, tag, new))
    return RankPhase(tuple(receives), tuple(sends)), after, learned


def _uncleared(phases: list[Any], run: _Run) -> list[Any] | None:
    """Where ``a`` stays the caller's (the phases only read it outside ``r``): the phases with
    the clears of those strips dropped, ``a`` being dropped after them; None when two strips
    overlap (a later read would have seen the clear)."""
    boxes = run.sent
    if any(not _apart(p, q) for k, p in enumerate(boxes) for q in boxes[k + 1 :]):
        return None
    name = run.read.name

    def kept(t: Transfer) -> Transfer:
        return replace(t, after="keep") if t.source.name == name and t.after == "clear" else t

    return [
        RankPhase(p.receives, tuple((peer, tag, kept(t)) for peer, tag, t in p.sends))
        if type(p) is RankPhase
        else p
        for p in phases
    ]


def hoisted(schedule: Sequence[Any]) -> Sequence[Any]:
    """``schedule`` with each ``A[b], C*[b <- a[r]], D[a]`` that follows a run of phases moved
    before them as a :class:`HoistedCopyBack`, the phases rewritten (:func:`_moved_phase`: the
    boxes of ``a`` inside ``r`` named in ``b``) and ``D[a]`` after them. Where the phases only
    read ``a`` outside ``r``, ``a`` stays the caller's and their clears there are dropped
    (:func:`_uncleared`); where they write into it, ``a`` is made the run's own from its strips
    alone. ``schedule`` itself when there is nothing to move."""
    steps = list(schedule)
    changed = False
    i = 0
    while i + 2 < len(steps):
        allocate, back, drop = steps[i], steps[i + 1], steps[i + 2]
        if not (
            type(allocate) is Allocate
            and type(back) is CopyAdjoint
            and _whole(back.src, allocate.block.name)
            and isinstance(back.dst, Region)
            and _box(back.dst) is not None
            and type(drop) is Deallocate
            and drop.name == back.dst.name != allocate.block.name
        ):
            i += 1
            continue
        start, run = i, _Run(back.dst, allocate.block, [])
        moved: list[Any] = []
        while start > 0 and type(steps[start - 1]) is RankPhase:
            found = _moved_phase(steps[start - 1], run)
            if found is None:
                break
            moved[:0] = [found[0], *found[1]]
            run = found[2]
            start -= 1
        if moved and not run.writes:
            uncleared = _uncleared(moved, run)
            moved = [] if uncleared is None else uncleared
        if moved:
            first = HoistedCopyBack(allocate, back, own=run.writes, zeros=tuple(run.zeros or ()))
            steps[start : i + 3] = [first, *moved, drop]
            changed = True
            i = start + len(moved) + 2
        else:
            i += 3
    return tuple(steps) if changed else schedule


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
    moved = hoisted(schedule)
    changed = moved is not schedule
    schedule = moved
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
