"""The dtype of a run, decided alike on every rank from the reduced check vector.

Dtypes follow the policy of :mod:`linop.dtypes` (``docs/theory.md#dtypes``), with the global
facts the ranks agree on: the dtypes present on any rank and the largest integer magnitude (a
maximum over ranks), so the numpy, sparse and distributed interpreters give the same result or
the same typed error. One exception: when some rank cannot form the tree's exact matrix (a tree
of local operators holding only that rank's data), the integer growth bound is unknown, and
integer blocks are widened to int64 without a bound instead (``growth_known``). The run dtype
then holds what the tree's local kernels produce (:mod:`.kernels`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ... import dtypes
from ...errors import DistributedOverflowError, DistributedStateError, IntegerOverflowError, LinopError
from ...operator import LinearOperator
from .outcome import CheckOutcome
from .vector import FLAGS, LARGEST, UNSETTLED, present_chars

__all__ = ["DtypePolicy"]


class DtypePolicy:
    """The run dtype of one tree for each set of dtypes present (remembered per set).

    Parameters
    ----------
    op : LinearOperator
        The tree.
    growth_known : callable
        Whether every rank can bound the tree's integer growth (collective the first time;
        asked only for integer runs).
    widened : callable, optional
        ``(answer, asked)`` for a candidate dtype and the reduced vector: the run dtype widened
        to hold what the tree's local kernels produce, or the error every rank raises, and
        whether kernels were probed for it (:meth:`.kernels.KernelDtypes.widened`; collective
        while some rank has not settled the candidate). None: the candidate itself.
    """

    def __init__(
        self,
        op: LinearOperator,
        growth_known: Callable[[], bool],
        widened: Callable[[np.dtype, np.ndarray], tuple[np.dtype | LinopError, bool]] | None = None,
    ) -> None:
        self.op = op
        self.growth_known = growth_known
        self.widened = widened
        self._dtypes: dict[bytes, tuple[np.dtype, bool, list[str]]] = {}

    def decide(self, reduced: np.ndarray, inplace: bool) -> CheckOutcome:
        """The outcome of a check every rank passed, from the reduced vector (the same on every
        rank): the run's dtype, the cast, or the dtype or overflow error every rank raises.

        The run's dtype is the common dtype of the blocks and scalars (:func:`dtypes.run_dtype`),
        with the integer cast of :func:`dtypes.cast_dtype` (decided from the blocks, as the
        numpy interpreter decides it), widened by the dtypes the local kernels produce
        (:attr:`widened`): every message of the run travels in it."""
        key = reduced[FLAGS:UNSETTLED].tobytes()
        known = self._dtypes.get(key)
        if known is None:
            chars = present_chars(reduced)
            known = self._dtypes[key] = (
                np.dtype(dtypes.run_dtype(self.op, [np.dtype(c) for c in chars])),
                any(np.dtype(c).kind in "iu" for c in chars),
                chars,
            )
        run, integers, chars = known
        cast = None
        overflow = None
        if integers:  # a widened integer run is cast back after it (dtypes.fit_back)
            found = [np.dtype(c) for c in chars]
            if self.growth_known():
                try:
                    cast = dtypes.cast_dtype(self.op, found, int(reduced[LARGEST]))
                except IntegerOverflowError as error:
                    overflow = DistributedOverflowError(str(error))
            elif any(d.kind in "iu" and d != np.int64 for d in found):
                cast = np.dtype(np.int64)  # no bound to test: the widest integers
            if cast is not None:
                run = np.result_type(run, cast)
        candidate = None
        held = known[0]  # what the callers' arrays must hold in place (an integer cast is fit back)
        if overflow is None and self.widened is not None:
            widened, asked = self.widened(run, reduced)
            if asked:
                candidate = run
            if isinstance(widened, LinopError):
                return CheckOutcome(None, widened, candidate=candidate)
            if widened != run:  # a kernel's results: not fit back
                held = widened
                if integers and run.kind in "iu" and widened.kind in "fc":
                    overflow = self._rounded(widened, int(reduced[LARGEST]))
            run = widened
        if inplace:
            narrow = [c for c in chars if not np.can_cast(held, c, "same_kind")]
            if narrow:
                return CheckOutcome(
                    None,
                    DistributedStateError(
                        f"in-place application of {self.op} computes in {run}, which the callers' "
                        f"{np.dtype(narrow[0])} arrays cannot hold"
                    ),
                    candidate=candidate,
                )
        if overflow is not None:
            return CheckOutcome(None, overflow, candidate=candidate)
        return CheckOutcome(run, None, cast, integers, candidate)

    def _rounded(self, run: np.dtype, largest: int) -> DistributedOverflowError | None:
        """The error of an integer run that local kernels widened to the inexact ``run``, when
        its integers may not be exact in ``run``'s messages: the largest input magnitude
        times the tree's growth bound (where every rank can form it; at least 1) reaches
        ``2**digits`` of ``run``. The numpy interpreter keeps such integers in their own
        dtype; here they travel as floats, so they are refused rather than rounded."""
        growth: int | float = 1
        if self.growth_known():
            try:
                growth = max(1, dtypes.growth(self.op)[0])
            except Exception:  # pragma: no cover - agreed known: every rank formed it
                growth = 1
        exact = 2 ** (np.finfo(run).nmant + 1)
        if largest * growth < exact:
            return None
        return DistributedOverflowError(
            f"the local kernels of {self.op} make its integer run {run}, whose messages hold "
            f"integers exactly below 2**{np.finfo(run).nmant + 1}, but its integers may reach "
            f"{float(largest * growth):.3g} (largest entry {largest}, row sum {growth}); cast the "
            f"state to {run} to accept rounding"
        )
