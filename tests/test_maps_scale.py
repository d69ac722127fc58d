"""A rank's planning under a worker map does not grow with the number of workers (issue 24):
the memory one rank allocates while it plans halo exchanges, collectives and repartitions under
blocked and round-robin maps of 4 workers per rank is the same at P = 1,024 and P = 16,384,
with the MPI's mapped fast paths (``native``) and without them (``portable``: the program the
torch.distributed executor runs under a map, collectives as their expansions' point-to-point
steps); the global route it replaced grows (the control)."""

from __future__ import annotations

import sys
import tracemalloc
from pathlib import Path

import pytest

from linop.backends.mpi.native import mpi_schedule
from linop.program import WorkerMap
from linop.program.mapped import MappedCompiled

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_scale

CASES = {
    "HaloExchange": 1,
    "Broadcast 1 -> P": 1,
    "Broadcast (1,s) -> (s,s)": 1,
    "AllReduce axis 0": 1,
    "AllReduce axes (0,1)": 1,
    "AllReduce batch norm (1,1,s,s)": 1,
    "Repartition (s,s) -> (2s,s/2)": 1,
    "AllGather axis 0": 4,
}
"""Each case and the growth its rank's work allows from P = 1,024 to 16,384: none, or that of
a group's size (an all-gather's worker receives a piece from each of the s = sqrt(P) members
of its column: 4 times as many)."""
KINDS = {"blocked": WorkerMap.blocked, "round-robin": WorkerMap.round_robin}


def _planned(
    case: str, s: int, kind: str, adjoint: bool, *, whole: bool = False, native: bool = True
) -> tuple[float, int]:
    """Peak traced megabytes while the rank holding the interior worker builds its map and
    plans (as the MPI plan does: the map, the fingerprint, its schedule and its blocks), and
    the number of steps of its schedule; ``whole``: the global route; ``native``: with the
    MPI's mapped fast paths (else the portable program, as the torch.distributed plan)."""
    op = bench_scale.CASES[case](s)
    op = op.H if adjoint else op
    interior = (s // 2) * s + s // 2
    tracemalloc.start()
    try:
        mapping = KINDS[kind](s * s, s * s // 4)
        rank = mapping.rank_of(interior)
        compiled = MappedCompiled(op, mapping, calls=mpi_schedule if native else None)
        compiled.per_worker = compiled.per_worker and not whole
        program, problem = compiled.for_rank(rank, s * s // 4)
        compiled.domain_blocks(rank), compiled.range_names(rank)
        peak = tracemalloc.get_traced_memory()[1] / 1e6
    finally:
        tracemalloc.stop()
    assert problem is None and program is not None
    return peak, len(program.schedule)


@pytest.mark.parametrize("native", [True, False], ids=["native", "portable"])
@pytest.mark.parametrize("adjoint", [False, True], ids=["forward", "adjoint"])
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("case", list(CASES))
def test_a_mapped_rank_plans_in_the_same_memory_at_sixteen_times_the_workers(case, kind, adjoint, native):
    (small, steps), (large, same_steps) = (_planned(case, s, kind, adjoint, native=native) for s in (32, 128))
    assert steps == same_steps
    assert large < 1.5 * CASES[case] * small + 0.25, (
        f"{case} under {kind}: {small:.2f} MB at P = 1024, {large:.2f} MB at P = 16384"
    )


@pytest.mark.parametrize("native", [True, False], ids=["native", "portable"])
@pytest.mark.parametrize("case", ["AllReduce axis 0", "Repartition (s,s) -> (2s,s/2)", "Broadcast 1 -> P"])
def test_the_global_route_grows(case, native):  # control: the measure sees growth when there is some
    # P = 64 against 1,024: 16 times the workers. At 4 times (P = 256) the global all-reduce's
    # growth (2.7x) sat too close to the one-time caches of the first call to tell apart.
    small, _ = _planned(case, 8, "blocked", False, whole=True, native=native)
    large, _ = _planned(case, 32, "blocked", False, whole=True, native=native)
    assert large > 4 * small
