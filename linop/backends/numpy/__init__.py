"""The numpy interpreter: apply an operator tree to a state in one process.

Handlers are registered per node type with :func:`handler` in the dispatch registry
(:mod:`linop.dispatch`); a node without a handler is run through its
:meth:`~linop.LinearOperator.expand`. The fast paths of derived nodes live in the modules of
this package (``collectives``, ``halo``, ``local``, ``shims``), which the registry imports on first use
(:data:`linop.dispatch.HANDLER_MODULES`).

Arrays are shared copy-on-write: the interpreter copies a caller's array only when it must change it, so application never mutates
its input, and pass-through blocks cost nothing. Dtypes are kept (float32 stays float32,
integers stay integers, object arrays of sympy symbols work) and are promoted only where the
mathematics demands it (adding complex into real, scaling by a complex number).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from ... import dispatch, dtypes
from ...errors import StateError
from ...movement import Copy, CopyAdjoint, Move
from ...operator import Composition, Identity, LinearOperator, Scaled, Sum, Zero
from ...primitives import Add, Allocate, Clear, Deallocate
from ...space import Block, Region, State, natural_key
from .. import array_api
from ..host_moves import add_back, relabel
from ..host_workspace import OwnedBlocks

__all__ = [
    "apply",
    "apply_numpy",
    "handler",
    "Workspace",
    "first_shared_memory",
    "scale_blocks",
    "sum_branches",
    "write_back",
]


class Workspace(OwnedBlocks[np.ndarray]):
    """The interpreter's working state: arrays by block name, and which of them it owns
    (``set`` and ``drop``: :class:`~linop.backends.host_workspace.OwnedBlocks`).

    An array that is not owned belongs to the caller and is copied before its first change.
    """

    __slots__ = ("dtype",)

    def __init__(self, arrays: dict[str, np.ndarray], owned: set[str], dtype: np.dtype) -> None:
        super().__init__(arrays, owned)
        self.dtype = dtype

    def writable(self, name: str, dtype: np.dtype | None = None) -> np.ndarray:
        """The array of block ``name``, owned and able to hold ``dtype`` values."""
        array = self.arrays[name]
        target = array.dtype if dtype is None else np.result_type(array.dtype, dtype)
        if name not in self.owned or target != array.dtype:
            array = array.astype(target, copy=True)
            self.arrays[name] = array
            self.owned.add(name)
        return array

    def overwritten(self, region: Region, dtype: np.dtype) -> np.ndarray:
        """The array of ``region``'s block, owned and able to hold ``dtype``, for a write that
        replaces the region's values: a whole borrowed block is not copied first."""
        array = self.arrays[region.name]
        if region.is_whole and region.name not in self.owned:
            array = np.empty(array.shape, dtype=np.result_type(array.dtype, dtype))
            self.set(region.name, array)
            return array
        return self.writable(region.name, dtype)

    def borrowed(self) -> Workspace:
        """A workspace over the same arrays that owns none of them (for branches of a sum)."""
        return Workspace(dict(self.arrays), set(), self.dtype)


Handler = Callable[[Any, Workspace], None]
H = TypeVar("H", bound=Handler)


def handler(node_type: type) -> Callable[[H], H]:
    """Register the numpy handler of a node type (a primitive or a fast path) in the
    dispatch registry (:mod:`linop.dispatch`)."""
    return dispatch.register("numpy", node_type)


def run(op: LinearOperator, work: Workspace) -> None:
    """Apply ``op`` to the workspace, changing it into a state of ``op.range``."""
    dispatch.dispatch("numpy", op, work)


def apply(
    op: LinearOperator,
    state: Mapping[str, Any],
    *,
    inplace: bool = False,
    dtype: npt.DTypeLike | None = None,
) -> State:
    """Apply ``op`` to ``state``; see :meth:`linop.LinearOperator.apply` (which also
    differentiates torch and JAX states: :mod:`linop.entry`).

    Raises
    ------
    StateError
        A block requires a gradient (apply with ``op(state)`` to differentiate).
    """
    library = array_api.library_of(state) if isinstance(state, Mapping) else None
    if library is not None:  # torch, jax, ... arrays: viewed as numpy here, same library out
        return array_api.apply(op, state, library, apply_numpy, inplace=inplace, dtype=dtype)
    return apply_numpy(op, state, inplace=inplace, dtype=dtype)


