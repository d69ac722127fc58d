"""Proofs of the lowering onto JAX devices, for several device counts in ONE process of D host
devices (launched by ``tests/test_jax_shard.py``: ``python check_lowering.py D K1 K2 ...``,
which sets ``XLA_FLAGS=--xla_force_host_platform_device_count=D`` before importing JAX; the
counts default to D alone). Each count K <= D runs every check below on its own mesh, over the
first K devices (``jax.sharding.Mesh`` over ``jax.devices()[:K]``), with K workers, its own
drawn examples and its own list of proven trees (:class:`Run`). Its output opens with a line
``== K devices`` and ends with ``OK n trees proven on K devices (s seconds)``; a count whose
checks fail prints its traceback and ``FAILED on K devices`` instead, and the next count still
runs (the exit status is then 1). One process for the counts 1, 2 and 4 starts Python, imports
JAX and warms up XLA once instead of three times.

For trees drawn by hypothesis (derandomized) on K workers: halo exchanges (nested multi-hop
and direct, unbalanced and empty shares, every boundary mode), halo windows, repartitions,
broadcasts, sum-reduces, all-reduces, all-gathers and random movement trees (copies, moves,
adds, clears, allocations, scalings, sums), and a worker map (2K workers on K devices):

- the lowered program equals the numpy interpreter exactly (int32 entries);
- its transpose by ``jax.linear_transpose`` and its ``jax.vjp`` equal ``op.H`` exactly, and
  so does JAX's own transpose of the lowered program (``adjoint_by_tree=False``);
- ``jax.jvp`` gives the op on the tangent and ``jax.vmap`` maps over a batch;
- phases in which every device sends to every other lower to native collectives
  (``all_to_all``, ``all_gather``, ``psum_scatter``), proven likewise (K >= 2);
- deliberately wrong lowerings (one round's permutation reversed, an all_to_all's boxes
  placed by the wrong senders) are caught (K >= 2).

At K = 4 also ``verify.lift_jax`` on hand-written ``shard_map`` functions (``check_lift.py``)
and a psum over one axis of a 2 x 2 mesh; at K >= 4 77 rows over 4 devices.
``LINOP_LONG=1`` draws more examples.
"""

from __future__ import annotations

import os
import sys

DEVICES = int(sys.argv[1]) if len(sys.argv) > 1 else 4
COUNTS = [int(a) for a in sys.argv[2:]] or [DEVICES]
# the flags this process was given (the suite's: tests/conftest.py), then its host devices
os.environ["XLA_FLAGS"] = (
    f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}"
)

import dataclasses  # noqa: E402
import pathlib  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tests/ (mpi strategies)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from hypothesis import HealthCheck, assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from mpi.strategies import movement_trees  # noqa: E402

from linop import (  # noqa: E402
    AllGather,
    AllReduce,
    Block,
    Broadcast,
    DistributedTensor,
    HaloExchange,
    Identity,
    LinearOperator,
    Partition,
    Repartition,
    Space,
    halo_geometry,
    halo_windows,
)
from linop.backends.jax.integers import integer_cast  # noqa: E402
from linop.backends.jax.plan import Exchange, Plan  # noqa: E402
from linop.errors import IntegerOverflowError  # noqa: E402
from linop.frameworks.jax_sharded import ShardedOperator, sharded  # noqa: E402
from linop.layout import BlockGrid  # noqa: E402
from verify.strategies_distributed import decompositions  # noqa: E402
from verify.strategies_halo import halo_cases  # noqa: E402

assert len(jax.devices()) == DEVICES, jax.devices()
assert COUNTS and all(1 <= k <= DEVICES for k in COUNTS), (COUNTS, DEVICES)
LONG = os.environ.get("LINOP_LONG") == "1"


@dataclasses.dataclass
class Run:
    """One device count's checks: ``count`` devices, the 1-d mesh ``("d",)`` over the first
    ``count`` of the process's devices, and the labels of the trees proven on it so far."""

    count: int
    mesh: Mesh
    checked: list[str] = dataclasses.field(default_factory=list)

    @classmethod
    def on_first(cls, count: int) -> Run:
        """The run on a mesh over ``jax.devices()[:count]``."""
        return cls(count, Mesh(np.array(jax.devices()[:count]), ("d",)))


