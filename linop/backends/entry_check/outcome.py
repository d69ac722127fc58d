"""What the ranks agreed at a call's entry check: :class:`CheckOutcome`."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...errors import LinopError

__all__ = ["CheckOutcome"]


@dataclass(frozen=True)
class CheckOutcome:
    """What the ranks agreed: the run's dtype and the cast of the blocks before the run
    (:func:`linop.dtypes.cast_dtype`; None: run them as they are), whether an integer dtype is
    present, or the error every rank raises. ``candidate``: the run dtype before the local
    kernels widened it, when kernels were probed for it (:mod:`.kernels`): the outcome may be
    reused only while every rank has settled that candidate."""

    dtype: np.dtype | None
    error: LinopError | None
    cast: np.dtype | None = None
    integers: bool = False
    candidate: np.dtype | None = None

    def result(self) -> np.dtype:
        """The run's dtype; raises the agreed error instead when there is one."""
        if self.error is not None:
            raise self.error
        assert self.dtype is not None
        return self.dtype
