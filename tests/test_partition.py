"""Partitions of workers, balanced and explicit decompositions, distributed tensors."""

import re

import numpy as np
import pytest
from hypothesis import Phase, find, given, settings
from hypothesis import strategies as st

from linop.errors import DecompositionError, LinopError, PartitionError, RegionError
from linop.partition import DistributedTensor, Partition, balanced_sizes, intersect
from verify.strategies_distributed import decompositions, distributed_tensors, partitions, tensor_pairs

FAST = settings(max_examples=40, deadline=None)


# -- partitions -------------------------------------------------------------------------------------
def test_partition_maps_index_to_worker_and_back():
    p = Partition((2, 3), workers=(7, 1, 4, 0, 9, 2))
    assert p.ndim == 2 and p.size == 6
    assert p.worker((0, 0)) == 7 and p.worker((1, 2)) == 2
    assert p.index(9) == (1, 1)
    assert 4 in p and 5 not in p
    assert list(p.indices()) == [(i, j) for i in range(2) for j in range(3)]


def test_partition_defaults_and_grid():
    assert Partition((2, 2)).workers == (0, 1, 2, 3)
    assert Partition.grid((3,), first=5).workers == (5, 6, 7)
    assert Partition(4).shape == (4,)


def test_partitions_may_share_overlap_or_be_disjoint():
    a = Partition.grid((2, 2))
    b = Partition((1, 2), (3, 4))
    c = Partition.grid((3,), first=10)
    assert set(a.workers) & set(b.workers) == {3}
    assert not set(a.workers) & set(c.workers)
    assert Partition((4,), a.workers) != a  # same workers, other shape


@given(partitions())
@FAST
def test_every_worker_round_trips_through_its_index(p):
    for index in p.indices():
        assert p.index(p.worker(index)) == index
    assert sorted(p.workers) == sorted(set(p.workers))


def test_subpartitions_group_workers_along_axes():
    p = Partition((2, 3), workers=(10, 11, 12, 13, 14, 15))
    rows = p.subpartitions([1])
    assert [q.workers for q in rows] == [(10, 11, 12), (13, 14, 15)]
    assert all(q.shape == (3,) for q in rows)
    columns = p.subpartitions([0])
    assert [q.workers for q in columns] == [(10, 13), (11, 14), (12, 15)]
    whole = p.subpartitions([0, 1])
    assert len(whole) == 1 and whole[0].workers == p.workers


@pytest.mark.parametrize(
    ("shape", "workers", "fragment"),
    [
        ((2, 2), (0, 1, 1, 2), "worker 1 is listed twice"),
        ((2, 2), (0, 1, 2), "needs 4 workers, got 3"),
        ((2, 0), (), "extent below 1"),
        ((2,), (0, -1), "must be >= 0"),
    ],
    ids=["duplicate-worker", "wrong-count", "zero-extent", "negative-id"],
)
def test_malformed_partitions_are_rejected_by_name(shape, workers, fragment):
    with pytest.raises(PartitionError, match=fragment):
        Partition(shape, workers)


@pytest.mark.parametrize(
    ("make", "error", "fragment"),
    [
        (lambda: Partition((2.5,)), PartitionError, r"partition shape \(2.5,\)"),
        (lambda: Partition((2,), ("a", "b")), PartitionError, r"workers \('a', 'b'\)"),
        (lambda: Partition.grid((2,), first=-1), PartitionError, "must be >= 0, got -1"),
        (lambda: Partition((2, 3)).subpartitions([2]), PartitionError, "axis 2 is out of range"),
        (lambda: Partition((2, 3)).subpartitions([0, -2]), PartitionError, "axis 0 is listed twice"),
        (lambda: balanced_sizes(-3, 2), DecompositionError, "length -3"),
    ],
    ids=["float-extent", "string-workers", "negative-first", "axis-range", "axis-twice", "negative-length"],
)
def test_malformed_arguments_get_typed_errors(make, error, fragment):
    with pytest.raises(error, match=fragment) as info:
        make()
    assert isinstance(info.value, LinopError)


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda: Partition((2,), np.array([5, 3])), Partition((2,), (5, 3))),
        (lambda: Partition.grid(np.int64(3), first=2), Partition((3,), (2, 3, 4))),
        (lambda: Partition(np.array([2, 1])), Partition((2, 1))),
    ],
    ids=["numpy-workers", "numpy-int-grid", "numpy-shape"],
)
def test_numpy_integers_are_accepted(make, expected):
    assert make() == expected


