"""The same arrays again (linop.backends.entry_check.repeat): a checked call passing exactly what the
previous passed call did runs the check's collective and the kept run only; any change to the
arrays (another object, a shape, dtype or writeability set on the same object, a collected
array whose id is reused) is a miss, and the call is then exact or fails with the typed error
on every rank. Each change has a control: with a stale repeat (one that compares the object
only) the same call gives a wrong answer or misses the error, so the test can fail."""

from __future__ import annotations

import gc

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


@pytest.mark.parametrize("stale", [False, True], ids=["repeat", "control-stale"])
@pytest.mark.parametrize("change", ["read-only", "shape"])
def test_a_changed_array_object_fails_on_every_rank(change, stale, monkeypatch):
    """The last rank's array, the same object, made read-only or reshaped: every rank raises
    DistributedStateError and nothing is written. Control: a stale repeat runs the kept
    binding (no error, the array written)."""
    op = _halo()
    local = local_part(op.domain, op.domain.random(22), RANK)
    _warm(op, local)
    (name,) = local
    array = local[name]
    array[...] = np.random.default_rng(RANK).standard_normal(array.shape)  # new halos to receive
    if RANK == LAST:
        if change == "read-only":
            array.flags.writeable = False
        else:
            array.shape = (array.shape[1], array.shape[0])
    before = array.copy()
    if stale:
        monkeypatch.setattr(Repeat, "same", _stale_same)
        mpi_backend.apply(op, local, comm=COMM, inplace=True)  # no error: the control
        written = not np.array_equal(array, before)
        collective_assert(SIZE == 1 or COMM.allreduce(written, op=MPI.LOR), "the stale run wrote nothing")
        return
    message = expect_collective_error(
        DistributedStateError, lambda: mpi_backend.apply(op, local, comm=COMM, inplace=True)
    )
    collective_assert(("writeable" if change == "read-only" else "shape") in message, message)
    collective_assert(np.array_equal(array, before), "a refused call wrote into the caller's array")


@pytest.mark.parametrize("stale", [False, True], ids=["repeat", "control-stale"])
def test_a_dtype_set_on_the_same_object_is_a_miss(stale, monkeypatch):
    """Every rank's float64 array reinterpreted as int64 (``a.dtype = ...``: same object, shape
    and strides), refilled with integers of both signs: the adjoint (which adds) equals numpy's
    in int64. Control: a stale repeat adds the integers' bits as float64 (a NaN for a negative
    one), which differs."""
    op = _halo().H
    local = local_part(op.domain, op.domain.random(23), RANK)
    _warm(op, local)
    (name,) = local
    array = local[name]
    array.dtype = np.int64
    integers = {
        b.name: np.random.default_rng(b.worker).integers(-5, 6, b.shape).astype(np.int64) for b in op.domain
    }
    array[...] = integers[name]
    expected = op(integers)
    if stale:
        monkeypatch.setattr(Repeat, "same", _stale_same)
    result = mpi_backend.apply(op, local, comm=COMM, inplace=True)
    exact = bool(np.array_equal(result[name].view(np.int64), expected[name]))
    everywhere = bool(COMM.allreduce(exact, op=MPI.LAND))
    if stale:
        collective_assert(SIZE == 1 or not everywhere, "the stale repeat gave numpy's answer")
    else:
        collective_assert(everywhere and array.dtype == np.int64, "not numpy's int64 result")


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
