"""linop: distributed data movement as linear operators, with adjoints proven exactly.

Every data-movement step (allocate, clear, add, copy, move, send-receive, collectives, halo
exchange) is a :class:`LinearOperator` on a :class:`Space` of named blocks. Operators compose
into trees whose adjoints (``op.H``) are derived by rules; interpreters apply a tree with numpy
(``op(state)``), or build its exact matrix (``op.to_sparse()``).
"""

from typing import Any

from .collectives import AllGather, AllReduce, Broadcast, ReduceScatter, SumReduce
from .errors import (
    AccountingError,
    AlgorithmError,
    ArrayLibraryError,
    BlockError,
    BlockExistsError,
    BroadcastError,
    CalibrationError,
    CommunicatorError,
    DecompositionError,
    DistributedStateError,
    DtypeError,
    GlobalShapeError,
    IntegerOverflowError,
    KernelOutputError,
    LayerError,
    LinopError,
    LocalOperatorError,
    MPIError,
    NoMatrixError,
    OperandError,
    OverlapError,
    PartitionError,
    PlacementError,
    PlotError,
    RegionError,
    ScalarError,
    ShapeMismatchError,
    SpaceMismatchError,
    StateError,
    TreeMismatchError,
    UnknownBlockError,
    UnsupportedNodeError,
    WorkerError,
    WorkerMapError,
    WorkerMapMismatchError,
)
from .halo import (
    HaloExchange,
    HaloExchangeAdjoint,
    HaloStage,
    HaloStageAdjoint,
    halo_windows,
    local_space,
    pad_shim,
    trim_shim,
    window_space,
)
from .halo_geometry import (
    BOUNDARY_MODES,
    DimGeometry,
    HaloError,
    HaloGeometry,
    Kernel,
    KernelError,
    halo_geometry,
    output_length,
)
from .layout import BlockGrid, Layout, broadcast_map, gathered_layout, reduction_groups
from .local import LocalKernel, LocalOperator, local_operator
from .mesh_layout import MeshLayout
from .movement import Copy, CopyAdjoint, Move, SendRecv, SendRecvAdjoint
from .operator import Composition, Identity, LinearOperator, Scaled, Sum, Zero, expand_all, walk
from .partition import DistributedTensor, Partition, balanced_sizes
from .primitives import Add, Allocate, Clear, Deallocate
from .redistribute import Redistribute
from .repartition import Gather, Repartition, Scatter, overlaps
from .space import Block, Region, Space, State


def __getattr__(name: str) -> Any:
    """Attributes loaded on first access, so that ``import linop`` stays cheap:
    ``__version__`` (read from the package metadata, see :mod:`linop.version`) and
    ``aslinearoperator`` (the scipy adapter, which imports ``scipy.sparse.linalg``)."""
    if name == "__version__":
        from .version import package_version

        return package_version()
    if name == "aslinearoperator":
        from .backends.sparse.scipy_interop import aslinearoperator

        return aslinearoperator
    raise AttributeError(f"module 'linop' has no attribute {name!r}")


__all__ = [
    "AccountingError",
    "Add",
    "AlgorithmError",
    "ArrayLibraryError",
    "AllGather",
    "AllReduce",
    "Allocate",
    "BOUNDARY_MODES",
    "Block",
    "BlockError",
    "BlockExistsError",
    "BlockGrid",
    "Broadcast",
    "BroadcastError",
    "CalibrationError",
    "Clear",
    "CommunicatorError",
    "Composition",
    "Copy",
    "CopyAdjoint",
    "Deallocate",
    "DecompositionError",
    "DimGeometry",
    "DistributedStateError",
    "DistributedTensor",
    "DtypeError",
    "Gather",
    "GlobalShapeError",
    "HaloError",
    "HaloExchange",
    "HaloExchangeAdjoint",
    "HaloGeometry",
    "HaloStage",
    "HaloStageAdjoint",
    "Identity",
    "IntegerOverflowError",
    "Kernel",
    "KernelError",
    "KernelOutputError",
    "LayerError",
    "Layout",
    "LinearOperator",
    "LinopError",
    "LocalKernel",
    "LocalOperator",
    "LocalOperatorError",
    "MPIError",
    "MeshLayout",
    "Move",
    "NoMatrixError",
    "OperandError",
    "OverlapError",
    "Partition",
    "PartitionError",
    "PlacementError",
    "PlotError",
    "Redistribute",
    "ReduceScatter",
    "Region",
    "RegionError",
    "Repartition",
    "ScalarError",
    "Scaled",
    "Scatter",
    "SendRecv",
    "SendRecvAdjoint",
    "ShapeMismatchError",
    "Space",
    "SpaceMismatchError",
    "State",
    "StateError",
    "Sum",
    "SumReduce",
    "TreeMismatchError",
    "UnknownBlockError",
    "UnsupportedNodeError",
    "WorkerError",
    "WorkerMapError",
    "WorkerMapMismatchError",
    "Zero",
    "aslinearoperator",
    "balanced_sizes",
    "broadcast_map",
    "expand_all",
    "gathered_layout",
    "halo_geometry",
    "halo_windows",
    "local_operator",
    "local_space",
    "output_length",
    "overlaps",
    "pad_shim",
    "reduction_groups",
    "trim_shim",
    "walk",
    "window_space",
]
