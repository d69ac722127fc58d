"""A bound sum-reduce of a large block over a few ranks as point-to-point messages: a
reduce-scatter, then a gather onto the root, with no copy of the block.

A sum-reduce (:class:`~linop.collectives.SumReduce`, a broadcast's adjoint) is out of place: the
caller's copies stay as they are, the root gets their sum in a result array. ``Allreduce`` (or
``Reduce``) from the copies into the result first copies the whole block into the result
(MPICH's algorithms run in place on the receive buffer), then adds into it: on this machine an
8 MB sum over 2 or 4 ranks so took 1.2-1.4x of an in-place ``Allreduce`` (which has no copy to
make, but writes the caller's array), see ``benchmarks/bench_mpi_collectives.py``. Here the
block, flattened, is cut into one share per rank of the group (``n * k // P`` boundaries), and
with persistent requests:

1. every rank sends each other rank that rank's share of its copy, and receives the others'
   contributions to its own share: the first other rank's straight into where the sum of its
   share goes (the root's result array on the root, a buffer built at binding elsewhere), the
   rest into buffers built at binding (one ``Startall``, one ``Waitall``);
2. it adds its own copy's share into that sum in place, then the other contributions, in rank
   order (the same sums as the tree's, in another order: exact for integer values). In place,
   as MPICH's reductions add: the sum written into a third array (own + first contribution)
   made one more pass over memory, and the whole call took 1.12-1.23x (2 ranks) and 1.10x
   (4 ranks) of this one (per-sample ratios, interleaved, 8 MB; the results bit for bit the
   same, since ``x + y == y + x``);
3. the root receives every other rank's summed share straight into its place in the result
   (receives started with step 1, so they are posted early); the others send theirs.

Each rank moves ``(P - 1) / P`` of the block out and in, as the in-place ``Allreduce``'s
reduce-scatter does, and the gather replaces its all-gather (only the root receives). Measured
against the other ways to the same sum that leave the copies alone (8 MB, every timed batch after
calls of its own, the loaded 2-core machine, median of per-sample ratios to an in-place
``Allreduce`` on a buffer of the benchmark's): these messages 0.65-0.77x on 2 ranks and 0.77x on
4 (with the sum into a third array: 0.78-1.03x and 0.77-0.85x); ``Allreduce`` from the copy into
the result 1.27-1.39x / 1.15-1.27x; a copy into the result then an in-place ``Allreduce``
1.13-1.24x; ``Reduce_scatter_block`` and ``Gather`` 1.36-1.44x. The
messages of a sum-reduce are ``P - 1`` per rank: this path is taken for groups of at most
:data:`RANKS_UP_TO` ranks and blocks of at least :data:`FROM_BYTES` bytes
(:func:`by_messages`, decided alike on every rank from the program), the persistent
``Allreduce_init`` otherwise (latency-bound small sums, and large groups, whose binding must not
grow with the group).

The messages carry tags :data:`TAGS` (contributions, summed shares). Every rank binds its
groups in their global order and waits for each group's messages before the next step, so the
messages between a pair with one tag are sent and received in the same order (MPI does not let
them overtake one another).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import numpy as np

from ..datatypes import mpi, predefined_type
from ..memory import lasting_array
from ..steps import Call

if TYPE_CHECKING:  # pragma: no cover - mpi4py is optional at run time
    from mpi4py.MPI import Intracomm

__all__ = ["FROM_BYTES", "RANKS_UP_TO", "TAGS", "by_messages", "bind_reduce"]

FROM_BYTES = 1 << 16
"""Blocks of at least this many bytes are summed by messages (smaller ones are latency-bound:
one persistent ``Allreduce_init`` is fewer round trips)."""

RANKS_UP_TO = 8
"""Groups of at most this many ranks are summed by messages (``P - 1`` messages per rank)."""

TAGS = (1, 2)
"""The tags of the contributions to a share and of the summed shares sent to the root."""


def by_messages(ranks: int, nbytes: int) -> bool:
    """Whether a sum-reduce over ``ranks`` ranks of a block of ``nbytes`` bytes is bound as
    messages (:func:`bind_reduce`) rather than as a persistent ``Allreduce_init``."""
    return 2 <= ranks <= RANKS_UP_TO and nbytes >= FROM_BYTES


def bind_reduce(
    sub: Intracomm, copy: np.ndarray, total: np.ndarray | None, dtype: np.dtype
) -> tuple[list[Call], list[Any], list[np.ndarray]]:
    """The prepared calls of the sum of every rank's ``copy`` onto rank 0 of ``sub`` (the root),
    into ``total`` there (None elsewhere), and the persistent requests and buffers they use.

    ``copy`` and ``total`` are C-contiguous arrays of one shape and of ``dtype``; every rank of
    ``sub`` calls this with arrays of that shape. Returns ``(calls, requests, scratch)``: the
    calls in order (``Startall``, ``Waitall`` and adds, as partials of positional arguments),
    the requests to free with the binding, and the buffers the messages and sums write that
    are no result (kept alive with the binding)."""
    rank, size = sub.Get_rank(), sub.Get_size()
    flat = copy.reshape(-1)
    n = flat.size
    bounds = [n * k // size for k in range(size + 1)]
    peers = [k for k in range(size) if k != rank]
    entry = predefined_type(dtype)
    share = bounds[rank + 1] - bounds[rank]
    scratch: list[np.ndarray] = []
    if total is not None:
        mine = total.reshape(-1)[bounds[rank] : bounds[rank + 1]]
    else:
        mine = lasting_array((share,), dtype)
        scratch.append(mine)
    # the first other rank's contribution lands in the sum itself; the others in buffers
    contributions = [mine] + [lasting_array((share,), dtype) for _ in peers[1:]]
    scratch.extend(contributions[1:])
    exchange = [
        sub.Send_init([flat[bounds[k] : bounds[k + 1]], bounds[k + 1] - bounds[k], entry], k, TAGS[0])
        for k in peers
    ]
    exchange.extend(
        sub.Recv_init([buffer, share, entry], k, TAGS[0]) for k, buffer in zip(peers, contributions)
    )
    if total is not None:  # the root: every other share lands in its place in the result
        whole = total.reshape(-1)
        gather = [
            sub.Recv_init([whole[bounds[k] : bounds[k + 1]], bounds[k + 1] - bounds[k], entry], k, TAGS[1])
            for k in peers
        ]
    else:
        gather = [sub.Send_init([mine, share, entry], 0, TAGS[1])]
    prequest, request = mpi().Prequest, mpi().Request
    own = flat[bounds[rank] : bounds[rank + 1]]
    calls: list[Call] = []
    if total is not None:
        calls.append(functools.partial(prequest.Startall, exchange + gather))
    else:
        calls.append(functools.partial(prequest.Startall, exchange))
    calls.append(functools.partial(request.Waitall, exchange))
    calls.append(functools.partial(np.add, mine, own, mine))  # in place: x + y == y + x exactly
    calls.extend(functools.partial(np.add, mine, buffer, mine) for buffer in contributions[1:])
    if total is None:
        calls.append(functools.partial(prequest.Startall, gather))
    calls.append(functools.partial(request.Waitall, gather))
    return calls, exchange + gather, scratch
