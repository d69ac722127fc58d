r"""Outer-product gradients across sites (dAD) as operators (docs/theory.md#outer-product-gradients).

A dense layer's weight gradient over S sites, each holding activations :math:`A_s` (N x h_i)
and output deltas :math:`D_s` (N x h_{i+1}), is

.. math::

    G = \sum_s A_s^T D_s = [A_1; \dots; A_S]^T [D_1; \dots; D_S].

For fixed activations both sides are linear maps of the deltas D, built here as trees:

* :func:`allreduce_gradient`: every site's local product (a :class:`~linop.local.LocalOperator`
  ``D_s -> A_s^T D_s``), then an :class:`~linop.AllReduce` of the h_i x h_{i+1} gradients;
* :func:`gathered_gradient`: an :class:`~linop.AllGather` of the deltas (and, counted beside it
  by :func:`factor_gather`, of the activations), then the product of the gathered factors on
  every site.

``verify.equal`` proves them the same operator (exactly, for integer activations).
:func:`traffic` counts from a tree what each site sends to other workers; a site contributes
h_i h_{i+1} values to the all-reduce and N (h_i + h_{i+1}) to the gathers, so gathering is
cheaper when :func:`crossover` ``= h_i h_{i+1} / (h_i + h_{i+1}) > N``.

:func:`rank_dad` is the rank-r variant: a structured (block) power iteration for the top-r
subspace of G that never forms G, each step all-reducing an h_i x r or h_{i+1} x r block, so
a site sends at most r (h_i + h_{i+1}) values per iteration; its relative error is reported
against the best rank-r error (Eckart-Young).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from .. import AllGather, AllReduce, BlockGrid
from ..local import LocalKernel, LocalOperator
from ..movement import Copy, CopyAdjoint, Move
from ..operator import Composition, LinearOperator
from ..partition import DistributedTensor, Partition
from ..primitives import Add
from ..space import Block, Region
from .base import LayerError

__all__ = [
    "RankDadResult",
    "Traffic",
    "allreduce_gradient",
    "crossover",
    "deltas",
    "factor_gather",
    "gathered_gradient",
    "gradient_layout",
    "rank_dad",
    "traffic",
]


def deltas(sites: int, samples: int, width: int, *, name: str = "D") -> DistributedTensor:
    """The deltas D = [D_1; ...; D_S]: (S N) x h_{i+1}, site s holding rows s N .. (s+1) N on
    worker s."""
    return DistributedTensor(name, (sites * samples, width), Partition((sites, 1)))


def gradient_layout(sites: int, shape: tuple[int, int], *, name: str = "G") -> BlockGrid:
    """One h_i x h_{i+1} gradient block per site (``G[s]`` on worker s)."""
    return BlockGrid.uniform(name, Partition((sites,)), shape)


def _product_kernel(a: np.ndarray) -> LocalKernel:
    a = np.array(a, copy=True)
    a.flags.writeable = False

    def forward(d: np.ndarray) -> np.ndarray:
        return np.einsum("ni,...nj->...ij", a, d)

    def adjoint(g: np.ndarray) -> np.ndarray:
        return np.einsum("ni,...ij->...nj", a.conj(), g)

    return LocalKernel.of(forward=forward, adjoint=adjoint, vectorized=True)


def _check(activations: Sequence[np.ndarray], d: DistributedTensor) -> tuple[int, int, int]:
    sites = d.partition.shape[0]
    if len(activations) != sites:
        raise LayerError(f"dAD: {len(activations)} activation blocks for {sites} sites")
    samples = d.global_shape[0] // sites
    widths = {np.shape(a)[1] for a in activations if np.ndim(a) == 2}
    for s, a in enumerate(activations):
        if np.ndim(a) != 2 or np.shape(a)[0] != samples:
            raise LayerError(
                f"dAD: activations of site {s} have shape {np.shape(a)}, expected ({samples}, h_i)"
            )
    if len(widths) != 1:
        raise LayerError(f"dAD: the sites' activations differ in width: {sorted(widths)}")
    return sites, samples, widths.pop()


def allreduce_gradient(
    activations: Sequence[np.ndarray], d: DistributedTensor, *, name: str = "G"
) -> LinearOperator:
    r"""D -> G on every site: :math:`G_s = A_s^T D_s` locally, then all-reduce (``AR L``)."""
    sites, _, h_in = _check(activations, d)
    layout = gradient_layout(sites, (h_in, d.global_shape[1]), name=name)
    space = d.space
    factors: list[LinearOperator] = []
    for s in range(sites):
        node = LocalOperator(
            (space.block(d.block_name((s, 0))),),
            (layout.block((s,)),),
            _product_kernel(activations[s]),
            name=f"AtD{s}",
        ).within(space)
        factors.append(node)
        space = node.range
    factors.append(AllReduce(layout, (0,)))
    return Composition(tuple(reversed(factors)))


def gathered_gradient(
    activations: Sequence[np.ndarray], d: DistributedTensor, *, name: str = "G"
) -> LinearOperator:
    r"""D -> G on every site: all-gather the deltas, then :math:`[A_1; \dots]^T [D_1; \dots]` on
    every site (``L AG``). The activations' own gather is :func:`factor_gather`."""
    sites, _, h_in = _check(activations, d)
    full = np.concatenate([np.asarray(a) for a in activations])
    layout = gradient_layout(sites, (h_in, d.global_shape[1]), name=name)
    gather = AllGather(d, (0,), f"{d.name}g")
    space = gather.range
    kernel = _product_kernel(full)
    factors: list[LinearOperator] = [gather]
    for s in range(sites):
        node = LocalOperator(
            (space.block(f"{d.name}g[{s},0]"),), (layout.block((s,)),), kernel, name=f"AtDg{s}"
        ).within(space)
        factors.append(node)
        space = node.range
    return Composition(tuple(reversed(factors)))


