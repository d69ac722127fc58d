"""Exact proofs through the sparse interpreter: adjoints and equalities, entry by entry.

Data movement has matrices of 0 and 1 (integers, with no rounding), so ``op.H`` can be proven
equal to the conjugate transpose of ``op`` exactly, and two trees can be proven to be the same
operator. Matrices whose entries are all integers (of any dtype, below 2**53) are compared with
no allowance. When an entry is a non-integer floating-point number (a tree scaled by 0.1),
products may round differently in the two trees; the comparison then allows
:data:`ROUNDING_ULPS` units in the last place of the largest entry and says so
(``Proof.exact`` is False).

A failure names the first differing entries as (block, index) pairs on both sides: the row's
block in one space and the column's block in the other.

These proofs report no progress (unlike :func:`verify.lift.lift` and
:func:`linop.algorithms.calibrate.calibrate`): the sparse interpreter calls one handler per
node, and a large operator is a tree of few nodes (``halo_windows`` of 2.25 M entries: a dozen
handler calls for both matrices) whose time is in a few whole-matrix scipy operations
(coo-to-csr conversions, sparse products, then one subtraction to compare), of costs that differ
by orders of magnitude; no count of steps would say how far a proof has got.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from linop import LinearOperator, Space
from linop.errors import OperandError

from ._text import short, space_problem
from .locate import Location, locations
from .verdict import Verdict

__all__ = [
    "Mismatch",
    "Proof",
    "exact_adjoint",
    "equal",
    "assert_exact_adjoint",
    "assert_equal",
]

MAX_REPORTED = 5
"""How many differing entries a failed proof lists."""

ROUNDING_ULPS = 64
"""Units of roundoff, relative to the largest entry of either matrix, allowed when a matrix has
non-integer floating-point entries."""


@dataclass(frozen=True, slots=True)
class Mismatch:
    """One differing matrix entry: its row and column as (block, index), and both values."""

    row: Location
    column: Location
    left: complex | float | int
    right: complex | float | int

    def __str__(self) -> str:
        return f"row {self.row}, column {self.column}: {_number(self.left)} versus {_number(self.right)}"


@dataclass(frozen=True)
class Proof(Verdict):
    """The outcome of an exact check; true when the claim holds.

    Attributes
    ----------
    claim : str
        What was checked, e.g. ``"C[x -> y].H == (C[x -> y])^H"``.
    passed : bool
        Whether it holds.
    detail : str
        One readable paragraph: the evidence, or the first differing entries.
    mismatches : tuple of Mismatch
        The first differing entries (at most :data:`MAX_REPORTED`), in row-major order.
    count : int
        How many entries differ in total.
    exact : bool
        True when the comparison was exact (integer-valued or identical entries); False when a
        rounding allowance was used.
    max_error : float
        Largest absolute difference between the two matrices.
    """

    claim: str
    passed: bool
    detail: str
    mismatches: tuple[Mismatch, ...] = ()
    count: int = 0
    exact: bool = True
    max_error: float = 0.0

    def __repr__(self) -> str:
        verdict = "proven" if self.passed else "FAILED"
        return f"Proof({verdict}: {self.claim}; {self.detail})"


def _number(value: complex | float | int) -> str:
    if isinstance(value, complex) or np.iscomplexobj(value):
        number = complex(value)
        if number.imag != 0:
            return f"{number:g}"
        real = number.real
    else:
        real = float(value)
    return str(int(real)) if real.is_integer() else f"{real:.17g}"


def _compare(
    claim: str,
    left: sp.sparray,
    right: sp.sparray,
    row_space: Space,
    column_space: Space,
    names: tuple[str, str],
    axes: tuple[str, str],
) -> Proof:
    """Compare two matrices of the same shape entry by entry."""
    left, right = sp.csr_array(left), sp.csr_array(right)
    dtype = np.result_type(left.dtype, right.dtype)
    difference = sp.coo_array(left.astype(dtype) - right.astype(dtype))
    difference.sum_duplicates()
    values = difference.data
    nonzero = values != 0  # NaN differs from everything, itself included
    rows, cols, values = difference.row[nonzero], difference.col[nonzero], values[nonzero]
    rows, cols, values = _drop_equal_infinities(left, right, rows, cols, values)
    exact = True
    max_error = float(np.abs(values).max()) if values.size else 0.0
    if values.size and not (_integer_valued(left.data) and _integer_valued(right.data)):
        scale = max(_largest_finite(left.data), _largest_finite(right.data))
        allowed = ROUNDING_ULPS * np.finfo(dtype).eps * scale
        significant = ~(np.abs(values) <= allowed)  # a NaN or infinite difference is significant
        exact = False
        rows, cols = rows[significant], cols[significant]
    shape = f"{left.shape[0]}x{left.shape[1]} {dtype} matrices"
    if rows.size == 0:
        how = "entry by entry" if exact else f"up to {ROUNDING_ULPS} ulps of rounding"
        return Proof(claim, True, f"equal {how} ({shape})", exact=exact, max_error=max_error)
    order = np.lexsort((cols, rows))
    rows, cols = rows[order], cols[order]
    first_rows, first_cols = rows[:MAX_REPORTED], cols[:MAX_REPORTED]
    left_dense = left[first_rows, first_cols]
    right_dense = right[first_rows, first_cols]
    mismatches = tuple(
        Mismatch(r, c, _scalar(a), _scalar(b))
        for r, c, a, b in zip(
            locations(row_space, first_rows),
            locations(column_space, first_cols),
            np.asarray(left_dense).ravel(),
            np.asarray(right_dense).ravel(),
        )
    )
    listed = "; ".join(str(m) for m in mismatches)
    more = f" (and {rows.size - len(mismatches)} more)" if rows.size > len(mismatches) else ""
    detail = (
        f"{rows.size} entries of the {shape} differ ({names[0]} versus {names[1]}; rows are "
        f"entries of {axes[0]}, columns entries of {axes[1]}); first: {listed}{more}"
    )
    return Proof(claim, False, detail, mismatches, int(rows.size), exact, max_error)


def _drop_equal_infinities(
    left: sp.csr_array, right: sp.csr_array, rows: np.ndarray, cols: np.ndarray, values: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Keep the differing entries, dropping those where both sides hold the same infinity
    (their difference is NaN, yet the entries are equal)."""
    nonfinite = np.flatnonzero(~np.isfinite(values))
    if nonfinite.size == 0:
        return rows, cols, values
    a = np.asarray(left[rows[nonfinite], cols[nonfinite]]).ravel()
    b = np.asarray(right[rows[nonfinite], cols[nonfinite]]).ravel()
    keep = np.ones(values.size, dtype=bool)
    keep[nonfinite[a == b]] = False
    return rows[keep], cols[keep], values[keep]


