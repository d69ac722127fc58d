"""The README's code runs as written: the API tour in this process, the MPI example under mpiexec
(in the MPI suite's launch, tests/mpi/test_readme_example.py), and README's facts match the code."""

import os
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
MPI_MARK = re.compile(r"^# \S+ — run with: \.venv/bin/mpiexec -n (\d+)")
NEEDS_MARK = re.compile(
    r"^# needs: (\w+)"
)  # blocks that need an optional framework: tests/test_readme_frameworks.py
TORCHRUN_MARK = re.compile(r"^# torchrun: (\d+)")  # blocks run under torchrun: tests/test_readme_torchrun.py
DTENSOR_MARK = re.compile(r"^# dtensor: (\d+)")  # run on K gloo processes by tests/dtensor/checks.py


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def tour_blocks() -> list[str]:
    return [
        block
        for block in python_blocks()
        if not any(mark.match(block) for mark in (MPI_MARK, NEEDS_MARK, TORCHRUN_MARK, DTENSOR_MARK))
    ]


def mpi_blocks() -> list[tuple[int, str]]:
    return [(int(MPI_MARK.match(b).group(1)), b) for b in python_blocks() if MPI_MARK.match(b)]


def test_readme_has_an_api_tour_and_an_mpi_example():
    assert len(tour_blocks()) >= 4 and len(mpi_blocks()) == 1


def test_readme_tour_runs_in_order(capsys):
    namespace: dict = {}
    for block in tour_blocks():
        exec(compile(block, str(README), "exec"), namespace)
    printed = capsys.readouterr().out
    assert "C*[a -> b] = K[b] @ S[b -> a]" in printed
    assert "2 * SR[a[0:2] -> b[2:4]] @ C[a -> b] - K[a]" in printed
    assert "R[w_copy -> w]" in printed
    assert "equal entry by entry (8x8 int64 matrices)" in printed
    assert "[a_0 + b_0 a_1 + b_1 a_2 + b_2 a_3 + b_3]" in printed
    assert "source shape (2,) differs from destination shape (4,)" in printed
    assert "block 'c' is missing on the left" in printed


def test_readme_mpi_example_reports_success():
    """The example runs under mpiexec inside the MPI suite (tests/mpi/test_readme_example.py, in
    the launch at its rank count: no launch of its own); a user sees that it worked."""
    ((ranks, block),) = mpi_blocks()
    assert 1 <= ranks <= 4, "tests/test_mpi.py launches 1 to 4 ranks"
    assert "if comm.rank == 0:\n    print(" in block
    assert (README.parent / "tests" / "mpi" / "test_readme_example.py").exists()


def test_the_package_and_the_readme_tour_type_check(tmp_path, monkeypatch):
    """mypy accepts linop and verify (the project's configuration) and the tour, which is what
    users type, against linop's annotations (blocks are joined into one module, so a name
    reused across blocks may change its type). One run checks both. ``make lint`` (which
    ``make test`` runs first) and ``make typecheck`` run it with ``LINOP_TYPECHECK=1``; the test
    run skips it (minutes of mypy under load, shown as one dot)."""
    pytest = __import__("pytest")
    if os.environ.get("LINOP_TYPECHECK") != "1":
        pytest.skip("the type check runs in `make lint` (LINOP_TYPECHECK=1)")
    pytest.importorskip("mypy")
    from mypy import api

    tour = tmp_path / "tour.py"
    tour.write_text("# mypy: allow-redefinition\n" + "\n".join(tour_blocks()))
    config = ["--config-file", str(README.parent / "pyproject.toml")]
    config += ["--cache-dir", str(README.parent / ".mypy_cache")]
    monkeypatch.chdir(README.parent)  # linop and verify as this checkout has them
    stdout, stderr, status = api.run([*config, "linop", "verify", str(tour)])
    assert status == 0, stdout + stderr
    checked = re.search(r"no issues found in (\d+) source files", stdout)
    assert checked and int(checked.group(1)) > 100, stdout  # the packages, not the tour alone


def test_readme_names_every_section_of_the_report():
    """The report's sections as the README lists them are the catalogue's, in order."""
    from verify.identities import sections

    text = " ".join(README.read_text().split())
    listed = re.search(r"\(`verify\.identities`: the sections (.*?) of \[docs/theory\.md\]", text)
    assert listed, "README no longer lists the report's sections"
    assert re.findall(r"`([a-z-]+)`", listed.group(1)) == list(sections())


def test_readme_states_the_algorithm_sizes_the_tests_run():
    """The worker counts README says the algorithm tests cover are tests/test_algorithms.py's:
    the default set, and every P = 1 .. 16 only with LINOP_LONG."""
    source = (README.parent / "tests" / "test_algorithms.py").read_text()
    default = re.search(r"^LIGHT = ALL_SIZES if LONG else \(([\d, ]+)\)$", source, re.MULTILINE)
    assert default and "ALL_SIZES = tuple(range(1, 17))" in source
    text = " ".join(README.read_text().split())
    stated = re.search(
        r"the tests do for P = ([\d, ]+) with unequal shares, and for every P = 1 \.\. 16 with `LINOP_LONG=1`",
        text,
    )
    assert stated, "README no longer states which P the algorithm tests run"
    assert [int(p) for p in stated.group(1).split(",")] == [int(p) for p in default.group(1).split(",")]
