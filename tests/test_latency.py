"""The latency model of per-rank schedules (linop.latency) and the halo exchange's critical
path: one latency per cut dimension on any grid, forward and adjoint, multi-hop included.

The schedules are the ones the MPI interpreter runs, each rank's compiled on its own
(:func:`~linop.program.compile_for_rank`), evaluated lazily: a rank's end depends
only on the ranks its phases wait for (its dependency cone). On a grid with zero boundaries and
equal shares a rank's schedule depends on its grid index only through its distance to each
boundary, up to the halo's reach in blocks, and its end on the schedules within the reach of
its cone; so the ranks within a band of a few reaches of each boundary, and one in the middle,
take every end the grid has. Grids up to 16 x 16 are evaluated on every rank, larger ones on
those bands (every rank, and the multi-hop exchange on 128 x 128 too, with LINOP_LONG=1).

The control is the batching before rounds (every transfer of round 0: a receive joins the
first phase it does not conflict with on its own rank): it must show today's chain, 3
latencies forward and p0 + 1 adjoint.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import pytest

from linop import Block, DistributedTensor, HaloExchange, Kernel, Partition, SendRecv, Space, halo_geometry
from linop.accounting import account_schedule
from linop.errors import AccountingError
from linop.latency import critical_path
from linop.program import RankPhase, Transfer, batch, compile_for_rank, lower_for, project

LONG = os.environ.get("LINOP_LONG") == "1"


def _halo(parts, block, kernel, *, variant="nested", adjoint=False):
    tensor = DistributedTensor("x", tuple(p * n for p, n in zip(parts, block)), Partition(parts))
    op = HaloExchange(halo_geometry(tensor, kernel), variant)
    return op.H if adjoint else op


def _roundless(op, rank):
    """The rank's schedule as batched before rounds: every transfer of round 0."""
    steps, _ = lower_for(op, rank)
    steps = [dataclasses.replace(s, round=0) if isinstance(s, Transfer) else s for s in steps]
    return project(batch(steps), rank)


def _schedules(op, *, old=False):
    if old:
        return functools.lru_cache(maxsize=None)(lambda rank: _roundless(op, rank))
    return functools.lru_cache(maxsize=None)(lambda rank: compile_for_rank(op, rank).schedule)


