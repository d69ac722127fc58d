"""Reliability of the MPI interpreter: aliasing refused like numpy, bad communicators typed on
every rank, communicators and plans that do not pile up, numpy's Sum semantics."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from helpers import collective_assert, compare_with_numpy, expect_collective_error, local_part, same_blocks
from mpi4py import MPI

from linop import Add, AllReduce, Block, BlockGrid, Clear, Copy, Identity, Partition, SendRecv, Space, Sum
from linop.backends import mpi as mpi_backend
from linop.backends.mpi.context import (
    PLAN_CACHE_SIZE,
    CommunicatorArgumentError,
    context_for,
    open_contexts,
    open_subcommunicators,
)
from linop.errors import (
    CommunicatorError,
    DistributedStateError,
    DtypeError,
    IntegerOverflowError,
    MPIError,
    StateError,
)

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size
LAST = SIZE - 1


def _move(src, dst):
    return SendRecv(src, dst) if src.worker != dst.worker else Copy(src, dst)


def aliasing_case():
    """Blocks a and c on worker 0, b on the last; data goes a -> b, a is cleared, b -> c."""
    space = Space([Block("a", (4,), 0), Block("b", (4,), LAST), Block("c", (4,), 0)])
    op = _move(space["b"], space["c"]) @ Clear(space["a"]) @ _move(space["a"], space["b"])
    return space, op


@pytest.mark.parametrize("bound", [False, True], ids=["apply", "bind"])
def test_one_array_for_two_blocks_in_place_is_refused_like_numpy(bound):
    _, op = aliasing_case()
    x = np.arange(1.0, 5.0)
    local = {"a": x, "c": x} if RANK == 0 else {}
    if RANK == LAST:
        local["b"] = np.zeros(4)
    with pytest.raises(StateError, match="share entries"):  # what numpy says
        op.apply({"a": x, "b": np.zeros(4), "c": x}, inplace=True)
    plan = mpi_backend.plan_for(op, comm=COMM)
    call = (lambda: plan.bind(local)) if bound else (lambda: mpi_backend.apply(op, local, inplace=True))
    message = expect_collective_error(DistributedStateError, call)
    collective_assert("rank 0" in message and "blocks 'a' and 'c' share entries" in message, message)
    collective_assert(np.array_equal(x, np.arange(1.0, 5.0)), "the refused call changed the array")


def test_one_array_for_two_blocks_out_of_place_is_fine():
    _, op = aliasing_case()
    x = np.arange(1.0, 5.0)
    state = {"a": x, "b": np.zeros(4), "c": x}
    compare_with_numpy(op, state)


@pytest.mark.parametrize(
    ("comm", "error", "phrase"),
    [
        ("world", CommunicatorArgumentError, "not str 'world'"),
        (3, CommunicatorArgumentError, "not int 3"),
        (MPI.COMM_NULL, CommunicatorError, "COMM_NULL"),
    ],
    ids=["string", "int", "comm-null"],
)
def test_a_bad_comm_argument_is_a_typed_error_on_every_rank(comm, error, phrase):
    space = Space([Block("x", (3,), 0)])
    op = Identity(space)
    local = {"x": np.zeros(3)} if RANK == 0 else {}
    message = expect_collective_error(error, lambda: op.apply_mpi(local, comm=comm))
    collective_assert(phrase in message, message)
    if error is CommunicatorArgumentError:
        collective_assert(issubclass(error, TypeError) and issubclass(error, CommunicatorError), "bases")


@pytest.mark.skipif(SIZE == 1, reason="an intercommunicator needs two groups")
def test_an_intercommunicator_is_refused_on_every_rank():
    half = COMM.Split(RANK % 2, RANK)
    inter = half.Create_intercomm(0, COMM, 1 - RANK % 2, tag=3)
    try:
        op = Identity(Space([Block("x", (3,), 0)]))
        local = {"x": np.zeros(3)} if inter.Get_rank() == 0 else {}
        message = expect_collective_error(CommunicatorError, lambda: op.apply_mpi(local, comm=inter))
        collective_assert("intercommunicator" in message, message)
    finally:
        inter.Free()
        half.Free()


def test_sum_with_a_complex_term_after_real_ones():
    space = Space(Block(f"x{w}", (3,), w) for w in range(SIZE))
    identity = Identity(space)
    for op in (Sum((identity, identity, 1j * identity)), Sum((identity, 1j * identity, identity))):
        compare_with_numpy(op, space.random(2))


CYCLES = 5000 if SIZE == 1 or os.environ.get("LINOP_LONG") == "1" else 100
"""Dup / apply / Free cycles. 5,000 is past MPICH's limit of about 2,045 live communicators,
which a leak of one duplicate per cycle hits; on one rank a cycle costs about 0.4 ms. With more
ranks each ``Dup`` is a collective (about 2 ms on a loaded two-core machine), so there the
suite counts linop's open contexts over 100 cycles, and ``LINOP_LONG=1`` runs the 5,000."""


