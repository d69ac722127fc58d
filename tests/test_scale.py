"""Per-rank planning grows linearly with the number of workers (issue 13).

What one rank spends before moving a byte (building the tree, its fingerprint, lowering,
batching and projecting onto one interior rank, as :func:`linop.backends.mpi_backend.plan_for`
does) is pinned by an operation count that does not depend on timing: the number of blocks
that every :class:`~linop.Space` built along the way holds. A plan that builds one P-block space
per worker (the O(P^2) of the shims' expansions) multiplies that count by 16 when P grows 4x; a
linear plan by about 4. ``benchmarks/bench_scale.py`` measures the seconds and megabytes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from linop import Space
from linop.backends.mpi_schedule import batch, fingerprint, lower, project

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_scale

LINEAR = 6.0
"""Bound on count(4P) / count(P): linear growth gives about 4, quadratic 16."""

CASES = [
    pytest.param("HaloExchange", id="halo-exchange"),
    pytest.param("halo_windows", id="halo-windows"),
    pytest.param("Broadcast 1 -> P", id="broadcast-one"),
    pytest.param("Broadcast (1,s) -> (s,s)", id="broadcast-row"),
    pytest.param("AllReduce axis 0", id="allreduce"),
    pytest.param("Repartition (s,s) -> (2s,s/2)", id="repartition"),
]


def _blocks_held(case: str, s: int, adjoint: bool, monkeypatch: pytest.MonkeyPatch) -> int:
    """Blocks held by all spaces built while one rank of an s x s grid plans ``case``."""
    count = [0]
    adopt = Space._adopt

    def counting(self: Space, ordered: tuple) -> None:
        count[0] += len(ordered)
        adopt(self, ordered)

    with monkeypatch.context() as patch:
        patch.setattr(Space, "_adopt", counting)
        op = bench_scale.CASES[case](s)
        op = op.H if adjoint else op
        fingerprint(op)
        project(batch(lower(op)), (s // 2) * s + s // 2)
    return count[0]


@pytest.mark.parametrize("adjoint", [False, True], ids=["forward", "adjoint"])
@pytest.mark.parametrize("case", CASES)
def test_planning_grows_linearly(case: str, adjoint: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    small = _blocks_held(case, 8, adjoint, monkeypatch)
    large = _blocks_held(case, 16, adjoint, monkeypatch)
    assert large / small < LINEAR, f"{case}: {small} blocks held at P = 64, {large} at P = 256"


def test_the_count_catches_quadratic_planning(monkeypatch: pytest.MonkeyPatch) -> None:
    """The old shims (one P-block space per worker, :func:`linop.halo.pad_expansion`) fail."""
    from linop.halo import pad_expansion

    def quadratic(s: int):
        from linop import Kernel, halo_geometry

        return pad_expansion(halo_geometry(bench_scale._grid(s), Kernel(3, padding=1)))

    monkeypatch.setitem(bench_scale.CASES, "old pad shim", quadratic)
    small = _blocks_held("old pad shim", 8, False, monkeypatch)
    large = _blocks_held("old pad shim", 16, False, monkeypatch)
    assert large / small > LINEAR