def factor_gather(sites: int, samples: int, width: int, *, name: str = "A") -> AllGather:
    """The all-gather of the activations [A_1; ...; A_S] (data movement, counted by :func:`traffic`)."""
    return AllGather(deltas(sites, samples, width, name=name), (0,), f"{name}g")


def crossover(h_in: int, h_out: int) -> float:
    """The sample count below which gathering the factors moves fewer values per site than
    all-reducing the gradient: h_i h_{i+1} / (h_i + h_{i+1})."""
    return h_in * h_out / (h_in + h_out)


@dataclass(frozen=True)
class Traffic:
    """Values a tree sends between workers, per sending worker: ``sent`` counts every value
    sent (repeats included), ``distinct`` the distinct entries a worker puts on the network
    (what it contributes)."""

    sent: dict[int, int]
    distinct: dict[int, int]

    def per_site(self) -> int:
        """The largest number of distinct values any worker contributes."""
        return max(self.distinct.values(), default=0)


def _sent_region(node: LinearOperator) -> Region | None:
    """The region a node sends to another worker, or None when it moves nothing across."""
    if isinstance(node, Add):
        return node.src if node.src.worker != node.dst.worker else None
    if isinstance(node, (Copy, CopyAdjoint, Move)):
        if node.src.worker == node.dst.worker:
            return None
        if isinstance(node, CopyAdjoint):  # data flows back from dst to src
            dst = node.dst  # a new block exactly when the adjoint is out of place
            return node.domain[dst.name] if isinstance(dst, Block) else dst
        return node.src
    return None


def _movements(op: LinearOperator) -> Iterator[LinearOperator]:
    """The tree's nodes, expanded until movement nodes (or leaves) are reached."""
    stack = [op]
    while stack:
        node = stack.pop()
        if isinstance(node, (Add, Copy, CopyAdjoint, Move)):
            yield node
            continue
        children = node.children()
        if children:
            stack.extend(reversed(children))
            continue
        expanded = node.expand()
        if expanded is not node:
            stack.append(expanded)


