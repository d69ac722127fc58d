"""Shared helpers of the MPI tests: local parts of states and collective assertions."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from hypothesis import HealthCheck, settings
from mpi4py import MPI

from linop import LinearOperator, Space

LONG = os.environ.get("LINOP_LONG") == "1"


def spmd(max_examples: int, *, long: int | None = None) -> settings:
    """Hypothesis settings under which every rank draws the same examples and takes the same
    path: derandomized, no database, and no timing-based health check (under load one rank
    alone could fail it, leaving the others waiting in a collective). ``long``: the number of
    examples with ``LINOP_LONG=1`` (default ``max_examples``)."""
    if LONG and long is not None:
        max_examples = long
    return settings(
        derandomize=True,
        database=None,
        deadline=None,
        max_examples=max_examples,
        suppress_health_check=list(HealthCheck),
    )


def local_part(space: Space, state: Mapping[str, np.ndarray], rank: int) -> dict[str, np.ndarray]:
    """The blocks of ``state`` that ``rank`` owns (copies, so tests can detect mutation)."""
    return {b.name: np.array(state[b.name]) for b in space if b.worker == rank}


def collective_assert(condition: bool, message: str = "", comm: Any = MPI.COMM_WORLD) -> None:
    """Fail on every rank when ``condition`` is false on any rank."""
    failed = comm.allgather(None if condition else f"rank {comm.rank}: {message}")
    failures = [f for f in failed if f is not None]
    assert not failures, "; ".join(failures)


def same_blocks(
    result: Mapping[str, np.ndarray],
    expected: Mapping[str, np.ndarray],
    names: tuple[str, ...],
    *,
    exact: bool = True,
) -> str | None:
    """None when ``result`` holds exactly ``names`` with the expected values, else why not."""
    if sorted(result) != sorted(names):
        return f"blocks {sorted(result)} instead of {sorted(names)}"
    for name in names:
        got, want = np.asarray(result[name]), np.asarray(expected[name])
        if got.shape != want.shape:
            return f"block {name!r} has shape {got.shape}, expected {want.shape}"
        if exact:
            ok = np.array_equal(got, want)
        else:  # sums in another order: a few units of the dtype's precision
            eps = np.finfo(np.result_type(got.dtype, np.float16)).eps
            ok = np.allclose(
                got, want, rtol=64 * eps, atol=64 * eps * max(1.0, float(np.abs(want).max(initial=0)))
            )
        if not ok:
            return f"block {name!r} differs: {got!r} versus {want!r}"
    return None


def expect_collective_error(error_type: type, call: Callable[[], Any], comm: Any = MPI.COMM_WORLD) -> str:
    """Run ``call`` on every rank; every rank must raise ``error_type`` with the same message."""
    try:
        call()
    except error_type as error:
        message = str(error)
    except Exception as error:
        message = f"UNEXPECTED {type(error).__name__}: {error}"
    else:
        message = "NO ERROR"
    messages = comm.allgather(message)
    collective_assert(
        all(m == messages[0] for m in messages) and not messages[0].startswith(("UNEXPECTED", "NO ERROR")),
        f"expected the same {error_type.__name__} on every rank, got {messages}",
        comm,
    )
    return messages[0]


def compare_with_numpy(
    op: LinearOperator, state: Mapping[str, np.ndarray], comm: Any = MPI.COMM_WORLD, *, exact: bool = True
) -> None:
    """Apply ``op`` under MPI and with numpy; each rank's blocks must agree, inputs unchanged."""
    from linop.backends import mpi as mpi_backend

    rank = comm.rank
    expected = op(state)
    local = local_part(op.domain, state, rank)
    before = {n: a.copy() for n, a in local.items()}
    result = mpi_backend.apply(op, local, comm=comm)
    names = tuple(b.name for b in op.range if b.worker == rank)
    problem = same_blocks(result, expected, names, exact=exact)
    if problem is None:
        if any(not np.array_equal(before[n], local[n]) for n in local):
            problem = "the caller's arrays were mutated"
    if problem is None:
        dtypes = [(n, result[n].dtype, np.asarray(expected[n]).dtype) for n in names]
        wrong = [d for d in dtypes if d[1] != d[2] and not np.can_cast(d[2], d[1], "same_kind")]
        if wrong:
            problem = f"dtypes differ: {wrong}"
    collective_assert(problem is None, f"{op}: {problem}", comm)


@dataclass(frozen=True, eq=True, repr=False)
class Opaque(LinearOperator):
    """A self-adjoint test node on a space with neither an interpreter handler nor an
    expansion: what an interpreter does with a node it does not know."""

    space: Space

    @property
    def domain(self) -> Space:
        return self.space

    @property
    def range(self) -> Space:
        return self.space

    def adjoint(self) -> LinearOperator:
        return self

    def __str__(self) -> str:
        return type(self).__name__
