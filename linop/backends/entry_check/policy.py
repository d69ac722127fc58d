"""The dtype of a run, decided alike on every rank from the reduced check vector.

Dtypes follow the policy of :mod:`linop.dtypes` (``docs/theory.md#dtypes``), with the global
facts the ranks agree on: the dtypes present on any rank and the largest integer magnitude (a
maximum over ranks), so the numpy, sparse and distributed interpreters give the same result or
the same typed error. One exception: when some rank cannot form the tree's exact matrix (a tree
of local operators holding only that rank's data), the integer growth bound is unknown, and
integer blocks are widened to int64 without a bound instead (``growth_known``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ... import dtypes
from ...errors import DistributedOverflowError, DistributedStateError, IntegerOverflowError
from ...operator import LinearOperator
from .outcome import CheckOutcome
from .vector import FLAGS, LARGEST, VECTOR_LENGTH, present_chars

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
    """

    def __init__(self, op: LinearOperator, growth_known: Callable[[], bool]) -> None:
        self.op = op
        self.growth_known = growth_known
        self._dtypes: dict[bytes, tuple[np.dtype, bool, list[str]]] = {}

    def decide(self, reduced: np.ndarray, inplace: bool) -> CheckOutcome:
        """The outcome of a check every rank passed, from the reduced vector (the same on every
        rank): the run's dtype, the cast, or the dtype or overflow error every rank raises."""
        key = reduced[FLAGS:VECTOR_LENGTH].tobytes()
        known = self._dtypes.get(key)
        if known is None:
            chars = present_chars(reduced)
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
            found = [np.dtype(c) for c in present_chars(reduced)]
            if self.growth_known():
                try:
                    cast = dtypes.cast_dtype(self.op, found, int(reduced[LARGEST]))
                except IntegerOverflowError as error:
                    return CheckOutcome(None, DistributedOverflowError(str(error)))
            elif any(d.kind in "iu" and d != np.int64 for d in found):
                cast = np.dtype(np.int64)  # no bound to test: the widest integers
            if cast is not None:
                run = np.result_type(run, cast)
        return CheckOutcome(run, None, cast, integers)
