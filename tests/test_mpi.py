"""Run the MPI suite (tests/mpi/) under mpiexec at 1, 2, 3 and 4 ranks, in one launch.

One ``mpiexec -n 4`` launch runs ``tests/mpi/run_passes.py``: the suite at 4 ranks, then at 3
and 1 side by side, then at 2, each size on a communicator of its own that the tests (and linop's
defaults) see as ``MPI.COMM_WORLD`` (the interpreter's start and imports paid once instead of
once per size). The launch is bounded twice: pytest-timeout inside (per test) and a timeout
around the launch, so that a deadlock fails the run instead of hanging it. The
bounds are generous (a correct suite passes on a machine running four times more processes than
it has cores) and report that the launch timed out; no test asserts how fast anything ran. On timeout every process of the launch is killed: MPICH's launcher starts its
proxy and each rank in a session of their own, so killing ``mpiexec`` or its process group
would rely on the proxy to clean up, and a surviving rank would hold the output pipe open
(and the run with it). Four ranks oversubscribe a two-core machine; that is intended. Every
launch prints its progress as it goes (a line when each size's pass starts and one when it
ends, with the minutes elapsed; on standard error, past pytest's capture). Every
launch inherits the MPICH settings of tests/conftest.py (``MPICH_YIELDING``): a rank that polls
for a message and finds none gives up the processor instead of spinning on it. The failure
cases (a rank raising, interrupted, never arriving) are launches of their own.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("mpi4py")

ROOT = Path(__file__).resolve().parent.parent
LAUNCH_TIMEOUT = 1800
"""Seconds the launch of the MPI suite may take (about 110 s on the idle machine)."""
TEST_TIMEOUT = 300
"""Seconds one test of the MPI suite may take inside its launch."""
LONG_ONLY = pytest.mark.skipif(
    os.environ.get("LINOP_LONG") != "1", reason="LINOP_LONG=1 (the CI suite's time: a case another covers)"
)
JOB_TIMEOUT = 300
"""Seconds a launch of one failure case (a rank raising, interrupted, or under the guard) may take
to start, fail and end every rank; a job still running then is killed and reported."""


def _mpiexec() -> str | None:
    beside_python = Path(sys.executable).parent / "mpiexec"
    return str(beside_python) if beside_python.exists() else shutil.which("mpiexec")


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (read from /proc; empty where there is none)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = entry.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.parent.name))
    found, queue = [], [pid]
    while queue:
        for child in children.get(queue.pop(), []):
            found.append(child)
            queue.append(child)
    return found


def run_bounded(
    command: list[str], timeout: float, env: dict[str, str], progress: Callable[[str], None] | None = None
) -> tuple[int, str, str]:
    """Run ``command``; after ``timeout`` seconds kill it and every process it started, and
    raise :class:`subprocess.TimeoutExpired` with the output so far. ``progress``, if given,
    is called with each line of its standard output as it comes."""
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    if progress is None:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stdout, stderr = _kill_all(process)
            raise subprocess.TimeoutExpired(command, timeout, stdout, stderr) from None
        return process.returncode, stdout, stderr
    lines: list[str] = []
    errors: list[str] = []

    def read_lines() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            progress(line)

    def read_errors() -> None:
        assert process.stderr is not None
        errors.append(process.stderr.read())

    readers = [threading.Thread(target=read, daemon=True) for read in (read_lines, read_errors)]
    for reader in readers:
        reader.start()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_all(process)
        for reader in readers:
            reader.join(5)
        raise subprocess.TimeoutExpired(command, timeout, "".join(lines), "".join(errors)) from None
    for reader in readers:
        reader.join()
    return process.returncode, "".join(lines), "".join(errors)


PASS_LINE = re.compile(r"^(== \d+ ranks: .*|.*(?<!\d)\d+ (passed|failed)\b.*)$")
"""The lines of the MPI suite's output that tell its progress: a size's pass starting, a pass's
summary."""


def _report(capsys: pytest.CaptureFixture[str]) -> Callable[[str], None]:
    """Print the launch's progress lines as they come, past pytest's capture (under xdist they
    reach the terminal through the worker's standard error), each with the minutes elapsed."""
    started = time.monotonic()

    def report(line: str) -> None:
        if PASS_LINE.match(line.strip()):
            with capsys.disabled():
                minutes = (time.monotonic() - started) / 60
                print(f"[MPI suite, {minutes:4.1f} min] {line.strip()}", file=sys.stderr, flush=True)

    return report


def _kill_all(process: subprocess.Popen) -> tuple[str, str]:
    """SIGKILL ``process`` and every process it started; return its output so far."""
    tree = _descendants(process.pid)
    for pid in (process.pid, *tree):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    stdout, stderr = process.communicate()
    for _ in range(100):  # SIGKILL is delivered asynchronously: wait for the ends
        if not any(_alive(pid) for pid in tree):
            break
        time.sleep(0.05)
    return stdout, stderr


SIZES = (4, 3, 2, 1)
"""The communicator sizes the suite runs at (``run_passes.py``: passes of one 4-rank launch)."""


@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_mpi_suite(capsys):
    mpiexec = _mpiexec()
    if mpiexec is None:
        pytest.skip("no mpiexec found")
    command = [
        mpiexec,
        "-n",
        str(max(SIZES)),
        sys.executable,
        "tests/mpi/run_passes.py",
        *map(str, SIZES),
        "--",
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
        status, stdout, stderr = run_bounded(command, LAUNCH_TIMEOUT, env, _report(capsys))
    except subprocess.TimeoutExpired as expired:
        pytest.fail(
            f"the MPI suite's launch timed out after {LAUNCH_TIMEOUT} s (every process killed)\n{expired.stdout}"
        )
    assert status == 0, f"the MPI suite failed:\n{stdout[-6000:]}\n{stderr[-3000:]}"
    for size in SIZES:  # each size ran, and passed on each of its ranks
        assert stdout.count(f"== {size} ranks: ") == 1, stdout[-6000:]
    assert len(re.findall(r"(?<!\d)\d+ passed", stdout)) == sum(SIZES), stdout[-6000:]


@pytest.mark.timeout(JOB_TIMEOUT + 60)
def test_a_rank_failing_mid_run_ends_the_job():
    """After the collective check, a rank that raises aborts the job with its message."""
    mpiexec = _mpiexec()
    if mpiexec is None:
        pytest.skip("no mpiexec found")
    command = [mpiexec, "-n", "2", sys.executable, "tests/mpi/abort_case.py"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        status, stdout, stderr = run_bounded(command, JOB_TIMEOUT, env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"timed out: a rank failing mid-run left the job running for {JOB_TIMEOUT} s")
    output = stdout + stderr
    assert status != 0, output
    assert "rank 1 failed while applying" in output and "a local kernel failed on rank 1" in output, output
    assert "finished (it should not have)" not in output, output


END_WITHIN = 120.0
"""Seconds every rank of a job may take to end once one rank fails (within a second or two on
the idle machine; generous, so that a loaded one passes): a job still running then has hung."""


def _ends_within(process: subprocess.Popen, seconds: float, pids: list[int]) -> tuple[bool, str]:
    """Wait up to ``seconds`` for the launch and every rank in ``pids`` to end; (ended, output).
    A launch still running then is killed with every process it started."""
    seen = ""
    try:
        stdout, stderr = process.communicate(timeout=seconds)
        ended = True
    except subprocess.TimeoutExpired:
        seen = _processes_seen([process.pid, *_descendants(process.pid), *pids])
        stdout, stderr = _kill_all(process)
        ended = False
    survivors = [pid for pid in pids if _alive(pid)]
    return ended and not survivors, f"{stdout}\n{stderr}\n{seen}survivors: {survivors}"


def _processes_seen(pids: list[int]) -> str:
    """For a failure's message: each of ``pids`` as /proc shows it (parent, state, where it
    sleeps in the kernel, command line), or that it is gone."""
    lines = ["processes at the timeout (pid, parent, state, kernel wait, command):"]
    for pid in dict.fromkeys(pids):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            wchan = Path(f"/proc/{pid}/wchan").read_text()
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:160]
        except OSError:
            lines.append(f"  {pid}: gone")
            continue
        lines.append(f"  {pid}: parent {fields[1]}, {fields[0]}, {wchan or '-'}, {command}")
    return "\n".join(lines) + "\n"


def _launch(ranks: int, script: str, *args: str) -> subprocess.Popen:
    mpiexec = _mpiexec()
    if mpiexec is None:
        pytest.skip("no mpiexec found")
    return subprocess.Popen(
        [mpiexec, "-n", str(ranks), sys.executable, f"tests/mpi/{script}", *args],
        cwd=ROOT,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.timeout(JOB_TIMEOUT + END_WITHIN + 60)
@pytest.mark.parametrize(
    ("ranks", "mode"), [(2, "apply"), (4, "bound")], ids=["2-ranks-apply", "4-ranks-bound"]
)
def test_sigint_to_one_rank_inside_linop_ends_every_rank(ranks, mode, tmp_path):
    """KeyboardInterrupt is not an Exception: linop's abort path must catch it too."""
    process = _launch(ranks, "interrupt_case.py", str(tmp_path), mode)
    victim = ranks - 1
    files = [tmp_path / f"rank{r}" for r in range(ranks)]
    deadline = time.monotonic() + JOB_TIMEOUT
    while not all(f.exists() and f.read_text() for f in files):
        if time.monotonic() > deadline or process.poll() is not None:
            stdout, stderr = _kill_all(process)
            pytest.fail(f"the ranks did not start looping (ended, or timed out):\n{stdout}\n{stderr}")
        time.sleep(0.05)
    pids = [int(f.read_text()) for f in files]
    for pid in pids:  # never signal anything but a rank of this launch
        assert b"interrupt_case.py" in Path(f"/proc/{pid}/cmdline").read_bytes(), f"pid {pid} is no rank"
    time.sleep(0.2)  # well inside the loop of applications
    os.kill(pids[victim], signal.SIGINT)
    ended, output = _ends_within(process, END_WITHIN, pids)
    assert ended, f"timed out: SIGINT to rank {victim} left the job running for {END_WITHIN} s:\n{output}"
    assert "KeyboardInterrupt; aborting the job" in output, output
    assert process.returncode != 0, output
    if f"linop MPI interpreter: rank {victim} failed while" not in output:  # not linop's abort:
        _assert_raised_at_the_call_boundary(output)  # the case's excepthook ended the job


def test_the_call_boundary_check_refuses_an_interrupt_from_inside_linop():
    """Control of the check above: an interrupt raised at ``apply_mpi``'s entry passes it, one
    raised inside linop's runtime (its abort path let it through) fails it."""
    case = f'  File "{ROOT / "tests" / "mpi" / "interrupt_case.py"}", line 45, in <module>\n'
    boundary = (
        case + f'  File "{ROOT / "linop" / "operator.py"}", line 163, in apply_mpi\nKeyboardInterrupt\n'
    )
    _assert_raised_at_the_call_boundary(boundary)
    inside = (
        boundary + f'  File "{ROOT / "linop" / "backends" / "mpi" / "runtime.py"}", line 99, in complete\n'
    )
    with pytest.raises(AssertionError, match="escaped linop's abort path"):
        _assert_raised_at_the_call_boundary(inside)
    bound = ROOT / "linop" / "backends" / "mpi" / "bound.py"
    late = case + f'  File "{bound}", line {_first_try(bound, "__call__") + 1}, in __call__\n'
    with pytest.raises(AssertionError, match="escaped linop's abort path"):  # inside its try
        _assert_raised_at_the_call_boundary(late)


def _assert_raised_at_the_call_boundary(output: str) -> None:
    """The KeyboardInterrupt that the excepthook reported was raised before any of linop's
    guarded sections: its traceback runs from the case script only through the imports and the
    entries of the calls, up to their first ``try`` (``apply_mpi``, which has none,
    ``linop.backends.mpi.apply`` and a bound plan's ``__call__``); a frame anywhere else in
    linop means linop's own abort path let it through."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', output)
    assert frames, output
    entries = {
        (ROOT / "linop" / "operator.py", "apply_mpi"),
        (ROOT / "linop" / "backends" / "mpi" / "__init__.py", "apply"),
        (ROOT / "linop" / "backends" / "mpi" / "bound.py", "__call__"),
    }
    for path, line, function in frames:
        if Path(path).name == "interrupt_case.py" or path.startswith("<frozen importlib"):
            continue
        if (Path(path), function) in entries and int(line) <= _first_try(Path(path), function):
            continue
        raise AssertionError(
            f"the interrupt escaped linop's abort path at {path}:{line} ({function}):\n{output}"
        )


def _first_try(path: Path, function: str) -> int:
    """The line number of the first ``try:`` in ``function`` of ``path`` (past its end when it
    has none)."""
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith(f"def {function}("))
    indent = len(lines[start]) - len(lines[start].lstrip())
    for i in range(start + 1, len(lines)):
        text = lines[i]
        if text.strip() and len(text) - len(text.lstrip()) <= indent and not text.lstrip().startswith(")"):
            return i  # the function ended without one: every line of it is before any try
        if text.strip() == "try:":
            return i + 1
    return len(lines)


@pytest.mark.timeout(JOB_TIMEOUT + 60)
@pytest.mark.parametrize(
    ("ranks", "mode"),
    [(2, "with"), (4, "with"), (3, "excepthook")],
    ids=["2-ranks", "4-ranks", "3-ranks-hook"],
)
def test_a_user_exception_under_the_guard_ends_every_rank(ranks, mode):
    process = _launch(ranks, "guard_case.py", mode)
    try:
        stdout, stderr = process.communicate(timeout=JOB_TIMEOUT)  # start-up, the failure, the end
    except subprocess.TimeoutExpired:
        stdout, stderr = _kill_all(process)
        pytest.fail(f"timed out: a user exception under the guard left the job running:\n{stdout}\n{stderr}")
    output = stdout + stderr
    message = (
        f"linop: rank {ranks - 1} raised ValueError: user code failed on rank {ranks - 1}; aborting the job"
    )
    assert message in output, output
    assert "finished (it should not have)" not in output, output
    assert process.returncode != 0, output
    assert re.search(r"raising at ([0-9.]+)", output), output  # the failing rank got there


@pytest.mark.timeout(400)
def test_a_hung_launch_is_killed_with_every_process(tmp_path):
    """The bound itself, on a launch shaped like MPICH's: a parent whose child runs in a
    session of its own (out of reach of a process-group kill) and holds the output pipe."""
    pid_file, woke = tmp_path / "child", tmp_path / "woke"
    child = (
        f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
        f"time.sleep(600); open({str(woke)!r}, 'w').write('the child was never killed')"
    )
    parent = (
        "import subprocess, sys; "
        f"subprocess.Popen([sys.executable, '-c', {child!r}], start_new_session=True).wait()"
    )
    with pytest.raises(subprocess.TimeoutExpired):
        run_bounded([sys.executable, "-c", parent], 1.5, dict(os.environ))
    assert not woke.exists(), "the launch ran on until the child woke (it was never killed)"
    assert pid_file.exists(), "the child did not start"
    assert not _alive(int(pid_file.read_text())), "the child survived the timeout"


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie has ended: only its parent has yet to reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in "ZX"


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("ranks", "mode"),
    [
        pytest.param(2, "apply", id="2-ranks-apply"),
        pytest.param(4, "apply", id="4-ranks-apply"),  # oversubscribed here: the check's yielding poll
        pytest.param(4, "bound", id="4-ranks-bound"),
        pytest.param(4, "dup", id="4-ranks-dup"),
        pytest.param(2, "unbound", id="2-ranks-unbound", marks=LONG_ONLY),  # the 4-rank case covers it
        pytest.param(2, "dup", id="2-ranks-dup", marks=LONG_ONLY),  # the 4-rank case covers it
        pytest.param(4, "unbound", id="4-ranks-unbound"),
        pytest.param(2, "every", id="2-ranks-every-call"),
        pytest.param(2, "every-barrier", id="2-ranks-every-call-barrier"),
    ],
)
def test_a_rank_that_never_arrives_ends_the_job_with_a_typed_error(ranks, mode):
    """Rank 1 skips a call (the entry check, a bound plan's first call, persistent or not, or
    the communicator's duplication at its first plan): every other rank raises
    PeerTimeoutError naming it by the deadline (2 s), and the job is aborted. The bound below
    is only a runaway guard (no timing is asserted): without the deadline the launch would
    hang until it."""
    mpiexec = _mpiexec()
    if mpiexec is None:
        pytest.skip("no mpiexec found")
    from_environment = mode in ("bound", "unbound")
    runner = ["-m", "mpi4py"] if from_environment else []
    command = [mpiexec, "-n", str(ranks), sys.executable, *runner, "tests/mpi/timeout_case.py", mode]
    env = dict(os.environ, PYTHONUNBUFFERED="1", LINOP_TIMEOUT="2" if from_environment else "")
    try:
        status, stdout, stderr = run_bounded(command, 200, env)
    except subprocess.TimeoutExpired as error:
        pytest.fail(
            f"timed out: a rank that never arrived left the others waiting:\n{error.stdout}\n{error.stderr}"
        )
    output = stdout + stderr
    assert status != 0, output
    assert "finished (it should not have)" not in output, output
    doing = {
        "dup": "the duplication of the communicator",
        "unbound": "the first call of the bound plan",
        "every": "a call of the bound plan",
        "every-barrier": "a call of the bound plan",
    }
    for rank in (r for r in range(ranks) if r != 1):
        assert f"PeerTimeoutError: rank {rank}: rank(s) [1] did not arrive" in output, output
        if mode in doing:
            assert f"rank {rank}: rank(s) [1] did not arrive at {doing[mode]}" in output, output
    assert "aborting the job" in output, output
