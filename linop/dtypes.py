"""The dtypes linop computes in: one policy for the numpy, sparse and MPI interpreters.

See ``docs/theory.md#dtypes``. In short:

* A state's blocks may be signed or unsigned integers, floats (float16 to long double) or
  complex numbers (:data:`NUMERIC_KINDS`). Bool, strings, bytes, dates, time deltas and
  structured dtypes are refused with a :class:`~linop.errors.DtypeError` naming the block: an
  interpreter adds entries, and ``True + True`` or ``"a" + "b"`` is not the sum the matrix
  states. Object arrays (sympy symbols) are accepted by the numpy interpreter only, for the
  symbolic checks of :mod:`verify`; the MPI interpreter refuses them.
* A run computes in the common dtype of the blocks and the tree's scalars (``numpy.result_type``).
  When that dtype is inexact (a float or complex block, or a float scalar), integer blocks are
  cast to it first, so no partial sum is ever taken in an integer dtype that could wrap.
* Integer runs are exact or refused, never wrapped. Every output entry of ``A x`` is bounded by
  ``G * M``, where ``G`` is the largest absolute row sum of the tree's matrix (its infinity
  norm, from the sparse interpreter, cached per tree) and ``M`` the largest magnitude of an
  input entry. Integer arithmetic is exact modulo 2**bits, so when ``G * M`` fits in the
  narrowest integer dtype of the state (and a negative entry of the matrix does not meet an
  unsigned dtype) the result is exact in the blocks' own dtypes. Otherwise every block is cast
  to the run dtype if ``G * M`` fits it, else to int64; when ``G * M`` reaches 2**62 (the
  sparse interpreter's own limit, :data:`linop.backends.sparse.SAFE_INTEGER`) the run
  raises :class:`~linop.errors.IntegerOverflowError`: cast the state to float64 to accept
  rounding. The decision depends only on the tree, the blocks' dtypes and ``M`` (a global
  maximum under MPI), so every interpreter and every rank decides alike.

The numpy interpreter calls :func:`prepare_numpy`; the MPI interpreter calls
:func:`check_block_dtype` for each local block, :func:`check_requested` for its ``dtype=``
argument, reduces :func:`largest_magnitude` to a global maximum, and calls :func:`cast_dtype`
with the global set of dtypes. Its run dtype (the dtype of every message) is then widened to
hold what the tree's local kernels produce (:mod:`linop.backends.entry_check.kernels`); the
numpy interpreter needs no such step, as each of its arrays keeps its own dtype.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from .errors import DtypeError, IntegerOverflowError
from .operator import LinearOperator, Scaled, walk

__all__ = [
    "NUMERIC_KINDS",
    "SAFE_INTEGER",
    "check_requested",
    "check_block_dtype",
    "scalars",
    "run_dtype",
    "largest_magnitude",
    "growth",
    "growth_bound",
    "EXACT_GROWTH_ENTRIES",
    "cast_dtype",
    "prepare_numpy",
    "fit_back",
]

NUMERIC_KINDS = "iufc"
"""numpy dtype kinds a state may hold: signed and unsigned integers, floats, complex."""

SAFE_INTEGER = 2**62
"""Integer runs whose bound reaches this raise IntegerOverflowError (as the sparse interpreter
switches to float64 there)."""


def _describe(dtype: np.dtype) -> str:
    kinds = {"b": "bool", "U": "string", "S": "bytes", "M": "datetime", "m": "timedelta", "V": "structured"}
    return f"{dtype} ({kinds.get(dtype.kind, dtype.kind)})"


def check_requested(dtype: npt.DTypeLike, *, allow_object: bool = False, what: str = "dtype") -> np.dtype:
    """A ``dtype=`` argument as a numpy dtype, if it is one linop computes in.

    Raises
    ------
    DtypeError
        If it is not a dtype, or not numeric (object allowed only with ``allow_object``).
    """
    try:
        result = np.dtype(dtype)
    except (TypeError, ValueError, SyntaxError):  # numpy parses "a," as a structured dtype
        raise DtypeError(f"{what} {dtype!r} is not a numpy dtype") from None
    if result.kind not in NUMERIC_KINDS and not (allow_object and result.kind == "O"):
        raise DtypeError(
            f"{what} {_describe(result)} is not numeric; linop computes in integers, floats or complex"
        )
    return result


def check_block_dtype(name: str, dtype: np.dtype, *, allow_object: bool = False) -> None:
    """Raise :class:`DtypeError` naming block ``name`` if its dtype is not one linop computes in."""
    if dtype.kind not in NUMERIC_KINDS and not (allow_object and dtype.kind == "O"):
        raise DtypeError(
            f"block {name!r} has dtype {_describe(dtype)}, which is not numeric; "
            "linop computes in integers, floats or complex (docs/theory.md#dtypes)"
        )


def scalars(op: LinearOperator) -> tuple[Any, ...]:
    """The scalars of the tree's :class:`~linop.Scaled` nodes (they take part in the run dtype)."""
    return tuple(node.alpha for node in walk(op) if isinstance(node, Scaled))


