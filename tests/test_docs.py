"""The documentation: the Sphinx build is warning-free, the docstring examples run, and every
reference into ``docs/theory.md`` names a section that exists."""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import nbformat
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
    "linop.layers.chain",
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
        if name.startswith("../")
        or not any(c.exists() for c in (ROOT / name, path.parent / name, DOCS / name))
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


SPHINX_TIMEOUT = 1800
"""Seconds the Sphinx build may take: generous (about 40 s on an idle machine), so a loaded one
still passes; past it the test reports that the build timed out."""


def docs_source(folder: Path) -> Path:
    """A copy of docs/ whose notebooks/ holds the notebooks executed (once per session, shared
    with tests/test_notebooks.py) instead of the link to the clean ones."""
    from notebook_runs import NOTEBOOKS, executed

    source = folder / "docs"
    shutil.copytree(DOCS, source, symlinks=True, ignore=shutil.ignore_patterns("_build"))
    (source / "notebooks").unlink()
    (source / "notebooks").mkdir()
    for path in NOTEBOOKS:
        nbformat.write(executed(path), source / "notebooks" / path.name)
    return source


@pytest.fixture(scope="module")
def built_docs(tmp_path_factory) -> Path:
    """The HTML docs, built warning-free (``-W``) from the executed notebooks."""
    for tool in ("sphinx", "numpydoc", "myst_parser", "myst_nb", "furo", "nbclient"):
        assert importlib.util.find_spec(tool), f"{tool} missing: install the docs extra (.[docs])"
    assert (DOCS / "notebooks").resolve() == ROOT / "notebooks", "docs/notebooks links to notebooks/"
    folder = tmp_path_factory.mktemp("docs")
    source = docs_source(folder)
    html = folder / "html"
    command = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-j", "1", "-b", "html"]
    command += ["-D", "nb_execution_mode=off", str(source), str(html)]
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=SPHINX_TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the Sphinx build timed out after {SPHINX_TIMEOUT} s")
    assert done.returncode == 0, done.stderr[-6000:]
    return html


@pytest.mark.timeout(2 * SPHINX_TIMEOUT)
def test_sphinx_build_is_warning_free(built_docs):
    theory = (built_docs / "theory.html").read_text(encoding="utf-8")
    for anchor in ANCHORS:
        assert f'id="{anchor}"' in theory, anchor
    api = (built_docs / "api" / "linop.html").read_text(encoding="utf-8")
    assert 'id="linop.space.Block"' in api and 'id="linop.halo.HaloExchange"' in api
    assert 'href="api/linop.html#linop.space.Space"' in theory, "theory links resolve into the API"
    assert 'href="../theory.html#collectives"' in api, "docstrings' theory references are links"


def test_docstring_references_into_the_theory_become_links():
    """docs/conf.py turns ``docs/theory.md#anchor`` in a docstring (quoted or not) into a link to
    that section of the built theory page; other text is left alone."""
    spec = importlib.util.spec_from_file_location("docs_conf", DOCS / "conf.py")
    assert spec is not None and spec.loader is not None
    conf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conf)
    lines = [
        "Collectives (``docs/theory.md#collectives``).",
        "(docs/theory.md#local-operators); the rest",
        "no reference here, nor in x/docs/theory.md#dtypes",
    ]
    conf._theory_links(None, "module", "linop.collectives", None, {}, lines)
    assert lines == [
        "Collectives (`docs/theory.md#collectives <../theory.html#collectives>`__).",
        "(`docs/theory.md#local-operators <../theory.html#local-operators>`__); the rest",
        "no reference here, nor in x/docs/theory.md#dtypes",
    ]


def test_the_notebooks_are_in_the_docs_navigation(built_docs):
    from notebook_runs import NOTEBOOKS

    index = (built_docs / "index.html").read_text(encoding="utf-8")
    for path in NOTEBOOKS:
        page = built_docs / "notebooks" / f"{path.stem}.html"
        assert page.exists(), page.name
        assert f'href="notebooks/{path.stem}.html"' in index, f"{path.name} is not in the navigation"
    halo = (built_docs / "notebooks" / "02_halo.html").read_text(encoding="utf-8")
    assert 'class="cell_output' in halo and "<img" in halo, "the stored outputs are rendered"


LOADING = {"script": "src", "link": "href", "img": "src", "iframe": "src", "source": "src", "embed": "src"}
LOADING |= {"object": "data", "video": "src", "audio": "src"}
"""The tags that load a resource, and the attribute naming it."""


