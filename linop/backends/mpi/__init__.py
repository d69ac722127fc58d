"""The MPI interpreter: apply an operator tree across the ranks of a communicator.

Every rank builds the same tree and holds only its own blocks: worker ``w`` of the tree runs on
rank ``w`` of the communicator (ranks beyond the tree's workers take part in the checks and
hold nothing). The result on each rank is that rank's blocks of the range, equal to the numpy
interpreter's blocks for that worker.

How a call runs
---------------
1. :func:`plan_for` (cached per tree and communicator, at most
   :data:`~linop.program.cache.PLAN_CACHE_SIZE` plans each) lowers the tree into a global
   program and projects it onto this rank (:mod:`linop.program`). Point-to-point
   moves are batched into phases of nonblocking receives (posted first) and sends and one wait,
   so no schedule can deadlock.
2. One small ``Allreduce`` (a persistent request of the communicator) checks, before any data
   moves, that every rank holds the same tree, that the communicator covers the tree's workers
   and that every rank's local blocks are right (:mod:`linop.backends.mpi.check`); it also
   agrees on the dtype of the run. When anything is wrong, every rank raises the same typed
   error (:class:`linop.errors.MPIError` and its subclasses).
3. The rank executes its schedule (:mod:`linop.backends.mpi.runtime`): local steps and the
   algebra (sums, scalings, the in-place write-back) with the numpy interpreter's semantics on a
   copy-on-write workspace, so caller arrays are never mutated (unless ``inplace=True``); data
   moves straight from and into the blocks (:mod:`linop.backends.mpi.datatypes`); the
   collectives' fast-path parts, planned by the program (:mod:`linop.program.parts`), run as
   the MPI calls of :mod:`linop.backends.mpi.native` (its table, one row per part). In place, a
   schedule of point-to-point phases (a halo exchange) runs as compiled once per layout of the
   caller's arrays (:mod:`linop.backends.mpi.inplace_phases`).
4. If a rank nevertheless fails during execution (a bug, a user kernel raising, Ctrl-C), it
   prints its error and calls ``MPI_Abort``: its peers may be waiting for its messages, and
   ending the job is the only way not to hang it (:mod:`linop.backends.mpi.guards`, whose
   :func:`guard` does the same for the user's own code).

A loop that passes the same arrays again (in place: a halo exchange in a time loop) runs each
call in one step after the first two: the arrays compared with the kept ones, the check's
collective, the kept in-place binding (:mod:`linop.backends.mpi.repeated`); the two trees of the
last calls (an operator and its adjoint in turn) find their plans without the cache's lookup.
:meth:`DistributedPlan.bind` goes one step further for repeated application (a halo exchange in
a time loop): it checks once, then builds persistent requests on the caller's arrays
(:mod:`linop.backends.mpi.bound`).

Communicators: linop works on a private duplicate of the user's communicator, freed when the
user frees theirs (:mod:`linop.backends.mpi.context`). Worker-to-rank mapping: identity by
default; ``mapping=`` (:class:`~linop.program.WorkerMap`) places any worker on any
rank, several workers per rank included (transfers between workers of one rank become local
copies; all-reduces, broadcasts and sum-reduces combine a rank's copies around one collective of
the ranks involved, other fast paths give way to the point-to-point expansion; see
:mod:`linop.backends.mpi.mapping`).

mpi4py is imported only when a function of this module runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NoReturn

import numpy as np
import numpy.typing as npt

from ...errors import LinopError
from ...operator import LinearOperator
from ...program import WorkerMap, lowering
from ...program.cache import PLAN_CACHE_SIZE, MappingLike, cached_plan
from ...space import State
from .. import array_api
from .bound import BoundPlan
from .check import DTYPE_CHARS
from .context import CommunicatorArgumentError, context_for
from .datatypes import PACK_BELOW, mpi
from .deadline import resolve_timeout
from .guards import Guard, abort_for, guard, install_excepthook
from .plan import DistributedPlan

__all__ = [
    "apply",
    "plan_for",
    "DistributedPlan",
    "BoundPlan",
    "guard",
    "Guard",
    "install_excepthook",
    "lowering",
    "WorkerMap",
    "CommunicatorArgumentError",
    "DTYPE_CHARS",
    "PACK_BELOW",
    "PLAN_CACHE_SIZE",
]


def plan_for(
    op: LinearOperator, *, comm: Any = None, mapping: MappingLike | None = None, timeout: Any = None
) -> DistributedPlan:
    """The plan of ``op`` on ``comm`` (default ``MPI.COMM_WORLD``), compiled once and cached.

    Compiling is local (no communication), except that the first use of a communicator
    duplicates it (``MPI_Comm_dup``, collective), so that linop's messages never meet the
    caller's; the first application checks collectively that every rank compiled the same
    tree. The cache (least recently used first out, :data:`PLAN_CACHE_SIZE` per communicator)
    holds the tree object (by identity) and structurally equal trees whose scalars have the
    same types (``==`` alone would take ``2 * A`` for ``2.0 * A``, whose results have another
    dtype).

    ``mapping`` (a :class:`~linop.program.WorkerMap`, a sequence ``ranks[w]`` or a
    dict of worker to rank; default worker ``w`` on rank ``w``) places the tree's workers on
    the ranks, several per rank if need be (:mod:`linop.backends.mpi.mapping`). A map that is
    malformed, leaves a worker of the tree out, names a rank the communicator lacks or differs
    between ranks fails the first application's check on every rank
    (:class:`~linop.errors.WorkerMapError`, :class:`~linop.errors.WorkerMapMismatchError`).

    ``timeout`` (seconds) sets the plan's default deadline (:attr:`DistributedPlan.timeout`):
    how long its checks and its bound plans' first calls wait for every rank to arrive before
    the ranks that did raise :class:`~linop.errors.PeerTimeoutError` naming the others and
    the job is aborted (:mod:`linop.backends.mpi.deadline`; default ``LINOP_TIMEOUT``, else
    no deadline). The first plan on a communicator duplicates it within the same deadline.

    Raises
    ------
    CommunicatorArgumentError
        ``comm`` is not an mpi4py communicator.
    CommunicatorError
        ``comm`` is ``MPI.COMM_NULL`` or an intercommunicator.
    TimeoutArgumentError
        ``timeout`` is not a positive number of seconds.
    """
    if timeout is not None:
        resolve_timeout(timeout)  # a bad value raises here, before any communication
    try:
        context = context_for(comm, timeout)
        plan = cached_plan(
            context.plans, context.mapped_plans, op, mapping, lambda m: DistributedPlan(op, context, m)
        )
        if timeout is not None:
            plan.timeout = timeout
        return plan
    except LinopError:  # typed errors are raised on every rank alike: the job goes on
        raise
    except BaseException as error:  # anything else here may leave the other ranks waiting
        _abort(comm, f"compiling {op}", error)


_LAST_PLAN: tuple[LinearOperator, Any, DistributedPlan] | None = None
_PREVIOUS_PLAN: tuple[LinearOperator, Any, DistributedPlan] | None = None
"""The trees (with their communicator object and plan) of the last two calls of :func:`apply`:
a loop applying one tree, or two in turn (an operator and its adjoint), finds its plan without
the cache's lookup."""


