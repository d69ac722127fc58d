"""linop: distributed data movement as linear operators, with adjoints proven exactly.

Every data-movement step (allocate, clear, add, copy, move, send-receive, collectives, halo
exchange) is a :class:`LinearOperator` on a :class:`Space` of named blocks. Operators compose
into trees whose adjoints (``op.H``) are derived by rules; interpreters apply a tree with numpy
(``op(state)``), or build its exact matrix (``op.to_sparse()``).
"""

from .backends.scipy_interop import aslinearoperator
from .errors import (
    BlockExistsError,
    LinopError,
    OverlapError,
    RegionError,
    ScalarError,
    ShapeMismatchError,
    SpaceMismatchError,
    StateError,
    UnknownBlockError,
    WorkerError,
)
from .movement import Copy, CopyAdjoint, Move, SendRecv, SendRecvAdjoint
from .operator import Composition, Identity, LinearOperator, Scaled, Sum, Zero, expand_all, walk
from .primitives import Add, Allocate, Clear, Deallocate
from .space import Block, Region, Space, State

__version__ = "0.1.0"

__all__ = [
    "Add",
    "Allocate",
    "Block",
    "BlockExistsError",
    "Clear",
    "Composition",
    "Copy",
    "CopyAdjoint",
    "Deallocate",
    "Identity",
    "LinearOperator",
    "LinopError",
    "Move",
    "OverlapError",
    "Region",
    "RegionError",
    "ScalarError",
    "Scaled",
    "SendRecv",
    "SendRecvAdjoint",
    "ShapeMismatchError",
    "Space",
    "SpaceMismatchError",
    "State",
    "StateError",
    "Sum",
    "UnknownBlockError",
    "WorkerError",
    "Zero",
    "aslinearoperator",
    "expand_all",
    "walk",
]
