"""Packaging: the distribution name, the licence (SPDX expression and file), the version defined
once, the extras, and a wheel and sdist built from a copy of the tree whose metadata is checked and
whose wheel runs ``python -m verify`` away from the source tree (``LINOP_LONG=1``: in a clean venv
that installs the core dependencies from the index)."""

from __future__ import annotations

import email
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import linop
from linop.version import DISTRIBUTION, UNKNOWN_VERSION, package_version

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


INSTALL_HINT = re.compile(r"pip install '?([\w.-]+)\[")
"""An install hint in an error message: ``pip install 'NAME[extra]'``."""


def test_the_distribution_has_a_name_of_its_own(pyproject):
    """``linop`` on PyPI is an unrelated project: ours is ``linop-adjoint`` everywhere, and every
    install hint names it."""
    assert pyproject["project"]["name"] == DISTRIBUTION == "linop-adjoint"
    hints = []
    for folder in ("linop", "verify"):
        for path in (ROOT / folder).rglob("*.py"):
            hints += [(path, h) for h in INSTALL_HINT.findall(path.read_text())]
    assert hints, "no install hints found: the check looks in the wrong place"
    assert INSTALL_HINT.findall("needs matplotlib: pip install 'linop[plot]'") == ["linop"], "the control"
    assert all(name == DISTRIBUTION for _, name in hints), hints


def test_version_is_defined_once_in_pyproject(pyproject):
    assert linop.__version__ == importlib.metadata.version(DISTRIBUTION) == pyproject["project"]["version"]
    literal = re.escape(pyproject["project"]["version"])
    for path in (ROOT / "linop").rglob("*.py"):
        assert not re.search(rf"['\"]{literal}['\"]", path.read_text()), f"{path} repeats the version"


def test_version_fallback_and_unknown_attributes():
    assert package_version("no-such-distribution-linop") == UNKNOWN_VERSION
    assert package_version() == package_version(DISTRIBUTION)
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        linop.no_such_name  # noqa: B018


def test_docs_extra_names_the_sphinx_toolchain(pyproject):
    docs = {re.split(r"[<>=!~ ]", r)[0] for r in pyproject["project"]["optional-dependencies"]["docs"]}
    assert {"sphinx", "numpydoc", "myst-parser"} <= docs


LONG = os.environ.get("LINOP_LONG") == "1"
UNBUILT = {".git", ".venv", "build", "dist", "_build", "__pycache__", ".mypy_cache", ".pytest_cache"}
UNBUILT |= {".hypothesis", ".ruff_cache", ".ipynb_checkpoints"}


def unbuilt(_: str, names: list[str]) -> list[str]:
    """What a build copy of the tree leaves out: environments, caches and earlier builds."""
    return [n for n in names if n in UNBUILT or n.endswith(".egg-info")]


def requirement_name(requirement: str) -> str:
    return re.split(r"[<>=!~; \[]", requirement, maxsplit=1)[0]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """A wheel and an sdist, built by ``python -m build`` from a copy of the tree (nothing is
    written into the checkout), without build isolation: the dev extra installs ``build`` and
    setuptools, so this needs no network."""
    assert importlib.util.find_spec("build"), "build missing: install the dev extra (pip install -e '.[dev]')"
    work = tmp_path_factory.mktemp("packaging")
    source = work / "source"
    shutil.copytree(ROOT, source, ignore=unbuilt)
    command = [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(work / "dist"), str(source)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=work)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (wheel,) = (work / "dist").glob("*.whl")
    (sdist,) = (work / "dist").glob("*.tar.gz")
    return {"wheel": wheel, "sdist": sdist, "work": work}


