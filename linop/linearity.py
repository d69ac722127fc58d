r"""Is a black-box map linear? The check behind every probed matrix.

A map :math:`f` known only as a callable is turned into a matrix :math:`F` by probing with
unit vectors (column :math:`j` is :math:`f(e_j)`). That matrix says nothing unless :math:`f`
is linear: an affine map :math:`x \mapsto x + 1` probes to :math:`I + \mathbf{1}\mathbf{1}^T`,
:math:`\lfloor x \rfloor` to :math:`I`. So after probing, :func:`linearity_problem` evaluates
:math:`f` again on states that the unit vectors do not span alone and compares with
:math:`F x`:

* :math:`x = 0` (:math:`f(0) = 0`, exactly);
* two random integer states :math:`a, b` (entries in -9..9), their sum :math:`a + b`
  (additivity) and :math:`-3a` (homogeneity): exactly when :math:`F` is integral, as data
  movement is, since then every product is an exact integer in floating point;
* a random non-integer state (entries in (-1, 1)): what is linear on integers only
  (``floor``, a cast to an integer dtype) fails here; compared up to rounding
  (:data:`ROUNDING_ULPS` units in the last place of :math:`|F|\,|x|`).

A map that passes agrees with a linear map on six states in general position, one of them
non-integer; a map that fails is not the linear map its matrix claims (which also catches a
callable that behaves differently when probed in batches, a false ``vectorized=True``). The
states are drawn from a fixed seed, so a check is reproducible (and the same on every MPI
rank).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["ROUNDING_ULPS", "LinearityProblem", "linearity_problem", "probe_states"]

ROUNDING_ULPS = 64
"""Units of roundoff allowed, relative to :math:`|F|\\,|x|`, on the non-integer state (or
wherever :math:`F` is not integral)."""

_SEED = 20261201


@dataclass(frozen=True)
class LinearityProblem:
    """Where a map differs from its probed matrix: the state (``"zero"``, ``"random integer
    state a"``, ...), the flat output index, the map's value and the matrix's."""

    state: str
    index: int
    got: complex | float
    want: complex | float
    count: int

    def describe(self, where: str) -> str:
        """The problem in words, ``where`` naming the output entry (a block and index)."""
        return (
            f"on the {self.state} its output at {where} is {_number(self.got)}, the probed matrix gives "
            f"{_number(self.want)} ({self.count} entries differ)"
        )


def _number(value: complex | float) -> str:
    value = complex(value)
    if value.imag:
        return f"{value:g}"
    real = value.real
    return str(int(real)) if real.is_integer() else f"{real:.17g}"


def probe_states(size: int) -> tuple[list[str], np.ndarray]:
    """The check's states as rows of a (6, size) float64 array, and their names."""
    rng = np.random.default_rng(_SEED)
    a = rng.integers(-9, 10, size=size).astype(np.float64)
    b = rng.integers(-9, 10, size=size).astype(np.float64)
    fraction = rng.uniform(-1.0, 1.0, size=size)
    names = [
        "zero state",
        "random integer state a",
        "random integer state b",
        "state a + b (additivity)",
        "state -3 a (homogeneity)",
        "random non-integer state",
    ]
    return names, np.stack([np.zeros(size), a, b, a + b, -3.0 * a, fraction])


def _integral(matrix: Any) -> bool:
    data = np.asarray(matrix.data if hasattr(matrix, "tocsr") else matrix)
    if data.dtype.kind in "biu":
        return True
    parts = (data.real, data.imag) if data.dtype.kind == "c" else (data,)
    return all(bool(np.all((p == np.round(p)) & (np.abs(p) < 2.0**50))) for p in parts)


def linearity_problem(
    apply_states: Callable[[np.ndarray], np.ndarray], matrix: Any, size: int
) -> LinearityProblem | None:
    """The first state on which ``apply_states`` differs from ``matrix`` (None: it agrees on
    every state of :func:`probe_states`).

    Parameters
    ----------
    apply_states : callable
        The map on a batch of flat states: (k, size) float64 -> (k, m).
    matrix : scipy.sparse array or ndarray, shape (m, size)
        The probed matrix :math:`F`.
    size : int
        The domain's size.
    """
    if size == 0:
        return None
    names, states = probe_states(size)
    images = np.asarray(apply_states(states.copy()))  # a map may write into its argument
    wants = np.asarray(matrix @ states.T).T
    scales = np.asarray(abs(matrix) @ np.abs(states.T)).T
    integral = _integral(matrix)
    kind = images.dtype if images.dtype.kind in "fc" else np.dtype(np.float64)
    eps = float(np.finfo(kind).eps)
    for k, (name, got, want, scale) in enumerate(zip(names, images, wants, scales)):
        exact = k == 0 or (integral and k < len(names) - 1)
        allowed = 0.0 if exact else ROUNDING_ULPS * eps * np.maximum(scale, 1.0)
        wrong = np.flatnonzero(~(np.abs(got - want) <= allowed))  # NaN counts as wrong
        if wrong.size:
            first = int(wrong[0])
            return LinearityProblem(name, first, got[first], want[first], int(wrong.size))
    return None
