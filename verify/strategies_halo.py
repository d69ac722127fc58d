"""Hypothesis strategies for sliding-window kernels and halo exchanges.

Re-exported by :mod:`verify.strategies`. Everything drawn is valid: the kernel's extent
d(k-1)+1 never exceeds the padded input m + 2p, inputs that a periodic or reflecting boundary
wraps are non-empty, and decompositions are balanced or explicit (empty shares included, so some
workers own no input and some no output). Shapes stay small so that exact sparse proofs are fast.

==================================  ===============================================================
strategy                            draws
==================================  ===============================================================
``boundaries()``                    a boundary mode: zero, periodic, reflect or symmetric
``kernels(ndim)``                   a :class:`~linop.halo_geometry.Kernel` with one entry per
                                    dimension: size 1-7, stride 1-4, dilation 1-3, padding 0-3
``halo_cases()``                    ``(tensor, kernel)``: a distributed tensor of rank 1-4 on a
                                    partition, and a kernel that fits it (the full kernel
                                    ranges in at least one dimension of every rank)
``halo_stages()``                   one stage of a nested or direct halo exchange, or its adjoint
``halo_exchanges()``                a nested or direct :class:`~linop.HaloExchange`, or its adjoint
==================================  ===============================================================
"""

from __future__ import annotations

from hypothesis import assume
from hypothesis import strategies as st

from linop import (
    HaloExchange,
    HaloExchangeAdjoint,
    HaloStage,
    HaloStageAdjoint,
    LinearOperator,
    halo_geometry,
)
from linop.halo_geometry import BOUNDARY_MODES, Kernel
from linop.partition import DistributedTensor, Partition

from .node_examples import examples_for
from .strategies_distributed import decompositions
from .strategy_cache import built_once

__all__ = ["boundaries", "halo_cases", "halo_exchanges", "halo_stages", "kernels"]


@built_once
def boundaries(modes: tuple[str, ...] = BOUNDARY_MODES) -> st.SearchStrategy[str]:
    """A boundary mode among ``modes``."""
    return st.sampled_from(modes)


@built_once
@st.composite
def _dimension_kernel(
    draw: st.DrawFn,
    *,
    max_size: int,
    max_stride: int,
    max_dilation: int,
    max_padding: int,
    modes: tuple[str, ...],
) -> tuple[int, int, int, int, str]:
    return (
        draw(st.integers(1, max_size)),
        draw(st.integers(1, max_stride)),
        draw(st.integers(0, max_padding)),
        draw(st.integers(1, max_dilation)),
        draw(boundaries(modes)),
    )


@built_once
@st.composite
def kernels(
    draw: st.DrawFn,
    ndim: int,
    *,
    max_size: int = 7,
    max_stride: int = 4,
    max_dilation: int = 3,
    max_padding: int = 3,
    modes: tuple[str, ...] = BOUNDARY_MODES,
) -> Kernel:
    """A kernel with one (size, stride, padding, dilation, boundary) per dimension."""
    dims = [
        draw(
            _dimension_kernel(
                max_size=max_size,
                max_stride=max_stride,
                max_dilation=max_dilation,
                max_padding=max_padding,
                modes=modes,
            )
        )
        for _ in range(ndim)
    ]
    size, stride, padding, dilation, boundary = (tuple(column) for column in zip(*dims))
    return Kernel(size, stride, padding, dilation, boundary)


_FULL_RANGES = {"max_size": 7, "max_stride": 4, "max_dilation": 3, "max_padding": 3}
"""The kernel ranges of the issue: size 1-7, stride 1-4, dilation 1-3, padding 0-3."""
_SMALL_RANGES = {"max_size": 3, "max_stride": 2, "max_dilation": 2, "max_padding": 2}
"""Ranges that keep a dimension's extent at most 5 (the other dimensions of rank 3 and 4)."""


