"""The typed errors of linop: one hierarchy under :class:`LinopError`.

Every message names the block, shape, index, dimension or rank at fault, so that a user
learns *what* is wrong without reading a numpy traceback. Each class also derives from the
builtin exception a caller would expect (``ValueError``, ``TypeError``, ``IndexError``,
``LookupError``), so ``except ValueError`` keeps working.

The errors of the MPI interpreter (:class:`MPIError` and below) are raised on *every* rank with
the same message, after a collective agreement, so that a mistake on one rank ends the whole
job cleanly instead of hanging it. This module imports no MPI: every error can be caught
without mpi4py installed.
"""

from __future__ import annotations

__all__ = [
    "CommunicatorArgumentError",
    "DistributedDtypeError",
    "DistributedOverflowError",
    "ArrayLibraryError",
    "LinopError",
    "BlockError",
    "OperandError",
    "SpaceMismatchError",
    "RegionError",
    "ShapeMismatchError",
    "OverlapError",
    "BlockExistsError",
    "UnknownBlockError",
    "StateError",
    "DtypeError",
    "IntegerOverflowError",
    "ScalarError",
    "WorkerError",
    "RankError",
    "UnsupportedNodeError",
    "PartitionError",
    "DecompositionError",
    "BroadcastError",
    "GlobalShapeError",
    "PlacementError",
    "HaloError",
    "KernelError",
    "MPIError",
    "TreeMismatchError",
    "CommunicatorError",
    "WorkerMapError",
    "WorkerMapMismatchError",
    "PeerMismatchError",
    "PeerTimeoutError",
    "RankFailedError",
    "TimeoutArgumentError",
    "DistributedStateError",
    "AccountingError",
    "PlotError",
    "LayerError",
    "LocalOperatorError",
    "KernelOutputError",
    "NoMatrixError",
    "NotLinearError",
    "KernelWriteError",
    "AlgorithmError",
    "CalibrationError",
    "ProcessGroupError",
    "ProcessGroupArgumentError",
    "MeshError",
    "DeviceKernelError",
]


class LinopError(Exception):
    """Base class of every error that linop raises on purpose."""


class BlockError(LinopError, TypeError, ValueError):
    """A block is malformed: an empty or non-string name, a shape or worker that is not a
    non-negative integer (bool is not taken as an integer), or more entries than int64 counts."""


class OperandError(LinopError, TypeError, ValueError):
    """Something other than an operator (or a space, a partition) was given where one is needed:
    a factor of a composition, an operand of ``@`` or ``+``, the argument of a verification."""


class SpaceMismatchError(LinopError, ValueError):
    """Two spaces that must agree (composition, sum, state) differ."""


class RegionError(LinopError, IndexError):
    """A region is out of bounds, has a step other than 1, or is not a basic box."""


class ShapeMismatchError(LinopError, ValueError):
    """Regions that must have the same shape (add, copy, move) do not."""


class OverlapError(LinopError, ValueError):
    """Regions that must be disjoint (add, copy, move) overlap."""


class BlockExistsError(LinopError, ValueError):
    """A block is allocated under a name that the space already holds."""


class UnknownBlockError(LinopError, LookupError):
    """A block name that the space does not hold."""

    def __str__(self) -> str:  # LookupError would quote the message like a key
        return str(self.args[0]) if self.args else ""


class StateError(LinopError, ValueError):
    """A state does not match its space: missing, extra or wrongly shaped blocks."""


class DtypeError(StateError, TypeError):
    """A block's dtype, or a requested dtype, is not one the interpreters compute in
    (``docs/theory.md#dtypes``): bool, strings, dates, structured and unknown dtypes."""


class IntegerOverflowError(LinopError, OverflowError):
    """An integer result may not fit in int64 (or an in-place result in the caller's integer
    dtype); the message names the block and the bound (``docs/theory.md#dtypes``)."""


class ScalarError(LinopError, TypeError):
    """An operator was multiplied by something that is not a scalar."""


class WorkerError(LinopError, ValueError):
    """An operator's blocks live on the wrong workers (ranks) for what it does."""


class RankError(LinopError, TypeError, ValueError):
    """A rank asked of a program that is not a non-negative integer, or not below the number of
    ranks given (``compile_for_rank(op, -1)``)."""


class PartitionError(LinopError, ValueError):
    """A partition of workers is malformed or does not fit the tensor or partition it meets."""


class DecompositionError(LinopError, ValueError):
    """Per-worker sizes of a tensor decomposition do not fit its global shape."""


class UnsupportedNodeError(LinopError, TypeError):
    """An interpreter has no handler for a node type, and the node does not expand."""


class BroadcastError(PartitionError):
    """Two partition shapes do not broadcast from source to destination."""


class GlobalShapeError(DecompositionError):
    """Two tensors (or a tensor and a block) that must have the same global shape do not."""


class PlacementError(DecompositionError):
    """A device mesh, its placements (``Shard``, ``Replicate``, ``Partial``) and a global shape
    do not fit together; the message names the mesh dimension or the tensor dimension."""


class HaloError(LinopError, ValueError):
    """A halo exchange cannot be built for this tensor (e.g. wrapping an empty dimension)."""


class KernelError(HaloError):
    """Sliding-window kernel parameters are invalid for a tensor; the message names the dimension."""


class MPIError(LinopError):
    """Base class of the errors that the MPI interpreter raises on every rank."""


class TreeMismatchError(MPIError, ValueError):
    """The ranks of a communicator hold different operator trees (their fingerprints differ)."""


