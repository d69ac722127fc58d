r"""A sliding-window layer's local product split into the interior and the boundary strips,
around an overlapped halo exchange (:class:`~linop.overlap.OverlappedHalo`).

Along a spatial dimension a worker's output position :math:`o` reads the padded input entries
:math:`[o s - p,\ o s - p + d(k-1) + 1)`. The exchange writes the window entries outside the
bulk, except the zero pads at the global edge; so the output positions whose reach lies inside
the bulk (extended over a zero pad at the edge) form the *interior*, an interval per dimension,
and their product needs no halo. The rest of the worker's output box is cut into at most two
*strips* per dimension, the onion way (dimension 0's strips span the whole box; dimension 1's
the interior's extent along dimension 0; and so on), disjoint and covering it.

The overlapped input tree of a layer, for each worker's local block :math:`\ell` and output
block :math:`y`:

.. math::

    y = \Big(\prod_{\text{strips } s} C_{y_s \to y[s]}\, L_s\, C_{\ell[\text{in}_s] \to u_s}\Big)
        D_\ell\ \cdot\ X' \cdot\ \big(L\, C_{\ell[\text{in}_I] \to u[\text{in}_I]}\, A_u\big)\ \cdot E

The interior runs while the exchange :math:`X` is in flight: a block :math:`u` of the whole
window's shape is allocated (:math:`A_u`, zeros), the interior's window copied into it, and the
product :math:`L` of the whole window computed on it, which gives the whole output block at
once (no output to embed: the outputs outside the interior read zeros there, and are
overwritten next). After the exchange each strip's window is copied out, computed, and stored
over its box of :math:`y` (:math:`C_{y_s \to y[s]}` replaces those entries), and the local
block dropped; :math:`E` is the pad shim. The adjoint reads each strip's box of :math:`\bar y`
and zeroes it, so the interior's adjoint :math:`L^*` sees the interior's outputs only, and
:math:`C^*` adds back the window entries it read. It equals the plain tree :math:`L\,T\,X\,E`
exactly, which the tests prove entry by entry; a split whose interior reaches into a halo does
not (:math:`u` then holds the halo's values from before the exchange).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..halo import HaloExchange, pad_shim
from ..halo_geometry import HaloGeometry
from ..local import LocalKernel, LocalOperator
from ..movement import Copy
from ..operator import Composition, LinearOperator
from ..overlap import OverlappedHalo
from ..partition import grid_block_name
from ..primitives import Allocate, Deallocate
from ..space import Block, Space

__all__ = ["Box", "interior_box", "boundary_strips", "input_box", "overlapped_products", "PieceKernels"]

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""(start, stop) of a box, in global output coordinates of the spatial dimensions."""

PieceKernels = Callable[[Sequence[int], tuple[int, ...]], tuple[Callable[..., Any], Callable[..., Any]]]
"""``kernels(j, window_spatial_shape) -> (forward, adjoint)``: worker ``P_w[j]``'s product on
one piece's window (``forward(window) -> output piece``, ``adjoint(output piece) -> window``)."""


def _reach(geometry: HaloGeometry, index: Sequence[int], dim: int) -> tuple[float, float]:
    """The padded input interval along ``dim`` that the exchange does not write: the bulk,
    extended over a zero pad at a global edge (empty for an empty bulk)."""
    row = geometry.row(index, dim)
    if row.bulk_size == 0:
        return (0.0, 0.0)
    zero = geometry.kernel.boundary[dim] == "zero"
    lo = -np.inf if zero and row.bulk_start == 0 else float(row.bulk_start)
    hi = np.inf if zero and row.bulk_stop == row.length else float(row.bulk_stop)
    return lo, hi


