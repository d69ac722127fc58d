"""The distributed program: an operator tree as data that any executor can run.

This package imports no engine (no mpi4py, torch or jax, not even lazily), and it plans all
that does not depend on one; the executors at the edge (:mod:`linop.backends.mpi`,
:mod:`linop.backends.torch_distributed`, :mod:`linop.backends.jax`) consume what it builds. Compilation has three
passes, all deterministic, so every process that holds the same tree computes the same program:

1. **Lowering** (:mod:`linop.program.lowering`) turns the tree into a flat list of *steps*
   (:mod:`linop.program.steps`): local steps on one worker, *transfers* between two workers,
   and the algebra's scale, zero and sum of branches. Its fast paths (:func:`lowering`: the
   halo exchange, :mod:`~linop.program.lowering_halo`, as transfers; the collectives as a
   :class:`FastPathStep` whose rank parts are the engine-neutral records of
   :mod:`linop.program.parts`) live here too: the registry's ``"program"`` entry lists this
   package alone.
2. **Batching** (:func:`batch`, :mod:`linop.program.batching`) groups consecutive transfers
   into *phases*.
3. **Projection** (:func:`project`, :mod:`linop.program.projection`) keeps, for one rank and
   a worker map (the identity by default), the rank steps it takes part in.

:func:`compile_program` builds the global :class:`Program`; :func:`compile_for_rank` one rank's
:class:`RankProgram` from its own steps only (:func:`lower_for`; under a worker map, its
workers' steps, :func:`lower_for_workers`). :func:`fingerprint` digests a
tree so that the ranks can check they hold the same one.

The contract an executor keeps
------------------------------
A rank's state holds the blocks of the workers the rank runs. The rank runs its schedule in
order, step after step:

- a node (a local step): run it on the rank's blocks with the numpy interpreter's handler;
- a :class:`RankPhase`: the transfers of one *phase*. A phase guarantees that its transfers do
  not conflict (none reads or writes what another writes; two adds into one region commute), so
  they may run in any order or all at once. The executor starts every receive of its part,
  then every send, and completes them all before the next step; a received transfer then adds
  into (``"add"``), stores into (``"store"``) or creates (``"new"``) its target, and the sender
  keeps, clears or drops its source (``after``) once the send has completed;
- a :class:`RankOverlap`: a phase with local work that may run while its messages are in
  flight (an overlapped halo exchange's interior products, :class:`~linop.overlap.OverlappedHalo`).
  The executor starts the phase's receives and sends, runs the ``during`` nodes on the rank's
  blocks, waits, then finishes the phase as above. The nodes read and write nothing the phase's
  transfers touch (batching moved them into the phase only across steps they commute with), so
  an executor that cannot overlap runs the phase and then the nodes, with the same result;
  ``phase`` is None when the rank has no message in it (the nodes just run);
- a :class:`LocalMoves` (under a worker map): the transfers between two of the rank's workers,
  done as local copies with the same semantics, after the messages of their phase;
- :class:`Scale` multiplies every block the rank holds; :class:`RankZero` replaces the state by
  zeros of the listed blocks; :class:`RankBranches` runs each term's schedule on the same input
  and adds the results blockwise over the listed range blocks;
- a fast path's :class:`RankPart` (:mod:`linop.program.parts`): run with the executor's own
  calls for its type (a table from part type to calls; an executor without a row for it lowers
  with :func:`lower_portable`, whose program holds no fast-path steps).

**Tags.** Each message carries a tag: the number of earlier messages between the same ordered
pair (source rank, destination rank) in program order, modulo :data:`TAG_LIMIT`. Both ends see
the transfers between them in program order, so they derive the same tag, however each groups
its transfers into phases (a rank's own batching may give fewer, larger phases than the global
program's). An executor whose channels are ordered per pair may match messages by order alone;
one that matches by tag must keep messages between a pair in program order beyond the limit.

**Why batching cannot deadlock.** Phases are runs of consecutive steps in program order on
every rank, and a rank waits only for the messages of its current phase, all of them started
before it waits. Take the earliest transfer, in program order, that is not finished: every
earlier transfer is finished, so each of its two ends has reached the phase holding it and has
started it; it therefore finishes. By induction every transfer does. Fast-path steps make their
collective calls in one global order of their groups, which cannot deadlock for the same
reason: the first unfinished group in that order has all its members inside it.
"""

from __future__ import annotations

from . import (  # noqa: F401 - register the lowerings
    lowering_all_reduce,
    lowering_all_to_all,
    lowering_gather,
    lowering_halo,
    lowering_local,
    lowering_overlap,
    lowering_pieces,
    lowering_rooted,
    lowering_shims,
    steps,
)
from .batching import batch
from .compile import Program, RankProgram, compile_for_rank, compile_program, mapped_global_program
from .fingerprinting import fingerprint
from .lowering import (
    INTERPRETER,
    Lowering,
    expansion_part,
    lower,
    lower_for,
    lower_for_workers,
    lower_portable,
    lowering,
    lowering_mapping,
    lowering_rank,
    lowering_workers,
    lowers_per_worker,
    movement_footprint,
    note_workers,
    per_worker,
    workers_named,
)
from .projection import TAG_LIMIT, owned_blocks, project
from .steps import *  # noqa: F403 - the steps are the program's vocabulary, all re-exported
from .workers import WorkerMap

__all__ = [
    "INTERPRETER",
    "Lowering",
    "lowering",
    "expansion_part",
    "lower",
    "lower_for",
    "lower_portable",
    "lower_for_workers",
    "lowering_mapping",
    "lowering_rank",
    "lowering_workers",
    "lowers_per_worker",
    "per_worker",
    "note_workers",
    "movement_footprint",
    "workers_named",
    "batch",
    "TAG_LIMIT",
    "project",
    "owned_blocks",
    "WorkerMap",
    "Program",
    "RankProgram",
    "compile_program",
    "compile_for_rank",
    "mapped_global_program",
    "fingerprint",
]
__all__ += steps.__all__
