"""The collective entry check shared by the distributed executors (MPI, torch.distributed).

- :mod:`.vector`: what each rank tells the others, as one int64 vector;
- :mod:`.state`: this rank's local state tested against the tree's domain blocks;
- :mod:`.policy`: the run's dtype decided from the reduced vector;
- :mod:`.kernels`: that dtype widened by what the tree's local kernels produce (probed on the
  ranks that run them, agreed in step);
- :mod:`.entry`: :class:`EntryCheck`, which runs the three through an engine's
  :class:`Agreement` and remembers what it can between calls;
- :mod:`.repeat`: what a passed call kept (:class:`~.repeat.Repeat`), so that a call passing
  the same arrays again runs the check's collective and nothing else of the check.
"""

from __future__ import annotations

from .entry import Agreement, EntryCheck
from .outcome import CheckOutcome
from .state import LocalStateCheck, Problem
from .vector import DTYPE_CHARS, VECTOR_LENGTH

__all__ = [
    "Agreement",
    "EntryCheck",
    "CheckOutcome",
    "LocalStateCheck",
    "Problem",
    "DTYPE_CHARS",
    "VECTOR_LENGTH",
]
