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


def test_import_linop_is_cheap():
    """The package's own import time (numpy already loaded), with a generous bound for a loaded
    machine; on the idle development machine it is about 45 ms."""
    seconds = float(
        _fresh("import time, numpy\nstart = time.perf_counter()\nimport linop\nprint(time.perf_counter() - start)")
    )
    assert seconds < 1.0, f"import linop took {seconds * 1000:.0f} ms of its own"


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
