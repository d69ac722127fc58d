"""The check vector: what one rank tells the others before a call, as int64 entries.

One reduction (maximum over ranks) of this vector decides a call on every rank alike:

======================  ==========================================================================
entries                 meaning
======================  ==========================================================================
``0 .. 3``              the tree's 128-bit fingerprint, as four 32-bit words
``4 .. 7``              their negations (maximum and minimum agree only when every rank holds the
                        same tree)
:data:`ERROR`           1 when this rank found something wrong (its state, a compile problem)
:data:`LARGEST`         the largest integer magnitude of this rank's blocks (integer runs only)
:data:`FLAGS` ``+ i``   1 when the dtype ``DTYPE_CHARS[i]`` is present (a block, ``dtype=``)
:data:`UNSETTLED`       1 when this rank's plan has not yet agreed what the tree's probed local
``+ i``                 kernels make of a run in ``DTYPE_CHARS[i]`` (:mod:`.kernels`: then every
                        rank probes and gathers, in step, when that is the run's candidate dtype)
======================  ==========================================================================
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

__all__ = [
    "DTYPE_CHARS",
    "VECTOR_LENGTH",
    "ERROR",
    "LARGEST",
    "FLAGS",
    "FLAG_OF",
    "UNSETTLED",
    "UNSETTLED_OF",
    "INTEGER_CHARS",
    "INT64_MAX",
    "tree_vector",
    "encode",
    "present_chars",
]

DTYPE_CHARS = "bBhHiIlLqQefdgFDG"
"""The numeric dtypes (numpy type characters) that the executors move: the kinds of
:data:`linop.dtypes.NUMERIC_KINDS`."""

ERROR, LARGEST, FLAGS = 8, 9, 10
"""Positions of the error flag, the largest integer magnitude and the first dtype flag."""

FLAG_OF = {c: FLAGS + i for i, c in enumerate(DTYPE_CHARS)}
"""The position of each dtype's flag."""

UNSETTLED = FLAGS + len(DTYPE_CHARS)
"""Position of the first flag of a candidate run dtype whose kernel dtypes this rank has not agreed."""

UNSETTLED_OF = {c: UNSETTLED + i for i, c in enumerate(DTYPE_CHARS)}
"""The position of each candidate dtype's unsettled flag."""

INTEGER_CHARS = frozenset(c for c in DTYPE_CHARS if np.dtype(c).kind in "iu")
INT64_MAX = 2**63 - 1

VECTOR_LENGTH = UNSETTLED + len(DTYPE_CHARS)
"""Length of the check vector (int64 entries): the same on every rank and for every tree."""


def tree_vector(fingerprint: bytes) -> np.ndarray:
    """The vector of a tree's 16-byte ``fingerprint`` with nothing else set."""
    words = np.frombuffer(fingerprint, dtype=np.uint32).astype(np.int64)
    return np.concatenate([words, -words, np.zeros(VECTOR_LENGTH - 8, dtype=np.int64)])


def encode(out: np.ndarray, tree: np.ndarray, flags: Iterable[int], largest: int, error: bool) -> None:
    """Write into ``out`` the vector of ``tree`` (:func:`tree_vector`, with its unsettled flags
    set) with the dtype ``flags`` (positions, :data:`FLAG_OF`), the ``largest`` integer
    magnitude and the error flag."""
    np.copyto(out, tree)
    out[list(flags)] = 1
    out[LARGEST] = largest
    out[ERROR] = error


def present_chars(reduced: np.ndarray) -> list[str]:
    """The dtype characters some rank flagged in a reduced vector."""
    return [c for c, flag in zip(DTYPE_CHARS, reduced[FLAGS:UNSETTLED]) if flag]
