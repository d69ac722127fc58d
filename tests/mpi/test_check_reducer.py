"""The MPI entry check's collectives (linop.backends.mpi.check): the digest first, the whole vector
only when the ranks' vectors differ, on every rank alike; the common case of a loop makes the
digest's collective only; on an oversubscribed node the wait for a late peer yields the core from
its first failed test (linop.backends.mpi.deadline.wait_all's ``busy=0``).

Each verdict is compared with an independent reduction (mpi4py's ``allreduce`` of the vectors),
and the digest's test has a control: a digest of the fingerprint words only misses ranks that
differ in a dtype flag, which the test then finds."""

from __future__ import annotations

import hashlib
import time

import numpy as np
import pytest
from helpers import collective_assert, local_part, same_blocks
from mpi4py import MPI

from linop.backends import mpi as mpi_backend
from linop.backends.entry_check.vector import FLAG_OF, LARGEST, UNSETTLED
from linop.backends.mpi import check, deadline
from linop.backends.mpi.check import VECTOR_LENGTH, CheckReducer
from linop.halo import HaloExchange
from linop.halo_geometry import Kernel, halo_geometry
from linop.partition import DistributedTensor, Partition

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size
TIMEOUT = 30.0  # a deadline (the checks poll under one by default); no test waits for it


def _reducer() -> CheckReducer:
    return CheckReducer(COMM.Dup())


def _free(reducer: CheckReducer) -> None:
    reducer.free()
    reducer.comm.Free()


def _load(reducer: CheckReducer, vector: np.ndarray) -> None:
    """Write ``vector`` into the send buffer as the entry check does (with its bytes)."""
    np.copyto(reducer.send, vector)
    reducer.signature, reducer.sent = object(), reducer.send.tobytes()


def _fingerprint_only(self: CheckReducer, sent: bytes) -> bytes:
    """The control: a digest of the fingerprint words alone (blind to flags and magnitudes)."""
    words = np.frombuffer(hashlib.blake2b(sent[:64], digest_size=16).digest(), dtype=np.int64)
    return np.concatenate([words, ~words]).tobytes()


class _Blind:
    """The digest's request of a reducer, blind to the other ranks: once complete, the received
    words are this rank's own (as if every rank had sent them)."""

    def __init__(self, reducer: CheckReducer) -> None:
        self.reducer, self.request = reducer, reducer.request

    def Start(self) -> None:  # noqa: N802 - mpi4py's name
        self.request.Start()

    def Test(self) -> bool:  # noqa: N802 - mpi4py's name
        done = bool(self.request.Test())
        if done:
            np.copyto(self.reducer.digest_received, self.reducer.digest)
        return done


@pytest.mark.parametrize(
    "control",
    [None, "fingerprint-only", "blind"],
    ids=["digest", "control-fingerprint-only", "control-blind"],
)
def test_the_reduction_is_the_maximum_over_ranks_whichever_rank_differs(control, monkeypatch):
    """For no rank, and for each rank in turn, differing in a fingerprint word, a dtype flag, an
    unsettled flag or the largest magnitude: every rank's reduced vector equals the maximum over
    ranks (an independent allreduce), and the digest's verdict is every rank's (on two ranks
    through the exchange with the peer, else the ``Allreduce``). The controls run the dtype
    flag's case, which each misses: a digest of the fingerprint words only, and a digest's
    reduction blind to the other ranks (the received words replaced by this rank's own)."""
    if control == "fingerprint-only":
        monkeypatch.setattr(CheckReducer, "digest_for", _fingerprint_only)
    reducer = _reducer()
    paired = reducer.digest_send is not None  # two ranks: a send to the peer and a receive from it
    if control == "blind" and SIZE > 1:
        reducer.request = _Blind(reducer)
    base = np.arange(VECTOR_LENGTH, dtype=np.int64) * 7 - 20
    wrong = []
    try:
        for position in (FLAG_OF["d"],) if control else (1, FLAG_OF["d"], UNSETTLED + 3, LARGEST):
            for odd in [None, *range(SIZE)]:
                vector = base.copy()
                if RANK == odd:
                    vector[position] += 1 + RANK
                _load(reducer, vector)
                unanimous = reducer.unanimous(TIMEOUT)
                reduced = (reducer.send if unanimous else reducer.received).copy()
                expected = np.empty_like(vector)
                COMM.Allreduce(vector, expected, op=MPI.MAX)
                verdicts = COMM.allgather(unanimous)
                if not np.array_equal(reduced, expected) or verdicts != [odd is None or SIZE == 1] * SIZE:
                    wrong.append((position, odd))
                _load(reducer, vector)
                if not np.array_equal(reducer.reduce(TIMEOUT), expected):  # the same through reduce()
                    wrong.append((position, odd, "reduce"))
    finally:
        if isinstance(reducer.request, _Blind):
            reducer.request = reducer.request.request
        _free(reducer)
    if control:  # a differing flag goes unseen by a fingerprint-only or a blind digest
        collective_assert(
            SIZE == 1 or bool(COMM.allreduce(bool(wrong), op=MPI.LOR)), "the control found nothing"
        )
    else:
        collective_assert(not wrong, f"wrong reductions (position, odd rank): {wrong}")
        collective_assert(
            paired == (SIZE == 2), f"the digest exchanged with a peer: {paired} on {SIZE} ranks"
        )


