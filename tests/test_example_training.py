"""The example of ``examples/train_spatial.py`` (a spatially parallel classifier: up-sampling,
convolutions, batch norm, max-pooling, a repartition, affine layers and a distributed loss)
learns what the same network in plain ``torch.nn`` learns on one process, step by step, in
float64 to 1e-10: every step's loss, every layer's gathered weights and bias, and every batch
norm's running mean and variance.

- On 4 gloo processes (9 x 9 images up-sampled to 18 x 18, cut 2 x 2: uneven shares after each
  pooling, so halos that cross processes), launched by ``tests/torchdist/train_example.py``
  (forked after the imports, as the example's ``main`` under torchrun), bounded by a timeout;
  the reference is trained here, in this process. The workers are placed in reverse
  (``--mapping reversed``: worker ``w`` on rank ``3 - w``, every module's ``mapping=``), so
  worker 0, the root of the affine layers' and the loss's sums, is on the last rank; the
  default placement (worker ``w`` on rank ``w``) is each module's own torch.distributed
  checks'.
- In this process, the distributed model with every worker's blocks (linop's numpy
  interpreter) on several grids and sizes, with average pooling (linop's windows and torch's
  ``avg_pool2d``) and with nearest up-sampling in place of the network's; then its loss in
  evaluation mode (the running statistics), and the input gradient (the up-sampling's
  backward, which training does not run).
- Under ``torch.compile`` (one process): the ``aot_eager`` backend here (dynamo's tracing with
  graph breaks at each linop call, AOT autograd's compiled backward of the torch parts); the
  default ``inductor`` backend (C++ code compiled with gcc: 40 s on the loaded 2-core machine,
  85 s with a cold cache) with ``LINOP_LONG=1``.
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


AVERAGE_POOLED = tuple(
    example.Pool("avg", 2) if isinstance(layer, example.Pool) else layer for layer in example.NETWORK
)
NEAREST = tuple(
    example.Upsample(2, "nearest") if isinstance(layer, example.Upsample) else layer
    for layer in example.NETWORK
)
WITHOUT_REGROUP = tuple(layer for layer in example.NETWORK if not isinstance(layer, example.Regroup))


def reference_history(
    size: int, *, batch: int, samples: int, steps: int, lr: float, momentum: float, spec=example.NETWORK
):
    """The plain torch.nn network trained on one process, every step's state recorded."""
    images, labels = example.shapes(samples, size, seed=0)
    model = example.reference_model(spec, (batch, 1, size, size), seed=0, dtype=torch.float64)
    data = example.batches(images, labels, batch, steps)
    return example.train_reference(model, data, lr=lr, momentum=momentum, record=True, dtype=torch.float64)


def assert_same_training(losses, weights, reference) -> None:
    """Every step's loss, weights and running statistics equal to 1e-10, and the weights really
    moved (a run that did not train would not pass by comparing initial weights)."""
    assert len(losses) == len(reference.losses) and len(weights) == len(reference.weights)
    np.testing.assert_allclose(losses, reference.losses, rtol=0, atol=TOLERANCE)
    for step, (mine, theirs) in enumerate(zip(weights, reference.weights)):
        assert [w.shape for w in mine] == [w.shape for w in theirs], step
        for k, (a, b) in enumerate(zip(mine, theirs)):
            np.testing.assert_allclose(a, b, rtol=0, atol=TOLERANCE, err_msg=f"step {step}, array {k}")
    moved = max(np.abs(a - b).max() for a, b in zip(weights[-1], weights[0]))
    assert moved > 1e-4, moved


@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_four_processes_train_as_one_process(tmp_path):
    record = tmp_path / "record.npz"
    size = 9  # up-sampled to 18 x 18: odd shares after each pooling, halos that cross processes
    options = [f"--{name}={value}" for name, value in SMALL.items()]
    command = [sys.executable, str(ROOT / "tests" / "torchdist" / "train_example.py"), "4", *options]
    command += [f"--size={size}", f"--record={record}", "--timeout=120", "--mapping=reversed"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"the 4-process training timed out after {LAUNCH_TIMEOUT} s\n{expired.stdout}")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    assert "linop (4 processes, grid 2 x 2, workers on ranks [3, 2, 1, 0])" in done.stdout, done.stdout
    data = np.load(record)
    reference = reference_history(size, **SMALL)
    steps, count = SMALL["steps"], len(reference.weights[0])
    assert count == 2 * 4 + 2 * 4  # 2 convolutions, 2 affine layers; 2 batch norms with their statistics
    weights = [[data[f"w{s}_{k}"] for k in range(count)] for s in range(steps)]
    assert_same_training(data["losses"], weights, reference)


def test_the_command_line_worker_maps_are_permutations():
    assert example.mapping_for("identity", (2, 2)) is None
    assert example.mapping_for("reversed", (2, 2)) == (3, 2, 1, 0)
    assert example.mapping_for("transposed", (2, 3)) == (0, 2, 4, 1, 3, 5)  # worker (i, j): rank 2 j + i
    with pytest.raises(ValueError, match="no worker map"):
        example.mapping_for("shuffled", (2, 2))


