"""BatchNorm's local kernels on torch tensors: where they work in place (tensors of their own,
untracked by autograd, of one dtype) they give bit for bit what the same operations give out
of place; on tensors autograd tracks, or of mixed dtypes, they keep the out-of-place
operations (differentiable, numpy's and torch's promotions unchanged); the caller's tensors
are never written."""

from __future__ import annotations

import numpy as np
import pytest

from linop import DistributedTensor, Partition
from linop.layers import BatchNorm
from linop.layers.batchnorm import Saved, local_moments

torch = pytest.importorskip("torch", reason="torch is not installed (the torch extra)")


def _layer() -> tuple[BatchNorm, str]:
    x = DistributedTensor("x", (3, 4, 5, 6), Partition((1, 1, 1, 1)))
    layer = BatchNorm(x)
    return layer, x.blocks[0].name


def _reference(x, mean, var, w, b, eps, g, totals, count):
    """The kernels' operations written out of place."""
    spread = (1, x.shape[1], 1, 1)
    centred = x - x.mean((0, 2, 3)).reshape(spread)
    variance = (centred * centred).mean((0, 2, 3))
    rstd = (var + eps) ** -0.5
    xhat = (x - mean.reshape(spread)) * rstd.reshape(spread)
    y = xhat * w.reshape(spread) + b.reshape(spread)
    shift, slope = (totals[1] / count).reshape(spread), (totals[0] / count).reshape(spread)
    dx = (g - shift - xhat * slope) * (rstd * w).reshape(spread)
    return variance, xhat, y, dx


@pytest.mark.parametrize("tracked", [False, True])
def test_kernels_in_place_equal_the_same_operations_bit_for_bit(tracked):
    layer, name = _layer()
    rng = np.random.default_rng(3)
    x = torch.from_numpy(rng.standard_normal((3, 4, 5, 6)) * 3 + 7)
    g = torch.from_numpy(rng.standard_normal((3, 4, 5, 6)))
    theta = torch.from_numpy(rng.standard_normal((2, 4)))
    totals = torch.from_numpy(rng.standard_normal((2, 4)))
    given = [t.clone() for t in (x, g, theta, totals)]
    if tracked:
        x.requires_grad_()
        theta.requires_grad_()
    mean, var = x.detach().mean((0, 2, 3)), x.detach().var((0, 2, 3), correction=0)
    with torch.enable_grad():
        _, variance = local_moments(x)
        outputs, saved = layer.normalized({name: x}, {name: (mean, var)}, {layer.copy_name(name): theta})
        copy = layer.copy_name(name)
        dx, _ = layer.input_gradient(
            {name: g}, saved, batch_statistics=True, run=lambda op, state: {copy: totals}
        )
    want = _reference(
        x.detach(), mean, var, theta[0].detach(), theta[1].detach(), layer.eps, g, totals, layer.count
    )
    got = (variance, saved[name].xhat, outputs[layer.y.block_name((0, 0, 0, 0))], dx[name])
    for what, a, b in zip(("variance", "xhat", "y", "dx"), got, want):
        assert a.dtype == b.dtype and torch.equal(a.detach(), b), what
        assert a.requires_grad == tracked, what
    if tracked:  # differentiable, with the gradients of the same operations out of place
        inputs = (x, theta)
        grads = torch.autograd.grad((variance.sum() + got[2].sum() + got[3].sum()), inputs)
        with torch.enable_grad():
            out = _reference(x, mean, var, theta[0], theta[1], layer.eps, g, totals, layer.count)
            expected = torch.autograd.grad(out[0].sum() + out[2].sum() + out[3].sum(), inputs)
        assert all(torch.equal(a, b) for a, b in zip(grads, expected))
    assert all(torch.equal(a.detach(), b) for a, b in zip((x, g, theta, totals), given))


def test_kernels_keep_the_promotions_of_mixed_dtypes():
    """float32 blocks and means with float64 variances and parameters: float64 results, as
    out of place (x - mean is float32, its scaling float64)."""
    layer, name = _layer()
    rng = np.random.default_rng(5)
    x = torch.from_numpy(rng.standard_normal((3, 4, 5, 6)).astype(np.float32))
    mean, var = torch.zeros(4, dtype=torch.float32), torch.ones(4, dtype=torch.float64) * 2
    theta = torch.from_numpy(rng.standard_normal((2, 4)))
    outputs, saved = layer.normalized({name: x}, {name: (mean, var)}, {layer.copy_name(name): theta})
    y = outputs[layer.y.block_name((0, 0, 0, 0))]
    assert saved[name].xhat.dtype == torch.float64 and y.dtype == torch.float64
    want = (x - mean.reshape(1, 4, 1, 1)) * ((var + layer.eps) ** -0.5).reshape(1, 4, 1, 1)
    assert torch.equal(saved[name].xhat, want)
    assert isinstance(saved[name], Saved)
