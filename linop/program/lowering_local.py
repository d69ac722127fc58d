"""The lowering of :class:`~linop.local.LocalOperator`: one local step on the owning worker
(run there with the numpy handler, :mod:`linop.backends.numpy.local`); other ranks skip it. It
reads the consumed blocks and writes (drops) them and the produced blocks, which is what
batching needs to keep it ordered against transfers of the same blocks. A mapped rank's
lowering keeps the steps of its workers only (:func:`~linop.program.lowering.per_worker`).
"""

from __future__ import annotations

from ..local import LocalOperator
from .lowering import lowering, per_worker
from .steps import Footprint, Local, Step

__all__: list[str] = []


@lowering(per_worker(LocalOperator))
def _local(op: LocalOperator) -> list[Step]:
    consumed = tuple((b.name, None, None) for b in op.consumed)
    produced = tuple((b.name, None, None) for b in op.produced)
    return [Local(op, op.worker, Footprint(reads=consumed, writes=consumed + produced))]
