"""How a communication phase moves on MPI: the host kit's recipe
(:func:`linop.backends.host_phase.phase_recipe`) with MPI's route rule (:func:`route_of`), which
its three executors follow.

The MPI interpreter runs phases three ways: the ordinary runtime posts nonblocking requests on
each call (:mod:`linop.backends.mpi.runtime`), the checked apply's in-place path makes
persistent requests once per layout of the caller's arrays
(:mod:`linop.backends.mpi.inplace_phases`), and a bound plan makes them once on fixed arrays
(:mod:`linop.backends.mpi.compiled`). *What* moves *where* is decided once, for all three
(:func:`phase_recipe`); the executors only differ in *when* they make their requests.

A bound plan may also send small messages of a phase between this rank and one peer, in one
direction, as one message: a *bundle* (:func:`bundles`, up to :data:`BUNDLE_UP_TO` bytes), when
both ends list it at binding (:func:`~linop.backends.mpi.compiled.bundle_peers`). A
bundle's data is its messages' data in the order of their tags, one after the other, under the
smallest tag; a rank of a worker map sends its workers' thin strips to one peer rank so (a
mapped halo exchange of small blocks: one message per peer and direction rather than one per
pair of workers).

A box *can be named without packing* when it is contiguous in its block (it moves as bytes, a
:data:`VIEW`) or when its block is C-ordered and its contiguous runs are at least
:data:`~linop.backends.mpi.datatypes.PACK_BELOW` bytes long (a subarray datatype,
:data:`STRIDED`); thinner boxes are faster packed with numpy (:data:`BUFFER`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ...program import RankPhase
from ...space import Region
from .. import host_phase
from ..host_phase import BUFFER, STRIDED, VIEW, Message, PhaseRecipe
from .datatypes import PACK_BELOW, BufferSpec, contiguous_run, mpi, subarray
from .mpi_types import Datatype

__all__ = [
    "phase_recipe",
    "route_of",
    "direct_spec",
    "bundles",
    "BUNDLE_UP_TO",
]


def route_of(array: np.ndarray, region: Region, index: tuple[Any, ...]) -> tuple[int, Datatype | None]:
    """How ``array[index]`` (the box ``region`` of ``array``, of the run's dtype) moves: as a
    contiguous view, through its subarray datatype, or packed into a buffer (see the module
    docstring)."""
    if array[index].flags.c_contiguous:
        return VIEW, None
    if array.flags.c_contiguous:
        extents = tuple(b - a for a, b in zip(region.start, region.stop))
        if contiguous_run(array.shape, extents, array.itemsize) >= PACK_BELOW:
            return STRIDED, subarray(array.shape, region.start, extents, array.dtype)
    return BUFFER, None


def direct_spec(array: np.ndarray, message: Message) -> BufferSpec:
    """The MPI buffer spec of a :data:`VIEW` or :data:`STRIDED` message on its block ``array``."""
    if message.route == VIEW:
        view = array[message.box]
        return [view, view.nbytes, mpi().BYTE]
    return [array, 1, message.datatype]


def phase_recipe(
    phase: RankPhase,
    dtype: np.dtype,
    target: Callable[[str], np.ndarray],
    source: Callable[[str], np.ndarray],
) -> PhaseRecipe:
    """The host kit's recipe of ``phase`` with MPI's rule (:func:`route_of`): ``target`` and
    ``source`` as in :func:`linop.backends.host_phase.phase_recipe`."""
    return host_phase.phase_recipe(phase, dtype, target, source, route_of)


BUNDLE_UP_TO = 4096
"""The most bytes a bundle carries. Measured here (MPICH, shared memory, 2 ranks): four
messages of 1 KiB each take about 8 us as four requests and 4 us as one struct datatype; at
2 KiB each the two are even, and from 4 KiB each the struct is slower (11 against 9 us; 3.8
against 2.4 ms at 2 MiB each, where MPICH packs it), so only small messages are bundled."""


def bundles(messages: Sequence[Message], itemsize: int) -> list[list[int]]:
    """The messages of one direction of a phase (its receives, or its sends) grouped per peer
    into bundles: the positions in ``messages`` of each group, the group of a single message
    included. Each peer's messages, in the order of their tags, fill bundles of at most
    :data:`BUNDLE_UP_TO` bytes (entries of ``itemsize`` bytes) one after the other; a larger
    message, and a transfer making a new block (its receive's buffer becomes the block), move
    alone. Both ends derive the same bundles from the transfers they share, however each
    groups its transfers into phases, provided each end holds them in one phase; a bound plan
    uses the bundles between two ranks only when both list the same ones
    (:func:`~linop.backends.mpi.compiled.bundle_peers`)."""
    by_peer: dict[int, list[int]] = {}
    groups: list[list[int]] = []
    for position, message in enumerate(messages):
        if message.transfer.mode == "new":  # on both ends
            groups.append([position])
        else:
            by_peer.setdefault(message.peer, []).append(position)
    for positions in by_peer.values():
        group: list[int] = []
        filled = 0
        for position in sorted(positions, key=lambda position: messages[position].tag):
            size = math.prod(messages[position].transfer.shape) * itemsize
            if group and filled + size > BUNDLE_UP_TO:
                groups.append(group)
                group, filled = [], 0
            group.append(position)
            filled += size
        groups.append(group)
    return groups
