"""The fast paths' rank parts (linop.program.parts) and the executors' tables of calls.

The program plans every collective's fast path as engine-neutral frozen parts; the MPI package
turns each into its step through one table (``linop.backends.mpi.native.CALLS``), applied to a
compiled schedule by ``mpi_schedule``, and the torch.distributed executor through its own
(``linop.backends.torch_distributed.schedule.CALLS``), read by part type. That the steps compute
the node is proven under mpiexec (tests/mpi/test_fastpaths.py, tests/mpi/test_registry.py) and
in the torch.distributed launches (tests/test_torch_distributed.py, which also run a plan whose
table lacks a row: portable and exact); here: the MPI table covers the closed union, the
translations reach every part (in sums too), a part without an MPI row is refused, and a part
without a torch row makes the rank's part portable.
"""

from __future__ import annotations

import dataclasses
import typing

import pytest

from linop import AllGather, AllReduce, Broadcast, DistributedTensor, Partition, ReduceScatter, Repartition
from linop.backends.mpi.native import CALLS, mpi_schedule
from linop.backends.mpi.steps import RankStep
from linop.program import RankBranches, RankPart, RankProgram, WorkerMap, compile_for_rank
from linop.program.parts import Part

TENSOR = DistributedTensor("x", (8, 8), Partition((2, 2)))
TREES = {
    "all-reduce": lambda: AllReduce(TENSOR, (0,)),
    "all-reduce-sum": lambda: 2 * AllReduce(TENSOR, (0,)) + AllReduce(TENSOR, (1,)),
    "broadcast": lambda: Broadcast(DistributedTensor("b", (3,), Partition((1,))), Partition((4,)), "c"),
    "sum-reduce": lambda: Broadcast(DistributedTensor("b", (3,), Partition((1,))), Partition((4,)), "c").H,
    "gather-line": lambda: AllGather(TENSOR, 1, "g"),
    "reduce-scatter-line": lambda: AllGather(TENSOR, 1, "g").H,
    "reduce-scatter-uneven": lambda: ReduceScatter(DistributedTensor("x", (7, 3), Partition((4, 1))), 0, "g"),
    "all-to-all": lambda: Repartition(TENSOR, DistributedTensor("u", (8, 8), Partition((4, 1)))),
}
MAPPED = ("all-reduce", "all-reduce-sum", "broadcast", "sum-reduce")
"""The families with a fast path under a worker map (the others run their expansion there)."""


def _parts(schedule: tuple) -> list:
    """Every fast-path part of a schedule, the terms of its sums included."""
    found = []
    for step in schedule:
        if isinstance(step, RankBranches):
            for term in step.terms:
                found.extend(_parts(term))
        elif isinstance(step, RankPart):
            found.append(step)
    return found


def test_the_mpi_table_has_a_row_for_every_part_type():
    assert set(CALLS) == set(typing.get_args(Part))


@pytest.mark.parametrize("mapped", [False, True], ids=["own", "mapped"])
@pytest.mark.parametrize("case", list(TREES))
def test_every_part_of_a_compiled_schedule_becomes_an_mpi_step(case, mapped):
    """The program's schedule holds engine-neutral parts only (frozen, of the closed union); the
    MPI schedule holds each as the step of its row, in the same places, and nothing else
    changes."""
    op = TREES[case]()
    mapping = WorkerMap([0, 0, 1, 1]) if mapped else None
    seen = 0
    for rank in range(2 if mapped else 4):
        schedule = compile_for_rank(op, rank, mapping).schedule
        parts = _parts(schedule)
        for part in parts:
            assert isinstance(part, typing.get_args(Part)) and not isinstance(part, RankStep)
            with pytest.raises(dataclasses.FrozenInstanceError):
                part.reduce = True  # type: ignore[misc, union-attr]
        translated = mpi_schedule(schedule)
        steps = _parts(translated)
        assert [type(step) for step in steps] == [type(CALLS[type(part)](part)) for part in parts]
        assert all(isinstance(step, RankStep) and step.part is part for step, part in zip(steps, parts))
        assert len(translated) == len(schedule)
        seen += len(parts)
        if not parts:
            assert translated is schedule
    assert bool(seen) == (not mapped or case in MAPPED), f"{case}: {seen} fast-path parts"


def test_a_part_without_a_row_is_refused():  # control
    @dataclasses.dataclass(frozen=True)
    class NewPart(RankPart):
        groups: tuple = ()

    schedule = (RankBranches(((NewPart(),),), ()),)
    with pytest.raises(TypeError, match="no calls for the part NewPart"):
        mpi_schedule(schedule)