def test_duplicated_communicators_are_freed_with_the_users():
    space = Space(Block(f"x{w}", (2,), w) for w in range(SIZE))
    op = None
    for w in range(1, SIZE):
        node = SendRecv(space["x0"], space[f"x{w}"])
        op = node if op is None else node @ op
    op = op if op is not None else 2 * Identity(space)
    state = space.random(1)
    local = local_part(space, state, RANK)
    before = open_contexts()
    started = time.perf_counter()
    for _ in range(CYCLES):
        sub = COMM.Dup()
        result = op.apply_mpi(local, comm=sub)
        sub.Free()
    seconds = time.perf_counter() - started
    if RANK == 0:
        print(f"\n{CYCLES} Dup/apply_mpi/Free cycles on {SIZE} rank(s): {seconds:.2f} s")
    collective_assert(open_contexts() == before, f"{open_contexts() - before} contexts left open")
    names = tuple(b.name for b in op.range if b.worker == RANK)
    problem = same_blocks(result, op(state), names)
    collective_assert(problem is None, str(problem))


def test_the_plan_cache_is_bounded():
    space = Space(Block(f"x{w}", (2,), w) for w in range(SIZE))
    identity = Identity(space)
    cache = context_for(COMM).plans
    first = mpi_backend.plan_for(2 * identity, comm=COMM)
    plans = [mpi_backend.plan_for((k + 3) * identity, comm=COMM) for k in range(PLAN_CACHE_SIZE + 10)]
    collective_assert(len(cache) <= PLAN_CACHE_SIZE, f"{len(cache)} plans cached")
    again = mpi_backend.plan_for((PLAN_CACHE_SIZE + 12) * identity, comm=COMM)
    collective_assert(again is plans[-1], "the most recent plan was evicted")
    collective_assert(mpi_backend.plan_for(2 * identity, comm=COMM) is not first, "the oldest plan was kept")


def pair_add():
    """b += a, with a on worker 0 and b on the last."""
    space = Space([Block("a", (3,), 0), Block("b", (3,), LAST)])
    return space, Add(space["a"], space["b"])


def test_dtypes_agree_with_numpy_bool_is_refused():
    space, op = pair_add()
    state = {"a": np.ones(3, dtype=bool), "b": np.ones(3, dtype=bool)}
    with pytest.raises(DtypeError) as numpy_error:
        op(state)
    local = local_part(space, state, RANK)
    message = expect_collective_error(DtypeError, lambda: mpi_backend.apply(op, local))
    collective_assert(str(numpy_error.value) in message and "rank 0" in message, message)
    expect_collective_error(DistributedStateError, lambda: mpi_backend.apply(op, local))


def test_dtypes_agree_with_numpy_integers_widen_instead_of_wrapping():
    _, op = pair_add()
    state = {"a": np.full(3, 200, dtype=np.uint8), "b": np.full(3, 100, dtype=np.uint8)}
    expected = op(state)
    collective_assert(int(expected["b"][0]) == 300, f"numpy gave {expected['b']}")
    compare_with_numpy(op, state)


def test_dtypes_agree_with_numpy_integer_overflow_is_a_typed_error():
    space, op = pair_add()
    big = 2**40 * (2**40 * op)
    state = {"a": np.full(3, 7, dtype=np.int64), "b": np.ones(3, dtype=np.int64)}
    with pytest.raises(IntegerOverflowError):
        big(state)
    local = local_part(space, state, RANK)
    expect_collective_error(IntegerOverflowError, lambda: mpi_backend.apply(big, local))
    expect_collective_error(MPIError, lambda: mpi_backend.apply(big, local))


def test_an_in_place_integer_result_that_does_not_fit_is_refused_on_every_rank():
    space, op = pair_add()
    state = {"a": np.full(3, 200, dtype=np.uint8), "b": np.full(3, 100, dtype=np.uint8)}
    with pytest.raises(IntegerOverflowError, match="'b'"):
        op.apply({n: a.copy() for n, a in state.items()}, inplace=True)
    local = local_part(space, state, RANK)
    message = expect_collective_error(
        IntegerOverflowError, lambda: mpi_backend.apply(op, local, inplace=True)
    )
    collective_assert(f"rank {LAST}" in message and "'b'" in message, message)
    unchanged = all(np.array_equal(local[n], state[n]) for n in local)
    collective_assert(unchanged, "a refused in-place call wrote into the caller's arrays")


