"""Lowering: an operator tree becomes a flat program of steps (:mod:`linop.program.steps`).

Local steps are a primitive or movement node whose blocks all live on one worker; *transfers*
are an add, copy or move whose source and destination live on different workers; the algebra
lowers to the per-rank steps scale, zero and sum of branches. Nodes without a lowering are
lowered through their :meth:`~linop.LinearOperator.expand`. The lowerings live in the dispatch
registry (:mod:`linop.dispatch`, interpreter :data:`INTERPRETER`): the generic ones here and
beside (:mod:`linop.program.lowering_local`, :mod:`linop.program.lowering_shims`,
:mod:`linop.program.lowering_halo`), the fast paths registered with :func:`lowering`
(:mod:`linop.program.lowering_all_reduce`, :mod:`linop.program.lowering_rooted`,
:mod:`linop.program.lowering_gather`, :mod:`linop.program.lowering_all_to_all`).

:func:`lower` builds the global program; :func:`lower_for` one rank's part of it (lowerings
that know the rank, :func:`lowering_rank`, build only that part); :func:`lower_portable` the
program without fast-path steps (for a worker-to-rank map, where the fast paths' worker == rank
layout does not hold); :func:`lower_for_workers` the portable program's part of a set of workers
(a mapped rank's: lowerings that know the set, :func:`lowering_workers`, build only its part;
where a node runs its expansion, the part of it registered with :func:`expansion_part`).
"""

from __future__ import annotations

import contextvars
import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Final

from .. import dispatch
from ..movement import Copy, CopyAdjoint, Move
from ..operator import Composition, Identity, LinearOperator, Scaled, Sum, Zero
from ..primitives import Add, Allocate, Clear, Deallocate
from ..space import Block, Region
from .steps import (
    Branches,
    FastPathStep,
    Footprint,
    Local,
    Scale,
    Step,
    Transfer,
    ZeroState,
    box_of,
    whole_block,
)

__all__ = [
    "INTERPRETER",
    "Lowering",
    "lowering",
    "lower",
    "lower_for",
    "lower_portable",
    "lower_for_workers",
    "lowers_per_worker",
    "per_worker",
    "lowering_rank",
    "lowering_workers",
    "lowering_mapping",
    "expansion_part",
    "note_workers",
    "movement_footprint",
    "workers_named",
]

INTERPRETER: Final = "program"
"""The key of the lowerings in the dispatch registry."""

Lowering = Callable[[Any], "list[Step] | None"]
"""A fast-path lowering: the node's global steps, or None to use its expansion."""


def lowering(node_type: type) -> Callable[[Lowering], Lowering]:
    """Register a fast-path lowering for a node type in the dispatch registry
    (:mod:`linop.dispatch`, interpreter :data:`INTERPRETER`).

    The function takes the node and returns its list of global steps, or None to fall back to
    the node's expansion (for cases the fast path does not cover).
    """

    def register(function: Lowering) -> Lowering:
        def lower_node(node: Any, steps: list[Step]) -> Any:
            mapped = _MAPPING.get() is not None  # the fast paths that run under a map wanted
            lowered = None if mapped else _expansion_part(node)
            if lowered is None:
                lowered = function(node)
                if (
                    lowered is not None
                    and _PORTABLE.get()
                    and any(
                        type(step) is FastPathStep and not hasattr(step.runner, "project_mapped")
                        for step in lowered
                    )
                ):
                    lowered = None  # a worker map: the expansion's point-to-point steps
                if lowered is None and mapped:  # the expansion: a mapped rank's part of it
                    lowered = _expansion_part(node)
                if lowered is None:
                    return dispatch.DECLINE
            steps.extend(lowered)
            return None

        lower_node.__doc__ = function.__doc__
        lower_node.__wrapped__ = function  # type: ignore[attr-defined]
        dispatch.register(INTERPRETER, node_type)(lower_node)
        return function

    return register


ExpansionPart = Callable[[Any, "frozenset[int]"], "list[Step] | None"]
"""The part of a node's expansion that a set of workers takes part in (see :func:`expansion_part`)."""

_EXPANSION_PARTS: dict[type, ExpansionPart] = {}


def expansion_part(node_type: type) -> Callable[[ExpansionPart], ExpansionPart]:
    """Register, for ``node_type`` and its subclasses, the steps of a node's expansion that a
    set of workers takes part in: ``part(node, workers)`` gives them in program order (the
    steps :func:`lower` of ``node.expand()`` gives, filtered to those ``workers`` take part in,
    the largest worker of the rest noted with :func:`note_workers`), or None when it cannot tell.

    Inside :func:`lower_for_workers` (a mapped rank's portable lowering) the node would run its
    expansion where its own lowerings decline or give a fast-path step that cannot run under
    a map, lowered whole on every rank (O(the node)); its part is used instead (O(the workers'
    own work)). Without the fast paths that run under a map (no ``mapping`` given to
    :func:`lower_for_workers`: the torch.distributed executor, the MPI portable program) the
    part is used first, before the node's fast-path lowering runs (which may plan the whole node
    before it declines): registering a part declares that the node type's lowerings give, in
    a portable program, only fast-path steps that cannot run under a map or the expansion's
    own steps, so that both routes give the same program. With a ``mapping``, the lowerings
    run first (a mapped fast path wins) and the part replaces the expansion where they decline.
    The part is consulted by the node's lowering registered with :func:`lowering` (a fast
    path's; the node type must also be declared with :func:`per_worker` for a tree holding
    it to take the per-worker route): the broadcast's, sum-reduce's, all-reduce's and other
    piece movers' (:mod:`linop.program.lowering_pieces`).
    """

    def register(part: ExpansionPart) -> ExpansionPart:
        _EXPANSION_PARTS[node_type] = part
        return part

    return register


