r"""Collective algorithms as operator trees, each equal to its mathematical collective
(``docs/theory.md#collective-algorithms``).

A collective (broadcast, reduce, all-reduce, all-gather, reduce-scatter, all-to-all) is one
linear operator; an *algorithm* is one way of composing it from send-receives, copies and adds.
Every variant here returns a tree over the same spaces as the collective node of
:mod:`linop.collectives` / :mod:`linop.repartition`, so ``verify.equal(variant, collective)``
proves it exactly, and ``variant.H`` (derived by rules) is the reverse algorithm.

:data:`VARIANTS` lists every variant by collective, each with the variant that its adjoint
equals; :func:`problem` builds the layouts of one collective for P workers and a length, with
the reference node and every variant on them. :mod:`linop.algorithms.chooser` picks the
cheapest variant under a fitted cost model (:mod:`linop.algorithms.calibrate`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..collectives import AllGather, AllReduce, BlockGrid, Broadcast
from ..operator import LinearOperator
from ..partition import DistributedTensor, Partition, balanced_sizes
from ..repartition import Repartition
from . import allreduce, alltoall, broadcast, gather
from .common import AlgorithmError, Fold, Steps, fold

__all__ = [
    "COLLECTIVES",
    "VARIANTS",
    "AlgorithmError",
    "Fold",
    "Problem",
    "Steps",
    "Variant",
    "fold",
    "problem",
]


@dataclass(frozen=True)
class Variant:
    """One algorithm of one collective.

    ``build(*problem.arguments)`` makes its tree; ``reverse`` names the variant (of the adjoint
    collective) that its adjoint equals; ``needs`` says what layouts it accepts, if limited.
    """

    collective: str
    name: str
    build: Callable[..., LinearOperator]
    reverse: tuple[str, str]
    needs: str = ""


def _reduce_scatter_gather(tensor: Any, partition: Partition, name: str) -> LinearOperator:
    """The reverse of the scatter + all-gather broadcast: a ring reduce-scatter of the copies'
    chunks, then a binomial gather of the chunks onto the root (derived as the adjoint tree)."""
    return broadcast.broadcast_scatter_allgather(tensor, partition, name).H


def _pairwise_reverse(x: DistributedTensor, y: DistributedTensor) -> LinearOperator:
    return alltoall.alltoall_pairwise(y, x)


def _bruck_reverse(x: DistributedTensor, y: DistributedTensor) -> LinearOperator:
    return alltoall.alltoall_bruck(x, y).H


def _duals(forward: str, backward: str, rows: Sequence[tuple[Any, ...]]) -> list[Variant]:
    """The variants of two collectives each other's adjoints, one row per pair of reverses:
    ``(name, build, reverse's name, reverse's build)``, then what both need if limited; the
    forward collective's variants first, in the rows' order. A self-adjoint collective
    (``forward == backward``) gives rows ``(name, build)``, each variant its own reverse."""
    if forward == backward:
        return [Variant(forward, name, build, (forward, name)) for name, build in rows]
    return [Variant(forward, row[0], row[1], (backward, row[2]), *row[4:]) for row in rows] + [
        Variant(backward, row[2], row[3], (forward, row[0]), *row[4:]) for row in rows
    ]


_LIST = [
    *_duals(
        "broadcast",
        "reduce",
        [
            ("linear", broadcast.broadcast_linear, "linear", broadcast.reduce_linear),
            ("binomial", broadcast.broadcast_binomial, "binomial", broadcast.reduce_binomial),
            (
                "scatter_allgather",
                broadcast.broadcast_scatter_allgather,
                "reduce_scatter_gather",
                _reduce_scatter_gather,
            ),
        ],
    ),
    *_duals(
        "allreduce",
        "allreduce",
        [
            ("reduce_broadcast_linear", allreduce.allreduce_reduce_broadcast_linear),
            ("reduce_broadcast_binomial", allreduce.allreduce_reduce_broadcast_binomial),
            ("recursive_doubling", allreduce.allreduce_recursive_doubling),
            ("ring", allreduce.allreduce_ring),
            ("rabenseifner", allreduce.allreduce_rabenseifner),
        ],
    ),
    *_duals(
        "allgather",
        "reduce_scatter",
        [
            ("ring", gather.allgather_ring, "ring", gather.reduce_scatter_ring),
            (
                "recursive_doubling",
                gather.allgather_recursive_doubling,
                "recursive_halving",
                gather.reduce_scatter_recursive_halving,
            ),
        ],
    ),
    *_duals(
        "alltoall",
        "alltoall_reverse",
        [
            ("pairwise", alltoall.alltoall_pairwise, "pairwise", _pairwise_reverse),
            ("bruck", alltoall.alltoall_bruck, "bruck", _bruck_reverse, "equal row shares"),
        ],
    ),
]

VARIANTS: dict[str, dict[str, Variant]] = {}
for _variant in _LIST:
    VARIANTS.setdefault(_variant.collective, {})[_variant.name] = _variant
del _variant

COLLECTIVES: tuple[str, ...] = tuple(VARIANTS)
"""The collectives that have variants: broadcast, reduce, allreduce, allgather,
reduce_scatter, alltoall and alltoall_reverse (the reverse repartition y -> x, the all-to-all's
adjoint)."""


@dataclass(frozen=True)
class Problem:
    """One collective on concrete layouts: the arguments of its variants and its reference node.

    ``variant(name)`` builds that variant's tree; ``variants()`` every one that accepts the
    layouts (a variant that raises :class:`AlgorithmError` for them is left out).
    """

    collective: str
    size: int
    arguments: tuple[Any, ...]
    reference: LinearOperator

    def variant(self, name: str) -> LinearOperator:
        """The tree of variant ``name``."""
        try:
            chosen = VARIANTS[self.collective][name]
        except KeyError:
            known = sorted(VARIANTS.get(self.collective, {}))
            raise AlgorithmError(f"{self.collective} has no variant {name!r} (variants: {known})") from None
        return chosen.build(*self.arguments)

    def variants(self) -> dict[str, LinearOperator]:
        """Every variant that accepts these layouts, by name."""
        built = {}
        for name in VARIANTS[self.collective]:
            try:
                built[name] = self.variant(name)
            except AlgorithmError:
                continue
        return built


def problem(
    collective: str,
    size: int,
    length: int | Sequence[int],
    *,
    root: int = 0,
    rows: int = 1,
) -> Problem:
    """Layouts of ``collective`` over workers ``0 .. size - 1`` (1-d float data, any dtype).

    Parameters
    ----------
    collective : str
        One of :data:`COLLECTIVES`.
    size : int
        Number of workers P.
    length : int or sequence of int
        broadcast, reduce, allreduce: the length n of the block (every worker's vector);
        allgather, reduce_scatter: the gathered length (balanced shares) or the P shares;
        alltoall: what each worker sends in all, cut into P column shares (balanced, or the P
        shares given), ``rows`` rows per worker.
    root : int, optional
        The root worker of broadcast and reduce.
    rows : int, optional
        Rows per worker of the all-to-all (its pieces are ``rows x share``).

    Raises
    ------
    AlgorithmError
        For an unknown collective or a share count that differs from ``size``.
    """
    if not isinstance(collective, str) or collective not in VARIANTS:
        raise AlgorithmError(f"no collective {collective!r}; known: {list(VARIANTS)}")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise AlgorithmError(f"{collective}: the number of workers must be a positive integer, not {size!r}")
    partition = Partition.grid(size)
    if collective in ("broadcast", "reduce", "allreduce"):
        if not isinstance(length, int):
            raise AlgorithmError(
                f"{collective}: length must be one integer (the block length), not {length!r}"
            )
        if collective == "allreduce":
            layout = BlockGrid.uniform("x", partition, (length,))
            return Problem(collective, size, (layout,), AllReduce(layout, (0,)))
        source = BlockGrid("x", Partition((1,), (root,)), ((length,),))
        node = Broadcast(source, partition, "y")
        return Problem(
            collective, size, (source, partition, "y"), node if collective == "broadcast" else node.H
        )
    shares = _shares(collective, size, length)
    if collective in ("allgather", "reduce_scatter"):
        tensor = DistributedTensor("x", (sum(shares),), partition, sizes=(shares,))
        gather = AllGather(tensor, (0,), "g")
        return Problem(collective, size, (tensor, "g"), gather if collective == "allgather" else gather.H)
    x, y = alltoall.alltoall_tensors((rows,) * size, shares)
    reference = Repartition(x, y)
    return Problem(collective, size, (x, y), reference if collective == "alltoall" else reference.H)


def _shares(collective: str, size: int, length: int | Sequence[int]) -> tuple[int, ...]:
    if isinstance(length, int):
        return balanced_sizes(length, size)
    shares = tuple(length)
    if len(shares) != size:
        raise AlgorithmError(f"{collective}: {len(shares)} shares for {size} workers")
    return shares