def interior_box(geometry: HaloGeometry, index: Sequence[int], dims: Sequence[int]) -> Box | None:
    """The worker's interior outputs along ``dims`` (the spatial dimensions): those whose
    reach lies where the exchange writes nothing; None when empty."""
    kernel = geometry.kernel
    start, stop = [], []
    for d in dims:
        row = geometry.row(index, d)
        s, p, ext = kernel.stride[d], kernel.padding[d], kernel.extent(d)  # type: ignore[index]
        lo, hi = _reach(geometry, index, d)
        a = row.output_start if lo == -np.inf else max(row.output_start, -(-(int(lo) + p) // s))
        b = row.output_stop if hi == np.inf else min(row.output_stop, (int(hi) + p - ext) // s + 1)
        if b <= a:
            return None
        start.append(a)
        stop.append(b)
    return tuple(start), tuple(stop)


def boundary_strips(output: Box, interior: Box | None) -> list[Box]:
    """The output box minus the interior, as disjoint strips (at most two per dimension);
    the whole box when there is no interior. Empty strips are left out."""
    (o0, o1), strips = output, []
    if interior is None:
        return [output] if all(b > a for a, b in zip(o0, o1)) else []
    i0, i1 = interior
    n = len(o0)
    for d in range(n):
        head_start = tuple(i0[e] if e < d else o0[e] for e in range(n))
        head_stop = tuple(i1[e] if e < d else o1[e] for e in range(n))
        for lo, hi in ((o0[d], i0[d]), (i1[d], o1[d])):
            if hi > lo:
                start = (*head_start[:d], lo, *head_start[d + 1 :])
                stop = (*head_stop[:d], hi, *head_stop[d + 1 :])
                strips.append((start, stop))
    return strips


def input_box(
    geometry: HaloGeometry, index: Sequence[int], dims: Sequence[int], piece: Box
) -> tuple[slice, ...]:
    """The local-block positions that the outputs ``piece`` read (whole along the other
    dimensions)."""
    kernel = geometry.kernel
    local = geometry.local_shape(index)
    slices = [slice(0, n) for n in local]
    for d, a, b in zip(dims, *piece):
        row = geometry.row(index, d)
        s, p, ext = kernel.stride[d], kernel.padding[d], kernel.extent(d)  # type: ignore[index]
        slices[d] = slice(a * s - p - row.local_start, (b - 1) * s - p + ext - row.local_start)
    return tuple(slices)


def _local(
    space: Space,
    source: Block,
    target: Block,
    forward: Callable[..., Any],
    adjoint: Callable[..., Any],
    label: str,
) -> LinearOperator:
    kernel = LocalKernel.of(forward=forward, adjoint=adjoint, vectorized=True)
    return LocalOperator((source,), (target,), kernel, name=label).within(space)


def overlapped_products(
    geometry: HaloGeometry,
    outputs: Sequence[tuple[Sequence[int], Block]],
    kernels: PieceKernels,
    *,
    variant: str = "direct",
    dims: Sequence[int] | None = None,
    prefix: str | None = None,
    interior: Callable[[Sequence[int], Sequence[int]], Box | None] | None = None,
    windows: Sequence[str] | None = None,
) -> LinearOperator:
    """The overlapped tree from the tensor's bulk blocks to each worker's output block (see the
    module docstring).

    Parameters
    ----------
    geometry : HaloGeometry
        The halo geometry of the input (one worker per bulk block).
    outputs : sequence of (index, Block)
        Per grid index of the input's partition (every one, in C order): the work index ``j``
        its product is for and the output block it makes (shape ``(..., *output box)``, on the
        same worker).
    kernels : callable
        :data:`PieceKernels`: the product of ``P_w[j]`` on one piece's window.
    variant : {"direct", "nested"}
        The exchange (the same operator; "direct" has one phase, so all of the interior can
        run while every message is in flight).
    dims : sequence of int, optional
        The dimensions the kernel slides along (default: those after the first two).
    prefix : str, optional
        Prefix of the pieces' block names (default the tensor's name).
    interior : callable, optional
        ``interior(index, dims) -> Box | None``, the interior of each worker (default
        :func:`interior_box`); another split gives another operator unless it too reads no
        halo (the control tests widen it into the halo and see the equality fail).
    windows : sequence of str, optional
        Keep each worker's window too, under these names (per grid index, in C order): the
        tree then gives ``(outputs, windows)``, what a framework needs for the weight gradient.
    """
    tensor = geometry.tensor
    dims = tuple(range(2, tensor.ndim)) if dims is None else tuple(dims)
    prefix = tensor.name if prefix is None else prefix
    shim = pad_shim(geometry)
    exchange = HaloExchange(geometry, variant)  # type: ignore[arg-type]
    space = shim.range
    local_name = exchange.local_name
    grid = list(tensor.partition.indices())
    if len(outputs) != len(grid):
        raise ValueError(f"overlapped_products: {len(outputs)} outputs for {len(grid)} workers")
    plans = []
    during: list[LinearOperator] = []
    for g, (j, block) in zip(grid, outputs):
        local = space.block(grid_block_name(local_name, g))  # type: ignore[arg-type]
        (o0, o1) = geometry.output_box(g)
        output = (tuple(o0[d] for d in dims), tuple(o1[d] for d in dims))
        inner = interior_box(geometry, g, dims) if interior is None else interior(g, dims)
        if inner is not None and not all(b > a for a, b in zip(*inner)):
            inner = None
        plans.append((g, j, block, local, output, inner))
        if inner is None:
            op: LinearOperator = Allocate(space, block)
            during.append(op)
            space = op.range
            continue
        window, whole = input_box(geometry, g, dims, inner), input_box(geometry, g, dims, output)
        interior_block = Block(grid_block_name(f"{prefix}_interior", g), _shape(whole), local.worker)
        allocate = Allocate(space, interior_block)
        inside = tuple(slice(w.start - o.start, w.stop - o.start) for w, o in zip(window, whole))
        copy = Copy(allocate.range[local.name][window], allocate.range[interior_block.name][inside])
        forward, adjoint = kernels(j, tuple(_shape(whole)[d] for d in dims))
        product = _local(copy.range, interior_block, block, forward, adjoint, grid_block_name("conv_in", j))
        during += [allocate, copy, product]
        space = product.range
    work = Composition(tuple(reversed(during)))
    factors: list[LinearOperator] = [OverlappedHalo(exchange, work)]
    space = work.range
    for g, j, block, local, output, inner in plans:
        local = space.block(local.name)
        for k, strip in enumerate(boundary_strips(output, inner)):
            window = input_box(geometry, g, dims, strip)
            copy = Copy(
                space[local.name][window],
                Block(grid_block_name(f"{prefix}_strip{k}", g), _shape(window), local.worker),
            )
            out_shape = (*block.shape[: block.ndim - len(dims)], *(b - a for a, b in zip(*strip)))
            piece = Block(grid_block_name(f"{block.name}_strip{k}", ()), out_shape, block.worker)
            forward, adjoint = kernels(j, tuple(_shape(window)[d] for d in dims))
            product = _local(
                copy.range,
                copy.range.block(copy.dst.name),
                piece,
                forward,
                adjoint,
                grid_block_name("conv_bd", j),
            )
            here = product.range
            where = tuple(slice(a - o, b - o) for a, b, o in zip(*strip, output[0]))
            full = (*(slice(None),) * (block.ndim - len(dims)), *where)
            store = Copy(here[piece.name], here[block.name][full])
            drop = Deallocate(store.range, piece.name)
            factors = [drop, store, product, copy, *factors]
            space = drop.range
        if windows is not None:
            name = windows[grid.index(g)]
            region = space[local.name][tuple(r.window for r in geometry.worker_rows(g))]
            keep = Copy(region, Block(name, region.shape, local.worker))
            factors = [keep, *factors]
            space = keep.range
        drop_local = Deallocate(space, local.name)
        factors = [drop_local, *factors]
        space = drop_local.range
    return Composition((*factors, shim))


def _shape(window: tuple[slice, ...]) -> tuple[int, ...]:
    return tuple(s.stop - s.start for s in window)
