"""What every fuzz launch prints (``tests/fuzz_engines/``): one ``OUTCOME`` line per call as
JSON (entry, description, verdict, evidence), then one ``SUMMARY`` line; read back by
``tests/test_fuzz_engines.py`` (:func:`read`)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict
from typing import Any


def emit(label: str, outcomes: Iterable[Any], seconds: float) -> None:
    """Print every outcome and the counts of each verdict."""
    outcomes = list(outcomes)
    for outcome in outcomes:
        print("OUTCOME " + json.dumps({"launch": label, **asdict(outcome)}), flush=True)
    counts = Counter(o.verdict for o in outcomes)
    print(
        f"SUMMARY {label}: {len(outcomes)} calls in {seconds:.1f} s: {dict(sorted(counts.items()))}",
        flush=True,
    )


def read(stdout: str) -> list[dict[str, str]]:
    """The ``OUTCOME`` lines of a launch's output."""
    return [
        json.loads(line[len("OUTCOME ") :]) for line in stdout.splitlines() if line.startswith("OUTCOME ")
    ]
