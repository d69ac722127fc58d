r"""Pick the cheapest proven variant of a collective under an alpha-beta-gamma model
(``docs/theory.md#cost-model``).

:func:`choose` builds every variant of the collective for P workers and the message size
(:func:`linop.algorithms.problem`), accounts it (:func:`linop.accounting.account_schedule`:
the schedule the MPI interpreter runs, or :func:`~linop.accounting.account`: the tree as
built) and returns the variant with the least modeled time. Every candidate is a variant whose
equality to the collective the test suite proves for P = 1 .. 16; the time comes from the
variant's own messages, so worker counts that are not powers of two are modeled as they run
(folds, empty chunks), not by a formula.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ..accounting import Accounting, CostModel, account, account_schedule, check_itemsize
from . import VARIANTS, AlgorithmError, problem

__all__ = ["Choice", "choose", "modeled_times"]


@dataclass(frozen=True)
class Choice:
    """The chooser's pick: ``variant`` with modeled ``time`` (s), and every candidate's time
    in ``ranking`` (cheapest first)."""

    collective: str
    size: int
    nbytes: int
    variant: str
    time: float
    ranking: tuple[tuple[str, float], ...]

    def __str__(self) -> str:
        others = ", ".join(f"{name} {t * 1e6:.1f} us" for name, t in self.ranking)
        return f"{self.collective} of {self.nbytes} B on {self.size} workers: {self.variant} ({others})"


@functools.lru_cache(maxsize=512)
def _accountings(
    collective: str, size: int, length: int, itemsize: int, schedule: bool
) -> tuple[tuple[str, Accounting], ...]:
    built = problem(collective, size, length).variants()
    how = account_schedule if schedule else account
    return tuple((name, how(op, itemsize=itemsize)) for name, op in built.items())


def _step_counts(
    collective: str, size: int, length: int, itemsize: int, schedule: bool
) -> dict[str, tuple[int, int]]:
    return {
        name: (accounting.total_messages, len(accounting.events))
        for name, accounting in _accountings(collective, size, length, itemsize, schedule)
    }


def modeled_times(
    collective: str,
    size: int,
    nbytes: int,
    model: CostModel,
    *,
    itemsize: int = 8,
    schedule: bool = True,
) -> dict[str, float]:
    """Modeled time (s) of every variant of ``collective`` for ``size`` workers and ``nbytes``
    per worker (rounded down to whole entries of ``itemsize`` bytes, at least one).

    Raises
    ------
    AlgorithmError
        For an unknown collective, a non-positive size, a negative or non-integer ``nbytes``
        or a ``model`` that is not a :class:`~linop.accounting.CostModel`.
    AccountingError
        If ``itemsize`` is not a positive integer.
    """
    if not isinstance(collective, str) or collective not in VARIANTS:
        raise AlgorithmError(f"no collective {collective!r}; known: {list(VARIANTS)}")
    if isinstance(size, bool) or not isinstance(size, int | np.integer) or size < 1:
        raise AlgorithmError(f"{collective}: size must be a positive integer (workers), not {size!r}")
    itemsize = check_itemsize(itemsize)
    if isinstance(nbytes, bool) or not isinstance(nbytes, int | np.integer) or nbytes < 0:
        raise AlgorithmError(
            f"{collective}: nbytes must be a non-negative integer (bytes per worker), not {nbytes!r}"
        )
    if not isinstance(model, CostModel):
        raise AlgorithmError(f"{collective}: model must be a CostModel, not {type(model).__name__}")
    length = max(1, int(nbytes) // int(itemsize))
    return {
        name: accounting.time(model)
        for name, accounting in _accountings(collective, size, length, int(itemsize), bool(schedule))
    }


def choose(
    collective: str,
    size: int,
    nbytes: int,
    model: CostModel,
    *,
    itemsize: int = 8,
    schedule: bool = True,
) -> Choice:
    """The variant of ``collective`` with the least modeled time (see :func:`modeled_times`).

    Ties (equal modeled times) go to the variant with fewer messages, then fewer steps in
    the interpreter's program (each step costs interpreter time the model does not count), then
    the one listed first in :data:`linop.algorithms.VARIANTS`.
    """
    times = modeled_times(collective, size, nbytes, model, itemsize=itemsize, schedule=schedule)
    steps = _step_counts(
        collective, size, max(1, int(nbytes) // int(itemsize)), int(itemsize), bool(schedule)
    )
    # equal times (within rounding): fewer messages, then fewer interpreter steps, win
    ranking = tuple(sorted(times.items(), key=lambda item: (round(item[1], 15), steps[item[0]])))
    best = ranking[0]
    return Choice(collective, size, int(nbytes), best[0], best[1], ranking)
