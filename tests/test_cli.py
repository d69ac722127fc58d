"""``python -m verify``: exit codes, the table, the JSON schema, and failures that name entries.

The command line is :func:`verify.__main__.main` and ``sys.exit`` of its status, so most tests
call ``main`` in this process (:func:`run_main`: what it printed, and the status it returned or
the ``SystemExit`` that argparse raised); only
:func:`test_python_m_verify_is_the_command_and_its_status_reaches_the_shell` starts the process,
for what only the process shows: that ``python -m verify`` runs ``main`` and exits with its
status.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from linop import Add, Block, Copy, LinearOperator, Space
from verify import __main__ as cli
from verify import identities, report
from verify.catalogue import adjoint_entry

ROOT = Path(__file__).resolve().parents[1]

RESULT_KEYS = {
    "identity",
    "section",
    "statement",
    "kind",
    "level",
    "status",
    "passed",
    "error",
    "threshold",
    "seconds",
    "message",
}


CLI_TIMEOUT = 900
"""Seconds one ``python -m verify`` process may take (the runs here list or refuse, and check
nothing: well under a second on the idle machine; generous, so that a loaded one passes)."""


@dataclass(frozen=True)
class Done:
    """What one run of the command line gave: its exit status and what it printed."""

    returncode: int
    stdout: str
    stderr: str


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``python -m verify args`` in a new process, from the repository's root."""
    try:
        return subprocess.run(
            [sys.executable, "-m", "verify", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=CLI_TIMEOUT,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"python -m verify {' '.join(args)} timed out after {CLI_TIMEOUT} s")


def run_main(capsys: pytest.CaptureFixture[str], *args: str) -> Done:
    """Run ``python -m verify args`` in this process: :func:`verify.__main__.main`, with the
    status it returns or the ``SystemExit`` it raises (argparse's usage errors), and what it
    printed on stdout and stderr."""
    capsys.readouterr()  # what was printed before is not this run's
    try:
        status = cli.main(list(args))
    except SystemExit as exited:
        status = exited.code
    out, err = capsys.readouterr()
    assert isinstance(status, int), f"exit status {status!r}"
    return Done(status, out, err)


def test_python_m_verify_is_the_command_and_its_status_reaches_the_shell():
    """In a process of its own: ``python -m verify`` runs ``main`` and exits with its status
    (0 with the listing on stdout; 2 with the reason on stderr)."""
    listed = run_cli("--list", "--only", "copy-inplace-adjoint")
    assert listed.returncode == 0, listed.stdout + listed.stderr
    names = [line.split()[0] for line in listed.stdout.splitlines()]
    assert names == [e.name for e in identities.select("copy-inplace-adjoint")], listed.stdout
    refused = run_cli("--no-progress", "--only", "no-such-identity")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "python -m verify: no identity matches 'no-such-identity'" in refused.stderr
    assert not refused.stdout


def test_a_reader_that_leaves_early_gets_no_traceback():
    """Issue 41: ``python -m verify --list | head -1``: the reader closes the pipe; the command
    ends quietly with the status of a process killed by SIGPIPE (141), not a BrokenPipeError
    traceback. Deterministic: stdout is a pipe whose reading end is closed before the start."""
    import os

    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "verify", "--list"],
            cwd=ROOT,
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=CLI_TIMEOUT,
        )
    finally:
        os.close(write)
    assert done.returncode == 141, done.stderr
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr


def test_mpi_with_a_pattern_that_selects_nothing_exits_2_naming_it(capsys):
    """Issue 41: ``python -m verify --mpi --only <typo>`` exited 0 having checked nothing."""
    done = run_main(capsys, "--mpi", "--only", "no-such-identity")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "no identity matches 'no-such-identity'" in done.stderr


def test_whole_catalogue_passes(capsys):
    done = run_main(capsys, "--no-progress")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    assert f"{len(identities.ENTRIES)} identities" in last and " 0 failed" in last


def test_json_schema(capsys):
    done = run_main(capsys, "--json", "--only", "copy-inplace-adjoint,broadcast-adjoint")
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    assert document["schema"] == report.SCHEMA
    assert document["passed"] is True
    assert document["levels"] == list(report.LEVELS)
    summary = document["summary"]
    assert set(summary) == {"identities", "checks", "passed", "failed", "seconds"}
    assert summary["failed"] == 0 and summary["checks"] == len(document["results"])
    for row in document["results"]:
        assert set(row) == RESULT_KEYS
        assert row["level"] in report.LEVELS and row["status"] == "pass"
    levels = {(r["identity"], r["level"]) for r in document["results"]}
    assert ("copy-inplace-adjoint", "size-free") in levels
    assert ("copy-inplace-adjoint", "complex128") in levels


def test_levels_option_and_table(capsys):
    done = run_main(capsys, "--only", "section:primitives", "--levels", "exact,float32", "--no-progress")
    assert done.returncode == 0
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["identity", "section", "level", "result", "error", "time"]
    assert "size-free" not in done.stdout and "float32" in done.stdout


