"""The entry check on a torch.distributed process group: :class:`TorchEntryCheck`.

The MPI interpreter's check (:class:`linop.backends.entry_check.EntryCheck`) decides, from one
reduction (maximum over ranks) of a short int64 vector, whether a call may run and in which
dtype: the tree's fingerprint words and their negations (maximum and minimum agree only when
every rank holds the same tree), an error flag, one flag per dtype present on any rank and the
largest integer magnitude. Here the same vector, decoded by the same code, is reduced by one
``torch.distributed.all_reduce`` (``MAX``) on the group (:class:`TorchReducer`), waited for
within the call's deadline: a rank that never arrives makes every rank that did raise
:class:`~linop.errors.PeerTimeoutError` instead of waiting forever. Only when something is
wrong, ``all_gather_object`` collects the ranks' messages, so that every rank raises the same
typed error (a mismatched tree, a missing or wrongly shaped block, a bad dtype, a group too
small for the tree) before any data moves.

What a checked call costs beyond the bound plan's is this reduction: the local work of a
call passing the same tensor again is about 8 us, and the rest is gloo's ``all_reduce`` (its
worker thread, a ring of ``2 (P - 1)`` steps), 0.3 ms on 2 processes and 4-6 ms on 4
processes oversubscribing 2 loaded cores, as much as a bound halo exchange of 64-192 KB rows
(``benchmarks/bench_torch_check_overhead.py ratios``, which also times a pairwise exchange of
the vector by recursive doubling of ``send``/``recv``: about half the ``all_reduce``'s time
on 4 processes). The check does not use that exchange: a gloo point-to-point wait given a
timeout closes the group's connections when it expires, so neither the deadline (``timeout=``)
nor the stall diagnosis's sliced waits (:mod:`.stall`) could be kept, and a choice by deadline
would let ranks with different deadlines wait in different collectives.

A peer that failed before taking part (its process ended; gloo closes its connections then) is
not a timeout when none was given: the ranks waiting on it raise
:class:`~linop.errors.RankFailedError`, naming the peer's rank and its error when the peer
reported one (:func:`report_failure`, which linop's wrappers call before raising an error of
their own on one rank: a key of the group's store).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ...errors import LinopError, PeerMismatchError, PeerTimeoutError, RankFailedError
from ...operator import LinearOperator
from ...space import Block
from ..entry_check import VECTOR_LENGTH, EntryCheck
from .group import GroupContext

__all__ = ["TorchReducer", "TorchEntryCheck", "report_failure", "reported_failures"]

FAILURE_KEY = "linop/failed/{rank}"
"""The store key under which a rank reports the error it raises alone (its world rank)."""


def _store() -> Any:
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


_REPORTED = [False]  # whether this process's key is set: cleared at its next completed check


def report_failure(error: BaseException) -> None:
    """Record, in the default group's store, that this process raises ``error`` on its own (a
    wrapper's local check), so that a peer left waiting for it can name its rank and cause.
    The record is removed when this process next completes an entry check's reduction (it
    lived on: the error was caught). Best effort: a store that cannot be reached is ignored."""
    import torch.distributed as dist

    try:
        message = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        _store().set(FAILURE_KEY.format(rank=dist.get_rank()), message)
        _REPORTED[0] = True
    except Exception:  # the store is gone: nothing to report to
        pass


def _withdraw_report() -> None:
    """Remove this process's failure record (it completed a reduction since: it lives on)."""
    import torch.distributed as dist

    _REPORTED[0] = False
    try:
        _store().delete_key(FAILURE_KEY.format(rank=dist.get_rank()))
    except Exception:  # pragma: no cover - the store is gone
        pass


def reported_failures(context: GroupContext) -> list[tuple[int, str]]:
    """(rank in the group, error) of the group's peers that reported a failure
    (:func:`report_failure`); best effort, empty when the store cannot be reached."""
    import datetime

    import torch.distributed as dist

    found = []
    try:
        store = _store()
        store.set_timeout(datetime.timedelta(seconds=5))  # the group is unusable: do not wait long
        for rank in range(context.size):
            world = rank if context.world else dist.get_global_rank(context.group, rank)
            key = FAILURE_KEY.format(rank=world)
            if rank != context.rank and store.check([key]):
                found.append((rank, store.get(key).decode()))
    except Exception:  # the store's server was on the failed rank
        pass
    return found


