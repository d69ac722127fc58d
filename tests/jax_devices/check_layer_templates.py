"""The layers' local kernels as ONE program on every JAX device (their
:class:`~linop.kernel_template.KernelTemplate`, :mod:`linop.layers.templates`), in one process
of D host devices (launched by ``tests/test_jax_templates.py``: ``python
check_layer_templates.py D K1 K2 ...``; the protocol of ``check_lowering.py``: ``== K
devices`` ... ``OK n trees proven on K devices``).

On each count K (K > 1), on uneven blocks, each tree's plans say ``"spmd"`` (no ``lax.switch``)
and its lowered program

- equals the numpy interpreter and its transposes ``op.H`` exactly (``prove``: forward, the
  transpose by ``op.H`` and by JAX's own rules, vjp, no padding leak; jvp and vmap on every
  fourth tree), on integers where the tree is integer-exact: an
  :class:`~linop.layers.Affine` layer's input and parameter trees (on 4 devices also a 2 x 2
  worker grid, broadcast and sum-reduce; with a bias, which only the first input-feature
  workers consume, the kernels differ and the plan switches, proven alike), a
  :class:`~linop.layers.MaxPoolJacobian` (a selection) and an
  :class:`~linop.layers.Interpolate`'s integer tree;
- average pooling (not integer-valued: a mean) exactly on float data whose means are exact;
- a :class:`~linop.layers.BatchNorm`'s training Jacobian (uneven rows and channels, its
  per-channel sums all-reduced between its two kernels) exactly on float data holding small
  integers, 32 entries per channel (so its divisions by m are exact), with no padding leak;
- equals the same plans run with a ``lax.switch`` (forward and transpose, exactly);
- with ``jax_enable_x64`` off, on 4 devices: the max pool, interpolation and batch-norm
  templates again under ``jax.enable_x64`` (:func:`check_under_x64`: exact in float64 on
  values float32 cannot hold; it prints ``x64: 3 templates proven under jax.enable_x64``).

``templated()`` leaves the tree's value unchanged (the numpy interpreter on it equals the
original); without it a pooling tree's numpy kernels cannot run on JAX devices at all (a
DeviceKernelError), and an affine parameter tree with a bias switches (the control for
``"spmd"``: its workers' kernels differ).
"""

from __future__ import annotations

import sys
import time

import jax
import numpy as np
from check_kernels import modes, same_as_switch
from check_lowering import FLOAT, Run, prove, run_counts

from linop import DistributedTensor, Kernel, Partition
from linop.errors import DeviceKernelError
from linop.frameworks.jax_sharded import sharded
from linop.layers import Affine, AveragePool, Interpolate, MaxPoolJacobian
from linop.layers.templates import templated

COUNTS = [int(a) for a in sys.argv[2:]] or [4]


def spmd(run: Run, op, label: str):
    f = sharded(op, run.mesh)
    assert modes(f) == {"spmd"}, f"{label}: {modes(f)}"
    return f


def integers(space, seed: int, dtype=np.int16) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {b.name: rng.integers(-5, 6, b.shape).astype(dtype) for b in space}


def check_affine(run: Run) -> None:
    rng = np.random.default_rng(3)
    k = run.count
    cases = [("input features", DistributedTensor("x", (3, 4 * k + 1), Partition((1, k))), None)]
    if k == 4:
        cases.append(("2 x 2 workers", DistributedTensor("x", (3, 9), Partition((1, 2))), Partition((2, 2))))
    for label, x, workers in cases:
        layer = Affine(x, 5, workers=workers)
        w = rng.integers(-3, 4, layer.weights.global_shape)
        f = spmd(run, layer.input_operator(w), f"affine {label}")
        prove(run, f, f"affine input tree ({label})")
        same_as_switch(
            run, f, f"affine input tree ({label})", integers(f.op.domain, 1), integers(f.op.range, 2)
        )
        inputs = layer.window_operator(x.scatter(rng.integers(-3, 4, x.global_shape)))
        plain = Affine(x, 5, workers=workers, bias=False)
        g = spmd(run, plain.parameter_operator(inputs), f"affine parameters {label}")
        prove(run, g, f"affine parameter tree ({label})")
        same_as_switch(
            run, g, f"affine parameter tree ({label})", integers(g.op.domain, 3), integers(g.op.range, 4)
        )
        # with a bias only the fi = 0 workers consume one: their kernels differ, so a switch
        # (of the templates bound to each worker's parameters)
        g = sharded(layer.parameter_operator(inputs), run.mesh)
        assert modes(g) == {"switch"}, modes(g)
        prove(run, g, f"affine parameter tree, bias ({label})")


