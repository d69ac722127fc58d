"""Fused movement steps on host memory (:mod:`linop.backends.host_fusion`) against the steps
they replace, run one at a time by the numpy interpreter: the same blocks, dtypes and values,
entry by entry on integers. ``np.empty`` is poisoned during the runs (filled with 7s), so no
fused step is right by the luck of fresh zero pages."""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from linop import Block, Copy, DistributedTensor, Kernel, Partition, Space, expand_all
from linop.backends import host_fusion
from linop.backends import numpy as numpy_backend
from linop.backends.host_fusion import (
    AddBackAndDrop,
    AllocateAndCopy,
    AllocateAndCopyBack,
    FusedStep,
    HoistedCopyBack,
    HostOverlap,
    fused,
)
from linop.backends.host_schedule import finish_phase, run_rank_schedule
from linop.layers import Convolution
from linop.operator import Composition, LinearOperator
from linop.primitives import Allocate, Deallocate
from linop.program import RankOverlap, RankPhase, compile_for_rank
from verify import strategies as lst

_real_empty = np.empty


@pytest.fixture(autouse=True)
def poisoned_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    def empty(shape: Any, dtype: Any = float, **kwargs: Any) -> np.ndarray:
        array = _real_empty(shape, dtype=dtype, **kwargs)
        array.fill(7)
        return array

    monkeypatch.setattr(np, "empty", empty)


def _nodes(op: LinearOperator) -> Iterator[LinearOperator]:
    """The tree's nodes in the order they run (compositions flattened)."""
    if isinstance(op, Composition):
        for factor in reversed(op.factors):
            yield from _nodes(factor)
    else:
        yield op


def _never(step: Any, work: Any) -> None:
    raise AssertionError(f"unexpected step {step!r}")


def _run(schedule: Any, state: dict[str, np.ndarray], dtype: Any = np.int64) -> dict[str, np.ndarray]:
    work = numpy_backend.Workspace(dict(state), set(), np.dtype(dtype))
    run_rank_schedule(schedule, work, np.dtype(dtype), phase=_never, part=_never)
    return work.arrays


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(
        a[n].dtype == b[n].dtype and a[n].shape == b[n].shape and np.array_equal(a[n], b[n]) for n in a
    )


def _fused_kinds(schedule: tuple[Any, ...]) -> list[type]:
    kinds = []
    for step in schedule:
        if isinstance(step, HostOverlap):
            kinds += _fused_kinds(step.during)
        elif isinstance(step, FusedStep):
            kinds.append(type(step))
    return kinds


SPACE = Space([Block("a", (4, 5)), Block("t", (2, 3))])
GROWN = Allocate(SPACE, Block("c", (4, 5)))
WITH_B = Allocate(SPACE, Block("b", (2, 3)))
COPY_BACK = Copy(WITH_B.range["b"], WITH_B.range["a"][1:3, 2:5]).H  # C*[b <- a[1:3, 2:5]]
ADD_BACK = Copy(SPACE["t"], SPACE["a"][1:3, 2:5]).H  # C*[t <- a[1:3, 2:5]]
FILLED = [GROWN, Copy(GROWN.range["a"], GROWN.range["c"])]  # c: a copy of a, allocated here
C_BACK = Copy(
    Allocate(GROWN.range, Block("b", (2, 3))).range["b"],
    GROWN.range.with_block(Block("b", (2, 3)))["c"][1:3, 2:5],
).H
RULES = {
    "allocate and copy": [GROWN, Copy(GROWN.range["a"][0:2, 0:3], GROWN.range["c"][1:3, 2:5])],
    "allocate and copy back": [WITH_B, COPY_BACK],
    "allocate, copy back, drop": [WITH_B, COPY_BACK, Deallocate(COPY_BACK.range, "a")],
    "add back and drop": [ADD_BACK, Deallocate(ADD_BACK.range, "a")],
    "copy back from a block of the run's": [*FILLED, Allocate(GROWN.range, Block("b", (2, 3))), C_BACK],
    "... then dropped": [
        *FILLED,
        Allocate(GROWN.range, Block("b", (2, 3))),
        C_BACK,
        Deallocate(C_BACK.range, "c"),
    ],
}
KINDS = {
    "allocate and copy": [AllocateAndCopy],
    "allocate and copy back": [AllocateAndCopyBack],
    "allocate, copy back, drop": [AllocateAndCopyBack],
    "add back and drop": [AddBackAndDrop],
    "copy back from a block of the run's": [AllocateAndCopy, AllocateAndCopyBack],
    "... then dropped": [AllocateAndCopy, AllocateAndCopyBack],
}


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.float32])
def test_each_rule_fuses_and_gives_the_steps_results(rule: str, dtype: Any) -> None:
    """Each rule fires on its pattern, and the fused step leaves the state the nodes leave,
    including the dtype a narrower input is widened to (int32 blocks in an int64 run)."""
    schedule = tuple(RULES[rule])
    steps = fused(schedule)
    assert _fused_kinds(steps) == KINDS[rule]
    lent = [s.lend for s in steps if isinstance(s, AllocateAndCopyBack)]
    assert lent == ([True] if rule == "... then dropped" else [False] * len(lent))  # the run's own, dropped
    rng = np.random.default_rng(3)
    state = {"a": rng.integers(-9, 10, (4, 5)).astype(dtype), "t": rng.integers(-9, 10, (2, 3)).astype(dtype)}
    before = {n: v.copy() for n, v in state.items()}
    expected = _run(schedule, state)
    assert _same(_run(steps, state), expected)
    assert _same(state, before)  # the caller's arrays are never written


