"""One rank's schedule run on host memory, for every executor that keeps its blocks in numpy
arrays (the MPI interpreter, the torch.distributed executor's host path).

The steps of a rank's schedule (:mod:`linop.program`) mean the same on every engine except two:
a communication phase (:class:`~linop.program.RankPhase`) and an executor's own fast-path parts.
:func:`run_rank_schedule` runs everything else with the numpy interpreter's semantics (the same
functions): local nodes with its handlers, :class:`~linop.program.Scale`
(:func:`~linop.backends.numpy.scale_blocks`), :class:`~linop.program.RankZero`,
:class:`~linop.program.RankBranches` (:func:`~linop.backends.numpy.sum_branches`) and,
under a worker-to-rank map, :class:`~linop.program.LocalMoves` (transfers between two workers of
one rank, as local copies); the executor passes how it runs a phase and its other parts, and
how it starts one so that the local work of a :class:`~linop.program.RankOverlap` runs while
the phase's messages are in flight.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import numpy as np

from ..operator import LinearOperator
from ..program import LocalMoves, RankBranches, RankOverlap, RankPhase, RankZero, Scale, Transfer
from ..space import Block, Region
from . import numpy as numpy_backend
from .host_fusion import FusedStep, HostOverlap, run_node

__all__ = ["run_rank_schedule", "finish_phase", "store_results", "shares_by_member"]

StepRunner = Callable[[Any, numpy_backend.Workspace], None]
"""Runs one step of a rank's schedule on a workspace (collective with the step's peers)."""


class StartedPhase(Protocol):
    """A phase whose nonblocking receives and sends are posted, while local work runs
    (:class:`~linop.program.RankOverlap`)."""

    def progress(self) -> None:
        """Let the messages move; called after each node of the work in flight (an engine
        that moves data only inside its calls, as MPICH, tests its requests here)."""

    def __call__(self) -> None:
        """Wait for the messages, then finish the phase (:func:`finish_phase`)."""


PhaseStarter = Callable[[RankPhase, numpy_backend.Workspace], StartedPhase]
"""Starts a phase's nonblocking receives and sends and returns it started."""


def run_rank_schedule(
    schedule: Sequence[Any],
    work: numpy_backend.Workspace,
    dtype: np.dtype,
    *,
    phase: StepRunner,
    part: StepRunner,
    start: PhaseStarter | None = None,
) -> None:
    """Run a rank's schedule on ``work``: ``phase`` runs each
    :class:`~linop.program.RankPhase`, ``part`` each step that is neither a phase nor one of the
    engine-independent steps above (an executor's fast-path part; it raises ``TypeError`` for a
    step it does not know). A :class:`~linop.program.RankOverlap` runs its nodes between
    ``start`` (which starts the phase) and the completion it returns; without ``start``, after
    the phase (the same result: the nodes touch nothing the phase moves). Collective with the
    other ranks' schedules."""
    for step in schedule:
        kind = type(step)
        if kind is RankPhase:
            phase(step, work)
        elif kind is RankOverlap or kind is HostOverlap:
            if step.phase is None:
                complete = None
            elif start is None:
                phase(step.phase, work)
                complete = None
            else:
                complete = start(step.phase, work)
            for node in step.during:
                run_node(node, work)
                if complete is not None:
                    complete.progress()
            if complete is not None:
                complete()
        elif isinstance(step, LinearOperator):
            numpy_backend.run(step, work)
        elif isinstance(step, FusedStep):
            step.run(work)
        elif kind is Scale:
            numpy_backend.scale_blocks(step.alpha, work)
        elif kind is RankZero:
            work.arrays.clear()
            work.owned.clear()
            for block in step.blocks:
                work.set(block.name, np.zeros(block.shape, dtype=work.dtype))
        elif kind is RankBranches:
            results = []
            for term in step.terms:
                branch = work.borrowed()
                run_rank_schedule(term, branch, dtype, phase=phase, part=part, start=start)
                results.append(branch.arrays)
            numpy_backend.sum_branches(results, step.names, work)
        elif kind is LocalMoves:
            from .mpi.mapping import run_local_moves  # the mpi package imports this module

            run_local_moves(step, work, dtype)
        else:
            part(step, work)


def finish_phase(
    phase: RankPhase,
    work: numpy_backend.Workspace,
    finish: list[tuple[Transfer, np.ndarray]],
    dtype: np.dtype,
) -> None:
    """After a phase's messages have arrived (whatever engine moved them): add or store the
    buffered receives (``(transfer, buffer)``), then clear or drop the sources."""
    for t, buffer in finish:
        if t.mode == "new":
            work.set(t.target.name, buffer)
        elif t.mode == "add":
            work.writable(t.target.name, dtype)[phase.index(cast(Region, t.target))] += buffer
        else:
            work.writable(t.target.name, dtype)[phase.index(cast(Region, t.target))] = buffer
    for _, _, t in phase.sends:
        if t.after == "clear":
            if not phase.empty(t):
                work.writable(t.source.name)[phase.index(t.source)] = 0
        elif t.after == "drop":
            work.drop(t.source.name)


def root_buffer(work: numpy_backend.Workspace, name: str, dtype: np.dtype) -> tuple[np.ndarray, bool]:
    """A native broadcast's send buffer on its root, and whether the workspace owns it: the
    root's block itself when it is C-contiguous, writeable and of the run's dtype (it is then
    also the root's copy, uncopied), else a C-ordered copy of it."""
    source = work.arrays[name]
    if source.dtype == dtype and source.flags.c_contiguous and source.flags.writeable:
        return source, name in work.owned
    return np.array(source, dtype=dtype, order="C"), True


def store_results(
    work: numpy_backend.Workspace,
    dropped: Sequence[str],
    results: Sequence[tuple[str, np.ndarray, bool]],
    created: Sequence[Block],
) -> None:
    """After a native broadcast or sum-reduce: drop the consumed blocks, store the results
    (``(name, array, owned)``; an array not owned is the caller's source, passed through
    read-only as the root's copy) and zero the targets no group filled (empty blocks)."""
    for name in dropped:
        work.drop(name)
    for name, array, owned in results:
        if owned:
            work.set(name, array)
        else:
            view = array.view()
            view.flags.writeable = False
            work.set(name, view, owned=False)
    for block in created:
        if block.name not in work.arrays:
            work.set(block.name, np.zeros(block.shape, dtype=work.dtype))


def shares_by_member(array: np.ndarray, axis: int, count: int, out: np.ndarray | None = None) -> np.ndarray:
    """``array`` (a gathered block) as ``[member, share]``: axis ``axis`` cut into ``count``
    equal shares and the member's index moved first (a C-ordered copy unless the shares lead).
    With ``out`` (that arrangement), the reverse: ``out`` written back into ``array``, which is
    returned. What the native all-gathers and reduce-scatters along one axis send and receive."""
    shape = array.shape
    split = (*shape[:axis], count, shape[axis] // count, *shape[axis + 1 :])
    lined = np.moveaxis(array.reshape(split), axis, 0)
    if out is not None:
        lined[...] = out
        return array
    return np.ascontiguousarray(lined)
