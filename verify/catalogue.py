"""The shape of a catalogue entry: one named identity of ``docs/theory.md``, provable at several levels.

Each feature module contributes a list ``ENTRIES`` of :class:`Entry` objects;
:mod:`verify.identities` collects them and ``python -m verify`` proves every one. The helpers
:func:`adjoint_entry` and :func:`equal_entry` build entries and, for whole-block trees, attach
the size-free proof.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from linop import LinearOperator

__all__ = ["Entry", "adjoint_entry", "equal_entry"]


@dataclass(frozen=True)
class Entry:
    """A named identity.

    Parameters
    ----------
    name : str
        Short unique id, e.g. ``"copy-inplace-adjoint"``.
    section : str
        The anchor of the section of ``docs/theory.md`` that states it, e.g. ``"primitives"``
        (``docs/theory.md#primitives``).
    statement : str
        One line of mathematics, e.g. ``"C_{a->b}* = K_b S_{b->a}"``.
    kind : {"adjoint", "equal"}
        ``"adjoint"``: ``build()`` returns ``(op,)`` and the claim is that ``op.H`` (its derived
        adjoint) is the conjugate transpose of ``op``. ``"equal"``: ``build()`` returns
        ``(lhs, rhs)`` and the claim is that both are the same operator.
    build : callable
        Builds the operators on concrete (small) spaces.
    size_free : callable or None
        Optional: returns a truthy value when a sympy proof for every block size succeeds
        (a :class:`verify.sizefree.SizeFreeProof`, whose ``detail`` the report shows), a
        falsy one when it fails.
    symbolic : bool
        Whether the report also runs the entry-wise symbolic check (the symbolic dot test,
        or symbolic equality); turn off for operators too large for sympy to expand quickly.
    """

    name: str
    section: str
    statement: str
    kind: Literal["adjoint", "equal"]
    build: Callable[[], tuple[LinearOperator, ...]]
    size_free: Callable[[], object] | None = None
    symbolic: bool = True


def adjoint_entry(
    name: str,
    section: str,
    statement: str,
    build: Callable[[], LinearOperator],
    *,
    size_free: bool = False,
    symbolic: bool = True,
) -> Entry:
    """An ``"adjoint"`` entry for the operator ``build()``; with ``size_free=True`` (whole-block
    trees only) the report also proves the adjoint for every block size."""

    def proof() -> object:
        from .sizefree import prove_adjoint

        return prove_adjoint(build())

    return Entry(
        name, section, statement, "adjoint", lambda: (build(),), proof if size_free else None, symbolic
    )


def equal_entry(
    name: str,
    section: str,
    statement: str,
    build: Callable[[], tuple[LinearOperator, LinearOperator]],
    *,
    size_free: bool = False,
    symbolic: bool = True,
) -> Entry:
    """An ``"equal"`` entry for the pair ``build()``; with ``size_free=True`` (whole-block trees
    only) the report also proves the equality for every block size."""

    def proof() -> object:
        from .sizefree import prove_equal

        return prove_equal(*build())

    return Entry(name, section, statement, "equal", build, proof if size_free else None, symbolic)
