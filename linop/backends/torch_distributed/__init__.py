"""The torch.distributed executor: apply an operator tree across the ranks of a process group.

The same trees as the MPI interpreter (:mod:`linop.backends.mpi`), under ``torchrun``
or ``torch.multiprocessing.spawn``: every rank builds the same tree and passes only its own
blocks (worker ``w`` on rank ``w`` of the group, or any map with ``mapping=``) as torch tensors
(numpy arrays work too) and gets its blocks of the range back, equal to the numpy
interpreter's blocks for its workers.

How a call runs
---------------
1. :func:`plan_for` (cached per tree and group) compiles this rank's program from the
   distributed program of :mod:`linop.program`
   (:mod:`~linop.backends.torch_distributed.schedule`; the rank plans only its own part):
   native collectives where the layout allows (all-reduce, broadcast, sum-reduce, and the
   all-gathers and reduce-scatters along one axis, of equal shares or, for the reduce-scatter,
   uneven ones, on cached sub-groups of the world group; one ``all_to_all_single`` of packed
   buffers for a repartition, scatter, gather or all-gather, on any group), else the portable
   point-to-point program, exact for every tree. The ranks agree on the choice at the plan's first run.
2. One small ``all_reduce`` checks, before any data moves, that every rank holds the same tree
   (a fingerprint), that the group has enough ranks and that each rank's blocks are right; any
   mistake raises the same typed error on every rank
   (:mod:`~linop.backends.torch_distributed.check`). ``timeout=`` (or ``$LINOP_TIMEOUT``)
   bounds it: a rank that never arrives makes the others raise
   :class:`~linop.errors.PeerTimeoutError`.
3. The rank runs its schedule (:mod:`~linop.backends.torch_distributed.runtime`): phases of
   ``batch_isend_irecv``, ``all_reduce``/``broadcast``/``reduce`` and
   ``all_gather_into_tensor``/``reduce_scatter_tensor`` on cached sub-groups,
   ``all_to_all_single``, local steps with the numpy interpreter's handlers on numpy views of
   the CPU tensors (no copy). A rank failing during the run raises
   :class:`~linop.errors.RankFailedError`; so does every peer blocked on it once its process
   ends (an uncaught error ends it), instead of hanging until the group's timeout.

The sub-groups linop creates are destroyed at interpreter exit (:func:`shutdown`, also
callable by hand); the groups you create are yours to destroy.

Devices: CPU tensors with gloo run as above. CUDA tensors with NCCL are not staged through
host memory: :mod:`~linop.backends.torch_distributed.device` runs the same schedule with the
tensors on their device (torch ops for the local steps, NCCL for the messages); it is written
and tested on the CPU, and its NCCL test is skipped without a GPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...errors import (  # noqa: F401 - re-exported for callers (documented in linop.errors)
    PeerTimeoutError,
    ProcessGroupArgumentError,
    ProcessGroupError,
    RankFailedError,
    WorkerMapError,
)
from ...operator import LinearOperator
from ...program import WorkerMap as WorkerMap  # re-exported for callers (documented in linop.program)
from ...program.cache import MappingLike, cached_plan
from .group import TIMEOUT_VARIABLE, GroupContext, context_for, resolve_timeout, shutdown
from .plan import BoundTorchPlan, TorchDistributedPlan

__all__ = [
    "apply",
    "plan_for",
    "plan_context",
    "TorchDistributedPlan",
    "BoundTorchPlan",
    "GroupContext",
    "TIMEOUT_VARIABLE",
    "shutdown",
]
# also importable from here (documented where they live): WorkerMap (linop.program),
# ProcessGroupError, ProcessGroupArgumentError, PeerTimeoutError (linop.errors)


def plan_context(group: Any = None) -> GroupContext:
    """The executor's context of ``group`` (None or True: the world group): its rank, size,
    device and caches (see :class:`~linop.backends.torch_distributed.group.GroupContext`).

    Raises
    ------
    ProcessGroupError, ProcessGroupArgumentError
        As :func:`plan_for`.
    """
    return context_for(group)


def plan_for(
    op: LinearOperator, *, group: Any = None, mapping: MappingLike | None = None
) -> TorchDistributedPlan:
    """The plan of ``op`` on ``group`` (default: the world group), compiled once and cached.

    Compiling is local (no communication); the first application checks collectively that
    every rank compiled the same tree. ``mapping`` places the tree's workers on the group's
    ranks (:class:`~linop.program.WorkerMap`, a sequence ``ranks[w]`` or a dict),
    several per rank if need be; mapped trees run the portable program.

    Raises
    ------
    ProcessGroupError
        torch.distributed is not initialized, or this process is not in ``group``.
    ProcessGroupArgumentError
        ``group`` is not a process group.
    """
    context = context_for(group)
    return cached_plan(
        context.plans, context.mapped_plans, op, mapping, lambda m: TorchDistributedPlan(op, context, m)
    )


def apply(
    op: LinearOperator,
    local_state: Mapping[str, Any],
    *,
    group: Any = None,
    inplace: bool = False,
    mapping: MappingLike | None = None,
    timeout: float | None = None,
) -> dict[str, Any]:
    """Apply ``op`` across the ranks of ``group``; collective.

    Parameters
    ----------
    op : LinearOperator
        The same tree on every rank.
    local_state : dict of str to torch.Tensor (or numpy array)
        The blocks of ``op.domain`` that this rank owns (those of its workers), and no others.
    group : ProcessGroup, optional
        Default (None or True): the world group; ``torch.distributed`` must be initialized. It
        must have more ranks than the tree's largest worker (under ``mapping``: than the
        largest rank the map uses).
    inplace : bool, optional
        Write the result into the caller's tensors (domain must equal range).
    mapping : WorkerMap, sequence of int or dict of int to int, optional
        The rank of each worker (default: worker ``w`` on rank ``w``); see :func:`plan_for`.
    timeout : float, optional
        Seconds the entry check waits for every rank (default ``$LINOP_TIMEOUT``, else none
        but the process group's own timeout).

    Returns
    -------
    dict of str to torch.Tensor
        This rank's blocks of ``op.range``, equal to the numpy interpreter's (numpy arrays when
        numpy arrays were passed).

    Raises
    ------
    TreeMismatchError, ProcessGroupError, DistributedStateError, DistributedDtypeError
        On every rank together, before any data moves (a different tree, a group too small, a
        missing, extra or wrongly shaped block, a dtype linop does not compute in).
    WorkerMapError, WorkerMapMismatchError
        A bad ``mapping``, on every rank together.
    PeerTimeoutError
        Some rank did not reach the check within ``timeout``, on every rank that did.
    RankFailedError
        A rank failed during the run (after the check): on that rank, and on every peer once
        the failing rank's process has ended. The group is unusable afterwards.
    ProcessGroupArgumentError
        ``group`` is not a process group, or ``timeout`` not a positive number.
    """
    seconds = resolve_timeout(timeout)
    return plan_for(op, group=group, mapping=mapping).apply(local_state, inplace=inplace, timeout=seconds)
