"""The MPI interpreter equals the numpy interpreter, rank by rank, on random and chosen trees."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import (
    collective_assert,
    compare_with_numpy,
    expect_collective_error,
    local_part,
    same_blocks,
    spmd_given,
)
from mpi4py import MPI
from strategies import movement_trees

from linop import Block, Copy, Move, SendRecv, Space
from linop.backends import mpi as mpi_backend

COMM = MPI.COMM_WORLD
SIZE = COMM.size
LAST = SIZE - 1
EXAMPLES = {"max_examples": 20, "long": 80}


@spmd_given(movement_trees(SIZE), **EXAMPLES)
def test_random_trees_equal_numpy_interpreter(op):
    compare_with_numpy(op, op.domain.random(7, dtype=np.int64))


@spmd_given(movement_trees(SIZE), **EXAMPLES)
def test_random_adjoint_trees_equal_numpy_interpreter(op):
    compare_with_numpy(op.H, op.range.random(8, dtype=np.int64))


def ring_space(shape=(4, 5)) -> Space:
    return Space(Block(f"x{w}", shape, w) for w in range(SIZE))


def ring_shift(space: Space) -> Copy:
    """Every worker's first row to the next worker's last row (a cycle of send-receives)."""
    op = None
    for w in range(SIZE):
        dst_worker = (w + 1) % SIZE
        src, dst = space[f"x{w}"][0:1, :], space[f"x{dst_worker}"][-1:, :]
        node = Copy(src, dst) if dst_worker == w else SendRecv(src, dst)
        op = node if op is None else node @ op
    return op


@pytest.mark.parametrize(
    "dtype", [np.int8, np.int32, np.uint16, np.float16, np.float32, np.float64, np.complex64, np.complex128]
)
def test_every_numeric_dtype(dtype):
    space = ring_space()
    op = ring_shift(space)
    compare_with_numpy(op, space.random(1, dtype=dtype))
    compare_with_numpy(op.H, space.random(2, dtype=dtype))


def test_complex_scaling_of_real_blocks():
    space = ring_space((3, 3))
    op = (1 + 2j) * ring_shift(space) + ring_shift(space).H
    compare_with_numpy(op, space.random(3), exact=False)


def test_mixed_dtypes_across_ranks():
    space = ring_space((2, 3))
    state = space.random(4, dtype=np.float64)
    state["x0"] = state["x0"].astype(np.float32)
    compare_with_numpy(ring_shift(space), state)


def test_phases_batch_a_ring_into_one():
    space = ring_space()
    plan = mpi_backend.plan_for(ring_shift(space), comm=COMM)
    collective_assert(plan.program.phases == (1 if SIZE > 1 else 0), f"{plan.program.phases} phases")


def test_inplace_writes_into_the_callers_arrays():
    space = ring_space()
    op = ring_shift(space)
    state = space.random(5)
    expected = op(state)
    local = local_part(space, state, COMM.rank)
    arrays = dict(local)
    result = mpi_backend.apply(op, local, comm=COMM, inplace=True)
    names = tuple(n for n in local)
    problem = same_blocks(local, expected, names)
    if problem is None and any(result[n] is not arrays[n] for n in names):
        problem = "the in-place result is not the caller's arrays"
    collective_assert(problem is None, str(problem))


def swap_on_every_worker() -> Move:
    """x_w and y_w trade places on every worker w through out-of-place moves: the results are
    the caller's arrays, each under the other's name."""
    space = Space(Block(f"{n}{w}", (2, 3), w) for w in range(SIZE) for n in "xy")
    op = None
    for w in range(SIZE):
        for src, dst in ((f"x{w}", f"t{w}"), (f"y{w}", f"x{w}"), (f"t{w}", f"y{w}")):
            current = space if op is None else op.range
            node = Move(current[src], Block(dst, (2, 3), w))
            op = node if op is None else node @ op
    return op


@pytest.mark.parametrize("bound", [False, True], ids=["apply", "bound"])
def test_inplace_swap_of_the_callers_arrays(bound):
    op = swap_on_every_worker()
    state = op.domain.random(5)
    expected = op(state)
    local = local_part(op.domain, state, COMM.rank)
    if bound:
        mpi_backend.plan_for(op, comm=COMM).bind(local)()
    else:
        mpi_backend.apply(op, local, comm=COMM, inplace=True)
    collective_assert(
        same_blocks(local, expected, tuple(local)) is None, str(same_blocks(local, expected, tuple(local)))
    )


def test_equal_trees_with_other_scalar_types_are_compiled_apart():
    """2 * A == 2.0 * A, but integer blocks stay integers only under the first."""
    space = ring_space()
    state = space.random(6, dtype=np.int64)
    mpi_backend.plan_for(2 * ring_shift(space), comm=COMM)
    compare_with_numpy(2.0 * ring_shift(space), state)
    compare_with_numpy(2 * ring_shift(space), state)


def test_bound_out_of_place_passes_blocks_through_read_only():
    space = Space([*ring_space(), *(Block(f"p{w}", (3,), w) for w in range(SIZE))])
    op = Move(space["p0"][0:1], space["p0"][2:3]) @ ring_shift(space)
    state = space.random(7)
    local = local_part(space, state, COMM.rank)
    result = mpi_backend.plan_for(op, comm=COMM).bind(local, inplace=False)()
    names = tuple(b.name for b in op.range if b.worker == COMM.rank)
    problem = same_blocks(result, op(state), names)
    writable = [n for n in names if result[n].flags.writeable and np.shares_memory(result[n], local[n])]
    if problem is None and writable:
        problem = f"results {writable} share writable memory with the input"
    collective_assert(problem is None, str(problem))


def test_a_donated_binding_writes_its_arrays_instead_of_copying_them():
    """bind(donate=True): the plan may overwrite the bound arrays (no copy of a block before its
    first change); refilled before each call it gives the operator's result every time, with
    fewer prepared copies than the plain binding, which leaves the arrays alone."""
    from linop import DistributedTensor, Kernel, Partition, halo_windows

    tensor = DistributedTensor("u", (4 * SIZE, 6), Partition((SIZE, 1)))
    op = halo_windows(tensor, Kernel(3, padding=1)).H  # window gradients added back into blocks
    plan = mpi_backend.plan_for(op, comm=COMM)
    names = tuple(b.name for b in op.range if b.worker == COMM.rank)
    problems = []
    copies = {}
    for donate in (False, True):
        local = {b.name: np.zeros(b.shape) for b in op.domain if b.worker == COMM.rank}
        bound = plan.bind(local, inplace=False, donate=donate)
        copies[donate] = sum(function is np.copyto for function, _ in bound._calls or ())
        for seed in (3, 4):
            state = op.domain.random(seed)
            given = local_part(op.domain, state, COMM.rank)
            for name, array in given.items():
                np.copyto(local[name], array)
            problem = same_blocks(bound(), op(state), names)
            if problem is None and not donate and any(not np.array_equal(local[n], given[n]) for n in given):
                problem = "the plain binding wrote its arrays"
            problems.append(problem)
        problems.append(None if bound.persistent else f"donate={donate}: not compiled")
        bound.free()
    if copies[True] >= copies[False]:
        problems.append(f"donated binding prepares {copies[True]} copies, the plain one {copies[False]}")
    problem = next((p for p in problems if p is not None), None)
    collective_assert(problem is None, str(problem))


@pytest.mark.parametrize("extra", ["messages-only", "with-a-local-move", "with-a-sum"])
def test_bound_plan(extra):
    """Phases of messages and local moves compile into prepared calls (persistent requests,
    numpy copies); a sum (not compiled) makes the bound plan run the ordinary schedule
    (without its check). Either way two calls apply the operator twice."""
    space = ring_space((64, 48))
    op = ring_shift(space)
    if extra == "with-a-local-move":
        op = op @ Move(space["x0"][:, 0:1], space["x0"][:, 5:6])
    elif extra == "with-a-sum":
        op = op + 2.0 * op
    state = space.random(6)
    expected = op(state)
    local = local_part(space, state, COMM.rank)
    bound = mpi_backend.plan_for(op, comm=COMM).bind(local)
    bound()
    problem = same_blocks(local, expected, tuple(local))
    twice = op(expected)
    bound()
    problem = problem or same_blocks(local, twice, tuple(local))
    persistent = extra != "with-a-sum"
    if problem is None and bound.persistent != persistent:
        problem = f"persistent is {bound.persistent}"
    bound.free()
    collective_assert(problem is None, str(problem))


def empty_block_trees() -> list:
    """Zero-size blocks and boxes moving between workers; most ranks own nothing."""
    space = Space([Block("e", (0, 3), 0), Block("f", (2, 0), LAST), Block("z", (3,), LAST)])

    def copy(src, dst):
        return SendRecv(src, dst) if src.worker != dst.worker else Copy(src, dst)

    moved = Move(space["e"], Block("n", (0, 3), LAST))
    return [
        moved,
        moved.H,
        copy(space["f"], Block("g", (2, 0), 0)),
        copy(space["f"], Block("g", (2, 0), 0)).H,
        copy(space["z"][1:1], space["e"][0:0, 0]),
        copy(space["z"][1:1], space["e"][0:0, 0]).H,
        Move(space["z"][0:0], space["e"][0:0, 2]),
    ]


@pytest.mark.parametrize("index", range(7))
def test_empty_blocks_and_boxes(index):
    op = empty_block_trees()[index]
    compare_with_numpy(op, op.domain.random(3, dtype=np.int64))


def test_a_subcommunicator():
    half = COMM.Split(COMM.rank % 2, COMM.rank)
    try:
        space = Space(Block(f"x{w}", (3,), w) for w in range(half.size))
        op = None
        for w in range(1, half.size):
            node = SendRecv(space["x0"], space[f"x{w}"])
            op = node if op is None else node @ op
        if op is not None:
            compare_with_numpy(op, space.random(9, dtype=np.int64), comm=half)
    finally:
        half.Free()


def test_cached_plan_is_reused():
    space = ring_space()
    op = ring_shift(space)
    first = mpi_backend.plan_for(op, comm=COMM)
    again = mpi_backend.plan_for(ring_shift(space), comm=COMM)
    collective_assert(
        first is again and mpi_backend.plan_for(op, comm=COMM) is first, "plans were not cached"
    )


def test_operator_method_apply_mpi_is_the_mpi_interpreter():
    space = ring_space()
    op = ring_shift(space)
    state = space.random(4, dtype=np.int64)
    local = local_part(space, state, COMM.rank)
    by_method = op.apply_mpi(local, comm=COMM)
    by_function = mpi_backend.apply(op, local, comm=COMM)
    names = tuple(b.name for b in op.range if b.worker == COMM.rank)
    collective_assert(same_blocks(by_method, by_function, names) is None, "apply_mpi differs")
    collective_assert(same_blocks(by_method, op(state), names) is None, "apply_mpi differs from numpy")


def test_a_freed_communicator_and_a_reused_handle():
    """A freed communicator is a typed error; a new one that MPI gives the freed handle gets
    a context of its own (not the freed one's plans and private duplicate)."""
    from linop.errors import CommunicatorError

    op = ring_shift(ring_space())
    state = ring_space().random(12, dtype=np.int64)
    local = local_part(op.domain, state, COMM.rank)
    first = COMM.Dup()
    compare_with_numpy(op, state, comm=first)
    old_plan = mpi_backend.plan_for(op, comm=first)
    first.Free()
    message = expect_collective_error(CommunicatorError, lambda: mpi_backend.apply(op, local, comm=first))
    collective_assert("COMM_NULL" in message, message)
    second = COMM.Dup()
    try:
        compare_with_numpy(op, state, comm=second)
        new_plan = mpi_backend.plan_for(op, comm=second)
        collective_assert(new_plan is not old_plan and new_plan.context.user is second, "stale context")
    finally:
        second.Free()
