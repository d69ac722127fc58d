"""The deadline rule both host executors (MPI, torch.distributed) follow: when a number of
seconds means no deadline at all.

Each executor reads ``timeout=`` and :data:`ENVIRONMENT` with its own typed errors
(:func:`linop.backends.mpi.deadline.resolve_timeout`,
:func:`linop.backends.torch_distributed.group.resolve_timeout`), then passes the seconds through
:func:`deadline_seconds`, so that ``inf``, ``1e300`` and ``LINOP_TIMEOUT=inf`` mean the same
on both engines.

**The default** (:data:`DEFAULT_SECONDS`, 600 s) applies where neither ``timeout=`` nor
:data:`ENVIRONMENT` says otherwise (the variable unset or empty): no job waits forever by
default for a rank that never arrives at the entry check, a bound plan's first call or a
communicator's duplication. ``LINOP_TIMEOUT=off`` (or ``0``, ``none``, ``inf``) switches it off.
Why 600 s: the collectives it bounds are where every rank of a healthy job meets within the
skew of its slowest rank's own work between two calls (a cold ``torch.compile``, measured
40-85 s here; loading data; writing a checkpoint), so the default must stay well above any such
skew, and it should end a hung job long before its allocation does. It is torch's default for
NCCL process groups (``default_pg_nccl_timeout``, 10 minutes; gloo's is 30). A job whose ranks
may legitimately stay apart longer sets ``LINOP_TIMEOUT`` higher, or off.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

__all__ = [
    "DEFAULT_SECONDS",
    "ENVIRONMENT",
    "NO_DEADLINE_BEYOND",
    "OFF",
    "deadline_seconds",
    "environment_text",
    "text_seconds",
]

ENVIRONMENT = "LINOP_TIMEOUT"
"""The environment variable giving the default deadline in seconds (unset or empty:
:data:`DEFAULT_SECONDS`; ``0``, ``off``, ``none`` or ``inf``: no deadline)."""

DEFAULT_SECONDS = 600.0
"""The deadline (seconds) when neither ``timeout=`` nor :data:`ENVIRONMENT` gives one (see the
module docstring for why 600)."""

OFF = ("0", "off", "none")
"""The texts (stripped, lower case) that mean no deadline (``inf`` and huge numbers too, by
:func:`deadline_seconds`)."""

NO_DEADLINE_BEYOND = 1e9
"""Seconds (about 32 years) beyond which a deadline means none: ``inf``, ``1e300`` and any
such value wait as long as it takes, on MPI and torch.distributed alike (no engine can hold a
wait that long: ``datetime.timedelta`` overflows near ``8.6e13`` seconds)."""


def deadline_seconds(seconds: float) -> float | None:
    """A positive number of seconds as the deadline the engines wait for: itself, or None (no
    deadline) when it is infinite or beyond :data:`NO_DEADLINE_BEYOND`. The one rule of both
    engines' ``resolve_timeout``."""
    return None if math.isinf(seconds) or seconds > NO_DEADLINE_BEYOND else seconds


def environment_text(environ: Mapping[str, str] | None = None) -> str:
    """The text of :data:`ENVIRONMENT` (stripped, lower case), or :data:`DEFAULT_SECONDS` as
    text when it is unset or empty."""
    text = (os.environ if environ is None else environ).get(ENVIRONMENT, "").strip().lower()
    return text if text else repr(DEFAULT_SECONDS)


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
