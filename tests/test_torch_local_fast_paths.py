"""The local fast paths of the torch modules Interpolate / Upsample and MaxPool.

Interpolate: where torch's interpolation of a worker's window is its arithmetic on the global
field (the nearest modes at any scale whose window maps shift onto the global ones; the linear
modes where the scale is dyadic: 2**k, 0.5, and ``align_corners`` with (n - 1) = 2**k (m - 1)),
its local step is torch's interpolation of its window and a crop. Its outputs are bit for bit
torch's interpolation of the whole field (uneven shares, empty shares, windows at the global
boundary, float64 and float32), and equal the general path (per-axis gathers and weights) to
the tolerances that path has against torch. Where the arithmetic would differ
(``align_corners`` at scale 2, linear scales 3 and 1.5, a size that is no dyadic multiple) no
worker takes it, and a layer where only some workers can takes it on those alone.

MaxPool: the -inf padding set as strips (the window's real box, padded back) equals masking the
whole window with the layer's real entries."""

from __future__ import annotations

import numpy as np
import pytest

from linop import DistributedTensor, Partition
from linop.layers import LayerError

torch = pytest.importorskip("torch", reason="torch is not installed (the torch extra)")
from linop.frameworks.torch_pooling import MaxPool  # noqa: E402
from linop.frameworks.torch_resample import Interpolate  # noqa: E402
from linop.frameworks.torch_strips import padding_strips  # noqa: E402

F64 = dict(rtol=0, atol=1e-10)


def tensor(shape, grid, sizes=None):
    partition = Partition(grid)
    return (
        DistributedTensor("x", shape, partition)
        if sizes is None
        else DistributedTensor("x", shape, partition, sizes=sizes)
    )


def run(module, x, data, dy, dtype):
    """The module on x's blocks of ``data``, backward with ``dy``: (y, dx) gathered."""
    blocks = {k: torch.from_numpy(v).to(dtype).requires_grad_() for k, v in x.scatter(data).items()}
    out = module(blocks)
    cotangent = module.y.scatter(dy)
    sum((out[k] * torch.from_numpy(cotangent[k]).to(dtype)).sum() for k in out).backward()
    y = module.y.gather({k: v.detach().numpy() for k, v in out.items()})
    return y, x.gather({k: v.grad.numpy() for k, v in blocks.items()})


def general(module):
    """The module with its fast path switched off (every worker on the general path)."""
    module._products = [(*product[:4], None) for product in module._products]
    return module