def apply_numpy(
    op: LinearOperator,
    state: Mapping[str, Any],
    *,
    inplace: bool = False,
    dtype: npt.DTypeLike | None = None,
) -> State:
    """:func:`apply` on a state of numpy arrays (and plain Python values) only."""
    arrays = op.domain.check_state(state)
    run_arrays, dtype, cast = dtypes.prepare_numpy(op, arrays, dtype)  # docs/theory.md#dtypes
    if dtype is None:
        dtype = np.result_type(*run_arrays.values()) if arrays else np.dtype(np.float64)
    if not inplace:
        work = Workspace(run_arrays, set(), dtype)
        run(op, work)
        result: State = {}
        for name in op.range.names:
            array = work.arrays[name]
            if name not in work.owned:
                array = array.view()
                array.flags.writeable = False
            result[name] = array
        return result

    op.domain.require_equal(op.range, f"in-place application of {op}: domain and range differ")
    for name, array in arrays.items():
        if array is not state[name] or not array.flags.writeable:
            raise StateError(f"in-place application needs a writeable numpy array for block {name!r}")
        if overlaps_itself(array):
            raise StateError(
                f"in-place application cannot write block {name!r}: its entries overlap in memory (strides "
                f"{array.strides} for shape {array.shape}, a broadcast or expanded view); pass an array "
                "with one memory location per entry"
            )
    shared = first_shared_memory(arrays)
    if shared is not None:
        raise StateError(
            f"in-place application needs separate memory per block; blocks {shared[0]!r} and "
            f"{shared[1]!r} share entries"
        )
    work = Workspace(run_arrays, set(arrays), dtype)
    run(op, work)
    if cast is not None:
        dtypes.fit_back(work.arrays, arrays)
    write_back(arrays, work)
    return state  # type: ignore[return-value]


def write_back(arrays: Mapping[str, np.ndarray], work: Workspace) -> None:
    """End an in-place run: copy each block's result into the caller's array ``arrays[name]``
    when the run left it in another array (shared by the numpy and MPI interpreters).

    A result may be another caller array (blocks swapped by out-of-place moves): it is copied
    before any write, or the first write would clobber it. Results are cast ``same_kind``.

    Raises
    ------
    StateError
        If a result's dtype cannot be cast ``same_kind`` into the caller's array.
    """
    pending = {}
    for name, target in arrays.items():
        result_array = work.arrays[name]
        if result_array is target:
            continue
        if not np.can_cast(result_array.dtype, target.dtype, casting="same_kind"):
            raise StateError(
                f"in-place result of block {name!r} has dtype {result_array.dtype}, "
                f"which the caller's {target.dtype} array cannot hold"
            )
        aliased = any(np.may_share_memory(result_array, other) for other in arrays.values())
        pending[name] = result_array.copy() if aliased else result_array
    for name, result_array in pending.items():
        np.copyto(arrays[name], result_array, casting="same_kind")


def _byte_bounds(array: np.ndarray) -> tuple[int, int]:
    """The first and one-past-last byte addresses that ``array`` can touch."""
    low = high = array.__array_interface__["data"][0]
    for extent, stride in zip(array.shape, array.strides):
        reach = (extent - 1) * stride
        if reach < 0:
            low += reach
        else:
            high += reach
    return low, high + array.itemsize


def _overlapping_bounds(spans: list[tuple[int, int, str]]) -> Iterator[tuple[str, str]]:
    """Pairs of names whose (low, high, name) spans, sorted by low, overlap."""
    for i, (_, high, name) in enumerate(spans):
        for other_low, _, other in spans[i + 1 :]:
            if other_low >= high:
                break
            yield name, other


def first_shared_memory(arrays: Mapping[str, np.ndarray]) -> tuple[str, str] | None:
    """Two block names whose arrays share an entry, or None. Candidates (overlapping byte
    bounds) are confirmed exactly, so that disjoint views of one buffer are accepted; few
    blocks are compared pairwise, many by a sweep over sorted byte bounds."""
    items = [(name, array) for name, array in arrays.items() if array.size and array.itemsize]
    candidates: Iterator[tuple[str, str]]
    if len(items) <= 16:
        candidates = (
            (a, b) for i, (a, x) in enumerate(items) for b, y in items[i + 1 :] if np.may_share_memory(x, y)
        )
    else:
        candidates = _overlapping_bounds(sorted((*_byte_bounds(array), name) for name, array in items))
    for name, other in candidates:
        if np.shares_memory(arrays[name], arrays[other]):
            return tuple(sorted((name, other), key=natural_key))  # type: ignore[return-value]
    return None


def overlaps_itself(array: np.ndarray) -> bool:
    """Whether two entries of ``array`` share memory (a stride-0 view such as a broadcast or
    ``torch.expand``, an ``as_strided`` view with overlapping strides): in-place writes into
    such an array cannot hold a different value per entry. Contiguous arrays are decided at
    once; others by their strides, sorted, each at least the span of the smaller ones
    (sufficient), else exactly by their entries' byte offsets. An array that stands in for
    memory elsewhere (the torch executor's device stand-ins) says so itself, in an
    ``overlapping`` attribute."""
    known = getattr(array, "overlapping", None)
    if known is not None:
        return bool(known)
    flags = array.flags
    if flags.c_contiguous or flags.f_contiguous or array.size <= 1:
        return False
    dims = sorted((abs(stride), extent) for stride, extent in zip(array.strides, array.shape) if extent > 1)
    if dims and dims[0][0] == 0:
        return True
    span = array.itemsize
    for stride, extent in dims:
        if stride < span:
            break
        span += stride * (extent - 1)
    else:
        return False
    offsets = np.zeros(1, dtype=np.int64)
    for stride, extent in dims:
        offsets = (offsets[:, None] + stride * np.arange(extent, dtype=np.int64)).ravel()
    offsets.sort()
    return bool(np.any(np.diff(offsets) < array.itemsize))


