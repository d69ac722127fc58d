"""The suite's own layout under pytest-xdist: a test module whose tests share one costly result
(a module-scoped fixture, or a ``functools.cache`` of a launch) is in ``conftest.GROUPS``, so
that one worker runs it. Spread over two workers, each would pay for it: the JAX layers' device
process (about 30 s of CPU) ran twice in every CI run before its module was grouped."""

from __future__ import annotations

import ast
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHARED = re.compile(r"""@pytest\.fixture\(scope=["'](module|session)["']\)|@(functools\.)?(lru_)?cache\b""")


def suite_groups() -> dict[str, str]:
    """``GROUPS`` of tests/conftest.py, read from its source (an import by the name ``conftest``
    may find tests/mpi's instead, in a run of the whole suite)."""
    tree = ast.parse((HERE / "conftest.py").read_text())
    (value,) = [
        node.value
        for node in tree.body
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["GROUPS"]
    ]
    return ast.literal_eval(value)


def shared_result_modules() -> list[str]:
    return sorted(path.name for path in HERE.glob("test_*.py") if SHARED.search(path.read_text()))


def test_every_module_sharing_a_costly_result_runs_on_one_worker():
    grouped = {key.partition("::")[0] for key in suite_groups()}
    assert shared_result_modules(), "the pattern finds nothing: it no longer matches the suite"
    missing = [
        name for name in shared_result_modules() if name not in grouped and name != Path(__file__).name
    ]
    assert not missing, f"add these test modules to conftest.GROUPS: {missing}"