def test_patterns_that_do_not_fuse_are_left_as_they_are() -> None:
    """A copy into a block other than the one just allocated, a copy back whose read block is
    not the one dropped next (or not next), a copy back into a block other than the one just
    allocated: no fusion (the same tuple back)."""
    elsewhere = Allocate(GROWN.range, Block("d", (4, 5)))
    cases = [
        (elsewhere, Copy(elsewhere.range["a"][0:2, 0:3], elsewhere.range["c"][1:3, 2:5])),
        (ADD_BACK, Deallocate(ADD_BACK.range, "t")),
        (
            ADD_BACK,
            Copy(ADD_BACK.range["a"][0:2, 0:3], "e"),
            Deallocate(ADD_BACK.range.with_block(Block("e", (2, 3))), "a"),
        ),
        (GROWN, Copy(GROWN.range["t"], GROWN.range["c"][0:2, 0:3]).H),
    ]
    for schedule in cases:
        assert fused(schedule) is schedule


def test_a_fused_step_that_skips_the_zeros_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: without the zeros around the copied region, the poisoned ``np.empty``
    shows through, and the comparison above fails."""
    schedule = tuple(RULES["allocate and copy"])
    state = {"a": np.arange(20).reshape(4, 5), "t": np.zeros((2, 3), np.int64)}
    expected = _run(schedule, state)
    monkeypatch.setattr(host_fusion, "around", lambda shape, start, stop: [])
    assert not _same(_run(fused(schedule), state), expected)


def _layer_schedules(shape: tuple[int, ...]) -> list[tuple[Any, ...]]:
    """One worker's overlapped convolution schedules, forward and adjoint (no messages)."""
    x = DistributedTensor("x", shape, Partition((1, 1, 1, 1)))
    layer = Convolution(x, 2, Kernel(3, padding=1), bias=False)
    w = np.random.default_rng(2).integers(-2, 3, layer.weights.global_shape)
    tree = layer.input_operator(w, overlap=True)
    return [compile_for_rank(op, 0).schedule for op in (tree, tree.H)]


def test_a_convolution_window_fuses_its_fills_and_copies_and_gives_the_same_blocks() -> None:
    """One worker's overlapped convolution: the padded block and the interior window are
    filled around their copies, the adjoint's interior gradient is added back and dropped
    uncleared, and the bulk's gradient copied out; the same blocks as the node-by-node run,
    forward and adjoint, and alike with the interior's steps run while a phase is in flight (a
    :class:`~linop.program.RankOverlap`, fused inside), as a rank with neighbours runs them."""
    expected_kinds = ([AllocateAndCopy, AllocateAndCopy], [AddBackAndDrop, AllocateAndCopyBack])
    for adjoint, schedule in enumerate(_layer_schedules((2, 3, 7, 6))):
        first = next(s for s in schedule if isinstance(s, LinearOperator))
        rng = np.random.default_rng(adjoint)
        state = {b.name: rng.integers(-9, 10, b.shape) for b in first.domain}
        a, b = ((3, 6), (1, 4))[adjoint]  # where the rank's phase starts and ends
        in_flight = (*schedule[:a], RankOverlap(None, tuple(schedule[a:b])), *schedule[b:])
        for variant in (schedule, in_flight):
            steps = fused(variant)
            assert _fused_kinds(steps) == expected_kinds[adjoint]
            assert _same(_run(steps, state), _run(variant, state))
        assert any(isinstance(s, HostOverlap) for s in fused(in_flight))
        if adjoint:  # the bulk's gradient: a view of the padded block, allocated in the run
            (back,) = [s for s in fused(schedule) if isinstance(s, AllocateAndCopyBack)]
            assert back.lend
            result = _run(fused(schedule), state)[back.allocate.block.name]
            assert not result.flags.c_contiguous and result.base is not None


