"""Example strategies of the halo shim nodes (:class:`~linop.halo.PadShim`,
:class:`~linop.halo.TrimShim` and their adjoints), for the registry proof that their handlers
equal their expansions (``tests/test_registry.py``). Imported by :mod:`verify.strategies`.
"""

from __future__ import annotations

from hypothesis import strategies as st

from linop import LinearOperator, halo_geometry
from linop.halo import PadShim, PadShimAdjoint, TrimShim, TrimShimAdjoint, pad_shim, trim_shim

from .node_examples import examples_for
from .strategies_halo import halo_cases

__all__ = ["shims"]


@st.composite
def shims(draw: st.DrawFn, *, max_dims: int = 2) -> LinearOperator:
    """The pad or trim shim of a drawn halo case, or its adjoint."""
    tensor, kernel = draw(halo_cases(max_dims=max_dims))
    geometry = halo_geometry(tensor, kernel)
    shim = draw(st.sampled_from([pad_shim, trim_shim]))(geometry)
    return shim.H if draw(st.booleans()) else shim


@examples_for(PadShim)
@examples_for(PadShimAdjoint)
@examples_for(TrimShim)
@examples_for(TrimShimAdjoint)
def _shims() -> st.SearchStrategy[LinearOperator]:
    return shims()