class _Counted:
    """A persistent request that counts its starts."""

    def __init__(self, request) -> None:
        self.request, self.starts = request, 0

    def Start(self) -> None:  # noqa: N802 - mpi4py's name
        self.starts += 1
        self.request.Start()

    def Test(self) -> bool:  # noqa: N802 - mpi4py's name
        return bool(self.request.Test())

    def Wait(self) -> None:  # noqa: N802 - mpi4py's name
        self.request.Wait()


def test_a_loop_makes_the_digests_collective_only_and_a_differing_rank_makes_every_rank_reduce_all():
    """The same arrays again: one start of the digest's reduction per call, none of the whole
    vector's. Then the last rank passes float32 (out of place: the run is float64): every rank
    reduces the whole vector on every such call, and the results stay exact."""
    tensor = DistributedTensor("x", (12, 40), Partition((SIZE, 1)))
    op = HaloExchange(halo_geometry(tensor, Kernel(3, padding=1)))
    state = op.domain.random(5)
    local = local_part(op.domain, state, RANK)
    for _ in range(2):
        mpi_backend.apply(op, local, comm=COMM, inplace=True)
    reducer = mpi_backend.plan_for(op, comm=COMM).context.reducer
    if SIZE == 1:
        collective_assert(reducer.request is None, "one rank: nothing to reduce")
        return
    digest, whole = _Counted(reducer.request), _Counted(reducer.vector_request)
    reducer.request, reducer.vector_request = digest, whole
    try:
        for _ in range(3):
            mpi_backend.apply(op, local, comm=COMM, inplace=True)
        loop = (digest.starts, whole.starts)
        last = {b.name for b in op.domain if b.worker == SIZE - 1}
        rounded = {n: a.astype(np.float32) if n in last else a for n, a in state.items()}
        mixed = local_part(op.domain, rounded, RANK)
        expected = op({n: a.astype(np.float64) for n, a in rounded.items()})
        results = [mpi_backend.apply(op, mixed, comm=COMM) for _ in range(2)]
        mixed_counts = (digest.starts - loop[0], whole.starts - loop[1])
    finally:
        reducer.request, reducer.vector_request = digest.request, whole.request
    collective_assert(loop == (3, 0), f"a loop of 3 calls started (digest, whole vector) {loop}")
    collective_assert(mixed_counts == (2, 2), f"2 calls with a float32 rank started {mixed_counts}")
    problems = [same_blocks(result, expected, tuple(result), exact=True) for result in results]
    dtypes = {str(a.dtype) for result in results for a in result.values()}
    collective_assert(dtypes == {"float64"} and problems == [None, None], f"{dtypes} {problems}")


@pytest.mark.parametrize(("cores", "expected"), [({0}, True), (set(range(4096)), False)], ids=["one", "many"])
def test_oversubscription_is_ranks_on_the_node_against_the_union_of_their_cores(cores, expected, monkeypatch):
    monkeypatch.setattr(check.os, "sched_getaffinity", lambda pid: cores, raising=False)
    local = COMM.Split_type(MPI.COMM_TYPE_SHARED)
    on_node = local.Get_size()
    local.Free()
    found = check.oversubscribed(COMM)
    collective_assert(found == (expected and on_node > 1), f"{found} with {on_node} rank(s) on the node")


class _Logged:
    """A persistent request that logs its tests (and, through the patched ``sched_yield``,
    the yields between them) in one list."""

    def __init__(self, request, log: list[str]) -> None:
        self.request, self.log = request, log

    def Start(self) -> None:  # noqa: N802 - mpi4py's name
        self.request.Start()

    def Test(self) -> bool:  # noqa: N802 - mpi4py's name
        self.log.append("test")
        return bool(self.request.Test())


@pytest.mark.parametrize("control", [False, True], ids=["yielding", "control-busy"])
def test_a_late_peer_is_waited_for_by_the_yielding_poll(control, monkeypatch):
    """Forced oversubscribed (no busy tests, ``busy=0``): the last rank comes 20 ms late, and
    the others wait for it in wait_all, which yields the core from its first failed test on;
    every rank gets the maximum. Control: the busy start of a node with a core per rank
    (``busy`` a second here) tests without yielding until the peer comes."""
    reducer = _reducer()
    reducer.oversubscribed, reducer.spins, reducer.busy = True, range(0), 1.0 if control else 0.0
    log: list[str] = []
    monkeypatch.setattr(deadline.os, "sched_yield", lambda: log.append("yield"))
    reducer.request = _Logged(reducer.request, log)
    try:
        vector = np.full(VECTOR_LENGTH, RANK, dtype=np.int64)
        _load(reducer, vector)
        if RANK == SIZE - 1:
            time.sleep(0.02)
        reduced = reducer.reduce(TIMEOUT).copy()
    finally:
        reducer.request = reducer.request.request
        _free(reducer)
    collective_assert(bool(np.all(reduced == SIZE - 1)), f"reduced {reduced[:3]}...")
    early = RANK < SIZE - 1  # these waited 20 ms for the last rank
    first = log.index("yield") if "yield" in log else len(log)
    if control:
        collective_assert(not early or first == len(log), f"a yield after {first} of {len(log)} tests")
    else:
        collective_assert(not early or first <= 2, f"first yield after {first} test(s)")


