"""Every mistake ends every rank with the same typed error, before any data moves."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import Opaque, collective_assert, compare_with_numpy, expect_collective_error, local_part
from mpi4py import MPI

from linop import Block, SendRecv, Space
from linop.backends import mpi as mpi_backend
from linop.errors import (
    CommunicatorError,
    DistributedStateError,
    LinopError,
    MPIError,
    TreeMismatchError,
    UnsupportedNodeError,
)

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size
LAST = SIZE - 1


def pair_space(shape=(4, 3)) -> Space:
    return Space([Block("x", shape, 0), Block("y", shape, LAST)])


def pair_copy(space: Space, row: int = 0):
    from linop import Copy

    src, dst = space["x"][row : row + 1, :], space["y"][1:2, :]
    return SendRecv(src, dst) if LAST else Copy(src, dst)


def still_works() -> None:
    """After an error, a correct call succeeds (no stray messages left behind)."""
    space = pair_space()
    compare_with_numpy(pair_copy(space), space.random(11, dtype=np.int64))


@pytest.mark.skipif(SIZE == 1, reason="one rank cannot disagree with itself")
def test_mismatched_trees():
    space = pair_space()
    op = pair_copy(space, row=0 if RANK == 0 else 2)
    local = local_part(space, space.random(0), RANK)
    message = expect_collective_error(TreeMismatchError, lambda: mpi_backend.apply(op, local))
    collective_assert("rank(s) [1" in message, message)
    still_works()


@pytest.mark.skipif(SIZE == 1, reason="one rank cannot disagree with itself")
def test_trees_equal_but_for_a_blocks_worker():
    """Rank 0 places y on the last worker, the others on worker 0: the same boxes, but rank 0
    would send a message that no rank receives."""
    from linop import Copy

    space = Space([Block("x", (4, 3), 0), Block("y", (4, 3), LAST if RANK == 0 else 0)])
    op = Copy(space["x"][0:1, :], space["y"][1:2, :])
    local = local_part(space, space.random(0), RANK)
    message = expect_collective_error(TreeMismatchError, lambda: mpi_backend.apply(op, local))
    collective_assert("rank(s) [1" in message, message)
    still_works()


def test_too_few_ranks():
    space = Space([Block("x", (2,), 0), Block("y", (2,), SIZE)])
    op = SendRecv(space["x"], space["y"])
    local = local_part(space, space.random(0), RANK)
    message = expect_collective_error(CommunicatorError, lambda: mpi_backend.apply(op, local))
    collective_assert(f"worker {SIZE}" in message and f"{SIZE} rank(s)" in message, message)
    still_works()


def _bad(kind: str, local: dict, space: Space) -> dict:
    local = dict(local)
    if kind == "missing":
        local.pop("y")
    elif kind == "misspelt":
        local["yy"] = local.pop("y")
    elif kind == "extra":
        local["x"] = np.zeros(space.block("x").shape)
    elif kind == "shape":
        local["y"] = np.zeros((2, 2))
    elif kind == "dtype":
        local["y"] = local["y"].astype(object)
    elif kind == "not-an-array":
        local["y"] = local["y"].tolist()
    return local


@pytest.mark.parametrize(
    ("kind", "phrase"),
    [
        ("missing", "missing block 'y'"),
        ("misspelt", "missing block 'y' (4, 3); it holds 'yy', which the domain lacks: did you mean 'y'?"),
        ("extra", "holds block 'x'"),
        ("shape", "has shape (2, 2)"),
        ("dtype", "not numeric"),
        ("not-an-array", "not a numpy array"),
    ],
)
def test_one_rank_with_wrong_blocks(kind, phrase):
    space = pair_space()
    op = pair_copy(space)
    local = local_part(space, space.random(0), RANK)
    if RANK == LAST:
        if kind == "extra" and LAST == 0:
            local["z"] = np.zeros(3)
            phrase = "holds block 'z'"
        else:
            local = _bad(kind, local, space)
    message = expect_collective_error(DistributedStateError, lambda: mpi_backend.apply(op, local))
    collective_assert(f"rank {LAST}" in message and phrase in message, message)
    still_works()


def test_readonly_array_in_place():
    space = pair_space()
    op = pair_copy(space)
    local = local_part(space, space.random(0), RANK)
    if RANK == LAST:
        local["y"].flags.writeable = False
    message = expect_collective_error(
        DistributedStateError, lambda: mpi_backend.apply(op, local, inplace=True)
    )
    collective_assert("writeable" in message, message)


def test_unsupported_node():
    space = pair_space()
    op = pair_copy(space) @ Opaque(space)
    local = local_part(space, space.random(0), RANK)
    message = expect_collective_error(UnsupportedNodeError, lambda: mpi_backend.apply(op, local))
    collective_assert("Opaque" in message, message)
    still_works()


def test_errors_are_linop_errors():
    for error in (TreeMismatchError, CommunicatorError, DistributedStateError):
        assert issubclass(error, MPIError)
    assert issubclass(UnsupportedNodeError, LinopError)


def test_in_place_result_too_wide_for_the_callers_arrays():
    space = pair_space()
    op = 1j * pair_copy(space)
    local = local_part(space, space.random(0), RANK)
    message = expect_collective_error(
        DistributedStateError, lambda: mpi_backend.apply(op, local, inplace=True)
    )
    collective_assert("complex128" in message and "float64" in message, message)
    still_works()


def test_one_rank_asking_for_a_dtype_that_is_none():
    """An argument numpy rejects on one rank only is found by the collective check (raising
    it there alone would leave the other ranks waiting)."""
    space = pair_space()
    op = pair_copy(space)
    local = local_part(space, space.random(0), RANK)
    dtype = "no-such-dtype" if RANK == LAST else None
    message = expect_collective_error(
        DistributedStateError, lambda: mpi_backend.apply(op, local, dtype=dtype)
    )
    collective_assert(f"rank {LAST}" in message and "no-such-dtype" in message, message)
    still_works()
