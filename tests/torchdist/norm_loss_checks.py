"""Batch normalization and the distributed losses on a torch.distributed group (``group=True``):
the modules against torch's BatchNorm2d and losses on one process (outputs, input, weight and
bias gradients, running statistics; the loss on the root and every rank's gradient). Run by
``checks.py`` (its ``main``) on every process of each launch."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: the shared cases
import module_map_cases as shared

from linop import DistributedTensor, Partition
from linop.layers import BatchNorm, Loss


def _local(
    tensor: DistributedTensor, array: np.ndarray, rank: int, grad: bool = False
) -> dict[str, torch.Tensor]:
    blocks = tensor.scatter(array)
    return {
        b.name: torch.from_numpy(np.array(blocks[b.name])).requires_grad_(grad)
        for b in tensor.blocks
        if b.worker == rank
    }


def batchnorm(rank: int, size: int) -> str | None:
    """Two training steps and one evaluation step of a BatchNorm2d over batch and channels
    (uneven shares; an empty batch share at 3 processes), with the parameters on their owners
    and replicated (every copy's gradient the whole sum), on both statistics paths (one
    all-reduce of the moments, or two of O(c))."""
    problems = [
        _batchnorm(rank, size, replicate, path)
        for path in ("gather", "two_pass")
        for replicate in (False, True)
    ]
    return "; ".join(p for p in problems if p) or None


def _batchnorm(rank: int, size: int, replicate: bool, path: str) -> str | None:
    from linop.frameworks.torch_norm import BatchNormModule

    grid = {1: (1, 1, 1, 1), 2: (2, 1, 1, 1), 3: (3, 1, 1, 1), 4: (2, 2, 1, 1)}[size]
    sizes = {1: (3,), 2: (2, 1), 3: (2, 0, 1), 4: (2, 1)}[size]
    channels = (3, 1) if grid[1] == 2 else (4,)
    x = DistributedTensor("x", (3, 4, 3, 5), Partition(grid), sizes=(sizes, channels, (3,), (5,)))
    rng = np.random.default_rng(31)
    w, b = rng.standard_normal(4), rng.standard_normal(4)
    layer = BatchNorm(x, statistics=path)
    module = BatchNormModule(layer, weight=w, bias=b, group=True, replicate=replicate)
    norm = torch.nn.BatchNorm2d(4, dtype=torch.float64)
    with torch.no_grad():
        norm.weight.copy_(torch.from_numpy(w))
        norm.bias.copy_(torch.from_numpy(b))
    problems: list[str] = []
    for step in range(3):
        if step == 2:
            module.eval()
            norm.eval()
        data, dy = rng.standard_normal(x.global_shape) + step, rng.standard_normal(x.global_shape)
        inputs = _local(x, data, rank, grad=True)
        module.zero_grad()
        out = module(inputs)
        dys = layer.y.scatter(dy)
        (sum((v * torch.from_numpy(dys[k])).sum() for k, v in out.items()) + module.token.sum()).backward()
        image = torch.from_numpy(data).requires_grad_()
        norm.zero_grad()
        reference = norm(image)
        reference.backward(torch.from_numpy(dy))
        expected: dict[str, Any] = {
            **layer.y.scatter(reference.detach().numpy()),
            **x.scatter(image.grad.numpy()),
            **layer.scatter_parameters(norm.weight.grad.numpy(), norm.bias.grad.numpy()),
            **layer.parameter_movement(
                layer.scatter_parameters(norm.weight.grad.numpy(), norm.bias.grad.numpy())
            ),
        }
        got = {
            **{k: v.detach() for k, v in out.items()},
            **{k: v.grad for k, v in inputs.items()},
            **{k: p.grad for k, p in module.parameter_state().items()},
        }
        problems += [
            f"{path} {'replicated' if replicate else 'owners'} step {step} {k}"
            for k, v in got.items()
            if not np.allclose(v, expected[k], atol=1e-10)
        ]
        offsets = np.cumsum((0, *layer.channel_sizes))
        mine = np.concatenate(
            [np.arange(offsets[c], offsets[c + 1]) for c in module.channels] or [np.zeros(0, int)]
        )
        if not np.allclose(module.running_var, norm.running_var.numpy()[mine], atol=1e-12):
            problems.append(f"{path} step {step} running var")
    return "; ".join(problems) or None


def losses(rank: int, size: int) -> str | None:
    """MSE (mean) and KL divergence (batchmean) over uneven rows, the loss on the last rank."""
    from linop.frameworks.torch_losses import LossModule

    rows = {1: (5,), 2: (4, 1), 3: (2, 0, 3), 4: (1, 2, 0, 2)}[size]
    x = DistributedTensor("x", (5, 3), Partition((size, 1)), sizes=(rows, (3,)))
    rng = np.random.default_rng(32)
    problems: list[str] = []
    for kind, reduction, function in (
        ("mse", "mean", torch.nn.functional.mse_loss),
        ("kl_div", "batchmean", torch.nn.functional.kl_div),
    ):
        data, target = rng.standard_normal(x.global_shape), rng.uniform(0, 1, x.global_shape)
        module = LossModule(Loss(x, kind, reduction=reduction, root=size - 1), group=True)
        inputs = _local(x, data, rank, grad=True)
        out = module(inputs, _local(x, target, rank))
        out.backward()
        reference = torch.from_numpy(data).requires_grad_()
        expected = function(reference, torch.from_numpy(target), reduction=reduction)
        expected.backward()
        value = float(out.detach())
        if rank == size - 1 and not np.isclose(value, float(expected.detach()), rtol=1e-12, atol=1e-12):
            problems.append(f"{kind}: loss {value} against {float(expected.detach())}")
        if rank != size - 1 and value != 0.0:
            problems.append(f"{kind}: a non-root rank got {value}")
        grads = x.scatter(reference.grad.numpy())
        problems += [
            f"{kind} d{k}" for k, v in inputs.items() if not np.allclose(v.grad, grads[k], atol=1e-12)
        ]
    return "; ".join(problems) or None


def dtype_changes(rank: int, size: int, dtypes: tuple[torch.dtype, ...], count: Any) -> str | None:
    """MSE at each of ``dtypes`` in turn, forward and backward: where every rank holds blocks of
    x (the backward's broadcast, whose ranks other than the root have no input, drops a binding
    of another dtype than the forward's on every rank alike: no agreement sent), and under a
    worker map with x's two workers on rank 0 and the root on the last rank (the others hold
    none of x's blocks: the forward's sum-reduce agrees on dtypes at each call from the second,
    one all-reduce; ``count()`` counts them). The root's loss equals torch's of the input's
    dtype, and so does every gradient."""
    from linop.frameworks.torch_losses import LossModule

    rows = {1: (5,), 2: (4, 1), 3: (2, 0, 3), 4: (1, 2, 0, 2)}[size]
    cases = {
        "every rank": (
            DistributedTensor("x", (5, 3), Partition((size, 1)), sizes=(rows, (3,))),
            size - 1,
            None,
        ),
        "a map": (DistributedTensor("x", (5, 3), Partition((2, 1))), 2, {0: 0, 1: 0, 2: size - 1}),
    }
    rng = np.random.default_rng(34)
    problems: list[str] = []
    for label, (x, root, mapping) in cases.items():
        module = LossModule(Loss(x, "mse", root=root), group=True, mapping=mapping)
        sent = count()
        try:
            for call, dtype in enumerate(dtypes):
                problems += shared.mse_step_problems(module, x, dtype, rng, f"{label} call {call}")
        finally:
            count.stop()
        agreed = 4 if mapping is not None and size > 1 else 0
        if sent != [str(module.reduce.op)] * agreed:
            problems.append(f"{label}: agreements on dtypes {sent}, expected {agreed}")
    return "; ".join(problems) or None