class CommunicatorError(MPIError, ValueError):
    """The communicator does not cover the tree's workers (too few ranks)."""


class WorkerMapError(CommunicatorError):
    """A worker-to-rank map is invalid for the tree or the communicator (a worker of the tree
    unmapped, a rank out of range, a malformed entry); the message names the worker."""


class WorkerMapMismatchError(TreeMismatchError):
    """The ranks hold the same tree but different worker-to-rank maps."""


class PeerTimeoutError(MPIError, TimeoutError):
    """Some ranks did not arrive at a collective of a distributed executor (the entry check, a
    bound plan's first start; MPI or a ``torch.distributed`` process group) within the deadline
    (``timeout=`` or ``LINOP_TIMEOUT``); raised on every rank that did, naming those that did
    not. Under MPI the job is then aborted; a process group is unusable afterwards (a collective
    is left unfinished): end the job."""


class PeerMismatchError(PeerTimeoutError):
    """A peer waits at the same call of the same tree on the group or communicator as this
    rank, but on the other path: its bound plan (no entry check: its inputs unchanged) where
    this rank's inputs changed and go through the entry check, or the reverse. Neither would
    ever complete; the stall diagnosis (:mod:`linop.backends.torch_distributed.stall`,
    :mod:`linop.backends.mpi.stall`) finds it seconds after the call started, instead of the
    deadline, and the message names the peer and both sides' dtypes and shapes. The group is
    unusable afterwards (under MPI the job is aborted): end the job."""


class TimeoutArgumentError(LinopError, TypeError, ValueError):
    """A deadline (``timeout=`` or the ``LINOP_TIMEOUT`` environment variable) that is not a
    positive number of seconds."""


class DistributedStateError(MPIError, StateError):
    """Some rank's local blocks are missing, extra, wrongly shaped or not numeric."""


class AccountingError(LinopError, ValueError):
    """Bad input to the accounting (an item size or model parameter out of range)."""


class PlotError(LinopError, ValueError):
    """A picture that cannot be drawn (nothing to show, or a matrix too large to materialize)."""


class LayerError(LinopError, ValueError):
    """A layer's arguments do not fit together (channels, partitions, weights); the message
    names the argument, its value and what was expected."""


class LocalOperatorError(LinopError, ValueError):
    """A local operator is built wrongly (blocks, matrix shape, kernel kind)."""


class KernelOutputError(LocalOperatorError):
    """A kernel returned arrays of the wrong number, shape or dtype; names the node and block."""


class NoMatrixError(LocalOperatorError, TypeError):
    """A kernel given only as callables has no matrix for the symbolic (object-array) interpreter."""


class NotLinearError(LocalOperatorError):
    """A kernel given as callables is not linear, or does not act as it claims (a false
    ``vectorized=True``): on some probe state its output differs from its probed matrix's
    (docs/theory.md#local-operators); names the node, the state and the entry."""


class KernelWriteError(LocalOperatorError):
    """A kernel tried to write into an array it was given (its arguments are read-only views:
    operators never change the caller's arrays); names the node, the direction and the block."""


class AlgorithmError(LinopError, ValueError):
    """A collective algorithm cannot be built for the given layout (names the block, the
    partition or the dimension at fault)."""


class CalibrationError(AlgorithmError):
    """The model cannot be fitted (fewer than two ranks, or unusable measurements)."""


class ArrayLibraryError(LinopError, TypeError):
    """A state mixes array libraries or devices, or holds an array the interpreters cannot
    read (a dtype numpy has no equivalent for, such as bfloat16)."""


class CommunicatorArgumentError(CommunicatorError, TypeError):
    """The ``comm`` argument is not an mpi4py communicator."""


class DistributedDtypeError(DistributedStateError, DtypeError):
    """A rank's block or requested dtype is not one linop computes in (raised on every rank;
    also a :class:`~linop.errors.DtypeError`, as the numpy interpreter raises)."""


class DistributedOverflowError(MPIError, IntegerOverflowError):
    """An integer result may not fit (raised on every rank; also an
    :class:`~linop.errors.IntegerOverflowError`, as the numpy interpreter raises)."""


class ProcessGroupError(CommunicatorError):
    """A ``torch.distributed`` process group cannot run the tree: torch.distributed is not
    initialized, this process is not a member of the group, or the group has too few ranks for
    the tree's workers (raised on every rank alike where the ranks can agree)."""


class RankFailedError(MPIError, RuntimeError):
    """A rank of a ``torch.distributed`` process group failed during a call, after the entry
    check had committed every rank to the schedule (its own error, or a peer's connection
    lost or timed out). The rank that failed raises it and shuts the group down on itself;
    every peer waiting on it raises it too once the failing rank's process ends (an uncaught
    error ends it: under gloo a living process cannot close its connections), instead of
    waiting for the group's timeout; the group
    is unusable afterwards on every rank: end the job (the original error is chained)."""


class ProcessGroupArgumentError(ProcessGroupError, TypeError):
    """The ``group`` argument is not a ``torch.distributed`` process group (or ``True``/None for
    the world group), or both ``comm=`` (MPI) and ``group=`` (torch.distributed) were given."""


class MeshError(PartitionError):
    """A JAX device mesh does not fit a partition or a compiled plan (names the mesh axis or
    the partition dimension at fault)."""


class DeviceKernelError(UnsupportedNodeError):
    """A node cannot run inside ``jit`` on JAX devices (a LocalOperator's numpy kernel)."""
