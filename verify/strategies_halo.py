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
                                    partition, and a kernel that fits it
==================================  ===============================================================
"""

from __future__ import annotations

from hypothesis import strategies as st

from linop.halo_geometry import BOUNDARY_MODES, Kernel
from linop.partition import DistributedTensor, Partition

from .strategies_distributed import decompositions

__all__ = ["boundaries", "halo_cases", "kernels"]


def boundaries(modes: tuple[str, ...] = BOUNDARY_MODES) -> st.SearchStrategy[str]:
    """A boundary mode among ``modes``."""
    return st.sampled_from(modes)


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

    Rank 1 and 2 draw the full kernel ranges (size 1-7, stride 1-4, dilation 1-3, padding 0-3)
    on grids of up to 3 workers per dimension; rank 3 and 4 keep each dimension's extent at most
    5 and up to 2 workers per dimension, so the whole tensor stays a few hundred entries. Each
    global extent is at least what the kernel needs, plus ``0 .. max_extra``.
    """
    ndim = draw(st.integers(min_dims, max_dims))
    small = ndim >= 3
    kernel = draw(
        kernels(
            ndim,
            max_size=3 if small else 7,
            max_dilation=2 if small else 3,
            max_stride=2 if small else 4,
            max_padding=2 if small else 3,
            modes=modes,
        )
    )
    shape = []
    for dim in range(ndim):
        extent = kernel.dilation[dim] * (kernel.size[dim] - 1) + 1  # type: ignore[index]
        least = max(1, extent - 2 * kernel.padding[dim])  # type: ignore[index]
        shape.append(least + draw(st.integers(0, 2 if small else max_extra)))
    grid = tuple(draw(st.integers(1, 2 if small else 3)) for _ in range(ndim))
    sizes = draw(decompositions(tuple(shape), grid, balanced=balanced))
    count = 1
    for n in grid:
        count *= n
    workers = tuple(draw(st.permutations(range(count))))
    return DistributedTensor("x", tuple(shape), Partition(grid, workers), sizes), kernel
