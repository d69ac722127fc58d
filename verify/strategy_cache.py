"""Strategy factories that build their strategy once per arguments.

Hypothesis validates a strategy object the first time it is drawn from, and for a strategy
built of lists, tuples, maps and composites that validation walks the whole strategy: it
costs more than a draw. A factory called inside another strategy's draw (``spaces()`` while
drawing a tree, ``partitions(shape)`` while drawing a tensor) would build and validate a new
object every time. :func:`built_once` keeps the strategy per arguments instead (strategies
are immutable), as hypothesis does for its own factories.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

__all__ = ["built_once"]

P = ParamSpec("P")
S = TypeVar("S")

CACHED_PER_FACTORY = 1024
"""Strategies kept per factory (least recently used first out)."""


def built_once(factory: Callable[P, S]) -> Callable[P, S]:
    """``factory`` (a function returning a strategy) returning the same strategy object for the
    same arguments; an unhashable argument (a list, an array) builds a new one, as before."""
    cached: Callable[..., S] = functools.lru_cache(maxsize=CACHED_PER_FACTORY)(factory)

    @functools.wraps(factory)
    def build(*args: P.args, **kwargs: P.kwargs) -> S:
        try:
            hash((args, tuple(kwargs.items())))
        except TypeError:  # an unhashable argument
            return factory(*args, **kwargs)
        return cached(*args, **kwargs)

    return build