def check_pooling(run: Run) -> None:
    rng = np.random.default_rng(5)
    k = run.count
    x = DistributedTensor("x", (2, 3, 3 * k + 2, 7), Partition((1, 1, k, 1)))  # uneven rows
    data = x.scatter(rng.integers(-3, 4, x.global_shape))
    for label, kernel in (
        ("k3 stride 2 padding 1", Kernel(3, stride=2, padding=1)),
        ("k2 dilation 2", Kernel(2, dilation=2)),
    ):
        layer = MaxPoolJacobian(x, kernel)
        windows = layer.window_operator({n: v + rng.random(v.shape) for n, v in data.items()})  # no ties
        plain = layer.at(windows)
        op = templated(layer, plain)
        try:  # without templates the numpy kernels cannot run inside jit at all
            sharded(plain, run.mesh)
        except DeviceKernelError:
            pass
        else:
            raise AssertionError("a max pool tree without templates was lowered")
        sample = integers(op.domain, 6)
        assert all(np.array_equal(op(sample)[n], plain(sample)[n]) for n in op.range.names), (
            "templated() value"
        )
        f = spmd(run, op, f"max pool {label}")
        prove(run, f, f"max pool Jacobian ({label})")
        same_as_switch(run, f, f"max pool Jacobian ({label})", sample, integers(op.range, 7))
    # average pooling: 4 taps, so the means of integers are exact in binary floating point
    layer = AveragePool(x, Kernel(2, stride=2, padding=1))
    op = templated(layer, layer.operator)
    f = spmd(run, op, "average pool")
    floats = {n: v.astype(FLOAT) for n, v in integers(op.domain, 8).items()}
    back = {n: v.astype(FLOAT) for n, v in integers(op.range, 9).items()}
    got, got_h = f.blocks(floats), f.H.blocks(back)
    want, want_h = op(floats), op.H(back)
    assert all(np.array_equal(np.asarray(got[n]), want[n]) for n in want), "average pool forward"
    assert all(np.array_equal(np.asarray(got_h[n]), want_h[n]) for n in want_h), "average pool transpose"
    same_as_switch(run, f, "average pool", floats, back)
    run.checked.append("average pool (exact floats)")


def check_interpolation(run: Run) -> None:
    k = run.count
    x = DistributedTensor("x", (1, 2, 2 * k + 1, 5), Partition((1, 1, k, 1)))
    for mode, options in (("bilinear", dict(scale_factor=2)), ("nearest", dict(size=(3 * k, 4)))):
        layer = Interpolate(x, mode=mode, **options)
        exact, _ = layer.integer_operator()
        op = templated(layer, exact, scales=layer.denominators)
        f = spmd(run, op, f"interpolate {mode}")
        prove(run, f, f"interpolate {mode} (integer weights)")
        # floats holding integers: exact (integer weights, small sums), and JAX's int16 program
        # could not hold the int32 products of the weights
        data = {n: v.astype(FLOAT) for n, v in integers(op.domain, 10).items()}
        cotangent = {n: v.astype(FLOAT) for n, v in integers(op.range, 11).items()}
        same_as_switch(run, f, f"interpolate {mode}", data, cotangent)


def batch_norm_jacobian(k: int):
    """The training Jacobian of a :class:`~linop.layers.BatchNorm` on ``k`` uneven workers (rows
    and channels on 4), m = 32 entries per channel, saved values that are small integers."""
    from linop.layers import BatchNorm
    from linop.layers.batchnorm import Saved

    grid, sizes = (
        ((1, 2, 2, 1), ((2,), (2, 1), (5, 3), (2,))) if k == 4 else ((1, 1, 2, 1), ((2,), (3,), (5, 3), (2,)))
    )
    x = DistributedTensor("x", (2, 3, 8, 2), Partition(grid), sizes=sizes)
    layer = BatchNorm(x)
    assert layer.count == 32
    rng = np.random.default_rng(12)
    saved = {
        b.name: Saved(
            rng.integers(-3, 4, b.shape).astype(FLOAT),
            np.ones(b.shape[1], FLOAT),
            rng.integers(-3, 4, b.shape[1]).astype(FLOAT),
        )
        for b in x.space
    }
    return layer.jacobian(saved)


