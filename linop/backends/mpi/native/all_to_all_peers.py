"""The point-to-point path of an all-to-all part: each rank's boxes as nonblocking messages to
and from its own peers only, in one phase (persistent requests in a bound plan).

An all-to-all part (:class:`~linop.program.parts.AllToAllPart`) of a repartition between two
grids is sparse: a block meets O(1) blocks of the other decomposition, but ``Alltoallv`` and
``Alltoallw`` take count, displacement and datatype arrays with one entry per rank of the
communicator, O(P) memory and time on every rank at every call and binding. Here a rank posts
one receive per peer it gets a box from, then one send per peer it gives a box to, copies its
own box locally while they are in flight, and waits once: O(its peers). It cannot deadlock for
the reason a phase cannot (:mod:`linop.program`): every message of the step is posted before
the wait, and every rank reaches its steps in program order.

Each box moves straight from or into its block when it is contiguous there (a slice of the
flattened block) or when its contiguous runs are at least :data:`~linop.backends.mpi.datatypes.
PACK_BELOW` bytes (a subarray datatype, the phases' rule for point-to-point messages); thinner
boxes are packed into a buffer (copied in before the sends, out after the wait). Both ends
describe a box as ``n`` entries of the run's element type, so the type signatures match
whichever way each end lays it out.

Messages carry tag :data:`TAG`. Two ranks exchange at most one box each way per all-to-all,
and every rank makes its steps in program order, so the messages between a pair with this tag
are sent and received in the same order (MPI does not let them overtake one another); the
phases' transfers carry their own counts as tags.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ....program.parts import AllToAllPart
from ..datatypes import PACK_BELOW, contiguous_run, element_type, mpi, subarray
from ..steps import Action, Call, OutOfPlaceBinding

if TYPE_CHECKING:  # pragma: no cover - mpi4py is optional at run time
    from mpi4py.MPI import Intracomm

    from ...numpy import Workspace

__all__ = ["TAG", "PeerMessages", "blocks", "run_blocks", "store_result"]

TAG = 0
"""The tag of the point-to-point all-to-all's messages (see the module's note on ordering)."""


@dataclass
class _Messages:
    """One rank's messages of an all-to-all between fixed arrays: the buffer specs of its
    receives and sends, per peer, and the local actions around them."""

    receives: list[tuple[int, list[Any]]] = field(default_factory=list)
    sends: list[tuple[int, list[Any]]] = field(default_factory=list)
    packs: list[Action] = field(default_factory=list)
    """Copies of thin boxes into their send buffers, before the sends start."""
    local: list[Action] = field(default_factory=list)
    """The rank's own box, copied while the messages are in flight."""
    unpacks: list[Action] = field(default_factory=list)
    """Copies of thin boxes out of their receive buffers, after the wait."""


