r"""A distributed affine layer y = W x + b as operator trees (docs/theory.md#layers).

W (F_out x F_in) lives on P_w = P_fo x P_fi, x (N x F_in) on P_x = 1 x P_fi, y (N x F_out) on
P_y = 1 x P_fo, and the bias on the P_fo x 1 sub-partition of P_w (fi = 0):

.. math::

    \tilde x = B_{P_x \to P_w} x, \qquad \tilde y_j = \tilde x_j W_j^T \;(+\, b_j \text{ where }
    fi = 0), \qquad y = R_{P_w \to P_y} \tilde y

:meth:`Affine.input_operator` is ``R L_W B`` (x -> y, W fixed; its adjoint is the input
gradient, the broadcast's adjoint summing over the output features) and
:meth:`Affine.parameter_operator` is ``R L_x`` ((W, b) -> y, x fixed; its adjoint gives dW and
db). The partial outputs are named ``yt[fi,fo]`` (the grid index reversed) so that y on
1 x P_fo is a NumPy-style broadcast of them, reduced by a plain :class:`~linop.SumReduce`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from .. import Broadcast
from ..operator import Composition, Identity, LinearOperator
from ..partition import DistributedTensor, Partition, WorkerRange, grid_block_name
from ..pieces import joined
from ..space import Block, Space
from . import templates
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

__all__ = ["Affine"]


def _input_kernels(weights: np.ndarray):
    def forward(x: np.ndarray) -> np.ndarray:
        return x @ weights.T

    def adjoint(y: np.ndarray) -> np.ndarray:
        return y @ weights.conj()

    return forward, adjoint


def _parameter_kernels(x: np.ndarray | None, label: str, with_bias: bool):
    def fixed() -> np.ndarray:
        if x is None:
            raise LayerError(f"{label}: the input block of this worker was not given to parameter_operator")
        return x

    def forward(w: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
        y = np.einsum("nf,...of->...no", fixed(), w)
        return y + b[..., None, :] if with_bias else y  # type: ignore[index]

    def adjoint(y: np.ndarray):
        dw = np.einsum("nf,...no->...of", fixed().conj(), y)
        return (dw, y.sum(axis=-2)) if with_bias else dw

    return forward, adjoint


class Affine:
    r"""A distributed affine layer :math:`y = W x + b` (rows of x are samples).

    Parameters
    ----------
    x : DistributedTensor
        Input (N, F_in) on P_x = 1 x P_fi; its feature shares (balanced, e.g. 7 over 3 is
        3, 2, 2, or explicit) are the weights' input-feature shares.
    out_features : int
        F_out.
    workers : Partition, optional
        P_w = P_fo x P_fi; default 1 x P_fi on x's workers.
    output : Partition, optional
        P_y = 1 x P_fo; default the workers of P_w with fi = 0.
    bias : bool, optional
        Whether the parameter tree has a bias (on P_w's fi = 0 workers).
    name : str, optional
        Output name; the weights are ``name + "_w"`` and the bias ``name + "_b"``.
    out_sizes : sequence of int, optional
        The output features' shares over P_fo (one per worker, adding up to F_out, empty
        shares allowed); default balanced. They are y's feature shares and the weights' and
        bias' output-feature shares.

    Attributes
    ----------
    fi_sizes, fo_sizes : tuple of int
        The input and output features' shares over P_fi and P_fo.

    Raises
    ------
    LayerError
        If x is not 2-D, its samples are partitioned, a partition has the wrong rank or shape,
        or ``out_sizes`` is not a decomposition of F_out over P_fo.
    """

    def __init__(
        self,
        x: DistributedTensor,
        out_features: int,
        *,
        workers: Partition | None = None,
        output: Partition | None = None,
        bias: bool = True,
        name: str = "y",
        out_sizes: Sequence[int] | None = None,
    ) -> None:
        layer = "Affine"
        self.x = require_tensor(layer, "x", x)
        if x.ndim != 2:
            raise LayerError(f"{layer}: x must be 2-D (samples, features), not of shape {x.global_shape}")
        require_partition(layer, "x's partition", x.partition, 2)
        if x.partition.shape[0] != 1:
            raise LayerError(f"{layer}: x's samples must not be partitioned: partition {x.partition.shape}")
        p_fi = x.partition.shape[1]
        if workers is None:
            workers = Partition((1, p_fi), x.partition.workers)
        pw = require_partition(layer, "work partition P_w", workers, 2)
        if pw.shape[1] != p_fi:
            raise LayerError(
                f"{layer}: work partition P_w {pw.shape} must be P_fo x {p_fi} to match x's {x.partition.shape}"
            )
        p_fo = pw.shape[0]
        self.out_features = require_int(layer, "out_features", out_features)
        self.fi_sizes = x.sizes[1]
        self.fo_sizes = shares(layer, "output feature", self.out_features, p_fo, out_sizes)
        if output is None:  # P_w[fo, 0]; with P_fi = 1 all of P_w's workers in its order
            column = pw.workers if p_fi == 1 else tuple(pw.worker((fo, 0)) for fo in range(p_fo))
            output = Partition((1, p_fo), column)
        py = require_partition(layer, "output partition P_y", output, 2)
        if py.shape != (1, p_fo):
            raise LayerError(f"{layer}: output partition P_y {py.shape} must be {(1, p_fo)}")
        self.work, self.p_fo, self.p_fi = pw, p_fo, p_fi
        self.y = DistributedTensor(
            name, (x.global_shape[0], self.out_features), py, sizes=((x.global_shape[0],), self.fo_sizes)
        )
        self.weights = DistributedTensor(
            f"{name}_w", (self.out_features, x.global_shape[1]), pw, sizes=(self.fo_sizes, self.fi_sizes)
        )
        self.bias = (
            DistributedTensor(
                f"{name}_b",
                (self.out_features,),
                Partition((p_fo,), tuple(pw.worker((fo, 0)) for fo in range(p_fo))),
                sizes=(self.fo_sizes,),
            )
            if bias
            else None
        )
        # P_w[0, fi] and x's (0, fi), P_w[fo, 0] and P_y[0, fo] have one flat C-order position
        # when P_fo = 1 (P_fi = 1): the worker tables compared in order (O(1) when described)
        self.broadcasts_input = not (p_fo == 1 and pw.workers == x.partition.workers)
        self.reduces_output = not (p_fi == 1 and pw.workers == py.workers)

    def input_name(self, j) -> str:
        """The name of the input block worker ``P_w[j]`` multiplies."""
        return grid_block_name("xt", j) if self.broadcasts_input else self.x.block_name((0, j[1]))

    def partial_name(self, j) -> str:
        """The name of worker ``P_w[j]``'s partial output."""
        return grid_block_name("yt", (j[1], j[0])) if self.reduces_output else self.y.block_name((0, j[0]))

    def work_indices(self) -> list[tuple[int, ...]]:
        """Every index (fo, fi) of P_w, in C order."""
        return list(self.work.indices())

    def partial_block(self, j) -> Block:
        """Worker ``P_w[j]``'s partial output block ``(N, fo_sizes[fo])``."""
        return Block(self.partial_name(j), (self.x.global_shape[0], self.fo_sizes[j[0]]), self.work.worker(j))

    @property
    def window_operator(self) -> LinearOperator:
        r"""The data movement x -> its copies on P_w, :math:`B_{P_x \to P_w}`."""
        if not self.broadcasts_input:
            return Identity(self.x.space)
        return Broadcast(self.x, self.work, "xt")

    def _reduction(self, space: Space) -> LinearOperator | None:
        if not self.reduces_output:
            return None
        workers: Iterable[int]
        if self.p_fo == 1 and isinstance(self.work.workers, WorkerRange):  # P_w's own order
            workers = range(self.work.workers.start, self.work.workers.stop)
        else:
            workers = (self.work.worker((fo, fi)) for fi in range(self.p_fi) for fo in range(self.p_fo))
        return partial_sums_reduction(self.y, (self.p_fi, self.p_fo), workers, space)

    def input_operator(self, weights: Any) -> LinearOperator:
        """The layer as a linear operator of x for fixed ``weights`` (F_out, F_in), no bias.

        Raises
        ------
        LayerError
            If ``weights`` has the wrong shape.
        """
        weights = require_shape("Affine", "weights", weights, self.weights.global_shape)
        moving = self.window_operator
        steps = []
        fo_slices, fi_slices = share_slices(self.fo_sizes), share_slices(self.fi_sizes)
        for j in self.work.indices():
            fo, fi = j
            part = np.array(weights[fo_slices[fo], fi_slices[fi]])
            part.flags.writeable = False
            forward, adjoint = _input_kernels(part)
            steps.append(
                LocalStep(
                    (self.input_name(j),),
                    (self.partial_block(j),),
                    forward,
                    adjoint,
                    grid_block_name("affine", j),
                    templates.affine_input_template(part),
                )
            )
        local = local_stage(moving.range, steps)
        tree = local @ moving
        reduce = self._reduction(local.range)
        return tree if reduce is None else reduce @ tree

    @property
    def parameter_space(self) -> Space:
        """The domain of :meth:`parameter_operator`: the weights (and the bias)."""
        if self.bias is None:
            return self.weights.space
        # the two grids described (names y_w[...] and y_b[...] differ): no list of the P blocks
        return joined("Affine", self.weights.space, self.bias.space)

    @property
    def parameter_movement(self) -> LinearOperator:
        """The data movement of the parameters to the workers that use them: none (each block
        of W already lives on its worker of P_w, and the bias on P_w's fi = 0 workers), so the
        identity of :attr:`parameter_space`."""
        return Identity(self.parameter_space)

    @property
    def copy_gradient_sum(self) -> LinearOperator:
        """:math:`M M^*` for :math:`M` = :attr:`parameter_movement`: the identity (every block
        has one copy)."""
        return Identity(self.parameter_space)

    def local_operands(self, j) -> tuple[str, str, str | None]:
        """The blocks worker ``P_w[j]`` computes its partial output from: its input copy (in
        :attr:`window_operator`'s range), its weight block and its bias block (None where
        fi > 0 or without bias). The partial output is ``x_j W_j^T (+ b_j)``, bilinear in
        (input, parameters)."""
        fo, fi = j
        bias = self.bias.block_name((fo,)) if self.bias is not None and fi == 0 else None
        return self.input_name(j), self.weights.block_name(j), bias

    @property
    def output_reduction(self) -> LinearOperator | None:
        """The sum over input-feature workers of the partial outputs into y, or None when each
        partial output already is a block of y."""
        if not self.reduces_output:
            return None
        # the partial outputs are the reduction's own domain (its yt grid): nothing passes through
        return self._reduction(Space())

    def parameter_operator(self, inputs: Mapping[str, Any]) -> LinearOperator:
        """The layer as a linear operator of (W, b) for a fixed x, given by its copies on P_w
        (``window_operator(x)``; under MPI the blocks a rank holds are enough)."""
        steps = []
        for j in self.work.indices():
            _, weight, bias = self.local_operands(j)
            with_bias = bias is not None
            names = (weight,) + ((bias,) if bias is not None else ())
            x = inputs.get(self.input_name(j))
            if x is not None:
                x = require_shape(
                    "Affine",
                    f"input {self.input_name(j)!r}",
                    x,
                    (self.x.global_shape[0], self.fi_sizes[j[1]]),
                )
            label = grid_block_name("affine_w", j)
            forward, adjoint = _parameter_kernels(x, label, with_bias)
            device = None if x is None else templates.affine_parameter_template(x, with_bias)
            steps.append(LocalStep(names, (self.partial_block(j),), forward, adjoint, label, device))
        local = local_stage(self.parameter_space, steps)
        reduce = self._reduction(local.range)
        return local if reduce is None else Composition((reduce, local))

    def scatter_parameters(
        self,
        weights: Any,
        bias: Any = None,
        *,
        held: Callable[[Partition], Iterable[Sequence[int]]] | None = None,
    ) -> dict[str, np.ndarray]:
        """A state of :attr:`parameter_space` from global W (and b); with ``held`` (a partition's
        grid indices a process holds: :meth:`~linop.frameworks.torch_placement.Placement.held`),
        only the blocks at those indices of the weights' and the bias' partitions."""
        return scatter_weights_and_bias("Affine", self.weights, self.bias, weights, bias, held)