def _expansion_part(node: Any) -> list[Step] | None:
    """The registered part of ``node``'s expansion of the workers of :func:`lowering_workers`,
    or None (no workers set, no part registered, or the part cannot tell)."""
    workers = _WORKERS.get()
    if workers is None:
        return None
    for cls in type(node).__mro__:
        part = _EXPANSION_PARTS.get(cls)
        if part is not None:
            return part(node, workers)
    return None


def _steps(
    node_type: type,
) -> Callable[[Callable[[Any, list[Step]], None]], Callable[[Any, list[Step]], None]]:
    """Register the lowering of an algebra node, primitive or movement node, which appends
    its steps to the program (it never declines)."""
    return dispatch.register(INTERPRETER, node_type)


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
    dst_box = whole_block(dst.name) if isinstance(dst, Block) else box_of(dst)
    if isinstance(node, CopyAdjoint):  # x_src += x_dst (an add: commutes with adds), x_dst cleared
        return Footprint(reads=(dst_box,), writes=(dst_box,), adds=(box_of(src),))
    if isinstance(node, Move):
        return Footprint(
            reads=(box_of(src),),
            writes=(dst_box, box_of(src) if isinstance(dst, Region) else whole_block(src.name)),
        )
    return Footprint(reads=(box_of(src),), writes=(dst_box,))


_PORTABLE: contextvars.ContextVar[bool] = contextvars.ContextVar("linop_portable", default=False)


_MAPPING: contextvars.ContextVar[Any] = contextvars.ContextVar("linop_mapping", default=None)


def lower_portable(op: LinearOperator, mapping: Any = None) -> list[Step]:
    """The global program of ``op`` for a worker-to-rank map
    (:class:`~linop.program.workers.WorkerMap`), where the fast paths' worker == rank layout
    does not hold: every lowering that would emit a
    :class:`~linop.program.steps.FastPathStep` declines, so its node runs its expansion (local
    steps and transfers between workers only), unless the step's runner projects under a map
    (``project_mapped(rank, mapping)``: a lowering that reads :func:`lowering_mapping`)."""
    token, mapping_token = _PORTABLE.set(True), _MAPPING.set(mapping)
    try:
        return lower(op)
    finally:
        _PORTABLE.reset(token)
        _MAPPING.reset(mapping_token)


