"""The same arrays again (linop.backends.entry_check.repeat, and its one-step record
linop.backends.mpi.repeated): a checked call passing exactly what the previous passed call did
runs the check's collective and the kept run only; any change to the arrays (another object, a
shape, strides, dtype or writeability set on the same object, a collected array whose id is
reused) is a miss, and the call is then exact or fails with the typed error on every rank.
Each change has two controls: with a stale repeat (one that compares the object only), and with
a record blind to the change (the kept value shown to its comparison only), the same call gives
a wrong answer or misses the error, so the test can fail on either path."""

from __future__ import annotations

import gc
import warnings

import numpy as np
import pytest
from helpers import collective_assert, expect_collective_error, local_part, same_blocks
from mpi4py import MPI

from linop.backends import mpi as mpi_backend
from linop.backends.entry_check.repeat import Repeat
from linop.errors import DistributedStateError
from linop.halo import HaloExchange
from linop.halo_geometry import Kernel, halo_geometry
from linop.partition import DistributedTensor, Partition

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size
LAST = SIZE - 1
SHAPE = (12, 80)
GRID = (SIZE, 1)


def _halo() -> HaloExchange:
    tensor = DistributedTensor("x", SHAPE, Partition(GRID))
    return HaloExchange(halo_geometry(tensor, Kernel(3, padding=1)))


def _stale_same(self: Repeat, state, inplace) -> bool:
    """A stale repeat: the same object under the same name, its properties not compared."""
    return type(state) is dict and len(state) == 1 and state.get(self.name) is self.ref()


