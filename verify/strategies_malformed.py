"""Hypothesis strategies of malformed arguments for linop's public constructors and entry points.

The fuzz campaign of the reliability review: every public constructor (blocks, spaces, regions,
the primitives and movements, the algebra, partitions, distributed tensors, kernels, halo
geometry and exchanges, collectives, repartitions) and every entry point (``op(state)``,
``apply`` with ``inplace``/``dtype``, ``to_sparse``, ``aslinearoperator``, the verify checks)
is called with arguments drawn half from valid values and half from :func:`junk`: wrong
types, negative, huge, NaN and infinite numbers, bools, strings, arrays, ``None``.

:func:`calls` draws one :class:`Call`; :func:`outcome` runs it and returns ``"ok"`` (it
succeeded, and its result equals the sparse interpreter's) or ``"typed"`` (it raised a
:class:`~linop.LinopError`). Anything else -- a builtin exception from inside, or a result
that differs from the matrix -- raises :class:`FuzzFailure` naming the call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from typing import Any

import numpy as np
from hypothesis import strategies as st

import linop
from linop import LinearOperator, LinopError, Space
from linop.backends.sparse.scipy_interop import aslinearoperator

from . import strategies as lst

__all__ = [
    "Call",
    "FuzzFailure",
    "check_against_matrix",
    "junk",
    "maybe",
    "calls",
    "outcome",
    "show_arguments",
    "ENTRY_POINTS",
]


class FuzzFailure(AssertionError):  # noqa: N818 - a failed check, like VerificationError
    """A call gave an untyped error, or a result different from the sparse interpreter's."""


@dataclass(frozen=True)
class Call:
    """One call of a public entry point: its name, the call itself and a readable description."""

    entry: str
    function: Callable[[], Any]
    description: str

    def __repr__(self) -> str:
        return f"{self.entry}: {self.description}"


class _Opaque:
    """An object of no known type."""

    def __repr__(self) -> str:
        return "<opaque>"


@functools.cache
def junk() -> st.SearchStrategy[Any]:
    """Values of the wrong type or out of range for any linop argument (one strategy, built once)."""
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.sampled_from([np.True_, np.False_]),
        st.integers(-3, -1),
        st.sampled_from([2**31, 2**40, 2**63, 2**64, -(2**63) - 1, 10**30]),
        st.floats(allow_nan=True, allow_infinity=True),
        st.sampled_from([float("nan"), float("inf"), -float("inf"), 1.5, -0.0]),
        st.complex_numbers(max_magnitude=4),
        st.text(max_size=3),
        st.binary(max_size=2),
        st.sampled_from(
            [Fraction(1, 3), Decimal("1.5"), Decimal("nan"), _Opaque(), object, ..., slice(1, 2)]
        ),
        st.sampled_from([np.float64("nan"), np.int8(-1), np.uint64(2**63), np.datetime64(1, "s")]),
    )
    containers = st.one_of(
        st.lists(scalars, max_size=3),
        st.tuples(scalars, scalars),
        st.lists(st.lists(st.integers(0, 3), max_size=3), min_size=2, max_size=3),  # ragged
        st.sampled_from(
            [
                np.array([1, 2]),
                np.zeros((2, 2)),
                np.array(["a", "b"]),
                np.array([True]),
                np.array(3),
                np.array([np.nan]),
                {},
                {"a": 1},
                set(),
            ]
        ),
    )
    return st.one_of(scalars, containers)


