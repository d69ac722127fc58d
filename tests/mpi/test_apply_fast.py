"""The cheap checked apply (linop.backends.mpi.inplace_phases and the cached entry check): repeated calls
give the numpy interpreter's results, and after warm calls (check vector, outcome and compiled
schedule cached) a mismatched tree or a wrong block on one rank still fails on every rank with
the same typed error, before any data moves."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import collective_assert, expect_collective_error, local_part, same_blocks
from mpi4py import MPI

from linop import AllReduce, BlockGrid, Partition
from linop.backends import mpi as mpi_backend
from linop.backends.mpi.inplace_phases import compile_phases
from linop.errors import DistributedStateError, IntegerOverflowError, TreeMismatchError
from linop.halo import HaloExchange
from linop.halo_geometry import Kernel, halo_geometry
from linop.partition import DistributedTensor

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size
LAST = SIZE - 1
SHAPE = (12, 80)  # rows of 80+ float64 move as subarray datatypes, columns are packed
GRIDS = sorted({(SIZE, 1), (1, SIZE), (2, SIZE // 2) if SIZE % 2 == 0 else (SIZE, 1)})


def halo(grid: tuple[int, int], h: int = 1) -> HaloExchange:
    tensor = DistributedTensor("x", SHAPE, Partition(grid))
    return HaloExchange(halo_geometry(tensor, Kernel(2 * h + 1, padding=h)))


def _own(op, state) -> dict[str, np.ndarray]:
    return local_part(op.domain, state, RANK)


@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: f"{g[0]}x{g[1]}")
@pytest.mark.parametrize("h", [1, 2], ids=["h1", "h2"])
@pytest.mark.parametrize("adjoint", [False, True], ids=["forward", "adjoint"])
def test_repeated_in_place_calls_equal_numpy_and_the_bound_plan(grid, h, adjoint):
    op = halo(grid, h)
    op = op.H if adjoint else op
    state = op.domain.random(3)
    local, bound_local = _own(op, state), _own(op, state)
    bound = mpi_backend.plan_for(op, comm=COMM).bind(bound_local)
    problem = None
    for call in range(3):  # the first call compiles, the others run the cached schedule
        state = op(state)
        result = mpi_backend.apply(op, local, comm=COMM, inplace=True)
        bound()
        problem = problem or same_blocks(result, state, tuple(local), exact=True)
        if problem is None and any(result[n] is not local[n] for n in local):
            problem = f"call {call}: the in-place result is not the caller's arrays"
        if problem is None and any(not np.array_equal(local[n], bound_local[n]) for n in local):
            problem = f"call {call}: apply and the bound plan differ"
    bound.free()
    collective_assert(problem is None, str(problem))


def test_the_in_place_halo_exchange_takes_the_compiled_path():
    """The case the compiled path is for: not silently the ordinary runtime."""
    op = halo(GRIDS[-1])
    local = _own(op, op.domain.random(1))
    plan = mpi_backend.plan_for(op, comm=COMM)
    compiled = compile_phases(plan.schedule, local, np.dtype(np.float64), plan.comm)
    collective_assert(SIZE == 1 or compiled is not None, f"schedule {plan.schedule} was not compiled")


def test_a_layout_change_is_compiled_again_or_run_ordinarily():
    """Same tree, arrays of another layout (Fortran order, then float32 widened to the run's
    float64 out of place): results still equal numpy."""
    op = halo(GRIDS[-1])
    state = op.domain.random(5)
    local = _own(op, state)
    mpi_backend.apply(op, local, comm=COMM, inplace=True)
    expected = op(state)
    fortran = {n: np.asfortranarray(a) for n, a in _own(op, state).items()}
    result = mpi_backend.apply(op, fortran, comm=COMM, inplace=True)
    problem = same_blocks(result, expected, tuple(local), exact=True)
    single = {n: a.astype(np.float32) for n, a in _own(op, state).items()}
    out = mpi_backend.apply(op, single, comm=COMM)
    problem = problem or same_blocks(out, op({n: a.astype(np.float32) for n, a in state.items()}), tuple(out))
    collective_assert(problem is None, str(problem))


def _warm(op, local, calls: int = 3) -> None:
    for _ in range(calls):
        mpi_backend.apply(op, local, comm=COMM, inplace=True)


@pytest.mark.skipif(SIZE == 1, reason="one rank cannot disagree with itself")
@pytest.mark.parametrize("other_warm", [False, True], ids=["other-tree-new", "other-tree-warm"])
def test_a_mismatched_tree_after_warm_calls_fails_on_every_rank(other_warm):
    """Every rank warms the fast path on one tree (and, in one case, on the other tree too);
    then the last rank alone passes the other tree: the same TreeMismatchError everywhere,
    the caller's arrays untouched, and the next correct call works."""
    grid = GRIDS[-1]
    op, other = halo(grid, 1), 2.0 * halo(grid, 1)
    state = op.domain.random(7)
    local = _own(op, state)
    _warm(op, local)
    if other_warm:
        _warm(other, local)
    before = {n: a.copy() for n, a in local.items()}
    mine = other if RANK == LAST else op
    message = expect_collective_error(
        TreeMismatchError, lambda: mpi_backend.apply(mine, local, comm=COMM, inplace=True)
    )
    collective_assert(f"rank(s) [{LAST}]" in message, message)
    untouched = all(np.array_equal(local[n], before[n]) for n in local)
    collective_assert(untouched, "a refused call wrote into the caller's arrays")
    reference = state  # the arrays hold this history; the refused call added nothing
    for _ in range(3):
        reference = op(reference)
    if other_warm:
        for _ in range(3):
            reference = other(reference)
    reference = op(reference)
    result = mpi_backend.apply(op, local, comm=COMM, inplace=True)
    problem = same_blocks(result, reference, tuple(local), exact=True)
    collective_assert(problem is None, str(problem))


