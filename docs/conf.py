"""Sphinx configuration: the theory (MyST markdown) and the API reference (autodoc + numpydoc).

Build with ``make docs`` (``sphinx-build -W --keep-going -b html docs docs/_build/html``); the test
suite builds it too (``tests/test_docs.py``). No extension reaches the network.
"""

from __future__ import annotations

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
    "numpydoc",
    "myst_parser",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
root_doc = "index"

# MyST: $...$ and $$...$$ math, and heading slugs as anchors (docs/theory.md#halo-exchange).
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence"]
myst_heading_anchors = 3

# autodoc: members in source order, type hints in the signature only.
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True, "show-inheritance": True}

# numpydoc: no autosummary tables of members (autodoc lists them), no cross-referencing of
# every type word.
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False
# numpydoc loads autosummary, which would scan every page and docstring for autosummary
# directives to generate stub pages; there are none.
autosummary_generate = False

html_theme = "alabaster"
html_title = f"linop {release}"
html_static_path: list[str] = []


def _alias_signature(app, what, name, obj, options, signature, return_annotation):
    """Type aliases (``State = dict[str, np.ndarray]``) have no signature: answer before numpydoc,
    whose answer for them makes Sphinx 9 fail with an IndexError. ``()`` is falsy, so Sphinx keeps
    the (empty) signature it has."""
    if isinstance(obj, types.GenericAlias):
        return ()
    return None


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


def setup(app):
    app.connect("autodoc-process-signature", _alias_signature, priority=400)
    _numpydoc_with_one_template()