@pytest.mark.parametrize(
    "grid, size, spec",
    [
        ((2, 2), 8, example.NETWORK),
        ((2, 2), 9, example.NETWORK),
        ((4, 1), 8, example.NETWORK),
        ((1, 3), 9, example.NETWORK),
        ((2, 2), 9, AVERAGE_POOLED),
        ((2, 2), 9, NEAREST),
    ],
    ids=["2x2-8", "2x2-9-uneven", "4x1-8", "1x3-9-uneven", "2x2-9-avg-pool", "2x2-9-nearest"],
)
def test_the_distributed_model_in_one_process_trains_as_the_reference(grid, size, spec):
    """The grid's model, with every worker's blocks in this process, trains as torch.nn; then
    in evaluation mode (the running statistics) its loss is torch.nn's too."""
    images, labels = example.shapes(SMALL["samples"], size, seed=0)
    batch, steps = SMALL["batch"], SMALL["steps"]
    reference = example.reference_model(spec, (batch, 1, size, size), seed=0, dtype=torch.float64)
    model = example.SpatialModel(spec, reference, batch=batch, size=size, grid=grid)
    options = {"lr": SMALL["lr"], "momentum": SMALL["momentum"], "record": True}
    mine = example.train_distributed(model, example.batches(images, labels, batch, steps), **options)
    theirs = example.train_reference(
        reference, example.batches(images, labels, batch, steps), dtype=torch.float64, **options
    )
    assert_same_training(mine.losses, mine.weights, theirs)
    model.eval()
    reference.eval()
    with torch.no_grad():
        evaluated, _ = model.loss(images[:batch], labels[:batch])
        expected = example.reference_loss(
            reference(torch.from_numpy(images[:batch])), torch.from_numpy(labels[:batch])
        )
    assert evaluated is not None and abs(evaluated.item() - expected.item()) <= TOLERANCE


def test_the_input_gradient_is_the_reference_input_gradient():
    """The gradient of the loss with respect to the images' blocks (through the up-sampling's
    adjoint halo, which training does not run: the images need no gradient) is torch.nn's."""
    size, batch, grid = 9, 4, (2, 2)
    images, labels = example.shapes(batch, size, seed=2)
    reference = example.reference_model(example.NETWORK, (batch, 1, size, size), seed=1, dtype=torch.float64)
    model = example.SpatialModel(example.NETWORK, reference, batch=batch, size=size, grid=grid)
    blocks = {name: block.requires_grad_() for name, block in model.mine(model.x, images).items()}
    loss, anchor = model.loss_of(blocks, labels)
    anchor.backward()
    mine = model.x.gather({name: block.grad.numpy() for name, block in blocks.items()})
    x = torch.from_numpy(images).requires_grad_()
    expected = example.reference_loss(reference(x), torch.from_numpy(labels))
    expected.backward()
    assert loss is not None and abs(loss.item() - expected.item()) <= TOLERANCE
    assert np.abs(x.grad.numpy()).max() > 1e-6
    np.testing.assert_allclose(mine, x.grad.numpy(), rtol=0, atol=TOLERANCE)


def test_float32_trains_as_the_reference_to_float32_tolerances():
    size, batch, steps = 8, 8, 3
    images, labels = example.shapes(SMALL["samples"], size, seed=0)
    runs = []
    for distributed in (True, False):
        reference = example.reference_model(
            example.NETWORK, (batch, 1, size, size), seed=0, dtype=torch.float32
        )
        data = example.batches(images, labels, batch, steps)
        options = {"lr": SMALL["lr"], "momentum": SMALL["momentum"], "record": True}
        if distributed:
            model = example.SpatialModel(
                example.NETWORK, reference, batch=batch, size=size, grid=(2, 2), dtype=torch.float32
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
    """After the repartition to channel shares the flatten is in torch's order (the affine
    layer takes the reference's weights as they are); without it, the affine layer holds the
    reference's columns in block order, and its gathered weights, mapped back, are the
    reference's (the map a permutation)."""
    for spec, permuted in ((example.NETWORK, False), (WITHOUT_REGROUP, True)):
        reference = example.reference_model(spec, (4, 1, 8, 8), seed=3, dtype=torch.float64)
        model = example.SpatialModel(spec, reference, batch=4, size=8, grid=(2, 2))
        (flatten,) = [s for s in model.stages if isinstance(s, example.FlattenStage)]
        dense = next(s for s in model.stages if isinstance(s, example.DenseStage))
        identity = np.arange(flatten.order.size)
        assert sorted(flatten.order) == list(identity)
        assert (flatten.order != identity).any() == permuted == (dense.order is not None)
        gathered = model.global_state()
        expected = example.reference_state(reference)
        assert len(gathered) == len(expected)
        assert all(np.array_equal(a, b) for a, b in zip(gathered, expected))


@pytest.mark.parametrize(
    "backend",
    ["aot_eager", pytest.param("inductor", marks=pytest.mark.skipif(not LONG, reason="LINOP_LONG=1: gcc"))],
)
def test_the_model_under_torch_compile_equals_eager(backend):
    size, batch = 8, 8
    images, labels = example.shapes(SMALL["samples"], size, seed=0)
    reference = example.reference_model(example.NETWORK, (batch, 1, size, size), seed=0, dtype=torch.float64)
    histories = []
    for compiled in (False, True):
        model = example.SpatialModel(example.NETWORK, reference, batch=batch, size=size, grid=(2, 2))
        step_loss = example.compiled_loss(model, backend=backend) if compiled else None
        data = example.batches(images, labels, batch, SMALL["steps"])
        histories.append(
            example.train_distributed(
                model, data, lr=SMALL["lr"], momentum=SMALL["momentum"], record=True, step_loss=step_loss
            )
        )
    eager, compiled_run = histories
    assert_same_training(compiled_run.losses, compiled_run.weights, eager)
