"""Random distributed layouts under MPI (hypothesis, the same draws on every rank): collectives,
repartitions and halo exchanges on balanced, unbalanced and empty decompositions, on any
placement of workers on ranks; fast paths and full expansions both equal the numpy interpreter."""

from __future__ import annotations

import numpy as np
from helpers import collective_assert, compare_with_numpy, local_part, same_blocks, spmd_given
from hypothesis import strategies as st
from mpi4py import MPI

from linop import expand_all
from linop.backends import mpi as mpi_backend
from linop.collectives import AllGather, AllReduce, ReduceScatter
from linop.halo import HaloExchange
from linop.halo_geometry import HaloError, KernelError, halo_geometry
from linop.partition import DistributedTensor, Partition
from linop.repartition import Repartition
from verify.strategies_distributed import decompositions
from verify.strategies_halo import kernels

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size
EXAMPLES = {"max_examples": 12, "long": 50}


@st.composite
def grids(draw, ndim: int) -> Partition:
    """A grid of at most SIZE workers, placed on a random choice of ranks."""
    shape = []
    for _ in range(ndim):
        room = SIZE // int(np.prod(shape, dtype=int))
        shape.append(draw(st.integers(1, max(room, 1))))
    count = int(np.prod(shape, dtype=int))
    ranks = draw(st.permutations(range(SIZE)))[:count]
    return Partition(tuple(shape), tuple(ranks))


@st.composite
def tensors(draw, name: str, ndim: int, global_shape=None) -> DistributedTensor:
    partition = draw(grids(ndim))
    if global_shape is None:
        global_shape = tuple(draw(st.integers(0, 6)) for _ in range(ndim))
    return DistributedTensor(
        name, global_shape, partition, draw(decompositions(global_shape, partition.shape))
    )


def agree(op, state) -> None:
    """Fast path and full expansion under MPI, and numpy, agree exactly (integers)."""
    compare_with_numpy(op, state)
    local = local_part(op.domain, state, RANK)
    names = tuple(b.name for b in op.range if b.worker == RANK)
    result = mpi_backend.apply(expand_all(op), local, comm=COMM)
    collective_assert(same_blocks(result, op(state), names) is None, f"expansion of {op}")


@spmd_given(st.data(), **EXAMPLES)
def test_random_repartitions(data):
    ndim = data.draw(st.integers(1, 2))
    x = data.draw(tensors("x", ndim))
    y = data.draw(tensors("y", ndim, x.global_shape))
    op = Repartition(x, y)
    agree(op, op.domain.random(1, dtype=np.int64))
    agree(op.H, op.range.random(2, dtype=np.int64))


@spmd_given(st.data(), **EXAMPLES)
def test_random_gathers_and_reductions(data):
    ndim = data.draw(st.integers(1, 2))
    x = data.draw(tensors("x", ndim))
    axes = tuple(d for d in range(ndim) if data.draw(st.booleans()))
    for op in (AllGather(x, axes, "g"), ReduceScatter(x, axes, "g")):
        agree(op, op.domain.random(3, dtype=np.int64))
    grid_shapes = [x.block(i).shape for i in x.partition.indices()]
    if all(s == grid_shapes[0] for s in grid_shapes):
        op = AllReduce(x, axes)
        agree(op, op.domain.random(4, dtype=np.int64))


@spmd_given(st.data(), **EXAMPLES)
def test_random_halo_exchanges(data):
    ndim = data.draw(st.integers(1, 2))
    kernel = data.draw(kernels(ndim, max_size=5, max_stride=2, max_dilation=2, max_padding=2))
    shape = []
    for dim in range(ndim):
        extent = kernel.dilation[dim] * (kernel.size[dim] - 1) + 1
        shape.append(max(1, extent - 2 * kernel.padding[dim]) + data.draw(st.integers(0, 4)))
    x = data.draw(tensors("x", ndim, tuple(shape)))
    try:
        geometry = halo_geometry(x, kernel)
    except (HaloError, KernelError):
        return  # a layout the geometry rejects (same on every rank: the draws are the same)
    variant = data.draw(st.sampled_from(["nested", "direct"]))
    op = HaloExchange(geometry, variant)
    agree(op, op.domain.random(5, dtype=np.int64))
    agree(op.H, op.domain.random(6, dtype=np.int64))
