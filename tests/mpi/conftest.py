"""Tests that run under ``mpiexec`` (launched by ``tests/test_mpi.py``: one launch of
``run_passes.py``, which runs them at 4, 3, 2 and 1 ranks). A plain serial ``pytest`` run does
not collect them: the launcher sets ``LINOP_MPI_TESTS=1``. They run on ``MPI.COMM_WORLD``; in a
pass of ``run_passes.py`` that is the communicator of the pass's group.

Rules for every test here: each rank runs on the same operators (hypothesis draws on rank 0
and sends each example to the others: :func:`helpers.spmd_given`),
pass/fail is decided collectively (:func:`collective_assert`), so that a failure on one rank
fails every rank instead of leaving the others waiting, and pytest-timeout bounds each test.
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("LINOP_MPI_TESTS") != "1":
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture
def comm():
    """The world communicator."""
    from mpi4py import MPI

    return MPI.COMM_WORLD
