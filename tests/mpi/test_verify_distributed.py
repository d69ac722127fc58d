"""verify.distributed: the MPI adjoint test and the cross-check pass on correct trees and catch
a deliberately wrong adjoint or a deviating interpreter, with one verdict on every rank."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from helpers import collective_assert, spmd_given
from mpi4py import MPI
from strategies import movement_trees

from linop import Block, Copy, LinearOperator, Region, SendRecv, SendRecvAdjoint, Space
from linop.backends import numpy as numpy_backend
from linop.collectives import AllReduce, BlockGrid, Broadcast
from linop.halo import HaloExchange
from linop.halo_geometry import Kernel, halo_geometry
from linop.partition import DistributedTensor, Partition
from verify.distributed import cross_check, distributed_adjoint_test, global_random, local_random
from verify.errors import CheckOptionError

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size
LAST = SIZE - 1


def same_on_every_rank(value) -> bool:
    return all(v == value for v in COMM.allgather(value))


def chosen_operators() -> list[LinearOperator]:
    grid = (2, 2) if SIZE == 4 else (SIZE, 1)
    tensor = DistributedTensor("x", (8, 6), Partition(grid))
    return [
        HaloExchange(halo_geometry(tensor, Kernel(3, padding=1))),
        Broadcast(DistributedTensor("s", (5,), Partition((1,))), Partition((SIZE,)), "c"),
        AllReduce(BlockGrid.uniform("a", Partition((SIZE,)), (4, 3)), (0,)),
    ]


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.complex64, np.complex128])
@pytest.mark.parametrize("index", range(3))
def test_adjoint_test_passes(index, dtype):
    op = chosen_operators()[index]
    result = distributed_adjoint_test(op, dtype=dtype)
    collective_assert(bool(result) and same_on_every_rank(result.measured), repr(result))


@pytest.mark.parametrize("index", range(3))
def test_cross_check_passes(index):
    op = chosen_operators()[index]
    for node in (op, op.H):
        result = cross_check(node)
        collective_assert(bool(result) and result.exact, result.detail)
    collective_assert(bool(cross_check(op, dtype=np.complex128)), "complex cross-check")


@spmd_given(movement_trees(SIZE), max_examples=8, long=30)
def test_random_trees_pass_both(op):
    collective_assert(bool(cross_check(op)), "cross-check")
    result = distributed_adjoint_test(op, trials=1)
    collective_assert(bool(result), repr(result))


class PairCopy(LinearOperator):
    """A copy from ``src`` to ``dst`` that expands into a send-receive (or a local copy)."""

    src: Region
    dst: Region

    @property
    def domain(self) -> Space:
        return self.src.space

    @property
    def range(self) -> Space:
        return self.src.space

    def expand(self) -> LinearOperator:
        return (
            SendRecv(self.src, self.dst) if self.src.worker != self.dst.worker else Copy(self.src, self.dst)
        )


@dataclass(frozen=True, eq=True, repr=False)
class WrongAdjoint(PairCopy):
    """A send-receive whose adjoint rule is deliberately wrong (twice the true adjoint)."""

    src: Region
    dst: Region

    def adjoint(self) -> LinearOperator:
        true = (
            SendRecv(self.src, self.dst).H
            if self.src.worker != self.dst.worker
            else Copy(self.src, self.dst).H
        )
        return 2 * true

    def __str__(self) -> str:
        return "W"


def pair() -> Space:
    return Space([Block("a", (3, 2), 0), Block("b", (3, 2), LAST)])


def test_adjoint_test_catches_a_wrong_adjoint():
    space = pair()
    result = distributed_adjoint_test(WrongAdjoint(space["a"], space["b"]))
    collective_assert(not result and same_on_every_rank(result.measured), repr(result))
    collective_assert(result.measured > 1e-3, repr(result))


@pytest.mark.parametrize(("option", "value"), [("dtype", np.int64), ("trials", 0)])
def test_adjoint_test_refuses_options_that_cannot_test(option, value):
    """An integer dtype, or no trial at all (which would pass any adjoint)."""
    space = pair()
    with pytest.raises(CheckOptionError):
        distributed_adjoint_test(WrongAdjoint(space["a"], space["b"]), **{option: value})


@dataclass(frozen=True, eq=True, repr=False)
class Deviant(PairCopy):
    """A copy whose numpy handler (below) negates, while its expansion (used by MPI) copies."""

    src: Region
    dst: Region

    def adjoint(self) -> LinearOperator:
        return SendRecvAdjoint(self.src, self.dst)

    def __str__(self) -> str:
        return "Dv"


@numpy_backend.handler(Deviant)
def _deviant(op: Deviant, work: numpy_backend.Workspace) -> None:
    work.writable(op.dst.name)[op.dst.index] = -work.arrays[op.src.name][op.src.index]


def test_cross_check_catches_a_deviating_interpreter():
    space = pair()
    result = cross_check(Deviant(space["a"], space["b"]))
    collective_assert(not result and same_on_every_rank(result.detail), result.detail)
    collective_assert("block 'b'" in result.detail and f"rank {LAST}" in result.detail, result.detail)


def test_random_states_are_one_global_state():
    space = Space(Block(f"x{w}", (2, 3), w) for w in range(SIZE))
    mine = local_random(space, RANK, seed=3)
    whole = global_random(space, seed=3)
    collective_assert(all(np.array_equal(mine[n], whole[n]) for n in mine) and len(mine) == 1, "draws differ")


def test_catalogue_runs_under_mpi(capsys):
    from verify.distributed import main

    status = main(["section:distributed-primitives,section:collectives"])
    output = capsys.readouterr().out
    collective_assert(status == 0, output[-2000:])
    if RANK == 0:
        assert "0 failed" in output


def test_the_mpi_flag_of_the_cli(capsys):
    """``python -m verify --mpi --only PATTERN`` (its argument handling, then the distributed
    catalogue), in this launch instead of one of its own."""
    from verify.__main__ import main

    status = main(["--mpi", "--only", "copy-inplace*"])
    output = capsys.readouterr().out
    collective_assert(status == 0, output[-2000:])
    if RANK == 0:
        assert "0 failed" in output and f"checked on {SIZE} rank(s)" in output, output[-2000:]
