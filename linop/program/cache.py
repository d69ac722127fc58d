"""Plans kept by tree: the bounded caches every executor keeps its plans and compilations in.

A tree is found first by its object's identity (held weakly: no walk of the tree), then by
:func:`tree_key`, so that structurally equal trees share a plan. An executor keeps one
:class:`PlanCache` per communicator or process group for its unmapped plans and one per worker
map (:func:`cached_plan`); :mod:`linop.program.mapped` keeps its compilations under a map the
same way. Nothing here depends on an engine.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Generic, TypeVar

from ..errors import WorkerMapError
from ..operator import LinearOperator, Scaled, walk
from .workers import WorkerMap

__all__ = ["PLAN_CACHE_SIZE", "MappingLike", "PlanCache", "tree_key", "cache_in", "cached_plan"]

PLAN_CACHE_SIZE = 128
"""Plans kept per communicator or process group (least recently used evicted first): at most
this many trees by structure, plus the plans of this many most recently used tree objects
(looked up by identity, the fast way); and the plans of at most this many worker maps."""


P = TypeVar("P")


def tree_key(op: LinearOperator) -> tuple[LinearOperator, tuple[type, ...]]:
    """The cache key of a tree: the tree itself (by ``==``) and the types of its scalars
    (``2 * A == 2.0 * A``, but the results of the two have different dtypes)."""
    return (op, tuple(type(node.alpha) for node in walk(op) if isinstance(node, Scaled)))


class PlanCache(Generic[P]):
    """Plans by tree, least recently used evicted beyond ``size``.

    Found first by the tree object's identity (held weakly: no walk of the tree), then by
    :func:`tree_key` (structurally equal trees share a plan)."""

    def __init__(self, size: int = PLAN_CACHE_SIZE) -> None:
        self.size = size
        self._by_tree: OrderedDict[tuple[LinearOperator, tuple[type, ...]], P] = OrderedDict()
        self._by_id: OrderedDict[int, tuple[weakref.ref[LinearOperator], P]] = OrderedDict()

    def __len__(self) -> int:
        """Number of distinct plans held."""
        return len({id(plan) for plan in (*self._by_tree.values(), *(p for _, p in self._by_id.values()))})

    def get(self, op: LinearOperator) -> P | None:
        """The cached plan of ``op``, or None."""
        key = id(op)
        entry = self._by_id.get(key)
        if entry is not None and entry[0]() is op:
            self._by_id.move_to_end(key)
            return entry[1]
        by_tree = tree_key(op)
        plan = self._by_tree.get(by_tree)
        if plan is not None:
            self._by_tree.move_to_end(by_tree)
            self._remember(op, plan)
        return plan

    def put(self, op: LinearOperator, plan: P) -> P:
        """Cache ``plan`` for ``op``; return it."""
        self._by_tree[tree_key(op)] = plan
        while len(self._by_tree) > self.size:
            self._by_tree.popitem(last=False)
        self._remember(op, plan)
        return plan

    def _remember(self, op: LinearOperator, plan: P) -> None:
        key, ids = id(op), self._by_id

        def forget(_ref: weakref.ref[LinearOperator]) -> None:
            ids.pop(key, None)

        ids[key] = (weakref.ref(op, forget), plan)
        while len(ids) > self.size:
            ids.popitem(last=False)

    def clear(self) -> None:
        self._by_tree.clear()
        self._by_id.clear()

    def kept(self, op: LinearOperator, make: Callable[[], P]) -> P:
        """The cached plan of ``op``, else ``make()`` cached for it."""
        found = self.get(op)
        return found if found is not None else self.put(op, make())


K = TypeVar("K")


def cache_in(caches: dict[K, PlanCache[P]], key: K, kept: int) -> PlanCache[P]:
    """The cache of ``key`` (a worker map, ...) in ``caches``, made on first use; the oldest
    key's cache out beyond ``kept`` keys."""
    cache = caches.get(key)
    if cache is None:
        if len(caches) >= kept:
            caches.pop(next(iter(caches)))
        cache = caches[key] = PlanCache()
    return cache


MappingLike = WorkerMap | Sequence[int] | Mapping[int, int]
"""What an executor's ``mapping=`` accepts: a :class:`WorkerMap`, ``ranks[w]`` per worker, or
worker -> rank."""


def cached_plan(
    plans: PlanCache[P],
    mapped_plans: dict[WorkerMap, PlanCache[P]],
    op: LinearOperator,
    mapping: MappingLike | None,
    make: Callable[[WorkerMap | WorkerMapError | None], P],
) -> P:
    """The plan of ``op`` under ``mapping`` (None: worker ``w`` on rank ``w``) from an
    executor's caches (``plans``; ``mapped_plans``, one cache per map, the oldest map's plans
    out beyond :data:`PLAN_CACHE_SIZE` maps), made by ``make`` and kept on a miss.

    A malformed ``mapping`` is not raised here: ``make`` gets its
    :class:`~linop.errors.WorkerMapError` (not kept), for the plan's entry check to report on
    every rank alike (the ranks' maps may differ)."""
    if mapping is None:
        return plans.kept(op, lambda: make(None))
    try:
        worker_map = WorkerMap.of(mapping)
    except WorkerMapError as error:
        return make(error)
    return cache_in(mapped_plans, worker_map, PLAN_CACHE_SIZE).kept(op, lambda: make(worker_map))
