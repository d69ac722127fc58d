"""The fuzz campaign's layers with unbalanced channel and feature shares
(:mod:`verify.strategies_malformed`).

Each strategy draws one :class:`~verify.strategies_malformed.Call` building a
:class:`~linop.layers.Convolution`, :class:`~linop.layers.Affine` or pooling layer whose
channels (features) do not divide over their workers: the balanced split, explicit uneven or
empty shares of the input (``sizes``) and of the output (``out_sizes``), or, half the time,
malformed shares, weights cut by the wrong shares, and junk. A call that succeeds must equal
the same layer on one worker exactly (integer-valued data: forward, input gradient, and the parameter
tree with its bias and weight gradient), else it is a
:class:`~verify.strategies_malformed.FuzzFailure` (a wrong answer); a call that fails must raise
a :class:`~linop.LinopError`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from hypothesis import strategies as st

from linop import DistributedTensor, Kernel, Partition, balanced_sizes

from .strategies_malformed import Call, FuzzFailure, junk, show_arguments

__all__ = ["LAYER_ENTRY_POINTS"]


@st.composite
def _shares(draw: st.DrawFn, total: int, parts: int) -> tuple[int, ...]:
    """Any decomposition of ``total`` into ``parts`` non-negative shares (empty ones included)."""
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=parts - 1, max_size=parts - 1)))
    bounds = [0, *cuts, total]
    return tuple(b - a for a, b in zip(bounds, bounds[1:]))


def _near_miss(total: int, parts: int) -> st.SearchStrategy[Any]:
    """Shares that are almost right: one too many or too few, a wrong sum, a negative entry,
    floats, bools, a string, or junk."""
    return st.one_of(
        st.just((total,) * (parts + 1)),
        st.just((total + 1,) + (0,) * (parts - 1)),
        st.just((total + 1, -1) + (0,) * (parts - 2)) if parts >= 2 else st.just((-1,)),
        st.just(tuple(float(v) + 0.5 for v in (total,) + (0,) * (parts - 1))),
        st.just((True,) * parts),
        st.just("3"),
        junk(),
    )


def _sizes(draw: st.DrawFn, total: int, parts: int, honest: bool) -> Any:
    """None (the balanced split), explicit shares, or (dishonest) a near miss."""
    if honest or draw(st.booleans()):
        return draw(st.one_of(st.none(), _shares(total, parts)))
    return draw(_near_miss(total, parts))


def _ints(rng: np.random.Generator, low: int, high: int, shape: Any) -> np.ndarray:
    """Small integers as float64 (exact: every sum here is an integer far below 2^53), so that
    the interpreter skips the integer-overflow bound, which would cost a matrix per call."""
    return rng.integers(low, high, shape).astype(np.float64)


def _equal(what: str, got: np.ndarray, expected: np.ndarray) -> None:
    if got.shape != expected.shape or not np.array_equal(got, expected):
        raise FuzzFailure(f"{what}: {got.tolist()} differs from the single-process layer {expected.tolist()}")


def _only(tensor: DistributedTensor, state: dict[str, Any]) -> dict[str, Any]:
    return {name: state[name] for name in tensor.space.names}


@st.composite
def _convolutions(draw: st.DrawFn) -> Call:
    from linop.layers import Convolution

    honest = draw(st.booleans())
    c_in, c_out = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    p_ci, p_co, p_s = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 2))
    x_sizes = _sizes(draw, c_in, p_ci, honest)
    out_sizes = _sizes(draw, c_out, p_co, honest)
    kernel = draw(st.sampled_from([Kernel(3, padding=1), Kernel(2, stride=2), Kernel(1)]))
    bias = draw(st.booleans())
    wrong_cut = not honest and draw(st.booleans())  # weights cut by the balanced split
    rng = np.random.default_rng(draw(st.integers(0, 99)))
    length = 5

    def build() -> Any:
        sizes = () if x_sizes is None else ((1,), x_sizes, balanced_sizes(length, p_s))
        x = DistributedTensor("x", (1, c_in, length), Partition((1, p_ci, p_s)), sizes=sizes)
        workers = Partition((1, p_co, p_ci, p_s))
        layer = Convolution(x, c_out, kernel, workers=workers, out_sizes=out_sizes, bias=bias)
        single = Convolution(
            DistributedTensor("xs", x.global_shape, Partition((1, 1, 1))), c_out, kernel, bias=bias, name="ys"
        )
        data = _ints(rng, -3, 4, x.global_shape)
        w = _ints(rng, -2, 3, layer.weights.global_shape)
        forward = layer.input_operator(w)
        _equal(
            "convolution",
            layer.y.gather(forward(x.scatter(data))),
            single.y.gather(single.input_operator(w)(single.x.scatter(data))),
        )
        dy = _ints(rng, -3, 4, layer.y.global_shape)
        _equal(
            "convolution input gradient",
            x.gather(forward.H(layer.y.scatter(dy))),
            single.x.gather(single.input_operator(w).H(single.y.scatter(dy))),
        )
        b = _ints(rng, -2, 3, (c_out,)) if bias else None
        parameters = layer.parameter_operator(layer.window_operator(x.scatter(data)))
        singles = single.parameter_operator(single.window_operator(single.x.scatter(data)))
        if wrong_cut:
            balanced = DistributedTensor(
                layer.weights.name, layer.weights.global_shape, layer.weights.partition
            )
            state = {**layer.scatter_parameters(w, b), **balanced.scatter(w)}
        else:
            state = layer.scatter_parameters(w, b)
        _equal(
            "convolution with its parameters",
            layer.y.gather(parameters(state)),
            single.y.gather(singles(single.scatter_parameters(w, b))),
        )
        gradient, expected = parameters.H(layer.y.scatter(dy)), singles.H(single.y.scatter(dy))
        _equal(
            "convolution weight gradient",
            layer.weights.gather(_only(layer.weights, gradient)),
            single.weights.gather(_only(single.weights, expected)),
        )
        return forward

    shown = show_arguments(
        c_in, c_out, (p_co, p_ci, p_s), x_sizes, out_sizes, kernel, bias=bias, wrong_cut=wrong_cut
    )
    return Call("Convolution (unbalanced)", build, shown)


@st.composite
def _affines(draw: st.DrawFn) -> Call:
    from linop.layers import Affine

    honest = draw(st.booleans())
    f_in, f_out = draw(st.integers(1, 6)), draw(st.integers(1, 5))
    p_fi, p_fo = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    x_sizes = _sizes(draw, f_in, p_fi, honest)
    out_sizes = _sizes(draw, f_out, p_fo, honest)
    wrong_cut = not honest and draw(st.booleans())
    rng = np.random.default_rng(draw(st.integers(0, 99)))

    def build() -> Any:
        sizes = () if x_sizes is None else ((3,), x_sizes)
        x = DistributedTensor("x", (3, f_in), Partition((1, p_fi)), sizes=sizes)
        layer = Affine(x, f_out, workers=Partition((p_fo, p_fi)), out_sizes=out_sizes)
        data, w = _ints(rng, -3, 4, (3, f_in)), _ints(rng, -3, 4, (f_out, f_in))
        b, dy = _ints(rng, -3, 4, f_out), _ints(rng, -3, 4, (3, f_out))
        forward = layer.input_operator(w)
        _equal("affine", layer.y.gather(forward(x.scatter(data))), data @ w.T)
        _equal("affine input gradient", x.gather(forward.H(layer.y.scatter(dy))), dy @ w)
        parameters = layer.parameter_operator(layer.window_operator(x.scatter(data)))
        state = layer.scatter_parameters(w, b)
        if wrong_cut:
            state.update(DistributedTensor(layer.weights.name, w.shape, layer.weights.partition).scatter(w))
        _equal("affine with its parameters", layer.y.gather(parameters(state)), data @ w.T + b)
        gradient = parameters.H(layer.y.scatter(dy))
        _equal("affine weight gradient", layer.weights.gather(_only(layer.weights, gradient)), dy.T @ data)
        return forward

    shown = show_arguments(f_in, f_out, (p_fo, p_fi), x_sizes, out_sizes, wrong_cut=wrong_cut)
    return Call("Affine (unbalanced)", build, shown)


@st.composite
def _pools(draw: st.DrawFn) -> Call:
    from linop.layers import AveragePool, MaxPoolJacobian

    honest = draw(st.booleans())
    channels, p_c = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    x_sizes = _sizes(draw, channels, p_c, honest)
    kernel = draw(st.sampled_from([Kernel(2, stride=2), Kernel(3, padding=1)]))
    average = draw(st.booleans())
    rng = np.random.default_rng(draw(st.integers(0, 99)))

    def build() -> Any:
        sizes = () if x_sizes is None else ((1,), x_sizes, (3, 3))
        x = DistributedTensor("x", (1, channels, 6), Partition((1, p_c, 2)), sizes=sizes)
        single_x = DistributedTensor("xs", x.global_shape, Partition((1, 1, 1)))
        data = -rng.permutation(6 * channels).reshape(x.global_shape).astype(float) - 1  # no ties
        pool: AveragePool | MaxPoolJacobian
        single: AveragePool | MaxPoolJacobian
        if average:
            pool, single = AveragePool(x, kernel), AveragePool(single_x, kernel, name="ys")
            op, reference = pool.operator, single.operator
        else:
            jacobian = MaxPoolJacobian(x, kernel)
            single_jacobian = MaxPoolJacobian(single_x, kernel, name="ys")
            op = jacobian.at(jacobian.window_operator(x.scatter(data)))
            reference = single_jacobian.at(single_jacobian.window_operator(single_x.scatter(data)))
            pool, single = jacobian, single_jacobian
        if pool.y.sizes[1] != x.sizes[1]:
            raise FuzzFailure(f"pooling moved the channel shares {x.sizes[1]} to {pool.y.sizes[1]}")
        _equal(
            "pooling", pool.y.gather(op(x.scatter(data))), single.y.gather(reference(single_x.scatter(data)))
        )
        return op

    return Call(
        "pooling (unbalanced)", build, show_arguments(channels, p_c, x_sizes, kernel, average=average)
    )


@st.composite
def _unbalanced_layers(draw: st.DrawFn) -> Call:
    """One of the three, as one group of the campaign (``st.one_of`` would flatten them into
    three groups, each as frequent as any other entry point)."""
    return draw(draw(st.sampled_from([_convolutions(), _affines(), _pools()])))


LAYER_ENTRY_POINTS: dict[str, Callable[[], st.SearchStrategy[Call]]] = {
    "unbalanced layers": _unbalanced_layers,
}
"""The strategy of the layers with unbalanced shares (numpy only): one group of the campaign,
its calls named by the layer (convolution, affine, pooling)."""
