"""The layers as JAX functions (:mod:`linop.frameworks.jax_layers`): ``tests/jax_devices/
layer_checks.py`` (not collected by pytest) proves, in ONE process of 4 host devices, each
layer's function under ``jit``, ``grad`` (and ``vmap`` where it applies) equal to ``jax.lax`` /
``jax.nn`` on one device; one test per layer reads its line. The typed errors are tested here
on one host device."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from jax_device_runs import host_devices

from linop import DistributedTensor, Kernel, Partition
from linop.errors import LayerError, MeshError
from linop.layers import Affine, Convolution

HERE = Path(__file__).resolve().parent
LAYERS = ("adjoint trees", "convolution", "affine", "pooling", "losses", "batch_norm", "interpolate", "edges")


@pytest.fixture(scope="module")
def device_run() -> subprocess.CompletedProcess[str]:
    pytest.importorskip("jax", reason="jax is not installed (the jax extra: pip install -e '.[jax]')")
    environment = dict(os.environ, XLA_FLAGS=host_devices(4))
    environment["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), environment.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, str(HERE / "jax_devices" / "layer_checks.py")],
        capture_output=True,
        text=True,
        timeout=600,
        env=environment,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.timeout(700)  # one subprocess of a few CPU seconds; longer on the loaded machine
@pytest.mark.parametrize("layer", LAYERS)
def test_layer_equals_jax_on_one_device_under_jit_grad_and_vmap(device_run, layer):
    lines = device_run.stdout.splitlines()
    assert f"OK {layer}" in lines, device_run.stdout[-4000:] + device_run.stderr[-4000:]


@pytest.fixture
def mesh():
    jax = pytest.importorskip("jax")
    from jax.sharding import Mesh

    return Mesh(np.array(jax.devices()[:1]), ("d",))


def test_a_builder_refuses_another_layer_and_a_non_mesh(mesh):
    from linop.frameworks import jax_layers

    x = DistributedTensor("x", (2, 3), Partition((1, 1)))
    with pytest.raises(LayerError, match=r"convolution\(\) takes a linop\.layers\.Convolution, not Affine"):
        jax_layers.convolution(Affine(x, 2), mesh)
    with pytest.raises(MeshError, match=r"mesh must be a jax\.sharding\.Mesh"):
        jax_layers.affine(Affine(x, 2), "mesh")


def test_a_wrong_shape_or_an_unwanted_bias_is_a_layer_error_naming_it(mesh):
    from linop.frameworks import jax_layers

    x = DistributedTensor("x", (1, 1, 5), Partition((1, 1, 1)))
    f = jax_layers.convolution(Convolution(x, 2, Kernel(3, padding=1), bias=False), mesh)
    with pytest.raises(LayerError, match=r"weights has shape \(2, 1, 2\), expected \(2, 1, 3\)"):
        f(np.zeros((1, 1, 5), np.float32), np.zeros((2, 1, 2), np.float32))
    with pytest.raises(LayerError, match="built with bias=False"):
        f(np.zeros((1, 1, 5), np.float32), np.zeros((2, 1, 3), np.float32), np.zeros(2, np.float32))
    y = f(np.ones((1, 1, 5), np.float32), np.ones((2, 1, 3), np.float32))
    assert np.asarray(y).tolist() == [[[2, 3, 3, 3, 2]] * 2]


def test_each_builder_names_the_layer_it_takes(mesh):
    from linop.frameworks import jax_layers, jax_losses, jax_norm

    x = DistributedTensor("x", (2, 3), Partition((1, 1)))
    wrong = Affine(x, 2)
    for builder, wants in (
        (jax_layers.average_pool, "AveragePool or MaxPoolJacobian"),
        (jax_layers.max_pool, "AveragePool or MaxPoolJacobian"),
        (jax_layers.interpolate, "Interpolate"),
        (jax_losses.loss, "Loss"),
        (jax_norm.batch_norm, "BatchNorm"),
    ):
        with pytest.raises(LayerError, match=rf"takes a linop\.layers\.{wants}.*not Affine"):
            builder(wrong, mesh)


def test_batch_norm_and_max_pool_refuse_what_they_cannot_compute(mesh):
    from linop.frameworks import jax_layers, jax_norm
    from linop.layers import BatchNorm, MaxPoolJacobian

    x = DistributedTensor("x", (2, 3, 4), Partition((1, 1, 1)))
    plain = jax_norm.batch_norm(BatchNorm(x, affine=False), mesh)
    with pytest.raises(LayerError, match="built with affine=False"):
        plain(np.ones((2, 3, 4), np.float32), np.ones(3, np.float32))
    single = DistributedTensor("x", (1, 2, 1), Partition((1, 1, 1)))
    with pytest.raises(LayerError, match="expected more than 1 value per channel"):
        jax_norm.batch_norm(BatchNorm(single), mesh)(np.ones((1, 2, 1), np.float32))
    pool = jax_layers.max_pool(MaxPoolJacobian(x, Kernel(2)), mesh)
    with pytest.raises(LayerError, match="max_pool: x has dtype int32"):
        pool(np.ones((2, 3, 4), np.int32))


@pytest.mark.parametrize(
    "kind, options",
    [
        ("l1", {}),
        ("mse", {}),
        ("poisson_nll", dict(log_input=True, full=True, eps=1e-8)),
        ("poisson_nll", dict(log_input=False, full=False, eps=1e-8)),
        ("bce", {}),
        ("bce_with_logits", {}),
        ("kl_div", dict(log_target=False)),
        ("kl_div", dict(log_target=True)),
    ],
    ids=["l1", "mse", "poisson-log-full", "poisson-raw", "bce", "bce-logits", "kl", "kl-log-target"],
)
def test_jax_loss_terms_read_the_numpy_table(kind, options):
    """One formula table (linop.layers.losses.elementwise) read by numpy and jax.numpy gives the
    same terms, targets at 0 and above 1 included (kl_div's t log t, Poisson's Stirling term)."""
    pytest.importorskip("jax")
    from linop.frameworks.jax_losses import terms
    from linop.layers.losses import elementwise

    x = np.array([0.1, 0.4, 0.7, 0.9, 0.25, 0.5])
    t = np.array([0.0, 0.3, 1.0, 2.5, 0.0, 4.0])
    if kind == "bce":
        t = np.clip(t, 0, 1)
    want = elementwise(kind, x, t, options)
    got = np.asarray(terms(kind, x.astype(np.float32), t.astype(np.float32), options))
    assert np.all(np.isfinite(want)) and np.allclose(got, want, rtol=1e-5, atol=1e-6), (got, want)
