"""The deadline rule both host executors (MPI, torch.distributed) follow: when a number of
seconds means no deadline at all.

Each executor reads ``timeout=`` and :data:`ENVIRONMENT` with its own typed errors
(:func:`linop.backends.mpi.deadline.resolve_timeout`,
:func:`linop.backends.torch_distributed.group.resolve_timeout`), then passes the seconds through
:func:`deadline_seconds`, so that ``inf``, ``1e300`` and ``LINOP_TIMEOUT=inf`` mean the same
on both engines.
"""

from __future__ import annotations

import math

__all__ = ["ENVIRONMENT", "NO_DEADLINE_BEYOND", "OFF", "deadline_seconds", "text_seconds"]

ENVIRONMENT = "LINOP_TIMEOUT"
"""The environment variable giving the default deadline in seconds (unset, empty, ``0``,
``off`` or ``none``: no deadline)."""

OFF = ("", "0", "off", "none")
"""The texts (stripped, lower case) that mean no deadline."""

NO_DEADLINE_BEYOND = 1e9
"""Seconds (about 32 years) beyond which a deadline means none: ``inf``, ``1e300`` and any
such value wait as long as it takes, on MPI and torch.distributed alike (no engine can hold a
wait that long: ``datetime.timedelta`` overflows near ``8.6e13`` seconds)."""


def deadline_seconds(seconds: float) -> float | None:
    """A positive number of seconds as the deadline the engines wait for: itself, or None (no
    deadline) when it is infinite or beyond :data:`NO_DEADLINE_BEYOND`. The one rule of both
    engines' ``resolve_timeout``."""
    return None if math.isinf(seconds) or seconds > NO_DEADLINE_BEYOND else seconds


def text_seconds(text: str) -> float | None:
    """The seconds a text gives (``timeout="30"``, ``LINOP_TIMEOUT=30``): None for the words of
    :data:`OFF`, else the number (not yet checked to be positive).

    Raises
    ------
    ValueError
        The text is no number (each executor raises its typed error from it).
    """
    text = text.strip().lower()
    return None if text in OFF else float(text)
