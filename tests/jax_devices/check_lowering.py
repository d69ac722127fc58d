"""Proofs of the lowering onto JAX devices, run in ONE process per device count (launched by
``tests/test_jax_shard.py``: ``python check_lowering.py K``, which sets
``XLA_FLAGS=--xla_force_host_platform_device_count=K`` before importing JAX).

For trees drawn by hypothesis (derandomized) on K workers: halo exchanges (nested multi-hop
and direct, unbalanced and empty shares, every boundary mode), halo windows, repartitions,
broadcasts, sum-reduces, all-reduces, all-gathers and random movement trees (copies, moves,
adds, clears, allocations, scalings, sums), and a worker map (2K workers on K devices):

- the lowered program equals the numpy interpreter exactly (int32 entries);
- its transpose by ``jax.linear_transpose`` and its ``jax.vjp`` equal ``op.H`` exactly, and
  so does JAX's own transpose of the lowered program (``adjoint_by_tree=False``);
- ``jax.jvp`` gives the op on the tangent and ``jax.vmap`` maps over a batch;
- phases in which every device sends to every other lower to native collectives
  (``all_to_all``, ``all_gather``, ``psum_scatter``), proven likewise;
- deliberately wrong lowerings (one round's permutation reversed, an all_to_all's boxes
  placed by the wrong senders) are caught.

``LINOP_LONG=1`` draws more examples.
"""

from __future__ import annotations

import os
import sys

COUNT = int(sys.argv[1]) if len(sys.argv) > 1 else 4
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={COUNT}"

import dataclasses  # noqa: E402
import pathlib  # noqa: E402

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
    Broadcast,
    DistributedTensor,
    HaloExchange,
    Partition,
    Repartition,
    halo_geometry,
    halo_windows,
)
from linop.backends.jax.plan import Exchange, Plan  # noqa: E402
from linop.frameworks.jax_sharded import ShardedOperator, sharded  # noqa: E402
from linop.layout import BlockGrid  # noqa: E402
from verify.strategies_distributed import decompositions  # noqa: E402
from verify.strategies_halo import halo_cases  # noqa: E402

assert len(jax.devices()) == COUNT, jax.devices()
LONG = os.environ.get("LINOP_LONG") == "1"
MESH = Mesh(np.array(jax.devices()), ("d",))
CHECKED: list[str] = []


