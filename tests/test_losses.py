"""Distributed losses: the sum-reduce onto the root proven exactly (its adjoint the broadcast of
the loss's gradient), and every kind and reduction equal to torch's loss on one process over
several partitions (uneven and empty shares), value and input gradient, through the numpy
interpreter and as a torch module. A control: a mean over the local count is caught."""

from __future__ import annotations

import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import verify
from linop import Broadcast, DistributedTensor, Partition
from linop.layers import LayerError, Loss
from linop.layers.losses import KINDS

torch = pytest.importorskip("torch", reason="torch is not installed (the torch extra)")
from linop.frameworks.torch_losses import LossModule  # noqa: E402

PARTITIONS = {
    "one-worker": ((3, 4), (1, 1), None),
    "2x2-uneven-empty": ((5, 3, 4), (2, 1, 2), ((5, 0), (3,), (1, 3))),
    "4-batch-3-features": ((4, 2, 6), (4, 1, 3), ((2, 0, 1, 1), (2,), (1, 0, 5))),
}

OPTIONS = {
    "l1": {},
    "mse": {},
    "poisson_nll": {"log_input": True},
    "poisson_nll-raw-full": {"log_input": False, "full": True},
    "bce": {},
    "bce_with_logits": {},
    "kl_div": {},
    "kl_div-log-target": {"log_target": True},
}

TORCH = {
    "l1": torch.nn.L1Loss,
    "mse": torch.nn.MSELoss,
    "poisson_nll": torch.nn.PoissonNLLLoss,
    "bce": torch.nn.BCELoss,
    "bce_with_logits": torch.nn.BCEWithLogitsLoss,
    "kl_div": torch.nn.KLDivLoss,
}


def _kind(case):
    return case.split("-")[0]


def _tensor(name):
    shape, grid, sizes = PARTITIONS[name]
    return DistributedTensor("x", shape, Partition(grid), sizes=sizes or ())


def _data(kind, options, shape, rng):
    """A prediction and a target in each loss's domain (BCE's x in (0, 1), Poisson's raw x > 0,
    targets with entries equal to the prediction for L1's zero sign)."""
    x, t = rng.standard_normal(shape), rng.standard_normal(shape)
    if kind == "bce":
        x, t = rng.uniform(0.05, 0.95, shape), rng.uniform(0, 1, shape)
    elif kind == "bce_with_logits":
        t = rng.uniform(0, 1, shape)
    elif kind == "poisson_nll":
        t = rng.integers(0, 5, shape).astype(float)
        if not options.get("log_input", True):
            x = rng.uniform(0.1, 3, shape)
    elif kind == "kl_div" and not options.get("log_target"):
        t = rng.uniform(0, 1, shape)
        t.flat[0] = 0.0  # torch's 0 log 0 = 0
    elif kind == "l1":
        t.flat[0] = x.flat[0]  # sign(0) = 0
    return x, t


def _reductions(kind):
    return ["sum", "mean", "none"] + (["batchmean"] if kind == "kl_div" else [])


pytestmark = pytest.mark.filterwarnings("ignore:reduction. 'mean' divides the total loss:UserWarning")


def _torch_loss(kind, options, reduction, x, t, dy=None):
    loss = TORCH[kind](reduction=reduction, **options)
    xt = torch.from_numpy(x).requires_grad_()
    value = loss(xt, torch.from_numpy(t))
    value.backward(torch.ones_like(value) if dy is None else torch.from_numpy(dy))
    return value.detach().numpy(), xt.grad.numpy()


def _close(a, b, what, tol=1e-10):
    assert np.allclose(a, b, rtol=tol, atol=tol), f"{what}: {a} against {b}"


@pytest.mark.parametrize("name", list(PARTITIONS))
def test_the_reduction_is_an_exact_sum_reduce_whose_adjoint_is_the_broadcast(name):
    layer = Loss(_tensor(name), "mse", root=1)
    op = layer.reduction_operator
    assert verify.exact_adjoint(op)
    assert op.H == Broadcast(layer.total, layer.x.partition, layer.partials.name)
    assert op.range.names == (layer.total_name,) and op.range[layer.total_name].worker == 1
    ones = {n: np.ones(1, dtype=np.int64) for n in op.domain.names}
    assert op(ones)[layer.total_name][0] == layer.x.partition.size


