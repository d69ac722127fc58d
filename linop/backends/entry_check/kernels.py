"""The dtypes the tree's local kernels produce, agreed by the ranks: the run dtype holds them.

A distributed run moves every message in its run dtype (``docs/theory.md#dtypes``), so that
dtype must hold every value an array of the run may take, the results of local kernels
included: averaging integers gives floats, a complex kernel makes real blocks complex. The run
dtype is therefore the smallest fixed point above the candidate :math:`c_0` (the common dtype
of the blocks and the tree's scalars, widened by an integer cast)

.. math::

    c_{k+1} = \\operatorname{result\\_type}\\bigl(c_k, \\{\\operatorname{out}_K(c_k)\\}_K\\bigr),

where :math:`\\operatorname{out}_K(d)` is the dtype local operator :math:`K` produces from
inputs of dtype :math:`d` (:meth:`~linop.local.LocalOperator.produced_dtype`). The sequence only
widens and the numeric dtypes form a small lattice, so it ends within a few steps.

A dense or sparse matrix kernel's output dtype follows from its coefficients, on every rank
alike: no collective. A callable (or scipy operator) kernel may hold one rank's data only, so
only the rank that runs its worker probes it (once per node and dtype, on zeros); the ranks
exchange what they found in one ``allgather`` per step, so every rank decides the same dtype,
or raises the same :class:`~linop.errors.DistributedDtypeError` when a probe fails somewhere.

Each plan remembers its answers per candidate, and says in the check vector which candidates
it has not settled (:data:`.vector.UNSETTLED`). After the reduction every rank reads whether
*any* rank lacks the answer for this call's candidate: then all probe and gather together,
else each uses its own answer. A plan one rank evicted and rebuilt thus never enters a gather
alone, and the cost is paid once per plan and candidate dtype: a float64 run of float kernels
gathers on its first call only; a tree without probed kernels never does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from ...errors import DistributedDtypeError, LinopError
from ...local import LocalOperator
from ...operator import LinearOperator, walk
from .vector import DTYPE_CHARS, UNSETTLED_OF

if TYPE_CHECKING:
    from .entry import Agreement

__all__ = ["KernelDtypes"]

Answer = np.dtype | LinopError


class KernelDtypes:
    """The run dtype widened by the dtypes the tree's local kernels produce (see the module).

    Parameters
    ----------
    op : LinearOperator
        The tree.
    agreement : Agreement
        The engine's collectives (``allgather``, ``rank``).
    rank_of : callable
        The rank that runs a worker.
    """

    def __init__(self, op: LinearOperator, agreement: Agreement, rank_of: Callable[[int], int]) -> None:
        self.agreement = agreement
        nodes = [n for n in walk(op) if isinstance(n, LocalOperator)]
        self.coefficients = tuple(
            {n.kernel.dtype for n in nodes if n.coefficients_known and n.kernel.dtype is not None}
        )
        """The coefficient dtypes of the matrix kernels (their outputs' dtypes follow on every rank)."""
        probed = [n for n in nodes if not n.coefficients_known]
        self.probing = bool(probed)
        """Whether some kernel must be probed (then every step of a fixed point gathers)."""
        self.mine = tuple(n for n in probed if rank_of(n.worker) == agreement.rank)
        """The kernels to probe that this rank runs."""
        self.answers: dict[str, Answer] = {}
        """Per candidate (``dtype.str``), the run dtype or the agreed error."""
        self.version = 0
        """Counts the changes of :meth:`unsettled` (the check rewrites its vector on a change)."""

    def unsettled(self) -> list[int]:
        """The positions of the check vector's :data:`.vector.UNSETTLED` flags to set: the
        candidates this plan has not agreed (none when no kernel is probed)."""
        if not self.probing:
            return []
        return [UNSETTLED_OF[c] for c in DTYPE_CHARS if np.dtype(c).str not in self.answers]

    def settled(self, outcome: object, reduced: np.ndarray) -> bool:
        """Whether a remembered ``outcome`` may be reused with ``reduced``: it asked no
        probed candidate, or every rank has settled its candidate."""
        candidate = getattr(outcome, "candidate", None)
        return candidate is None or not reduced[UNSETTLED_OF[candidate.char]]

    def widened(self, candidate: np.dtype, reduced: np.ndarray) -> tuple[Answer, bool]:
        """``(answer, asked)``: the run dtype for ``candidate`` (the fixed point above it) or
        the error every rank raises; ``asked`` when probed kernels took part (the outcome then
        records its candidate). Collective (one ``allgather`` per step) when some rank has not
        settled ``candidate``, which ``reduced`` says alike on every rank."""
        if not self.probing:
            if not self.coefficients:
                return candidate, False
            return self._fixed_point(candidate, reduced), False
        if candidate.char not in UNSETTLED_OF:  # pragma: no cover - candidates are movable dtypes
            return DistributedDtypeError(f"no run in {candidate} can be moved"), True
        if reduced[UNSETTLED_OF[candidate.char]]:
            return self._fixed_point(candidate, reduced), True
        return self.answers[candidate.str], True

    def _fixed_point(self, candidate: np.dtype, reduced: np.ndarray) -> Answer:
        run = candidate
        chain = [candidate]
        answer: Answer | None = None
        for _ in range(len(DTYPE_CHARS) + 1):  # each step widens strictly: the lattice bounds the steps
            widened = np.result_type(run, *self.coefficients)  # K @ u, as produced_dtype says
            if self.probing:
                probed = self._probe(run)
                if isinstance(probed, LinopError):
                    answer = probed
                    break
                widened = np.result_type(widened, *probed)
            if widened == run:
                answer = run
                break
            if widened.char not in UNSETTLED_OF:
                answer = DistributedDtypeError(
                    f"the local kernels of the tree widen the run's dtype {candidate} to {widened}, "
                    "which the distributed executors cannot move (docs/theory.md#dtypes)"
                )
                break
            if self.probing and not reduced[UNSETTLED_OF[widened.char]]:  # every rank knows from there
                answer = self.answers[widened.str]
                break
            run = widened
            chain.append(run)
        if answer is None:  # pragma: no cover - the lattice is finite
            raise AssertionError(f"the kernels' dtypes did not settle from {candidate}")
        if self.probing:
            for step in chain:
                self.answers[step.str] = answer
            self.version += 1
        return answer

    def _probe(self, dtype: np.dtype) -> list[np.dtype] | LinopError:
        """Every rank's kernels probed at ``dtype`` (one ``allgather``): their output dtypes,
        or the error of the first rank whose probe failed."""
        found: set[str] = set()
        problem = None
        for node in self.mine:
            try:
                found.add(node.produced_dtype(dtype).str)
            except Exception as error:  # the kernel's own error, or evaluate's checks
                problem = (
                    f"rank {self.agreement.rank}: local operator {node} failed when run on zeros of "
                    f"dtype {dtype}, to learn the dtype it produces (docs/theory.md#dtypes): "
                    f"{type(error).__name__}: {error}"
                )
                break
        reports = self.agreement.allgather((sorted(found), problem))
        problems = [p for _, p in reports if p is not None]
        if problems:
            more = f" (and {len(problems) - 1} more rank(s) at fault)" if len(problems) > 1 else ""
            return DistributedDtypeError(problems[0] + more)
        return [np.dtype(s) for found, _ in reports for s in found]
