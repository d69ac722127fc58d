"""Fast paths of the MPI interpreter: native collectives and the halo exchange.

Each fast path is a *lowering* (:func:`linop.program.lowering`) that replaces a
node's expansion by steps that do the same thing with fewer, larger MPI calls; the tests under
``tests/mpi/`` prove each equal to the expansion, rank by rank.

=============================  ===============================================================
node                           MPI execution
=============================  ===============================================================
HaloStage (and its adjoint)    one phase of nonblocking point-to-point messages straight
                               between the local blocks (subarray datatypes: the bulk is never
                               copied); local pairs are plain copies (adjoint: adds and clears)
AllReduce                      ``Allreduce`` in place on a cached sub-communicator per group
                               (``Allreduce_init`` persistent requests in a bound plan)
Broadcast                      ``Bcast`` per source block on a cached sub-communicator, straight
                               from the source array (the root's copy is that array, uncopied)
SumReduce                      ``Allreduce`` per target block on a cached sub-communicator (on
                               this MPICH it reaches the sum faster than ``Reduce``); the
                               members other than the root discard their sum
other copying plans           one all-to-all when every worker gives and gets at most one block:
(repartition, scatter,         ``Alltoallw`` with subarray datatypes, or the boxes packed into one
gather, all-gather)            buffer for ``Alltoallv`` (contiguous boxes sent or received in
                               place), chosen per step by a measured rule (``alltoall_strategy``,
                               recorded as the step's ``strategy``); otherwise, and for adding
                               plans (reduce-scatter), the expansion: one phase of point-to-point
                               messages with subarray datatypes
=============================  ===============================================================

A collective fast path applies when every group has its members on distinct workers and moves
whole blocks; otherwise the lowering declines and the node runs through its expansion. Sums
run natively only for dtypes MPI can add (``REDUCIBLE``); other dtypes run the expansion, a
choice every rank makes alike because the run's dtype is agreed collectively. The collectives of
one step are blocking calls made in one global order of the groups, which cannot deadlock: the
first unfinished group in that order has all its members inside it.

One module per family: :mod:`.halo` (the halo exchange), :mod:`.all_reduce` (the
all-reduce, also under a worker map), :mod:`.rooted` (broadcast and sum-reduce),
:mod:`.all_to_all` (the all-to-all of copying plans and the dispatch of any
:class:`~linop.collectives.Planned` node), :mod:`.gather` (all-gather and reduce-scatter along
one line); :mod:`.common` holds what several share (``REDUCIBLE`` among it). Importing this
package imports them all, which registers every lowering.
"""

from . import all_reduce, all_to_all, gather, halo, rooted  # noqa: F401 - registers the lowerings