X64 = bool(jax.config.jax_enable_x64)
"""Whether this process runs with ``jax_enable_x64`` (``JAX_ENABLE_X64=1``): then the
transposes run in float64, else in float32."""
FLOAT = np.float64 if X64 else np.float32


def integers_for(op: LinearOperator) -> type:
    """The integer dtype of the exact checks of ``op``: int32 where JAX computes its sums
    exactly for every int32 value (it only copies, or x64 widens them to int64), else int16
    (widened to int32: with x64 off an int32 sum is refused, see linop.backends.jax.integers)."""
    try:
        integer_cast(op, (np.int32,))
    except IntegerOverflowError:
        return np.int16
    return np.int32


def state_of(space, seed: int, dtype: type = np.int32) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {b.name: rng.integers(-9, 10, b.shape).astype(dtype) for b in space}


def mismatch(got, want) -> str | None:
    for name in want:
        if not np.array_equal(np.asarray(got[name]), np.asarray(want[name])):
            return (
                f"block {name!r}: {np.asarray(got[name]).tolist()} versus {np.asarray(want[name]).tolist()}"
            )
    return None


def host_pack(layout, state) -> list[np.ndarray]:
    """Stacked, zero-padded slots of a numpy state (on the host: no compilation)."""
    out = []
    for spec in layout.slots:
        dtype = np.result_type(*state.values()) if state else np.int32
        array = np.zeros((layout.devices, *spec.shape), dtype)
        for d, block in enumerate(spec.blocks):
            if block is not None:
                array[(d, *(slice(0, n) for n in block.shape))] = state[block.name]
        out.append(array)
    return out


def host_unpack(layout, arrays) -> dict[str, np.ndarray]:
    out = {}
    for spec, array in zip(layout.slots, arrays):
        array = np.asarray(array)
        for d, block in enumerate(spec.blocks):
            if block is not None:
                out[block.name] = array[(d, *(slice(0, n) for n in block.shape))]
    return out


def prove(run: Run, f: ShardedOperator, label: str, every: bool = False) -> None:
    """Forward, both transposes, vjp (and on every fourth case of ``run`` jvp and vmap) of
    ``f`` against the numpy interpreter, all in one jitted function (one compilation per case);
    ``label`` is added to ``run.checked``."""
    op = f.op
    dtype = integers_for(op)
    x, y, x2 = state_of(op.domain, 1, dtype), state_of(op.range, 2, dtype), state_of(op.domain, 3, dtype)
    want, want_h = op(x), op.H(y)
    args, cotangent = host_pack(f.domain, x), tuple(a.astype(FLOAT) for a in host_pack(f.range, y))
    second = host_pack(f.domain, x2)
    own = _own(f)
    extra = every or LONG or len(run.checked) % 4 == 0

    def everything(args, cotangent, second):
        floats = [a.astype(FLOAT) for a in args]
        out = {
            "forward": f.arrays(*args),
            "transpose by op.H": jax.linear_transpose(f.arrays, *floats)(cotangent),
            "transpose by JAX's own rules": jax.linear_transpose(own, *floats)(cotangent),
            "vjp": jax.vjp(f.arrays, *floats)[1](cotangent),
        }
        if extra:
            out["jvp"] = jax.jvp(f.arrays, tuple(floats), tuple(floats))[1]
            stacked = [jnp.stack([a, b], axis=1) for a, b in zip(args, second)]
            mapped = jax.vmap(f.arrays, in_axes=1, out_axes=1)(*stacked)
            out["vmap"] = tuple(m[:, 1] for m in mapped)
        return out

    results = jax.jit(everything)(args, cotangent, second)
    for what, values in results.items():
        if what in ("forward", "jvp", "vmap"):
            found = mismatch(host_unpack(f.range, values), op(x2) if what == "vmap" else want)
            against = "the numpy interpreter"
        else:
            found = mismatch(host_unpack(f.domain, values), want_h)
            against = "op.H"
        assert found is None, f"{label}: {what} differs from {against}, {found}"
        if what not in ("forward", "vmap"):
            assert all(v.dtype == FLOAT for v in values), f"{label}: {what} in {[v.dtype for v in values]}"
        leak = padding_leak(f.range if against == "the numpy interpreter" else f.domain, values)
        assert leak is None, f"{label}: {what} leaks into the padding of {leak}"
    run.checked.append(label)