def test_a_copy_back_from_the_callers_block_is_a_copy() -> None:
    """A block the schedule did not allocate (the caller's, or renamed onto its name) is never
    lent: the result is a copy, and the caller's array is left as it was."""
    schedule = tuple(RULES["allocate, copy back, drop"])
    (step,) = fused(schedule)
    assert isinstance(step, AllocateAndCopyBack) and not step.lend
    grown = Allocate(SPACE, Block("s", (4, 5)))
    lent = fused((grown, *(n for n in _nodes(Copy(grown.range["a"], grown.range["s"]))), *schedule))
    assert [s.lend for s in lent if isinstance(s, AllocateAndCopyBack)] == [False]


@st.composite
def fusable_schedules(draw: st.DrawFn) -> tuple[Space, tuple[LinearOperator, ...]]:
    """A space and a schedule on it: the rules' patterns on random boxes of random blocks
    (a copy into a block just allocated, a copy back into one, dropped or not, a copy back
    into a block made earlier then the read block dropped), between random in-place
    movements; ``(domain, nodes in the order they run)``."""
    space = start = draw(lst.spaces(min_blocks=1, max_blocks=3, min_side=1))
    names = (f"n{i}" for i in itertools.count())
    steps: list[LinearOperator] = []
    for _ in range(draw(st.integers(1, 6))):
        if not len(space):
            break
        kind = draw(st.sampled_from(["allocate and copy", "copy back", "add back and drop", "movement"]))
        if kind == "movement":
            step: LinearOperator = draw(lst.endomorphisms(space))
            steps.append(step)
            continue
        read = space[draw(st.sampled_from(space.names))]
        box = draw(lst.regions(Space([read.block])))
        index = tuple(slice(a, b) for a, b in zip(box.start, box.stop))
        new = next(names)
        if kind == "allocate and copy":
            grow = Allocate(space, Block(new, read.shape, read.block.worker))
            steps += [grow, Copy(grow.range[read.name][index], grow.range[new][index])]
            space = grow.range
            continue
        if kind == "copy back":
            grow = Allocate(space, Block(new, box.shape, read.block.worker))
            back = Copy(grow.range[new], grow.range[read.name][index]).H
            steps += [grow, back]
        else:
            made = Copy(space[read.name][index], new)
            back = Copy(made.range[new], made.range[read.name][index]).H
            steps += [made, back]
        space = back.range
        if kind == "add back and drop" or draw(st.booleans()):
            drop = Deallocate(space, read.name)
            steps.append(drop)
            space = drop.range
    return start, tuple(steps)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fusable_schedules(), st.sampled_from([np.int64, np.int32]))
def test_random_schedules_run_fused_as_node_by_node(case: tuple[Space, tuple[Any, ...]], dtype: Any) -> None:
    """Random schedules of the fusable patterns between other movements: fused and node by
    node, the same blocks, dtypes and values (the caller's arrays untouched)."""
    domain, schedule = case
    state = {name: array.astype(dtype) for name, array in domain.random(1, np.int64).items()}
    before = {n: v.copy() for n, v in state.items()}
    assert _same(_run(fused(schedule), state), _run(schedule, state))
    assert _same(state, before)


TREES = lst.operators(max_depth=6, max_leaves=10)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(TREES)
def test_random_trees_expanded_into_primitives_run_fused_as_node_by_node(op: LinearOperator) -> None:
    """Random trees, expanded into their primitives and run as one schedule: fused and
    node by node, the same blocks (integers)."""
    schedule = tuple(_nodes(expand_all(op)))
    state = op.domain.random(1, np.int64)
    assert _same(_run(fused(schedule), state), _run(schedule, state))


