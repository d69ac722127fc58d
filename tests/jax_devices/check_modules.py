"""The equinox modules (:mod:`linop.frameworks.jax_modules`) in ONE process of 4 host devices
(launched by ``tests/test_jax_modules.py``: ``python check_modules.py``; not collected by
pytest). Prints ``OK <label>`` per check:

- ``training``: a small model (convolution on a 2 x 2 spatial split, batch norm with its running
  statistics in an ``eqx.nn.State``, max pooling, an affine layer on 4 feature workers, an MSE
  loss) trained 3 steps of plain SGD under ``jit``, every step's loss, every parameter and the
  running statistics equal to the same steps written with the layers' functions (and the
  running statistics to torch's update of ``jnp``'s own batch statistics);
- ``inference``: batch norm with ``inference=True`` equals the elementwise normalization by the
  running statistics;
- ``stateless``: average pooling and interpolation modules equal their functions.
"""

from __future__ import annotations

import os

# the flags this process was given (the suite's: tests/conftest.py), then its host devices
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4"

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Mesh

from linop import DistributedTensor, Kernel, Partition
from linop.frameworks import jax_layers, jax_losses, jax_modules, jax_norm
from linop.layers import Affine, AveragePool, BatchNorm, Convolution, Interpolate, Loss, MaxPoolJacobian

assert len(jax.devices()) == 4, jax.devices()
MESH_2D = Mesh(np.array(jax.devices()).reshape(2, 2), ("a", "b"))
MESH_1D = Mesh(np.array(jax.devices()), ("d",))
RNG = np.random.default_rng(38)
RATE = 0.1
STEPS = 3


def close(label: str, got, want, tolerance: float = 1e-5) -> None:
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape, f"{label}: shape {g.shape} versus {w.shape}"
        error = float(np.max(np.abs(g - w))) if g.size else 0.0
        assert error <= tolerance * max(1.0, float(np.max(np.abs(w)))), f"{label}: differs by {error}"


x = DistributedTensor("x", (4, 2, 9, 8), Partition((1, 1, 2, 2)))  # uneven rows
conv = Convolution(x, 3, Kernel(3, padding=1), name="h")
norm = BatchNorm(conv.y, momentum=0.25, name="n")
pool = MaxPoolJacobian(norm.y, Kernel(2, stride=2), name="p")
features = int(np.prod(pool.y.global_shape[1:]))
dense = Affine(DistributedTensor("f", (4, features), Partition((1, 4))), 2)
mse = Loss(dense.y, "mse")


class Model(eqx.Module):
    conv: jax_modules.Convolution
    norm: jax_modules.BatchNorm
    pool: jax_modules.MaxPool
    dense: jax_modules.Affine

    def __init__(self, key: jax.Array) -> None:
        first, second = jax.random.split(key)
        self.conv = jax_modules.Convolution(conv, MESH_2D, key=first)
        self.norm = jax_modules.BatchNorm(norm, MESH_2D)
        self.pool = jax_modules.MaxPool(pool, MESH_2D)
        self.dense = jax_modules.Affine(dense, MESH_1D, key=second)

    def __call__(self, data: jax.Array, state: eqx.nn.State) -> tuple[jax.Array, eqx.nn.State]:
        y, state = self.norm(self.conv(data), state)
        y = self.pool(y)
        return self.dense(y.reshape(y.shape[0], -1)), state


