"""More of the fuzz campaign (:mod:`verify.strategies_malformed`): local operators, layers,
``lift`` / ``prove_backward``, worker maps, the display, the accounting and the chooser,
states of other array libraries (torch, JAX), the JAX device executor, and the
torch.distributed executor on a one-process group.

Each strategy draws one :class:`~verify.strategies_malformed.Call`, with arguments half valid
and half :func:`~verify.strategies_malformed.junk`, and kernels that are honest half the time:
linear callables (plain or vectorized), dense and sparse matrices, and the kernels that must
never be proven or silently misapplied (affine maps, squares, ``floor``, a false
``vectorized=True``, a kernel writing into its argument). A call succeeds with the sparse
interpreter's result (checked by :func:`~verify.strategies_malformed.outcome`), or raises a
:class:`~linop.LinopError`; a proof of a map known not to be linear, or a state changed by a
call, is a :class:`~verify.strategies_malformed.FuzzFailure`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import numpy as np
from hypothesis import strategies as st

import linop
from linop import Block, DistributedTensor, Kernel, Partition, Space

from .strategies_malformed import (
    SMALL_INT,
    Call,
    FuzzFailure,
    check_against_matrix,
    junk,
    maybe,
    show_arguments,
)
from .strategies_malformed_layers import LAYER_ENTRY_POINTS

__all__ = ["SURFACE_ENTRY_POINTS", "FRAMEWORK_ENTRY_POINTS", "GROUP_ENTRY_POINTS"]

HELD_WEIGHTS = 10**6
"""The most weight entries the campaign draws for a layer; a larger valid layer (a drawn
channel count such as 2^31) is only built."""

_M = np.array([[1, 0, 2, 0], [0, -1, 0, 3]])  # a 2 x 4 integer kernel
_P = np.arange(16).reshape(4, 4) % 5  # square and not symmetric: a batched probe reads P^T


def _arg(draw: st.DrawFn, valid: st.SearchStrategy[Any], honest: bool) -> Any:
    """A valid value when the call is ``honest``, else valid or junk (half and half)."""
    return draw(valid if honest else maybe(valid))


def _linear(vectorized: bool) -> tuple[Callable[..., Any], Callable[..., Any]]:
    if vectorized:
        return (lambda x: x @ _M.T), (lambda y: y @ _M)
    return (lambda x: _M @ x), (lambda y: _M.T @ y)


_NOT_LINEAR: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "affine": (lambda x: _M @ x + 1, lambda y: _M.T @ y + 1),
    "square": (lambda x: (_M @ x) ** 2, lambda y: (_M.T @ y) ** 2),
    "floor": (lambda x: np.floor(_M @ x / 2), lambda y: np.floor(_M.T @ y / 2)),
    "false vectorized": (lambda x: _P @ x, lambda y: _P.T @ y),  # unbatched code claimed batched
    "writes its input": (lambda x: _M @ x.__imul__(1), lambda y: _M.T @ y),
    "saturating": (lambda x: np.clip(_M @ x / 100, -30, 30), lambda y: _M.T @ y / 100),
    "vanishing beyond 1e6": (lambda x: np.where(np.abs(_M @ x) > 1e6, 0, _M @ x), lambda y: _M.T @ y),
    "antilinear": (lambda x: _M @ np.conj(x), lambda y: _M.T @ y),
}
"""Kernels a proof must refuse (the false vectorized claim is made with ``vectorized=True``;
its batched probe reads another matrix than its single calls; the saturating, vanishing and
antilinear ones agree with their matrix on every real state of magnitude below 3000)."""

_M32 = _M.astype(np.float32) / 3
_FLOAT32 = (
    lambda x: (_M32 @ np.asarray(x).astype(np.float32)).astype(np.float64),
    lambda y: (_M32.T @ np.asarray(y).astype(np.float32)).astype(np.float64),
)
"""A linear map computed in float32 (returned in float64): a proof must accept it."""


def _refused(call: Callable[[], Any], what: str) -> Callable[[], Any]:
    """``call`` must raise (a LinopError, checked by ``outcome``); a result is a false proof."""

    def run() -> Any:
        result = call()
        if isinstance(result, linop.LinearOperator):
            result.to_sparse()  # the probe and its linearity check
        if bool(result) if hasattr(result, "passed") else True:
            raise FuzzFailure(f"a kernel that is {what} was accepted: {result!r}")
        return result

    return run


@st.composite
def _local_operators(draw: st.DrawFn) -> Call:
    """``local_operator`` with matrices, honest callables and kernels that are not linear."""
    space = Space([Block("x", (4,)), Block("z", (2,))])
    honest = draw(st.booleans())
    inputs = _arg(draw, st.sampled_from(["x", ("x",)]), honest)
    outputs = _arg(draw, st.sampled_from([("y", (2,)), ("y", 2), {"y": (2,)}, Block("y", (2,))]), honest)
    kind = draw(st.sampled_from(["dense", "sparse", "callables", "vectorized", "not linear", "junk"]))
    if kind in ("dense", "sparse"):
        import scipy.sparse as sp

        kernel = _M if kind == "dense" else sp.csr_array(_M)
        return Call(
            "local_operator",
            lambda: linop.local_operator(space, inputs, outputs, kernel),
            show_arguments(inputs, outputs, kind),
        )
    if kind == "junk":
        kernel, forward, adjoint = draw(junk()), draw(maybe(st.just(np.sum))), draw(junk())
        return Call(
            "local_operator",
            lambda: linop.local_operator(space, inputs, outputs, kernel, forward=forward, adjoint=adjoint),
            show_arguments(inputs, outputs, kernel, forward, adjoint),
        )
    if kind == "not linear":
        what = draw(st.sampled_from(sorted(_NOT_LINEAR)))
        forward, adjoint = _NOT_LINEAR[what]
        vectorized = what == "false vectorized"

        produced = ("y", (4,)) if vectorized else ("y", (2,))

        def build() -> Any:
            return linop.local_operator(
                space, "x", produced, forward=forward, adjoint=adjoint, vectorized=vectorized
            )

        return Call("local_operator (not linear)", _refused(build, what), what)
    vectorized = kind == "vectorized"
    forward, adjoint = _linear(vectorized)
    return Call(
        "local_operator",
        lambda: linop.local_operator(
            space, inputs, outputs, forward=forward, adjoint=adjoint, vectorized=vectorized
        ),
        show_arguments(inputs, outputs, kind),
    )


@st.composite
def _layers(draw: st.DrawFn) -> Call:
    """The layers' constructors and operators with malformed channels, kernels and weights."""
    from linop.layers import Affine, AveragePool, Convolution, MaxPoolJacobian

    workers = draw(st.sampled_from([1, 2, 3]))
    honest = draw(st.booleans())
    x = DistributedTensor("x", (1, 2, 6), Partition((1, 1, workers)))
    kernel = _arg(draw, st.sampled_from([2, 3, Kernel(3, padding=1), Kernel(2, stride=2)]), honest)
    kind = draw(st.sampled_from(["conv", "affine", "average", "max"]))
    rng = np.random.default_rng(draw(st.integers(0, 9)))
    if kind == "conv":
        channels = _arg(draw, st.sampled_from([1, 2]), honest)
        bias = draw(st.booleans())

        def conv() -> Any:
            layer = Convolution(x, channels, kernel, bias=bias)
            if math.prod(layer.weights.global_shape) > HELD_WEIGHTS:  # a valid, huge layer (2^31
                return layer  # channels): building it is the call; no campaign holds its weights
            weights = draw_weights(layer.weights.global_shape)
            layer.scatter_parameters(weights, draw_bias(layer))
            return layer.input_operator(weights)

        weights_kind = "ok" if honest else draw(st.sampled_from(["ok", "junk", "strings"]))

        def draw_weights(shape: tuple[int, ...]) -> Any:
            if weights_kind == "ok":
                return rng.integers(-3, 4, shape)
            return np.full(shape, "w") if weights_kind == "strings" else junk_weights

        junk_weights = draw(junk())
        junk_bias = _arg(draw, st.just(np.ones(2)), honest)

        def draw_bias(layer: Any) -> Any:
            return None if layer.bias is None and draw_none else junk_bias

        draw_none = honest or draw(st.booleans())
        return Call("Convolution", conv, show_arguments(channels, kernel, bias=bias, weights=weights_kind))
    if kind == "affine":
        y = DistributedTensor("x", (1, 4), Partition((1, workers if workers != 3 else 1)))
        features = _arg(draw, st.just(3), honest)
        weights = _arg(draw, st.just(rng.integers(-3, 4, (3, 4))), honest)

        def affine() -> Any:
            return Affine(y, features).input_operator(weights)

        return Call("Affine", affine, show_arguments(features, weights))
    if kind == "average":
        return Call("AveragePool", lambda: AveragePool(x, kernel).operator, show_arguments(kernel))
    x0 = -rng.permutation(12).reshape(1, 2, 6).astype(float) - 1  # negative: padding must not win

    def maximum() -> Any:
        pool = MaxPoolJacobian(x, kernel)
        jacobian = pool.at(pool.window_operator(x.scatter(x0)))
        got = pool.y.gather(jacobian(x.scatter(x0)))
        resolved: Any = pool.kernel
        size, stride, padding = resolved.size[2], resolved.stride[2], resolved.padding[2]
        padded = np.pad(x0, [(0, 0), (0, 0), (padding, padding)], constant_values=-np.inf)
        windows = np.lib.stride_tricks.sliding_window_view(padded, size, axis=2)[:, :, ::stride]
        if not np.array_equal(got, windows.max(axis=-1)):
            raise FuzzFailure(f"max pooling {got.tolist()} differs from the reference")
        return jacobian

    return Call("MaxPoolJacobian", maximum, show_arguments(kernel))


