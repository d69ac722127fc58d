r"""Distributed convolution as operator trees: feature, channel and general partitions.

The paper's algorithm (docs/theory.md#layers), for an input x of shape (N, C_in, S_0, ...) on
P_x = 1 x P_ci x P_0 x ..., weights w (C_out, C_in, k_0, ...) on P_r = P_co x P_ci x 1 ...,
output y (N, C_out, n_0, ...) on P_y = 1 x P_co x P_0 x ... and work partition
P_w = 1 x P_co x P_ci x P_0 x ...:

.. math::

    \hat x = H x, \quad \tilde x = B_{P_x \to P_w} \hat x, \quad
    \tilde y_j = \tilde w_j \star \tilde x_j \;(+\, \tilde b_j \text{ where } ci = 0), \quad
    y = R_{P_w \to P_y} \tilde y

with :math:`\tilde w = B_{P_r \to P_w} w` and the bias broadcast from one P_co x 1
sub-partition over the spatial workers. As operators:

* :meth:`Convolution.input_operator` (weights fixed): ``R L_w B H`` (x -> y); its adjoint
  ``H* R* L_w* B*`` = ``H* B_{P_y->P_w} ...`` is the input gradient, the broadcast's adjoint
  (a sum-reduce over the output channels) included.
* :meth:`Convolution.parameter_operator` (input fixed, through its windows): ``R L_x (B_w, B_b)``
  ((w, b) -> y); its adjoint gives dw and db, the implicit all-reduce of the weight gradient
  appearing as the sum-reduce adjoint to the weights' broadcast.

Partitions broadcast as in NumPy (right-aligned), so the internal copies are named by
permuted grid indices that make each broadcast and reduction a plain :class:`~linop.Broadcast`
or :class:`~linop.SumReduce`: the input windows' copies ``xt[co,0,ci,*s]``, the partial outputs
``yt[ci,0,co,*s]`` and the bias copies ``bt[*s,co]``, all on worker ``P_w[0,co,ci,*s]``. When
P_co is 1 (P_ci is 1) and the workers agree, the broadcast of the input (the reduction of the
output) is the identity and left out, so a feature-partitioned layer is just ``L H``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, cast

import numpy as np

from .. import AllReduce, BlockGrid, Broadcast
from ..halo import halo_windows
from ..halo_geometry import Kernel, halo_geometry
from ..layout import ProductShapes
from ..operator import Composition, LinearOperator
from ..partition import DistributedTensor, Partition, WorkerRange, grid_block_name
from ..space import Block, Space
from . import kernels, overlap_split
from .base import (
    LayerError,
    LocalStep,
    local_stage,
    partial_sums_reduction,
    require_int,
    require_partition,
    require_shape,
    require_tensor,
    scatter_weights_and_bias,
    share_slices,
    shares,
)

__all__ = ["Convolution"]


def _spatial_kernel(kernel: Kernel | int, dims: int) -> Kernel:
    """The kernel over the whole tensor: identity on batch and channel (``leading=2``)."""
    if isinstance(kernel, int) or not isinstance(kernel, Kernel):
        kernel = Kernel(kernel)
    if kernel.leading not in (0, 2):
        raise LayerError(
            f"Convolution: the kernel acts on the {dims} spatial dimensions; leading must be 0, not {kernel.leading}"
        )
    full = Kernel(kernel.size, kernel.stride, kernel.padding, kernel.dilation, kernel.boundary, leading=2)
    return full.resolve(dims + 2)


def _input_kernels(weights: np.ndarray, window: tuple[int, ...], stride, dilation):
    def forward(x: np.ndarray) -> np.ndarray:
        return kernels.correlate(x, weights, stride, dilation)

    def adjoint(y: np.ndarray) -> np.ndarray:
        return kernels.correlate_adjoint(y, weights, window, stride, dilation)

    return forward, adjoint


def _parameter_kernels(
    window: np.ndarray | None, label: str, size, stride, dilation, with_bias: bool, dims: int
):
    def fixed() -> np.ndarray:
        if window is None:
            raise LayerError(f"{label}: the input window of this worker was not given to parameter_operator")
        return window

    def forward(w: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
        y = kernels.weight_correlate(fixed(), w, stride, dilation)
        if with_bias:
            assert b is not None  # the bias is given exactly when the layer has one
            spread: kernels.Index = (..., None, slice(None), *(None,) * dims)
            y = y + b[spread]
        return y

    def adjoint(y: np.ndarray):
        dw = kernels.weight_correlate_adjoint(fixed(), y, size, stride, dilation)
        if not with_bias:
            return dw
        return dw, y.sum(axis=(y.ndim - dims - 2, *range(y.ndim - dims, y.ndim)))

    return forward, adjoint


class Convolution:
    r"""A distributed convolution (cross-correlation) layer over a feature, channel or general
    partition, as two operator trees.

    Parameters
    ----------
    x : DistributedTensor
        Input (N, C_in, S_0, ...) on P_x = 1 x P_ci x P_0 x ... (any shares, unbalanced ones
        included: its channel shares are the weights' input-channel shares, e.g. 7 channels
        over 3 workers 3, 2, 2 by default, or the explicit sizes x was built with).
    out_channels : int
        C_out.
    kernel : Kernel or int
        The spatial kernel (size, stride, padding, dilation, boundary per spatial dimension).
    workers : Partition, optional
        P_w = 1 x P_co x P_ci x P_0 x ...; default 1 x 1 x P_ci x ... on the workers of P_x.
    output : Partition, optional
        P_y = 1 x P_co x P_0 x ...; default the ci = 0 slice of P_w.
    bias : bool, optional
        Whether the parameter tree has a learnable bias (on the P_co x 1 sub-partition of P_w
        with ci = 0 and spatial index 0, broadcast over the spatial workers).
    name : str, optional
        Name of the output tensor (default ``"y"``); the weights are ``name + "_w"``, the bias
        ``name + "_b"``.
    out_sizes : sequence of int, optional
        The output channels' shares over P_co (one per worker, adding up to C_out, empty
        shares allowed); default balanced (:func:`~linop.partition.balanced_sizes`: 10 over 3
        is 4, 3, 3). They are y's channel shares and the weights' and bias' output-channel
        shares.

    Attributes
    ----------
    x, y, weights, bias : DistributedTensor
        The input, output, weights (on P_r, shares ``(out_sizes, x.sizes[1], k...)``) and bias
        (shares ``out_sizes``; None without bias).
    ci_sizes, co_sizes : tuple of int
        The input and output channels' shares over P_ci and P_co.

    Raises
    ------
    LayerError
        If a partition has the wrong rank or shape, the batch dimension is partitioned,
        ``out_sizes`` is not a decomposition of C_out over P_co, or the output partition does
        not match.
    """

    def __init__(
        self,
        x: DistributedTensor,
        out_channels: int,
        kernel: Kernel | int,
        *,
        workers: Partition | None = None,
        output: Partition | None = None,
        bias: bool = True,
        name: str = "y",
        out_sizes: Sequence[int] | None = None,
    ) -> None:
        layer = "Convolution"
        self.x = require_tensor(layer, "x", x)
        dims = x.ndim - 2
        if dims < 1:
            raise LayerError(f"{layer}: x {x.global_shape} needs (batch, channel, spatial...) dimensions")
        px = x.partition
        if px.shape[0] != 1:
            raise LayerError(f"{layer}: the batch dimension of x's partition {px.shape} must have extent 1")
        p_ci, spatial = px.shape[1], px.shape[2:]
        if workers is None:
            workers = Partition((1, 1, p_ci, *spatial), px.workers)
        pw = require_partition(layer, "work partition P_w", workers, dims + 3)
        if pw.shape[0] != 1 or pw.shape[2] != p_ci or pw.shape[3:] != spatial:
            raise LayerError(
                f"{layer}: work partition P_w {pw.shape} must be 1 x P_co x {p_ci} x {' x '.join(map(str, spatial))} "
                f"to match x's partition {px.shape}"
            )
        p_co = pw.shape[1]
        c_in = x.global_shape[1]
        self.out_channels = require_int(layer, "out_channels", out_channels)
        ci_sizes = x.sizes[1]
        co_sizes = shares(layer, "output channel", self.out_channels, p_co, out_sizes)
        self.kernel = _spatial_kernel(kernel, dims)
        self.spatial_kernel = kernel if isinstance(kernel, Kernel) else Kernel(kernel)
        # the channels stay where x has them (its shares, balanced or not: no halo along them)
        self._window_shares: tuple[tuple[int, ...] | None, ...] = (x.sizes[0], ci_sizes, *(None,) * dims)
        self.geometry = halo_geometry(x, self.kernel, output_sizes=self._window_shares)
        out_global = (x.global_shape[0], self.out_channels, *self.geometry.output_shape[2:])
        if output is None:
            output = _default_output(pw)
        py = require_partition(layer, "output partition P_y", output, dims + 2)
        if py.shape != (1, p_co, *spatial):
            raise LayerError(f"{layer}: output partition P_y {py.shape} must be {(1, p_co, *spatial)}")
        spatial_sizes = self.geometry.output_sizes[2:]
        self.y = DistributedTensor(name, out_global, py, sizes=((out_global[0],), co_sizes, *spatial_sizes))
        self.work = pw
        self.dims, self.p_co, self.p_ci, self.spatial = dims, p_co, p_ci, spatial
        self.co_sizes, self.ci_sizes = co_sizes, ci_sizes
        size = self.kernel.size[2:]  # type: ignore[index]
        self.weights = DistributedTensor(
            f"{name}_w",
            (self.out_channels, c_in, *size),
            Partition(
                (p_co, p_ci, *(1,) * dims),
                tuple(pw.worker((0, co, ci, *(0,) * dims)) for co, ci in _grid((p_co, p_ci))),
            ),
            sizes=(co_sizes, ci_sizes, *((k,) for k in size)),
        )
        self.bias = (
            DistributedTensor(
                f"{name}_b",
                (self.out_channels,),
                Partition((p_co,), tuple(pw.worker((0, co, 0, *(0,) * dims)) for co in range(p_co))),
                sizes=(co_sizes,),
            )
            if bias
            else None
        )
        self._window_name = f"{x.name}_window"
        self.broadcasts_input = broadcasts_input(px, pw)
        self.reduces_output = reduces_output(pw, py)
        for name_ in (f"{name}_w", f"{name}_b"):
            if name_ in (x.name, name):
                raise LayerError(f"{layer}: names must differ, {name_!r} is taken")

    # -- names and shapes per work index j = (0, co, ci, *s) ----------------------------------
    def work_indices(self) -> list[tuple[int, ...]]:
        """Every index of P_w, in C order."""
        return list(self.work.indices())

    def window_name(self, j: Sequence[int]) -> str:
        """Name of the input window that worker ``P_w[j]`` correlates."""
        _, co, ci, *s = j
        if self.broadcasts_input:
            return grid_block_name("xt", (co, 0, ci, *s))
        return grid_block_name(self._window_name, (0, ci, *s))

    def partial_name(self, j: Sequence[int]) -> str:
        """Name of worker ``P_w[j]``'s partial output (the output block itself without reduction)."""
        _, co, ci, *s = j
        if self.reduces_output:
            return grid_block_name("yt", (ci, 0, co, *s))
        return self.y.block_name((0, co, *s))

    def _window_shape(self, j: Sequence[int]) -> tuple[int, ...]:
        _, _co, ci, *s = j
        return self.geometry.window_shape((0, ci, *s))

    def partial_block(self, j: Sequence[int]) -> Block:
        """Worker ``P_w[j]``'s partial output block ``(N, co_sizes[co], *out)``."""
        _, co, ci, *s = j
        start, stop = self.geometry.output_box((0, ci, *s))
        spatial = tuple(b - a for a, b in zip(start[2:], stop[2:]))
        return Block(
            self.partial_name(j), (self.x.global_shape[0], self.co_sizes[co], *spatial), self.work.worker(j)
        )

    # -- trees ----------------------------------------------------------------------------------
    @property
    def window_operator(self) -> LinearOperator:
        r"""The data movement x -> the windows on P_w: :math:`B_{P_x \to P_w} H` (an exact 0/1
        operator)."""
        windows = halo_windows(
            self.x, self.kernel, window_name=self._window_name, output_sizes=self._window_shares
        )
        if not self.broadcasts_input:
            return windows
        px = self.x.partition
        extents = tuple(self.geometry.column(d, "window_size") for d in range(self.geometry.ndim))
        grid = BlockGrid(self._window_name, px, ProductShapes(px.shape, extents))  # described
        shape = (self.p_co, 1, self.p_ci, *self.spatial)  # P_w's workers in its own C order
        workers = self.work.workers
        copies = (
            Partition.grid(shape, first=workers.start)
            if isinstance(workers, WorkerRange)
            else Partition(shape, tuple(self.work.worker((0, co, ci, *s)) for co, _, ci, *s in _grid(shape)))
        )
        return Broadcast(grid, copies, "xt") @ windows

    def _reduction(self, space: Space) -> LinearOperator | None:
        if not self.reduces_output:
            return None
        shape = (self.p_ci, 1, self.p_co, *self.spatial)
        workers = (self.work.worker((0, co, ci, *s)) for ci, _, co, *s in _grid(shape))
        return partial_sums_reduction(self.y, shape, workers, space)

    def input_operator(self, weights: Any, *, overlap: bool = False) -> LinearOperator:
        r"""The layer as a linear operator of its input for fixed ``weights`` ``(C_out, C_in, *k)``:
        :math:`y = R\, L_w\, B\, H\, x` (no bias: the bias is not linear in x). Its adjoint is the
        input gradient.

        ``overlap=True`` gives the same operator with the halo exchange overlapped: each
        worker's interior product runs while the exchange's messages are in flight, the
        boundary strips after it (:mod:`linop.layers.overlap_split`; the adjoint overlapped
        alike). It needs a layer that does not broadcast its input (P_co = 1).

        Raises
        ------
        LayerError
            If ``weights`` has the wrong shape, or ``overlap`` is asked of a layer that
            broadcasts its input.
        """
        weights = require_shape("Convolution", "weights", weights, self.weights.global_shape)
        if overlap:
            return self._overlapped_input_operator(weights)
        moving = self.window_operator
        space = moving.range
        stride, dilation = self.kernel.stride[2:], self.kernel.dilation[2:]  # type: ignore[index]
        steps = []
        for j in self.work_indices():
            part, window = self._part(weights, j), self._window_shape(j)[2:]
            forward, adjoint = _input_kernels(part, window, stride, dilation)
            steps.append(
                LocalStep(
                    (self.window_name(j),),
                    (self.partial_block(j),),
                    forward,
                    adjoint,
                    grid_block_name("conv", j),
                    kernels.jax_correlate_template(part, stride, dilation),
                )
            )
        local = local_stage(space, steps)
        tree = local @ moving
        reduce = self._reduction(local.range)
        return tree if reduce is None else reduce @ tree

    @property
    def overlappable(self) -> bool:
        """True when the input tree can overlap its halo exchange (the input is not broadcast:
        each worker's window is its own input's)."""
        return not self.broadcasts_input

    def _part(self, weights: np.ndarray, j: Sequence[int]) -> np.ndarray:
        """Worker ``j``'s read-only share of the global weights (its output and input channels)."""
        _, co, ci, *_ = j
        part = np.array(weights[share_slices(self.co_sizes)[co], share_slices(self.ci_sizes)[ci]])
        part.flags.writeable = False
        return part

    def overlapped_products(
        self, kernels: overlap_split.PieceKernels, *, windows: bool = False
    ) -> LinearOperator:
        """The tree from x to the partial outputs with the halo exchange overlapped, each
        piece's product made by ``kernels(j, window_shape) -> (forward, adjoint)``
        (:func:`linop.layers.overlap_split.overlapped_products`; the reduction over input-channel
        workers not included). ``windows``: keep the windows too (the blocks
        :meth:`window_name` names), for a framework's weight gradient.

        Raises
        ------
        LayerError
            If the layer broadcasts its input (P_co > 1).
        """
        if not self.overlappable:
            raise LayerError(
                f"Convolution: the halo exchange cannot be overlapped when the input is broadcast "
                f"(P_co = {self.p_co}); use overlap=False"
            )
        outputs = []
        for g in self.x.partition.indices():
            j = (0, 0, *g[1:])
            outputs.append((j, self.partial_block(j)))
        names = [self.window_name(j) for j, _ in outputs] if windows else None
        return overlap_split.overlapped_products(self.geometry, outputs, kernels, windows=names)

    def interior_fraction(self) -> float:
        """The smallest share, over the workers with output, of their outputs that the interior
        holds (:func:`linop.layers.overlap_split.interior_box`): 1 without any halo, 0 when
        some worker's every output needs one."""
        dims = tuple(range(2, self.x.ndim))
        worst = 1.0
        for g in self.x.partition.indices():
            start, stop = self.geometry.output_box(g)
            total = int(np.prod([stop[d] - start[d] for d in dims]))
            if total == 0:
                continue
            box = overlap_split.interior_box(self.geometry, g, dims)
            inner = 0 if box is None else int(np.prod([b - a for a, b in zip(*box)]))
            worst = min(worst, inner / total)
        return worst

    def _overlapped_input_operator(self, weights: np.ndarray) -> LinearOperator:
        stride, dilation = self.kernel.stride[2:], self.kernel.dilation[2:]  # type: ignore[index]

        def kernels(j: Sequence[int], window: tuple[int, ...]):
            return _input_kernels(self._part(weights, j), window, stride, dilation)

        tree = self.overlapped_products(kernels)
        reduce = self._reduction(tree.range)
        return tree if reduce is None else reduce @ tree

    @property
    def parameter_space(self) -> Space:
        """The domain of :meth:`parameter_operator`: the weights' blocks (and the bias')."""
        blocks = list(self.weights.blocks)
        if self.bias is not None:
            blocks += self.bias.blocks
        return Space(blocks)

    @property
    def parameter_movement(self) -> LinearOperator:
        r"""The data movement of the parameters to the workers that use them,
        :math:`(B_w w, B_b b)`: the weight copies ``wt[j]`` on every worker of P_w and the bias
        copies ``bt[*s, co]`` on the workers with ci = 0 (an exact 0/1 operator; its adjoint
        sums the per-worker gradients)."""
        bias_space = self.bias.space if self.bias is not None else Space()
        weights = Broadcast(self.weights, self.work, "wt", others=bias_space)
        if self.bias is None:
            return weights
        # the weight copies pass through the bias broadcast: their grid, described (no listing)
        return Broadcast(self.bias, self._bias_copies, "bt", others=weights.copies.space) @ weights

    @property
    def copy_gradient_sum(self) -> LinearOperator:
        r"""The sum of the gradients of all copies of each parameter block, given to every copy:
        :math:`M M^{*}` for :math:`M` = :attr:`parameter_movement`, as one
        :class:`~linop.AllReduce` per copy grid (the weight copies over P_w's spatial axes, the
        bias copies over their spatial axes). It is what replicated parameters need: a process
        that keeps its copies as parameters, all updated alike, gets the gradient of the
        original block on each (``LayerModule(..., replicate=True)``)."""
        dims = self.dims
        size = tuple(self.kernel.size[2:])  # type: ignore[index]
        # both grids described by their rules (no list of the P shapes or blocks)
        shapes = ProductShapes(self.work.shape, (None, self.co_sizes, self.ci_sizes, *(None,) * dims), size)
        weights = BlockGrid("wt", self.work, shapes)
        if self.bias is None:
            return AllReduce(weights, tuple(range(3, 3 + dims)))
        copies = self._bias_copies
        bias = BlockGrid("bt", copies, ProductShapes(copies.shape, (*(None,) * dims, self.co_sizes)))
        return AllReduce(bias, tuple(range(dims)), others=weights.space) @ AllReduce(
            weights, tuple(range(3, 3 + dims)), others=bias.space
        )

    @property
    def _bias_copies(self) -> Partition:
        """The workers of the bias copies ``bt[*s, co]``: P_w's workers with ci = 0, in C order
        of ``(*s, co)``; for consecutive workers of P_w in closed form (with P_co = 1 a
        described grid: no list of the P workers)."""
        shape = (*self.spatial, self.p_co)
        workers = self.work.workers
        if not isinstance(workers, WorkerRange):
            return Partition(shape, tuple(self.work.worker((0, co, 0, *s)) for *s, co in _grid(shape)))
        if self.p_co == 1:  # worker (0, 0, 0, *s) = first + C-order position of s
            return Partition.grid(shape, first=workers.start)
        area = int(np.prod(self.spatial))  # P_w is 1 x P_co x P_ci x spatial, C order
        ids = workers.start + np.arange(area)[:, None] + self.p_ci * area * np.arange(self.p_co)[None, :]
        # an integer array (a sequence of ints to Partition, which checks it at C speed)
        return Partition(shape, cast(Sequence[int], ids.ravel()))

    def local_operands(self, j: Sequence[int]) -> tuple[str, str, str | None]:
        """The blocks worker ``P_w[j]`` computes its partial output from: its input window
        (a block of :attr:`window_operator`'s range), its weight copy and its bias copy (None
        where ci > 0 or without bias; both in :attr:`parameter_movement`'s range).

        The partial output is ``bias + correlate(window, weight copy)``
        (:func:`linop.layers.kernels.correlate`), bilinear in (window, parameters)."""
        _, co, ci, *s = j
        bias = grid_block_name("bt", (*s, co)) if self.bias is not None and ci == 0 else None
        return self.window_name(j), grid_block_name("wt", j), bias

    @property
    def output_reduction(self) -> LinearOperator | None:
        """The sum over input-channel workers of the partial outputs into y (a
        :class:`~linop.SumReduce` on the partial blocks alone), or None when each partial
        output already is a block of y."""
        if not self.reduces_output:
            return None
        return self._reduction(Space(self.partial_block(j) for j in self.work_indices()))

    def parameter_operator(self, windows: Mapping[str, Any]) -> LinearOperator:
        r"""The layer as a linear operator of its parameters (w, b) for a fixed input, given by
        its windows (``window_operator(x)``; under MPI, the blocks a rank holds are enough):
        :math:`y = R\, L_{\tilde x}\, (B_w w, B_b b)`. Its adjoint gives the weight and bias
        gradients (the broadcasts' adjoints sum the per-worker gradients).
        """
        stride, dilation = self.kernel.stride[2:], self.kernel.dilation[2:]  # type: ignore[index]
        size = self.kernel.size[2:]  # type: ignore[index]
        movement = self.parameter_movement
        space = movement.range
        steps = []
        for j in self.work_indices():
            _, weight, bias = self.local_operands(j)
            with_bias = bias is not None
            inputs = (weight,) + ((bias,) if bias is not None else ())
            window = windows.get(self.window_name(j))
            if window is not None:
                window = require_shape(
                    "Convolution", f"window {self.window_name(j)!r}", window, self._window_shape(j)
                )
            label = grid_block_name("conv_w", j)
            forward, adjoint = _parameter_kernels(window, label, size, stride, dilation, with_bias, self.dims)
            device = (
                kernels.jax_weight_correlate_pair(window, size, stride, dilation, with_bias, label)
                if window is None  # its typed error when called
                else kernels.jax_weight_correlate_template(window, size, stride, dilation, with_bias)
            )
            steps.append(LocalStep(inputs, (self.partial_block(j),), forward, adjoint, label, device))
        local = local_stage(space, steps)
        reduce = self._reduction(local.range)
        factors = [movement, local] if reduce is None else [movement, local, reduce]
        return Composition(tuple(reversed(factors)))

    def scatter_parameters(
        self,
        weights: Any,
        bias: Any = None,
        *,
        held: Callable[[Partition], Iterable[Sequence[int]]] | None = None,
    ) -> dict[str, np.ndarray]:
        """A state of :attr:`parameter_space` from global weights (and bias); with ``held`` (a partition's
        grid indices a process holds: :meth:`~linop.frameworks.torch_placement.Placement.held`),
        only the blocks at those indices of the weights' and the bias' partitions."""
        return scatter_weights_and_bias("Convolution", self.weights, self.bias, weights, bias, held)


