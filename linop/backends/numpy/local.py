"""The numpy handler of :class:`~linop.local.LocalOperator`: call the kernel on the consumed
blocks, check what it returns (shape and dtype, naming the node and block; see
:meth:`~linop.local.LocalOperator.evaluate`), drop the consumed blocks and bind the produced
ones. An array the kernel returns that shares memory with an array of the workspace (an
identity kernel returning its input, a view) is copied, so no two blocks ever share a
writable array and the caller's arrays are never changed.
"""

from __future__ import annotations

import numpy as np

from ...local import LocalOperator
from . import Workspace, handler

__all__: list[str] = []


@handler(LocalOperator)
def _local(op: LocalOperator, work: Workspace) -> None:
    arrays = [work.arrays[block.name] for block in op.consumed]
    results = op.evaluate(arrays)
    for block in op.consumed:
        work.drop(block.name)
    for block, result in zip(op.produced, results):
        shared = not result.flags.writeable or any(
            np.may_share_memory(result, other) for other in (*arrays, *work.arrays.values())
        )
        work.set(block.name, result.copy() if shared else result)
