"""The sparse handler of :class:`~linop.local.LocalOperator`: the identity on the pass-through
blocks plus the kernel's matrix from the consumed blocks' positions to the produced blocks'
positions. The kernel's matrix is its own (dense or sparse) or, for a scipy LinearOperator or
callables, probed with int64 unit vectors (:meth:`~linop.local.LocalOperator.kernel_matrix`),
so integer kernels give exact integer matrices.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from ...local import LocalOperator
from . import INDEX, handler

__all__: list[str] = []


def _positions(space, blocks) -> np.ndarray:
    if not blocks:
        return np.zeros(0, dtype=INDEX)
    return np.concatenate(
        [np.arange(space.offset(b.name), space.offset(b.name) + b.size, dtype=INDEX) for b in blocks]
    )


@handler(LocalOperator)
def _local(op: LocalOperator) -> sp.csr_array:
    kernel = sp.coo_array(op.kernel_matrix())
    rows_out = _positions(op.range, op.produced)
    cols_in = _positions(op.domain, op.consumed)
    passed = op.others.blocks
    rows_id = _positions(op.range, passed)
    cols_id = _positions(op.domain, passed)
    dtype = np.result_type(kernel.dtype, INDEX)
    data = np.concatenate([np.ones(rows_id.size, dtype=dtype), kernel.data.astype(dtype)])
    rows = np.concatenate([rows_id, rows_out[kernel.row]])
    cols = np.concatenate([cols_id, cols_in[kernel.col]])
    return sp.csr_array((data, (rows, cols)), shape=op.shape)