@pytest.mark.parametrize(
    "args",
    [
        ("--only", "no-such-identity"),
        ("--levels", "float16"),
        ("--bogus",),
        ("--only", "clear-box-adjoint", "--levels", "size-free"),
        ("--mpi", "--json"),
    ],
    ids=["nothing-selected", "unknown-level", "unknown-option", "no-level-applies", "mpi-with-json"],
)
def test_usage_errors_exit_2(capsys, args):
    done = run_main(capsys, "--no-progress", *args)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr


def test_a_level_named_twice_runs_once(capsys):
    done = run_main(capsys, "--only", "clear-box-adjoint", "--levels", "exact,exact", "--no-progress")
    assert done.returncode == 0
    assert "1 identity, 1 check: 1 passed, 0 failed" in done.stdout


def test_list(capsys):
    done = run_main(capsys, "--list", "--only", "section:distributed-primitives")
    assert done.returncode == 0
    assert "sendrecv-adjoint" in done.stdout and "allocate-adjoint" not in done.stdout


@dataclass(frozen=True, eq=True, repr=False)
class CopyForgetsClear(Copy):
    """A wrong adjoint: S_{b->a} instead of K_b S_{b->a}."""

    def adjoint(self) -> LinearOperator:
        return Add(self.dst, self.src)


def broken_entry():
    space = Space([Block("a", (2,)), Block("b", (2,))])
    return adjoint_entry(
        "broken-copy-adjoint",
        "primitives",
        "a deliberately wrong adjoint",
        lambda: CopyForgetsClear(space["a"], space["b"]),
        size_free=True,
    )


def test_a_broken_identity_fails_every_level_and_exits_1(monkeypatch, capsys):
    monkeypatch.setattr(identities, "ENTRIES", (*identities.ENTRIES[:2], broken_entry()))
    status = cli.main(["--json", "--no-progress"])
    assert status == 1
    document = json.loads(capsys.readouterr().out)
    assert document["passed"] is False
    broken = [r for r in document["results"] if r["identity"] == "broken-copy-adjoint"]
    assert {r["level"] for r in broken} == set(report.LEVELS)
    assert all(r["status"] == "fail" for r in broken)
    assert document["summary"]["failed"] == len(broken)
    for row in broken:
        if row["level"] == "size-free":
            assert "block (row b, column b)" in row["message"]
        else:
            assert "row b[0], column b[0]" in row["message"], row


def test_failures_are_spelled_out_below_the_table(monkeypatch, capsys):
    monkeypatch.setattr(identities, "ENTRIES", (broken_entry(),))
    assert cli.main(["--levels", "exact", "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "Failures:" in out and "row b[0], column b[0]" in out


def test_a_crashing_entry_is_an_error_not_a_crash(monkeypatch, capsys):
    def explode():
        raise RuntimeError("cannot build")

    entry = adjoint_entry("explodes", "primitives", "boom", explode)
    monkeypatch.setattr(identities, "ENTRIES", (entry,))
    assert cli.main(["--json", "--no-progress"]) == 1
    document = json.loads(capsys.readouterr().out)
    assert document["results"][0]["status"] == "error"
    assert "RuntimeError: cannot build" in document["results"][0]["message"]


def test_progress_lines_when_not_a_terminal(monkeypatch):
    """The CLI's progress (linop.progress.Progress): a line every few seconds off a terminal."""
    import io

    import linop.progress

    now = iter([0.0, 1.0, 9.0])
    monkeypatch.setattr(linop.progress, "clock", lambda: next(now))
    stream = io.StringIO()
    progress = linop.progress.Progress("python -m verify", 3, "identities checked", stream=stream)
    progress.update(0, identities.ENTRIES[0].name)
    progress.update(1, identities.ENTRIES[1].name)
    progress.clear()
    lines = stream.getvalue().splitlines()
    assert lines == [f"python -m verify: 1 of 3 identities checked ({identities.ENTRIES[1].name}) (9 s)"]


def test_run_refuses_an_unknown_level():
    import verify

    with pytest.raises(verify.CheckOptionError, match="unknown level 'float16'"):
        report.run(identities.ENTRIES[:1], ("exact", "float16"))


def test_ctrl_c_ends_the_report_with_a_line_and_status_130(monkeypatch, capsys):
    """A long report interrupted: one line saying how far it got, no traceback, exit 130."""

    def interrupted(entries, levels, progress):
        progress(0, len(entries), entries[0], 0.0)
        progress(1, len(entries), entries[1], 1.0)
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "run", interrupted)
    status = cli.main(["--only", "copy-*"])
    err = capsys.readouterr().err
    total = len(identities.select("copy-*"))
    assert status == 130
    assert f"python -m verify: interrupted after 1/{total} identities; no result to report" in err
    assert "Traceback" not in err