@built_once
@st.composite
def halo_cases(
    draw: st.DrawFn,
    *,
    min_dims: int = 1,
    max_dims: int = 4,
    balanced: bool | None = None,
    modes: tuple[str, ...] = BOUNDARY_MODES,
    max_extra: int = 4,
) -> tuple[DistributedTensor, Kernel]:
    """A distributed tensor ``x`` and a kernel that fits it.

    Every rank draws the full kernel ranges (size 1-7, stride 1-4, dilation 1-3, padding 0-3)
    on grids of up to 3 workers: rank 1 and 2 in every dimension, rank 3 and 4 in one drawn
    dimension, the others keeping size 1-3, stride 1-2, dilation 1-2, padding 0-2, extent at
    most 5 and up to 2 workers, so the whole tensor stays a few thousand entries. Each global
    extent is at least what the kernel needs, plus ``0 .. max_extra`` (``0 .. 2`` in the small
    dimensions).
    """
    ndim = draw(st.integers(min_dims, max_dims))
    wide = set(range(ndim)) if ndim <= 2 else {draw(st.integers(0, ndim - 1))}
    dims, shape, grid = [], [], []
    for dim in range(ndim):
        ranges = _FULL_RANGES if dim in wide else _SMALL_RANGES
        size, stride, padding, dilation, boundary = draw(_dimension_kernel(**ranges, modes=modes))
        dims.append((size, stride, padding, dilation, boundary))
        least = max(1, dilation * (size - 1) + 1 - 2 * padding)
        shape.append(least + draw(st.integers(0, max_extra if dim in wide else 2)))
        grid.append(draw(st.integers(1, 3 if dim in wide else 2)))
    k_size, k_stride, k_padding, k_dilation, k_boundary = (tuple(column) for column in zip(*dims))
    kernel = Kernel(k_size, k_stride, k_padding, k_dilation, k_boundary)
    sizes = draw(decompositions(tuple(shape), tuple(grid), balanced=balanced))
    count = 1
    for n in grid:
        count *= n
    workers = tuple(draw(st.permutations(range(count))))
    return DistributedTensor("x", tuple(shape), Partition(tuple(grid), workers), sizes), kernel


@st.composite
def halo_stages(draw: st.DrawFn, *, max_dims: int = 2, adjoint: bool | None = None) -> LinearOperator:
    """One :class:`~linop.HaloStage` of a nested or direct halo exchange of a drawn case, or
    its :class:`~linop.HaloStageAdjoint` (``adjoint`` True or False: only those)."""
    tensor, kernel = draw(halo_cases(max_dims=max_dims))
    exchange = HaloExchange(halo_geometry(tensor, kernel), draw(st.sampled_from(["nested", "direct"])))
    stages = exchange.stages()
    assume(stages)  # a case with nothing to exchange has no stage
    stage: LinearOperator = draw(st.sampled_from(stages))
    return stage.H if (draw(st.booleans()) if adjoint is None else adjoint) else stage


@examples_for(HaloStage)
def _stages() -> st.SearchStrategy[LinearOperator]:
    return halo_stages(adjoint=False).filter(lambda op: isinstance(op, HaloStage))


@examples_for(HaloStageAdjoint)
def _stage_adjoints() -> st.SearchStrategy[LinearOperator]:
    return halo_stages(adjoint=True).filter(lambda op: isinstance(op, HaloStageAdjoint))


@st.composite
def halo_exchanges(draw: st.DrawFn, *, max_dims: int = 2, adjoint: bool | None = None) -> LinearOperator:
    """A nested or direct :class:`~linop.HaloExchange` of a drawn case, or its adjoint (the MPI
    interpreter lowers them rank by rank, from the geometry; ``adjoint`` True or False: only
    adjoints or only exchanges)."""
    tensor, kernel = draw(halo_cases(max_dims=max_dims))
    exchange = HaloExchange(halo_geometry(tensor, kernel), draw(st.sampled_from(["nested", "direct"])))
    return exchange.H if (draw(st.booleans()) if adjoint is None else adjoint) else exchange


@examples_for(HaloExchange)
def _exchanges() -> st.SearchStrategy[LinearOperator]:
    return halo_exchanges(adjoint=False).filter(lambda op: isinstance(op, HaloExchange))


@examples_for(HaloExchangeAdjoint)
def _exchange_adjoints() -> st.SearchStrategy[LinearOperator]:
    return halo_exchanges(adjoint=True).filter(lambda op: isinstance(op, HaloExchangeAdjoint))
