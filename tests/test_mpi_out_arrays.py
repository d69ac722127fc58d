"""linop.backends.mpi.out_arrays without MPI: the local checks of ``bind(..., out=)`` and which
given arrays a compiled run may write straight."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from linop.backends.mpi.compiled import CompiledRun
from linop.backends.mpi.out_arrays import check_out, dtype_problem, straight
from linop.errors import OverlapError


def plan_of(*names: str) -> SimpleNamespace:
    """What check_out reads of a plan: rank 3 of a job, range blocks ``names`` of 4 entries."""
    block = SimpleNamespace(shape=(4,))
    return SimpleNamespace(
        comm=SimpleNamespace(Get_rank=lambda: 3),
        range_names=names,
        op=SimpleNamespace(range=SimpleNamespace(block=lambda name: block)),
    )


def test_two_out_arrays_on_the_same_memory_are_refused():
    memory = np.zeros(6)
    with pytest.raises(OverlapError, match=r"rank 3: .*block 'b'.*the out array of block 'a'"):
        check_out(plan_of("a", "b"), {"a": memory[:4], "b": memory[2:]}, {}, inplace=False)
    apart = np.zeros(8)
    first, second = apart[:4], apart[4:]
    given = check_out(plan_of("a", "b"), {"a": first, "b": second}, {}, inplace=False)
    assert set(given) == {"a", "b"} and given["a"] is first and given["b"] is second


def test_a_wrong_dtype_names_the_rank_and_the_blocks():
    out = {"a": np.zeros(4, np.float32), "b": np.zeros(4)}
    problem = dtype_problem(out, np.dtype(np.float64), 3)
    assert (
        problem is not None and "rank 3" in problem and "'a': 'float32'" in problem and "'b'" not in problem
    )
    assert dtype_problem(out, np.dtype(np.float32), 3) is not None
    assert dtype_problem({"b": out["b"]}, np.dtype(np.float64), 3) is None


def test_only_a_taken_array_that_ends_as_its_block_alone_goes_straight():
    """A taken array is straight when it is its block's result at the end and no other
    block's; one replaced later, or shared with another result, is copied into instead."""
    kept, replaced, shared = np.zeros(4), np.zeros(4), np.zeros(4)
    run = CompiledRun(outputs={"a": kept, "b": np.ones(4), "c": shared, "d": shared[:2]})
    found = straight(run, {"a": kept, "b": replaced, "c": shared})
    assert set(found) == {"a"} and found["a"] is kept
