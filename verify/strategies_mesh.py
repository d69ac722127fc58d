"""Example strategies of mesh layouts (DTensor's placements as linop layouts) and of the
redistribute between two of them (:class:`~linop.redistribute.Redistribute` and its stages
:class:`~linop.redistribute.RedistributeCopies` / :class:`~linop.redistribute.RedistributeSums`),
for the property tests and the registry proof (``tests/test_registry.py``). Imported by
:mod:`verify.strategies`.
"""

from __future__ import annotations

import math

from hypothesis import strategies as st

from linop import LinearOperator
from linop.mesh_layout import MeshLayout, Partial, Placement, Replicate, Shard
from linop.redistribute import Redistribute, RedistributeCopies, RedistributeSums

from .node_examples import examples_for

__all__ = ["compositions", "placements", "layout_sizes", "layout_pairs", "redistributes"]


@st.composite
def compositions(draw: st.DrawFn, total: int, parts: int) -> tuple[int, ...]:
    """``total`` cut into ``parts`` non-negative sizes (uneven and empty pieces included)."""
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=parts - 1, max_size=parts - 1)))
    edges = [0, *cuts, total]
    return tuple(b - a for a, b in zip(edges, edges[1:]))


@st.composite
def placements(draw: st.DrawFn, mesh_ndim: int, ndim: int) -> tuple[Placement, ...]:
    """One placement per mesh dimension: replicated, partial sums or a shard of a tensor dim."""
    kinds: list[Placement] = [Replicate(), Partial(), *(Shard(d) for d in range(ndim))]
    return tuple(draw(st.sampled_from(kinds)) for _ in range(mesh_ndim))


@st.composite
def layout_sizes(draw: st.DrawFn, layout: MeshLayout) -> dict[int, tuple[int, ...]]:
    """Explicit uneven sizes for some of the sharded tensor dimensions of ``layout``."""
    sizes: dict[int, tuple[int, ...]] = {}
    for d in range(layout.ndim):
        cuts = layout.shard_mesh_dims(d)
        if len(cuts) > 0 and draw(st.booleans()):
            count = math.prod(layout.mesh_shape[i] for i in cuts)
            sizes[d] = draw(compositions(layout.global_shape[d], count))
    return sizes


@st.composite
def layout_pairs(
    draw: st.DrawFn, *, max_extent: int = 3, max_mesh_dims: int = 3, max_size: int = 7
) -> tuple[MeshLayout, MeshLayout]:
    """Two layouts ``a`` and ``b`` of one global shape on one mesh (placements and uneven sizes
    drawn independently)."""
    mesh = tuple(draw(st.lists(st.integers(1, max_extent), min_size=1, max_size=max_mesh_dims)))
    shape = tuple(draw(st.lists(st.integers(0, max_size), min_size=1, max_size=3)))
    layouts = []
    for name in ("a", "b"):
        draft = MeshLayout.from_placements(mesh, draw(placements(len(mesh), len(shape))), shape, name=name)
        layouts.append(draft.with_placements(draft.placements, draw(layout_sizes(draft))))
    return layouts[0], layouts[1]


def redistributes() -> st.SearchStrategy[LinearOperator]:
    """Small redistributes (meshes of at most 2 x 2, tensors of at most 4 entries per dimension)
    or their adjoints."""
    pairs = layout_pairs(max_extent=2, max_mesh_dims=2, max_size=4)
    return st.tuples(pairs, st.booleans()).map(lambda case: _maybe_adjoint(Redistribute(*case[0]), case[1]))


def _maybe_adjoint(op: LinearOperator, adjoint: bool) -> LinearOperator:
    return op.H if adjoint else op


def _stages(op: LinearOperator) -> list[LinearOperator]:
    stages = op.expand()
    return list(getattr(stages, "factors", (stages,)))


@examples_for(Redistribute)
def _redistribute_examples() -> st.SearchStrategy:
    return redistributes()


@examples_for(RedistributeCopies)
@examples_for(RedistributeSums)
def _stage_examples() -> st.SearchStrategy:
    return redistributes().flatmap(lambda op: st.sampled_from(_stages(op)))