def _set(array: np.ndarray, change: str, value) -> None:
    """Set the property ``change`` of ``array`` (the same object) to ``value``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # setting strides: deprecated in numpy 2.4
        if change == "read-only":
            array.flags.writeable = value
        else:
            setattr(array, change, value)


def _get(array: np.ndarray, change: str):
    return array.flags.writeable if change == "read-only" else getattr(array, change)


def _blind_record(monkeypatch, op, change: str, kept) -> None:
    """The control of the record's own comparison: the plan's one-step call sees the kept value
    of ``change`` (set back on the array for the call, then changed again), so it runs the kept
    binding as if nothing had changed."""
    plan = mpi_backend.plan_for(op, comm=COMM)
    original = plan.fast
    if original is None:  # no record: nothing to blind (the caller asserts one on 2+ ranks)
        return

    def blind(state, inplace):
        array = state.get(plan.fast_record.repeat.name)
        now = _get(array, change)
        _set(array, change, kept)
        try:
            return original(state, inplace)
        finally:
            _set(array, change, now)

    monkeypatch.setattr(plan, "fast", blind)


def _record_ready(op, comm=COMM) -> bool:
    """The plan's one-step record is in place for the entry check's kept repeat (so the next
    call on the same arrays goes through it)."""
    plan = mpi_backend.plan_for(op, comm=comm)
    return plan.fast is not None and plan.fast_record.repeat is plan.entry.last


def _hits(op) -> int:
    last = mpi_backend.plan_for(op, comm=COMM).entry.last
    return -1 if last is None else last.hits


@pytest.mark.parametrize("inplace", [True, False], ids=["in-place", "out-of-place"])
def test_the_same_arrays_again_hit_and_stay_exact(inplace):
    op = _halo()
    op = op.H if inplace else op  # the adjoint adds: a repeat run twice on stale data would show
    state = op.domain.random(21)
    local = local_part(op.domain, state, RANK)
    problem = None
    for call in range(4):
        expected = op(state)
        result = mpi_backend.apply(op, local, comm=COMM, inplace=inplace)
        problem = problem or same_blocks(result, expected, tuple(local), exact=True)
        state = expected
        if inplace:
            problem = problem or (None if result is local else f"call {call}: not the caller's dict")
        else:
            local = {n: np.array(result[n]) for n in result}
    collective_assert(problem is None, str(problem))
    if inplace:  # the same arrays in a new dict: still the same arrays
        result = mpi_backend.apply(op, dict(local), comm=COMM, inplace=True)
        problem = same_blocks(result, op(state), tuple(local), exact=True)
        collective_assert(problem is None, str(problem))
        collective_assert(_hits(op) >= 3, f"the repeat served {_hits(op)} of 4 repeated calls")
    else:
        collective_assert(_hits(op) == -1 or _hits(op) == 0, "out-of-place results are new arrays: no hit")
        again = {n: np.array(a) for n, a in local.items()}
        for _ in range(3):
            result = mpi_backend.apply(op, again, comm=COMM)
        problem = same_blocks(result, op(state), tuple(again), exact=True)
        collective_assert(problem is None and _hits(op) >= 2, f"{problem}, hits {_hits(op)}")


def _warm(op, local) -> None:
    for _ in range(3):
        mpi_backend.apply(op, local, comm=COMM, inplace=True)


CONTROLS = [None, "stale-repeat", "blind-record"]


@pytest.mark.parametrize("control", CONTROLS, ids=["repeat", "control-stale", "control-blind-record"])
@pytest.mark.parametrize("change", ["read-only", "shape"])
def test_a_changed_array_object_fails_on_every_rank(change, control, monkeypatch):
    """The last rank's array, the same object, made read-only or reshaped: every rank raises
    DistributedStateError and nothing is written. Controls: a stale repeat, or a record blind
    to the change, runs the kept binding (no error, the array written)."""
    op = _halo()
    local = local_part(op.domain, op.domain.random(22), RANK)
    _warm(op, local)
    collective_assert(SIZE == 1 or _record_ready(op), "no record for the repeated call")
    (name,) = local
    array = local[name]
    array[...] = np.random.default_rng(RANK).standard_normal(array.shape)  # new halos to receive
    kept = _get(array, change)
    if RANK == LAST:
        _set(array, change, False if change == "read-only" else (array.shape[1], array.shape[0]))
    before = array.copy()
    if control is not None:
        if control == "stale-repeat":
            monkeypatch.setattr(Repeat, "same", _stale_same)
        else:
            _blind_record(monkeypatch, op, change, kept)
        mpi_backend.apply(op, local, comm=COMM, inplace=True)  # no error: the control
        written = not np.array_equal(array, before)
        collective_assert(SIZE == 1 or COMM.allreduce(written, op=MPI.LOR), "the stale run wrote nothing")
        return
    message = expect_collective_error(
        DistributedStateError, lambda: mpi_backend.apply(op, local, comm=COMM, inplace=True)
    )
    collective_assert(("writeable" if change == "read-only" else "shape") in message, message)
    collective_assert(np.array_equal(array, before), "a refused call wrote into the caller's array")


@pytest.mark.parametrize("control", CONTROLS, ids=["repeat", "control-stale", "control-blind-record"])
def test_a_dtype_set_on_the_same_object_is_a_miss(control, monkeypatch):
    """Every rank's float64 array reinterpreted as int64 (``a.dtype = ...``: same object, shape
    and strides), refilled with integers of both signs: the adjoint (which adds) equals numpy's
    in int64. Controls: a stale repeat, or a record blind to the dtype, adds the integers' bits
    as float64 (a NaN for a negative one), which differs."""
    op = _halo().H
    local = local_part(op.domain, op.domain.random(23), RANK)
    _warm(op, local)
    collective_assert(SIZE == 1 or _record_ready(op), "no record for the repeated call")
    (name,) = local
    array = local[name]
    kept = array.dtype
    array.dtype = np.int64
    integers = {
        b.name: np.random.default_rng(b.worker).integers(-5, 6, b.shape).astype(np.int64) for b in op.domain
    }
    array[...] = integers[name]
    expected = op(integers)
    if control == "stale-repeat":
        monkeypatch.setattr(Repeat, "same", _stale_same)
    elif control == "blind-record":
        _blind_record(monkeypatch, op, "dtype", kept)
    result = mpi_backend.apply(op, local, comm=COMM, inplace=True)
    exact = bool(np.array_equal(result[name].view(np.int64), expected[name]))
    everywhere = bool(COMM.allreduce(exact, op=MPI.LAND))
    if control is not None:
        collective_assert(SIZE == 1 or not everywhere, "the stale repeat gave numpy's answer")
    else:
        collective_assert(everywhere and array.dtype == np.int64, "not numpy's int64 result")


@pytest.mark.parametrize("control", [None, "blind-record"], ids=["repeat", "control-blind-record"])
def test_strides_set_on_the_same_object_are_a_miss(control, monkeypatch):
    """The last rank's array, the same object and shape, given the strides of Fortran order
    (the same memory read in another order: no longer C-contiguous, which the record tests in
    place of the strides): every rank's result equals numpy's on the values as the array now
    reads them. Control: a record blind to the strides moves the kept C-ordered rows, which
    differ (the stale repeat compares strides exactly: the test above covers its path)."""
    op = _halo()
    state = op.domain.random(27)
    local = local_part(op.domain, state, RANK)
    _warm(op, local)
    for _ in range(3):
        state = op(state)
    collective_assert(SIZE == 1 or _record_ready(op), "no record for the repeated call")
    (name,) = local
    array = local[name]
    kept = array.strides
    if RANK == LAST:
        _set(array, "strides", (array.itemsize, array.itemsize * array.shape[0]))
    now = {b.name: np.array(state[b.name]) for b in op.domain}
    for block in op.domain:  # every rank's block as its rank's array now reads it
        if block.worker == LAST:
            memory = np.ascontiguousarray(state[block.name]).ravel()
            now[block.name] = memory.reshape(block.shape, order="F")
    if control is not None:
        _blind_record(monkeypatch, op, "strides", kept)
    result = mpi_backend.apply(op, local, comm=COMM, inplace=True)
    problem = same_blocks(result, op(now), (name,), exact=True)
    everywhere = not COMM.allreduce(problem is not None, op=MPI.LOR)
    if control is not None:
        collective_assert(SIZE == 1 or not everywhere, "the blind record gave numpy's answer")
    else:
        collective_assert(everywhere, str(problem))


def test_a_collected_array_is_never_taken_for_a_new_one():
    """The array is dropped and a new one made (often at the same id): the repeat's weak
    reference is dead, so the call checks afresh and is exact."""
    op = _halo().H
    state = op.domain.random(24)
    local = local_part(op.domain, state, RANK)
    _warm(op, local)
    (name,) = local
    old = id(local[name])
    before = _hits(op)
    del local[name]
    gc.collect()
    local[name] = np.array(state[name])
    result = mpi_backend.apply(op, local, comm=COMM, inplace=True)
    problem = same_blocks(result, op(state), (name,), exact=True)
    collective_assert(problem is None, f"{problem} (same id reused: {id(local[name]) == old})")
    collective_assert(_hits(op) <= before or _hits(op) == 0, "a new array was taken for the collected one")


def test_none_for_a_collected_array_is_the_typed_error_on_every_rank():
    """The kept array is collected and the call passes None for it: the record's identity test
    (a dead reference gives None too) must not take None for the array; the call is checked the
    general way and every rank gets the typed error naming the block."""
    op = _halo().H
    state = op.domain.random(25)
    local = local_part(op.domain, state, RANK)
    _warm(op, local)
    (name,) = local
    del local[name]
    gc.collect()
    local[name] = None if RANK == LAST else np.array(state[name])
    message = expect_collective_error(
        DistributedStateError, lambda: mpi_backend.apply(op, local, comm=COMM, inplace=True)
    )
    collective_assert("NoneType" in message and name.split("[")[0] in message, message)


def test_another_rank_changing_its_dtype_is_found_by_a_rank_that_repeats():
    """Rank 0 passes the same arrays again, the last rank a float32 array in the same dict:
    rank 0's repeat matches locally, the reduced vector does not, and every rank runs the
    agreed float64 run with numpy's results."""
    op = _halo()
    state = op.domain.random(25)
    local = local_part(op.domain, state, RANK)
    _warm(op, local)
    for _ in range(3):
        state = op(state)
    (name,) = local
    if RANK == LAST and SIZE > 1:
        local[name] = local[name].astype(np.float32)
    last = SIZE > 1 and {b.name for b in op.domain if b.worker == LAST}
    mixed = {n: a.astype(np.float32) if last and n in last else a.copy() for n, a in state.items()}
    result = mpi_backend.apply(op, local, comm=COMM, inplace=True)
    expected = op.apply(mixed, inplace=True)
    problem = same_blocks(result, expected, (name,), exact=True)
    collective_assert(problem is None, str(problem))


