"""The JAX layers (:mod:`linop.frameworks.jax_layers`) against ``jax.lax`` / ``jax.nn`` on one
device, in ONE process of 4 host devices (launched by ``tests/test_jax_layers.py``: ``python
layer_checks.py``; not collected by pytest). Each check prints ``OK <label>`` when the layer's
function, under ``jit``, equals the sequential reference in value and in ``grad`` (every
argument), and where it applies under ``vmap``, within float32 tolerance.
"""

from __future__ import annotations

import os
import sys
import traceback

# the flags this process was given (the suite's: tests/conftest.py), then its host devices
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4"

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh

from linop import DistributedTensor, Kernel, Partition
from linop.frameworks import jax_layers, jax_losses, jax_norm
from linop.frameworks.jax_stages import Tree
from linop.layers import Affine, AveragePool, BatchNorm, Convolution, Interpolate, Loss, MaxPoolJacobian

assert len(jax.devices()) == 4, jax.devices()
MESH_1D = Mesh(np.array(jax.devices()), ("d",))
MESH_2D = Mesh(np.array(jax.devices()).reshape(2, 2), ("a", "b"))
RNG = np.random.default_rng(2026)
TOLERANCE = 2e-5


def normal(shape) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def close(label: str, got, want) -> None:
    """Equal within float32 tolerance, compared on the host (no eager JAX ops to compile)."""
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape, f"{label}: shape {g.shape} versus {w.shape}"
        error = float(np.max(np.abs(g - w))) if g.size else 0.0
        scale = float(np.max(np.abs(w))) if w.size else 0.0
        assert error <= TOLERANCE * max(1.0, scale), f"{label}: differs by {error} (scale {scale})"


def equivalent(label: str, function, reference, *arguments, argnums=None) -> None:
    """``function`` under jit equals ``reference`` in value and in the gradient of a nonlinear
    scalar of the output with respect to ``argnums`` (default all): one compilation of each
    (``value_and_grad``, the output as its auxiliary value)."""
    argnums = tuple(range(len(arguments))) if argnums is None else argnums

    def scalar(f):
        def value(*a):
            y = f(*a)
            return jnp.sum(jnp.sin(y) * jnp.arange(y.size).reshape(y.shape) / 7.0), y

        return jax.jit(jax.value_and_grad(value, argnums=argnums, has_aux=True))

    (_, got), got_grad = scalar(function)(*arguments)
    (_, want), want_grad = scalar(reference)(*arguments)
    close(f"{label} forward", got, want)
    close(f"{label} grad", got_grad, want_grad)


def lax_convolution(layer: Convolution):
    stride = layer.kernel.stride[2:]
    dilation = layer.kernel.dilation[2:]
    padding = [(p, p) for p in layer.kernel.padding[2:]]

    def reference(x, w, b):
        y = lax.conv_general_dilated(x, w, stride, padding, rhs_dilation=dilation)
        return y + b.reshape((1, -1) + (1,) * layer.dims)

    return reference


def check_convolution() -> None:
    cases = [
        (
            "2x2 spatial, uneven, k3p1",
            MESH_2D,
            DistributedTensor("x", (2, 3, 11, 9), Partition((1, 1, 2, 2))),
            {},
            {},
        ),
        (
            "4 rows, stride 2, dilation (1, 2)",
            MESH_1D,
            DistributedTensor("x", (1, 2, 13, 10), Partition((1, 1, 4, 1))),
            dict(stride=2, dilation=(1, 2)),
            {},
        ),
        (
            "channels: 2 input x 2 output channel workers",
            MESH_1D,
            DistributedTensor("x", (1, 3, 7, 6), Partition((1, 2, 1, 1))),
            {},
            dict(workers=Partition((1, 2, 2, 1, 1), (0, 1, 2, 3))),
        ),
    ]
    for label, mesh, x, kernel, options in cases:
        layer = Convolution(x, 3, Kernel(3, padding=1, **kernel), **options)
        f = jax_layers.convolution(layer, mesh)
        arguments = (normal(x.global_shape), normal(layer.weights.global_shape), normal((3,)))
        equivalent(f"convolution {label}", f, lax_convolution(layer), *arguments)
    # vmap over a leading axis of weights, and the gradient under vmap
    x, w, b = arguments
    ws = np.stack([w, -2 * w, w + 1])
    reference = lax_convolution(layer)
    close(
        "convolution vmap",
        jax.jit(jax.vmap(lambda v: f(x, v, b)))(ws),
        jax.jit(jax.vmap(lambda v: reference(x, v, b)))(ws),
    )
    print("OK convolution")


