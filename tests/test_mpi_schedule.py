"""The MPI compiler without MPI: batching into phases, conflict rules, projection, fingerprints."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from linop import Add, Block, Copy, Move, SendRecv, Space
from linop.program import Phase, RankPhase, Transfer, compile_program, fingerprint, project

SPACE = Space([Block("a", (4, 4), 0), Block("b", (4, 4), 1), Block("c", (4, 4), 2)])


def phases(op) -> list[Phase]:
    return [s for s in compile_program(op).steps if isinstance(s, Phase)]


def test_independent_transfers_share_one_phase():
    op = SendRecv(SPACE["a"][0:1], SPACE["b"][0:1]) @ SendRecv(SPACE["b"][1:2], SPACE["c"][1:2])
    op = SendRecv(SPACE["c"][2:3], SPACE["a"][2:3]) @ op
    assert [len(p.transfers) for p in phases(op)] == [3]


def test_a_transfer_reading_what_another_wrote_starts_a_new_phase():
    first = SendRecv(SPACE["a"][0:1], SPACE["b"][0:1])
    second = SendRecv(SPACE["b"][0:1], SPACE["c"][0:1])  # reads b[0:1], written by the first
    assert [len(p.transfers) for p in phases(second @ first)] == [1, 1]


def test_a_transfer_overwriting_what_another_sends_starts_a_new_phase():
    first = SendRecv(SPACE["b"][0:1], SPACE["c"][0:1])
    second = SendRecv(SPACE["a"][0:1], SPACE["b"][0:1])  # writes b[0:1] while it is being sent
    assert [len(p.transfers) for p in phases(second @ first)] == [1, 1]


def test_adds_into_one_region_commute():
    first = Add(SPACE["a"][0:1], SPACE["c"][0:1])
    second = Add(SPACE["b"][0:1], SPACE["c"][0:1])
    assert [len(p.transfers) for p in phases(second @ first)] == [2]


def test_local_steps_are_deferred_behind_a_phase():
    op = SendRecv(SPACE["a"][0:1], SPACE["b"][0:1])
    op = Copy(SPACE["a"][2:3], SPACE["a"][3:4]) @ op  # local on worker 0, unrelated
    op = SendRecv(SPACE["c"][0:1], SPACE["a"][1:2]) @ op
    assert [len(p.transfers) for p in phases(op)] == [2]


def test_a_deferred_local_step_that_conflicts_ends_the_phase():
    op = SendRecv(SPACE["a"][0:1], SPACE["b"][0:1])
    op = Move(SPACE["b"][0:1], SPACE["b"][2:3]) @ op  # local on worker 1, reads what arrived
    op = SendRecv(SPACE["b"][2:3], SPACE["c"][0:1]) @ op  # must see the moved rows
    assert [len(p.transfers) for p in phases(op)] == [1, 1]


def test_projection_posts_receives_and_sends_with_matching_tags():
    op = SendRecv(SPACE["a"][0:1], SPACE["b"][0:1]) @ SendRecv(SPACE["b"][1:2], SPACE["a"][1:2])
    program = compile_program(op)
    (mine0,) = [s for s in project(program.steps, 0) if isinstance(s, RankPhase)]
    (mine1,) = [s for s in project(program.steps, 1) if isinstance(s, RankPhase)]
    assert {(peer, tag) for peer, tag, _ in mine0.sends} == {(1, tag) for _, tag, _ in mine1.receives}
    assert {(peer, tag) for peer, tag, _ in mine1.sends} == {(0, tag) for _, tag, _ in mine0.receives}
    assert project(program.steps, 2) == ()


def test_movement_nodes_map_onto_transfers():
    (t,) = phases(SendRecv(SPACE["a"], SPACE["b"]).H)[0].transfers
    assert (t.source.name, t.target.name, t.mode, t.after) == ("b", "a", "add", "clear")
    (t,) = phases(Move(SPACE["a"], Block("n", (4, 4), 2)))[0].transfers
    assert isinstance(t, Transfer) and (t.mode, t.after) == ("new", "drop")


MOVED = Space([Block("a", (4, 4), 0), Block("b", (4, 4), 2), Block("c", (4, 4), 2)])
RESHAPED = Space([Block("a", (4, 4), 0), Block("b", (5, 4), 1), Block("c", (4, 4), 2)])


@pytest.mark.parametrize(
    ("one", "other"),
    [
        (Copy(SPACE["a"][0:1], SPACE["b"][0:1]), Copy(MOVED["a"][0:1], MOVED["b"][0:1])),
        (Copy(SPACE["a"][0:1], SPACE["b"][0:1]), Copy(RESHAPED["a"][0:1], RESHAPED["b"][0:1])),
        (Copy(SPACE["a"][0], SPACE["b"][0]), Copy(SPACE["a"][0:1], SPACE["b"][0:1])),
        (2 * Copy(SPACE["a"][0:1], SPACE["b"][0:1]), 2.0 * Copy(SPACE["a"][0:1], SPACE["b"][0:1])),
    ],
    ids=["worker-of-a-block", "shape-of-a-block", "integer-index", "scalar-type"],
)
def test_fingerprints_tell_apart_what_changes_the_program(one, other):
    """Equal boxes on another layout (or of another kind) make another program: a fingerprint
    blind to them would let ranks run different programs (stray messages, hangs)."""
    assert fingerprint(one) != fingerprint(other)


def test_fingerprints_tell_trees_apart():
    one = SendRecv(SPACE["a"][0:1], SPACE["b"][0:1])
    other = SendRecv(SPACE["a"][1:2], SPACE["b"][0:1])
    assert fingerprint(one) == fingerprint(SendRecv(SPACE["a"][0:1], SPACE["b"][0:1]))
    assert fingerprint(one) != fingerprint(other)
    assert fingerprint(2 * one) != fingerprint(3 * one)
    assert fingerprint(one) != fingerprint(one.H)


@pytest.mark.timeout(60)
def test_fingerprints_do_not_depend_on_the_process():
    """Python's string hashing is randomized per process; the fingerprint must not be."""
    code = (
        "from linop import Block, SendRecv, Space;"
        "from linop.program import fingerprint;"
        "s = Space([Block('a', (4, 4), 0), Block('b', (4, 4), 1)]);"
        "print(fingerprint(2 * SendRecv(s['a'][0:1], s['b'][0:1]).H).hex())"
    )
    digests = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={"PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2", "3")
    }
    assert len(digests) == 1


