"""The example of ``examples/train_spatial.py`` (a spatially parallel LeNet-style classifier)
learns what the same network in plain ``torch.nn`` learns on one process, step by step, in
float64 to 1e-10: every step's loss and every layer's gathered weights and bias.

- On 4 gloo processes (the images cut 2 x 2, 18 x 18 pixels: uneven pooling windows, so halos
  that cross processes), launched by ``tests/torchdist/train_example.py`` (forked after the
  imports, as the example's ``main`` under torchrun), bounded by a timeout; the reference is
  trained here, in this process.
- In this process, the distributed model with every worker's blocks (linop's numpy
  interpreter) on several grids and sizes, and with max-pooling in place of average pooling
  (halo windows and torch's ``max_pool2d``).
- Under ``torch.compile`` (one process): the ``aot_eager`` backend here (dynamo's tracing with
  graph breaks at each linop call, AOT autograd's compiled backward of the torch parts); the
  default ``inductor`` backend (C++ code compiled with gcc: 85 s of wall time on the loaded
  2-core machine with a cold cache, 10 s of this process's CPU; 19 s with inductor's cache
  warm) with ``LINOP_LONG=1``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (the torch extra)")
pytest.importorskip("torch.distributed")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

import train_spatial as example  # noqa: E402

LONG = bool(os.environ.get("LINOP_LONG"))
LAUNCH_TIMEOUT = 600
"""Seconds the 4-process launch may take (about 10 s on the loaded 2-core machine)."""
TOLERANCE = 1e-10
SMALL = {"batch": 8, "samples": 32, "steps": 3, "lr": 0.05, "momentum": 0.9}


MAX_POOLED = tuple(
    example.Pool("max", 2) if isinstance(layer, example.Pool) else layer for layer in example.LENET
)


def reference_history(
    size: int, *, batch: int, samples: int, steps: int, lr: float, momentum: float, spec=example.LENET
):
    """The plain torch.nn network trained on one process, every step's weights recorded."""
    images, labels = example.shapes(samples, size, seed=0)
    model = example.reference_model(spec, (batch, 1, size, size), seed=0, dtype=torch.float64)
    data = example.batches(images, labels, batch, steps)
    return example.train_reference(model, data, lr=lr, momentum=momentum, record=True, dtype=torch.float64)


def assert_same_training(losses, weights, reference) -> None:
    """Every step's loss and weights equal to 1e-10, and the weights really moved (a run that
    did not train would not pass by comparing initial weights)."""
    assert len(losses) == len(reference.losses) and len(weights) == len(reference.weights)
    np.testing.assert_allclose(losses, reference.losses, rtol=0, atol=TOLERANCE)
    for step, (mine, theirs) in enumerate(zip(weights, reference.weights)):
        assert [w.shape for w in mine] == [w.shape for w in theirs], step
        for k, (a, b) in enumerate(zip(mine, theirs)):
            np.testing.assert_allclose(a, b, rtol=0, atol=TOLERANCE, err_msg=f"step {step}, parameter {k}")
    moved = max(np.abs(a - b).max() for a, b in zip(weights[-1], weights[0]))
    assert moved > 1e-4, moved


@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_four_processes_train_as_one_process(tmp_path):
    record = tmp_path / "record.npz"
    size = 18
    options = [f"--{name}={value}" for name, value in SMALL.items()]
    command = [sys.executable, str(ROOT / "tests" / "torchdist" / "train_example.py"), "4", *options]
    command += [f"--size={size}", f"--record={record}", "--timeout=120"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"the 4-process training timed out after {LAUNCH_TIMEOUT} s\n{expired.stdout}")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    assert "linop (4 processes, grid 2 x 2)" in done.stdout, done.stdout
    data = np.load(record)
    steps, count = SMALL["steps"], 2 * 4  # 2 convolutions and 2 affine layers, weights and bias
    weights = [[data[f"w{s}_{k}"] for k in range(count)] for s in range(steps)]
    assert_same_training(data["losses"], weights, reference_history(size, **SMALL))


