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


def _halo_2x2(variant: str, adjoint: bool = False):
    u = DistributedTensor("u", (8, 8), Partition.grid((2, 2)))
    exchange = HaloExchange(halo_geometry(u, Kernel(3, padding=1)), variant)
    return exchange.H if adjoint else exchange


@pytest.mark.parametrize("adjoint", [False, True], ids=["forward", "adjoint"])
def test_direct_halo_exchange_is_three_messages_per_worker(adjoint):
    """2 x 2 workers, 8 x 8, kernel 3: every worker sends a row, a column and a corner (32 + 32
    + 8 bytes), all independent: 3 alpha + 72 beta on one port each way, not a queue of the
    other workers' messages in program order."""
    exchange = _halo_2x2("direct", adjoint)
    for how in (account, account_schedule):
        path = how(exchange).critical_path(MODEL)
        assert (path.messages, path.bytes) == (3, 72), how.__name__
        assert path.reduced == (72 if adjoint else 0)


@pytest.mark.parametrize("variant", ["nested", "direct"])
def test_as_built_adds_and_copies_what_the_schedule_does(variant):
    """The tree as built counts the halo stages' messages, not the staging buffers of their
    expansion that the interpreter never runs: 72 bytes added per worker in the adjoint."""
    for adjoint in (False, True):
        built, scheduled = account(_halo_2x2(variant, adjoint)), account_schedule(_halo_2x2(variant, adjoint))
        for mine, theirs in zip(built.workers, scheduled.workers):
            assert (mine.reduced_bytes, mine.copied_bytes) == (theirs.reduced_bytes, theirs.copied_bytes)
            assert mine.reduced_bytes == (72 if adjoint else 0)


@pytest.mark.parametrize("size", range(2, 10))
def test_dependent_phases_of_a_binomial_broadcast(size):
    """The tree and the schedule agree on the longest chain (worker r is reached through one
    message per bit set in r: 0 -> 1 -> 3 -> 7 ...), while the one-port critical path holds
    the round count ceil(log2 P): 2 dependent phases and 3 alpha at P = 6."""
    from linop.algorithms import problem

    op = problem("broadcast", size, 4).variant("binomial")
    rounds = (size - 1).bit_length()
    chain = max(bin(r).count("1") for r in range(size))
    built, scheduled = account(op), account_schedule(op)
    assert built.phases == scheduled.phases == chain
    for accounting in (built, scheduled):
        assert accounting.critical_path(CostModel(1.0, 0.0)).messages == rounds
