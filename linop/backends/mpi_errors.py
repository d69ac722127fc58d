"""Typed errors of the MPI interpreter.

Every one of them is raised on *every* rank with the same message, after a collective
agreement, so that a mistake on one rank ends the whole job cleanly instead of hanging it.
This module imports no MPI: the errors can be caught without mpi4py installed.
"""

from __future__ import annotations

from .. import errors
from ..errors import LinopError, StateError

__all__ = [
    "MPIError",
    "TreeMismatchError",
    "CommunicatorError",
    "DistributedStateError",
    "UnsupportedNodeError",
]


class MPIError(LinopError):
    """Base class of the errors that the MPI interpreter raises on every rank."""


class TreeMismatchError(MPIError, ValueError):
    """The ranks of a communicator hold different operator trees (their fingerprints differ)."""


class CommunicatorError(MPIError, ValueError):
    """The communicator does not cover the tree's workers (too few ranks)."""


class DistributedStateError(MPIError, StateError):
    """Some rank's local blocks are missing, extra, wrongly shaped or not numeric."""


class UnsupportedNodeError(MPIError, errors.UnsupportedNodeError):
    """A node has no MPI handler and does not expand into simpler nodes (raised on every rank
    together; also a :class:`linop.UnsupportedNodeError`)."""