class ExternalLoads(HTMLParser):
    """Every resource an HTML page loads from outside the build: ``<script src>``, ``<link
    href>`` (stylesheets, icons, preloads; not ``<a>`` links, which load nothing), ``<img src>``,
    ``<iframe src>``, ``<source src>``, ``<embed src>``, ``<object data>``."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def handle_starttag(self, tag, attrs):
        wanted = LOADING.get(tag)
        for name, value in attrs:
            if name == wanted and value and re.match(r"(https?:)?//", value.strip()):
                self.found.append(f"<{tag} {name}={value}>")


def external_loads(html: str) -> list[str]:
    parser = ExternalLoads()
    parser.feed(html)
    return parser.found


REMOTE_CSS = re.compile(r"@import\s+(url\()?['\"]?(https?:)?//|url\(['\"]?(https?:)?//")


def test_no_page_loads_anything_from_outside_the_build(built_docs):
    pages = sorted(built_docs.rglob("*.html"))
    assert len(pages) > 10
    offenders = [f"{p.relative_to(built_docs)}: {x}" for p in pages for x in external_loads(p.read_text())]
    styles = sorted(built_docs.rglob("*.css"))
    offenders += [str(s.relative_to(built_docs)) for s in styles if REMOTE_CSS.search(s.read_text("utf-8"))]
    assert not offenders, "the docs load from the network:\n" + "\n".join(offenders)


def test_the_external_load_check_catches_a_cdn():
    page = (
        '<script src="https://cdn.jsdelivr.net/npm/mathjax@3/es5/tex-chtml.js"></script>'
        '<link rel="stylesheet" href="//fonts.example.org/a.css"><img src="_images/x.png">'
        '<a href="https://example.org">a link loads nothing</a><script src="_static/mathjax/tex-chtml.js">'
    )
    assert external_loads(page) == [
        "<script src=https://cdn.jsdelivr.net/npm/mathjax@3/es5/tex-chtml.js>",
        "<link href=//fonts.example.org/a.css>",
    ]
    assert REMOTE_CSS.search("@import url('https://fonts.example.org/x.css');")
    assert not REMOTE_CSS.search("src: url(fonts/woff-v2/MathJax_Zero.woff)")


def test_math_renders_from_a_mathjax_in_the_build(built_docs):
    mathjax = built_docs / "_static" / "mathjax"
    assert (mathjax / "tex-chtml.js").is_file()
    assert any((mathjax / "output" / "chtml" / "fonts").rglob("*.woff")), "MathJax's fonts are in the build"
    for page in ("theory.html", "notebooks/01_primitives.html"):
        html = (built_docs / page).read_text(encoding="utf-8")
        assert 'src="' in html and "_static/mathjax/tex-chtml.js" in html, page
        assert 'class="math' in html, f"{page} has no formulas"


def test_signatures_name_type_aliases_and_no_private_class_shows(built_docs):
    api = (built_docs / "api" / "linop.html").read_text(encoding="utf-8")
    text = " ".join(re.sub(r"<[^>]+>", "", api).split())
    start = text.index("apply( state")
    signature = text[start : start + 400]
    assert "dtype: numpy.typing.DTypeLike | None = None" in signature, signature
    for page in (built_docs / "api").glob("*.html"):
        text = re.sub(r"<[^>]+>", "", page.read_text(encoding="utf-8"))
        assert "TypeAliasForwardRef" not in text and "_SupportsDType" not in text, page.name
        private = sorted(set(re.findall(r"Bases: ([\w.]*\b_\w+)", text)))
        assert not private, f"{page.name} shows private bases {private}"
        anchors = re.findall(r'id="((?:linop|verify)\.[\w.]*\._\w+)"', page.read_text(encoding="utf-8"))
        assert not [a for a in anchors if not a.rsplit(".", 1)[1].startswith("__")], anchors


RAW_ROLE = re.compile(r"\{[a-z]+(?::[a-z]+)?\}`")
"""A Sphinx role in MyST syntax, ``{class}`X```: a code host shows it raw."""


def test_the_theory_reads_on_a_code_host():
    for path in (THEORY, DOCS / "index.md"):
        roles = RAW_ROLE.findall(path.read_text(encoding="utf-8"))
        assert not roles, (
            f"{path.name} shows {len(roles)} raw Sphinx roles on a code host; use [text](#target)"
        )
    assert RAW_ROLE.findall("A {class}`~linop.space.Space` and {py:func}`f`") == ["{class}`", "{py:func}`"]