@pytest.mark.parametrize(
    "grid, size, spec",
    [
        ((2, 2), 16, example.LENET),
        ((2, 2), 18, example.LENET),
        ((4, 1), 16, example.LENET),
        ((1, 3), 17, example.LENET),
        ((2, 2), 18, MAX_POOLED),
    ],
    ids=["2x2-16", "2x2-18-uneven", "4x1-16", "1x3-17-uneven", "2x2-18-max-pool"],
)
def test_the_distributed_model_in_one_process_trains_as_the_reference(grid, size, spec):
    images, labels = example.shapes(SMALL["samples"], size, seed=0)
    batch = SMALL["batch"]
    reference = example.reference_model(spec, (batch, 1, size, size), seed=0, dtype=torch.float64)
    model = example.SpatialModel(spec, reference, batch=batch, size=size, grid=grid)
    data = example.batches(images, labels, batch, SMALL["steps"])
    mine = example.train_distributed(model, data, lr=SMALL["lr"], momentum=SMALL["momentum"], record=True)
    assert_same_training(mine.losses, mine.weights, reference_history(size, **SMALL, spec=spec))


def test_float32_trains_as_the_reference_to_float32_tolerances():
    size, batch, steps = 16, 8, 3
    images, labels = example.shapes(SMALL["samples"], size, seed=0)
    runs = []
    for distributed in (True, False):
        reference = example.reference_model(
            example.LENET, (batch, 1, size, size), seed=0, dtype=torch.float32
        )
        data = example.batches(images, labels, batch, steps)
        options = {"lr": SMALL["lr"], "momentum": SMALL["momentum"], "record": True}
        if distributed:
            model = example.SpatialModel(
                example.LENET, reference, batch=batch, size=size, grid=(2, 2), dtype=torch.float32
            )
            runs.append(example.train_distributed(model, data, **options))
        else:
            runs.append(example.train_reference(reference, data, dtype=torch.float32, **options))
    mine, theirs = runs
    np.testing.assert_allclose(mine.losses, theirs.losses, rtol=1e-5)
    for a, b in zip(mine.weights[-1], theirs.weights[-1]):
        assert a.dtype == b.dtype == np.float32
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_the_flatten_order_maps_the_reference_weights():
    """The affine layer after the flatten holds the reference's columns in block order: its
    gathered weights, mapped back, are the reference's (and the map is a permutation)."""
    reference = example.reference_model(example.LENET, (4, 1, 16, 16), seed=3, dtype=torch.float64)
    model = example.SpatialModel(example.LENET, reference, batch=4, size=16, grid=(2, 2))
    (flatten,) = [s for s in model.stages if isinstance(s, example.FlattenStage)]
    assert (
        sorted(flatten.order) == list(range(flatten.order.size)) and (flatten.order != np.arange(192)).any()
    )
    gathered = model.global_parameters()
    expected = [p.detach().numpy() for p in reference.parameters()]
    assert all(np.array_equal(a, b) for a, b in zip(gathered, expected))


@pytest.mark.parametrize(
    "backend",
    ["aot_eager", pytest.param("inductor", marks=pytest.mark.skipif(not LONG, reason="LINOP_LONG=1: gcc"))],
)
def test_the_model_under_torch_compile_equals_eager(backend):
    size, batch = 16, 8
    images, labels = example.shapes(SMALL["samples"], size, seed=0)
    reference = example.reference_model(example.LENET, (batch, 1, size, size), seed=0, dtype=torch.float64)
    histories = []
    for compiled in (False, True):
        model = example.SpatialModel(example.LENET, reference, batch=batch, size=size, grid=(2, 2))
        step_loss = example.compiled_loss(model, backend=backend) if compiled else None
        data = example.batches(images, labels, batch, SMALL["steps"])
        histories.append(
            example.train_distributed(
                model, data, lr=SMALL["lr"], momentum=SMALL["momentum"], record=True, step_loss=step_loss
            )
        )
    eager, compiled_run = histories
    assert_same_training(compiled_run.losses, compiled_run.weights, eager)
