r"""All-gather and reduce-scatter algorithms (``docs/theory.md#collective-algorithms``).

The all-gather variants equal ``AllGather(tensor, (axis,), name)`` and the reduce-scatter
variants ``ReduceScatter(tensor, (axis,), name)``, for a :class:`~linop.DistributedTensor`
cut along one dimension ``axis`` over P workers (any sizes, empty shares included): chunk r
is block r's box along ``axis``, and the gathered block ``name[r]`` on worker r holds every
chunk. Costs for P ranks, N bytes gathered per rank (chunks of about N / P), P a power of two
(``docs/theory.md#cost-model``):

==================================  ==========================================================
variant                             modeled time
==================================  ==========================================================
allgather_ring                      (P-1) (alpha + beta N / P): in step s rank r passes chunk
                                    (r - s) mod P on to rank r + 1
allgather_recursive_doubling        log2 P alpha + (P-1)/P beta N: in round k rank r and
                                    r XOR 2^k exchange the 2^k chunks each holds
reduce_scatter_ring                 (P-1) (alpha + (beta + gamma) N / P)
reduce_scatter_recursive_halving    log2 P alpha + (P-1)/P (beta + gamma) N: each round halves
                                    the segment a rank is responsible for
==================================  ==========================================================

The adjoint of each all-gather is the matching reduce-scatter run backwards, and the other way
round: ``allgather_ring(...).H`` equals ``reduce_scatter_ring(...)`` (both are RS = AG*) and
sends the same messages. For P not a power of two the recursive variants fold rank 2i into
rank 2i + 1 (i < P - p2) first, as in :mod:`linop.algorithms.allreduce`.
"""

from __future__ import annotations

from ..collectives import AllGather, ReduceScatter
from ..operator import LinearOperator
from ..partition import DistributedTensor
from .common import AlgorithmError, Fold, Steps, fold

__all__ = [
    "allgather_recursive_doubling",
    "allgather_ring",
    "gather_axis",
    "reduce_scatter_recursive_halving",
    "reduce_scatter_ring",
]


def gather_axis(kind: str, tensor: DistributedTensor) -> int:
    """The one dimension along which ``tensor`` is cut (0 when it is not cut at all).

    Raises
    ------
    AlgorithmError
        If ``tensor`` is not a DistributedTensor or is cut along more than one dimension.
    """
    if not isinstance(tensor, DistributedTensor):
        raise AlgorithmError(f"{kind}: expected a DistributedTensor, not {type(tensor).__name__}")
    cut = [d for d, n in enumerate(tensor.partition.shape) if n > 1]
    if len(cut) > 1:
        raise AlgorithmError(
            f"{kind}: tensor {tensor.name!r} is cut along dimensions {cut} of partition "
            f"{tensor.partition.shape}; these algorithms gather along one dimension"
        )
    if tensor.ndim == 0:
        raise AlgorithmError(f"{kind}: tensor {tensor.name!r} is a scalar")
    return cut[0] if cut else 0


class _Chunks:
    """Blocks, gathered blocks and chunk bounds of an all-gather along one axis."""

    def __init__(self, kind: str, tensor: DistributedTensor, name: str) -> None:
        self.axis = gather_axis(kind, tensor)
        self.gather = AllGather(tensor, (self.axis,), name)
        indices = list(tensor.partition.indices())
        self.blocks = [tensor.block(i) for i in indices]
        self.gathered = [self.gather.gathered.block(i) for i in indices]
        self.bounds = [(tensor.box(i)[0][self.axis], tensor.box(i)[1][self.axis]) for i in indices]

    @property
    def size(self) -> int:
        return len(self.blocks)

    def span(self, first: int, last: int) -> tuple[int, int]:
        """Bounds of chunks ``first .. last - 1`` together."""
        return self.bounds[first][0], self.bounds[last - 1][1]


def _fold_span(chunks: _Chunks, plan: Fold, first: int, count: int) -> tuple[int, int]:
    """Bounds of the chunks that new ranks ``first .. first + count - 1`` stand for."""
    return chunks.span(plan.chunks[first][0], plan.chunks[first + count - 1][1])


def _nonempty(bounds: tuple[int, int]) -> bool:
    return bounds[1] > bounds[0]


def _start_gather(chunks: _Chunks, steps: Steps) -> None:
    for block, gathered, chunk in zip(chunks.blocks, chunks.gathered, chunks.bounds):
        steps.allocate(gathered)
        if _nonempty(chunk):
            steps.copy(steps.region(block.name), steps.region(gathered.name, chunk, chunks.axis))
    for block in chunks.blocks:
        steps.drop(block.name)


def allgather_ring(tensor: DistributedTensor, name: str) -> LinearOperator:
    r"""Ring all-gather: each rank copies its chunk into its gathered block, then in step s
    (s = 0 .. P-2) rank r sends chunk (r - s) mod P to rank r + 1.

    .. math:: g_j = [x_0; x_1; \ldots; x_{P-1}] \ (\text{every } j), \qquad \text{adjoint:
        the ring reduce-scatter}

    Parameters
    ----------
    tensor : DistributedTensor
        Cut along one dimension.
    name : str
        Prefix of the gathered blocks (as for :class:`~linop.AllGather`).

    Raises
    ------
    AlgorithmError
        If ``tensor`` is cut along more than one dimension.
    """
    chunks = _Chunks("allgather_ring", tensor, name)
    steps = Steps(tensor.space)
    _start_gather(chunks, steps)
    size, names = chunks.size, [g.name for g in chunks.gathered]
    for s in range(size - 1):
        for r in range(size):
            chunk = chunks.bounds[(r - s) % size]
            if _nonempty(chunk):
                steps.copy(
                    steps.region(names[r], chunk, chunks.axis),
                    steps.region(names[(r + 1) % size], chunk, chunks.axis),
                )
    return steps.operator()