def padding_leak(layout: Any, values: Any) -> str | None:
    """The first slot and device whose stacked array is nonzero outside the device's block
    (padding must never leak into a result or a gradient), else None."""
    for spec, value in zip(layout.slots, values):
        value = np.asarray(value)
        for d, block in enumerate(spec.blocks):
            inside = np.zeros(spec.shape, dtype=bool)
            if block is not None:
                inside[tuple(slice(0, n) for n in block.shape)] = True
            if np.any(value[d][~inside]):
                return f"slot {spec.name!r} on device {d}"
    return None


def _own(f: ShardedOperator):
    from linop.backends.jax.shard import sharded_call

    return sharded_call(f.plan, f.mesh, f.axes, adjoint_by_tree=False)


SETTINGS = settings(
    max_examples=12 if LONG else 1,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)


def workers_partition(draw, shape, count: int) -> Partition:
    chosen = draw(st.permutations(range(count)))[: int(np.prod(shape))]
    return Partition(tuple(shape), tuple(chosen))


@st.composite
def grid_shapes(draw, rank: int, count: int) -> tuple[int, ...]:
    """A grid of ``rank`` dimensions with at most ``count`` cells."""
    shape = []
    left = count
    for _ in range(rank):
        n = draw(st.integers(1, max(1, left)))
        shape.append(n)
        left //= n
    return tuple(shape)


@st.composite
def tensors(draw, name: str, rank: int, count: int, global_shape=None) -> DistributedTensor:
    grid = draw(grid_shapes(rank, count))
    if global_shape is None:
        global_shape = tuple(draw(st.integers(0, 7)) for _ in range(rank))
    sizes = draw(decompositions(global_shape, grid))
    return DistributedTensor(name, tuple(global_shape), workers_partition(draw, grid, count), sizes)


@st.composite
def collective_trees(draw, count: int):
    kind = draw(st.sampled_from(["repartition", "broadcast", "allreduce", "allgather"]))
    rank = draw(st.integers(1, 2))
    op: LinearOperator
    if kind == "repartition":
        x = draw(tensors("x", rank, count))
        op = Repartition(x, draw(tensors("y", rank, count, x.global_shape)))
    elif kind == "broadcast":
        x = draw(tensors("x", rank, count))
        left = count // int(np.prod(x.partition.shape))
        grid = []
        for n in x.partition.shape:  # a source extent > 1 stays, an extent 1 may broadcast
            g = n if n != 1 else draw(st.integers(1, max(1, left)))
            left //= 1 if n != 1 else g
            grid.append(g)
        op = Broadcast(x, workers_partition(draw, grid, count), "y")
    elif kind == "allreduce":
        partition = workers_partition(draw, draw(grid_shapes(rank, count)), count)
        shape = tuple(draw(st.integers(0, 3)) for _ in range(draw(st.integers(0, 2))))
        axes = tuple(sorted(draw(st.sets(st.integers(0, rank - 1)))))
        op = AllReduce(BlockGrid.uniform("u", partition, shape), axes)
    else:
        x = draw(tensors("x", rank, count))
        op = AllGather(x, tuple(sorted(draw(st.sets(st.integers(0, rank - 1))))), "g")
    return op.H if draw(st.booleans()) else op


@st.composite
def halo_trees(draw, count: int):
    x, kernel = draw(halo_cases(max_dims=2))
    assume(x.partition.size <= count)
    kind = draw(st.sampled_from(["nested", "direct", "windows"]))
    op = halo_windows(x, kernel) if kind == "windows" else HaloExchange(halo_geometry(x, kernel), kind)
    return op.H if draw(st.booleans()) else op


def drawn(trees: st.SearchStrategy, check: Callable[[Any], None]) -> None:
    """``check`` on :data:`SETTINGS` many trees drawn from ``trees`` (the first failing one
    shrunk and reported by hypothesis)."""
    SETTINGS(given(trees)(check))()


def check_collectives(run: Run) -> None:
    """Drawn repartitions, broadcasts, all-reduces and all-gathers (or their adjoints)."""

    def collective(op: LinearOperator) -> None:
        prove(run, sharded(op, run.mesh), str(op))

    drawn(collective_trees(run.count), collective)


def check_halos(run: Run) -> None:
    """Drawn halo exchanges (nested and direct) and halo windows (or their adjoints)."""

    def halo(op: LinearOperator) -> None:
        prove(run, sharded(op, run.mesh), str(op))

    drawn(halo_trees(run.count), halo)


