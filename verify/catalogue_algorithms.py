"""Catalogue, ``docs/theory.md#collective-algorithms``: every collective algorithm of
:mod:`linop.algorithms` equals its collective, and its adjoint equals the reverse algorithm.

Each variant is built on 3 workers (not a power of two: the recursive variants fold a worker)
with lengths that do not divide evenly (unequal chunks; the all-gather, reduce-scatter and
all-to-all shares are unequal and one is empty); the test suite proves the same for every
P = 1 .. 16. The ``-reverse`` entries prove ``variant.H == reverse variant`` (the binomial
broadcast's adjoint is the binomial reduce, the ring all-gather's the ring reduce-scatter, ...).
"""

from __future__ import annotations

from collections.abc import Callable

from linop import LinearOperator
from linop.algorithms import VARIANTS, Variant, problem

from .catalogue import Entry, equal_entry

__all__ = ["ENTRIES"]

SECTION = "collective-algorithms"
WORKERS = 3
_SHARES = (2, 0, 3)  # unequal, one empty
_LENGTH = {"broadcast": 5, "reduce": 5, "allreduce": 5}


def _length(collective: str) -> int | tuple[int, ...]:
    return _LENGTH.get(collective, _SHARES)


def _equals_collective(variant: Variant) -> Callable[[], tuple[LinearOperator, LinearOperator]]:
    def build() -> tuple[LinearOperator, LinearOperator]:
        case = problem(variant.collective, WORKERS, _length(variant.collective))
        return case.variant(variant.name), case.reference

    return build


def _adjoint_is_reverse(variant: Variant) -> Callable[[], tuple[LinearOperator, LinearOperator]]:
    def build() -> tuple[LinearOperator, LinearOperator]:
        case = problem(variant.collective, WORKERS, _length(variant.collective))
        collective, name = variant.reverse
        reverse = problem(collective, WORKERS, _length(collective)).variant(name)
        return case.variant(variant.name).H, reverse

    return build


def _slug(text: str) -> str:
    return text.replace("_", "-")


ENTRIES: list[Entry] = []
for _collective, _variants in VARIANTS.items():
    if _collective == "alltoall_reverse":  # the all-to-all entries' reverse side already proves it
        continue
    for _variant in _variants.values():
        _name = f"algorithm-{_slug(_collective)}-{_slug(_variant.name)}"
        ENTRIES.append(
            equal_entry(
                _name,
                SECTION,
                f"{_collective} by {_variant.name.replace('_', ' ')} = the {_collective} collective",
                _equals_collective(_variant),
                symbolic=False,
            )
        )
        _reverse = f"{_variant.reverse[0]} by {_variant.reverse[1].replace('_', ' ')}"
        ENTRIES.append(
            equal_entry(
                f"{_name}-reverse",
                SECTION,
                f"({_collective} by {_variant.name.replace('_', ' ')})* = {_reverse}",
                _adjoint_is_reverse(_variant),
                symbolic=False,
            )
        )
del _collective, _variants, _variant, _name, _reverse
