"""The engines' edge, one process (issue 41): sizes refused before memory runs out, ranks that
are no ranks, torch functions that cannot be lifted. Each case failed before its fix (a bare
MemoryError, an empty schedule, torch's raw RuntimeError)."""

from __future__ import annotations

import tracemalloc
from collections.abc import Mapping, Sequence

import pytest

from linop import Block, Copy, Space
from linop.errors import LinopError, RankError, WorkerMapError
from linop.program import WorkerMap, compile_for_rank
from linop.program.workers import MAX_MAP_WORKERS


class _Huge(Sequence[int]):
    """A sequence of 2**30 ranks that lists nothing until asked (as a lazy user type would)."""

    def __len__(self) -> int:
        return 1 << 30

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            raise TypeError("no slices")
        if not 0 <= index < len(self):
            raise IndexError(index)
        return index % 4


class _HugeMapping(Mapping[int, int]):
    def __len__(self) -> int:
        return 1 << 30

    def __getitem__(self, key: int) -> int:
        return key % 4

    def __iter__(self):
        return iter(range(len(self)))


def test_the_identity_map_of_a_billion_workers_is_described_not_listed():
    tracemalloc.start()
    mapping = WorkerMap(range(1 << 30))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1 << 20, f"{peak} bytes allocated"
    assert mapping == WorkerMap.blocked(1 << 30, 1 << 30) and mapping.rank_of(12345) == 12345
    assert WorkerMap.of(range(3)) == WorkerMap([0, 1, 2])  # control: small ones agree


@pytest.mark.parametrize(
    "table", [_Huge(), _HugeMapping(), range(0, 1 << 31, 2)], ids=["sequence", "dict", "range-step-2"]
)
def test_a_table_of_a_billion_workers_is_refused_before_it_is_listed(table):
    tracemalloc.start()
    with pytest.raises(WorkerMapError, match=f"MAX_MAP_WORKERS = {MAX_MAP_WORKERS}.*WorkerMap.blocked"):
        WorkerMap(table)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1 << 20, f"{peak} bytes allocated"


def test_a_mapped_plan_with_a_billion_workers_is_refused_as_a_map():
    """A mapped apply takes ``mapping=`` through ``WorkerMap.of``: a listed table of 2**30
    workers is a typed error there too, before any MemoryError."""
    with pytest.raises(WorkerMapError, match="at most MAX_MAP_WORKERS"):
        WorkerMap.of(_Huge())


def _copy():
    space = Space([Block("x", (2,)), Block("y", (2,), worker=1)])
    return Copy(space["x"], space["y"])


@pytest.mark.parametrize("rank", [-1, "0", True, 1.0])
def test_compile_for_rank_refuses_a_rank_that_is_no_rank(rank):
    with pytest.raises(RankError, match="rank must be a non-negative integer"):
        compile_for_rank(_copy(), rank)


def test_compile_for_rank_refuses_a_rank_beyond_the_size_given():
    with pytest.raises(RankError, match="rank 2 is not one of the 2 rank"):
        compile_for_rank(_copy(), 2, size=2)
    with pytest.raises(RankError, match="size must be a positive"):
        compile_for_rank(_copy(), 0, size=0)
    assert compile_for_rank(_copy(), 1, size=2).schedule  # control: rank 1 receives
    assert compile_for_rank(_copy(), 5).schedule == ()  # a rank beyond every worker holds none
    assert issubclass(RankError, LinopError) and issubclass(RankError, ValueError)


# -- lifting torch functions that autograd cannot follow ---------------------------------------
def test_lifting_a_torch_function_that_detaches_is_a_lift_error():
    torch = pytest.importorskip("torch")
    from verify.lift import LiftError, lift

    with pytest.raises(LiftError, match=r"output block\(s\) \['y'\] do not depend on the input"):
        lift(lambda x: x.detach() * 2, {"x": (4,)}, {"y": (4,)}, framework="torch")
    assert lift(lambda x: x * 2, {"x": (4,)}, {"y": (4,)}, framework="torch")  # control
    del torch