def test_subpartitions_follow_the_order_of_the_axes():
    p = Partition((2, 3), workers=(10, 11, 12, 13, 14, 15))
    (transposed,) = p.subpartitions([1, 0])
    assert transposed.shape == (3, 2)
    assert transposed.workers == (10, 13, 11, 14, 12, 15)
    assert [q.workers for q in p.subpartitions([-1])] == [q.workers for q in p.subpartitions([1])]


def test_partition_lookup_errors_name_the_culprit():
    p = Partition.grid((2, 2))
    with pytest.raises(PartitionError, match=r"index \(2, 0\) is outside"):
        p.worker((2, 0))
    with pytest.raises(PartitionError, match="worker 9 is not in partition"):
        p.index(9)


# -- decompositions ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("length", "parts", "expected"),
    [(5, 3, (2, 2, 1)), (5, 8, (1, 1, 1, 1, 1, 0, 0, 0)), (6, 3, (2, 2, 2)), (0, 2, (0, 0)), (7, 1, (7,))],
    ids=["5/3", "5/8-empty-shares", "even", "empty", "one-part"],
)
def test_balanced_sizes_larger_first(length, parts, expected):
    assert balanced_sizes(length, parts) == expected


@given(st.integers(0, 50), st.integers(1, 12))
@FAST
def test_balanced_sizes_differ_by_at_most_one(length, parts):
    sizes = balanced_sizes(length, parts)
    assert sum(sizes) == length and len(sizes) == parts
    assert max(sizes) - min(sizes) <= 1
    assert list(sizes) == sorted(sizes, reverse=True)


def test_balanced_sizes_reject_zero_parts():
    with pytest.raises(DecompositionError):
        balanced_sizes(3, 0)


def test_balanced_sizes_refuse_more_parts_than_they_can_list_naming_the_count():
    """Found by the long fuzz campaign: 2**40 parts raised a bare MemoryError (after minutes
    of allocation); the largest count listed still works."""
    from linop.partition import MAX_LISTED_PARTS

    with pytest.raises(DecompositionError, match=str(2**40)):
        balanced_sizes(2**31, 2**40)
    assert len(balanced_sizes(3, MAX_LISTED_PARTS)) == MAX_LISTED_PARTS


def test_intersect_boxes():
    assert intersect(((0, 0), (4, 4)), ((2, 3), (6, 5))) == ((2, 3), (4, 4))
    assert intersect(((0,), (2,)), ((2,), (5,))) is None
    assert intersect(((0,), (0,)), ((0,), (5,))) is None


# -- distributed tensors ----------------------------------------------------------------------------
def test_five_entries_over_eight_workers_leave_three_empty_blocks():
    t = DistributedTensor("x", (5,), Partition.grid((8,)))
    assert [b.shape for b in t.blocks] == [(1,)] * 5 + [(0,)] * 3
    assert t.space.size == 5
    state = t.scatter(np.arange(5))
    assert state["x[7]"].shape == (0,)
    assert np.array_equal(t.gather(state), np.arange(5))


def test_blocks_know_their_boxes_names_and_workers():
    t = DistributedTensor("w", (7, 4), Partition((2, 2), (5, 6, 7, 8)), sizes=((3, 4), (4, 0)))
    assert t.box((1, 0)) == ((3, 0), (7, 4))
    assert t.block((1, 1)).shape == (4, 0)
    assert t.block((0, 1)).worker == 6
    assert t.block_name((1, 0)) == "w[1,0]"
    assert t.space.workers == (5, 6, 7, 8)
    region = t.region((1, 0), ((4, 1), (6, 3)))
    assert (region.name, region.start, region.stop) == ("w[1,0]", (1, 1), (3, 3))


@given(distributed_tensors())
@FAST
def test_scatter_then_gather_is_the_identity(t):
    array = np.arange(int(np.prod(t.global_shape)), dtype=np.int64).reshape(t.global_shape)
    state = t.scatter(array)
    assert set(state) == set(t.space.names)
    assert np.array_equal(t.gather(state), array)


