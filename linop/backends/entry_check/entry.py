"""The collective entry check of the distributed executors: validate everything before data moves.

One reduction (maximum over ranks) of a short integer vector (:mod:`.vector`) decides, on every
rank alike, whether a call may run and in which dtype: the tree's 128-bit fingerprint and its
negation (maximum and minimum agree only when every rank holds the same tree), an error flag,
one flag per dtype present on any rank (blocks, the requested dtype), and one per candidate
run dtype whose local kernels' dtypes some rank has not agreed yet (:mod:`.kernels`: then the
ranks probe and gather in step). Only when something is
wrong, a second collective gathers the ranks' messages, so that every rank raises the same
typed error (:class:`~linop.errors.MPIError` subclasses). Local problems are the numpy
interpreter's (:mod:`.state`); the dtype follows :mod:`linop.dtypes` (:mod:`.policy`).

The check runs on any engine through an :class:`Agreement`: the MPI executor's is a persistent
``Allreduce`` per communicator (:class:`linop.backends.mpi.check.CheckReducer`: a 128-bit
digest of the vector first, the whole vector only when the ranks' digests differ), the
torch.distributed executor's an ``all_reduce`` per process group
(:class:`linop.backends.torch_distributed.check.TorchReducer`).

The per-call cost is kept small without weakening any of this (``benchmarks/bench_mpi_apply.py``):
a state that passes a few cheap tests (a dict of exactly the rank's blocks, numpy arrays of the
right shapes and numeric dtypes) skips the detailed diagnosis, which only words the error; the
vector is rewritten only when what it says changes; and the outcome (run dtype, cast, or the
error of a dtype clash) is remembered per reduced vector, which holds every global fact it
depends on. A call passing the same arrays again (the same objects, unchanged:
:mod:`.repeat`) skips even the cheap tests: :meth:`EntryCheck.repeat` finds the kept call,
:meth:`EntryCheck.again` reduces its vector, and the engine runs what it kept for those arrays
(the MPI executor's in-place binding, the torch.distributed executor's prepared phases). Every
call still reduces the whole vector (or, on MPI, its digest, which agrees exactly when every
rank's vector does): a tree, block or dtype that differs on any rank is found on the call where
it differs.

With a deadline (``timeout=``, ``LINOP_TIMEOUT``) the reduction is polled instead of waited for,
and ranks that do not arrive in time are named by every rank that did
(:class:`~linop.errors.PeerTimeoutError`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from ... import dtypes
from ...errors import DistributedDtypeError, DtypeError, LinopError, TreeMismatchError, WorkerMapMismatchError
from ...operator import LinearOperator
from ...space import Block
from .kernels import KernelDtypes
from .outcome import CheckOutcome
from .policy import DtypePolicy
from .repeat import Repeat
from .state import LocalStateCheck, Problem
from .vector import ERROR, FLAG_OF, INT64_MAX, INTEGER_CHARS, UNSETTLED, encode, tree_vector

__all__ = ["Agreement", "EntryCheck"]

_OUTCOMES_KEPT = 64  # outcomes remembered per tree (integer runs add one per largest magnitude)


class Agreement(Protocol):
    """What the entry check needs of an engine: one reduction of the check vector, shared by
    every tree checked on the same communicator or group (calls are collective, so they never
    overlap), and two rarer collectives.

    ``send`` and ``received`` are the vector's buffers (int64, :data:`.vector.VECTOR_LENGTH`);
    ``signature`` and ``sent`` say what ``send`` holds (set by the check that wrote it, so an
    unchanged vector is not rewritten, and an engine may keep what it derives from it, such as
    the MPI reducer's digest); ``growth`` the facts agreed per tree
    (:meth:`EntryCheck._growth_known`)."""

    send: np.ndarray
    received: np.ndarray
    signature: Any
    sent: bytes
    rank: int
    growth: dict[bytes, bool]
    """Per tree fingerprint, whether every rank can bound the tree's integer growth (agreed
    once, kept here for every plan of the tree on this communicator or group; never evicted:
    a few bytes per tree checked with integer blocks)."""

    def reduce(self, timeout: float | None = None, doing: str = "the entry check") -> np.ndarray:
        """The maximum over ranks of ``send``, in ``received`` (returned), within ``timeout``
        seconds (:class:`~linop.errors.PeerTimeoutError` naming the ranks that did not come)."""
        ...

    def minimum(self, value: int) -> int:
        """The minimum over ranks of ``value``."""
        ...

    def allgather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order."""
        ...