@pytest.mark.parametrize("name", list(PARTITIONS))
@pytest.mark.parametrize("case", list(OPTIONS))
def test_numpy_description_equals_torch_losses(case, name):
    kind, options = _kind(case), OPTIONS[case]
    rng = np.random.default_rng(3)
    x = _tensor(name)
    data, target = _data(kind, options, x.global_shape, rng)
    for reduction in _reductions(kind):
        layer = Loss(x, kind, reduction=reduction, **options)
        dy = rng.standard_normal(x.global_shape) if reduction == "none" else None
        expected, expected_grad = _torch_loss(kind, options, reduction, data, target, dy)
        value = layer.value(x.scatter(data), x.scatter(target))
        if reduction == "none":
            _close(layer.y.gather(value), expected, f"{reduction} value")
            grad = layer.gradient(x.scatter(data), x.scatter(target), layer.y.scatter(dy))
        else:
            _close(value[layer.total_name][0], expected, f"{reduction} value")
            grad = layer.gradient(x.scatter(data), x.scatter(target), {layer.total_name: np.array([1.5])})
            expected_grad = 1.5 * expected_grad
        _close(x.gather(grad), expected_grad, f"{reduction} gradient")


@pytest.mark.parametrize("name", ["one-worker", "2x2-uneven-empty", "4-batch-3-features"])
@pytest.mark.parametrize("case", list(OPTIONS))
def test_module_equals_torch_losses(case, name):
    kind, options = _kind(case), OPTIONS[case]
    rng = np.random.default_rng(4)
    x = _tensor(name)
    data, target = _data(kind, options, x.global_shape, rng)
    for reduction in _reductions(kind):
        module = LossModule(Loss(x, kind, reduction=reduction, **options))
        inputs = {k: torch.from_numpy(v).requires_grad_() for k, v in x.scatter(data).items()}
        targets = {k: torch.from_numpy(v) for k, v in x.scatter(target).items()}
        out = module(inputs, targets)
        dy = rng.standard_normal(x.global_shape) if reduction == "none" else None
        expected, expected_grad = _torch_loss(kind, options, reduction, data, target, dy)
        if reduction == "none":
            dys = module.layer.y.scatter(dy)
            sum((v * torch.from_numpy(dys[k])).sum() for k, v in out.items()).backward()
            _close(module.layer.y.gather({k: v.detach().numpy() for k, v in out.items()}), expected, "none")
        else:
            assert out.shape == () and module.is_root
            out.backward()
            _close(out.detach().numpy(), expected, reduction)
        _close(x.gather({k: v.grad.numpy() for k, v in inputs.items()}), expected_grad, f"{reduction} grad")


def test_a_mean_over_the_local_count_is_caught():
    """The control: each worker's mean of its own entries, summed, is not the global mean on
    an uneven partition (so the comparison above would catch a loss normalised locally)."""
    rng = np.random.default_rng(5)
    x = _tensor("4-batch-3-features")
    data, target = _data("mse", {}, x.global_shape, rng)
    expected, _ = _torch_loss("mse", {}, "mean", data, target)
    xs, ts = x.scatter(data), x.scatter(target)
    local_means = sum(((xs[n] - ts[n]) ** 2).mean() for n in xs if xs[n].size)
    assert not np.isclose(local_means, expected)
    layer = Loss(x, "mse", reduction="mean")
    assert np.isclose(layer.value(xs, ts)[layer.total_name][0], expected, rtol=1e-12)


def test_float32_module_within_torch_tolerances():
    rng = np.random.default_rng(6)
    x = _tensor("2x2-uneven-empty")
    data, target = (a.astype(np.float32) for a in _data("bce_with_logits", {}, x.global_shape, rng))
    module = LossModule(Loss(x, "bce_with_logits"))
    inputs = {k: torch.from_numpy(v).requires_grad_() for k, v in x.scatter(data).items()}
    out = module(inputs, {k: torch.from_numpy(v) for k, v in x.scatter(target).items()})
    out.backward()
    xt = torch.from_numpy(data).requires_grad_()
    expected = torch.nn.functional.binary_cross_entropy_with_logits(xt, torch.from_numpy(target))
    expected.backward()
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(
        torch.from_numpy(x.gather({k: v.grad.numpy() for k, v in inputs.items()})), xt.grad
    )


def test_loss_arguments_are_checked():
    x = DistributedTensor("x", (2, 3), Partition((1, 1)))
    with pytest.raises(LayerError, match="unknown kind"):
        Loss(x, "hinge")
    with pytest.raises(LayerError, match="other than x's"):
        Loss(x, "mse", name="x")
    with pytest.raises(LayerError, match="unknown reduction"):
        Loss(x, "mse", reduction="max")
    with pytest.raises(LayerError, match="batchmean"):
        Loss(x, "mse", reduction="batchmean")
    with pytest.raises(LayerError, match="expected"):
        Loss(x, "mse").value({"x[0,0]": np.ones((2, 2))}, {"x[0,0]": np.ones((2, 2))})
    with pytest.raises(LayerError, match="Loss layer"):
        LossModule(object())
    assert set(KINDS) == set(TORCH)


