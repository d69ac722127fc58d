"""An all-reduce whose group is the whole grid (|G| = P) is planned and bound without a list of
its members: one rank's lowering names its group by a box of the partition
(:class:`~linop.partition.WorkerBox`), a mapped rank's group's ranks are runs
(:func:`~linop.program.groups.sorted_mapped_ranks`), and the MPI executor takes the whole
communicator, or includes a sub-group run by run (``MPI_Group_range_incl``), never rank by rank.

The cases are ``bench_scale``'s: ``AllReduce axes (0,1)`` (an s x s grid reduced over both
axes) and ``AllReduce batch norm (1,1,s,s)`` (the statistics of a batch norm on a spatial-only
partition: every axis but the channel axis reduced). Memory is traced (no wall-clock time): the
rank's planning allocates as much at P = 65,536 as at P = 256; listing the group (the lowering
before) allocates megabytes more (the control)."""

from __future__ import annotations

import itertools
import sys
import tracemalloc
from pathlib import Path
from typing import Any, ClassVar

import pytest

from linop import AllReduce, BlockGrid, Partition
from linop.layout import ProductShapes, reduction_groups
from linop.partition import WorkerBox
from linop.program import WorkerMap, compile_for_rank, fingerprint, lower_for
from linop.program.groups import sorted_mapped_ranks
from linop.program.parts import AllReducePart

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_scale

WHOLE = ["AllReduce axes (0,1)", "AllReduce batch norm (1,1,s,s)"]


