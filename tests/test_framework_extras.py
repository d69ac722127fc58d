"""Importing a torch or JAX adapter without its library names the extra that installs it (as
linop.plot and the MPI interpreter do): each in a fresh process whose library import fails."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BLOCKED = """
import sys
sys.modules["{library}"] = None  # the import fails as where it is not installed
try:
    import {module}
except ModuleNotFoundError as error:
    print(type(error).__name__, error.name, error, sep="|")
"""


ADAPTERS = (
    [("torch", m) for m in ("torch_function", "torch_layers", "dtensor")]
    + [("jax", m) for m in ("jax_function", "jax_sharded", "jax_layers", "jax_losses", "jax_norm")]
    + [("equinox", "jax_modules")]
)


@pytest.mark.parametrize("library, module", ADAPTERS, ids=[m for _, m in ADAPTERS])
def test_an_adapter_without_its_library_names_the_extra(library, module):
    found = subprocess.run(
        [sys.executable, "-c", BLOCKED.format(library=library, module=f"linop.frameworks.{module}")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert found.returncode == 0, found.stderr
    kind, name, message = found.stdout.strip().split("|")
    assert (kind, name) == ("ModuleNotFoundError", library)
    assert f"linop.frameworks.{module} needs {library}" in message
    assert (
        f"pip install -e '.[{library}]'" in message and f"pip install 'linop-adjoint[{library}]'" in message
    )


def test_another_missing_module_is_reported_as_it_is():
    from linop.frameworks.extras import missing_extra

    error = ModuleNotFoundError("No module named 'torch._C'", name="sympy")
    assert missing_extra(error, "torch", "linop.frameworks.torch_function") is error


def test_the_readme_extras_table_names_modules_that_exist():
    """The torch and jax rows of README's extras table name the adapter modules as they are."""
    import importlib.util
    import re

    rows = [
        line
        for line in (ROOT / "README.md").read_text().splitlines()
        if line.startswith(("| `torch`", "| `jax`"))
    ]
    assert len(rows) == 2, rows
    for row in rows:
        names = re.findall(r"`(?:linop\.frameworks\.)?(\w+)`", row.split("|")[2])
        assert len(names) >= 2, row
        for name in names:
            assert importlib.util.find_spec(f"linop.frameworks.{name}") is not None, (name, row)


def test_importing_names_the_extra_and_lets_another_failure_through():
    from linop.frameworks.extras import importing

    with pytest.raises(ModuleNotFoundError, match=r"linop\.frameworks\.x needs jax") as caught:
        with importing("jax", "linop.frameworks.x"):
            raise ModuleNotFoundError("No module named 'jax'", name="jax")
    assert caught.value.name == "jax"
    with pytest.raises(ModuleNotFoundError, match="No module named 'sympy'"):
        with importing("jax", "linop.frameworks.x"):
            raise ModuleNotFoundError("No module named 'sympy'", name="sympy")
