"""Described worker maps (issue 24): :meth:`WorkerMap.blocked` and :meth:`WorkerMap.round_robin`
hold two numbers, answer in O(1) at any size, and are equal (with one hash and one digest) to
the explicit table of their assignment."""

from __future__ import annotations

import itertools
import tracemalloc

import numpy as np
import pytest

from linop.described import Stride
from linop.errors import WorkerMapError
from linop.partition import Partition, WorkerBox
from linop.program import WorkerMap
from linop.program.groups import MappedRanks, mapped_ranks


def _assignment(kind, workers, ranks):
    if kind == "blocked":
        return [w * ranks // workers for w in range(workers)]
    return [w % ranks for w in range(workers)]


@pytest.mark.parametrize("kind", ["blocked", "round_robin"])
@pytest.mark.parametrize("workers", [1, 2, 5, 16, 17])
@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 5, 16, 20])
def test_a_described_map_is_the_table_of_its_assignment(kind, workers, ranks):
    described = getattr(WorkerMap, kind)(workers, ranks)
    table = _assignment(kind, workers, ranks)
    for explicit in (WorkerMap(table), WorkerMap(dict(enumerate(table))), WorkerMap(np.array(table))):
        assert described == explicit and explicit == described
        assert hash(described) == hash(explicit)
        assert described.description() == explicit.description()
    assert described.pairs == tuple(enumerate(table))
    assert len(described) == workers and list(described) == list(range(workers))
    assert described.dense == workers and described.largest_rank == max(table)
    for rank in range(ranks + 2):
        held = described.workers_on(rank)
        assert held == tuple(w for w, r in enumerate(table) if r == rank)
        assert all(described.rank_of(w) == rank for w in held)


