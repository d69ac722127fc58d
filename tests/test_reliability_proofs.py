"""Reliability of the proofs and of the answers (issue 22): no proof of a map that is not
linear, no kernel that changes the caller's arrays, no silent in-place write into overlapping
memory, max pooling padded as torch pads it, no parameter silently ignored.

Every case failed on the code before its fix."""

from __future__ import annotations

import numpy as np
import pytest

import verify
from linop import Block, DistributedTensor, Kernel, Partition, Space, local_operator
from linop.errors import (
    KernelWriteError,
    LayerError,
    LinopError,
    NotLinearError,
    StateError,
)
from linop.layers import Affine, Convolution, MaxPoolJacobian
from verify.lift import LiftError, lift, prove_backward

X4 = Space([Block("x", (4,))])


# -- lift: linearity on several states -------------------------------------------------------
@pytest.mark.parametrize(
    ("forward", "adjoint", "what"),
    [
        pytest.param(lambda x: x + 1, lambda y: y + 1, "affine", id="affine"),
        pytest.param(lambda x: x * x, lambda y: y * y, "square", id="square"),
        pytest.param(np.floor, np.floor, "floor", id="floor-integral-on-integers"),
        pytest.param(lambda x: np.abs(x), lambda y: np.abs(y), "abs", id="abs"),
        pytest.param(lambda x: x * (x.sum() != 1), lambda y: y, "bent", id="bent-on-one-plane"),
    ],
)
def test_lift_refuses_maps_that_are_not_linear(forward, adjoint, what):
    with pytest.raises(LiftError, match="not linear"):
        prove_backward(forward, {"x": (4,)}, {"y": (4,)}, adjoint=adjoint)


def test_lift_still_proves_linear_maps_and_refutes_a_wrong_adjoint():
    """Control: the stronger check keeps the true cases true and the false ones false."""
    assert prove_backward(lambda x: x[::-1] * 3, {"x": (4,)}, {"y": (4,)}, adjoint=lambda y: y[::-1] * 3)
    assert prove_backward(lambda x: x * 0.1, {"x": (4,)}, {"y": (4,)}, adjoint=lambda y: y * 0.1)
    assert not prove_backward(lambda x: x[::-1], {"x": (4,)}, {"y": (4,)}, adjoint=lambda y: y)


def test_lift_refuses_a_map_that_writes_its_input_naming_the_write():
    with pytest.raises(LiftError, match="writes into its input") as caught:
        lift(lambda v: v.__imul__(2), {"x": (4,)}, {"y": (4,)}, adjoint=lambda v: v * 2)
    assert "not linear" not in str(caught.value)


@pytest.mark.parametrize("batch", [0, -1, 2.5, "8", True])
def test_lift_refuses_a_bad_batch(batch):
    with pytest.raises(LiftError, match="batch"):
        lift(lambda x: x, {"x": (4,)}, {"y": (4,)}, adjoint=lambda y: y, batch=batch)


def test_lift_refuses_a_domain_too_large_to_probe_before_probing():
    calls = []

    def f(x):
        calls.append(1)
        return x

    with pytest.raises(LiftError, match="entries") as caught:
        lift(f, {"x": (2**20, 2**20)}, {"y": (2**20, 2**20)}, adjoint=f)
    assert "max_entries" in str(caught.value) and not calls
    with pytest.raises(LiftError, match="max_entries"):
        lift(f, {"x": (64,)}, {"y": (64,)}, adjoint=f, max_entries=32)
    assert lift(f, {"x": (64,)}, {"y": (64,)}, adjoint=f, max_entries=64)  # control


# -- local operators given as callables --------------------------------------------------------
def _square_op():
    def forward(x):
        return x[:2] ** 2

    def adjoint(y):
        return np.concatenate([y**2, np.zeros(2, dtype=y.dtype)])

    return local_operator(X4, "x", ("y", (2,)), forward=forward, adjoint=adjoint)