@st.composite
def _lifts(draw: st.DrawFn) -> Call:
    """``lift`` / ``prove_backward`` on linear maps, maps that are not, and malformed options."""
    from verify.lift import prove_backward

    honest = draw(st.booleans())
    domain = _arg(draw, st.sampled_from([{"x": (4,)}, {"x": (2, 2)}, {}]), honest)
    batch = _arg(draw, st.sampled_from([1, 3, 256]), honest)
    kind = draw(st.sampled_from(["linear", "linear", "not linear", "wrong adjoint", "float32"]))
    if kind == "float32":

        def computed_in_float32() -> Any:
            proof = prove_backward(*_FLOAT32[:1], {"x": (4,)}, {"y": (2,)}, adjoint=_FLOAT32[1])
            if not proof:
                raise FuzzFailure(f"a linear map computed in float32 was refuted: {proof!r}")
            return proof

        return Call("prove_backward (float32)", computed_in_float32, kind)
    if kind == "not linear":
        what = draw(
            st.sampled_from(
                [
                    "affine",
                    "square",
                    "floor",
                    "writes its input",
                    "saturating",
                    "vanishing beyond 1e6",
                    "antilinear",
                ]
            )
        )
        forward, adjoint = _NOT_LINEAR[what]
        call = _refused(lambda: prove_backward(forward, {"x": (4,)}, {"y": (2,)}, adjoint=adjoint), what)
        return Call("prove_backward (not linear)", call, what)

    def flip(x: np.ndarray) -> np.ndarray:
        return x[::-1].copy()

    adjoint = flip if kind == "linear" else (lambda y: y * 1)

    def run() -> Any:
        proof = prove_backward(flip, domain, domain, adjoint=adjoint, batch=batch)
        if kind == "wrong adjoint" and proof and np.prod(next(iter(domain.values()), (1,))) > 1:
            raise FuzzFailure(f"a wrong adjoint was proven: {proof!r}")
        if kind == "linear" and not proof:
            raise FuzzFailure(f"a true adjoint was refuted: {proof!r}")
        return proof

    return Call("prove_backward", run, show_arguments(domain, batch=batch, kind=kind))