def check_affine() -> None:
    for label, x, workers in (
        (
            "2 input x 2 output feature workers",
            DistributedTensor("x", (5, 7), Partition((1, 2))),
            Partition((2, 2)),
        ),
        ("4 input feature workers", DistributedTensor("x", (3, 9), Partition((1, 4))), None),
    ):
        layer = Affine(x, 6, workers=workers)
        f = jax_layers.affine(layer, MESH_1D)
        arguments = (normal(x.global_shape), normal((6, x.global_shape[1])), normal((6,)))
        equivalent(f"affine {label}", f, lambda x, w, b: x @ w.T + b, *arguments)
    xs = np.stack([arguments[0], 2 * arguments[0]])
    loss = lambda g: lambda x, w, b: jnp.sum(g(x, w, b) ** 2)  # noqa: E731
    got = jax.jit(jax.vmap(jax.grad(loss(f), argnums=1), in_axes=(0, None, None)))(xs, *arguments[1:])
    want = jax.jit(jax.vmap(jax.grad(loss(lambda x, w, b: x @ w.T + b), argnums=1), in_axes=(0, None, None)))(
        xs, *arguments[1:]
    )
    close("affine grad under vmap", got, want)
    print("OK affine")


def lax_pool(layer, kind: str):
    k = layer.kernel
    window, strides, dilation = ((1, 1, *v[2:]) for v in (k.size, k.stride, k.dilation))
    padding = [(0, 0), (0, 0), *((p, p) for p in k.padding[2:])]
    taps = int(np.prod(k.size[2:]))

    def reference(x):
        if kind == "max" and any(d != 1 for d in dilation):  # JAX has no vjp of a dilated max window
            padded = jnp.pad(x, padding, constant_values=-jnp.inf)
            shifted = [
                padded[..., i * dilation[2] :: 1, j * dilation[3] :: 1][
                    ...,
                    : padded.shape[2] - (window[2] - 1) * dilation[2] : strides[2],
                    : padded.shape[3] - (window[3] - 1) * dilation[3] : strides[3],
                ]
                for i in range(window[2])
                for j in range(window[3])
            ]
            return jnp.max(jnp.stack(shifted), axis=0)
        if kind == "max":
            return lax.reduce_window(x, -jnp.inf, lax.max, window, strides, padding, window_dilation=dilation)
        total = lax.reduce_window(x, 0.0, lax.add, window, strides, padding, window_dilation=dilation)
        return total / taps

    return reference


def check_pooling() -> None:
    x = DistributedTensor("x", (2, 3, 11, 9), Partition((1, 1, 2, 2)))
    for kind, label, kernel in (
        ("average", "k2 dilation 2 padding 1", Kernel(2, dilation=2, padding=1)),
        ("max", "k2 stride 1 dilation 2", Kernel(2, dilation=2)),  # by taps
        ("max", "k3 stride 2 padding 1", Kernel(3, stride=2, padding=1)),  # padding as -inf
    ):
        layer = AveragePool(x, kernel) if kind == "average" else MaxPoolJacobian(x, kernel)
        function = jax_layers.average_pool if kind == "average" else jax_layers.max_pool
        f = function(layer, MESH_2D)
        equivalent(f"{kind} pool {label}", f, lax_pool(layer, kind), normal(x.global_shape))
    xs = normal((3, *x.global_shape))
    close("max pool vmap", jax.jit(jax.vmap(f))(xs), jax.jit(jax.vmap(lax_pool(layer, "max")))(xs))
    print("OK pooling")