def test_numpy_refuses_to_resize_a_kept_array():
    """What the repeat relies on for the memory under an unchanged object: ``a.resize`` (which
    may move it) is refused while the repeat's weak reference exists (``refcheck=False``
    excepted, which numpy documents as unsafe)."""
    op = _halo()
    local = local_part(op.domain, op.domain.random(26), RANK)
    _warm(op, local)
    (name,) = local
    try:
        local[name].resize((local[name].size + 8,))
    except ValueError:
        refused = True
    else:
        refused = False
    collective_assert(refused, "numpy resized an array the repeat holds a weak reference to")


def test_the_record_follows_the_plans_deadline_and_waits_without_one():
    """The record takes the plan's deadline as it is when built: set to none (``"off"``), the
    repeated calls wait for the check (``Wait``) and stay exact; set to 30 s, the next call
    goes the general way and the record is built again with it."""
    op = _halo().H
    state = op.domain.random(28)
    local = local_part(op.domain, state, RANK)
    plan = mpi_backend.plan_for(op, comm=COMM)
    problem = None
    try:
        for timeout, seconds in (("off", None), (30.0, 30.0)):
            plan.timeout = timeout
            for _ in range(4):
                state = op(state)
                mpi_backend.apply(op, local, comm=COMM, inplace=True)
                problem = problem or same_blocks(local, state, tuple(local), exact=True)
            collective_assert(
                SIZE == 1 or (_record_ready(op) and plan.fast_record.seconds == seconds), f"{timeout}"
            )
    finally:
        plan.timeout = None
    collective_assert(problem is None, str(problem))


