"""Worker-to-rank maps under MPI: 16 workers on 1, 2, 3 or 4 ranks (round-robin, blocked and
scattered maps), several workers per rank. Every result equals the numpy interpreter exactly
(integers), adjoints included (and the inner-product identity across ranks); transfers between
workers of one rank are local moves, never messages; bad maps fail on every rank with a typed
error."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import LONG, collective_assert, expect_collective_error, same_blocks, spmd_given
from mpi4py import MPI
from strategies import movement_trees

from linop.backends import mpi as mpi_backend
from linop.backends.mpi.mapping import compiled_for
from linop.collectives import AllGather, AllReduce, BlockGrid, Broadcast, SumReduce
from linop.errors import DistributedStateError, WorkerMapError, WorkerMapMismatchError
from linop.halo import HaloExchange, halo_windows
from linop.halo_geometry import Kernel, halo_geometry
from linop.movement import Copy
from linop.partition import DistributedTensor, Partition
from linop.program import LocalMoves, RankPhase, WorkerMap
from linop.repartition import Repartition, Scatter
from linop.space import Block

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size
WORKERS = 16

MAPS = {
    "round-robin": WorkerMap.round_robin(WORKERS, SIZE),
    "blocked": WorkerMap.blocked(WORKERS, SIZE),
    "scattered": WorkerMap({w: (5 * w + 3) % 7 % SIZE for w in range(WORKERS)}),
}


def grid_tensor(name: str = "x", shape: tuple[int, ...] = (11, 9), grid: tuple[int, ...] = (4, 4)):
    return DistributedTensor(name, shape, Partition(grid))


def _halo():
    return HaloExchange(halo_geometry(grid_tensor(), Kernel(3, padding=1)))


def _halo_direct_5():
    return HaloExchange(halo_geometry(grid_tensor(), Kernel(5, padding=2)), "direct")


def _windows():
    return halo_windows(grid_tensor(), Kernel(3, padding=1))


def _broadcast_1d():
    return Broadcast(DistributedTensor("x", (7,), Partition((1,))), Partition((WORKERS,)), "y")


def _broadcast_rows():
    return Broadcast(DistributedTensor("x", (6, 5), Partition((1, 4))), Partition((4, 4)), "y")


def _sum_reduce():
    return SumReduce(DistributedTensor("x", (6, 5), Partition((1, 4))), Partition((4, 4)), "y")


def _all_reduce(axes):
    return lambda: AllReduce(BlockGrid.uniform("x", Partition((4, 4)), (3, 2)), axes)


def _repartition():
    reversed_workers = tuple(reversed(range(WORKERS)))
    target = DistributedTensor("z", (11, 9), Partition((2, 8), workers=reversed_workers))
    return Repartition(grid_tensor(), target)


def _halo_periodic_twice():
    exchange = HaloExchange(
        halo_geometry(grid_tensor(grid=(4, 2)), Kernel(5, padding=2, boundary="periodic"))
    )
    return exchange @ exchange


def _convolution_overlapped():
    from linop.layers import Convolution

    layer = Convolution(
        DistributedTensor("x", (1, 2, 12, 10), Partition((1, 1, 4, 4))), 2, Kernel(3, padding=1)
    )
    weights = np.random.default_rng(5).integers(-3, 4, size=layer.weights.global_shape)
    return layer.input_operator(weights, overlap=True)


CASES = {
    "halo": _halo,
    "halo-twice": lambda: _halo() @ _halo(),
    "halo-periodic-twice": _halo_periodic_twice,
    "windows-adjoint-windows": lambda: _windows().H @ _windows(),
    "convolution-overlapped": _convolution_overlapped,
    "halo-direct-k5": _halo_direct_5,
    "halo_windows": _windows,
    "broadcast-1-to-16": _broadcast_1d,
    "broadcast-rows": _broadcast_rows,
    "sum-reduce": _sum_reduce,
    "all-reduce-0": _all_reduce((0,)),
    "all-reduce-0-1": _all_reduce((0, 1)),
    "repartition": _repartition,
}


def mine(space, mapping: WorkerMap) -> tuple[str, ...]:
    held = set(mapping.workers_on(RANK))
    return tuple(b.name for b in space if b.worker in held)


def local_part(space, state, mapping: WorkerMap) -> dict[str, np.ndarray]:
    return {name: np.array(state[name]) for name in mine(space, mapping)}


def check_mapped(op, mapping: WorkerMap, seed: int) -> dict[str, np.ndarray]:
    """``op`` under ``mapping`` equals numpy on every rank's blocks; inputs unchanged."""
    state = op.domain.random(seed, dtype=np.int64)
    expected = op(state)
    local = local_part(op.domain, state, mapping)
    before = {n: a.copy() for n, a in local.items()}
    result = mpi_backend.apply(op, local, comm=COMM, mapping=mapping)
    problem = same_blocks(result, expected, mine(op.range, mapping))
    if problem is None and any(not np.array_equal(before[n], local[n]) for n in local):
        problem = "the caller's arrays were mutated"
    collective_assert(problem is None, f"{op} under {mapping}: {problem}")
    return result


