"""The MPI executor's calls for the program's fast-path parts: a table from part type to calls.

The program plans every fast path (:mod:`linop.program.parts`: groups, roots, per-peer sends
and receives, engine-neutral); this package declares, per part type, the MPI step that runs it
(:data:`CALLS`), and :func:`mpi_schedule` turns a rank's schedule into one the MPI runtime runs.
The tests under ``tests/mpi/`` prove each equal to the node's expansion, rank by rank.

================================  ================================================================
part                              MPI calls
================================  ================================================================
AllReducePart                     ``Allreduce`` in place on a cached sub-communicator per group
                                  (``Allreduce_init`` persistent requests in a bound plan)
MappedAllReducePart               local sums, one ``Allreduce`` over the group's distinct ranks,
                                  the sum copied back
RootedPart (broadcast)            ``Bcast`` per source block on a cached sub-communicator, straight
                                  from the source array (the root's copy is that array, uncopied)
RootedPart (sum-reduce)           ``Allreduce`` per target block on a cached sub-communicator (on
                                  this MPICH it reaches the sum faster than ``Reduce``); the
                                  members other than the root discard their sum
MappedRootedPart                  the same around local copies or sums under a worker map
LineGatherPart                    ``Allgather`` / ``Reduce_scatter_block`` on a line's
                                  sub-communicator
LineReduceScatterPart             ``Reduce_scatter`` (counts per member) on a line's
                                  sub-communicator
AllToAllPart                      point-to-point messages with the rank's own peers (persistent
                                  requests, one ``Startall``, when bound) where every rank has few
                                  boxes (a repartition between grids: O(peers), not O(P)); else
                                  ``Alltoallw`` with subarray datatypes, or the boxes packed into
                                  one buffer for ``Alltoallv`` (contiguous boxes sent or received
                                  in place); chosen per step by a rule alike on every rank
                                  (``all_to_all_strategy``, recorded as the step's ``strategy``)
================================  ================================================================

The halo exchange has no row: its lowering (:mod:`linop.program.lowering_halo`) emits transfers,
which the MPI phases move with subarray datatypes straight between the blocks. Sums run natively
only for dtypes MPI can add (``REDUCIBLE``); other dtypes run the part's ``fallback`` (the
expansion), a choice every rank makes alike because the run's dtype is agreed collectively. The
collectives of one step are blocking calls made in one global order of the groups, which cannot
deadlock: the first unfinished group in that order has all its members inside it.

One module per family: :mod:`.all_reduce`, :mod:`.rooted` (broadcast and sum-reduce),
:mod:`.all_to_all` (its point-to-point path in :mod:`.all_to_all_peers`), :mod:`.gather`
(all-gather and reduce-scatter along one line, of equal or uneven shares);
:mod:`.common` holds what several share (``REDUCIBLE`` among it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Final

from ....program import RankBranches, RankPart
from ....program.parts import (
    AllReducePart,
    AllToAllPart,
    LineGatherPart,
    LineReduceScatterPart,
    MappedAllReducePart,
    MappedRootedPart,
    RootedPart,
)
from ..steps import RankStep
from .all_reduce import rank_all_reduce, rank_mapped_all_reduce
from .all_to_all import rank_all_to_all
from .gather import rank_gather, rank_reduce_scatter
from .rooted import rank_mapped_rooted, rank_rooted

__all__ = ["CALLS", "mpi_schedule"]

CALLS: Final[Mapping[type, Callable[[Any], RankStep]]] = MappingProxyType(
    {
        AllReducePart: rank_all_reduce,
        MappedAllReducePart: rank_mapped_all_reduce,
        RootedPart: rank_rooted,
        MappedRootedPart: rank_mapped_rooted,
        LineGatherPart: rank_gather,
        LineReduceScatterPart: rank_reduce_scatter,
        AllToAllPart: rank_all_to_all,
    }
)
"""Part type -> the MPI step that runs it (every type of :data:`linop.program.parts.Part`)."""


def mpi_schedule(schedule: tuple[Any, ...]) -> tuple[Any, ...]:
    """``schedule`` (a rank's, :func:`~linop.program.compile_for_rank`) with every fast-path
    part replaced by its MPI step (:data:`CALLS`; the terms of a sum too); the same tuple when
    it holds no part.

    Raises
    ------
    TypeError
        For a part whose type has no row (a program part the table does not list).
    """
    out: list[Any] = []
    changed = False
    for step in schedule:
        if isinstance(step, RankBranches):
            terms = tuple(mpi_schedule(term) for term in step.terms)
            if any(new is not old for new, old in zip(terms, step.terms)):
                step = RankBranches(terms, step.names)
                changed = True
        elif isinstance(step, RankPart) and not isinstance(step, RankStep):
            calls = CALLS.get(type(step))
            if calls is None:
                raise TypeError(f"the MPI executor has no calls for the part {type(step).__name__}")
            step = calls(step)
            changed = True
        out.append(step)
    return tuple(out) if changed else schedule
