"""The documentation: the Sphinx build is warning-free, the docstring examples run, and every
reference into ``docs/theory.md`` names a section that exists."""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
THEORY = DOCS / "theory.md"

ANCHORS = (
    "memory-and-blocks",
    "primitives",
    "distributed-primitives",
    "collectives",
    "halo-exchange",
    "halo-geometry",
    "adjoint-test",
    "local-operators",
    "layers",
    "collective-algorithms",
    "cost-model",
    "outer-product-gradients",
    "dtypes",
)
"""The stable section anchors of docs/theory.md that code, README, CLI and notebooks cite."""

DOCTESTED = (
    "linop.space",
    "linop.operator",
    "linop.primitives",
    "linop.movement",
    "linop.partition",
    "linop.halo_geometry",
    "linop.halo",
    "linop.layout",
    "linop.collectives",
    "linop.repartition",
    "linop.mesh_layout",
    "linop.redistribute",
    "linop.version",
    "linop.local",
    "linop.display",
    "verify.identities",
    "verify.exact",
    "verify.numeric",
)
"""Modules whose docstring examples run as doctests."""

REFERENCE = re.compile(r"docs/theory\.md#([A-Za-z0-9-]+)")
SEARCHED = ("linop", "verify", "tests", "benchmarks", "notebooks")


def slug(heading: str) -> str:
    """The anchor MyST (``myst_heading_anchors``) and GitHub give a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def theory_anchors() -> set[str]:
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,3} (.+)$", THEORY.read_text(), re.MULTILINE)}


def test_theory_has_every_stable_anchor():
    missing = set(ANCHORS) - theory_anchors()
    assert not missing, f"docs/theory.md lacks the sections {sorted(missing)}"


def project_files() -> list[Path]:
    files = [ROOT / "README.md"]
    for folder in SEARCHED:
        files += [p for p in (ROOT / folder).rglob("*") if p.suffix in {".py", ".ipynb", ".md"}]
    return [p for p in files if "__pycache__" not in p.parts and p != Path(__file__)]


def test_every_reference_into_the_theory_names_an_existing_section():
    anchors = theory_anchors()
    broken = []
    for path in project_files():
        text = path.read_text(encoding="utf-8")
        broken += [f"{path.relative_to(ROOT)}: #{a}" for a in REFERENCE.findall(text) if a not in anchors]
    assert not broken, "references to sections docs/theory.md lacks:\n" + "\n".join(broken)


#: A cited markdown file: ``docs/theory.md``, ``README.md``, ``../elsewhere/notes.md``.
CITED_FILE = re.compile(r"(?<![\w/.-])((?:\.\./)*[\w./-]*\w\.md)\b")


def missing_files(path: Path, text: str) -> list[str]:
    """The markdown files ``text`` (of ``path``) cites that the project does not contain: a
    path leaving the repository, or one found neither from the root, beside ``path``, nor in
    docs/."""
    return [
        name
        for name in sorted(set(CITED_FILE.findall(text)))
        if name.startswith("../") or not any(c.exists() for c in (ROOT / name, path.parent / name, DOCS / name))
    ]


def test_every_cited_markdown_file_is_in_the_project():
    offenders = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in project_files()
        for name in missing_files(path, path.read_text(encoding="utf-8"))
    ]
    assert not offenders, "files cite documents the project does not contain:\n" + "\n".join(offenders)


def test_the_citation_check_catches_files_outside_the_project():
    here = ROOT / "tests" / "test_docs.py"
    text = "see ../notes/DESIGN.md, docs/no-such-file.md and docs/theory.md"
    assert missing_files(here, text) == ["../notes/DESIGN.md", "docs/no-such-file.md"]


def test_the_reference_checks_catch_a_broken_anchor():
    assert slug("Outer-product gradients") == "outer-product-gradients"
    assert slug("Memory and blocks") == "memory-and-blocks"
    assert "no-such-section" not in theory_anchors()
    assert REFERENCE.findall("see ``docs/theory.md#no-such-section``.") == ["no-such-section"]


@pytest.mark.parametrize("name", DOCTESTED, ids=DOCTESTED)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    result = doctest.testmod(module, optionflags=flags, report=False, verbose=False)
    assert result.failed == 0, (
        f"{result.failed} of {result.attempted} examples of {name} failed (run doctest -v)"
    )


def test_public_nodes_have_doctested_examples():
    import linop

    names = [
        "Block",
        "Space",
        "Region",
        "Allocate",
        "Deallocate",
        "Clear",
        "Add",
        "Copy",
        "Move",
        "SendRecv",
        "Partition",
        "DistributedTensor",
        "Kernel",
        "halo_geometry",
        "HaloExchange",
        "halo_windows",
        "pad_shim",
        "trim_shim",
        "Broadcast",
        "SumReduce",
        "AllReduce",
        "AllGather",
        "ReduceScatter",
        "Repartition",
        "Scatter",
        "Gather",
        "MeshLayout",
        "Redistribute",
        "LinearOperator",
        "Identity",
        "Zero",
        "Composition",
        "Sum",
        "Scaled",
    ]
    lacking = [n for n in names if ">>> " not in (getattr(linop, n).__doc__ or "")]
    assert not lacking, f"no Examples in the docstrings of {lacking}"
    modules = {getattr(linop, n).__module__ for n in names}
    assert modules <= set(DOCTESTED), f"examples in {sorted(modules - set(DOCTESTED))} are not run"


def test_sphinx_build_is_warning_free(tmp_path):
    for tool in ("sphinx", "numpydoc", "myst_parser"):
        assert importlib.util.find_spec(tool), (
            f"{tool} missing: install the docs extra (pip install -e '.[docs]')"
        )
    command = [
        sys.executable,
        "-m",
        "sphinx",
        "-W",
        "--keep-going",
        "-q",
        "-j",
        "1",
        "-b",
        "html",
        str(DOCS),
        str(tmp_path / "html"),
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-6000:]
    theory = (tmp_path / "html" / "theory.html").read_text(encoding="utf-8")
    for anchor in ANCHORS:
        assert f'id="{anchor}"' in theory, anchor
    api = (tmp_path / "html" / "api" / "linop.html").read_text(encoding="utf-8")
    assert 'id="linop.space.Block"' in api and 'id="linop.halo.HaloExchange"' in api
