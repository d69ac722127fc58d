"""How a communication phase moves on MPI: the one recipe its three executors follow.

A rank's phase (:class:`~linop.program.RankPhase`) lists the transfers it receives and sends.
The MPI interpreter runs phases three ways: the ordinary runtime posts nonblocking requests on
each call (:mod:`linop.backends.mpi.runtime`), the checked apply's in-place path makes
persistent requests once per layout of the caller's arrays
(:mod:`linop.backends.mpi.inplace_phases`), and a bound plan makes them once on fixed arrays
(:mod:`linop.backends.mpi.compiled`). *What* moves *where* is decided here, once, for all three
(:func:`phase_recipe`); the executors only differ in *when* they make their requests:

- a receive of a new block (``mode="new"``) lands in a fresh buffer that becomes the block (a
  block of size 0 is still created, with no message);
- a receive that stores into a box of a block of the run's dtype lands straight in the block
  when the box can be named without packing (:func:`route_of`), else in a buffer copied into
  the box after the wait; a receive that adds into a box always lands in a buffer, added after
  the wait;
- a send leaves straight from its block when the block is of the run's dtype and the box can be
  named without packing, else from a buffer it is packed (and cast) into before it starts;
- other empty transfers move nothing;
- after the wait, the sources marked ``after="clear"`` are zeroed (non-empty boxes) and those
  marked ``"drop"`` dropped.

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
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import numpy as np

from ...program import RankPhase, Transfer
from ...space import Region
from .datatypes import PACK_BELOW, BufferSpec, contiguous_run, mpi, subarray

if TYPE_CHECKING:  # pragma: no cover - mpi4py is optional at run time
    from mpi4py.MPI import Datatype

__all__ = [
    "VIEW",
    "STRIDED",
    "BUFFER",
    "Message",
    "PhaseRecipe",
    "phase_recipe",
    "route_of",
    "direct_spec",
    "bundles",
    "BUNDLE_UP_TO",
]

VIEW, STRIDED, BUFFER = 0, 1, 2
"""How a message's data is named: the box's own memory as bytes (:data:`VIEW`), the whole block
with the box's subarray datatype (:data:`STRIDED`), or a scratch buffer of the transfer's shape
(:data:`BUFFER`: packed before a send starts; stored, added or made the new block after a
receive completes)."""


class Message(NamedTuple):
    """One message of a phase on this rank, as it moves.

    ``name`` and ``box`` (a numpy index) are the block and box the data leaves (a send) or
    lands in (a receive; ``()`` for a new block); ``route`` is :data:`VIEW`, :data:`STRIDED` (with the
    box's subarray ``datatype``) or :data:`BUFFER`."""

    peer: int
    tag: int
    transfer: Transfer
    name: str
    box: tuple[Any, ...]
    route: int
    datatype: Any = None


class PhaseRecipe(NamedTuple):
    """A phase's messages on this rank in posting order (every receive before every send), and
    what follows the wait besides the buffered receives: the boxes cleared and the blocks
    dropped (the sources of ``after="clear"`` / ``"drop"`` transfers)."""

    receives: tuple[Message, ...]
    sends: tuple[Message, ...]
    clears: tuple[tuple[str, tuple[Any, ...]], ...]
    drops: tuple[str, ...]


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
    """The recipe of ``phase`` in the run's ``dtype`` (see the module docstring).

    ``target(name)`` gives the array a receive stores or adds into, made writable as the
    executor does (copy-on-write); it is called once per non-empty receive into an existing
    block, in posting order, before any ``source(name)``, which gives the array a send reads.
    """
    receives = []
    for peer, tag, t in phase.receives:
        if t.mode == "new":
            receives.append(Message(peer, tag, t, t.target.name, (), BUFFER))
            continue
        if phase.empty(t):
            continue
        region = cast(Region, t.target)  # a box of an existing block (not "new")
        index = phase.index(region)
        array = target(region.name)
        route, datatype = BUFFER, None
        if t.mode == "store" and array.dtype == dtype:
            route, datatype = route_of(array, region, index)
        receives.append(Message(peer, tag, t, region.name, index, route, datatype))
    sends = []
    clears = []
    drops = []
    for peer, tag, t in phase.sends:
        if t.after == "drop":
            drops.append(t.source.name)
        if phase.empty(t):
            continue
        index = phase.index(t.source)
        if t.after == "clear":
            clears.append((t.source.name, index))
        array = source(t.source.name)
        route, datatype = BUFFER, None
        if array.dtype == dtype:
            route, datatype = route_of(array, t.source, index)
        sends.append(Message(peer, tag, t, t.source.name, index, route, datatype))
    return PhaseRecipe(tuple(receives), tuple(sends), tuple(clears), tuple(drops))


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