def _largest_finite(values: np.ndarray) -> float:
    """The largest finite magnitude (0 if none): the scale of the rounding allowance."""
    magnitudes = np.abs(values)
    return float(magnitudes[np.isfinite(magnitudes)].max(initial=0.0))


def _integer_valued(values: np.ndarray) -> bool:
    """Whether every value is an integer that floating point holds exactly (below 2**53),
    real and imaginary parts alike: such matrices are compared with no allowance."""
    if values.dtype.kind in "iub":
        return True
    parts = (values.real, values.imag) if values.dtype.kind == "c" else (values,)
    return all(bool(np.all((part == np.round(part)) & (np.abs(part) < 2.0**53))) for part in parts)


def _require_operator(value: object, what: str) -> None:
    if not isinstance(value, LinearOperator):
        raise OperandError(f"{what} must be a LinearOperator, not {type(value).__name__}")


def _scalar(value: object) -> complex | float | int:
    item = np.asarray(value).item()
    return item


def exact_adjoint(op: LinearOperator) -> Proof:
    """Prove that ``op.H`` is the conjugate transpose of ``op``, entry by entry.

    Both trees are materialized by the sparse interpreter (integer matrices for data
    movement) and compared with no tolerance (a rounding allowance only when an entry is a
    non-integer float, and then ``Proof.exact`` is False). Also checked: ``op.H`` maps ``op.range`` to
    ``op.domain``, and ``op.H.H == op`` structurally.

    Returns
    -------
    Proof
        True when the claim holds; on failure its ``detail`` lists the first differing
        entries, each as row (a block and index of ``op.domain``) and column (a block and
        index of ``op.range``) with the value of ``op.H`` and of ``conj(op)^T`` there.

    Examples
    --------
    >>> from linop import Space, Copy
    >>> space = Space([("x", (2,)), ("y", (2,))])
    >>> bool(exact_adjoint(Copy(space["x"], space["y"])))
    True
    """
    _require_operator(op, "exact_adjoint: op")
    adjoint = op.H
    claim = f"{short(op)}: op.H == conj(op)^T"
    problem = space_problem("op.H's domain is not op's range", adjoint.domain, op.range) or space_problem(
        "op.H's range is not op's domain", adjoint.range, op.domain
    )
    if problem:
        return Proof(claim, False, problem)
    proof = _compare(
        claim,
        adjoint.to_sparse(),
        op.to_sparse().conj().T,
        op.domain,
        op.range,
        ("op.H", "conj(op)^T"),
        ("op.domain", "op.range"),
    )
    if proof.passed and adjoint.H != op:
        return Proof(
            claim,
            False,
            f"the matrices agree, but op.H.H is not structurally op: {short(adjoint.H)} versus {short(op)}",
            exact=proof.exact,
        )
    return proof


def equal(a: LinearOperator, b: LinearOperator) -> Proof:
    """Prove that two trees are the same operator: same spaces and the same matrix, compared
    as in :func:`exact_adjoint`.

    Returns
    -------
    Proof
        On failure, ``detail`` names the first differing block of the spaces, or the first
        differing entries as row (a block and index of the range) and column (a block and
        index of the domain) with the value of ``a`` and of ``b`` there.
    """
    _require_operator(a, "equal: the left operand")
    _require_operator(b, "equal: the right operand")
    claim = f"{short(a)} == {short(b)}"
    problem = space_problem("domains differ", a.domain, b.domain) or space_problem(
        "ranges differ", a.range, b.range
    )
    if problem:
        return Proof(claim, False, problem)
    return _compare(
        claim, a.to_sparse(), b.to_sparse(), a.range, a.domain, ("left", "right"), ("the range", "the domain")
    )


def assert_exact_adjoint(op: LinearOperator) -> Proof:
    """:func:`exact_adjoint`, raising :class:`VerificationError` (an AssertionError) on failure."""
    return exact_adjoint(op).check()


def assert_equal(a: LinearOperator, b: LinearOperator) -> Proof:
    """:func:`equal`, raising :class:`VerificationError` (an AssertionError) on failure."""
    return equal(a, b).check()
