"""Communication accounting (linop.accounting): counts per worker, dependent phases, the
alpha-beta-gamma time of a tree as built and of its MPI schedule, table and plain data."""

from __future__ import annotations

import pytest

from linop import AllReduce, Block, BlockGrid, DistributedTensor, Partition, SendRecv, Space
from linop.accounting import AccountingError, Cost, CostModel, account, account_schedule
from linop.halo import HaloExchange
from linop.halo_geometry import Kernel, halo_geometry

MODEL = CostModel(alpha=2e-6, beta=1e-9, gamma=5e-10)


def _chain() -> tuple[Space, object]:
    """x0 -> x1 -> x2 (the second message waits for the first), and x0 -> x3 (independent)."""
    space = Space([Block(f"x{w}", (5,), w) for w in range(4)])
    tree = (
        SendRecv(space["x0"], space["x3"])
        @ SendRecv(space["x1"], space["x2"])
        @ SendRecv(space["x0"], space["x1"])
    )
    return space, tree


def test_counts_per_worker_and_bytes():
    _, tree = _chain()
    accounting = account(tree)
    rows = {w.worker: w for w in accounting.workers}
    assert (rows[0].sent, rows[0].sent_bytes, rows[0].received) == (2, 80, 0)
    assert (rows[1].sent, rows[1].received, rows[1].received_bytes) == (1, 1, 40)
    assert (rows[2].received, rows[3].received) == (1, 1)
    assert accounting.total_messages == 3 and accounting.total_bytes == 120
    assert account(tree, itemsize=4).total_bytes == 60


def test_dependent_phases_and_the_critical_path():
    """The chain x0 -> x1 -> x2 is two dependent phases; x0 -> x3 shares worker 0's send port
    with the first message, so it waits one message time, and finishes with the second."""
    _, tree = _chain()
    for how in (account, account_schedule):
        accounting = how(tree)
        assert accounting.phases == 2
        path = accounting.critical_path(MODEL)
        assert (path.messages, path.bytes, path.reduced) == (2, 80, 0)
        assert accounting.time(MODEL) == pytest.approx(2 * (2e-6 + 40e-9))


def test_adds_cost_gamma_and_the_adjoint_reverses_the_messages():
    _, tree = _chain()
    forward, backward = account(tree), account(tree.H)
    assert [(m.target, m.source, m.nbytes) for m in backward.messages] == [
        (m.source, m.target, m.nbytes) for m in reversed(forward.messages)
    ]
    assert all(m.adds for m in backward.messages) and not any(m.adds for m in forward.messages)
    path = backward.critical_path(MODEL)
    assert (path.messages, path.bytes) == (2, 80) and path.reduced == 80
    rows = {w.worker: w for w in backward.workers}
    assert rows[0].received == 2 and rows[0].reduced_bytes == 80


def test_a_collective_node_as_built_and_as_scheduled():
    """As built, an AllReduce is its expansion (reduce to the root, then broadcast); the MPI
    schedule runs it natively, a phase whose time the model does not know."""
    layout = BlockGrid.uniform("a", Partition.grid(4), (3,))
    node = AllReduce(layout, (0,))
    built, scheduled = account(node), account_schedule(node)
    assert built.total_messages == 6 and built.phases == 2 and not built.native
    assert scheduled.native and scheduled.phases == 1 and scheduled.total_messages == 0
    assert "native collectives (time not modeled)" in scheduled.table(MODEL)


def test_halo_exchange_accounting():
    u = DistributedTensor("u", (8, 8), Partition.grid((2, 2)))
    exchange = HaloExchange(halo_geometry(u, Kernel(3, padding=1)))
    built, scheduled = account(exchange), account_schedule(exchange)
    assert built.total_messages == scheduled.total_messages > 0
    assert built.total_bytes == scheduled.total_bytes
    assert sorted(w.worker for w in built.workers) == [0, 1, 2, 3]
    assert all(w.sent == w.received for w in built.workers)  # every worker has the same neighbours


def test_table_and_plain_data():
    _, tree = _chain()
    accounting = account(tree)
    text = accounting.table(MODEL)
    assert text.splitlines()[1].split()[:3] == ["worker", "sent", "bytes"]
    assert "messages 3, bytes 120, dependent phases 2" in text and "critical path 2 alpha + 80 beta" in text
    data = accounting.as_dict(MODEL)
    assert data["messages"] == 3 and data["workers"][0]["sent"] == 2
    assert data["critical_path"] == {"messages": 2, "bytes": 80, "reduced": 0, "steps": 0}
    assert data["time"] == pytest.approx(accounting.time(MODEL))


def test_sums_and_scalings_are_accounted_term_by_term():
    _, tree = _chain()
    single = account(tree)
    doubled = account(2 * tree + tree)
    assert doubled.total_messages == 2 * single.total_messages
    assert account_schedule(2 * tree + tree).total_messages == 2 * single.total_messages


def test_cost_terms_add_and_price():
    assert (Cost(1, 8, 0) + Cost(2, 16, 8)).time(CostModel(1.0, 0.5, 0.25)) == 3 + 12 + 2
    assert Cost(0, 0, 0, 3).time(CostModel(0.0, 0.0, 0.0, delta=0.5)) == 1.5


def test_delta_charges_local_steps_on_the_critical_path():
    """A recursive-doubling exchange adds its received block and drops the buffer: two local
    steps after the message on each worker."""
    from linop.algorithms import problem

    op = problem("allreduce", 2, 4).variant("recursive_doubling")
    path = account(op).critical_path(CostModel(1.0, 0.0, 0.0, delta=1.0))
    assert path.steps == 2 and path.messages == 1


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: CostModel(-1.0, 0.0), "alpha must be a finite number >= 0"),
        (lambda: CostModel(0.0, float("nan")), "beta must be"),
        (lambda: account(_chain()[1], itemsize=0), "itemsize must be a positive integer"),
        (lambda: account_schedule(_chain()[1], itemsize=2.5), "itemsize"),
    ],
    ids=["negative-alpha", "nan-beta", "zero-itemsize", "float-itemsize"],
)
def test_bad_input_raises_accounting_error(build, message):
    with pytest.raises(AccountingError, match=message):
        build()
