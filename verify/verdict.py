"""What every check's result shares: it is truthy when its claim holds, and ``check()`` turns a
failure into a :class:`~verify.VerificationError`."""

from __future__ import annotations

from typing import TypeVar

from .errors import VerificationError

__all__ = ["Verdict"]

V = TypeVar("V", bound="Verdict")


class Verdict:
    """Mixin of the result dataclasses; they define ``claim``, ``passed`` and ``detail``."""

    __slots__ = ()

    claim: str
    passed: bool
    detail: str

    def __bool__(self) -> bool:
        return self.passed

    def check(self: V) -> V:
        """Return self if the claim holds; raise :class:`VerificationError` otherwise."""
        if not self.passed:
            raise VerificationError(self._failure())
        return self

    def _repr_html_(self) -> str:
        """Jupyter: the verdict, claim and evidence as a table (see :mod:`verify.display`)."""
        from .display import verdict_html

        return verdict_html(self)

    def _failure(self) -> str:
        """The message of the :class:`VerificationError` that :meth:`check` raises."""
        return f"{self.claim}: {self.detail}"
