"""The lowering of trees onto JAX devices (``linop.backends.jax.shard``), proven in a
subprocess: JAX's host device count must be set before JAX is imported, so
``tests/jax_devices/check_lowering.py D K1 K2 ...`` (not collected by pytest) runs with D host
devices under a timeout and proves every check for each device count K on a mesh over the
first K of them. In CI one process of 4 devices proves the counts 1 and 4 (Python, the JAX
import and XLA's warm-up paid once, not once per count); with ``LINOP_LONG=1`` the count 2 too,
a second process of 8 devices proves the count 8, and every count draws more examples. A second process proves
the count 4 again with ``jax_enable_x64`` on (``JAX_ENABLE_X64=1``: index arithmetic, float64
transposes, integer sums widened to int64), the count whose checks cover every family (the 2 x
2 mesh, the API, the lifting, uneven and native collectives), reading back from JAX's
compilation cache the programs the first process compiled that x64 leaves unchanged
(:func:`jax_device_runs.compilation_cache`). Each process runs once per module
(:func:`device_run`) and one test per count and mode reads its section of the output.

The host-side plan (slots, rounds, edge colouring) is tested here directly, without JAX devices.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax_device_runs import compilation_cache, host_devices

from linop import DistributedTensor, Partition, Repartition
from linop.backends.jax.plan import Exchange, compile_plan, edge_colouring, space_layout
from linop.errors import DeviceKernelError, WorkerError

HERE = Path(__file__).resolve().parent
LONG = os.environ.get("LINOP_LONG") == "1"
PROCESSES = {4: (1, 2, 4), 8: (8,)} if LONG else {4: (1, 4)}  # the count 2: the CI suite's time
"""Host devices of each device process, and the device counts it proves (meshes over its
first K devices)."""
COUNTS = [count for counts in PROCESSES.values() for count in counts]
X64_COUNTS = (4,)
"""The counts proven a second time with ``jax_enable_x64`` on (in a process of 4 devices)."""


def run_device_script(
    script: str, devices: int, *args: str, timeout: float = 600, x64: bool = False
) -> subprocess.CompletedProcess[str]:
    """Run ``tests/jax_devices/<script> devices *args`` with ``devices`` host devices (and
    ``jax_enable_x64`` on if ``x64``), bounded by ``timeout`` seconds."""
    pytest.importorskip("jax", reason="jax is not installed (the jax extra: pip install -e '.[jax]')")
    environment = dict(os.environ, XLA_FLAGS=host_devices(devices))
    environment["JAX_ENABLE_X64"] = "1" if x64 else "0"
    environment["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), environment.get("PYTHONPATH", "")])
    environment.update(compilation_cache())  # the x64 process reads back the first one's programs
    return subprocess.run(
        [sys.executable, str(HERE / "jax_devices" / script), str(devices), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environment,
        stdin=subprocess.DEVNULL,
    )


@dataclass(frozen=True)
class DeviceRun:
    """The output of one ``check_lowering.py`` process, split by device count."""

    counts: tuple[int, ...]
    returncode: int | None
    """The exit status; None if the process was killed at its timeout."""
    stdout: str = field(repr=False)
    stderr: str = field(repr=False)

    @functools.cached_property
    def sections(self) -> dict[int, str]:
        """The stdout of each count, from its ``== K devices`` line to the next."""
        parts = re.split(r"^== (\d+) devices$", self.stdout, flags=re.MULTILINE)
        return {int(k): text for k, text in zip(parts[1::2], parts[2::2])}

    def passed(self, count: int) -> bool:
        """Whether every check of ``count`` devices ran and passed."""
        return f"trees proven on {count} devices" in self.sections.get(count, "")

    def failure(self, count: int) -> str:
        """Why ``count`` did not pass: its section (or the process's end) and stderr."""
        why = "timed out; " if self.returncode is None else f"exit status {self.returncode}; "
        text = self.sections.get(count, f"no output for {count} devices\n" + self.stdout)
        return why + text[-4000:] + self.stderr[-4000:]


@functools.cache
def device_run(devices: int, x64: bool = False) -> DeviceRun:
    """The ``check_lowering.py`` process of ``devices`` host devices (:data:`PROCESSES`; with
    ``x64``, of 4 devices proving :data:`X64_COUNTS`), run once (also when it fails or times
    out) for the tests of all its counts."""
    counts = X64_COUNTS if x64 else PROCESSES[devices]
    try:
        done = run_device_script("check_lowering.py", devices, *map(str, counts), x64=x64)
    except subprocess.TimeoutExpired as expired:  # the counts finished before it still pass

        def text(out: str | bytes | None) -> str:
            return out.decode(errors="replace") if isinstance(out, bytes) else out or ""

        return DeviceRun(counts, None, text(expired.stdout), text(expired.stderr))
    return DeviceRun(counts, done.returncode, done.stdout, done.stderr)


@pytest.mark.timeout(900)  # one subprocess: seconds on an idle machine, minutes on a loaded one
@pytest.mark.parametrize(
    ("count", "x64"),
    [(count, False) for count in COUNTS] + [(count, True) for count in X64_COUNTS],
    ids=[f"{count}" for count in COUNTS] + [f"{count}-x64" for count in X64_COUNTS],
)
def test_lowering_equals_numpy_and_its_transpose_equals_the_adjoint(count, x64):
    devices = 4 if x64 else next(d for d, counts in PROCESSES.items() if count in counts)
    run = device_run(devices, x64)
    assert run.passed(count), run.failure(count)
    printed = run.sections[count]
    if count >= 2:
        assert "control caught: control: reversed permutation" in printed, printed[-4000:]
    # a failed process is the failure of one of its counts, reported by that count's test; if
    # every count passed (a crash after them), by the test of each
    assert run.returncode == 0 or not all(map(run.passed, run.counts)), run.failure(count)


@pytest.mark.timeout(900)
def test_the_readme_jax_devices_example_runs_with_x64():
    """README's "Run on JAX devices" block (uneven shares, the 2 x 2 layout, tensor_function)
    with ``jax_enable_x64`` on, where its lowering used to fail on the index dtypes."""
    pytest.importorskip("jax", reason="jax is not installed (the jax extra: pip install -e '.[jax]')")
    from test_readme import NEEDS_MARK, python_blocks

    (block,) = [b for b in python_blocks() if NEEDS_MARK.match(b) and "jax_sharded" in b]
    environment = dict(os.environ, JAX_ENABLE_X64="1")
    environment["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), environment.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", block + "\nassert jax.config.jax_enable_x64\n"],
        capture_output=True,
        text=True,
        timeout=600,
        env=environment,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "[('x', (20, 55))]" in done.stdout


@settings(max_examples=60, derandomize=True, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), unique=True))
def test_edge_colouring_is_proper_with_the_largest_degree_many_colours(edges):
    colours = edge_colouring(edges)
    for c in set(colours):
        chosen = [e for e, k in zip(edges, colours) if k == c]
        assert len({u for u, _ in chosen}) == len(chosen) and len({v for _, v in chosen}) == len(chosen)
    degree = max(
        [sum(u == a for u, _ in edges) for a in range(6)] + [sum(v == b for _, v in edges) for b in range(6)]
    )
    assert len(set(colours)) == degree