def check_batch_norm(run: Run) -> None:
    """The training Jacobian of a :class:`~linop.layers.BatchNorm` (its two kernels per worker
    around the all-reduce of the per-channel sums) on uneven rows and channels: "spmd", equal
    to the numpy interpreter and ``op.H`` exactly, no padding leak, and to the switch. Exact:
    m = 32 entries per channel (a power of two, so g / m is exact) and saved values that are
    small integers (the Jacobian is linear in the tangent for any saved xhat and scale)."""
    from check_lowering import padding_leak

    op = batch_norm_jacobian(run.count)
    f = spmd(run, op, "batch norm Jacobian")
    data = {n: v.astype(FLOAT) for n, v in integers(op.domain, 13).items()}
    back = {n: v.astype(FLOAT) for n, v in integers(op.range, 14).items()}
    args, cot = f.pack(data), f.pack(back, f.range)
    got, got_h = jax.jit(lambda a, c: (f(a), f.H(c)))(args, cot)
    for side, values, want, layout in (
        ("forward", got, op(data), f.range),
        ("transpose", got_h, op.H(back), f.domain),
    ):
        unpacked = f.unpack(values, layout)
        for name in want:
            assert np.array_equal(np.asarray(unpacked[name]), want[name]), f"batch norm {side} {name}"
        leak = padding_leak(layout, [values[s.name] for s in layout.slots])
        assert leak is None, f"batch norm {side} leaks into the padding of {leak}"
    same_as_switch(run, f, "batch norm Jacobian", data, back)
    run.checked.append("batch norm Jacobian (exact floats)")


def check_under_x64(run: Run) -> None:
    """With ``jax_enable_x64`` off in this process: the templates whose dtypes x64 changes (the
    max pool's integer selection, the interpolation's ``result_type`` of data and weights, the
    batch norm's sums) again under ``jax.enable_x64`` (the CI suite's x64 check of the
    templates; the whole check with x64 on is ``LINOP_LONG=1``'s process). Forward and
    transpose equal the numpy interpreter and ``op.H`` exactly: float64 on values that float32
    cannot hold (steps of 2**30 + 1; a template computing in float32 fails), and int32 entries
    up to 5 * 2**28, whose sums in the selection's transpose x64 widens to int64."""
    k = run.count
    rng = np.random.default_rng(15)
    x = DistributedTensor("x", (2, 3, 3 * k + 2, 7), Partition((1, 1, k, 1)))
    selection = MaxPoolJacobian(x, Kernel(3, stride=2, padding=1))
    windows = selection.window_operator(x.scatter(rng.random(x.global_shape)))  # no ties
    pool = templated(selection, selection.at(windows))
    y = DistributedTensor("u", (1, 2, 2 * k + 1, 5), Partition((1, 1, k, 1)))
    layer = Interpolate(y, mode="bilinear", scale_factor=2)
    exact, _ = layer.integer_operator()
    interpolate = templated(layer, exact, scales=layer.denominators)
    cases = (
        ("max pool Jacobian", pool, np.int32, 2**28),
        ("interpolate bilinear", interpolate, np.float64, 2**30 + 1),
        ("batch norm Jacobian", batch_norm_jacobian(k), np.float64, 2**30 + 1),
    )
    with jax.enable_x64(True):
        for label, op, dtype, step in cases:
            f = spmd(run, op, f"{label} (x64)")
            data = {n: v.astype(dtype) * dtype(step) for n, v in integers(op.domain, 16).items()}
            back = {n: v.astype(dtype) * dtype(step) for n, v in integers(op.range, 17).items()}
            wide = np.int64 if dtype == np.int32 else dtype
            got, got_h = jax.jit(lambda a, c, f=f: (f(a), f.H(c)))(f.pack(data), f.pack(back, f.range))
            for side, values, want, layout in (
                ("forward", got, op({n: v.astype(wide) for n, v in data.items()}), f.range),
                ("transpose", got_h, op.H({n: v.astype(wide) for n, v in back.items()}), f.domain),
            ):
                unpacked = f.unpack(values, layout)
                for name in want:
                    value = np.asarray(unpacked[name])
                    assert value.dtype == wide or dtype == np.int32, (
                        f"{label} (x64) {side} {name}: {value.dtype}"
                    )
                    assert np.array_equal(value, want[name]), f"{label} (x64) {side} {name}"
            run.checked.append(f"{label} (x64)")
    print(f"x64: {len(cases)} templates proven under jax.enable_x64", flush=True)


def check_count(count: int) -> None:
    start = time.perf_counter()
    run = Run.on_first(count)
    check_affine(run)
    check_pooling(run)
    check_interpolation(run)
    check_batch_norm(run)
    if count == 4 and not jax.config.jax_enable_x64:
        check_under_x64(run)
    seconds = time.perf_counter() - start
    print(f"OK {len(run.checked)} trees proven on {count} devices ({seconds:.1f} s)")


if __name__ == "__main__":
    run_counts(check_count, COUNTS)
