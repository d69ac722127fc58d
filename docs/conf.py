"""Sphinx configuration: the theory (MyST markdown), the notebooks (myst-nb) and the API reference
(autodoc + numpydoc), in the furo theme.

Build with ``make docs`` (``sphinx-build -W --keep-going -b html docs docs/_build/html``); the test
suite builds it too (``tests/test_docs.py``, from notebooks it has already executed). Nothing is
loaded from the network: MathJax is served from the build (``sphinx-mathjax-offline``), and no
extension reaches out while building.
"""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from linop.version import package_version  # noqa: E402

project = "linop"
author = "the linop developers"
copyright = "2026, the linop developers"
release = package_version()
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.mathjax",
    "sphinx-mathjax-offline",  # MathJax 3 copied into _build/html/_static/mathjax
    "numpydoc",
    "myst_nb",  # MyST markdown (it loads myst_parser) and Jupyter notebooks
]

exclude_patterns = ["_build", "**/.ipynb_checkpoints"]
root_doc = "index"

# The notebooks (docs/notebooks links to the repository's notebooks/, committed without outputs)
# are executed once during the build; tests/test_docs.py passes ``-D nb_execution_mode=off`` with
# notebooks its kernels already ran.
nb_execution_mode = "auto"
nb_execution_timeout = 1200  # per cell; generous (notebook 05 launches MPI ranks)
nb_execution_raise_on_error = True
nb_execution_show_tb = True

# MyST: $...$ and $$...$$ math, and heading slugs as anchors (docs/theory.md#halo-exchange).
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence"]
myst_heading_anchors = 3

# autodoc: members in source order, type hints in the signature only, numpy's type aliases by
# name (not their expansion: ``DTypeLike`` is a union of some forty types).
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_type_aliases = {
    "npt.DTypeLike": "numpy.typing.DTypeLike",
    "DTypeLike": "numpy.typing.DTypeLike",
    "npt.ArrayLike": "numpy.typing.ArrayLike",
    "ArrayLike": "numpy.typing.ArrayLike",
    "npt.NDArray": "numpy.typing.NDArray",
}
python_maximum_signature_line_length = 100

# numpydoc: no autosummary tables of members (autodoc lists them), no cross-referencing of
# every type word.
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False
# numpydoc loads autosummary, which would scan every page and docstring for autosummary
# directives to generate stub pages; there are none.
autosummary_generate = False

html_theme = "furo"
html_title = f"linop {release}"
html_static_path = ["_static"]
html_css_files = ["linop.css"]  # a wider column for code (lines of up to 110 characters)


_ALIAS_REPR = re.compile(r"TypeAliasForwardRef\('([\w.]+)'\)")
"""How Sphinx 9 prints an ``autodoc_type_aliases`` entry inside a union (``DTypeLike | None``)."""


def _alias_signature(app, what, name, obj, options, signature, return_annotation):
    """Type aliases (``State = dict[str, np.ndarray]``) have no signature: answer before numpydoc,
    whose answer for them makes Sphinx 9 fail with an IndexError. ``()`` is falsy, so Sphinx keeps
    the (empty) signature it has. A type alias inside a union is shown by its name (Sphinx leaves
    the repr of its placeholder there)."""
    if isinstance(obj, types.GenericAlias):
        return ()
    if _ALIAS_REPR.search(signature or "") or _ALIAS_REPR.search(return_annotation or ""):
        return _ALIAS_REPR.sub(r"\1", signature or ""), _ALIAS_REPR.sub(r"\1", return_annotation or "")
    return None


def _public_bases(app, name, obj, options, bases):
    """Show a class's public ancestors as its bases: a private helper base (``_Movement``) is
    replaced by the first public class of its method resolution order."""
    public = []
    for base in bases:
        if isinstance(base, type) and base.__name__.startswith("_"):
            base = next(c for c in base.__mro__ if not c.__name__.startswith("_"))
        if base not in public:
            public.append(base)
    bases[:] = public


def _numpydoc_with_one_template():
    """numpydoc compiles its Jinja template anew for every object it documents (about a fifth of
    the build time here); compile it once. The template is numpydoc's own: no custom template
    directories are configured."""
    import numpydoc.numpydoc
    from numpydoc import docscrape, docscrape_sphinx

    original = docscrape_sphinx.get_doc_object
    template = []

    def get_doc_object(obj, what=None, doc=None, config=None, builder=None):
        config = {} if config is None else config
        if not template:
            return_value = original(obj, what=what, doc=doc, config=config, builder=builder)
            template.append(config["template"])
            return return_value
        config["template"] = template[0]
        return docscrape.get_doc_object(
            obj,
            what=what,
            doc=doc,
            config=config,
            class_doc=docscrape_sphinx.SphinxClassDoc,
            func_doc=docscrape_sphinx.SphinxFunctionDoc,
            obj_doc=docscrape_sphinx.SphinxObjDoc,
        )

    numpydoc.numpydoc.get_doc_object = get_doc_object


THEORY_REFERENCE = re.compile(r"(``)?(?<![\w/<])docs/theory\.md#([A-Za-z0-9-]+)(``)?")
"""A docstring's reference into the theory (``docs/theory.md#halo-exchange``, quoted or not)."""


def _theory_links(app, what, name, obj, options, lines):
    """Docstrings cite the theory as ``docs/theory.md#anchor`` (what a reader of the source
    opens); in the API pages each becomes a link to that section of the built theory page
    (the API pages are in ``api/``, the theory beside it; anonymous links: the same text may
    point at several sections)."""
    for i, line in enumerate(lines):
        lines[i] = THEORY_REFERENCE.sub(
            lambda m: f"`docs/theory.md#{m.group(2)} <../theory.html#{m.group(2)}>`__", line
        )


def setup(app):
    app.connect("autodoc-process-docstring", _theory_links, priority=400)
    app.connect("autodoc-process-signature", _alias_signature, priority=400)
    app.connect("autodoc-process-bases", _public_bases)
    _numpydoc_with_one_template()
