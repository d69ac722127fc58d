"""numpy fast paths of the halo exchange stages.

A stage's copies commute (no destination meets a source or another destination), so the
interpreter runs them without the send and receive buffers of the expansion: forward,
``x_dst = x_src`` for each transfer; adjoint, ``x_src += x_dst`` then ``x_dst = 0``. In place,
only the halo-sized regions are touched: no local block is copied. Proven equal to the
expansion into primitives in ``tests/test_halo.py``.
"""

from __future__ import annotations

from typing import Any

from ...halo import HaloStage, HaloStageAdjoint
from . import Workspace, handler

__all__: list[str] = []


@handler(HaloStage)
def _stage(op: HaloStage, work: Workspace) -> None:
    arrays = work.arrays
    for src, src_index, dst, dst_index in op.moves:
        source = arrays[src][src_index]
        _writable(work, dst, source)[dst_index] = source


@handler(HaloStageAdjoint)
def _stage_adjoint(op: HaloStageAdjoint, work: Workspace) -> None:
    arrays, owned = work.arrays, work.owned
    for src, src_index, dst, dst_index in op.moves:
        back = arrays[dst][dst_index]
        _writable(work, src, back)[src_index] += back
        (arrays[dst] if dst in owned else work.writable(dst))[dst_index] = 0


def _writable(work: Workspace, name: str, incoming: Any) -> Any:
    """Block ``name``, ready to take ``incoming`` (owned, and of a dtype that holds it)."""
    target = work.arrays[name]
    if name not in work.owned or target.dtype != incoming.dtype:  # else work.writable is a no-op
        target = work.writable(name, incoming.dtype)
    return target
