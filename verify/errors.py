"""The errors of verify: a failed claim, and a claim that a level cannot decide.

A failed verification is an :class:`AssertionError` (so it reads naturally in tests); asking a
level for something it cannot do (a size-free proof of a tree that cuts blocks into pieces) is
bad input, a :class:`~linop.LinopError`.
"""

from __future__ import annotations

from linop import LinopError

__all__ = ["VerificationError", "NotSizeFreeError", "SymbolicError", "CheckOptionError", "LiftError"]


class VerificationError(AssertionError):
    """A claim (an adjoint, an equality) is false; the message names the block and index."""


class NotSizeFreeError(LinopError, ValueError):
    """A size-free proof was asked of a tree that is not made of whole-block primitives."""


class SymbolicError(LinopError, ValueError):
    """A symbolic computation cannot be set up (for example, clashing symbol names)."""


class CheckOptionError(LinopError, TypeError, ValueError):
    """A check was called with an option it cannot use: a dtype that is not floating, fewer
    than one trial, an unknown level of the report."""


class LiftError(LinopError, ValueError):
    """A function cannot be lifted: it is not linear, returns the wrong blocks or shapes, or
    its framework has no backward to probe."""
