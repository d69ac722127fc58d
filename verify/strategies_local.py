"""Hypothesis strategies of local operators (:class:`linop.local.LocalOperator`), and their
registration as the examples of the registry proof (:mod:`verify.node_examples`).

A local operator is a leaf (it has no expansion into primitives), so the registry proof for it
compares every interpreter against its sparse matrix. The examples cover every kernel kind
(dense, scipy.sparse, scipy LinearOperator, callables, vectorized callables), one or two
input and output blocks, pass-through blocks, and zero-size blocks; the kernels have small
integer entries so the matrices are exact.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
import scipy.sparse.linalg as spla
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from linop import Block, Space
from linop.local import KERNEL_KINDS, LocalOperator, local_operator, matrix_callables

from .node_examples import examples_for

__all__ = ["integer_matrices", "local_operators"]


def integer_matrices(rows: int, columns: int) -> st.SearchStrategy[np.ndarray]:
    """Dense int64 matrices of the given shape with entries in -3..3 (mostly zeros)."""
    return hnp.arrays(np.int64, (rows, columns), elements=st.sampled_from((0, 0, 0, 1, -1, 2, -3)))


@st.composite
def local_operators(
    draw: st.DrawFn, space: Space | None = None, *, kinds: tuple[str, ...] = KERNEL_KINDS
) -> LocalOperator:
    """A local operator on ``space`` (default: drawn) with an integer kernel of one of ``kinds``
    (``"dense"``, ``"sparse"``, ``"scipy"``, ``"callables"``, ``"vectorized"``)."""
    from .strategies import shapes, spaces  # not at the top: verify.strategies imports this module

    if space is None:
        space = draw(spaces(max_blocks=3, max_side=3))
    worker = draw(st.sampled_from(sorted({b.worker for b in space})))
    mine = [b.name for b in space if b.worker == worker]
    inputs = draw(st.lists(st.sampled_from(mine), min_size=1, max_size=min(2, len(mine)), unique=True))
    count = draw(st.integers(1, 2))
    names = [n for n in ("p", "q", "r", "s") if n not in space or n in inputs][:count]
    outputs = [Block(n, draw(shapes(max_ndim=2, max_side=3)), worker) for n in names]
    n_in = sum(space.block(n).size for n in inputs)
    n_out = sum(b.size for b in outputs)
    matrix = draw(integer_matrices(n_out, n_in))
    kind = draw(st.sampled_from(kinds))
    if kind == "dense":
        return local_operator(space, inputs, outputs, matrix, name="K")
    if kind == "sparse":
        return local_operator(space, inputs, outputs, sp.csr_array(matrix), name="K")
    if kind == "scipy":
        return local_operator(space, inputs, outputs, spla.aslinearoperator(matrix), name="K")
    blocks_in = tuple(space.block(n) for n in inputs)
    vectorized = kind == "vectorized"
    forward, adjoint = matrix_callables(matrix, blocks_in, tuple(outputs), vectorized=vectorized)
    return local_operator(
        space, inputs, outputs, forward=forward, adjoint=adjoint, vectorized=vectorized, name="K"
    )


@examples_for(LocalOperator)
def _local_examples() -> st.SearchStrategy[LocalOperator]:
    return local_operators().flatmap(lambda op: st.sampled_from((op, op.H)))