def test_each_round_is_a_permutation_and_uneven_blocks_are_padded():
    x = DistributedTensor("x", (77, 6), Partition.grid((4, 1)))
    y = DistributedTensor("y", (77, 6), Partition.grid((1, 4)))
    plan = compile_plan(Repartition(x, y), 4)
    (slot,) = plan.domain.slots
    assert slot.name == "x" and slot.shape == (20, 6) and slot.padded
    assert [b.shape for b in slot.blocks] == [(20, 6), (19, 6), (19, 6), (19, 6)]
    for op in plan.ops:
        if isinstance(op, Exchange):
            senders, receivers = [s for s, _ in op.perm], [r for _, r in op.perm]
            assert len(set(senders)) == len(senders) and len(set(receivers)) == len(receivers)
    assert plan.rounds >= 3  # every device sends to three others


def test_a_block_on_a_worker_without_a_device_is_refused_naming_it():
    x = DistributedTensor("x", (8,), Partition.grid((4,)))
    with pytest.raises(WorkerError, match=r"block 'x\[3\]' lives on worker 3"):
        space_layout(x.space, (0, 1, 2), 3)


def test_a_numpy_kernel_is_refused_with_a_typed_error():
    from linop import Block, Space, local_operator

    space = Space([Block("a", (2,))])
    kernel = local_operator(space, ["a"], {"b": (2,)}, forward=lambda a: (a,), adjoint=lambda b: (b,))
    with pytest.raises(DeviceKernelError, match="cannot run inside jit on JAX devices"):
        compile_plan(kernel, 1)


