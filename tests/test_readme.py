"""The README's code runs as written: the API tour in this process, the MPI example under mpiexec."""

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
MPI_MARK = re.compile(r"^# \S+ — run with: \.venv/bin/mpiexec -n (\d+)")
NEEDS_MARK = re.compile(r"^# needs: (\w+)")  # blocks that need an optional framework: tests/test_readme_frameworks.py
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


def test_readme_mpi_example_runs_under_mpiexec(tmp_path):
    ((ranks, block),) = mpi_blocks()
    script = tmp_path / "example.py"
    script.write_text(block + "\nassert back[mine.name].shape == mine.shape\n")
    mpiexec = str(Path(sys.executable).with_name("mpiexec"))
    done = subprocess.run(
        [mpiexec, "-n", str(ranks), sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=180,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_readme_tour_type_checks(tmp_path):
    """The tour is what users type: mypy accepts it against linop's annotations (blocks are
    joined into one module, so a name reused across blocks may change its type)."""
    pytest = __import__("pytest")
    pytest.importorskip("mypy")
    tour = tmp_path / "tour.py"
    tour.write_text("# mypy: allow-redefinition\n" + "\n".join(tour_blocks()))
    # the project's own cache (.mypy_cache, warm after `make typecheck`) keeps this quick
    command = [sys.executable, "-m", "mypy", str(tour)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=README.parent)
    assert result.returncode == 0, result.stdout + result.stderr
