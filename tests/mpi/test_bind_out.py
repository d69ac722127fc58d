"""``bind(..., out=)``: a bound plan's results in the caller's arrays (linop.backends.mpi.out_arrays)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import collective_assert, local_part, same_blocks
from mpi4py import MPI

from linop import halo_windows
from linop.backends import mpi as mpi_backend
from linop.collectives import Broadcast
from linop.errors import (
    DistributedDtypeError,
    DistributedStateError,
    OverlapError,
    ShapeMismatchError,
    StateError,
    UnknownBlockError,
)
from linop.halo import HaloExchange
from linop.halo_geometry import Kernel, halo_geometry
from linop.partition import DistributedTensor, Partition
from linop.repartition import Repartition

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size


def broadcast(entries: int) -> Broadcast:
    return Broadcast(DistributedTensor("s", (entries,), Partition((1,))), Partition((SIZE,)), "c")


def trees() -> list:
    """A broadcast and its sum-reduces (persistent ``Allreduce_init``, and 8192 entries: the
    messages of :mod:`~linop.backends.mpi.native.reduce_messages`), straight into ``out``; halo
    windows (the compiler's buffers) and a repartition (an all-to-all), copied into it."""
    tensor = DistributedTensor("x", (12, 10), Partition((SIZE, 1)))
    return [
        broadcast(6),
        broadcast(6).H,
        broadcast(8192).H,
        halo_windows(tensor, Kernel(3, padding=1)),
        Repartition(tensor, DistributedTensor("z", (12, 10), Partition((1, SIZE)))),
    ]


def straight_expected(case: int) -> set[str]:
    """The blocks of this rank a collective writes whole: a non-root's copy of the broadcast,
    the root's sum of the sum-reduces (see trees())."""
    if SIZE == 1 or case > 2:
        return set()
    if case == 0:
        return {f"c[{RANK}]"} if RANK else set()
    return {"s[0]"} if RANK == 0 else set()


RUNS = [(case, "compiled") for case in range(5)] + [(0, "not persistent"), (3, "integers")]
"""(tree, way): compiled, or each call the ordinary run (``persistent=False``; integer blocks,
checked on every call), whose results are copied into ``out`` whatever the tree."""


@pytest.mark.parametrize(("case", "how"), RUNS)
def test_results_land_in_the_callers_arrays(case, how):
    """Two calls (the bound arrays refilled between them) give the tree's results exactly, in
    the very arrays given and returned as the blocks; a collective's result goes there straight
    (no copy after it) where one writes the block whole."""
    op = trees()[case]
    dtype = np.int64 if how == "integers" else np.float64
    names = tuple(b.name for b in op.range if b.worker == RANK)
    out = {name: np.full(op.range.block(name).shape, -7, dtype=dtype) for name in names}
    given = dict(out)
    state = {k: v.astype(dtype) for k, v in op.domain.random(case, dtype=np.int64).items()}
    bound = mpi_backend.plan_for(op, comm=COMM).bind(
        local_part(op.domain, state, RANK), inplace=False, out=out, persistent=how != "not persistent"
    )
    problem = None
    for values in (state, {k: 2 * v + 1 for k, v in state.items()}):
        for name, array in bound.arrays.items():
            array[...] = values[name]
        result = bound()
        problem = problem or same_blocks(result, op(values), names)
        problem = problem or same_blocks(given, op(values), names)
        wrong = [name for name in names if result[name] is not given[name]]
        problem = problem or (f"blocks {wrong} not returned in their out arrays" if wrong else None)
    expected = straight_expected(case) if how == "compiled" else set()
    if problem is None and set(bound.straight) != expected:
        problem = f"straight into out: {sorted(bound.straight)}, expected {sorted(expected)}"
    bound.free()
    collective_assert(problem is None, f"{op} ({how}): {problem}")


def test_wrong_out_arrays_raise_typed_errors():
    """A wrong argument is found on its rank before the check and raised on every rank with
    the binding's agreement: a block not in this rank's range, another shape, a strided or
    read-only array, memory shared with a bound array, and any out in place (its own error on
    the rank, DistributedStateError naming it on the others); a wrong dtype on one rank
    raises on every rank after the check."""
    op = broadcast(6)
    local = {"s[0]": np.arange(6.0)} if RANK == 0 else {}
    plan = mpi_backend.plan_for(op, comm=COMM)
    mine = f"c[{RANK}]"
    read_only = np.zeros(6)
    read_only.flags.writeable = False
    wide = np.zeros(12)
    cases = [
        ({"nowhere": np.zeros(6)}, UnknownBlockError),
        ({mine: np.zeros(5)}, ShapeMismatchError),
        ({mine: wide[::2]}, StateError),
        ({mine: read_only}, StateError),
        ({mine: [0.0] * 6}, StateError),
    ]
    # one rank alone refuses (rank 0's out shares its source's memory; the last rank's has
    # another shape): its own error there, the others' names it
    good = {mine: np.zeros(6)}
    cases.append(
        ({mine: local["s[0]"]} if RANK == 0 else good, OverlapError if RANK == 0 else DistributedStateError)
    )
    last = SIZE - 1
    cases.append(
        (
            {mine: np.zeros(5)} if RANK == last else good,
            ShapeMismatchError if RANK == last else DistributedStateError,
        )
    )
    problems = []
    for out, error in cases:
        with pytest.raises(error) as raised:
            plan.bind(local, inplace=False, out=out)
        if str(RANK) not in str(raised.value):
            problems.append(f"{error.__name__} names no rank: {raised.value}")
    problems += (
        []
        if SIZE == 1 or RANK == last or f"rank {last} refused" in str(raised.value)
        else [f"rank {RANK}: the peers' error names not rank {last}: {raised.value}"]
    )
    exchange = HaloExchange(
        halo_geometry(DistributedTensor("x", (8, 4), Partition((SIZE, 1))), Kernel(3, padding=1))
    )
    block = exchange.range.block(f"x_local[{RANK},0]")
    with pytest.raises(StateError):  # in place: the results are the bound arrays themselves
        mpi_backend.plan_for(exchange, comm=COMM).bind(
            local_part(exchange.domain, exchange.domain.random(1), RANK),
            inplace=True,
            out={block.name: np.zeros(block.shape)},
        )
    wrong_dtype = {mine: np.zeros(6, dtype=np.float32 if RANK == SIZE - 1 else np.float64)}
    with pytest.raises(DistributedDtypeError) as raised:
        plan.bind(local, inplace=False, out=wrong_dtype)
    if f"rank {SIZE - 1}" not in str(raised.value):
        problems.append(f"the dtype error names not rank {SIZE - 1}: {raised.value}")
    collective_assert(not problems, "; ".join(problems))
