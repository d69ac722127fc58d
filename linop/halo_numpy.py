"""Numpy fast paths of the halo exchange stages (proven equal to their expansions in the tests).

A stage's copies commute (no destination meets a source or another destination), so the
interpreter runs them one after another without the send and receive buffers of the expansion:
forward ``x_dst = x_src``; adjoint ``x_src += x_dst`` then ``x_dst = 0``. In place, only the
halo-sized regions are touched: no local block is copied.
"""

from __future__ import annotations

from .backends.numpy_backend import Workspace, handler
from .halo import HaloStage, HaloStageAdjoint

__all__: list[str] = []


@handler(HaloStage)
def _stage(op: HaloStage, work: Workspace) -> None:
    for src, dst in op.transfers:
        source = work.arrays[src.name][src.index]
        work.writable(dst.name, source.dtype)[dst.index] = source


@handler(HaloStageAdjoint)
def _stage_adjoint(op: HaloStageAdjoint, work: Workspace) -> None:
    for src, dst in op.transfers:
        back = work.arrays[dst.name][dst.index]
        work.writable(src.name, back.dtype)[src.index] += back
        work.writable(dst.name)[dst.index] = 0
