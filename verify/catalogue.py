"""The shape of a catalogue entry: one named identity of THEORY.md, provable at several levels.

Each feature module contributes a list of :class:`Entry` objects; :mod:`verify.identities`
collects them and ``python -m verify`` proves every one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from linop import LinearOperator

__all__ = ["Entry"]


@dataclass(frozen=True)
class Entry:
    """A named identity.

    Parameters
    ----------
    name : str
        Short unique id, e.g. ``"copy-inplace-adjoint"``.
    section : str
        The THEORY.md section that states it, e.g. ``"1"``.
    statement : str
        One line of mathematics, e.g. ``"C_{a->b}* = K_b S_{b->a}"``.
    kind : {"adjoint", "equal"}
        ``"adjoint"``: ``build()`` returns ``(op,)`` and the claim is that ``op.H`` (its derived
        adjoint) is the conjugate transpose of ``op``. ``"equal"``: ``build()`` returns
        ``(lhs, rhs)`` and the claim is that both are the same operator.
    build : callable
        Builds the operators on concrete (small) spaces.
    size_free : callable or None
        Optional: returns True when a sympy proof for every block size succeeds.
    """

    name: str
    section: str
    statement: str
    kind: Literal["adjoint", "equal"]
    build: Callable[[], tuple[LinearOperator, ...]]
    size_free: Callable[[], bool] | None = None