def test_module_blocks_of_a_wrong_name_or_shape_are_state_errors():
    from linop import StateError

    x = _tensor("2x2-uneven-empty")
    module = LossModule(Loss(x, "mse"))
    good = {b.name: torch.zeros(b.shape, dtype=torch.float64) for b in x.blocks}
    with pytest.raises(StateError, match="takes blocks"):
        module({}, good)
    wrong = dict(good, **{"x[0,0,1]": torch.zeros(5, 3, 2, dtype=torch.float64)})
    with pytest.raises(
        StateError, match=r"target's block 'x\[0,0,1\]' has shape \(5, 3, 2\), expected \(5, 3, 3\)"
    ):
        module(good, wrong)
    with pytest.raises(StateError, match=r"input's block 'x\[0,0,1\]' has shape \(5, 3, 2\)"):
        module(wrong, good)  # the input's shape too, not only the target's
    with pytest.raises(StateError, match="input takes blocks"):
        module(dict(good, extra=torch.zeros(1)), good)
    assert float(module(types.MappingProxyType(good), good)) == 0.0  # any mapping, the checked way


def test_module_mixed_dtypes_and_double_backward():
    """A float32 block next to float64 ones (the tree runs in the promoted dtype, each block's
    gradient in its own), and the backward recorded under ``create_graph`` (the broadcast
    differentiable again): the Hessian-vector product of the MSE mean is 2 v / count, and the
    input gradient's derivative in the loss's seed is that gradient at seed 1."""
    x = _tensor("2x2-uneven-empty")
    rng = np.random.default_rng(8)
    data, target = rng.standard_normal(x.global_shape), rng.standard_normal(x.global_shape)
    first = x.blocks[0].name
    inputs = {
        k: torch.from_numpy(v.astype(np.float32) if k == first else v).requires_grad_()
        for k, v in x.scatter(data).items()
    }
    module = LossModule(Loss(x, "mse"))
    out = module(inputs, {k: torch.from_numpy(v) for k, v in x.scatter(target).items()})
    assert out.dtype == torch.float64
    names = list(inputs)
    seed = torch.tensor(1.0, dtype=torch.float64, requires_grad=True)
    grads = torch.autograd.grad(out, [inputs[k] for k in names], seed, create_graph=True)
    assert grads[0].dtype == torch.float32 and all(g.dtype == inputs[k].dtype for k, g in zip(names, grads))
    vs = [torch.ones_like(g) * (1 + j) for j, g in enumerate(grads)]
    *hvp, by_seed = torch.autograd.grad(
        sum((g * v).sum() for g, v in zip(grads, vs)), [*(inputs[k] for k in names), seed]
    )
    count = float(np.prod(x.global_shape))
    for h, v in zip(hvp, vs):
        torch.testing.assert_close(h, 2 * v / count)
    # the gradient is linear in the seed: its derivative is the gradient at seed 1
    torch.testing.assert_close(by_seed, sum((g.detach().double() * v).sum() for g, v in zip(grads, vs)))


@st.composite
def _layouts(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 5)) for _ in range(ndim))
    grid = tuple(draw(st.integers(1, 4 if d == 0 else 2)) for d in range(ndim))
    sizes = []
    for n, p in zip(shape, grid):
        cuts = sorted(draw(st.integers(0, n)) for _ in range(p - 1))
        bounds = [0, *cuts, n]
        sizes.append(tuple(bounds[k + 1] - bounds[k] for k in range(p)))
    return DistributedTensor("x", shape, Partition(grid), sizes=tuple(sizes))


@settings(max_examples=12, deadline=None)
@given(
    _layouts(),
    st.sampled_from(list(OPTIONS)),
    st.sampled_from(["sum", "mean", "batchmean"]),
    st.integers(0, 99),
)
def test_random_partitions_equal_torch_losses(x, case, reduction, seed):
    """Any partition of 1-3 dimensions (up to 4 workers along the first, shares cut at random,
    empty ones included), a random kind: the module's loss and gradient equal torch's."""
    kind, options = _kind(case), OPTIONS[case]
    if reduction == "batchmean" and kind != "kl_div":
        reduction = "mean"
    data, target = _data(kind, options, x.global_shape, np.random.default_rng(seed))
    module = LossModule(Loss(x, kind, reduction=reduction, **options))
    inputs = {k: torch.from_numpy(v).requires_grad_() for k, v in x.scatter(data).items()}
    out = module(inputs, {k: torch.from_numpy(v) for k, v in x.scatter(target).items()})
    out.backward()
    expected, expected_grad = _torch_loss(kind, options, reduction, data, target)
    _close(out.detach().numpy(), expected, reduction)
    _close(x.gather({k: v.grad.numpy() for k, v in inputs.items()}), expected_grad, "gradient")