def pairwise_batch(steps):
    """The batching rule checked against every gathered step (the reference for ``batch``,
    which only checks the steps that share a block)."""
    from linop.program import Local

    out, phase, deferred = [], [], []
    for step in steps:
        if isinstance(step, Transfer):
            fp = step.footprint
            gathered = [t.footprint for t in phase] + [d.footprint for d in deferred]
            if any(earlier.conflicts(fp) for earlier in gathered):
                out.append(("phase", tuple(phase)))
                out.extend(("local", d) for d in deferred)
                phase, deferred = [], []
            phase.append(step)
        elif isinstance(step, Local) and phase:
            deferred.append(step)
        else:
            if phase:
                out.append(("phase", tuple(phase)))
            out.extend(("local", d) for d in deferred)
            phase, deferred = [], []
            out.append(("local", step))
    if phase:
        out.append(("phase", tuple(phase)))
    out.extend(("local", d) for d in deferred)
    return out


@st.composite
def movement_sequences(draw):
    nodes = []
    for _ in range(draw(st.integers(1, 12))):
        src_block, dst_block = draw(st.sampled_from(["a", "b", "c"])), draw(st.sampled_from(["a", "b", "c"]))
        rows = draw(st.sampled_from([(0, 1), (1, 3), (2, 4), (0, 4)]))
        other = draw(st.sampled_from([(0, 1), (1, 3), (2, 4), (0, 4)]))
        src = SPACE[src_block][rows[0] : rows[1]]
        length = rows[1] - rows[0]
        start = other[0] if other[0] + length <= 4 else 0
        dst = SPACE[dst_block][start : start + length]
        if src.overlaps(dst):
            continue
        kind = draw(st.sampled_from([Copy, Add, Move]))
        if kind is Copy and src.worker != dst.worker:
            kind = SendRecv
        nodes.append(kind(src, dst))
    if not nodes:
        nodes.append(SendRecv(SPACE["a"][0:1], SPACE["b"][0:1]))
    op = nodes[0]
    for node in nodes[1:]:
        op = node @ op
    return op


@settings(max_examples=80, deadline=None)
@given(movement_sequences())
def test_indexed_batching_equals_the_pairwise_rule(op):
    from linop.program import batch, lower

    steps = lower(op)
    indexed = [("phase", s.transfers) if isinstance(s, Phase) else ("local", s) for s in batch(steps)]
    assert indexed == pairwise_batch(steps)


def test_each_nested_halo_stage_is_one_phase_at_scale():
    from linop import DistributedTensor, HaloExchange, Kernel, Partition, halo_geometry

    tensor = DistributedTensor("x", (64, 64), Partition.grid((8, 8)))
    exchange = HaloExchange(halo_geometry(tensor, Kernel(3, padding=1)))
    assert [len(p.transfers) for p in phases(exchange)] == [112, 112]