def _box_index(start: tuple[int, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(a, a + n) for a, n in zip(start, shape))


def _box_spec(
    block: np.ndarray, start: tuple[int, ...], shape: tuple[int, ...], dtype: np.dtype
) -> tuple[list[Any], np.ndarray | None]:
    """The buffer spec of a box of the C-contiguous ``block``, and the packing buffer it needs
    (None when the box moves straight from or into the block)."""
    n = math.prod(shape)
    entry = element_type(dtype)
    run = contiguous_run(block.shape, shape, 1)
    if run == n:  # one contiguous run: a slice of the flattened block
        offset = int(np.ravel_multi_index(start, block.shape))
        return [block.reshape(-1)[offset : offset + n], n, entry], None
    if run * dtype.itemsize >= PACK_BELOW:
        return [block, 1, subarray(block.shape, start, shape, dtype)], None
    buffer = np.empty(shape, dtype=dtype)
    return [buffer, n, entry], buffer


def _messages(
    part: AllToAllPart, send: np.ndarray, receive: np.ndarray, rank: int, dtype: np.dtype
) -> _Messages:
    """The rank's messages of ``part`` from the block ``send`` into the block ``receive``."""
    found = _Messages()
    own: tuple[int, ...] | None = None  # where the rank's own box lands in its new block
    for peer, start, shape in part.receives:
        if peer == rank:
            own = start
        elif math.prod(shape):
            spec, buffer = _box_spec(receive, start, shape, dtype)
            found.receives.append((peer, spec))
            if buffer is not None:
                found.unpacks.append(functools.partial(np.copyto, receive[_box_index(start, shape)], buffer))
    for peer, start, shape in part.sends:
        entries: int = math.prod(shape)
        if peer == rank:
            if own is not None and entries:
                found.local.append(
                    functools.partial(
                        np.copyto, receive[_box_index(own, shape)], send[_box_index(start, shape)]
                    )
                )
        elif entries:
            spec, buffer = _box_spec(send, start, shape, dtype)
            found.sends.append((peer, spec))
            if buffer is not None:
                found.packs.append(functools.partial(np.copyto, buffer, send[_box_index(start, shape)]))
    return found


def blocks(part: AllToAllPart, source: np.ndarray | None, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """The send block (``source``, or an empty one on a rank without a source block) and a
    zeroed result block (empty on a rank without a target block)."""
    send = source if source is not None else np.empty(0, dtype=dtype)
    receive = np.zeros(part.target.shape if part.target is not None else 0, dtype=dtype)
    return send, receive


def run_blocks(part: AllToAllPart, work: Workspace, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """:func:`blocks` of a run: the source block taken from ``work``, as a C-contiguous array
    of the run's ``dtype`` (converted only when it is not one)."""
    source = None
    if part.source is not None:
        source = work.arrays[part.source]
        if source.dtype != dtype or not source.flags.c_contiguous:
            source = np.ascontiguousarray(source, dtype=dtype)
    return blocks(part, source, dtype)


def store_result(part: AllToAllPart, work: Workspace, receive: np.ndarray) -> None:
    """End a run: the source block dropped from ``work``, the result block set as the target."""
    if part.source is not None:
        work.drop(part.source)
    if part.target is not None:
        work.set(part.target.name, receive)


@dataclass
class PeerMessages:
    """One rank's part of an all-to-all (:class:`~linop.program.parts.AllToAllPart`) as
    point-to-point messages with its own peers: the same entries as the collective, O(peers)
    work and memory instead of O(P). Run and bound as a :class:`~linop.backends.mpi.steps.
    RankStep` is (the all-to-all's step delegates to it when its strategy is ``"peers"``)."""

    part: AllToAllPart

    def run(self, work: Workspace, comm: Intracomm, dtype: np.dtype) -> None:
        send, receive = run_blocks(self.part, work, dtype)
        found = _messages(self.part, send, receive, comm.Get_rank(), dtype)
        requests = [comm.Irecv(spec, peer, TAG) for peer, spec in found.receives]
        for action in found.packs:
            action()
        requests.extend(comm.Isend(spec, peer, TAG) for peer, spec in found.sends)
        for action in found.local:
            action()
        if requests:
            mpi().Request.Waitall(requests)
        for action in found.unpacks:
            action()
        store_result(self.part, work, receive)

    def bind_out_of_place(
        self,
        arrays: dict[str, np.ndarray],
        comm: Intracomm,
        dtype: np.dtype,
        *,
        dry: bool = False,
        out: Mapping[str, np.ndarray] | None = None,
    ) -> OutOfPlaceBinding | None:
        """Persistent receives and sends between the bound source block and a result block
        built once (packing buffers too): the packs, one ``Startall``, the local copy, one
        ``Waitall``, the unpacks, as prepared calls. ``out`` is not taken (the result
        block is built zeroed here, and nothing shows that every call writes all of it): the
        bound plan copies into it."""
        source = arrays[self.part.source] if self.part.source is not None else None
        if source is not None and (source.dtype != dtype or not source.flags.c_contiguous):
            return None
        send, receive = blocks(self.part, source, dtype)
        results = {self.part.target.name: receive} if self.part.target is not None else {}
        dropped = (self.part.source,) if self.part.source is not None else ()
        if dry:
            return OutOfPlaceBinding(results=results, dropped=dropped)
        found = _messages(self.part, send, receive, comm.Get_rank(), dtype)
        requests = [comm.Recv_init(spec, peer, TAG) for peer, spec in found.receives]
        requests.extend(comm.Send_init(spec, peer, TAG) for peer, spec in found.sends)
        calls: list[Call] = list(found.packs)
        if requests:
            prequest = mpi().Prequest
            calls.append(functools.partial(prequest.Startall, requests))
            calls.extend(found.local)
            calls.append(functools.partial(prequest.Waitall, requests))
        else:
            calls.extend(found.local)
        calls.extend(found.unpacks)
        return OutOfPlaceBinding(calls, results, dropped, requests=requests)
