"""Lowering: an operator tree becomes a flat program of steps (:mod:`linop.program.steps`).

Local steps are a primitive or movement node whose blocks all live on one worker; *transfers*
are an add, copy or move whose source and destination live on different workers; the algebra
lowers to the per-rank steps scale, zero and sum of branches. Nodes without a lowering are
lowered through their :meth:`~linop.LinearOperator.expand`. The lowerings live in the dispatch
registry (:mod:`linop.dispatch`, interpreter :data:`INTERPRETER`): the generic ones here and
beside (:mod:`linop.program.lowering_local`, :mod:`linop.program.lowering_shims`), the
fast paths of an executor registered with :func:`lowering`.

:func:`lower` builds the global program; :func:`lower_for` one rank's part of it (lowerings
that know the rank, :func:`lowering_rank`, build only that part); :func:`lower_portable` the
program without fast-path steps (for a worker-to-rank map, where the fast paths' worker == rank
layout does not hold).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterable
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
    "lowering_rank",
    "lowering_mapping",
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
            lowered = function(node)
            if lowered is None:
                return dispatch.DECLINE
            if _PORTABLE.get() and any(
                type(step) is FastPathStep and not hasattr(step.runner, "project_mapped") for step in lowered
            ):
                return dispatch.DECLINE  # a worker map: the expansion's point-to-point steps
            steps.extend(lowered)
            return None

        lower_node.__doc__ = function.__doc__
        lower_node.__wrapped__ = function  # type: ignore[attr-defined]
        dispatch.register(INTERPRETER, node_type)(lower_node)
        return function

    return register


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
    largest = max((*omitted, *workers_named(steps)), default=0)
    return _involving(steps, rank), largest


def workers_named(steps: Iterable[Step]) -> list[int]:
    """Every worker that a step of the program names (a space: its largest worker)."""
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
                found.extend(workers_named(term))
        elif isinstance(step, FastPathStep):
            found.extend(step.runner.workers)
    return found


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
