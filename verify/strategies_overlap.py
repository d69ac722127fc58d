"""Example strategies of the overlapped halo exchange (:class:`~linop.overlap.OverlappedHalo`
and its adjoint), for the registry proof that their lowerings equal their expansions
(``tests/test_registry.py``). Imported by :mod:`verify.strategies`.
"""

from __future__ import annotations

from hypothesis import strategies as st

from linop import Copy, HaloExchange, Identity, LinearOperator, halo_geometry
from linop.overlap import OverlappedHalo, OverlappedHaloAdjoint
from linop.partition import grid_block_name

from .node_examples import examples_for
from .strategies_halo import halo_cases

__all__ = ["overlapped_halos"]


@st.composite
def overlapped_halos(draw: st.DrawFn, *, max_dims: int = 2) -> LinearOperator:
    """A drawn halo exchange overlapped with copies of each worker's bulk into a new block
    (work that needs no halo), or its adjoint."""
    tensor, kernel = draw(halo_cases(max_dims=max_dims))
    geometry = halo_geometry(tensor, kernel)
    exchange = HaloExchange(geometry, draw(st.sampled_from(["nested", "direct"])))
    space = exchange.domain
    during: LinearOperator = Identity(space)
    for g in tensor.partition.indices():
        rows = geometry.worker_rows(g)
        if any(r.bulk_size == 0 for r in rows) or not draw(st.booleans()):
            continue
        name = grid_block_name(exchange.local_name, g)  # type: ignore[arg-type]
        copy = Copy(during.range[name][tuple(r.bulk for r in rows)], grid_block_name("inner", g))
        during = copy @ during
    node = OverlappedHalo(exchange, during)
    return node.H if draw(st.booleans()) else node


@examples_for(OverlappedHalo)
@examples_for(OverlappedHaloAdjoint)
def _overlapped() -> st.SearchStrategy[LinearOperator]:
    return overlapped_halos()
