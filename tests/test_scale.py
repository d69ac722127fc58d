"""Per-rank planning is O(the rank's own work) plus a small O(P) description (issue 13).

What one rank spends before moving a byte (building the tree, its fingerprint, and compiling its
own schedule as :class:`~linop.backends.mpi.plan.DistributedPlan` does:
:func:`~linop.program.compile_for_rank`) is pinned by operation counts that do not
depend on timing:

* the *objects* of the model built while a rank plans: every :class:`~linop.Block` and
  :class:`~linop.Region` constructed, and every block a :class:`~linop.Space` holds in full
  (a :class:`~linop.space.GridSpace` holds none until asked for all of them);
* for the halo cases, the count for compiling one interior rank is the same at P = 64 and
  P = 256 (independent of P: the rank visits its neighbours only), and so is its schedule;
* for every case, the count of the whole plan grows at most linearly (ratio < 6 when P grows
  4x; linear gives 4, quadratic 16).

A plan that builds one P-block space per worker (the old shims) fails the linear bound; the
global program (every rank's transfers) fails the independence. ``benchmarks/bench_scale.py``
measures seconds and megabytes.
"""

from __future__ import annotations

import importlib
import itertools
import math
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from linop import Block, Region, Space
from linop.backends.mpi.native import mpi_schedule
from linop.backends.mpi.plan import Compiled
from linop.program import RankPhase, WorkerMap, compile_for_rank, compile_program, fingerprint
from linop.program.mapped import MappedCompiled

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
    pytest.param("AllReduce axes (0,1)", id="allreduce-whole"),
    pytest.param("AllReduce batch norm (1,1,s,s)", id="allreduce-batch-norm"),
    pytest.param("Repartition (s,s) -> (2s,s/2)", id="repartition"),
    pytest.param("AllGather axis 0", id="allgather"),
]
HALO = CASES[:2]


def _counted(run: Callable[[], object], monkeypatch: pytest.MonkeyPatch) -> int:
    """Blocks and regions constructed, plus blocks held by spaces in full, while ``run`` runs."""
    count = [0]
    adopt, block_check, trusted = Space._adopt, Block.__post_init__, Block.trusted.__func__  # type: ignore[attr-defined]
    region_check, checked = Region.__post_init__, Region._checked.__func__  # type: ignore[attr-defined]

    def counting_adopt(self: Space, ordered: tuple) -> None:
        count[0] += len(ordered)
        adopt(self, ordered)

    def counting_block(self: Block) -> None:
        count[0] += 1
        block_check(self)

    def counting_trusted(cls: type, *args: object) -> Block:
        count[0] += 1
        return trusted(cls, *args)

    def counting_region(self: Region) -> None:
        count[0] += 1
        region_check(self)

    def counting_checked(cls: type, *args: object) -> Region:
        count[0] += 1
        return checked(cls, *args)

    with monkeypatch.context() as patch:
        patch.setattr(Space, "_adopt", counting_adopt)
        patch.setattr(Block, "__post_init__", counting_block)
        patch.setattr(Block, "trusted", classmethod(counting_trusted))
        patch.setattr(Region, "__post_init__", counting_region)
        patch.setattr(Region, "_checked", classmethod(counting_checked))
        run()
    return count[0]