def _stale_digest(self: CheckReducer, sent: bytes, digest: bytes) -> None:
    """The control: a digest write that leaves the buffer as it was (the other tree's digest)."""
    self.digest_of = sent


@pytest.mark.parametrize("control", [False, True], ids=["digest-written", "control-stale-digest"])
def test_a_tree_and_its_adjoint_in_turn_are_each_served_by_their_kept_run_and_stay_exact(
    control, monkeypatch
):
    """A loop applying an operator and its adjoint in turn on the same arrays: both plans'
    repeats serve the calls after the first, through their one-step records, apply remembers
    both trees (each plan found without the cache's lookup), and every result equals the numpy
    interpreter's. Each record writes its own digest before the reduction, so the loop reduces
    no whole vector; control: a record that leaves the other tree's digest in place makes
    every call's digests differ (still exact, through the whole vector)."""
    tensor = DistributedTensor("x", (12, 40), Partition((SIZE, 1)))
    op = HaloExchange(halo_geometry(tensor, Kernel(3, padding=1)))
    adjoint = op.H
    state = op.domain.random(8)
    local = local_part(op.domain, state, RANK)
    problem = None
    plans = [mpi_backend.plan_for(tree, comm=COMM) for tree in (op, adjoint)]
    reducer = plans[0].context.reducer
    whole = _Counted(reducer.vector_request) if SIZE > 1 else None
    for call in range(4):
        if call == 2 and whole is not None:  # both records built: count from here
            reducer.vector_request = whole
            if control:
                monkeypatch.setattr(CheckReducer, "write_digest", _stale_digest)
        for tree in (op, adjoint):
            state = tree(state)
            mpi_backend.apply(tree, local, comm=COMM, inplace=True)
            problem = problem or same_blocks(local, state, tuple(local), exact=True)
    if whole is not None:
        reducer.vector_request = whole.request
    remembered = [mpi_backend._LAST_PLAN[0] is adjoint, mpi_backend._PREVIOUS_PLAN[0] is op]
    collective_assert(all(remembered), f"apply's last two trees: {remembered}")
    hits = [plan.entry.last.hits for plan in plans]
    records = [plan.fast is not None for plan in plans]
    collective_assert(problem is None, str(problem))
    collective_assert(SIZE == 1 or (min(hits) >= 3 and all(records)), f"hits {hits} of 4 calls, {records}")
    starts = whole.starts if whole is not None else 0
    if control:
        collective_assert(SIZE == 1 or starts > 0, "the stale digest: no whole-vector reduction")
    else:
        collective_assert(starts == 0, f"{starts} whole-vector reductions in the loop")


@pytest.mark.parametrize("control", [False, True], ids=["yielding", "control-busy"])
def test_the_small_agreement_and_the_duplication_yield_on_an_oversubscribed_node(control, monkeypatch):
    """Forced oversubscribed (the context's reducer and the node as first found): the torch
    wrapper's small agreement (deadline.largest_within) and the duplication's barrier (a new
    communicator's first plan within a deadline) wait with no busy spin (``busy=0``), as the
    check's reduction does; every rank gets the maximum. Control: the constant busy start (as
    before) is seen."""
    from linop.backends.mpi import context

    seen: list[float] = []
    real = deadline.wait_all

    def recording(requests, comm, timeout, doing, *, busy=deadline.BUSY):
        seen.append(busy)
        real(requests, comm, timeout, doing, busy=busy)

    monkeypatch.setattr(deadline, "wait_all", recording)
    monkeypatch.setattr(check, "_FOUND", [True])
    if control:
        monkeypatch.setattr(context, "busy_for", lambda comm: deadline.BUSY)
        monkeypatch.setattr(context, "node_oversubscribed", lambda: False)
    private = context.context_for(COMM)
    monkeypatch.setattr(private.reducer, "busy", 0.0)
    largest = deadline.largest_within(private.comm, RANK, TIMEOUT, "the test's agreement")
    sub = COMM.Dup()
    try:
        context.context_for(sub, TIMEOUT)  # duplicated within the deadline: its barrier first
    finally:
        sub.Free()
    collective_assert(largest == SIZE - 1, f"the largest rank: {largest}")
    if control:
        collective_assert(SIZE == 1 or deadline.BUSY in seen, f"busy {seen}")
    else:
        collective_assert(SIZE == 1 or (len(seen) == 2 and set(seen) == {0.0}), f"busy {seen}")
