"""The stall diagnosis (issue 41, item 4; ``linop/backends/torch_distributed/stall.py``): after a
wrapper on a process group has bound its plan, one rank alone changes its input's dtype, so it
takes the checked path while its peer runs the bound plan. Before, both waited for the deadline
(600 s by default; forever with none); now both raise ``PeerMismatchError`` naming the other
rank and both dtypes within seconds, under the default deadline (no ``LINOP_TIMEOUT``): a launch
bounded far below 600 s proves it. Each launch first checks that a slow peer is no stall (the
waiting rank publishes its record, finds the same kind, and the call completes exactly).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch is not installed (the torch extra)")

from linop.backends.torch_distributed.stall import CallRecord
from linop.errors import PeerMismatchError, PeerTimeoutError

ROOT = Path(__file__).resolve().parent.parent
LAUNCH_TIMEOUT = 90
"""Seconds a 2-process launch may take (about 13 s here, 5 of them the slow-peer controls):
far below the 600 s default deadline the ranks waited for before the diagnosis."""


def _launch(mode: str) -> str:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("LINOP_TIMEOUT", None)  # the default deadline: the diagnosis must not need a short one
    try:
        result = subprocess.run(
            [sys.executable, "stall.py", mode],
            cwd=ROOT / "tests" / "torchdist",
            env=env,
            capture_output=True,
            text=True,
            timeout=LAUNCH_TIMEOUT,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"stall.py {mode}: the ranks still waited after {LAUNCH_TIMEOUT} s")
    assert result.returncode == 0, (
        f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    )
    return result.stdout


def _line(out: str, rank: int) -> str:
    found = [line for line in out.splitlines() if line.startswith(f"STALL OK rank {rank}: ")]
    assert found, out
    return found[0]


@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
@pytest.mark.parametrize(
    "mode, changing",
    [
        pytest.param("function", 0, id="function-rank0-changes"),
        pytest.param(  # the same wrapper underneath: the CI suite's time
            "dtensor1",
            1,
            id="redistribute_local-rank1-changes",
            marks=pytest.mark.skipif(os.environ.get("LINOP_LONG") != "1", reason="LINOP_LONG=1"),
        ),
    ],
)
def test_one_rank_changing_its_dtype_after_binding_is_named_on_both_ranks(mode, changing):
    out = _launch(mode)
    other = 1 - changing
    changed, kept = _line(out, changing), _line(out, other)
    assert "PeerMismatchError" in changed and "PeerMismatchError" in kept, out
    # the changed rank: its peer runs the bound plan in float32 while it rebinds in float64
    assert f"rank {changing}: rank {other} is at the same call" in changed, changed
    assert (
        "runs its bound plan" in changed
        and "float32 (3, 3), where this rank goes through the entry check" in changed
    )
    assert "float64 (3, 3)" in changed
    # the peer (its wait ended when the changed rank's process did): the same, seen from it
    assert f"rank {other}: rank {changing} is at the same call" in kept, kept
    assert (
        "goes through the entry check" in kept
        and "float64 (3, 3), where this rank runs its bound plan" in kept
    )


@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_a_rank_refusing_its_input_alone_in_a_bound_call_is_named_by_its_peer():
    # rank 1 passes a misshapen tensor after binding: StateError on rank 1 alone, which then
    # ends; rank 0, in its bound call, read rank 1's record (before: a bare RankFailedError,
    # "Connection closed by peer", no rank named)
    out = _launch("failed1")
    refused = [line for line in out.splitlines() if line.startswith("FAILED OK rank 1: StateError: rank 1: ")]
    named = [line for line in out.splitlines() if line.startswith("FAILED OK rank 0: RankFailedError: ")]
    assert refused and named, out
    assert "rank 0: rank 1 is at the same call" in named[0] and "raised StateError: rank 1: block" in named[0]
    assert "(4, 3) float32" in named[0] and "on its own, before any data moved" in named[0], named[0]


def test_a_call_record_reads_back_what_it_wrote():
    record = CallRecord("ab12", 7, "bound", "a[0] float64 (3, 3), c float32 (2,)", seen=True)
    assert CallRecord.parse(record.text()) == record
    assert CallRecord.parse("ab12|x|bound|0|k") is None and CallRecord.parse("junk") is None
    assert CallRecord.parse("ab12|3|failed|0|StateError: a|b").key == "StateError: a|b"
    assert "bound plan" in record.describe() and "float64 (3, 3)" in record.describe()
    assert issubclass(PeerMismatchError, PeerTimeoutError)  # caught where a deadline's error is


def test_the_windows_of_peers_reach_every_peer_without_a_list_of_every_rank():
    # the watcher sends to / reads from READ_AT_ONCE peers a tick: in turn, every peer once
    # reached (an MPI bound call sends its record window after window until then)
    from linop.backends.stall_record import READ_AT_ONCE, WatchedCall

    call = WatchedCall.__new__(WatchedCall)
    for size, rank in ((1, 0), (2, 1), (5, 2), (READ_AT_ONCE + 1, READ_AT_ONCE), (3 * READ_AT_ONCE + 7, 7)):
        call.size, call.rank, call.turn = size, rank, 0
        seen: list[int] = []
        while call.turn < size - 1:
            window = call.window()
            assert rank not in window and len(window) <= READ_AT_ONCE
            seen += window
        assert set(seen) == set(range(size)) - {rank}, (size, rank)