def check_training() -> None:
    model, state = eqx.nn.make_with_state(Model)(jax.random.key(0))
    loss = jax_modules.Loss(mse, MESH_1D)
    data = RNG.standard_normal(x.global_shape).astype(np.float32)
    target = RNG.standard_normal(dense.y.global_shape).astype(np.float32)

    @eqx.filter_jit
    def step(model, state):
        def objective(model, state):
            out, state = model(data, state)
            return loss(out, target), state

        (value, state), grads = eqx.filter_value_and_grad(objective, has_aux=True)(model, state)
        model = eqx.apply_updates(model, jax.tree.map(lambda g: -RATE * g, grads))
        return model, state, value

    # the same with the functions and explicit parameters
    f_conv, f_norm = jax_layers.convolution(conv, MESH_2D), jax_norm.batch_norm(norm, MESH_2D)
    f_pool, f_dense = jax_layers.max_pool(pool, MESH_2D), jax_layers.affine(dense, MESH_1D)
    f_loss = jax_losses.loss(mse, MESH_1D)
    params = {
        "cw": model.conv.weight,
        "cb": model.conv.bias,
        "nw": model.norm.weight,
        "nb": model.norm.bias,
        "dw": model.dense.weight,
        "db": model.dense.bias,
    }

    @jax.jit
    def function_step(params):
        def objective(p):
            h = f_conv(data, p["cw"], p["cb"])
            y = f_norm(h, p["nw"], p["nb"])
            y = f_pool(y)
            return f_loss(f_dense(y.reshape(y.shape[0], -1), p["dw"], p["db"]), target), h

        (value, h), grads = jax.value_and_grad(objective, has_aux=True)(params)
        return jax.tree.map(lambda p, g: p - RATE * g, params, grads), value, h

    running = (np.zeros(3), np.ones(3))
    count = int(np.prod(conv.y.global_shape)) // 3
    for k in range(STEPS):
        model, state, value = step(model, state)
        params, want, h = function_step(params)
        close(f"loss of step {k}", value, want)
        h = np.asarray(h, np.float64)
        mean, var = h.mean(axis=(0, 2, 3)), h.var(axis=(0, 2, 3))
        running = (0.75 * running[0] + 0.25 * mean, 0.75 * running[1] + 0.25 * var * count / (count - 1))
        got = state.get(model.norm.index)
        close(f"running statistics after step {k}", got[:2], running, 1e-4)
        assert int(got[2]) == k + 1, got[2]
    module_params = (
        model.conv.weight,
        model.conv.bias,
        model.norm.weight,
        model.norm.bias,
        model.dense.weight,
        model.dense.bias,
    )
    close(
        "parameters after 3 steps", module_params, [params[n] for n in ("cw", "cb", "nw", "nb", "dw", "db")]
    )
    assert float(value) != float(step(model, state)[2]), "training does not move the loss"
    print("OK training")

    # evaluation: the running statistics, elementwise
    h = np.asarray(model.conv(data), np.float64)
    y, same = jax.jit(lambda h, s: model.norm(h, s, inference=True))(h.astype(np.float32), state)
    mean, var, _ = (np.asarray(v, np.float64) for v in state.get(model.norm.index))
    spread = (1, -1, 1, 1)
    want = (h - mean.reshape(spread)) / np.sqrt(var.reshape(spread) + norm.eps)
    want = want * np.asarray(model.norm.weight).reshape(spread) + np.asarray(model.norm.bias).reshape(spread)
    close("inference", y, want)
    close("inference keeps the state", same.get(model.norm.index), state.get(model.norm.index), 0.0)
    print("OK inference")


def check_stateless() -> None:
    v = DistributedTensor("v", (2, 3, 7, 5), Partition((1, 1, 2, 2)))
    data = RNG.standard_normal(v.global_shape).astype(np.float32)
    average = AveragePool(v, Kernel(2, stride=2))
    interpolate = Interpolate(v, mode="bilinear", scale_factor=2, dtype=np.float32)
    for label, module, function in (
        (
            "average pool",
            jax_modules.AveragePool(average, MESH_2D),
            jax_layers.average_pool(average, MESH_2D),
        ),
        (
            "interpolate",
            jax_modules.Interpolate(interpolate, MESH_2D),
            jax_layers.interpolate(interpolate, MESH_2D),
        ),
    ):
        close(label, eqx.filter_jit(module)(data), jax.jit(function)(data), 0.0)
    print("OK stateless")


if __name__ == "__main__":
    check_training()
    check_stateless()
