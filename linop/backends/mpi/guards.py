"""Ending an MPI job when one rank fails, so that no rank waits forever for it.

An MPI program whose rank raises and exits leaves its peers blocked in their next collective or
receive: the raising rank sits in ``MPI_Finalize`` and the job hangs until killed. Two places
need a loud end instead:

- **inside linop** (:func:`abort_on_failure`): after the collective check every rank is
  committed to the schedule, so any exception there (a bug, a user kernel raising, and also
  ``KeyboardInterrupt`` or ``SystemExit``) prints the rank's message and calls ``MPI_Abort``;
- **in the user's own code** (opt in): :func:`guard` (a context manager and decorator) or
  :func:`install_excepthook` does the same for an exception raised between two calls, e.g.
  ``with guard(): main()``. Running the program as ``mpiexec -n 4 python -m mpi4py prog.py``
  gives the same protection for the whole program (mpi4py aborts on an unhandled exception)
  and is recommended; the guard covers code run otherwise (a notebook, an embedding).

mpi4py is imported only when an abort happens or a guard is entered without a communicator.
"""

from __future__ import annotations

import faulthandler
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import ContextDecorator, contextmanager
from types import TracebackType
from typing import Any, Literal, NoReturn

from ...errors import PeerTimeoutError
from .datatypes import mpi
from .mpi_types import Comm

__all__ = [
    "guard",
    "Guard",
    "install_excepthook",
    "abort_on_failure",
    "abort_for",
    "abort_job",
    "exit_status",
]


def exit_status(error: BaseException) -> int:
    """The job's exit status for ``error``: 130 for ``KeyboardInterrupt`` (128 + SIGINT, as
    mpi4py and shells report it), the code of a ``SystemExit`` (1 when it is not an integer),
    1 for any other exception."""
    if isinstance(error, KeyboardInterrupt):
        return 130
    if isinstance(error, SystemExit):
        return error.code if isinstance(error.code, int) and error.code else 1
    return 1


def _describe(error: BaseException) -> str:
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


OUTPUT_DRAIN = 0.25
"""Seconds a rank waits after printing why it aborts and before ``MPI_Abort``: the launcher
forwards a rank's output asynchronously, and an abort right after the write can end the job
before the message is forwarded (seen with MPICH's hydra: the traceback of a rank under
:func:`install_excepthook` lost, once in a CI run)."""

REPORT_GRACE = 1.0
"""Seconds a rank waits after printing a :class:`~linop.errors.PeerTimeoutError` before it
aborts the job: the other ranks that arrived reach the same error at about the same time, and
each prints its own before the abort ends them."""


ABORT_WATCHDOG = 30.0
"""Seconds a rank may spend inside ``MPI_Abort`` before it ends itself (:func:`abort_job`):
``MPI_Abort`` hands the job to the launcher, which kills every rank within a second or so;
a rank still alive long after has hung in the abort (seen once under load: the aborting
rank's message printed, the job still running two minutes later). The watchdog is
:func:`faulthandler.dump_traceback_later` with ``exit=True``, a C thread that needs neither
the interpreter's lock nor MPI: it prints every thread's stack and calls ``_exit(1)``, and
the launcher, seeing a rank end with a non-zero status, ends the others."""


def abort_job(
    comm: Comm,
    message: str,
    error: BaseException | None = None,
    *,
    status: int = 1,
    settle: float = OUTPUT_DRAIN,
) -> NoReturn:
    """Print ``message`` (and ``error``'s traceback) to stderr in one write, wait ``settle``
    seconds (default :data:`OUTPUT_DRAIN`), then ``comm.Abort(status)``, which ends every
    process of the job. A rank still inside ``comm.Abort`` after :data:`ABORT_WATCHDOG`
    seconds prints its stacks and exits with status 1 (a watchdog armed before the call)."""
    text = message + "\n"
    if error is not None:
        text += "".join(traceback.format_exception(type(error), error, error.__traceback__))
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
        if settle:
            time.sleep(settle)
    finally:
        _arm_abort_watchdog()
        try:
            comm.Abort(status)
        finally:  # only an Abort that returns (a stand-in communicator) gets here
            faulthandler.cancel_dump_traceback_later()
    raise SystemExit(status)