def test_maps_of_different_assignments_differ_in_equality_and_digest():
    maps = [
        WorkerMap.blocked(16, 4),
        WorkerMap.round_robin(16, 4),
        WorkerMap.blocked(16, 3),
        WorkerMap.round_robin(16, 3),
        WorkerMap.blocked(17, 4),
        WorkerMap([0, 0, 0, 1] * 4),  # a table no rule gives
        WorkerMap({w: w // 4 for w in range(1, 16)}),  # worker 0 unmapped
    ]
    for a, other in enumerate(maps):
        for b, another in enumerate(maps):
            assert (other == another) == (a == b), (other, another)
            assert (other.description() == another.description()) == (a == b)


def test_one_assignment_one_map_however_it_is_given():
    """Round robin on one rank is blocked on one rank; on as many ranks as workers (or more)
    both are the identity; a blocked map of more ranks than workers is a table."""
    assert WorkerMap.round_robin(8, 1) == WorkerMap.blocked(8, 1) == WorkerMap([0] * 8)
    assert WorkerMap.round_robin(8, 8) == WorkerMap.round_robin(8, 50) == WorkerMap.blocked(8, 8)
    assert WorkerMap.blocked(4, 5) == WorkerMap([0, 1, 2, 3]) == WorkerMap.blocked(4, 4)
    assert WorkerMap.blocked(4, 8) == WorkerMap([0, 2, 4, 6]) and WorkerMap.blocked(4, 8).rule is None
    assert WorkerMap.blocked(0, 3) == WorkerMap([]) and WorkerMap.blocked(0, 3).pairs == ()
    assert WorkerMap([0, 0, 1, 1]).rule == ("blocked", 4, 2)
    assert repr(WorkerMap([0, 1, 0, 1])) == "WorkerMap.round_robin(4, 2)"
    assert repr(WorkerMap([1, 0])) == "WorkerMap({0: 1, 1: 0})"


@pytest.mark.parametrize("kind", ["blocked", "round_robin"])
def test_a_described_map_of_a_billion_workers_answers_in_constant_memory(kind):
    """No answer lists the workers: the whole test allocates under 1 MB (a listing of 2**30
    workers would take gigabytes). Memory, not time: a loaded machine slows, it does not
    allocate more."""
    tracemalloc.start()
    workers, ranks = 1 << 30, 1 << 28
    mapping = getattr(WorkerMap, kind)(workers, ranks)
    held = mapping.workers_on(ranks // 2 + 1)
    assert isinstance(held, Stride) and len(held) == 4
    assert all(mapping.rank_of(w) == ranks // 2 + 1 for w in held)
    assert len(mapping.description()) == 17 and hash(mapping) == hash(mapping.rule)
    assert mapping.largest_rank == ranks - 1 and len(mapping) == workers
    assert mapping.problem([0, workers - 1], ranks) is None
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1 << 20, f"{peak} bytes allocated"


@pytest.mark.parametrize("kind", ["blocked", "round_robin"])
def test_a_described_map_names_the_worker_at_fault(kind):
    mapping = getattr(WorkerMap, kind)(16, 4)
    with pytest.raises(WorkerMapError, match="worker 16 of the tree is not in the worker map"):
        mapping.rank_of(16)
    with pytest.raises(WorkerMapError, match="worker -1 of the tree"):
        mapping.rank_of(-1)
    assert str(mapping.problem([3, 16, 20], 4)) == "worker 16 of the tree is not in the worker map"
    fault = {"blocked": "worker 12 on rank 3", "round_robin": "worker 3 on rank 3"}[kind]
    assert str(mapping.problem([0, 3, 12], 3)) == (
        f"the worker map puts {fault}, but the communicator has 3 rank(s)"
    )
    assert mapping.workers_on(4) == () and mapping.workers_on(-1) == ()


@pytest.mark.parametrize(
    "call, problem",
    [
        (lambda: WorkerMap.blocked(-1, 3), "workers must be a non-negative integer, not -1"),
        (lambda: WorkerMap.round_robin(4, 0), "ranks must be a positive integer, not 0"),
        (lambda: WorkerMap.blocked(4, True), "ranks must be a positive integer, not True"),
        (lambda: WorkerMap.blocked((1 << 24) + 1, 1 << 25), "at most MAX_MAP_WORKERS"),
    ],
    ids=["negative-workers", "zero-ranks", "bool-ranks", "listed-too-large"],
)
def test_malformed_rules_raise_a_typed_error(call, problem):
    with pytest.raises(WorkerMapError, match=problem):
        call()


def test_the_equality_test_catches_a_wrong_rule():  # control
    """A map one worker off (worker 5 moved) differs from the described map in equality,
    hash-free comparison and digest."""
    table = _assignment("blocked", 16, 4)
    table[5] = 2
    assert WorkerMap(table) != WorkerMap.blocked(16, 4)
    assert WorkerMap(table).description() != WorkerMap.blocked(16, 4).description()
    assert WorkerMap.round_robin(16, 4).workers_on(1) != (1, 5, 9, 12)


def test_a_stride_is_the_tuple_of_its_entries():
    stride = Stride(2, 17, 5)
    assert stride == (2, 7, 12) and (2, 7, 12) == stride and hash(stride) == hash((2, 7, 12))
    assert 7 in stride and 8 not in stride and 17 not in stride and stride[-1] == 12
    assert list(Stride(3, 3)) == [] and len(Stride(0, 10, 3)) == 4
    with pytest.raises(IndexError, match="entry 3 of a stride of 3"):
        stride[3]


@pytest.mark.parametrize("shape", [(16,), (4, 4), (3, 5), (2, 3, 4)], ids=str)
@pytest.mark.parametrize("kind", ["blocked", "round_robin"])
def test_a_groups_ranks_under_a_described_map_are_its_listed_ranks(shape, kind):
    """The ranks of a group (a box of a partition's workers, any root) under a described map,
    found from runs of workers, equal the distinct ranks listed worker by worker, root's first;
    a table that is no rule (a worker beyond the partition) gives the same ranks, listed."""
    partition = Partition(shape)
    workers = partition.max_worker + 1
    for ranks in range(1, workers + 2):
        mapping = getattr(WorkerMap, kind)(workers, ranks)
        table = WorkerMap({**{w: mapping.rank_of(w) for w in range(workers)}, workers + 5: 0})
        assert mapping.rule is not None and table.rule is None
        for fixed in itertools.product(*([None, *range(n)] for n in shape)):
            box = WorkerBox(partition, fixed)
            for root in {0, workers - 1, box[0]}:
                first = mapping.rank_of(root)
                listed = (first, *sorted({mapping.rank_of(w) for w in box} - {first}))
                described = mapped_ranks(root, box, mapping)
                assert described == listed and tuple(described) == listed
                assert described.triples()[0] == (first, first, 1) and len(described) == len(listed)
                assert mapped_ranks(root, box, table) == described


def test_a_group_of_a_million_workers_has_its_ranks_in_one_run():
    partition = Partition((1024, 1024))
    mapping = WorkerMap.blocked(1 << 20, 1 << 18)
    ranks = mapped_ranks(5, WorkerBox(partition, (None, None)), mapping)
    assert ranks.triples() == ((1, 1, 1), (0, 0, 1), (2, (1 << 18) - 1, 1)) and len(ranks) == 1 << 18


def test_the_ranks_comparison_catches_a_wrong_root_and_a_missing_rank():  # control
    ranks = mapped_ranks(5, WorkerBox(Partition((4, 4)), (None, 1)), WorkerMap.round_robin(16, 3))
    assert tuple(ranks) == (2, 0, 1)
    assert ranks != (0, 1, 2) and ranks != (2, 0) and ranks != MappedRanks(2, ((0, 0),))


def test_a_described_map_of_any_size_answers_in_constant_time_and_refuses_to_be_listed():
    """2**40 workers: counted and asked without a listing; its pairs (a listing) and counts
    beyond 64 bits are typed errors, not a run out of memory (the fuzz campaign's find)."""
    huge = WorkerMap.blocked(2**40, 3)
    assert len(huge) == 2**40 and huge.rank_of(2**40 - 1) == 2 and huge.largest_rank == 2
    with pytest.raises(WorkerMapError, match="too many to list as pairs"):
        _ = huge.pairs
    for workers, ranks in [(2**64, 2), (5, 2**70)]:
        with pytest.raises(WorkerMapError, match="more than a map counts"):
            WorkerMap.round_robin(workers, ranks)
