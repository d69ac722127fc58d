"""The steps of a distributed program, global and per rank, as a closed set of types.

A *global* step (:data:`Step`) names workers: :class:`Local` (a node run on one worker),
:class:`Transfer` (data from one worker to another), :class:`Phase` (transfers run as one
batch), :class:`Scale`, :class:`ZeroState`, :class:`Branches` (a sum) and
:class:`FastPathStep` (a step an executor's fast-path lowering made). A *rank* step
(:data:`ScheduleStep`) is what one rank runs after projection
(:func:`~linop.program.projection.project`): a node, a :class:`RankPhase`, a :class:`Scale`, a
:class:`RankZero`, a :class:`RankBranches`, a :class:`LocalMoves` (transfers between two
workers of one rank) or a fast path's :class:`RankPart`.

A :class:`Footprint` says what a step reads and writes, which is all batching needs
(:mod:`linop.program.batching`).
"""

from __future__ import annotations

import operator
from abc import ABC
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..operator import LinearOperator
from ..space import Block, Region, Space

__all__ = [
    "BlockBox",
    "box_of",
    "whole_block",
    "boxes_overlap",
    "Footprint",
    "OPAQUE",
    "Local",
    "Transfer",
    "Phase",
    "Scale",
    "ZeroState",
    "Branches",
    "FastPathStep",
    "FastPathRunner",
    "RankPart",
    "Step",
    "RankPhase",
    "RankBranches",
    "RankZero",
    "LocalMoves",
    "RankOverlap",
    "ScheduleStep",
]

BlockBox = tuple[str, "tuple[int, ...] | None", "tuple[int, ...] | None"]
"""A block name and a box in it; ``None`` bounds mean the whole block."""


def box_of(region: Region) -> BlockBox:
    """The box of ``region``."""
    return (region.name, region.start, region.stop)


def whole_block(name: str) -> BlockBox:
    """The box of the whole block ``name``."""
    return (name, None, None)


def boxes_overlap(a: BlockBox, b: BlockBox) -> bool:
    """True when the two boxes share an entry (a whole block meets every box of it)."""
    if a[0] != b[0]:
        return False
    if a[1] is None or b[1] is None or a[2] is None or b[2] is None:
        return True
    for a0, a1, b0, b1 in zip(a[1], a[2], b[1], b[2]):  # a loop: batching asks once per transfer
        if (a0 if a0 > b0 else b0) >= (a1 if a1 < b1 else b1):
            return False
    return True


@dataclass(frozen=True, slots=True)
class Footprint:
    """What a step reads and writes; ``adds`` are writes that commute with each other."""

    reads: tuple[BlockBox, ...] = ()
    writes: tuple[BlockBox, ...] = ()
    adds: tuple[BlockBox, ...] = ()
    opaque: bool = False

    def conflicts(self, later: Footprint) -> bool:
        """True when running ``later`` concurrently with (before the end of) this step could
        change the result of running them in order."""
        if self.opaque or later.opaque:
            return True
        mine_written = self.writes + self.adds
        theirs_written = later.writes + later.adds
        for w in mine_written:
            if any(boxes_overlap(w, r) for r in later.reads):
                return True
        for r in self.reads:
            if any(boxes_overlap(r, w) for w in theirs_written):
                return True
        for w in self.writes:
            if any(boxes_overlap(w, o) for o in theirs_written):
                return True
        return any(boxes_overlap(a, w) for a in self.adds for w in later.writes)


OPAQUE = Footprint(opaque=True)
"""The footprint of a step that may touch anything (nothing moves across it)."""


# -- global steps ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Local:
    """A node whose blocks all live on ``worker``: run there with the numpy handler.

    ``in_flight``: the node may run while the messages of a phase are in flight (an
    overlapped product's interior, :class:`~linop.overlap.OverlappedHalo`): batching puts it
    into the phase it does not conflict with (:attr:`Phase.during`), else runs it in order."""

    node: LinearOperator
    worker: int
    footprint: Footprint
    in_flight: bool = False


@dataclass(frozen=True, slots=True)
class Transfer:
    """Move data of ``source`` (on one worker) into ``target`` (on another).

    ``mode``: ``"add"`` (target += data), ``"store"`` (target = data) or ``"new"`` (target is a
    new block). ``after``: ``"keep"``, ``"clear"`` or ``"drop"`` the source afterwards.
    ``round``: the transfer's depth in the data dependencies of the node that emits it, the
    same at both ends (0 by default; see :mod:`linop.program.batching`). ``ends``: the workers
    of ``source`` and ``target``, given by a lowering that knows them (a run of pieces), else
    read from the regions' spaces on first use (lowering, batching and projection each ask);
    not part of the transfer's equality.
    """

    source: Region
    target: Region | Block
    mode: str
    after: str
    round: int = 0
    ends: tuple[int, int] | None = field(default=None, repr=False, compare=False)

    def workers(self) -> tuple[int, int]:
        """The source's and the target's worker (read once, then kept in ``ends``)."""
        ends = self.ends
        if ends is None:
            ends = (self.source.worker, self.target.worker)
            object.__setattr__(self, "ends", ends)
        return ends

    @property
    def src_worker(self) -> int:
        return self.workers()[0]

    @property
    def dst_worker(self) -> int:
        return self.workers()[1]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.source.shape

    @property
    def footprint(self) -> Footprint:
        target = box_of(self.target) if isinstance(self.target, Region) else whole_block(self.target.name)
        source_write = (
            ()
            if self.after == "keep"
            else (box_of(self.source) if self.after == "clear" else whole_block(self.source.name),)
        )
        if self.mode == "add":
            return Footprint(reads=(box_of(self.source),), writes=source_write, adds=(target,))
        return Footprint(reads=(box_of(self.source),), writes=(target, *source_write))


