"""A rank's own schedule (:func:`~linop.program.compile_for_rank`) against its
projection of the global program (:meth:`~linop.program.Program.for_rank`).

Every rank compiles its schedule on its own, visiting only its neighbours (issue 13), so what
two ranks exchange must agree without either seeing the whole program: the same messages with
the same tags between every pair, in the same order, and the same local steps. The two routes
may group messages into phases differently (a rank only splits a phase where one of *its*
steps depends on an earlier one), so the comparison is of the sequences per peer (what MPI
matches) and of the local steps.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from linop import (
    AllGather,
    Block,
    DistributedTensor,
    Gather,
    HaloExchange,
    Kernel,
    Partition,
    ReduceScatter,
    Scatter,
    halo_geometry,
    halo_windows,
)
from linop.program import RankPhase, Transfer, compile_for_rank, compile_program

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_scale


def _transfer(t: Transfer) -> tuple:
    target = t.target
    box = (target.start, target.stop) if hasattr(target, "start") else target.shape
    return (t.source.name, t.source.start, t.source.stop, target.name, box, t.mode, t.after)


def _sequences(schedule: tuple) -> tuple[dict, list, list]:
    """A rank's schedule as: its messages per (direction, peer) in order, with their tags; its
    local nodes in order; its other steps in order."""
    messages: dict[tuple[str, int], list] = {}
    local, other = [], []
    for step in schedule:
        if isinstance(step, RankPhase):
            for direction, entries in (("recv", step.receives), ("send", step.sends)):
                for peer, tag, t in entries:
                    messages.setdefault((direction, peer), []).append((tag, _transfer(t)))
        elif hasattr(step, "fallback"):  # a fast path's rank step: its fields but the fallback
            other.append({k: v for k, v in vars(step).items() if k != "fallback"})
        elif type(step).__module__.startswith(("linop.backends", "linop.program")):  # a rank step
            other.append(repr(step))
        else:  # a node run on the rank: its blocks and boxes (the rank may build it on a smaller space)
            local.append((type(step).__name__, str(step), repr(getattr(step, "block", None))))
    return messages, local, other


def _halo(shape, parts, kernel, variant="nested", windows=False, adjoint=False):
    tensor = DistributedTensor("x", shape, Partition(parts))
    op = (
        halo_windows(tensor, kernel, variant=variant)
        if windows
        else HaloExchange(halo_geometry(tensor, kernel), variant)
    )
    return op.H if adjoint else op


TREES = [
    pytest.param(lambda: _halo((16, 16), (4, 4), Kernel(3, padding=1)), id="zero-4x4"),
    pytest.param(lambda: _halo((16, 16), (4, 4), Kernel(3, padding=1), adjoint=True), id="zero-4x4-adjoint"),
    pytest.param(lambda: _halo((16, 16), (4, 4), Kernel(3, padding=1), "direct"), id="zero-direct"),
    pytest.param(
        lambda: _halo((12, 10), (3, 2), Kernel(5, padding=2, boundary="periodic"), windows=True),
        id="periodic-windows",
    ),
    pytest.param(
        lambda: _halo((12, 10), (3, 2), Kernel(5, padding=2, boundary="periodic"), "direct", adjoint=True),
        id="periodic-direct-adjoint",
    ),
    pytest.param(lambda: _halo((9,), (3,), Kernel(3, padding=4, boundary="reflect")), id="reflect-wide"),
    pytest.param(
        lambda: _halo(
            (8, 9, 7), (2, 3, 2), Kernel(3, padding=1, boundary="symmetric"), windows=True, adjoint=True
        ),
        id="symmetric-3d-windows-adjoint",
    ),
    pytest.param(
        lambda: _halo((10, 10), (5, 5), Kernel((3, 5), padding=(1, 6), boundary="periodic")), id="multi-hop"
    ),
    pytest.param(lambda: _halo((10,), (1,), Kernel(3, padding=1, boundary="periodic")), id="one-worker"),
    pytest.param(lambda: _halo((11, 6), (3, 2), Kernel(2, stride=2), windows=True), id="strided-trims"),
    *(
        pytest.param(
            lambda name=name, adjoint=adjoint: _bench(name, adjoint),
            id=f"{name}-{'adjoint' if adjoint else 'forward'}",
        )
        for name in bench_scale.CASES
        for adjoint in (False, True)
    ),
]


def _gathers(kind, shape, parts, axes, sizes=()):
    return kind(DistributedTensor("x", shape, Partition(parts), sizes), axes, "g")


GATHERS = [
    pytest.param(lambda: _gathers(AllGather, (8, 8), (4, 4), 0), id="all-gather-axis-0"),
    pytest.param(lambda: _gathers(AllGather, (8, 6), (2, 3), (0, 1)), id="all-gather-both-axes"),
    pytest.param(lambda: _gathers(ReduceScatter, (8, 8), (4, 4), 1), id="reduce-scatter-axis-1"),
    pytest.param(
        lambda: _gathers(ReduceScatter, (7, 5), (3, 2), 0, ((3, 0, 4), (2, 3))),
        id="reduce-scatter-empty-share",
    ),
    pytest.param(
        lambda: _gathers(AllGather, (7, 5), (3, 2), 0, ((3, 0, 4), (2, 3))), id="all-gather-empty-share"
    ),
]
TREES += GATHERS


def _root(kind, worker, sizes=()):
    return kind(Block("r", (7, 5), worker), DistributedTensor("x", (7, 5), Partition((3, 2)), sizes))


TREES += [
    pytest.param(lambda: _root(Scatter, 0), id="scatter-root-0"),
    pytest.param(lambda: _root(Scatter, 4, ((3, 0, 4), (2, 3))), id="scatter-root-4-empty-share"),
    pytest.param(lambda: _root(Gather, 2), id="gather-root-2"),
    pytest.param(lambda: _root(Gather, 7, ((3, 0, 4), (5, 0))), id="gather-root-outside-empty-share"),
]


def _bench(name: str, adjoint: bool):
    op = bench_scale.CASES[name](4)
    return op.H if adjoint else op


@pytest.mark.parametrize("build", TREES)
def test_rank_schedule_matches_the_global_projection(build) -> None:
    op = build()
    program = compile_program(op)
    for rank in range(program.max_worker + 1):
        mine = compile_for_rank(op, rank)
        assert _sequences(mine.schedule) == _sequences(program.for_rank(rank)), f"rank {rank}"
        assert mine.max_worker == program.max_worker


def test_the_comparison_catches_a_wrong_tag() -> None:
    """A schedule whose tags were counted per phase (not per pair) differs."""
    op = _halo((16, 16), (4, 4), Kernel(3, padding=1))
    schedule = compile_for_rank(op, 5).schedule
    phase = next(s for s in schedule if isinstance(s, RankPhase) and len(s.receives) > 1)
    changed = tuple(
        RankPhase(tuple((p, i, t) for i, (p, _, t) in enumerate(s.receives)), s.sends) if s is phase else s
        for s in schedule
    )
    assert _sequences(changed) != _sequences(compile_program(op).for_rank(5))
