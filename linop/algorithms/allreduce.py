r"""All-reduce algorithms as trees of send-receives and adds (``docs/theory.md#collective-algorithms``).

Every function takes a layout whose blocks all have one shape (one block per worker of its
partition, members in C order of grid index; rank r is the r-th member) and returns a tree
equal to ``AllReduce(tensor, all axes)``: x_j <- sum_k x_k for every j, in place. They differ
in the messages they send. For P ranks, n bytes per block, a message costing alpha + beta n
and an add gamma n (``docs/theory.md#cost-model``), with P a power of two:

================================  ============================================================
variant                           modeled time
================================  ============================================================
reduce_broadcast_linear           2 (P-1) (alpha + beta n) + (P-1) gamma n: everyone adds into
                                  rank 0, which sends the sum back to everyone
reduce_broadcast_binomial         2 log2 P (alpha + beta n) + log2 P gamma n: the survey's "two
                                  trees" (binomial reduce, then binomial broadcast)
recursive_doubling                log2 P (alpha + beta n + gamma n): the butterfly; in round k
                                  rank r exchanges its whole partial sum with rank r XOR 2^k
ring                              2 (P-1) (alpha + beta n / P) + (P-1) gamma n / P: a ring
                                  reduce-scatter of P chunks, then a ring all-gather
rabenseifner                      2 log2 P alpha + 2 (P-1)/P beta n + (P-1)/P gamma n:
                                  reduce-scatter by recursive halving, all-gather by recursive
                                  doubling
================================  ============================================================

These are the survey's formulas (Ben-Nun and Hoefler, section 2.5) with the adds' cost made
explicit; with gamma = 0 they are its T_tree, T_bfly, T_pipe and T_rabe. When P is not a power
of two, recursive doubling and Rabenseifner first fold the P - p2 extra ranks into their
neighbours (rank 2i adds its block into rank 2i + 1, i < P - p2, p2 the largest power of two
<= P), run on the p2 participants and send the result back: two more messages on the
critical path. Chunks are cut along the blocks' first dimension with balanced sizes, so any
block length works (chunks may be empty; empty messages are not sent).

Every variant is self-adjoint as an operator (all-reduce is B R); the adjoint tree of a variant
is the same algorithm run backwards (the same messages, reversed, with copies and adds
exchanged).
"""

from __future__ import annotations

from ..collectives import AllReduce, Layout
from ..operator import LinearOperator
from ..space import Block
from .common import AlgorithmError, Fold, Steps, balanced_bounds, fold

__all__ = [
    "allreduce_rabenseifner",
    "allreduce_recursive_doubling",
    "allreduce_reduce_broadcast_binomial",
    "allreduce_reduce_broadcast_linear",
    "allreduce_ring",
    "reference",
]


def reference(tensor: Layout) -> AllReduce:
    """The mathematical all-reduce over every axis of ``tensor``'s partition."""
    return AllReduce(tensor, tuple(range(tensor.partition.ndim)))


def _members(kind: str, tensor: Layout) -> list[Block]:
    if not isinstance(tensor, Layout):
        raise AlgorithmError(
            f"{kind}: expected a DistributedTensor or a BlockGrid, not {type(tensor).__name__}"
        )
    reference(tensor)  # validates the shapes
    return [tensor.block(i) for i in tensor.partition.indices()]


def _first_extent(kind: str, block: Block) -> int:
    if not block.shape:
        raise AlgorithmError(f"{kind}: block {block.name!r} is a scalar; chunked algorithms need a dimension")
    return block.shape[0]


def _chunked(kind: str, tensor: Layout) -> tuple[list[str], int]:
    """The members' block names and the extent of their first dimension (the one cut in chunks)."""
    blocks = _members(kind, tensor)
    return [b.name for b in blocks], _first_extent(kind, blocks[0])


def allreduce_reduce_broadcast_linear(tensor: Layout) -> LinearOperator:
    r"""Every rank adds its block into rank 0's, which sends the sum back to every rank.

    .. math:: x_j \leftarrow \sum_k x_k, \qquad A = B R \text{ (linear } R \text{ and } B)
    """
    blocks = _members("allreduce_reduce_broadcast_linear", tensor)
    steps = Steps(tensor.space)
    root = blocks[0].name
    for b in blocks[1:]:
        steps.add(steps.region(b.name), steps.region(root))
    for b in blocks[1:]:
        steps.copy(steps.region(root), steps.region(b.name))
    return steps.operator()