def _grid(shape: Sequence[int]):
    return itertools.product(*(range(n) for n in shape))


def _default_output(pw: Partition) -> Partition:
    r"""The default output partition :math:`P_y = 1 \times P_{co} \times P_0 \cdots`: the
    workers :math:`P_w[0, co, 0, s]` in C order of ``(co, s)``.

    With :math:`P_{ci} = 1` those are all of P_w's workers in P_w's own C order (the flat
    position of ``(0, co, 0, s)`` in P_w is that of ``(co, s)``), so P_w's worker table is
    taken as it is: O(1) for consecutive workers instead of one look-up per block."""
    p_co, p_ci, spatial = pw.shape[1], pw.shape[2], pw.shape[3:]
    if p_ci == 1:
        return Partition((1, p_co, *spatial), pw.workers)
    return Partition(
        (1, p_co, *spatial), tuple(pw.worker((0, co, 0, *s)) for co, *s in _grid((p_co, *spatial)))
    )


def broadcasts_input(px: Partition, pw: Partition) -> bool:
    r"""Whether a convolution broadcasts its input from P_x = 1 x P_ci x P_0 ... to its work
    partition P_w = 1 x P_co x P_ci x P_0 ...: unless :math:`P_{co} = 1` and every
    :math:`P_w[0, 0, g_1, g_2, \ldots]` is the worker of :math:`P_x[g]`.

    With :math:`P_{co} = 1` the flat C-order position of ``(0, 0, *g[1:])`` in P_w is that of
    ``g`` in P_x (the shapes differ by a leading 1), so the test is the equality of the two
    worker tables in order: O(1) for consecutive workers (both described), one comparison
    of the tables otherwise (no per-block look-up)."""
    return not (pw.shape[1] == 1 and pw.workers == px.workers)


def reduces_output(pw: Partition, py: Partition) -> bool:
    r"""Whether a convolution sum-reduces its partial outputs from P_w = 1 x P_co x P_ci x P_0
    ... onto P_y = 1 x P_co x P_0 ...: unless :math:`P_{ci} = 1` and every
    :math:`P_w[0, g_1, 0, g_2, \ldots]` is the worker of :math:`P_y[g]`.

    With :math:`P_{ci} = 1` the flat C-order position of ``(0, g_1, 0, *g[2:])`` in P_w is that
    of ``g`` in P_y, so the test is the equality of the two worker tables in order (as
    :func:`broadcasts_input`)."""
    return not (pw.shape[2] == 1 and pw.workers == py.workers)
