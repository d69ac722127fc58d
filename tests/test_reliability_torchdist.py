"""The torch.distributed executor's edge (issue 41), on 2 gloo processes: two launches of
``tests/torchdist/reliability.py`` (see its docstring), each bounded by a timeout.

- ``entry``: the entry check refuses a meta tensor and an in-place write into a tensor that
  requires a gradient, on every rank alike (before: the meta rank returned values-less
  results while its peer failed after the check; the write went through); ``timeout=inf``,
  ``1e300`` and ``LINOP_TIMEOUT=inf`` mean no deadline (before: a raw ``OverflowError``); then
  ``lift_group`` with a function raising on one rank: a ``LiftError`` naming that rank on both
  (before: gloo's raw "Connection closed by peer" on the peer).
- ``bound``: a bound plan that is not prepared honours ``bind(..., timeout=3)`` on its first
  call when the peer never calls (before: it waited for the group's own timeout).
- ``every``: ``bind(..., timeout=3, every_call=True)`` bounds every call of a prepared halo
  exchange: a peer that skips the second call is named (before: no ``every_call``, and the
  second call waited for the group's own timeout); then a peer killed (``SIGKILL``) between
  two calls of a bound plan that is not prepared is named as ended by the survivor, from its
  closed connection (before: "a peer's connection closed", no rank named).
- ``teardown``: after linop has run on the world group, ``destroy_process_group`` ends every
  thread of torch.distributed, as without linop, and the processes leave through the
  interpreter's teardown (before: linop's contexts held the group, its threads ran to the
  exit, and some 4-process runs ended in SIGABRT, "terminate called without an active
  exception").
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch is not installed (the torch extra)")

ROOT = Path(__file__).resolve().parent.parent
LAUNCH_TIMEOUT = 300
"""Seconds one 2-process launch may take (about 10 s on an idle machine; generous)."""


def _launch(mode: str, markers: Path) -> str:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["LINOP_CHECKS_MARKERS"] = str(markers)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("LINOP_TIMEOUT", None)
    try:
        result = subprocess.run(
            [sys.executable, "reliability.py", mode],
            cwd=ROOT / "tests" / "torchdist",
            env=env,
            capture_output=True,
            text=True,
            timeout=LAUNCH_TIMEOUT,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"reliability.py {mode} timed out after {LAUNCH_TIMEOUT} s")
    assert result.returncode == 0, (
        f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    )
    return result.stdout


@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_the_entry_refuses_meta_and_graded_in_place_and_lift_group_names_the_failing_rank(tmp_path):
    out = _launch("entry", tmp_path)
    assert "ENTRY OK rank 0" in out and "ENTRY OK rank 1" in out, out
    assert "LIFT OK rank 0" in out and "LIFT OK rank 1" in out, out


@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_every_call_of_a_bound_plan_within_the_deadline_names_the_absent_and_the_killed_rank(tmp_path):
    out = _launch("every", tmp_path)
    assert "EVERY OK rank 0" in out and "EVERY ABSENT rank 1" in out, out
    assert "KILLED OK rank 0" in out and "EXIT CODES [0, -9]" in out, out


@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_destroy_process_group_ends_every_thread_after_linop_ran(tmp_path):
    out = _launch("teardown", tmp_path)
    assert "TEARDOWN OK rank 0" in out and "TEARDOWN OK rank 1" in out, out


@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_a_bound_plan_that_is_not_prepared_honours_its_first_call_deadline(tmp_path):
    out = _launch("bound", tmp_path)
    assert "BOUND OK rank 0" in out and "BOUND ABSENT rank 1" in out, out