@given(distributed_tensors())
@FAST
def test_blocks_tile_the_global_array_exactly_once(t):
    cover = np.zeros(t.global_shape, dtype=np.int64)
    for index in t.partition.indices():
        start, stop = t.box(index)
        cover[tuple(slice(a, b) for a, b in zip(start, stop))] += 1
    assert np.all(cover == 1)


@given(st.data())
@FAST
def test_drawn_decompositions_add_up(data):
    shape = data.draw(st.lists(st.integers(0, 9), min_size=1, max_size=3).map(tuple))
    grid = data.draw(st.lists(st.integers(1, 4), min_size=len(shape), max_size=len(shape)).map(tuple))
    sizes = data.draw(decompositions(shape, grid))
    assert [sum(s) for s in sizes] == list(shape)
    assert [len(s) for s in sizes] == list(grid)
    DistributedTensor("x", shape, Partition.grid(grid), sizes)


@pytest.mark.parametrize(
    ("make", "error", "fragment"),
    [
        (
            lambda: DistributedTensor("x", (4, 4), Partition.grid((2,))),
            PartitionError,
            "rank 2 but partition",
        ),
        (
            lambda: DistributedTensor("x", (4,), Partition.grid((2,)), sizes=((1, 2),)),
            DecompositionError,
            r"add up to 3, not the global extent 4",
        ),
        (
            lambda: DistributedTensor("x", (4,), Partition.grid((2,)), sizes=((4,),)),
            DecompositionError,
            "1 sizes for 2 workers",
        ),
        (
            lambda: DistributedTensor("x", (4,), Partition.grid((2,)), sizes=((5, -1),)),
            DecompositionError,
            "negative size",
        ),
        (
            lambda: DistributedTensor("x", (4, 2), Partition.grid((2, 1)), sizes=((2, 2),)),
            DecompositionError,
            "sizes given for 1 dimensions",
        ),
    ],
    ids=["rank-mismatch", "sizes-do-not-add-up", "size-count", "negative-size", "missing-dimension"],
)
def test_bad_tensors_get_typed_errors(make, error, fragment):
    with pytest.raises(error, match=fragment) as info:
        make()
    assert isinstance(info.value, LinopError)
    assert "'x'" in str(info.value)


@pytest.mark.parametrize(
    ("make", "error", "fragment"),
    [
        (lambda t: t.box((2, 0)), PartitionError, r"index \(2, 0\) is outside partition \(2, 2\)"),
        (lambda t: t.box((-1, 0)), PartitionError, r"index \(-1, 0\) is outside"),
        (lambda t: t.block((0,)), PartitionError, r"index \(0,\) is outside"),
        (lambda t: t.region((0, 3), ((0, 0), (1, 1))), PartitionError, r"index \(0, 3\) is outside"),
        (
            lambda t: t.region((1, 0), ((0, 0), (4, 1))),
            RegionError,
            r"global box \(\(0, 0\), \(4, 1\)\) is not inside the box \(\(3, 0\), \(5, 2\)\) of block 'x\[1,0\]'",
        ),
        (
            lambda t: t.region((0, 0), ((0, 0), (1,))),
            RegionError,
            r"global box \(\(0, 0\), \(1,\)\) is not inside",
        ),
        (
            lambda t: DistributedTensor("x", (4,), (2,)),
            TypeError,
            "partition must be a Partition, not tuple",
        ),
        (
            lambda t: DistributedTensor("x", (4.0,), Partition((2,))),
            DecompositionError,
            r"tensor 'x': global shape \(4.0,\)",
        ),
        (
            lambda t: DistributedTensor("x", (4,), Partition((2,)), sizes=(3,)),
            DecompositionError,
            r"tensor 'x': dimension 0 has 1 sizes for 2 workers",
        ),
    ],
    ids=[
        "index-too-large",
        "negative-index",
        "index-rank",
        "region-index",
        "region-box-outside-the-block",
        "region-box-wrong-rank",
        "not-a-partition",
        "float-extent",
        "sizes-not-nested",
    ],
)
def test_bad_tensor_arguments_get_typed_errors(make, error, fragment):
    tensor = DistributedTensor("x", (5, 4), Partition.grid((2, 2)))
    with pytest.raises(error, match=fragment):
        make(tensor)


def test_numpy_sizes_are_accepted():
    sizes = np.array([[1, 3], [2, 0]])
    tensor = DistributedTensor("x", np.array([4, 2]), Partition.grid((2, 2)), sizes)
    assert tensor == DistributedTensor("x", (4, 2), Partition.grid((2, 2)), ((1, 3), (2, 0)))


