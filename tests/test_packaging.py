"""Packaging: the licence (SPDX expression and file), the version defined once, the docs extra."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest

import linop
from linop.version import UNKNOWN_VERSION, package_version

ROOT = Path(__file__).resolve().parents[1]
tomllib = pytest.importorskip("tomllib")


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_license_is_an_spdx_expression_with_its_file(pyproject):
    project = pyproject["project"]
    assert project["license"] == "BSD-3-Clause"
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("BSD 3-Clause License")
    assert "Copyright (c) 2026, the linop developers" in text
    assert not any(c.startswith("License ::") for c in project["classifiers"]), "SPDX replaces them"


def test_build_backend_supports_license_expressions(pyproject):
    (requirement,) = [r for r in pyproject["build-system"]["requires"] if r.startswith("setuptools")]
    (major,) = re.fullmatch(r"setuptools>=(\d+)(\.\d+)*", requirement).groups()[:1]
    assert int(major) >= 77


def test_version_is_defined_once_in_pyproject(pyproject):
    assert linop.__version__ == importlib.metadata.version("linop") == pyproject["project"]["version"]
    literal = re.escape(pyproject["project"]["version"])
    for path in (ROOT / "linop").rglob("*.py"):
        assert not re.search(rf"['\"]{literal}['\"]", path.read_text()), f"{path} repeats the version"


def test_version_fallback_and_unknown_attributes():
    assert package_version("no-such-distribution-linop") == UNKNOWN_VERSION
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        linop.no_such_name  # noqa: B018


def test_docs_extra_names_the_sphinx_toolchain(pyproject):
    docs = {re.split(r"[<>=!~ ]", r)[0] for r in pyproject["project"]["optional-dependencies"]["docs"]}
    assert {"sphinx", "numpydoc", "myst-parser"} <= docs
