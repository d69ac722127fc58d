"""Rich displays of verification results for Jupyter (the ``_repr_html_`` of every result).

Each result class keeps its plain ``repr`` for the terminal; in a notebook it shows as a small
table: the verdict, the claim, the evidence, and for a failed exact proof its first wrong
entries as (row, column) pairs of (block, index) locations. A :class:`~verify.report.Report`
shows the rows of ``python -m verify`` (see the README's "How to read the report").
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, Any

from linop.display import table_html

if TYPE_CHECKING:
    from .report import Report
    from .verdict import Verdict

__all__ = ["report_html", "verdict_html"]

_COLOURS = {True: "#1a7f37", False: "#cf222e"}

_FIELDS = (
    ("exact", "exact"),
    ("max_error", "largest difference"),
    ("count", "wrong entries"),
    ("measured", "relative error"),
    ("threshold", "threshold"),
    ("dtype", "dtype"),
    ("trials", "trials"),
)


def _badge(passed: bool, word: str | None = None) -> str:
    word = word or ("proven" if passed else "FAILED")
    return f'<b style="color:{_COLOURS[bool(passed)]}">{html.escape(word)}</b>'


def _value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def _word(result: Verdict) -> str:
    """ "proven" for exact and symbolic results, "passed" for numeric tests (tolerances)."""
    if not result.passed:
        return "FAILED"
    return "passed" if hasattr(result, "measured") else "proven"


def verdict_html(result: Verdict) -> str:
    """One result (Proof, AdjointTestResult, SymbolicResult, SizeFreeProof, ...) as HTML."""
    rows: list[tuple[str, str]] = [
        ("result", _badge(result.passed, _word(result))),
        ("claim", f"<code>{html.escape(result.claim)}</code>"),
    ]
    if result.detail:
        rows.append(("detail", html.escape(result.detail)))
    for attribute, label in _FIELDS:
        if hasattr(result, attribute):
            rows.append((label, html.escape(_value(getattr(result, attribute)))))
    parts = [table_html(("", type(result).__name__), rows, raw=(1,))]
    mismatches = getattr(result, "mismatches", ())
    if mismatches:
        wrong = [(str(m.row), str(m.column), _value(m.left), _value(m.right)) for m in mismatches]
        count = getattr(result, "count", len(mismatches))
        parts.append(
            table_html(
                ("row", "column", "left", "right"),
                wrong,
                caption=f"first wrong entries (of {count})",
                more=max(0, count - len(mismatches)),
            )
        )
    return "".join(parts)


def _error_text(error: float | None) -> str:
    if error is None:
        return "-"
    return "0" if error == 0 else f"{error:.1e}"


def report_html(report: Report) -> str:
    """The rows of a report (identity, section, level, result, error, time), failures last."""
    words = {"pass": "pass", "fail": "FAIL", "error": "ERROR"}
    rows = [
        (
            html.escape(r.identity),
            html.escape(r.section),
            html.escape(r.level),
            _badge(r.passed, words.get(r.status, r.status)),
            _error_text(r.error),
            f"{r.seconds * 1000:.0f} ms",
        )
        for r in report.results
    ]
    failures = report.failures
    caption = (
        f"{report.identities} identities, {len(report.results)} checks: "
        f"{len(report.results) - len(failures)} passed, {len(failures)} failed ({report.seconds:.1f} s)"
    )
    parts = [
        table_html(
            ("identity", "sec", "level", "result", "error", "time"), rows, caption=caption, raw=(0, 1, 2, 3)
        )
    ]
    if failures:
        parts.append(
            table_html(
                ("identity", "level", "message"),
                ((f.identity, f.level, f.message) for f in failures),
                caption="failures",
            )
        )
    return "".join(parts)