def local_dot(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> int:
    return int(sum(np.vdot(a[n], b[n]) for n in a))


ONE_MAP_IN_CI = {"convolution-overlapped": "scattered"}
"""Cases run under one map in the CI suite (every map with ``LINOP_LONG=1``): the overlapped
convolution's three maps were a third of the MPI suite's time in this module (about 15 s of
CPU over its four sizes). Under the scattered map its workers' neighbours are on its own rank
and on others, and the ranks hold unequal numbers of workers; the blocked and round-robin maps
are proven on every other case, the halo exchanges and windows the convolution is made of
among them."""
MAPPED = [
    (case, map_name)
    for case in CASES
    for map_name in MAPS
    if LONG or ONE_MAP_IN_CI.get(case, map_name) == map_name
]


@pytest.mark.parametrize(("case", "map_name"), MAPPED, ids=[f"{case}-{name}" for case, name in MAPPED])
def test_mapped_equals_numpy_and_adjoint(case, map_name):
    mapping = MAPS[map_name]
    op = CASES[case]()
    forward = check_mapped(op, mapping, 1)
    check_mapped(op.H, mapping, 2)
    # <A x, y> == <x, A* y> with each rank's blocks, summed over ranks (integers: exact)
    x = local_part(op.domain, op.domain.random(3, dtype=np.int64), mapping)
    y = local_part(op.range, op.range.random(4, dtype=np.int64), mapping)
    ax = mpi_backend.apply(op, x, comm=COMM, mapping=mapping)
    ahy = mpi_backend.apply(op.H, y, comm=COMM, mapping=mapping)
    left = COMM.allreduce(local_dot(ax, y))
    right = COMM.allreduce(local_dot(x, ahy))
    collective_assert(left == right, f"{op}: <Ax, y> = {left}, <x, A*y> = {right}")
    assert sorted(forward) == sorted(mine(op.range, mapping))


@pytest.mark.parametrize("map_name", list(MAPS))
def test_same_rank_transfers_are_local_moves(map_name):
    mapping = MAPS[map_name]
    plan = mpi_backend.plan_for(_halo(), comm=COMM, mapping=mapping)
    peers = [
        peer
        for step in plan.schedule
        if type(step) is RankPhase
        for peer, _, _ in (*step.receives, *step.sends)
    ]
    moves = sum(len(step.transfers) for step in plan.schedule if type(step) is LocalMoves)
    held = len(mapping.workers_on(RANK))
    collective_assert(RANK not in peers, f"messages to self: {peers}")
    # a rank holding two or more workers of the 4 x 4 grid holds a neighbouring pair unless the
    # map scatters them: then at least one local move
    neighbours = any(
        abs(a - b) in (1, 4) and (a // 4 == b // 4 or abs(a - b) == 4)
        for a in mapping.workers_on(RANK)
        for b in mapping.workers_on(RANK)
    )
    collective_assert(moves > 0 or not neighbours, f"{held} workers, {moves} local moves")
    if SIZE == 1:
        collective_assert(not peers and moves > 0, f"one rank: peers {peers}, {moves} moves")


def test_in_place_and_bound_halo_exchange():
    mapping = MAPS["blocked"]
    op = _halo()
    state = op.domain.random(5, dtype=np.float64)
    expected = op(state)
    names = mine(op.range, mapping)
    local = local_part(op.domain, state, mapping)
    out = mpi_backend.apply(op, local, comm=COMM, mapping=mapping, inplace=True)
    problem = same_blocks(out, expected, names)
    collective_assert(problem is None and out is local, f"in place: {problem}")
    bound_state = local_part(op.domain, state, mapping)
    bound = mpi_backend.plan_for(op, comm=COMM, mapping=mapping).bind(bound_state)
    for _ in range(2):  # a second call: applied again to the first call's result
        result = bound()
    twice = op(expected)
    collective_assert(same_blocks(result, twice, names) is None, "bound plan, two calls")


@pytest.mark.parametrize("map_name", list(MAPS))
@pytest.mark.parametrize("adjoint", [False, True], ids=["forward", "adjoint"])
def test_bound_mapped_halo_is_persistent_and_exact(map_name, adjoint):
    """Bound under a map, the halo exchange (and its adjoint) runs persistent requests between
    ranks and local copies (adds, clears) between a rank's own workers, equal to numpy
    exactly (integer values) on two calls."""
    mapping = MAPS[map_name]
    op = _halo().H if adjoint else _halo()
    # integer values in float64 (integer blocks are checked on every call, never persistent)
    state = {n: a.astype(np.float64) for n, a in op.domain.random(7, dtype=np.int64).items()}
    names = mine(op.range, mapping)
    bound = mpi_backend.plan_for(op, comm=COMM, mapping=mapping).bind(local_part(op.domain, state, mapping))
    first = {n: a.copy() for n, a in bound().items()}
    second = bound()
    problem = same_blocks(first, op(state), names, exact=True) or same_blocks(
        second, op(op(state)), names, exact=True
    )
    collective_assert(problem is None, f"{op} bound under {map_name}: {problem}")
    collective_assert(bound.persistent, f"{op} under {map_name}: not persistent")
    bound.free()


def _bundled_halo_run(op, mapping: WorkerMap, state) -> tuple[dict[str, np.ndarray], int]:
    """``op`` bound under ``mapping`` on this rank's part of ``state``: its first call's
    result and how many bundles (of two messages or more) its phases move."""
    bound = mpi_backend.plan_for(op, comm=COMM, mapping=mapping).bind(local_part(op.domain, state, mapping))
    try:
        collective_assert(bound.persistent, f"{op}: not persistent")
        return {n: a.copy() for n, a in bound().items()}, len(bound._run.bundles)
    finally:
        bound.free()


@pytest.mark.parametrize("map_name", ["blocked", "round-robin", "squares"])
@pytest.mark.parametrize("adjoint", [False, True], ids=["forward", "adjoint"])
def test_bound_mapped_halo_bundles_messages_per_peer(map_name, adjoint):
    """Bound under a map, a rank sends its workers' strips to one peer rank in a phase as one
    message (a bundle: a struct datatype over the strips, whichever way each is named):
    exactly the tree's expansion (integer values in float64). The control: the same plan with
    one rank's bundles built from its strips in reverse order (a swapped piece, agreed by the
    tags all the same) differs from it."""
    from linop.backends.mpi import compiled

    mapping = _squares() if map_name == "squares" else MAPS[map_name]
    op = _halo().H if adjoint else _halo()
    state = {n: a.astype(np.float64) for n, a in op.domain.random(17, dtype=np.int64).items()}
    expected = op.expand()(state)
    names = mine(op.range, mapping)
    result, found = _bundled_halo_run(op, mapping, state)
    collective_assert(same_blocks(result, expected, names, exact=True) is None, f"{op}: not exact")
    bundled = COMM.allreduce(found)
    collective_assert(bundled > 0 or SIZE == 1, f"{op} under {map_name}: no bundle on any rank")
    if SIZE == 1:
        return
    honest = compiled.bundle_type

    def swapped(specs):
        return honest(specs[::-1] if RANK == 0 else specs)

    compiled.bundle_type = swapped
    try:
        wrong, _ = _bundled_halo_run(op, mapping, state)
    finally:
        compiled.bundle_type = honest
    caught = COMM.allreduce(same_blocks(wrong, expected, names, exact=True) is not None, op=MPI.LOR)
    collective_assert(caught, f"{op}: the swapped bundle went unnoticed")


def _squares() -> WorkerMap:
    """Worker (i, j) of the 4 x 4 grid on rank ((i // 2) * 2 + j // 2) mod the size: at 4
    ranks a 2 x 2 square each, so each stage has messages and local copies on every rank."""
    return WorkerMap([((w // 8) * 2 + (w % 4) // 2) % SIZE for w in range(WORKERS)])


def _phases_then_moves(schedule) -> list[tuple[RankPhase, LocalMoves]]:
    return [
        (step, following)
        for step, following in zip(schedule, schedule[1:])
        if isinstance(step, RankPhase) and isinstance(following, LocalMoves) and step.receives
    ]


@pytest.mark.parametrize("adjoint", [False, True], ids=["forward", "adjoint"])
def test_local_moves_run_while_their_phase_is_in_flight(adjoint):
    """A worker map's local copies that follow a phase and touch nothing its transfers touch
    are prepared between its start and its wait; the bound result is exactly the expansion's.
    Controls: the same moves made to read a box one of the phase's receives writes are refused
    (they would read it before it arrives), and so are, at 4 ranks under the blocked map (a row
    of workers per rank), the column stage's copies, which follow the row stage's messages and
    read the halo rows they bring."""
    from linop.backends.mpi import compiled
    from linop.program import Transfer

    op = _halo().H if adjoint else _halo()
    mapping = _squares()
    pairs = _phases_then_moves(mpi_backend.plan_for(op, comm=COMM, mapping=mapping).schedule)
    accepted = [compiled._independent(phase, moves) for phase, moves in pairs]
    collective_assert(COMM.allreduce(sum(accepted)) > 0 or SIZE == 1, "no moves run in flight")
    admitted = []  # collective asserts below, once: ranks hold different numbers of phases
    for phase, moves in pairs:
        landed = phase.receives[0][2].target  # a box a message writes
        first = moves.transfers[0]
        reading = LocalMoves((Transfer(landed, first.target, first.mode, first.after), *moves.transfers[1:]))
        admitted.append(compiled._independent(phase, reading))
    collective_assert(not any(admitted), "a move reading a landing box admitted")
    if SIZE == 4 and not adjoint:
        rows = _phases_then_moves(mpi_backend.plan_for(op, comm=COMM, mapping=MAPS["blocked"]).schedule)
        refused = [not compiled._independent(phase, moves) for phase, moves in rows]
        collective_assert(bool(rows) and all(refused), f"the column copies after the rows: {refused}")
    state = {n: a.astype(np.float64) for n, a in op.domain.random(3, dtype=np.int64).items()}
    bound = mpi_backend.plan_for(op, comm=COMM, mapping=mapping).bind(local_part(op.domain, state, mapping))
    names = [getattr(function, "__name__", "") for function, _ in bound._calls]
    inside = [name for start, end in _spans(names, "Startall", "Waitall") for name in names[start + 1 : end]]
    collective_assert(bool(inside) or not any(accepted), f"nothing between start and wait: {names}")
    problem = same_blocks(bound(), op.expand()(state), mine(op.range, mapping), exact=True)
    collective_assert(problem is None, f"{op}: {problem}")
    bound.free()


def _spans(names: list[str], opening: str, closing: str) -> list[tuple[int, int]]:
    """The positions of each ``opening`` and the ``closing`` that follows it."""
    found = []
    for position, name in enumerate(names):
        if name == opening:
            found.append((position, names.index(closing, position)))
    return found


def test_bundles_hold_small_messages_only():
    """A phase's messages to one peer form one bundle while they fit in
    :data:`~linop.backends.mpi.phase_recipe.BUNDLE_UP_TO` bytes (the small halo's strips of
    float64), and move alone when each is larger (the same strips of 4 KiB entries), in tag
    order either way."""
    from linop.backends.host_phase import VIEW, Message
    from linop.backends.mpi.phase_recipe import bundles

    schedule = mpi_backend.plan_for(_halo(), comm=COMM, mapping=_squares()).schedule
    problems = []  # asserted collectively once: ranks hold different numbers of phases
    for step in schedule:
        if not isinstance(step, RankPhase):
            continue
        messages = [Message(peer, tag, t, t.source.name, (), VIEW) for peer, tag, t in step.sends]
        small = bundles(messages, 8)
        peers = {m.peer for m in messages}
        if len(small) != len(peers):
            problems.append(f"{len(small)} bundles to {len(peers)} peers")
        for group in small:
            tags = [messages[p].tag for p in group]
            if tags != sorted(tags) or len({messages[p].peer for p in group}) != 1:
                problems.append(f"a bundle of tags {tags}")
        large = bundles(messages, 4096)
        if sorted(map(len, large)) != [1] * len(messages):
            problems.append(f"large ones bundled: {large}")
    collective_assert(not problems, "; ".join(problems))


def test_bundles_are_agreed_per_pair_of_ranks():
    """Two ranks bundle their messages only when both list the same bundles between them,
    with the same tags (:func:`~linop.backends.mpi.compiled.bundle_peers`, which talks to
    the rank's peers only): a ring of matching bundles is agreed on every pair; one rank
    claiming a bundle its left peer does not list turns bundling off for that pair only, on
    both of its ends; peers with no bundles agree."""
    from linop.backends.mpi.compiled import CompiledRun, bundle_peers

    if SIZE == 1:  # no peer: nothing to agree on, nothing sent
        collective_assert(bundle_peers(COMM, CompiledRun()) == frozenset(), "a peer on one rank")
        return
    right, left = (RANK + 1) % SIZE, (RANK - 1) % SIZE
    both = [(right, True, (0, 1)), (left, False, (0, 1))]
    agreed = bundle_peers(COMM, CompiledRun(bundles=both, peers={left, right}))
    collective_assert(agreed == {left, right}, f"matching bundles refused: {sorted(agreed)}")
    agreed = bundle_peers(COMM, CompiledRun(peers={left, right}))
    collective_assert(agreed == {left, right}, f"no bundles refused: {sorted(agreed)}")
    one_sided = both if RANK != 0 else [both[0], (left, False, (0, 2))]
    agreed = bundle_peers(COMM, CompiledRun(bundles=one_sided, peers={left, right}))
    refused = {left} if RANK == 0 else {right} if right == 0 else set()
    expected = {left, right} - refused
    collective_assert(agreed == expected, f"agreed {sorted(agreed)}, expected {sorted(expected)}")


def test_a_pair_that_lists_other_bundles_moves_each_message_alone():
    """Rank 0 bundling nothing (its own phases grouped otherwise, as a rank's own batching
    may), its peers bundle nothing with it but keep their bundles with each other; the bound
    mapped halo exchange is still exactly the tree's expansion (integer values in float64)."""
    from linop.backends.mpi import compiled

    op = _halo()
    mapping = _squares()
    state = {n: a.astype(np.float64) for n, a in op.domain.random(23, dtype=np.int64).items()}
    honest = compiled.bundles
    if RANK == 0:
        compiled.bundles = lambda messages, itemsize: [[p] for p in range(len(messages))]
    try:
        bound = mpi_backend.plan_for(op, comm=COMM, mapping=mapping).bind(
            local_part(op.domain, state, mapping)
        )
    finally:
        compiled.bundles = honest
    try:
        collective_assert(bound.persistent, f"{op}: not persistent")
        problem = same_blocks(bound(), op.expand()(state), mine(op.range, mapping), exact=True)
        collective_assert(problem is None, f"{op}: {problem}")
        with_zero = [tags for peer, _, tags in bound._run.bundles if peer == 0 or RANK == 0]
        collective_assert(not with_zero, f"bundled with rank 0: {with_zero}")
        others = COMM.allreduce(len(bound._run.bundles))
        collective_assert(others > 0 or SIZE < 4, "no pair bundles at 4 ranks")
    finally:
        bound.free()


def _batch_norm_statistics():
    """(3, 2) blocks on a (1, 2, 4, 2) grid of the 16 workers reduced over every axis but the
    channel axis (a batch norm's statistics, channels cut in two): two groups of 8 workers."""
    return AllReduce(BlockGrid.uniform("t", Partition((1, 2, 4, 2)), (3, 2)), (0, 2, 3))


ALL_REDUCES = {
    "axis-0": _all_reduce((0,)),
    "axes-0-1": _all_reduce((0, 1)),
    "batch-norm": _batch_norm_statistics,
}


@pytest.mark.parametrize("map_name", list(MAPS))
@pytest.mark.parametrize("case", list(ALL_REDUCES))
def test_mapped_all_reduce_is_native_and_exact(map_name, case):
    """Under a map an all-reduce sums a rank's own members locally, then runs one native
    ``Allreduce`` per group on the sub-communicator of its distinct ranks (no point-to-point
    messages): equal to numpy exactly (integers, checked; integer values in float64, bound
    persistently, two calls), float16 (which MPI cannot sum) through the expansion."""
    mapping = MAPS[map_name]
    op = ALL_REDUCES[case]()
    plan = mpi_backend.plan_for(op, comm=COMM, mapping=mapping)
    kinds = {type(step).__name__ for step in plan.schedule}
    collective_assert("RankPhase" not in kinds and "LocalMoves" not in kinds, f"{op}: {kinds}")
    check_mapped(op, mapping, 8)
    names = mine(op.range, mapping)
    for dtype in (np.float64, np.float16):
        state = {n: a.astype(dtype) for n, a in op.domain.random(9, dtype=np.int64).items()}
        bound = plan.bind(local_part(op.domain, state, mapping))
        first = {n: a.copy() for n, a in bound().items()}
        second = bound()
        problem = same_blocks(first, op(state), names, exact=True) or same_blocks(
            second, op(op(state)), names, exact=True
        )
        collective_assert(problem is None, f"{op} ({np.dtype(dtype)}) under {map_name}: {problem}")
        collective_assert(bound.persistent or dtype == np.float16, f"{op} under {map_name}: not persistent")
        bound.free()


ROOTED = {
    "broadcast-1-to-16": _broadcast_1d,
    "broadcast-rows": _broadcast_rows,
    "sum-reduce": _sum_reduce,
    "sum-reduce-16-to-1": lambda: _broadcast_1d().H,
    "broadcast-rows-adjoint": lambda: _broadcast_rows().H,
}


def _kinds(schedule) -> set[str]:
    return {type(step).__name__ for step in schedule}


@pytest.mark.parametrize("map_name", list(MAPS))
@pytest.mark.parametrize("case", list(ROOTED))
def test_mapped_broadcast_and_sum_reduce_are_native_and_exact(case, map_name):
    """Under a map a broadcast fills a rank's copies from one ``Bcast`` over the group's
    distinct ranks, and a sum-reduce adds a rank's copies locally before one ``Allreduce``
    over them (no point-to-point messages, no local moves): equal to numpy exactly (integers,
    checked; integer values in float64, bound as prepared calls, two calls on new values), float16 sums
    (which MPI cannot add) through the expansion. The control: the same tree compiled
    without the native steps under the map moves its copies point to point (messages or
    local moves), which the check above refuses."""
    mapping = MAPS[map_name]
    op = ROOTED[case]()
    plan = mpi_backend.plan_for(op, comm=COMM, mapping=mapping)
    kinds = _kinds(plan.schedule)
    collective_assert("RankPhase" not in kinds and "LocalMoves" not in kinds, f"{op}: {kinds}")
    portable, _ = compiled_for(op, mapping, native=False).for_rank(RANK, SIZE)
    moved = COMM.allreduce(len(_kinds(portable.schedule) & {"RankPhase", "LocalMoves"}))
    collective_assert(moved > 0, f"{op}: the control moves nothing point to point")
    check_mapped(op, mapping, 11)
    names = mine(op.range, mapping)
    for dtype in (np.int64, np.float64, np.float16):
        first_state = {n: a.astype(dtype) for n, a in op.domain.random(12, dtype=np.int64).items()}
        second_state = {n: a.astype(dtype) for n, a in op.domain.random(13, dtype=np.int64).items()}
        local = local_part(op.domain, first_state, mapping)
        bound = plan.bind(local)
        first = {n: np.array(a) for n, a in bound().items()}
        for name, array in local_part(op.domain, second_state, mapping).items():
            local[name][...] = array
        second = bound()
        problem = same_blocks(first, op(first_state), names, exact=True) or same_blocks(
            second, op(second_state), names, exact=True
        )
        collective_assert(problem is None, f"{op} ({np.dtype(dtype)}) under {map_name}: {problem}")
        collective_assert(bound.persistent or dtype != np.float64, f"{op} under {map_name}: not prepared")
        bound.free()


@pytest.mark.parametrize("map_name", ["blocked", "round-robin"])
def test_mapped_broadcast_copies_sharing_a_buffer_are_written_apart(map_name):
    """A rank's copies of a broadcast share one read-only buffer; a later step writing one
    copy (an in-place copy between two copies) leaves the others as numpy has them, checked
    and bound. Under the blocked map copies 0 and 1 share a rank (the buffer), under
    round-robin (on several ranks) they do not."""
    mapping = MAPS[map_name]
    broadcast = _broadcast_1d()
    y = broadcast.range
    op = Copy(y["y[0]"][0:3], y["y[1]"][3:6]) @ broadcast
    check_mapped(op, mapping, 21)
    check_mapped(op.H, mapping, 22)
    plan = mpi_backend.plan_for(op, comm=COMM, mapping=mapping)
    state = {n: a.astype(np.float64) for n, a in op.domain.random(23, dtype=np.int64).items()}
    bound = plan.bind(local_part(op.domain, state, mapping))
    for _ in range(2):
        problem = same_blocks(bound(), op(state), mine(op.range, mapping), exact=True)
        collective_assert(problem is None, f"{op} under {map_name}: {problem}")
    bound.free()


@spmd_given(movement_trees(WORKERS), max_examples=8, long=30)
def test_random_trees(op):
    for name, mapping in MAPS.items():
        state = op.domain.random(6, dtype=np.int64)
        expected = op(state)
        result = mpi_backend.apply(op, local_part(op.domain, state, mapping), comm=COMM, mapping=mapping)
        problem = same_blocks(result, expected, mine(op.range, mapping))
        collective_assert(problem is None, f"{name}: {op}: {problem}")


def test_worker_missing_fails_on_every_rank():
    op = _halo()
    partial = WorkerMap({w: w % SIZE for w in range(WORKERS) if w != 9})
    message = expect_collective_error(
        WorkerMapError, lambda: mpi_backend.apply(op, {}, comm=COMM, mapping=partial)
    )
    assert "worker 9" in message


def test_rank_out_of_range_fails_on_every_rank():
    op = _halo()
    beyond = WorkerMap([SIZE if w == 6 else 0 for w in range(WORKERS)])
    message = expect_collective_error(
        WorkerMapError, lambda: mpi_backend.apply(op, {}, comm=COMM, mapping=beyond)
    )
    assert "worker 6" in message and f"rank {SIZE}" in message


def test_malformed_map_fails_on_every_rank():
    op = _halo()
    message = expect_collective_error(
        WorkerMapError, lambda: mpi_backend.apply(op, {}, comm=COMM, mapping=[0] * 15 + [-1])
    )
    assert "worker 15" in message


@pytest.mark.skipif(SIZE == 1, reason="one rank cannot disagree with itself")
@pytest.mark.parametrize("other", ["another map", "no map", "malformed on rank 1"])
def test_maps_differing_across_ranks_fail_on_every_rank(other):
    op = _halo()
    mapping: object = MAPS["round-robin"]
    if RANK == 1:
        mapping = {
            "another map": MAPS["blocked"],
            "no map": None,
            "malformed on rank 1": [0, -3],
        }[other]
    local = local_part(op.domain, op.domain.random(1), MAPS["round-robin"])
    message = expect_collective_error(
        WorkerMapMismatchError, lambda: mpi_backend.apply(op, local, comm=COMM, mapping=mapping)
    )
    assert "rank(s) [1]" in message


def test_wrong_local_state_under_a_map_fails_on_every_rank():
    op = _halo()
    mapping = MAPS["blocked"]
    local = local_part(op.domain, op.domain.random(1), mapping)
    if RANK == SIZE - 1:
        local.pop(next(iter(local)))
    expect_collective_error(
        DistributedStateError, lambda: mpi_backend.apply(op, local, comm=COMM, mapping=mapping)
    )


# -- a rank plans its workers' part of collectives and repartitions (issue 24) ------------------
PER_RANK = {
    "scatter": lambda: Scatter(Block("r", (11, 9), 6), grid_tensor()),
    "gather": lambda: Scatter(Block("r", (11, 9), 6), grid_tensor()).H,
    "all-gather-0": lambda: AllGather(grid_tensor(shape=(12, 9)), 0, "g"),
    "reduce-scatter-1": lambda: AllGather(grid_tensor(), 1, "g").H,
    "repartition-uneven": lambda: Repartition(grid_tensor(), grid_tensor("z", grid=(3, 5))),
    "repartition-there-and-back": lambda: (
        Repartition(grid_tensor(), grid_tensor("z", grid=(2, 8))).H
        @ Repartition(grid_tensor(), grid_tensor("z", grid=(2, 8)))
    ),
    "all-reduce-twice": lambda: _all_reduce((0,))() @ _all_reduce((1,))(),
}


@pytest.mark.parametrize("map_name", list(MAPS))
@pytest.mark.parametrize("case", list(PER_RANK))
def test_collectives_planned_per_rank_under_a_map_equal_numpy(case, map_name):
    """Scatter, gather, all-gather, reduce-scatter, repartitions and compositions under a map:
    each rank compiles its workers' part only (the global program is never built) and the
    results equal numpy exactly, adjoints included (the inner-product identity across ranks)."""
    mapping = MAPS[map_name]
    op = PER_RANK[case]()
    compiled = compiled_for(op, mapping)
    collective_assert(compiled.per_worker, f"{op}: not compiled per rank")
    y = check_mapped(op, mapping, 21)
    x = local_part(op.domain, op.domain.random(21, dtype=np.int64), mapping)
    z = local_part(op.range, op.range.random(22, dtype=np.int64), mapping)
    adjoint = mpi_backend.apply(op.H, z, comm=COMM, mapping=mapping)
    left = COMM.allreduce(local_dot(y, z))
    right = COMM.allreduce(local_dot(x, adjoint))
    collective_assert(left == right, f"{op} under {map_name}: <Ax, z> = {left} but <x, A*z> = {right}")
    collective_assert(compiled._global is None, f"{op} under {map_name}: the global program was built")


@pytest.mark.parametrize("case", ["halo", "all-reduce-0", "repartition", "broadcast-rows"])
def test_a_described_map_on_some_ranks_and_its_table_on_others_run_together(case):
    """The blocked map described on even ranks and listed as a table on odd ranks: one
    fingerprint (the entry check passes) and the numpy results."""
    table = [w * SIZE // WORKERS for w in range(WORKERS)]
    mapping = WorkerMap.blocked(WORKERS, SIZE) if RANK % 2 == 0 else WorkerMap(table)
    op = CASES[case]()
    collective_assert(mapping == MAPS["blocked"], f"{mapping!r} differs from {MAPS['blocked']!r}")
    check_mapped(op, mapping, 31)
