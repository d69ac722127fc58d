"""Run the catalogue at every level and report: the engine of ``python -m verify``.

Levels, in order, for each entry of :mod:`verify.identities`:

==========  ==========================================================================
level       what it proves
==========  ==========================================================================
exact       the sparse interpreter's matrices, entry by entry (integers for data
            movement): ``op.H == conj(op)^T``, or ``lhs == rhs``
size-free   sympy block matrices with symbolic block sizes: the identity for every
            size (whole-block entries only)
symbolic    numpy interpreter on arrays of sympy symbols: the dot test (or both sides)
            expands to exactly 0 (small operators only)
float32,    the numeric adjoint test (or closeness of both sides) on random states in
float64,    that dtype, below a threshold from the dtype's machine epsilon
complex128
==========  ==========================================================================

A level that does not apply to an entry (size-free for an entry on parts of blocks) is left
out of the report rather than counted.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from .catalogue import Entry
from .errors import CheckOptionError

__all__ = ["LEVELS", "SCHEMA", "CheckResult", "Report", "check", "run", "format_table", "to_json"]

LEVELS: tuple[str, ...] = ("exact", "size-free", "symbolic", "float32", "float64", "complex128")
"""All levels, in report order."""

SCHEMA = "linop-verify-report/1"
"""Identifier of the JSON layout written by ``python -m verify --json``."""

SYMBOLIC_LIMIT = 400
"""Largest domain + range size for the entry-wise symbolic level."""

SEED = 20240601
"""Seed of the numeric levels' random states (the report is reproducible)."""


@dataclass(frozen=True)
class CheckResult:
    """One row of the report: one identity at one level.

    ``level`` is one of :data:`LEVELS`, or ``"build"`` for an entry whose operators could not
    be built (its only row, with status ``"error"``). ``status`` is ``"pass"``, ``"fail"`` (the claim is false) or ``"error"`` (the check
    raised). ``error`` is the measured error where there is one: the relative error of a
    numeric level, the largest absolute matrix difference of the exact level (0 when the
    matrices agree), None otherwise.
    """

    identity: str
    section: str
    statement: str
    kind: str
    level: str
    status: str
    error: float | None
    threshold: float | None
    seconds: float
    message: str

    @property
    def passed(self) -> bool:
        return self.status == "pass"


@dataclass
class Report:
    """All rows of a run, with the wall time."""

    results: list[CheckResult] = field(default_factory=list)
    identities: int = 0
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        """True when every check passed (and there was at least one)."""
        return bool(self.results) and all(r.passed for r in self.results)

    @property
    def failures(self) -> list[CheckResult]:
        return [r for r in self.results if not r.passed]

    def _repr_html_(self) -> str:
        """Jupyter: the report's rows as a table (see :mod:`verify.display`)."""
        from .display import report_html

        return report_html(self)


def _finite(value: Any) -> float | None:
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _levels_of(entry: Entry, levels: Iterable[str]) -> list[str]:
    chosen = []
    for level in levels:
        if level == "size-free" and entry.size_free is None:
            continue
        if level == "symbolic" and not entry.symbolic:
            continue
        chosen.append(level)
    return chosen


def check(entry: Entry, level: str, operators: tuple | None = None) -> CheckResult | None:
    """Run one level on one entry; None when the level does not apply to it."""
    from . import exact, numeric, symbolic

    start = time.perf_counter()

    def result(passed: bool, error: Any, threshold: Any, message: str) -> CheckResult:
        return CheckResult(
            entry.name,
            entry.section,
            entry.statement,
            entry.kind,
            level,
            "pass" if passed else "fail",
            _finite(error),
            _finite(threshold),
            time.perf_counter() - start,
            message,
        )

    try:
        ops = entry.build() if operators is None else operators
        if level == "exact":
            proof = exact.exact_adjoint(ops[0]) if entry.kind == "adjoint" else exact.equal(*ops)
            return result(proof.passed, proof.max_error, None, proof.detail)
        if level == "size-free":
            if entry.size_free is None:
                return None
            outcome = entry.size_free()
            return result(bool(outcome), None, None, str(getattr(outcome, "detail", outcome)))
        if level == "symbolic":
            size = max(op.domain.size + op.range.size for op in ops)
            if not entry.symbolic or size > SYMBOLIC_LIMIT:
                return None
            outcome = symbolic.dot_test(ops[0]) if entry.kind == "adjoint" else symbolic.equal(*ops)
            return result(
                outcome.passed, 0.0 if outcome.passed else None, None, outcome.detail or "residual is 0"
            )
        dtype = np.dtype(level)
        rng = np.random.default_rng(SEED)
        if entry.kind == "adjoint":
            outcome = numeric.adjoint_test(ops[0], rng=rng, dtype=dtype)
        else:
            outcome = numeric.numeric_equal(*ops, rng=rng, dtype=dtype)
        return result(outcome.passed, outcome.measured, outcome.threshold, outcome.detail)
    except Exception as exc:  # a crashing check is reported, not fatal
        return CheckResult(
            entry.name,
            entry.section,
            entry.statement,
            entry.kind,
            level,
            "error",
            None,
            None,
            time.perf_counter() - start,
            f"{type(exc).__name__}: {exc}",
        )


