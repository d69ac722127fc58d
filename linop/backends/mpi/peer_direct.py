"""A rank's point-to-point all-to-all moved straight between a call's own arrays:
:class:`DirectPeers`.

A bound plan (:mod:`linop.backends.mpi.compiled`) runs on buffers fixed at binding: a caller
with new memory on each call (a torch module's input tensor, its fresh result) copies its input
into the bound buffer first and its result out of the bound result buffer after. For the
all-to-all of a repartition moved by messages with the rank's own peers
(:class:`~linop.backends.mpi.native.all_to_all_peers.PeerMessages`) both copies can go: here
the rank's messages are worked out once (each box's offset or subarray datatype in its
C-contiguous block, the packing buffers of thin boxes), and each call posts them as
nonblocking requests on the arrays it is given: receives straight into the result array,
sends straight from the source array (thin boxes packed into buffers kept here), the rank's own
box copied between the two while they fly, one wait, then the unpacks. The same messages as the
bound plan's (tag :data:`~linop.backends.mpi.native.all_to_all_peers.TAG`, the same entries in
the same order between each pair), so one rank may run this while another runs its bound plan.

The source array is only read. The result array is written whole: a :class:`DirectPeers` is
made only where the boxes this rank receives (its own included) tile its result block
(checked once: their sizes add up to the block's and no two overlap), so an uninitialized array
(``torch.empty``) is a valid result array.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...program.parts import AllToAllPart
from .datatypes import PACK_BELOW, contiguous_run, element_type, mpi, subarray
from .guards import abort_for
from .native.all_to_all import _RankAlltoall
from .native.all_to_all_peers import TAG

__all__ = ["DirectPeers"]

_SLICE, _TYPE, _PACKED = 0, 1, 2
"""How a box moves: a slice ``offset : offset + n`` of the flattened block, the whole block
with the box's subarray datatype, or through a packing buffer kept here."""


def _size(shape: Sequence[int]) -> int:
    return math.prod(shape)


