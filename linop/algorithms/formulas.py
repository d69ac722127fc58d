r"""Closed-form alpha-beta-gamma times of the variants for P a power of two
(``docs/theory.md#cost-model``).

With L = log2 P, a message of m bytes costing alpha + beta m and an add of m bytes gamma m, and
``nbytes`` the size n of one worker's buffer (the block of broadcast, reduce and all-reduce; the
gathered vector N of all-gather and reduce-scatter; what one worker sends in all, N, in an
all-to-all):

=======================================  =========================================================
collective / variant                     time
=======================================  =========================================================
broadcast / linear                       (P-1) (alpha + beta n)
broadcast / binomial                     L (alpha + beta n)
broadcast / scatter_allgather            (L + P - 1) alpha + 2 (P-1)/P beta n
reduce / linear                          (P-1) (alpha + (beta + gamma) n)
reduce / binomial                        L (alpha + (beta + gamma) n)
reduce / reduce_scatter_gather           (L + P - 1) alpha + 2 (P-1)/P (beta + gamma) n
allreduce / reduce_broadcast_linear      2 (P-1) (alpha + beta n) + (P-1) gamma n
allreduce / reduce_broadcast_binomial    2 L (alpha + beta n) + L gamma n        (survey: T_tree)
allreduce / recursive_doubling           L (alpha + beta n + gamma n)            (survey: T_bfly)
allreduce / ring                         2 (P-1) (alpha + beta n/P) + (P-1) gamma n/P  (T_pipe)
allreduce / rabenseifner                 2 L alpha + 2 (P-1)/P beta n + (P-1)/P gamma n  (T_rabe)
allgather / ring                         (P-1) (alpha + beta N/P)
allgather / recursive_doubling           L alpha + (P-1)/P beta N
reduce_scatter / ring                    (P-1) (alpha + (beta + gamma) N/P)
reduce_scatter / recursive_halving       L alpha + (P-1)/P (beta + gamma) N
alltoall / pairwise                      (P-1) (alpha + beta N/P)
alltoall / bruck                         L (alpha + beta N/2)
=======================================  =========================================================

With gamma = 0 the all-reduce rows are the survey's (Ben-Nun and Hoefler, section 2.5), whose
gamma is the size of one value: their gamma m is our n. The lower bound for an all-reduce
without redundant computation is L alpha + 2 (P-1)/P beta n; Rabenseifner attains it in the
bandwidth term. The reduce by reduce-scatter and gather is the derived adjoint of the scatter +
all-gather broadcast, so its gather *adds* each chunk into the root's (zero) buffer where the
scatter copied: (P-1)/P gamma n more than a gather that stores would cost. The tests check that :func:`linop.accounting.account` of every variant's tree
gives these times exactly when P is a power of two and the shares divide evenly.
"""

from __future__ import annotations

import math

from ..accounting import CostModel
from .common import AlgorithmError

__all__ = ["FORMULAS", "formula_time"]


def _log(size: int) -> int:
    if size < 1 or size & (size - 1):
        raise AlgorithmError(f"the closed forms hold for powers of two, not P = {size}")
    return int(math.log2(size))


def _t(p: int, n: float, a: float, b: float, g: float, name: str) -> float:
    L = _log(p)  # noqa: N806 - the formulas' name
    f = (p - 1) / p
    return {
        ("broadcast", "linear"): (p - 1) * (a + b * n),
        ("broadcast", "binomial"): L * (a + b * n),
        ("broadcast", "scatter_allgather"): (L + p - 1) * a + 2 * f * b * n,
        ("reduce", "linear"): (p - 1) * (a + (b + g) * n),
        ("reduce", "binomial"): L * (a + (b + g) * n),
        ("reduce", "reduce_scatter_gather"): (L + p - 1) * a + 2 * f * (b + g) * n,
        ("allreduce", "reduce_broadcast_linear"): 2 * (p - 1) * (a + b * n) + (p - 1) * g * n,
        ("allreduce", "reduce_broadcast_binomial"): 2 * L * (a + b * n) + L * g * n,
        ("allreduce", "recursive_doubling"): L * (a + b * n + g * n),
        ("allreduce", "ring"): 2 * (p - 1) * (a + b * n / p) + (p - 1) * g * n / p,
        ("allreduce", "rabenseifner"): 2 * L * a + 2 * f * b * n + f * g * n,
        ("allgather", "ring"): (p - 1) * (a + b * n / p),
        ("allgather", "recursive_doubling"): L * a + f * b * n,
        ("reduce_scatter", "ring"): (p - 1) * (a + (b + g) * n / p),
        ("reduce_scatter", "recursive_halving"): L * a + f * (b + g) * n,
        ("alltoall", "pairwise"): (p - 1) * (a + b * n / p),
        ("alltoall", "bruck"): L * (a + b * n / 2),
    }[tuple(name.split("/"))]  # type: ignore[index]


FORMULAS: tuple[str, ...] = (
    "broadcast/linear",
    "broadcast/binomial",
    "broadcast/scatter_allgather",
    "reduce/linear",
    "reduce/binomial",
    "reduce/reduce_scatter_gather",
    "allreduce/reduce_broadcast_linear",
    "allreduce/reduce_broadcast_binomial",
    "allreduce/recursive_doubling",
    "allreduce/ring",
    "allreduce/rabenseifner",
    "allgather/ring",
    "allgather/recursive_doubling",
    "reduce_scatter/ring",
    "reduce_scatter/recursive_halving",
    "alltoall/pairwise",
    "alltoall/bruck",
)
"""The ``collective/variant`` pairs that have a closed form."""


def formula_time(collective: str, variant: str, size: int, nbytes: float, model: CostModel) -> float:
    """The closed-form time of ``variant`` of ``collective`` on ``size`` workers (a power of
    two) for ``nbytes`` per worker (see the table above).

    Raises
    ------
    AlgorithmError
        If ``size`` is not a power of two or the pair has no closed form.
    """
    key = f"{collective}/{variant}"
    if key not in FORMULAS:
        raise AlgorithmError(f"no closed form for {key!r}; known: {list(FORMULAS)}")
    return _t(size, nbytes, model.alpha, model.beta, model.gamma, key)
