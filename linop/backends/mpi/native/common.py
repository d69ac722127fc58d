"""What several MPI fast paths share: the dtypes MPI sums natively and a block made
contiguous in place."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # pragma: no cover - mpi4py is optional at run time
    from ...numpy import Workspace

__all__ = ["REDUCIBLE", "contiguous_owned"]

REDUCIBLE = "bBhHiIlLqQfdFD"
"""Dtypes (numpy type characters) that the native sums use; others run the expansion."""


def contiguous_owned(work: Workspace, name: str, dtype: np.dtype) -> np.ndarray:
    """The workspace's block ``name``, writable, C-contiguous and of ``dtype`` (replaced by
    such a copy when it is not)."""
    array = work.writable(name, dtype)
    if not array.flags.c_contiguous or array.dtype != dtype:
        array = np.ascontiguousarray(array, dtype=dtype)
        work.set(name, array)
    return array
