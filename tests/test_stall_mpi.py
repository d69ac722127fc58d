"""The stall diagnosis under MPI (issue 41, item 4; ``linop/backends/mpi/stall.py``): after the
torch wrapper under MPI bound its plan, one rank alone changes its input dtype, so it rebinds
(a collective) while its peer runs the bound plan. Before, both waited forever (the binding's
first collective had no deadline); now the rank that rebinds aborts the job with
``PeerMismatchError`` naming its peer within seconds, under the default deadline: a launch
bounded far below 600 s proves it. One launch of ``tests/mpi/stall_case.py`` (see its docstring).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("mpi4py")
pytest.importorskip("torch", reason="torch is not installed (the torch extra)")

from test_mpi import _mpiexec, run_bounded

LAUNCH_TIMEOUT = 90
"""Seconds the launch may take (about 12 s here, 5 of them the slow-peer controls): far below
the 600 s default deadline."""


@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_one_rank_changing_its_dtype_after_binding_aborts_the_job_naming_its_peer():
    mpiexec = _mpiexec()
    if mpiexec is None:
        pytest.skip("no mpiexec found")
    changing = 1  # rank 1 rebinds (polls, reads the record); rank 0, bound, sends it
    command = [mpiexec, "-n", "2", sys.executable, "tests/mpi/stall_case.py", str(changing)]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.pop("LINOP_TIMEOUT", None)
    try:
        status, stdout, stderr = run_bounded(command, LAUNCH_TIMEOUT, env)
    except subprocess.TimeoutExpired as error:
        pytest.fail(
            f"timed out: the ranks still waited after {LAUNCH_TIMEOUT} s\n{error.stdout}\n{error.stderr}"
        )
    output = stdout + stderr
    assert status != 0, output
    assert "finished (it should not have)" not in output, output
    assert "SLOW OK rank 0" in output and "SLOW OK rank 1" in output, output
    assert "PeerMismatchError: rank 1: rank 0 is at the same call" in output, output
    assert "runs its bound plan (no entry check: its inputs unchanged) with a[0] float32 (3, 3)" in output, (
        output
    )
    assert "where this rank goes through the entry check" in output and "a[1] float64 (3, 3)" in output, (
        output
    )
    assert "aborting the job" in output, output
