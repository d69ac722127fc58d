"""Catalogue, ``docs/theory.md#distributed-primitives``: distributed primitives built from send-receives.

Send-receive is a copy between workers; scatter, gather, broadcast, sum-reduce, all-reduce and
all-to-all are compositions of send-receives, moves and adds. The entries here build those
patterns by hand from :class:`~linop.SendRecv`, :class:`~linop.Move` and the primitives, and
prove the section's statements about them: each adjoint is the stated reverse pattern (with
adds where the forward pattern copied), and broadcast and sum-reduce are each other's
adjoints for every block size. The dedicated collective nodes add their own entries in
``verify.catalogue_collectives``.
"""

from __future__ import annotations

from functools import reduce

from linop import (
    Add,
    Block,
    Clear,
    Copy,
    Deallocate,
    LinearOperator,
    Move,
    SendRecv,
    Space,
)

from .catalogue import Entry, adjoint_entry, equal_entry

__all__ = ["ENTRIES"]

SECTION = "distributed-primitives"
K = 3
"""Number of destination workers of the broadcasts and scatters."""


def _compose(factors: list[LinearOperator]) -> LinearOperator:
    """factors[-1] applied first: Composition in the written order."""
    return reduce(lambda left, right: left @ right, factors)


def _pair() -> Space:
    return Space([Block("a", (2, 3), 0), Block("b", (2, 3), 1), Block("c", (5,), 2)])


def _sendrecv() -> LinearOperator:
    s = _pair()
    return SendRecv(s["a"], s["b"])


def _sendrecv_adjoint_form() -> tuple[LinearOperator, LinearOperator]:
    s = _pair()
    return SendRecv(s["a"], s["b"]).H, Clear(s["b"]) @ Add(s["b"], s["a"])


def _sendrecv_new() -> LinearOperator:
    s = _pair().without("b")
    return SendRecv(s["a"], Block("b", (2, 3), 1))


def _sendrecv_new_adjoint_form() -> tuple[LinearOperator, LinearOperator]:
    s = _pair()
    small = s.without("b")
    return SendRecv(small["a"], Block("b", (2, 3), 1)).H, Deallocate(s, "b") @ Add(s["b"], s["a"])


# -- broadcast and sum-reduce: x_a on worker 0 to new blocks b1..bK on workers 1..K ----------------
def _source() -> Space:
    return Space([Block("a", (4,), 0)])


def _targets() -> list[Block]:
    return [Block(f"b{k}", (4,), k) for k in range(1, K + 1)]


def _broadcast() -> LinearOperator:
    """B_{a->{k}} = C_{a->bK} ... C_{a->b1}, linear form, out of place."""
    factors: list[LinearOperator] = []
    space = _source()
    for block in _targets():
        step = SendRecv(space["a"], block)
        factors.insert(0, step)
        space = step.range
    return _compose(factors)


def _sum_reduce() -> LinearOperator:
    """R_{{k}->a} = [I I ... I] built from the primitives: add each b_k into a, drop b_k."""
    space = _broadcast().range
    factors: list[LinearOperator] = []
    for block in _targets():
        factors.insert(0, Deallocate(space, block.name) @ Add(space[block.name], space["a"]))
        space = space.without(block.name)
    return _compose(factors)


def _broadcast_tree() -> LinearOperator:
    """The logarithmic form: a -> b1, then a -> b2 and b1 -> b3 in the second round."""
    first = SendRecv(_source()["a"], _targets()[0])
    second = SendRecv(first.range["a"], _targets()[1])
    third = SendRecv(second.range["b1"], _targets()[2])
    return third @ second @ first


def _broadcast_in_place() -> LinearOperator:
    """Broadcast into existing blocks on every worker, the source's own copy being the identity."""
    space = Space([Block("a", (4,), 0), *_targets()])
    return _compose([SendRecv(space["a"], space[b.name]) for b in _targets()])


def _sum_reduce_in_place() -> LinearOperator:
    space = Space([Block("a", (4,), 0), *_targets()])
    return _compose([Clear(space[b.name]) @ Add(space[b.name], space["a"]) for b in _targets()])


