"""The notebooks of notebooks/, each executed at most once per test session.

tests/test_notebooks.py checks the executed notebooks; tests/test_docs.py builds the docs from the
same executed copies, so no notebook runs twice. The kernel is ``python3`` as this interpreter
sees it (jupyter_client launches it with ``sys.executable``), started in the repository root.
"""

from __future__ import annotations

import copy
from functools import cache
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
TIMEOUT = 1200
"""Seconds one cell may take (generous: the suite must pass on a loaded machine)."""


def execute(notebook: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Run ``notebook`` top to bottom in a fresh kernel, in place; return it."""
    client = NotebookClient(
        notebook,
        kernel_name="python3",
        timeout=TIMEOUT,
        resources={"metadata": {"path": str(ROOT)}},
    )
    client.execute()
    return notebook


@cache
def _executed(path: Path) -> nbformat.NotebookNode:
    return execute(nbformat.read(path, as_version=4))


def executed(path: Path) -> nbformat.NotebookNode:
    """The notebook at ``path`` executed (once per session; each caller gets its own copy)."""
    return copy.deepcopy(_executed(path))
