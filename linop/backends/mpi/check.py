"""The collective entry check of the MPI interpreter: validate everything before data moves.

One ``Allreduce`` (maximum) of a short integer vector decides, on every rank alike, whether a
call may run and in which dtype: the tree's 128-bit fingerprint and its negation (maximum and
minimum agree only when every rank holds the same tree), an error flag, and one flag per dtype
present on any rank (blocks, the requested dtype). Only when something is wrong, a second
collective gathers the ranks' messages, so that every rank raises the same typed error
(:class:`~linop.errors.MPIError` subclasses). Local problems are the same as the numpy
interpreter's: missing, extra, wrongly shaped or non-numeric blocks, and in place a read-only
array or one array passed for two blocks.

The per-call cost is kept small without weakening any of this (``benchmarks/bench_mpi_apply.py``):
the ``Allreduce`` is a persistent request made once per communicator (:class:`CheckReducer`);
a state that passes a few cheap tests (a dict of exactly the rank's blocks, numpy arrays of the
right shapes and numeric dtypes) skips the detailed diagnosis, which only words the error;
the vector is rewritten only when what it says changes; and the outcome (run dtype, cast, or
the error of a dtype clash) is remembered per reduced vector, which holds every global fact it
depends on. Every call still reduces the whole vector: a tree, block or dtype that differs on
any rank is found on the call where it differs.

With a deadline (``timeout=``, ``LINOP_TIMEOUT``) the ``Allreduce`` is polled instead of
waited for, and ranks that do not arrive in time are named by every rank that did
(:class:`~linop.errors.PeerTimeoutError`, :mod:`linop.backends.mpi.deadline`); without one the
check waits as before, at no extra cost.

Dtypes follow the policy of :mod:`linop.dtypes` (``docs/theory.md#dtypes``), with the global
facts the ranks agree on: the dtypes present on any rank and the largest integer magnitude
(a maximum over ranks, in the same ``Allreduce``), so the numpy, sparse and MPI interpreters
give the same result or the same typed error, and every rank decides alike. One exception:
when some rank cannot form the tree's exact matrix (a tree of local operators holding only that
rank's data), the integer growth bound is unknown, and integer blocks are widened to int64
without a bound instead (the ranks agree on that once per tree).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from ... import dtypes
from ...errors import (
    DistributedDtypeError,
    DistributedOverflowError,
    DistributedStateError,
    DtypeError,
    IntegerOverflowError,
    LinopError,
    TreeMismatchError,
    WorkerMapMismatchError,
)
from ...operator import LinearOperator
from ...space import Block, closest_name
from ..numpy import first_shared_memory, overlaps_itself
from .datatypes import mpi
from .deadline import wait_all

if TYPE_CHECKING:  # pragma: no cover - mpi4py is optional at run time
    from mpi4py.MPI import Intracomm

__all__ = [
    "DTYPE_CHARS",
    "VECTOR_LENGTH",
    "DistributedDtypeError",
    "DistributedOverflowError",
    "CheckOutcome",
    "CheckReducer",
    "EntryCheck",
]

DTYPE_CHARS = "bBhHiIlLqQefdgFDG"
"""The numeric dtypes (numpy type characters) that the interpreter moves: the kinds of
:data:`linop.dtypes.NUMERIC_KINDS`."""

_ERROR, _LARGEST, _FLAGS = 8, 9, 10  # vector: fingerprint words (0-3), their negations (4-7), ...
_INT64_MAX = 2**63 - 1
_FLAG_OF = {c: _FLAGS + i for i, c in enumerate(DTYPE_CHARS)}
_INTEGER_CHARS = frozenset(c for c in DTYPE_CHARS if np.dtype(c).kind in "iu")
_END = _FLAGS + len(DTYPE_CHARS)
VECTOR_LENGTH = _END
"""Length of the check vector (int64 entries): the same on every rank and for every tree."""
_OUTCOMES_KEPT = 64  # outcomes remembered per tree (integer runs add one per largest magnitude)


class CheckReducer:
    """The one collective of the entry check on one private communicator: the maximum over
    ranks of a :data:`VECTOR_LENGTH` int64 vector, in buffers owned here.

    Created once per communicator context (collective, like the duplicate it belongs to) as
    a persistent ``Allreduce_init`` request, so each check costs one ``Start`` and one
    ``Wait`` (measured about half the latency of a blocking ``Allreduce`` on this MPICH);
    when the MPI library has no persistent collectives, a blocking ``Allreduce``. On one rank
    there is nothing to agree on: the vector is its own maximum. Every tree checked on the
    communicator shares it (calls are collective, so they never overlap). ``persistent=False``
    (a communicator without a context): a blocking ``Allreduce``, nothing created."""

    def __init__(self, comm: Intracomm, *, persistent: bool = True) -> None:
        self.comm = comm
        self.send = np.zeros(VECTOR_LENGTH, dtype=np.int64)
        self.received = np.zeros(VECTOR_LENGTH, dtype=np.int64)
        self.request: Any = None
        self._pending: Any = None  # the nonblocking reduction without a persistent request
        self.signature: Any = None  # what :attr:`send` holds (set by the check that wrote it)
        self.sent = b""  # :attr:`send` as bytes
        self.single = comm.Get_size() == 1
        if persistent and not self.single:
            try:
                self.request = comm.Allreduce_init(self.send, self.received, op=mpi().MAX)
            except (NotImplementedError, AttributeError):  # pragma: no cover - MPI-4 here
                self.request = None

    def start(self) -> None:
        """Start reducing :attr:`send` (maximum over ranks) into :attr:`received`."""
        if self.single:
            np.copyto(self.received, self.send)
        elif self.request is not None:
            self.request.Start()
        else:  # pragma: no cover - MPI libraries without persistent collectives
            self._pending = self.comm.Iallreduce(self.send, self.received, op=mpi().MAX)

    def wait(self, timeout: float | None = None, doing: str = "the entry check") -> np.ndarray:
        """Complete the reduction started by :meth:`start`; return :attr:`received`. With a
        ``timeout`` (seconds) the reduction is polled, and ranks that do not arrive in time
        raise :class:`~linop.errors.PeerTimeoutError` (:mod:`linop.backends.mpi.deadline`)."""
        if self.single:
            return self.received
        request = self.request if self.request is not None else self._pending
        if timeout is None:
            request.Wait()
        else:
            wait_all([request], self.comm, timeout, doing)
        return self.received

    def reduce(self, timeout: float | None = None, doing: str = "the entry check") -> np.ndarray:
        """Reduce :attr:`send` (maximum over ranks) into :attr:`received` and return it
        (within ``timeout`` seconds, see :meth:`wait`)."""
        self.start()
        return self.wait(timeout, doing)

    def free(self) -> None:
        """Release the persistent request (before the communicator is freed)."""
        if self.request is not None:
            self.request.Free()
            self.request = None


@dataclass(frozen=True)
class CheckOutcome:
    """What the ranks agreed: the run's dtype and the cast of the blocks before the run
    (:func:`linop.dtypes.cast_dtype`; None: run them as they are), whether an integer dtype is
    present, or the error every rank raises."""

    dtype: np.dtype | None
    error: LinopError | None
    cast: np.dtype | None = None
    integers: bool = False

    def result(self) -> np.dtype:
        """The run's dtype; raises the agreed error instead when there is one."""
        if self.error is not None:
            raise self.error
        assert self.dtype is not None
        return self.dtype