@pytest.mark.skipif(SIZE < 3, reason="a sub-communicator needs a group smaller than the job")
def test_sub_communicators_are_freed_with_the_users():
    """A native all-reduce over workers 0 and 1 only creates a sub-communicator inside the
    private duplicate: freed with it."""
    layout = BlockGrid.uniform("a", Partition((2,)), (3, 2))
    op = AllReduce(layout, (0,))
    state = op.domain.random(4)
    local = local_part(op.domain, state, RANK)
    before = (open_contexts(), open_subcommunicators())
    for _ in range(100):
        sub = COMM.Dup()
        result = op.apply_mpi(local, comm=sub)
        during = open_subcommunicators()
        sub.Free()
    collective_assert(during > before[1] or RANK > 1, "the all-reduce made no sub-communicator")
    after = (open_contexts(), open_subcommunicators())
    collective_assert(after == before, f"open (contexts, sub-communicators): {before} before, {after} after")
    names = tuple(b.name for b in op.range if b.worker == RANK)
    problem = same_blocks(result, op(state), names, exact=False)
    collective_assert(problem is None, str(problem))


def test_the_subarray_datatype_cache_is_bounded_and_frees_what_it_evicts(monkeypatch):
    """Issue 22: the cache of subarray datatypes is least recently used first out, like the
    plan cache; an evicted datatype is freed once nothing else holds it."""
    from linop.backends.mpi import datatypes as mpi_datatypes

    monkeypatch.setattr(mpi_datatypes, "SUBARRAY_CACHE_SIZE", 4)
    dtype = np.dtype(np.float64)
    first = [mpi_datatypes.subarray((64,), (i,), (1,), dtype) for i in range(50, 54)]
    held = first[0]  # a schedule would hold its datatype like this
    del first
    made = [mpi_datatypes.subarray((64,), (i,), (1,), dtype) for i in range(8)]
    assert mpi_datatypes.cached_subarrays() <= 4
    assert held != MPI.DATATYPE_NULL and held.Get_size() == 8  # still referenced: not freed
    assert all(d != MPI.DATATYPE_NULL for d in made[-4:])
    again = mpi_datatypes.subarray((64,), (7,), (1,), dtype)
    assert again is made[-1]  # a hit: the same committed datatype
    del made, again
    handle = held.py2f()
    assert any(d.py2f() == handle for d in mpi_datatypes._RETIRED)  # evicted, waiting to be freed
    del held
    for i in range(8, 12):  # the next evictions free it
        mpi_datatypes.subarray((64,), (i,), (1,), dtype)
    assert not any(d.py2f() == handle for d in mpi_datatypes._RETIRED)
    space = Space(Block(f"x{w}", (8,), w) for w in range(SIZE))  # the interpreter, on a tiny cache
    op = _move(space["x0"][1:3], space[f"x{LAST}"][5:7])
    compare_with_numpy(op, {f"x{w}": np.arange(8.0) + w for w in range(SIZE)})


@pytest.mark.parametrize("bound", [False, True], ids=["apply", "bind"])
def test_in_place_into_a_stride_zero_array_is_refused_on_every_rank(bound):
    """Issue 22: a writeable view whose entries share memory (stride 0) cannot hold a result
    in place; refused like numpy, on every rank."""
    space = Space(Block(f"x{w}", (4,), w) for w in range(SIZE))
    op = _move(space["x0"][0:1], space[f"x{LAST}"][3:4])
    broadcast = np.lib.stride_tricks.as_strided(np.zeros(1), shape=(4,), strides=(0,))
    local = {f"x{RANK}": broadcast if RANK == LAST else np.arange(4.0)}
    plan = mpi_backend.plan_for(op, comm=COMM)
    call = (lambda: plan.bind(local)) if bound else (lambda: mpi_backend.apply(op, local, inplace=True))
    message = expect_collective_error(DistributedStateError, call)
    collective_assert(f"rank {LAST}" in message and "overlap in memory" in message, message)
    good = {f"x{RANK}": np.arange(4.0)}  # control: an ordinary array is fine
    mpi_backend.apply(op, good, inplace=True)
