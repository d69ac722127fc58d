"""The interfaces between the MPI interpreter's fast paths and its runtime.

A fast-path lowering (:func:`linop.program.lowering`) emits a
:class:`~linop.program.FastPathStep` holding a :class:`~linop.program.FastPathRunner`: the
global step, which knows the workers it involves and gives each rank its part, here a
:class:`RankStep`. The runtime (:mod:`linop.backends.mpi.runtime`) runs a rank step on the
rank's workspace; a bound plan (:mod:`linop.backends.mpi.bound`) asks it, once, for persistent
requests instead (:meth:`RankStep.persistent`, :meth:`RankStep.bind_out_of_place`), which a
step that cannot be bound so declines by returning None (the default).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Union

import numpy as np

from ...program import RankPart
from .mpi_types import Intracomm, Prequest

if TYPE_CHECKING:  # pragma: no cover - annotations only
    from ..numpy import Workspace

__all__ = ["RankStep", "Persistent", "OutOfPlaceBinding", "Action", "Call"]

Action = Callable[[], object]
"""A local action run after the requests of a phase complete (an unpack, add or clear)."""

Call = Union["Prequest", Action]
"""One collective call of a bound plan: a persistent request, or a blocking collective call."""


@dataclass
class Persistent:
    """An in-place rank step bound to fixed arrays: persistent requests (started one at a
    time, in the global order of their groups) and the local actions that follow them."""

    requests: list[Prequest] = field(default_factory=list)
    finish: list[Action] = field(default_factory=list)


@dataclass
class OutOfPlaceBinding:
    """An out-of-place rank step bound to fixed input arrays: its collective calls in order,
    the result arrays they write (built once, overwritten by every call) and the input blocks
    the step drops from the state."""

    calls: list[Call] = field(default_factory=list)
    results: dict[str, np.ndarray] = field(default_factory=dict)
    dropped: tuple[str, ...] = ()
    scratch: list[np.ndarray] = field(default_factory=list)
    """Arrays the calls write into that are no result (a non-root's sum): kept alive with
    the binding, released by its ``free()``."""
    requests: list[Prequest] = field(default_factory=list)
    """Persistent requests the calls start themselves (``Startall`` of many at once): freed
    with the binding."""


class RankStep(RankPart, ABC):
    """One rank's part of an MPI fast-path step."""

    @abstractmethod
    def run(self, work: Workspace, comm: Intracomm, dtype: np.dtype) -> None:
        """Run the step on this rank's workspace; collective over the ranks that take part."""

    def written(self) -> tuple[str, ...] | None:
        """The blocks an in-place step writes, which :meth:`persistent` binds (a compiled run
        makes them its own first); None for a step that binds out of place (the default)."""
        return None

    def persistent(
        self, arrays: dict[str, np.ndarray], comm: Intracomm, dtype: np.dtype, *, dry: bool = False
    ) -> Persistent | None:
        """Persistent requests doing the step in place on ``arrays`` on every call, or None when
        the step cannot be bound so (the default). ``dry``: only decide, create nothing
        (collective initializations are made by every member or none, so ranks agree first)."""
        return None

    def bind_out_of_place(
        self,
        arrays: dict[str, np.ndarray],
        comm: Intracomm,
        dtype: np.dtype,
        *,
        dry: bool = False,
        out: Mapping[str, np.ndarray] | None = None,
    ) -> OutOfPlaceBinding | None:
        """Collective calls doing the step from ``arrays`` into result arrays built once, or
        None when the step cannot be bound so (the default). ``dry`` as in :meth:`persistent`.

        ``out``: arrays the caller gave for some blocks of the range (``bind(..., out=)``,
        checked there: each of its block's shape and the run's dtype, C-contiguous, writeable,
        sharing memory with nothing else of the run). A step may take the one of a block it
        creates as that block's result array (then ``results[name] is out[name]``), when its
        calls write the whole block on every call (they may not count on what the array held
        before); one it does not take, the bound plan fills with a copy after each call."""
        return None

    def reads(self) -> tuple[str, ...] | None:
        """The blocks this rank's out-of-place binding reads, or None when unknown (the
        default). Known, a bound plan may start its persistent requests while an earlier
        step's are still in flight, unless it reads what they fill."""
        return None
