"""Collective algorithms run on the MPI interpreter (they are send-receives, copies and adds)
and give, rank by rank, what the numpy interpreter gives; the calibration fits one model on
every rank, and the chooser's pick runs."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import collective_assert, compare_with_numpy
from mpi4py import MPI

from linop.algorithms import VARIANTS, problem
from linop.algorithms.calibrate import CalibrationError, calibrate
from linop.algorithms.chooser import choose

COMM = MPI.COMM_WORLD
SIZE = COMM.size

CASES = [
    ("broadcast", "binomial", 5),
    ("broadcast", "scatter_allgather", 7),
    ("reduce", "binomial", 5),
    ("reduce", "reduce_scatter_gather", 7),
    ("allreduce", "recursive_doubling", 6),
    ("allreduce", "ring", 7),
    ("allreduce", "rabenseifner", 9),
    ("allreduce", "reduce_broadcast_binomial", 3),
    ("allgather", "ring", (2, 0, 3, 1)[:SIZE]),
    ("allgather", "recursive_doubling", (2, 0, 3, 1)[:SIZE]),
    ("reduce_scatter", "ring", (1, 3, 0, 2)[:SIZE]),
    ("reduce_scatter", "recursive_halving", (1, 3, 0, 2)[:SIZE]),
    ("alltoall", "pairwise", (1, 2, 0, 3)[:SIZE]),
    ("alltoall", "bruck", (1, 2, 0, 3)[:SIZE]),
]


@pytest.mark.parametrize(("collective", "name", "length"), CASES, ids=[f"{c}-{n}" for c, n, _ in CASES])
def test_variant_and_its_adjoint_run_under_mpi(collective, name, length):
    op = problem(collective, SIZE, length).variant(name)
    state = op.domain.random(7, dtype=np.int64)  # integers: sums in any order are exact
    compare_with_numpy(op, state)
    compare_with_numpy(op.H, op.range.random(8, dtype=np.int64))


def test_float_all_reduce_agrees_with_native_allreduce():
    op = problem("allreduce", SIZE, 11).variant("rabenseifner")
    mine = np.random.default_rng(COMM.rank).standard_normal(11)
    result = op.apply_mpi({f"x[{COMM.rank}]": mine}, comm=COMM)[f"x[{COMM.rank}]"]
    native = mine.copy()
    COMM.Allreduce(MPI.IN_PLACE, native)
    collective_assert(bool(np.allclose(result, native, rtol=1e-12, atol=1e-12)), "rabenseifner != Allreduce")


def test_calibration_is_one_model_on_every_rank_and_the_pick_runs():
    if SIZE < 2:
        with pytest.raises(CalibrationError, match="at least two ranks"):
            calibrate(COMM)
        return
    model = calibrate(COMM, repeats=3)
    fitted = COMM.allgather((model.alpha, model.beta, model.gamma))
    collective_assert(all(f == fitted[0] for f in fitted), f"models differ: {fitted}")
    collective_assert(model.alpha > 0 and np.isfinite(model.beta) and model.gamma > 0, f"model {model}")
    choice = choose("allreduce", SIZE, 1 << 12, model)
    collective_assert(choice.variant in VARIANTS["allreduce"], str(choice))
    op = problem("allreduce", SIZE, 1 << 9).variant(choice.variant)
    compare_with_numpy(op, op.domain.random(3, dtype=np.int64))