# -- scatter and gather: pieces of x_a (6 entries on worker 0) to workers 1..K ---------------------
def _pieces() -> list[slice]:
    return [slice(0, 2), slice(2, 4), slice(4, 6)]


def _scatter_space() -> Space:
    return Space([Block("a", (6,), 0), *(Block(f"r{k}", (2,), k) for k in range(1, K + 1))])


def _scatter_copies() -> LinearOperator:
    s = _scatter_space()
    return _compose([SendRecv(s["a"][p], s[f"r{k}"]) for k, p in enumerate(_pieces(), 1)])


def _gather_with_adds() -> LinearOperator:
    s = _scatter_space()
    return _compose([Clear(s[f"r{k}"]) @ Add(s[f"r{k}"], s["a"][p]) for k, p in enumerate(_pieces(), 1)])


def _scatter_moves() -> LinearOperator:
    s = _scatter_space()
    return _compose([Move(s["a"][p], s[f"r{k}"]) for k, p in enumerate(_pieces(), 1)])


def _gather_moves() -> LinearOperator:
    s = _scatter_space()
    return _compose([Move(s[f"r{k}"], s["a"][p]) for k, p in enumerate(_pieces(), 1)])


def _gather_copies() -> LinearOperator:
    s = _scatter_space()
    return _compose([SendRecv(s[f"r{k}"], s["a"][p]) for k, p in enumerate(_pieces(), 1)])


def _scatter_with_adds() -> LinearOperator:
    s = _scatter_space()
    return _compose([Clear(s["a"][p]) @ Add(s["a"][p], s[f"r{k}"]) for k, p in enumerate(_pieces(), 1)])


# -- all-to-all: a length-6 tensor from 2 workers (3 + 3) to 3 workers (2 + 2 + 2) ------------------
def _repartition_space() -> Space:
    old = [Block("p0", (3,), 0), Block("p1", (3,), 1)]
    new = [Block("q0", (2,), 0), Block("q1", (2,), 1), Block("q2", (2,), 2)]
    return Space(old + new)


def _routes(s: Space) -> list[tuple]:
    """(source piece, destination piece) of the re-decomposition, global order kept."""
    return [
        (s["p0"][0:2], s["q0"]),
        (s["p0"][2:3], s["q1"][0:1]),
        (s["p1"][0:1], s["q1"][1:2]),
        (s["p1"][1:3], s["q2"]),
    ]


def _alltoall_moves() -> LinearOperator:
    return _compose([Move(src, dst) for src, dst in _routes(_repartition_space())])


def _alltoall_moves_reverse() -> LinearOperator:
    return _compose([Move(dst, src) for src, dst in _routes(_repartition_space())])


def _alltoall_copies() -> LinearOperator:
    """Pieces staying on their worker are plain copies, the others send-receives."""
    return _compose(
        [
            SendRecv(src, dst) if src.worker != dst.worker else Copy(src, dst)
            for src, dst in _routes(_repartition_space())
        ]
    )


def _alltoall_copies_reverse() -> LinearOperator:
    return _compose([Clear(dst) @ Add(dst, src) for src, dst in _routes(_repartition_space())])


