"""Hypothesis strategy for random data-movement trees over a given number of workers.

Every kind of node the MPI interpreter handles appears: in-place and out-of-place copies and
moves (within a worker and across workers, where copies become send-receives), adjoints of
copies, adds, clears, allocations, deallocations, scalings and sums. Draws depend only on the
strategy's seed, so with ``derandomize=True`` every rank builds the same tree.
"""

from __future__ import annotations

from hypothesis import strategies as st

from linop import (
    Add,
    Allocate,
    Block,
    Clear,
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
)

KINDS = (
    "copy",
    "copy_new",
    "copy_adjoint",
    "copy_adjoint_new",
    "move",
    "move_new",
    "add",
    "clear",
    "allocate",
    "deallocate",
    "scale",
    "sum",
)


@st.composite
def shapes(draw, ndim=None):
    ndim = draw(st.integers(0, 2)) if ndim is None else ndim
    return tuple(draw(st.integers(1, 4)) for _ in range(ndim))


@st.composite
def boxes(draw, space: Space, name: str) -> Region:
    block = space.block(name)
    index = []
    for n in block.shape:
        start = draw(st.integers(0, n - 1))
        stop = draw(st.integers(start + 1, n))
        index.append(slice(start, stop))
    return space[name][tuple(index)]


@st.composite
def region_pairs(draw, space: Space):
    """Two disjoint regions of the same shape, or None when the draw finds none."""
    src = draw(boxes(space, draw(st.sampled_from(space.names))))
    fits = [
        b.name for b in space if b.ndim == len(src.shape) and all(n >= m for n, m in zip(b.shape, src.shape))
    ]
    name = draw(st.sampled_from(fits))
    block = space.block(name)
    start = [draw(st.integers(0, n - m)) for n, m in zip(block.shape, src.shape)]
    dst = space[name][tuple(slice(a, a + m) for a, m in zip(start, src.shape))]
    if src.overlaps(dst) or (src.name == dst.name and len(src.shape) == 0):
        return None
    return src, dst


def _copy(src: Region, dst: Region | Block) -> LinearOperator:
    return SendRecv(src, dst) if src.worker != dst.worker else Copy(src, dst)


@st.composite
def movement_trees(draw, workers: int, max_steps: int = 6) -> LinearOperator:
    """A random tree of data movement on blocks spread over ``workers`` workers."""
    worker = st.integers(0, workers - 1)
    count = draw(st.integers(1, 3))
    space = Space(Block(f"b{i}", draw(shapes()), draw(worker)) for i in range(count))
    op: LinearOperator = Identity(space)
    fresh = iter(range(1000))
    wanted, placed = draw(st.integers(2, max_steps)), 0
    for _ in range(3 * max_steps):
        if placed >= wanted:
            break
        space = op.range
        kind = draw(st.sampled_from(KINDS))
        node: LinearOperator | None = None
        if kind in ("copy", "move", "add", "copy_adjoint"):
            pair = draw(region_pairs(space))
            if pair is not None:
                src, dst = pair
                node = {"copy": _copy, "move": Move, "add": Add, "copy_adjoint": lambda a, b: _copy(a, b).H}[
                    kind
                ](src, dst)
        elif kind == "copy_new":
            src = draw(boxes(space, draw(st.sampled_from(space.names))))
            node = _copy(src, Block(f"n{next(fresh)}", src.shape, draw(worker)))
        elif kind == "copy_adjoint_new" and len(space) > 1:
            dropped = space.block(draw(st.sampled_from(space.names)))
            rest = space.without(dropped.name)
            fits = [
                b.name
                for b in rest
                if b.ndim == dropped.ndim and all(n >= m for n, m in zip(b.shape, dropped.shape))
            ]
            if fits:
                name = draw(st.sampled_from(fits))
                start = [draw(st.integers(0, n - m)) for n, m in zip(rest.block(name).shape, dropped.shape)]
                src = rest[name][tuple(slice(a, a + m) for a, m in zip(start, dropped.shape))]
                node = CopyAdjoint(src, dropped) if src.worker == dropped.worker else _copy(src, dropped).H
        elif kind == "move_new":
            src = space[draw(st.sampled_from(space.names))]
            node = Move(src, Block(f"n{next(fresh)}", src.shape, draw(worker)))
        elif kind == "clear":
            node = Clear(draw(boxes(space, draw(st.sampled_from(space.names)))))
        elif kind == "allocate":
            node = Allocate(space, Block(f"n{next(fresh)}", draw(shapes()), draw(worker)))
        elif kind == "deallocate" and len(space) > 1:
            node = Deallocate(space, draw(st.sampled_from(space.names)))
        elif kind == "scale":
            op, placed = Scaled(draw(st.sampled_from([-1, 2, 3])), op), placed + 1
        elif kind == "sum":
            op, placed = Sum((op, Scaled(-2, op))), placed + 1
        if node is not None:
            op, placed = node @ op, placed + 1
    return op
