"""Progress of long work on stderr, and one line saying how far it got when interrupted.

Long user-facing work (lifting a large function by probing, calibrating the cost model, the
``python -m verify`` report) counts its steps through a :class:`Progress`. What the user sees
is chosen by the ``progress=`` keyword of those functions (:data:`ProgressOption`):

- ``None`` (the default): report on stderr only once the work has run :data:`QUIET_SECONDS`
  (so short calls in tests and notebooks stay silent);
- ``True``: report from the first step; ``False``: never;
- a callable: called as ``callback(done, total, what)`` at every step (a notebook or a GUI
  draws its own bar), with nothing written to stderr but the line on Ctrl-C.

On a terminal the report is one live line, rewritten in place; otherwise (a log, a pipe, a
captured stream) a line every :data:`LINE_SECONDS` and one at the end. Under MPI only rank 0
reports (``report=False`` on the others).

Used as a context manager, a :class:`Progress` also handles Ctrl-C: when ``KeyboardInterrupt``
leaves the block it clears the live line, writes one line such as ``lift of f: interrupted
after 1,536 of 65,536 probes (forward)``, and lets the interrupt propagate (the program still
stops; nothing partial is returned); ``progress=False`` silences this line too. Under MPI a
``KeyboardInterrupt`` inside linop's collective sections aborts the whole job as before
(:mod:`linop.backends.mpi.guards`); this line comes only from the rank-0 code that sees the
interrupt itself.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from types import TracebackType
from typing import Literal, TextIO

__all__ = ["LINE_SECONDS", "QUIET_SECONDS", "Progress", "ProgressCallback", "ProgressOption", "clock"]

ProgressCallback = Callable[[int, int, str], None]
"""``callback(done, total, what)``: ``done`` of ``total`` steps of the work ``what``."""

ProgressOption = bool | ProgressCallback | None
"""What a ``progress=`` keyword takes: None (report when long), True, False, or a callback."""

QUIET_SECONDS = 2.0
"""With ``progress=None``, seconds of work before anything is reported."""

LINE_SECONDS = 5.0
"""Seconds between two progress lines when stderr is not a terminal."""

clock: Callable[[], float] = time.monotonic
"""The clock progress reads (a module attribute, so that tests can replace it)."""


class Progress:
    """Counts the steps of one piece of long work and reports them (see the module docstring).

    Parameters
    ----------
    what : str
        The work, as the user knows it: ``"lift of f"``, ``"calibrate"``.
    total : int
        The number of steps the work takes.
    unit : str
        What a step is, in the plural: ``"probes"``, ``"samples"``.
    progress : None, bool or callable
        :data:`ProgressOption`: None reports after :data:`QUIET_SECONDS`, True always, False
        never, a callable receives ``(done, total, what)`` at every step instead.
    report : bool
        False on the ranks that must stay silent (under MPI, every rank but 0).
    stream : text stream, optional
        Where lines go (default ``sys.stderr`` at the time of each write).
    quiet, every : float
        :data:`QUIET_SECONDS` and :data:`LINE_SECONDS` for this work.
    """

    def __init__(
        self,
        what: str,
        total: int,
        unit: str = "steps",
        *,
        progress: ProgressOption = None,
        report: bool = True,
        stream: TextIO | None = None,
        quiet: float = QUIET_SECONDS,
        every: float = LINE_SECONDS,
    ) -> None:
        self.what = what
        self.total = int(total)
        self.unit = unit
        self.done = 0
        self.stage = ""
        self._callback = progress if callable(progress) else None
        self._report = report and progress is not False
        self._to_stream = self._report and self._callback is None
        self._stream = stream
        self._quiet = 0.0 if progress is True else quiet
        self._every = every
        self._start = clock()
        self._last_line: float | None = None
        self._live_shown = False
        self._ended = False

    @property
    def stream(self) -> TextIO:
        """The stream lines go to."""
        return self._stream if self._stream is not None else sys.stderr

    def describe(self) -> str:
        """The work and its stage: ``"lift of f (forward)"``."""
        return f"{self.what} ({self.stage})" if self.stage else self.what

    def _count(self) -> str:
        return f"{self.done:,} of {self.total:,} {self.unit}" + (f" ({self.stage})" if self.stage else "")

    def update(self, done: int, stage: str | None = None) -> None:
        """``done`` steps of the total are complete (``stage``, when given, names what runs now)."""
        self.done = done
        if stage is not None:
            self.stage = stage
        if not self._report:
            return
        if self._callback is not None:
            self._callback(done, self.total, self.describe())
            return
        now = clock()
        if now - self._start < self._quiet:
            return
        stream = self.stream
        if stream.isatty():
            stream.write(f"\r\033[K{self.what}: {self._count()}")
            stream.flush()
            self._live_shown = True
        elif (
            self._last_line is None
            or now - self._last_line >= self._every
            or (done >= self.total and not self._ended)
        ):
            self._last_line = now
            self._ended = done >= self.total
            stream.write(f"{self.what}: {self._count()} ({now - self._start:.0f} s)\n")
            stream.flush()

    def advance(self, steps: int = 1, stage: str | None = None) -> None:
        """``steps`` more steps are complete."""
        self.update(self.done + steps, stage)

    def clear(self) -> None:
        """Leave the terminal line clean (erase the live line, if one is shown)."""
        if self._live_shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self._live_shown = False

    def interrupted(self) -> None:
        """Clear the line and write one saying what was interrupted and how far it got."""
        self.clear()
        if self._report:
            self.stream.write(f"{self.what}: interrupted after {self._count()}\n")
            self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> Literal[False]:
        if isinstance(error, KeyboardInterrupt):
            self.interrupted()
        else:
            self.clear()
        return False
