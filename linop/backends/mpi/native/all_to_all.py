"""The MPI calls of the all-to-all part of copying plans (:mod:`linop.program.lowering_all_to_all`
plans it: repartition, scatter, gather, all-gather): point-to-point messages with each rank's
own peers where every rank has few (:mod:`.all_to_all_peers`, the rule of
:func:`rank_all_to_all`), else ``Alltoallw`` with subarray datatypes or boxes packed for
``Alltoallv``, chosen per step by a measured rule (:func:`alltoall_strategy`)."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import numpy as np

from ....program.parts import AllToAllPart, PeerBox
from ..datatypes import contiguous_run, element_type, mpi, subarray
from ..mpi_types import Intracomm
from ..steps import Action, Call, OutOfPlaceBinding, RankStep
from .all_to_all_peers import PeerMessages, run_blocks, store_result

if TYPE_CHECKING:  # pragma: no cover - annotations only
    from ...numpy import Workspace

__all__ = [
    "ALLTOALL_STRATEGY",
    "PACKED_RUNS_BELOW",
    "PEER_MESSAGES_AT_MOST",
    "all_to_all_strategy",
    "alltoall_strategy",
    "rank_all_to_all",
]

Box = PeerBox
"""One piece of an all-to-all on one rank: (peer, start of the box in the block, its shape)."""

ALLTOALL_STRATEGY = "auto"
"""How an all-to-all of a copying plan moves its boxes: ``"auto"`` (each step's own choice,
:attr:`_RankAlltoall.strategy`, made by :func:`all_to_all_strategy` when it is planned),
``"peers"`` (point-to-point messages with each rank's peers), ``"packed"`` or ``"subarray"``
(the collective, so moved): forced for every step run or bound after it is set, on every rank
alike (for measurements and tests)."""

PEER_MESSAGES_AT_MOST = 16
"""The rule of :func:`all_to_all_strategy`: an all-to-all whose ranks each send plus receive at
most this many boxes (own box included; :attr:`~linop.program.parts.AllToAllPart.
most_messages`, a bound from the plan's geometry alike on every rank) runs as point-to-point
messages with each rank's own peers; one with more (or no known bound: a scatter's root talks
to every rank) as the collective ``Alltoallv`` / ``Alltoallw``, whose count and datatype
arrays have one entry per rank. A repartition between two grids sends and receives a few
boxes per rank whatever P, so its cost per rank stays flat in P (``benchmarks/bench_scale.py``).

Measured with ``benchmarks/bench_mpi_repartition.py`` on 4 ranks (this MPICH, shared memory,
float32, N = 1024 and 4096, on the shared 2-core machine at load averages 18-29: noisy), the
point-to-point path against the best of the forced collectives, interleaved sample by sample in
the same run (three runs): bound 4 (rows to a 2 x 2 grid and back) 0.70-1.04x by the median
sample (0.68-1.36x by the best), bound 8 (rows to columns: every rank talks to every other)
0.94-1.16x (0.89-1.29x): a draw within the noise, with few peers or all. Above 8
boxes nothing is measured here (4 ranks); 16 is a choice: with a bound plan's messages one
``Startall`` and one ``Waitall`` whatever their number, the point-to-point path does what
MPICH's ``Alltoallv`` does for a few peers, without the P-long arrays."""

PACKED_RUNS_BELOW = 2048
"""The measured rule of :func:`alltoall_strategy`, in entries of one contiguous run of a box:
a step packs by hand (one buffer, ``Alltoallv``) when some box it sends or receives is strided
with runs shorter than this; with longer runs the subarray datatypes (``Alltoallw``) move the
data without an extra copy. When every box is contiguous the packed path copies nothing
(``Alltoallv`` straight between the blocks). Measured with ``benchmarks/bench_mpi_repartition.py``
on this MPICH (shared memory, 4 ranks on 2 cores, float32, at load averages of 22-28: best
samples): runs of 2 KB packed 1.20x faster than subarray datatypes, runs of 4 KB 0.95-1.13x
(a draw), runs of 8 KB 0.70-0.94x (the datatypes faster); an earlier quiet-machine measurement
at 4 KB runs (4096 x 4096 float32 rows to columns) found packing 1.17-1.34x faster."""


def _box_index(start: tuple[int, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(a, a + n) for a, n in zip(start, shape))


def _contiguous_offset(block: tuple[int, ...], start: tuple[int, ...], shape: tuple[int, ...]) -> int | None:
    """The offset (in entries) of a box that is one contiguous run of a C-ordered block of
    shape ``block``, or None when it is strided."""
    if contiguous_run(block, shape, 1) != math.prod(shape):
        return None
    return int(np.ravel_multi_index(start, block)) if math.prod(shape) else 0


def _shortest_strided_run(block: tuple[int, ...], boxes: tuple[Box, ...]) -> int | None:
    """Entries in the shortest contiguous run of the strided boxes, None when every box is
    contiguous."""
    runs = [
        contiguous_run(block, shape, 1)
        for _, start, shape in boxes
        if _contiguous_offset(block, start, shape) is None
    ]
    return min(runs) if runs else None


def all_to_all_strategy(part: AllToAllPart) -> str:
    """``"peers"``: point-to-point messages with the rank's own peers
    (:mod:`.all_to_all_peers`) when the part's bound on any rank's boxes
    (:attr:`~linop.program.parts.AllToAllPart.most_messages`, the same on every rank) is at
    most :data:`PEER_MESSAGES_AT_MOST`; else the collective, ``"packed"`` or ``"subarray"``
    by :func:`alltoall_strategy`. Every rank of the communicator takes the same path (the
    collective needs all of them): the bound comes from the plan's geometry, which every rank
    knows, not from the rank's own peers."""
    most = part.most_messages
    if most is not None and most <= PEER_MESSAGES_AT_MOST:
        return "peers"
    target_shape = part.target.shape if part.target is not None else ()
    return alltoall_strategy(part.source_shape, target_shape, part.sends, part.receives)


def alltoall_strategy(
    source_shape: tuple[int, ...],
    target_shape: tuple[int, ...],
    sends: tuple[Box, ...],
    receives: tuple[Box, ...],
) -> str:
    """``"packed"`` (boxes copied into one buffer, ``Alltoallv``, copied out) when some box is
    strided with contiguous runs shorter than :data:`PACKED_RUNS_BELOW` entries, or when no box
    is strided, else ``"subarray"`` (``Alltoallw`` with a subarray datatype per box): the measured
    rule (see :data:`PACKED_RUNS_BELOW`). A box contiguous in its block is never copied by
    either: the packed path sends or receives it in place when every box of that side is."""
    runs = [
        r
        for r in (_shortest_strided_run(source_shape, sends), _shortest_strided_run(target_shape, receives))
        if r is not None
    ]
    if runs and min(runs) >= PACKED_RUNS_BELOW:
        return "subarray"
    return "packed"


@dataclass
class _RankAlltoall(RankStep):
    """One rank's part of an all-to-all (:class:`~linop.program.parts.AllToAllPart`: boxes of its
    one source block sent to each peer, boxes of its one new block received from each peer). Moved by
    point-to-point messages with its own peers (:mod:`.all_to_all_peers`), ``Alltoallw`` with a
    subarray datatype per box, or packed by hand into one buffer for ``Alltoallv``
    (:attr:`strategy`, chosen by :func:`all_to_all_strategy`, overridden by
    :data:`ALLTOALL_STRATEGY`); all move the same entries."""

    part: AllToAllPart
    strategy: str = ""
    """``"peers"``, ``"packed"`` or ``"subarray"``: the rules' choice for these boxes
    (:func:`all_to_all_strategy`)."""

    def __post_init__(self) -> None:
        if not self.strategy:
            self.strategy = all_to_all_strategy(self.part)
        self._peers = PeerMessages(self.part)

    def chosen(self) -> str:
        """The strategy a run uses now: :attr:`strategy` unless :data:`ALLTOALL_STRATEGY` forces one."""
        return self.strategy if ALLTOALL_STRATEGY == "auto" else ALLTOALL_STRATEGY

    def run(self, work: Workspace, comm: Intracomm, dtype: np.dtype) -> None:
        if self.chosen() == "peers":
            self._peers.run(work, comm, dtype)
            return
        send, receive = run_blocks(self.part, work, dtype)
        for call in self._calls(send, receive, comm, dtype, self.chosen()):
            call()
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
        """The all-to-all from the bound source block into a result block built once (the
        packing buffers too): blocking collective calls on prebuilt arguments, and the packs
        and unpacks as prepared copies between prebuilt views (point-to-point: persistent
        requests, :meth:`.all_to_all_peers.PeerMessages.bind_out_of_place`). ``out`` is not
        taken (the result block is built zeroed here, and nothing shows that every call
        writes all of it): the bound plan copies into it."""
        if self.chosen() == "peers":
            return self._peers.bind_out_of_place(arrays, comm, dtype, dry=dry)
        send = arrays[self.part.source] if self.part.source is not None else np.empty(0, dtype=dtype)
        if send.dtype != dtype or not send.flags.c_contiguous:
            return None
        results: dict[str, np.ndarray] = {}
        receive = np.zeros(self.part.target.shape if self.part.target is not None else 0, dtype=dtype)
        if self.part.target is not None:
            results[self.part.target.name] = receive
        dropped = (self.part.source,) if self.part.source is not None else ()
        if dry:
            return OutOfPlaceBinding(results=results, dropped=dropped)
        calls: list[Call] = list(self._calls(send, receive, comm, dtype, self.chosen()))
        return OutOfPlaceBinding(calls, results, dropped)

    def _calls(
        self, send: np.ndarray, receive: np.ndarray, comm: Intracomm, dtype: np.dtype, strategy: str
    ) -> list[Action]:
        """The calls of one all-to-all from ``send`` into ``receive``, prepared."""
        if strategy == "subarray":
            return [self._alltoallw(send, receive, comm, dtype)]
        size = comm.Get_size()
        entry = element_type(dtype)
        calls: list[Action] = []
        send_side = _packed_side(send, self.part.sends, size, dtype, pack=True)
        receive_side = _packed_side(receive, self.part.receives, size, dtype, pack=False)
        calls.extend(send_side.copies)
        calls.append(
            functools.partial(
                comm.Alltoallv,
                [send_side.buffer, (send_side.counts, send_side.displacements), entry],
                [receive_side.buffer, (receive_side.counts, receive_side.displacements), entry],
            )
        )
        calls.extend(receive_side.copies)
        return calls

    def _alltoallw(self, send: np.ndarray, receive: np.ndarray, comm: Intracomm, dtype: np.dtype) -> Action:
        lib = mpi()
        size = comm.Get_size()
        send_counts, send_types = [0] * size, [lib.BYTE] * size
        for peer, start, shape in self.part.sends:
            send_counts[peer], send_types[peer] = 1, subarray(send.shape, start, shape, dtype)
        receive_counts, receive_types = [0] * size, [lib.BYTE] * size
        for peer, start, shape in self.part.receives:
            receive_counts[peer], receive_types[peer] = 1, subarray(receive.shape, start, shape, dtype)
        zeros = [0] * size
        return functools.partial(
            comm.Alltoallw,
            [send, (send_counts, zeros), send_types],
            [receive, (receive_counts, zeros), receive_types],
        )


@dataclass
class _PackedSide:
    """One side of a packed all-to-all: the buffer MPI reads or writes, the count and
    displacement (in entries) of each peer's box in it, and the copies into it (sends) or out
    of it (receives); no copies when every box is contiguous in the block (the block is the
    buffer)."""

    buffer: np.ndarray
    counts: list[int]
    displacements: list[int]
    copies: list[Action]


def _packed_side(
    block: np.ndarray, boxes: tuple[Box, ...], size: int, dtype: np.dtype, *, pack: bool
) -> _PackedSide:
    counts, displacements = [0] * size, [0] * size
    offsets = [_contiguous_offset(block.shape, start, shape) for _, start, shape in boxes]
    if all(offset is not None for offset in offsets):  # straight from or into the block
        for (peer, _, shape), offset in zip(boxes, offsets):
            counts[peer], displacements[peer] = math.prod(shape), cast(int, offset)
        return _PackedSide(block.reshape(-1) if block.ndim else block.reshape(1), counts, displacements, [])
    buffer = np.empty(sum(math.prod(shape) for _, _, shape in boxes), dtype=dtype)
    copies: list[Action] = []
    offset = 0
    for peer, start, shape in boxes:
        n = math.prod(shape)
        counts[peer], displacements[peer] = n, offset
        packed = buffer[offset : offset + n].reshape(shape)
        view = block[_box_index(start, shape)]
        copies.append(
            functools.partial(np.copyto, packed, view) if pack else functools.partial(np.copyto, view, packed)
        )
        offset += n
    return _PackedSide(buffer, counts, displacements, copies)


def rank_all_to_all(part: AllToAllPart) -> RankStep:
    """The MPI step of an all-to-all part (its strategy chosen by :func:`all_to_all_strategy`)."""
    return _RankAlltoall(part)
