"""Hypothesis strategies for linop: spaces, regions, operators, operator trees, states, dtypes.

Use them to property-test your own operators the way ``hypothesis.extra.numpy`` is used::

    from hypothesis import given
    from verify import strategies as lst
    import verify

    @given(lst.operators(max_leaves=4))
    def test_every_tree_has_an_exact_adjoint(op):
        verify.exact_adjoint(op).check()

    @given(lst.spaces().flatmap(lambda s: lst.states(s, dtype=lst.dtypes())))
    def test_states_match_their_space(state):
        ...

Every strategy draws small objects (a few blocks of a few entries) so that exact (sparse) and
symbolic checks stay fast; the size knobs are keyword arguments. ``whole=True`` (on the
operator strategies) keeps every region a whole block, which gives trees that have size-free
block forms::

    @given(lst.operators(whole=True))
    def test_size_free(op):
        verify.symbolic.prove_adjoint(op).check()

Everything drawn is valid: regions lie inside their blocks, the pairs related by an add are
disjoint and of one shape, and trees compose (each factor's domain is the range of the one to
its right).

========================  ==================================================================
strategy                  draws
========================  ==================================================================
``dtypes()``              float32, float64, complex64, complex128 (numpy dtypes)
``block_names()``         short names such as ``x``, ``b3``
``shapes()``              block shapes, zero extents included
``blocks()``              :class:`~linop.Block` with a shape and a worker
``spaces()``              :class:`~linop.Space` of uniquely named blocks
``regions(space)``        a :class:`~linop.Region` (box) of one of the space's blocks
``region_pairs(space)``   two disjoint regions of one shape (source, destination)
``scalars()``             small exact scalars: integers, dyadic fractions, complex
``primitives(space)``     Allocate, Deallocate, Clear or Add with domain ``space``
``movements(space)``      Copy, Move (in and out of place), SendRecv with domain ``space``
``endomorphisms(space)``  leaves whose domain and range are both ``space``
``operators(space)``      operator trees (compositions, sums, scalings) of bounded depth/size
``states(space)``         a state (dict of arrays) of ``space`` with finite entries
========================  ==================================================================

``primitives`` and ``movements`` draw some of their kinds with ``kinds=``.

The strategies of the distributed features (partitions, distributed tensors, halos) live in
their own modules (:data:`FEATURE_MODULES`) and are re-exported here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, cast

import numpy as np
import numpy.typing as npt
from hypothesis import reject
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from linop import (
    Add,
    Allocate,
    Block,
    Clear,
    Composition,
    Copy,
    CopyAdjoint,
    Deallocate,
    Identity,
    LinearOperator,
    Move,
    Region,
    Scaled,
    SendRecv,
    Space,
    Sum,
    Zero,
    walk,
)

from .node_examples import examples_for
from .strategy_cache import built_once

__all__ = [
    "dtypes",
    "block_names",
    "shapes",
    "blocks",
    "spaces",
    "regions",
    "region_pairs",
    "scalars",
    "primitives",
    "movements",
    "PRIMITIVE_KINDS",
    "MOVEMENT_KINDS",
    "endomorphisms",
    "operators",
    "states",
]

_FLOATING = (np.float32, np.float64, np.complex64, np.complex128)


@built_once
def dtypes(*, real: bool = True, complex: bool = True, single: bool = True) -> st.SearchStrategy[np.dtype]:
    """Floating dtypes that linop supports: float32/float64 (``real``) and complex64/complex128
    (``complex``); ``single=False`` leaves out the single-precision ones."""
    chosen = [
        np.dtype(t)
        for t in _FLOATING
        if (real if np.dtype(t).kind == "f" else complex) and (single or t not in (np.float32, np.complex64))
    ]
    if not chosen:
        raise ValueError("dtypes(): no dtype left with these options")
    return st.sampled_from(chosen)


@built_once
def block_names() -> st.SearchStrategy[str]:
    """Short block names: a letter, sometimes followed by a number (``x``, ``b3``, ``h12``)."""
    return st.builds(
        lambda letter, number: letter if number is None else f"{letter}{number}",
        st.sampled_from("abcdhuvwxyz"),
        st.none() | st.integers(0, 12),
    )


@built_once
def shapes(
    *, min_ndim: int = 1, max_ndim: int = 2, min_side: int = 0, max_side: int = 4
) -> st.SearchStrategy[tuple[int, ...]]:
    """Block shapes with ``min_ndim..max_ndim`` dimensions of extent ``min_side..max_side``."""
    return hnp.array_shapes(min_dims=min_ndim, max_dims=max_ndim, min_side=min_side, max_side=max_side)


@built_once
def blocks(
    *,
    names: st.SearchStrategy[str] | None = None,
    shape: st.SearchStrategy[tuple[int, ...]] | None = None,
    max_workers: int = 3,
) -> st.SearchStrategy[Block]:
    """Blocks with a name, a shape and a worker in ``0..max_workers-1``."""
    return st.builds(
        Block,
        names if names is not None else block_names(),
        shape if shape is not None else shapes(),
        st.integers(0, max_workers - 1),
    )


@built_once
def spaces(
    *,
    min_blocks: int = 1,
    max_blocks: int = 4,
    min_ndim: int = 1,
    max_ndim: int = 2,
    min_side: int = 0,
    max_side: int = 4,
    max_workers: int = 3,
    same_shape: bool = False,
) -> st.SearchStrategy[Space]:
    """Spaces of ``min_blocks..max_blocks`` uniquely named blocks; ``same_shape=True`` gives
    every block one shape (so whole blocks can be added, copied and moved into each other)."""
    shape = shapes(min_ndim=min_ndim, max_ndim=max_ndim, min_side=min_side, max_side=max_side)

    if same_shape:
        return shape.flatmap(lambda one: _spaces_of_one_shape(one, min_blocks, max_blocks, max_workers))
    return _spaces_of(shape, min_blocks, max_blocks, max_workers)


@built_once
def _spaces_of_one_shape(
    shape: tuple[int, ...], min_blocks: int, max_blocks: int, max_workers: int
) -> st.SearchStrategy[Space]:
    return _spaces_of(st.just(shape), min_blocks, max_blocks, max_workers)


@built_once
def _spaces_of(
    shape: st.SearchStrategy[tuple[int, ...]], min_blocks: int, max_blocks: int, max_workers: int
) -> st.SearchStrategy[Space]:
    block = blocks(shape=shape, max_workers=max_workers)
    return st.lists(block, min_size=min_blocks, max_size=max_blocks, unique_by=lambda b: b.name).map(Space)


@st.composite
def _interval(draw: st.DrawFn, extent: int, length: int | None = None) -> tuple[int, int]:
    if length is None:
        length = draw(st.integers(0, extent))
    start = draw(st.integers(0, extent - length))
    return start, start + length


@st.composite
def regions(draw: st.DrawFn, space: Space, *, whole: bool | None = None) -> Region:
    """A region of one of ``space``'s blocks: a box, possibly empty, possibly the whole block
    (``whole=True`` always whole, ``whole=False`` any box)."""
    if not len(space):
        raise ValueError("regions(): the space holds no block")
    name = draw(st.sampled_from(space.names))
    region = space[name]
    if whole or (whole is None and draw(st.booleans())):
        return region
    bounds = [draw(_interval(n)) for n in region.shape]
    return region[tuple(slice(a, b) for a, b in bounds)]


def _pair_candidates(
    space: Space, *, other_worker: bool = False, whole: bool = False
) -> list[tuple[Block, Block]]:
    """Blocks (a, b) that can hold a (source, destination) pair of regions."""
    pairs = []
    for a in space.blocks:
        for b in space.blocks:
            if other_worker and a.worker == b.worker:
                continue
            if whole and (a.name == b.name or a.shape != b.shape):
                continue
            if a.ndim != b.ndim or (a.name == b.name and a.ndim == 0):
                continue
            pairs.append((a, b))
    return pairs


@st.composite
def region_pairs(
    draw: st.DrawFn, space: Space, *, other_worker: bool = False, whole: bool = False
) -> tuple[Region, Region]:
    """A (source, destination) pair of disjoint regions of one shape, in one block or two.

    With ``other_worker=True`` the two regions lie on different workers (a send-receive);
    with ``whole=True`` both are whole blocks (of one shape). The space must allow such a
    pair (ValueError otherwise).
    """
    pairs = _pair_candidates(space, other_worker=other_worker, whole=whole)
    if not pairs:
        raise ValueError(f"region_pairs(): the space {space} holds no suitable pair of blocks")
    a, b = draw(st.sampled_from(pairs))
    if whole:
        return space[a.name], space[b.name]
    if a.name != b.name:
        extents = [draw(st.integers(0, min(m, n))) for m, n in zip(a.shape, b.shape)]
        src = [draw(_interval(m, e)) for m, e in zip(a.shape, extents)]
        dst = [draw(_interval(n, e)) for n, e in zip(b.shape, extents)]
    else:
        # one block: separate the two boxes along one dimension (empty boxes never overlap)
        split = draw(st.integers(0, a.ndim - 1))
        src, dst = [], []
        for dim, n in enumerate(a.shape):
            if dim == split:
                e = draw(st.integers(0, n // 2))
                s = draw(st.integers(0, n - 2 * e))
                t = draw(st.integers(s + e, n - e))
                src.append((s, s + e))
                dst.append((t, t + e))
            else:
                e = draw(st.integers(0, n))
                src.append(draw(_interval(n, e)))
                dst.append(draw(_interval(n, e)))
    source = space[a.name][tuple(slice(*p) for p in src)]
    destination = space[b.name][tuple(slice(*p) for p in dst)]
    return source, destination


@built_once
def scalars(*, complex: bool = True) -> st.SearchStrategy[Any]:
    """Small scalars that keep matrices exact: integers, dyadic fractions, complex integers."""
    real = st.integers(-3, 3) | st.sampled_from([0.5, -0.25, 2.0])
    if not complex:
        return real
    return real | st.sampled_from([1j, -2j, 1 + 1j, 2 - 1j])


def _fresh_name(space: Space, stem: str = "new") -> str:
    i = 0
    while f"{stem}{i}" in space:
        i += 1
    return f"{stem}{i}"


PRIMITIVE_KINDS = ("allocate", "deallocate", "clear", "add")
"""The kinds :func:`primitives` draws (its ``kinds=``)."""

MOVEMENT_KINDS = ("copy", "move", "sendrecv", "copy-new", "move-new", "sendrecv-new")
"""The kinds :func:`movements` draws (its ``kinds=``): in place between two regions, or into
a new block (``-new``)."""


def _kinds_to_draw(
    what: str, known: tuple[str, ...], available: list[str], kinds: Sequence[str] | None
) -> list[str]:
    """The kinds asked for (all when ``kinds`` is None) that ``available`` allows; the draw is
    rejected (``hypothesis.reject``) when the space allows none of them."""
    if kinds is not None:
        unknown = sorted(set(kinds) - set(known))
        if unknown:
            raise ValueError(f"{what}(): unknown kinds {unknown}; the kinds are {list(known)}")
        available = [kind for kind in available if kind in kinds]
    if not available:
        reject()
    return available


@st.composite
def primitives(
    draw: st.DrawFn, space: Space, *, whole: bool = False, kinds: Sequence[str] | None = None
) -> LinearOperator:
    """One of the four primitives (Allocate, Deallocate, Clear, Add) with domain ``space``;
    ``whole=True`` keeps every region a whole block (trees for size-free proofs); ``kinds``
    (a subset of :data:`PRIMITIVE_KINDS`) draws only those (rejecting a space that allows none)."""
    available = ["allocate"]
    if len(space):
        available += ["deallocate", "clear"]
    if _pair_candidates(space, whole=whole):
        available.append("add")
    kind = draw(st.sampled_from(_kinds_to_draw("primitives", PRIMITIVE_KINDS, available, kinds)))
    if kind == "allocate":
        shape = st.sampled_from([b.shape for b in space.blocks]) if whole and len(space) else None
        return Allocate(space, draw(blocks(names=st.just(_fresh_name(space)), shape=shape)))
    if kind == "deallocate":
        return Deallocate(space, draw(st.sampled_from(space.names)))
    if kind == "clear":
        return Clear(draw(regions(space, whole=whole or None)))
    return Add(*draw(region_pairs(space, whole=whole)))


@st.composite
def movements(
    draw: st.DrawFn, space: Space, *, whole: bool = False, kinds: Sequence[str] | None = None
) -> LinearOperator:
    """A Copy or Move, in place or out of place, or a SendRecv, with domain ``space``;
    ``whole=True`` keeps every region a whole block; ``kinds`` (a subset of
    :data:`MOVEMENT_KINDS`) draws only those (rejecting a space that allows none)."""
    if not len(space):
        raise ValueError("movements(): the space holds no block")
    available = ["copy-new", "move-new", "sendrecv-new"]
    if _pair_candidates(space, whole=whole):
        available += ["copy", "move"]
    if _pair_candidates(space, whole=whole, other_worker=True):
        available.append("sendrecv")
    kind = draw(st.sampled_from(_kinds_to_draw("movements", MOVEMENT_KINDS, available, kinds)))
    if kind in ("copy", "move"):
        src, dst = draw(region_pairs(space, whole=whole))
        return (Copy if kind == "copy" else Move)(src, dst)
    if kind == "sendrecv":
        return SendRecv(*draw(region_pairs(space, other_worker=True, whole=whole)))
    new = _fresh_name(space)
    if kind == "move-new":
        return Move(draw(regions(space, whole=True)), new)
    src = draw(regions(space, whole=whole or None))
    if kind == "copy-new":
        return Copy(src, new)
    worker = draw(st.integers(0, 3).filter(lambda w: w != src.worker))
    return SendRecv(src, Block(new, src.shape, worker))


@st.composite
def endomorphisms(draw: st.DrawFn, space: Space, *, whole: bool = False) -> LinearOperator:
    """A leaf whose domain and range are both ``space``: Identity, Zero, Clear, Add, or an
    in-place Copy or Move; ``whole=True`` keeps every region a whole block."""
    kinds = ["identity", "zero"]
    if len(space):
        kinds.append("clear")
    if _pair_candidates(space, whole=whole):
        kinds += ["add", "copy", "move"]
    kind = draw(st.sampled_from(kinds))
    if kind == "identity":
        return Identity(space)
    if kind == "zero":
        return Zero(space, space)
    if kind == "clear":
        return Clear(draw(regions(space, whole=whole or None)))
    src, dst = draw(region_pairs(space, whole=whole))
    makers: dict[str, Callable[[Region, Region], LinearOperator]] = {"add": Add, "copy": Copy, "move": Move}
    return makers[kind](src, dst)


@st.composite
def operators(
    draw: st.DrawFn,
    space: Space | None = None,
    *,
    max_depth: int = 3,
    max_leaves: int = 6,
    complex: bool = True,
    whole: bool = False,
) -> LinearOperator:
    """Operator trees: leaves from :func:`primitives`, :func:`movements` and
    :func:`endomorphisms`, combined by composition, sum and scalar multiple.

    Parameters
    ----------
    space : Space, optional
        The domain of the tree; drawn from :func:`spaces` when omitted.
    max_depth : int
        Largest nesting depth of algebra nodes.
    max_leaves : int
        Largest number of leaves (nodes without children) in the tree.
    complex : bool
        Allow complex scalars.
    whole : bool
        Only whole-block regions: trees that have a size-free block form
        (:func:`verify.symbolic.prove_adjoint`). A drawn space then has blocks of one shape.
    """
    if space is None:
        space = draw(spaces(same_shape=whole))
    budget = [max(1, max_leaves)]

    def leaf(domain: Space) -> LinearOperator:
        budget[0] -= 1
        if not len(domain):
            return draw(primitives(domain, whole=whole))
        return draw(
            st.one_of(
                primitives(domain, whole=whole),
                movements(domain, whole=whole),
                endomorphisms(domain, whole=whole),
            )
        )

    def build(domain: Space, depth: int) -> LinearOperator:
        if depth <= 0 or budget[0] <= 1:
            return leaf(domain)
        kind = draw(st.sampled_from(["leaf", "compose", "sum", "scale"]))
        if kind == "leaf":
            return leaf(domain)
        if kind == "scale":
            return draw(scalars(complex=complex)) * build(domain, depth - 1)
        first = build(domain, depth - 1)
        if kind == "compose":
            if budget[0] <= 0:
                return first
            return build(first.range, depth - 1) @ first
        # a sum repeats ``first`` in its second term (e @ first): count its leaves again
        repeated = sum(1 for node in walk(first) if not node.children())
        if budget[0] < repeated + 1:
            return first
        budget[0] -= repeated + 1
        return first + draw(endomorphisms(first.range, whole=whole)) @ first

    return build(space, max_depth)


def _elements(dtype: np.dtype, bound: float) -> st.SearchStrategy[Any]:
    if dtype.kind == "c":
        width: Literal[64, 128] = 64 if dtype.itemsize == 8 else 128
        return st.complex_numbers(max_magnitude=bound, allow_nan=False, allow_infinity=False, width=width)
    if dtype.kind == "f":
        width_bits = cast(Literal[16, 32, 64], 8 * dtype.itemsize)  # hypothesis rejects other widths
        return st.floats(-bound, bound, width=width_bits, allow_subnormal=False)
    if dtype.kind in "iu":
        return st.integers(0 if dtype.kind == "u" else -9, 9)
    raise TypeError(f"states(): unsupported dtype {dtype}")


@st.composite
def states(
    draw: st.DrawFn,
    space: Space,
    *,
    dtype: npt.DTypeLike | st.SearchStrategy[np.dtype] = np.float64,
    bound: float = 1e3,
) -> dict[str, np.ndarray]:
    """A state of ``space``: one array per block, finite entries of magnitude at most ``bound``.

    ``dtype`` may be a dtype or a strategy of dtypes (e.g. :func:`dtypes`); one dtype is
    drawn for the whole state. Integer dtypes get entries in -9..9 (0..9 unsigned), whatever
    ``bound``.
    """
    chosen = np.dtype(draw(dtype) if isinstance(dtype, st.SearchStrategy) else dtype)
    elements = _elements(chosen, bound)
    return {b.name: draw(hnp.arrays(chosen, b.shape, elements=elements)) for b in space.blocks}


# -- examples per node type, for the registry proof (tests/test_registry.py) ----------------
# Each factory draws its own node type directly: a factory drawing several kinds, filtered to
# one, would throw most of its draws away (hypothesis then runs several times as many tests).
_EXAMPLE_SPACES = st.one_of(spaces(), spaces(same_shape=True))
"""Spaces for node examples: any shapes, or one shape (so whole blocks pair up). Built once:
hypothesis validates each new strategy object on its first draw, which costs more than the draw."""


@examples_for(Identity)
def _identities() -> st.SearchStrategy[LinearOperator]:
    return spaces().map(Identity)


@examples_for(Zero)
def _zeros() -> st.SearchStrategy[LinearOperator]:
    return st.tuples(spaces(), spaces()).map(lambda pair: Zero(*pair))


@st.composite
def _algebra_node(draw: st.DrawFn, node_type: type) -> LinearOperator:
    """A tree whose root is a ``node_type`` (Composition, Sum or Scaled) and whose operands are
    trees of :func:`operators`, on whole blocks or any regions."""
    space, whole = draw(_EXAMPLE_SPACES), draw(st.booleans())
    first = draw(operators(space, max_depth=2, max_leaves=2, whole=whole))
    if node_type is Scaled:
        return draw(scalars()) * first
    if node_type is Composition:
        return draw(operators(first.range, max_depth=2, max_leaves=2, whole=whole)) @ first
    return first + draw(endomorphisms(first.range, whole=whole)) @ first


@st.composite
def _leaf_node(
    draw: st.DrawFn, leaves: Callable[..., st.SearchStrategy[LinearOperator]], kinds: tuple[str, ...]
) -> LinearOperator:
    """A leaf of ``leaves`` (:func:`primitives` or :func:`movements`) of one of ``kinds``, on
    whole blocks or any regions."""
    return draw(leaves(draw(_EXAMPLE_SPACES), whole=draw(st.booleans()), kinds=kinds))


def _examples(strategy: st.SearchStrategy[LinearOperator]) -> Callable[[], st.SearchStrategy[LinearOperator]]:
    return lambda: strategy


for _algebra_type in (Composition, Sum, Scaled):
    examples_for(_algebra_type)(_examples(_algebra_node(_algebra_type)))
_PRIMITIVES: tuple[tuple[type, str], ...] = (
    (Allocate, "allocate"),
    (Deallocate, "deallocate"),
    (Clear, "clear"),
    (Add, "add"),
)
for _primitive_type, _kind in _PRIMITIVES:
    examples_for(_primitive_type)(_examples(_leaf_node(primitives, (_kind,))))
_COPIES = ("copy", "copy-new", "sendrecv", "sendrecv-new")  # SendRecv is a Copy: drawn by its factory
examples_for(Copy)(_examples(_leaf_node(movements, _COPIES)))
examples_for(Move)(_examples(_leaf_node(movements, ("move", "move-new"))))
examples_for(CopyAdjoint)(_examples(_leaf_node(movements, _COPIES).map(lambda op: op.H)))


# -- strategies of the distributed features: partitions, distributed tensors, halos ------------
from . import strategies_distributed as _distributed  # noqa: E402
from . import strategies_halo as _halo  # noqa: E402
from .strategies_distributed import *  # noqa: E402, F403
from .strategies_halo import *  # noqa: E402, F403

FEATURE_MODULES: tuple[str, ...] = (_distributed.__name__, _halo.__name__)
"""Modules whose public strategies this module re-exports."""

__all__ += [name for module in (_distributed, _halo) for name in module.__all__ if name not in __all__]
from . import strategies_frameworks as _frameworks  # noqa: E402, F401 - linop types for st.from_type, Lifted examples
from . import strategies_local as _local  # noqa: E402, F401 - registers the LocalOperator examples
from . import strategies_mesh as _mesh  # noqa: E402, F401 - registers the redistribute examples
from . import strategies_overlap as _overlap  # noqa: E402, F401 - registers the overlapped halo examples
from . import strategies_shims as _shims  # noqa: E402, F401 - registers the halo shim examples
