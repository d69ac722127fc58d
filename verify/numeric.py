r"""Numeric checks in floating point: the adjoint (dot) test and operator closeness.

The adjoint test of ``docs/theory.md#adjoint-test``: for random x and y,

.. math::

    \frac{|\langle F x, y\rangle - \langle x, F^* y\rangle|}
         {\max(\|F x\|\,\|y\|,\ \|x\|\,\|F^* y\|)} < \varepsilon

with the inner product :math:`\langle u, v\rangle = \sum \bar u_i v_i` and
:math:`\varepsilon` a small multiple of the dtype's machine epsilon (:func:`threshold_for`).
The check runs in the dtype asked for (float32 stays float32), so it exercises the numpy
interpreter as a user would run it.

A dot test says *that* an adjoint is wrong, not *where*. On failure, when the operator is small
enough (:data:`LOCALIZE_LIMIT`), the entry at fault is found by probing both trees with unit
vectors through the numpy interpreter, and reported as (block, index) pairs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from linop import LinearOperator, Space
from linop.errors import OperandError

from ._text import short, space_problem
from .errors import CheckOptionError
from .locate import locate
from .verdict import Verdict

__all__ = [
    "AdjointTestResult",
    "adjoint_test",
    "assert_adjoint",
    "numeric_equal",
    "threshold_for",
    "LOCALIZE_LIMIT",
]

LOCALIZE_LIMIT = 250_000
"""Largest domain size x range size for which a failure is localized by probing."""

SAFETY = 10.0
"""The threshold is SAFETY * eps * sqrt(n): rounding of an n-term inner product, with margin."""


def threshold_for(dtype: npt.DTypeLike, size: int) -> float:
    """The pass threshold of a relative error in ``dtype`` over vectors of ``size`` entries:
    ``SAFETY * eps(dtype) * sqrt(max(size, 1))`` (``docs/theory.md#adjoint-test``).

    Examples
    --------
    >>> import numpy as np
    >>> bool(threshold_for(np.float64, 100) == 10 * np.finfo(np.float64).eps * 10)
    True
    >>> f"{threshold_for(np.float32, 4):.3g}"
    '2.38e-06'
    """
    return float(SAFETY * np.finfo(np.dtype(dtype)).eps * np.sqrt(max(size, 1)))


@dataclass(frozen=True)
class AdjointTestResult(Verdict):
    """Outcome of a numeric test (:func:`adjoint_test` or :func:`numeric_equal`).

    Attributes
    ----------
    claim : str
        What was tested.
    measured : float
        The worst relative error over the trials (``inf`` if the spaces do not even agree).
    threshold : float
        The largest relative error that passes, from the dtype's machine epsilon.
    passed : bool
        ``measured < threshold``, or ``measured == 0``.
    dtype : numpy.dtype
        The dtype the test ran in.
    trials : int
        How many random pairs were drawn.
    detail : str
        The numbers of the worst trial, and on failure the entry at fault when found.
    """

    claim: str
    measured: float
    threshold: float
    passed: bool
    dtype: np.dtype
    trials: int
    detail: str = ""

    def _failure(self) -> str:
        return (
            f"{self.claim}: relative error {self.measured:.3g} is not below the threshold "
            f"{self.threshold:.3g} ({self.dtype}); {self.detail}"
        )

    def __repr__(self) -> str:
        verdict = "passed" if self.passed else "FAILED"
        relation = "<" if self.passed else ">="
        text = (
            f"AdjointTestResult({verdict}: {self.claim}; relative error {self.measured:.3g} {relation} "
            f"threshold {self.threshold:.3g}, dtype={self.dtype}, trials={self.trials}"
        )
        return text + (f"; {self.detail})" if self.detail and not self.passed else ")")


def _require_operator(value: object, what: str) -> None:
    if not isinstance(value, LinearOperator):
        raise OperandError(f"{what} must be a LinearOperator, not {type(value).__name__}")


MAX_TRIALS = 1_000_000
"""The most trials a numeric check takes (each applies the operator and its adjoint to fresh
random states): a count beyond it is refused, as a slip (``10**30``) would run for ever."""


def check_trials(test: str, trials: object) -> int:
    """``trials`` as a count of trials of ``test``: an int from 1 to :data:`MAX_TRIALS`, else
    :class:`CheckOptionError`."""
    if isinstance(trials, bool) or not isinstance(trials, (int, np.integer)):
        raise CheckOptionError(f"{test}: trials must be an int, not {trials!r}")
    if trials < 1:  # no trial would pass any adjoint
        raise CheckOptionError(f"{test}: trials must be at least 1, not {trials}")
    if trials > MAX_TRIALS:
        raise CheckOptionError(f"{test}: trials must be at most {MAX_TRIALS:,}, not {trials}")
    return int(trials)


def _checked_options(test: str, dtype: npt.DTypeLike, trials: object) -> np.dtype:
    """The dtype of a check's states, after validating it and the number of trials."""
    try:
        dtype = np.dtype(dtype)
    except (TypeError, ValueError):
        raise CheckOptionError(f"{test}: {dtype!r} is not a dtype") from None
    if dtype.kind not in "fc":
        raise CheckOptionError(f"{test} needs a real or complex floating dtype, not {dtype}")
    check_trials(test, trials)
    return dtype


def _norm(space: Space, state: dict) -> float:
    return float(np.sqrt(abs(space.inner(state, state))))


def adjoint_test(
    op: LinearOperator,
    *,
    rng: np.random.Generator | int | None = None,
    dtype: npt.DTypeLike = np.float64,
    trials: int = 3,
    threshold: float | None = None,
    localize: bool = True,
) -> AdjointTestResult:
    r"""The coherence (dot) test of ``op.H`` against ``op`` on random states.

    .. math::

        \frac{|\langle F x, y\rangle - \langle x, F^* y\rangle|}
             {\max(\|F x\|\,\|y\|,\ \|x\|\,\|F^* y\|)} < \varepsilon

    Parameters
    ----------
    op : LinearOperator
    rng : numpy.random.Generator or int, optional
        Source of the random states; ``None`` means a fixed seed (0), so results repeat.
    dtype : dtype, optional
        Real or complex floating dtype of the states (float32, float64, complex64,
        complex128, ...). Default float64.
    trials : int, optional
        Number of random (x, y) pairs; the worst counts.
    threshold : float, optional
        Override the threshold (default :func:`threshold_for` of the dtype and the larger
        space's size).
    localize : bool, optional
        On failure, find the first wrong entry by probing (small operators only).

    Returns
    -------
    AdjointTestResult
        Truthy when the test passes.

    Raises
    ------
    CheckOptionError
        If ``dtype`` is not a floating dtype or ``trials`` is below 1 (a
        :class:`~linop.LinopError`, also a TypeError and a ValueError).

    Examples
    --------
    >>> import numpy as np
    >>> from linop import Block, Copy, Space
    >>> from verify import adjoint_test
    >>> space = Space([Block("a", (3,)), Block("b", (3,))])
    >>> result = adjoint_test(Copy(space["a"], space["b"]), dtype=np.float32)
    >>> bool(result), result.measured < result.threshold, result.trials
    (True, True, 3)
    """
    _require_operator(op, "adjoint_test: op")
    dtype = _checked_options("the adjoint test", dtype, trials)
    rng = np.random.default_rng(0 if rng is None else rng)
    adjoint = op.H
    claim = f"adjoint test of {short(op)}"
    limit = threshold_for(dtype, max(op.domain.size, op.range.size)) if threshold is None else threshold
    problem = space_problem("op.H's domain is not op's range", adjoint.domain, op.range) or space_problem(
        "op.H's range is not op's domain", adjoint.range, op.domain
    )
    if problem:
        return AdjointTestResult(claim, float("inf"), limit, False, dtype, 0, problem)
    worst, worst_detail = 0.0, ""
    for _ in range(trials):
        x = op.domain.random(rng, dtype)
        y = op.range.random(rng, dtype)
        forward, backward = op(x), adjoint(y)
        left, right = op.range.inner(forward, y), op.domain.inner(x, backward)
        scale = max(
            _norm(op.range, forward) * _norm(op.range, y), _norm(op.domain, x) * _norm(op.domain, backward)
        )
        gap = abs(left - right)
        error = float(gap / scale) if scale > 0 else float(gap)
        if not np.isfinite(error):
            error = float("inf")
        if error >= worst:
            worst = error
            worst_detail = f"<F x, y> = {_fmt(left)}, <x, F* y> = {_fmt(right)}"
    passed = worst < limit or worst == 0.0
    detail = worst_detail
    if not passed and localize:
        detail += "; " + _localize_adjoint(op, adjoint)
    return AdjointTestResult(claim, worst, limit, passed, dtype, trials, detail)


def assert_adjoint(op: LinearOperator, **options: object) -> AdjointTestResult:
    """:func:`adjoint_test`, raising an AssertionError (:class:`VerificationError`) with the
    measured error, the threshold, both inner products and the entry at fault on failure."""
    return adjoint_test(op, **options).check()  # type: ignore[arg-type]


def numeric_equal(
    a: LinearOperator,
    b: LinearOperator,
    *,
    rng: np.random.Generator | int | None = None,
    dtype: npt.DTypeLike = np.float64,
    trials: int = 3,
    threshold: float | None = None,
) -> AdjointTestResult:
    r"""Test that two operators agree on random states:
    :math:`\|a x - b x\| / \max(\|a x\|, \|b x\|) < \varepsilon`.

    Parameters
    ----------
    a, b : LinearOperator
        The two trees; their domains and ranges must agree (else the result fails, naming
        the first differing block).
    rng, dtype, trials, threshold
        As for :func:`adjoint_test`.

    Returns
    -------
    AdjointTestResult
        Truthy when the worst relative difference is below the threshold; on failure the
        detail names the block and index of the largest difference. A NaN or infinite
        difference counts as an infinite error.

    Raises
    ------
    CheckOptionError
        As for :func:`adjoint_test`.
    """
    _require_operator(a, "numeric_equal: the left operand")
    _require_operator(b, "numeric_equal: the right operand")
    dtype = _checked_options("the numeric test", dtype, trials)
    rng = np.random.default_rng(0 if rng is None else rng)
    claim = f"{short(a)} == {short(b)} numerically"
    limit = threshold_for(dtype, max(a.domain.size, a.range.size)) if threshold is None else threshold
    problem = space_problem("domains differ", a.domain, b.domain) or space_problem(
        "ranges differ", a.range, b.range
    )
    if problem:
        return AdjointTestResult(claim, float("inf"), limit, False, dtype, 0, problem)
    worst, detail = 0.0, ""
    for _ in range(trials):
        x = a.domain.random(rng, dtype)
        left, right = a(x), b(x)
        difference = {name: np.asarray(left[name]) - np.asarray(right[name]) for name in a.range.names}
        scale = max(_norm(a.range, left), _norm(a.range, right))
        gap = _norm(a.range, difference)
        error = float(gap / scale) if scale > 0 else float(gap)
        if not np.isfinite(error):
            error = float("inf")
        if gap != 0 and error >= worst:  # a NaN gap counts, as an infinite error
            worst = error
            name = max(difference, key=lambda n: np.abs(difference[n]).max(initial=0.0))
            at = np.unravel_index(int(np.abs(difference[name]).argmax()), difference[name].shape)
            where = locate(
                a.range, a.range.offset(name) + int(np.ravel_multi_index(at, difference[name].shape))
            )
            detail = (
                f"largest difference at {where}: left {_fmt(left[name][at])}, right {_fmt(right[name][at])}"
            )
    passed = worst < limit or worst == 0.0
    return AdjointTestResult(claim, worst, limit, passed, dtype, trials, detail)


def _unit_states(space: Space, dtype: np.dtype):
    """Yield (flat position, unit state) for every entry of ``space``."""
    zeros = space.zeros(dtype)
    for block in space.blocks:
        offset = space.offset(block.name)
        for flat in range(block.size):
            state = dict(zeros)
            unit = np.zeros(block.shape, dtype=dtype)
            unit.reshape(-1)[flat] = 1
            state[block.name] = unit
            yield offset + flat, state


def _matrix_by_probing(op: LinearOperator, dtype: np.dtype) -> np.ndarray:
    """The dense matrix of ``op`` from applying it to unit vectors (numpy interpreter)."""
    matrix = np.zeros((op.range.size, op.domain.size), dtype=dtype)
    for column, state in _unit_states(op.domain, dtype):
        matrix[:, column] = op.range.flatten(op(state))
    return matrix


def _localize_adjoint(op: LinearOperator, adjoint: LinearOperator) -> str:
    """Name the first entry where op.H differs from conj(op)^T, found by probing both trees
    with unit vectors in complex128 (whatever dtype the test ran in)."""
    if op.domain.size * op.range.size > LOCALIZE_LIMIT:
        return f"not localized (the operator is larger than {LOCALIZE_LIMIT} entries)"
    dtype = np.dtype(np.complex128)
    forward = _matrix_by_probing(op, dtype)
    backward = _matrix_by_probing(adjoint, dtype)
    difference = np.abs(backward - forward.conj().T)
    scale = max(float(np.abs(forward).max(initial=0.0)), float(np.abs(backward).max(initial=0.0)))
    wrong = np.argwhere(difference > threshold_for(dtype, max(op.domain.size, op.range.size)) * scale)
    if wrong.size == 0:
        return "no single entry differs by more than the threshold"
    row, column = (int(i) for i in wrong[0])
    return (
        f"{len(wrong)} entries of op.H differ from conj(op)^T; first: row {locate(op.domain, row)}, "
        f"column {locate(op.range, column)}: op.H has {_fmt(backward[row, column])}, "
        f"conj(op)^T has {_fmt(np.conj(forward[column, row]))}"
    )


def _fmt(value: complex | float | int) -> str:
    number = complex(value)
    if number.imag == 0:
        return f"{number.real:.6g}"
    return f"{number:.6g}"
