"""Run the MPI suite (tests/mpi/) under mpiexec at 1, 2, 3 and 4 ranks.

One ``mpiexec`` launch per rank count, each bounded twice: pytest-timeout inside (per test)
and a wall-clock timeout around the launch, so that a deadlock fails the run instead of
hanging it. Four ranks oversubscribe a two-core machine; that is intended.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mpi4py")

ROOT = Path(__file__).resolve().parent.parent
LAUNCH_TIMEOUT = 240
TEST_TIMEOUT = 90


def _mpiexec() -> str | None:
    beside_python = Path(sys.executable).parent / "mpiexec"
    return str(beside_python) if beside_python.exists() else shutil.which("mpiexec")


@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
@pytest.mark.parametrize("ranks", [1, 2, 3, 4], ids=lambda n: f"{n}-ranks")
def test_mpi_suite(ranks):
    mpiexec = _mpiexec()
    if mpiexec is None:
        pytest.skip("no mpiexec found")
    command = [
        mpiexec,
        "-n",
        str(ranks),
        sys.executable,
        "-m",
        "pytest",
        "tests/mpi",
        "-q",
        "-x",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:mpi-pytest",
        f"--timeout={TEST_TIMEOUT}",
        # a thread, not a signal: a rank stuck inside an MPI call never returns to Python
        "--timeout-method=thread",
    ]
    env = dict(os.environ, LINOP_MPI_TESTS="1", PYTHONHASHSEED="0", PYTHONUNBUFFERED="1")
    try:
        done = subprocess.run(
            command,
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=LAUNCH_TIMEOUT,
            check=False,
        )
    except subprocess.TimeoutExpired as expired:
        pytest.fail(
            f"mpiexec -n {ranks} did not finish within {LAUNCH_TIMEOUT} s (deadlock?)\n{expired.stdout}"
        )
    assert done.returncode == 0, f"mpiexec -n {ranks} failed:\n{done.stdout[-6000:]}\n{done.stderr[-3000:]}"


@pytest.mark.timeout(90)
def test_a_rank_failing_mid_run_ends_the_job():
    """After the collective check, a rank that raises aborts the job with its message."""
    mpiexec = _mpiexec()
    if mpiexec is None:
        pytest.skip("no mpiexec found")
    command = [mpiexec, "-n", "2", sys.executable, "tests/mpi/abort_case.py"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        done = subprocess.run(
            command,
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("a rank failing mid-run left the job hanging")
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert "rank 1 failed while applying" in output and "a local kernel failed on rank 1" in output, output
    assert "finished (it should not have)" not in output, output