def check_movement(run: Run) -> None:
    """Drawn movement trees on ``run.count`` workers, one per device."""

    def movement(op: LinearOperator) -> None:
        prove(run, sharded(op, run.mesh), f"movement tree {op}")

    drawn(movement_trees(run.count), movement)


def check_worker_map(run: Run) -> None:
    """Drawn movement trees on ``2 * run.count`` workers, worker ``w`` on device ``w % count``."""
    count = run.count

    def worker_map(op: LinearOperator) -> None:
        workers = [w % count for w in range(2 * count)]
        prove(run, sharded(op, run.mesh, workers=workers), f"2 workers per device: {op}")

    drawn(movement_trees(2 * count), worker_map)


def check_uneven_77_rows(run: Run) -> None:
    """77 rows over 4 devices (shard_map refuses): repartition and halo windows, exactly, the
    padding of every result zero."""
    if run.count < 4:
        return
    x = DistributedTensor("x", (77, 6), Partition.grid((4, 1)))
    y = DistributedTensor("y", (77, 6), Partition.grid((2, 2)))
    from linop import Kernel

    for op in (
        Repartition(x, y),
        halo_windows(x, Kernel((3, 3), padding=1, boundary="periodic")),
        halo_windows(x, Kernel((3, 3), padding=1)),  # the adjoint's zero-padding cells beyond a block
    ):
        f = sharded(op, run.mesh)
        assert any(s.padded for s in f.domain.slots), f.domain
        prove(run, f, f"uneven {op}")


def check_native_allreduce(run: Run) -> None:
    """An all-reduce over every device lowers to one ``psum`` (also inside a composition and
    in its adjoint), exactly: read from the program's part (an ``AllReducePart`` per device).
    On one device the program has no part (a group of one member: the identity), and no psum
    is made."""
    from linop.backends.jax.plan import PsumOp

    count = run.count
    t = DistributedTensor("t", (3 * count, 2), Partition.grid((count, 1)))
    x = DistributedTensor("x", (3 * count, 2), Partition.grid((1, 1)))
    for op in (AllReduce(t, (0,)), AllReduce(t, (0,)) @ Repartition(x, t)):
        f = sharded(op, run.mesh)
        for ops in (f.plan.ops, f.plan.adjoint().ops):
            assert any(isinstance(o, PsumOp) for o in ops) == (count > 1), ops
        prove(run, f, f"native {op}")


def check_psum_over_a_mesh_axis(run: Run) -> None:
    """On a 2 x 2 mesh, an all-reduce over one partition axis is one psum over the mesh axis
    its groups run along (rows: "a", columns: "b"), in the forward and the adjoint plan."""
    if run.count != 4:
        return
    from linop.backends.jax.plan import PsumOp

    square = Mesh(run.mesh.devices.reshape(2, 2), ("a", "b"))
    t = DistributedTensor("t", (4, 6), Partition.grid((2, 2)))
    for axis in (0, 1):
        f = sharded(AllReduce(t, (axis,)), square)
        assert [o.over for o in f.plan.ops if isinstance(o, PsumOp)] == [(axis,)], f.plan.ops
        assert [o.over for o in f.plan.adjoint().ops if isinstance(o, PsumOp)] == [(axis,)]
        prove(run, f, f"psum over mesh axis {'ab'[axis]}")
    on_a_line = sharded(AllReduce(t, (0,)), run.mesh)  # the same groups on one axis: ppermute rounds
    assert not any(isinstance(o, PsumOp) for o in on_a_line.plan.ops)
    prove(run, on_a_line, "the same all-reduce on a 1-d mesh")


def kinds(plan: Plan) -> list[tuple[str, bool]]:
    from linop.backends.jax.plan import CollectiveOp

    return [(p.kind, p.with_self) for o in plan.ops if isinstance(o, CollectiveOp) for p in o.pieces]


