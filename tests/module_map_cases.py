"""Cases of the worker-map tests of the torch modules (``mapping=``), shared by the MPI tests
(``tests/mpi/test_module_maps.py``) and the torch.distributed checks
(``tests/torchdist/map_checks.py``).

Each case builds one module over ``size`` workers with the engine arguments it is given
(``comm=`` or ``group=``, and ``mapping=``; none: one process), runs a forward and a backward
on the blocks the module takes (from global data drawn alike on every process) and returns
what it computed, by key (``y:`` outputs, ``dx:`` input gradients, ``dp:`` parameter
gradients, ``run:`` running statistics, ``loss``). :func:`compare` checks a distributed run's
results against the same module's in one process (every worker there): exactly where the
module only moves data, else to 1e-10 (float64). :func:`placed` names what a process should
hold under a map, so that a map the module ignored fails the test.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from linop import DistributedTensor, Partition
from linop.halo_geometry import Kernel
from linop.layers import Affine, BatchNorm, ChainStage, Convolution, Loss, WindowChain
from linop.layers.base import share_slices

Results = dict[str, np.ndarray]


def reversed_ranks(size: int) -> list[int]:
    """Worker ``w`` on rank ``size - 1 - w``: every worker off its default rank (but the middle
    one of an odd size)."""
    return list(reversed(range(size)))


def _blocks(tensor: DistributedTensor, array: np.ndarray, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    scattered = tensor.scatter(array)
    return {name: torch.from_numpy(np.array(scattered[name])).requires_grad_() for name in names}


def _backward(out: Mapping[str, torch.Tensor], cotangent: Mapping[str, np.ndarray], token: Any) -> None:
    loss = sum((v * torch.from_numpy(np.asarray(cotangent[k])).to(v.dtype)).sum() for k, v in out.items())
    (loss + token.sum()).backward()


def _collect(out: Mapping[str, torch.Tensor], inputs: Mapping[str, torch.Tensor]) -> Results:
    results = {f"y:{k}": v.detach().numpy().copy() for k, v in out.items()}
    for k, v in inputs.items():
        results[f"dx:{k}"] = np.zeros(tuple(v.shape)) if v.grad is None else v.grad.numpy().copy()
    return results


def _window_run(module: Any, x: DistributedTensor, y: DistributedTensor, seed: int) -> Results:
    """One forward and backward of a block module (x blocks in, y blocks out)."""
    rng = np.random.default_rng(seed)
    data, dy = rng.standard_normal(x.global_shape), rng.standard_normal(y.global_shape)
    inputs = _blocks(x, data, module.input_names)
    out = module(inputs)
    _backward(out, y.scatter(dy), module.token)
    return _collect(out, inputs)


def conv(size: int, *, overlap: bool = False, replicate: bool = False, **engine: Any) -> tuple[Any, Results]:
    """A convolution over rows (uneven shares), its bias and weights on their owners (or
    replicated; the halo exchange overlapped with the interior products, or not)."""
    from linop.frameworks.torch_layers import LayerModule

    rng = np.random.default_rng(5)
    x = DistributedTensor("x", (2, 3, 3 * size + 1, 5), Partition((1, 1, size, 1)))
    layer = Convolution(x, 2, Kernel(3, padding=1))
    w, b = rng.standard_normal(layer.weights.global_shape), rng.standard_normal(2)
    module = LayerModule(layer, weights=w, bias=b, overlap=overlap, replicate=replicate, **engine)
    results = _window_run(module, x, layer.y, 6)
    results.update({f"dp:{k}": p.grad.numpy().copy() for k, p in module.parameter_state().items()})
    return module, results


def affine(size: int, **engine: Any) -> tuple[Any, Results]:
    """An affine layer on a P_fo x P_fi work partition: outputs and parameter owners on the
    fi = 0 column, so some processes hold no output."""
    from linop.frameworks.torch_layers import LayerModule

    p_fi = 2 if size % 2 == 0 else 1
    p_fo = size // p_fi
    rng = np.random.default_rng(7)
    x = DistributedTensor("x", (3, 4), Partition((1, p_fi)))
    layer = Affine(x, 2 * p_fo + 1, workers=Partition((p_fo, p_fi)))
    w, b = rng.standard_normal(layer.weights.global_shape), rng.standard_normal(2 * p_fo + 1)
    module = LayerModule(layer, weights=w, bias=b, **engine)
    results = _window_run(module, x, layer.y, 8)
    results.update({f"dp:{k}": p.grad.numpy().copy() for k, p in module.parameter_state().items()})
    return module, results


def batchnorm(size: int, *, replicate: bool = False, **engine: Any) -> tuple[Any, Results]:
    """Two training steps and an evaluation step of a BatchNorm2d over batch (and channels on
    4 workers), the parameters on their owners (or replicated); outputs, gradients and running
    statistics."""
    from linop.frameworks.torch_norm import BatchNormModule

    grid = {1: (1, 1, 1, 1), 2: (2, 1, 1, 1), 3: (3, 1, 1, 1), 4: (2, 2, 1, 1)}[size]
    x = DistributedTensor("x", (4, 3, 3, 4), Partition(grid))
    layer = BatchNorm(x)
    rng = np.random.default_rng(9)
    weight, bias = rng.standard_normal(3), rng.standard_normal(3)
    module = BatchNormModule(layer, weight=weight, bias=bias, replicate=replicate, **engine)
    results: Results = {}
    for step in range(3):
        if step == 2:
            module.eval()
        module.zero_grad()
        data, dy = rng.standard_normal(x.global_shape) + step, rng.standard_normal(x.global_shape)
        inputs = _blocks(x, data, module.input_names)
        out = module(inputs)
        _backward(out, layer.y.scatter(dy), module.token)
        results.update({f"{step}{k}": v for k, v in _collect(out, inputs).items()})
        results.update({f"{step}dp:{k}": p.grad.numpy().copy() for k, p in module.parameter_state().items()})
    slices = share_slices(layer.channel_sizes)
    assert module.running_mean is not None and module.running_var is not None
    for c in module.channels:
        part = module._offsets[c]
        results[f"run:mean{c}"] = module.running_mean[part].numpy().copy()
        results[f"run:var{c}"] = module.running_var[part].numpy().copy()
        results[f"run:slice{c}"] = np.array([slices[c].start, slices[c].stop])
    return module, results


def loss(size: int, **engine: Any) -> tuple[Any, Results]:
    """An MSE loss (mean over the global count) over rows and columns, the loss on the root."""
    from linop.frameworks.torch_losses import LossModule

    grid = (1, 1, 2, 2) if size == 4 else (1, 1, size, 1)
    x = DistributedTensor("x", (2, 2, 5, 4), Partition(grid))
    layer = Loss(x, "mse", reduction="mean")
    module = LossModule(layer, **engine)
    rng = np.random.default_rng(10)
    data, target = rng.standard_normal(x.global_shape), rng.standard_normal(x.global_shape)
    inputs = _blocks(x, data, module.input_names)
    targets = {k: v.detach() for k, v in _blocks(x, target, module.input_names).items()}
    value = module(inputs, targets)
    (3.0 * value).backward()
    results = _collect({}, inputs)
    if module.is_root:
        results["loss"] = value.detach().numpy().copy()
    return module, results


def interpolate(size: int, **engine: Any) -> tuple[Any, Results]:
    """Bilinear up-sampling x2 over rows (output-driven partition: uneven halos)."""
    from linop.frameworks.torch_resample import Interpolate

    x = DistributedTensor("x", (1, 2, 2 * size + 1, 4), Partition((1, 1, size, 1)))
    module = Interpolate(x, scale_factor=2, mode="bilinear", **engine)
    return module, _window_run(module, x, module.y, 11)


def nearest(size: int, **engine: Any) -> tuple[Any, Results]:
    """Nearest up-sampling x3 over columns: pure data movement (exact)."""
    from linop.frameworks.torch_resample import Upsample

    x = DistributedTensor("x", (1, 1, 3, 2 * size + 1), Partition((1, 1, 1, size)))
    module = Upsample(x, scale_factor=3, **engine)
    return module, _window_run(module, x, module.y, 12)


def maxpool(size: int, **engine: Any) -> tuple[Any, Results]:
    """Max pooling 3 / stride 2 / padding 1 over rows (a selection: exact)."""
    from linop.frameworks.torch_pooling import MaxPool

    x = DistributedTensor("x", (2, 2, 3 * size + 2, 5), Partition((1, 1, size, 1)))
    module = MaxPool(x, 3, stride=2, padding=1, **engine)
    return module, _window_run(module, x, module.y, 13)


def repartition(size: int, **engine: Any) -> tuple[Any, Results]:
    """Rows to columns (uneven column shares): a permutation of the entries (exact)."""
    from linop.frameworks.torch_repartition import Repartition

    x = DistributedTensor("x", (2, 3, 7, 5), Partition((1, 1, size, 1)))
    z = DistributedTensor("z", (2, 3, 7, 5), Partition((1, 1, 1, size)))
    module = Repartition(x, z, **engine)
    return module, _window_run(module, x, z, 14)


def chain(size: int, **engine: Any) -> tuple[Any, Results]:
    """conv -> conv -> max pool with one fused halo; the weight gradients summed over the
    processes (:meth:`ChainModule.sum_gradients`)."""
    from linop.frameworks.torch_chain import ChainModule

    rng = np.random.default_rng(15)
    x = DistributedTensor("x", (1, 2, 4 * size + 2, 5), Partition((1, 1, size, 1)))
    stages = [
        ChainStage.conv(rng.standard_normal((2, 2, 3, 3)), padding=1),
        ChainStage.conv(rng.standard_normal((2, 2, 3, 3)), padding=1),
        ChainStage.max(Kernel(2, stride=2)),
    ]
    chain = WindowChain(x, stages)
    module = ChainModule(chain, **engine)
    results = _window_run(module, x, chain.y, 16)
    module.sum_gradients()
    results.update({f"dp:{i}": w.grad.numpy().copy() for i, w in enumerate(module.weights)})
    return module, results


CASES: dict[str, tuple[Callable[..., tuple[Any, Results]], bool]] = {
    "conv": (conv, False),
    "conv-overlap-replicate": (functools.partial(conv, overlap=True, replicate=True), False),
    "affine": (affine, False),
    "batchnorm": (batchnorm, False),
    "batchnorm-replicate": (functools.partial(batchnorm, replicate=True), False),
    "loss": (loss, False),
    "interpolate": (interpolate, False),
    "nearest": (nearest, True),
    "maxpool": (maxpool, True),
    "repartition": (repartition, True),
    "chain": (chain, False),
}
"""name: (build and run, exact)."""


def compare(got: Results, expected: Results, exact: bool) -> list[str]:
    """Why ``got`` (a process's results) differs from ``expected`` (the one-process run's, every
    worker's blocks): exactly, or to 1e-10."""
    problems = []
    for key, value in got.items():
        if key.startswith("run:slice"):
            continue
        want = expected.get(key)
        if key.startswith("run:") and want is None:
            continue
        if want is None or np.shape(want) != np.shape(value):
            problems.append(f"{key}: not in the one-process run's results, or another shape")
        elif not (np.array_equal(value, want) if exact else np.allclose(value, want, rtol=0, atol=1e-10)):
            problems.append(f"{key}: {np.max(np.abs(value - want))} off")
    return problems


def running_expected(module_results: Results, serial: Results) -> Results:
    """The one-process run's results with its (C,) running statistics cut as a distributed
    process's channel groups are (by the ``run:slice`` entries of its results)."""
    expected = dict(serial)
    for key, bounds in module_results.items():
        if key.startswith("run:slice"):
            c = key[len("run:slice") :]
            start, stop = (int(v) for v in bounds)
            expected[f"run:mean{c}"] = serial["run:meanall"][start:stop]
            expected[f"run:var{c}"] = serial["run:varall"][start:stop]
    return expected


def serial_run(name: str, size: int) -> Results:
    """The case in one process; a BatchNorm's running statistics whole (``run:meanall``)."""
    build, _ = CASES[name]
    module, results = build(size)
    if name.startswith("batchnorm"):
        results = {k: v for k, v in results.items() if not k.startswith("run:")}
        results["run:meanall"] = module.running_mean.numpy().copy()
        results["run:varall"] = module.running_var.numpy().copy()
    return results


def placed(module: Any, rank: int, ranks: list[int]) -> list[str]:
    """Why ``module`` does not take the blocks of exactly the workers that ``ranks`` (worker ->
    rank) puts on ``rank``."""
    layout = _input_layout(module)
    expected = {b.name for b in layout if ranks[b.worker] == rank}
    if set(module.input_names) != expected:
        return [f"takes {sorted(module.input_names)}, the map gives this rank {sorted(expected)}"]
    return []


def _input_layout(module: Any) -> Any:
    for attribute in ("x", "source"):
        tensor = getattr(module, attribute, None)
        if isinstance(tensor, DistributedTensor):
            return tensor.space
    layer = getattr(module, "layer", None) or getattr(module, "chain", None)
    return layer.x.space


def mse_step_problems(module: Any, x: DistributedTensor, dtype: Any, rng: Any, label: str) -> list[str]:
    """One forward and backward of a LossModule (MSE) at ``dtype`` on global data drawn from
    ``rng`` alike on every process: what differs from torch's ``mse_loss`` of that dtype (the
    root's loss, this process's input gradients, and their dtype). Shared by the dtype-change
    tests of both engines."""
    import torch

    data, target = rng.standard_normal(x.global_shape), rng.standard_normal(x.global_shape)
    blocks, target_blocks = x.scatter(data), x.scatter(target)
    inputs = {k: torch.from_numpy(blocks[k]).to(dtype).requires_grad_() for k in module.input_names}
    targets = {k: torch.from_numpy(target_blocks[k]).to(dtype) for k in module.input_names}
    reference = torch.from_numpy(data).to(dtype).requires_grad_()
    expected = torch.nn.functional.mse_loss(reference, torch.from_numpy(target).to(dtype))
    expected.backward()
    out = module(inputs, targets)
    out.backward()
    rtol = 1e-12 if dtype == torch.float64 else 1e-5
    grads = x.scatter(reference.grad.numpy())
    problems = [
        f"{label}: dx {k}"
        for k, v in inputs.items()
        if v.grad.dtype != dtype or not np.allclose(v.grad, grads[k], rtol=rtol)
    ]
    value, want = out.detach(), expected.detach()
    if module.is_root and (value.dtype != dtype or not np.isclose(float(value), float(want), rtol=rtol)):
        problems.append(f"{label}: loss {value} against {want}")
    return problems