def test_wheel_metadata_is_the_pyprojects(built, pyproject):
    project = pyproject["project"]
    stem = DISTRIBUTION.replace("-", "_")
    assert built["wheel"].name == f"{stem}-{project['version']}-py3-none-any.whl"
    with zipfile.ZipFile(built["wheel"]) as wheel:
        names = wheel.namelist()
        metadata = email.message_from_bytes(wheel.read(f"{stem}-{project['version']}.dist-info/METADATA"))
    assert metadata["Name"] == DISTRIBUTION and metadata["Version"] == project["version"]
    assert metadata["License-Expression"] == "BSD-3-Clause"
    assert metadata["Requires-Python"] == project["requires-python"]
    requires = metadata.get_all("Requires-Dist")
    assert [r for r in requires if "extra ==" not in r] == project["dependencies"], "the core differs"
    assert set(metadata.get_all("Provides-Extra")) == set(project["optional-dependencies"])
    for extra, wanted in project["optional-dependencies"].items():
        got = {requirement_name(r) for r in requires if f'extra == "{extra}"' in r}
        assert got == {requirement_name(r) for r in wanted}, extra
    assert metadata.get_payload().startswith("# linop"), "the README is the long description"
    assert {n.split("/")[0] for n in names} == {"linop", "verify", f"{stem}-{project['version']}.dist-info"}
    assert {"linop/py.typed", "verify/py.typed", "linop/backends/mpi/__init__.py"} <= set(names)
    assert f"{stem}-{project['version']}.dist-info/licenses/LICENSE" in names


def test_sdist_holds_the_sources_and_the_licence(built, pyproject):
    stem = f"{DISTRIBUTION.replace('-', '_')}-{pyproject['project']['version']}"
    with tarfile.open(built["sdist"]) as sdist:
        names = set(sdist.getnames())
        info = email.message_from_bytes(sdist.extractfile(f"{stem}/PKG-INFO").read())
    assert info["Name"] == DISTRIBUTION
    assert {f"{stem}/{n}" for n in ("LICENSE", "README.md", "pyproject.toml", "linop/__init__.py")} <= names
    assert f"{stem}/verify/__main__.py" in names


def run_verify_from(python: str, path: str | None, *args: str) -> subprocess.CompletedProcess:
    """``python -m verify`` started away from the checkout (so ``linop`` cannot come from it),
    also printing where ``linop`` was imported from and the installed version."""
    probe = (
        "import importlib.metadata, runpy, sys, linop;"
        f"print('FROM', linop.__file__, importlib.metadata.version({DISTRIBUTION!r}), linop.__version__);"
        "sys.argv = ['verify', *sys.argv[1:]]; runpy.run_module('verify', run_name='__main__')"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if path is not None:
        env["PYTHONPATH"] = path
    return subprocess.run(
        [python, "-c", probe, *args], capture_output=True, text=True, timeout=1800, cwd=path or "/", env=env
    )


def check_verify_ran_from(done: subprocess.CompletedProcess, where: Path, version: str) -> None:
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("FROM ")]
    _, location, installed, reported = line.split()
    assert Path(location).is_relative_to(where), f"linop came from {location}, not the wheel"
    assert installed == reported == version
    assert re.search(r"\b(\d+) checks: \1 passed, 0 failed\b", done.stdout), done.stdout[-2000:]


def test_the_wheel_runs_verify_away_from_the_checkout(built, pyproject):
    """The wheel unpacked by pip into a directory of its own (its dependencies from this
    environment): ``python -m verify`` runs from it, with its metadata."""
    target = built["work"] / "target"
    install = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index"]
    install += ["--target", str(target), str(built["wheel"])]
    subprocess.run(install, check=True, capture_output=True, timeout=600)
    done = run_verify_from(sys.executable, str(target), "--only", "section:primitives")
    check_verify_ran_from(done, target, pyproject["project"]["version"])


@pytest.mark.timeout(1800)
@pytest.mark.skipif(not LONG, reason="a clean venv installing the core from the index: LINOP_LONG=1")
def test_the_wheel_installs_into_a_clean_venv_and_proves_the_catalogue(built, pyproject):
    venv = built["work"] / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=600)
    python = str(venv / "bin" / "python")
    install = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-compile"]
    install.append(str(built["wheel"]))
    subprocess.run(install, check=True, timeout=1800)
    done = run_verify_from(python, None)
    check_verify_ran_from(done, venv, pyproject["project"]["version"])