def run_dtype(op: LinearOperator, dtypes: Iterable[np.dtype]) -> np.dtype:
    """The common dtype of the blocks and the tree's scalars (float64 for no block). A Python
    int scalar beyond int64 counts as a float, as in the sparse interpreter."""
    parts = [np.dtype(d) for d in dtypes]
    for alpha in scalars(op):
        if isinstance(alpha, int) and not -(2**63) <= alpha < 2**63:
            parts.append(np.dtype(np.float64))
        else:
            parts.append(alpha)
    return np.result_type(*parts) if parts else np.dtype(np.float64)


def largest_magnitude(arrays: Iterable[np.ndarray]) -> int:
    """The largest magnitude of an entry of the integer arrays, exactly (0 if there are none)."""
    largest = 0
    for array in arrays:
        if array.dtype.kind in "iu" and array.size:
            largest = max(largest, int(array.max()), -int(array.min()))
    return largest


@functools.lru_cache(maxsize=64)
def _cached_growth(op: LinearOperator) -> tuple[int | float, bool]:
    return _growth_of(op)


def _growth_of(op: LinearOperator) -> tuple[int | float, bool]:
    if op.domain.size + op.range.size <= EXACT_GROWTH_ENTRIES:
        return _growth(op)
    return _bound(op)


def _bound(op: LinearOperator) -> tuple[int | float, bool]:
    from . import collectives, halo, movement, primitives, repartition
    from .operator import Composition, Identity, Scaled, Sum, Zero

    if isinstance(op, Composition):
        g: int | float = 1
        negative = False
        for factor in op.factors:
            fg, fn = _bound(factor)
            g, negative = g * fg, negative or fn
        return g, negative
    if isinstance(op, Sum):
        parts = [_bound(term) for term in op.terms]
        return sum(g for g, _ in parts), any(n for _, n in parts)
    if isinstance(op, Scaled):
        g, negative = _bound(op.operator)
        alpha = op.alpha
        return abs(alpha) * g, negative or bool(np.real(alpha) < 0)
    if isinstance(op, Zero):
        return 0, False
    copying = (
        Identity,
        movement.Copy,
        movement.SendRecv,
        movement.Move,
        primitives.Clear,
        primitives.Allocate,
        primitives.Deallocate,
        collectives.Broadcast,
        collectives.AllGather,
        repartition.Repartition,
        repartition.Scatter,
        repartition.Gather,
    )
    if isinstance(op, copying):
        return 1, False
    if isinstance(op, (primitives.Add, movement.CopyAdjoint, movement.SendRecvAdjoint)):
        return 2, False
    if isinstance(op, collectives.SumReduce):
        return len(op.copy_box((0,) * op.tensor.partition.ndim)), False  # every block: as many copies
    if isinstance(op, collectives.AllReduce):
        return int(np.prod([op.tensor.partition.shape[a] for a in op.axes], dtype=object)), False
    if isinstance(op, collectives.ReduceScatter):
        return int(np.prod([op.tensor.partition.shape[a] for a in op.axes], dtype=object)), False
    if isinstance(op, (halo.HaloExchange, halo.HaloStage)) and _zero_boundary(op):
        return 1, False
    if isinstance(op, halo.HaloExchangeAdjoint) and _zero_boundary(op):
        g = 1
        for rows in op.geometry.rows:
            g *= 1 + _most_halos_holding_one_entry(rows)
        return g, False
    expanded = op.expand()
    if expanded is not op:
        return _bound(expanded)
    return _growth(op)  # a leaf: its own matrix (a local operator: its block's)