@st.composite
def even_collectives(draw, count: int):
    """Layouts whose phases are native collectives: every device sends one box of one shape
    to every other (even shares over all ``count`` devices, workers in any order)."""
    kind = draw(st.sampled_from(["repartition", "allgather", "reducescatter"]))
    n = draw(st.integers(1, 3))
    cols = draw(st.integers(1, 3))
    order = tuple(draw(st.permutations(range(count))))
    rows = DistributedTensor("x", (count * n, count * cols), Partition((count, 1), order))
    op: LinearOperator
    if kind == "repartition":
        target = DistributedTensor(
            "y", rows.global_shape, Partition((1, count), tuple(draw(st.permutations(range(count)))))
        )
        op = Repartition(rows, target)
        want = "all_to_all"
    else:
        op = AllGather(rows, (0,), "g")
        want = "all_gather"
        if kind == "reducescatter":
            op, want = op.H, "psum_scatter"
    return op, want


def check_drawn_native_collectives(run: Run) -> None:
    """Drawn even layouts lower to the native collective they call for, exactly."""

    def check(case: tuple[LinearOperator, str]) -> None:
        op, want = case
        f = sharded(op, run.mesh)
        assert (want, True) in kinds(f.plan), (op, kinds(f.plan))
        prove(run, f, f"native {want}: {op}", every=True)

    drawn(even_collectives(run.count), check)


def check_native_collectives(run: Run) -> None:
    """Rows -> columns is one all_to_all (each device's own box inside it), an all-gather one
    all_gather, its adjoint (a reduce-scatter) one psum_scatter; exactly, with their
    transposes by op.H; uneven shares keep ppermute rounds; a wrong all_to_all is caught."""
    if run.count < 2:
        return
    count = run.count
    rows = DistributedTensor("x", (2 * count, 3 * count), Partition.grid((count, 1)))
    columns = DistributedTensor("y", (2 * count, 3 * count), Partition.grid((1, count)))
    turn = sharded(Repartition(rows, columns), run.mesh)
    assert kinds(turn.plan) == [("all_to_all", True)], kinds(turn.plan)
    assert kinds(turn.plan.adjoint()) == [("all_to_all", True)]
    assert not any(isinstance(o, Exchange) for o in turn.plan.ops)
    prove(run, turn, "native all_to_all", every=True)
    gather = sharded(AllGather(rows, (0,), "g"), run.mesh)
    assert ("all_gather", True) in kinds(gather.plan), kinds(gather.plan)
    assert ("psum_scatter", True) in kinds(gather.plan.adjoint()), kinds(gather.plan.adjoint())
    prove(run, gather, "native all_gather", every=True)
    prove(run, gather.H, "native psum_scatter", every=True)
    uneven = DistributedTensor("u", (2 * count + 1, 3 * count), Partition.grid((count, 1)))
    other = DistributedTensor("v", (2 * count + 1, 3 * count), Partition.grid((1, count)))
    if count > 2:  # boxes of two shapes: no single collective
        assert kinds(sharded(Repartition(uneven, other), run.mesh).plan) == []
    from linop.backends.jax.plan import CollectiveOp

    ops = list(turn.plan.ops)
    k = next(i for i, o in enumerate(ops) if isinstance(o, CollectiveOp))
    (piece,) = ops[k].pieces
    ops[k] = CollectiveOp((dataclasses.replace(piece, places=piece.places[::-1].copy()),))
    wrong = ShardedOperator(
        turn.op, run.mesh, plan=dataclasses.replace(turn.plan, ops=tuple(ops), adjoint_cache=[])
    )
    try:
        prove(run, wrong, "control: all_to_all boxes placed by the wrong senders")
    except AssertionError as error:
        assert "forward differs from the numpy interpreter" in str(error), error
        print("control caught:", str(error)[:100])
    else:
        raise AssertionError("a wrong all_to_all was not caught")


def reversed_round(plan: Plan) -> Plan:
    """The plan with its first exchange's permutation reversed (a wrong lowering)."""
    ops = list(plan.ops)
    for i, op in enumerate(ops):
        if isinstance(op, Exchange) and any(s != r for s, r in op.perm):
            flipped = tuple((r, s) for s, r in op.perm)
            receivers = np.zeros_like(op.receivers)
            receivers[[r for _, r in flipped]] = True
            ops[i] = dataclasses.replace(op, perm=flipped, receivers=receivers)
            return dataclasses.replace(plan, ops=tuple(ops), adjoint_cache=[])
    raise AssertionError("no exchange to reverse")


