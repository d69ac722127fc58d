"""The fast paths' rank parts (linop.program.parts) and the MPI executor's table of calls.

The program plans every collective's fast path as engine-neutral frozen parts; the MPI package
turns each into its step through one table (``linop.backends.mpi.native.CALLS``), applied to a
compiled schedule by ``mpi_schedule``. That the steps compute the node is proven under mpiexec
(tests/mpi/test_fastpaths.py, tests/mpi/test_registry.py); here: the table covers the closed
union, the translation reaches every part (in sums too), and a part without a row is refused.
"""

from __future__ import annotations

import dataclasses
import typing

import pytest

from linop import AllGather, AllReduce, Broadcast, DistributedTensor, Partition, Repartition
from linop.backends.mpi.native import CALLS, mpi_schedule
from linop.backends.mpi.steps import RankStep
from linop.program import RankBranches, RankPart, WorkerMap, compile_for_rank
from linop.program.parts import Part

TENSOR = DistributedTensor("x", (8, 8), Partition((2, 2)))
TREES = {
    "all-reduce": lambda: AllReduce(TENSOR, (0,)),
    "all-reduce-sum": lambda: 2 * AllReduce(TENSOR, (0,)) + AllReduce(TENSOR, (1,)),
    "broadcast": lambda: Broadcast(DistributedTensor("b", (3,), Partition((1,))), Partition((4,)), "c"),
    "sum-reduce": lambda: Broadcast(DistributedTensor("b", (3,), Partition((1,))), Partition((4,)), "c").H,
    "gather-line": lambda: AllGather(TENSOR, 1, "g"),
    "reduce-scatter-line": lambda: AllGather(TENSOR, 1, "g").H,
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