def test_an_even_rows_to_columns_phase_is_one_all_to_all_with_each_devices_own_box():
    from linop.backends.jax.plan import CollectiveOp

    x = DistributedTensor("x", (8, 8), Partition.grid((4, 1)))
    y = DistributedTensor("y", (8, 8), Partition.grid((1, 4)))
    plan = compile_plan(Repartition(x, y), 4)
    (op,) = plan.ops  # the local copies of each device's own box folded into the collective
    assert isinstance(op, CollectiveOp)
    (piece,) = op.pieces
    assert (piece.kind, piece.with_self) == ("all_to_all", True)
    assert piece.sends[:, 2].tolist() == [[0, 0], [0, 2], [0, 4], [0, 6]]  # device 2's box for each e
    assert piece.places[:, 1].tolist() == [[0, 0], [2, 0], [4, 0], [6, 0]]  # device 1 puts s's box


def test_the_halo_adjoint_drops_the_clears_of_halo_cells_never_read_again():
    from linop import Kernel, halo_windows
    from linop.backends.jax.plan import BoxOp

    u = DistributedTensor("u", (32, 8), Partition.grid((4, 1)))
    plan = compile_plan(halo_windows(u, Kernel(3, padding=1)), 4).adjoint()
    assert not [o for o in plan.ops if isinstance(o, BoxOp) and o.kind == "clear"]


def test_a_clear_whose_box_is_read_later_is_kept_and_one_outside_dropped():
    import numpy as np

    from linop.backends.jax.plan import BoxOp, drop_dead_clears

    everyone = np.ones(2, dtype=bool)

    def box(kind, src, dst, start, shape):
        starts = np.asarray([start, start], dtype=np.int32)
        return BoxOp(kind, src, None if src is None else starts, dst, starts, shape, shape, everyone)

    read = box("set", "a", "b", (2,), (2,))  # reads a[2:4]
    inside, outside = box("clear", None, "a", (3,), (1,)), box("clear", None, "a", (0,), (2,))
    kept = drop_dead_clears([inside, outside, read], {"b"}, {"a": (4,), "b": (4,)}, 2)
    assert kept == (inside, read)


def test_an_all_reduce_along_a_mesh_axis_is_one_psum_over_that_axis_only_on_a_fitting_mesh():
    from linop import AllReduce
    from linop.backends.jax.plan import PsumOp

    t = DistributedTensor("t", (4, 6), Partition.grid((2, 2)))
    for axis in (0, 1):
        square = compile_plan(AllReduce(t, (axis,)), 4, mesh_shape=(2, 2))
        assert [o.over for o in square.ops if isinstance(o, PsumOp)] == [(axis,)]
        assert [o.over for o in square.adjoint().ops if isinstance(o, PsumOp)] == [(axis,)]
    line = compile_plan(AllReduce(t, (0,)), 4)  # groups {0, 2}, {1, 3} are no axis of a line
    assert not any(isinstance(o, PsumOp) for o in line.ops)
    assert [o.over for o in compile_plan(AllReduce(t, (0, 1)), 4).ops if isinstance(o, PsumOp)] == [(0,)]


