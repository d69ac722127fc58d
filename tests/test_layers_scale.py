"""The layers' per-rank descriptions at scale: the closed-form decisions of Convolution and
Affine (whether the input is broadcast, whether the output is reduced, the default output
partition) equal the per-block brute force over many partitions, custom worker tables
included, and a layer of many workers is described without one look-up per block."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from linop import DistributedTensor, Kernel, Partition
from linop.layers import Affine, Convolution
from linop.layers.conv import broadcasts_input, reduces_output


def brute_broadcasts(px: Partition, pw: Partition) -> bool:
    """The per-block test the closed form replaces."""
    return not (pw.shape[1] == 1 and all(pw.worker((0, 0, *g[1:])) == px.worker(g) for g in px.indices()))


def brute_reduces(pw: Partition, py: Partition) -> bool:
    return not (
        pw.shape[2] == 1 and all(pw.worker((0, g[1], 0, *g[2:])) == py.worker(g) for g in py.indices())
    )


def brute_output(pw: Partition) -> Partition:
    p_co, spatial = pw.shape[1], pw.shape[3:]
    grid = itertools.product(*(range(n) for n in (p_co, *spatial)))
    return Partition((1, p_co, *spatial), tuple(pw.worker((0, co, 0, *s)) for co, *s in grid))


def tables(count: int, rng: random.Random) -> list[tuple[int, ...]]:
    """Worker tables of ``count`` ids: consecutive from 0 and from 5, reversed, shuffled,
    with gaps, and consecutive but for one swapped pair (equal to none of the others)."""
    base = list(range(count))
    shuffled = base[:]
    rng.shuffle(shuffled)
    swapped = base[:]
    if count > 1:
        swapped[-1], swapped[-2] = swapped[-2], swapped[-1]
    return [
        tuple(base),
        tuple(range(5, 5 + count)),
        tuple(reversed(base)),
        tuple(shuffled),
        tuple(3 * w + 1 for w in base),
        tuple(swapped),
    ]


def partitions(shape: tuple[int, ...], rng: random.Random) -> list[Partition]:
    return [Partition(shape, t) for t in tables(Partition(shape).size, rng)]


SHAPES = [(1,), (3,), (2, 2), (1, 3), (2, 3), (2, 1, 2)]


@pytest.mark.parametrize("spatial", SHAPES)
@pytest.mark.parametrize("p_ci", [1, 2])
@pytest.mark.parametrize("p_co", [1, 2])
def test_the_closed_form_decisions_equal_the_per_block_tests(spatial, p_ci, p_co):
    rng = random.Random(hash((spatial, p_ci, p_co)) % 1000)
    seen = set()
    for px in partitions((1, p_ci, *spatial), rng):
        for pw in partitions((1, p_co, p_ci, *spatial), rng):
            got = broadcasts_input(px, pw)
            assert got == brute_broadcasts(px, pw), (px, pw)
            seen.add(("broadcast", got))
    for pw in partitions((1, p_co, p_ci, *spatial), rng):
        for py in partitions((1, p_co, *spatial), rng):
            got = reduces_output(pw, py)
            assert got == brute_reduces(pw, py), (pw, py)
            seen.add(("reduce", got))
    if p_co == 1:  # both answers occur: the cases tell the closed form from a constant
        assert {("broadcast", True), ("broadcast", False)} <= seen
    if p_ci == 1:
        assert {("reduce", True), ("reduce", False)} <= seen


@pytest.mark.parametrize("spatial", [(3,), (2, 2), (2, 3)])
@pytest.mark.parametrize("p_ci", [1, 2])
@pytest.mark.parametrize("p_co", [1, 2])
def test_a_convolution_decides_and_places_as_the_per_block_tests(spatial, p_ci, p_co):
    rng = random.Random(7)
    dims = len(spatial)
    for px in partitions((1, p_ci, *spatial), rng)[:4]:
        x = DistributedTensor("x", (2, 4, *(6 * n for n in spatial)), px)
        for pw in partitions((1, p_co, p_ci, *spatial), rng)[:4]:
            default = Convolution(x, 4, Kernel((3,) * dims, padding=1), workers=pw)
            assert default.y.partition == brute_output(pw)
            assert list(default.y.partition.workers) == list(brute_output(pw).workers)
            assert default.broadcasts_input == brute_broadcasts(px, pw)
            assert default.reduces_output == brute_reduces(pw, default.y.partition)
            for py in partitions((1, p_co, *spatial), rng)[:3]:
                layer = Convolution(x, 4, Kernel((3,) * dims, padding=1), workers=pw, output=py)
                assert layer.broadcasts_input == brute_broadcasts(px, pw)
                assert layer.reduces_output == brute_reduces(pw, py)


@pytest.mark.parametrize("p_fo, p_fi", [(1, 1), (1, 3), (2, 1), (2, 3)])
def test_an_affine_decides_and_places_as_the_per_block_tests(p_fo, p_fi):
    rng = random.Random(3)
    for px in partitions((1, p_fi), rng):
        x = DistributedTensor("x", (2, 6), px)
        for pw in partitions((p_fo, p_fi), rng):
            default = Affine(x, 4, workers=pw)
            expected_out = tuple(pw.worker((fo, 0)) for fo in range(p_fo))
            assert list(default.y.partition.workers) == list(expected_out)
            for py in partitions((1, p_fo), rng)[:3]:
                layer = Affine(x, 4, workers=pw, output=py)
                broadcasts = not (
                    p_fo == 1 and all(pw.worker((0, f)) == px.worker((0, f)) for f in range(p_fi))
                )
                reduces = not (p_fi == 1 and all(pw.worker((f, 0)) == py.worker((0, f)) for f in range(p_fo)))
                assert (layer.broadcasts_input, layer.reduces_output) == (broadcasts, reduces)


def _counted(monkeypatch, owner, name):
    """The indices passed to ``owner.name`` (a method of one index) from now on, as a list."""
    calls = []
    original = getattr(owner, name)

    def counted(self, index):
        calls.append(index)
        return original(self, index)

    monkeypatch.setattr(owner, name, counted)
    return calls


@pytest.mark.parametrize("layer", ["conv", "affine"])
def test_a_layer_of_many_workers_is_described_without_a_look_up_per_block(layer, monkeypatch):
    """P = 65,536 workers (consecutive): the description asks the partitions for a handful of
    workers, not one per block (the per-block test asked 2 P times)."""
    calls = _counted(monkeypatch, Partition, "worker")
    if layer == "conv":
        x = DistributedTensor("x", (2, 4, 2048, 2048), Partition((1, 1, 256, 256)))
        built = Convolution(x, 4, Kernel(3, padding=1))
        assert not built.broadcasts_input and not built.reduces_output
    else:
        x = DistributedTensor("x", (2, 4 * 65536), Partition((1, 65536)))
        built = Affine(x, 4)
        assert not built.broadcasts_input and built.reduces_output
    assert len(calls) < 16, len(calls)


@pytest.mark.parametrize("shape", [(), (3,), (2, 3), (1, 2, 2)])
def test_a_loss_finds_a_block_index_from_its_name_as_the_table_did(shape):
    from linop.errors import LayerError
    from linop.layers import Loss

    x = DistributedTensor("x", tuple(4 * n for n in shape), Partition(shape))
    loss = Loss(x, "mse")
    table = {x.block_name(j): j for j in x.partition.indices()}
    for name, j in table.items():
        assert loss.partial_name(name) == loss.partials.block_name(j)
        assert loss.output_name(name) == loss.y.block_name(j)
    wrong = [
        "x",
        "x[",
        "x[9]",
        "x[0,0,0,0]",
        "y[0]",
        "x[01]",
        "x[-1]",
        "x[ 1]",
        "x[1,]",
        "xx[0]",
        "x[0]x",
        "x[\u00b2]",
    ]
    for name in [w for w in wrong if w not in table] + [3, None]:
        with pytest.raises(LayerError, match="is not a block of"):
            loss.partial_name(name)


def test_a_loss_of_many_workers_names_a_block_without_a_table_of_them(monkeypatch):
    from linop.layers import Loss

    x = DistributedTensor("x", (1024, 1024), Partition((256, 256)))
    loss = Loss(x, "mse")
    calls = _counted(monkeypatch, DistributedTensor, "block_name")
    assert loss.partial_name("x[128,3]") == "loss_part[128,3]"
    assert len(calls) < 4, len(calls)


def _placement_cases():
    """(partition, mapping, size) triples: consecutive, offset, shuffled and gapped worker
    tables, without a map and under blocked, round-robin, dict and sequence maps."""
    from linop.program import WorkerMap

    rng = random.Random(5)
    for shape in [(1,), (4,), (2, 3), (1, 2, 2)]:
        for table in tables(Partition(shape).size, rng):
            partition = Partition(shape, table)
            top = max(table) + 1
            yield partition, None, top
            for ranks in (1, 2, 3):
                yield partition, WorkerMap.blocked(top, ranks), ranks
                yield partition, WorkerMap.round_robin(top, ranks), ranks
            ranks_of = [rng.randrange(3) for _ in range(top)]
            yield partition, ranks_of, 3
            yield partition, {w: ranks_of[w] for w in range(top)}, 3


def test_a_placement_finds_the_blocks_it_holds_as_testing_every_block_does():
    from types import SimpleNamespace

    from linop.frameworks.torch_placement import Placement

    for partition, mapping, size in _placement_cases():
        for rank in range(size):
            placement = Placement(mapping, SimpleNamespace(rank=rank, size=size), None, partition.workers)
            expected = [g for g in partition.indices() if placement.holds(partition.worker(g))]
            assert placement.held(partition) == expected, (partition, mapping, rank)
        alone = Placement(mapping, None, None)
        assert alone.held(partition) == list(partition.indices())


def test_a_placement_lists_the_workers_to_check_only_for_a_map():
    from types import SimpleNamespace

    from linop.errors import WorkerMapError
    from linop.frameworks.torch_placement import Placement

    asked = []

    def workers():
        asked.append(True)
        return [0, 1, 5]

    comm = SimpleNamespace(rank=0, size=2)
    Placement(None, comm, None, workers)
    Placement([0, 1, 0, 1, 0, 1], None, None, workers)  # one process: no map used
    assert not asked
    with pytest.raises(WorkerMapError, match="worker 5"):
        Placement([0, 1, 0, 1, 0], comm, None, workers)
    assert asked == [True]


@pytest.mark.parametrize("shape", [(), (3,), (2, 3)])
def test_a_loss_describes_its_partial_sums_as_the_listed_grid(shape):
    from linop import BlockGrid
    from linop.layers import Loss
    from linop.layout import ProductShapes

    workers = tuple(range(7, 7 + Partition(shape).size))  # consecutive from 7
    x = DistributedTensor("x", tuple(4 * n for n in shape), Partition(shape, workers))
    loss = Loss(x, "mse")
    listed = BlockGrid("loss_part", x.partition, ((1,),) * x.partition.size)
    assert isinstance(loss.partials.shapes, ProductShapes)  # no tuple of P shapes
    assert loss.partials == listed and hash(loss.partials) == hash(listed)
    assert loss.partials.blocks == listed.blocks


def test_a_joined_space_s_blocks_on_a_rank_under_a_map_are_found_without_listing_it():
    """``owned_blocks`` of a :class:`~linop.pieces.JoinedSpace` (a convolution's pass-through
    parameters next to a grid of copies) under a worker map asks each of the rank's workers
    (no list of the P blocks), in the order the listed space gives."""
    from linop.layout import BlockGrid
    from linop.pieces import JoinedSpace
    from linop.program import WorkerMap
    from linop.program.projection import owned_blocks
    from linop.space import Space

    grid = BlockGrid.uniform("a", Partition((1 << 16,)), (2,)).space
    few = BlockGrid.uniform("b", Partition((4,), (7, 8, 9, 10)), (1,)).space
    joined = JoinedSpace((grid, few))
    found = owned_blocks(joined, 2, WorkerMap.blocked(1 << 16, 1 << 14))  # workers 8-11
    assert [b.name for b in found] == ["a[8]", "a[9]", "a[10]", "a[11]", "b[1]", "b[2]", "b[3]"]
    with pytest.raises(AttributeError):
        object.__getattribute__(joined, "_blocks")  # never listed
    rng = np.random.default_rng(3)
    for _ in range(30):  # against the listed space, small
        n, m = (int(k) for k in rng.integers(1, 12, 2))
        a = BlockGrid.uniform("a", Partition((n,)), (2,)).space
        b = BlockGrid.uniform("b", Partition((m,), tuple(range(3, 3 + m))), (1,)).space
        workers, ranks = max(n, m + 3), int(rng.integers(1, 6))
        mapping = (
            WorkerMap.round_robin(workers, ranks) if rng.random() < 0.5 else WorkerMap.blocked(workers, ranks)
        )
        for rank in range(ranks):
            listed = Space(list(a.blocks) + list(b.blocks))
            assert owned_blocks(JoinedSpace((a, b)), rank, mapping) == owned_blocks(listed, rank, mapping)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("p_co,p_ci", [(1, 1), (2, 1), (1, 2), (2, 3)])
def test_a_convolution_s_copy_gradient_sum_is_described_and_equals_the_listed_one(p_co, p_ci, bias):
    """The replicated parameters' gradient sum built from described grids (no list of the P
    shapes or blocks) moves exactly what the same all-reduces of listed grids move."""
    from linop.collectives import AllReduce
    from linop.layout import BlockGrid
    from linop.space import Space

    x = DistributedTensor("x", (2, 6, 9, 7), Partition((1, p_ci, 3, 2)))
    layer = Convolution(x, 5, Kernel(3, padding=1), workers=Partition((1, p_co, p_ci, 3, 2)), bias=bias)
    size = tuple(layer.kernel.size[2:])
    shapes = tuple((layer.co_sizes[co], layer.ci_sizes[ci], *size) for _, co, ci, *_ in layer.work.indices())
    weights = BlockGrid("wt", layer.work, shapes)
    if bias:
        copies = layer._bias_copies
        b = BlockGrid("bt", copies, tuple((layer.co_sizes[g[-1]],) for g in copies.indices()))
        listed = AllReduce(b, (0, 1), others=Space(weights.blocks)) @ AllReduce(
            weights, (3, 4), others=Space(b.blocks)
        )
    else:
        listed = AllReduce(weights, (3, 4))
    ours = layer.copy_gradient_sum
    assert ours.domain == listed.domain and ours.range == listed.range
    rng = np.random.default_rng(p_co * 10 + p_ci)
    state = {blk.name: rng.integers(-9, 9, blk.shape) for blk in listed.domain.blocks}
    got, want = ours.apply(state), listed.apply(state)
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)
