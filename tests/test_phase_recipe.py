"""The one recipe of a phase (linop.backends.host_phase; MPI's rule in linop.backends.mpi.phase_recipe,
torch.distributed's contiguous rule): how each message moves, decided once for MPI's runtime, its
checked in-place path and its bound plan, and for torch.distributed's host path. Single process:
the recipe is read from the rank schedules, no message is sent."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("mpi4py")

from linop import Block, SendRecv, Space
from linop.backends.host_phase import BUFFER, STRIDED, VIEW
from linop.backends.mpi.phase_recipe import phase_recipe
from linop.program import RankPhase, compile_for_rank

SHAPE = (4, 200)  # a row of float64 is 1600 bytes: a 100-column strip runs 800 bytes, a column 8
SPACE = Space([Block("a", SHAPE, 0), Block("b", SHAPE, 1)])
A, B = SPACE["a"], SPACE["b"]


def recipes(op, rank, arrays, dtype=np.float64):
    """The recipe of every phase of ``rank``'s schedule, on ``arrays``."""
    schedule = compile_for_rank(op, rank).schedule
    found = [
        phase_recipe(step, np.dtype(dtype), target=arrays.__getitem__, source=arrays.__getitem__)
        for step in schedule
        if type(step) is RankPhase
    ]
    assert found, f"rank {rank} has no phase in {op}"
    return found


def routes(op, rank, dtype=np.float64, block_dtype=np.float64):
    name = "a" if rank == 0 else "b"
    arrays = {name: np.zeros(SHAPE, dtype=block_dtype)}
    found = recipes(op, rank, arrays, dtype)
    return [m.route for r in found for m in r.receives], [m.route for r in found for m in r.sends]


@pytest.mark.parametrize(
    "source, target, route",
    [
        (A[0:1, :], B[3:4, :], VIEW),  # a whole row: contiguous
        (A[:, 0:100], B[:, 100:200], STRIDED),  # runs of 800 bytes: a subarray datatype
        (A[:, 0:1], B[:, 199:200], BUFFER),  # runs of 8 bytes: packed
    ],
    ids=["row", "wide-strip", "column"],
)
def test_a_store_moves_straight_where_its_box_can_be_named(source, target, route):
    op = SendRecv(source, target)
    assert routes(op, 0) == ([], [route])
    assert routes(op, 1) == ([route], [])


def test_an_add_always_lands_in_a_buffer():
    op = SendRecv(A[0:1, :], B[3:4, :]).H  # the adjoint: b's row added into a's, b's cleared
    receives, sends = routes(op, 0)
    assert receives == [BUFFER] and sends == []
    (recipe,) = recipes(op, 1, {"b": np.zeros(SHAPE)})
    assert [m.route for m in recipe.sends] == [VIEW]
    assert recipe.clears == (("b", recipe.sends[0].box),)


def test_a_block_of_another_dtype_moves_through_a_buffer():
    op = SendRecv(A[0:1, :], B[3:4, :])
    assert routes(op, 0, dtype=np.float64, block_dtype=np.float32) == ([], [BUFFER])
    assert routes(op, 1, dtype=np.float64, block_dtype=np.float32) == ([BUFFER], [])


def test_a_new_block_is_received_into_a_buffer():
    op = SendRecv(A, Block("c", SHAPE, 1))  # a new block c on worker 1
    (recipe,) = recipes(op, 1, {"b": np.zeros(SHAPE)})
    assert [(m.name, m.route) for m in recipe.receives] == [("c", BUFFER)]


def test_an_empty_box_moves_nothing():
    op = SendRecv(A[0:0, :], B[0:0, :]) @ SendRecv(A[0:1, :], B[3:4, :])
    schedule = compile_for_rank(op, 0).schedule
    phases = [step for step in schedule if type(step) is RankPhase]
    assert sum(len(p.sends) for p in phases) == 2  # both transfers are in the schedule
    assert routes(op, 0) == ([], [VIEW])  # only the non-empty one moves


@pytest.mark.parametrize(
    "source, target, route",
    [
        (A[0:1, :], B[3:4, :], VIEW),  # a whole row: contiguous
        (A[:, 0:100], B[:, 100:200], BUFFER),  # strided: torch names no subarray, it packs
        (A[:, 0:1], B[:, 199:200], BUFFER),
    ],
    ids=["row", "wide-strip", "column"],
)
def test_the_torch_rule_moves_contiguous_writeable_boxes_only(source, target, route):
    """The host kit's recipe under torch.distributed's rule (linop.backends.host_phase): the same
    recipe as MPI's but for its rule, which names contiguous writeable boxes only (a read-only
    source is packed: torch shares no read-only memory)."""
    from linop.backends.host_phase import contiguous_route
    from linop.backends.host_phase import phase_recipe as host_recipe

    op = SendRecv(source, target)
    for rank, name in ((0, "a"), (1, "b")):
        arrays = {name: np.zeros(SHAPE)}
        (recipe,) = [
            host_recipe(step, np.dtype(np.float64), arrays.__getitem__, arrays.__getitem__, contiguous_route)
            for step in compile_for_rank(op, rank).schedule
            if type(step) is RankPhase
        ]
        assert [m.route for m in (*recipe.receives, *recipe.sends)] == [route]
    frozen = np.zeros(SHAPE)
    frozen.flags.writeable = False
    (step,) = [
        s for s in compile_for_rank(SendRecv(A[0:1, :], B[3:4, :]), 0).schedule if type(s) is RankPhase
    ]
    recipe = host_recipe(
        step, np.dtype(np.float64), {"a": frozen}.__getitem__, {"a": frozen}.__getitem__, contiguous_route
    )
    assert [m.route for m in recipe.sends] == [BUFFER]
