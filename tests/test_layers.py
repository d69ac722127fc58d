"""Distributed layers (convolution, pooling, affine) as operator trees: equal to independent
sequential references, adjoints exact for integers (within tolerance for floats), weight
gradients from the parameter tree's adjoint, and typed errors for bad arguments."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.signal
from numpy.lib.stride_tricks import sliding_window_view

import verify
from linop import DistributedTensor, Kernel, Partition, StateError, balanced_sizes
from linop.layers import Affine, AveragePool, Convolution, LayerError, MaxPoolJacobian
from linop.local import LocalKernel, LocalOperator

RNG_SEED = 11


# -- independent sequential references --------------------------------------------------------
def reference_correlation(x, w, b, stride, padding, dilation):
    """Cross-correlation with scipy.signal.correlate, one (sample, output channel) at a time:
    the kernel dilated by inserting zeros, the input zero-padded, 'valid' mode, then strided."""
    dims = x.ndim - 2
    padded = np.pad(x, [(0, 0), (0, 0), *((p, p) for p in padding)])
    dilated_shape = tuple(d * (k - 1) + 1 for k, d in zip(w.shape[2:], dilation))
    out = []
    for n in range(x.shape[0]):
        row = []
        for o in range(w.shape[0]):
            kernel = np.zeros((w.shape[1], *dilated_shape), dtype=w.dtype)
            kernel[(slice(None), *(slice(None, None, d) for d in dilation))] = w[o]
            full = scipy.signal.correlate(padded[n], kernel, mode="valid", method="direct")[0]
            row.append(full[tuple(slice(None, None, s) for s in stride)] + (0 if b is None else b[o]))
        out.append(row)
    result = np.array(out)
    assert result.ndim == dims + 2
    return result


def reference_pool(x, size, stride, padding, how):
    dims = x.ndim - 2
    padded = np.pad(x, [(0, 0), (0, 0), *((p, p) for p in padding)])
    view = sliding_window_view(padded, size, axis=tuple(range(2, 2 + dims)))
    view = view[(Ellipsis, *(slice(None, None, s) for s in stride), *(slice(None),) * dims)]
    taps = tuple(range(view.ndim - dims, view.ndim))
    return view.mean(axis=taps) if how == "mean" else view.max(axis=taps)


def only(tensor: DistributedTensor, state: dict) -> dict:
    """The blocks of ``state`` that belong to ``tensor``."""
    return {name: state[name] for name in tensor.space.names}


def spatial(kernel: Kernel, what: str) -> tuple[int, ...]:
    return getattr(kernel, what)[2:]


# -- convolution ---------------------------------------------------------------------------
CONV_CASES = [
    pytest.param(
        lambda: DistributedTensor("x", (2, 3, 9, 8), Partition((1, 1, 2, 2))),
        None,
        4,
        Kernel(3, padding=1),
        id="feature-2x2-k3-pad1",
    ),
    pytest.param(
        lambda: DistributedTensor(
            "x", (1, 2, 10, 7), Partition((1, 1, 2, 2)), sizes=((1,), (2,), (3, 7), (5, 2))
        ),
        None,
        3,
        Kernel((3, 2), stride=(2, 1), padding=(1, 0), dilation=(1, 2)),
        id="feature-unbalanced-stride-dilation",
    ),
    pytest.param(
        lambda: DistributedTensor("x", (1, 1, 5), Partition((1, 1, 4))),
        None,
        2,
        Kernel(3, stride=2),
        id="feature-1d-workers-without-output",
    ),
    pytest.param(
        lambda: DistributedTensor("x", (2, 4, 6, 5), Partition((1, 2, 1, 1))),
        Partition((1, 2, 2, 1, 1)),
        4,
        Kernel(3, padding=1),
        id="channel-2x2",
    ),
    pytest.param(
        lambda: DistributedTensor("x", (1, 2, 9, 7), Partition((1, 2, 2, 1))),
        Partition((1, 2, 2, 2, 1), tuple(range(8))),
        4,
        Kernel(3, stride=2, padding=(1, 0)),
        id="general-1x2x2x2x1",
    ),
    pytest.param(
        lambda: DistributedTensor("x", (1, 2, 4, 4, 3), Partition((1, 1, 2, 1, 1))),
        Partition((1, 2, 1, 2, 1, 1), (3, 2, 1, 0)),
        2,
        Kernel(2, padding=(1, 0, 1)),
        id="general-3d-permuted-workers",
    ),
]


@pytest.mark.parametrize(("tensor", "workers", "out_channels", "kernel"), CONV_CASES)
def test_convolution_equals_the_sequential_reference_and_is_exactly_adjoint(
    tensor, workers, out_channels, kernel
):
    rng = np.random.default_rng(RNG_SEED)
    x = tensor()
    layer = Convolution(x, out_channels, kernel, workers=workers)
    data = rng.integers(-3, 4, x.global_shape)
    w = rng.integers(-2, 3, layer.weights.global_shape)
    b = rng.integers(-2, 3, (out_channels,))
    k = layer.kernel
    args = (spatial(k, "stride"), spatial(k, "padding"), spatial(k, "dilation"))

    forward = layer.input_operator(w)
    result = layer.y.gather(forward(x.scatter(data)))
    assert result.dtype.kind == "i"
    assert np.array_equal(result, reference_correlation(data, w, None, *args))
    assert verify.exact_adjoint(forward), verify.exact_adjoint(forward)

    parameters = layer.parameter_operator(layer.window_operator(x.scatter(data)))
    result = layer.y.gather(parameters(layer.scatter_parameters(w, b)))
    assert np.array_equal(result, reference_correlation(data, w, b, *args))
    assert verify.exact_adjoint(parameters), verify.exact_adjoint(parameters)
    assert verify.exact_adjoint(layer.window_operator)  # the data movement alone


@pytest.mark.parametrize(
    ("boundary", "mode"), [("periodic", "wrap"), ("reflect", "reflect"), ("symmetric", "symmetric")], ids=str
)
def test_convolution_with_a_wrapping_boundary_equals_numpy_padding(boundary, mode):
    rng = np.random.default_rng(RNG_SEED)
    x = DistributedTensor("x", (1, 2, 7, 6), Partition((1, 1, 2, 2)))
    layer = Convolution(x, 2, Kernel(3, padding=1, boundary=boundary))
    data, w = rng.integers(-3, 4, x.global_shape), rng.integers(-2, 3, layer.weights.global_shape)
    padded = np.pad(data, [(0, 0), (0, 0), (1, 1), (1, 1)], mode=mode)
    expected = reference_correlation(padded, w, None, (1, 1), (0, 0), (1, 1))
    forward = layer.input_operator(w)
    assert np.array_equal(layer.y.gather(forward(x.scatter(data))), expected)
    assert verify.exact_adjoint(forward)


def test_the_feature_partitioned_tree_is_halo_exchange_then_local_kernels():
    x = DistributedTensor("x", (1, 2, 8, 8), Partition((1, 1, 2, 2)))
    layer = Convolution(x, 3, Kernel(3, padding=1))
    assert not layer.broadcasts_input and not layer.reduces_output
    tree = layer.input_operator(np.ones(layer.weights.global_shape))
    leaves = [f for f in tree.factors if isinstance(f, LocalOperator)]
    assert len(leaves) == 4 and {leaf.worker for leaf in leaves} == {0, 1, 2, 3}


@pytest.mark.parametrize("stride", [1, 2], ids=["stride1", "stride2"])
def test_complex_weights_have_a_conjugated_adjoint(stride):
    rng = np.random.default_rng(RNG_SEED)
    x = DistributedTensor("x", (1, 2, 7, 6), Partition((1, 1, 2, 1)))
    layer = Convolution(x, 2, Kernel(3, stride=stride, padding=1, dilation=(1, 2)))
    w = rng.standard_normal(layer.weights.global_shape) + 1j * rng.standard_normal(layer.weights.global_shape)
    assert verify.adjoint_test(layer.input_operator(w), dtype=np.complex128)
    parameters = layer.parameter_operator(
        layer.window_operator(x.scatter(rng.standard_normal(x.global_shape) * (1 + 1j)))
    )
    assert verify.adjoint_test(parameters, dtype=np.complex128)


def test_float_convolution_passes_the_adjoint_test_and_fails_with_a_wrong_kernel():
    rng = np.random.default_rng(RNG_SEED)
    x = DistributedTensor("x", (1, 2, 6, 6), Partition((1, 2, 1, 2)))
    layer = Convolution(x, 2, Kernel(3, padding=1), workers=Partition((1, 2, 2, 1, 2), tuple(range(8))))
    op = layer.input_operator(rng.standard_normal(layer.weights.global_shape).astype(np.float32))
    assert verify.adjoint_test(op, dtype=np.float32) and verify.adjoint_test(op)
    local = next(f for f in op.factors if isinstance(f, LocalOperator))
    kernel = LocalKernel.of(
        forward=lambda x: local.kernel.call([x], adjoint=False),
        adjoint=lambda y: 2 * local.kernel.call([y], adjoint=True),
        vectorized=True,
    )
    broken = LocalOperator(local.inputs, local.outputs, kernel, local.others, "bad")
    assert verify.adjoint_test(local) and not verify.adjoint_test(broken)
    assert not verify.exact_adjoint(broken)


@pytest.mark.parametrize(
    "kernel",
    [Kernel(3, padding=1), Kernel(3, stride=2, padding=1, dilation=1), Kernel(2, dilation=2)],
    ids=["k3p1", "k3s2p1", "k2d2"],
)
def test_gradients_match_torch_autograd(kernel):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(RNG_SEED)
    x = DistributedTensor("x", (2, 4, 7, 6), Partition((1, 2, 2, 1)))
    layer = Convolution(x, 4, kernel, workers=Partition((1, 2, 2, 2, 1), tuple(range(8))))
    data, w, b = (rng.standard_normal(s) for s in (x.global_shape, layer.weights.global_shape, (4,)))
    k = layer.kernel
    tx, tw, tb = (torch.tensor(a, requires_grad=True) for a in (data, w, b))
    ty = torch.nn.functional.conv2d(
        tx,
        tw,
        tb,
        stride=spatial(k, "stride"),
        padding=spatial(k, "padding"),
        dilation=spatial(k, "dilation"),
    )
    dy = rng.standard_normal(tuple(ty.shape))
    ty.backward(torch.tensor(dy))
    parameters = layer.parameter_operator(layer.window_operator(x.scatter(data)))
    y = layer.y.gather(parameters(layer.scatter_parameters(w, b)))
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-12, atol=1e-12)
    gradient = parameters.H(layer.y.scatter(dy))
    np.testing.assert_allclose(
        layer.weights.gather(only(layer.weights, gradient)), tw.grad.numpy(), rtol=1e-12, atol=1e-12
    )
    np.testing.assert_allclose(
        layer.bias.gather(only(layer.bias, gradient)), tb.grad.numpy(), rtol=1e-12, atol=1e-12
    )
    dx = x.gather(layer.input_operator(w).H(layer.y.scatter(dy)))
    np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=1e-12, atol=1e-12)


# -- unbalanced channel shares -----------------------------------------------------------------
def sparse_apply(op, state):
    """``op`` through the sparse interpreter: its exact matrix times the flattened state."""
    return op.range.unflatten(op.to_sparse() @ op.domain.flatten(state))


def sequential_twin(layer: Convolution) -> Convolution:
    """The same convolution on one worker (the single-process layer)."""
    ones = (1,) * layer.x.ndim
    xs = DistributedTensor("xs", layer.x.global_shape, Partition(ones))
    return Convolution(xs, layer.out_channels, layer.spatial_kernel, name="ys")


# (x shape, x partition, x sizes or None, P_w, C_out, out_sizes or None, kernel); the channel
# shares are the balanced split (7 over 3 is 3, 2, 2) or the explicit sizes given
UNBALANCED_CONV_CASES = [
    pytest.param(
        (1, 7, 6, 5), (1, 3, 1, 1), None, (1, 2, 3, 1, 1), 5, None, Kernel(3, padding=1), id="ci7/3-co5/2"
    ),
    pytest.param(
        (1, 6, 6, 5),
        (1, 3, 1, 1),
        ((1,), (1, 4, 1), (6,), (5,)),
        (1, 2, 3, 1, 1),
        4,
        (3, 1),
        Kernel(3, padding=1),
        id="explicit-ci1,4,1-co3,1",
    ),
    pytest.param(
        (1, 5, 7, 6),
        (1, 2, 2, 1),
        None,
        (1, 3, 2, 2, 1),
        4,
        None,
        Kernel(3, stride=2, padding=1),
        id="general-ci5/2-co4/3",
    ),
    pytest.param(
        (1, 2, 5, 5), (1, 3, 1, 1), None, (1, 3, 3, 1, 1), 2, None, Kernel(3), id="empty-shares-ci2/3-co2/3"
    ),
    pytest.param((2, 8, 5, 4), (1, 3, 1, 1), None, (1, 2, 3, 1, 1), 10, None, Kernel(3), id="distdl-co2-ci3"),
    pytest.param(
        (1, 5, 6, 4), (1, 2, 1, 1), None, (1, 2, 2, 1, 1), 10, None, Kernel(3, padding=1), id="distdl-co2-ci2"
    ),
]


def _unbalanced_layer(shape, px, sizes, pw, out, out_sizes, kernel, *, bias=True):
    x = DistributedTensor("x", shape, Partition(px), sizes=sizes or ())
    workers = Partition(pw, tuple(range(int(np.prod(pw)))))
    return Convolution(x, out, kernel, workers=workers, out_sizes=out_sizes, bias=bias)


@pytest.mark.parametrize(("shape", "px", "sizes", "pw", "out", "out_sizes", "kernel"), UNBALANCED_CONV_CASES)
def test_unbalanced_channel_shares_equal_the_single_process_layer_exactly(
    shape, px, sizes, pw, out, out_sizes, kernel
):
    rng = np.random.default_rng(RNG_SEED)
    layer = _unbalanced_layer(shape, px, sizes, pw, out, out_sizes, kernel)
    x = layer.x
    assert layer.ci_sizes == (sizes[1] if sizes else balanced_sizes(shape[1], px[1]))
    assert layer.co_sizes == (out_sizes or balanced_sizes(out, pw[1]))
    assert layer.y.sizes[1] == layer.co_sizes and layer.weights.sizes[:2] == (layer.co_sizes, layer.ci_sizes)
    single = sequential_twin(layer)
    data = rng.integers(-3, 4, shape)
    w = rng.integers(-2, 3, layer.weights.global_shape)
    b = rng.integers(-2, 3, (out,))
    dy = rng.integers(-3, 4, layer.y.global_shape)
    k = layer.kernel
    expected = reference_correlation(
        data, w, None, spatial(k, "stride"), spatial(k, "padding"), spatial(k, "dilation")
    )

    forward, forward_single = layer.input_operator(w), single.input_operator(w)
    parameters = layer.parameter_operator(layer.window_operator(x.scatter(data)))
    parameters_single = single.parameter_operator(single.window_operator(single.x.scatter(data)))
    for run in (lambda op, state: op(state), sparse_apply):  # the numpy and the sparse interpreters
        result = layer.y.gather(run(forward, x.scatter(data)))
        assert result.dtype.kind == "i" and np.array_equal(result, expected)
        assert np.array_equal(result, single.y.gather(run(forward_single, single.x.scatter(data))))
        dx = x.gather(run(forward.H, layer.y.scatter(dy)))
        assert np.array_equal(dx, single.x.gather(run(forward_single.H, single.y.scatter(dy))))
        with_bias = layer.y.gather(run(parameters, layer.scatter_parameters(w, b)))
        assert np.array_equal(with_bias, expected + b[None, :, None, None])
        gradient = run(parameters.H, layer.y.scatter(dy))
        gradient_single = run(parameters_single.H, single.y.scatter(dy))
        for mine, theirs in ((layer.weights, single.weights), (layer.bias, single.bias)):
            assert np.array_equal(
                mine.gather(only(mine, gradient)), theirs.gather(only(theirs, gradient_single))
            )
    for op in (forward, parameters, layer.window_operator, layer.copy_gradient_sum):
        proof = verify.exact_adjoint(op)
        assert proof, proof


def test_weights_scattered_with_the_wrong_channel_shares_are_refused():
    """The control: with explicit uneven channel shares (1, 4, 1), weights cut by the balanced
    split (2, 2, 2) have the wrong block shapes, and every interpreter refuses them by name."""
    rng = np.random.default_rng(RNG_SEED)
    layer = _unbalanced_layer(
        (1, 6, 6, 5), (1, 3, 1, 1), ((1,), (1, 4, 1), (6,), (5,)), (1, 1, 3, 1, 1), 3, None, 3
    )
    w = rng.integers(-2, 3, layer.weights.global_shape)
    balanced = DistributedTensor(layer.weights.name, layer.weights.global_shape, layer.weights.partition)
    wrong = {**balanced.scatter(w), **layer.bias.scatter(np.zeros(3, dtype=int))}
    assert layer.scatter_parameters(w, np.zeros(3, dtype=int)).keys() == wrong.keys()
    data = rng.integers(-3, 4, layer.x.global_shape)
    parameters = layer.parameter_operator(layer.window_operator(layer.x.scatter(data)))
    with pytest.raises(StateError, match=r"y_w\[0,0,0,0\]"):
        parameters(wrong)
    with pytest.raises(StateError, match=r"y_w\[0,0,0,0\]"):
        parameters.domain.flatten(wrong)
    # and an operator that cut the weights by the balanced split is a different operator
    forward = layer.input_operator(w)
    x_balanced = DistributedTensor("x", layer.x.global_shape, layer.x.partition)
    shifted = Convolution(x_balanced, 3, 3, workers=layer.work)
    assert forward.domain != shifted.input_operator(w).domain


def test_unbalanced_feature_shares_equal_the_single_process_affine_exactly():
    rng = np.random.default_rng(RNG_SEED)
    cases = [
        (DistributedTensor("x", (4, 7), Partition((1, 3))), Partition((2, 3)), 5, None),
        (
            DistributedTensor("x", (4, 7), Partition((1, 2)), sizes=((4,), (6, 1))),
            Partition((3, 2)),
            4,
            (0, 3, 1),
        ),
        (DistributedTensor("x", (3, 12), Partition((1, 4))), Partition((3, 4)), 7, None),  # DistDL's 12 -> 7
    ]
    for x, workers, out, out_sizes in cases:
        layer = Affine(x, out, workers=workers, out_sizes=out_sizes)
        assert layer.fi_sizes == x.sizes[1] and layer.fo_sizes == (
            out_sizes or balanced_sizes(out, workers.shape[0])
        )
        data, w, b = (
            rng.integers(-3, 4, x.global_shape),
            rng.integers(-3, 4, (out, x.global_shape[1])),
            rng.integers(-3, 4, out),
        )
        dy = rng.integers(-3, 4, (x.global_shape[0], out))
        forward = layer.input_operator(w)
        parameters = layer.parameter_operator(layer.window_operator(x.scatter(data)))
        for run in (lambda op, state: op(state), sparse_apply):
            assert np.array_equal(layer.y.gather(run(forward, x.scatter(data))), data @ w.T)
            assert np.array_equal(
                layer.y.gather(run(parameters, layer.scatter_parameters(w, b))), data @ w.T + b
            )
            gradient = run(parameters.H, layer.y.scatter(dy))
            assert np.array_equal(layer.weights.gather(only(layer.weights, gradient)), dy.T @ data)
            assert np.array_equal(layer.bias.gather(only(layer.bias, gradient)), dy.sum(axis=0))
            assert np.array_equal(x.gather(run(forward.H, layer.y.scatter(dy))), dy @ w)
        assert verify.exact_adjoint(forward) and verify.exact_adjoint(parameters)
    with pytest.raises(StateError, match=r"y_w\[0,0\]"):  # the control: the balanced split of W
        layer = Affine(cases[1][0], 4, workers=cases[1][1], out_sizes=(0, 3, 1))
        balanced = DistributedTensor("y_w", (4, 7), layer.weights.partition)
        layer.parameter_operator(layer.window_operator(cases[1][0].scatter(np.ones((4, 7), int))))(
            {**balanced.scatter(np.ones((4, 7), int)), **layer.bias.scatter(np.ones(4, int))}
        )


@pytest.mark.parametrize("cls", [AveragePool, MaxPoolJacobian], ids=["average", "max"])
def test_pooling_keeps_unbalanced_channel_shares(cls):
    rng = np.random.default_rng(RNG_SEED)
    x = DistributedTensor("x", (1, 5, 7, 6), Partition((1, 3, 2, 1)), sizes=((1,), (4, 0, 1), (4, 3), (6,)))
    pool = cls(x, Kernel(2, stride=2, padding=(1, 0)))
    assert pool.y.sizes[1] == (4, 0, 1)
    windows = pool.window_operator
    assert all(windows.range[pool.window_name(g)].shape[1] == x.sizes[1][g[1]] for g in x.partition.indices())
    x0 = rng.permutation(int(np.prod(x.global_shape))).reshape(x.global_shape).astype(float) - 300  # no ties
    op = pool.operator if cls is AveragePool else pool.at(windows(x.scatter(x0)))
    how = "mean" if cls is AveragePool else "max"
    expected = reference_pool(x0, (2, 2), (2, 2), (1, 0), how) if how == "mean" else None
    result = pool.y.gather(op(x.scatter(x0)))
    if expected is not None:
        np.testing.assert_allclose(result, expected, rtol=1e-14)
    else:
        padded = np.pad(x0, [(0, 0), (0, 0), (1, 1), (0, 0)], constant_values=-np.inf)
        assert np.array_equal(result, reference_pool(padded, (2, 2), (2, 2), (0, 0), "max"))
    assert verify.exact_adjoint(op)


# -- pooling ---------------------------------------------------------------------------------
POOL_CASES = [
    pytest.param(
        lambda: DistributedTensor("x", (2, 3, 9, 7), Partition((1, 2, 2, 1))),
        Kernel(2, stride=2, padding=(1, 0)),
        id="2x2-s2",
    ),
    pytest.param(
        lambda: DistributedTensor("x", (1, 2, 8, 8), Partition((1, 1, 2, 2))),
        Kernel(3, stride=1, padding=1),
        id="3x3-s1-p1",
    ),
    pytest.param(
        lambda: DistributedTensor("x", (1, 1, 7), Partition((1, 1, 4))), Kernel(2, stride=3), id="1d-s3"
    ),
]


@pytest.mark.parametrize(("tensor", "kernel"), POOL_CASES)
def test_average_pooling_equals_numpy_and_is_adjoint(tensor, kernel):
    rng = np.random.default_rng(RNG_SEED)
    x = tensor()
    pool = AveragePool(x, kernel)
    data = rng.integers(-8, 9, x.global_shape).astype(float)
    k = pool.kernel
    expected = reference_pool(data, spatial(k, "size"), spatial(k, "stride"), spatial(k, "padding"), "mean")
    np.testing.assert_allclose(pool.y.gather(pool.operator(x.scatter(data))), expected, rtol=1e-14)
    proof = verify.exact_adjoint(pool.operator)
    assert proof, proof
    assert verify.adjoint_test(pool.operator, dtype=np.float32)


@pytest.mark.parametrize(("tensor", "kernel"), POOL_CASES)
def test_max_pooling_jacobian_selects_the_window_maxima_exactly(tensor, kernel):
    rng = np.random.default_rng(RNG_SEED)
    x = tensor()
    pool = MaxPoolJacobian(x, kernel)
    x0 = (
        rng.permutation(np.prod(x.global_shape)).reshape(x.global_shape).astype(float) + 1
    )  # no ties, positive
    jacobian = pool.at(pool.window_operator(x.scatter(x0)))
    k = pool.kernel
    size, stride, padding = spatial(k, "size"), spatial(k, "stride"), spatial(k, "padding")
    assert np.array_equal(
        pool.y.gather(jacobian(x.scatter(x0))), reference_pool(x0, size, stride, padding, "max")
    )
    # independently: the derivative of max pooling at x0 picks the argmax entry of each window
    v = rng.integers(-9, 10, x.global_shape)
    positions = np.arange(x0.size).reshape(x0.shape)
    padded = np.pad(x0, [(0, 0), (0, 0), *((p, p) for p in padding)], constant_values=-np.inf)
    where = np.pad(positions, [(0, 0), (0, 0), *((p, p) for p in padding)], constant_values=-1)
    dims = x0.ndim - 2
    axes = tuple(range(2, 2 + dims))
    index = (Ellipsis, *(slice(None, None, s) for s in stride), *(slice(None),) * dims)
    values = sliding_window_view(padded, size, axis=axes)[index]
    owners = sliding_window_view(where, size, axis=axes)[index]
    flat_values = values.reshape(*values.shape[: values.ndim - dims], -1)
    chosen = np.take_along_axis(owners.reshape(flat_values.shape), flat_values.argmax(-1)[..., None], -1)[
        ..., 0
    ]
    assert np.array_equal(pool.y.gather(jacobian(x.scatter(v))), v.reshape(-1)[chosen])
    matrix = jacobian.to_sparse()
    assert matrix.dtype.kind == "i" and set(np.unique(matrix.data)) == {1}
    assert verify.exact_adjoint(jacobian)


def test_max_pooling_jacobian_without_its_window_raises():
    x = DistributedTensor("x", (1, 1, 4, 4), Partition((1, 1, 2, 1)))
    pool = MaxPoolJacobian(x, 2)
    windows = pool.window_operator(x.scatter(np.arange(16.0).reshape(1, 1, 4, 4)))
    partial = {name: array for name, array in windows.items() if name.endswith("[0,0,0,0]")}
    with pytest.raises(LayerError, match=r"x_window\[0,0,1,0\]"):
        pool.at(partial)(x.scatter(np.ones((1, 1, 4, 4))))


# -- affine ------------------------------------------------------------------------------------
AFFINE_CASES = [
    pytest.param((1, 1), None, id="sequential"),
    pytest.param((1, 2), None, id="features-1x2"),
    pytest.param((1, 2), Partition((2, 2), (0, 1, 2, 3)), id="work-2x2"),
    pytest.param((1, 1), Partition((3, 1), (2, 0, 1)), id="work-3x1"),
]


@pytest.mark.parametrize(("px", "workers"), AFFINE_CASES)
def test_affine_equals_numpy_and_is_exactly_adjoint(px, workers):
    rng = np.random.default_rng(RNG_SEED)
    x = DistributedTensor("x", (5, 6), Partition(px))
    layer = Affine(x, 6, workers=workers)
    data, w, b = rng.integers(-3, 4, (5, 6)), rng.integers(-3, 4, (6, 6)), rng.integers(-3, 4, 6)
    forward = layer.input_operator(w)
    assert np.array_equal(layer.y.gather(forward(x.scatter(data))), data @ w.T)
    parameters = layer.parameter_operator(layer.window_operator(x.scatter(data)))
    assert np.array_equal(layer.y.gather(parameters(layer.scatter_parameters(w, b))), data @ w.T + b)
    dy = rng.integers(-3, 4, (5, 6))
    gradient = parameters.H(layer.y.scatter(dy))
    assert np.array_equal(layer.weights.gather(only(layer.weights, gradient)), dy.T @ data)
    assert np.array_equal(layer.bias.gather(only(layer.bias, gradient)), dy.sum(axis=0))
    assert np.array_equal(x.gather(forward.H(layer.y.scatter(dy))), dy @ w)
    assert verify.exact_adjoint(forward) and verify.exact_adjoint(parameters)


# -- bad arguments -------------------------------------------------------------------------------
def _x(shape=(1, 4, 6, 6), partition=(1, 2, 1, 1)) -> DistributedTensor:
    return DistributedTensor("x", shape, Partition(partition))


BAD = [
    pytest.param(
        lambda: Convolution(_x(), 3, 3, workers=Partition((1, 2, 2, 1, 1)), out_sizes=(2, 2)),
        r"the output channel shares \(2, 2\) add up to 4, not 3",
        id="out-sizes-sum",
    ),
    pytest.param(
        lambda: Convolution(_x(), 3, 3, out_sizes=(1, 2)),
        r"2 output channel shares \(1, 2\) for 1 workers",
        id="out-sizes-count",
    ),
    pytest.param(
        lambda: Convolution(_x(), 1, 3, workers=Partition((1, 2, 2, 1, 1)), out_sizes=(2, -1)),
        "negative entry",
        id="out-sizes-negative",
    ),
    pytest.param(
        lambda: Convolution(_x(), 2, 3, workers=Partition((1, 2, 2, 1, 1)), out_sizes=(1.5, 0.5)),
        "must be integers",
        id="out-sizes-floats",
    ),
    pytest.param(
        lambda: Convolution(_x(), 2, 3, out_sizes="2"), "must be a sequence of integers", id="out-sizes-str"
    ),
    pytest.param(  # found by the long fuzz campaign: iterating it raised a bare TypeError
        lambda: Convolution(_x(), 2, 3, out_sizes=np.array(2)),
        "must be a sequence of integers",
        id="out-sizes-0d-array",
    ),
    pytest.param(
        lambda: Convolution(_x(), 2, 3, workers=Partition((1, 2, 2, 1))),
        r"work partition P_w \(1, 2, 2, 1\) has rank 4, expected rank 5",
        id="work-rank",
    ),
    pytest.param(
        lambda: Convolution(_x(), 2, 3, workers=Partition((1, 1, 1, 1, 1))),
        r"must be 1 x P_co x 2",
        id="work-shape",
    ),
    pytest.param(
        lambda: Convolution(_x(), 2, 3, output=Partition((1, 1, 1))),
        r"output partition P_y \(1, 1, 1\) has rank 3",
        id="output-rank",
    ),
    pytest.param(
        lambda: Convolution(_x(partition=(2, 1, 1, 1)), 2, 3), "batch dimension", id="batch-partitioned"
    ),
    pytest.param(
        lambda: Convolution(_x(), 2, 3).input_operator(np.ones((2, 4, 3))),
        r"weights has shape \(2, 4, 3\), expected \(2, 4, 3, 3\)",
        id="weights-shape",
    ),
    pytest.param(lambda: Convolution(_x(), 0, 3), "out_channels is 0", id="zero-channels"),
    pytest.param(
        lambda: Affine(_x((4, 6), (1, 2)), 3, workers=Partition((2, 2)), out_sizes=(3, 1)),
        r"the output feature shares \(3, 1\) add up to 4, not 3",
        id="affine-out-sizes",
    ),
    pytest.param(
        lambda: Affine(_x((4, 6), (1, 2)), 3, workers=Partition((2, 2)), out_sizes=(True, 2)),
        "must be integers",
        id="affine-out-sizes-bools",
    ),
    pytest.param(
        lambda: Affine(_x((4, 6), (1, 2)), 4, workers=Partition((2,))),
        r"has rank 1, expected rank 2",
        id="affine-rank",
    ),
    pytest.param(
        lambda: Affine(_x((4, 6), (1, 1)), 4).input_operator(np.ones((6, 4))),
        r"weights has shape \(6, 4\), expected \(4, 6\)",
        id="affine-weights",
    ),
    pytest.param(lambda: Affine(_x(), 4), "must be 2-D", id="affine-input-rank"),
    pytest.param(lambda: AveragePool(_x(partition=(2, 1, 1, 1)), 2), "batch dimension", id="pool-batch"),
]


@pytest.mark.parametrize(("build", "message"), BAD)
def test_bad_layer_arguments_raise_layer_errors_naming_them(build, message):
    with pytest.raises(LayerError, match=message) as caught:
        build()
    assert isinstance(caught.value, ValueError)


def test_a_parameter_tree_fingerprints_alike_from_any_ranks_windows():
    """Every rank builds a convolution's parameter tree from its own windows only (the others'
    absent), and the ranks must fingerprint it alike: the kernels' JAX forms (a one-program
    template where the window is held, the worker's pair where it is not) are not part of
    it. Control: a different kernel size is a different fingerprint."""
    from linop.program.fingerprinting import fingerprint

    x = DistributedTensor("x", (2, 2, 7, 6), Partition((1, 1, 2, 1)))
    layer = Convolution(x, 2, Kernel(3, padding=1))
    data = np.random.default_rng(0).integers(-3, 4, x.global_shape)
    windows = layer.window_operator(x.scatter(data))
    prints = {
        fingerprint(layer.parameter_operator({k: v for k, v in windows.items() if k == name}))
        for name in windows
    }
    assert prints == {fingerprint(layer.parameter_operator(windows))}
    other = Convolution(x, 2, Kernel(5, padding=2))
    assert fingerprint(other.parameter_operator(other.window_operator(x.scatter(data)))) not in prints