def allreduce_reduce_broadcast_binomial(tensor: Layout) -> LinearOperator:
    r"""A binomial reduce onto rank 0, then a binomial broadcast from it ("two trees").

    .. math:: x_j \leftarrow \sum_k x_k, \qquad 2 \lceil \log_2 P \rceil \text{ dependent rounds}
    """
    blocks = _members("allreduce_reduce_broadcast_binomial", tensor)
    names = [b.name for b in blocks]
    size = len(names)
    steps = Steps(tensor.space)
    step = 1
    while step < size:
        senders = list(range(step, size, 2 * step))
        senders.sort(key=lambda r: not (step > 1 and r + step // 2 < size))
        for r in senders:
            steps.add(steps.region(names[r]), steps.region(names[r - step]))
        step *= 2
    step //= 2
    while step >= 1:  # the reduce's rounds backwards: rank r sends the sum to rank r + step
        senders = [r for r in range(0, size, 2 * step) if r + step < size]
        senders.sort(key=lambda r: r % (4 * step) == 0)  # informed last round first
        for r in senders:
            steps.copy(steps.region(names[r]), steps.region(names[r + step]))
        step //= 2
    return steps.operator()


def _fold_in(steps: Steps, names: list[str], folding: Fold) -> None:
    for low, high in folding.folded:
        steps.add(steps.region(names[low]), steps.region(names[high]))


def _fold_out(steps: Steps, names: list[str], folding: Fold) -> None:
    for low, high in folding.folded:
        steps.copy(steps.region(names[high]), steps.region(names[low]))


def allreduce_recursive_doubling(tensor: Layout) -> LinearOperator:
    r"""The butterfly: in round k rank r and rank r XOR 2^k exchange their partial sums and
    both add; ranks beyond the largest power of two are folded in first and served last.

    .. math:: x_j \leftarrow \sum_k x_k, \qquad \log_2 P \text{ rounds of whole-block exchanges}

    Each exchange receives into a temporary block (``<block>+rd<2^k>``), adds it and drops it.
    """
    blocks = _members("allreduce_recursive_doubling", tensor)
    names = [b.name for b in blocks]
    folding = fold(len(names))
    steps = Steps(tensor.space)
    _fold_in(steps, names, folding)
    mask = 1
    while mask < folding.p2:
        exchanges = []
        for k in range(folding.p2):
            receiver = blocks[folding.participants[k ^ mask]]
            temp = steps.temporary(f"{receiver.name}+rd{mask}")
            sending = names[folding.participants[k]]
            steps.copy(steps.region(sending), Block(temp, receiver.shape, receiver.worker))
            exchanges.append((temp, receiver.name))
        for temp, target in exchanges:
            steps.add(steps.region(temp), steps.region(target))
        for temp, _ in exchanges:
            steps.drop(temp)
        mask *= 2
    _fold_out(steps, names, folding)
    return steps.operator()


def allreduce_ring(tensor: Layout) -> LinearOperator:
    r"""Ring (pipeline): a ring reduce-scatter of P chunks, then a ring all-gather.

    .. math:: x_j \leftarrow \sum_k x_k, \qquad 2 (P-1) \text{ rounds of chunks of } n/P

    In reduce-scatter step s rank r adds its chunk (r - 1 - s) mod P into rank r + 1's; after
    P - 1 steps rank r holds the whole sum of chunk r. In all-gather step s rank r sends chunk
    (r - s) mod P to rank r + 1.

    Raises
    ------
    AlgorithmError
        If the blocks are scalars.
    """
    names, extent = _chunked("allreduce_ring", tensor)
    size = len(names)
    bounds = balanced_bounds(extent, size)
    steps = Steps(tensor.space)
    for shift, move in ((1, steps.add), (0, steps.copy)):  # the reduce-scatter, then the all-gather
        for s in range(size - 1):
            for r in range(size):
                chunk = bounds[(r - shift - s) % size]
                if chunk[1] > chunk[0]:
                    move(steps.region(names[r], chunk), steps.region(names[(r + 1) % size], chunk))
    return steps.operator()


def allreduce_rabenseifner(tensor: Layout) -> LinearOperator:
    r"""Rabenseifner: reduce-scatter by recursive halving, all-gather by recursive doubling.

    .. math:: x_j \leftarrow \sum_k x_k, \qquad 2 \log_2 P \text{ rounds}, \quad
        2 (P-1)/P \cdot n \text{ bytes per rank}

    In halving round k (distance d = p2 / 2^{k+1}) new rank q and q XOR d split their current
    segment of chunks: each adds the half it gives up into the partner's, keeping the other;
    the all-gather retraces the rounds backwards, each sending the segment it holds. Extra
    ranks (P not a power of two) are folded in first and served last.

    Raises
    ------
    AlgorithmError
        If the blocks are scalars.
    """
    names, extent = _chunked("allreduce_rabenseifner", tensor)
    folding = fold(len(names))
    bounds = balanced_bounds(extent, folding.p2)
    steps = Steps(tensor.space)
    _fold_in(steps, names, folding)

    def span(first: int, count: int) -> tuple[int, int]:
        return bounds[first][0], bounds[first + count - 1][1]

    def region(q: int, first: int, count: int):
        return steps.region(names[folding.participants[q]], span(first, count))

    distance = folding.p2 // 2
    while distance >= 1:
        for q in range(folding.p2):
            partner = q ^ distance
            base = q & ~(2 * distance - 1)
            # q gives up the half of the segment [base, base + 2d) that holds the partner
            give = base + distance if q < partner else base
            if span(give, distance)[1] > span(give, distance)[0]:
                steps.add(region(q, give, distance), region(partner, give, distance))
        distance //= 2
    distance = 1
    while distance < folding.p2:
        for q in range(folding.p2):
            partner = q ^ distance
            mine = q & ~(distance - 1)
            if span(mine, distance)[1] > span(mine, distance)[0]:
                steps.copy(region(q, mine, distance), region(partner, mine, distance))
        distance *= 2
    _fold_out(steps, names, folding)
    return steps.operator()
