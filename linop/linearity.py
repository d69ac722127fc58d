r"""Is a black-box map linear? The one rule behind every probed matrix.

A map :math:`f` known only as a callable is turned into a matrix :math:`F` by probing with
unit vectors (column :math:`j` is :math:`f(e_j)`). That matrix says nothing unless :math:`f`
is linear: an affine map :math:`x \mapsto x + 1` probes to :math:`I + \mathbf{1}\mathbf{1}^T`,
:math:`\lfloor x \rfloor` to :math:`I`, :math:`\operatorname{clip}(x, -30, 30)` and
:math:`\bar x` to :math:`I` too. So after probing, :func:`linearity_problem` evaluates
:math:`f` again on states that the unit vectors do not reach and compares with :math:`F x`.
Every checker calls it: a :class:`~linop.local.LocalOperator`'s callables (and so
``verify.exact_adjoint`` of a tree holding one), ``verify.lift`` and ``prove_backward`` on
numpy, torch and JAX, ``lift_mpi`` and ``lift_group`` across ranks.

The states (:func:`probe_states`, drawn from a fixed seed: reproducible, the same on every
rank):

* :math:`x = 0`: :math:`f(0) = 0`, exactly;
* two random integer states :math:`a, b` (entries in -9..9), :math:`a + b` (additivity) and
  :math:`-3a` (homogeneity): exactly when :math:`F` is integral, as data movement is (every
  product is then an exact integer in floating point);
* a random non-integer state :math:`u` (entries in (-1, 1)): what is linear on integers only
  (``floor``, a cast to an integer dtype) fails here; and :math:`-u`: a map that depends on
  the sign of its image (``relu``, ``abs``) fails on :math:`u` or :math:`-u` (the integer
  :math:`a` and :math:`-3a` may lie in the kernel of :math:`F`);
* scaled copies :math:`2^k u` for :math:`k` in :data:`SCALE_EXPONENTS` (about :math:`10^{-12}`
  to :math:`10^{12}`): homogeneity across magnitudes, which a map that saturates
  (``clip(K x, -30, 30)``), vanishes beyond a bound or below one, fails; powers of two, so a
  linear map computed in floating point scales exactly (no rounding is added);
* one state whose entries span those magnitudes together (:math:`u_j 2^{k_j}`);
* when the map accepts complex input (it returns without raising on it), the complex states
  :math:`b + i a` and :math:`w + i u` (:math:`w` another random non-integer state): an
  antilinear map (:math:`f(x) = \bar x`, :math:`f(i x) = -i f(x)`) fails here (probing with
  real unit vectors cannot see it). The second state is there because the integer :math:`a`
  can lie in the kernel of :math:`F` (a one-row :math:`F` with small entries meets it: then
  :math:`F \bar x = F x` on the first), which a non-integer :math:`u` does not, almost surely. A map that raises on complex
  input, or returns real values for it (it computes over the reals, casting its input, as it
  would at run time, with numpy's ``ComplexWarning``), is judged on the real states only.

Integral :math:`F` on the integer states is compared exactly; everything else up to rounding
in the *computed* dtype: :data:`ROUNDING_ULPS` units of roundoff of the narrowest floating
dtype (float16, bfloat16, float32, float64) that holds every value the map returned, relative
to the state's largest entry of :math:`|F|\,|x|`, plus as many of that dtype's smallest
normal numbers (underflow). A linear map computed in float32 is thus judged by float32's
rounding even when it returns float64, and a map computed in float64 by float64's. States
whose images or entries the computed dtype cannot hold (beyond its largest value, for
float16) are not compared. NaN never compares equal.

A map that passes agrees with a linear map over the field of its input on every state above;
one that fails is not the linear map its matrix claims (which also catches a callable that
behaves differently when probed in batches, a false ``vectorized=True``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import LinopError

__all__ = [
    "ROUNDING_ULPS",
    "SCALE_EXPONENTS",
    "LinearityProblem",
    "complex_state",
    "complex_states",
    "computed_precision",
    "linearity_problem",
    "probe_states",
]

ROUNDING_ULPS = 64
"""Units of roundoff (of the computed dtype) allowed, relative to the state's largest entry of
:math:`|F|\\,|x|`, wherever the comparison is not exact."""

SCALE_EXPONENTS = (-40, -20, -10, 10, 20, 40)
"""The exponents :math:`k` of the scaled states :math:`2^k u` (and the range of the spanning
state's): :math:`2^{40} \\approx 1.1 \\cdot 10^{12}`, within float32's range with room for the
map's own sums."""

_HEADROOM = 2.0**-4
r"""States whose images (bounded by :math:`|F|\,|x|`, as every partial sum of :math:`F x` is) or
entries exceed this fraction of the computed dtype's largest value are not compared: float16
compares images up to 4094 (a saturation at 10 is seen), not only up to 64."""

_SEED = 20261201
_EXACT_STATES = 5  # zero, a, b, a + b, -3 a: exact for an integral matrix

_PRECISIONS: tuple[tuple[str, float, float, float], ...] = (
    # name, eps, smallest normal, largest finite: widest eps first
    ("bfloat16", 2.0**-7, 2.0**-126, float(np.finfo(np.float32).max)),
    ("float16", 2.0**-10, 2.0**-14, 65504.0),
    ("float32", 2.0**-23, 2.0**-126, float(np.finfo(np.float32).max)),
    ("float64", 2.0**-52, 2.0**-1022, float(np.finfo(np.float64).max)),
)


@dataclass(frozen=True)
class LinearityProblem:
    """Where a map differs from its probed matrix: the state (``"zero state"``, ``"random integer
    state a"``, ...), the flat output index, the map's value and the matrix's."""

    state: str
    index: int
    got: complex | float
    want: complex | float
    count: int

    def describe(self, where: str) -> str:
        """The problem in words, ``where`` naming the output entry (a block and index)."""
        text = (
            f"on the {self.state} its output at {where} is {_number(self.got)}, the probed matrix gives "
            f"{_number(self.want)} ({self.count} entries differ)"
        )
        got, want = complex(self.got), complex(self.want)
        if want.imag and abs(got - want.conjugate()) <= 1e-6 * abs(want):
            text += "; it is the conjugate: the map is antilinear, not linear"
        return text


def _number(value: complex | float) -> str:
    value = complex(value)
    if value.imag:
        return f"{value:g}"
    real = value.real
    return str(int(real)) if real.is_integer() else f"{real:.17g}"


def probe_states(size: int) -> tuple[list[str], np.ndarray]:
    """The check's real states as rows of a float64 array (``len(names)`` by ``size``), and
    their names (see the module docstring)."""
    rng = np.random.default_rng(_SEED)
    a = rng.integers(-9, 10, size=size).astype(np.float64)
    b = rng.integers(-9, 10, size=size).astype(np.float64)
    fraction = rng.uniform(-1.0, 1.0, size=size)
    low, high = min(SCALE_EXPONENTS), max(SCALE_EXPONENTS)
    spread = fraction * np.exp2(rng.integers(low, high + 1, size=size).astype(np.float64))
    names = [
        "zero state",
        "random integer state a",
        "random integer state b",
        "state a + b (additivity)",
        "state -3 a (homogeneity)",
        "random non-integer state u",
        "state -u (homogeneity, a negative factor)",
    ]
    rows = [np.zeros(size), a, b, a + b, -3.0 * a, fraction, -fraction]
    for k in SCALE_EXPONENTS:
        names.append(f"state 2**{k} u (homogeneity across magnitudes)")
        rows.append(fraction * 2.0**k)
    names.append(f"state of entries u_j 2**k_j, k_j in {low}..{high} (magnitudes together)")
    rows.append(spread)
    return names, np.stack(rows)


def complex_state(size: int) -> tuple[str, np.ndarray]:
    """The complex state ``b + i a`` of the integer states of :func:`probe_states`, as one
    complex128 row, and its name."""
    rng = np.random.default_rng(_SEED)
    a = rng.integers(-9, 10, size=size).astype(np.float64)
    b = rng.integers(-9, 10, size=size).astype(np.float64)
    return "complex state b + i a (linearity over C)", (b + 1j * a)[None, :]


def complex_states(size: int) -> tuple[list[str], np.ndarray]:
    """The complex states of the check: ``b + i a`` (:func:`complex_state`, compared exactly
    for an integral matrix) and ``w + i u`` (``u`` the non-integer state of
    :func:`probe_states`, ``w`` another), as rows of a complex128 array, and their names."""
    rng = np.random.default_rng(_SEED)
    a = rng.integers(-9, 10, size=size).astype(np.float64)
    b = rng.integers(-9, 10, size=size).astype(np.float64)
    fraction = rng.uniform(-1.0, 1.0, size=size)
    rng.integers(min(SCALE_EXPONENTS), max(SCALE_EXPONENTS) + 1, size=size)  # the spread's draw
    other = rng.uniform(-1.0, 1.0, size=size)
    names = ["complex state b + i a (linearity over C)", "complex state w + i u (linearity over C)"]
    return names, np.stack([b + 1j * a, other + 1j * fraction])


def _integral(matrix: Any) -> bool:
    data = np.asarray(matrix.data if hasattr(matrix, "tocsr") else matrix)
    if data.dtype.kind in "biu":
        return True
    parts = (data.real, data.imag) if data.dtype.kind == "c" else (data,)
    return all(bool(np.all((p == np.round(p)) & (np.abs(p) < 2.0**50))) for p in parts)


def _holds(name: str, values: np.ndarray) -> bool:
    """Whether every value (float64) is representable in the named dtype."""
    if name == "float64" or values.size == 0:
        return True
    if name == "float16":
        with np.errstate(over="ignore"):
            return bool(np.all(values.astype(np.float16).astype(np.float64) == values))
    with np.errstate(over="ignore"):
        single = values.astype(np.float32)
    if not np.all(single.astype(np.float64) == values):
        return False
    return name == "float32" or bool(np.all(single.view(np.uint32) & np.uint32(0xFFFF) == 0))


def computed_precision(images: np.ndarray) -> tuple[str, float, float, float]:
    """The narrowest floating dtype that holds every finite value of ``images`` (real and
    imaginary parts): ``(name, eps, smallest normal, largest finite)``, never finer than the
    images' own dtype. What the map was computed in, as far as its results show. When several
    dtypes hold every value (a few short results fit both bfloat16 and float16), any of them
    could have computed them: the widest eps, the largest smallest normal and the smallest
    largest finite of those (a float16 map's results that happen to fit bfloat16 are still
    allowed float16's underflow, and its states beyond 65504 are not compared)."""
    images = np.asarray(images)
    own_eps = float(np.finfo(images.dtype).eps) if images.dtype.kind in "fc" else 2.0**-52
    parts = (images.real, images.imag) if images.dtype.kind == "c" else (images,)
    values = np.concatenate([np.asarray(p, dtype=np.float64).ravel() for p in parts])
    values = values[np.isfinite(values)]
    holding = [p for p in _PRECISIONS if p[1] >= own_eps and _holds(p[0], values)]  # widest eps first
    if not holding:
        return _PRECISIONS[-1]
    # values that several dtypes hold could come from any of them (bfloat16 and float16 both
    # hold a few short results): the widest eps, the largest underflow, the smallest range
    name, eps = holding[0][0], holding[0][1]
    return name, eps, max(p[2] for p in holding), min(p[3] for p in holding)


def _first_problem(
    names: Sequence[str],
    images: np.ndarray,
    wants: np.ndarray,
    scales: np.ndarray,
    exact: Sequence[bool],
    precision: tuple[str, float, float, float],
    rows: np.ndarray | None,
    states: np.ndarray,
) -> LinearityProblem | None:
    _, eps, tiny, largest = precision
    for name, got, want, scale, is_exact, state in zip(names, images, wants, scales, exact, states):
        if rows is not None:
            got, want, scale = got[rows], want[rows], scale[rows]
        top = float(np.max(scale, initial=0.0))
        if not is_exact and max(top, float(np.max(np.abs(state), initial=0.0))) > largest * _HEADROOM:
            continue  # the computed dtype cannot hold this state (0 * inf is NaN) or its images
        allowed = 0.0 if is_exact else ROUNDING_ULPS * (eps * top + tiny)
        with np.errstate(invalid="ignore", over="ignore"):
            wrong = np.flatnonzero(~(np.abs(got - want) <= allowed))  # NaN counts as wrong
        if wrong.size:
            first = int(wrong[0])
            index = first if rows is None else int(rows[first])
            return LinearityProblem(name, index, got[first].item(), want[first].item(), int(wrong.size))
    return None


def linearity_problem(
    apply_states: Callable[[np.ndarray], np.ndarray],
    matrix: Any,
    size: int,
    *,
    rows: Sequence[int] | np.ndarray | None = None,
    agree: Callable[[bool], bool] | None = None,
) -> LinearityProblem | None:
    """The first state on which ``apply_states`` differs from ``matrix`` (None: it agrees on
    every state of :func:`probe_states`, and on :func:`complex_state` when it accepts complex
    input); the rule of the module docstring.

    Parameters
    ----------
    apply_states : callable
        The map on a batch of flat states: (k, size) float64 or complex128 -> (k, m). Called
        twice: once with the real states, once with the complex one (an exception there means
        the map does not accept complex input).
    matrix : scipy.sparse array or ndarray, shape (m, size)
        The probed matrix :math:`F`.
    size : int
        The domain's size.
    rows : sequence of int, optional
        The output entries to compare (default all): a rank of a distributed map compares the
        rows it computed.
    agree : callable, optional
        ``agree(accepted)`` -> whether every caller's map accepted the complex state (the
        ranks of a distributed map decide alike; default: this caller's own answer).
    """
    if size == 0:
        return None
    picked = None if rows is None else np.asarray(rows, dtype=np.int64)
    names, states = probe_states(size)
    images = np.asarray(apply_states(states.copy()))  # a map may write into its argument
    wants = np.asarray(matrix @ states.T).T
    scales = np.asarray(abs(matrix) @ np.abs(states.T)).T
    integral = _integral(matrix)
    inexact = slice(_EXACT_STATES, None)
    checked = images if picked is None else images[:, picked]
    precision = computed_precision(checked[inexact])
    exact = [k == 0 or (integral and k < _EXACT_STATES) for k in range(len(names))]
    problem = _first_problem(names, images, wants, scales, exact, precision, picked, states)
    accepted = True
    complex_names, state = complex_states(size)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", np.exceptions.ComplexWarning)
            complex_images = np.asarray(apply_states(state.copy()))
    except LinopError:  # a typed error of the caller's own (a lift that lost a rank): not a verdict
        raise
    except Exception:  # the map does not take complex input: it cannot be applied to it either
        accepted = False
        complex_images = None
    if complex_images is not None and complex_images.dtype.kind != "c" and (picked is None or picked.size):
        accepted = False  # it computes over the reals, casting its input (as it would at run time)
    if agree is not None:
        accepted = agree(accepted)
    if problem is not None or not accepted or complex_images is None:
        return problem
    want = np.asarray(matrix @ state.T).T
    scale = np.asarray(abs(matrix) @ np.abs(state.T)).T
    checked = complex_images if picked is None else complex_images[:, picked]
    precision = computed_precision(checked)
    return _first_problem(
        complex_names, complex_images, want, scale, [integral, False], precision, picked, state
    )
