"""What every executor's plan holds: the glossary's *plan*, a tree prepared for one executor and
one group of workers (``docs/design.md#glossary``). The MPI executor's
:class:`~linop.backends.mpi.plan.DistributedPlan` and torch.distributed's
:class:`~linop.backends.torch_distributed.plan.TorchDistributedPlan` extend it with their
schedules, checks and bindings."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

from ..operator import LinearOperator
from ..space import Block

__all__ = ["ExecutorPlan"]

Context = TypeVar("Context")


class ExecutorPlan(Generic[Context]):
    """A tree, the context of the group it runs on (an executor's own: a communicator's, a
    process group's) and the worker map (None: worker w on rank w; or the map's error, reported
    by the first call's check); :attr:`domain_blocks` and :attr:`range_names` are what this
    rank passes and gets back, filled in by the executor's plan once it has compiled the tree."""

    def __init__(self, op: LinearOperator, context: Context, mapping: Any) -> None:
        self.op = op
        self.context = context
        self.mapping = mapping
        self.domain_blocks: dict[str, Block] = {}
        self.range_names: tuple[str, ...] = ()