def traffic(op: LinearOperator) -> Traffic:
    """Count the cross-worker transfers of a tree (expanded down to its movement nodes: every
    send-receive sends its source region, every receive-send adjoint its destination back)."""
    sent: dict[int, int] = {}
    entries: dict[int, list[np.ndarray]] = {}
    names: dict[tuple[int, str], int] = {}
    for node in _movements(op):
        region = _sent_region(node)
        if region is None:
            continue
        worker = region.worker
        sent[worker] = sent.get(worker, 0) + region.size
        key = names.setdefault((worker, region.name), len(names))
        local = region.flat_indices() - region.space.offset(region.name)
        entries.setdefault(worker, []).append(local + (key << 40))
    distinct = {w: int(np.unique(np.concatenate(parts)).size) for w, parts in entries.items()}
    return Traffic(sent, distinct)


@dataclass(frozen=True)
class RankDadResult:
    """A rank-r approximation G ~ P Q^T of the summed gradient, with what it cost and how good
    it is: ``sent_per_site`` values per site (all iterations), ``bound`` = iterations x r (h_i +
    h_{i+1}), ``error`` = ||G - P Q^T||_F / ||G||_F and ``best`` the optimal rank-r error."""

    p: np.ndarray
    q: np.ndarray
    sent_per_site: int
    bound: int
    error: float
    best: float


def rank_dad(
    activations: Sequence[np.ndarray],
    deltas_: Sequence[np.ndarray],
    rank: int,
    *,
    iterations: int = 2,
    seed: int = 0,
    allreduce: Callable[[list[np.ndarray]], np.ndarray] | None = None,
) -> RankDadResult:
    r"""Rank-r dAD by structured power iteration on :math:`G = \sum_s A_s^T D_s`, never forming G:

    .. math::

        P \leftarrow \mathrm{orth}\Big(\sum_s A_s^T (D_s Q)\Big), \qquad
        Q \leftarrow \sum_s D_s^T (A_s P) \quad (G \approx P Q^T)

    starting from a seeded random Q (the same on every site). Each sum is an all-reduce of an
    h_i x r (h_{i+1} x r) block, so each iteration sends r (h_i + h_{i+1}) values per site.
    ``allreduce`` sums the sites' blocks (default: a plain sum, one process simulating the
    sites; under MPI each rank passes its own site's factors and
    ``lambda parts: comm.allreduce(parts[0])``). The error report all-reduces G once more
    (not counted in ``sent_per_site``).

    Raises
    ------
    LayerError
        If ``rank`` or ``iterations`` is below 1 or the factors do not match.
    """
    if rank < 1 or iterations < 1:
        raise LayerError(f"rank_dad: rank ({rank}) and iterations ({iterations}) must be >= 1")
    if len(activations) != len(deltas_):
        raise LayerError(f"rank_dad: {len(activations)} activation blocks but {len(deltas_)} delta blocks")
    h_in, h_out = np.shape(activations[0])[1], np.shape(deltas_[0])[1]
    total = allreduce or (lambda parts: np.sum(parts, axis=0))
    q = np.random.default_rng(seed).standard_normal((h_out, rank))
    sent = 0
    p = np.zeros((h_in, rank))
    for _ in range(iterations):
        p, _ = np.linalg.qr(total([a.T @ (d @ q) for a, d in zip(activations, deltas_)]))
        q = total([d.T @ (a @ p) for a, d in zip(activations, deltas_)])
        sent += rank * (h_in + h_out)
    g = total([a.T @ d for a, d in zip(activations, deltas_)])  # for the error report only (not counted)
    norm = float(np.linalg.norm(g)) or 1.0
    singular = np.linalg.svd(g, compute_uv=False)
    best = float(np.sqrt(np.sum(singular[rank:] ** 2))) / norm
    error = float(np.linalg.norm(g - p @ q.T)) / norm
    return RankDadResult(p, q, sent, iterations * rank * (h_in + h_out), error, best)