@st.composite
def _worker_maps(draw: st.DrawFn) -> Call:
    from linop.program import WorkerMap

    kind = draw(st.sampled_from(["WorkerMap", "round_robin", "blocked", "array", "range"]))
    if kind == "range":  # the identity of any length: described, never listed
        count = draw(st.sampled_from([0, 3, 1 << 24, 1 << 30]))

        def identity() -> Any:
            made = WorkerMap(range(count))
            if len(made) != count or (count and made.rank_of(count - 1) != count - 1):
                raise FuzzFailure(f"WorkerMap(range({count})) is {made!r}")
            return made

        return Call("WorkerMap(range)", identity, show_arguments(count))
    if kind == "WorkerMap":
        ranks = draw(maybe(st.lists(SMALL_INT, max_size=4)))
        return Call("WorkerMap", lambda: WorkerMap(ranks), show_arguments(ranks))
    if kind == "array":
        ranks = draw(st.sampled_from([np.array([0, 1, 1]), np.array([[0]]), np.array([0.5]), np.array([-1])]))

        def of() -> Any:
            made = WorkerMap.of(ranks)
            if made != WorkerMap([int(r) for r in ranks]):
                raise FuzzFailure(f"WorkerMap.of({ranks!r}) is {made!r}")
            return made

        return Call("WorkerMap.of(array)", of, show_arguments(ranks))
    workers, ranks = draw(maybe(SMALL_INT)), draw(maybe(SMALL_INT))
    build = getattr(WorkerMap, kind)

    def made() -> Any:
        result = build(workers, ranks)
        probes = {w for w in (0, workers // 2, workers - 1) if 0 <= w < workers}  # O(1), not a listing
        if len(result) != workers or any(not 0 <= result.rank_of(w) < ranks for w in probes):
            raise FuzzFailure(f"WorkerMap.{kind}({workers}, {ranks}) is {result!r}")
        return result

    return Call(f"WorkerMap.{kind}", made, show_arguments(workers, ranks))


_TEXT_RUN = re.compile(r"\\text(?:tt)?\{([^{}]*)\}")


@st.composite
def _displays(draw: st.DrawFn) -> Call:
    """The LaTeX displays: every text run free of characters MathJax would show as macros."""
    from linop import display

    name = draw(st.text(alphabet="ab_{}#%&$^~\\ 1[]", min_size=1, max_size=6))
    kind = draw(st.sampled_from(["operator", "state", "text", "show_state junk"]))

    def checked(latex: str) -> str:
        for run in _TEXT_RUN.findall(latex):
            if set(run) & set("\\_{}#%&$^~"):
                raise FuzzFailure(f"a text run keeps a special character: {run!r} in {latex!r}")
        return latex

    if kind == "operator":

        def latex() -> str:  # "zz" is outside the names' alphabet: no clash
            space = Space([Block(name, (2,)), Block("zz", (2,))])
            return checked(display.operator_latex(linop.Copy(space[name], space["zz"])))

        return Call("operator_latex", latex, show_arguments(name))
    if kind == "state":
        return Call(
            "show_state",
            lambda: checked(display.show_state({name: np.arange(2)})._repr_latex_()),
            show_arguments(name),
        )
    if kind == "text":
        return Call(
            "tex_text",
            lambda: checked(display.tex_text(name) + display.tex_words(name)),
            show_arguments(name),
        )
    value = draw(junk())
    return Call("show_state", lambda: display.show_state(value), show_arguments(value))


@st.composite
def _costs(draw: st.DrawFn) -> Call:
    from linop.accounting import CostModel, account
    from linop.algorithms.chooser import choose

    kind = draw(st.sampled_from(["CostModel", "choose", "account"]))
    if kind == "CostModel":
        alpha, beta = draw(maybe(st.just(1e-6))), draw(maybe(st.just(1e-9)))
        return Call("CostModel", lambda: CostModel(alpha, beta), show_arguments(alpha, beta))
    if kind == "choose":
        honest = draw(st.booleans())
        size = _arg(draw, st.sampled_from([2, 4]), honest)
        nbytes = _arg(draw, st.sampled_from([0, 8, 1 << 12]), honest)
        itemsize = _arg(draw, st.sampled_from([4, 8]), honest)
        model = _arg(draw, st.just(CostModel(1e-6, 1e-9)), honest)
        collective = _arg(draw, st.sampled_from(["allreduce", "broadcast"]), honest)
        return Call(
            "choose",
            lambda: choose(collective, size, nbytes, model, itemsize=itemsize),
            show_arguments(collective, size, nbytes, model, itemsize=itemsize),
        )
    space = Space([Block("a", (2,)), Block("b", (2,), worker=1)])
    op = draw(maybe(st.just(linop.SendRecv(space["a"], space["b"]))))
    itemsize = draw(maybe(st.sampled_from([4, 8])))
    return Call("account", lambda: account(op, itemsize=itemsize), show_arguments(op, itemsize=itemsize))


SURFACE_ENTRY_POINTS: dict[str, Callable[[], st.SearchStrategy[Call]]] = {
    "local operators": _local_operators,
    "layers": _layers,
    **LAYER_ENTRY_POINTS,  # unbalanced channel and feature shares
    "lift / prove_backward": _lifts,
    "worker maps": _worker_maps,
    "display": _displays,
    "accounting and chooser": _costs,
}
"""The strategies of this module that need no other array library."""


# -- states of other array libraries ------------------------------------------------------------
def _framework_state(draw: st.DrawFn, library: str, values: np.ndarray) -> tuple[Any, str]:
    """A state block of ``library`` holding ``values``, in some awkward form."""
    if library == "torch":
        import torch

        form = draw(
            st.sampled_from(
                [
                    "plain",
                    "requires_grad",
                    "non-contiguous",
                    "stride 0",
                    "float16",
                    "bfloat16",
                    "int",
                    "numpy",
                ]
            )
        )
        tensor = torch.from_numpy(values.copy())
        if form == "requires_grad":
            return tensor.requires_grad_(), form
        if form == "non-contiguous":
            return torch.from_numpy(np.repeat(values, 2))[::2], form
        if form == "stride 0":
            return torch.tensor([float(values[0])]).expand(values.size), form
        if form in ("float16", "bfloat16"):
            return tensor.to(getattr(torch, form)), form
        if form == "int":
            return tensor.to(torch.int64), form
        return (values.copy() if form == "numpy" else tensor), form
    import jax.numpy as jnp

    form = draw(st.sampled_from(["plain", "float16", "int", "numpy"]))
    if form == "numpy":
        return values.copy(), form
    array = jnp.asarray(values)
    return (
        array.astype(jnp.float16)
        if form == "float16"
        else array.astype(jnp.int32)
        if form == "int"
        else array
    ), form


def _as_numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):
        value = value.detach().float() if str(value.dtype) == "torch.bfloat16" else value.detach()
        return value.numpy()
    return np.asarray(value)


@st.composite
def _framework_applications(draw: st.DrawFn, library: str) -> Call:
    """An operator applied to a state of ``library`` arrays (some forms awkward, some mixed
    with numpy), in place or not: the sparse interpreter's result or a LinopError."""
    space = Space([Block("a", (4,)), Block("b", (4,))])
    op = draw(
        st.sampled_from(
            [
                linop.Move(space["a"][0:2], space["b"][2:4]),
                linop.Add(space["a"], space["b"]),
                linop.Identity(space),
                2 * linop.Copy(space["a"][1:3], space["b"][0:2]),
            ]
        )
    )
    values = {name: np.arange(4.0) + 4 * i for i, name in enumerate(space.names)}
    state, forms = {}, []
    for name in space.names:
        state[name], form = _framework_state(draw, library, values[name])
        forms.append(form)
    inplace = draw(st.booleans())

    def run() -> Any:
        before = {name: _as_numpy(v).copy() for name, v in state.items()}
        result = op.apply(state, inplace=inplace)
        reference = {name: before[name].astype(np.float64) for name in space.names}
        got = {name: _as_numpy(result[name]).astype(np.float64) for name in op.range.names}
        check_against_matrix(op, reference, got, np.float16 if any("16" in f for f in forms) else None)
        if not inplace:
            for name, value in state.items():
                if not np.array_equal(_as_numpy(value), before[name]):
                    raise FuzzFailure(f"block {name!r} of the caller changed ({forms})")
        return result

    return Call(f"apply ({library} states)", run, show_arguments(op, forms, inplace=inplace))


def _device_trees() -> list[linop.LinearOperator]:
    """Small distributed trees (workers 0 and 1) for the JAX device executor."""
    space = Space([Block("a", (4,), 0), Block("b", (4,), 1)])
    tensor = DistributedTensor("t", (6,), Partition((2,)))
    halo = linop.HaloExchange(linop.halo_geometry(tensor, Kernel(3, padding=1)))
    return [
        linop.SendRecv(space["a"][0:2], space["b"][2:4]),
        linop.Move(space["a"][1:3], space["b"][0:2]) + linop.Identity(space),
        halo,
        halo.H,
    ]


@st.composite
def _device_executions(draw: st.DrawFn) -> Call:
    """A tree compiled for a one-device JAX mesh (both workers on it) with arguments half
    valid: the mesh, ``axes``, ``workers``; then applied to a state of numpy or JAX blocks, some
    missing, extra, misshapen or of a non-numeric dtype. The sparse interpreter's result, or a
    LinopError."""
    import jax
    from jax.sharding import Mesh

    from linop.frameworks.jax_sharded import sharded

    op = draw(st.sampled_from(_device_trees()))
    honest = draw(st.booleans())
    mesh = _arg(draw, st.just(Mesh(np.array(jax.devices()[:1]), ("d",))), honest)
    axes = _arg(draw, st.sampled_from([None, ("d",), ["d"]]), honest)
    workers = _arg(draw, st.sampled_from([{0: 0, 1: 0}, [0, 0], (0, 0)]), honest)
    values = {b.name: (np.arange(b.size) + 10 * i).reshape(b.shape) for i, b in enumerate(op.domain)}
    state: dict[str, Any] = {}
    forms = []
    for name, array in values.items():
        form = draw(
            st.sampled_from(
                ["numpy int", "numpy float", "jax", "junk"] if not honest else ["numpy int", "jax"]
            )
        )
        forms.append(form)
        if form == "junk":
            state[name] = draw(junk())
        elif form == "jax":
            state[name] = jax.numpy.asarray(array.astype(np.float32))
        else:
            state[name] = array.astype(np.int64 if form == "numpy int" else np.float64)
    if not honest and draw(st.booleans()):
        state[draw(st.sampled_from(["extra", *values]))] = draw(junk())

    def run() -> Any:
        before = {n: np.array(v) for n, v in state.items() if isinstance(v, np.ndarray)}
        executor = sharded(op, mesh, axes=axes, workers=workers)
        result = executor.blocks(state)
        got = {name: np.asarray(result[name]).astype(np.float64) for name in op.range.names}
        reference = {name: np.asarray(state[name]).astype(np.float64) for name in op.domain.names}
        check_against_matrix(op, reference, got, np.float32)
        for name, array in before.items():
            if not np.array_equal(state[name], array):
                raise FuzzFailure(f"block {name!r} of the caller changed")
        return result

    return Call("JAX device executor", run, show_arguments(op, mesh, forms, axes=axes, workers=workers))


@st.composite
def _group_executions(draw: st.DrawFn) -> Call:
    """A tree applied by the torch.distributed executor on a one-process group (the caller
    initializes it: ``torch.distributed`` with world size 1), both workers mapped onto rank 0,
    with arguments half valid: ``group``, ``mapping``, ``timeout``, ``inplace``, and a state of
    torch or numpy blocks, some missing, extra, misshapen or junk. The sparse interpreter's
    result, or a LinopError."""
    import torch

    from linop.backends import torch_distributed as td

    op = draw(st.sampled_from(_device_trees()))
    honest = draw(st.booleans())
    group = _arg(draw, st.sampled_from([None, True]), honest)
    mapping = _arg(draw, st.sampled_from([[0, 0], {0: 0, 1: 0}, (0, 0)]), honest)
    timeout = _arg(draw, st.sampled_from([None, 30.0, 60]), honest)
    inplace = draw(st.booleans())
    values = {b.name: (np.arange(b.size) + 10 * i).reshape(b.shape) for i, b in enumerate(op.domain)}
    state: dict[str, Any] = {}
    forms = []
    for name, array in values.items():
        form = draw(st.sampled_from(["torch int", "torch float", "numpy"] + ([] if honest else ["junk"])))
        forms.append(form)
        if form == "junk":
            state[name] = draw(junk())
        elif form == "numpy":
            state[name] = array.astype(np.float64)
        else:
            state[name] = torch.from_numpy(array.astype(np.int64 if form == "torch int" else np.float64))
    if not honest and draw(st.booleans()):
        state[draw(st.sampled_from(["extra", *values]))] = draw(junk())

    def run() -> Any:
        before = {n: _as_numpy(v).copy() for n, v in state.items() if hasattr(v, "shape")}
        result = td.apply(op, state, group=group, mapping=mapping, timeout=timeout, inplace=inplace)
        reference = {name: before[name].astype(np.float64) for name in op.domain.names}
        got = {name: _as_numpy(result[name]).astype(np.float64) for name in op.range.names}
        check_against_matrix(op, reference, got, None)
        if not inplace:
            for name, array in before.items():
                if not np.array_equal(_as_numpy(state[name]), array):
                    raise FuzzFailure(f"block {name!r} of the caller changed")
        return result

    arguments = show_arguments(op, forms, group=group, mapping=mapping, timeout=timeout, inplace=inplace)
    return Call("torch.distributed executor", run, arguments)


FRAMEWORK_ENTRY_POINTS: dict[str, Callable[[], st.SearchStrategy[Call]]] = {
    "torch states": lambda: _framework_applications("torch"),
    "JAX states": lambda: _framework_applications("jax"),
    "JAX device executor": _device_executions,
}
GROUP_ENTRY_POINTS: dict[str, Callable[[], st.SearchStrategy[Call]]] = {
    "torch.distributed executor": _group_executions,
}
"""Strategies that need a torch.distributed process group (the caller initializes one)."""
"""Strategies that import torch or JAX (slow to import: a test of their own)."""
