"""The run dtype holds what local kernels produce (docs/theory.md#dtypes): integers averaged
by a kernel travel as floats, real blocks made complex by a kernel travel as complex, equal to
the numpy interpreter exactly; a kernel that fails when probed is every rank's typed error."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import collective_assert, expect_collective_error, local_part
from mpi4py import MPI

from linop import Block, DistributedTensor, Partition, SendRecv, Space, local_operator
from linop.backends import mpi as mpi_backend
from linop.errors import DistributedDtypeError, DtypeError
from linop.halo_geometry import Kernel
from linop.layers import AveragePool

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size
LAST = SIZE - 1


def exactly_numpy(op, state, dtype):
    """Every rank's results equal the numpy interpreter's, entry for entry, in ``dtype``."""
    expected = op(state)
    result = mpi_backend.apply(op, local_part(op.domain, state, RANK))
    wrong = [
        (name, result[name].dtype, float(np.abs(result[name] - expected[name]).max()))
        for name in result
        if result[name].dtype != dtype
        or expected[name].dtype != dtype
        or not np.array_equal(result[name], expected[name])
    ]
    collective_assert(not wrong, f"{op}: {wrong}")


@pytest.mark.parametrize("dtype", [np.int64, np.int16, np.uint8])
def test_average_pooling_adjoint_of_integers_is_exact(dtype):
    """The adjoint averages (1/4 per window entry) and sums the halos back across ranks."""
    x = DistributedTensor("x", (1, 1, 4 * SIZE, 4), Partition((1, 1, SIZE, 1)))
    op = AveragePool(x, Kernel(2, padding=1)).operator.H
    rng = np.random.default_rng(7)
    state = {b.name: rng.integers(0, 100, b.shape).astype(dtype) for b in op.domain}
    exactly_numpy(op, state, np.float64)


class Counting:
    """``(1 + 2j) x`` (or its adjoint), counting its calls on this rank."""

    def __init__(self, factor: complex) -> None:
        self.factor = factor
        self.calls = 0

    def __call__(self, a: np.ndarray) -> np.ndarray:
        self.calls += 1
        return self.factor * a


FORWARD, ADJOINT = Counting(1 + 2j), Counting(1 - 2j)


def complex_on_last_moved_to_first():
    """A complex kernel on the last worker, its result sent to worker 0."""
    space = Space([Block("a", (3, 2), LAST)])
    kernel = local_operator(space, "a", ("b", (3, 2)), forward=FORWARD, adjoint=ADJOINT)
    move = SendRecv(kernel.range["b"], Block("c", (3, 2), 0)) if LAST != 0 else None
    return kernel if move is None else move @ kernel


def test_a_complex_kernel_makes_the_run_complex_and_only_its_rank_probes_it():
    op = complex_on_last_moved_to_first()
    state = {"a": np.arange(6.0).reshape(3, 2)}
    expected = op(state)
    before = FORWARD.calls
    result = mpi_backend.apply(op, local_part(op.domain, state, RANK))
    calls = FORWARD.calls - before
    wrong = [
        (name, result[name].dtype)
        for name in result
        if result[name].dtype != np.complex128 or not np.array_equal(result[name], expected[name])
    ]
    mine = sorted(b.name for b in op.range if b.worker == RANK)
    collective_assert(not wrong and sorted(result) == mine, f"{sorted(result)}: {wrong}")
    # the last rank probes it twice (float64 gives complex128, which settles) and runs it; others never
    collective_assert(calls == (3 if RANK == LAST else 0), f"rank {RANK} called the kernel {calls} times")
    again = mpi_backend.apply(op, local_part(op.domain, state, RANK))  # settled: no probe
    collective_assert(FORWARD.calls - before == calls + (RANK == LAST), f"{FORWARD.calls - before} calls")
    collective_assert(all(np.array_equal(again[n], result[n]) for n in result), "the second call differs")


def _refuses_integers(a: np.ndarray) -> np.ndarray:
    if a.dtype.kind in "iu":
        raise TypeError("this kernel takes floats only")
    return a / 2


def test_a_kernel_failing_on_the_run_dtype_is_every_ranks_typed_error():
    space = Space([Block("a", (4,), LAST), Block("z", (4,), 0)])
    op = local_operator(space, "a", ("b", (4,)), forward=_refuses_integers, adjoint=_refuses_integers)
    state = {n: np.ones(4, dtype=np.int64) for n in ("a", "z")}
    with pytest.raises(TypeError):
        op(state)  # the numpy interpreter: the kernel's own error
    local = local_part(space, state, RANK)
    message = expect_collective_error(DistributedDtypeError, lambda: mpi_backend.apply(op, local))
    collective_assert(f"rank {LAST}:" in message and "takes floats only" in message, message)
    expect_collective_error(DtypeError, lambda: mpi_backend.apply(op, local))