def test_the_psum_is_read_from_the_programs_part_by_its_type(monkeypatch):
    """JAX's table of calls has one row, the all-reduce's part: the psum is found from the
    program's ``AllReducePart`` of every device (a factor of a composition too; a scaled
    all-reduce runs its portable program), a part without a row (a reduce-scatter of uneven
    shares) runs the portable program; control: with the row removed, no psum."""
    from types import MappingProxyType

    from linop import AllReduce, ReduceScatter
    from linop.backends.jax import plan as jax_plan
    from linop.program.parts import AllReducePart

    assert set(jax_plan.PART_CALLS) == {AllReducePart}
    t = DistributedTensor("t", (4, 6), Partition.grid((2, 2)))
    op = AllReduce(t, (0,))

    def psums(tree):
        return [
            o.over for o in compile_plan(tree, 4, mesh_shape=(2, 2)).ops if isinstance(o, jax_plan.PsumOp)
        ]

    assert psums(op) == [(0,)] and psums((2 * op) @ op) == [(0,)]  # the scaled factor: portable
    assert psums(Repartition(t, t.__class__("u", (4, 6), Partition.grid((2, 2)))) @ op) == [(0,)]
    uneven = ReduceScatter(DistributedTensor("v", (7, 2), Partition.grid((4, 1))), (0,), "g")
    assert psums(uneven) == []
    monkeypatch.setattr(jax_plan, "PART_CALLS", MappingProxyType({}))  # control: no row
    assert psums(op) == []


def test_a_reduce_scatter_is_one_psum_scatter_with_each_devices_own_add_inside():
    from linop import AllGather
    from linop.backends.jax.plan import CollectiveOp

    x = DistributedTensor("x", (8, 3), Partition.grid((4, 1)))
    (op,) = compile_plan(AllGather(x, (0,), "g").H, 4).ops  # the self adds folded, clears dropped
    assert isinstance(op, CollectiveOp)
    assert [(p.kind, p.with_self) for p in op.pieces] == [("psum_scatter", True)]


def test_uneven_halo_windows_run_each_local_step_as_one_op_on_every_device():
    """The steps that differ only by the shapes of uneven blocks become one op of the largest
    shape (the entries it gains are zeros), so XLA sees what it sees for even blocks; the
    forward's output needs no mask on exit, and the adjoint's adds cut each source box to its
    device's shape (the halo cells beyond it hold cotangents of the zero padding)."""
    from linop import Kernel, halo_windows
    from linop.backends.jax.plan import BoxOp

    u = DistributedTensor("u", (29, 8), Partition.grid((4, 1)))  # 8 / 7 / 7 / 7 rows
    plan = compile_plan(halo_windows(u, Kernel(3, padding=1)), 4)
    boxes = [o for o in plan.ops if isinstance(o, BoxOp)]
    assert [(o.kind, o.shape, bool(o.active.all()), o.extents is None) for o in boxes] == [
        ("set", (8, 8), True, True),
        ("set", (10, 10), True, True),
    ]
    assert plan.output_masks == (False,)
    adds = [o for o in plan.adjoint().ops if isinstance(o, BoxOp) and o.kind == "add"]
    assert len(adds) == 1 and adds[0].active.all() and adds[0].extents is not None
    assert adds[0].extents.tolist() == [[8, 8], [7, 8], [7, 8], [7, 8]]


def test_widening_needs_zeros_in_the_entries_a_box_gains():
    """Control for :func:`widen_boxes`: a set whose widened target would overwrite a nonzero
    entry stays two ops; once that entry is cleared they merge; a source entry that is not
    zero is cut by the op's extents instead."""
    import numpy as np

    from linop.backends.jax.plan import BoxOp, widen_boxes

    def on(device, kind, src, shape, start=0):
        active = np.arange(2) == device
        starts = np.full((2, 1), start, dtype=np.int32)
        return BoxOp(kind, src, None if src is None else starts, "b", starts, shape, shape, active)

    slots = {"a": (2,), "b": (2,)}
    run = [on(0, "set", "a", (2,)), on(1, "set", "a", (1,))]
    blocks = {"a": [(0, (0,), (2,)), (1, (0,), (1,))]}
    (merged,), _ = widen_boxes(run, blocks, slots, 2)
    assert merged.shape == (2,) and merged.active.all() and merged.extents is None
    dirty = {**blocks, "b": [(1, (1,), (2,))]}  # b[1] on device 1 may be nonzero
    assert widen_boxes(run, dirty, slots, 2)[0] == tuple(run)
    cleared, _ = widen_boxes([on(1, "clear", None, (1,), 1), *run], dirty, slots, 2)
    assert len(cleared) == 2 and cleared[1].active.all()
    stale = {"a": [(0, (0,), (2,)), (1, (0,), (2,))]}  # a[1] on device 1 may be nonzero
    (cut,), _ = widen_boxes(run, stale, slots, 2)
    assert cut.extents is not None and cut.extents.tolist() == [[2], [1]]
