r"""Distributed losses: elementwise local terms, their sums reduced onto one worker
(docs/theory.md#layers).

A prediction x and a target t share one layout (any partition, any shares, empty ones
included). Each worker j sums its elementwise terms :math:`\ell(x, t)` into a partial
:math:`p_j`; the sum-reduce :math:`R` (a :class:`~linop.SumReduce` onto the root worker, an
operator tree that ``verify`` proves exactly) adds them, and the reduction's scale s gives the
loss on the root:

.. math::

    L = s\, R\, p, \qquad p_j = \sum_{\text{local}} \ell(x_j, t_j), \qquad
    s = 1 \;(\texttt{sum}), \; 1/|x| \;(\texttt{mean}, \text{the global count}), \;
    1/N \;(\texttt{batchmean}, \text{the global batch})

Its backward is the broadcast :math:`R^* = B` of the root's output gradient :math:`\bar L` to
every worker, then the local derivative: :math:`\bar x_j = s\, (B \bar L)_j\, \partial_x
\ell(x_j, t_j)`. With ``reduction="none"`` the loss is the elementwise terms on x's layout: no
communication.

The kinds, with torch's loss of the same semantics:

* ``l1`` (``L1Loss``): :math:`|x - t|`
* ``mse`` (``MSELoss``): :math:`(x - t)^2`
* ``poisson_nll`` (``PoissonNLLLoss``): :math:`e^x - t x` (``log_input``) or
  :math:`x - t \log(x + \epsilon)`; with ``full``, plus Stirling's
  :math:`t \log t - t + \frac12 \log 2\pi t` where :math:`t > 1`
* ``bce`` (``BCELoss``): :math:`-(t \log x + (1 - t) \log (1 - x))`, the logarithms clamped
  at -100
* ``bce_with_logits`` (``BCEWithLogitsLoss``): :math:`\max(x, 0) - x t + \log(1 + e^{-|x|})`
* ``kl_div`` (``KLDivLoss``): :math:`t (\log t - x)` (0 where t = 0), or :math:`e^t (t - x)`
  (``log_target``)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import numpy as np

from ..collectives import SumReduce
from ..layout import BlockGrid
from ..operator import LinearOperator
from ..partition import DistributedTensor, Partition
from ..space import grid_index
from .base import LayerError, require_tensor

__all__ = ["KINDS", "REDUCTIONS", "Loss", "elementwise", "elementwise_gradient"]

KINDS = ("l1", "mse", "poisson_nll", "bce", "bce_with_logits", "kl_div")
"""The losses, named as torch's functional losses without ``_loss``."""
REDUCTIONS = ("none", "sum", "mean", "batchmean")
"""``batchmean`` is KL divergence's only (as in torch)."""

_BCE_LOG_FLOOR = -100.0  # torch clamps BCE's logarithms here
_BCE_EPSILON = 1e-12  # torch's floor on x (1 - x) in BCE's derivative


def elementwise(kind: str, x: Any, t: Any, options: Mapping[str, Any], xp: ModuleType | None = None) -> Any:
    r"""The terms :math:`\ell(x, t)` of a loss kind, float: ONE table for every engine, written
    against the array namespace ``xp`` (numpy, the default; ``jax.numpy`` for the JAX
    functions, :func:`linop.frameworks.jax_losses.terms`), with ``where`` instead of masked
    assignment so that JAX traces and differentiates it."""
    xp = np if xp is None else xp
    if kind == "l1":
        return xp.abs(x - t)
    if kind == "mse":
        return (x - t) ** 2
    if kind == "poisson_nll":
        terms = xp.exp(x) - t * x if options["log_input"] else x - t * xp.log(x + options["eps"])
        if options["full"]:
            big = t > 1
            safe = xp.where(big, t, 2.0)  # Stirling's term only where t > 1 (no log of t <= 0)
            stirling = safe * xp.log(safe) - safe + 0.5 * xp.log(2 * np.pi * safe)
            terms = terms + xp.where(big, stirling, 0.0)
        return terms
    if kind == "bce":
        log_x = xp.maximum(xp.log(x), _BCE_LOG_FLOOR)
        log_1x = xp.maximum(xp.log1p(-x), _BCE_LOG_FLOOR)
        return -(t * log_x + (1 - t) * log_1x)
    if kind == "bce_with_logits":
        return xp.maximum(x, 0) - x * t + xp.log1p(xp.exp(-xp.abs(x)))
    if kind == "kl_div":
        if options["log_target"]:
            return xp.exp(t) * (t - x)
        nonzero = t != 0  # t log t, 0 where t = 0
        return xp.where(nonzero, t * xp.log(xp.where(nonzero, t, 1.0)), 0.0) - t * x
    raise LayerError(f"Loss: unknown kind {kind!r}; one of {KINDS}")


