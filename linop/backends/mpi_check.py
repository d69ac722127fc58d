"""The collective entry check of the MPI interpreter: validate everything before data moves.

One ``Allreduce`` (maximum) of a short integer vector decides, on every rank alike, whether a
call may run and in which dtype: the tree's 128-bit fingerprint and its negation (maximum and
minimum agree only when every rank holds the same tree), an error flag, and one flag per dtype
present on any rank (blocks, the requested dtype). Only when something is wrong, a second
collective gathers the ranks' messages, so that every rank raises the same typed error
(:class:`~linop.errors.MPIError` subclasses). Local problems are the same as the numpy
interpreter's: missing, extra, wrongly shaped or non-numeric blocks, and in place a read-only
array or one array passed for two blocks.

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

from .. import dtypes
from ..errors import (
    DistributedDtypeError,
    DistributedOverflowError,
    DistributedStateError,
    DtypeError,
    IntegerOverflowError,
    LinopError,
    TreeMismatchError,
)
from ..operator import LinearOperator
from ..space import Block
from .mpi_datatypes import mpi
from .numpy_backend import first_shared_memory

if TYPE_CHECKING:  # pragma: no cover - mpi4py is optional at run time
    from mpi4py.MPI import Intracomm

__all__ = [
    "DTYPE_CHARS",
    "DistributedDtypeError",
    "DistributedOverflowError",
    "CheckOutcome",
    "EntryCheck",
]

DTYPE_CHARS = "bBhHiIlLqQefdgFDG"
"""The numeric dtypes (numpy type characters) that the interpreter moves: the kinds of
:data:`linop.dtypes.NUMERIC_KINDS`."""

_ERROR, _LARGEST, _FLAGS = 8, 9, 10  # vector: fingerprint words (0-3), their negations (4-7), ...
_INT64_MAX = 2**63 - 1


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
        Its 16-byte fingerprint (:func:`linop.backends.mpi_schedule.fingerprint`).
    comm : mpi4py communicator
        The private communicator the check runs on.
    domain_blocks : dict of str to Block
        The blocks of ``op.domain`` that this rank owns.
    problem : LinopError, optional
        A compile-time problem (raised by the check on every rank, after the tree test).
    """

    def __init__(
        self,
        op: LinearOperator,
        fingerprint: bytes,
        comm: Intracomm,
        domain_blocks: dict[str, Block],
        problem: LinopError | None,
    ) -> None:
        self.op = op
        self.fingerprint = fingerprint
        self.comm = comm
        self.rank = comm.Get_rank()
        self.domain_blocks = domain_blocks
        self.problem = problem
        words = np.frombuffer(fingerprint, dtype=np.uint32).astype(np.int64)
        self._vector = np.concatenate([words, -words, np.zeros(2 + len(DTYPE_CHARS), dtype=np.int64)])
        self._reduced = np.empty_like(self._vector)
        self._dtypes: dict[bytes, tuple[np.dtype, bool, list[str]]] = {}
        self._growth: bool | None = None

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
                return (
                    f"rank {rank}: local state is missing block {name!r} {block.shape}",
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

    def run(self, state: Any, *, inplace: bool = False, dtype: npt.DTypeLike | None = None) -> CheckOutcome:
        """Check collectively; every rank gets the same outcome. Raises nothing itself (the
        caller raises the outcome's error, outside its abort-on-failure section)."""
        problem: Problem | None = None
        if self.problem is not None:
            problem = (str(self.problem), type(self.problem))
        else:
            problem = self.local_problem(state, inplace)
        vector = self._vector.copy()  # fingerprint words and their negation, then flags
        present = vector[_FLAGS:]
        if problem is None:
            arrays = [state[name] for name in self.domain_blocks]
            for array in arrays:
                present[DTYPE_CHARS.index(array.dtype.char)] = 1
            if any(array.dtype.kind in "iu" for array in arrays):
                vector[_LARGEST] = min(dtypes.largest_magnitude(arrays), _INT64_MAX)
        if dtype is not None:
            try:
                char = dtypes.check_requested(dtype).char
            except DtypeError as error:
                if problem is None:
                    problem = f"rank {self.rank}: {error}", DistributedDtypeError
            else:
                present[DTYPE_CHARS.index(char)] = 1
        vector[_ERROR] = problem is not None
        reduced = self._reduced
        self.comm.Allreduce(vector, reduced, op=mpi().MAX)
        same_tree = bool(np.array_equal(reduced[:4], -reduced[4:8]))
        if not same_tree or reduced[_ERROR]:
            return CheckOutcome(None, self._collective_error(same_tree, problem))
        flags = reduced[_FLAGS:]
        key = flags.tobytes()
        known = self._dtypes.get(key)
        if known is None:  # decided from global facts only, so every rank decides alike
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
        reports = self.comm.allgather((self.fingerprint, problem))
        if not same_tree:
            reference = reports[0][0]
            others = [r for r, (fp, _) in enumerate(reports) if fp != reference]
            return TreeMismatchError(
                f"the ranks hold different operator trees: rank(s) {others} differ from rank 0 "
                "(every rank must build the same tree)"
            )
        faults = [p for _, p in reports if p is not None]
        message, kind = faults[0]
        if self.problem is not None:
            return kind(message)
        more = f" (and {len(faults) - 1} more rank(s) at fault)" if len(faults) > 1 else ""
        return kind(message + more)