def check_control(run: Run) -> None:
    """The same comparison catches a reversed permutation (forward and transpose)."""
    if run.count < 2:
        return
    count = run.count
    x = DistributedTensor("x", (9, 4), Partition.grid((count, 1)))
    y = DistributedTensor("y", (9, 4), Partition.grid((1, 2 if count >= 2 else 1)))
    op = Repartition(x, y)
    good = sharded(op, run.mesh)
    wrong = ShardedOperator(op, run.mesh, plan=reversed_round(good.plan))
    try:
        prove(run, wrong, "control: reversed permutation")
    except AssertionError as error:
        assert "forward differs from the numpy interpreter" in str(error), error
        print("control caught:", str(error)[:100])
    else:
        raise AssertionError("a reversed permutation was not caught")


def check_api(run: Run) -> None:
    """tensor_function on global arrays (uneven rows), f.blocks, and the typed errors."""
    from linop.errors import DtypeError, MeshError, StateError
    from linop.frameworks.jax_sharded import tensor_function

    count = run.count
    rows = 4 * count + 1  # uneven over the devices
    x = DistributedTensor("x", (rows, 5), Partition.grid((count, 1)))
    y = DistributedTensor("y", (rows, 5), Partition.grid((1, 1)))
    z = DistributedTensor(
        "z",
        (rows, 5),
        Partition.grid((count, 1), first=0),
        sizes=((rows - count + 1,) + (1,) * (count - 1), (5,)),
    )
    data = np.arange(rows * 5, dtype=np.int32).reshape(rows, 5)
    move = tensor_function(Repartition(x, z), run.mesh, x, z, ("d", None))
    assert np.array_equal(np.asarray(jax.jit(move)(data)), data)
    gradient = jax.grad(lambda a: jnp.sum(move(a) * jnp.arange(rows * 5.0).reshape(rows, 5)))(
        data.astype(np.float32)
    )
    assert np.array_equal(np.asarray(gradient), data), "the gradient of a repartition is its inverse"
    rows_even = DistributedTensor("r", (2 * count, 3 * count), Partition.grid((count, 1)))
    columns = DistributedTensor("c", (2 * count, 3 * count), Partition.grid((1, count)))
    even = np.arange(6 * count * count, dtype=np.float32).reshape(2 * count, 3 * count)
    turn = tensor_function(
        Repartition(rows_even, columns), run.mesh, rows_even, columns, ("d", None), (None, "d")
    )
    assert turn.reshapes and (count == 1 or not move.reshapes)  # one device: nothing is uneven
    assert np.array_equal(np.asarray(jax.jit(turn)(even)), even), "even shards: the reshape path"
    back = jax.jit(jax.grad(lambda a: jnp.sum(turn(a) * even)))(even)
    assert np.array_equal(np.asarray(back), even)
    # a gradient with respect to some inputs only: the others get no cotangent (JAX 0.10 has
    # no jax.core.get_aval, which the transpose once called for them)
    pair = sharded(Identity(Space([Block("a", (3,)), Block("b", (3,))])), run.mesh)
    ones, ramp = jnp.ones((count, 3)), jnp.arange(3.0 * count).reshape(count, 3)  # one row a device
    partial = jax.grad(lambda u, v: sum(jnp.sum(o * o) for o in pair.arrays(u, v)))(ones, ramp)
    held = np.zeros((count, 3))
    held[0] = 2.0  # both blocks live on worker 0: the other devices' rows are padding
    assert np.array_equal(np.asarray(partial), held), partial
    f = sharded(Repartition(x, z), run.mesh)
    blocks = f.blocks(x.scatter(data))
    assert all(np.array_equal(np.asarray(blocks[n]), v) for n, v in z.scatter(data).items())
    errors = []
    try:
        tensor_function(Repartition(x, y), run.mesh, x, y, ("d", None), (None, None, "d"))
    except MeshError as error:
        errors.append(str(error))
    try:
        f({"x": np.zeros((count, 3, 5), np.int32)})
    except StateError as error:
        errors.append(str(error))
    try:
        f({"x": np.zeros((count, *f.domain.slots[0].shape), bool)})
    except DtypeError as error:
        errors.append(str(error))
    try:
        f.blocks(data)  # the global array, not the per-worker blocks
    except StateError as error:
        errors.append(str(error))
    try:
        f.blocks({n: np.full(v.shape, "a") for n, v in x.scatter(data).items()})
    except DtypeError as error:
        errors.append(str(error))
    assert len(errors) == 5, errors
    assert "dict of per-worker arrays keyed by block name" in errors[3] and "tensor_function" in errors[3]
    assert "block 'x[0,0]' has dtype <U1 (string)" in errors[4], errors[4]
    assert "tensor 'y' has 2 dimensions but the mesh mapping (None, None, 'd') names 3" in errors[0], errors[
        0
    ]
    assert "slot 'x' has shape" in errors[1] and "slot 'x' has dtype bool" in errors[2], errors
    print("api and errors:", errors[0][:60], "|", errors[1][:40])


