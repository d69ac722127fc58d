"""Progress of long work (linop.progress) and Ctrl-C: lifting, its MPI variant, calibration.

No test waits for a wall-clock threshold: the clock is replaced (``linop.progress.clock``) or
reporting is forced with ``progress=True``.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import linop.progress
from linop import Block, Space
from linop.algorithms.calibrate import calibrate
from linop.progress import Progress
from verify.lift import lift, lift_mpi, prove_backward

SIZE = 12  # domain and range of the lifted maps: 12 forward probes, 12 adjoint probes


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def frozen(monkeypatch: pytest.MonkeyPatch) -> None:
    """A clock that never advances: work under progress=None never counts as long."""
    monkeypatch.setattr(linop.progress, "clock", lambda: 0.0)


@pytest.fixture
def slow(monkeypatch: pytest.MonkeyPatch) -> None:
    """A clock that advances 10 s per reading: every piece of work is long."""
    ticks: Iterator[float] = iter(range(0, 10**9, 10))
    monkeypatch.setattr(linop.progress, "clock", lambda: float(next(ticks)))


def roll(x: np.ndarray) -> np.ndarray:
    return np.roll(x, 1)


def unroll(y: np.ndarray) -> np.ndarray:
    return np.roll(y, -1)


def interrupting(fn: Any, after: int) -> Any:
    """``fn``, raising KeyboardInterrupt on its call number ``after + 1`` (as if Ctrl-C)."""
    calls = [0]

    def wrapped(*args: Any) -> Any:
        calls[0] += 1
        if calls[0] > after:
            raise KeyboardInterrupt
        return fn(*args)

    return wrapped


def lift_roll(**options: Any) -> Any:
    return lift(roll, {"x": (SIZE,)}, {"y": (SIZE,)}, adjoint=unroll, label="roll", **options)


# -- the helper ---------------------------------------------------------------------------------
def test_a_terminal_gets_one_live_line_left_clean(frozen):
    stream = Terminal()
    with Progress("work", 3, "steps", progress=True, stream=stream) as progress:
        for done in range(4):
            progress.update(done, "stage")
    text = stream.getvalue()
    assert "\r\033[Kwork: 2 of 3 steps (stage)" in text
    assert "\n" not in text and text.endswith("\r\033[K")  # the live line erased at the end


def test_off_a_terminal_a_line_every_few_seconds_and_one_at_the_end(monkeypatch):
    now = iter([0.0, 0.0, 1.0, 6.0, 7.0])
    monkeypatch.setattr(linop.progress, "clock", lambda: next(now))
    stream = io.StringIO()
    progress = Progress("work", 3, "steps", progress=True, stream=stream)
    for done in range(4):
        progress.update(done)
    assert stream.getvalue().splitlines() == [
        "work: 0 of 3 steps (0 s)",
        "work: 2 of 3 steps (6 s)",
        "work: 3 of 3 steps (7 s)",
    ]


def test_by_default_only_long_work_reports(monkeypatch):
    now = iter([0.0, 1.0, 2.5])
    monkeypatch.setattr(linop.progress, "clock", lambda: next(now))
    stream = io.StringIO()
    progress = Progress("work", 3, "steps", stream=stream)
    progress.update(1)  # 1 s in: quiet
    assert stream.getvalue() == ""
    progress.update(2)  # 2.5 s in: long work, reported
    assert stream.getvalue() == "work: 2 of 3 steps (2 s)\n"


def test_false_and_other_ranks_never_report(slow):
    for options in ({"progress": False}, {"progress": True, "report": False}):
        stream = io.StringIO()
        with pytest.raises(KeyboardInterrupt), Progress("work", 3, stream=stream, **options) as progress:
            progress.update(2)
            raise KeyboardInterrupt
        assert stream.getvalue() == ""


def test_the_interrupt_line_names_the_work_and_the_count(frozen):
    stream = Terminal()
    with (
        pytest.raises(KeyboardInterrupt),
        Progress("work", 65536, "probes", progress=True, stream=stream) as p,
    ):
        p.update(1536, "forward")
        raise KeyboardInterrupt
    assert stream.getvalue().endswith("\r\033[Kwork: interrupted after 1,536 of 65,536 probes (forward)\n")


# -- lifting --------------------------------------------------------------------------------------
def test_lift_reports_when_forced_and_only_on_stderr(frozen, capsys):
    lifted = lift_roll(progress=True)
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert lines[0] == f"lift of roll: 0 of {2 * SIZE} probes (forward) (0 s)"
    assert lines[-1] == f"lift of roll: {2 * SIZE} of {2 * SIZE} probes (adjoint) (0 s)"
    assert lifted.matrix.shape == (SIZE, SIZE)


def test_short_lifts_are_silent_by_default(frozen, capsys):
    lift_roll()
    prove_backward(roll, {"x": (SIZE,)}, {"y": (SIZE,)}, adjoint=unroll)
    assert capsys.readouterr() == ("", "")


def test_long_lifts_report_by_default(slow, capsys):
    lift_roll(batch=4)
    out, err = capsys.readouterr()
    assert out == "" and "lift of roll: " in err and f"of {2 * SIZE} probes" in err


def test_a_callable_receives_monotone_counts_ending_at_the_total(capsys):
    seen: list[tuple[int, int, str]] = []
    proof = prove_backward(
        roll,
        {"x": (SIZE,)},
        {"y": (SIZE,)},
        adjoint=unroll,
        label="roll",
        batch=5,
        progress=lambda *a: seen.append(a),
    )
    assert proof
    counts = [done for done, _, _ in seen]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 2 * SIZE
    assert {total for _, total, _ in seen} == {2 * SIZE}
    assert {what for _, _, what in seen} == {
        "lift of roll (forward)",
        "lift of roll (adjoint)",
        "lift of roll (checking linearity)",
    }
    assert 5 in counts and 10 in counts  # one step per probe, counted batch by batch
    assert capsys.readouterr() == ("", "")  # a callable instead of stderr


@pytest.mark.parametrize(
    ("forward", "adjoint", "expected"),
    [
        (interrupting(roll, 9), unroll, f"lift of roll: interrupted after 8 of {2 * SIZE} probes (forward)"),
        (roll, interrupting(unroll, 5), f"lift of roll: interrupted after 16 of {2 * SIZE} probes (adjoint)"),
    ],
)
def test_ctrl_c_says_how_far_the_lift_got_and_still_stops(frozen, capsys, forward, adjoint, expected):
    with pytest.raises(KeyboardInterrupt):
        lift(forward, {"x": (SIZE,)}, {"y": (SIZE,)}, adjoint=adjoint, label="roll", batch=4)
    out, err = capsys.readouterr()
    assert out == ""
    assert err == expected + "\n"  # the default (progress=None) too: the only line, short work or not


# -- lifting across ranks, with a stand-in communicator -----------------------------------------------
class OneRank:
    """The two things ``lift_mpi`` asks of a communicator, for a job of one rank ``rank``."""

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank

    def allgather(self, value: Any) -> list[Any]:
        return [value]


def ranked(worker: int) -> tuple[Space, Space]:
    return Space([Block("x", (SIZE,), worker)]), Space([Block("y", (SIZE,), worker)])


def test_lift_mpi_reports_on_rank_0_and_says_how_far_it_got(frozen, capsys):
    domain, range_ = ranked(0)
    seen: list[int] = []
    lift_mpi(
        roll,
        domain,
        range_,
        adjoint=unroll,
        comm=OneRank(),
        label="roll",
        progress=lambda d, t, w: seen.append(d),
    )
    assert seen == sorted(seen) and seen[-1] == 2 * SIZE and len(seen) == 2 * SIZE + 3
    with pytest.raises(KeyboardInterrupt):
        lift_mpi(interrupting(roll, 7), domain, range_, adjoint=unroll, comm=OneRank(), label="roll")
    assert capsys.readouterr() == ("", f"lift of roll: interrupted after 7 of {2 * SIZE} probes (forward)\n")


def test_lift_mpi_is_silent_on_other_ranks(frozen, capsys):
    domain, range_ = ranked(1)
    lift_mpi(roll, domain, range_, adjoint=unroll, comm=OneRank(1), label="roll", progress=True)
    with pytest.raises(KeyboardInterrupt):
        lift_mpi(interrupting(roll, 3), domain, range_, adjoint=unroll, comm=OneRank(1), label="roll")
    assert capsys.readouterr() == ("", "")


# -- calibration, with a stand-in communicator ----------------------------------------------------------
class TwoRanks:
    """A communicator of two ranks seen from ``rank`` whose messages take no time; ``Recv``
    raises KeyboardInterrupt after ``interrupt_after`` receives."""

    def __init__(self, rank: int = 0, interrupt_after: int | None = None) -> None:
        self.rank = rank
        self.receives = 0
        self.interrupt_after = interrupt_after

    def Get_rank(self) -> int:  # noqa: N802 - mpi4py's spelling
        return self.rank

    def Get_size(self) -> int:  # noqa: N802
        return 2

    def Send(self, buffer: Any, dest: int, tag: int) -> None:  # noqa: N802
        pass

    def Recv(self, buffer: Any, source: int, tag: int) -> None:  # noqa: N802
        self.receives += 1
        if self.interrupt_after is not None and self.receives > self.interrupt_after:
            raise KeyboardInterrupt

    def Barrier(self) -> None:  # noqa: N802
        pass

    def bcast(self, value: Any, root: int = 0) -> Any:
        return value if value is not None else (1e-6, 1e-9, 1e-10, 0.0)


def test_calibrate_reports_samples_on_rank_0(frozen, capsys):
    seen: list[tuple[int, int, str]] = []
    calibrate(TwoRanks(), sizes=(8, 64), repeats=8, progress=lambda *a: seen.append(a))
    total = 8 + 3 + 1  # small ping-pongs, large ones (at least 3), the reduction rate
    counts = [done for done, _, _ in seen]
    assert counts == sorted(counts) and counts[-1] == total and {t for _, t, _ in seen} == {total}
    assert seen[0][2] == "calibrate (alpha: 8-byte ping-pong)"
    calibrate(TwoRanks(), sizes=(8, 64), repeats=8, progress=True)
    out, err = capsys.readouterr()
    assert (
        out == ""
        and err.splitlines()[-1] == f"calibrate: {total} of {total} samples (gamma: reduction rate) (0 s)"
    )
    calibrate(TwoRanks(rank=1), sizes=(8, 64), repeats=8, progress=True)
    calibrate(TwoRanks(), sizes=(8, 64), repeats=8)
    assert capsys.readouterr() == ("", "")


def test_ctrl_c_says_how_far_calibration_got(frozen, capsys):
    # 2 warm-up round trips, then samples of 10 round trips: the 53rd receive is in sample 6
    with pytest.raises(KeyboardInterrupt):
        calibrate(TwoRanks(interrupt_after=52), sizes=(8, 64), repeats=8)
    assert capsys.readouterr() == (
        "",
        "calibrate: interrupted after 5 of 12 samples (alpha: 8-byte ping-pong)\n",
    )
