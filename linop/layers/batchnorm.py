r"""Distributed batch normalization: per-channel statistics reduced exactly over the workers that
share a channel (docs/theory.md#layers).

x (N, C, S_0, ...) lies on any partition P_x = P_n x P_c x P_0 x ... (batch, channels and
features all cut, unevenly and with empty shares if wanted). The workers with one channel
index c form the group G(c) of :math:`|G|` workers; each worker j in it has a slot g(j) (its position
along the axes other than the channel's) and holds :math:`m_j` entries of each of its
channels (:math:`m = \sum_j m_j = N \prod_d S_d`, the global count). In training mode one
all-reduce :math:`A = \mathrm{AllReduce}(\cdot, \text{axes} \ne 1)` (an operator tree that
``verify`` proves exactly) of the *moments* blocks (:math:`2|G|` (+2) x c) gives every worker of the
group the local mean and biased variance of every worker's block, each in its own slot (the
others write zeros there, so the sum is a gather), and combines them as Chan et al.'s
parallel variance does:

.. math::

    \mu_j = \tfrac{1}{m_j} \sum_{\text{block } j} x, \quad
    v_j = \tfrac{1}{m_j} \sum_{\text{block } j} (x - \mu_j)^2, \qquad
    \mu = \tfrac1m \sum_j m_j \mu_j, \quad
    \sigma^2 = \tfrac1m \sum_j m_j \big(v_j + (\mu_j - \mu)^2\big),

    \hat x = (x - \mu)(\sigma^2 + \epsilon)^{-1/2}, \qquad y = w\, \hat x + b

(empty blocks, :math:`m_j = 0`, add nothing). No large sums of squares are subtracted (never
:math:`E[x^2] - \mu^2`): each :math:`v_j` is a centred second moment computed in two passes
over the worker's own block, and the between-block part squares differences of means, so the
variance keeps the accuracy of the two-pass formula (a relative error of order
:math:`\varepsilon\,|\mu| / \sigma`, not :math:`\varepsilon\,\mu^2 / \sigma^2`), in the input's own
dtype, with one collective instead of two. Its bytes grow with the group,
:math:`(2|G| + 2) \times c` per worker, so beyond :data:`GATHER_LIMIT` workers per group (or
with ``statistics="two_pass"``) the layer takes two all-reduces of O(c) instead, as accurate:
:math:`\mu = A(\sum_{\text{local}} x) / m` (:attr:`BatchNorm.totals_reduction`, θ riding along),
then :math:`\sigma^2 = A(\sum_{\text{local}} (x - \mu)^2) / m` (:attr:`BatchNorm.statistics_reduction`):
squares centred on the global mean (:attr:`BatchNorm.statistics_path`). The parameters :math:`\theta = (w; b)` (2 x C) live
on the owners, the workers :math:`P_x[0, c, 0, \dots]`, and reach the other workers by the
broadcast :math:`M = B_{P_\theta \to P_x}` (:attr:`BatchNorm.parameter_movement`). In a
training forward the broadcast rides in the same all-reduce: the owner writes θ into the
moments block's last two rows and the other workers zeros, and :math:`A` of that embedding is
:math:`M` (proven in the tests), so the whole forward is one collective. The backward pass
needs, per channel, the global sums

.. math::

    g = A \Big( \textstyle\sum_{\text{local}} \bar y\, \hat x,\; \sum_{\text{local}} \bar y \Big)
    = M M^{*} \tilde g, \qquad
    \bar x = w (\sigma^2 + \epsilon)^{-1/2}\Big(\bar y - \tfrac{g_1}{m} - \hat x\, \tfrac{g_0}{m}\Big)

where :math:`\tilde g` are the per-worker partial sums: the gradients of the parameter copies
:math:`\tilde\theta = M\theta`. Since the all-reduce over a channel group is :math:`M M^*` (the
copies' sum-reduce onto the owner, then its broadcast back; proven equal in the tests), one
all-reduce gives both what :math:`\bar x` needs and, on each owner, the parameter gradient
:math:`\bar\theta = M^* \tilde g` (the broadcast's adjoint: the gradients of the copies summed),
or on every worker the gradient :math:`M M^* \tilde g` of its copy when the parameters are
replicated (``BatchNormModule(..., replicate=True)``).
In evaluation mode (running statistics) :math:`\bar x = w\,\bar y\,(\sigma_r^2 + \epsilon)^{-1/2}`
needs no reduction, and :math:`\bar\theta = M^* \tilde g` is the sum-reduce
(:attr:`BatchNorm.parameter_gradient_reduction`).

The running statistics follow torch: :math:`r \leftarrow (1 - \alpha) r + \alpha s` with the
unbiased variance :math:`\sigma^2 m / (m - 1)`, :math:`\alpha` the momentum (None: the
cumulative average, :math:`1 / \text{batches seen}`).

The training Jacobian at a given input is itself a tree (:meth:`BatchNorm.jacobian`: local
kernels around the same all-reduce); its adjoint, derived by rules, is the input gradient. Its
kernels carry :func:`~linop.layers.templates.batch_norm_templates` (the saved :math:`\hat x`
and scale as each worker's parameters), so that on JAX devices
(:func:`~linop.frameworks.jax_sharded.sharded`) they run as one program on every device.

The algorithm (:meth:`BatchNorm.statistics`, :meth:`BatchNorm.normalized`,
:meth:`BatchNorm.input_gradient`) takes the blocks a process holds and a function that runs a
tree on them, so the numpy interpreter (:meth:`BatchNorm.forward`, :meth:`BatchNorm.backward`:
all workers in one process) and the torch module on MPI or torch.distributed
(:class:`linop.frameworks.torch_norm.BatchNormModule`) run the same steps; its local kernels
work on numpy arrays and torch tensors alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from ..collectives import AllReduce, Broadcast
from ..layout import BlockGrid, ProductShapes
from ..operator import LinearOperator
from ..partition import DistributedTensor, Partition, grid_block_name
from ..space import Block, Space, grid_index
from . import templates
from .base import LayerError, LocalStep, local_stage, require_shape, require_tensor, share_slices

__all__ = ["GATHER_LIMIT", "BatchNorm", "Saved", "statistics_path"]

Run = Callable[[LinearOperator, Mapping[str, Any]], Mapping[str, Any]]
"""Runs a tree on the blocks this process holds and returns its result blocks (the numpy
interpreter, or a torch function on MPI / torch.distributed)."""


def _reduced_axes(ndim: int) -> tuple[int, ...]:
    return (0, *range(2, ndim))


def _spread(values: Any, ndim: int) -> Any:
    """A per-channel vector (c,) as (1, c, 1, ...), to broadcast over a block."""
    return values.reshape((1, values.shape[-1], *(1,) * (ndim - 2)))


def local_moments(x: Any) -> tuple[Any, Any]:
    """The per-channel mean and biased variance (c,) of a non-empty block, numpy arrays and
    torch tensors alike: two passes, the mean then the mean of the centred squares (torch's
    ``var_mean`` over the batch and feature axes, a one-pass Welford reduction, is 10x slower
    on CPU for a block of 4 x 16 x 32 x 32 and no more accurate)."""
    axes = _reduced_axes(x.ndim)
    if isinstance(x, np.ndarray):
        mean = x.mean(axis=axes)
        centred = x - _spread(mean, x.ndim)
        return mean, (centred * centred).mean(axis=axes)
    mean = x.mean(axes)
    centred = x - _spread(mean, x.ndim)
    squares = centred.square_()  # a tensor of its own, of x's dtype
    return mean, squares.mean(axes)


def _channel_sums(x: Any) -> Any:
    """The per-channel sum (c,) of a block, numpy arrays and torch tensors alike."""
    axes = _reduced_axes(x.ndim)
    return x.sum(axis=axes) if isinstance(x, np.ndarray) else x.sum(axes)


def centred_squares(x: Any, mean: Any) -> Any:
    """The per-channel sum of squares about ``mean`` (c,) of a block, as a (1, c) row, numpy
    arrays and torch tensors alike (zeros for an empty block)."""
    axes = _reduced_axes(x.ndim)
    centred = x - _spread(mean, x.ndim)
    if isinstance(x, np.ndarray):
        return (centred * centred).sum(axis=axes).reshape(1, -1)
    return centred.square_().sum(axes).reshape(1, -1)  # a tensor of its own, of x's dtype


def _own(result: Any, *operands: Any) -> bool:
    """Whether ``result``, a tensor just computed here, may be changed in place by operations
    with ``operands``: of their dtype, so that in place gives what out of place gives (numpy
    arrays: never, to keep numpy's promotions as they are). Autograd tracks in-place operations
    (and refuses one on a tensor it saved)."""
    if isinstance(result, np.ndarray):
        return False
    return all(operand.dtype == result.dtype for operand in operands)


def _zeros(like: Any, shape: tuple[int, ...]) -> Any:
    """Zeros of ``shape`` in ``like``'s library, dtype (and device)."""
    if isinstance(like, np.ndarray):
        return np.zeros(shape, dtype=like.dtype)
    return like.new_zeros(shape)


def _column(like: Any, values: np.ndarray) -> Any:
    """``values`` (k,) as a (k, 1) column in ``like``'s library and dtype."""
    column = values.reshape(-1, 1)
    if isinstance(like, np.ndarray):
        return column.astype(like.dtype)
    return like.new_tensor(column)


def _shapes(partition: Partition, rows: int, channel_extents: tuple[Any, ...]) -> ProductShapes:
    """The shapes (rows, c_share) of a grid with one block per worker of ``partition``,
    described by their rule (no table of P shapes): ``rows`` as the extent of every coordinate
    of axis 0, the channel shares along axis 1."""
    extents = ((rows,) * partition.shape[0], *channel_extents[1:])
    return ProductShapes(partition.shape, extents)


GATHER_LIMIT = 16
r"""The largest channel group :math:`|G|` whose training statistics take the gather path (one
all-reduce of :math:`(2|G| + 2) \times c` per worker, :attr:`BatchNorm.moments_reduction`);
larger groups take the two-pass path (two all-reduces, :math:`3 \times c` and :math:`1 \times c`:
:attr:`BatchNorm.totals_reduction`, :attr:`BatchNorm.statistics_reduction`), whose bytes do not
grow with :math:`|G|`. Measured (a training step of ``BatchNormModule``, forward and backward,
float32, on 4 MPI ranks of a shared 2-core machine, x (4, c, 64, 64) on a (1, 1, a, b) grid of
:math:`|G| = ab` workers dealt blocked over the ranks; two-pass time over gather time, median
of 7-9 interleaved samples, two to three runs): c = 16: 1.06-1.23x at :math:`|G| = 4`,
1.10-1.16x at 16, 1.14x at 32, 0.98-1.09x at 64, 0.86-0.90x at 256; c = 128: 1.08x at 4,
1.06x at 16, 1.01x at 32, 0.95x at 64. The gather path wins up to 16 at both widths (its one
collective against two); beyond, the two-pass path's bytes, :math:`4c` entries per worker
whatever :math:`|G|`, win (see :func:`statistics_path`)."""

STATISTICS_PATHS = ("gather", "two_pass")


def statistics_path(group_size: int, statistics: str | None = None) -> str:
    r"""The training statistics' path of a layer whose channel groups have ``group_size``
    workers: ``statistics`` when given ("gather" or "two_pass"), else "gather" up to
    :data:`GATHER_LIMIT` workers and "two_pass" beyond. The same on every rank, from the
    layer's description alone (no communication).

    Raises
    ------
    LayerError
        ``statistics`` is neither None nor one of the two paths.
    """
    if statistics is None:
        return "gather" if group_size <= GATHER_LIMIT else "two_pass"
    if not isinstance(statistics, str) or statistics not in STATISTICS_PATHS:
        raise LayerError(f"BatchNorm: statistics must be None, 'gather' or 'two_pass', not {statistics!r}")
    return statistics


def gradient_partials(dy: Any, xhat: Any) -> Any:
    r"""The block's :math:`(\sum \bar y \hat x;\, \sum \bar y)` per channel, a (2, c) array: the
    gradient of its (w; b) copy."""
    axes = _reduced_axes(dy.ndim)
    rows = (dy * xhat).sum(axis=axes), dy.sum(axis=axes)
    if isinstance(dy, np.ndarray):
        return np.stack(rows)
    import torch  # only reached with torch tensors

    return torch.stack(rows)


def _lead_axes(array: np.ndarray, rank: int) -> tuple[int, tuple[int, ...]]:
    """For a block of ``rank`` dimensions that may carry leading probe axes: how many lead, and
    the axes a per-channel sum reduces (all of the block's but the channel's)."""
    lead = array.ndim - rank
    return lead, (lead, *range(lead + 2, array.ndim))


def _per_channel(values: np.ndarray, rank: int) -> np.ndarray:
    """(..., c) as (..., 1, c, 1, ...) against a block of ``rank`` dimensions."""
    return values.reshape((*values.shape[:-1], 1, values.shape[-1], *(1,) * (rank - 2)))


def _jacobian_kernels(saved: Saved | None, count: int, rank: int, block: str):
    r"""The two local kernels of the training Jacobian on one block:
    ``gather``: :math:`t \mapsto (t, (\sum t \hat x; \sum t))` and ``combine``:
    :math:`(t, g) \mapsto s (t - g_1 / m - \hat x g_0 / m)`, s = w (\sigma^2 + \epsilon)^{-1/2},
    with their adjoints (vectorized: leading probe axes pass through). Without ``saved`` (a
    block another process computes) they raise when called."""

    def operands() -> tuple[np.ndarray, np.ndarray]:
        if saved is None:
            raise LayerError(f"BatchNorm: the saved forward of block {block!r} was not given to jacobian()")
        scale = saved.rstd if saved.weight is None else saved.rstd * saved.weight
        return np.asarray(saved.xhat), np.asarray(scale)

    def sums(t: np.ndarray) -> np.ndarray:
        xhat, _ = operands()
        _, axes = _lead_axes(t, rank)
        return np.stack([(t * xhat).sum(axis=axes), t.sum(axis=axes)], axis=-2)

    def spread(g: np.ndarray, row: int) -> np.ndarray:
        return _per_channel(g[..., row, :], rank)

    def gather(t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return t, sums(t)

    def gather_adjoint(t: np.ndarray, g: np.ndarray) -> np.ndarray:
        xhat, _ = operands()
        return t + xhat * spread(g, 0) + spread(g, 1)

    def combine(t: np.ndarray, g: np.ndarray) -> np.ndarray:
        xhat, scale = operands()
        return _per_channel(scale, rank) * (t - spread(g, 1) / count - xhat * spread(g, 0) / count)

    def combine_adjoint(y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        _, scale = operands()
        u = _per_channel(scale, rank) * y
        return u, -sums(u) / count

    return (gather, gather_adjoint), (combine, combine_adjoint)


def _device_templates(saved: Saved | None, count: int) -> tuple[Any, Any]:
    """The JAX forms of a block's two Jacobian kernels (:func:`~.templates.batch_norm_templates`:
    one program on every JAX device, each worker's saved values its parameters), where its
    saved forward is on the host (numpy; a torch module's tensors are not), else (None, None)."""
    if saved is None or not all(
        isinstance(v, np.ndarray | np.generic) for v in (saved.xhat, saved.rstd) if v is not None
    ):
        return None, None
    if saved.weight is not None and not isinstance(saved.weight, np.ndarray | np.generic):
        return None, None
    scale = saved.rstd if saved.weight is None else saved.rstd * saved.weight
    return templates.batch_norm_templates(saved.xhat, np.asarray(scale), count)


@dataclass(frozen=True)
class _BlockNames:
    """What goes with one block of x (and the y block of the same index): its grid index,
    the names of its y, moments, totals, partial sums, parameter copy and parameter (the
    owner's; None without affine) blocks, the moments and totals blocks' shapes, its slot in
    the channel group and the shape (1, c, 1, ...) that spreads a per-channel vector over it."""

    index: tuple[int, ...]
    y: str
    moments: str
    moments_shape: tuple[int, ...]
    totals: str
    totals_shape: tuple[int, ...]
    sums: str
    copy: str
    theta: str | None
    slot: int
    spread: tuple[int, ...]


@dataclass(frozen=True)
class Saved:
    """What the forward of one block keeps for its backward: the normalized block, the
    per-channel :math:`(\\sigma^2 + \\epsilon)^{-1/2}` and weights (None without affine)."""

    xhat: Any
    rstd: Any
    weight: Any


class BatchNorm:
    r"""Distributed batch normalization over (N, C, S_0, ...) with any partition of batch,
    channels and features (0 to 3 feature dimensions for torch's ``BatchNorm{1,2,3}d``; the
    description takes any number).

    Parameters
    ----------
    x : DistributedTensor
        The input (N, C, ...) on P_x (any shares, empty ones included).
    eps : float
        Added to the variance (torch's default 1e-5).
    momentum : float or None
        The running statistics' factor (torch's default 0.1; None: cumulative average).
    affine : bool
        Whether the layer has the learnable (w; b), held by the owners P_x[0, c, 0, ...].
    track_running_stats : bool
        Whether it keeps running statistics (without them, batch statistics in both modes).
    name : str
        The output's name; the parameters are ``name + "_theta"`` (rows w, b), their copies
        ``name + "_theta_copy"``, the statistics' blocks ``name + "_moments"`` (gather path),
        ``name + "_totals"`` and ``name + "_sums"`` (two-pass path).
    statistics : {None, "gather", "two_pass"}
        How a training forward reduces the statistics: "gather" (one all-reduce of the
        moments blocks, :math:`(2|G| + 2) \times c` per worker), "two_pass" (an all-reduce of the totals
        blocks, 3 x c, then one of the centred sums of squares, 1 x c); None (default): the
        rule :func:`statistics_path` (gather up to :data:`GATHER_LIMIT` workers per group).

    Attributes
    ----------
    x, y : DistributedTensor
        Input and output (y has x's partition and shares).
    count : int
        m, the number of entries of one channel (N times the features).
    channel_sizes : tuple of int
        The channels' shares over P_c.
    owners : Partition
        1 x P_c x 1 ...: the workers that hold the parameters (and the root of each group).
    parameters : BlockGrid or None
        θ = (w; b), block (2, c_share) on each owner.
    copies : BlockGrid
        (2, c_share) on every worker of P_x: the parameters' copies, and in the backward the
        gradients of those copies.
    sums : BlockGrid
        (1, c_share) on every worker: the statistics' partial sums of squares about the mean
        (the two-pass path's second reduction :attr:`statistics_reduction`; the JAX function
        runs it for both of its passes).
    totals : BlockGrid
        (3, c_share) on every worker (1 without affine): the two-pass path's first blocks, row
        0 the block's per-channel sum, rows 1-2 θ (the owner's; zeros elsewhere). Reduced by
        :attr:`totals_reduction`.
    group_size : int
        :math:`|G|`, the workers of one channel group (the product of P_x's axes but the channel's).
    statistics_path : str
        "gather" or "two_pass": the path the training statistics take (the ``statistics``
        argument, or the rule :func:`statistics_path`).
    slot_counts : tuple of int
        :math:`m_j` of the worker in each slot of a group (the same for every group; built
        when first asked for).
    moments : BlockGrid
        (:math:`2|G| + 2`, c_share) on every worker (:math:`2|G|` without affine): rows ``g`` and
        ``n + g`` (n = :math:`|G|`) the mean and variance of the block in slot g, the last two θ (the
        owner's; zeros elsewhere). Reduced by :attr:`moments_reduction` (built when first
        asked for).

    Raises
    ------
    LayerError
        If x has fewer than 2 dimensions, eps is not positive, momentum not in [0, 1] or
        ``statistics`` not None, "gather" or "two_pass".
    """

    layer = "BatchNorm"

    def __init__(
        self,
        x: DistributedTensor,
        *,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        name: str = "y",
        statistics: str | None = None,
    ) -> None:
        self.x = require_tensor(self.layer, "x", x)
        if x.ndim < 2:
            raise LayerError(
                f"{self.layer}: x {x.global_shape} needs (batch, channel, features...) dimensions"
            )
        if not (isinstance(eps, (int, float)) and eps > 0):
            raise LayerError(f"{self.layer}: eps must be a positive number, not {eps!r}")
        if momentum is not None and not (isinstance(momentum, (int, float)) and 0 <= momentum <= 1):
            raise LayerError(f"{self.layer}: momentum must be None or in [0, 1], not {momentum!r}")
        if not isinstance(name, str) or not name or name == x.name:
            raise LayerError(
                f"{self.layer}: the output's name must be a non-empty string other than x's, not {name!r}"
            )
        self.eps, self.momentum = float(eps), None if momentum is None else float(momentum)
        self.affine, self.track_running_stats = bool(affine), bool(track_running_stats)
        self.dims = x.ndim - 2
        self.name = name
        p = x.partition
        self.count = x.global_shape[0] * math.prod(x.global_shape[2:])
        self.channels = x.global_shape[1]
        self.channel_sizes = x.sizes[1]
        self.reduce_axes = tuple(a for a in range(x.ndim) if a != 1)
        self.y = DistributedTensor(name, x.global_shape, p, sizes=x.sizes)
        rest = (0,) * self.dims
        self.owners = Partition(
            (1, p.shape[1], *(1,) * self.dims), tuple(p.worker((0, c, *rest)) for c in range(p.shape[1]))
        )
        self.parameters = (
            BlockGrid(f"{name}_theta", self.owners, tuple((2, s) for s in self.channel_sizes))
            if self.affine
            else None
        )
        channel_extents = (None, self.channel_sizes, *(None,) * self.dims)
        self.copies = BlockGrid(f"{name}_theta_copy", p, _shapes(p, 2, channel_extents))
        self.sums = BlockGrid(f"{name}_sums", p, _shapes(p, 1, channel_extents))
        others = tuple(s for a, s in enumerate(p.shape) if a != 1)
        self.group_size = math.prod(others)
        self._slot_strides = tuple(math.prod(others[k + 1 :]) for k in range(len(others)))
        self._moment_rows = 2 * self.group_size + (2 if self.affine else 0)
        self._total_rows = 1 + (2 if self.affine else 0)
        self._channel_extents = channel_extents
        self.statistics_path = statistics_path(self.group_size, statistics)

    @cached_property
    def slot_counts(self) -> tuple[int, ...]:
        """:math:`m_j` of the worker in each slot of a group (the same for every group): the
        products of x's shares along the axes other than the channel's, in C order
        (:math:`O(|G|)`, built when first asked for: by the gather path only)."""
        counts = np.ones(1, dtype=np.int64)
        for a in (0, *range(2, self.x.ndim)):
            counts = np.multiply.outer(counts, np.asarray(self.x.sizes[a], dtype=np.int64)).ravel()
        return tuple(int(n) for n in counts)

    @cached_property
    def moments(self) -> BlockGrid:
        """(:math:`2|G| + 2`, c_share) on every worker (:math:`2|G|` without affine): the gather
        path's blocks (built when first asked for)."""
        p = self.x.partition
        return BlockGrid(f"{self.name}_moments", p, _shapes(p, self._moment_rows, self._channel_extents))

    @cached_property
    def totals(self) -> BlockGrid:
        """(3, c_share) on every worker (1 without affine): the two-pass path's first blocks,
        row 0 the block's per-channel sum, rows 1-2 θ from its owner (zeros elsewhere)."""
        p = self.x.partition
        return BlockGrid(f"{self.name}_totals", p, _shapes(p, self._total_rows, self._channel_extents))

    # -- the trees -------------------------------------------------------------------------------
    @cached_property
    def statistics_reduction(self) -> LinearOperator:
        """The all-reduce of the (1, c) partial sums over each channel group: the two-pass
        path's second collective (the centred sums of squares about the global mean), and
        both passes of the JAX function (:func:`linop.frameworks.jax_norm.batch_norm`)."""
        return AllReduce(self.sums, self.reduce_axes)

    @cached_property
    def totals_reduction(self) -> LinearOperator:
        r"""The all-reduce of the totals blocks over each channel group: the two-pass path's
        first collective (the per-channel sums, and θ from its owner: rows 1-2 are then
        :math:`M \theta`)."""
        return AllReduce(self.totals, self.reduce_axes)

    @cached_property
    def moments_reduction(self) -> LinearOperator:
        r"""The all-reduce of the moments blocks over each channel group: the gather path's
        one collective of a training forward (every slot's local mean and variance, and θ from
        its owner)."""
        return AllReduce(self.moments, self.reduce_axes)

    @property
    def statistics_trees(self) -> tuple[LinearOperator, ...]:
        """The trees a training forward runs for its statistics, in order: the moments'
        all-reduce (gather path), or the totals' and the partial sums' (two-pass path)."""
        if self.statistics_path == "gather":
            return (self.moments_reduction,)
        return (self.totals_reduction, self.statistics_reduction)

    @cached_property
    def gradient_reduction(self) -> LinearOperator:
        r"""The all-reduce of the copies' gradients :math:`\tilde g` (2, c) over each channel
        group, :math:`M M^*` (the training backward)."""
        return AllReduce(self.copies, self.reduce_axes)

    @cached_property
    def parameter_movement(self) -> LinearOperator:
        r""":math:`M`: the owners' (w; b) broadcast to every worker of their channel group.

        Raises
        ------
        LayerError
            Without affine parameters.
        """
        if self.parameters is None:
            raise LayerError(f"{self.layer}: built with affine=False, it has no parameters to move")
        return Broadcast(self.parameters, self.x.partition, self.copies.name)

    @cached_property
    def parameter_gradient_reduction(self) -> LinearOperator:
        r""":math:`M^*`: the copies' gradients summed onto the owners (the evaluation backward)."""
        return self.parameter_movement.H

    @property
    def parameter_space(self) -> Space:
        """The parameters' blocks (empty without affine)."""
        return Space(()) if self.parameters is None else self.parameters.space

    def index(self, block: str) -> tuple[int, ...]:
        """The grid index of a block of x or y, read from its name (``x[0,1,...]``: no table
        of the P blocks).

        Raises
        ------
        LayerError
            For a name that is no block of x or y.
        """
        found = grid_index(block, self.x.name, self.x.partition.shape)
        if found is None:
            found = grid_index(block, self.y.name, self.x.partition.shape)
        if found is None:
            raise LayerError(f"{self.layer}: {block!r} is not a block of {self.x.name!r} or {self.y.name!r}")
        return found

    def slot(self, index: tuple[int, ...]) -> int:
        """The slot in its channel group of the block at grid ``index``: the C-order position
        of its index along the axes other than the channel's (closed form)."""
        rest = (index[0], *index[2:])
        return sum(k * stride for k, stride in zip(rest, self._slot_strides))

    def _names(self, block: str) -> _BlockNames:
        """The names and shapes that go with a block of x or y (worked out once per block, when
        first asked for: a training step derives none of them, and a process works out only
        those of the blocks it holds).

        Raises
        ------
        LayerError
            For a name that is no block of x or y.
        """
        table: dict[str, _BlockNames] = self.__dict__.setdefault("_names_table", {})
        found = table.get(block)
        if found is None:
            j = self.index(block)
            c = self.channel_sizes[j[1]]
            shape = tuple(self.x.sizes[a][k] for a, k in enumerate(j))
            found = _BlockNames(
                index=j,
                y=self.y.block_name(j),
                moments=grid_block_name(f"{self.name}_moments", j),
                moments_shape=(self._moment_rows, c),
                totals=grid_block_name(f"{self.name}_totals", j),
                totals_shape=(self._total_rows, c),
                sums=self.sums.block_name(j),
                copy=self.copies.block_name(j),
                theta=None if self.parameters is None else grid_block_name(self.parameters.name, j),
                slot=self.slot(j),
                spread=(1, shape[1], *(1,) * (len(shape) - 2)),
            )
            table[self.x.block_name(j)] = table[found.y] = found
        return found

    def _count_column(self, like: Any) -> Any:
        """The slots' counts :math:`m_j` as a (:math:`|G|`, 1) column in ``like``'s library, dtype and
        device (made once for each)."""
        cache: dict[Any, Any] = self.__dict__.setdefault("_count_columns", {})
        numpy = isinstance(like, np.ndarray)
        key = like.dtype if numpy else (like.dtype, like.device)
        column = cache.get(key)
        if column is None:
            column = cache[key] = _column(like, np.array(self.slot_counts, dtype=float))
        return column

    def channel(self, block: str) -> int:
        """The channel index (along P_c) of a block of x or y."""
        return self.index(block)[1]

    def copy_name(self, block: str) -> str:
        """The name of the parameter copy (and of its gradient) of x's block ``block``."""
        return self._names(block).copy

    def moments_name(self, block: str) -> str:
        """The name of the moments block of x's block ``block``."""
        return self._names(block).moments

    def sums_name(self, block: str) -> str:
        """The name of the statistics' partial sums of x's block ``block``."""
        return self._names(block).sums

    def totals_name(self, block: str) -> str:
        """The name of the two-pass path's totals block of x's block ``block``."""
        return self._names(block).totals

    def owner_copy(self, parameter_block: str) -> str:
        """The copy that lies on the owner of the parameter block ``name[0,c,0,...]`` (the
        copy of the same grid index)."""
        assert self.parameters is not None
        index = parameter_block[len(self.parameters.name) :]
        return self.copies.name + index

    # -- the algorithm on the blocks a process holds --------------------------------------------
    def local_moments(
        self, x: Mapping[str, Any], parameters: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """The moments block of each given block of x (by moments name): its per-channel mean
        and biased variance in its slot's rows (nothing for an empty block), zeros in the
        other slots, and in the last two rows the parameter block (w; b) of the same worker
        when ``parameters`` (by parameter block name) holds it: an owner's, else zeros."""
        groups = self.group_size
        state = {}
        for n, v in x.items():
            names = self._names(n)
            block = _zeros(v, names.moments_shape)
            slot = names.slot
            if self.slot_counts[slot] and v.shape[1]:
                mean, variance = local_moments(v)
                block[slot] = mean
                block[groups + slot] = variance
            if parameters is not None and names.theta is not None:
                theta = parameters.get(names.theta)
                if theta is not None:
                    block[2 * groups :] = theta
            state[names.moments] = block
        return state

    def combined(self, moments: Any) -> tuple[Any, Any]:
        r"""A channel group's mean and biased variance (c,) from its all-reduced moments block:
        :math:`\mu = \sum_j m_j \mu_j / m`, :math:`\sigma^2 = \sum_j m_j (v_j + (\mu_j - \mu)^2) / m`."""
        groups = self.group_size
        counts = self._count_column(moments)
        means, variances = moments[:groups], moments[groups : 2 * groups]
        mean = (counts * means).sum(axis=0) / self.count
        apart = means - mean
        variance = (counts * (variances + apart * apart)).sum(axis=0) / self.count
        return mean, variance

    def local_totals(
        self, x: Mapping[str, Any], parameters: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """The totals block of each given block of x (by totals name): its per-channel sum in
        row 0 (zeros for an empty block), and in rows 1-2 the parameter block (w; b) of the
        same worker when ``parameters`` (by parameter block name) holds it: an owner's, else
        zeros."""
        state = {}
        for n, v in x.items():
            names = self._names(n)
            block = _zeros(v, names.totals_shape)
            block[0] = _channel_sums(v)
            if parameters is not None and names.theta is not None:
                theta = parameters.get(names.theta)
                if theta is not None:
                    block[1:] = theta
            state[names.totals] = block
        return state

    def statistics(
        self, x: Mapping[str, Any], run: Run, parameters: Mapping[str, Any] | None = None
    ) -> tuple[dict[str, tuple[Any, Any]], dict[str, Any] | None]:
        """The global mean and biased variance (c,) of each given block's channel group, by
        the layer's :attr:`statistics_path`: one all-reduce of the moments blocks
        (:attr:`moments_reduction`), or two (:attr:`totals_reduction`, then
        :attr:`statistics_reduction`); with ``parameters`` (this process's parameter blocks by
        name) also the parameter copies of the given blocks (by copy name), moved in the
        (first) all-reduce; else None.

        Raises
        ------
        LayerError
            When a channel has fewer than 2 entries (torch's "expected more than 1 value per
            channel").
        """
        if self.count < 2:
            raise LayerError(
                f"{self.layer}: expected more than 1 value per channel when training, x has shape "
                f"{self.x.global_shape}"
            )
        if self.statistics_path == "two_pass":
            return self._two_pass_statistics(x, run, parameters)
        reduced = run(self.moments_reduction, self.local_moments(x, parameters))
        statistics = {}
        copies: dict[str, Any] | None = None
        if parameters is not None and self.parameters is not None:
            copies = {}
        rows = 2 * self.group_size
        for n in x:
            names = self._names(n)
            moments = reduced[names.moments]
            statistics[n] = self.combined(moments)
            if copies is not None:
                copies[names.copy] = moments[rows:]
        return statistics, copies

    def _two_pass_statistics(
        self, x: Mapping[str, Any], run: Run, parameters: Mapping[str, Any] | None
    ) -> tuple[dict[str, tuple[Any, Any]], dict[str, Any] | None]:
        r""":meth:`statistics` in two all-reduces of O(c) each, whatever :math:`|G|`:
        :math:`\mu = A(\sum_{\text{local}} x) / m` (θ riding in the same all-reduce), then
        :math:`\sigma^2 = A(\sum_{\text{local}} (x - \mu)^2) / m`: the centred squares about the
        global mean, never :math:`E[x^2] - \mu^2`."""
        first = run(self.totals_reduction, self.local_totals(x, parameters))
        copies: dict[str, Any] | None = None
        if parameters is not None and self.parameters is not None:
            copies = {}
        means, squares = {}, {}
        for n, v in x.items():
            names = self._names(n)
            totals = first[names.totals]
            mean = totals[0] / self.count
            means[n] = mean
            squares[names.sums] = centred_squares(v, mean)
            if copies is not None:
                copies[names.copy] = totals[1:]
        second = run(self.statistics_reduction, squares)
        statistics = {n: (mean, second[self._names(n).sums][0] / self.count) for n, mean in means.items()}
        return statistics, copies

    def normalized(
        self,
        x: Mapping[str, Any],
        statistics: Mapping[str, tuple[Any, Any]],
        copies: Mapping[str, Any] | None,
    ) -> tuple[dict[str, Any], dict[str, Saved]]:
        """y for each given block from its channel's (mean, variance) and its parameter copy
        (``copies`` by copy name; None without affine), and what the backward keeps."""
        outputs, saved = {}, {}
        for n, v in x.items():
            names = self._names(n)
            spread = names.spread if v.shape[1] == names.spread[1] else (1, v.shape[1], *names.spread[2:])
            mean, var = statistics[n]
            rstd = (var + self.eps) ** -0.5
            xhat = v - mean.reshape(spread)
            weight = None
            if _own(xhat, rstd):  # the same operations, in place on a tensor of its own
                xhat.mul_(rstd.reshape(spread))
            else:
                xhat = xhat * rstd.reshape(spread)
            y = xhat
            if copies is not None:
                theta = copies[names.copy]
                weight = theta[0]
                y = xhat * weight.reshape(spread)
                if _own(y, theta):
                    y.add_(theta[1].reshape(spread))
                else:
                    y = y + theta[1].reshape(spread)
            outputs[names.y] = y
            saved[n] = Saved(xhat, rstd, weight)
        return outputs, saved

    def input_gradient(
        self, dy: Mapping[str, Any], saved: Mapping[str, Saved], *, batch_statistics: bool, run: Run
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        r"""The input gradient of each block (``dy`` by x's block names) and the gradients of
        the parameter copies: reduced over the channel groups (:math:`M M^*\tilde g`, training)
        or the local partials :math:`\tilde g` (evaluation), by copy name."""
        partials = {self._names(n).copy: gradient_partials(g, saved[n].xhat) for n, g in dy.items()}
        if not batch_statistics:
            gradients = {}
            for n, g in dy.items():
                s = saved[n]
                scale = s.rstd if s.weight is None else s.rstd * s.weight
                gradients[n] = g * _spread(scale, g.ndim)
            return gradients, partials
        totals = run(self.gradient_reduction, partials)
        gradients = {}
        for n, g in dy.items():
            s = saved[n]
            names = self._names(n)
            spread = names.spread if g.shape[1] == names.spread[1] else (1, g.shape[1], *names.spread[2:])
            total = totals[names.copy]
            scale = s.rstd if s.weight is None else s.rstd * s.weight
            shift, slope = (total[1] / self.count).reshape(spread), (total[0] / self.count).reshape(spread)
            centred = g - shift
            if _own(centred, s.xhat, slope, scale):  # the same operations, in place
                gradients[n] = centred.sub_(s.xhat * slope).mul_(scale.reshape(spread))
            else:
                gradients[n] = (centred - s.xhat * slope) * scale.reshape(spread)
        return gradients, dict(totals)

    def running_factor(self, batches: int) -> float:
        """The weight of a new batch in the running statistics after ``batches`` training
        batches (this one included): the momentum, or 1 / batches (cumulative)."""
        return 1.0 / batches if self.momentum is None else self.momentum

    def updated_running(
        self, running: tuple[Any, Any], batch: tuple[Any, Any], factor: float
    ) -> tuple[Any, Any]:
        """``(mean, var)`` running statistics after a batch of biased statistics ``batch``:
        torch's update, with the unbiased variance var * m / (m - 1)."""
        mean, var = batch
        unbiased = self._unbiased(var)
        return (1 - factor) * running[0] + factor * mean, (1 - factor) * running[1] + factor * unbiased

    def _unbiased(self, var: Any) -> Any:
        """The unbiased variance of biased batch statistics ``var``: var * m / (m - 1)."""
        return var * (self.count / (self.count - 1))

    def update_running_in_place(
        self, running: tuple[Any, Any], batch: tuple[Any, Any], factor: float
    ) -> None:
        """:meth:`updated_running` written into the ``running`` (mean, var) tensors, the same
        operations in the same order (for tensors of one dtype, untracked by autograd)."""
        mean, var = batch
        unbiased = self._unbiased(var)
        for value, new in zip(running, (mean, unbiased)):
            value.mul_(1 - factor).add_(factor * new)

    # -- the whole layer in one process (the numpy interpreter) ---------------------------------
    def scatter_parameters(self, weight: Any = None, bias: Any = None) -> dict[str, np.ndarray]:
        """A state of the parameter blocks from global w and b (C,) (defaults: ones and
        zeros, torch's initialization)."""
        if self.parameters is None:
            return {}
        c = self.channels
        w = np.ones(c) if weight is None else require_shape(self.layer, "weight", weight, (c,))
        b = np.zeros(c) if bias is None else require_shape(self.layer, "bias", bias, (c,))
        theta = np.stack([w, b])
        return {
            self.parameters.block_name((0, k, *(0,) * self.dims)): np.array(theta[:, part])
            for k, part in enumerate(share_slices(self.channel_sizes))
        }

    def gather_parameters(self, state: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray]:
        """Global (w, b) from a state of the parameter blocks."""
        if self.parameters is None:
            raise LayerError(f"{self.layer}: built with affine=False, it has no parameters")
        blocks = [
            np.asarray(state[self.parameters.block_name((0, k, *(0,) * self.dims))])
            for k in range(len(self.channel_sizes))
        ]
        theta = np.concatenate(blocks, axis=1)
        return theta[0], theta[1]

    def forward(
        self,
        x: Mapping[str, Any],
        parameters: Mapping[str, Any] | None = None,
        *,
        training: bool = True,
        running: tuple[np.ndarray, np.ndarray] | None = None,
        batches: int = 1,
    ) -> tuple[dict[str, Any], dict[str, Saved], tuple[np.ndarray, np.ndarray] | None]:
        """The layer on a whole state of x, every tree run by the numpy interpreter: y, what
        the backward keeps, and the running statistics (global (C,) mean and var) after the
        call (``running`` as given in evaluation; None when neither tracked nor given).

        ``batches`` counts the training batches including this one (for momentum=None).

        Raises
        ------
        LayerError
            Evaluation with tracked statistics but no ``running`` given.
        """
        x = {b.name: x[b.name] for b in self.x.blocks}
        given = None
        if self.parameters is not None:
            given = dict(self.scatter_parameters() if parameters is None else parameters)

        def run(op: LinearOperator, state: Mapping[str, Any]) -> Mapping[str, Any]:
            return op(dict(state))

        slices = share_slices(self.channel_sizes)
        if training or not self.track_running_stats:
            statistics, copies = self.statistics(x, run, given)
            if self.track_running_stats and running is not None:
                mean, var = np.array(running[0], dtype=float), np.array(running[1], dtype=float)
                done: set[int] = set()
                for n, batch in statistics.items():
                    c = self.channel(n)
                    if c not in done:
                        done.add(c)
                        m, v = self.updated_running(
                            (mean[slices[c]], var[slices[c]]), batch, self.running_factor(batches)
                        )
                        mean[slices[c]], var[slices[c]] = m, v
                running = (mean, var)
        else:
            if running is None:
                raise LayerError(
                    f"{self.layer}: evaluation with running statistics needs running=(mean, var)"
                )
            statistics = {
                n: (running[0][slices[self.channel(n)]], running[1][slices[self.channel(n)]]) for n in x
            }
            copies = None if given is None else self.parameter_movement(given)
        y, saved = self.normalized(x, statistics, copies)
        return y, saved, running

    def jacobian(self, saved: Mapping[str, Saved]) -> LinearOperator:
        r"""The Jacobian of the training forward at the input whose :meth:`forward` kept
        ``saved`` (batch statistics), as an operator tree x -> y: per worker a local kernel
        :math:`t_j \mapsto (t_j, \tilde g_j)`, the all-reduce of the :math:`\tilde g` over the
        channel groups (:attr:`gradient_reduction`), and a local kernel
        :math:`(t_j, g_j) \mapsto w (\sigma^2 + \epsilon)^{-1/2} (t_j - g_1/m - \hat x_j g_0/m)`.

        Its adjoint, derived by rules (the kernels' adjoints, the all-reduce's self-adjointness),
        is the input gradient of :meth:`backward`; ``verify`` checks the kernels' adjoints. Under
        MPI the blocks a process holds are enough in ``saved``: a kernel whose block is missing
        raises :class:`LayerError` when it runs.

        The same tree on either statistics path: it reads the saved forward, not how its
        statistics were reduced, and its one all-reduce is the :math:`2 \times c` one of the
        backward. It is a tree over all P workers (for proofs: built in O(P)).
        """
        tangent = f"{self.name}_tangent"
        first, last = [], []
        for j in self.x.partition.indices():
            block = self.x.block(j)
            (gather, gather_adjoint), (combine, combine_adjoint) = _jacobian_kernels(
                saved.get(block.name), self.count, self.x.ndim, block.name
            )
            copy = self.copies.block(j)
            t = Block(grid_block_name(tangent, j), block.shape, block.worker)
            device = _device_templates(saved.get(block.name), self.count)
            first.append(
                LocalStep(
                    (block.name,), (t, copy), gather, gather_adjoint, grid_block_name("bn_sums", j), device[0]
                )
            )
            y = self.y.block(j)
            last.append(
                LocalStep(
                    (t.name, copy.name),
                    (y,),
                    combine,
                    combine_adjoint,
                    grid_block_name("bn_jac", j),
                    device[1],
                )
            )
        spread = local_stage(self.x.space, first)
        others = Space(b for b in spread.range if not b.name.startswith(f"{self.copies.name}["))
        reduce = AllReduce(self.copies, self.reduce_axes, others=others)
        return local_stage(reduce.range, last) @ reduce @ spread

    def backward(
        self, dy: Mapping[str, Any], saved: Mapping[str, Saved], *, training: bool = True
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The input gradient (by x's block names) and the parameter gradient (by parameter
        block, empty without affine) of a :meth:`forward` with ``training``, from ``dy`` by
        y's block names, every tree run by the numpy interpreter."""
        by_x = {self.x.block_name(self.index(n)): g for n, g in dy.items()}

        def run(op: LinearOperator, state: Mapping[str, Any]) -> Mapping[str, Any]:
            return op(dict(state))

        batch = training or not self.track_running_stats
        dx, copies = self.input_gradient(by_x, saved, batch_statistics=batch, run=run)
        if self.parameters is None:
            return dx, {}
        if batch:  # the all-reduced sums: each owner's copy is M* of the partials
            return dx, {n: copies[self.owner_copy(n)] for n in self.parameters.space.names}
        return dx, dict(self.parameter_gradient_reduction(copies))
