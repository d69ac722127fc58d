"""The equinox modules (:mod:`linop.frameworks.jax_modules`, the ``equinox`` extra):
``tests/jax_devices/check_modules.py`` (not collected by pytest) trains a small model 3 steps
under ``jit`` in ONE process of 4 host devices and checks it equal to the same steps written
with the layers' functions; one test per line it prints. The typed errors are tested here on one
host device. Skipped without equinox."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from jax_device_runs import host_devices

from linop import DistributedTensor, Kernel, Partition
from linop.errors import LayerError
from linop.layers import Convolution

HERE = Path(__file__).resolve().parent
CHECKS = ("training", "inference", "stateless")


@pytest.fixture(scope="module")
def device_run() -> subprocess.CompletedProcess[str]:
    pytest.importorskip("jax", reason="jax is not installed (the jax extra: pip install -e '.[jax]')")
    pytest.importorskip(
        "equinox", reason="equinox is not installed (the equinox extra: pip install -e '.[equinox]')"
    )
    environment = dict(os.environ, XLA_FLAGS=host_devices(4), JAX_ENABLE_X64="0")
    environment["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), environment.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, str(HERE / "jax_devices" / "check_modules.py")],
        capture_output=True,
        text=True,
        timeout=600,
        env=environment,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.timeout(700)  # one subprocess of about 20 CPU seconds; longer on the loaded machine
@pytest.mark.parametrize("check", CHECKS)
def test_modules_train_as_the_functions_do(device_run, check):
    assert f"OK {check}" in device_run.stdout.splitlines(), (
        device_run.stdout[-4000:] + device_run.stderr[-4000:]
    )


def test_parameters_need_a_key_or_a_value_of_the_right_shape():
    jax = pytest.importorskip("jax")
    pytest.importorskip("equinox")
    from jax.sharding import Mesh

    from linop.frameworks import jax_modules

    mesh = Mesh(np.array(jax.devices()[:1]), ("d",))
    layer = Convolution(DistributedTensor("x", (1, 2, 5), Partition((1, 1, 1))), 3, Kernel(3, padding=1))
    with pytest.raises(LayerError, match="give key="):
        jax_modules.Convolution(layer, mesh)
    with pytest.raises(LayerError, match=r"Convolution: weight has shape \(3, 2, 2\), expected \(3, 2, 3\)"):
        jax_modules.Convolution(layer, mesh, weight=np.zeros((3, 2, 2)), bias=np.zeros(3))
    plain = Convolution(layer.x, 3, Kernel(3, padding=1), bias=False)
    with pytest.raises(LayerError, match="built with bias=False"):
        jax_modules.Convolution(plain, mesh, weight=np.zeros((3, 2, 3)), bias=np.zeros(3))
    module = jax_modules.Convolution(layer, mesh, key=jax.random.key(1))
    bound = 1 / np.sqrt(2 * 3)
    assert module.weight.shape == (3, 2, 3) and float(np.max(np.abs(module.weight))) <= bound
    y = module(np.ones((1, 2, 5), np.float32))
    assert y.shape == (1, 3, 5)
