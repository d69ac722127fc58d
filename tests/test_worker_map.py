"""Worker-to-rank maps without MPI: validation errors, the schedules' messages agreeing between
ranks, and 16 workers on one rank run with local moves only, equal to the numpy interpreter."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from linop.backends import numpy as numpy_backend
from linop.backends.mpi.mapping import compile_mapped, compiled_for
from linop.backends.mpi.native import mpi_schedule
from linop.backends.mpi.runtime import run_schedule
from linop.collectives import AllGather, AllReduce, BlockGrid, Broadcast
from linop.errors import CommunicatorError, LinopError, WorkerMapError
from linop.halo import HaloExchange, halo_windows
from linop.halo_geometry import Kernel, halo_geometry
from linop.layers import Convolution
from linop.movement import SendRecv
from linop.operator import LinearOperator
from linop.partition import DistributedTensor, Partition
from linop.pieces import PieceMovement
from linop.program import (
    Local,
    LocalMoves,
    RankBranches,
    RankOverlap,
    RankPhase,
    Transfer,
    WorkerMap,
    batch,
    compile_for_rank,
    compile_program,
    lower_for,
    lower_for_workers,
    lowers_per_worker,
    mapped_global_program,
    owned_blocks,
    project,
)
from linop.program.lowering_pieces import held_blocks, piece_order, piece_steps
from linop.program.mapped import MappedCompiled
from linop.repartition import Repartition, Scatter
from linop.space import Block, Space

WORKERS = 16
lowering_module = importlib.import_module("linop.program.lowering")  # the package's name is the function


def _tensor(name="x", grid=(4, 4)):
    return DistributedTensor(name, (11, 9), Partition(grid))


CASES = {
    "halo": lambda: HaloExchange(halo_geometry(_tensor(), Kernel(3, padding=1))),
    "halo_windows": lambda: halo_windows(_tensor(), Kernel(3, padding=1)),
    "broadcast": lambda: Broadcast(DistributedTensor("x", (7,), Partition((1,))), Partition((16,)), "y"),
    "all-reduce": lambda: AllReduce(BlockGrid.uniform("x", Partition((4, 4)), (3, 2)), (0, 1)),
    "repartition": lambda: Repartition(_tensor(), _tensor("z", (2, 8))),
    "sum": lambda: (
        2 * HaloExchange(halo_geometry(_tensor(), Kernel(3, padding=1)))
        + HaloExchange(halo_geometry(_tensor(), Kernel(3, padding=1)))
    ),
}


@pytest.mark.parametrize(
    "ranks, problem",
    [
        ([0, -1], "worker 1 maps to -1"),
        ([0, True], "worker 1 maps to True"),
        ([0, 1.0], "worker 1 maps to 1.0"),
        ({-2: 0}, "worker -2"),
        ({"a": 0}, "worker 'a'"),
        ("0123", "not str"),
        (7, "not int"),
    ],
    ids=["negative", "bool", "float", "negative-worker", "str-worker", "string", "int"],
)
def test_malformed_maps_raise_a_typed_error(ranks, problem):
    with pytest.raises(WorkerMapError, match=problem) as caught:
        WorkerMap(ranks)
    assert isinstance(caught.value, (CommunicatorError, LinopError, ValueError))


def test_round_robin_blocked_and_lookup():
    assert WorkerMap.round_robin(16, 3).workers_on(2) == (2, 5, 8, 11, 14)
    assert WorkerMap.blocked(16, 3).workers_on(2) == (11, 12, 13, 14, 15)
    assert WorkerMap.blocked(16, 4) == WorkerMap({w: w // 4 for w in range(16)})
    assert hash(WorkerMap.blocked(16, 4)) == hash(WorkerMap([w // 4 for w in range(16)]))
    assert WorkerMap.blocked(16, 4) != WorkerMap.round_robin(16, 4)
    assert WorkerMap.blocked(16, 4).description() != WorkerMap.round_robin(16, 4).description()
    assert WorkerMap.of([0, 0]).rank_of(1) == 0
    with pytest.raises(WorkerMapError, match="worker 2 of the tree is not in the worker map"):
        WorkerMap([0, 0]).rank_of(2)


@pytest.mark.parametrize(
    "mapping, size, problem",
    [
        (WorkerMap({w: 0 for w in range(16) if w != 9}), 1, "worker 9 of the tree is not in the worker map"),
        (
            WorkerMap([3 if w == 6 else 0 for w in range(16)]),
            3,
            "puts worker 6 on rank 3, but the communicator has 3",
        ),
    ],
    ids=["worker-missing", "rank-out-of-range"],
)
def test_maps_that_do_not_fit_the_tree_or_communicator(mapping, size, problem):
    op = CASES["halo"]()
    with pytest.raises(WorkerMapError, match=problem):
        compile_mapped(op, mapping, 0, size)


def _messages(schedule, rank, out):
    """(kind, peer, tag, shape) of every message of a schedule, in order (sums included)."""
    for step in schedule:
        if type(step) is RankPhase:
            out.extend(("recv", peer, tag, t.shape) for peer, tag, t in step.receives)
            out.extend(("send", peer, tag, t.shape) for peer, tag, t in step.sends)
        elif type(step) is RankBranches:
            for term in step.terms:
                _messages(term, rank, out)
    return out


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("kind", ["round-robin", "blocked"])
def test_messages_agree_between_ranks(case, size, kind):
    """What rank a sends to rank b, b receives from a: the same tags and shapes in the same
    order; no rank messages itself; tags of a pair are distinct."""
    op = CASES[case]()
    mapping = getattr(WorkerMap, kind.replace("-", "_"))(WORKERS, size)
    schedules = {r: compile_mapped(op, mapping, r, size).schedule for r in range(size)}
    messages = {r: _messages(schedules[r], r, []) for r in range(size)}
    for a in range(size):
        assert all(peer != a for _, peer, _, _ in messages[a])
        for b in range(size):
            sent = [(tag, shape) for kind_, peer, tag, shape in messages[a] if kind_ == "send" and peer == b]
            got = [(tag, shape) for kind_, peer, tag, shape in messages[b] if kind_ == "recv" and peer == a]
            assert sorted(sent) == sorted(got)
            assert len({tag for tag, _ in sent}) == len(sent)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("adjoint", [False, True], ids=["forward", "adjoint"])
def test_sixteen_workers_on_one_rank_equal_numpy(case, adjoint):
    """All 16 workers on rank 0: the schedule has no messages (every transfer a local move)
    and equals the numpy interpreter exactly."""
    op = CASES[case]()
    op = op.H if adjoint else op
    mapping = WorkerMap([0] * WORKERS)
    schedule = compile_mapped(op, mapping, 0, 1).schedule
    assert not _messages(schedule, 0, [])
    if case == "all-reduce":  # native under a map: the rank sums its members locally
        assert [type(step).__name__ for step in schedule] == ["_RankMappedAllReduce"]
    elif case == "broadcast":  # native under a map: the rank fills (or sums) its copies locally
        assert [type(step).__name__ for step in schedule] == ["_RankMappedRooted"]
    elif case != "sum":
        assert any(type(step) is LocalMoves for step in schedule)
    state = op.domain.random(3, dtype=np.int64)
    before = {n: a.copy() for n, a in state.items()}
    work = numpy_backend.Workspace(dict(state), set(), np.dtype(np.int64))
    run_schedule(schedule, work, None, np.dtype(np.int64))  # type: ignore[arg-type]
    expected = op(state)
    assert sorted(work.arrays) == sorted(b.name for b in op.range)
    for name, want in expected.items():
        np.testing.assert_array_equal(work.arrays[name], want)
    assert all(np.array_equal(before[n], state[n]) for n in state)


def test_compilation_is_kept_per_tree_and_map():
    op = CASES["halo"]()
    mapping = WorkerMap.blocked(WORKERS, 4)
    assert compiled_for(op, mapping) is compiled_for(op, WorkerMap.blocked(WORKERS, 4))
    assert (
        compiled_for(op, mapping).fingerprint
        != compiled_for(op, WorkerMap.round_robin(WORKERS, 4)).fingerprint
    )
    assert (
        compiled_for(op, mapping).tree_fingerprint
        == compiled_for(op, WorkerMap.round_robin(16, 4)).tree_fingerprint
    )


# -- a mapped rank compiles its workers' part only ----------------------------------------------
def _halo_tree(shape, parts, kernel, variant="nested", windows=False):
    tensor = DistributedTensor("x", shape, Partition(parts))
    if windows:
        return halo_windows(tensor, kernel, variant=variant)
    return HaloExchange(halo_geometry(tensor, kernel), variant)


PER_WORKER_TREES = {
    "nested-4x4": lambda: _halo_tree((11, 9), (4, 4), Kernel(3, padding=1)),
    "direct-4x4": lambda: _halo_tree((11, 9), (4, 4), Kernel(3, padding=1), "direct"),
    "periodic-windows": lambda: _halo_tree(
        (12, 10), (3, 2), Kernel(5, padding=2, boundary="periodic"), windows=True
    ),
    "multi-hop": lambda: _halo_tree((10, 10), (5, 5), Kernel((3, 5), padding=(1, 6), boundary="periodic")),
    "strided-trims": lambda: _halo_tree((11, 6), (3, 2), Kernel(2, stride=2), windows=True),
    "symmetric-3d": lambda: _halo_tree(
        (8, 9, 7), (2, 3, 2), Kernel(3, padding=1, boundary="symmetric"), windows=True
    ),
    "sum": CASES["sum"],
    "stage-direct": lambda: _halo_tree((11, 9), (4, 4), Kernel(3, padding=1), "direct").expand(),
    "stage-multi-hop-periodic": lambda: _halo_tree(
        (10, 10), (5, 5), Kernel((3, 5), padding=(1, 6), boundary="periodic"), "direct"
    ).expand(),
}
"""Halo trees whose nodes lower per worker, the bare stages (:class:`~linop.halo.HaloStage`,
the direct exchange's one stage; adjoint: :class:`~linop.halo.HaloStageAdjoint`) included."""


def _maps(workers):
    return {
        "blocked-4": WorkerMap.blocked(workers, 4),
        "round-robin-3": WorkerMap.round_robin(workers, 3),
        "one-rank": WorkerMap([0] * workers),
        "scattered-with-empty-ranks": WorkerMap([(7 * w) % 5 + 2 * (w % 2) for w in range(workers)]),
    }


def _rank_parts(op, **options):
    """For each map of :func:`_maps` and each rank (ranks holding no worker included): the map's
    name, the rank, the program the rank compiles from its own workers and the projection of
    the global portable program onto it (``options``: of both compilations)."""
    assert lowers_per_worker(op)
    workers = max(op.domain.max_worker, op.range.max_worker) + 1
    for name, mapping in _maps(workers).items():
        for rank in range(mapping.largest_rank + 2):
            yield (
                name,
                rank,
                compile_for_rank(op, rank, mapping, **options),
                mapped_global_program(op, rank, mapping, **options),
            )


@pytest.mark.parametrize("case", list(PER_WORKER_TREES))
@pytest.mark.parametrize("adjoint", [False, True], ids=["forward", "adjoint"])
def test_a_mapped_rank_compiles_its_workers_part_equal_to_the_global_projection(case, adjoint):
    """Per rank (ranks holding no worker included), the schedule compiled from the rank's
    workers' part equals the projection of the global portable program step by step: local
    nodes, phases, local moves, message peers and tags, and the largest worker."""
    op = PER_WORKER_TREES[case]()
    op = op.H if adjoint else op
    for name, rank, mine, reference in _rank_parts(op):
        assert mine.schedule == reference.schedule, (name, rank)
        assert mine.max_worker == reference.max_worker, (name, rank)


def _convolution(overlap):
    layer = Convolution(
        DistributedTensor("x", (1, 2, 12, 10), Partition((1, 1, 4, 4))), 2, Kernel(3, padding=1)
    )
    weights = np.random.default_rng(3).integers(-3, 4, size=layer.weights.global_shape)
    return layer.input_operator(weights, overlap=overlap)


COMPOSED_TREES = {
    "nested-twice": lambda: PER_WORKER_TREES["nested-4x4"]() @ PER_WORKER_TREES["nested-4x4"](),
    "direct-after-nested": lambda: PER_WORKER_TREES["direct-4x4"]() @ PER_WORKER_TREES["nested-4x4"](),
    "periodic-twice": lambda: (
        _halo_tree((12, 10), (3, 2), Kernel(5, padding=2, boundary="periodic"))
        @ _halo_tree((12, 10), (3, 2), Kernel(5, padding=2, boundary="periodic"))
    ),
    "windows-adjoint-windows": lambda: (
        PER_WORKER_TREES["periodic-windows"]().H @ PER_WORKER_TREES["periodic-windows"]()
    ),
    "convolution": lambda: _convolution(False),
    "convolution-overlapped": lambda: _convolution(True),
    "stages-nested": lambda: PER_WORKER_TREES["nested-4x4"]().expand(),
    "stages-multi-hop-periodic": lambda: PER_WORKER_TREES["multi-hop"]().expand(),
    "stages-symmetric-3d": lambda: (
        _halo_tree((8, 9, 7), (2, 3, 2), Kernel(3, padding=1, boundary="symmetric")).expand().H
    ),
}


def _sequences(schedule, out=None):
    """A schedule as what two ranks must agree on and what the rank runs, phases aside: its
    messages per (direction, peer) in order with their tags, its local moves in order, its
    local nodes in order (those run in flight included) and its other steps in order."""
    messages, moves, nodes, other = out if out is not None else ({}, [], [], [])
    for step in schedule:
        phase = step.phase if isinstance(step, RankOverlap) else step
        if isinstance(step, RankOverlap):
            nodes.extend(step.during)
        if isinstance(phase, RankPhase):
            for direction, entries in (("recv", phase.receives), ("send", phase.sends)):
                for peer, tag, t in entries:
                    messages.setdefault((direction, peer), []).append((tag, t))
        elif isinstance(step, LocalMoves):
            moves.extend(step.transfers)
        elif isinstance(step, RankBranches):
            other.append((step.names, tuple(_sequences(term) for term in step.terms)))
        elif type(step).__module__.startswith("linop.program"):
            if not isinstance(step, RankOverlap):
                other.append(step)
        else:
            nodes.append(step)
    return messages, moves, nodes, other


@pytest.mark.parametrize("case", list(COMPOSED_TREES))
@pytest.mark.parametrize("adjoint", [False, True], ids=["forward", "adjoint"])
def test_a_mapped_rank_compiles_composed_trees_with_the_global_messages(case, adjoint):
    """Trees of several exchanges (layers' included, overlapped or not): per rank the same
    messages per peer in the same order with the same tags, the same local moves and local
    nodes in order, as the global projection. A rank may group its messages into fewer
    phases (as :func:`~linop.program.compile_for_rank` does without a map): a conflict
    between two other ranks' steps splits a global phase that the rank's part keeps whole."""
    op = COMPOSED_TREES[case]()
    op = op.H if adjoint else op
    for name, rank, mine, reference in _rank_parts(op):
        assert _sequences(mine.schedule) == _sequences(reference.schedule), (name, rank)
        assert mine.max_worker == reference.max_worker, (name, rank)


def test_the_sequences_catch_a_tag_off_by_one_and_a_dropped_transfer():
    op = COMPOSED_TREES["nested-twice"]()
    mapping = WorkerMap.round_robin(WORKERS, 3)
    reference = _sequences(mapped_global_program(op, 1, mapping).schedule)
    wrong = list(_mutations(compile_for_rank(op, 1, mapping).schedule))
    assert len(wrong) >= 3
    assert all(_sequences(schedule) != reference for schedule in wrong)


def test_the_stage_comparison_catches_a_wrong_part():  # control
    """Wrong parts of a nested exchange's stages differ from the global projection: the part
    of another map's rank, and each message, tag or local move mutated."""
    op = COMPOSED_TREES["stages-multi-hop-periodic"]()
    mapping = WorkerMap.round_robin(25, 3)
    reference = _sequences(mapped_global_program(op, 1, mapping).schedule)
    assert _sequences(compile_for_rank(op, 1, WorkerMap.blocked(25, 3)).schedule) != reference
    wrong = list(_mutations(compile_for_rank(op, 1, mapping).schedule))
    assert len(wrong) >= 3
    assert all(_sequences(schedule) != reference for schedule in wrong)


def _unfiltered(monkeypatch):
    """Let :func:`~linop.program.lower_for_workers` return what the lowerings built, unfiltered."""
    monkeypatch.setattr(lowering_module, "_involving_workers", lambda steps, workers: list(steps))


def test_a_stage_lowers_per_worker_without_building_the_others_steps(monkeypatch):
    """A mapped rank's lowering of a bare stage builds only its workers' transfers (nothing
    filtered afterwards), and its largest worker is the stage's."""
    stage = PER_WORKER_TREES["stage-direct"]().factors[0]
    assert type(stage).__name__ == "HaloStage" and lowers_per_worker(stage) and lowers_per_worker(stage.H)
    mapping = WorkerMap.round_robin(WORKERS, 3)
    workers = frozenset(mapping.workers_on(2))
    held = [(s, d) for s, d in stage.transfers if s.worker in workers or d.worker in workers]
    _unfiltered(monkeypatch)
    for node in (stage, stage.H):
        steps, largest = lower_for_workers(node, workers, mapping)
        assert largest == WORKERS - 1
        assert len(steps) == len(held) < len(stage.transfers)


@pytest.mark.parametrize(
    "case", ["all-reduce-both-axes", "all-reduce-with-others", "broadcast-row", "scatter"]
)
@pytest.mark.parametrize("adjoint", [False, True], ids=["forward", "adjoint"])
def test_a_portable_rank_plans_a_collective_without_its_whole_expansion(case, adjoint, monkeypatch):
    """Without the mapped fast paths (the torch.distributed executor, the MPI portable program)
    a mapped rank lowers an all-reduce, broadcast, sum-reduce or scatter from its workers' part
    of the expansion: the whole expansion (or movement) is never built, and the lowerings build only
    the workers' steps (a control: the global route builds the expansion)."""
    op = COLLECTIVE_TREES[case]()
    op = op.H if adjoint else op
    mapping = WorkerMap.round_robin(WORKERS, 3)
    reference = mapped_global_program(op, 1, mapping, mapped_fast_paths=False)
    monkeypatch.setattr(AllReduce, "expand", _refuse)
    monkeypatch.setattr(PieceMovement, "expand", _refuse)
    with pytest.raises(AssertionError, match="the whole expansion"):  # the control
        mapped_global_program(op, 1, mapping, mapped_fast_paths=False)
    mine = compile_for_rank(op, 1, mapping, mapped_fast_paths=False)
    assert _normalized(mine.schedule) == _normalized(reference.schedule)
    _unfiltered(monkeypatch)
    workers = frozenset(mapping.workers_on(1))
    for step in lower_for_workers(op, workers)[0]:
        ends = (step.worker,) if isinstance(step, Local) else (step.src_worker, step.dst_worker)
        assert workers.intersection(ends), step


def _refuse(*args, **kwargs):
    raise AssertionError("the whole expansion was built")


def test_sixteen_workers_on_four_ranks_compile_per_rank():
    """The MPI entry point compiles a halo tree per rank (no global program built) and gives the
    global projection's schedule; a collective keeps the global route."""
    op = CASES["halo_windows"]()
    mapping = WorkerMap.blocked(WORKERS, 4)
    compiled = MappedCompiled(op, mapping, calls=mpi_schedule)
    assert compiled.per_worker
    for rank in range(4):
        program, problem = compiled.for_rank(rank, 4)
        assert problem is None and program is not None
        assert program.schedule == mapped_global_program(op, rank, mapping).schedule
    assert compiled._global is None  # the whole tree was never lowered
    assert lowers_per_worker(CASES["halo"]().H @ (2 * CASES["halo"]()))
    for case in ("all-reduce", "repartition", "broadcast"):  # collectives too (issue 24)
        collective = MappedCompiled(CASES[case](), mapping, calls=mpi_schedule)
        assert collective.per_worker
        assert collective.for_rank(1, 4)[1] is None and collective._global is None
    tensor = _tensor()
    node = SendRecv(
        tensor.space[tensor.block_name((0, 0))][0:1, 0:1], tensor.space[tensor.block_name((3, 3))][0:1, 0:1]
    )
    assert (
        not lowers_per_worker(node) and not MappedCompiled(node, mapping, calls=mpi_schedule).per_worker
    )  # the global route


def _mutations(schedule):
    """Wrong schedules: each phase's first message with its tag one off, each phase with its
    last send dropped, a local move dropped."""
    for i, step in enumerate(schedule):
        if isinstance(step, RankPhase) and step.sends:
            peer, tag, t = step.sends[0]
            wrong = RankPhase(step.receives, ((peer, tag + 1, t), *step.sends[1:]))
            yield (*schedule[:i], wrong, *schedule[i + 1 :])
            yield (*schedule[:i], RankPhase(step.receives, step.sends[:-1]), *schedule[i + 1 :])
        if isinstance(step, LocalMoves):
            yield (*schedule[:i], LocalMoves(step.transfers[1:]), *schedule[i + 1 :])


def test_the_comparison_catches_a_tag_off_by_one_and_a_dropped_transfer():
    op = PER_WORKER_TREES["nested-4x4"]()
    mapping = WorkerMap.round_robin(WORKERS, 3)
    reference = mapped_global_program(op, 1, mapping).schedule
    wrong = list(_mutations(compile_for_rank(op, 1, mapping).schedule))
    assert len(wrong) >= 3
    assert all(schedule != reference for schedule in wrong)


def test_the_comparison_catches_a_lowering_that_counts_from_its_own_worker():
    """A control: lowering each worker's part on its own and concatenating them (not merged in
    the global order) gives other tags than the global projection."""
    op = PER_WORKER_TREES["nested-4x4"]()
    mapping = WorkerMap.round_robin(WORKERS, 3)
    steps = []
    for worker in mapping.workers_on(1):
        steps.extend(lower_for_workers(op, [worker], mapping)[0])
    wrong = project(batch(steps), 1, mapping)
    assert wrong != mapped_global_program(op, 1, mapping).schedule


def test_a_map_that_does_not_fit_is_reported_per_rank_as_before():
    op = CASES["halo"]()
    sparse = WorkerMap({w: 0 for w in range(16) if w != 9})
    with pytest.raises(WorkerMapError, match="worker 9 of the tree is not in the worker map"):
        compile_mapped(op, sparse, 0, 1)
    spare = WorkerMap([0] * 16 + [5])  # a worker the tree does not name, on a rank beyond the size
    assert compile_mapped(op, spare, 0, 1).schedule == mapped_global_program(op, 0, spare).schedule


@pytest.mark.parametrize("case", ["nested-4x4", "periodic-windows"])
def test_a_mapped_rank_finds_its_blocks_of_a_grid_space_in_space_order(case):
    op = PER_WORKER_TREES[case]()
    workers = op.domain.max_worker + 1
    for mapping in _maps(workers).values():
        for space in (op.domain, op.range):
            for rank in range(mapping.largest_rank + 2):
                held = set(mapping.workers_on(rank))
                assert owned_blocks(space, rank, mapping) == tuple(
                    b for b in space.blocks if b.worker in held
                )


# -- a mapped rank compiles its workers' part of a collective or repartition ---------------------
def _uneven(name="x", grid=(4, 4), shape=(12, 9)):
    return DistributedTensor(name, shape, Partition(grid))


COLLECTIVE_TREES = {
    "all-reduce-both-axes": CASES["all-reduce"],
    "all-reduce-axis-0": lambda: AllReduce(_uneven(), 0),
    "broadcast-1-to-16": CASES["broadcast"],
    "broadcast-row": lambda: Broadcast(_uneven("x", (1, 4), (3, 9)), Partition((4, 4)), "y"),
    "broadcast-3d": lambda: Broadcast(_uneven("x", (2, 2), (6, 9)), Partition((4, 2, 2)), "y"),
    "repartition": CASES["repartition"],
    "repartition-uneven": lambda: Repartition(_tensor(), _tensor("z", (3, 5))),
    "scatter": lambda: Scatter(Block("r", (11, 9), 5), _tensor()),
    "all-gather-axis-0": lambda: AllGather(_uneven(), 0, "g"),
    "all-gather-axis-1": lambda: AllGather(_tensor(), 1, "g"),
    "sum": lambda: 2 * AllReduce(_uneven(shape=(12, 8)), 0) + AllReduce(_uneven(shape=(12, 8)), 1),
    "all-reduce-with-others": lambda: AllReduce(_uneven(), 0, Space([Block("o", (3,), 6)])),
    "broadcast-with-others": lambda: Broadcast(
        _uneven("x", (1, 4), (3, 9)), Partition((4, 4)), "y", others=Space([Block("o", (3,), 6)])
    ),
}
"""Collectives and repartitions (adjoints: sum-reduce, gather, reduce-scatter, by parameter)."""


def _transfer(t):
    """A transfer as its two boxes, mode and after (a rank's part builds its regions on a space
    of the two blocks, the global program on the whole space)."""
    target = t.target
    box = (target.start, target.stop) if hasattr(target, "start") else target.shape
    return (t.source.name, t.source.start, t.source.stop, target.name, box, t.mode, t.after)


def _normalized(schedule):
    """A schedule as :func:`_sequences` gives it, with transfers as their boxes, nodes as their
    type, text and block, and a fast path's rank step as its fields but the fallback (a
    closure)."""
    messages, moves, nodes, other = {}, [], [], []
    for step in schedule:
        if isinstance(step, RankPhase):
            for direction, entries in (("recv", step.receives), ("send", step.sends)):
                for peer, tag, t in entries:
                    messages.setdefault((direction, peer), []).append((tag, _transfer(t)))
        elif isinstance(step, LocalMoves):
            moves.extend(_transfer(t) for t in step.transfers)
        elif isinstance(step, RankBranches):
            other.append((step.names, tuple(_normalized(term) for term in step.terms)))
        elif isinstance(step, LinearOperator):
            nodes.append((type(step).__name__, str(step), repr(getattr(step, "block", None))))
        elif hasattr(step, "fallback"):
            other.append((type(step).__name__, {k: v for k, v in vars(step).items() if k != "fallback"}))
        else:
            other.append(step)
    return messages, moves, nodes, other


@pytest.mark.parametrize("native", [True, False], ids=["native", "portable"])
@pytest.mark.parametrize("adjoint", [False, True], ids=["forward", "adjoint"])
@pytest.mark.parametrize("case", list(COLLECTIVE_TREES))
def test_a_mapped_rank_compiles_its_part_of_a_collective_equal_to_the_global_projection(
    case, adjoint, native
):
    """Per rank (ranks holding no worker included), under the blocked, round-robin, one-rank and
    scattered maps, the schedule compiled from the rank's workers' part has the messages per
    peer in order with their tags, the local moves, local nodes and fast-path steps of the
    projection of the global portable program (``native``: with the mapped fast paths of the
    all-reduce, broadcast and sum-reduce; else their point-to-point expansions)."""
    op = COLLECTIVE_TREES[case]()
    op = op.H if adjoint else op
    for name, rank, mine, reference in _rank_parts(op, mapped_fast_paths=native):
        assert _normalized(mine.schedule) == _normalized(reference.schedule), (name, rank)
        assert mine.max_worker == reference.max_worker, (name, rank)


def _listed_all_reduce(op, rank, mapping):
    """A mapped rank's all-reduce entries listed from every group (the route before issue 24)."""
    entries = []
    held = set(mapping.workers_on(rank))
    for group in op.groups:
        blocks = [op.tensor.block(i) for i in group]
        names = tuple(b.name for b in blocks if b.worker in held)
        if len(blocks) > 1 and blocks[0].size and names:
            entries.append((names, tuple(sorted({mapping.rank_of(b.worker) for b in blocks}))))
    return tuple(entries)


def _listed_rooted(op, rank, mapping, reduce):
    """A mapped rank's broadcast groups listed from every piece of the movement: (root block, the
    group's ranks root first, whether the rank holds the root, its copies)."""
    held = set(mapping.workers_on(rank))
    by_root = {}
    for piece in op.movement.pieces:
        root, copy = (piece.target, piece.source) if reduce else (piece.source, piece.target)
        by_root.setdefault(root, []).append(copy)
    roots_space, copies_space = (op.range, op.domain) if reduce else (op.domain, op.range)
    groups = []
    for root, copies in by_root.items():
        root_rank = mapping.rank_of(roots_space.block(root).worker)
        ranks = {mapping.rank_of(copies_space.block(c).worker) for c in copies} - {root_rank}
        mine = tuple(c for c in copies if copies_space.block(c).worker in held)
        if rank == root_rank or rank in ranks:
            groups.append((root, (root_rank, *sorted(ranks)), rank == root_rank, mine))
    return groups


@pytest.mark.parametrize(
    "case",
    ["all-reduce-both-axes", "all-reduce-axis-0", "broadcast-1-to-16", "broadcast-row", "broadcast-3d"],
)
@pytest.mark.parametrize("adjoint", [False, True], ids=["forward", "adjoint"])
def test_the_mapped_fast_paths_of_a_rank_are_those_listed_from_every_group(case, adjoint):
    """A reference independent of the rank's part: the groups of the native mapped all-reduce,
    broadcast and sum-reduce equal those found by listing every group of the whole node."""
    op = COLLECTIVE_TREES[case]()
    op = op.H if adjoint and not case.startswith("all-reduce") else op
    workers = max(op.domain.max_worker, op.range.max_worker) + 1
    for name, mapping in _maps(workers).items():
        for rank in range(mapping.largest_rank + 2):
            steps = compile_for_rank(op, rank, mapping).schedule
            if case.startswith("all-reduce"):
                listed = _listed_all_reduce(op, rank, mapping)
                assert (steps[0].entries if steps else ()) == listed, (name, rank)
            else:
                listed = _listed_rooted(op, rank, mapping, reduce=adjoint)
                got = [
                    (g.root_name, g.ranks, g.is_root, g.copies) for g in (steps[0].groups if steps else ())
                ]
                assert got == listed, (name, rank)


def test_the_collective_comparison_catches_a_wrong_order_a_wrong_map_and_a_wrong_tag():  # control
    """Wrong schedules of a repartition and an all-reduce differ from the global projection:
    each worker's part lowered alone and concatenated (not in movement order), the part of another
    map, a tag one off."""
    op = COLLECTIVE_TREES["repartition"]()
    mapping = WorkerMap.round_robin(WORKERS, 3)
    reference = _normalized(mapped_global_program(op, 1, mapping).schedule)
    steps = []
    for worker in mapping.workers_on(1):
        steps.extend(lower_for_workers(op, [worker], mapping)[0])
    assert _normalized(project(batch(steps), 1, mapping)) != reference
    assert _normalized(compile_for_rank(op, 1, WorkerMap.blocked(WORKERS, 3)).schedule) != reference
    wrong = list(_mutations(compile_for_rank(op, 1, mapping).schedule))
    assert wrong and all(_normalized(schedule) != reference for schedule in wrong)
    reduce = COLLECTIVE_TREES["all-reduce-axis-0"]()
    listed = _normalized(mapped_global_program(reduce, 1, mapping).schedule)
    assert _normalized(compile_for_rank(reduce, 1, WorkerMap.blocked(WORKERS, 3)).schedule) != listed
    assert _normalized(compile_for_rank(reduce, 2, mapping).schedule) != listed


# -- an all-gather's part, group by group ---------------------------------------------------------
GATHER_TREES = {
    "axis-0-uneven": lambda: AllGather(_uneven(), 0, "g"),
    "axis-1": lambda: AllGather(_tensor(), 1, "g"),
    "both-axes-uneven": lambda: AllGather(_uneven(), (0, 1), "g"),
    "empty-blocks": lambda: AllGather(DistributedTensor("x", (3, 9), Partition((4, 4))), 0, "g"),
    "3d-two-axes": lambda: AllGather(DistributedTensor("x", (4, 6, 5), Partition((2, 3, 2))), (0, 2), "g"),
}
"""All-gathers (adjoints: reduce-scatters) of uneven, empty and 3-D blocks along one or two axes."""


def _pieces_route(op, workers):
    """The steps of ``workers`` from the pieces of their blocks (:meth:`rank_pieces`) put in movement
    order by their order key, as :func:`~linop.program.lowering_pieces.piece_steps` builds them."""
    pieces = sorted({p for w in workers for p in op.rank_pieces(w)}, key=piece_order(op))
    source, target = op.layouts()
    return pieces, piece_steps(op, held_blocks(target, workers), pieces, held_blocks(source, workers))


@pytest.mark.parametrize("adjoint", [False, True], ids=["forward", "adjoint"])
@pytest.mark.parametrize("case", list(GATHER_TREES))
def test_an_all_gathers_part_is_the_steps_of_its_pieces_in_plan_order(case, adjoint):
    """A mapped rank's part of an all-gather or reduce-scatter, built group by group from each
    member's geometry (read once), is exactly the steps of its workers' pieces in movement order:
    the same transfers (regions, mode, after) and local copies, in the same order."""
    op = GATHER_TREES[case]()
    op = op.H if adjoint else op
    for name, mapping in _maps(op.domain.max_worker + 1).items():
        for rank in range(mapping.largest_rank + 2):
            workers = frozenset(mapping.workers_on(rank))
            mine, largest = lower_for_workers(op, workers, mapping)
            pieces, reference = _pieces_route(op, workers)
            assert mine == reference, (name, rank)
            for step in mine:  # the workers a run gives its transfers are their regions'
                if isinstance(step, Transfer):
                    assert (step.src_worker, step.dst_worker) == (step.source.worker, step.target.worker)
            assert largest == op.tensor.partition.max_worker
            if len(pieces) > 2:  # control: the same pieces in another order are caught
                assert mine != _pieces_route_reordered(op, workers, pieces), (name, rank)


def _pieces_route_reordered(op, workers, pieces):
    source, target = op.layouts()
    wrong = [pieces[-1], *pieces[:-1]]
    return piece_steps(op, held_blocks(target, workers), wrong, held_blocks(source, workers))


@pytest.mark.parametrize("case", ["stages-nested", "stages-multi-hop-periodic"])
@pytest.mark.parametrize("adjoint", [False, True], ids=["forward", "adjoint"])
def test_one_rank_lowers_only_its_own_pairs_of_a_stage(case, adjoint, monkeypatch):
    """Without a map, one rank's lowering of bare stages (:func:`~linop.program.lower_for`)
    builds only the pairs it takes part in, and its schedule has the messages and local steps
    of the global program's projection."""
    op = COMPOSED_TREES[case]()
    op = op.H if adjoint else op
    programs = {rank: compile_for_rank(op, rank).schedule for rank in range(op.domain.max_worker + 1)}
    reference = compile_program(op)
    for rank, schedule in programs.items():
        assert _sequences(schedule) == _sequences(reference.for_rank(rank)), rank
    monkeypatch.setattr(lowering_module, "_involving", lambda steps, rank: list(steps))
    steps, _ = lower_for(op, 3)
    assert steps and all(
        3 in ((s.worker,) if isinstance(s, Local) else (s.src_worker, s.dst_worker)) for s in steps
    )
