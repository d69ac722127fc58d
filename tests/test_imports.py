"""Import hygiene: ``import linop`` is cheap and loads no interpreter, and no module of the
project imports another module's private names."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("linop", "verify")


def _fresh(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout


def test_import_linop_loads_no_backend_and_no_scipy_linalg():
    loaded = _fresh(
        "import sys, linop\n"
        "print(sorted(m for m in sys.modules\n"
        "             if m.startswith('linop.backends.') or m in ('scipy.sparse.linalg', 'mpi4py')))\n"
    )
    assert loaded.strip() == "[]", loaded


def test_scipy_adapter_still_reachable_from_the_package():
    assert _fresh("import linop; print(linop.aslinearoperator.__module__)").strip() == (
        "linop.backends.scipy_interop"
    )


def third_party(modules: list[str]) -> list[str]:
    """The top-level names of ``modules`` that are neither the standard library, numpy nor
    linop itself."""
    tops = {m.split(".")[0] for m in modules if not m.startswith("_")}
    return sorted(tops - {"linop", "numpy"} - set(sys.stdlib_module_names))


def test_import_linop_is_cheap():
    """``import linop`` loads nothing but numpy and the standard library (no scipy, sympy,
    hypothesis, array-api-compat): what keeps it at about 45 ms of its own on the idle
    development machine. The time itself is not asserted (a loaded machine takes seconds)."""
    loaded = _fresh(
        "import sys, numpy\nbefore = set(sys.modules)\nimport linop\nprint(sorted(set(sys.modules) - before))"
    )
    modules = ast.literal_eval(loaded.strip())
    assert "linop" in modules
    assert third_party(modules) == [], f"import linop loads {third_party(modules)}"
    assert third_party(["linop.space", "heapq", "_heapq", "scipy.sparse", "numpy.linalg"]) == ["scipy"]


def _private_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {alias.name} from {node.module}")
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_imports_private_names_of_another(package):
    offenders = [line for path in sorted((ROOT / package).rglob("*.py")) for line in _private_imports(path)]
    assert not offenders, "\n".join(offenders)