Problem = tuple[str, type[LinopError]]


class EntryCheck:
    """The entry check of one compiled tree on one communicator.

    Parameters
    ----------
    op : LinearOperator
        The tree.
    fingerprint : bytes
        Its 16-byte fingerprint (:func:`linop.program.fingerprint`).
    comm : mpi4py communicator
        The private communicator the check runs on.
    domain_blocks : dict of str to Block
        The blocks of ``op.domain`` that this rank owns.
    problem : LinopError, optional
        A compile-time problem (raised by the check on every rank, after the tree test).
    tree_fingerprint : bytes, optional
        The tree's own fingerprint, when ``fingerprint`` also covers a worker map.
    reducer : CheckReducer, optional
        The reduction the check runs through: its communicator context's
        (:attr:`~linop.backends.mpi.context.CommContext.reducer`); default a blocking
        ``Allreduce`` on ``comm``.
    """

    def __init__(
        self,
        op: LinearOperator,
        fingerprint: bytes,
        comm: Intracomm,
        domain_blocks: dict[str, Block],
        problem: LinopError | None,
        *,
        tree_fingerprint: bytes | None = None,
        reducer: Any = None,
    ) -> None:
        self.op = op
        self.fingerprint = fingerprint
        self.tree_fingerprint = fingerprint if tree_fingerprint is None else tree_fingerprint
        self.comm = comm
        self.rank = comm.Get_rank()
        self.domain_blocks = domain_blocks
        self.problem = problem
        words = np.frombuffer(fingerprint, dtype=np.uint32).astype(np.int64)
        self._vector = np.concatenate([words, -words, np.zeros(VECTOR_LENGTH - 8, dtype=np.int64)])
        self._tree = self._vector[:8].tobytes()  # the reduced words equal these iff all ranks agree
        self._reducer = reducer if reducer is not None else CheckReducer(comm, persistent=False)
        self._expected = tuple((name, block.shape) for name, block in domain_blocks.items())
        self._same_space: bool | None = None  # domain == range, decided on first in-place use
        self._single = self._expected[0] if len(self._expected) == 1 else None
        self._prepared: dict[str, list[Any]] = {}  # by dtype char: vector, bytes, outcomes
        self._outcomes: dict[tuple[bytes, bool], CheckOutcome] = {}  # by the reduced vector
        self._dtypes: dict[bytes, tuple[np.dtype, bool, list[str]]] = {}
        self._growth: bool | None = None
        self._doing_text: str | None = None

    def _arrays_if_valid(self, state: Any, inplace: bool) -> list[np.ndarray] | None:
        """This rank's arrays, in domain order, when a few cheap tests show the state right
        (a dict holding exactly the rank's blocks as numpy arrays of the right shapes and
        numeric dtypes; writeable, and one block in place or not); None otherwise, and then
        :meth:`local_problem` decides (and words the error)."""
        if type(state) is not dict or len(state) != len(self._expected):
            return None
        arrays = []
        for name, shape in self._expected:
            array = state.get(name)
            if type(array) is not np.ndarray or array.shape != shape or array.dtype.char not in _FLAG_OF:
                return None
            if inplace and not (array.flags.writeable and array.flags.contiguous):
                return None  # read-only, or perhaps overlapping itself: the full test
            arrays.append(array)
        if inplace and (len(arrays) > 1 or not self._domain_is_range()):
            return None  # blocks sharing memory, or domain != range: the full test
        return arrays

    def _domain_is_range(self) -> bool:
        if self._same_space is None:
            self._same_space = bool(self.op.domain == self.op.range)
        return self._same_space

    def local_problem(self, state: Any, inplace: bool) -> Problem | None:
        """What is wrong with this rank's local state (None when nothing is), and the error
        class to raise for it."""
        rank = self.rank
        if not isinstance(state, Mapping):
            return (
                f"rank {rank}: the local state must be a dict of arrays, not {type(state).__name__}",
                DistributedStateError,
            )
        for name, block in self.domain_blocks.items():
            if name not in state:
                typo = closest_name(name, [str(n) for n in state if n not in self.op.domain])
                hint = ""
                if typo is not None:  # a misspelt key ('bb' for 'b'): name both
                    hint = f"; it holds {typo!r}, which the domain lacks: did you mean {name!r}?"
                return (
                    f"rank {rank}: local state is missing block {name!r} {block.shape}{hint}",
                    DistributedStateError,
                )
        for name in state:
            if name not in self.domain_blocks:
                if name in self.op.domain:
                    owner = self.op.domain.block(name).worker
                    message = (
                        f"rank {rank}: local state holds block {name!r}, which belongs to worker {owner}"
                    )
                else:
                    message = f"rank {rank}: local state holds block {name!r}, which the domain does not hold"
                return message, DistributedStateError
        for name, block in self.domain_blocks.items():
            array = state[name]
            if not isinstance(array, np.ndarray):
                return (
                    f"rank {rank}: block {name!r} is a {type(array).__name__}, not a numpy array",
                    DistributedStateError,
                )
            if array.shape != block.shape:
                return (
                    f"rank {rank}: block {name!r} has shape {array.shape}, the domain expects {block.shape}",
                    DistributedStateError,
                )
            try:
                dtypes.check_block_dtype(name, array.dtype)
            except DtypeError as error:
                return f"rank {rank}: {error}", DistributedDtypeError
            if inplace and not array.flags.writeable:
                return (
                    f"rank {rank}: in-place application needs a writeable array for block {name!r}",
                    DistributedStateError,
                )
            if inplace and overlaps_itself(array):
                return (
                    f"rank {rank}: in-place application cannot write block {name!r}: its entries overlap "
                    f"in memory (strides {array.strides} for shape {array.shape}, a broadcast or expanded view)",
                    DistributedStateError,
                )
        if inplace:
            if self.op.domain != self.op.range:
                return f"in-place application of {self.op}: domain and range differ", DistributedStateError
            shared = (
                first_shared_memory({name: state[name] for name in self.domain_blocks})
                if len(self.domain_blocks) > 1
                else None
            )
            if shared is not None:
                return (
                    f"rank {rank}: in-place application needs separate memory per block; blocks "
                    f"{shared[0]!r} and {shared[1]!r} share entries",
                    DistributedStateError,
                )
        return None

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
        if dtype is None and self._single is not None:
            outcome = self._run_single(state, inplace, timeout)
            if outcome is not None:
                return outcome
        return self._run(state, inplace, dtype, timeout)

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
        if char in _INTEGER_CHARS or char not in _FLAG_OF:
            return None
        if inplace and not (array.flags.writeable and array.flags.contiguous and self._domain_is_range()):
            return None
        prepared = self._prepared.get(char)
        if prepared is None:
            vector = self._vector.copy()
            vector[_FLAG_OF[char]] = 1
            prepared = self._prepared[char] = [(self, char), vector.tobytes(), vector, None, None]
        signature, sent, vector, agreed, agreed_in_place = prepared
        reducer = self._reducer
        if reducer.signature is not signature:  # else the send buffer holds this vector already
            np.copyto(reducer.send, vector)
            reducer.signature, reducer.sent = signature, sent
        request = reducer.request
        if request is not None and timeout is None:  # the persistent Allreduce, without calls around it
            request.Start()
            request.Wait()
            reduced = reducer.received
        else:
            reduced = reducer.reduce(timeout, self._doing())
        got = reduced.tobytes()
        if got != sent:  # another rank differs: the general decoding, from the reduced vector
            return self._outcome(reduced, got, None, inplace)
        outcome = agreed_in_place if inplace else agreed  # every rank sent this very vector
        if outcome is None:
            outcome = self._outcome(reduced, got, None, inplace)
            prepared[4 if inplace else 3] = outcome
        return outcome

    def _run(
        self, state: Any, inplace: bool, dtype: npt.DTypeLike | None, timeout: float | None = None
    ) -> CheckOutcome:
        problem: Problem | None = None
        arrays = None if self.problem is not None else self._arrays_if_valid(state, inplace)
        if arrays is None:
            if self.problem is not None:
                problem = (str(self.problem), type(self.problem))
            else:
                problem = self.local_problem(state, inplace)
                if problem is None:
                    arrays = [state[name] for name in self.domain_blocks]
        reducer = self._reducer
        flags: tuple[int, ...] = ()
        largest = 0
        if arrays:
            flags = tuple(sorted({_FLAG_OF[a.dtype.char] for a in arrays}))
            if any(a.dtype.char in _INTEGER_CHARS for a in arrays):
                largest = min(dtypes.largest_magnitude(arrays), _INT64_MAX)
        if dtype is not None:
            try:
                char = dtypes.check_requested(dtype).char
            except DtypeError as error:
                if problem is None:
                    problem = f"rank {self.rank}: {error}", DistributedDtypeError
            else:
                flags = tuple(sorted({*flags, _FLAG_OF[char]}))
        signature = (self, flags, largest, problem is not None)
        if reducer.signature != signature:  # else the vector holds exactly this already
            vector = reducer.send
            np.copyto(vector, self._vector)  # fingerprint words and their negation, then flags
            vector[list(flags)] = 1
            vector[_LARGEST] = largest
            vector[_ERROR] = problem is not None
            reducer.signature, reducer.sent = signature, vector.tobytes()
        reduced = reducer.reduce(timeout, self._doing())
        return self._outcome(reduced, reduced.tobytes(), problem, inplace)

    def _outcome(
        self, reduced: np.ndarray, got: bytes, problem: Problem | None, inplace: bool
    ) -> CheckOutcome:
        """The outcome from the reduced vector (``got``: as bytes), the same on every rank."""
        if got != self._reducer.sent or problem is not None:  # some rank differs from this one
            same_tree = got[: len(self._tree)] == self._tree
            if not same_tree or reduced[_ERROR]:
                self._reducer.signature = None  # the error path's collectives do not touch it
                return CheckOutcome(None, self._collective_error(same_tree, problem))
        key = (got, inplace)  # global facts only: every rank decides alike
        outcome = self._outcomes.get(key)
        if outcome is None:
            if len(self._outcomes) >= _OUTCOMES_KEPT:
                self._outcomes.clear()
            outcome = self._outcomes[key] = self._decide(reduced, inplace)
        return outcome

    def _decide(self, reduced: np.ndarray, inplace: bool) -> CheckOutcome:
        """The outcome of a check every rank passed, from the reduced vector (the same on every
        rank): the run's dtype, the cast, or the dtype or overflow error every rank raises."""
        flags = reduced[_FLAGS:_END]
        key = flags.tobytes()
        known = self._dtypes.get(key)
        if known is None:
            chars = [c for c, flag in zip(DTYPE_CHARS, flags) if flag]
            run = np.dtype(dtypes.run_dtype(self.op, [np.dtype(c) for c in chars]))
            known = self._dtypes[key] = (
                run,
                any(np.dtype(c).kind in "iu" for c in chars),
                [c for c in chars if not np.can_cast(run, c, "same_kind")],
            )
        run, integers, narrow = known
        if inplace:
            if narrow:
                return CheckOutcome(
                    None,
                    DistributedStateError(
                        f"in-place application of {self.op} computes in {run}, which the callers' "
                        f"{np.dtype(narrow[0])} arrays cannot hold"
                    ),
                )
        cast = None
        if integers:  # a widened integer run is cast back after it (dtypes.fit_back)
            found = [np.dtype(c) for c, flag in zip(DTYPE_CHARS, flags) if flag]
            if self._growth_known():
                try:
                    cast = dtypes.cast_dtype(self.op, found, int(reduced[_LARGEST]))
                except IntegerOverflowError as error:
                    return CheckOutcome(None, DistributedOverflowError(str(error)))
            elif any(d.kind in "iu" and d != np.int64 for d in found):
                cast = np.dtype(np.int64)  # no bound to test: the widest integers
            if cast is not None:
                run = np.result_type(run, cast)
        return CheckOutcome(run, None, cast, integers)

    def _growth_known(self) -> bool:
        """Whether every rank can bound the tree's integer growth (:func:`linop.dtypes.growth`,
        from the tree's exact matrix); agreed once per tree (one more ``Allreduce``). A rank
        may not: a tree of local operators that hold only this rank's data (a layer's
        parameter operator) has no global matrix there. Then integer runs are widened to
        int64 without a bound (see the module docstring)."""
        if self._growth is None:
            try:
                dtypes.growth(self.op)
                known = 1
            except Exception:  # the matrix cannot be formed on this rank
                known = 0
            self._growth = bool(self.comm.allreduce(known, op=mpi().MIN))
        return self._growth

    def _collective_error(self, same_tree: bool, problem: Problem | None) -> LinopError:
        reports = self.comm.allgather((self.fingerprint, problem, self.tree_fingerprint))
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