class TorchReducer:
    """The check's reduction on one group: the maximum over ranks of a :data:`VECTOR_LENGTH`
    int64 vector (the interface :class:`~linop.backends.entry_check.EntryCheck` reduces through).

    Made once per group context; every tree checked on the group shares it (calls on a group
    are collective, so they never overlap). The check's reduction (:meth:`reduce`) runs in place
    on a tensor sharing :attr:`received`'s memory, started on the group itself with options
    made once (on the CPU: no copy, and none of ``torch.distributed.all_reduce``'s per-call
    Python; copied to and from the device for NCCL)."""

    def __init__(self, context: GroupContext) -> None:
        import torch

        self.context = context
        self.send = np.zeros(VECTOR_LENGTH, dtype=np.int64)
        self.received = np.zeros(VECTOR_LENGTH, dtype=np.int64)
        self.signature: Any = None
        self.sent = b""
        self.rank = context.rank
        self.growth: dict[bytes, bool] = {}  # agreed per tree: see EntryCheck._growth_known
        self.single = context.size == 1
        self._tensor = torch.from_numpy(self.received)
        self.timeout: float | None = None  # set by the check before each reduction
        self.doing = "the entry check"
        self._maximum: Any = None  # the all_reduce options of :meth:`reduce` on the CPU (made once)
        if not self.single and context.device.type == "cpu":
            import torch.distributed as dist

            self._maximum = dist.AllreduceOptions()
            self._maximum.reduceOp = dist.ReduceOp.MAX

    def reduce(self, timeout: float | None = None, doing: str | None = None) -> np.ndarray:
        """Reduce :attr:`send` (maximum over ranks) into :attr:`received` and return it (the
        signature of the MPI check's reducer; ``timeout`` None waits :attr:`timeout`).

        Raises
        ------
        PeerTimeoutError
            Not every rank took part within the timeout.
        """
        if timeout is not None:
            self.timeout = timeout
        np.copyto(self.received, self.send)
        if self._maximum is not None and not self.context.failed:  # in place, on received's memory
            self._finish(self.context.group.allreduce([self._tensor], self._maximum))
        elif not self.single:
            self.received[:] = self.all_reduce(self.received, "max")
        return self.received

    def minimum(self, value: int) -> int:
        """The minimum over ranks of ``value``."""
        return value if self.single else int(self.all_reduce(np.array([value]), "min")[0])

    def allgather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order (``all_gather_object``)."""
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.context.size
        dist.all_gather_object(gathered, value, group=self.context.group)
        return gathered

    def all_reduce(self, values: np.ndarray, how: str) -> np.ndarray:
        """The maximum (``"max"``) or minimum (``"min"``) over ranks of an int64 vector."""
        import torch
        import torch.distributed as dist

        context = self.context
        op = dist.ReduceOp.MAX if how == "max" else dist.ReduceOp.MIN
        tensor = torch.from_numpy(np.array(values, dtype=np.int64))
        if context.device.type != "cpu":
            tensor = tensor.to(context.device)
        self._finish(dist.all_reduce(tensor, op=op, group=context.group, async_op=True))
        return tensor.cpu().numpy()

    def _finish(self, work: Any) -> None:
        """Wait for a reduction ``work`` on the group within :attr:`timeout` (its errors named:
        :class:`~linop.errors.PeerTimeoutError`, or :class:`~linop.errors.RankFailedError`
        when a peer's connection closed with no deadline passed)."""
        try:
            self.context.wait(work, self.timeout, self.doing)
        except PeerMismatchError:  # a peer at the same call on its bound plan (stall.py): named
            raise
        except PeerTimeoutError as error:
            transport = str(error.__cause__ or error).lower()
            if self.timeout is not None and ("timed out" in transport or "timeout" in transport):
                raise
            raise self._peer_failed(error) from error
        if _REPORTED[0]:
            _withdraw_report()

    def _peer_failed(self, error: PeerTimeoutError) -> RankFailedError:
        """The error of a wait that ended because a peer's connection closed (no deadline
        passed): the peers that reported their error named with it."""
        context = self.context
        failures = reported_failures(context)
        if failures:
            who = "; ".join(f"rank {rank} raised {cause}" for rank, cause in failures)
        else:  # the roll call's finding (group.GroupContext.wait), the peers that ended named
            who = str(error).removeprefix(f"rank {context.rank}: ")
        return RankFailedError(
            f"rank {context.rank}: a peer of the group of {context.size} failed before {self.doing} "
            f"completed ({who}); the group cannot be used any more: end the job"
        )


class TorchEntryCheck(EntryCheck):
    """The entry check of one compiled tree on one process group (see the module docstring).

    Parameters
    ----------
    op : LinearOperator
        The tree.
    fingerprint : bytes
        Its 16-byte fingerprint (the tree's, and the worker map's under ``mapping=``).
    context : GroupContext
        The group.
    domain_blocks : dict of str to Block
        The blocks of ``op.domain`` that this rank owns.
    problem : LinopError, optional
        A compile-time problem (a group too small, a bad map), raised on every rank.
    tree_fingerprint : bytes, optional
        The tree's own fingerprint, when ``fingerprint`` also covers a worker map.
    rank_of : callable, optional
        The rank that runs a worker (under a worker map; default worker ``w`` on rank ``w``).
    """

    def __init__(
        self,
        op: LinearOperator,
        fingerprint: bytes,
        context: GroupContext,
        domain_blocks: dict[str, Block],
        problem: LinopError | None,
        *,
        tree_fingerprint: bytes | None = None,
        rank_of: Callable[[int], int] | None = None,
    ) -> None:
        if context.reducer is None:
            context.reducer = TorchReducer(context)
        super().__init__(
            op,
            fingerprint,
            context.reducer,
            domain_blocks,
            problem,
            tree_fingerprint=tree_fingerprint,
            rank_of=rank_of,
        )
        self.context = context

    def run_within(self, state: Any, timeout: float | None, *, inplace: bool = False) -> Any:
        """:meth:`run` with the reduction waited for at most ``timeout`` seconds."""
        reducer = self.context.reducer
        reducer.timeout = timeout
        reducer.doing = f"the entry check of {self.op}"
        return self.run(state, inplace=inplace)
