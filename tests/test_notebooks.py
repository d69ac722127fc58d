"""Every notebook in notebooks/ runs top to bottom in a real kernel, and is committed clean.

The kernel is ``python3`` as this interpreter sees it; jupyter_client launches it with this
very interpreter (``sys.executable``), which the first test checks, so the notebooks run
against the code under test. Kernels run from the repository root.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
TIMEOUT = 120


def execute(notebook: nbformat.NotebookNode) -> nbformat.NotebookNode:
    client = NotebookClient(
        notebook,
        kernel_name="python3",
        timeout=TIMEOUT,
        resources={"metadata": {"path": str(ROOT)}},
    )
    client.execute()
    return notebook


def test_kernel_is_this_interpreter():
    probe = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("import sys; print(sys.executable)")])
    out = execute(probe).cells[0].outputs[0]["text"].strip()
    assert os.path.realpath(out) == os.path.realpath(sys.executable)


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/ holds no notebook"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_committed_without_outputs(path):
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{path.name}: a code cell has outputs"
            assert cell.execution_count is None, f"{path.name}: a code cell has an execution count"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path):
    notebook = execute(nbformat.read(path, as_version=4))
    errors = [
        o for c in notebook.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"
    ]
    assert not errors