def check_integer_sums(run: Run) -> None:
    """An all-reduce of integers over every device never wraps: uint8 200 x K and int16
    30000 x K are exact (int64 with x64, else int32); int32 2**30 + 5 x K is exact in int64
    with x64 and an IntegerOverflowError without (JAX holds no wider integer); int64 with x64
    is refused (its sum may pass 2**62). The same through the host callback (jax_function)
    and inside jit."""
    if run.count < 2:
        return
    from linop.frameworks.jax_function import function

    count = run.count
    t = DistributedTensor("t", (2 * count,), Partition.grid((count,)))
    op = AllReduce(t, (0,))
    f, host = sharded(op, run.mesh), function(op)
    wide = np.int64 if X64 else np.int32
    cases = [(np.uint8, 200, wide), (np.int16, 30000, wide), (np.int32, 2**30 + 5, np.int64 if X64 else None)]
    if X64:
        cases.append((np.int64, 3, None))
    for dtype, value, expected in cases:
        state = {b.name: np.full(b.shape, value, dtype) for b in op.domain}
        runs = {"sharded": f.blocks, "sharded in jit": jax.jit(f.blocks), "jax_function": host}
        runs["jax_function in jit"] = jax.jit(host)
        for how, call in runs.items():
            label = f"{how} {np.dtype(dtype).name} {value} x {count}"
            try:
                got = call(state)
            except IntegerOverflowError as error:
                assert expected is None, f"{label}: refused, expected {expected}: {error}"
                assert "jax_enable_x64" in str(error) or "2**62" in str(error) or "int64" in str(error), error
                continue
            assert expected is not None, f"{label}: not refused: {got}"
            for name, block in got.items():
                assert block.dtype == expected, f"{label}: {name} in {block.dtype}, expected {expected}"
                assert np.asarray(block).tolist() == [value * count] * 2, f"{label}: {name} = {block}"
    run.checked.append(f"integer all-reduces on {count} devices")


def check_reordered_mesh_axes(run: Run) -> None:
    """A plan over the axes of a 2 x 2 mesh named out of the mesh's order (``("c", "r")`` on a
    mesh ``("r", "c")``) counts devices in that order in every collective, ``ppermute``
    included: repartitions (uneven: ppermute rounds; even: all_to_all), halo windows and an
    all-reduce along one partition axis (one psum over the mesh axis it runs along), forward
    and transposes exact."""
    if run.count != 4:
        return
    square = Mesh(run.mesh.devices.reshape(2, 2), ("r", "c"))
    from linop import Kernel

    a = DistributedTensor("a", (5, 4), Partition.grid((2, 2)))
    b = DistributedTensor("b", (5, 4), Partition.grid((4, 1)))
    c = DistributedTensor("c", (4, 4), Partition.grid((2, 2)))
    d = DistributedTensor("d", (4, 4), Partition.grid((1, 4)))
    t = DistributedTensor("t", (4, 6), Partition.grid((2, 2)))
    trees = (
        Repartition(a, b),
        Repartition(c, d),
        halo_windows(a, Kernel((3, 3), padding=1)),
        AllReduce(t, (0,)),
    )
    for op in trees:
        prove(run, sharded(op, square, axes=("c", "r")), f"axes ('c', 'r') of a mesh ('r', 'c'): {op}")
    cube = Mesh(run.mesh.devices.reshape(2, 1, 2), ("x", "y", "z"))  # three axes, one of size 1
    for axes in (("z", "y", "x"), ("z", "x")):
        prove(run, sharded(trees[0], cube, axes=axes), f"axes {axes} of a mesh ('x', 'y', 'z')")


