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
- controls: a kernel whose JAX adjoint is twice the true one, and one whose JAX forward is
  wrong, are caught by the same comparison.
"""

from __future__ import annotations

import os
import sys

DEVICES = int(sys.argv[1]) if len(sys.argv) > 1 else 4
COUNTS = [int(a) for a in sys.argv[2:]] or [DEVICES]
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES}"

import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from check_lowering import Run, prove, run_counts  # noqa: E402

from linop import DistributedTensor, Kernel, Partition, halo_windows, local_operator  # noqa: E402
from linop.frameworks.jax_sharded import sharded  # noqa: E402
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
    seconds = time.perf_counter() - start
    print(f"OK {len(run.checked)} trees proven on {count} devices ({seconds:.1f} s)")


if __name__ == "__main__":
    run_counts(check_count, COUNTS)