def _zero_boundary(op: Any) -> bool:
    geometry = getattr(op, "geometry", None)
    if geometry is None:
        return False
    modes = geometry.kernel.resolve(geometry.tensor.ndim).boundary
    return all(mode == "zero" for mode in modes)


def _most_halos_holding_one_entry(rows: Any) -> int:
    """The most halos of one dimension's workers that hold one input entry (a sweep over the
    halos' intervals, clipped to the tensor)."""
    events: list[tuple[int, int]] = []
    for row in rows:
        for start, stop in ((row.need_start, row.bulk_start), (row.bulk_stop, row.need_stop)):
            start, stop = max(start, 0), min(stop, row.length)
            if start < stop:
                events += [(start, 1), (stop, -1)]
    most = depth = 0
    for _, step in sorted(events):  # at one coordinate, ends (-1) sort before starts
        depth += step
        most = max(most, depth)
    return most


def _growth(op: LinearOperator) -> tuple[int | float, bool]:
    matrix = op.to_sparse()
    if matrix.dtype.kind not in "iuf":  # complex: never an integer run
        return float("inf"), True
    magnitudes = abs(matrix.astype(np.float64))
    largest = float(np.asarray(magnitudes.sum(axis=1)).max(initial=0.0))
    negative = bool(matrix.data.size) and bool(matrix.data.min() < 0)
    return (int(largest) if largest < 2.0**53 else largest), negative


EXACT_GROWTH_ENTRIES = 1 << 16
"""Trees whose domain and range hold at most this many entries together bound their growth
by their exact matrix; larger ones by the structural rule (:func:`growth_bound`), whose cost
does not depend on the number of workers."""


def growth(op: LinearOperator) -> tuple[int | float, bool]:
    """``(G, negative)``: a bound on the largest absolute row sum of the tree's matrix, and
    whether an entry may be negative. Cached per tree.

    For a tree of at most :data:`EXACT_GROWTH_ENTRIES` entries (domain and range) it is exact
    (from the matrix, below 2**53); for a larger one it is :func:`growth_bound`, from the
    nodes' structure and per-block facts, never the global matrix."""
    try:
        return _cached_growth(op)
    except TypeError:  # an unhashable node (a user's kernel holding an array)
        return _growth_of(op)


def growth_bound(op: LinearOperator) -> tuple[int | float, bool]:
    """``(G, negative)`` with ``G`` at least the largest absolute row sum of ``op``'s matrix,
    from the structure of the tree (O(the tree's nodes and the rows of its geometries), not
    O(P)):

    ===============================================  =================================================
    node                                             G
    ===============================================  =================================================
    A @ B, A + B, alpha * A                          G(A) G(B), G(A) + G(B), abs(alpha) G(A)
    identity, copies, moves, clears, allocations     1 (every output entry one input entry, or 0)
    adds (Add, CopyAdjoint, SendRecvAdjoint)         2
    Broadcast, AllGather, a copying piece movement   1
    SumReduce                                        the number of copies of one source block
    AllReduce, ReduceScatter                         the size of a group (the blocks summed)
    HaloExchange (zero boundary), its stages         1
    HaloExchange adjoint (zero boundary)             per dimension, 1 + the most halos that hold
                                                     one input entry (the forward copies e into a
                                                     product of such sets: the column sums of the
                                                     forward), multiplied over the dimensions
    any other node                                   its own matrix (a local operator's block), or
                                                     its expansion's bound
    ===============================================  =================================================

    ``negative`` is True when a scalar or a node's own matrix has a negative entry.
    """
    return _bound(op)