class EntryCheck:
    """The entry check of one compiled tree on one communicator or process group.

    Parameters
    ----------
    op : LinearOperator
        The tree.
    fingerprint : bytes
        Its 16-byte fingerprint (:func:`linop.program.fingerprint`).
    agreement : Agreement
        The engine's reduction the check runs through (one per communicator or group, shared
        by every tree checked there).
    domain_blocks : dict of str to Block
        The blocks of ``op.domain`` that this rank owns.
    problem : LinopError, optional
        A compile-time problem (raised by the check on every rank, after the tree test).
    tree_fingerprint : bytes, optional
        The tree's own fingerprint, when ``fingerprint`` also covers a worker map.
    rank_of : callable, optional
        The rank that runs a worker (default: worker ``w`` on rank ``w``); this rank probes
        the callable kernels of its workers (:mod:`.kernels`).
    """

    def __init__(
        self,
        op: LinearOperator,
        fingerprint: bytes,
        agreement: Agreement,
        domain_blocks: dict[str, Block],
        problem: LinopError | None,
        *,
        tree_fingerprint: bytes | None = None,
        rank_of: Callable[[int], int] | None = None,
    ) -> None:
        self.op = op
        self.fingerprint = fingerprint
        self.tree_fingerprint = fingerprint if tree_fingerprint is None else tree_fingerprint
        self.agreement = agreement
        self.rank = agreement.rank
        self.domain_blocks = domain_blocks
        self.problem = problem
        self.local = LocalStateCheck(op, domain_blocks, self.rank)
        self.kernels = KernelDtypes(op, agreement, rank_of or (lambda worker: worker))
        self.policy = DtypePolicy(op, self._growth_known, self.kernels.widened)
        self._prepared: dict[str, list[Any]] = {}  # by dtype char: vector, bytes, outcomes
        self._vector = tree_vector(fingerprint)
        self._settled_version = -1  # the kernels' version the vector's unsettled flags say
        self._mark_unsettled()
        self._tree = self._vector[:8].tobytes()  # the reduced words equal these iff all ranks agree
        expected = self.local.expected
        self._single = expected[0] if len(expected) == 1 else None
        self._outcomes: dict[tuple[bytes, bool], CheckOutcome] = {}  # by the reduced vector
        self._doing_text: str | None = None
        self.last: Repeat | None = None
        """The last call that passed on the single-block path with every rank sending the same
        vector (:mod:`.repeat`): the same arrays again skip the local work (:meth:`repeat`,
        :meth:`again`)."""

    def run(
        self,
        state: Any,
        *,
        inplace: bool = False,
        dtype: npt.DTypeLike | None = None,
        timeout: float | None = None,
    ) -> CheckOutcome:
        """Check collectively; every rank gets the same outcome. Raises nothing itself (the
        caller raises the outcome's error, outside its abort-on-failure section), except
        :class:`~linop.errors.PeerTimeoutError` when ``timeout`` (seconds, resolved) passes
        before every rank arrives (the caller aborts the job then)."""
        self._mark_unsettled()
        if dtype is None and self._single is not None:
            outcome = self._run_single(state, inplace, timeout)
            if outcome is not None:
                return outcome
        return self._run(state, inplace, dtype, timeout)

    def repeat(self, state: Any, inplace: bool) -> Repeat | None:
        """The kept :class:`~.repeat.Repeat` when ``state`` passes exactly what it kept (the
        same array object, unchanged: :meth:`Repeat.same <.repeat.Repeat.same>`) and the vector
        it kept is still the one to send; None otherwise (then :meth:`run` checks the call).
        Communicates nothing."""
        last = self.last
        if last is not None and last.version == self.kernels.version and last.same(state, inplace):
            return last
        return None

    def again(self, repeat: Repeat, timeout: float | None = None) -> tuple[CheckOutcome, bool]:
        """The check of a call that passes what ``repeat`` kept (:meth:`repeat`): its vector
        reduced, with nothing else done locally. ``(outcome, True)`` when every rank sent that
        very vector (the kept outcome, and the engine may run its kept :attr:`Repeat.run
        <.repeat.Repeat.run>`); else ``(outcome, False)``, the outcome decoded afresh from the
        reduced vector (another rank's input differs: an error, or another run dtype), the same
        on every rank. Collective, like :meth:`run`."""
        self.load(repeat.signature, repeat.sent, repeat.vector)
        reduced, got = self._exchange(timeout)
        return self._again_decided(repeat, reduced, got)

    def _again_decided(self, repeat: Repeat, reduced: np.ndarray, got: bytes) -> tuple[CheckOutcome, bool]:
        """:meth:`again`'s answer from the reduced vector (``got``: its bytes)."""
        if got != repeat.sent:
            return self._outcome(reduced, got, None, repeat.inplace), False
        repeat.hits += 1
        return repeat.outcome, True

    def load(self, signature: Any, sent: bytes, vector: np.ndarray) -> None:
        """Put ``vector`` (its bytes ``sent``, prepared under ``signature``: a kept vector, as
        :meth:`_run_single` prepares it and a :class:`~.repeat.Repeat` keeps it) in the
        agreement's send buffer, unless the buffer holds it already (the agreement's
        ``signature`` is this one). Communicates nothing."""
        reducer = self.agreement
        if reducer.signature is not signature:
            np.copyto(reducer.send, vector)
            reducer.signature, reducer.sent = signature, sent

    def _exchange(self, timeout: float | None) -> tuple[np.ndarray, bytes]:
        """The agreement's ``send`` vector (its bytes: ``sent``) reduced over the ranks, and the
        reduced vector's bytes (the engine's reduction; an engine may answer with ``send`` and
        ``sent`` themselves when it knows every rank sent them, :class:`~linop.backends.mpi.check.MPIEntryCheck`).
        Collective."""
        reduced = self.agreement.reduce(timeout, self._doing_text or self._doing())
        return reduced, reduced.tobytes()

    def _doing(self) -> str:
        """What a deadline's error says the ranks were doing (worded once per tree)."""
        if self._doing_text is None:
            text = str(self.op)
            self._doing_text = f"the entry check of {text if len(text) <= 80 else text[:77] + '...'}"
        return self._doing_text

    def _run_single(self, state: Any, inplace: bool, timeout: float | None = None) -> CheckOutcome | None:
        """The common case, cheaply: one block of a float or complex dtype, no ``dtype=``;
        None when the state is anything else (then :meth:`_run` checks it, before any
        communication). Reduces the same vector :meth:`_run` would."""
        name, shape = self._single  # type: ignore[misc]
        if type(state) is not dict or len(state) != 1:
            return None
        array = state.get(name)
        if type(array) is not np.ndarray or array.shape != shape:
            return None
        char = array.dtype.char
        if char in INTEGER_CHARS or char not in FLAG_OF:
            return None
        if inplace and not (
            array.flags.writeable and array.flags.contiguous and self.local.domain_is_range()
        ):
            return None
        prepared = self._prepared.get(char)
        if prepared is None:
            vector = self._vector.copy()
            vector[FLAG_OF[char]] = 1
            prepared = self._prepared[char] = [(self, char), vector.tobytes(), vector, None, None]
        signature, sent, vector, agreed, agreed_in_place = prepared
        self.load(signature, sent, vector)
        reduced, got = self._exchange(timeout)
        if got != sent:  # another rank differs: the general decoding, from the reduced vector
            return self._outcome(reduced, got, None, inplace)
        outcome = agreed_in_place if inplace else agreed  # every rank sent this very vector
        if outcome is None or not self.kernels.settled(outcome, reduced):
            outcome = self._outcome(reduced, got, None, inplace)
            prepared[4 if inplace else 3] = outcome
        if outcome.error is None and self._settled_version == self.kernels.version:  # kept for a repeat
            last = self.last
            if last is None or not (last.outcome is outcome and last.same(state, inplace)):
                self.last = Repeat(
                    name, array, inplace, signature, sent, vector, self._settled_version, outcome
                )
        return outcome

    def _run(
        self, state: Any, inplace: bool, dtype: npt.DTypeLike | None, timeout: float | None = None
    ) -> CheckOutcome:
        problem: Problem | None = None
        arrays = None if self.problem is not None else self.local.arrays_if_valid(state, inplace)
        if arrays is None:
            if self.problem is not None:
                problem = (str(self.problem), type(self.problem))
            else:
                problem = self.local.problem(state, inplace)
                if problem is None:
                    arrays = [state[name] for name in self.domain_blocks]
        reducer = self.agreement
        flags: tuple[int, ...] = ()
        largest = 0
        if arrays:
            flags = tuple(sorted({FLAG_OF[a.dtype.char] for a in arrays}))
            if any(a.dtype.char in INTEGER_CHARS for a in arrays):
                largest = min(dtypes.largest_magnitude(arrays), INT64_MAX)
        if dtype is not None:
            try:
                char = dtypes.check_requested(dtype).char
            except DtypeError as error:
                if problem is None:
                    problem = f"rank {self.rank}: {error}", DistributedDtypeError
            else:
                flags = tuple(sorted({*flags, FLAG_OF[char]}))
        signature = (self, flags, largest, problem is not None, self._settled_version)
        if reducer.signature != signature:  # else the vector holds exactly this already
            encode(reducer.send, self._vector, flags, largest, problem is not None)
            reducer.signature, reducer.sent = signature, reducer.send.tobytes()
        reduced, got = self._exchange(timeout)
        return self._outcome(reduced, got, problem, inplace)

    def _outcome(
        self, reduced: np.ndarray, got: bytes, problem: Problem | None, inplace: bool
    ) -> CheckOutcome:
        """The outcome from the reduced vector (``got``: as bytes), the same on every rank."""
        if got != self.agreement.sent or problem is not None:  # some rank differs from this one
            same_tree = got[: len(self._tree)] == self._tree
            if not same_tree or reduced[ERROR]:
                self.agreement.signature = None  # the error path's collectives do not touch it
                return CheckOutcome(None, self._collective_error(same_tree, problem))
        key = (got, inplace)  # global facts only: every rank decides alike
        outcome = self._outcomes.get(key)
        if outcome is None or not self.kernels.settled(outcome, reduced):  # else no rank gathers
            if len(self._outcomes) >= _OUTCOMES_KEPT:
                self._outcomes.clear()
            outcome = self._outcomes[key] = self.policy.decide(reduced, inplace)
        return outcome

    def _growth_known(self) -> bool:
        """Whether every rank can bound the tree's integer growth (:func:`linop.dtypes.growth`,
        from the tree's exact matrix); agreed once per tree and communicator (one more
        collective, :meth:`Agreement.minimum`). A rank may not: a tree of local operators that
        hold only this rank's data (a layer's parameter operator) has no global matrix there.
        Then integer runs are widened to int64 without a bound (see :mod:`.policy`).

        The agreed answer is kept by the agreement (:attr:`Agreement.growth`, one per
        communicator), not by this check: plans are cached per rank, and a rank may have
        evicted and rebuilt a plan that another rank still holds, so a per-plan answer would
        make one rank enter the collective alone. Every rank asks at the same calls (integer
        runs are agreed by the reduced vector), so the agreement's table is the same on all."""
        known = self.agreement.growth.get(self.fingerprint)
        if known is None:
            try:
                dtypes.growth(self.op)
                local = 1
            except Exception:  # the matrix cannot be formed on this rank
                local = 0
            known = self.agreement.growth[self.fingerprint] = bool(self.agreement.minimum(local))
        return known

    def _mark_unsettled(self) -> None:
        """Set the vector's unsettled flags (:data:`.vector.UNSETTLED`) to the candidate dtypes
        whose kernel dtypes this plan has not agreed; the prepared vectors are rebuilt."""
        if self._settled_version == self.kernels.version:
            return
        self._settled_version = self.kernels.version
        self._vector[UNSETTLED:] = 0
        self._vector[self.kernels.unsettled()] = 1
        self._prepared.clear()

    def _collective_error(self, same_tree: bool, problem: Problem | None) -> LinopError:
        reports = self.agreement.allgather((self.fingerprint, problem, self.tree_fingerprint))
        if not same_tree:
            reference = reports[0][0]
            others = [r for r, (fp, _, _) in enumerate(reports) if fp != reference]
            if all(tree == reports[0][2] for _, _, tree in reports):  # one tree, other worker maps
                return WorkerMapMismatchError(
                    f"the ranks hold different worker-to-rank maps for {self.op}: rank(s) {others} "
                    "differ from rank 0 (every rank must pass the same mapping=)"
                )
            return TreeMismatchError(
                f"the ranks hold different operator trees: rank(s) {others} differ from rank 0 "
                "(every rank must build the same tree)"
            )
        faults = [p for _, p, _ in reports if p is not None]
        message, kind = faults[0]
        if self.problem is not None:
            return kind(message)
        more = f" (and {len(faults) - 1} more rank(s) at fault)" if len(faults) > 1 else ""
        return kind(message + more)
