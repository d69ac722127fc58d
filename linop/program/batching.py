"""Batching: consecutive transfers grouped into phases (:class:`~linop.program.steps.Phase`).

A phase runs as one batch of nonblocking receives (posted first) and sends followed by one
wait. A transfer joins the open phase only when that gives the same result as running it after
the others (no read-after-write, write-after-read or write-after-write conflict, two adds into
one region excepted: they commute and are applied in program order), and when its ``round``
is not above the round of the phase's last transfer. Local steps that follow a phase are
deferred behind it, so transfers separated only by unrelated local work still share a phase.
Batching is deterministic, so every rank that holds the same steps batches them alike.

The round is a transfer's depth in the data dependencies of the node that emits it, as both of
its ends compute it (the halo exchange: its stage). A rank sees only its own side of a
dependency, so without rounds a receiver would post a message of the next stage in the phase
where its sender is still receiving what that message carries, and wait for the sender's next
phase; ranks waiting so for each other chain across the grid. With rounds a receive is posted
in the phase its sender sends in (:mod:`linop.latency` models the schedules' critical path).
Rounds only split phases further, so phases stay runs of program order on every rank and
batching still cannot deadlock.

A local step marked ``in_flight`` (an overlapped product's interior,
:class:`~linop.overlap.OverlappedHalo`) joins the open phase as work to run while its messages
are in flight (:attr:`~linop.program.steps.Phase.during`) when it conflicts with none of the
phase's transfers and none of the local steps deferred behind it (the in-flight steps keep their
order among themselves); with no phase open it waits for the next phase, whose transfers must then
not conflict with it. Either way it is moved only across steps it commutes with, so the result
is that of program order; otherwise it runs in order.
"""

from __future__ import annotations

from collections.abc import Iterable

from .steps import BlockBox, Branches, Footprint, Local, Phase, Step, Transfer
from .steps import boxes_overlap as _boxes_overlap

__all__ = ["batch"]


_CONFLICTING_HULLS = ((1, 2), (0, 1, 2), (0, 1))
"""Per kind of a later step's boxes (reads, writes, adds), the hulls (0 reads, 1 writes, 2 adds)
of the gathered steps it conflicts with: a read comes after writes and adds, a write after
anything, an add after reads and writes (adds commute)."""


class _Pending:
    """The steps gathered since the last flush, indexed by the names of the blocks their
    footprints touch, so that a new step is checked only against the steps that touch one of
    its blocks (a step's footprint is read again only then: a transfer's is not kept)."""

    def __init__(self) -> None:
        self.by_block: dict[str, list[Transfer | Local]] = {}
        # per block: the hull of the boxes read, written and added to (a necessary condition of
        # a conflict, so that a run of steps on disjoint boxes of one block is checked in O(1)
        # per step instead of against every earlier step)
        self.hulls: dict[str, list[BlockBox | None]] = {}
        self.opaque = False
        self.empty = True

    def add(self, footprint: Footprint, step: Transfer | Local) -> None:
        """Gather ``step``, whose footprint is ``footprint``."""
        self.empty = False
        if footprint.opaque:
            self.opaque = True
            return
        by_block, all_hulls = self.by_block, self.hulls
        seen = None
        for kind, boxes in enumerate((footprint.reads, footprint.writes, footprint.adds)):
            for box in boxes:
                name = box[0]
                if name != seen:  # a step is listed once per block it touches
                    listed = by_block.setdefault(name, [])
                    if not listed or listed[-1] is not step:
                        listed.append(step)
                    seen = name
                hulls = all_hulls.get(name)
                if hulls is None:
                    hulls = all_hulls[name] = [None, None, None]
                hulls[kind] = _hull(hulls[kind], box)

    def _may_conflict(self, later: Footprint) -> bool:
        """False when no hull of the gathered steps meets ``later`` as a conflict would."""
        hulls, overlap = self.hulls, _boxes_overlap
        for boxes, kinds in zip((later.reads, later.writes, later.adds), _CONFLICTING_HULLS):
            for box in boxes:
                found = hulls.get(box[0])
                if found is not None:
                    for kind in kinds:
                        hull = found[kind]
                        if hull is not None and overlap(hull, box):
                            return True
        return False

    def conflicts(self, later: Footprint) -> bool:
        """True when ``later`` conflicts with any gathered step (see Footprint.conflicts)."""
        if self.empty:
            return False
        if self.opaque or later.opaque:
            return True
        if not self._may_conflict(later):
            return False
        seen: set[int] = set()
        for name in _block_names(later):
            for earlier in self.by_block.get(name, ()):
                if id(earlier) not in seen:
                    seen.add(id(earlier))
                    if earlier.footprint.conflicts(later):
                        return True
        return False

    def clear(self) -> None:
        self.by_block.clear()
        self.hulls.clear()
        self.opaque = False
        self.empty = True