def elementwise_gradient(kind: str, x: np.ndarray, t: np.ndarray, options: Mapping[str, Any]) -> np.ndarray:
    r""":math:`\partial_x \ell(x, t)`, as torch's backward computes it (the sign's 0 at x = t,
    BCE's floored denominator)."""
    if kind == "l1":
        return np.sign(x - t)
    if kind == "mse":
        return 2 * (x - t)
    if kind == "poisson_nll":
        return np.exp(x) - t if options["log_input"] else 1 - t / (x + options["eps"])
    if kind == "bce":
        return (x - t) / np.maximum((1 - x) * x, _BCE_EPSILON)
    if kind == "bce_with_logits":
        return 1 / (1 + np.exp(-x)) - t
    if kind == "kl_div":
        return -np.exp(t) if options["log_target"] else -t
    raise LayerError(f"Loss: unknown kind {kind!r}; one of {KINDS}")


class Loss:
    r"""A distributed loss of a prediction and a target of one layout.

    Parameters
    ----------
    x : DistributedTensor
        The prediction's layout (the target has the same one), any partition.
    kind : str
        One of :data:`KINDS`.
    reduction : str
        ``"mean"`` (default: over the global count of entries), ``"sum"``, ``"none"`` or
        ``"batchmean"`` (``kl_div`` only: over the global batch, x's first extent).
    root : int, optional
        The worker that gets the loss (default the worker of x's first block).
    name : str
        The loss's block (``name[0,...]``, shape (1,), on the root), or with ``"none"`` the
        elementwise terms' tensor; the partial sums are ``name + "_part"``.
    log_input, full, eps : optional
        ``poisson_nll``'s options (torch's defaults True, False, 1e-8).
    log_target : bool
        ``kl_div``'s option (default False).

    Attributes
    ----------
    scale : float
        s: 1, 1 / the global count, or 1 / the global batch.
    partials : BlockGrid
        One (1,) block per worker of x's partition.
    total : BlockGrid
        The (1,) loss block on the root (partition (1, ..., 1)).
    y : DistributedTensor
        The elementwise terms' layout (``reduction="none"``).

    Raises
    ------
    LayerError
        For an unknown kind or reduction, ``batchmean`` with another kind, or options that
        belong to another kind.
    """

    layer = "Loss"

    def __init__(
        self,
        x: DistributedTensor,
        kind: str,
        *,
        reduction: str = "mean",
        root: int | None = None,
        name: str = "loss",
        log_input: bool = True,
        full: bool = False,
        eps: float = 1e-8,
        log_target: bool = False,
    ) -> None:
        self.x = require_tensor(self.layer, "x", x)
        if kind not in KINDS:
            raise LayerError(f"{self.layer}: unknown kind {kind!r}; one of {KINDS}")
        if reduction not in REDUCTIONS:
            raise LayerError(f"{self.layer}: unknown reduction {reduction!r}; one of {REDUCTIONS}")
        if reduction == "batchmean" and kind != "kl_div":
            raise LayerError(f"{self.layer}: reduction 'batchmean' is kl_div's only, not {kind!r}'s")
        if x.ndim == 0 and reduction == "batchmean":
            raise LayerError(f"{self.layer}: 'batchmean' needs a batch dimension; x has shape ()")
        if not isinstance(name, str) or not name or name == x.name:
            raise LayerError(
                f"{self.layer}: the loss's name must be a non-empty string other than x's, not {name!r}"
            )
        self.kind, self.reduction = kind, reduction
        self.options: dict[str, Any] = {
            "log_input": bool(log_input),
            "full": bool(full),
            "eps": float(eps),
            "log_target": bool(log_target),
        }
        p = x.partition
        self.root = p.worker((0,) * p.ndim) if root is None else int(root)
        if self.root < 0:
            raise LayerError(f"{self.layer}: the root worker must be >= 0, not {root!r}")
        count = math.prod(x.global_shape)
        if reduction == "sum" or reduction == "none":
            self.scale = 1.0
        elif reduction == "mean":
            self.scale = 1.0 / count if count else math.nan
        else:
            self.scale = 1.0 / x.global_shape[0] if x.global_shape[0] else math.nan
        self.name = name
        self.y = DistributedTensor(name, x.global_shape, p, sizes=x.sizes)
        self.partials = BlockGrid.uniform(f"{name}_part", p, (1,))  # described: no P shapes
        self.total = BlockGrid(name, Partition((1,) * p.ndim, (self.root,)), ((1,),))

    @property
    def total_name(self) -> str:
        """The loss's block on the root."""
        return self.total.block_name((0,) * self.x.ndim)

    @property
    def reduction_operator(self) -> LinearOperator:
        """R: the partial sums added onto the root (its adjoint, the broadcast of the output
        gradient, is the backward's only communication)."""
        return SumReduce(self.total, self.x.partition, self.partials.name)

    def partial_name(self, block: str) -> str:
        """The partial sum of x's block ``block``."""
        return self.partials.block_name(self._index(block))

    def output_name(self, block: str) -> str:
        """The elementwise terms' block (``reduction="none"``) of x's block ``block``."""
        return self.y.block_name(self._index(block))

    def _index(self, block: str) -> tuple[int, ...]:
        """The grid index of x's block named ``block``, read from the name (``x[1,2]``,
        :func:`~linop.space.grid_index`): no table of x's P names (a rank asks for its own)."""
        index = grid_index(block, self.x.name, self.x.partition.shape)
        if index is None:
            raise LayerError(f"{self.layer}: {block!r} is not a block of {self.x.name!r}")
        return index

    # -- in one process (the numpy interpreter) -------------------------------------------------
    def _pairs(self, x: Mapping[str, Any], target: Mapping[str, Any]):
        for b in self.x.blocks:
            xv, tv = np.asarray(x[b.name], dtype=float), np.asarray(target[b.name], dtype=float)
            if xv.shape != b.shape or tv.shape != b.shape:
                raise LayerError(
                    f"{self.layer}: block {b.name!r} has shapes {xv.shape} (input), {tv.shape} (target); "
                    f"expected {b.shape}"
                )
            yield b.name, xv, tv

    def value(self, x: Mapping[str, Any], target: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """The loss as a state: ``{total_name: (1,)}`` (the reduction's tree run by the numpy
        interpreter), or the elementwise terms on ``y`` with ``"none"``."""
        if self.reduction == "none":
            return {
                self.output_name(n): elementwise(self.kind, xv, tv, self.options)
                for n, xv, tv in self._pairs(x, target)
            }
        partials = {
            self.partial_name(n): np.atleast_1d(elementwise(self.kind, xv, tv, self.options).sum())
            for n, xv, tv in self._pairs(x, target)
        }
        total = self.reduction_operator(partials)
        return {name: self.scale * value for name, value in total.items()}

    def gradient(
        self, x: Mapping[str, Any], target: Mapping[str, Any], seed: Mapping[str, Any] | None = None
    ) -> dict[str, np.ndarray]:
        """The input gradient of x's blocks for the output gradient ``seed`` (a state of the
        loss block; default 1; with ``"none"`` a state of y, default ones): the seed broadcast
        by R*, times the scale and the local derivative."""
        pairs = list(self._pairs(x, target))
        if self.reduction == "none":
            seeds = {n: 1.0 if seed is None else np.asarray(seed[self.output_name(n)]) for n, _, _ in pairs}
        else:
            given = (
                {self.total_name: np.ones(1)}
                if seed is None
                else {self.total_name: np.asarray(seed[self.total_name])}
            )
            copies = self.reduction_operator.H(given)
            seeds = {n: copies[self.partial_name(n)][0] for n, _, _ in pairs}
        return {
            n: self.scale * seeds[n] * elementwise_gradient(self.kind, xv, tv, self.options)
            for n, xv, tv in pairs
        }
