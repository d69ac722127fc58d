"""A rank that hangs inside ``MPI_Abort`` still ends (linop.backends.mpi.guards.abort_job's
watchdog), and an ``Abort`` that returns leaves no watchdog behind."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import sys, time
    from linop.backends.mpi import guards

    guards.ABORT_WATCHDOG = 0.5

    class Comm:
        def Abort(self, status):
            if sys.argv[1] == "hangs":
                time.sleep(30)  # a launcher that never kills this rank

    try:
        guards.abort_job(Comm(), "rank 0 gives up", settle=0)
    except SystemExit as ended:
        print("Abort returned, status", ended.code, flush=True)
    time.sleep(1.5)  # past the watchdog's time: it must have been cancelled
    print("still running", flush=True)
    """
)


def _run(mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=20)


def test_a_rank_hanging_in_abort_prints_its_stack_and_exits():
    ended = _run("hangs")  # without the watchdog: 30 s, past the timeout
    assert ended.returncode == 1, ended
    assert "rank 0 gives up" in ended.stderr
    assert "Abort" in ended.stderr and "Timeout" in ended.stderr, ended.stderr  # faulthandler's dump
    assert "still running" not in ended.stdout


def test_an_abort_that_returns_cancels_the_watchdog():
    ended = _run("returns")
    assert ended.returncode == 0, ended
    assert "Abort returned, status 1" in ended.stdout and "still running" in ended.stdout, ended