FAST = {
    "1d-nearest-x2-empty-share": (((1, 2, 9), (1, 1, 4), ((1,), (2,), (4, 0, 2, 3))), dict(scale_factor=2)),
    "1d-linear-x1-uneven": (
        ((2, 1, 8), (1, 1, 3), ((2,), (1,), (1, 5, 2))),
        dict(scale_factor=1, mode="linear"),
    ),
    "2d-bilinear-x2-uneven": (
        ((2, 2, 7, 6), (1, 2, 3, 2), ((2,), (1, 1), (3, 1, 3), (1, 5))),
        dict(scale_factor=2, mode="bilinear"),
    ),
    "2d-bilinear-size-x2-x4": (((1, 2, 5, 3), (1, 1, 2, 3)), dict(size=(10, 12), mode="bilinear")),
    "2d-nearest-exact-x4": (
        ((1, 1, 5, 4), (1, 1, 3, 2), ((1,), (1,), (2, 0, 3), (3, 1))),
        dict(scale_factor=4, mode="nearest-exact"),
    ),
    "2d-nearest-recomputed-x2": (
        ((1, 1, 6, 5), (1, 1, 2, 2)),
        dict(scale_factor=2.0, recompute_scale_factor=True),
    ),
    "1d-linear-align-corners-9-to-17": (
        ((1, 1, 9), (1, 1, 3), ((1,), (1,), (4, 2, 3))),
        dict(size=17, mode="linear", align_corners=True),
    ),
    "2d-bilinear-align-corners-dyadic": (
        ((1, 2, 9, 5), (1, 1, 2, 2)),
        dict(size=(17, 9), mode="bilinear", align_corners=True),
    ),
    "2d-bilinear-x0.5": (((1, 2, 12, 8), (1, 1, 3, 2)), dict(scale_factor=0.5, mode="bilinear")),
    "2d-nearest-x3": (((1, 1, 6, 4), (1, 1, 2, 2)), dict(scale_factor=3)),
    "2d-nearest-x2-x3": (((1, 1, 6, 4), (1, 1, 2, 2)), dict(scale_factor=(2, 3))),
    "1d-nearest-exact-x1.5": (((1, 1, 8), (1, 1, 2)), dict(scale_factor=1.5, mode="nearest-exact")),
    "3d-trilinear-x2-uneven": (
        ((1, 2, 4, 5, 3), (1, 1, 2, 2, 1), ((1,), (2,), (1, 3), (4, 1), (3,))),
        dict(scale_factor=2, mode="trilinear"),
    ),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("name", list(FAST))
def test_the_fast_path_is_torchs_interpolation_of_the_whole_field(name, dtype):
    (shape, grid, *sizes), kwargs = FAST[name]
    x = tensor(shape, grid, *sizes)
    module = Interpolate(x, **kwargs, dtype=dtype)
    for out, _, block_shape, _, fast in module._products:
        assert fast is not None or 0 in block_shape, out  # every worker with outputs takes it
    rng = np.random.default_rng(11)
    data, dy = rng.standard_normal(shape), rng.standard_normal(module.y.global_shape)
    y, dx = run(module, x, data, dy, dtype)
    t = torch.from_numpy(data).to(dtype).requires_grad_()
    expected = torch.nn.functional.interpolate(t, **kwargs)
    expected.backward(torch.from_numpy(dy).to(dtype))
    assert np.array_equal(y, expected.detach().numpy())  # bit for bit: the same arithmetic
    slow_y, slow_dx = run(general(module), x, data, dy, dtype)
    for ours, theirs in ((y, slow_y), (dx, slow_dx), (dx, t.grad.numpy())):
        if dtype == torch.float64:
            assert np.allclose(ours, theirs, **F64)
        else:
            torch.testing.assert_close(torch.from_numpy(ours), torch.from_numpy(theirs))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(scale_factor=2, mode="bilinear", align_corners=True),  # (m - 1)/(n - 1) = 5/11
        dict(scale_factor=3, mode="bilinear"),
        dict(scale_factor=1.5, mode="bilinear"),
        dict(size=(13, 7), mode="bilinear"),
        dict(size=(13, 7)),  # nearest: no window length with the same scale
        dict(scale_factor=(2, 3), mode="bilinear"),  # one axis without it: the worker takes none
    ],
    ids=lambda kwargs: "-".join(f"{k}={v}" for k, v in kwargs.items()),
)
def test_no_fast_path_where_the_window_arithmetic_would_differ(kwargs):
    x = tensor((1, 1, 6, 4), (1, 1, 2, 2))
    module = Interpolate(x, **kwargs)
    assert all(fast is None for *_, fast in module._products)
    rng = np.random.default_rng(12)
    data, dy = rng.standard_normal((1, 1, 6, 4)), rng.standard_normal(module.y.global_shape)
    y, _ = run(module, x, data, dy, torch.float64)
    expected = torch.nn.functional.interpolate(torch.from_numpy(data), **kwargs)
    assert np.allclose(y, expected.numpy(), **F64)