# -- the torch.distributed table -----------------------------------------------------------------
torch_schedule = pytest.importorskip("linop.backends.torch_distributed.schedule")
TORCH_ROWS = {
    "all-reduce": "AllReducePart",
    "all-reduce-sum": "AllReducePart",
    "broadcast": "RootedPart",
    "sum-reduce": "RootedPart",
    "gather-line": "LineGatherPart",
    "reduce-scatter-line": "LineGatherPart",
    "reduce-scatter-uneven": "LineReduceScatterPart",
    "all-to-all": "AllToAllPart",
}
"""The part type each family's unmapped fast path lowers to (each a row of torch's table)."""


def test_the_torch_table_has_a_row_for_every_unmapped_part_type():
    """torch.distributed runs its native program without a worker map only: the mapped parts
    have no row (a plan under a map runs the portable program)."""
    rows = set(torch_schedule.CALLS)
    assert rows <= set(typing.get_args(Part))
    assert {t.__name__ for t in set(typing.get_args(Part)) - rows} == {
        "MappedAllReducePart",
        "MappedRootedPart",
    }


def test_both_torch_paths_run_every_step_of_the_table():
    """Every step the table makes has a row in the host path's runs (numpy views) and the device
    path's (tensors where they are), and nothing else does but the host path's packed step (made
    by a bound plan's packing pass, never by the table: the device path does not pack)."""
    from linop.backends.torch_distributed.device import DEVICE_RUNS
    from linop.backends.torch_distributed.runtime import RUNS, PackedStep

    steps = set(typing.get_args(torch_schedule.TorchStep))
    assert {typing.get_type_hints(call)["return"] for call in torch_schedule.CALLS.values()} == steps
    assert set(DEVICE_RUNS) == steps
    assert set(RUNS) == steps | {PackedStep}


def _torch_steps(schedule: tuple) -> list:
    found = []
    for step in schedule:
        if isinstance(step, RankBranches):
            for term in step.terms:
                found.extend(_torch_steps(term))
        elif isinstance(step, typing.get_args(torch_schedule.TorchStep)):
            found.append(step)
    return found


@pytest.mark.parametrize("case", list(TREES))
def test_every_part_becomes_the_torch_step_of_its_row(case):
    """Read by type: each part of a rank's schedule becomes the step of its row of torch's
    table, in the same place, and the native program's rank sets are its groups' (sorted,
    those of more than one rank)."""
    op = TREES[case]()
    for rank in range(4):
        program = compile_for_rank(op, rank)
        parts = _parts(program.schedule)
        assert {type(part).__name__ for part in parts} <= {TORCH_ROWS[case]}
        native = torch_schedule.native_program(op, rank, program)
        assert native is not None, case
        translated, sets = native
        steps = _torch_steps(translated.schedule)
        assert [type(step) for step in steps] == [type(torch_schedule.CALLS[type(p)](p)) for p in parts]
        assert steps == [torch_schedule.CALLS[type(p)](p) for p in parts]
        assert len(translated.schedule) == len(program.schedule)
        expected = {tuple(sorted(r)) for step in steps for r in step.rank_sets if len(r) > 1}
        assert set(sets) == expected


@pytest.mark.parametrize("case", list(TREES))
def test_a_part_without_a_torch_row_makes_the_rank_portable(case):  # control
    """With the row of the tree's part type removed from torch's table, the rank's part is not
    native (None) and its plan compiles the portable program, which holds no part at all; with
    the table whole, the same rank is native (the control of the control). That the portable
    program computes the node exactly is checked in the launches (checks.py: ``table``)."""
    op = TREES[case]()
    rank = 1
    program = compile_for_rank(op, rank)
    if not _parts(program.schedule):
        pytest.skip(f"rank {rank} has no part in {case}")
    missing = {k: v for k, v in torch_schedule.CALLS.items() if k.__name__ != TORCH_ROWS[case]}
    assert torch_schedule.native_program(op, rank, program, missing) is None
    assert torch_schedule.native_program(op, rank, program) is not None
    compiled = torch_schedule.Compiled(op, rank, 4, world=True, calls=missing)
    assert compiled.problem is None and compiled.native is None
    assert not _parts(compiled.portable().schedule) and not _torch_steps(compiled.portable().schedule)
    assert torch_schedule.Compiled(op, rank, 4, world=True).native is not None


def test_a_new_part_type_has_no_torch_row():  # control
    @dataclasses.dataclass(frozen=True)
    class NewPart(RankPart):
        groups: tuple = ()

    program = RankProgram((RankBranches(((NewPart(),),), ()),), 0)
    assert torch_schedule.native_program(TREES["all-reduce"](), 0, program) is None
