r"""Broadcast and reduce algorithms as trees of send-receives, copies and adds
(``docs/theory.md#collective-algorithms``).

Each function returns a tree equal, as an operator, to the mathematical collective it
implements (``verify.equal`` proves it): the broadcast variants equal
``Broadcast(tensor, partition, name)``, the reduce variants ``SumReduce(tensor, partition,
name)``. ``tensor`` holds one block x (on the *root* worker); the copies ``name[j]`` live on
the workers of ``partition``. Ranks are counted from the root: rank 0 is the root, ranks
1 .. N-1 the other destination workers in C order starting after the root's position (a root
outside the partition is an extra rank 0 that keeps no copy).

Costs in the alpha-beta model (``docs/theory.md#cost-model``) for N ranks and a block of n
bytes, a message costing alpha + beta n and an add gamma n:

====================================  ==================================================
variant                               modeled time
====================================  ==================================================
broadcast_linear                      (N-1) (alpha + beta n): the root sends N-1 times
broadcast_binomial                    ceil(log2 N) (alpha + beta n): the informed ranks
                                      double every round
broadcast_scatter_allgather           binomial scatter of N chunks, then a ring
                                      all-gather: (log2 N + N - 1) alpha + 2 (N-1)/N beta n
                                      (powers of two)
reduce_linear                         (N-1) (alpha + (beta + gamma) n)
reduce_binomial                       ceil(log2 N) (alpha + (beta + gamma) n)
====================================  ==================================================

The adjoint of a broadcast algorithm is the reverse algorithm: ``broadcast_binomial(...).H``
sends the same messages in the opposite direction and order, adding where the forward tree
copied, and equals ``reduce_binomial(...)`` (both are R = B*).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..collectives import BlockGrid, Broadcast, Layout
from ..operator import LinearOperator
from ..partition import Partition
from ..space import Block
from .common import AlgorithmError, Steps, balanced_bounds

__all__ = [
    "broadcast_binomial",
    "broadcast_linear",
    "broadcast_scatter_allgather",
    "reduce_binomial",
    "reduce_linear",
]


@dataclass(frozen=True)
class _Rooted:
    """The ranks of a rooted collective: source block, copies, whether the root keeps one."""

    source: Block
    copies: tuple[Block | None, ...]  # per rank; rank 0 is the root (None: no copy there)
    grid: BlockGrid  # the copies' layout

    @property
    def size(self) -> int:
        return len(self.copies)


def _rooted(kind: str, tensor: Layout, partition: Partition, name: str) -> _Rooted:
    if not isinstance(tensor, Layout) or tensor.partition.size != 1:
        size = tensor.partition.size if isinstance(tensor, Layout) else None
        raise AlgorithmError(f"{kind}: the source layout must hold exactly one block (it has {size})")
    reference = Broadcast(tensor, partition, name)  # validates the names and the partitions
    source = tensor.blocks[0]
    copies: list[Block | None] = list(reference.copies.blocks)
    at = next((k for k, b in enumerate(copies) if b is not None and b.worker == source.worker), None)
    ranks = [None, *copies] if at is None else copies[at:] + copies[:at]
    return _Rooted(source, tuple(ranks), reference.copies)


def broadcast_linear(tensor: Layout, partition: Partition, name: str) -> LinearOperator:
    r"""The root sends its block to every other rank, one message each.

    .. math:: y_j = x \ (\text{every } j), \qquad \text{equal to } B; \text{ adjoint: } R

    Parameters
    ----------
    tensor : DistributedTensor or BlockGrid
        A layout with one block (the root's).
    partition : Partition
        The destination workers.
    name : str
        Prefix of the copies' names (as for :class:`~linop.Broadcast`).

    Raises
    ------
    AlgorithmError
        If ``tensor`` holds more than one block.
    """
    ranks = _rooted("broadcast_linear", tensor, partition, name)
    steps = Steps(tensor.space)
    x = ranks.source.name
    for copy in ranks.copies[1:]:
        steps.copy(steps.region(x), copy)  # type: ignore[arg-type]  # ranks past 0 have copies
    _finish_broadcast(steps, ranks)
    return steps.operator()


def _finish_broadcast(steps: Steps, ranks: _Rooted) -> None:
    if ranks.copies[0] is None:
        steps.drop(ranks.source.name)
    else:
        steps.relabel(ranks.source.name, ranks.copies[0])


def _holder(ranks: _Rooted, rank: int) -> str:
    return ranks.source.name if rank == 0 else ranks.copies[rank].name  # type: ignore[union-attr]


def broadcast_binomial(tensor: Layout, partition: Partition, name: str) -> LinearOperator:
    r"""Binomial tree: in round k every rank r < 2^k sends its copy to rank r + 2^k.

    .. math:: y_j = x, \quad \lceil \log_2 N \rceil \text{ rounds}; \qquad \text{adjoint:
        the binomial reduce}

    Parameters and errors as for :func:`broadcast_linear`.
    """
    ranks = _rooted("broadcast_binomial", tensor, partition, name)
    steps = Steps(tensor.space)
    step = 1
    while step < ranks.size:
        # senders informed last round first: each round then starts a new phase under MPI
        for r in range(step - 1, -1, -1):
            if r + step < ranks.size:
                steps.copy(steps.region(_holder(ranks, r)), ranks.copies[r + step])  # type: ignore[arg-type]
        step *= 2
    _finish_broadcast(steps, ranks)
    return steps.operator()


def broadcast_scatter_allgather(tensor: Layout, partition: Partition, name: str) -> LinearOperator:
    r"""Van de Geijn's broadcast: a binomial scatter of N chunks (along the block's first
    dimension, balanced sizes), then a ring all-gather of the chunks among the copies.

    .. math:: y_j = x; \quad \text{bytes per rank} \approx 2 n (N-1)/N \text{ instead of }
        n \log_2 N

    Raises
    ------
    AlgorithmError
        If the source block is a scalar (it has no dimension to cut into chunks) or ``tensor``
        holds more than one block.
    """
    ranks = _rooted("broadcast_scatter_allgather", tensor, partition, name)
    if not ranks.source.shape:
        raise AlgorithmError(
            f"broadcast_scatter_allgather: block {ranks.source.name!r} is a scalar; it needs a dimension to cut"
        )
    n = ranks.source.shape[0]
    size = ranks.size
    members = [r for r in range(size) if ranks.copies[r] is not None]
    bounds = [(0, 0)] * size
    for r, b in zip(members, balanced_bounds(n, len(members))):
        bounds[r] = b
    steps = Steps(tensor.space)
    for copy in ranks.copies[1:]:
        steps.allocate(copy)  # type: ignore[arg-type]
    # binomial scatter: rank r (a multiple of 2 mask) hands ranks [r + mask, r + 2 mask) their chunks
    mask = 1 << max(size - 1, 0).bit_length() >> 1
    while mask >= 1:
        for r in range(((size - 1) // (2 * mask)) * 2 * mask, -1, -2 * mask):
            if r + mask < size:
                lo, hi = bounds[r + mask][0], bounds[min(r + 2 * mask, size) - 1][1]
                if hi > lo:
                    steps.copy(
                        steps.region(_holder(ranks, r), (lo, hi)),
                        steps.region(_holder(ranks, r + mask), (lo, hi)),
                    )
        mask //= 2
    # ring all-gather: member i passes the chunk it received last to member i + 1
    count = len(members)
    for s in range(count - 1):
        for i in reversed(range(count)):  # the last member first: it was served last
            chunk = bounds[members[(i - s) % count]]
            if chunk[1] > chunk[0]:
                src, dst = _holder(ranks, members[i]), _holder(ranks, members[(i + 1) % count])
                steps.copy(steps.region(src, chunk), steps.region(dst, chunk))
    _finish_broadcast(steps, ranks)
    return steps.operator()


def _reduce_ranks(kind: str, tensor: Layout, partition: Partition, name: str) -> tuple[_Rooted, Steps]:
    ranks = _rooted(kind, tensor, partition, name)
    steps = Steps(ranks.grid.space)
    if ranks.copies[0] is None:
        steps.allocate(ranks.source)
    return ranks, steps


def _reduce_holder(ranks: _Rooted, rank: int) -> str:
    copy = ranks.copies[rank]
    return ranks.source.name if copy is None else copy.name


def _finish_reduce(steps: Steps, ranks: _Rooted) -> None:
    if ranks.copies[0] is not None:
        steps.relabel(ranks.copies[0].name, ranks.source)


def reduce_linear(tensor: Layout, partition: Partition, name: str) -> LinearOperator:
    r"""Every rank adds its copy into the root's, one message each.

    .. math:: x = \sum_j y_j, \qquad \text{equal to } R = B^*; \text{ adjoint: the linear
        broadcast}

    Parameters mean what they mean for :func:`broadcast_linear` (the domain holds the
    copies, the range the block x).
    """
    ranks, steps = _reduce_ranks("reduce_linear", tensor, partition, name)
    root = _reduce_holder(ranks, 0)
    for copy in ranks.copies[1:]:
        steps.add(steps.region(copy.name), steps.region(root))  # type: ignore[union-attr]
    for copy in ranks.copies[1:]:
        steps.drop(copy.name)  # type: ignore[union-attr]
    _finish_reduce(steps, ranks)
    return steps.operator()


def reduce_binomial(tensor: Layout, partition: Partition, name: str) -> LinearOperator:
    r"""Binomial tree: in round k every rank r = 2^k mod 2^{k+1} adds its partial sum into
    rank r - 2^k.

    .. math:: x = \sum_j y_j, \quad \lceil \log_2 N \rceil \text{ rounds}; \qquad
        \text{adjoint: the binomial broadcast}
    """
    ranks, steps = _reduce_ranks("reduce_binomial", tensor, partition, name)
    size = ranks.size
    step = 1
    while step < size:
        senders = list(range(step, size, 2 * step))
        # a sender that received last round first, so that every round is a new MPI phase
        senders.sort(key=lambda r: not (step > 1 and r + step // 2 < size))
        for r in senders:
            steps.add(steps.region(_reduce_holder(ranks, r)), steps.region(_reduce_holder(ranks, r - step)))
        for r in senders:  # drops after the round's adds: the adjoint allocates before it sends
            steps.drop(_reduce_holder(ranks, r))
        step *= 2
    _finish_reduce(steps, ranks)
    return steps.operator()
