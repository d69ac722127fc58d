"""verify: prove the adjoints of linop operators numerically, exactly and symbolically.

Levels
------
numeric
    :func:`adjoint_test` / :func:`assert_adjoint`: the dot test of ``docs/theory.md#adjoint-test`` on
    random states in float32, float64, complex64 or complex128; :func:`numeric_equal`.
exact
    :func:`exact_adjoint`, :func:`equal` (and ``assert_`` forms): the sparse interpreter's
    matrices compared entry by entry, integers for data movement.
symbolic
    :mod:`verify.symbolic`: actions on named sympy symbols, the symbolic dot test, and
    size-free proofs with symbolic block sizes.

Every failure names the block and index at fault. :mod:`verify.strategies` offers hypothesis
strategies for property tests of your own operators; :mod:`verify.identities` is the catalogue
that ``python -m verify`` proves.
"""

from __future__ import annotations

import importlib
from typing import Any

from .errors import CheckOptionError, NotSizeFreeError, SymbolicError, VerificationError
from .exact import Mismatch, Proof, assert_equal, assert_exact_adjoint, equal, exact_adjoint
from .locate import Location
from .numeric import AdjointTestResult, adjoint_test, assert_adjoint, numeric_equal

__all__ = [
    "AdjointTestResult",
    "CheckOptionError",
    "Location",
    "Mismatch",
    "NotSizeFreeError",
    "Proof",
    "SymbolicError",
    "VerificationError",
    "adjoint_test",
    "assert_adjoint",
    "assert_equal",
    "assert_exact_adjoint",
    "equal",
    "exact_adjoint",
    "identities",
    "numeric_equal",
    "strategies",
    "symbolic",
]

_SUBMODULES = ("symbolic", "strategies", "identities", "sizefree", "report")


def __getattr__(name: str) -> Any:
    """Load the heavier submodules (sympy, hypothesis, the catalogue) on first use."""
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'verify' has no attribute {name!r}")
