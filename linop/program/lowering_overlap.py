"""The lowering of :class:`~linop.overlap.OverlappedHalo` and its adjoint: the work in flight
as local steps marked ``in_flight``, beside the exchange's own steps.

Forward (:math:`X' D`): :math:`D`'s steps first, then the exchange's, so that batching puts
:math:`D` into the exchange's first phase (:attr:`~linop.program.steps.Phase.during`) when it
conflicts with none of its transfers. Adjoint (:math:`D^* X'^*`): the adjoint exchange's steps,
then :math:`D^*`'s, which join the adjoint's last phase. Either way the program order is the
node's product, so where batching cannot overlap a step it runs in that order.
"""

from __future__ import annotations

import dataclasses

from ..overlap import OverlappedHalo, OverlappedHaloAdjoint
from .lowering import lower, lowering, per_worker
from .steps import Local, Step

__all__: list[str] = []


def _in_flight(steps: list[Step]) -> list[Step]:
    return [dataclasses.replace(s, in_flight=True) if isinstance(s, Local) else s for s in steps]


@lowering(per_worker(OverlappedHalo, lambda op: (op.during, op.exchange)))
def _overlapped(op: OverlappedHalo) -> list[Step]:
    return _in_flight(lower(op.during)) + lower(op.exchange)


@lowering(per_worker(OverlappedHaloAdjoint, lambda op: (op.exchange.H, op.during.H)))
def _overlapped_adjoint(op: OverlappedHaloAdjoint) -> list[Step]:
    return lower(op.exchange.H) + _in_flight(lower(op.during.H))