def _run_ranks(
    schedules: list[tuple[Any, ...]], states: list[dict[str, np.ndarray]], dtype: Any = np.int64
) -> list[dict[str, np.ndarray]]:
    """Every rank's schedule on its own thread, the phases' messages through queues (sends
    never wait): the blocks each rank ends with."""
    boxes: dict[tuple[int, int, int], queue.Queue[np.ndarray]] = {}
    results: list[Any] = [None] * len(schedules)

    def box(key: tuple[int, int, int]) -> queue.Queue[np.ndarray]:
        return boxes.setdefault(key, queue.Queue())

    def rank_run(rank: int) -> None:
        work = numpy_backend.Workspace(dict(states[rank]), set(), np.dtype(dtype))

        def phase(step: RankPhase, work: Any) -> None:
            for peer, tag, t in step.sends:
                box((rank, peer, tag)).put(np.array(work.arrays[t.source.name][step.index(t.source)]))
            finish = [(t, box((peer, rank, tag)).get(timeout=30)) for peer, tag, t in step.receives]
            finish_phase(step, work, finish, np.dtype(dtype))

        try:
            run_rank_schedule(schedules[rank], work, np.dtype(dtype), phase=phase, part=_never)
            results[rank] = work.arrays
        except BaseException as error:  # reported by the caller
            results[rank] = error

    threads = [threading.Thread(target=rank_run, args=(r,)) for r in range(len(schedules))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


@pytest.mark.parametrize(
    ("shape", "grid", "kernel"),
    [
        ((2, 3, 8, 8), (1, 1, 2, 2), Kernel(3, 2, 1)),
        ((1, 2, 11, 7), (1, 1, 3, 3), Kernel(3, 1, 1)),
        ((2, 2, 13), (1, 2, 3), Kernel(5, 2, 2)),
    ],
    ids=["2x2", "3x3-uneven", "1d"],
)
def test_a_window_adjoint_copies_its_core_out_before_the_phases(shape, grid, kernel) -> None:
    """The adjoint of a max pool's halo windows on every rank: the core's copy out of the
    incoming window gradient moved before the phases (:class:`HoistedCopyBack`), which then add
    into the result and send the strips straight from the caller's array, uncleared. Run on
    all ranks (threads, messages through queues) on read-only caller arrays: the same blocks
    as the schedules run node by node, and the window gradient never made writable (copied
    whole), which the node-by-node run does (the control). On 2 x 2 one rank forwards a
    corner (a receive straddles its core: the window made the run's own from its strips alone),
    on 3 x 3 most do; in 1-d none does (the caller's window only read)."""
    from linop.layers import MaxPoolJacobian

    x = DistributedTensor("x", shape, Partition(grid))
    op = MaxPoolJacobian(x, kernel).window_operator.H
    ranks = max(b.worker for b in op.domain) + 1
    schedules = [compile_for_rank(op, r).schedule for r in range(ranks)]
    rng = np.random.default_rng(5)
    states = []
    for r in range(ranks):
        state = {b.name: rng.integers(-9, 10, b.shape) for b in op.domain if b.worker == r}
        for array in state.values():
            array.flags.writeable = False
        states.append(state)
    callers = {id(a) for state in states for a in state.values()}
    copied: list[str] = []  # blocks made writable while they held a caller's array
    writable = numpy_backend.Workspace.writable

    def spy(self: Any, name: str, dtype: Any = None) -> np.ndarray:
        if id(self.arrays[name]) in callers:
            copied.append(name)
        return writable(self, name, dtype)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(numpy_backend.Workspace, "writable", spy)
        expected = _run_ranks(schedules, states)
        copied_before = set(copied)
        copied.clear()
        fused_schedules = [fused(s) for s in schedules]
        got = _run_ranks(fused_schedules, states)
        copied_after = set(copied)
    assert all(_same(g, e) for g, e in zip(got, expected))
    assert all(any(isinstance(s, HoistedCopyBack) for s in steps) for steps in fused_schedules)
    assert copied_before and not copied_after


def test_a_hoisted_copy_back_that_forgets_a_straddling_receive_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The control: the 3 x 3 grid's windows (halos on both sides, corners forwarded through
    a neighbour's strip, so receives straddle the core) run with :class:`AddIntoCopy` doing
    nothing differ from the node-by-node run."""
    from linop.layers import MaxPoolJacobian

    x = DistributedTensor("x", (1, 2, 11, 7), Partition((1, 1, 3, 3)))
    op = MaxPoolJacobian(x, Kernel(3, 1, 1)).window_operator.H
    schedules = [compile_for_rank(op, r).schedule for r in range(9)]
    rng = np.random.default_rng(6)
    states = [{b.name: rng.integers(-9, 10, b.shape) for b in op.domain if b.worker == r} for r in range(9)]
    expected = _run_ranks(schedules, states)
    monkeypatch.setattr(host_fusion.AddIntoCopy, "run", lambda self, work: None)
    got = _run_ranks([fused(s) for s in schedules], states)
    assert not all(_same(g, e) for g, e in zip(got, expected))
