r"""Communication accounting of operator trees, and their time in the alpha-beta model
(``docs/theory.md#cost-model``).

For any tree, :func:`account` counts per worker the messages and bytes it sends and receives
and the bytes it adds, and finds the dependent communication phases; :func:`account_schedule`
does the same for the schedule the MPI interpreter would run (the tree lowered and batched by
:func:`linop.program.compile_program`). Both return an :class:`Accounting`:
plain data (:meth:`Accounting.as_dict`) and a printable table (:meth:`Accounting.table`).

The model
---------
A :class:`CostModel` has three parameters: ``alpha`` (seconds per message: latency),
``beta`` (seconds per byte moved) and ``gamma`` (seconds per byte *added*, the reduction's
arithmetic). A message of n bytes costs alpha + beta n, plus gamma n when the receiver adds it
into its data; a local add of n bytes costs gamma n; local copies cost nothing (their bytes
are counted). An optional fourth parameter ``delta`` charges every local step a fixed time: the
interpreter's overhead per step, which the classical model leaves out (0 by default).

- **The tree as built** (:func:`account`): the tree's movement steps in program order (a node
  the MPI interpreter lowers to plain messages and local steps, such as a halo stage, counted
  as those steps, not as the staging buffers of its expansion); a step waits for every earlier
  step whose data it reads or overwrites (the footprints of :mod:`linop.program`),
  and each worker sends one message at a time and receives one at a time (full duplex, one
  port each way). Each step takes the earliest time at which its dependencies have finished
  and its ports are free for its whole duration (first fit: a message independent of the ones
  before it uses a port's idle time rather than queueing behind them). The modeled time is the
  end of the last step; the *dependent phases* are the longest chain of messages each waiting
  for the data of the one before.
- **The schedule** (:func:`account_schedule`): the interpreter's phases, rank by rank. A rank
  starts a phase (or a local step) when everything it took part in before has finished, since
  it waits for all the requests of its phase; there is no global barrier, so ranks that do not
  meet run ahead. Within a phase each rank sends one message at a time and receives one at a
  time, as in the tree. Native collectives of fast paths are steps whose time the model does
  not know (``native``). The *dependent phases* are the critical path, in latencies, of the
  schedules the ranks run, each compiled on its own (:func:`linop.latency.critical_path`: a
  phase posts all its messages at once and ends when its receives have arrived); a rank that
  waits in a phase for a message its peer sends only in a later one lengthens it.

Dependent phases count latencies one after the other when every message of a phase is in
flight at once; the one-port critical path can hold more messages than that, where a worker
sends several in one phase: the binomial broadcast on 6 workers has 2 dependent phases
(0 -> 1 -> 3), and its root's three sends make the critical path 3 alpha, its round count.

Both are the classical synchronous alpha-beta model: for P a power of two the all-reduce
algorithms of :mod:`linop.algorithms.allreduce` come out at the survey's formulas (two trees
2 log2 P (alpha + beta n), butterfly log2 P (alpha + beta n), ring 2 (P-1) (alpha + beta n / P),
Rabenseifner 2 log2 P alpha + 2 (P-1)/P beta n, each plus its adds' gamma terms), which the
tests check.

A critical path is reported as a :class:`Cost`: how many message latencies, bytes and added
bytes lie on it, so ``cost.time(model) = messages alpha + bytes beta + reduced gamma``. The
adjoint of a tree sends the same messages in reverse: its alpha and beta terms are the tree's.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import AccountingError, OperandError
from .latency import critical_path
from .movement import Copy, CopyAdjoint, Move
from .operator import Composition, Identity, LinearOperator, Scaled, Sum, Zero
from .primitives import Add, Allocate, Clear, Deallocate
from .program import (
    Branches,
    FastPathStep,
    Footprint,
    Local,
    Phase,
    Scale,
    Transfer,
    ZeroState,
    compile_for_rank,
    compile_program,
    lower,
    lower_portable,
)

__all__ = [
    "Accounting",
    "AccountingError",
    "Cost",
    "CostModel",
    "Message",
    "WorkerTraffic",
    "account",
    "account_schedule",
]


@dataclass(frozen=True, slots=True)
class CostModel:
    """The alpha-beta(-gamma) model: a message of n bytes costs ``alpha + beta n``, adding n
    bytes costs ``gamma n`` (seconds); ``delta`` (default 0, outside the classical model) is
    the fixed cost of one local step (an add, copy, allocation or drop on one worker), the
    overhead an interpreter pays per step whatever its size.

    Raises
    ------
    AccountingError
        If a parameter is negative or not finite.
    """

    alpha: float
    beta: float
    gamma: float = 0.0
    delta: float = 0.0

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "gamma", "delta"):
            given = getattr(self, name)
            if isinstance(given, bool | str | bytes):
                raise AccountingError(f"cost model: {name} must be a finite number >= 0, not {given!r}")
            try:
                value = float(given)
            except (TypeError, ValueError):
                raise AccountingError(
                    f"cost model: {name} must be a finite number >= 0, not {given!r}"
                ) from None
            if not np.isfinite(value) or value < 0:
                raise AccountingError(f"cost model: {name} must be a finite number >= 0, not {value!r}")
            object.__setattr__(self, name, value)

    def __str__(self) -> str:
        text = f"alpha {self.alpha * 1e6:.3g} us, beta {self.beta * 1e9:.3g} ns/B, gamma {self.gamma * 1e9:.3g} ns/B"
        return text + (f", delta {self.delta * 1e6:.3g} us" if self.delta else "")


@dataclass(frozen=True, slots=True)
class Cost:
    """Terms of a path: ``messages`` latencies, ``bytes`` moved, ``reduced`` bytes added and
    ``steps`` local steps."""

    messages: int = 0
    bytes: int = 0
    reduced: int = 0
    steps: int = 0

    def time(self, model: CostModel) -> float:
        """messages alpha + bytes beta + reduced gamma + steps delta."""
        return (
            self.messages * model.alpha
            + self.bytes * model.beta
            + self.reduced * model.gamma
            + self.steps * model.delta
        )

    def __add__(self, other: Cost) -> Cost:
        return Cost(
            self.messages + other.messages,
            self.bytes + other.bytes,
            self.reduced + other.reduced,
            self.steps + other.steps,
        )

    def __str__(self) -> str:
        text = f"{self.messages} alpha + {self.bytes} beta + {self.reduced} gamma"
        return text + (f" + {self.steps} delta" if self.steps else "")


_NOTHING = Cost()


@dataclass(frozen=True, slots=True)
class Message:
    """One message: from worker ``source`` to worker ``target``; ``adds`` when the receiver adds
    it into its data; ``phase`` the dependent phase it belongs to (1 = first)."""

    source: int
    target: int
    nbytes: int
    adds: bool
    phase: int


@dataclass(frozen=True, slots=True)
class WorkerTraffic:
    """What one worker sends, receives, adds (``reduced``: bytes of adds, remote and local)
    and copies locally, in messages and bytes."""

    worker: int
    sent: int = 0
    sent_bytes: int = 0
    received: int = 0
    received_bytes: int = 0
    reduced_bytes: int = 0
    copied_bytes: int = 0


@dataclass(frozen=True)
class _Event:
    """A step of the tree as built: a message (``target`` set) or local work on ``worker``."""

    worker: int
    target: int | None
    nbytes: int
    adds: bool
    footprint: Footprint
    depends: tuple[int, ...] = ()


@dataclass(frozen=True)
class Accounting:
    """The communication of a tree (``kind="tree"``) or of its MPI schedule (``"schedule"``).

    Attributes
    ----------
    kind : str
    itemsize : int
        Bytes per entry used to count bytes.
    messages : tuple of Message
        Every message, in program order.
    workers : tuple of WorkerTraffic
        One row per worker that the tree names.
    phases : int
        Dependent communication phases: for a tree the longest chain of messages each waiting
        for the previous one; for a schedule the critical path of the ranks' schedules in
        latencies (native collectives counted as one each).
    native : tuple of str
        Fast-path steps of a schedule whose time the model does not know.
    """

    kind: str
    itemsize: int
    messages: tuple[Message, ...]
    workers: tuple[WorkerTraffic, ...]
    phases: int
    native: tuple[str, ...] = ()
    events: tuple[_Event, ...] = field(default=(), repr=False)

    # -- totals -------------------------------------------------------------------------------
    @property
    def total_messages(self) -> int:
        """Number of messages."""
        return len(self.messages)

    @property
    def total_bytes(self) -> int:
        """Bytes sent over all messages."""
        return sum(m.nbytes for m in self.messages)

    # -- the model ----------------------------------------------------------------------------
    def critical_path(self, model: CostModel) -> Cost:
        """The terms of the longest path under ``model`` (see the module docstring)."""
        return _simulate(self.events, model)

    def time(self, model: CostModel) -> float:
        """Modeled time in seconds."""
        return self.critical_path(model).time(model)

    # -- output -------------------------------------------------------------------------------
    def as_dict(self, model: CostModel | None = None) -> dict[str, Any]:
        """Plain data: totals, per-worker rows and, with a model, the critical path and time."""
        data: dict[str, Any] = {
            "kind": self.kind,
            "itemsize": self.itemsize,
            "messages": self.total_messages,
            "bytes": self.total_bytes,
            "phases": self.phases,
            "native": list(self.native),
            "workers": [
                {
                    "worker": w.worker,
                    "sent": w.sent,
                    "sent_bytes": w.sent_bytes,
                    "received": w.received,
                    "received_bytes": w.received_bytes,
                    "reduced_bytes": w.reduced_bytes,
                    "copied_bytes": w.copied_bytes,
                }
                for w in self.workers
            ],
        }
        if model is not None:
            path = self.critical_path(model)
            data["critical_path"] = {
                "messages": path.messages,
                "bytes": path.bytes,
                "reduced": path.reduced,
                "steps": path.steps,
            }
            data["time"] = path.time(model)
        return data

    def table(self, model: CostModel | None = None) -> str:
        """A printable table: one row per worker, then totals and (with a model) the time."""
        what = "tree as built" if self.kind == "tree" else "MPI schedule"
        header = ("worker", "sent", "bytes sent", "received", "bytes received", "bytes added", "bytes copied")
        rows = [
            (w.worker, w.sent, w.sent_bytes, w.received, w.received_bytes, w.reduced_bytes, w.copied_bytes)
            for w in self.workers
        ]
        widths = [
            max(len(h), *(len(str(r[k])) for r in rows)) if rows else len(h) for k, h in enumerate(header)
        ]
        lines = [f"communication of the {what} ({self.itemsize}-byte entries)"]
        lines.append("  ".join(h.rjust(n) for h, n in zip(header, widths)))
        lines.extend("  ".join(str(v).rjust(n) for v, n in zip(r, widths)) for r in rows)
        lines.append(
            f"messages {self.total_messages}, bytes {self.total_bytes}, dependent phases {self.phases}"
        )
        if self.native:
            lines.append(f"native collectives (time not modeled): {', '.join(self.native)}")
        if model is not None:
            path = self.critical_path(model)
            lines.append(f"critical path {path} = {_seconds(path.time(model))} ({model})")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _seconds(value: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value * 1e9:.3g} ns"


def _check_operator(op: object) -> None:
    if not isinstance(op, LinearOperator):
        raise OperandError(f"the accounting needs a LinearOperator, not {type(op).__name__} {op!r:.60}")


def check_itemsize(itemsize: int) -> int:
    """``itemsize`` (bytes per entry) as an int, or an :class:`AccountingError` if it is not a
    positive integer (shared with :mod:`linop.algorithms.chooser`)."""
    if isinstance(itemsize, bool) or not isinstance(itemsize, (int, np.integer)) or itemsize < 1:
        raise AccountingError(f"itemsize must be a positive integer (bytes per entry), not {itemsize!r}")
    return int(itemsize)


# -- the tree as built ----------------------------------------------------------------------------
_LEAVES = (Copy, CopyAdjoint, Move, Add, Clear, Allocate, Deallocate)


def _tree_steps(op: LinearOperator, out: list[Any]) -> None:
    """The movement steps of ``op`` in program order, every other node expanded."""
    if isinstance(op, Composition):
        for factor in reversed(op.factors):
            _tree_steps(factor, out)
    elif isinstance(op, Sum):
        for term in op.terms:  # each term runs on the same input, one after the other
            _tree_steps(term, out)
    elif isinstance(op, Scaled):
        _tree_steps(op.operator, out)
    elif isinstance(op, (Identity, Zero)):
        pass
    elif isinstance(op, _LEAVES):
        out.extend(lower(op))
    else:
        # the interpreter's own steps where they are plain messages and local steps (a halo
        # stage's transfers, not the staging buffers of its expansion); else the expansion
        lowered = lower_portable(op)
        if all(type(step) in (Transfer, Local) for step in lowered):
            out.extend(lowered)
            return
        expanded = op.expand()
        if expanded is op:
            out.extend(lower(op))  # the interpreter's own lowering, or its error for an unknown node
        else:
            _tree_steps(expanded, out)


def _local_bytes(node: LinearOperator, itemsize: int) -> tuple[int, int]:
    """(bytes added, bytes copied) by a local step."""
    if isinstance(node, CopyAdjoint):
        return node.src.size * itemsize, 0
    if isinstance(node, Add):
        return node.src.size * itemsize, 0
    if isinstance(node, (Copy, Move)):
        return 0, node.src.size * itemsize
    return 0, 0


def _names(footprint: Footprint) -> set[str]:
    return {box[0] for boxes in (footprint.reads, footprint.writes, footprint.adds) for box in boxes}


def _events(steps: Sequence[Any], itemsize: int) -> list[_Event]:
    events: list[_Event] = []
    touching: dict[str, list[int]] = {}
    for step in steps:
        if isinstance(step, Transfer):
            event = _Event(
                step.src_worker,
                step.dst_worker,
                step.source.size * itemsize,
                step.mode == "add",
                step.footprint,
            )
        elif isinstance(step, Local):
            added, _ = _local_bytes(step.node, itemsize)
            event = _Event(step.worker, None, added, added > 0, step.footprint)
        else:  # a fast path of an unexpandable node: a barrier between everything before and after
            raise AccountingError(f"cannot account the step {type(step).__name__} of a tree as built")
        fp = event.footprint
        earlier: set[int] = set()
        for name in _names(fp):
            earlier.update(touching.get(name, ()))
        depends = tuple(sorted(k for k in earlier if events[k].footprint.conflicts(fp)))
        index = len(events)
        events.append(_Event(event.worker, event.target, event.nbytes, event.adds, fp, depends))
        for name in _names(fp):
            touching.setdefault(name, []).append(index)
    return events


def _duration(event: _Event) -> Cost:
    if event.target is None:
        return Cost(0, 0, event.nbytes if event.adds else 0, 1)
    return Cost(1, event.nbytes, event.nbytes if event.adds else 0)


def _simulate(events: Sequence[_Event], model: CostModel) -> Cost:
    """List scheduling in program order with dependencies and one port each way per worker:
    each event takes the earliest time, from when its dependencies have finished, at which its
    ports are free for its whole duration (first fit, so that a message independent of the
    ones before it fills a port's idle time instead of queueing behind them)."""
    finish: list[tuple[float, Cost]] = []
    busy: dict[tuple[str, int], list[tuple[float, float, Cost]]] = {}
    last = (0.0, _NOTHING)
    for event in events:
        start = (0.0, _NOTHING)
        for k in event.depends:
            if finish[k][0] > start[0]:
                start = finish[k]
        if event.target is None:
            resources = [("cpu", event.worker)]
        else:
            resources = [("send", event.worker), ("receive", event.target)]
        duration = _duration(event)
        length = duration.time(model)
        intervals = [interval for key in resources for interval in busy.get(key, ())]
        candidates = [start, *((e, c) for _, e, c in intervals if e > start[0])]
        candidates.sort(key=lambda item: item[0])
        for candidate in candidates:
            begin = candidate[0]
            if not any(begin < e and begin + length > b for b, e, _ in intervals):
                start = candidate
                break
        cost = start[1] + duration
        end = (cost.time(model), cost)
        finish.append(end)
        for key in resources:
            busy.setdefault(key, []).append((start[0], end[0], cost))
        if end[0] > last[0]:
            last = end
    return last[1]


def _depths(events: Sequence[_Event]) -> list[int]:
    depth: list[int] = []
    for event in events:
        before = max((depth[k] for k in event.depends), default=0)
        depth.append(before + (event.target is not None))
    return depth


def _traffic(
    messages: Iterable[Message], local: dict[int, tuple[int, int]], workers: Iterable[int]
) -> tuple[WorkerTraffic, ...]:
    rows: dict[int, dict[str, int]] = {w: {} for w in workers}
    for m in messages:
        for w in (m.source, m.target):
            rows.setdefault(w, {})
        src, dst = rows[m.source], rows[m.target]
        src["sent"] = src.get("sent", 0) + 1
        src["sent_bytes"] = src.get("sent_bytes", 0) + m.nbytes
        dst["received"] = dst.get("received", 0) + 1
        dst["received_bytes"] = dst.get("received_bytes", 0) + m.nbytes
        if m.adds:
            dst["reduced_bytes"] = dst.get("reduced_bytes", 0) + m.nbytes
    for w, (added, copied) in local.items():
        row = rows.setdefault(w, {})
        row["reduced_bytes"] = row.get("reduced_bytes", 0) + added
        row["copied_bytes"] = row.get("copied_bytes", 0) + copied
    return tuple(WorkerTraffic(w, **rows[w]) for w in sorted(rows))


def _space_workers(op: LinearOperator) -> set[int]:
    return {b.worker for space in (op.domain, op.range) for b in space}


def account(op: LinearOperator, *, itemsize: int = 8) -> Accounting:
    """The communication of ``op`` as built: every movement step in program order.

    Parameters
    ----------
    op : LinearOperator
        Any tree; nodes other than the movement primitives are expanded.
    itemsize : int, optional
        Bytes per entry (8 for float64, the default).

    Returns
    -------
    Accounting
        ``kind="tree"``; its ``critical_path(model)`` simulates the steps with their
        dependencies and one send and one receive port per worker.

    Raises
    ------
    AccountingError
        If ``itemsize`` is not a positive integer.
    OperandError
        If ``op`` is not a :class:`~linop.LinearOperator`.
    """
    _check_operator(op)
    itemsize = check_itemsize(itemsize)
    steps: list[Any] = []
    _tree_steps(op, steps)
    events = _events(steps, itemsize)
    depth = _depths(events)
    messages = tuple(
        Message(e.worker, e.target, e.nbytes, e.adds, d)
        for e, d in zip(events, depth)
        if e.target is not None
    )
    local: dict[int, tuple[int, int]] = {}
    for step in steps:
        if isinstance(step, Local):
            added, copied = _local_bytes(step.node, itemsize)
            before = local.get(step.worker, (0, 0))
            local[step.worker] = (before[0] + added, before[1] + copied)
    return Accounting(
        "tree",
        itemsize,
        messages,
        _traffic(messages, local, _space_workers(op)),
        max(depth, default=0),
        events=tuple(events),
    )


# -- the MPI schedule ------------------------------------------------------------------------------
class _ScheduleEvents:
    """Events of a schedule: a rank starts its next phase (or local step) when everything it
    took part in before has finished: the interpreter waits for a phase's requests, rank by
    rank, with no global barrier."""

    def __init__(self, itemsize: int) -> None:
        self.itemsize = itemsize
        self.events: list[_Event] = []
        self.messages: list[Message] = []
        self.local: dict[int, tuple[int, int]] = {}
        self.native: list[str] = []
        self.phases = 0
        self.frontier: dict[int, list[int]] = {}  # per worker: the events its next step waits for

    def _event(self, worker: int, target: int | None, nbytes: int, adds: bool, depends: set[int]) -> int:
        self.events.append(_Event(worker, target, nbytes, adds, Footprint(), tuple(sorted(depends))))
        return len(self.events) - 1

    def run(self, steps: Iterable[Any]) -> None:
        for step in steps:
            if isinstance(step, Phase):
                self.phase(step.transfers)
            elif isinstance(step, Transfer):  # batch() emits phases; a lone transfer is one
                self.phase((step,))
            elif isinstance(step, Local):
                added, copied = _local_bytes(step.node, self.itemsize)
                before = self.local.get(step.worker, (0, 0))
                self.local[step.worker] = (before[0] + added, before[1] + copied)
                index = self._event(
                    step.worker, None, added, added > 0, set(self.frontier.get(step.worker, ()))
                )
                self.frontier[step.worker] = [index]
            elif isinstance(step, Branches):
                for term in step.terms:
                    self.run(term)
            elif isinstance(step, FastPathStep):
                self.phases += 1
                self.native.append(type(step.runner).__name__.lstrip("_"))
                workers = sorted(getattr(step.runner, "workers", ()) or self.frontier)
                waits = {k for w in workers for k in self.frontier.get(w, ())}
                index = self._event(workers[0] if workers else 0, None, 0, False, waits)
                for w in workers:
                    self.frontier[w] = [index]
            elif isinstance(step, (Scale, ZeroState)):
                pass
            else:  # pragma: no cover - compile_program emits nothing else
                raise AccountingError(f"unknown schedule step {step!r}")

    def phase(self, transfers: Sequence[Transfer]) -> None:
        self.phases += 1
        joined: dict[int, list[int]] = {}
        for t in transfers:
            nbytes = t.source.size * self.itemsize
            adds = t.mode == "add"
            self.messages.append(Message(t.src_worker, t.dst_worker, nbytes, adds, self.phases))
            waits = set(self.frontier.get(t.src_worker, ())) | set(self.frontier.get(t.dst_worker, ()))
            index = self._event(t.src_worker, t.dst_worker, nbytes, adds, waits)
            for w in (t.src_worker, t.dst_worker):
                joined.setdefault(w, []).append(index)
        self.frontier.update(joined)


def _rank_phases(op: LinearOperator, max_worker: int) -> int:
    """The dependent phases of the schedules the ranks run (each compiled on its own, as the
    interpreter does): their critical path in latencies (:func:`linop.latency.critical_path`),
    a native collective counted as one latency on its rank."""
    schedules = {rank: compile_for_rank(op, rank).schedule for rank in range(max_worker + 1)}
    return critical_path(schedules, native=lambda rank, step: (1, (rank,)))


def account_schedule(op: LinearOperator, *, itemsize: int = 8) -> Accounting:
    """The communication of the schedule the MPI interpreter would run for ``op``.

    The tree is compiled with :func:`linop.program.compile_program` (fast paths
    included, then batched into phases) for the messages and the time, and every rank's own
    schedule (:func:`~linop.program.compile_for_rank`) for the dependent phases;
    see the module docstring for the phase model.

    Parameters and errors as for :func:`account`.
    """
    _check_operator(op)
    itemsize = check_itemsize(itemsize)
    program = compile_program(op)
    schedule = _ScheduleEvents(itemsize)
    schedule.run(program.steps)
    return Accounting(
        "schedule",
        itemsize,
        tuple(schedule.messages),
        _traffic(schedule.messages, schedule.local, _space_workers(op)),
        _rank_phases(op, program.max_worker),
        tuple(schedule.native),
        events=tuple(schedule.events),
    )
