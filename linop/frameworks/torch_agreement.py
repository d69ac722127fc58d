r"""Whether any process needs a gradient: a flag OR-ed over the processes without a blocking call.

A distributed layer's backward may skip its input gradient, the local product's :math:`\bar x`
and the adjoint window movement :math:`W^{*}` with it, only if *no* process needs it: a
process whose own input needs no gradient still sends its neighbours their halos' gradients
when theirs do. The skip is therefore decided alike on every process, as

.. math::

    g = \bigvee_{r} g_r

(:math:`g_r`: some input block of process :math:`r` requires a gradient), an all-reduce of one
integer under ``MAX``, started without waiting in the forward (MPI ``Iallreduce``, a
torch.distributed ``all_reduce(async_op=True)``) and waited for in the backward, by which time
every process has started it (its latency hidden behind the rest of the forward). Every
process starts it in the same forward call (the calls are collective), so every process
waits for the same answer and takes the same path in the backward: the skipped adjoint is
skipped everywhere or nowhere.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["Agreement", "start_agreement"]


class Agreement:
    """An OR of one flag over the processes, started; :meth:`result` waits for it (once)."""

    def __init__(self, value: bool, wait: Any = None, read: Any = None, buffers: Any = ()) -> None:
        self._value = value
        self._wait = wait
        self._read = read
        self._buffers = buffers  # the message's memory, alive until the wait

    @property
    def pending(self) -> bool:
        """Whether it is still in flight (not waited for)."""
        return self._wait is not None

    def result(self) -> bool:
        """The OR over the processes (waits for it the first time)."""
        if self._wait is not None:
            wait, self._wait = self._wait, None
            wait()
            self._value = bool(self._read())
            self._buffers = ()
        return self._value


def start_agreement(local: bool, *, comm: Any = None, group: Any = None) -> Agreement:
    """Start the OR of ``local`` over ``comm``'s ranks (MPI) or ``group``'s (torch.distributed,
    ``True``: the world group); in one process (neither given) the flag itself. Collective:
    every process of the communicator or group starts it, in the same order as its other
    collectives."""
    if comm is not None:
        from mpi4py import MPI

        sent = np.array([int(local)], dtype=np.int32)
        got = np.zeros(1, dtype=np.int32)
        request = comm.Iallreduce(sent, got, op=MPI.MAX)
        return Agreement(local, request.Wait, lambda: int(got[0]), (sent, got))
    if group is not None and group is not False:
        import torch
        import torch.distributed as dist

        from ..backends import torch_distributed

        context = torch_distributed.plan_context(None if group is True else group)
        flag = torch.tensor([int(local)], dtype=torch.int32, device=context.device)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=context.group, async_op=True)
        assert work is not None  # async_op=True returns the work
        return Agreement(local, work.wait, lambda: int(flag.item()), (flag,))
    return Agreement(local)