def test_scatter_rejects_an_array_of_the_wrong_shape():
    t = DistributedTensor("x", (3, 2), Partition.grid((1, 2)))
    with pytest.raises(DecompositionError, match=r"shape \(2, 3\) does not match global shape \(3, 2\)"):
        t.scatter(np.zeros((2, 3)))


def _workers(tensor):
    return set(tensor.partition.workers)


@pytest.mark.parametrize(
    "situation",
    [
        lambda x, y: not _workers(x) & _workers(y),
        lambda x, y: _workers(x) & _workers(y) and _workers(x) != _workers(y),
        lambda x, y: _workers(x) == _workers(y) and x.partition != y.partition,
        lambda x, y: any(0 in dim for dim in x.sizes) and x.sizes != y.sizes,
        lambda x, y: x.partition.size == 1 and y.partition.size > 1,
    ],
    ids=["disjoint", "overlapping", "same-workers-other-grid", "empty-share", "scatter-like"],
)
def test_tensor_pairs_reach_every_distdl_situation(situation):
    """The strategy's docstring promises these situations; hypothesis must be able to find each."""
    found = find(
        tensor_pairs(),
        lambda pair: bool(situation(*pair)),
        settings=settings(max_examples=2000, database=None, phases=[Phase.generate], derandomize=True),
    )
    assert situation(*found)


def test_a_rank_zero_tensor_scatters_into_a_zero_d_array():
    t = DistributedTensor("x", (), Partition(()))
    array = np.array(5.0)
    state = t.scatter(array)
    assert isinstance(state["x[]"], np.ndarray) and state["x[]"].shape == ()
    assert not np.shares_memory(state["x[]"], array)
    assert t.gather(state) == array


# -- consecutive workers, described -----------------------------------------------------------------
def _peak_bytes(build) -> int:
    import tracemalloc

    tracemalloc.start()
    try:
        build()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_consecutive_workers_are_described_not_enumerated():
    """2^30 workers cost what 4 do: the ids are a WorkerRange (O(1) memory, membership and
    position), equal to the tuple of them however they were given."""
    from linop.partition import WorkerRange

    huge = Partition((1 << 15, 1 << 15))
    assert isinstance(huge.workers, WorkerRange) and huge.size == 1 << 30
    assert huge.max_worker == (1 << 30) - 1 and (1 << 30) - 1 in huge and (1 << 30) not in huge
    assert huge.index(huge.worker((3, 4))) == (3, 4)
    assert _peak_bytes(lambda: Partition((1 << 15, 1 << 15))) < 100_000
    assert _peak_bytes(lambda: Partition.grid((1 << 15, 1 << 15), first=7)) < 100_000
    small = Partition((2, 3), workers=(4, 5, 6, 7, 8, 9))
    assert small == Partition.grid((2, 3), first=4) == Partition((2, 3), workers=range(4, 10))
    assert hash(small) == hash(Partition.grid((2, 3), first=4))
    assert small.workers == (4, 5, 6, 7, 8, 9) == tuple(small.workers) and small.workers == range(4, 10)
    assert small.workers[1:3] == (5, 6) and next(reversed(small.workers)) == 9
    assert hash(small.workers) == hash((4, 5, 6, 7, 8, 9))
    assert repr(small) == "Partition(shape=(2, 3), workers=(4, 5, 6, 7, 8, 9))"


def test_control_listed_workers_are_enumerated():
    """The memory measure catches a partition that holds its ids one by one."""
    count = 1 << 16
    shuffled = tuple(reversed(range(count)))
    assert _peak_bytes(lambda: Partition((count,), workers=shuffled)) > 8 * count
    assert Partition((count,), workers=shuffled) != Partition((count,))


@pytest.mark.parametrize(("first", "named"), [(4, "<= 2147483647, got 2147483651"), (-3, ">= 0, got -3")])
def test_a_grid_of_ids_out_of_range_names_one_without_listing_them(first, named):
    """Found by the long fuzz campaign: ``Partition.grid(2**31, first=4)`` listed 2**31 ids to
    name the offending one and raised a bare MemoryError."""
    with pytest.raises(PartitionError, match=re.escape(named)):
        Partition.grid(2**31, first=first)