def check_losses() -> None:
    from jax.nn import log_sigmoid

    references = {
        "mse": lambda x, t: jnp.mean((x - t) ** 2),
        "l1": lambda x, t: jnp.mean(jnp.abs(x - t)),
        "bce_with_logits": lambda x, t: -jnp.mean(t * log_sigmoid(x) + (1 - t) * log_sigmoid(-x)),
    }
    x = DistributedTensor("x", (3, 5, 7), Partition((1, 2, 2)), sizes=((3,), (4, 1), (2, 5)))  # uneven shares
    prediction, target = normal(x.global_shape), RNG.uniform(0, 1, x.global_shape).astype(np.float32)
    for kind, reference in references.items():
        f = jax_losses.loss(Loss(x, kind), MESH_2D)
        equivalent(f"loss {kind} (mean)", f, reference, prediction, target)
    f = jax_losses.loss(Loss(x, "mse", reduction="sum"), MESH_2D)
    equivalent("loss mse (sum)", f, lambda x, t: jnp.sum((x - t) ** 2), prediction, target)
    # the gradient under vmap over a batch of targets
    targets = np.stack([target, 1 - target])
    got = jax.jit(jax.vmap(jax.grad(f), in_axes=(None, 0)))(prediction, targets)
    want = jax.jit(jax.vmap(jax.grad(lambda x, t: jnp.sum((x - t) ** 2)), in_axes=(None, 0)))(
        prediction, targets
    )
    close("loss grad under vmap", got, want)
    print("OK losses")


def check_batch_norm() -> None:
    for label, x in (
        ("features 2 x 2, uneven", DistributedTensor("x", (3, 2, 5, 7), Partition((1, 1, 2, 2)))),
        ("batch 2 x channels 2 (3 as 2, 1)", DistributedTensor("x", (4, 3, 5, 6), Partition((2, 2, 1, 1)))),
    ):
        layer = BatchNorm(x, eps=1e-3)
        f = jax_norm.batch_norm(layer, MESH_1D)
        channels = x.global_shape[1]

        def reference(x, w, b):
            axis = (0, *range(2, x.ndim))
            return jax.nn.standardize(x, axis=axis, epsilon=1e-3) * w.reshape(1, -1, 1, 1) + b.reshape(
                1, -1, 1, 1
            )

        arguments = (3 + 2 * normal(x.global_shape), normal((channels,)), normal((channels,)))
        equivalent(f"batch norm {label}", f, reference, *arguments)
    # the statistics of the last case (channels cut): each share read from its owner
    _, mean, var = jax.jit(lambda *a: f(*a, with_statistics=True))(*arguments)
    axis = (0, *range(2, x.ndim))
    close("batch norm statistics", (mean, var), (arguments[0].mean(axis=axis), arguments[0].var(axis=axis)))
    print("OK batch_norm")


def check_interpolation() -> None:
    x = DistributedTensor("x", (2, 3, 7, 5), Partition((1, 1, 2, 2)))
    for mode, method, options in (
        ("bilinear", "linear", dict(scale_factor=2)),
        ("nearest-exact", "nearest", dict(size=(16, 9))),
    ):
        layer = Interpolate(x, mode=mode, dtype=np.float32, **options)
        f = jax_layers.interpolate(layer, MESH_2D)
        shape = layer.y.global_shape
        equivalent(
            f"interpolate {mode} {options}",
            f,
            lambda v, shape=shape, method=method: jax.image.resize(v, shape, method),
            normal(x.global_shape),
        )
    print("OK interpolate")