@pytest.mark.parametrize("kind", ["shape", "read-only", "complex", "missing"])
def test_a_wrong_block_after_warm_calls_fails_on_every_rank(kind):
    if kind == "complex" and SIZE == 1:
        pytest.skip("one rank's complex block makes the whole run complex: nothing to refuse")
    op = halo(GRIDS[-1])
    local = _own(op, op.domain.random(9))
    _warm(op, local)
    before = {n: a.copy() for n, a in local.items()}
    bad = dict(local)
    if RANK == LAST:
        (name,) = bad
        if kind == "shape":
            bad[name] = np.zeros((2, 2))
        elif kind == "read-only":
            view = bad[name].view()
            view.flags.writeable = False
            bad[name] = view
        elif kind == "complex":  # the run becomes complex: the others' float arrays cannot hold it
            bad[name] = bad[name].astype(np.complex128)
        else:
            bad.pop(name)
    message = expect_collective_error(
        DistributedStateError, lambda: mpi_backend.apply(op, bad, comm=COMM, inplace=True)
    )
    phrase = {
        "shape": "has shape (2, 2)",
        "read-only": "writeable",
        "complex": "complex128",
        "missing": "missing",
    }
    collective_assert(phrase[kind] in message, message)
    untouched = all(np.array_equal(local[n], before[n]) for n in local)
    collective_assert(untouched, "a refused call wrote into the caller's arrays")
    start = op.domain.random(10)
    expected, fresh = op(start), _own(op, start)
    result = mpi_backend.apply(op, fresh, comm=COMM, inplace=True)
    collective_assert(same_blocks(result, expected, tuple(fresh)) is None, "the next call is wrong")


@pytest.mark.parametrize("warm32", [False, True], ids=["float32-new", "float32-warm"])
def test_one_rank_in_float32_after_warm_calls_equals_numpy(warm32):
    """The last rank's block turns float32 (the run stays float64, its result is cast back
    into its array, as numpy does in place): that rank runs the ordinary runtime, the others
    the compiled schedule; the messages agree. With ``warm32`` every rank ran float32 first,
    so the last rank has a float32 schedule compiled for that layout: it must not be used
    for the float64 run."""
    op = halo(GRIDS[-1])
    state = op.domain.random(13)
    if warm32:
        state = {n: a.astype(np.float32) for n, a in state.items()}
        single = _own(op, state)
        _warm(op, single, 2)
        state = {n: a.astype(np.float64) for n, a in op(op(state)).items()}
    local = _own(op, state)
    _warm(op, local, 2)
    for _ in range(2):
        state = op(state)
    last = {b.name for b in op.domain if b.worker == LAST}
    mixed = {n: a.astype(np.float32) if n in last else a for n, a in state.items()}
    mine = {n: mixed[n].copy() for n in local}
    problem = None
    for _ in range(3):
        mixed = op.apply(mixed, inplace=True)
        result = mpi_backend.apply(op, mine, comm=COMM, inplace=True)
        problem = problem or same_blocks(result, mixed, tuple(mine), exact=True)
        if problem is None and any(result[n].dtype != mixed[n].dtype for n in mine):
            problem = "an in-place result changed dtype"
    collective_assert(problem is None, str(problem))


def test_trees_interleaved_on_one_communicator():
    """Two trees alternate (they share the communicator's check buffers): no false mismatch,
    numpy's results."""
    grid = GRIDS[-1]
    first, second = halo(grid, 1), halo(grid, 2)
    states = [first.domain.random(11), second.domain.random(12)]
    locals_ = [_own(first, states[0]), _own(second, states[1])]
    problem = None
    for _ in range(3):
        for i, op in enumerate((first, second, first.H)):
            j = 1 if i == 1 else 0
            states[j] = op(states[j])
            result = mpi_backend.apply(op, locals_[j], comm=COMM, inplace=True)
            problem = problem or same_blocks(result, states[j], tuple(locals_[j]))
    collective_assert(problem is None, str(problem))


