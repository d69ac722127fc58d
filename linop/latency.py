r"""The latency model of the per-rank schedules that the MPI interpreter runs.

Each rank runs its schedule (:func:`linop.program.compile_for_rank`) in order.
A communication phase (:class:`~linop.program.RankPhase`) posts its receives
and its sends at once and ends when every one of its receives has arrived; a message sent at
the start of its sender's phase arrives one latency later. Local steps take no time. So, with
:math:`s(r, k)` the start of rank r's k-th phase and :math:`e(r, k)` its end,

.. math::

    s(r, 0) = 0, \qquad s(r, k) = e(r, k - 1), \qquad
    e(r, k) = \max\bigl(s(r, k),\ \max_{m \text{ received in } (r, k)} s(\mathrm{sender}(m)) + 1\bigr)

and the schedule's *critical path* is the largest end, in latencies. It is the number of
message latencies one after the other that the run pays (the alpha term of the alpha-beta
model when every phase's messages overlap), independent of the bytes: the measure of how a
schedule's dependent phases chain across ranks. A rank that waits in phase k for a message its
neighbour sends only in its phase k + 1 makes a chain that grows with the grid.

Messages are matched as MPI matches them: between one sender and one receiver, by tag, in
order (the n-th receive of a tag from a peer gets the n-th send of that tag to it).
A native collective step of a fast path (any other rank step that communicates) is outside the
model: :func:`critical_path` refuses it unless ``native`` says how to time it.

The schedules can be given lazily (a function of the rank, called once per rank it needs), so
that the end of a few ranks' schedules on a large grid is computed from those ranks' dependency
cones only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import AccountingError
from .program import RankBranches, RankPart, RankPhase

__all__ = ["RankTimes", "critical_path", "rank_phases"]

Schedule = tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class _Phase:
    """One rank's phase in the model: the messages it receives and sends, each as
    (sender, receiver, tag, occurrence of that tag between the pair)."""

    receives: tuple[tuple[int, int, int, int], ...]
    sends: tuple[tuple[int, int, int, int], ...]


def _flatten(schedule: Iterable[Any], out: list[Any]) -> None:
    for step in schedule:
        if isinstance(step, RankBranches):  # the terms run one after the other
            for term in step.terms:
                _flatten(term, out)
        else:
            out.append(step)


def rank_phases(rank: int, schedule: Schedule, native: Callable[[Any], bool] | None = None) -> list[Any]:
    """The communicating steps of ``rank``'s schedule in order: each phase as its messages
    (sender, receiver, tag, occurrence), each native step (``native(step)`` true) as itself.

    Raises
    ------
    AccountingError
        For a fast-path step (a :class:`~linop.program.RankPart`) that ``native`` does not
        accept: the model does not know its messages.
    """
    steps: list[Any] = []
    _flatten(schedule, steps)
    seen: dict[tuple[int, int, int], int] = {}

    def key(src: int, dst: int, tag: int) -> tuple[int, int, int, int]:
        count = seen.get((src, dst, tag), 0)
        seen[(src, dst, tag)] = count + 1
        return (src, dst, tag, count)

    out: list[Any] = []
    for step in steps:
        if isinstance(step, RankPhase):
            receives = tuple(key(peer, rank, tag) for peer, tag, _ in step.receives)
            sends = tuple(key(rank, peer, tag) for peer, tag, _ in step.sends)
            out.append(_Phase(receives, sends))
        elif native is not None and native(step):
            out.append(step)
        elif isinstance(step, RankPart):
            raise AccountingError(
                f"rank {rank}: the latency model does not know the messages of {type(step).__name__}"
            )
    return out


class RankTimes:
    """Start and end of every phase of the ranks asked for, computed on demand.

    Parameters
    ----------
    schedules : mapping or callable
        Rank -> its schedule (a :class:`~linop.program.RankProgram`'s
        ``schedule``); a callable is called once per rank the answer needs.
    native : callable, optional
        ``native(rank, step) -> (latencies, group)`` for a native step: it starts when every
        rank of ``group`` has reached it and lasts ``latencies``. Without it a native step
        raises :class:`~linop.errors.AccountingError`.
    """

    def __init__(
        self,
        schedules: Mapping[int, Schedule] | Callable[[int], Schedule],
        native: Callable[[int, Any], tuple[int, tuple[int, ...]]] | None = None,
    ) -> None:
        self._get = schedules.__getitem__ if isinstance(schedules, Mapping) else schedules
        self._native = native
        self._phases: dict[int, list[Any]] = {}
        self._ends: dict[int, list[int | None]] = {}
        self._sent_in: dict[int, dict[tuple[int, int, int, int], int]] = {}
        self._native_index: dict[int, dict[int, int]] = {}

    def phases(self, rank: int) -> list[Any]:
        """The rank's communicating steps (see :func:`rank_phases`)."""
        found = self._phases.get(rank)
        if found is None:
            accepts = None if self._native is None else (lambda step: isinstance(step, RankPart))
            found = self._phases[rank] = rank_phases(rank, self._get(rank), accepts)
            self._ends[rank] = [None] * len(found)
            self._sent_in[rank] = {
                m: k for k, phase in enumerate(found) if isinstance(phase, _Phase) for m in phase.sends
            }
        return found

    def start(self, rank: int, k: int) -> int:
        """When rank ``rank`` starts its k-th communicating step (in latencies)."""
        return 0 if k == 0 else self.end(rank, k - 1)

    def end(self, rank: int, k: int) -> int:
        """When rank ``rank``'s k-th communicating step ends (in latencies)."""
        self.phases(rank)
        done = self._ends[rank][k]
        if done is None:
            done = self._evaluate(rank, k)
        return done

    def finish(self, rank: int) -> int:
        """When ``rank`` ends its schedule (0 for a rank that does not communicate)."""
        count = len(self.phases(rank))
        return self.end(rank, count - 1) if count else 0

    def _evaluate(self, rank: int, k: int) -> int:
        # iterative over the dependency cone (a chain of ranks can be as long as the grid)
        stack = [(rank, k)]
        expanded: set[tuple[int, int]] = set()  # on the stack below their dependencies
        while stack:
            r, j = stack[-1]
            if self._ends[r][j] is not None:
                stack.pop()
                continue
            missing = [(q, i) for q, i in self._needs(r, j) if self._ends[q][i] is None]
            if missing:
                if (r, j) in expanded or any(item in expanded for item in missing):
                    raise AccountingError(
                        f"the schedules wait on each other in a cycle (rank {r}, step {j}): they deadlock"
                    )
                expanded.add((r, j))
                stack.extend(missing)
                continue
            begin = self._start_known(r, j)
            step = self._phases[r][j]
            if isinstance(step, _Phase):
                arrivals = [self._start_known(q, i) + 1 for q, i in self._senders(r, j)]
                self._ends[r][j] = max(begin, *arrivals) if arrivals else begin
            else:
                latencies, group = self._native(r, step)  # type: ignore[misc]
                starts = [self._start_known(q, i) for q, i in self._native_peers(r, j, group)]
                self._ends[r][j] = max(begin, *starts) + latencies if starts else begin + latencies
            stack.pop()
            expanded.discard((r, j))
        found = self._ends[rank][k]
        assert found is not None
        return found

    def _start_known(self, rank: int, k: int) -> int:
        if k == 0:
            return 0
        found = self._ends[rank][k - 1]
        assert found is not None
        return found

    def _senders(self, rank: int, k: int) -> list[tuple[int, int]]:
        """(sender, its phase index) of every receive of rank ``rank``'s phase k."""
        out = []
        for message in self._phases[rank][k].receives:
            sender = message[0]
            self.phases(sender)
            index = self._sent_in[sender].get(message)
            if index is None:
                raise AccountingError(
                    f"rank {rank} receives a message (tag {message[2]}) that rank {sender} never sends"
                )
            out.append((sender, index))
        return out

    def _native_peers(self, rank: int, k: int, group: tuple[int, ...]) -> list[tuple[int, int]]:
        """(member, index of its matching native step) for a native step of a group: the n-th
        native step of a group on one rank meets the n-th on every other member."""
        nth = sum(1 for step in self._phases[rank][:k] if not isinstance(step, _Phase))
        out = []
        for member in group:
            steps = self.phases(member)
            natives = [i for i, step in enumerate(steps) if not isinstance(step, _Phase)]
            if nth >= len(natives):
                raise AccountingError(f"rank {member} has no native step matching rank {rank}'s")
            out.append((member, natives[nth]))
        return out

    def _needs(self, rank: int, k: int) -> list[tuple[int, int]]:
        """The (rank, step) ends that step k of ``rank`` needs before it can be timed."""
        needs = [(rank, k - 1)] if k else []
        step = self._phases[rank][k]
        if isinstance(step, _Phase):
            pairs = self._senders(rank, k)
        else:
            pairs = self._native_peers(rank, k, self._native(rank, step)[1])  # type: ignore[misc]
        needs.extend((q, i - 1) for q, i in pairs if i > 0)
        return needs


def critical_path(
    schedules: Mapping[int, Schedule] | Callable[[int], Schedule],
    ranks: Iterable[int] | None = None,
    native: Callable[[int, Any], tuple[int, tuple[int, ...]]] | None = None,
) -> int:
    """The critical path of per-rank schedules in latencies (see the module docstring): the
    latest end among ``ranks`` (default: every rank of the mapping).

    Parameters
    ----------
    schedules : mapping or callable
        Rank -> its schedule; a callable is evaluated lazily for the ranks the answer needs.
    ranks : iterable of int, optional
        The ranks whose ends are taken (required when ``schedules`` is a callable).
    native : callable, optional
        How to time native steps (see :class:`RankTimes`).

    Raises
    ------
    AccountingError
        If a receive has no matching send, the schedules wait in a cycle, or a native step
        cannot be timed.
    """
    if ranks is None:
        if not isinstance(schedules, Mapping):
            raise AccountingError("critical_path: give the ranks to evaluate for lazily given schedules")
        ranks = schedules.keys()
    times = RankTimes(schedules, native)
    return max((times.finish(r) for r in ranks), default=0)
