"""The suite's own layout under pytest-xdist: a test module whose tests share one costly result
(a module-scoped fixture, or a ``functools.cache`` of a launch) is in ``conftest.GROUPS``, so
that one worker runs it. Spread over two workers, each would pay for it: the JAX layers' device
process (about 30 s of CPU) ran twice in every CI run before its module was grouped."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import GROUPS

HERE = Path(__file__).resolve().parent
SHARED = re.compile(r'@pytest\.fixture\(scope="module"\)|@functools\.cache\b')


def shared_result_modules() -> list[str]:
    return sorted(path.name for path in HERE.glob("test_*.py") if SHARED.search(path.read_text()))


def test_every_module_sharing_a_costly_result_runs_on_one_worker():
    grouped = {key.partition("::")[0] for key in GROUPS}
    assert shared_result_modules(), "the pattern finds nothing: it no longer matches the suite"
    missing = [
        name for name in shared_result_modules() if name not in grouped and name != Path(__file__).name
    ]
    assert not missing, f"add these test modules to conftest.GROUPS: {missing}"
