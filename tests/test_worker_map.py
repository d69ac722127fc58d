"""Worker-to-rank maps without MPI: validation errors, the schedules' messages agreeing between
ranks, and 16 workers on one rank run with local moves only, equal to the numpy interpreter."""

from __future__ import annotations

import numpy as np
import pytest

from linop.backends import numpy as numpy_backend
from linop.backends.mpi.mapping import compile_mapped, compiled_for
from linop.backends.mpi.runtime import run_schedule
from linop.collectives import AllReduce, BlockGrid, Broadcast
from linop.errors import CommunicatorError, LinopError, WorkerMapError
from linop.halo import HaloExchange, halo_windows
from linop.halo_geometry import Kernel, halo_geometry
from linop.partition import DistributedTensor, Partition
from linop.program import LocalMoves, RankBranches, RankPhase, WorkerMap
from linop.repartition import Repartition

WORKERS = 16


def _tensor(name="x", grid=(4, 4)):
    return DistributedTensor(name, (11, 9), Partition(grid))


CASES = {
    "halo": lambda: HaloExchange(halo_geometry(_tensor(), Kernel(3, padding=1))),
    "halo_windows": lambda: halo_windows(_tensor(), Kernel(3, padding=1)),
    "broadcast": lambda: Broadcast(DistributedTensor("x", (7,), Partition((1,))), Partition((16,)), "y"),
    "all-reduce": lambda: AllReduce(BlockGrid.uniform("x", Partition((4, 4)), (3, 2)), (0, 1)),
    "repartition": lambda: Repartition(_tensor(), _tensor("z", (2, 8))),
    "sum": lambda: (
        2 * HaloExchange(halo_geometry(_tensor(), Kernel(3, padding=1)))
        + HaloExchange(halo_geometry(_tensor(), Kernel(3, padding=1)))
    ),
}


@pytest.mark.parametrize(
    "ranks, problem",
    [
        ([0, -1], "worker 1 maps to -1"),
        ([0, True], "worker 1 maps to True"),
        ([0, 1.0], "worker 1 maps to 1.0"),
        ({-2: 0}, "worker -2"),
        ({"a": 0}, "worker 'a'"),
        ("0123", "not str"),
        (7, "not int"),
    ],
    ids=["negative", "bool", "float", "negative-worker", "str-worker", "string", "int"],
)
def test_malformed_maps_raise_a_typed_error(ranks, problem):
    with pytest.raises(WorkerMapError, match=problem) as caught:
        WorkerMap(ranks)
    assert isinstance(caught.value, (CommunicatorError, LinopError, ValueError))


def test_round_robin_blocked_and_lookup():
    assert WorkerMap.round_robin(16, 3).workers_on(2) == (2, 5, 8, 11, 14)
    assert WorkerMap.blocked(16, 3).workers_on(2) == (11, 12, 13, 14, 15)
    assert WorkerMap.blocked(16, 4) == WorkerMap({w: w // 4 for w in range(16)})
    assert hash(WorkerMap.blocked(16, 4)) == hash(WorkerMap([w // 4 for w in range(16)]))
    assert WorkerMap.blocked(16, 4) != WorkerMap.round_robin(16, 4)
    assert WorkerMap.blocked(16, 4).description() != WorkerMap.round_robin(16, 4).description()
    assert WorkerMap.of([0, 0]).rank_of(1) == 0
    with pytest.raises(WorkerMapError, match="worker 2 of the tree is not in the worker map"):
        WorkerMap([0, 0]).rank_of(2)


@pytest.mark.parametrize(
    "mapping, size, problem",
    [
        (WorkerMap({w: 0 for w in range(16) if w != 9}), 1, "worker 9 of the tree is not in the worker map"),
        (
            WorkerMap([3 if w == 6 else 0 for w in range(16)]),
            3,
            "puts worker 6 on rank 3, but the communicator has 3",
        ),
    ],
    ids=["worker-missing", "rank-out-of-range"],
)
def test_maps_that_do_not_fit_the_tree_or_communicator(mapping, size, problem):
    op = CASES["halo"]()
    with pytest.raises(WorkerMapError, match=problem):
        compile_mapped(op, mapping, 0, size)


def _messages(schedule, rank, out):
    """(kind, peer, tag, shape) of every message of a schedule, in order (sums included)."""
    for step in schedule:
        if type(step) is RankPhase:
            out.extend(("recv", peer, tag, t.shape) for peer, tag, t in step.receives)
            out.extend(("send", peer, tag, t.shape) for peer, tag, t in step.sends)
        elif type(step) is RankBranches:
            for term in step.terms:
                _messages(term, rank, out)
    return out


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("kind", ["round-robin", "blocked"])
def test_messages_agree_between_ranks(case, size, kind):
    """What rank a sends to rank b, b receives from a: the same tags and shapes in the same
    order; no rank messages itself; tags of a pair are distinct."""
    op = CASES[case]()
    mapping = getattr(WorkerMap, kind.replace("-", "_"))(WORKERS, size)
    schedules = {r: compile_mapped(op, mapping, r, size).schedule for r in range(size)}
    messages = {r: _messages(schedules[r], r, []) for r in range(size)}
    for a in range(size):
        assert all(peer != a for _, peer, _, _ in messages[a])
        for b in range(size):
            sent = [(tag, shape) for kind_, peer, tag, shape in messages[a] if kind_ == "send" and peer == b]
            got = [(tag, shape) for kind_, peer, tag, shape in messages[b] if kind_ == "recv" and peer == a]
            assert sorted(sent) == sorted(got)
            assert len({tag for tag, _ in sent}) == len(sent)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("adjoint", [False, True], ids=["forward", "adjoint"])
def test_sixteen_workers_on_one_rank_equal_numpy(case, adjoint):
    """All 16 workers on rank 0: the schedule has no messages (every transfer a local move)
    and equals the numpy interpreter exactly."""
    op = CASES[case]()
    op = op.H if adjoint else op
    mapping = WorkerMap([0] * WORKERS)
    schedule = compile_mapped(op, mapping, 0, 1).schedule
    assert not _messages(schedule, 0, [])
    if case == "all-reduce":  # native under a map: the rank sums its members locally
        assert [type(step).__name__ for step in schedule] == ["_RankMappedAllReduce"]
    elif case == "broadcast":  # native under a map: the rank fills (or sums) its copies locally
        assert [type(step).__name__ for step in schedule] == ["_RankMappedRooted"]
    elif case != "sum":
        assert any(type(step) is LocalMoves for step in schedule)
    state = op.domain.random(3, dtype=np.int64)
    before = {n: a.copy() for n, a in state.items()}
    work = numpy_backend.Workspace(dict(state), set(), np.dtype(np.int64))
    run_schedule(schedule, work, None, np.dtype(np.int64))  # type: ignore[arg-type]
    expected = op(state)
    assert sorted(work.arrays) == sorted(b.name for b in op.range)
    for name, want in expected.items():
        np.testing.assert_array_equal(work.arrays[name], want)
    assert all(np.array_equal(before[n], state[n]) for n in state)


def test_compilation_is_kept_per_tree_and_map():
    op = CASES["halo"]()
    mapping = WorkerMap.blocked(WORKERS, 4)
    assert compiled_for(op, mapping) is compiled_for(op, WorkerMap.blocked(WORKERS, 4))
    assert (
        compiled_for(op, mapping).fingerprint
        != compiled_for(op, WorkerMap.round_robin(WORKERS, 4)).fingerprint
    )
    assert (
        compiled_for(op, mapping).tree_fingerprint
        == compiled_for(op, WorkerMap.round_robin(16, 4)).tree_fingerprint
    )