def cast_dtype(op: LinearOperator, dtypes: Iterable[np.dtype], largest: int) -> np.dtype | None:
    """The dtype to cast the state's blocks to before a run, or None to run them as they are.

    ``dtypes`` are the dtypes of every block of the state (all ranks' under MPI) and
    ``largest`` the largest magnitude of an integer entry (global under MPI). Inexact runs
    cast their integer blocks to the run dtype; integer runs follow the bound of the module
    docstring.

    Raises
    ------
    IntegerOverflowError
        If an integer result may reach 2**62.
    """
    dtypes = [np.dtype(d) for d in dtypes]
    integers = [d for d in dtypes if d.kind in "iu"]
    if not integers or any(d.kind == "O" for d in dtypes):  # the common case: no tree walk
        return None
    run = run_dtype(op, dtypes)
    if run.kind not in "iu":
        return run
    g, negative = growth(op)
    negative = negative or any(np.real(alpha) < 0 for alpha in scalars(op))  # -1 * uint8 fails in numpy
    bound = g * largest
    unsigned = any(d.kind == "u" for d in dtypes)
    narrowest = min(np.iinfo(d).max for d in integers)
    if bound <= narrowest and not (negative and unsigned):
        return None
    if bound >= SAFE_INTEGER:
        raise IntegerOverflowError(
            f"integer result of {_short(op)} may reach {float(bound):.3g} (row sum {g} times the "
            f"largest entry {largest}), beyond int64; cast the state to float64 to accept rounding"
        )
    if bound <= np.iinfo(run).max and not (negative and run.kind == "u"):
        return run
    return np.dtype(np.int64)


def _short(op: LinearOperator, limit: int = 60) -> str:
    text = str(op)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def prepare_numpy(
    op: LinearOperator, arrays: Mapping[str, np.ndarray], dtype: npt.DTypeLike | None
) -> tuple[dict[str, np.ndarray], np.dtype | None, np.dtype | None]:
    """The numpy interpreter's side of the policy: validate the blocks' and the requested
    dtypes (object arrays allowed), and return ``(arrays, dtype, cast)``: the arrays to run on
    (copies cast to ``cast`` when that is not None; else the caller's), the requested dtype
    (None if not given) and the cast.
    """
    present = {a.dtype for a in arrays.values()}
    if any(d.kind not in NUMERIC_KINDS and d.kind != "O" for d in present):
        for name, array in arrays.items():
            check_block_dtype(name, array.dtype, allow_object=True)
    requested = None if dtype is None else check_requested(dtype, allow_object=True)
    if all(d.kind in "fc" for d in present):  # the common case: nothing to decide
        return dict(arrays), requested, None
    cast = cast_dtype(op, list(present), largest_magnitude(arrays.values()))
    if cast is None:
        return dict(arrays), requested, None
    cast_arrays = {name: a.astype(np.result_type(a.dtype, cast)) for name, a in arrays.items()}  # copies
    return cast_arrays, requested, cast


def fit_back(results: dict[str, np.ndarray], targets: Mapping[str, np.ndarray]) -> None:
    """Before the in-place write-back of a cast run: check that every integer result fits its
    caller's integer array, and cast it back to that array's dtype (in ``results``).

    Raises
    ------
    IntegerOverflowError
        Naming the first block whose result does not fit (nothing has been written yet).
    """
    for name, target in targets.items():
        result = results[name]
        if target.dtype.kind in "iu" and result.dtype.kind in "iu" and result.dtype != target.dtype:
            info = np.iinfo(target.dtype)
            low, high = (int(result.min()), int(result.max())) if result.size else (0, 0)
            if low < info.min or high > info.max:
                raise IntegerOverflowError(
                    f"in-place result of block {name!r} spans [{low}, {high}], which the caller's "
                    f"{target.dtype} array cannot hold"
                )
            results[name] = result.astype(target.dtype)