def _ranks(parts, band):
    """Every rank of a small grid; on a large one the ranks within ``band`` of a boundary along
    every dimension, or in the middle (see the module docstring)."""
    if LONG or all(p <= 16 for p in parts):
        indices = [range(p) for p in parts]
    else:
        indices = [
            sorted({*range(min(band, p)), *range(max(p - band, 0), p), *range(p // 2 - 1, p // 2 + 1)})
            for p in parts
        ]
    out = [0]
    for p, index in zip(parts, indices):  # C order, as Partition numbers its workers
        out = [r * p + i for r in out for i in index]
    return out


GRIDS = [(2, 2), (4, 4), (8, 8), (3, 5), (1, 6), (32, 32), (128, 128)]


@pytest.mark.parametrize("parts", GRIDS, ids=lambda p: "x".join(map(str, p)))
@pytest.mark.parametrize("adjoint", [False, True], ids=["forward", "adjoint"])
def test_nested_exchange_takes_one_latency_per_cut_dimension(parts, adjoint):
    op = _halo(parts, (4, 4), Kernel(3, padding=1), adjoint=adjoint)
    cut = sum(p > 1 for p in parts)
    assert critical_path(_schedules(op), _ranks(parts, 4)) == cut


MULTI_HOP_GRIDS = [(5, 5), (16, 16), (64, 64), *([(128, 128)] if LONG else [])]


@pytest.mark.parametrize("parts", MULTI_HOP_GRIDS, ids=lambda p: "x".join(map(str, p)))
@pytest.mark.parametrize("adjoint", [False, True], ids=["forward", "adjoint"])
def test_multi_hop_exchange_takes_one_latency_per_cut_dimension(parts, adjoint):
    """Blocks of 2 and a padding of 6 along the second axis: halos from three blocks away."""
    op = _halo(parts, (2, 2), Kernel((3, 5), padding=(1, 6)), adjoint=adjoint)
    assert critical_path(_schedules(op), _ranks(parts, 8)) == 2


@pytest.mark.parametrize("adjoint", [False, True], ids=["forward", "adjoint"])
def test_periodic_three_dimensional_and_direct_exchanges(adjoint):
    periodic = _halo((4, 4), (3, 3), Kernel(3, padding=1, boundary="periodic"), adjoint=adjoint)
    assert critical_path(_schedules(periodic), range(16)) == 2
    cube = _halo((2, 3, 2), (3, 3, 3), Kernel(3, padding=1), adjoint=adjoint)
    assert critical_path(_schedules(cube), range(12)) == 3
    direct = _halo((8, 8), (4, 4), Kernel(3, padding=1), variant="direct", adjoint=adjoint)
    assert critical_path(_schedules(direct), range(64)) == 1


@pytest.mark.parametrize("p", [2, 4, 8, 32, 128])
def test_control_the_batching_without_rounds_chains_across_the_grid(p):
    """Today's chain: 3 latencies forward, p0 + 1 adjoint (5 on 4 x 4, 129 on 128 x 128).

    The adjoint's chain runs down the grid's first axis, each rank waiting for the one below
    (every column alike): on a large grid two columns are evaluated, each with its whole cone."""
    forward = _halo((p, p), (4, 4), Kernel(3, padding=1))
    assert critical_path(_schedules(forward, old=True), _ranks((p, p), 4)) == 3
    columns = _ranks((p, p), 4) if p <= 16 else [r * p + c for r in range(p) for c in (0, p // 2)]
    assert critical_path(_schedules(forward.H, old=True), columns) == p + 1


def test_rounds_split_phases_on_each_rank():
    """Every rank of the nested exchange runs one phase per stage, its receives with the
    sends of the same stage (the control groups a later stage's receive into the first)."""
    op = _halo((4, 4), (4, 4), Kernel(3, padding=1))
    schedule = compile_for_rank(op, 0).schedule
    phases = [s for s in schedule if isinstance(s, RankPhase)]
    rounds = [{t.round for _, _, t in (*ph.receives, *ph.sends)} for ph in phases]
    assert rounds == [{0}, {1}]
    old = [s for s in _roundless(op, 0) if isinstance(s, RankPhase)]
    assert [p for p, _, _ in old[0].receives] == [4, 1]  # the row's and the column's receive together


def _space(n):
    return Space([Block(f"x{w}", (3,), w) for w in range(n)])


def test_the_model_on_hand_built_schedules():
    """A chain x0 -> x1 -> x2 is two latencies; independent messages overlap."""
    space = _space(4)
    chain = SendRecv(space["x1"], space["x2"]) @ SendRecv(space["x0"], space["x1"])
    assert critical_path({r: compile_for_rank(chain, r).schedule for r in range(4)}) == 2
    fan = SendRecv(space["x0"], space["x3"]) @ SendRecv(space["x0"], space["x1"])
    assert critical_path({r: compile_for_rank(fan, r).schedule for r in range(4)}) == 1


def test_the_model_refuses_a_deadlock_and_an_unmatched_receive():
    space = _space(2)
    t01, t10 = (
        Transfer(space["x0"], space["x1"], "add", "keep"),
        Transfer(space["x1"], space["x0"], "add", "keep"),
    )
    # rank 0 waits for 1's message before sending its own, and rank 1 the same: a cycle
    cycle = {
        0: (RankPhase(((1, 0, t10),), ()), RankPhase((), ((1, 0, t01),))),
        1: (RankPhase(((0, 0, t01),), ()), RankPhase((), ((0, 0, t10),))),
    }
    with pytest.raises(AccountingError, match="cycle"):
        critical_path(cycle)
    lonely = {0: (RankPhase(((1, 0, t10),), ()),), 1: ()}
    with pytest.raises(AccountingError, match="never sends"):
        critical_path(lonely)
    with pytest.raises(AccountingError, match="give the ranks"):
        critical_path(lambda rank: ())


def test_account_schedule_dependent_phases_come_from_the_model():
    """The accounting's dependent phases are the critical path of the ranks' schedules."""
    for parts in ((2, 2), (4, 4)):
        for adjoint in (False, True):
            op = _halo(parts, (4, 4), Kernel(3, padding=1), adjoint=adjoint)
            assert account_schedule(op).phases == 2
