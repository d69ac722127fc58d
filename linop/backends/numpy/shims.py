"""Numpy fast paths of the halo shims (:class:`~linop.halo.PadShim`,
:class:`~linop.halo.TrimShim` and their adjoints): each per-worker part runs on its own blocks
of the workspace, so applying a shim costs O(P) in the number of workers instead of the O(P^2)
of its expansion over whole spaces. Proven equal to the expansion in ``tests/test_registry.py``.
"""

from __future__ import annotations

from ...halo import PadShim, PadShimAdjoint, TrimShim, TrimShimAdjoint
from . import Workspace, handler, run

__all__: list[str] = []


@handler(PadShim)
@handler(PadShimAdjoint)
@handler(TrimShim)
@handler(TrimShimAdjoint)
def _shim(op: PadShim, work: Workspace) -> None:
    for part in op.parts():  # disjoint blocks: the order does not matter
        run(part, work)