def maybe(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """A valid value or junk, half and half."""
    return st.one_of(valid, junk())


def show_arguments(*args: Any, **kwargs: Any) -> str:
    """The arguments of a call, each shortened, as a readable description."""
    parts = [_short(repr(a)) for a in args] + [f"{k}={_short(repr(v))}" for k, v in kwargs.items()]
    return ", ".join(parts)


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _call(entry: str, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Call:
    return Call(entry, lambda: function(*args, **kwargs), show_arguments(*args, **kwargs))


SMALL_INT = st.integers(0, 4)
SHAPE = st.tuples(SMALL_INT) | st.tuples(SMALL_INT, SMALL_INT) | st.just(())
NAME = st.sampled_from(["a", "b", "x1", "y"])


# -- constructors -------------------------------------------------------------------------------
@st.composite
def _blocks(draw: st.DrawFn) -> Call:
    args = [draw(maybe(NAME)), draw(maybe(SHAPE)), draw(maybe(SMALL_INT))]
    return _call("Block", linop.Block, *args[: draw(st.integers(2, 3))])


@st.composite
def _spaces(draw: st.DrawFn) -> Call:
    items = draw(st.lists(maybe(st.tuples(NAME, SHAPE)), max_size=3))
    return _call("Space", linop.Space, draw(st.one_of(st.just(items), junk())))


@st.composite
def _indexing(draw: st.DrawFn) -> Call:
    space = draw(lst.spaces())
    name = draw(maybe(st.sampled_from(space.names) if space.names else NAME))
    index = draw(
        st.one_of(
            junk(),
            st.integers(-6, 6),
            st.builds(slice, maybe(st.integers(-6, 6)), maybe(st.integers(-6, 6)), maybe(st.just(1))),
            st.tuples(st.integers(-3, 3), st.builds(slice, st.integers(-3, 6), st.none())),
            st.just((Ellipsis, 0)),
            st.just((Ellipsis, Ellipsis)),
        )
    )
    return Call("space[name][index]", lambda: space[name][index], show_arguments(space, name, index))


@st.composite
def _regions(draw: st.DrawFn) -> Call:
    space = draw(lst.spaces())
    name = draw(maybe(st.sampled_from(space.names) if space.names else NAME))
    corner = st.tuples(st.integers(-2, 6)) | st.tuples(st.integers(-2, 6), st.integers(-2, 6))
    args = [draw(maybe(st.just(space))), name, draw(maybe(corner)), draw(maybe(corner))]
    if draw(st.booleans()):
        args.append(draw(maybe(st.tuples(st.integers(-1, 2)))))
    return _call("Region", linop.Region, *args)


@st.composite
def _primitives(draw: st.DrawFn) -> Call:
    space = draw(lst.spaces())
    region = lst.regions(space) if len(space) else st.nothing()
    kind = draw(
        st.sampled_from(["Allocate", "Deallocate", "Clear", "Add", "Copy", "CopyAdjoint", "Move", "SendRecv"])
    )
    node = getattr(linop, kind)
    if kind == "Allocate":
        block = st.builds(linop.Block, NAME, SHAPE)
        return _call(kind, node, draw(maybe(st.just(space))), draw(maybe(block)))
    if kind == "Deallocate":
        return _call(kind, node, draw(maybe(st.just(space))), draw(maybe(NAME)))
    if kind == "Clear":
        return _call(kind, node, draw(maybe(region)))
    target = st.one_of(region, st.builds(linop.Block, st.sampled_from(["new", "z"]), SHAPE, SMALL_INT))
    return _call(kind, node, draw(maybe(region)), draw(maybe(target)))


@st.composite
def _algebra(draw: st.DrawFn) -> Call:
    space = draw(lst.spaces())
    op = draw(lst.operators(space, max_leaves=3))
    other = draw(maybe(st.one_of(st.just(op), st.just(linop.Identity(space)))))
    alpha = draw(maybe(lst.scalars()))
    kind = draw(
        st.sampled_from(["@", "r@", "+", "-", "*", "r*", "Identity", "Zero", "Composition", "Sum", "Scaled"])
    )
    actions: dict[str, Callable[[], Any]] = {
        "@": lambda: op @ other,
        "r@": lambda: other @ op,
        "+": lambda: op + other,
        "-": lambda: op - other,
        "*": lambda: op * alpha,
        "r*": lambda: alpha * op,
        "Identity": lambda: linop.Identity(draw_space),
        "Zero": lambda: linop.Zero(draw_space, draw_other),
        "Composition": lambda: linop.Composition(items),
        "Sum": lambda: linop.Sum(items),
        "Scaled": lambda: linop.Scaled(alpha, other),
    }
    draw_space = draw(maybe(st.just(space)))
    draw_other = draw(maybe(st.just(space)))
    items = draw(st.one_of(st.tuples(st.just(op), maybe(st.just(op))), junk()))
    return Call(kind, actions[kind], show_arguments(op, other, alpha, draw_space, items))


@st.composite
def _partitions(draw: st.DrawFn) -> Call:
    shape = draw(maybe(st.tuples(st.integers(1, 3)) | st.tuples(st.integers(1, 2), st.integers(1, 2))))
    if draw(st.booleans()):
        return _call("Partition.grid", linop.Partition.grid, shape, first=draw(maybe(SMALL_INT)))
    workers = draw(maybe(st.lists(st.integers(0, 5), max_size=4).map(tuple)))
    return _call("Partition", linop.Partition, shape, workers)


@st.composite
def _tensors(draw: st.DrawFn) -> Call:
    partition = draw(maybe(st.builds(linop.Partition, st.tuples(st.integers(1, 3)))))
    shape = draw(maybe(st.tuples(st.integers(0, 6))))
    sizes = draw(maybe(st.tuples(st.lists(st.integers(-1, 4), max_size=3).map(tuple))))
    args = [draw(maybe(NAME)), shape, partition]
    if draw(st.booleans()):
        args.append(sizes)
    return _call("DistributedTensor", linop.DistributedTensor, *args)


@st.composite
def _kernels(draw: st.DrawFn) -> Call:
    fields = {
        "size": draw(maybe(st.integers(1, 3))),
        "stride": draw(maybe(st.integers(1, 2))),
        "padding": draw(maybe(st.integers(0, 3))),
        "dilation": draw(maybe(st.integers(1, 2))),
        "boundary": draw(maybe(st.sampled_from(linop.BOUNDARY_MODES))),
    }
    kept = {k: v for k, v in fields.items() if draw(st.booleans())}
    kernel = linop.Kernel(fields["size"], **{k: v for k, v in kept.items() if k != "size"})
    tensor = draw(
        maybe(
            st.builds(
                linop.DistributedTensor,
                st.just("x"),
                st.tuples(st.integers(0, 5)),
                st.builds(linop.Partition, st.tuples(st.integers(1, 3))),
            )
        )
    )
    variant = draw(maybe(st.sampled_from(["nested", "direct"])))

    def build() -> Any:
        geometry = linop.halo_geometry(tensor, kernel)
        return linop.HaloExchange(geometry, variant)

    return Call("halo_geometry/HaloExchange", build, show_arguments(tensor, kernel, variant))


@st.composite
def _collectives(draw: st.DrawFn) -> Call:
    tensor = linop.DistributedTensor("x", (4,), linop.Partition((2,)))
    partition = draw(maybe(st.just(linop.Partition((2,), (2, 3)))))
    name = draw(maybe(st.sampled_from(["y", "z"])))
    axes = draw(maybe(st.just((0,))))
    root = draw(maybe(st.just(linop.Block("r", (4,), 5))))
    other = draw(maybe(st.just(linop.DistributedTensor("w", (4,), linop.Partition((4,), (4, 5, 6, 7))))))
    kind = draw(
        st.sampled_from(
            [
                "Broadcast",
                "SumReduce",
                "AllReduce",
                "AllGather",
                "ReduceScatter",
                "Scatter",
                "Gather",
                "Repartition",
            ]
        )
    )
    source = draw(maybe(st.just(tensor)))
    builders: dict[str, Callable[[], Any]] = {
        "Broadcast": lambda: linop.Broadcast(source, partition, name),
        "SumReduce": lambda: linop.SumReduce(source, partition, name),
        "AllReduce": lambda: linop.AllReduce(source, axes),
        "AllGather": lambda: linop.AllGather(source, axes, name),
        "ReduceScatter": lambda: linop.ReduceScatter(source, axes, name),
        "Scatter": lambda: linop.Scatter(root, source),
        "Gather": lambda: linop.Gather(root, source),
        "Repartition": lambda: linop.Repartition(source, other),
    }
    return Call(kind, builders[kind], show_arguments(source, partition, name, axes, root, other))


@st.composite
def _methods(draw: st.DrawFn) -> Call:
    """Methods and helpers of spaces, partitions and tensors, and the halo helpers."""
    space = draw(lst.spaces())
    partition = linop.Partition((2, 2))
    tensor = linop.DistributedTensor("x", (4, 3), partition)
    a, b = draw(junk()), draw(maybe(SMALL_INT))
    kind = draw(
        st.sampled_from(
            [
                "Space.with_block",
                "Space.without",
                "Space.offset",
                "Space.flatten",
                "Space.unflatten",
                "Space.inner",
                "Space.check_state",
                "Partition.worker",
                "Partition.index",
                "Partition.subpartitions",
                "DistributedTensor.box",
                "DistributedTensor.region",
                "DistributedTensor.scatter",
                "DistributedTensor.gather",
                "balanced_sizes",
                "output_length",
                "reduction_groups",
                "gathered_layout",
                "broadcast_map",
                "halo_windows",
                "pad_shim",
            ]
        )
    )
    actions: dict[str, Callable[[], Any]] = {
        "Space.with_block": lambda: space.with_block(a),
        "Space.without": lambda: space.without(a),
        "Space.offset": lambda: space.offset(a),
        "Space.flatten": lambda: space.flatten(a),
        "Space.unflatten": lambda: space.unflatten(a),
        "Space.inner": lambda: space.inner(a, a),
        "Space.check_state": lambda: space.check_state(a),
        "Partition.worker": lambda: partition.worker(a),
        "Partition.index": lambda: partition.index(a),
        "Partition.subpartitions": lambda: partition.subpartitions(a),
        "DistributedTensor.box": lambda: tensor.box(a),
        "DistributedTensor.region": lambda: tensor.region((0, 0), a),
        "DistributedTensor.scatter": lambda: tensor.scatter(a),
        "DistributedTensor.gather": lambda: tensor.gather(a),
        "balanced_sizes": lambda: linop.balanced_sizes(a, b),
        "output_length": lambda: linop.output_length(a, b),
        "reduction_groups": lambda: linop.reduction_groups(partition, a),
        "gathered_layout": lambda: linop.gathered_layout(tensor, a, "y"),
        "broadcast_map": lambda: linop.broadcast_map(partition, a),
        "halo_windows": lambda: linop.halo_windows(tensor, a),
        "pad_shim": lambda: linop.pad_shim(a),
    }
    return Call(kind, actions[kind], show_arguments(space, a, b))


# -- entry points -------------------------------------------------------------------------------
_STATE_DTYPES: list[type | str] = [
    np.float64,
    np.float32,
    np.int64,
    np.int8,
    np.uint8,
    np.complex128,
    bool,
    "U1",
    "M8[s]",
    object,
]


@st.composite
def _bad_states(draw: st.DrawFn, space: Space) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for block in space:
        kind = draw(st.sampled_from(["valid", "dtype", "shape", "list", "junk", "missing", "big"]))
        if kind == "missing":
            continue
        if kind == "junk":
            state[block.name] = draw(junk())
        elif kind == "shape":
            state[block.name] = np.zeros((*block.shape, 2))
        elif kind == "list":
            state[block.name] = np.arange(block.size).reshape(block.shape).tolist()
        elif kind == "big":
            integer_types: list[type[np.integer[Any]]] = [np.uint8, np.int8, np.int64]
            big = draw(st.sampled_from(integer_types))
            info = np.iinfo(big)
            state[block.name] = np.full(block.shape, draw(st.sampled_from([info.max, info.min])), dtype=big)
        else:
            dtype = np.float64 if kind == "valid" else draw(st.sampled_from(_STATE_DTYPES))
            values = np.arange(block.size).reshape(block.shape) % 7 - 3
            state[block.name] = (
                values.astype(dtype) if np.dtype(dtype).kind not in "U" else values.astype(str)
            )
    if draw(st.booleans()) and draw(st.booleans()):
        state["extra"] = np.zeros(1)
    return state


@st.composite
def _applications(draw: st.DrawFn) -> Call:
    space = draw(lst.spaces(max_blocks=3))
    op = draw(lst.operators(space, max_leaves=3))
    state = draw(st.one_of(_bad_states(op.domain), lst.states(op.domain), junk()))
    inplace = draw(st.one_of(st.just(False), st.just(True)))
    dtype: Any = draw(
        st.one_of(st.none(), st.none(), st.sampled_from([*_STATE_DTYPES, "foo", 3]))
    )  # some invalid

    def apply() -> Any:
        arrays = (
            state
            if not inplace
            else {k: np.array(v) if isinstance(v, np.ndarray) else v for k, v in state.items()}
            if isinstance(state, dict)
            else state
        )
        before = _copy_state(arrays)
        result = op.apply(arrays, inplace=inplace, dtype=dtype)
        if not inplace:
            _check_unchanged(arrays, before)
        check_against_matrix(op, before, result, dtype)
        return result

    return Call("apply", apply, show_arguments(op, state, inplace=inplace, dtype=dtype))


@st.composite
def _matrices(draw: st.DrawFn) -> Call:
    op = draw(lst.operators(draw(lst.spaces()), max_leaves=3))
    dtype = draw(
        maybe(st.sampled_from([None, np.float64, np.int64, np.int8, np.complex128, np.float16, bool, "foo"]))
    )
    return _call("to_sparse", op.to_sparse, dtype)


@st.composite
def _scipy(draw: st.DrawFn) -> Call:
    op = draw(lst.operators(draw(lst.spaces()), max_leaves=3))
    dtype = draw(maybe(st.just(np.float64)))
    vector = draw(maybe(st.just(np.arange(op.domain.size, dtype=float))))
    adjoint = draw(st.booleans())

    def run() -> Any:
        wrapped = aslinearoperator(op, dtype)
        result = wrapped.rmatvec(vector) if adjoint else wrapped.matvec(vector)
        # the sparse matrix, not a dense one: a dense product spreads a junk vector's nan
        # through its zeros (0 * nan), which linop's interpreters never multiply
        matrix = op.to_sparse()
        # complex: a junk vector may hold complex entries, which the wrapper takes
        expected = (matrix.conj().T if adjoint else matrix) @ np.ravel(np.asarray(vector, dtype=complex))
        if not np.allclose(np.ravel(result), expected, equal_nan=True):  # junk vectors hold nan
            raise FuzzFailure(f"aslinearoperator: {result} != {expected}")
        return result

    return Call("aslinearoperator", run, show_arguments(op, dtype, vector, adjoint=adjoint))


@st.composite
def _verifications(draw: st.DrawFn) -> Call:
    import verify

    op = draw(lst.operators(draw(lst.spaces()), max_leaves=2))
    a, b = draw(maybe(st.just(op))), draw(maybe(st.just(op)))
    kind = draw(st.sampled_from(["exact_adjoint", "equal", "adjoint_test", "numeric_equal"]))
    options = {}
    if kind in ("adjoint_test", "numeric_equal"):
        if draw(st.booleans()):
            options["dtype"] = draw(maybe(st.sampled_from([np.float32, np.complex128])))
        if draw(st.booleans()):
            options["trials"] = draw(maybe(st.integers(1, 2)))
    function = getattr(verify, kind)
    args = (a,) if kind in ("exact_adjoint", "adjoint_test") else (a, b)
    return _call(f"verify.{kind}", function, *args, **options)


ENTRY_POINTS: dict[str, Callable[[], st.SearchStrategy[Call]]] = {
    "Block": _blocks,
    "Space": _spaces,
    "indexing": _indexing,
    "Region": _regions,
    "primitives and movements": _primitives,
    "algebra": _algebra,
    "Partition": _partitions,
    "DistributedTensor": _tensors,
    "Kernel and halo": _kernels,
    "collectives and repartitions": _collectives,
    "methods and helpers": _methods,
    "apply": _applications,
    "to_sparse": _matrices,
    "aslinearoperator": _scipy,
    "verify": _verifications,
}
"""The strategy of calls of each group of entry points."""


def calls(*, frameworks: bool = False) -> st.SearchStrategy[Call]:
    """One call of any public constructor or entry point, with malformed arguments half the time
    (with ``frameworks``: also states of torch and JAX arrays, which imports both); the groups
    of :mod:`verify.strategies_malformed_surface` included."""
    from .strategies_malformed_surface import FRAMEWORK_ENTRY_POINTS, SURFACE_ENTRY_POINTS

    groups = {**ENTRY_POINTS, **SURFACE_ENTRY_POINTS, **(FRAMEWORK_ENTRY_POINTS if frameworks else {})}
    return st.one_of(*(strategy() for strategy in groups.values()))


# -- checking -------------------------------------------------------------------------------------
def _copy_state(state: Any) -> Any:
    if isinstance(state, dict):
        return {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in state.items()}
    return state


def _check_unchanged(state: Any, before: Any) -> None:
    for name, value in before.items():
        if isinstance(value, np.ndarray) and not np.array_equal(
            state[name], value, equal_nan=value.dtype.kind in "fc"
        ):
            raise FuzzFailure(f"the caller's block {name!r} was changed")


def check_against_matrix(
    op: LinearOperator, state: dict[str, Any], result: dict[str, Any], dtype: Any
) -> None:
    """The numpy result equals the matrix times the state: exactly (object arithmetic on Python
    numbers) for integer states, to rounding for inexact ones."""
    arrays = op.domain.check_state(state)
    exact = all(a.dtype.kind in "iu" for a in arrays.values())
    matrix = op.to_sparse()
    if exact and matrix.dtype.kind in "iu":
        vector = (
            op.domain.flatten({n: a.astype(object) for n, a in arrays.items()})
            if arrays
            else np.zeros(0, object)
        )
        expected = (
            matrix.toarray().astype(object).dot(vector) if vector.size else np.zeros(op.range.size, object)
        )
        got = op.range.flatten(result) if op.range.size else np.zeros(0)
        if [int(v) for v in got] != [int(v) for v in expected]:
            raise FuzzFailure(f"integer result {list(got)} differs from the matrix's {list(expected)}")
        return
    vector = op.domain.flatten({n: a.astype(complex) for n, a in arrays.items()}) if arrays else np.zeros(0)
    expected = matrix.toarray() @ vector if vector.size else np.zeros(op.range.size)
    got = op.range.flatten(result).astype(complex) if op.range.size else np.zeros(0)
    narrow = any(np.dtype(a.dtype).itemsize < 8 and a.dtype.kind in "fc" for a in arrays.values())
    tolerance = 1e-3 if narrow or (dtype is not None and np.dtype(dtype).kind in "fc") else 1e-9
    scale = max(1.0, float(np.nanmax(np.abs(expected), initial=0.0)) if expected.size else 1.0)
    with np.errstate(invalid="ignore"):
        close = np.isclose(got, expected, rtol=tolerance, atol=tolerance * scale, equal_nan=True)
    if not np.all(close | ~np.isfinite(expected)):  # inf - inf orderings may differ
        raise FuzzFailure(f"result {got} differs from the matrix's {expected}")


def outcome(call: Call) -> str:
    """Run ``call``: ``"ok"`` if it succeeds (operators are also checked against their matrix on
    a random state), ``"typed"`` if it raises a LinopError.

    Raises
    ------
    FuzzFailure
        On any other exception, or a result that disagrees with the sparse interpreter.
    """
    try:
        result = call.function()
        if isinstance(result, LinearOperator) and result.domain.size <= 64 and result.range.size <= 64:
            state = result.domain.random(0)
            got = result(state)
            if result.domain.size:
                matrix = result.to_sparse()
                # scalars whose product overflows float64 give a matrix of inf: the orders in
                # which the interpreters multiply then differ in where inf and nan appear
                overflowed = not np.isfinite(matrix.data).all()
                with np.errstate(invalid="ignore", over="ignore"):
                    expected = matrix @ result.domain.flatten(state)
                    close = np.allclose(result.range.flatten(got), expected, equal_nan=True)
                if not (close or overflowed):
                    raise FuzzFailure(f"{call!r}: numpy and sparse interpreters differ")
    except LinopError:
        return "typed"
    except FuzzFailure:
        raise
    except Exception as error:  # the point: nothing else may escape
        raise FuzzFailure(f"{call!r} raised {type(error).__name__}: {error}") from error
    return "ok"
