"""Compile an operator tree into per-rank schedules for the MPI interpreter.

Compilation has three passes, all deterministic, so every rank that holds the same tree
computes the same global program and the same batching:

1. **Lowering** (:func:`lower`) turns the tree into a flat global program of steps: local
   steps (a primitive or movement node whose blocks all live on one worker, run with the numpy
   interpreter's handler on that worker), *transfers* (an add, copy or move whose source and
   destination live on different workers), and the per-rank algebra steps (scale, zero, sum of
   branches). Nodes without a handler are lowered through their :meth:`expand`; fast paths
   (native collectives, halo exchange) register a lowering with :func:`lowering`.
2. **Batching** (:func:`batch`) groups consecutive transfers into *phases* that run as one
   batch of nonblocking receives (posted first) and sends followed by one wait. A transfer
   joins the open phase only when that gives the same result as running it after the others
   (no read-after-write, write-after-read or write-after-write conflict, two adds into one
   region excepted: they commute and are applied in program order), and when its ``round``
   is not above the round of the phase's last transfer. Local steps that follow a
   phase are deferred behind it, so transfers separated only by unrelated local work still
   share a phase. The round is a transfer's depth in the data dependencies of the node that
   emits it, as both of its ends compute it (the halo exchange: its stage): a rank sees only
   its own side of a dependency, so without it a receiver would post a message of the next
   stage in the phase where its sender is still receiving what that message carries, and wait
   for the sender's next phase; ranks waiting so for each other chain across the grid. With it
   a receive is posted in the phase its sender sends in (:mod:`linop.latency` models the
   schedules' critical path).
3. **Projection** (:func:`project`) keeps, for one rank, the steps it takes part in.

A plan does not build the global program: each rank compiles its own schedule
(:func:`compile_for_rank`), lowering only the steps it takes part in (:func:`lower_for`; the
halo exchange, its shims and the collectives' fast paths build the rank's part from their
geometry, in O(the rank's own work), see ``docs/theory.md#cost-model``), then batching and
projecting those. Batching a rank's steps alone may group them into fewer phases than the
global program does (a phase is split only where one of the rank's own steps depends on an
earlier one), which gives the same result, and cannot deadlock: phases are runs of program
order on every rank (the rounds only split phases further), so the earliest unfinished
transfer always has both ends posted. A
message's tag counts the earlier transfers between the same pair of ranks, which both ends see
in program order, so the schedules of :func:`compile_for_rank` and :meth:`Program.for_rank`
run together. The global program (:func:`compile_program`) stays for inspection, accounting
and plots.

A transfer's data flow: the rank owning ``source`` sends it; the rank owning ``target``
receives and then adds it (``"add"``), stores it (``"store"``) or makes it a new block
(``"new"``); afterwards the source is kept, cleared or dropped (``after``). Every movement
node maps onto one transfer: ``SendRecv`` is (store or new, keep), its adjoint (add, clear or
drop) in the reverse direction, a cross-worker move (store or new, clear or drop).
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import dispatch
from ..movement import Copy, CopyAdjoint, Move
from ..operator import Composition, Identity, LinearOperator, Scaled, Sum, Zero
from ..partition import Partition
from ..primitives import Add, Allocate, Clear, Deallocate
from ..space import Block, GridSpace, Region, Space
from .mpi_steps import FastPathRunner

__all__ = [
    "Footprint",
    "Local",
    "Transfer",
    "Phase",
    "Scale",
    "ZeroState",
    "Branches",
    "FastPathStep",
    "movement_footprint",
    "Program",
    "lower",
    "lower_portable",
    "lowering",
    "batch",
    "project",
    "compile_program",
    "compile_for_rank",
    "RankProgram",
    "lower_for",
    "lowering_rank",
    "note_workers",
    "fingerprint",
]

BlockBox = tuple[str, "tuple[int, ...] | None", "tuple[int, ...] | None"]
"""A block name and a box in it; ``None`` bounds mean the whole block."""


def _box(region: Region) -> BlockBox:
    return (region.name, region.start, region.stop)


def _whole_block(name: str) -> BlockBox:
    return (name, None, None)


def _boxes_overlap(a: BlockBox, b: BlockBox) -> bool:
    if a[0] != b[0]:
        return False
    if a[1] is None or b[1] is None or a[2] is None or b[2] is None:
        return True
    return all(max(a0, b0) < min(a1, b1) for a0, a1, b0, b1 in zip(a[1], a[2], b[1], b[2]))


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
            if any(_boxes_overlap(w, r) for r in later.reads):
                return True
        for r in self.reads:
            if any(_boxes_overlap(r, w) for w in theirs_written):
                return True
        for w in self.writes:
            if any(_boxes_overlap(w, o) for o in theirs_written):
                return True
        return any(_boxes_overlap(a, w) for a in self.adds for w in later.writes)


OPAQUE = Footprint(opaque=True)


# -- global steps ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Local:
    """A node whose blocks all live on ``worker``: run there with the numpy handler."""

    node: LinearOperator
    worker: int
    footprint: Footprint


@dataclass(frozen=True, slots=True)
class Transfer:
    """Move data of ``source`` (on one worker) into ``target`` (on another).

    ``mode``: ``"add"`` (target += data), ``"store"`` (target = data) or ``"new"`` (target is a
    new block). ``after``: ``"keep"``, ``"clear"`` or ``"drop"`` the source afterwards.
    ``round``: the transfer's depth in the data dependencies of the node that emits it, the
    same at both ends (0 by default; see the module docstring's batching).
    """

    source: Region
    target: Region | Block
    mode: str
    after: str
    round: int = 0

    @property
    def src_worker(self) -> int:
        return self.source.worker

    @property
    def dst_worker(self) -> int:
        return self.target.worker

    @property
    def shape(self) -> tuple[int, ...]:
        return self.source.shape

    @property
    def footprint(self) -> Footprint:
        target = _box(self.target) if isinstance(self.target, Region) else _whole_block(self.target.name)
        source_write = (
            ()
            if self.after == "keep"
            else (_box(self.source) if self.after == "clear" else _whole_block(self.source.name),)
        )
        if self.mode == "add":
            return Footprint(reads=(_box(self.source),), writes=source_write, adds=(target,))
        return Footprint(reads=(_box(self.source),), writes=(target, *source_write))


@dataclass(frozen=True, slots=True)
class Phase:
    """Transfers that run as one batch: receives posted first, then sends, then one wait."""

    transfers: tuple[Transfer, ...]


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

    terms: tuple[tuple[Any, ...], ...]
    space: Space


@dataclass(frozen=True, slots=True)
class FastPathStep:
    """A step provided by a fast-path lowering, which runs itself on each rank.

    ``runner`` (a :class:`~linop.backends.mpi_steps.FastPathRunner`) names the workers it
    involves and gives each rank its part (a :class:`~linop.backends.mpi_steps.RankStep`), or
    None when the rank takes no part. Batching never moves other steps across it. (Not an MPI
    barrier: only the ranks the step involves synchronize, and only as its messages require.)
    """

    runner: FastPathRunner


Step = Any
"""One of Local, Transfer, Phase, Scale, ZeroState, Branches, FastPathStep."""


# -- lowering -------------------------------------------------------------------------------
Lowering = Callable[[Any], "list[Step] | None"]


def lowering(node_type: type) -> Callable[[Lowering], Lowering]:
    """Register a fast-path lowering for a node type in the dispatch registry
    (:mod:`linop.dispatch`, interpreter ``"mpi"``).

    The function takes the node and returns its list of global steps, or None to fall back to
    the node's expansion (for cases the fast path does not cover).
    """

    def register(function: Lowering) -> Lowering:
        def lower_node(node: Any, steps: list[Step]) -> Any:
            lowered = function(node)
            if lowered is None:
                return dispatch.DECLINE
            if _PORTABLE.get() and any(type(step) is FastPathStep for step in lowered):
                return dispatch.DECLINE  # a worker map: the expansion's point-to-point steps
            steps.extend(lowered)
            return None

        lower_node.__doc__ = function.__doc__
        lower_node.__wrapped__ = function  # type: ignore[attr-defined]
        dispatch.register("mpi", node_type)(lower_node)
        return function

    return register


def _steps(
    node_type: type,
) -> Callable[[Callable[[Any, list[Step]], None]], Callable[[Any, list[Step]], None]]:
    """Register the lowering of an algebra node, primitive or movement node, which appends
    its steps to the program (it never declines)."""
    return dispatch.register("mpi", node_type)


def _movement_steps(node: Copy | CopyAdjoint | Move) -> list[Step]:
    """A movement node: local when both ends share a worker, else one transfer."""
    src, dst = node.src, node.dst
    if src.worker == dst.worker:
        return [Local(node, src.worker, movement_footprint(node))]
    out = isinstance(dst, Block)
    if isinstance(node, CopyAdjoint):
        # data flows back from dst to src and is added there; dst is cleared or dropped
        back = dst if isinstance(dst, Region) else node.domain[dst.name]
        return [Transfer(back, src.in_space(node.domain), "add", "drop" if out else "clear")]
    if isinstance(node, Move):
        return [Transfer(src, dst, "new" if out else "store", "drop" if out else "clear")]
    return [Transfer(src, dst, "new" if out else "store", "keep")]


def movement_footprint(node: Copy | CopyAdjoint | Move) -> Footprint:
    """What a movement node reads and writes (for batching; shared with the fast paths)."""
    src, dst = node.src, node.dst
    dst_box = _whole_block(dst.name) if isinstance(dst, Block) else _box(dst)
    if isinstance(node, CopyAdjoint):  # x_src += x_dst (an add: commutes with adds), x_dst cleared
        return Footprint(reads=(dst_box,), writes=(dst_box,), adds=(_box(src),))
    if isinstance(node, Move):
        return Footprint(
            reads=(_box(src),),
            writes=(dst_box, _box(src) if isinstance(dst, Region) else _whole_block(src.name)),
        )
    return Footprint(reads=(_box(src),), writes=(dst_box,))


_PORTABLE: contextvars.ContextVar[bool] = contextvars.ContextVar("linop_portable", default=False)


def lower_portable(op: LinearOperator) -> list[Step]:
    """The global program of ``op`` without fast-path steps: every lowering that would emit a
    :class:`FastPathStep` declines, so its node runs its expansion (local steps and transfers
    between workers only). Used under a worker-to-rank map (:mod:`linop.backends.mpi_mapping`),
    where the fast paths' worker == rank layout does not hold."""
    token = _PORTABLE.set(True)
    try:
        return lower(op)
    finally:
        _PORTABLE.reset(token)


def lower(op: LinearOperator) -> list[Step]:
    """The global program of ``op``: its steps in execution order (inside :func:`lower_for`,
    the steps of that rank's lowering)."""
    steps: list[Step] = []
    _lower_into(op, steps)
    return steps


_RANK: contextvars.ContextVar[int | None] = contextvars.ContextVar("linop_lowering_rank", default=None)
_OMITTED: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("linop_omitted", default=None)


def lowering_rank() -> int | None:
    """The rank a lowering is for (inside :func:`lower_for`), or None for the global program.

    A lowering that can tell which of its steps a rank takes part in may emit only those when
    this is not None (the rest are other ranks' business); it then reports the largest worker
    of what it left out with :func:`note_workers`."""
    return _RANK.get()


def note_workers(largest: int) -> None:
    """Record the largest worker that a rank's lowering left out (see :func:`lowering_rank`)."""
    omitted = _OMITTED.get()
    if omitted is not None:
        omitted.append(largest)


def lower_for(op: LinearOperator, rank: int) -> tuple[list[Step], int]:
    """The steps of ``op`` that ``rank`` takes part in, in program order, and the largest worker
    the whole program names.

    Lowerings that know the rank (:func:`lowering_rank`: the halo exchange and shims) build only
    its part, in O(its own work); the steps other lowerings build for other ranks are dropped
    here. Every pair of ranks sees the transfers between them in the same order as in the
    global program, which is what :func:`project` needs to match tags.
    """
    omitted: list[int] = []
    rank_token, omitted_token = _RANK.set(rank), _OMITTED.set(omitted)
    try:
        steps = lower(op)
    finally:
        _RANK.reset(rank_token)
        _OMITTED.reset(omitted_token)
    largest = max((*omitted, *_workers(steps)), default=0)
    return _involving(steps, rank), largest


def _involving(steps: Iterable[Step], rank: int) -> list[Step]:
    """The steps a rank takes part in (sums: every term's, kept whole as a step)."""
    out: list[Step] = []
    for step in steps:
        if isinstance(step, Local):
            if step.worker == rank:
                out.append(step)
        elif isinstance(step, Transfer):
            if step.src_worker == rank or step.dst_worker == rank:
                out.append(step)
        elif isinstance(step, Branches):
            out.append(Branches(tuple(tuple(_involving(term, rank)) for term in step.terms), step.space))
        else:
            out.append(step)
    return out


def _lower_into(op: LinearOperator, steps: list[Step]) -> None:
    dispatch.dispatch("mpi", op, steps)


@_steps(Composition)
def _lower_composition(op: Composition, steps: list[Step]) -> None:
    for factor in reversed(op.factors):
        _lower_into(factor, steps)


@_steps(Identity)
def _lower_identity(op: Identity, steps: list[Step]) -> None:
    pass


@_steps(Zero)
def _lower_zero(op: Zero, steps: list[Step]) -> None:
    steps.append(ZeroState(op.range))


@_steps(Scaled)
def _lower_scaled(op: Scaled, steps: list[Step]) -> None:
    _lower_into(op.operator, steps)
    steps.append(Scale(op.alpha))


@_steps(Sum)
def _lower_sum(op: Sum, steps: list[Step]) -> None:
    steps.append(Branches(tuple(tuple(lower(t)) for t in op.terms), op.range))


@_steps(Copy)
@_steps(CopyAdjoint)
@_steps(Move)
def _lower_movement(op: Copy | CopyAdjoint | Move, steps: list[Step]) -> None:
    steps.extend(_movement_steps(op))


@_steps(Add)
def _lower_add(op: Add, steps: list[Step]) -> None:
    if op.src.worker == op.dst.worker:
        steps.append(Local(op, op.src.worker, Footprint(reads=(_box(op.src),), adds=(_box(op.dst),))))
    else:
        steps.append(Transfer(op.src, op.dst, "add", "keep"))


@_steps(Clear)
def _lower_clear(op: Clear, steps: list[Step]) -> None:
    steps.append(Local(op, op.region.worker, Footprint(writes=(_box(op.region),))))


@_steps(Allocate)
def _lower_allocate(op: Allocate, steps: list[Step]) -> None:
    steps.append(Local(op, op.block.worker, Footprint(writes=(_whole_block(op.block.name),))))


@_steps(Deallocate)
def _lower_deallocate(op: Deallocate, steps: list[Step]) -> None:
    steps.append(Local(op, op.space.block(op.name).worker, Footprint(writes=(_whole_block(op.name),))))


# -- batching -------------------------------------------------------------------------------
class _Pending:
    """Footprints of the steps gathered since the last flush, indexed by block name, so that a
    new step is checked only against the steps that touch one of its blocks."""

    def __init__(self) -> None:
        self.by_block: dict[str, list[Footprint]] = {}
        # per block: the hull of the boxes read, written and added to (a necessary condition of
        # a conflict, so that a run of steps on disjoint boxes of one block is checked in O(1)
        # per step instead of against every earlier step)
        self.hulls: dict[str, list[BlockBox | None]] = {}
        self.opaque = False
        self.empty = True

    def add(self, footprint: Footprint) -> None:
        self.empty = False
        if footprint.opaque:
            self.opaque = True
            return
        for name in _block_names(footprint):
            self.by_block.setdefault(name, []).append(footprint)
        for kind, boxes in enumerate((footprint.reads, footprint.writes, footprint.adds)):
            for box in boxes:
                hulls = self.hulls.setdefault(box[0], [None, None, None])
                hulls[kind] = _hull(hulls[kind], box)

    def _may_conflict(self, later: Footprint) -> bool:
        """False when no hull of the gathered steps meets ``later`` as a conflict would."""
        empty = (None, None, None)
        for box in later.reads:  # after writes or adds
            read, written, added = self.hulls.get(box[0], empty)
            if _meets(written, box) or _meets(added, box):
                return True
        for box in later.writes:  # after reads, writes or adds
            read, written, added = self.hulls.get(box[0], empty)
            if _meets(read, box) or _meets(written, box) or _meets(added, box):
                return True
        for box in later.adds:  # after reads or writes (adds commute)
            read, written, added = self.hulls.get(box[0], empty)
            if _meets(read, box) or _meets(written, box):
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
                    if earlier.conflicts(later):
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
    if hull[1] is None or hull[2] is None or box[1] is None or box[2] is None:
        return (box[0], None, None)
    return (
        box[0],
        tuple(min(a, b) for a, b in zip(hull[1], box[1])),
        tuple(max(a, b) for a, b in zip(hull[2], box[2])),
    )


def _meets(hull: BlockBox | None, box: BlockBox) -> bool:
    return hull is not None and _boxes_overlap(hull, box)


def _block_names(footprint: Footprint) -> set[str]:
    return {box[0] for boxes in (footprint.reads, footprint.writes, footprint.adds) for box in boxes}


def batch(steps: Iterable[Step]) -> list[Step]:
    """Group transfers into phases (see the module docstring); recurse into sum branches."""
    out: list[Step] = []
    phase: list[Transfer] = []
    deferred: list[Local] = []
    pending = _Pending()  # footprints of ``phase`` and ``deferred``

    def flush() -> None:
        if phase:
            out.append(Phase(tuple(phase)))
            phase.clear()
        out.extend(deferred)
        deferred.clear()
        pending.clear()

    for step in steps:
        if isinstance(step, Transfer):
            fp = step.footprint
            if pending.conflicts(fp) or (phase and step.round > phase[-1].round):
                flush()
            phase.append(step)
            pending.add(fp)
        elif isinstance(step, Local) and phase:
            deferred.append(step)
            pending.add(step.footprint)
        else:
            flush()
            if isinstance(step, Branches):
                step = Branches(tuple(tuple(batch(term)) for term in step.terms), step.space)
            out.append(step)
    flush()
    return out


# -- projection -----------------------------------------------------------------------------
@dataclass(frozen=True)
class RankPhase:
    """One rank's part of a phase: (peer, tag, transfer) for its receives and its sends.

    :meth:`index` and :meth:`empty` answer from tables built once, so that running a phase
    does no region arithmetic."""

    receives: tuple[tuple[int, int, Transfer], ...]
    sends: tuple[tuple[int, int, Transfer], ...]

    def __post_init__(self) -> None:
        indices: dict[int, tuple] = {}
        empty: set[int] = set()
        for _, _, t in (*self.receives, *self.sends):
            for region in (t.source, t.target):
                if isinstance(region, Region):
                    indices[id(region)] = (*region.index, Ellipsis)
            if t.source.size == 0:
                empty.add(id(t))
        object.__setattr__(self, "_indices", indices)
        object.__setattr__(self, "_empty", frozenset(empty))

    def index(self, region: Region) -> tuple:
        """The numpy index of one of the phase's regions (a view even for integer indices)."""
        return self._indices[id(region)]  # type: ignore[attr-defined]

    def empty(self, transfer: Transfer) -> bool:
        """True when the transfer moves no entries."""
        return id(transfer) in self._empty  # type: ignore[attr-defined]


@dataclass(frozen=True, slots=True)
class RankBranches:
    """One rank's part of a sum: each term's rank program, and the range blocks it owns."""

    terms: tuple[tuple[Any, ...], ...]
    names: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class RankZero:
    """The blocks of a zero operator's range that a rank owns."""

    blocks: tuple[Block, ...]


TAG_LIMIT = 32767
"""The largest tag MPI guarantees; tags repeat beyond it, which MPI's ordering makes safe."""


def project(steps: Iterable[Step], rank: int) -> tuple[Any, ...]:
    """The steps of a batched program that ``rank`` takes part in (the global program, or the
    rank's own from :func:`lower_for` batched: the same messages with the same tags).

    A message's tag counts the earlier transfers between the same (source, destination) pair
    in program order (modulo :data:`TAG_LIMIT`), so both ends derive it from the transfers
    they take part in, however each groups its transfers into phases."""
    return _project(steps, rank, {})


def _project(steps: Iterable[Step], rank: int, counts: dict[tuple[int, int], int]) -> tuple[Any, ...]:
    out: list[Any] = []

    def tag(t: Transfer) -> int:
        pair = (t.src_worker, t.dst_worker)
        count = counts.get(pair, 0)
        counts[pair] = count + 1
        return count % TAG_LIMIT

    for step in steps:
        if isinstance(step, Local):
            if step.worker == rank:
                out.append(step.node)
        elif isinstance(step, (Phase, Transfer)):
            receives, sends = [], []
            for t in step.transfers if isinstance(step, Phase) else (step,):
                src, dst = t.src_worker, t.dst_worker
                if dst == rank:
                    receives.append((src, tag(t), t))
                elif src == rank:
                    sends.append((dst, tag(t), t))
            if receives or sends:
                out.append(RankPhase(tuple(receives), tuple(sends)))
        elif isinstance(step, Scale):
            out.append(step)
        elif isinstance(step, ZeroState):
            out.append(RankZero(step.space.owned(rank)))
        elif isinstance(step, Branches):
            names = tuple(b.name for b in step.space.owned(rank))
            out.append(RankBranches(tuple(_project(term, rank, counts) for term in step.terms), names))
        elif isinstance(step, FastPathStep):
            mine = step.runner.project(rank)
            if mine is not None:
                out.append(mine)
        else:  # pragma: no cover - lower() emits nothing else
            raise TypeError(f"unknown step {step!r}")
    return tuple(out)


# -- whole programs -------------------------------------------------------------------------
@dataclass(frozen=True)
class Program:
    """A compiled tree: its global batched steps, the scalars it multiplies by, and the
    largest worker it names."""

    steps: tuple[Step, ...]
    alphas: tuple[Any, ...]
    max_worker: int

    def for_rank(self, rank: int) -> tuple[Any, ...]:
        """The rank's schedule."""
        return project(self.steps, rank)

    @property
    def phases(self) -> int:
        """Number of communication phases and fast-path steps at the top level (sums not counted)."""
        return sum(isinstance(s, (Phase, FastPathStep)) for s in self.steps)


def _alphas(steps: Iterable[Step]) -> list[Any]:
    found = []
    for step in steps:
        if isinstance(step, Scale):
            found.append(step.alpha)
        elif isinstance(step, Branches):
            for term in step.terms:
                found.extend(_alphas(term))
    return found


@dataclass(frozen=True)
class RankProgram:
    """One rank's compiled tree: its schedule, the scalars the tree multiplies by, and the
    largest worker the whole tree names (:func:`compile_for_rank`)."""

    schedule: tuple[Any, ...]
    alphas: tuple[Any, ...]
    max_worker: int


def compile_for_rank(op: LinearOperator, rank: int) -> RankProgram:
    """``rank``'s schedule of ``op``: its own steps lowered (:func:`lower_for`), batched and
    projected, without the global program. Runs with the schedules other ranks compile from
    the global program (:meth:`Program.for_rank`) and with each other: the messages between
    two ranks and their tags are the same."""
    steps, largest = lower_for(op, rank)
    batched = batch(steps)
    workers = (op.domain.max_worker, op.range.max_worker, largest)
    return RankProgram(project(batched, rank), tuple(_alphas(batched)), max(workers))


def compile_program(op: LinearOperator) -> Program:
    """Lower and batch ``op`` (deterministic: the same on every rank)."""
    lowered = lower(op)
    workers = [op.domain.max_worker, op.range.max_worker]
    workers.extend(_workers(lowered))
    steps = tuple(batch(lowered))
    return Program(steps, tuple(_alphas(steps)), max(workers, default=0))


def _workers(steps: Iterable[Step]) -> list[int]:
    """Every worker that a step of the program names."""
    found: list[int] = []
    for step in steps:
        if isinstance(step, Local):
            found.append(step.worker)
        elif isinstance(step, Transfer):
            found.extend((step.src_worker, step.dst_worker))
        elif isinstance(step, ZeroState):
            found.append(step.space.max_worker)
        elif isinstance(step, Branches):
            found.append(step.space.max_worker)
            for term in step.terms:
                found.extend(_workers(term))
        elif isinstance(step, FastPathStep):
            found.extend(step.runner.workers)
    return found


# -- fingerprint ----------------------------------------------------------------------------
def fingerprint(op: LinearOperator) -> bytes:
    """A stable 16-byte digest of the tree's structure (types, spaces, regions with the shape
    and worker of their block, scalars with their type: ``2`` and ``2.0`` differ).

    The same on every process for the same tree (it does not use Python's randomized
    ``hash``); different trees differ with overwhelming probability.
    """
    digest = hashlib.blake2b(digest_size=16)
    memo: dict[int, bytes] = {}
    _feed(op, digest, memo)
    return digest.digest()


@functools.lru_cache(maxsize=256)
def _fields_of(kind: type) -> tuple[str, ...]:
    """The field names of a dataclass type."""
    return tuple(field.name for field in dataclasses.fields(kind))


def _block_bytes(block: Block, memo: dict[int, bytes]) -> bytes:
    """``repr(block)`` encoded, once per block object (spaces of a tree share their blocks)."""
    text = memo.get(id(block))
    if text is None:
        text = memo[id(block)] = repr(block).encode()
    return text


def _feed(value: Any, digest: Any, memo: dict[int, bytes]) -> None:
    # memo: bytes by object id, for the spaces and blocks of the tree (alive while it is fed)
    if isinstance(value, (GridSpace, Partition)):  # described by their rules, not block by block
        digest.update(value.description())
    elif isinstance(value, Space):
        text = memo.get(id(value))
        if text is None:
            text = memo[id(value)] = b"S%d:" % len(value) + b",".join(
                _block_bytes(b, memo) for b in value.blocks
            )
        digest.update(text)
    elif isinstance(value, Region):
        # the block's shape and worker too: a box means a different program on another layout
        digest.update(f"R{value.start}{value.stop}{value.dropped}".encode())
        digest.update(_block_bytes(value.block, memo))
    elif isinstance(value, Block):
        digest.update(b"B" + _block_bytes(value, memo))
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        # a node, layout or geometry: digested once per object (a tree shares its tensors and
        # geometries between nodes), the sub-digest fed wherever it appears
        known = memo.get(id(value))
        if known is None:
            fields = _fields_of(type(value))
            values = [getattr(value, name) for name in fields]
            head = f"<{type(value).__module__}.{type(value).__qualname__}".encode()
            if all(type(v) is int for v in values):  # a row of ints (a geometry row): one buffer
                try:
                    known = head + np.asarray(values, dtype=np.int64).tobytes()
                except OverflowError:
                    known = head + repr(values).encode()
            else:
                sub = hashlib.blake2b(digest_size=16)
                sub.update(head)
                for name, item in zip(fields, values):
                    sub.update(name.encode())
                    _feed(item, sub, memo)
                known = b"D" + sub.digest()
            memo[id(value)] = known
        digest.update(known)
    elif isinstance(value, tuple) and len(value) > 8 and all(type(v) is int for v in value):
        # a long tuple of ints (a partition's workers, a decomposition's sizes): one buffer
        try:
            digest.update(b"I%d:" % len(value) + np.asarray(value, dtype=np.int64).tobytes())
        except OverflowError:  # beyond int64: item by item
            digest.update(repr(value).encode())
    elif type(value) is tuple and len(value) > 8 and value.count(value[0]) == len(value):
        # P equal items (a block grid's uniform shapes): the item once and the count
        digest.update(b"U%d:" % len(value))
        _feed(value[0], digest, memo)
    elif isinstance(value, (tuple, list)):
        digest.update(f"({len(value)}".encode())
        for item in value:
            _feed(item, digest, memo)
        digest.update(b")")
    elif isinstance(value, np.ndarray):
        digest.update(f"A{value.dtype.str}{value.shape}".encode())
        digest.update(np.ascontiguousarray(value).tobytes())
    elif callable(value):
        digest.update(
            f"F{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', type(value).__name__)}".encode()
        )
    else:
        digest.update(f"V{type(value).__name__}:{value!r}".encode())