# -- algebra -------------------------------------------------------------------------------
@handler(Identity)
def _identity(op: Identity, work: Workspace) -> None:
    pass


@handler(Zero)
def _zero(op: Zero, work: Workspace) -> None:
    work.arrays.clear()
    work.owned.clear()
    for block in op.range:
        work.set(block.name, np.zeros(block.shape, dtype=work.dtype))


@handler(Composition)
def _composition(op: Composition, work: Workspace) -> None:
    for factor in reversed(op.factors):
        run(factor, work)


@handler(Sum)
def _sum(op: Sum, work: Workspace) -> None:
    results = []
    for term in op.terms:
        branch = work.borrowed()
        run(term, branch)
        results.append(branch.arrays)
    sum_branches(results, op.range.names, work)


def sum_branches(results: list[dict[str, np.ndarray]], names: Iterable[str], work: Workspace) -> None:
    """Replace the workspace by the blockwise sum of the branch states ``results`` over the
    blocks ``names`` (the semantics of a Sum, shared by the numpy and MPI interpreters).

    Each total has the dtype of the sum of its terms (``np.result_type``): a complex term
    after real ones promotes the total instead of failing to add into it.
    """
    work.arrays.clear()
    work.owned.clear()
    for name in names:
        # np.asarray: numpy turns arithmetic on 0-d arrays into scalars, which cannot be written
        total = (
            np.asarray(results[0][name] + results[1][name]) if len(results) > 1 else results[0][name].copy()
        )
        for other in results[2:]:
            addend = other[name]
            if np.result_type(total, addend) == total.dtype:
                total += addend
            else:
                total = np.asarray(total + addend)
        work.set(name, total)


@handler(Scaled)
def _scaled(op: Scaled, work: Workspace) -> None:
    run(op.operator, work)
    scale_blocks(op.alpha, work)


def scale_blocks(alpha: Any, work: Workspace) -> None:
    """Multiply every block of the workspace by ``alpha`` (the tail of a Scaled node, shared by
    the numpy and MPI interpreters): in place in owned arrays that can hold the product, else
    into a new array of the promoted dtype (a borrowed array is never written)."""
    for name, array in list(work.arrays.items()):
        scaled_dtype = np.result_type(array, alpha) if array.dtype != object else array.dtype
        if name in work.owned and scaled_dtype == array.dtype:
            array *= alpha
        else:
            work.set(name, np.asarray(alpha * array))  # 0-d stays an array


# -- primitives ----------------------------------------------------------------------------
@handler(Allocate)
def _allocate(op: Allocate, work: Workspace) -> None:
    work.set(op.block.name, np.zeros(op.block.shape, dtype=work.dtype))


@handler(Deallocate)
def _deallocate(op: Deallocate, work: Workspace) -> None:
    work.drop(op.name)


@handler(Clear)
def _clear(op: Clear, work: Workspace) -> None:
    if op.region.size:
        work.writable(op.region.name)[op.region.index] = 0


@handler(Add)
def _add(op: Add, work: Workspace) -> None:
    source = work.arrays[op.src.name][op.src.index]
    work.writable(op.dst.name, source.dtype)[op.dst.index] += source


# -- fast paths (proven equal to their expansions in the tests) -----------------------------
@handler(Copy)
def _copy(op: Copy, work: Workspace) -> None:
    source = work.arrays[op.src.name][op.src.index]
    if isinstance(op.dst, Block):
        # np.array, not astype: indexing a 0-d block gives a scalar, and a block must stay an array
        work.set(op.dst.name, np.array(source, dtype=np.result_type(work.dtype, source.dtype)))
    else:
        work.overwritten(op.dst, source.dtype)[op.dst.index] = source


@handler(CopyAdjoint)
def _copy_adjoint(op: CopyAdjoint, work: Workspace) -> None:
    add_back(op, work, _region_index)


def _region_index(region: Region) -> tuple[int | slice, ...]:
    return region.index


def _widened(array: np.ndarray, dtype: np.dtype) -> np.ndarray | None:
    target = np.result_type(dtype, array.dtype)
    return array.astype(target) if target != array.dtype else None


@handler(Move)
def _move(op: Move, work: Workspace) -> None:
    if isinstance(op.dst, Block):
        relabel(work, op.src.name, op.dst.name, lambda block: _widened(block, work.dtype))
        return
    source = work.arrays[op.src.name][op.src.index]
    work.overwritten(op.dst, source.dtype)[op.dst.index] = source
    if op.src.size:
        work.writable(op.src.name)[op.src.index] = 0
