r"""Which workers of a torch module's trees this process runs: :class:`Placement`.

Every torch module of :mod:`linop.frameworks` takes ``mapping=``, the executors' worker map
(:class:`~linop.program.WorkerMap`, a sequence ``ranks[w]`` or a dict of worker to rank;
default worker ``w`` on rank ``w``). The module passes it down to every tree it runs, and its
own "my workers" (the blocks it takes and gives back, the local products it computes, the
parameter blocks it owns, the process that gets a loss) are the workers the map puts on this
process's rank:

.. math::

    \text{mine} = \{\, w : r(w) = \text{rank} \,\}, \qquad
    r(w) = \texttt{mapping.rank\_of}(w) \quad (\text{default } r(w) = w)

so a rank may hold several workers or none. In one process (no ``comm``, no ``group``) every
worker runs here and the map is not used, as in
:class:`~linop.frameworks.torch_function.TorchOperator`.

The map is checked when the module is built, from the map and the size of the communicator or
group alone, so every rank given the same map raises the same error before any communication:
a malformed map, a worker of the module's trees left out, or a rank the communicator or group
lacks is :class:`~linop.errors.WorkerMapError` (the executors' words, naming the worker).
Ranks given different maps build their modules, and the first call's collective entry check
raises :class:`~linop.errors.WorkerMapMismatchError` on every rank, as the executors do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from ..operator import LinearOperator
from ..partition import Partition
from ..program import WorkerMap
from .torch_function import process_rank

__all__ = ["Placement", "workers_of"]


class Placement:
    """This process's place among the workers of a module's trees.

    Parameters
    ----------
    mapping : WorkerMap, sequence of int or dict of int to int, or None
        The rank of each worker (None: worker ``w`` on rank ``w``).
    comm, group
        The module's engine arguments (neither: one process).
    workers : iterable of int, or a function of no arguments giving them
        The workers the map must place: those of the module's trees
        (:func:`workers_of`). A function is called only when there is a map to check
        (the set is O(P) to build, and without a map nothing needs it).

    Attributes
    ----------
    rank : int or None
        This process's rank (None in one process).
    map : WorkerMap or None
        The map as a :class:`~linop.program.WorkerMap`; None without one or in one process.
        What the module passes down to its trees.

    Raises
    ------
    WorkerMapError
        Across processes: ``mapping`` is malformed, leaves one of ``workers`` out or puts
        one on a rank the communicator or group lacks (the smallest such worker named).
    """

    __slots__ = ("map", "rank")

    def __init__(
        self, mapping: Any, comm: Any, group: Any, workers: Iterable[int] | Callable[[], Iterable[int]] = ()
    ) -> None:
        self.rank = process_rank(comm, group)
        self.map: WorkerMap | None = None
        if self.rank is None or mapping is None:
            return
        self.map = WorkerMap.of(mapping)
        problem = self.map.problem(workers() if callable(workers) else workers, _size(comm, group))
        if problem is not None:
            raise problem

    def holds(self, worker: int) -> bool:
        """Whether this process runs ``worker`` (always in one process).

        Raises
        ------
        WorkerMapError
            ``worker`` is not in the map.
        """
        if self.rank is None:
            return True
        return self.rank_of(worker) == self.rank

    def held(self, partition: Partition) -> list[tuple[int, ...]]:
        """The grid indices of ``partition`` whose workers this process runs, in C order:
        ``[g for g in partition.indices() if self.holds(partition.worker(g))]``, found from
        this rank's own workers (its rank without a map, ``map.workers_on(rank)`` with one)
        rather than by testing every block, except in one process (every index) and where
        this rank holds more workers than ``partition`` has blocks.

        The map is taken to place every worker of ``partition`` (the constructor checks the
        workers it is given: a module passes those of all its trees); a worker it leaves out
        is not found here, and is tested (:class:`~linop.errors.WorkerMapError`, as
        :meth:`holds` raises) only where every block is tested.
        """
        if self.rank is None:
            return list(partition.indices())
        mine = (self.rank,) if self.map is None else self.map.workers_on(self.rank)
        if len(mine) > partition.size:  # more workers here than blocks: test the blocks
            return [g for g in partition.indices() if self.holds(partition.worker(g))]
        positions = sorted(p for p in (partition.position(w) for w in mine) if p is not None)
        return [partition.index(partition.workers[p]) for p in positions]

    def rank_of(self, worker: int) -> int:
        """The rank that runs ``worker`` (``worker`` itself without a map).

        Raises
        ------
        WorkerMapError
            ``worker`` is not in the map.
        """
        return worker if self.map is None else self.map.rank_of(worker)


def workers_of(*trees: LinearOperator | None) -> set[int]:
    """The workers of the trees' domains and ranges (None: no tree)."""
    workers: set[int] = set()
    for tree in trees:
        if tree is not None:
            workers.update(tree.domain.workers)
            workers.update(tree.range.workers)
    return workers


def _size(comm: Any, group: Any) -> int:
    """The number of ranks of ``comm`` or of ``group``."""
    if comm is not None:
        return int(comm.size)
    from ..backends import torch_distributed

    return torch_distributed.plan_context(group).size