@pytest.mark.parametrize("how", ["mul_", "setitem"])
@pytest.mark.parametrize("claimed", [False, True], ids=["autograd", "adjoint-given"])
def test_lifting_a_torch_function_that_writes_its_input_is_a_lift_error(how, claimed):
    pytest.importorskip("torch")
    from verify.lift import LiftError, lift

    def writes(x):
        if how == "mul_":
            x.mul_(2)
            return x
        x[0] = 5
        return x * 1

    with pytest.raises(LiftError, match=r"writes into its input \(blocks \['x'\]\) in place"):
        lift(
            writes,
            {"x": (4,)},
            {"y": (4,)},
            framework="torch",
            adjoint=(lambda y: y * 2) if claimed else None,
        )


# -- deadlines: infinite and huge mean none, on both engines ------------------------------------
@pytest.mark.parametrize("value", [float("inf"), 1e300, 1e10, "inf", "1e300"])
def test_an_infinite_or_huge_deadline_is_none_on_both_engines(value, monkeypatch):
    from linop.backends.mpi import deadline

    assert deadline.resolve_timeout(value) is None
    pytest.importorskip("torch")
    from linop.backends.torch_distributed.group import resolve_timeout

    if isinstance(value, str):
        monkeypatch.setenv("LINOP_TIMEOUT", value)
        assert resolve_timeout(None) is None
    else:
        assert resolve_timeout(value) is None
    assert resolve_timeout(5) == 5.0 and deadline.resolve_timeout(5) == 5.0  # control


def test_shutdown_destroys_the_sub_groups_linop_made_and_only_those(monkeypatch):
    """Issue 41: the process groups linop creates are destroyed at exit (``atexit``), before
    torch's teardown; the user's groups (the context's own group) are left alone. Checked with
    stand-in groups: two processes make no sub-group (only 1 < ranks < size do)."""
    pytest.importorskip("torch")
    import torch.distributed as dist

    from linop.backends.torch_distributed import group as groups

    destroyed = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", lambda sub=None: destroyed.append(sub))
    context = groups.GroupContext.__new__(groups.GroupContext)
    held = {name: groups._Strong(name) for name in ("the user's group", "sub 01", "sub 23")}
    context._group = held["the user's group"]
    context._subgroups = {
        (0, 1): held["sub 01"],
        (0, 1, 2, 3): held["the user's group"],
        (2, 3): held["sub 23"],
    }
    monkeypatch.setattr(groups, "_CONTEXTS", {1: (held["the user's group"], context)})
    assert groups.shutdown() == 2
    assert destroyed == ["sub 01", "sub 23"] and not groups._CONTEXTS and not context._subgroups
    assert groups.shutdown() == 0  # idempotent
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    assert groups.shutdown() == 0


@pytest.mark.parametrize(
    ("text", "expected"),
    [(None, 600.0), ("", 600.0), (" OFF ", None), ("0", None), ("none", None), ("inf", None), ("30", 30.0)],
    ids=["unset", "empty", "off", "zero", "none", "inf", "30"],
)
def test_the_default_deadline_is_600_s_on_both_engines_and_off_switches_it_off(text, expected, monkeypatch):
    """Issue 41: no job waits forever by default (before: unset meant no deadline, and on MPI a
    rank that never arrived held every other rank until the job was killed)."""
    from linop.backends import host_deadline
    from linop.backends.mpi import deadline

    assert host_deadline.DEFAULT_SECONDS == 600.0
    if text is None:
        monkeypatch.delenv("LINOP_TIMEOUT", raising=False)
    else:
        monkeypatch.setenv("LINOP_TIMEOUT", text)
    monkeypatch.setattr(deadline, "_default", deadline._UNSET)  # read once per process: read again
    assert deadline.resolve_timeout(None) == expected
    assert deadline.resolve_timeout(7) == 7.0  # an explicit timeout= wins
    pytest.importorskip("torch")
    from linop.backends.torch_distributed.group import resolve_timeout

    assert resolve_timeout(None) == expected
    assert resolve_timeout(7) == 7.0