@dataclass(frozen=True, slots=True)
class Phase:
    """Transfers that run as one batch: receives posted first, then sends, then one wait.

    ``during``: local steps that run while the phase's messages are in flight (after every
    receive and send is started, before the wait). They conflict with no transfer of the
    phase (nor with any step they were moved across), so running them before, during or after
    the phase gives the same result."""

    transfers: tuple[Transfer, ...]
    during: tuple[Local, ...] = ()


@dataclass(frozen=True, slots=True)
class Scale:
    """Multiply every block a rank holds by ``alpha`` (the tail of a Scaled node)."""

    alpha: Any


@dataclass(frozen=True, slots=True)
class ZeroState:
    """Replace the state by zeros of ``space`` (each rank: the blocks it owns)."""

    space: Space


@dataclass(frozen=True, slots=True)
class Branches:
    """A sum: run each term's program on the same input, then add the results blockwise."""

    terms: tuple[tuple[Step, ...], ...]
    space: Space


class RankPart(ABC):  # noqa: B024 - a marker base: the parts are data, each executor's calls its own
    """One rank's part of a fast-path step: an engine-neutral record of the program
    (:mod:`linop.program.parts`, the closed union :data:`~linop.program.parts.Part`), which each
    executor turns into its engine's calls through its own table (the MPI executor's calls,
    :class:`~linop.backends.mpi.steps.RankStep`, share this base)."""


class FastPathRunner(Protocol):
    """The global step of a fast-path lowering: the workers it involves and each rank's part."""

    @property
    def workers(self) -> tuple[int, ...]:
        """Every worker the step involves (the communicator must cover them)."""
        ...

    def project(self, rank: int) -> RankPart | None:
        """This rank's part, or None when the rank takes no part."""
        ...


@dataclass(frozen=True, slots=True)
class FastPathStep:
    """A step provided by a fast-path lowering, which runs itself on each rank.

    ``runner`` (a :class:`FastPathRunner`) names the workers it involves and gives each rank
    its part (a :class:`RankPart`), or None when the rank takes no part. Batching never moves
    other steps across it. (Not a barrier: only the ranks the step involves synchronize, and
    only as its messages require.) Its parts are engine-neutral
    (:mod:`linop.program.parts`); an executor without calls for a part type (no row in its
    table) lowers with :func:`~linop.program.lowering.lower_portable`.
    """

    runner: FastPathRunner


Step = Local | Transfer | Phase | Scale | ZeroState | Branches | FastPathStep
"""A step of a global program."""


# -- rank steps -----------------------------------------------------------------------------
@dataclass(frozen=True)
class RankPhase:
    """One rank's part of a phase: (peer, tag, transfer) for its receives and its sends.

    :meth:`index` and :meth:`empty` answer from tables built once, so that running a phase
    does no region arithmetic."""

    receives: tuple[tuple[int, int, Transfer], ...]
    sends: tuple[tuple[int, int, Transfer], ...]
    _indices: dict[int, tuple[Any, ...]] = field(init=False, repr=False, compare=False)
    _empty: frozenset[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        indices: dict[int, tuple[Any, ...]] = {}
        empty: set[int] = set()
        boxes: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[Any, ...]] = {}  # one index per box
        for _, _, t in (*self.receives, *self.sends):
            for region in (t.source, t.target):
                if isinstance(region, Region) and id(region) not in indices:
                    if region.dropped:
                        indices[id(region)] = (*region.index, Ellipsis)
                        continue
                    corners = (region.start, region.stop)
                    index = boxes.get(corners)
                    if index is None:  # the same box of many blocks (a run of pieces): one index
                        index = boxes[corners] = (*map(slice, region.start, region.stop), Ellipsis)
                    indices[id(region)] = index
            source = t.source  # dropped dimensions have extent 1: the product of the extents
            if 0 in map(operator.sub, source.stop, source.start):
                empty.add(id(t))
        object.__setattr__(self, "_indices", indices)
        object.__setattr__(self, "_empty", frozenset(empty))

    def index(self, region: Region) -> tuple[Any, ...]:
        """The numpy index of one of the phase's regions (a view even for integer indices)."""
        return self._indices[id(region)]

    def empty(self, transfer: Transfer) -> bool:
        """True when the transfer moves no entries."""
        return id(transfer) in self._empty


@dataclass(frozen=True, slots=True)
class RankBranches:
    """One rank's part of a sum: each term's rank program, and the range blocks it owns."""

    terms: tuple[tuple[ScheduleStep, ...], ...]
    names: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class RankZero:
    """The blocks of a zero operator's range that a rank owns."""

    blocks: tuple[Block, ...]


@dataclass(frozen=True, slots=True)
class LocalMoves:
    """Transfers between two workers of one rank (under a worker map), run as local copies,
    adds or moves with a transfer's semantics: ``target`` gets (``"new"``, ``"store"``) or adds
    (``"add"``) ``source`` in the run's dtype; then ``source`` is kept, cleared or dropped."""

    transfers: tuple[Transfer, ...]


@dataclass(frozen=True, slots=True)
class RankOverlap:
    """One rank's part of a phase with local work in flight: start ``phase``'s receives and
    sends, run the ``during`` nodes on the rank's blocks, wait, finish the phase. The nodes
    touch nothing the phase's transfers read or write, so an executor that cannot overlap
    may run the phase and then the nodes (``phase`` is None when the rank has no message in
    it: the nodes then just run)."""

    phase: RankPhase | None
    during: tuple[LinearOperator, ...]


ScheduleStep = (
    LinearOperator | RankPhase | Scale | RankZero | RankBranches | LocalMoves | RankOverlap | RankPart
)
"""A step of one rank's schedule: a node run on the rank's blocks, or one of the rank steps."""
