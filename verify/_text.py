"""Small text helpers shared by the verification levels' messages."""

from __future__ import annotations

from linop import Space

__all__ = ["short", "space_problem"]


def short(op: object, limit: int = 80) -> str:
    """``str(op)``, cut to ``limit`` characters with an ellipsis."""
    text = str(op)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def space_problem(label: str, actual: Space, expected: Space) -> str | None:
    """``"label: <first differing block>"`` when the spaces differ, None when they agree."""
    diff = actual.difference(expected)
    return None if diff is None else f"{label}: {diff}"