def run(
    entries: Iterable[Entry],
    levels: Iterable[str] = LEVELS,
    progress: Callable[[int, int, Entry, float], None] | None = None,
) -> Report:
    """Check every entry at every applicable level; ``progress(done, total, entry, seconds)``
    is called before each entry."""
    entries = list(entries)
    levels = tuple(levels)
    unknown = [level for level in levels if level not in LEVELS]
    if unknown:
        raise CheckOptionError(f"unknown level {unknown[0]!r}; the levels are {', '.join(LEVELS)}")
    report = Report(identities=len(entries))
    start = time.perf_counter()
    for done, entry in enumerate(entries):
        if progress is not None:
            progress(done, len(entries), entry, time.perf_counter() - start)
        try:
            ops = entry.build()
        except Exception as exc:  # a failing build is reported too
            report.results.append(
                CheckResult(
                    entry.name,
                    entry.section,
                    entry.statement,
                    entry.kind,
                    "build",
                    "error",
                    None,
                    None,
                    0.0,
                    f"{type(exc).__name__}: {exc}",
                )
            )
            continue
        for level in _levels_of(entry, levels):
            row = check(entry, level, ops)
            if row is not None:
                report.results.append(row)
    report.seconds = time.perf_counter() - start
    return report


def _error_text(row: CheckResult) -> str:
    if row.error is None:
        return "-"
    if row.error == 0:
        return "0"
    return f"{row.error:.1e}"


def _plural(count: int, one: str, many: str | None = None) -> str:
    return f"{count} {one if count == 1 else (many or one + 's')}"


def _time_text(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"


def format_table(report: Report, *, verbose: bool = False) -> str:
    """The report as a text table, failures spelled out below it."""
    width = max([len("identity"), *(len(r.identity) for r in report.results)])
    section_width = max([len("section"), *(len(r.section) for r in report.results)])
    header = (
        f"{'identity':<{width}}  {'section':<{section_width}}  {'level':<10}  result  {'error':>8}  "
        f"{'time':>7}"
    )
    lines = [header, "-" * len(header)]
    previous = None
    for row in report.results:
        name = row.identity if row.identity != previous else ""
        section = row.section if row.identity != previous else ""
        if verbose and row.identity != previous:
            lines.append(f"# {row.statement}")
        previous = row.identity
        verdict = {"pass": "pass", "fail": "FAIL", "error": "ERROR"}[row.status]
        lines.append(
            f"{name:<{width}}  {section:<{section_width}}  {row.level:<10}  {verdict:<6}  "
            f"{_error_text(row):>8}  {_time_text(row.seconds):>7}"
        )
    failures = report.failures
    lines.append("-" * len(header))
    lines.append(
        f"{_plural(report.identities, 'identity', 'identities')}, {_plural(len(report.results), 'check')}: "
        f"{len(report.results) - len(failures)} passed, {len(failures)} failed ({report.seconds:.1f} s)"
    )
    if failures:
        lines.append("")
        lines.append("Failures:")
        for row in failures:
            lines.append(f"- {row.identity} [{row.level}] ({row.statement}): {row.message}")
    return "\n".join(lines)


def to_json(report: Report, *, levels: Iterable[str] = LEVELS) -> str:
    """The report as JSON (layout :data:`SCHEMA`)."""
    failures = report.failures
    document = {
        "schema": SCHEMA,
        "passed": report.passed,
        "levels": list(levels),
        "summary": {
            "identities": report.identities,
            "checks": len(report.results),
            "passed": len(report.results) - len(failures),
            "failed": len(failures),
            "seconds": round(report.seconds, 3),
        },
        "results": [
            {**asdict(row), "passed": row.passed, "seconds": round(row.seconds, 6)} for row in report.results
        ],
    }
    return json.dumps(document, indent=2, allow_nan=False)
