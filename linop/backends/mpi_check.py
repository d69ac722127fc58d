"""The collective entry check of the MPI interpreter: validate everything before data moves.

One ``Allreduce`` (maximum) of a short integer vector decides, on every rank alike, whether a
call may run and in which dtype: the tree's 128-bit fingerprint and its negation (maximum and
minimum agree only when every rank holds the same tree), an error flag, and one flag per dtype
present on any rank (blocks, the requested dtype). Only when something is wrong, a second
collective gathers the ranks' messages, so that every rank raises the same typed error
(:class:`~linop.errors.MPIError` subclasses). Local problems are the same as the numpy
interpreter's: missing, extra, wrongly shaped or non-numeric blocks, and in place a read-only
array or one array passed for two blocks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from ..errors import DistributedStateError, LinopError, TreeMismatchError
from ..operator import LinearOperator
from ..space import Block
from .mpi_datatypes import mpi
from .numpy_backend import first_shared_memory

if TYPE_CHECKING:  # pragma: no cover - mpi4py is optional at run time
    from mpi4py.MPI import Intracomm

__all__ = ["DTYPE_CHARS", "CheckOutcome", "EntryCheck"]

DTYPE_CHARS = "bBhHiIlLqQefdgFDG"
"""The numeric dtypes (numpy type characters) that the interpreter moves."""

_HEAD = 9  # fingerprint words (4), their negations (4), the error flag


@dataclass(frozen=True)
class CheckOutcome:
    """What the ranks agreed: the run's dtype, or the error every rank raises."""

    dtype: np.dtype | None
    error: LinopError | None

    def result(self) -> np.dtype:
        """The run's dtype; raises the agreed error instead when there is one."""
        if self.error is not None:
            raise self.error
        assert self.dtype is not None
        return self.dtype


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
    alphas : tuple
        The tree's scalars (they take part in the run's dtype).
    problem : LinopError, optional
        A compile-time problem (raised by the check on every rank, after the tree test).
    """

    def __init__(
        self,
        op: LinearOperator,
        fingerprint: bytes,
        comm: Intracomm,
        domain_blocks: dict[str, Block],
        alphas: tuple[Any, ...],
        problem: LinopError | None,
    ) -> None:
        self.op = op
        self.fingerprint = fingerprint
        self.comm = comm
        self.rank = comm.Get_rank()
        self.domain_blocks = domain_blocks
        self.alphas = alphas
        self.problem = problem
        words = np.frombuffer(fingerprint, dtype=np.uint32).astype(np.int64)
        self._vector = np.concatenate([words, -words, np.zeros(1 + len(DTYPE_CHARS), dtype=np.int64)])
        self._reduced = np.empty_like(self._vector)
        self._dtypes: dict[bytes, np.dtype] = {}

    def local_problem(self, state: Any, inplace: bool) -> str | None:
        """What is wrong with this rank's local state (None when nothing is)."""
        rank = self.rank
        if not isinstance(state, Mapping):
            return f"rank {rank}: the local state must be a dict of arrays, not {type(state).__name__}"
        for name, block in self.domain_blocks.items():
            if name not in state:
                return f"rank {rank}: local state is missing block {name!r} {block.shape}"
        for name in state:
            if name not in self.domain_blocks:
                if name in self.op.domain:
                    owner = self.op.domain.block(name).worker
                    return f"rank {rank}: local state holds block {name!r}, which belongs to worker {owner}"
                return f"rank {rank}: local state holds block {name!r}, which the domain does not hold"
        for name, block in self.domain_blocks.items():
            array = state[name]
            if not isinstance(array, np.ndarray):
                return f"rank {rank}: block {name!r} is a {type(array).__name__}, not a numpy array"
            if array.shape != block.shape:
                return (
                    f"rank {rank}: block {name!r} has shape {array.shape}, the domain expects {block.shape}"
                )
            if array.dtype.char not in DTYPE_CHARS:
                return f"rank {rank}: block {name!r} has dtype {array.dtype}, which is not numeric"
            if inplace and not array.flags.writeable:
                return f"rank {rank}: in-place application needs a writeable array for block {name!r}"
        if inplace:
            if self.op.domain != self.op.range:
                return f"in-place application of {self.op}: domain and range differ"
            shared = first_shared_memory({name: state[name] for name in self.domain_blocks})
            if shared is not None:
                return (
                    f"rank {rank}: in-place application needs separate memory per block; blocks "
                    f"{shared[0]!r} and {shared[1]!r} share entries"
                )
        return None

    def run(self, state: Any, *, inplace: bool = False, dtype: npt.DTypeLike | None = None) -> CheckOutcome:
        """Check collectively; every rank gets the same outcome. Raises nothing itself (the
        caller raises the outcome's error, outside its abort-on-failure section)."""
        problem = str(self.problem) if self.problem is not None else None
        if problem is None:
            problem = self.local_problem(state, inplace)
        vector = self._vector.copy()  # fingerprint words and their negation, then flags
        present = vector[_HEAD:]
        if problem is None:
            for name in self.domain_blocks:
                present[DTYPE_CHARS.index(state[name].dtype.char)] = 1
        if dtype is not None:
            try:
                char = np.dtype(dtype).char
            except Exception:  # numpy raises TypeError, ValueError, ... for what is no dtype
                char = None
            if char is not None and char in DTYPE_CHARS:
                present[DTYPE_CHARS.index(char)] = 1
            elif problem is None:
                problem = f"rank {self.rank}: dtype {dtype!r} is not a numeric dtype"
        vector[_HEAD - 1] = problem is not None
        reduced = self._reduced
        self.comm.Allreduce(vector, reduced, op=mpi().MAX)
        same_tree = bool(np.array_equal(reduced[:4], -reduced[4:8]))
        if not same_tree or reduced[_HEAD - 1]:
            return CheckOutcome(None, self._collective_error(same_tree, problem))
        flags = reduced[_HEAD:]
        key = flags.tobytes()
        run = self._dtypes.get(key)
        if run is None:
            chars = [c for c, flag in zip(DTYPE_CHARS, flags) if flag]
            run = np.result_type(*chars) if chars else np.dtype(np.float64)
            for alpha in self.alphas:
                run = np.result_type(run, alpha)
            run = self._dtypes[key] = np.dtype(run)
        if inplace:  # decided from global facts only, so every rank decides alike
            narrow = [
                c for c, flag in zip(DTYPE_CHARS, flags) if flag and not np.can_cast(run, c, "same_kind")
            ]
            if narrow:
                return CheckOutcome(
                    None,
                    DistributedStateError(
                        f"in-place application of {self.op} computes in {run}, which the callers' "
                        f"{np.dtype(narrow[0])} arrays cannot hold"
                    ),
                )
        return CheckOutcome(run, None)

    def _collective_error(self, same_tree: bool, problem: str | None) -> LinopError:
        reports = self.comm.allgather((self.fingerprint, problem))
        if not same_tree:
            reference = reports[0][0]
            others = [r for r, (fp, _) in enumerate(reports) if fp != reference]
            return TreeMismatchError(
                f"the ranks hold different operator trees: rank(s) {others} differ from rank 0 "
                "(every rank must build the same tree)"
            )
        messages = [(r, p) for r, (_, p) in enumerate(reports) if p is not None]
        first = messages[0][1]
        assert first is not None
        if self.problem is not None:
            return type(self.problem)(first)
        more = f" (and {len(messages) - 1} more rank(s) at fault)" if len(messages) > 1 else ""
        return DistributedStateError(first + more)
