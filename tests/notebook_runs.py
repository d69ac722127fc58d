"""The notebooks of notebooks/, each executed at most once per test session.

tests/test_notebooks.py checks the executed notebooks; tests/test_docs.py builds the docs from the
same executed copies, so no notebook runs twice. The kernel is ``python3`` as this interpreter
sees it (jupyter_client launches it with ``sys.executable``), started in the repository root.

One kernel runs them all, one after another (a kernel's start and its first imports of numpy,
scipy, sympy, matplotlib and linop cost more than most notebooks). Before each notebook the
kernel forgets every name (``%reset -f``), closes every figure and returns to the repository
root: a notebook that uses a name it did not define fails as it would in a fresh kernel. What
stays is what a module keeps, such as modules already imported.
"""

from __future__ import annotations

import atexit
import copy
from functools import cache
from pathlib import Path

import nbformat
from jupyter_client.manager import AsyncKernelManager
from jupyter_core.utils import run_sync
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
TIMEOUT = 1200
"""Seconds one cell may take (generous: the suite must pass on a loaded machine)."""


FRESH_START = f"""\
%reset -f
import matplotlib.pyplot
matplotlib.pyplot.close("all")
del matplotlib
import os
os.chdir({str(ROOT)!r})
del os
"""
"""What the kernel runs before each notebook: no name, no figure, the repository root."""


@cache
def _kernel() -> AsyncKernelManager:
    """The session's one kernel manager (its kernel starts with the first notebook, and is
    shut down when the session ends)."""
    manager = AsyncKernelManager(kernel_name="python3")

    def shut_down() -> None:
        if manager.has_kernel:
            run_sync(manager.shutdown_kernel)(now=True)

    atexit.register(shut_down)
    return manager


def _run(notebook: nbformat.NotebookNode) -> nbformat.NotebookNode:
    client = NotebookClient(
        notebook,
        km=_kernel(),
        kernel_name="python3",
        timeout=TIMEOUT,
        resources={"metadata": {"path": str(ROOT)}},
    )
    client.execute()
    return notebook


def execute(notebook: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Run ``notebook`` top to bottom in the session's kernel, from a fresh start (no name, no
    figure, the repository root), in place; return it."""
    _run(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(FRESH_START)]))
    return _run(notebook)


@cache
def _executed(path: Path) -> nbformat.NotebookNode:
    return execute(nbformat.read(path, as_version=4))


def executed(path: Path) -> nbformat.NotebookNode:
    """The notebook at ``path`` executed (once per session; each caller gets its own copy)."""
    return copy.deepcopy(_executed(path))