ENTRIES: list[Entry] = [
    # -- send-receive -------------------------------------------------------------------------------
    adjoint_entry(
        "sendrecv-adjoint",
        SECTION,
        "SR_{a->b}* is the adjoint of a send-receive (in place)",
        _sendrecv,
        size_free=True,
    ),
    equal_entry(
        "sendrecv-adjoint-adds",
        SECTION,
        "SR_{a->b}* = K_b S_{b->a}: receive-send adds into x_a, clears x_b",
        _sendrecv_adjoint_form,
        size_free=True,
    ),
    adjoint_entry(
        "sendrecv-outofplace-adjoint",
        SECTION,
        "SR_{a->b}* is the adjoint of a send-receive (out of place)",
        _sendrecv_new,
        size_free=True,
    ),
    equal_entry(
        "sendrecv-outofplace-adjoint-adds",
        SECTION,
        "SR_{a->b}* = D_b S_{b->a}: receive-send adds into x_a, drops x_b",
        _sendrecv_new_adjoint_form,
        size_free=True,
    ),
    adjoint_entry(
        "sendrecv-box-adjoint",
        SECTION,
        "SR_{a->b}* = K_b S_{b->a} between boxes on two workers",
        lambda: SendRecv(_pair()["a"][1, :], _pair()["c"][1:4]),
    ),
    # -- scatter and gather ---------------------------------------------------------------------------
    adjoint_entry(
        "scatter-adjoint",
        SECTION,
        "scatter (send-receives of pieces of x_a) has an exact adjoint",
        _scatter_copies,
    ),
    equal_entry(
        "scatter-adjoint-is-gather-with-adds",
        SECTION,
        "scatter* = gather that adds each piece back into x_a",
        lambda: (_scatter_copies().H, _gather_with_adds()),
    ),
    equal_entry(
        "scatter-by-moves-adjoint-is-gather",
        SECTION,
        "(scatter by moves)* = plain gather (moves back)",
        lambda: (_scatter_moves().H, _gather_moves()),
    ),
    adjoint_entry(
        "gather-adjoint",
        SECTION,
        "gather (send-receives into pieces of x_a) has an exact adjoint",
        _gather_copies,
    ),
    equal_entry(
        "gather-adjoint-is-scatter-with-adds",
        SECTION,
        "gather* = scatter that adds into the pieces' sources",
        lambda: (_gather_copies().H, _scatter_with_adds()),
    ),
    # -- broadcast, sum-reduce, all-reduce --------------------------------------------------------------
    adjoint_entry(
        "broadcast-adjoint",
        SECTION,
        "B_{a->{k}} = [I; I; ...; I] has an exact adjoint",
        _broadcast,
        size_free=True,
    ),
    equal_entry(
        "broadcast-adjoint-is-sum-reduce",
        SECTION,
        "B_{a->{k}}* = R_{{k}->a} = [I I ... I]",
        lambda: (_broadcast().H, _sum_reduce()),
        size_free=True,
    ),
    equal_entry(
        "sum-reduce-adjoint-is-broadcast",
        SECTION,
        "R_{{k}->a}* = B_{a->{k}}",
        lambda: (_sum_reduce().H, _broadcast()),
        size_free=True,
    ),
    adjoint_entry(
        "allreduce-adjoint",
        SECTION,
        "all-reduce B R has an exact adjoint",
        lambda: _broadcast() @ _sum_reduce(),
        size_free=True,
    ),
    equal_entry(
        "allreduce-self-adjoint",
        SECTION,
        "(B R)* = R* B* = B R",
        lambda: ((_broadcast() @ _sum_reduce()).H, _broadcast() @ _sum_reduce()),
        size_free=True,
    ),
    equal_entry(
        "broadcast-linear-equals-tree",
        SECTION,
        "the linear (k copies) and tree forms of a broadcast are the same operator",
        lambda: (_broadcast(), _broadcast_tree()),
        size_free=True,
    ),
    adjoint_entry(
        "broadcast-inplace-adjoint",
        SECTION,
        "in-place broadcast (source's own copy the identity) has an exact adjoint",
        _broadcast_in_place,
        size_free=True,
    ),
    equal_entry(
        "broadcast-inplace-adjoint-is-sum-reduce",
        SECTION,
        "in-place B* = in-place sum-reduce: x_a += sum_k x_bk, x_bk <- 0",
        lambda: (_broadcast_in_place().H, _sum_reduce_in_place()),
        size_free=True,
    ),
    # -- all-to-all -------------------------------------------------------------------------------------
    adjoint_entry(
        "alltoall-adjoint",
        SECTION,
        "all-to-all (a block permutation of moves) has an exact adjoint",
        _alltoall_moves,
    ),
    equal_entry(
        "alltoall-adjoint-is-reverse",
        SECTION,
        "(all-to-all by moves)* = the reverse all-to-all",
        lambda: (_alltoall_moves().H, _alltoall_moves_reverse()),
    ),
    equal_entry(
        "alltoall-copies-adjoint-adds",
        SECTION,
        "(all-to-all by copies)* = reverse all-to-all that adds the pieces back",
        lambda: (_alltoall_copies().H, _alltoall_copies_reverse()),
    ),
]
