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

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar, cast

import numpy as np

from ..operator import LinearOperator
from ..program import LocalMoves, RankBranches, RankOverlap, RankPhase, RankZero, Scale, Transfer
from ..space import Block, Region
from . import numpy as numpy_backend
from .host_fusion import FusedStep, HostOverlap, run_node

__all__ = [
    "run_rank_schedule",
    "run_on_engine",
    "Started",
    "run_local_moves",
    "finish_phase",
    "store_results",
    "shares_by_member",
    "uneven_shares_by_member",
    "read_only",
    "cast_copies",
    "outputs",
]


E = TypeVar("E")
"""An executor's engine handle (an MPI communicator, a torch.distributed group context)."""


class BlockWorkspace(Protocol):
    """The copy-on-write workspace a schedule's steps write through: blocks by name, a block
    copied before its first change unless the workspace owns it. The numpy interpreter's
    :class:`~linop.backends.numpy.Workspace` (numpy arrays: the MPI executor and the
    torch.distributed host path) and the torch.distributed device path's
    :class:`~linop.backends.torch_distributed.device.DeviceWorkspace` (tensors) implement it;
    :func:`run_local_moves` and :func:`finish_phase` run on either."""

    @property
    def arrays(self) -> Mapping[str, Any]:
        """The blocks by name (read them; change them through the methods below)."""

    def writable(self, name: str, dtype: Any = None, /) -> Any:
        """Block ``name``, owned (copied first when it is not, or when ``dtype`` widens it)."""

    def set(self, name: str, array: Any, /, *, owned: bool = True) -> None:
        """Make ``array`` block ``name`` (``owned``: the workspace may change it in place)."""

    def drop(self, name: str, /) -> Any:
        """Remove block ``name``; return it."""


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


class Started:
    """A started phase (:class:`StartedPhase`) of an executor's requests: calling it waits
    for them (``wait``), then finishes the phase (``finish``: :func:`finish_phase`);
    :meth:`progress` lets them move (``test``, for an engine that moves data only inside its
    calls; None where the engine's own threads move it)."""

    __slots__ = ("_test", "_wait", "finish", "requests")

    def __init__(
        self,
        requests: list[Any],
        finish: Callable[[], None],
        wait: Callable[[list[Any]], object],
        test: Callable[[list[Any]], object] | None = None,
    ) -> None:
        self.requests = requests
        self.finish = finish
        self._wait = wait
        self._test = test

    def progress(self) -> None:
        if self.requests and self._test is not None:
            self._test(self.requests)

    def __call__(self) -> None:
        if self.requests:
            self._wait(self.requests)
        self.finish()


def run_on_engine(
    schedule: Sequence[Any],
    work: numpy_backend.Workspace,
    dtype: np.dtype,
    engine: E,
    *,
    start: Callable[[RankPhase, numpy_backend.Workspace, E, np.dtype], StartedPhase],
    part: Callable[[Any, numpy_backend.Workspace, E, np.dtype], None],
) -> None:
    """:func:`run_rank_schedule` for an executor whose calls take its engine (a communicator, a
    process-group context) and the dtype: ``start`` starts a phase (run whole: started, then
    completed), ``part`` runs any other step that is the executor's."""
    run_rank_schedule(
        schedule,
        work,
        dtype,
        phase=lambda step, work: start(step, work, engine, dtype)(),
        part=lambda step, work: part(step, work, engine, dtype),
        start=lambda step, work: start(step, work, engine, dtype),
    )


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
            run_local_moves(step, work, dtype)
        else:
            part(step, work)


def _numpy_copy(data: Any, dtype: Any) -> Any:
    return np.array(data, dtype=dtype)


def run_local_moves(
    step: LocalMoves, work: BlockWorkspace, dtype: Any, new: Callable[[Any, Any], Any] = _numpy_copy
) -> None:
    """Run ``step`` (a worker map's transfers between two workers of this rank) on ``work``:
    each a copy, add or store between the two blocks (a new block is ``new(data, dtype)``, a
    copy in the run's dtype: numpy's by default), then the source cleared or dropped."""
    for t in step.transfers:
        source_index = (*t.source.index, Ellipsis)
        data = work.arrays[t.source.name][source_index]
        if t.mode == "new":
            work.set(t.target.name, new(data, dtype))
        else:
            target_index = (*t.target.index, Ellipsis)  # type: ignore[union-attr]
            target = work.writable(t.target.name, dtype)
            if t.mode == "add":
                target[target_index] += data
            else:
                target[target_index] = data
        if t.after == "clear":
            if t.source.size:
                work.writable(t.source.name)[source_index] = 0
        elif t.after == "drop":
            work.drop(t.source.name)


def finish_phase(
    phase: RankPhase, work: BlockWorkspace, finish: Sequence[tuple[Transfer, Any]], dtype: Any
) -> None:
    """After a phase's messages have arrived (whatever engine moved them, into numpy arrays or
    tensors): add or store the buffered receives (``(transfer, buffer)``), then clear or drop
    the sources."""
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
            work.set(name, read_only(array), owned=False)
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


def uneven_shares_by_member(
    array: np.ndarray, axis: int, shares: Sequence[int]
) -> tuple[np.ndarray, list[int]]:
    """``array`` (a gathered block) flat, member by member, and the number of entries of each
    member: axis ``axis`` cut into consecutive shares of ``shares[k]`` entries (some may be
    empty) and member ``k``'s box, in C order, after member ``k - 1``'s (a view of ``array``
    when the shares lead and it is C-ordered, else one copy). What the native reduce-scatters
    of uneven shares send."""
    rest = array.size // array.shape[axis] if array.shape[axis] else 0  # entries per unit of share
    counts = [share * rest for share in shares]
    if int(np.prod(array.shape[:axis])) == 1 and array.flags.c_contiguous:
        return array.reshape(-1), counts
    out = np.empty(array.size, dtype=array.dtype)
    at, start = 0, 0
    for share in shares:
        box = array[(slice(None),) * axis + (slice(start, start + share),)]
        out[at : at + box.size].reshape(box.shape)[...] = box
        at, start = at + box.size, start + share
    return out, counts


def read_only(array: np.ndarray) -> np.ndarray:
    """A read-only view: how a caller's array passed through comes back."""
    view = array.view()
    view.flags.writeable = False
    return view


def cast_copies(arrays: Mapping[str, np.ndarray], cast: np.dtype | None) -> dict[str, np.ndarray]:
    """The arrays to run on: the caller's (a new dict, the arrays themselves), or copies widened
    to ``cast`` (an integer run the entry check widened, :func:`linop.dtypes.cast_dtype`)."""
    if cast is None:
        return dict(arrays)
    return {name: a.astype(np.result_type(a.dtype, cast)) for name, a in arrays.items()}


def outputs(work: numpy_backend.Workspace, names: Sequence[str]) -> dict[str, np.ndarray]:
    """The blocks ``names`` at the end of an out-of-place run: those the workspace owns as they
    are, the caller's arrays passed through as read-only views (never written by the caller's
    next run)."""
    return {name: work.arrays[name] if name in work.owned else read_only(work.arrays[name]) for name in names}