def test_a_local_operator_that_is_not_linear_is_not_proven():
    op = _square_op()
    with pytest.raises(NotLinearError, match=r"L\*?\[(x -> y|y -> x)\].*not linear"):
        verify.exact_adjoint(op)
    with pytest.raises(NotLinearError):
        op.to_sparse()


def test_a_local_operator_affine_or_integral_only_is_not_linear():
    for forward in (lambda x: x + 1, np.floor, lambda x: np.trunc(x / 2) * 2):
        op = local_operator(X4, "x", ("y", (4,)), forward=forward, adjoint=lambda y: y)
        with pytest.raises(NotLinearError):
            op.to_sparse()


def test_a_false_vectorized_claim_is_detected():
    m = np.arange(9).reshape(3, 3)  # not symmetric: a batched probe would read K^T
    space = Space([Block("x", (3,))])
    op = local_operator(
        space, "x", ("y", (3,)), forward=lambda x: m @ x, adjoint=lambda y: m.T @ y, vectorized=True
    )
    with pytest.raises(NotLinearError, match="vectorized"):
        verify.exact_adjoint(op)
    # control: the same callables without the false claim are proven, and agree with numpy
    honest = local_operator(space, "x", ("y", (3,)), forward=lambda x: m @ x, adjoint=lambda y: m.T @ y)
    assert verify.exact_adjoint(honest)
    state = {"x": np.arange(3)}
    assert np.array_equal(honest(state)["y"], honest.to_sparse().toarray() @ state["x"])


def test_linear_callables_and_layers_still_pass():
    """Control: linear callables (plain, vectorized, float coefficients) are proven."""
    m = np.array([[0.5, 0.25, 0, 1], [1.5, 0, 0, -2]])
    space = X4
    for vectorized in (False, True):
        op = local_operator(
            space,
            "x",
            ("y", (2,)),
            forward=lambda x: x @ m.T,
            adjoint=lambda y: y @ m,
            vectorized=vectorized,
        )
        assert verify.exact_adjoint(op)
    x = DistributedTensor("x", (1, 2, 6), Partition((1, 1, 2)))
    conv = Convolution(x, 2, Kernel(3, padding=1))
    weights = np.random.default_rng(0).standard_normal(conv.weights.global_shape)
    op = conv.input_operator(weights)
    assert verify.exact_adjoint(op)
    state = x.scatter(np.random.default_rng(1).standard_normal(x.global_shape))
    want = op.to_sparse() @ op.domain.flatten(state)
    np.testing.assert_allclose(op.range.flatten(op(state)), want, rtol=1e-12, atol=1e-12)


def test_a_kernel_that_writes_its_argument_raises_and_leaves_the_caller_array_alone():
    op = local_operator(X4, "x", ("y", (4,)), forward=lambda v: v.__imul__(2), adjoint=lambda v: v * 2)
    x = np.arange(4.0)
    with pytest.raises(KernelWriteError, match=r"L\[x -> y\].*forward.*'x'"):
        op({"x": x})
    assert np.array_equal(x, np.arange(4.0))
    with pytest.raises(KernelWriteError):
        op.to_sparse()
    # control: a kernel that returns a new array works and reads the caller's values
    good = local_operator(X4, "x", ("y", (4,)), forward=lambda v: v * 2, adjoint=lambda v: v * 2)
    assert np.array_equal(good({"x": x})["y"], 2 * x)


# -- in place into overlapping memory ------------------------------------------------------------
def _swap():
    space = Space([Block("x", (4,))])
    from linop import Move

    return Move(space["x"][0:2], space["x"][2:4])  # in place: domain == range


