"""The registry proof under MPI: every lowering into the distributed program in the dispatch
registry (interpreter ``"program"``: the generic lowerings and the MPI fast paths), run by the
MPI interpreter, gives, across the ranks, exactly what its node's full expansion into
primitives gives (and what the numpy interpreter computes), on the examples of
``verify.node_examples``.

Examples whose workers do not all fit on this job's ranks are skipped on every rank alike
(hypothesis draws the same examples everywhere); each lowering must be proven on some example
when the job has three ranks or more (the example spaces use workers 0-2).
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import collective_assert, local_part, same_blocks, spmd_given
from hypothesis import strategies as st
from mpi4py import MPI

import verify.strategies  # noqa: F401 - registers the example strategies
import verify.strategies_distributed as distributed_strategies
from linop import LinearOperator, dispatch, expand_all
from linop.backends import mpi as mpi_backend
from verify.node_examples import example_strategy

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size
PAIRS = sorted(dispatch.registered("program"), key=lambda pair: pair[1].__name__)


def _workers(op: LinearOperator) -> int:
    return max((b.worker for space in (op.domain, op.range) for b in space), default=0)


def _integer_state(op: LinearOperator, seed: int) -> dict[str, np.ndarray]:
    values = np.random.default_rng(seed).permutation(op.domain.size).astype(np.int64) + 1
    return op.domain.unflatten(values)


@pytest.fixture(autouse=True)
def _workers_on_this_job(monkeypatch):
    """Partitions draw their workers among this job's ranks where they can."""
    monkeypatch.setattr(distributed_strategies, "MAX_WORKER", SIZE)


@pytest.mark.parametrize("pair", PAIRS, ids=lambda pair: pair[1].__name__)
def test_lowering_equals_expansion(pair):
    _, node_type = pair
    strategy = example_strategy(node_type)
    assert strategy is not None, f"{node_type.__name__} has an MPI lowering but no example strategy"
    checked = 0

    @spmd_given(strategy, st.integers(0, 2**31), max_examples=8)
    def run(op, seed):
        nonlocal checked
        if _workers(op) >= SIZE:
            return
        checked += 1
        state = _integer_state(op, seed)
        expected = op(state)
        local = local_part(op.domain, state, RANK)
        names = tuple(b.name for b in op.range if b.worker == RANK)
        fast = mpi_backend.apply(op, local, comm=COMM)
        collective_assert(same_blocks(fast, expected, names) is None, f"lowering of {op}")
        if op.expand() is not op:
            slow = mpi_backend.apply(expand_all(op), local, comm=COMM)
            collective_assert(same_blocks(slow, expected, names) is None, f"expansion of {op}")
        changed = [name for name, array in local.items() if not np.array_equal(array, state[name])]
        collective_assert(not changed, f"{op} changed its input blocks {changed}")  # once on every rank

    run()
    # the example spaces put blocks on workers 0-2: from 3 ranks on, every lowering is exercised
    collective_assert(checked > 0 or SIZE < 3, f"no example of {node_type.__name__} fits {SIZE} ranks")