def apply(
    op: LinearOperator,
    local_state: Mapping[str, Any],
    *,
    comm: Any = None,
    inplace: bool = False,
    dtype: npt.DTypeLike | None = None,
    mapping: MappingLike | None = None,
    timeout: Any = None,
) -> State:
    """Apply ``op`` across the ranks of ``comm``; collective.

    Parameters
    ----------
    op : LinearOperator
        The same tree on every rank.
    local_state : dict of str to array
        The blocks of ``op.domain`` that this rank owns (those of its workers), and no others.
    comm : mpi4py communicator, optional
        Default ``MPI.COMM_WORLD``; it must have more ranks than the tree's largest worker
        (under ``mapping``: than the largest rank the map uses).
    inplace : bool, optional
        Write the result into the caller's arrays (domain must equal range; one array per
        block).
    dtype : dtype, optional
        Dtype of newly allocated blocks; default the run's dtype: the common dtype of all
        ranks' blocks and the tree's scalars (data moves between ranks in the run's dtype).
    mapping : WorkerMap, sequence of int or dict of int to int, optional
        The rank of each worker (default: worker ``w`` on rank ``w``); see :func:`plan_for`.
    timeout : float, optional
        Seconds to wait at the entry check for every rank to arrive (default: the plan's
        :attr:`~DistributedPlan.timeout`, else the environment variable ``LINOP_TIMEOUT``,
        else no deadline). When it passes, every rank that arrived raises
        :class:`~linop.errors.PeerTimeoutError` naming the ranks that did not, prints it and
        aborts the job (a missing rank may never return).

    Returns
    -------
    dict of str to array
        This rank's blocks of ``op.range``.

    Raises
    ------
    TreeMismatchError, CommunicatorError, DistributedStateError, UnsupportedNodeError
        On every rank together, before any data moves.
    WorkerMapError, WorkerMapMismatchError
        A bad ``mapping`` (see :func:`plan_for`), on every rank together.
    CommunicatorArgumentError
        ``comm`` is not an mpi4py communicator (raised before any communication).
    """
    global _LAST_PLAN, _PREVIOUS_PLAN
    try:
        kept = None  # the plan of one of the last two calls' trees: found without the cache's lookup
        if mapping is None:
            last = _LAST_PLAN
            if last is not None and last[0] is op and last[1] is comm:
                kept = last[2]
            else:
                previous = _PREVIOUS_PLAN
                if previous is not None and previous[0] is op and previous[1] is comm:
                    _LAST_PLAN, _PREVIOUS_PLAN = previous, last
                    kept = previous[2]
        if kept is not None and dtype is None and timeout is None:
            fast = kept.fast  # the same arrays again, in one step (when it answers)
            if fast is not None:
                done = fast(local_state, inplace)
                if done is not None:
                    return done
        if kept is not None and not kept.context.freed:
            if dtype is None:  # the same arrays again (numpy arrays then): the collective, the run
                done = kept.repeated(local_state, inplace, timeout)
                if done is not None:
                    return done
            if _plain(local_state):
                return kept.apply_checked(local_state, inplace=inplace, dtype=dtype, timeout=timeout)
        else:
            if kept is not None:  # its communicator is freed: let the plan go (raised below)
                _LAST_PLAN = None  # kept is its plan (a previous one was swapped in above)
                kept.drop_fast()
            if timeout is not None:  # the communicator's first plan duplicates it within this deadline
                context_for(comm, timeout)
            if mapping is not None:
                plan = plan_for(op, comm=comm, mapping=mapping)
                if _plain(local_state):
                    return plan.apply(local_state, inplace=inplace, dtype=dtype, timeout=timeout)
                entry = array_api.mpi_entry(local_state)
                result = plan.apply(entry.arrays, inplace=inplace, dtype=dtype, timeout=timeout)
                return entry.result(result, inplace=inplace)
            if _plain(local_state):
                kept = plan_for(op, comm=comm)
                _LAST_PLAN, _PREVIOUS_PLAN = (op, comm, kept), _LAST_PLAN
                return kept.apply(local_state, inplace=inplace, dtype=dtype, timeout=timeout)
        entry = array_api.mpi_entry(local_state)  # torch, CuPy, ... arrays: numpy views, same library out
        result = plan_for(op, comm=comm).apply(entry.arrays, inplace=inplace, dtype=dtype, timeout=timeout)
        return entry.result(result, inplace=inplace)
    except LinopError:  # typed errors are raised on every rank alike: the job goes on
        raise
    except BaseException as error:  # anything else here may leave the other ranks waiting
        _abort(comm, f"applying {op}", error)


def _plain(state: Any) -> bool:
    """A dict of numpy arrays (no conversion from another array library needed)."""
    if type(state) is not dict:
        return False
    for array in state.values():
        if type(array) is not np.ndarray:
            return False
    return True


def _abort(comm: Any, doing: str, error: BaseException) -> NoReturn:
    module = mpi()
    live = isinstance(comm, module.Comm) and comm != module.COMM_NULL
    abort_for(comm if live else module.COMM_WORLD, doing, error)