def _hull(hull: BlockBox | None, box: BlockBox) -> BlockBox:
    """The smallest box holding ``hull`` and ``box`` (whole-block bounds stay whole)."""
    if hull is None:
        return box
    low, high, start, stop = hull[1], hull[2], box[1], box[2]
    if low is None or high is None:
        return hull
    if start is None or stop is None:
        return (box[0], None, None)
    if low == start and high == stop:  # the same box again (a block read by a run of sends)
        return hull
    return (box[0], tuple(map(min, low, start)), tuple(map(max, high, stop)))


def _block_names(footprint: Footprint) -> set[str]:
    return {box[0] for boxes in (footprint.reads, footprint.writes, footprint.adds) for box in boxes}


def batch(steps: Iterable[Step]) -> list[Step]:
    """Group transfers into phases (see the module docstring); recurse into sum branches."""
    steps = list(steps)
    # what in-flight work crosses is tracked only for a program that has some
    in_flight = any(isinstance(step, Local) and step.in_flight for step in steps)
    out: list[Step] = []
    phase: list[Transfer] = []
    during: list[Local] = []  # in-flight local steps of the open phase
    waiting: list[Local] = []  # in-flight local steps before any phase: for the next one
    deferred: list[Local] = []
    pending = _Pending()  # footprints of ``phase``, ``during``, ``waiting`` and ``deferred``
    crossed = _Pending()  # footprints of ``phase`` and ``deferred``: what in-flight work crosses

    def flush() -> None:
        if phase:
            out.append(Phase(tuple(phase), tuple(during)))
            phase.clear()
        else:
            out.extend(during)
        during.clear()
        out.extend(waiting)
        waiting.clear()
        out.extend(deferred)
        deferred.clear()
        pending.clear()
        crossed.clear()

    for step in steps:
        if isinstance(step, Transfer):
            fp = step.footprint
            if pending.conflicts(fp) or (phase and step.round > phase[-1].round):
                flush()
            if not phase and waiting:  # in-flight work before the phase: run it during
                during.extend(waiting)
                waiting.clear()
            phase.append(step)
            pending.add(fp, step)
            if in_flight:
                crossed.add(fp, step)
        elif isinstance(step, Local) and step.in_flight:
            fp = step.footprint
            # the in-flight steps of a phase run in program order among themselves: one needs
            # to commute only with the transfers and the deferred steps it is moved across
            if phase and not crossed.conflicts(fp):
                during.append(step)
            else:
                if phase or deferred:
                    flush()
                waiting.append(step)
            pending.add(fp, step)
        elif isinstance(step, Local) and phase:
            deferred.append(step)
            pending.add(step.footprint, step)
            if in_flight:
                crossed.add(step.footprint, step)
        else:
            flush()
            if isinstance(step, Branches):
                step = Branches(tuple(tuple(batch(term)) for term in step.terms), step.space)
            out.append(step)
    flush()
    return out
