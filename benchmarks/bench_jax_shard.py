"""JAX devices benchmark: linop's lowering into ``shard_map`` against hand-written ``shard_map``
code doing the same moves, and against the host-callback adapter (``linop.frameworks.
jax_function``), on 4 host devices (``XLA_FLAGS=--xla_force_host_platform_device_count=4``,
set here before JAX is imported). Forward and ``grad`` (of ``0.5 |f(x)|^2``: a forward and a
transpose), all under ``jit``, float32:

- halo windows of a 2-d array cut in 4 row blocks, kernel 3 x 3, zero padding 1 (hand: two
  ``ppermute`` of one row each, ``concatenate`` and ``pad``): forward, grad, and the transpose
  alone (the VJP of a fixed cotangent; in the grad of ``0.5 |f|^2`` the cotangent is the
  forward's output, which XLA partly simplifies away for the hand-written code);
- repartition rows -> columns (hand: one tiled ``all_to_all``; linop: one ``all_to_all``);
- all-gather (hand and linop: one ``all_gather``; its transpose a ``psum_scatter``);
- all-reduce (hand and linop: ``psum``);
- against the host callback at the README's size (16 rows per device) and larger;
- the fixed cost of one call (the smallest halo; and an identity ``shard_map``: dispatch);
- the padding overhead: halo windows with 4n - 3 rows (uneven, padded slots) against 4n rows,
  forward, grad of ``0.5 |f - t|^2`` (the target an argument of the jitted function), the
  transpose alone, and grad of ``0.5 |f|^2``, which is not the same work on both sides: for the
  even layout XLA cancels the transpose's slices against the forward's (its grad compiles to
  the forward's fusions and costs about a forward), which the masks of uneven blocks prevent,
  so that row measures XLA's simplification, not the padding (the row prints both programs'
  fusion counts);
- a 3 x 3 convolution's input tree (``Convolution(x, 16, Kernel(3, padding=1)).input_operator``
  on a 4 x 16 x 256 x 256 field in 4 row blocks; 4 x 16 x 64 x 64 with ``--quick``) against a
  hand-written ``shard_map`` convolution (two one-row ``ppermute``, ``concatenate``, one
  ``conv_general_dilated``), against plain ``conv_general_dilated`` on one device, and against
  the same plan with its kernels run the old way (a ``lax.switch`` over per-device kernels),
  forward and grad; on 4n - 3 rows too (uneven; against the even rows also the grad of
  ``0.5 |f - t|^2`` and the transpose alone). ``--conv`` runs this case alone, ``--padding``
  the padding overhead alone.

Every pair is first checked to give the same result. Prints medians and ratios (linop /
other). Run: ``python benchmarks/bench_jax_shard.py [--quick | --large]``.
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax
import jax.numpy as jnp
import numpy as np
from _timing import compare
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from linop import AllGather, AllReduce, DistributedTensor, Kernel, Partition, Repartition, halo_windows
from linop.backends.jax.plan import KernelOp
from linop.frameworks.jax_function import function as callback_function
from linop.frameworks.jax_sharded import sharded
from linop.layers import Convolution
from linop.layout import BlockGrid

QUICK = "--quick" in sys.argv
REPEATS = 5 if QUICK else 11
PADDING_REPEATS = 41  # the padding cases take about a millisecond: more samples on a shared machine
MESH = Mesh(np.array(jax.devices()), ("d",))
ROWS = NamedSharding(MESH, PartitionSpec("d"))
P = 4


def hand_map(kernel):
    return jax.jit(
        jax.shard_map(kernel, mesh=MESH, in_specs=PartitionSpec("d"), out_specs=PartitionSpec("d"))
    )


def hand_halo(x):
    block = x[0]
    from_above = lax.ppermute(block[-1:], "d", [(i, i + 1) for i in range(P - 1)])
    from_below = lax.ppermute(block[:1], "d", [(i + 1, i) for i in range(P - 1)])
    return jnp.pad(jnp.concatenate([from_above, block, from_below]), ((0, 0), (1, 1)))[None]


def hand_columns(x):
    return lax.all_to_all(x[0], "d", split_axis=1, concat_axis=0, tiled=True)[None]


def hand_gather(x):
    return lax.all_gather(x[0], "d", axis=0, tiled=True)[None]


def hand_allreduce(x):
    return lax.psum(x, "d")


def loss_grad(f):
    return jax.jit(jax.grad(lambda a: 0.5 * jnp.sum(f(a) ** 2)))


def target_grad(f, target):
    """The grad of ``0.5 |f(x) - t|^2``, the target ``t`` a jitted argument: the transpose
    then runs on a cotangent that is not ``f``'s own output, so XLA cannot cancel it against
    the forward (as it does for ``0.5 |f|^2`` where every slice is static: the even layout's
    grad then costs a forward, and comparing an uneven layout with it compares different
    work). Both sides of a comparison do the whole forward and transpose."""
    g = jax.jit(jax.grad(lambda a, t: 0.5 * jnp.sum((f(a) - t) ** 2)))
    return lambda a: g(a, target)


def fusions(f, argument) -> int:
    """How many fusions XLA compiled ``f`` into (a program that does less has fewer)."""
    return f.lower(argument).compile().as_text().count(" fusion(")


def run(ours, theirs, argument) -> tuple[float, float, float]:
    a, b = ours(argument), theirs(argument)
    assert np.array_equal(np.asarray(a), np.asarray(b)), "the two sides differ"
    return compare(
        lambda: jax.block_until_ready(ours(argument)),
        lambda: jax.block_until_ready(theirs(argument)),
        REPEATS,
    )


def row(label: str, timing: tuple[float, float, float]) -> None:
    mine, other, ratio = timing
    print(f"| {label} | {mine * 1e3:9.3f} ms | {other * 1e3:9.3f} ms | {ratio:6.2f}x |")


def single(f):
    """The lowering on one stacked slot in, one out."""
    return jax.jit(lambda a: f.arrays(a)[0])


def vjp_of(f, cotangent):
    """The transpose alone: the VJP of ``f`` applied to ``cotangent``, passed to the jitted
    function as an argument (closed over, it is a constant, and XLA may fold the whole
    transpose of a constant away where the program has no per-device starts: the even
    layout's transpose then measured nothing)."""
    transpose = jax.jit(lambda a, c: jax.vjp(f, a)[1](c)[0])
    return lambda a: transpose(a, cotangent)


def via_callback_of(op):
    back = callback_function(op)
    names = op.domain.names

    def via_callback(a):
        state = {name: a[i] for i, name in enumerate(names)}
        return jnp.stack(list(back(state).values()))

    return jax.jit(via_callback)


def close(ours, theirs, argument, tolerance=1e-3) -> tuple[float, float, float]:
    """:func:`run` for float kernels: the two sides agree within ``tolerance`` (relative to the
    largest entry)."""
    a, b = np.asarray(ours(argument)), np.asarray(theirs(argument))
    scale = max(float(np.abs(b).max()), 1.0)
    assert a.shape == b.shape and np.abs(a - b).max() <= tolerance * scale, "the two sides differ"
    return compare(
        lambda: jax.block_until_ready(ours(argument)),
        lambda: jax.block_until_ready(theirs(argument)),
        REPEATS,
    )


def switched(f):
    """``f`` with its plans' kernels run the old way (``lax.switch`` over per-device kernels),
    for the comparison: the same plan, every KernelOp's mode set to "switch"."""
    from dataclasses import replace

    def retag(plan):
        ops = tuple(replace(o, mode="switch") if isinstance(o, KernelOp) else o for o in plan.ops)
        return replace(plan, ops=ops, adjoint_cache=[])

    plan = retag(f.plan)
    plan.adjoint_cache.append(retag(f.plan.adjoint()))
    return type(f)(f.op, f.mesh, axes=f.axes, plan=plan)


def convolution_rows() -> None:
    """The convolution input tree against hand shard_map, one device and the switch path."""
    batch, channels, side = (4, 16, 64) if QUICK else (4, 16, 256)
    rng = np.random.default_rng(3)
    w = rng.standard_normal((channels, channels, 3, 3)).astype(np.float32) / 12
    weights = jnp.asarray(w)
    numbers = lax.conv_dimension_numbers((1, 1, 1, 1), w.shape, ("NCHW", "OIHW", "NCHW"))

    def hand_conv(a):  # a: (1, N, C, rows, side), this device's rows
        block = a[0]
        above = lax.ppermute(block[:, :, -1:], "d", [(i, i + 1) for i in range(P - 1)])
        below = lax.ppermute(block[:, :, :1], "d", [(i + 1, i) for i in range(P - 1)])
        window = jnp.concatenate([above, block, below], axis=2)
        y = lax.conv_general_dilated(window, weights, (1, 1), ((0, 0), (1, 1)), dimension_numbers=numbers)
        return y[None]

    def one_device(a):  # a: (N, C, rows, side), the whole field
        return lax.conv_general_dilated(a, weights, (1, 1), ((1, 1), (1, 1)), dimension_numbers=numbers)

    even = None
    for rows in (P * side // 4, P * side // 4 - 3):
        x = DistributedTensor("x", (batch, channels, rows, side), Partition((1, 1, P, 1)))
        f = sharded(Convolution(x, channels, Kernel(3, padding=1)).input_operator(w), MESH)
        modes = sorted({o.mode for o in (*f.plan.ops, *f.plan.adjoint().ops) if isinstance(o, KernelOp)})
        field = rng.standard_normal((batch, channels, rows, side)).astype(np.float32)
        stacked = jax.device_put(jnp.asarray(next(iter(f.pack(x.scatter(field)).values()))), ROWS)
        ours, old = single(f), single(switched(f))
        label = f"convolution 3x3 {batch}x{channels}x{rows}x{side} ({'/'.join(modes)})"
        if even is None:
            hand = hand_map(hand_conv)
            row(f"{label}, forward, vs hand shard_map", close(ours, hand, stacked))
            row(f"{label}, grad, vs hand shard_map", close(loss_grad(ours), loss_grad(hand), stacked))
            whole = jax.device_put(jnp.asarray(field), jax.devices()[0])
            row(f"{label}, forward, vs one device", timed(ours, stacked, jax.jit(one_device), whole))
            row(
                f"{label}, grad, vs one device", timed(loss_grad(ours), stacked, loss_grad(one_device), whole)
            )
            even = (ours, stacked)
            even_transpose = (vjp_of(ours, random_cotangent(f)), stacked)
            even_target = (target_grad(ours, random_cotangent(f)), stacked)
        else:
            e_ours, e_stacked = even
            row(
                f"{label}, forward, vs the even {P * side // 4} rows", timed(ours, stacked, e_ours, e_stacked)
            )
            row(
                f"{label}, grad, vs the even {P * side // 4} rows",
                timed(loss_grad(ours), stacked, loss_grad(e_ours), e_stacked),
            )
            row(
                f"{label}, grad of 0.5 |f - t|^2 (t an argument), vs the even {P * side // 4} rows",
                timed(target_grad(ours, random_cotangent(f)), stacked, *even_target),
            )
            row(
                f"{label}, transpose alone (vjp of a random cotangent), vs the even {P * side // 4} rows",
                timed(vjp_of(ours, random_cotangent(f)), stacked, *even_transpose),
            )
        row(f"{label}, forward, vs lax.switch kernels", close(ours, old, stacked))
        row(f"{label}, grad, vs lax.switch kernels", close(loss_grad(ours), loss_grad(old), stacked))


def random_cotangent(f) -> jax.Array:
    """A float32 cotangent of ``f``'s one range slot, stacked over the devices."""
    shape = (P, *f.range.slots[0].shape)
    return jax.device_put(jnp.asarray(np.random.default_rng(9).standard_normal(shape), jnp.float32), ROWS)


def timed(ours, a, theirs, b) -> tuple[float, float, float]:
    """:func:`compare` of ``ours(a)`` against ``theirs(b)``."""
    return compare(lambda: jax.block_until_ready(ours(a)), lambda: jax.block_until_ready(theirs(b)), REPEATS)


def padding_rows() -> None:
    """Halo windows of 4n - 3 rows (padded slots) against 4n rows, forward and grad."""
    n = 512
    even = DistributedTensor("u", (P * n, n), Partition.grid((P, 1)))
    uneven = DistributedTensor("u", (P * n - 3, n), Partition.grid((P, 1)))
    f_even, f_uneven = (sharded(halo_windows(t, Kernel(3, padding=1)), MESH) for t in (even, uneven))
    xe = jax.device_put(jnp.ones((P, n, n), jnp.float32), ROWS)
    shape = f_uneven.domain.slots[0].shape
    xu = jax.device_put(jnp.ones((P, *shape), jnp.float32), ROWS)
    padded = 1 - (P * n - 3) * n / (P * shape[0] * shape[1])
    ours_u, ours_e = single(f_uneven), single(f_even)
    ours_u(xu)
    timing = compare(
        lambda: jax.block_until_ready(ours_u(xu)), lambda: jax.block_until_ready(ours_e(xe)), PADDING_REPEATS
    )
    row(
        f"padding: halo windows of {P * n - 3} rows ({padded:.2%} of the slot padded) vs {P * n} rows, forward",
        timing,
    )
    ct_u = jax.device_put(jnp.ones((P, *f_uneven.range.slots[0].shape), jnp.float32), ROWS)
    ct_e = jax.device_put(jnp.ones((P, *f_even.range.slots[0].shape), jnp.float32), ROWS)
    grads = target_grad(ours_u, ct_u / 2), target_grad(ours_e, ct_e / 2)
    grads[0](xu)
    timing = compare(
        lambda: jax.block_until_ready(grads[0](xu)),
        lambda: jax.block_until_ready(grads[1](xe)),
        PADDING_REPEATS,
    )
    row("padding: same, grad of 0.5 |f - t|^2 (t an argument: both sides the whole work)", timing)
    grads = loss_grad(ours_u), loss_grad(ours_e)
    grads[0](xu)
    timing = compare(
        lambda: jax.block_until_ready(grads[0](xu)),
        lambda: jax.block_until_ready(grads[1](xe)),
        PADDING_REPEATS,
    )
    counts = fusions(grads[0], xu), fusions(grads[1], xe)
    row(
        f"padding: same, grad of 0.5 |f|^2 (not the same work: XLA cancels the even layout's transpose "
        f"against its forward; fusions compiled: uneven {counts[0]}, even {counts[1]})",
        timing,
    )
    vjps = vjp_of(ours_u, ct_u), vjp_of(ours_e, ct_e)
    timing = compare(
        lambda: jax.block_until_ready(vjps[0](xu)),
        lambda: jax.block_until_ready(vjps[1](xe)),
        PADDING_REPEATS,
    )
    row("padding: same, transpose alone (vjp of a fixed cotangent)", timing)


def main() -> None:
    load = os.getloadavg()
    print(
        f"4 host devices, float32; load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} on {os.cpu_count()} cores"
    )
    print("| case | linop | other | ratio |")
    print("|---|---|---|---|")
    if "--padding" in sys.argv:
        padding_rows()
        return
    convolution_rows()
    if "--conv" in sys.argv:
        return
    sizes = (64, 128) if QUICK else (64, 128, 512, 1024) if "--large" in sys.argv else (64, 128, 512)
    for n in sizes:
        u = DistributedTensor("u", (P * n, n), Partition.grid((P, 1)))
        windows = sharded(halo_windows(u, Kernel(3, padding=1)), MESH)
        x = jax.device_put(jnp.arange(P * n * n, dtype=jnp.float32).reshape(P, n, n) % 97, ROWS)
        ours, hand = single(windows), hand_map(hand_halo)
        label = f"halo windows {P}x{n} x {n}"
        row(f"{label}, forward, vs hand shard_map", run(ours, hand, x))
        row(f"{label}, grad of 0.5 |f|^2, vs hand shard_map", run(loss_grad(ours), loss_grad(hand), x))
        ct = jax.device_put(jnp.ones((P, n + 2, n + 2), jnp.float32), ROWS)
        row(
            f"{label}, transpose (vjp of a fixed cotangent), vs hand",
            run(vjp_of(ours, ct), vjp_of(hand, ct), x),
        )
        y = DistributedTensor("y", (P * n, P * n), Partition.grid((1, P)))
        xr = DistributedTensor("x", (P * n, P * n), Partition.grid((P, 1)))
        columns = single(sharded(Repartition(xr, y), MESH))
        big = jax.device_put(jnp.arange(P * n * P * n, dtype=jnp.float32).reshape(P, n, P * n) % 89, ROWS)
        hand_c = hand_map(hand_columns)
        row(
            f"repartition rows -> columns {P * n} x {P * n}, forward, vs all_to_all",
            run(columns, hand_c, big),
        )
        row(
            f"repartition rows -> columns {P * n} x {P * n}, grad, vs all_to_all",
            run(loss_grad(columns), loss_grad(hand_c), big),
        )
        gather = single(sharded(AllGather(u, (0,), "g"), MESH))
        hand_g = hand_map(hand_gather)
        row(f"all-gather {P}x{n} x {n}, forward, vs all_gather", run(gather, hand_g, x))
        row(f"all-gather {P}x{n} x {n}, grad, vs all_gather", run(loss_grad(gather), loss_grad(hand_g), x))
        reduce = single(sharded(AllReduce(BlockGrid.uniform("r", Partition.grid((P,)), (n, n)), (0,)), MESH))
        hand_r = hand_map(hand_allreduce)
        row(f"all-reduce {n} x {n} per device, forward, vs psum", run(reduce, hand_r, x))
        row(f"all-reduce {n} x {n} per device, grad, vs psum", run(loss_grad(reduce), loss_grad(hand_r), x))
    callback_sizes = (16, 64) if QUICK else (16, 64, 128)  # at 256 the callback stalls (XLA aborts)
    for n in callback_sizes:  # 16: the README's 64 x 48 field is 16 rows per device
        u = DistributedTensor("u", (P * n, n), Partition.grid((P, 1)))
        windows = sharded(halo_windows(u, Kernel(3, padding=1)), MESH)
        x = jax.device_put(jnp.arange(P * n * n, dtype=jnp.float32).reshape(P, n, n) % 97, ROWS)
        ours, called = single(windows), via_callback_of(windows.op)
        row(f"halo windows {P}x{n} x {n}, forward, vs host callback", run(ours, called, x))
        row(f"halo windows {P}x{n} x {n}, grad, vs host callback", run(loss_grad(ours), loss_grad(called), x))
    # the fixed cost of one call: the smallest case, linop's jitted call against the hand one,
    # and against an empty jitted shard_map (the dispatch alone)
    u = DistributedTensor("u", (P * 2, 2), Partition.grid((P, 1)))
    windows = sharded(halo_windows(u, Kernel(3, padding=1)), MESH)
    x = jax.device_put(jnp.ones((P, 2, 2), jnp.float32), ROWS)
    tiny = single(windows)  # made once: a new jit wrapper per call would retrace
    row("per-call cost, halo of 2 x 2 blocks, forward, vs hand shard_map", run(tiny, hand_map(hand_halo), x))
    nothing = hand_map(lambda a: a)
    timing = compare(
        lambda: jax.block_until_ready(tiny(x)), lambda: jax.block_until_ready(nothing(x)), REPEATS
    )
    row("per-call cost, same, vs an identity shard_map (dispatch alone)", timing)
    padding_rows()
    load = os.getloadavg()
    print(f"load average at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}")


if __name__ == "__main__":
    main()