def test_an_integer_overflow_is_found_after_warm_calls():
    """Integer outcomes are cached by the ranks' largest magnitude: values that fit pass
    again and again, then larger ones are refused on every rank, arrays untouched."""
    layout = BlockGrid.uniform("a", Partition((SIZE,)), (4,))
    op = AllReduce(layout, (0,))
    names = [b.name for b in op.domain if b.worker == RANK]
    small = {n: np.ones(4, dtype=np.int8) for n in names}
    for _ in range(3):
        for a in small.values():
            a.fill(1)
        mpi_backend.apply(op, small, comm=COMM, inplace=True)
        collective_assert(all(int(a[0]) == SIZE for a in small.values()), f"{small}")
    large = {n: np.full(4, 127 if SIZE > 1 else 1, dtype=np.int8) for n in names}
    if SIZE == 1:
        return  # one rank: a sum of one term always fits
    before = {n: a.copy() for n, a in large.items()}
    expect_collective_error(
        IntegerOverflowError, lambda: mpi_backend.apply(op, large, comm=COMM, inplace=True)
    )
    collective_assert(all(np.array_equal(large[n], before[n]) for n in large), "arrays written")


@pytest.mark.parametrize("reduce", [False, True], ids=["broadcast", "sum-reduce"])
def test_kept_results_of_large_collectives_are_not_overwritten(reduce):
    """Results of out-of-place broadcasts and sum-reduces come from recycled memory
    (linop.backends.mpi.memory): a result the caller keeps is never reused by the next call."""
    from linop.collectives import Broadcast

    count = 1 << 15  # 256 KB of float64: pooled
    source = DistributedTensor("s", (count,), Partition((1,)))
    op = Broadcast(source, Partition((SIZE,)), "c")
    op = op.H if reduce else op
    kept, problem = [], None
    for call in range(4):
        state = {b.name: np.full(b.shape, float(call + 1)) for b in op.domain}
        expected = op(state)
        result = mpi_backend.apply(op, _own(op, state), comm=COMM)
        kept.append((result, expected))
        mpi_backend.apply(op, _own(op, state), comm=COMM)  # a result dropped at once: recycled
    for result, expected in kept:
        problem = problem or same_blocks(result, expected, tuple(result))
    collective_assert(problem is None, str(problem))


def test_persistent_requests_follow_the_array_objects():
    """The compiled schedule's persistent requests are made per array object, by address:
    new arrays each call (some kept, some dropped at once, ids and addresses reused), more of
    them than are kept bound, and the old ones again: every call equals numpy, and a dropped
    array frees its requests."""
    import gc

    op = halo(GRIDS[-1])
    kept, problem = [], None
    for call in range(2 * 4 + 3):
        state = op.domain.random(20 + call % 5)
        local = _own(op, state)
        result = mpi_backend.apply(op, local, comm=COMM, inplace=True)
        problem = problem or same_blocks(result, op(state), tuple(local))
        if call % 2:
            kept.append((local, state))
        del local, result
        gc.collect()
    for local, state in kept:  # bound again (evicted meanwhile) or still bound
        expected = op(op(op(state)))
        mpi_backend.apply(op, local, comm=COMM, inplace=True)
        result = mpi_backend.apply(op, local, comm=COMM, inplace=True)
        problem = problem or same_blocks(result, expected, tuple(local))
    collective_assert(problem is None, str(problem))


@pytest.mark.skipif(SIZE == 1, reason="the move between the workers needs two ranks")
def test_the_same_arrays_under_swapped_names_are_not_the_same_binding():
    """Rank 0 holds blocks a and b (one shape): its arrays passed again with the names
    swapped (and the dict in an order that lists the objects as before) move by name."""
    from linop import Block, SendRecv, Space

    space = Space([Block("a", (3, 4), 0), Block("b", (3, 4), 0), Block("y", (3, 4), LAST)])
    op = SendRecv(space["y"][2:3, :], space["b"][0:1, :]) @ SendRecv(space["a"][1:2, :], space["y"][0:1, :])
    mine = _own(op, space.random(31))
    problem = None
    for call in range(4):
        local = mine
        if RANK == 0 and call % 2:
            first, second = mine["a"], mine["b"]
            local = {"b": first, "a": second}  # the objects in the same order, names swapped
        current: dict[str, np.ndarray] = {}
        for part in COMM.allgather({n: a.copy() for n, a in local.items()}):
            current.update(part)
        expected = op(current)
        result = mpi_backend.apply(op, local, comm=COMM, inplace=True)
        problem = problem or same_blocks(result, expected, tuple(local))
    collective_assert(problem is None, str(problem))