def check_adjoint_trees() -> None:
    """The movement trees' vjp (custom_vjp: the lowering of op.H) equals linop's op.H run by
    the numpy interpreter, exactly, on integer data: the halo windows of a convolution on
    uneven 2 x 2 blocks, a loss's sum-reduction and a batch norm's all-reduce."""
    x = DistributedTensor("x", (1, 2, 11, 9), Partition((1, 1, 2, 2)))
    trees = (
        Convolution(x, 3, Kernel(3, padding=1)).window_operator,
        Loss(x, "mse").reduction_operator,
        BatchNorm(DistributedTensor("x", (4, 3, 5, 6), Partition((2, 2, 1, 1)))).statistics_reduction,
    )
    for op in trees:
        tree = Tree(op, MESH_1D, ("d",))
        state = {b.name: RNG.integers(-9, 10, b.shape).astype(np.float32) for b in op.domain}
        seed = {b.name: RNG.integers(-9, 10, b.shape).astype(np.float32) for b in op.range}
        out, vjp = jax.vjp(jax.jit(lambda s, tree=tree: tree.blocks(tree.slots(s))), state)
        (back,) = vjp(seed)
        want, want_back = op(state), op.H(seed)
        assert all(np.array_equal(np.asarray(out[n]), want[n]) for n in want), f"{op}: forward"
        assert all(np.array_equal(np.asarray(back[n]), want_back[n]) for n in want_back), f"{op}: vjp"
    print("OK adjoint trees")


def check_edges() -> None:
    """Forward only (one compilation each): fewer workers than devices with a periodic
    boundary, empty channel shares, and the loss kinds without a jax.nn twin against the numpy
    layer (value and gradient)."""
    x = DistributedTensor("x", (1, 2, 8, 6), Partition((1, 1, 2, 1)))
    layer = Convolution(x, 2, Kernel(3, stride=3, padding=1, boundary="periodic"))
    data, w, b = normal(x.global_shape), normal(layer.weights.global_shape), normal((2,))
    wrapped = np.pad(data, [(0, 0), (0, 0), (1, 1), (1, 1)], mode="wrap")
    want = lax.conv_general_dilated(wrapped, w, (3, 3), "VALID") + b.reshape(1, -1, 1, 1)
    close(
        "convolution, 2 workers on 4 devices, periodic",
        jax.jit(jax_layers.convolution(layer, MESH_1D))(data, w, b),
        want,
    )
    x = DistributedTensor("x", (3, 4, 5), Partition((1, 3, 1)), sizes=((3,), (2, 0, 2), (5,)))
    data = normal(x.global_shape)
    got = jax.jit(jax_norm.batch_norm(BatchNorm(x, affine=False), MESH_1D))(data)
    close("batch norm, an empty channel share", got, jax.nn.standardize(data, axis=(0, 2), epsilon=1e-5))
    x = DistributedTensor("x", (5, 7), Partition((1, 3)))
    prediction = RNG.uniform(0.1, 0.9, x.global_shape).astype(np.float32)
    target = RNG.uniform(0.1, 0.9, x.global_shape).astype(np.float32)
    for kind in ("bce", "poisson_nll", "kl_div"):
        layer = Loss(x, kind)
        value, gradient = jax.jit(jax.value_and_grad(jax_losses.loss(layer, MESH_1D)))(prediction, target)
        want = layer.value(x.scatter(prediction), x.scatter(target))[layer.total_name]
        close(f"loss {kind}", value.reshape(1), want)
        close(
            f"loss {kind} grad", gradient, x.gather(layer.gradient(x.scatter(prediction), x.scatter(target)))
        )
    print("OK edges")


CHECKS = {
    "adjoint trees": check_adjoint_trees,
    "convolution": check_convolution,
    "affine": check_affine,
    "pooling": check_pooling,
    "losses": check_losses,
    "batch_norm": check_batch_norm,
    "interpolate": check_interpolation,
    "edges": check_edges,
}

if __name__ == "__main__":
    failed = []
    for name, check in CHECKS.items():
        try:
            check()
        except Exception:
            traceback.print_exc(file=sys.stdout)
            print(f"FAILED {name}")
            failed.append(name)
        sys.stdout.flush()
    sys.exit(1 if failed else 0)