def _arm_abort_watchdog() -> None:
    """Arm :data:`ABORT_WATCHDOG` (the process's one faulthandler timer: one the program set,
    such as pytest's ``faulthandler_timeout``, is replaced, the rank being about to end), writing to
    stderr's descriptor, or to descriptor 2 where ``sys.stderr`` has none (a notebook); a
    failure to arm never keeps the rank from aborting."""
    try:
        faulthandler.dump_traceback_later(ABORT_WATCHDOG, exit=True, file=sys.stderr)
    except (AttributeError, OSError, ValueError, RuntimeError):  # no descriptor behind stderr
        try:
            faulthandler.dump_traceback_later(ABORT_WATCHDOG, exit=True, file=2)
        except (OSError, ValueError, RuntimeError):
            pass


@contextmanager
def abort_on_failure(comm: Comm, doing: Callable[[], str]) -> Iterator[None]:
    """Abort the job if anything (any ``BaseException``) is raised inside the block.

    For linop's own collective sections, where the other ranks may be waiting for this one:
    its message is ``linop MPI interpreter: rank R failed while <doing()>: <error>``.
    """
    try:
        yield
    except BaseException as error:
        abort_for(comm, doing(), error)


def abort_for(comm: Comm, doing: str, error: BaseException) -> NoReturn:
    """Abort the job because linop failed on this rank with ``error`` while ``doing``: the
    message is ``linop MPI interpreter: rank R failed while <doing>: <error>; aborting the job``.
    (For hot paths: a bare ``try``/``except BaseException`` calling this costs nothing until
    it raises, unlike entering :func:`abort_on_failure`.)"""
    abort_job(
        comm,
        f"linop MPI interpreter: rank {comm.Get_rank()} failed while {doing}: {_describe(error)}; "
        "aborting the job",
        error,
        status=exit_status(error),
        settle=REPORT_GRACE if isinstance(error, PeerTimeoutError) else OUTPUT_DRAIN,
    )


class Guard(ContextDecorator):
    """End the whole MPI job when the guarded code raises on any rank (opt in).

    ``with guard(): main()`` (or ``@guard()`` on a function): an exception leaving the block on
    one rank prints ``linop: rank R raised <error> ...`` with its traceback and calls
    ``MPI_Abort`` on ``comm``, so that every rank ends within seconds instead of the others
    waiting forever for the failed one. ``KeyboardInterrupt`` (Ctrl-C, SIGINT) aborts too;
    ``SystemExit`` aborts unless its code is 0 or None (a normal exit on every rank).

    Parameters
    ----------
    comm : mpi4py communicator, optional
        The communicator to abort; default ``MPI.COMM_WORLD`` (the whole job).

    Notes
    -----
    ``mpiexec -n N python -m mpi4py program.py`` protects a whole program the same way and is
    recommended where it applies.
    """

    def __init__(self, comm: Comm | None = None) -> None:
        self.comm = comm

    def __enter__(self) -> Guard:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> Literal[False]:
        if error is None:
            return False
        if isinstance(error, SystemExit) and error.code in (0, None):
            return False
        _abort_for_user_error(self.comm, error)


def guard(comm: Comm | None = None) -> Guard:
    """``with guard(): ...`` or ``@guard()``: see :class:`Guard`."""
    return Guard(comm)


def _abort_for_user_error(comm: Comm | None, error: BaseException) -> NoReturn:
    comm = mpi().COMM_WORLD if comm is None else comm
    rank = comm.Get_rank()
    abort_job(
        comm,
        f"linop: rank {rank} raised {_describe(error)}; aborting the job (MPI_Abort) so that no rank "
        "waits for it",
        error,
        status=exit_status(error),
    )


def install_excepthook(comm: Comm | None = None) -> Callable[..., Any]:
    """Make an exception that reaches the top level of the program abort the MPI job (opt in).

    Sets :data:`sys.excepthook` so that an uncaught exception on any rank prints its message
    and traceback and calls ``MPI_Abort`` on ``comm`` (default ``MPI.COMM_WORLD``) instead of
    leaving the rank in ``MPI_Finalize`` while its peers wait. Returns the previous hook.
    """
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
        _abort_for_user_error(comm, error.with_traceback(tb))

    sys.excepthook = hook
    return previous