def _box(start: tuple[int, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(a, a + n) for a, n in zip(start, shape))


def _route(
    block_shape: tuple[int, ...], start: tuple[int, ...], shape: tuple[int, ...], dtype: np.dtype
) -> tuple[int, Any, Any]:
    """``(how, a, b)`` for a box of a C-contiguous block, as the bound plan's rule
    (:func:`~linop.backends.mpi.native.all_to_all_peers._box_spec`): ``(_SLICE, offset, n)``,
    ``(_TYPE, datatype, None)`` or ``(_PACKED, buffer, box index)``."""
    n = _size(shape)
    run = contiguous_run(block_shape, shape, 1)
    if run == n:
        return _SLICE, int(np.ravel_multi_index(start, block_shape)), n
    if run * dtype.itemsize >= PACK_BELOW:
        return _TYPE, subarray(block_shape, start, shape, dtype), None
    return _PACKED, np.empty(shape, dtype=dtype), _box(start, shape)


def _overlap(a: tuple[tuple[int, ...], tuple[int, ...]], b: tuple[tuple[int, ...], tuple[int, ...]]) -> bool:
    return all(s < t + m and t < s + n for s, n, t, m in zip(a[0], a[1], b[0], b[1]))


def peer_bound(calls: Sequence[Any]) -> bool:
    """Whether a compiled all-to-all's prepared ``calls`` are its peer messages' (one
    ``Startall`` and one ``Waitall`` of point-to-point requests, copies around them) rather
    than a collective's (a strategy forced by
    :data:`~linop.backends.mpi.native.all_to_all.ALLTOALL_STRATEGY` when it was bound): the
    direct form posts peer messages, which only peer messages on the other ranks match."""
    request = mpi().Request
    for function, arguments in calls:
        found = getattr(function, "func", function)
        if arguments:
            return False
        if found is np.copyto:
            continue
        owner = getattr(found, "__self__", None)
        if not (
            isinstance(owner, type)
            and issubclass(owner, request)
            and found.__name__ in ("Startall", "Waitall")
        ):
            return False
    return True


class DirectPeers:
    """One rank's part of a point-to-point all-to-all on the arrays of each call (see the module
    docstring): ``direct(send, receive)`` moves the boxes of the C-contiguous source array
    ``send`` to the peers and fills the C-contiguous result array ``receive`` (written whole,
    never read), collectively with the other ranks' calls of the same all-to-all (theirs direct
    or bound).

    Parameters
    ----------
    part : AllToAllPart
        The rank's part (one source block, one target block).
    comm : mpi4py communicator
        The plan's.
    dtype : numpy.dtype
        The run's dtype (the arrays').
    doing : str
        What a failure aborts the job while doing (named in the message).
    """

    def __init__(self, part: AllToAllPart, comm: Any, dtype: np.dtype, doing: str) -> None:
        assert part.target is not None and part.source is not None
        self.comm = comm
        self.dtype = np.dtype(dtype)
        self.doing = doing
        self.source_shape = tuple(part.source_shape)
        self.target_shape = tuple(part.target.shape)
        rank = comm.Get_rank()
        self.entry = element_type(self.dtype)
        self.waitall = mpi().Request.Waitall
        own: tuple[int, ...] | None = None
        self.receives: list[tuple[int, int, Any, Any]] = []
        for peer, start, shape in part.receives:
            if peer == rank:
                own = start
            elif _size(shape):
                self.receives.append((peer, *_route(self.target_shape, start, shape, self.dtype)))
        self.sends: list[tuple[int, int, Any, Any]] = []
        self.local: tuple[tuple[slice, ...], tuple[slice, ...]] | None = None
        for peer, start, shape in part.sends:
            if peer == rank:
                if own is not None and _size(shape):
                    self.local = (_box(own, shape), _box(start, shape))
            elif _size(shape):
                self.sends.append((peer, *_route(self.source_shape, start, shape, self.dtype)))

    @staticmethod
    def tiles(part: AllToAllPart, rank: int) -> bool:
        """Whether the boxes ``rank`` receives in ``part`` (its own kept box included) tile its
        target block: their sizes add up to the block's and no two overlap."""
        if part.target is None:
            return False
        own = [shape for peer, _, shape in part.sends if peer == rank and _size(shape)]
        boxes = [
            (tuple(start), tuple(shape))
            for peer, start, shape in part.receives
            if _size(shape) and (peer != rank or own)
        ]
        if sum(_size(shape) for _, shape in boxes) != _size(part.target.shape):
            return False
        return not any(_overlap(a, b) for i, a in enumerate(boxes) for b in boxes[:i])

    @classmethod
    def of(cls, bound: Any, source: str, target: str) -> DirectPeers | None:
        """The direct form of the bound plan ``bound`` (a
        :class:`~linop.backends.mpi.bound.BoundPlan`, compiled) on this rank, when its schedule
        here is one all-to-all from block ``source`` into block ``target`` that it binds as
        peer messages (:func:`peer_bound`), whose received boxes tile the target
        (:meth:`tiles`); else None."""
        plan = bound.plan
        schedule: Sequence[Any] = plan.schedule
        if len(schedule) != 1 or type(schedule[0]) is not _RankAlltoall or bound.every_call:
            return None
        if not bound.persistent or not peer_bound(bound.calls):
            return None
        part = schedule[0].part
        if part.source != source or part.target is None or part.target.name != target:
            return None
        if not cls.tiles(part, plan.comm.Get_rank()):
            return None
        return cls(part, plan.comm, bound.dtype, f"applying {plan.op} on the call's arrays")

    def __call__(self, send: np.ndarray, receive: np.ndarray) -> None:
        try:
            self._run(send, receive)
        except BaseException as error:  # as a bound plan's call: the job ends
            abort_for(self.comm, self.doing, error)

    def _run(self, send: np.ndarray, receive: np.ndarray) -> None:
        comm, entry = self.comm, self.entry
        requests = []
        flat = receive.reshape(-1)
        for peer, how, a, b in self.receives:
            if how == _SLICE:
                requests.append(comm.Irecv([flat[a : a + b], b, entry], peer, TAG))
            elif how == _TYPE:
                requests.append(comm.Irecv([receive, 1, a], peer, TAG))
            else:
                requests.append(comm.Irecv([a, a.size, entry], peer, TAG))
        flat = send.reshape(-1)
        for peer, how, a, b in self.sends:
            if how == _SLICE:
                requests.append(comm.Isend([flat[a : a + b], b, entry], peer, TAG))
            elif how == _TYPE:
                requests.append(comm.Isend([send, 1, a], peer, TAG))
            else:
                np.copyto(a, send[b])
                requests.append(comm.Isend([a, a.size, entry], peer, TAG))
        if self.local is not None:
            into, out_of = self.local
            np.copyto(receive[into], send[out_of])
        if requests:
            self.waitall(requests)
        for _, how, a, b in self.receives:
            if how == _PACKED:
                np.copyto(receive[b], a)
