"""The torch modules under a worker map (``mapping=``) across MPI ranks: with every worker on
another rank than its own (worker w on rank size - 1 - w) each module takes the blocks of the
workers the map puts on its rank, and its forward and backward (outputs, input and parameter
gradients, running statistics, the loss on the root worker's rank) equal the same module's in
one process: exactly where it moves data, to 1e-10 in float64 otherwise. A map that leaves a
worker out or names a rank the communicator lacks is a WorkerMapError on every rank when the
module is built; maps that differ between ranks a WorkerMapMismatchError at the first call."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from helpers import collective_assert, expect_collective_error
from mpi4py import MPI

from linop.errors import WorkerMapError, WorkerMapMismatchError
from linop.program import WorkerMap

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: the shared cases
import module_map_cases as cases  # noqa: E402

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size


@pytest.mark.skipif(
    SIZE > 2 and os.environ.get("LINOP_LONG") != "1",
    reason="3 and 4 ranks with LINOP_LONG=1 (the CI suite's time: 2 ranks reverse every module's placement)",
)
@pytest.mark.parametrize("name", list(cases.CASES))
def test_module_under_reversed_map_equals_one_process(name):
    build, exact = cases.CASES[name]
    ranks = cases.reversed_ranks(SIZE)
    problems: list[str] = []
    try:
        module, got = build(SIZE, comm=COMM, mapping=ranks)
        problems += cases.placed(module, RANK, ranks)
        if name == "loss":
            root_rank = ranks[module.layer.root]
            if module.root != root_rank or module.is_root != (RANK == root_rank):
                problems.append(
                    f"root on rank {module.root} (is_root {module.is_root}), the map says {root_rank}"
                )
            if module.is_root and "loss" not in got:
                problems.append("no loss on the root's rank")
        expected = cases.serial_run(name, SIZE)
        if name.startswith("batchnorm"):
            expected = cases.running_expected(got, expected)
        problems += cases.compare(got, expected, exact)
    except Exception as error:  # reported on every rank
        problems.append(f"{type(error).__name__}: {error}")
    collective_assert(not problems, f"{name}: {problems}")


@pytest.mark.skipif(
    SIZE > 2, reason="the cases are laid out for at most 4 workers: 2 per rank on 1 or 2 ranks"
)
@pytest.mark.parametrize("name", ["conv", "batchnorm", "loss", "maxpool"])
def test_module_under_several_workers_per_rank(name):
    """Twice as many workers as ranks, blocked (two per rank) and round robin: a rank runs the
    products, holds the parameters and passes the blocks of all its workers, and the modules
    equal one process."""
    build, exact = cases.CASES[name]
    workers = 2 * SIZE
    for mapping in (WorkerMap.blocked(workers, SIZE), WorkerMap.round_robin(workers, SIZE)):
        problems: list[str] = []
        try:
            module, got = build(workers, comm=COMM, mapping=mapping)
            problems += cases.placed(module, RANK, [mapping.rank_of(w) for w in range(workers)])
            expected = cases.serial_run(name, workers)
            if name.startswith("batchnorm"):
                expected = cases.running_expected(got, expected)
            problems += cases.compare(got, expected, exact)
        except Exception as error:  # reported on every rank
            problems.append(f"{type(error).__name__}: {error}")
        collective_assert(not problems, f"{name} under {mapping!r}: {problems}")


@pytest.mark.parametrize("name", list(cases.CASES))
def test_bad_maps_raise_typed_errors_on_every_rank(name):
    build, _ = cases.CASES[name]
    short = list(range(SIZE - 1))  # the last worker left out
    message = expect_collective_error(WorkerMapError, lambda: build(SIZE, comm=COMM, mapping=short))
    collective_assert(f"worker {SIZE - 1} of the tree is not in the worker map" in message, message)
    beyond = [w + 1 for w in range(SIZE)]  # the last worker on a rank the communicator lacks
    message = expect_collective_error(WorkerMapError, lambda: build(SIZE, comm=COMM, mapping=beyond))
    collective_assert(f"on rank {SIZE}" in message, message)
    expect_collective_error(WorkerMapError, lambda: build(SIZE, comm=COMM, mapping=["a"] * SIZE))
    if SIZE > 1:  # rank 0 alone reverses the workers: the first call's entry check
        mine = cases.reversed_ranks(SIZE) if RANK == 0 else list(range(SIZE))
        expect_collective_error(WorkerMapMismatchError, lambda: build(SIZE, comm=COMM, mapping=mine))
