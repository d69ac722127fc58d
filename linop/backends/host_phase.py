"""What moves where in a communication phase, for every executor that keeps its blocks in host
memory: :func:`phase_recipe`, the one recipe the MPI executor's three runtimes and the
torch.distributed host path follow.

A rank's phase (:class:`~linop.program.RankPhase`) lists the transfers it receives and sends.
The recipe decides, once per phase, how each message names its data; the executor passes its
*route rule* (what its engine can move without a copy: MPI a contiguous box or, through a
subarray datatype, a strided one, :func:`linop.backends.mpi.phase_recipe.route_of`;
torch.distributed a contiguous, writeable box only, :func:`contiguous_route`):

- a receive of a new block (``mode="new"``) lands in a fresh buffer that becomes the block (a
  block of size 0 is still created, with no message);
- a receive that stores into a box of a block of the run's dtype lands straight in the block
  when the rule names the box, else in a buffer copied into the box after the wait; a receive
  that adds into a box always lands in a buffer, added after the wait;
- a send leaves straight from its block when the block is of the run's dtype and the rule names
  the box, else from a buffer it is packed (and cast) into before it starts;
- other empty transfers move nothing;
- after the wait, the sources marked ``after="clear"`` are zeroed (non-empty boxes) and those
  marked ``"drop"`` dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, cast

import numpy as np

from ..program import RankPhase, Transfer
from ..space import Region

__all__ = [
    "VIEW",
    "STRIDED",
    "BUFFER",
    "Message",
    "PhaseRecipe",
    "RouteRule",
    "contiguous_route",
    "phase_recipe",
]

VIEW, STRIDED, BUFFER = 0, 1, 2
"""How a message's data is named: the box's own memory (:data:`VIEW`), the whole block with a
description of the box the engine reads (:data:`STRIDED`: MPI's subarray datatype, in
``Message.datatype``), or a scratch buffer of the transfer's shape (:data:`BUFFER`: packed
before a send starts; stored, added or made the new block after a receive completes)."""

RouteRule = Callable[[np.ndarray, Region, tuple[Any, ...]], tuple[int, Any]]
"""An executor's rule: ``(block, box, its numpy index)`` of the run's dtype -> ``(route, what
the engine needs to name it, or None)``."""


class Message(NamedTuple):
    """One message of a phase on this rank, as it moves.

    ``name`` and ``box`` (a numpy index) are the block and box the data leaves (a send) or
    lands in (a receive; ``()`` for a new block); ``route`` is :data:`VIEW`, :data:`STRIDED`
    (with what names the box, ``datatype``) or :data:`BUFFER`."""

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


def contiguous_route(array: np.ndarray, region: Region, index: tuple[Any, ...]) -> tuple[int, Any]:
    """The rule of an engine that moves a box straight only when its memory is one C-ordered,
    writeable run (torch.distributed: a tensor sharing the array's memory)."""
    view = array[index]
    return (VIEW, None) if view.flags.c_contiguous and view.flags.writeable else (BUFFER, None)


def phase_recipe(
    phase: RankPhase,
    dtype: np.dtype,
    target: Callable[[str], np.ndarray],
    source: Callable[[str], np.ndarray],
    route: RouteRule,
) -> PhaseRecipe:
    """The recipe of ``phase`` in the run's ``dtype`` under the executor's ``route`` rule (see
    the module docstring).

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
        how, datatype = BUFFER, None
        if t.mode == "store" and array.dtype == dtype:
            how, datatype = route(array, region, index)
        receives.append(Message(peer, tag, t, region.name, index, how, datatype))
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
        how, datatype = BUFFER, None
        if array.dtype == dtype:
            how, datatype = route(array, t.source, index)
        sends.append(Message(peer, tag, t, t.source.name, index, how, datatype))
    return PhaseRecipe(tuple(receives), tuple(sends), tuple(clears), tuple(drops))