def lowering_mapping() -> Any:
    """The worker map a portable lowering is for (:func:`lower_portable`), or None."""
    return _MAPPING.get()


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
    global program, which is what :func:`~linop.program.projection.project` needs to match tags.
    """
    omitted: list[int] = []
    rank_token, omitted_token = _RANK.set(rank), _OMITTED.set(omitted)
    try:
        steps = lower(op)
    finally:
        _RANK.reset(rank_token)
        _OMITTED.reset(omitted_token)
    largest = max(itertools.chain(omitted, _named(steps)), default=0)
    return _involving(steps, rank), largest


_WORKERS: contextvars.ContextVar[frozenset[int] | None] = contextvars.ContextVar(
    "linop_workers", default=None
)


def lowering_workers() -> frozenset[int] | None:
    """The workers a mapped rank's lowering is for (inside :func:`lower_for_workers`: the
    workers the map puts on the rank), or None.

    A lowering that can tell which of its steps these workers take part in may emit only those,
    in the order of the global program, when this is not None; it then reports the largest
    worker of what it left out with :func:`note_workers`. Inside :func:`lower_for_workers`
    :func:`lowering_rank` is None: a lowering that knows one rank only builds its global steps,
    which are filtered afterwards (correct, in O(its global steps))."""
    return _WORKERS.get()


_PER_WORKER: dict[type, Callable[[Any], Iterable[LinearOperator]] | None] = {}


def per_worker(node_type: type, parts: Callable[[Any], Iterable[LinearOperator]] | None = None) -> type:
    """Declare that the lowering of ``node_type`` builds only the part of the workers of
    :func:`lowering_workers` when that is set, in global program order (returns the type).
    ``parts``: for a node whose lowering lowers other trees (:func:`lower`), those trees, which
    must lower per worker too (:func:`lowers_per_worker`)."""
    _PER_WORKER[node_type] = parts
    return node_type


def lowers_per_worker(op: LinearOperator) -> bool:
    """True when every node of ``op`` below the algebra (composition, sum, scaling, identity,
    zero) lowers per worker (:func:`per_worker`): then a mapped rank's part
    (:func:`lower_for_workers`) holds the steps of the global portable program its workers
    take part in, in program order, and, batched and projected, gives the messages, tags and
    local steps of the global program's projection (the movement nodes and primitives, one
    step each, count as lowering per worker). Other nodes would be lowered whole there
    (O(the tree) on every rank), so such trees take the global route. A function of the tree
    alone: the same on every rank (the executors' lowerings, which declare some, loaded first)."""
    dispatch.load(INTERPRETER)
    return _per_worker(op)


def _per_worker(op: LinearOperator) -> bool:
    if isinstance(op, Composition):
        return all(_per_worker(f) for f in op.factors)
    if isinstance(op, Sum):
        return all(_per_worker(t) for t in op.terms)
    if isinstance(op, Scaled):
        return _per_worker(op.operator)
    if type(op) in (Identity, Zero, *_PRIMITIVES):
        return True
    if type(op) not in _PER_WORKER:
        return False
    parts = _PER_WORKER[type(op)]
    return parts is None or all(_per_worker(part) for part in parts(op))


_PRIMITIVES = (Copy, CopyAdjoint, Move, Add, Clear, Allocate, Deallocate)
"""Nodes of one step each (below): lowered whole and filtered, in O(1)."""


def lower_for_workers(
    op: LinearOperator, workers: Iterable[int], mapping: Any = None
) -> tuple[list[Step], int]:
    """The steps of the portable program of ``op`` (:func:`lower_portable`, ``mapping`` as
    there) that some worker of ``workers`` takes part in, in program order, and the largest
    worker the whole program names: a mapped rank's part, ``workers`` being the workers the map
    puts on it.

    Lowerings that know the set (:func:`lowering_workers`: the halo exchange and its shims)
    build only its part, in O(the workers' own work); the steps other lowerings build for other
    workers are dropped here. The transfers between a rank's workers and another rank's keep
    their global program order, which :func:`~linop.program.projection.project` needs to count
    the tags of a pair of ranks under the map.
    """
    omitted: list[int] = []
    tokens = (
        _PORTABLE.set(True),
        _MAPPING.set(mapping),
        _RANK.set(None),
        _WORKERS.set(frozenset(workers)),
        _OMITTED.set(omitted),
    )
    try:
        steps = lower(op)
    finally:
        _OMITTED.reset(tokens[4])
        _WORKERS.reset(tokens[3])
        _RANK.reset(tokens[2])
        _MAPPING.reset(tokens[1])
        _PORTABLE.reset(tokens[0])
    largest = max(itertools.chain(omitted, _named(steps)), default=0)
    return _involving_workers(steps, frozenset(workers)), largest


def _involving_workers(steps: Iterable[Step], workers: frozenset[int]) -> list[Step]:
    """The steps some worker of ``workers`` takes part in (sums: every term's, kept whole)."""
    out: list[Step] = []
    for step in steps:
        if isinstance(step, Local):
            if step.worker in workers:
                out.append(step)
        elif isinstance(step, Transfer):
            if step.src_worker in workers or step.dst_worker in workers:
                out.append(step)
        elif isinstance(step, Branches):
            terms = tuple(tuple(_involving_workers(term, workers)) for term in step.terms)
            out.append(Branches(terms, step.space))
        else:
            out.append(step)
    return out


def workers_named(steps: Iterable[Step]) -> list[int]:
    """Every worker that a step of the program names (a space: its largest worker)."""
    return list(_named(steps))


def _named(steps: Iterable[Step]) -> Iterator[int]:
    """The workers of :func:`workers_named`, one by one (their largest found without a list)."""
    for step in steps:
        if isinstance(step, Transfer):
            yield step.src_worker
            yield step.dst_worker
        elif isinstance(step, Local):
            yield step.worker
        elif isinstance(step, ZeroState):
            yield step.space.max_worker
        elif isinstance(step, Branches):
            yield step.space.max_worker
            for term in step.terms:
                yield from _named(term)
        elif isinstance(step, FastPathStep):
            yield from step.runner.workers


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
    dispatch.dispatch(INTERPRETER, op, steps)


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
        steps.append(Local(op, op.src.worker, Footprint(reads=(box_of(op.src),), adds=(box_of(op.dst),))))
    else:
        steps.append(Transfer(op.src, op.dst, "add", "keep"))


@_steps(Clear)
def _lower_clear(op: Clear, steps: list[Step]) -> None:
    steps.append(Local(op, op.region.worker, Footprint(writes=(box_of(op.region),))))


@_steps(Allocate)
def _lower_allocate(op: Allocate, steps: list[Step]) -> None:
    steps.append(Local(op, op.block.worker, Footprint(writes=(whole_block(op.block.name),))))


@_steps(Deallocate)
def _lower_deallocate(op: Deallocate, steps: list[Step]) -> None:
    steps.append(Local(op, op.space.block(op.name).worker, Footprint(writes=(whole_block(op.name),))))
