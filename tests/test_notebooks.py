"""Every notebook in notebooks/ runs top to bottom in a real kernel, and is committed clean.

The kernel is ``python3`` as this interpreter sees it; jupyter_client launches it with this
very interpreter (``sys.executable``), which the first test checks, so the notebooks run
against the code under test. One kernel runs every notebook, from the repository root and a
fresh start each time (no name of the notebook before: checked); each notebook runs once per
session (tests/notebook_runs.py), and tests/test_docs.py renders the same executed copies. Every executed notebook must
show rich outputs (LaTeX, HTML and PNG), the displays of :mod:`linop.display` and
:mod:`linop.plot`.
"""

from __future__ import annotations

import os
import sys

import nbformat
import pytest
from notebook_runs import NOTEBOOKS, execute, executed


def test_kernel_is_this_interpreter():
    probe = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("import sys; print(sys.executable)")])
    out = execute(probe).cells[0].outputs[0]["text"].strip()
    assert os.path.realpath(out) == os.path.realpath(sys.executable)


def test_a_notebook_does_not_see_the_names_of_the_one_before():
    """The notebooks share one kernel (tests/notebook_runs.py), each from a fresh start."""
    from nbclient.exceptions import CellExecutionError

    execute(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("left_behind = 1")]))
    with pytest.raises(CellExecutionError, match="left_behind"):
        execute(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("left_behind")]))


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


RICH = {"text/latex", "text/html", "image/png"}
"""The rich outputs every notebook shows: operators' block matrices (LaTeX), tables and trees
(HTML) and pictures (PNG)."""


def mime_types(notebook: nbformat.NotebookNode) -> set[str]:
    """Every mime type of the executed cells' display outputs."""
    return {
        kind
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.outputs
        if output.output_type in ("display_data", "execute_result")
        for kind in output.get("data", {})
    }


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path):
    notebook = executed(path)
    errors = [
        o for c in notebook.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"
    ]
    assert not errors
    missing = RICH - mime_types(notebook)
    assert not missing, f"{path.name}: no output of type {sorted(missing)}"


def test_mime_types_reads_display_outputs():
    cell = nbformat.v4.new_code_cell("x")
    cell.outputs = [
        nbformat.v4.new_output("execute_result", {"text/plain": "x", "text/latex": "$x$"}, execution_count=1),
        nbformat.v4.new_output("stream", name="stdout", text="image/png"),
    ]
    assert mime_types(nbformat.v4.new_notebook(cells=[cell])) == {"text/plain", "text/latex"}