def state_of(space, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {b.name: rng.integers(-9, 10, b.shape).astype(np.int32) for b in space}


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
        array = np.zeros((layout.devices, *spec.shape), np.int32)
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


def prove(f: ShardedOperator, label: str, every: bool = False) -> None:
    """Forward, both transposes, vjp (and on every fourth case jvp and vmap) of ``f`` against
    the numpy interpreter, all in one jitted function (one compilation per case)."""
    op = f.op
    x, y, x2 = state_of(op.domain, 1), state_of(op.range, 2), state_of(op.domain, 3)
    want, want_h = op(x), op.H(y)
    args, cotangent = host_pack(f.domain, x), tuple(a.astype(np.float32) for a in host_pack(f.range, y))
    second = host_pack(f.domain, x2)
    own = _own(f)
    extra = every or LONG or len(CHECKED) % 4 == 0

    def everything(args, cotangent, second):
        floats = [a.astype(jnp.float32) for a in args]
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
    CHECKED.append(label)


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


def workers_partition(draw, shape) -> Partition:
    count = int(np.prod(shape))
    chosen = draw(st.permutations(range(COUNT)))[:count]
    return Partition(tuple(shape), tuple(chosen))


@st.composite
def grid_shapes(draw, rank: int) -> tuple[int, ...]:
    shape = []
    left = COUNT
    for _ in range(rank):
        n = draw(st.integers(1, max(1, left)))
        shape.append(n)
        left //= n
    return tuple(shape)


@st.composite
def tensors(draw, name: str, rank: int, global_shape=None) -> DistributedTensor:
    grid = draw(grid_shapes(rank))
    if global_shape is None:
        global_shape = tuple(draw(st.integers(0, 7)) for _ in range(rank))
    sizes = draw(decompositions(global_shape, grid))
    return DistributedTensor(name, tuple(global_shape), workers_partition(draw, grid), sizes)


@st.composite
def collective_trees(draw):
    kind = draw(st.sampled_from(["repartition", "broadcast", "allreduce", "allgather"]))
    rank = draw(st.integers(1, 2))
    if kind == "repartition":
        x = draw(tensors("x", rank))
        op = Repartition(x, draw(tensors("y", rank, x.global_shape)))
    elif kind == "broadcast":
        x = draw(tensors("x", rank))
        left = COUNT // int(np.prod(x.partition.shape))
        grid = []
        for n in x.partition.shape:  # a source extent > 1 stays, an extent 1 may broadcast
            g = n if n != 1 else draw(st.integers(1, max(1, left)))
            left //= 1 if n != 1 else g
            grid.append(g)
        op = Broadcast(x, workers_partition(draw, grid), "y")
    elif kind == "allreduce":
        partition = workers_partition(draw, draw(grid_shapes(rank)))
        shape = tuple(draw(st.integers(0, 3)) for _ in range(draw(st.integers(0, 2))))
        axes = tuple(sorted(draw(st.sets(st.integers(0, rank - 1)))))
        op = AllReduce(BlockGrid.uniform("u", partition, shape), axes)
    else:
        x = draw(tensors("x", rank))
        op = AllGather(x, tuple(sorted(draw(st.sets(st.integers(0, rank - 1))))), "g")
    return op.H if draw(st.booleans()) else op


@st.composite
def halo_trees(draw):
    x, kernel = draw(halo_cases(max_dims=2))
    assume(x.partition.size <= COUNT)
    kind = draw(st.sampled_from(["nested", "direct", "windows"]))
    op = halo_windows(x, kernel) if kind == "windows" else HaloExchange(halo_geometry(x, kernel), kind)
    return op.H if draw(st.booleans()) else op


@SETTINGS
@given(collective_trees())
def check_collectives(op) -> None:
    prove(sharded(op, MESH), str(op))


@SETTINGS
@given(halo_trees())
def check_halos(op) -> None:
    prove(sharded(op, MESH), str(op))


@SETTINGS
@given(movement_trees(COUNT))
def check_movement(op) -> None:
    prove(sharded(op, MESH), f"movement tree {op}")


@SETTINGS
@given(movement_trees(2 * COUNT))
def check_worker_map(op) -> None:
    prove(sharded(op, MESH, workers=[w % COUNT for w in range(2 * COUNT)]), f"2 workers per device: {op}")


def check_uneven_77_rows() -> None:
    """77 rows over 4 devices (shard_map refuses): repartition and halo windows, exactly."""
    if COUNT < 4:
        return
    x = DistributedTensor("x", (77, 6), Partition.grid((4, 1)))
    y = DistributedTensor("y", (77, 6), Partition.grid((2, 2)))
    from linop import Kernel

    for op in (Repartition(x, y), halo_windows(x, Kernel((3, 3), padding=1, boundary="periodic"))):
        f = sharded(op, MESH)
        assert any(s.padded for s in f.domain.slots), f.domain
        prove(f, f"uneven {op}")


def check_native_allreduce() -> None:
    """An all-reduce over every device lowers to one ``psum`` (also inside a composition and
    in its adjoint), exactly."""
    from linop.backends.jax.plan import PsumOp

    t = DistributedTensor("t", (3 * COUNT, 2), Partition.grid((COUNT, 1)))
    x = DistributedTensor("x", (3 * COUNT, 2), Partition.grid((1, 1)))
    for op in (AllReduce(t, (0,)), AllReduce(t, (0,)) @ Repartition(x, t)):
        f = sharded(op, MESH)
        assert any(isinstance(o, PsumOp) for o in f.plan.ops), f.plan.ops
        assert any(isinstance(o, PsumOp) for o in f.plan.adjoint().ops)
        prove(f, f"native {op}")


def check_psum_over_a_mesh_axis() -> None:
    """On a 2 x 2 mesh, an all-reduce over one partition axis is one psum over the mesh axis
    its groups run along (rows: "a", columns: "b"), in the forward and the adjoint plan."""
    if COUNT != 4:
        return
    from linop.backends.jax.plan import PsumOp

    square = Mesh(np.array(jax.devices()).reshape(2, 2), ("a", "b"))
    t = DistributedTensor("t", (4, 6), Partition.grid((2, 2)))
    for axis in (0, 1):
        f = sharded(AllReduce(t, (axis,)), square)
        assert [o.over for o in f.plan.ops if isinstance(o, PsumOp)] == [(axis,)], f.plan.ops
        assert [o.over for o in f.plan.adjoint().ops if isinstance(o, PsumOp)] == [(axis,)]
        prove(f, f"psum over mesh axis {'ab'[axis]}")
    on_a_line = sharded(AllReduce(t, (0,)), MESH)  # the same groups on one axis: ppermute rounds
    assert not any(isinstance(o, PsumOp) for o in on_a_line.plan.ops)
    prove(on_a_line, "the same all-reduce on a 1-d mesh")


def kinds(plan: Plan) -> list[tuple[str, bool]]:
    from linop.backends.jax.plan import CollectiveOp

    return [(p.kind, p.with_self) for o in plan.ops if isinstance(o, CollectiveOp) for p in o.pieces]


@st.composite
def even_collectives(draw):
    """Layouts whose phases are native collectives: every device sends one box of one shape
    to every other (even shares over all COUNT devices, workers in any order)."""
    kind = draw(st.sampled_from(["repartition", "allgather", "reducescatter"]))
    n = draw(st.integers(1, 3))
    cols = draw(st.integers(1, 3))
    order = tuple(draw(st.permutations(range(COUNT))))
    rows = DistributedTensor("x", (COUNT * n, COUNT * cols), Partition((COUNT, 1), order))
    if kind == "repartition":
        target = DistributedTensor(
            "y", rows.global_shape, Partition((1, COUNT), tuple(draw(st.permutations(range(COUNT)))))
        )
        op = Repartition(rows, target)
        want = "all_to_all"
    else:
        op = AllGather(rows, (0,), "g")
        want = "all_gather"
        if kind == "reducescatter":
            op, want = op.H, "psum_scatter"
    return op, want


@SETTINGS
@given(even_collectives())
def check_drawn_native_collectives(case) -> None:
    op, want = case
    f = sharded(op, MESH)
    assert (want, True) in kinds(f.plan), (op, kinds(f.plan))
    prove(f, f"native {want}: {op}", every=True)


def check_native_collectives() -> None:
    """Rows -> columns is one all_to_all (each device's own box inside it), an all-gather one
    all_gather, its adjoint (a reduce-scatter) one psum_scatter; exactly, with their
    transposes by op.H; uneven shares keep ppermute rounds; a wrong all_to_all is caught."""
    if COUNT < 2:
        return
    rows = DistributedTensor("x", (2 * COUNT, 3 * COUNT), Partition.grid((COUNT, 1)))
    columns = DistributedTensor("y", (2 * COUNT, 3 * COUNT), Partition.grid((1, COUNT)))
    turn = sharded(Repartition(rows, columns), MESH)
    assert kinds(turn.plan) == [("all_to_all", True)], kinds(turn.plan)
    assert kinds(turn.plan.adjoint()) == [("all_to_all", True)]
    assert not any(isinstance(o, Exchange) for o in turn.plan.ops)
    prove(turn, "native all_to_all", every=True)
    gather = sharded(AllGather(rows, (0,), "g"), MESH)
    assert ("all_gather", True) in kinds(gather.plan), kinds(gather.plan)
    assert ("psum_scatter", True) in kinds(gather.plan.adjoint()), kinds(gather.plan.adjoint())
    prove(gather, "native all_gather", every=True)
    prove(gather.H, "native psum_scatter", every=True)
    uneven = DistributedTensor("u", (2 * COUNT + 1, 3 * COUNT), Partition.grid((COUNT, 1)))
    other = DistributedTensor("v", (2 * COUNT + 1, 3 * COUNT), Partition.grid((1, COUNT)))
    if COUNT > 2:  # boxes of two shapes: no single collective
        assert kinds(sharded(Repartition(uneven, other), MESH).plan) == []
    from linop.backends.jax.plan import CollectiveOp

    ops = list(turn.plan.ops)
    k = next(i for i, o in enumerate(ops) if isinstance(o, CollectiveOp))
    (piece,) = ops[k].pieces
    ops[k] = CollectiveOp((dataclasses.replace(piece, places=piece.places[::-1].copy()),))
    wrong = ShardedOperator(
        turn.op, MESH, plan=dataclasses.replace(turn.plan, ops=tuple(ops), adjoint_cache=[])
    )
    try:
        prove(wrong, "control: all_to_all boxes placed by the wrong senders")
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


def check_control() -> None:
    """The same comparison catches a reversed permutation (forward and transpose)."""
    if COUNT < 2:
        return
    x = DistributedTensor("x", (9, 4), Partition.grid((COUNT, 1)))
    y = DistributedTensor("y", (9, 4), Partition.grid((1, 2 if COUNT >= 2 else 1)))
    op = Repartition(x, y)
    good = sharded(op, MESH)
    wrong = ShardedOperator(op, MESH, plan=reversed_round(good.plan))
    try:
        prove(wrong, "control: reversed permutation")
    except AssertionError as error:
        assert "forward differs from the numpy interpreter" in str(error), error
        print("control caught:", str(error)[:100])
    else:
        raise AssertionError("a reversed permutation was not caught")


def check_api() -> None:
    """tensor_function on global arrays (uneven rows), f.blocks, and the typed errors."""
    from linop.errors import DtypeError, MeshError, StateError
    from linop.frameworks.jax_sharded import tensor_function

    rows = 4 * COUNT + 1  # uneven over the devices
    x = DistributedTensor("x", (rows, 5), Partition.grid((COUNT, 1)))
    y = DistributedTensor("y", (rows, 5), Partition.grid((1, 1)))
    z = DistributedTensor(
        "z",
        (rows, 5),
        Partition.grid((COUNT, 1), first=0),
        sizes=((rows - COUNT + 1,) + (1,) * (COUNT - 1), (5,)),
    )
    data = np.arange(rows * 5, dtype=np.int32).reshape(rows, 5)
    move = tensor_function(Repartition(x, z), MESH, x, z, ("d", None))
    assert np.array_equal(np.asarray(jax.jit(move)(data)), data)
    gradient = jax.grad(lambda a: jnp.sum(move(a) * jnp.arange(rows * 5.0).reshape(rows, 5)))(
        data.astype(np.float32)
    )
    assert np.array_equal(np.asarray(gradient), data), "the gradient of a repartition is its inverse"
    rows_even = DistributedTensor("r", (2 * COUNT, 3 * COUNT), Partition.grid((COUNT, 1)))
    columns = DistributedTensor("c", (2 * COUNT, 3 * COUNT), Partition.grid((1, COUNT)))
    even = np.arange(6 * COUNT * COUNT, dtype=np.float32).reshape(2 * COUNT, 3 * COUNT)
    turn = tensor_function(
        Repartition(rows_even, columns), MESH, rows_even, columns, ("d", None), (None, "d")
    )
    assert turn.reshapes and (COUNT == 1 or not move.reshapes)  # one device: nothing is uneven
    assert np.array_equal(np.asarray(jax.jit(turn)(even)), even), "even shards: the reshape path"
    back = jax.jit(jax.grad(lambda a: jnp.sum(turn(a) * even)))(even)
    assert np.array_equal(np.asarray(back), even)
    f = sharded(Repartition(x, z), MESH)
    blocks = f.blocks(x.scatter(data))
    assert all(np.array_equal(np.asarray(blocks[n]), v) for n, v in z.scatter(data).items())
    errors = []
    try:
        tensor_function(Repartition(x, y), MESH, x, y, ("d", None), (None, None, "d"))
    except MeshError as error:
        errors.append(str(error))
    try:
        f({"x": np.zeros((COUNT, 3, 5), np.int32)})
    except StateError as error:
        errors.append(str(error))
    try:
        f({"x": np.zeros((COUNT, *f.domain.slots[0].shape), bool)})
    except DtypeError as error:
        errors.append(str(error))
    assert len(errors) == 3, errors
    assert "tensor 'y' has 2 dimensions but the mesh mapping (None, None, 'd') names 3" in errors[0], errors[
        0
    ]
    assert "slot 'x' has shape" in errors[1] and "slot 'x' has dtype bool" in errors[2], errors
    print("api and errors:", errors[0][:60], "|", errors[1][:40])


if __name__ == "__main__":
    if COUNT == 4:
        from check_lift import check_lift

        check_lift(MESH)
    check_api()
    check_control()
    check_native_allreduce()
    check_native_collectives()
    check_psum_over_a_mesh_axis()
    if COUNT >= 2:  # one device: nothing moves between devices
        check_drawn_native_collectives()
    check_uneven_77_rows()
    check_collectives()
    check_halos()
    check_movement()
    check_worker_map()
    print(f"OK {len(CHECKED)} trees proven on {COUNT} devices")
