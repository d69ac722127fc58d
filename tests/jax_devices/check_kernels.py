"""Proofs of local kernels (:class:`~linop.local.LocalOperator`) inside the lowering onto JAX
devices, for several device counts in ONE process of D host devices (launched by
``tests/test_jax_kernels.py``: ``python check_kernels.py D K1 K2 ...``; the same protocol as
``check_lowering.py``, whose checks it reuses: ``== K devices`` ... ``OK n trees proven on K
devices``).

On each count K, with uneven blocks:

- halo windows then a dense-matrix stencil per worker, and the same as callables marked
  traceable (``jax=True``) and with a separate jnp pair: the lowered program equals the numpy
  interpreter exactly (int32), its transposes (by ``op.H`` and by JAX's own rules) and its vjp
  equal ``op.H`` exactly, jvp and vmap likewise, the padding never leaks (``prove``);
- a :class:`~linop.layers.Convolution` layer's input tree (halo exchange + the
  ``conv_general_dilated`` kernels) and its parameter tree with a bias, and (K = 4) a layer
  that broadcasts its input over two output-channel workers and sum-reduces its partial
  outputs, proven exactly with integer weights;
- float32 weights: forward and ``jax.grad`` against numpy within float tolerance;
- one kernel for every device (:class:`~linop.kernel_template.KernelTemplate`): the
  convolution's kernels (input and parameter trees) and a stencil template with different taps per worker run as ONE
  program (the plans say ``"spmd"``; a jnp pair per worker says ``"switch"``), proven like
  the rest and equal to the same plans run with a ``lax.switch`` (exactly on integers, float32
  within tolerance on 4 devices, forward and transpose), and, with x64 off, the stencil again
  under ``jax.enable_x64`` (4 devices);
- controls: a kernel whose JAX adjoint is twice the true one, and one whose JAX forward is
  wrong, are caught by the same comparison.
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

import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from check_lowering import Run, prove, run_counts  # noqa: E402

from linop import DistributedTensor, Kernel, Partition, halo_windows, local_operator  # noqa: E402
from linop.backends.jax.plan import KernelOp  # noqa: E402
from linop.frameworks.jax_sharded import sharded  # noqa: E402
from linop.kernel_template import KernelTemplate  # noqa: E402
from linop.layers import Convolution  # noqa: E402
from linop.operator import Composition, LinearOperator  # noqa: E402

assert len(jax.devices()) == DEVICES, jax.devices()


def stencil_tree(count: int, how: str, adjoint_factor: int = 1, forward_factor: int = 1) -> LinearOperator:
    """Halo windows of 4 count + 1 entries over ``count`` workers (uneven), then per worker the
    stencil (1, -2, 3) as a matrix kernel: ``how`` "dense" (the matrix), "traced" (numpy-free
    callables, ``jax=True``) or "pair" (numpy callables and a jnp pair, whose adjoint is scaled
    by ``adjoint_factor`` and forward by ``forward_factor``: controls)."""
    u = DistributedTensor("u", (4 * count + 1,), Partition.grid((count,)))
    windows = halo_windows(u, Kernel(3, padding=1))
    space = windows.range
    factors = []
    for block in list(space.blocks):
        n = block.shape[0]
        matrix = np.zeros((n - 2, n), dtype=np.int32)
        for i in range(n - 2):
            matrix[i, i : i + 3] = (1, -2, 3)
        name = block.name.replace("u_window", "v")
        if how == "dense":
            op = local_operator(space, block.name, (name, (n - 2,)), matrix)
        elif how == "traced":
            op = local_operator(
                space,
                block.name,
                (name, (n - 2,)),
                forward=lambda a, m=matrix: a @ m.T,
                adjoint=lambda b, m=matrix: b @ m,
                jax=True,
            )
        elif how == "template":  # the worker's taps its parameters: one program on every device
            taps = np.array((1, -2, 3), dtype=np.int32) * (block.worker + 1)
            m = matrix * (block.worker + 1)
            op = local_operator(
                space,
                block.name,
                (name, (n - 2,)),
                forward=lambda a, m=m: m @ a,
                adjoint=lambda b, m=m: m.T @ b,
                jax=KernelTemplate(_taps_forward, _taps_adjoint, (taps,), "taps"),
            )
        else:
            jf = lambda a, m=matrix: forward_factor * (jnp.asarray(m) @ a)  # noqa: E731
            ja = lambda b, m=matrix: adjoint_factor * (jnp.asarray(m).T @ b)  # noqa: E731
            op = local_operator(
                space,
                block.name,
                (name, (n - 2,)),
                forward=lambda a, m=matrix: m @ a,
                adjoint=lambda b, m=matrix: m.T @ b,
                jax=(jf, ja),
            )
        factors.append(op)
        space = op.range
    return Composition((*reversed(factors), windows))


def _taps_forward(params, a, *, shapes):
    """The stencil of taps ``params[0]`` (valid correlation) at the length ``shapes[0]``."""
    (taps,) = params
    (n,) = shapes[0]
    a = jnp.pad(a, (0, max(0, n + 2 - a.shape[0])))
    return sum(taps[k] * a[k : k + n] for k in range(3))


def _taps_adjoint(params, b, *, shapes):
    """Its adjoint: ``b`` spread back over the taps, at the length ``shapes[0]``."""
    (taps,) = params
    (n,) = shapes[0]
    b = jnp.pad(b, (0, max(0, n - b.shape[0])))[: n - 2]
    return sum(jnp.pad(taps[k] * b, (k, 2 - k)) for k in range(3))


def modes(f) -> set[str]:
    """How the kernel rounds of ``f``'s plan and of its adjoint's run."""
    return {o.mode for o in (*f.plan.ops, *f.plan.adjoint().ops) if isinstance(o, KernelOp)}


def switched(f):
    """``f`` with every kernel round of its plans run by ``lax.switch`` (the way every round
    ran before templates): the plan that :func:`check_one_kernel` compares with."""
    from dataclasses import replace

    def retag(plan):
        ops = tuple(replace(o, mode="switch") if isinstance(o, KernelOp) else o for o in plan.ops)
        return replace(plan, ops=ops, adjoint_cache=[])

    plan = retag(f.plan)
    plan.adjoint_cache.append(retag(f.plan.adjoint()))
    return type(f)(f.op, f.mesh, axes=f.axes, plan=plan)


def same_as_switch(run: Run, f, label: str, data, cotangent, tolerance: float = 0.0) -> None:
    """``f`` (its kernels one program) against the same plans under ``lax.switch``: forward
    and transpose, exactly (tolerance 0) or within ``tolerance`` of the largest entry."""
    g = switched(f)
    args, cot = f.pack(data), f.pack(cotangent, f.range)
    got = jax.jit(lambda a, c: (f(a), f.H(c)))(args, cot)
    want = jax.jit(lambda a, c: (g(a), g.H(c)))(args, cot)
    for side, mine, theirs in zip(("forward", "transpose"), got, want):
        for name in theirs:
            a, b = np.asarray(mine[name]), np.asarray(theirs[name])
            scale = max(float(np.abs(b).max(initial=0)), 1.0)
            assert a.shape == b.shape and np.abs(a - b).max(initial=0) <= tolerance * scale, (
                f"{label}: {side} {name} differs from the switch path by {np.abs(a - b).max()}"
            )
    run.checked.append(f"{label}: one program == lax.switch")


def check_one_kernel(run: Run) -> None:
    """Templates run as one program, equal to the switch path; a pair per worker switches."""
    expected = {"single"} if run.count == 1 else {"spmd"}
    rng = np.random.default_rng(5)
    stencil = sharded(stencil_tree(run.count, "template"), run.mesh)
    assert modes(stencil) == expected, modes(stencil)
    if run.count > 1:
        pair = sharded(stencil_tree(run.count, "pair"), run.mesh)
        assert modes(pair) == {"switch"}, modes(pair)
    prove(run, stencil, "stencil (template, taps per worker)", every=True)
    if run.count == 1:  # one call on one device: no program to compare with a switch
        return
    op = stencil.op
    data = {b.name: rng.integers(-9, 10, b.shape).astype(np.int16) for b in op.domain}
    cotangent = {b.name: rng.integers(-9, 10, b.shape).astype(np.int16) for b in op.range}
    same_as_switch(run, stencil, "stencil template", data, cotangent)
    if run.count == 4 and not jax.config.jax_enable_x64:
        with jax.enable_x64(True):
            big = {k: v.astype(np.int32) * 10**6 for k, v in data.items()}  # sums widened to int64
            got = stencil.blocks(big)
            want = op({k: v.astype(np.int64) for k, v in big.items()})
            assert all(np.array_equal(np.asarray(got[n]), want[n]) for n in want), "x64 stencil template"
            same_as_switch(run, stencil, "stencil template (x64)", big, cotangent)
    layer, x = conv_layer(run.count)
    floats = (("float32", np.float32, 1e-5),) if run.count == 4 else ()
    for what, dtype, tolerance in (("int16", np.int16, 0.0), *floats):
        if dtype == np.int16:
            w = rng.integers(-2, 3, layer.weights.global_shape)
        else:
            w = rng.standard_normal(layer.weights.global_shape).astype(np.float32)
        f = sharded(layer.input_operator(w), run.mesh)
        assert modes(f) == expected, modes(f)
        data = {k: v.astype(dtype) for k, v in x.scatter(rng.integers(-3, 4, x.global_shape)).items()}
        cotangent = {b.name: rng.integers(-3, 4, b.shape).astype(dtype) for b in f.op.range}
        same_as_switch(run, f, f"convolution input tree {what}", data, cotangent, tolerance)
    windows = layer.window_operator(x.scatter(rng.integers(-3, 4, x.global_shape)))
    with_bias = Convolution(x, 2, Kernel(3, padding=1), bias=True).parameter_operator(windows)
    f = sharded(with_bias, run.mesh)
    assert modes(f) == expected, modes(f)
    data = {b.name: rng.integers(-2, 3, b.shape).astype(np.int16) for b in with_bias.domain}
    cotangent = {b.name: rng.integers(-3, 4, b.shape).astype(np.int16) for b in with_bias.range}
    same_as_switch(run, f, "convolution parameter tree, bias", data, cotangent)
    if run.count == 4:  # channel shares 2 and 1: the parameters zero-padded to one shape
        x = DistributedTensor("x", (1, 3, 7, 6), Partition((1, 2, 1, 1)))
        layer = Convolution(x, 3, Kernel(3, padding=1), workers=Partition((1, 2, 2, 1, 1), (0, 1, 2, 3)))
        f = sharded(layer.input_operator(rng.integers(-2, 3, layer.weights.global_shape)), run.mesh)
        assert modes(f) == {"spmd"}, modes(f)
        data = {k: v.astype(np.int16) for k, v in x.scatter(rng.integers(-3, 4, x.global_shape)).items()}
        cotangent = {b.name: rng.integers(-3, 4, b.shape).astype(np.int16) for b in f.op.range}
        same_as_switch(run, f, "convolution, channel-partitioned", data, cotangent)


def check_stencils(run: Run) -> None:
    for how in ("dense", "traced", "pair"):
        prove(run, sharded(stencil_tree(run.count, how), run.mesh), f"stencil ({how})", every=True)


def conv_layer(count: int, **options) -> tuple[Convolution, DistributedTensor]:
    x = DistributedTensor("x", (2, 3, 4 * count + 3, 5), Partition((1, 1, count, 1)))
    return Convolution(x, 2, Kernel(3, padding=1, **options)), x


def check_convolution(run: Run) -> None:
    rng = np.random.default_rng(7)
    for label, options in (("k3p1", {}), ("k3p1 stride 2 dilation (1, 2)", dict(stride=2, dilation=(1, 2)))):
        layer, x = conv_layer(run.count, **options)
        w = rng.integers(-2, 3, layer.weights.global_shape)
        prove(run, sharded(layer.input_operator(w), run.mesh), f"convolution input tree {label}", every=True)
        windows = layer.window_operator(x.scatter(rng.integers(-3, 4, x.global_shape)))
        layer_b = Convolution(x, 2, Kernel(3, padding=1, **options), bias=True)
        parameters = layer_b.parameter_operator(windows)
        prove(run, sharded(parameters, run.mesh), f"convolution parameter tree {label}, bias", every=True)
    if run.count == 4:  # broadcast over 2 output-channel workers, sum-reduce over 2 input-channel ones
        x = DistributedTensor("x", (1, 3, 7, 6), Partition((1, 2, 1, 1)))
        layer = Convolution(x, 3, Kernel(3, padding=1), workers=Partition((1, 2, 2, 1, 1), (0, 1, 2, 3)))
        assert layer.broadcasts_input and layer.reduces_output
        w = rng.integers(-2, 3, layer.weights.global_shape)
        prove(run, sharded(layer.input_operator(w), run.mesh), "convolution, channel-partitioned", every=True)


def check_float_convolution(run: Run) -> None:
    """Genuine float32 kernels: the forward and jax.grad within float tolerance."""
    rng = np.random.default_rng(11)
    layer, x = conv_layer(run.count)
    op = layer.input_operator(rng.standard_normal(layer.weights.global_shape).astype(np.float32))
    f = sharded(op, run.mesh)
    data = x.scatter(rng.standard_normal(x.global_shape).astype(np.float32))
    target = {b.name: rng.standard_normal(b.shape).astype(np.float32) for b in op.range}
    got = f.blocks(data)
    want = op(data)
    assert all(np.allclose(np.asarray(got[n]), want[n], rtol=1e-5, atol=1e-5) for n in want), "float forward"
    slots, weights = f.pack(data), f.pack(target, f.range)
    loss = lambda s: sum(jnp.sum(v * weights[k]) for k, v in f(s).items())  # noqa: E731
    gradient = f.unpack(jax.jit(jax.grad(loss))(slots), f.domain)
    expected = op.H(target)
    assert all(np.allclose(np.asarray(gradient[n]), expected[n], rtol=1e-5, atol=1e-5) for n in expected), (
        "float grad"
    )
    run.checked.append("convolution float32 (forward, grad)")


def check_controls(run: Run) -> None:
    """A wrong JAX adjoint (twice the true one) and a wrong JAX forward are caught."""
    for what, options, expect in (
        ("adjoint twice", dict(adjoint_factor=2), "transpose by op.H differs from op.H"),
        ("forward twice", dict(forward_factor=2), "forward differs from the numpy interpreter"),
    ):
        f = sharded(stencil_tree(run.count, "pair", **options), run.mesh)
        try:
            prove(run, f, f"control: {what}")
        except AssertionError as error:
            assert expect in str(error), error
            print(f"control caught: {what}: {str(error)[:90]}")
        else:
            raise AssertionError(f"a kernel pair with its {what} was not caught")


def check_count(count: int) -> None:
    start = time.perf_counter()
    run = Run.on_first(count)
    check_controls(run)
    check_stencils(run)
    check_convolution(run)
    check_float_convolution(run)
    check_one_kernel(run)
    seconds = time.perf_counter() - start
    print(f"OK {len(run.checked)} trees proven on {count} devices ({seconds:.1f} s)")


if __name__ == "__main__":
    run_counts(check_count, COUNTS)