def _rank(s: int) -> int:
    return (s // 2) * s + s // 2


def _tree(case: str, s: int, adjoint: bool):
    op = bench_scale.CASES[case](s)
    return op.H if adjoint else op


def _whole_plan(case: str, s: int, adjoint: bool, monkeypatch: pytest.MonkeyPatch) -> int:
    def plan() -> None:
        op = _tree(case, s, adjoint)
        fingerprint(op)
        compile_for_rank(op, _rank(s))

    return _counted(plan, monkeypatch)


@pytest.mark.parametrize("adjoint", [False, True], ids=["forward", "adjoint"])
@pytest.mark.parametrize("case", CASES)
def test_planning_grows_linearly(case: str, adjoint: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    small = _whole_plan(case, 8, adjoint, monkeypatch)
    large = _whole_plan(case, 16, adjoint, monkeypatch)
    assert large / max(small, 1) < LINEAR, f"{case}: {small} objects at P = 64, {large} at P = 256"


def _messages(schedule: tuple) -> list[tuple]:
    """A schedule's messages, shape-free: (direction, grid offset of the peer, tag, shape)."""
    out = []
    for step in schedule:
        if isinstance(step, RankPhase):
            out += [("recv", tag, t.shape) for _, tag, t in step.receives]
            out += [("send", tag, t.shape) for _, tag, t in step.sends]
        else:
            out.append(type(step).__name__)
    return out


@pytest.mark.parametrize("adjoint", [False, True], ids=["forward", "adjoint"])
@pytest.mark.parametrize("case", HALO)
def test_halo_rank_compiles_independently_of_p(
    case: str, adjoint: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One interior rank's compile builds as many objects at P = 256 as at P = 64, and its
    schedule is the same (messages, tags, shapes)."""
    counts, schedules = [], []
    for s in (8, 16):
        op = _tree(case, s, adjoint)
        found: list[tuple] = []
        counts.append(
            _counted(
                lambda op=op, s=s, found=found: found.append(compile_for_rank(op, _rank(s)).schedule),
                monkeypatch,
            )
        )
        schedules.append(_messages(found[0]))
    assert counts[0] == counts[1], f"{case}: {counts[0]} objects at P = 64, {counts[1]} at P = 256"
    assert schedules[0] == schedules[1]
    assert len(schedules[0]) > 0


@pytest.mark.parametrize("case", HALO)
def test_a_plan_compiles_only_its_rank(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """What :class:`~linop.backends.mpi.plan.DistributedPlan` compiles (the fingerprint and the
    rank's program, :class:`~linop.backends.mpi.plan.Compiled`) builds no object per worker."""
    counts = []
    for s in (8, 16):
        op = _tree(case, s, False)
        counts.append(_counted(lambda op=op, s=s: Compiled(op).for_rank(op, _rank(s)), monkeypatch))
    assert counts[0] == counts[1], f"{case}: {counts[0]} objects at P = 64, {counts[1]} at P = 256"


def _geometry_work(
    case: str, s: int, adjoint: bool, monkeypatch: pytest.MonkeyPatch, listed: bool = False
) -> int:
    """Geometry rows built, fill segments and widths computed while one interior rank plans a
    halo case (the tree, its fingerprint, its compile); ``listed`` also lists every row, as
    the geometry did before issue 24 (the control)."""
    geometry_module = importlib.import_module("linop.halo_geometry")  # the module, not the function
    count = [0]
    build, fills = geometry_module.DimGeometry.build.__func__, geometry_module._fill_segments  # type: ignore[attr-defined]

    def counting_build(cls: type, *args: object) -> object:
        count[0] += 1
        return build(cls, *args)

    def counting_fills(*args: object, **kwargs: object) -> object:
        count[0] += 1
        return fills(*args, **kwargs)

    def counting_width(self: object, *args: object) -> object:
        count[0] += 1
        return width(self, *args)

    width = geometry_module.GeometryRows.width
    with monkeypatch.context() as patch:
        patch.setattr(geometry_module.DimGeometry, "build", classmethod(counting_build))
        patch.setattr(geometry_module, "_fill_segments", counting_fills)
        patch.setattr(geometry_module.GeometryRows, "width", counting_width)
        op = _tree(case, s, adjoint)
        if listed:
            geometry = op.geometry if hasattr(op, "geometry") else None
            for rows in geometry.rows if geometry is not None else ():
                tuple(rows)
        fingerprint(op)
        compile_for_rank(op, _rank(s))
    return count[0]


@pytest.mark.parametrize("adjoint", [False, True], ids=["forward", "adjoint"])
@pytest.mark.parametrize("case", HALO)
def test_halo_rank_builds_its_neighbours_geometry_only(
    case: str, adjoint: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The geometry's rows, fill segments and widths are described: one interior rank's
    planning builds as many at P = 64 as at P = 4096 (its own and its neighbours'), where
    listing the rows builds 2 sqrt(P) of them (the control). Comparing two spaces of local
    blocks compares the rows' shares, not every width."""
    counts = [_geometry_work(case, s, adjoint, monkeypatch) for s in (8, 64)]
    assert counts[0] == counts[1] > 0, (
        f"{case}: {counts[0]} rows and fills at P = 64, {counts[1]} at P = 4096"
    )
    if case == "HaloExchange":
        listed = [_geometry_work(case, s, adjoint, monkeypatch, listed=True) for s in (8, 64)]
        assert listed[1] - listed[0] >= 2 * (64 - 8)


def test_the_global_program_is_not_independent_of_p(monkeypatch: pytest.MonkeyPatch) -> None:
    """The independence test catches a compile that lowers every rank's transfers."""
    counts = []
    for s in (8, 16):
        op = _tree("HaloExchange", s, False)
        counts.append(_counted(lambda op=op, s=s: compile_program(op).for_rank(_rank(s)), monkeypatch))
    assert counts[1] > 3 * counts[0]


def test_the_count_catches_quadratic_planning(monkeypatch: pytest.MonkeyPatch) -> None:
    """The old shims (one P-block space per worker, :func:`linop.halo.pad_expansion`) fail."""
    from linop.halo import pad_expansion

    def quadratic(s: int):
        from linop import Kernel, halo_geometry

        return pad_expansion(halo_geometry(bench_scale._grid(s), Kernel(3, padding=1)))

    monkeypatch.setitem(bench_scale.CASES, "old pad shim", quadratic)
    small = _whole_plan("old pad shim", 8, False, monkeypatch)
    large = _whole_plan("old pad shim", 16, False, monkeypatch)
    assert large / small > LINEAR


def _block_grid_all_reduce(s: int, *, uneven: bool = False):
    from linop import AllReduce, BlockGrid, Partition

    shapes = [(bench_scale.BLOCK, bench_scale.BLOCK)] * (s * s)
    if uneven:  # the last row's blocks of another shape (each row reduced): checked block by block
        shapes[-s:] = [(bench_scale.BLOCK, bench_scale.BLOCK + 1)] * s
    return AllReduce(BlockGrid("x", Partition((s, s)), tuple(shapes)), 1 if uneven else 0)


def test_all_reduce_on_a_uniform_block_grid_builds_no_block_per_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Building the tree, its fingerprint and one rank's compile construct as many objects at
    P = 256 as at P = 64 (the constructor checks one shape, not every block); the control, a
    grid whose shapes differ, is checked block by block and fails the equality."""

    def plan(uneven: bool, s: int) -> int:
        def run() -> None:
            op = _block_grid_all_reduce(s, uneven=uneven)
            fingerprint(op)
            compile_for_rank(op, _rank(s))

        return _counted(run, monkeypatch)

    assert plan(False, 8) == plan(False, 16)
    assert plan(True, 16) > 3 * plan(True, 8)


DESCRIBED = [
    pytest.param("Broadcast 1 -> P", id="broadcast-one"),
    pytest.param("Broadcast (1,s) -> (s,s)", id="broadcast-row"),
    pytest.param("AllGather axis 0", id="allgather"),
]


@pytest.mark.parametrize("adjoint", [False, True], ids=["forward", "adjoint"])
@pytest.mark.parametrize("case", DESCRIBED)
def test_collective_rank_plans_independently_of_p(
    case: str, adjoint: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Building the tree, its fingerprint and one interior rank's compile construct as many
    objects at P = 256 as at P = 64: the groups are described (a box of the copies'
    partition, the root; an all-gather's line), never listed."""
    counts = [_whole_plan(case, s, adjoint, monkeypatch) for s in (8, 16)]
    assert counts[0] == counts[1], f"{case}: {counts[0]} objects at P = 64, {counts[1]} at P = 256"


def test_a_listed_broadcast_group_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: a rank lowering that lists the group (the copies' blocks, one per copy, as
    the lowering before issue 24 did) fails the equality."""
    from linop.collectives import Broadcast

    def listing(self, index):  # type: ignore[no-untyped-def]
        box = original(self, index)
        for k in range(len(box)):  # one block per copy, as a listed group builds
            self.copies.block(box.grid_index(k))
        return box

    original = Broadcast.copy_box
    monkeypatch.setattr(Broadcast, "copy_box", listing)
    counts = [_whole_plan("Broadcast 1 -> P", s, False, monkeypatch) for s in (8, 16)]
    assert counts[1] > 3 * counts[0]


def test_described_groups_equal_their_lists() -> None:
    """A :class:`~linop.partition.WorkerBox`, the runs MPI includes, the rooted ranks and the
    copy names equal their enumeration on consecutive and listed workers, the root first,
    among the members or outside them."""
    import itertools

    from linop import Partition
    from linop.layout import BlockGrid
    from linop.partition import WorkerBox
    from linop.program.groups import CopyPairs, RootedRanks

    for partition in (Partition((3, 4, 2)), Partition((3, 4, 2), workers=tuple(range(50, 74))[::-1])):
        for fixed in itertools.product(*((None, *range(n)) for n in partition.shape)):
            box = WorkerBox(partition, fixed)
            listed = tuple(
                partition.worker(i)
                for i in partition.indices()
                if all(f is None or f == c for f, c in zip(fixed, i))
            )
            assert tuple(box) == listed and len(box) == len(listed)
            assert all(box.index(w) == k for k, w in enumerate(listed)) and 99 not in box
            runs = [w for first, last, stride in box.triples() for w in range(first, last + 1, stride)]
            assert tuple(runs) == listed
            for root in (listed[0], listed[-1], listed[len(listed) // 2], 99):
                ranks = RootedRanks(root, box)
                expected = (root, *(w for w in listed if w != root))
                assert tuple(ranks) == expected and len(ranks) == len(expected)
                assert [ranks[k] for k in range(len(ranks))] == list(expected)
                spread = [w for a, b, st in ranks.triples() for w in range(a, b + 1, st)]
                assert tuple(spread) == expected
            grid = BlockGrid.uniform("y", partition, (2,))
            pairs = CopyPairs(grid, box)
            assert list(pairs) == [(grid.block_name(partition.index(w)), w) for w in listed]
            assert all(pairs.name_on(w) == grid.block_name(partition.index(w)) for w in listed)
            assert pairs.name_on(99) is None


def test_described_shapes_equal_their_lists() -> None:
    """The copies of a broadcast and the blocks of an all-gather, described by product rules,
    have the shapes the map and the gathered boxes give one by one (padded, broadcast and
    uneven dimensions; a transposed route listed); equal grids hash alike in either form."""
    from linop import AllGather, BlockGrid, Broadcast, DistributedTensor, Partition, broadcast_map
    from linop.layout import ProductShapes

    cases = [
        (DistributedTensor("x", (5, 7), Partition((1, 3))), Partition((4, 3)), False),
        (DistributedTensor("x", (5,), Partition((2,))), Partition((3, 2)), False),
        (DistributedTensor("x", (5, 7), Partition((2, 1))), Partition((2, 3)), False),
        (DistributedTensor("x", (5, 7), Partition((2, 3))), Partition((3, 2)), True),
        (BlockGrid.uniform("x", Partition((1, 2)), (3,)), Partition((2, 2)), False),
    ]
    for tensor, destination, transpose in cases:
        op = Broadcast(tensor, destination, "y", transpose=transpose)
        routes = broadcast_map(tensor.partition, destination, transpose=transpose)
        listed = tuple(tensor.block(routes[j]).shape for j in destination.indices())
        assert op.copies.shapes == listed and listed == op.copies.shapes
        assert all(op.source_index(j) == routes[j] for j in destination.indices())
        assert isinstance(op.copies.shapes, ProductShapes) != transpose
        again = BlockGrid("y", destination, listed)
        assert again == op.copies and hash(again) == hash(op.copies)
    tensor = DistributedTensor("x", (5, 7), Partition((2, 3)))
    for axes in ((0,), (1,), (0, 1)):
        gathered = AllGather(tensor, axes, "g").gathered
        boxes = tuple(
            tuple(n if d in axes else b - a for d, (a, b, n) in enumerate(zip(*tensor.box(i), (5, 7))))
            for i in tensor.partition.indices()
        )
        assert gathered.shapes == boxes and gathered.space.size == sum(math.prod(s) for s in boxes)
    assert ProductShapes((2,), ((1, 2),)) != ((1,), (3,))  # the control: a wrong list differs


def test_repartition_pieces_of_one_block_equal_the_whole_plan() -> None:
    """One rank's pieces of a repartition (found per dimension by bisection on the parts'
    edges) equal the whole plan's pieces of that block, in the plan's order, on balanced and
    unbalanced decompositions with empty parts; the 1-d overlaps equal their listing."""
    import random

    from linop import DistributedTensor, Partition, Repartition
    from linop.pieces import Piece
    from linop.repartition import _boxes_overlap_1d, _overlap_1d

    def decomposition(rng: random.Random, shape: tuple[int, ...], grid: tuple[int, ...]) -> tuple:
        if rng.random() < 0.4:
            return ()
        sizes = []
        for m, p in zip(shape, grid):
            cuts = sorted(rng.randint(0, m) for _ in range(p - 1))
            sizes.append(tuple(b - a for a, b in zip([0, *cuts], [*cuts, m])))
        return tuple(sizes)

    rng = random.Random(2404)
    compared = 0
    for _ in range(200):
        ndim = rng.choice([1, 2, 3])
        shape = tuple(rng.randint(0, 9) for _ in range(ndim))
        grids = [tuple(rng.randint(1, 5) for _ in range(ndim)) for _ in range(2)]
        x = DistributedTensor("x", shape, Partition(grids[0]), decomposition(rng, shape, grids[0]))
        y = DistributedTensor("y", shape, Partition(grids[1]), decomposition(rng, shape, grids[1]))
        for a, b in zip(x.sizes, y.sizes):
            edges_a = tuple(itertools.accumulate(a, initial=0))
            edges_b = tuple(itertools.accumulate(b, initial=0))
            assert [_overlap_1d(edges_a, edges_b, k) for k in range(len(b))] == _boxes_overlap_1d(a, b)
        op = Repartition(x, y)
        whole = [
            Piece(p.source, p.source_start, p.target, p.target_start, p.shape) for p in op.movement.pieces
        ]
        for j in y.partition.indices():
            name = y.block_name(j)
            assert list(op.pieces_into(j)) == [p for p in whole if p.target == name]
        for i in x.partition.indices():
            name = x.block_name(i)
            assert list(op.pieces_from(i)) == [p for p in whole if p.source == name]
        compared += 1
    assert compared == 200


def test_described_offsets_equal_their_running_sums() -> None:
    """:class:`~linop.described.Offsets` equals the running sums of balanced sizes (held by
    their rule) and of any other sizes (listed), with or without the total; a halo geometry's
    widths (:class:`~linop.halo_geometry.Column`) and a tensor's block boxes read them."""
    import random

    from linop import DistributedTensor, Kernel, Partition, balanced_sizes, halo_geometry
    from linop.described import Offsets

    rng = random.Random(24)
    described = 0
    for _ in range(2000):
        parts = rng.randint(1, 12)
        if rng.random() < 0.5:
            sizes = balanced_sizes(rng.randint(0, 40), parts)
        else:
            sizes = tuple(rng.randint(0, 5) for _ in range(parts))
        for total in (False, True):
            expected = tuple(itertools.accumulate(sizes, initial=0))[: None if total else -1]
            offsets = Offsets(sizes, total=total)
            assert tuple(offsets) == expected and offsets == expected and len(offsets) == len(expected)
            assert [offsets[k] for k in range(-len(expected), 0)] == list(expected)
            described += offsets._listed is None
    assert described > 1000
    assert Offsets((2, 1, 2))._listed is not None  # not balanced (a larger part last): listed
    tensor = DistributedTensor("x", (10**6 + 3, 7), Partition((1024, 1)))
    assert tensor.box((1023, 0)) == ((10**6 + 3 - 976, 0), (10**6 + 3, 7))
    geometry = halo_geometry(tensor, Kernel(3, padding=1))
    widths = geometry.column(0, "local_size")
    assert len(widths) == 1024 and widths[0] == 977 + 1 + 1 and widths[-1] == 976 + 1 + 1


def _mapped_plan(
    case: str, s: int, adjoint: bool, monkeypatch: pytest.MonkeyPatch, *, whole: bool = False
) -> int:
    """Objects built while the rank holding the interior worker plans under a map of 4 workers
    per rank (the map built beforehand), as the MPI plan does; ``whole``: the global route."""
    op = _tree(case, s, adjoint)
    mapping = WorkerMap.blocked(s * s, s * s // 4)
    rank = mapping.rank_of(_rank(s))

    def plan() -> None:
        compiled = MappedCompiled(op, mapping, calls=mpi_schedule)
        compiled.per_worker = compiled.per_worker and not whole
        program, problem = compiled.for_rank(rank, s * s // 4)
        assert problem is None and program is not None and program.schedule
        compiled.domain_blocks(rank), compiled.range_names(rank)

    return _counted(plan, monkeypatch)


@pytest.mark.parametrize("adjoint", [False, True], ids=["forward", "adjoint"])
@pytest.mark.parametrize("case", HALO)
def test_a_mapped_rank_plans_its_workers_part_only(
    case: str, adjoint: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a worker map (4 workers per rank) a rank's plan of a halo tree builds as many
    objects at P = 256 as at P = 1024 (its 4 workers interior in both grids); the global route
    it replaced grows (the control)."""
    counts = [_mapped_plan(case, s, adjoint, monkeypatch) for s in (16, 32)]
    assert counts[0] == counts[1], f"{case}: {counts[0]} objects at P = 256, {counts[1]} at P = 1024"
    whole = [_mapped_plan(case, s, adjoint, monkeypatch, whole=True) for s in (8, 16)]
    assert whole[1] > 3 * whole[0]


def _binding(case: str, s: int, adjoint: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[int, int]:
    """Objects built (:func:`_counted`) and bytes exchanged (the test communicator's
    :attr:`~bench_scale.RankOfP.traffic`) while one interior rank of P = s * s binds ``case``
    (:meth:`~linop.backends.mpi.plan.DistributedPlan.bind`: the check, the compiled schedule,
    the bundle agreement) and runs one bound call, on a communicator that answers as that
    rank of P would (:class:`bench_scale.RankOfP`)."""
    op = _tree(case, s, adjoint)
    rank = _rank(s)
    plan = bench_scale.plan_on_rank_of_p(
        op, fingerprint(op), compile_for_rank(op, rank).schedule, rank, s * s
    )
    state = bench_scale.zeros_of(plan)
    found: dict[str, object] = {"plan": plan}
    try:
        before = plan.comm.traffic
        count = _counted(lambda: found.__setitem__("bound", plan.bind(state)), monkeypatch)
        found["bound"]()  # type: ignore[operator]
        return count, plan.comm.traffic - before
    finally:
        bench_scale.release(found)


@pytest.mark.parametrize("adjoint", [False, True], ids=["forward", "adjoint"])
@pytest.mark.parametrize("case", CASES)
def test_binding_depends_on_the_ranks_neighbours_only(
    case: str, adjoint: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Binding a plan and its first bound call build as many objects, and exchange as many
    bytes, at P = 256 as at P = 64 (issue 39: the bundles are agreed with the rank's peers
    only, :func:`~linop.backends.mpi.compiled.bundle_peers`), and the halo cases compile
    persistent requests."""
    pytest.importorskip("mpi4py")
    small, large = (_binding(case, s, adjoint, monkeypatch) for s in (8, 16))
    assert small == large, f"{case}: (objects, bytes) {small} at P = 64, {large} at P = 256"
    if case in ("HaloExchange", "halo_windows"):
        assert small[1] > 0  # the peers were told the bundles


def test_an_agreement_with_every_rank_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: the bundle agreement before issue 39 (an all-to-all of a P-long list, then
    one all-reduce) exchanges about 4x the bytes when P grows 4x."""
    pytest.importorskip("mpi4py")
    from linop.backends.mpi import bound

    def with_every_rank(comm, run):  # type: ignore[no-untyped-def]
        told: list[list[tuple[bool, tuple[int, ...]]]] = [[] for _ in range(comm.Get_size())]
        for peer, sending, tags in run.bundles:
            told[peer].append((sending, tags))
        heard = comm.alltoall(told)
        agreed = all(
            sorted((not sending, tags) for sending, tags in theirs) == sorted(mine)
            for mine, theirs in zip(told, heard)
        )
        return frozenset(run.peers) if comm.allreduce(agreed) else frozenset()

    monkeypatch.setattr(bound, "bundle_peers", with_every_rank)
    small, large = (_binding("HaloExchange", s, False, monkeypatch)[1] for s in (8, 16))
    assert large > 3 * small, f"{small} bytes at P = 64, {large} at P = 256"


class _Arguments:
    """What the test communicators of one binding were given: the longest sequence in the
    arguments of any point-to-point or all-to-all call (the count, displacement and datatype
    arrays of ``Alltoallv`` / ``Alltoallw`` have one entry per rank) and the point-to-point
    requests made."""

    longest = 0
    requests = 0


def _longest(value: object) -> int:
    if isinstance(value, (list, tuple)):
        return max([len(value), *(_longest(item) for item in value)])
    return 0


def _recording(base: type) -> type:
    """A subclass of the test communicator that records its calls' arguments in :class:`_Arguments`."""

    def recorded(name: str, request: bool) -> Callable[..., object]:
        method = getattr(base, name)

        def call(self: object, *args: object, **kwargs: object) -> object:
            _Arguments.longest = max(_Arguments.longest, _longest(list(args)))
            _Arguments.requests += request
            return method(self, *args, **kwargs)

        return call

    names = {"Alltoallv": False, "Alltoallw": False, "Isend": True, "Irecv": True}
    names |= {"Send_init": True, "Recv_init": True}
    return type("Recording", (base,), {name: recorded(name, request) for name, request in names.items()})


_RECORDING = _recording(bench_scale.RankOfP)


def _repartition_calls(s: int, adjoint: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[int, int, int]:
    """Objects built while one interior rank of P = s * s binds the repartition of
    ``bench_scale`` (:func:`_binding`'s count), and what its first checked call, the binding and
    its first bound call give the communicator (:class:`_Arguments`)."""
    monkeypatch.setattr(bench_scale, "RankOfP", _RECORDING)
    _Arguments.longest = _Arguments.requests = 0
    op = _tree("Repartition (s,s) -> (2s,s/2)", s, adjoint)
    rank = _rank(s)
    plan = bench_scale.plan_on_rank_of_p(
        op, fingerprint(op), compile_for_rank(op, rank).schedule, rank, s * s
    )
    state = bench_scale.zeros_of(plan)
    found: dict[str, object] = {"plan": plan}
    try:
        plan.apply(state)
        count = _counted(lambda: found.__setitem__("bound", plan.bind(state)), monkeypatch)
        found["bound"]()  # type: ignore[operator]
        return count, _Arguments.longest, _Arguments.requests
    finally:
        bench_scale.release(found)


@pytest.mark.parametrize("adjoint", [False, True], ids=["forward", "adjoint"])
def test_a_repartition_between_grids_talks_to_the_ranks_peers_only(
    adjoint: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A repartition between two grids (a rank meets O(1) blocks of the other) runs as
    point-to-point messages with the rank's own peers (issue 39): its checked call, binding and
    first bound call build as many objects, give MPI arguments no longer and make as many
    requests at P = 256 as at P = 64. The control: the collective (``Alltoallv``, forced) gets
    count and displacement arrays of P entries."""
    pytest.importorskip("mpi4py")
    from linop.backends.mpi.native import all_to_all

    small, large = (_repartition_calls(s, adjoint, monkeypatch) for s in (8, 16))
    assert small == large, f"(objects, longest argument, requests) {small} at P = 64, {large} at P = 256"
    assert 0 < small[1] < 8 and small[2] > 0, small  # buffer specs; messages were posted
    monkeypatch.setattr(all_to_all, "ALLTOALL_STRATEGY", "packed")
    collective = [_repartition_calls(s, adjoint, monkeypatch)[1] for s in (8, 16)]
    assert collective == [64, 256], collective