def test_a_freed_communicator_after_repeated_calls_is_a_typed_error():
    """Repeated calls on a duplicate of the communicator, which the caller then frees: the next
    call (the record at hand) raises CommunicatorError on every rank, through apply and through
    the plan, instead of starting the freed check's reduction."""
    from linop.errors import CommunicatorError

    op = _halo()
    local = local_part(op.domain, op.domain.random(29), RANK)
    comm = COMM.Dup()
    plan = mpi_backend.plan_for(op, comm=comm)
    for _ in range(3):
        mpi_backend.apply(op, local, comm=comm, inplace=True)
    ready = _record_ready(op, comm)
    comm.Free()
    message = expect_collective_error(
        CommunicatorError, lambda: mpi_backend.apply(op, local, comm=comm, inplace=True)
    )
    again = expect_collective_error(CommunicatorError, lambda: plan.apply(local, inplace=True))
    collective_assert(SIZE == 1 or ready, "no record for the repeated call")
    collective_assert("COMM_NULL" in message and "freed" in again, f"{message} / {again}")
    # what can never answer again is let go: the record, and apply's hold on the plan
    held = [entry for entry in (mpi_backend._LAST_PLAN, mpi_backend._PREVIOUS_PLAN) if entry is not None]
    collective_assert(plan.fast is None and plan.fast_record is None, "the freed plan kept its record")
    collective_assert(all(entry[2] is not plan for entry in held), "apply still holds the freed plan")


def test_a_record_outliving_the_kept_repeat_serves_its_array_and_goes_with_it():
    """Two arrays in turn after the first twice (the adjoint adds: a run on stale data would
    show): every call is exact, including those the record of one array answers while the
    entry check keeps the other's repeat; once the record's array is collected the plan lets
    the record go."""
    op = _halo().H
    start = op.domain.random(31)
    a = local_part(op.domain, start, RANK)
    b = {n: v.copy() for n, v in a.items()}
    (name,) = a
    plan = mpi_backend.plan_for(op, comm=COMM)
    expected = {id(a): start, id(b): start}
    problem, served = None, False
    for local in (a, a, b, a, b, a, b):
        record = plan.fast_record
        outliving = record is not None and record.repeat is not plan.entry.last
        hits = record.repeat.hits if record is not None else 0
        mpi_backend.apply(op, local, comm=COMM, inplace=True)
        served = served or (outliving and record.repeat.hits > hits)
        expected[id(local)] = op(expected[id(local)])
        problem = problem or same_blocks(local, expected[id(local)], (name,), exact=True)
    collective_assert(problem is None, str(problem))
    collective_assert(served, "no call was answered by a record outliving the kept repeat")
    mpi_backend.apply(op, a, comm=COMM, inplace=True)  # the record: a's again
    kept = plan.fast_record is not None and plan.fast_record.repeat.ref() is a[name]
    del a[name]
    gc.collect()
    collective_assert(kept and plan.fast is None and plan.fast_record is None, f"record kept: {kept}")
