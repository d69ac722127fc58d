"""Collectives benchmark: the numpy interpreter's fast paths against hand-written numpy doing the
same moves, and the cost of building and proving the operators.

Prints figures; nothing is asserted. Run: ``python benchmarks/bench_collectives.py``.
"""

from __future__ import annotations

import time

import numpy as np
from _timing import compare

from linop.backends.numpy import apply
from linop.backends.sparse import matrix_of
from linop.collectives import AllGather, AllReduce, BlockGrid, Broadcast, SumReduce
from linop.operator import expand_all
from linop.partition import DistributedTensor, Partition
from linop.repartition import Repartition

N = 4096
REPEATS = 7


def by_hand_repartition(x: DistributedTensor, y: DistributedTensor, state: dict) -> dict:
    """The same moves written directly: one slice copy per intersection."""
    out = {}
    for j in y.partition.indices():
        y_start, y_stop = y.box(j)
        block = np.empty(tuple(b - a for a, b in zip(y_start, y_stop)), dtype=np.float64)
        for i in x.partition.indices():
            x_start, x_stop = x.box(i)
            lo = [max(a, b) for a, b in zip(x_start, y_start)]
            hi = [min(a, b) for a, b in zip(x_stop, y_stop)]
            if all(a < b for a, b in zip(lo, hi)):
                block[tuple(slice(a - s, b - s) for a, b, s in zip(lo, hi, y_start))] = state[
                    x.block_name(i)
                ][tuple(slice(a - s, b - s) for a, b, s in zip(lo, hi, x_start))]
        out[y.block_name(j)] = block
    return out


def row(label: str, ours, theirs) -> None:
    """Time both alternately (:func:`_timing.compare`); print the medians and the median ratio."""
    t_ours, t_theirs, ratio = compare(ours, theirs, REPEATS)
    print(
        f"  {label:44s} linop {t_ours * 1e3:8.2f} ms   numpy {t_theirs * 1e3:8.2f} ms   ratio {ratio:5.2f}x"
    )


def main() -> None:
    x = DistributedTensor("x", (N, N), Partition.grid((4, 1)))
    y = DistributedTensor("y", (N, N), Partition.grid((3, 4), first=4))
    repartition = Repartition(x, y)
    state = x.scatter(np.random.default_rng(0).standard_normal((N, N)))
    moved = repartition(state)
    assert np.array_equal(y.gather(moved), x.gather(state))

    print(f"numpy interpreter against hand-written numpy ({N}x{N} float64, median of {REPEATS})")
    row(
        "repartition 4x1 -> 3x4 (disjoint workers)",
        lambda: repartition(state),
        lambda: by_hand_repartition(x, y, state),
    )
    expanded = expand_all(repartition)
    row(
        "  same, through the primitive expansion",
        lambda: apply(expanded, state),
        lambda: by_hand_repartition(x, y, state),
    )

    row_tensor = DistributedTensor("r", (N // 4, N), Partition.grid((1, 4)))
    copies = Partition.grid((4, 4), first=4)
    broadcast = Broadcast(row_tensor, copies, "c")
    row_state = row_tensor.scatter(np.ones((N // 4, N)))
    row(
        "broadcast 1x4 -> 4x4 (4 copies of each block)",
        lambda: broadcast(row_state),
        lambda: {k: row_state[f"r[0,{k % 4}]"].copy() for k in range(16)},
    )
    copied = broadcast(row_state)
    reduce = SumReduce(row_tensor, copies, "c")
    names = [broadcast.copies.block_name((i, j)) for i in range(4) for j in range(4)]

    def reduce_by_hand() -> dict:
        out = {}
        for j in range(4):
            total = copied[names[j]].copy()
            for i in range(1, 4):
                total += copied[names[4 * i + j]]
            out[j] = total
        return out

    row("sum-reduce 4x4 -> 1x4", lambda: reduce(copied), reduce_by_hand)
    all_reduce = AllReduce(BlockGrid.of(broadcast.copies), (0,))

    def all_reduce_by_hand() -> dict:
        # every member owns its sum, as in linop's result: the first row keeps it, the others copy
        totals = reduce_by_hand()
        return {name: totals[k % 4] if k < 4 else totals[k % 4].copy() for k, name in enumerate(names)}

    row("all-reduce over axis 0 of 4x4", lambda: all_reduce(copied), all_reduce_by_hand)
    gather = AllGather(x, (0,), "g")

    def all_gather_by_hand() -> dict:
        out = {}
        for k in range(4):  # every member assembles the whole column of blocks
            whole = np.empty((N, N))
            for i in range(4):
                start, stop = x.box((i, 0))
                whole[start[0] : stop[0]] = state[x.block_name((i, 0))]
            out[k] = whole
        return out

    row("all-gather along axis 0 of 4x1", lambda: gather(state), all_gather_by_hand)

    print("\nexact adjoint proof of a repartition 4x1 -> 3x4 (build the node, both matrices, compare)")
    for n in (256, 1024):
        small_x = DistributedTensor("x", (n, n), Partition.grid((4, 1)))
        small_y = DistributedTensor("y", (n, n), Partition.grid((3, 4), first=4))
        start = time.perf_counter()
        op = Repartition(small_x, small_y)
        ok = (op.H.to_sparse() != op.to_sparse().T).nnz == 0
        fast = time.perf_counter() - start
        line = f"  {n}x{n}: proven={ok}  sparse fast path {fast:.3f} s"
        if n <= 256:
            start = time.perf_counter()
            ok = (matrix_of(op.H.expand()) != matrix_of(op.expand()).T).nnz == 0
            line += f"   through the expansion {time.perf_counter() - start:.3f} s (proven={ok})"
        print(line)


if __name__ == "__main__":
    main()
