r"""All-to-all algorithms (``docs/theory.md#collective-algorithms``).

An all-to-all is a :class:`~linop.Repartition` between two decompositions of one global array
over the same workers: the piece x_i ∩ y_j travels from worker i to worker j. Both variants
equal ``Repartition(x, y)``. The classic personalized all-to-all is the case of a 2-d array cut
by rows on ``x`` (partition P x 1) and by columns on ``y`` (partition 1 x P), built by
:func:`alltoall_tensors`: worker o sends the piece (rows of o, columns of d) to worker d.

Costs for P ranks, each sending N bytes in all (N / P per destination), P a power of two
(``docs/theory.md#cost-model``):

====================  ==================================================================
variant               modeled time
====================  ==================================================================
alltoall_pairwise     (P-1) (alpha + beta N / P): in step s rank r sends to r + s
alltoall_bruck        log2 P (alpha + beta N / 2): in round k every rank packs the pieces
                      whose distance (d - o) mod P has bit k set and sends them 2^k ranks on
====================  ==================================================================

Bruck trades bandwidth for latency (each piece travels once per set bit of its distance); it
packs pieces side by side along the columns, so it needs every row share to be equal (column
shares may differ). The adjoint of either is the reverse algorithm: the same messages sent
back, which is the reverse repartition.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..operator import LinearOperator
from ..partition import DistributedTensor, Partition
from ..repartition import Repartition, overlaps
from ..space import Block
from .common import AlgorithmError, Steps

__all__ = ["alltoall_bruck", "alltoall_pairwise", "alltoall_tensors"]


def alltoall_tensors(
    rows: Sequence[int],
    columns: Sequence[int],
    *,
    names: tuple[str, str] = ("x", "y"),
    workers: Sequence[int] | None = None,
) -> tuple[DistributedTensor, DistributedTensor]:
    """The two layouts of a personalized all-to-all among ``len(rows)`` workers.

    ``x`` cuts a ``(sum(rows), sum(columns))`` array by rows (worker o holds ``rows[o]`` rows),
    ``y`` by columns; piece (o, d) has shape ``(rows[o], columns[d])``.

    Raises
    ------
    AlgorithmError
        If ``rows`` and ``columns`` have different lengths.
    """
    rows, columns = tuple(rows), tuple(columns)
    if len(rows) != len(columns):
        raise AlgorithmError(f"alltoall_tensors: {len(rows)} row shares but {len(columns)} column shares")
    size = len(rows)
    workers = tuple(range(size)) if workers is None else tuple(workers)
    shape = (sum(rows), sum(columns))
    x = DistributedTensor(names[0], shape, Partition((size, 1), workers), sizes=(rows, (shape[1],)))
    y = DistributedTensor(names[1], shape, Partition((1, size), workers), sizes=((shape[0],), columns))
    return x, y


def _positions(kind: str, x: DistributedTensor, y: DistributedTensor) -> dict[int, int]:
    if not isinstance(x, DistributedTensor) or not isinstance(y, DistributedTensor):
        raise AlgorithmError(f"{kind}: x and y must be DistributedTensors")
    if sorted(x.partition.workers) != sorted(y.partition.workers):
        raise AlgorithmError(
            f"{kind}: tensors {x.name!r} and {y.name!r} live on different workers "
            f"({list(x.partition.workers)} and {list(y.partition.workers)})"
        )
    return {w: k for k, w in enumerate(x.partition.workers)}


def alltoall_pairwise(x: DistributedTensor, y: DistributedTensor) -> LinearOperator:
    r"""Pairwise exchange: every piece stays or goes in step s = (position of its destination
    - position of its source) mod P; step 0 is local copies.

    .. math:: y_j[\text{box}] = x_i[\text{box}] \text{ for every intersection}, \qquad
        \text{adjoint: the reverse pairwise exchange}

    Parameters
    ----------
    x, y : DistributedTensor
        Two decompositions of one global shape over the same set of workers.

    Raises
    ------
    AlgorithmError
        If the two tensors live on different worker sets.
    """
    position = _positions("alltoall_pairwise", x, y)
    reference = Repartition(x, y)
    size = len(position)
    steps = Steps(reference.domain)
    for block in y.blocks:
        steps.allocate(block)
    pieces = []
    for i, j, box in overlaps(x, y):
        shift = (position[y.partition.worker(j)] - position[x.partition.worker(i)]) % size
        pieces.append((shift, position[x.partition.worker(i)], i, j, box))
    pieces.sort(key=lambda p: (p[0], p[1]))
    for _, _, i, j, box in pieces:
        steps.copy(x.region(i, box, steps.space), y.region(j, box, steps.space))
    for block in x.blocks:
        steps.drop(block.name)
    return steps.operator()


def alltoall_bruck(x: DistributedTensor, y: DistributedTensor) -> LinearOperator:
    r"""Bruck's all-to-all for x cut by rows (P x 1) and y by columns (1 x P) on the same
    workers in the same order: ceil(log2 P) rounds of one packed message per rank.

    .. math:: y_d[\text{rows of } o, :] = x_o[:, \text{columns of } d], \qquad
        \text{adjoint: the same rounds backwards}

    Piece (o, d) moves 2^k ranks on in every round k whose bit is set in (d - o) mod P; in each
    round a rank packs the pieces it sends side by side into one block
    (``<y>~bruck<k>[<rank>]``), sends it, and the receiver reads them from there later.

    Raises
    ------
    AlgorithmError
        If the layouts are not rows-by-columns on one worker order, or the row shares differ.
    """
    _positions("alltoall_bruck", x, y)
    size = x.partition.size
    if (
        x.partition.shape != (size, 1)
        or y.partition.shape != (1, size)
        or x.partition.workers != y.partition.workers
        or x.global_shape != y.global_shape
    ):
        raise AlgorithmError(
            f"alltoall_bruck: needs {x.name!r} on a P x 1 and {y.name!r} on a 1 x P partition of the same "
            f"workers in the same order, got {x.partition} and {y.partition}"
        )
    rows = x.sizes[0]
    if len(set(rows)) > 1:
        raise AlgorithmError(
            f"alltoall_bruck: the row shares of {x.name!r} differ ({list(rows)}); they must be equal"
        )
    height = rows[0]
    col_bounds = [(y.box((0, d))[0][1], y.box((0, d))[1][1]) for d in range(size)]
    workers = x.partition.workers
    steps = Steps(Repartition(x, y).domain)
    for block in y.blocks:
        steps.allocate(block)
    # where each non-empty piece (o, d) is: (block name, first column, last column + 1)
    where: dict[tuple[int, int], tuple[str, int, int]] = {}
    holder: dict[tuple[int, int], int] = {}
    users: dict[str, int] = {}
    temporaries: set[str] = set()  # received packs, dropped once their last piece moves on
    for o in range(size):
        for d in range(size):
            lo, hi = col_bounds[d]
            if hi > lo and height > 0:
                where[(o, d)] = (x.block_name((o, 0)), lo, hi)
                holder[(o, d)] = o
    for name, _, _ in where.values():
        users[name] = users.get(name, 0) + 1

    def region(piece: tuple[int, int]):
        name, lo, hi = where[piece]
        return steps.space[name][:, lo:hi]

    def release(name: str) -> None:
        users[name] -= 1
        if users[name] == 0 and name in temporaries:
            steps.drop(name)

    step, k = 1, 0
    while step < size:
        packs = []
        for w in range(size):
            moving = sorted(p for p in where if holder[p] == w and ((p[1] - p[0]) % size) & step)
            if not moving:
                continue
            width = sum(where[p][2] - where[p][1] for p in moving)
            pack = steps.temporary(f"{y.name}~bruck{k}[{w}]")
            steps.allocate(Block(pack, (height, width), workers[w]))
            offset, placed = 0, []
            for p in moving:
                n = where[p][2] - where[p][1]
                steps.copy(region(p), steps.space[pack][:, offset : offset + n])
                placed.append((p, offset, offset + n))
                offset += n
            packs.append((w, pack, placed, width))
        arrivals = []
        for w, pack, placed, width in packs:
            target = (w + step) % size
            received = steps.temporary(f"{y.name}~bruck{k}>[{target}]")
            steps.copy(steps.space[pack], Block(received, (height, width), workers[target]))
            arrivals.append((pack, received, placed, target))
        for pack, received, placed, target in arrivals:
            steps.drop(pack)
            for p, lo, hi in placed:
                release(where[p][0])
                where[p] = (received, lo, hi)
                holder[p] = target
            users[received] = len(placed)
            temporaries.add(received)
        step, k = step * 2, k + 1
    for o, d in sorted(where):
        row = x.box((o, 0))[0][0]
        steps.copy(region((o, d)), steps.space[y.block_name((0, d))][row : row + height, :])
        release(where[(o, d)][0])
    for block in x.blocks:
        steps.drop(block.name)
    return steps.operator()