def _rank(s: int) -> int:
    return (s // 2) * s + s // 2


def _planned_mb(case: str, s: int, adjoint: bool) -> float:
    """Peak traced megabytes while the interior rank of P = s * s builds ``case``, its
    fingerprint and its schedule (:func:`~linop.program.compile_for_rank`)."""
    tracemalloc.start()
    try:
        op = bench_scale.CASES[case](s)
        op = op.H if adjoint else op
        fingerprint(op)
        compile_for_rank(op, _rank(s))
        return tracemalloc.get_traced_memory()[1] / 1e6
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("adjoint", [False, True], ids=["forward", "adjoint"])
@pytest.mark.parametrize("case", WHOLE)
def test_a_rank_plans_a_group_of_p_in_the_same_memory_at_256_times_the_workers(
    case: str, adjoint: bool
) -> None:
    """P = 256 against 65,536: a listed group of 65,536 members (ints and grid indices) costs
    megabytes; the described group costs what the small one does."""
    _planned_mb(case, 4, adjoint)  # the first call's one-time caches
    small, large = (_planned_mb(case, s, adjoint) for s in (16, 256))
    assert large < small + 0.1, f"{case}: {small:.3f} MB at P = 256, {large:.3f} MB at P = 65536"


@pytest.mark.parametrize("case", WHOLE)
def test_the_rank_step_holds_its_group_described(case: str) -> None:
    """The rank's part names the whole grid as a box of P members, equal to the listed group."""
    s = 512
    (step,) = lower_for(bench_scale.CASES[case](s), _rank(s))[0]
    part = step.runner.project(_rank(s))
    assert isinstance(part, AllReducePart)
    ((_, ranks),) = part.entries
    assert isinstance(ranks, WorkerBox) and len(ranks) == s * s and _rank(s) in ranks
    assert ranks.triples() == ((0, s * s - 1, 1),)


def _partitions() -> list[Partition]:
    return [Partition((2, 3, 2)), Partition((2, 3, 2), workers=tuple(range(40, 52))[::-1])]


@pytest.mark.parametrize("partition", _partitions(), ids=["consecutive", "listed"])
def test_a_rank_group_equals_the_global_group(partition: Partition) -> None:
    """On every rank and for every set of axes, the described group of the rank's part equals,
    in order, the workers of its group of :func:`~linop.layout.reduction_groups`."""
    shapes = ProductShapes(partition.shape, (None, None, None), (2,))
    grid = BlockGrid("g", partition, shapes)
    for k in (1, 2, 3):
        for axes in itertools.combinations(range(3), k):
            op = AllReduce(grid, axes)
            groups = reduction_groups(partition, axes)
            for worker in partition.workers:
                (step,) = lower_for(op, worker)[0]
                ((name, ranks),) = step.runner.project(worker).entries
                index = partition.index(worker)
                (group,) = [g for g in groups if index in g]
                assert name == grid.block_name(index)
                assert tuple(ranks) == tuple(partition.worker(i) for i in group) == ranks
                runs = [w for a, b, st in ranks.triples() for w in range(a, b + 1, st)]
                assert sorted(runs) == sorted(ranks)


@pytest.mark.parametrize("kind", [WorkerMap.blocked, WorkerMap.round_robin], ids=["blocked", "round-robin"])
def test_sorted_mapped_ranks_equal_the_sorted_distinct_ranks(kind: Any) -> None:
    """Runs of ranks (described partitions) and listed ranks (listed workers) equal the sorted
    set of the members' ranks, for every box of a (3, 4, 2) grid on 1, 5 and 24 ranks."""
    for partition in (Partition((3, 4, 2)), Partition((3, 4, 2), workers=tuple(range(24))[::-1])):
        for ranks_count in (1, 5, 24):
            mapping = kind(24, ranks_count)
            for fixed in itertools.product(*((None, *range(n)) for n in partition.shape)):
                box = WorkerBox(partition, fixed)
                found = sorted_mapped_ranks(box, mapping)
                expected = tuple(sorted({mapping.rank_of(w) for w in box}))
                assert tuple(found) == expected == found and len(found) == len(expected)
                assert [r for a, b, _ in found.triples() for r in range(a, b + 1)] == list(expected)


def test_listed_ranks_equal_the_iterated_ranks() -> None:
    """What a torch.distributed group is given (:func:`~linop.program.groups.listed_ranks`,
    from runs) equals the ranks iterated, for boxes of consecutive and listed workers, rooted
    ranks and mapped ranks."""
    from linop.program.groups import MappedRanks, RootedRanks, listed_ranks

    for partition in _partitions():
        for fixed in itertools.product(*((None, *range(n)) for n in partition.shape)):
            box = WorkerBox(partition, fixed)
            assert listed_ranks(box) == tuple(box)
            root = partition.worker((1, 2, 1))
            assert listed_ranks(RootedRanks(root, box)) == tuple(RootedRanks(root, box))
    assert listed_ranks(MappedRanks(2, ((0, 1), (3, 7)))) == (2, 0, 1, 3, 4, 5, 6, 7)
    assert listed_ranks([3, 1, 2]) == (3, 1, 2)


class _Groups:
    """What the test communicator's groups were asked to include: the lengths of the rank
    lists (``Incl``) and of the runs (``Range_incl``), and the sub-communicators made."""

    incl: ClassVar[list[int]] = []
    runs: ClassVar[list[int]] = []
    created: ClassVar[list[int]] = []


def _recording_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    group, comm = bench_scale._GroupOfP, bench_scale.RankOfP
    incl, range_incl, create = group.Incl, group.Range_incl, comm.Create_group
    _Groups.incl, _Groups.runs, _Groups.created = [], [], []

    def counting_incl(self: Any, ranks: list[int]) -> Any:
        _Groups.incl.append(len(ranks))
        return incl(self, ranks)

    def counting_range_incl(self: Any, runs: list[tuple[int, int, int]]) -> Any:
        _Groups.runs.append(len(runs))
        return range_incl(self, runs)

    def counting_create(self: Any, group: Any, tag: int = 0) -> Any:
        _Groups.created.append(group.size)
        return create(self, group, tag)

    monkeypatch.setattr(group, "Incl", counting_incl)
    monkeypatch.setattr(group, "Range_incl", counting_range_incl)
    monkeypatch.setattr(comm, "Create_group", counting_create)


def _channels_cut(s: int) -> AllReduce:
    """A batch norm's statistics on a (1, 2, s, s) grid: two groups of s * s workers."""
    grid = Partition((1, 2, s, s))
    return AllReduce(BlockGrid("t", grid, ProductShapes(grid.shape, ((3,), (8, 8), None, None))), (0, 2, 3))


@pytest.mark.parametrize("adjoint", [False, True], ids=["forward", "adjoint"])
@pytest.mark.parametrize("case", [*WHOLE, "channels cut"])
def test_the_mpi_executor_includes_a_group_of_p_by_runs(
    case: str, adjoint: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checked call, the binding and the bound call of a rank of P = 65,536 (131,072)
    (:class:`bench_scale.RankOfP`): a group of every rank runs on the communicator itself (no
    sub-group); the half-grid groups of a batch norm whose channels are cut in two are
    included as one run (``Range_incl``), never as a list of ranks (``Incl``)."""
    pytest.importorskip("mpi4py")
    _recording_groups(monkeypatch)
    s = 256
    op = _channels_cut(s) if case == "channels cut" else bench_scale.CASES[case](s)
    op = op.H if adjoint else op
    size = 2 * s * s if case == "channels cut" else s * s
    rank = size - s * s + _rank(s)  # the second channel's group when cut: ranks s * s .. 2 s * s - 1
    plan = bench_scale.plan_on_rank_of_p(op, fingerprint(op), compile_for_rank(op, rank).schedule, rank, size)
    found: dict[str, object] = {"plan": plan}
    try:
        state = bench_scale.zeros_of(plan)
        plan.apply(state)
        found["bound"] = bound = plan.bind(state)
        bound()
    finally:
        bench_scale.release(found)
    assert _Groups.incl == []
    if case == "channels cut":
        assert _Groups.runs == [1] and _Groups.created == [s * s]
    else:
        assert _Groups.runs == [] and _Groups.created == []