def test_in_place_into_a_stride_zero_numpy_array_is_refused():
    op = _swap()
    base = np.zeros(1)
    broadcast = np.lib.stride_tricks.as_strided(base, shape=(4,), strides=(0,))
    assert broadcast.flags.writeable
    with pytest.raises(StateError, match=r"block 'x'.*overlap"):
        op.apply({"x": broadcast}, inplace=True)
    overlapping = np.lib.stride_tricks.as_strided(np.zeros(6), shape=(2, 4), strides=(16, 8))
    square = Space([Block("x", (2, 4))])
    from linop import Identity

    with pytest.raises(StateError, match="overlap"):
        Identity(square).apply({"x": overlapping}, inplace=True)
    # control: non-contiguous but non-overlapping views stay allowed
    wide = np.arange(8.0)
    view = wide[::2]
    expected = op({"x": view.copy()})["x"]
    op.apply({"x": view}, inplace=True)
    assert np.array_equal(wide[::2], expected) and np.array_equal(wide[1::2], [1, 3, 5, 7])


def test_in_place_into_an_expanded_torch_tensor_is_refused():
    torch = pytest.importorskip("torch")
    op = _swap()
    with pytest.raises(StateError, match="overlap"):
        op.apply({"x": torch.zeros(1).expand(4)}, inplace=True)
    t = torch.arange(4.0)
    op.apply({"x": t}, inplace=True)  # control
    assert t.tolist() == op({"x": np.arange(4.0)})["x"].tolist()


# -- max pooling pads with minus infinity --------------------------------------------------------
@pytest.mark.parametrize(
    ("workers", "length", "size", "stride", "padding"),
    [(2, 4, 3, 1, 1), (1, 4, 3, 1, 1), (2, 7, 3, 2, 1), (3, 9, 5, 2, 2), (2, 6, 2, 2, 1)],
)
def test_max_pooling_matches_torch_on_negative_inputs(workers, length, size, stride, padding):
    torch = pytest.importorskip("torch")
    x = DistributedTensor("x", (1, 2, length), Partition((1, 1, workers)))
    pool = MaxPoolJacobian(x, Kernel(size, stride=stride, padding=padding))
    rng = np.random.default_rng(length)
    x0 = -(rng.permutation(2 * length).reshape(1, 2, length) + 1.0)  # all negative, no ties
    jacobian = pool.at(pool.window_operator(x.scatter(x0)))
    got = pool.y.gather(jacobian(x.scatter(x0)))
    want = torch.nn.functional.max_pool1d(torch.from_numpy(x0), size, stride, padding).numpy()
    assert np.array_equal(got, want)
    # the gradient goes where torch sends it
    t = torch.from_numpy(x0.copy()).requires_grad_()
    out = torch.nn.functional.max_pool1d(t, size, stride, padding)
    v = rng.integers(-9, 10, out.shape).astype(float)
    out.backward(torch.from_numpy(v))
    assert np.array_equal(x.gather(jacobian.H(pool.y.scatter(v))), t.grad.numpy())
    assert verify.exact_adjoint(jacobian)


def test_max_pooling_of_the_issue_example():
    x = DistributedTensor("x", (1, 1, 4), Partition((1, 1, 2)))
    pool = MaxPoolJacobian(x, Kernel(3, padding=1))
    x0 = -np.arange(1.0, 5.0).reshape(1, 1, 4)
    got = pool.y.gather(pool.at(pool.window_operator(x.scatter(x0)))(x.scatter(x0)))
    assert got.ravel().tolist() == [-1, -1, -2, -3]


# -- parameters that would be ignored ----------------------------------------------------------------
def test_scatter_parameters_refuses_a_bias_for_a_layer_without_one():
    x = DistributedTensor("x", (1, 2, 6), Partition((1, 1, 2)))
    conv = Convolution(x, 2, 3, bias=False)
    weights = np.ones(conv.weights.global_shape)
    with pytest.raises(LayerError, match="bias=False"):
        conv.scatter_parameters(weights, np.ones(2))
    assert set(conv.scatter_parameters(weights)) == set(conv.parameter_space.names)  # control
    affine = Affine(DistributedTensor("x", (1, 4), Partition((1, 2))), 3, bias=False)
    with pytest.raises(LayerError, match="bias=False"):
        affine.scatter_parameters(np.ones(affine.weights.global_shape), np.ones(3))
    assert issubclass(KernelWriteError, LinopError) and issubclass(NotLinearError, LinopError)