def check_uneven_normal_operator(run: Run) -> None:
    """``w.H @ w`` of halo windows on uneven rows (the windows cleared whole, then read
    back): exactly, with its transposes."""
    from linop import Kernel

    count = run.count
    w = halo_windows(
        DistributedTensor("w", (7 * count + 1, 8), Partition.grid((count, 1))), Kernel(3, padding=1)
    )
    prove(run, sharded(w.H @ w, run.mesh), f"uneven w.H @ w: {w}", every=True)


def check_dtypes(run: Run) -> None:
    """Every dtype JAX holds in this mode: an uneven repartition and the in-place halo
    exchange on an even 2 x 2 split (the two that failed with x64), in float32/64,
    complex64/128 and integers; the forward equals the numpy interpreter in the dtype JAX holds
    (float64 as float32 without x64), the transpose equals ``op.H`` in the cotangent's dtype.
    Integer sums: :func:`check_integer_sums`."""
    if run.count != 4:
        return
    from linop import Kernel

    square = Mesh(run.mesh.devices.reshape(2, 2), ("r", "c"))
    x = DistributedTensor("x", (9, 5), Partition.grid((4, 1)))
    y = DistributedTensor("y", (9, 5), Partition.grid((2, 2)))
    u = DistributedTensor("u", (6, 6), Partition.grid((2, 2)))
    trees = [(Repartition(x, y), run.mesh), (HaloExchange(halo_geometry(u, Kernel(3, padding=1))), square)]
    dtypes = [np.float32, np.float64, np.complex64, np.complex128, np.int8, np.uint16, np.int32]
    rng = np.random.default_rng(5)
    for op, mesh in trees:
        f = sharded(op, mesh)
        for dtype in dtypes:
            label = f"{np.dtype(dtype).name} {op}"
            held = jax.dtypes.canonicalize_dtype(dtype)
            try:
                cast = integer_cast(op, (held,))
            except IntegerOverflowError:
                assert np.dtype(dtype) == np.int32 and not X64, label
                continue
            expected = held if cast is None else cast
            x_state = {b.name: rng.integers(0, 100, b.shape).astype(dtype) for b in op.domain}
            got = f.blocks(x_state)
            want = op(x_state)
            for name in want:
                assert got[name].dtype == expected, (
                    f"{label}: {name} in {got[name].dtype}, expected {expected}"
                )
            assert mismatch(got, want) is None, f"{label}: {mismatch(got, want)}"
            if np.dtype(dtype).kind in "fc":
                y_state = {b.name: rng.integers(0, 100, b.shape).astype(held) for b in op.range}
                x_jax = {k: jnp.asarray(v, held) for k, v in x_state.items()}
                (back,) = jax.linear_transpose(f.blocks, x_jax)(y_state)
                for name, value in back.items():
                    assert value.dtype == held, f"{label}: transpose {name} in {value.dtype}"
                assert mismatch(back, op.H(y_state)) is None, (
                    f"{label}: transpose {mismatch(back, op.H(y_state))}"
                )
        run.checked.append(f"{op} in {len(dtypes)} dtypes")


def check_count(count: int) -> None:
    """Every check on a mesh over the first ``count`` devices; prints ``OK n trees proven on
    count devices``."""
    start = time.perf_counter()
    run = Run.on_first(count)
    if count == 4:
        from check_lift import check_lift

        check_lift(run.mesh)
    check_api(run)
    check_control(run)
    check_native_allreduce(run)
    check_native_collectives(run)
    check_psum_over_a_mesh_axis(run)
    if count >= 2:  # one device: nothing moves between devices
        check_drawn_native_collectives(run)
    check_uneven_77_rows(run)
    check_integer_sums(run)
    check_dtypes(run)
    check_reordered_mesh_axes(run)
    check_uneven_normal_operator(run)
    check_collectives(run)
    check_halos(run)
    check_movement(run)
    check_worker_map(run)
    seconds = time.perf_counter() - start
    print(f"OK {len(run.checked)} trees proven on {count} devices ({seconds:.1f} s)")


def run_counts(check: Callable[[int], None], counts: list[int]) -> None:
    """Run ``check`` for each device count, each reported under its count (a failure does not
    stop the next count); exit with status 1 if any failed."""
    failed = []
    for count in counts:
        print(f"== {count} devices", flush=True)
        try:
            check(count)
        except Exception:  # reported under its count; the next count still runs
            traceback.print_exc(file=sys.stdout)
            print(f"FAILED on {count} devices")
            failed.append(count)
        sys.stdout.flush()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    run_counts(check_count, COUNTS)