def allgather_recursive_doubling(tensor: DistributedTensor, name: str) -> LinearOperator:
    r"""Recursive doubling: in round k new rank q and q XOR 2^k exchange the chunks each has
    gathered so far (2^k new ranks' worth), doubling them.

    .. math:: g_j = [x_0; \ldots; x_{P-1}], \quad \log_2 P \text{ rounds}; \qquad
        \text{adjoint: the recursive-halving reduce-scatter}

    For P not a power of two rank 2i first sends its chunk to rank 2i + 1 (i < P - p2), and
    receives the whole gathered block from it at the end.
    """
    chunks = _Chunks("allgather_recursive_doubling", tensor, name)
    steps = Steps(tensor.space)
    _start_gather(chunks, steps)
    names = [g.name for g in chunks.gathered]
    plan = fold(chunks.size)
    axis = chunks.axis
    for low, high in plan.folded:
        if _nonempty(chunks.bounds[low]):
            steps.copy(
                steps.region(names[low], chunks.bounds[low], axis),
                steps.region(names[high], chunks.bounds[low], axis),
            )
    distance = 1
    while distance < plan.p2:
        for q in range(plan.p2):
            partner = q ^ distance
            mine = _fold_span(chunks, plan, q & ~(distance - 1), distance)
            if _nonempty(mine):
                src, dst = names[plan.participants[q]], names[plan.participants[partner]]
                steps.copy(steps.region(src, mine, axis), steps.region(dst, mine, axis))
        distance *= 2
    for low, high in plan.folded:
        steps.copy(steps.region(names[high]), steps.region(names[low]))
    return steps.operator()


def _finish_scatter(chunks: _Chunks, steps: Steps, ranks: list[int]) -> None:
    for r in ranks:
        gathered, block = chunks.gathered[r], chunks.blocks[r]
        steps.copy(steps.region(gathered.name, chunks.bounds[r], chunks.axis), block)
        steps.drop(gathered.name)


def _scatter_steps(kind: str, tensor: DistributedTensor, name: str) -> tuple[_Chunks, Steps]:
    chunks = _Chunks(kind, tensor, name)
    ReduceScatter(tensor, (chunks.axis,), name)  # validates like the collective
    return chunks, Steps(chunks.gather.range)


def reduce_scatter_ring(tensor: DistributedTensor, name: str) -> LinearOperator:
    r"""Ring reduce-scatter: in step s (s = 0 .. P-2) rank r adds chunk (r - 1 - s) mod P of its
    gathered block into rank r + 1's; after P - 1 steps rank r holds the sum of chunk r.

    .. math:: x_i = \sum_j g_j\big|_{\text{chunk } i}, \qquad \text{adjoint: the ring all-gather}

    Parameters mean what they mean for :func:`allgather_ring` (the domain holds the gathered
    blocks, the range the tensor's blocks).
    """
    chunks, steps = _scatter_steps("reduce_scatter_ring", tensor, name)
    size, names, axis = chunks.size, [g.name for g in chunks.gathered], chunks.axis
    for s in range(size - 1):
        for r in range(size):
            chunk = chunks.bounds[(r - 1 - s) % size]
            if _nonempty(chunk):
                steps.add(
                    steps.region(names[r], chunk, axis), steps.region(names[(r + 1) % size], chunk, axis)
                )
    _finish_scatter(chunks, steps, list(range(size)))
    return steps.operator()


def reduce_scatter_recursive_halving(tensor: DistributedTensor, name: str) -> LinearOperator:
    r"""Recursive halving: in round k (distance d = p2 / 2^{k+1}) new rank q and q XOR d split
    the segment of chunks they share; each adds the half it gives up into the partner's.

    .. math:: x_i = \sum_j g_j\big|_{\text{chunk } i}, \quad \log_2 P \text{ rounds}; \qquad
        \text{adjoint: the recursive-doubling all-gather}

    For P not a power of two rank 2i first adds its whole gathered block into rank 2i + 1's
    (i < P - p2), and receives its own chunk of the sum from it at the end.
    """
    chunks, steps = _scatter_steps("reduce_scatter_recursive_halving", tensor, name)
    names, axis = [g.name for g in chunks.gathered], chunks.axis
    plan = fold(chunks.size)
    for low, high in plan.folded:
        steps.add(steps.region(names[low]), steps.region(names[high]))
        steps.drop(names[low])
    distance = plan.p2 // 2
    while distance >= 1:
        for q in range(plan.p2):
            partner = q ^ distance
            base = q & ~(2 * distance - 1)
            give = _fold_span(chunks, plan, base + distance if q < partner else base, distance)
            if _nonempty(give):
                src, dst = names[plan.participants[q]], names[plan.participants[partner]]
                steps.add(steps.region(src, give, axis), steps.region(dst, give, axis))
        distance //= 2
    for low, high in plan.folded:
        block = chunks.blocks[low]
        if _nonempty(chunks.bounds[low]):
            steps.copy(steps.region(names[high], chunks.bounds[low], axis), block)
        else:  # an empty share: nothing to send
            steps.allocate(block)
    _finish_scatter(chunks, steps, list(plan.participants))
    return steps.operator()