def test_workers_that_cannot_take_the_fast_path_take_the_general_one_and_all_agree_bit_for_bit():
    """nearest-exact x1.5 on 6 x 4 over 2 x 2: the first row of workers' windows map onto the
    global field, the second's do not (their window would start at an input whose shift is no
    integer); both kinds together give torch's interpolation of the whole field exactly."""
    x = tensor((1, 1, 6, 4), (1, 1, 2, 2))
    kwargs = dict(scale_factor=1.5, mode="nearest-exact")
    module = Interpolate(x, **kwargs)
    taken = [fast is not None for *_, fast in module._products]
    assert any(taken) and not all(taken)
    data = np.random.default_rng(13).standard_normal((1, 1, 6, 4))
    y, _ = run(module, x, data, np.ones(module.y.global_shape), torch.float64)
    expected = torch.nn.functional.interpolate(torch.from_numpy(data), **kwargs)
    assert np.array_equal(y, expected.numpy())


def test_without_the_dyadic_condition_a_linear_fast_path_is_caught(monkeypatch):
    """The control: with the exactness condition on a linear scale switched off, linear x3 on
    4 workers takes the fast path everywhere (the shift 3a is an integer and the exact maps
    agree) and its outputs differ from torch's on the whole field in the last bits, which the
    bit-for-bit comparison catches."""
    from linop.frameworks import torch_resample

    monkeypatch.setattr(torch_resample, "_exact_scale", lambda *args: True)
    x = tensor((1, 1, 16), (1, 1, 4))
    kwargs = dict(scale_factor=3, mode="linear")
    module = Interpolate(x, **kwargs)
    assert all(fast is not None for *_, fast in module._products)
    data = np.random.default_rng(14).standard_normal((1, 1, 16))
    y, _ = run(module, x, data, np.ones(module.y.global_shape), torch.float64)
    expected = torch.nn.functional.interpolate(torch.from_numpy(data), **kwargs).numpy()
    assert not np.array_equal(y, expected) and np.allclose(y, expected, **F64)


POOLED = {
    "1d-k3-s2-p1": (
        ((1, 2, 9), (1, 1, 3), ((1,), (2,), (2, 4, 3))),
        dict(kernel_size=3, stride=2, padding=1),
    ),
    "2d-k3-s2-p1-uneven": (
        ((2, 3, 9, 7), (1, 1, 3, 2), ((2,), (3,), (1, 5, 3), (6, 1))),
        dict(kernel_size=3, stride=2, padding=1),
    ),
    "2d-k5-p2-dilated": (
        ((1, 1, 10, 8), (1, 1, 2, 2)),
        dict(kernel_size=(5, 3), padding=(2, 1), dilation=(1, 2)),
    ),
    "3d-k3-s1-p1": (((1, 1, 5, 4, 6), (1, 1, 2, 1, 3)), dict(kernel_size=3, stride=1, padding=1)),
}


@pytest.mark.parametrize("name", list(POOLED))
def test_max_pool_padding_strips_equal_the_whole_window_mask(name):
    (shape, grid, *sizes), kwargs = POOLED[name]
    x = tensor(shape, grid, *sizes)
    module = MaxPool(x, **kwargs)
    layer, rng = module.layer, np.random.default_rng(13)
    strips = 0
    for g in x.partition.indices():
        window = layer.geometry.window_shape(g)
        real = layer.real_entries(g)
        if 0 in window or real.all():
            continue
        strips += 1
        spatial = np.broadcast_to(real, window)[(0,) * 2]
        padding = padding_strips(spatial, g, "MaxPool")
        data = torch.from_numpy(rng.standard_normal(window))
        masked = data.masked_fill(torch.from_numpy(~np.ascontiguousarray(spatial)), float("-inf"))
        assert torch.equal(padding.fill_(data.clone()), masked), g
        # the gradient reaches the real entries alone, as the mask's does
        leaf = data.clone().requires_grad_()
        padding.fill_(leaf.clone()).sum().backward()
        assert torch.equal(leaf.grad, torch.from_numpy(np.array(spatial)).to(leaf.grad).expand_as(leaf.grad))
    assert strips > 0  # the case has windows with padding


def test_strips_refuse_real_entries_that_are_not_a_box():
    real = np.ones((4, 4), dtype=bool)
    real[0, 0] = False
    with pytest.raises(LayerError, match="not a box"):
        padding_strips(real, (0, 0, 0, 0), "MaxPool")
