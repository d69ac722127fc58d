"""Derived data movement: copy, move and send-receive, each defined by its expansion.

In place, both regions live in one space. Out of place, the destination is a new
:class:`~linop.Block` (or just its name: same shape and worker as the source), allocated by
the operator. Each node states its expansion into the primitives (``docs/theory.md#primitives``)
and its adjoint rule; tests prove that the two agree.

=========================  ======================================  ===============================
operator                   expansion                               adjoint
=========================  ======================================  ===============================
Copy, in place             C = S_{a->b} K_b                        CopyAdjoint: K_b S_{b->a}
Copy, out of place         C = S_{a->b} A_b                        CopyAdjoint: D_b S_{b->a}
Move, in place             M = K_a S_{a->b} K_b                    Move b -> a
Move, out of place         M = D_a S_{a->b} A_b  (relabel)         Move b -> a, out of place
SendRecv                   a Copy between different workers        SendRecvAdjoint (adds back)
=========================  ======================================  ===============================
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from .errors import OperandError, RegionError, ShapeMismatchError, WorkerError
from .operator import Composition, LinearOperator
from .primitives import Add, Allocate, Clear, Deallocate, check_pair
from .space import Block, Region, Space

__all__ = ["Copy", "CopyAdjoint", "Move", "SendRecv", "SendRecvAdjoint"]

Destination = Region | Block | str


def _normalize_destination(kind: str, src: Region, dst: Destination) -> Region | Block:
    """Check a (source, destination) pair; a name becomes a block shaped like the source."""
    if not isinstance(src, Region):
        raise OperandError(f"{kind} needs a source region, not {type(src).__name__}")
    if isinstance(dst, str):
        dst = Block(dst, src.shape, src.worker)
    if isinstance(dst, Region):
        check_pair(kind, src, dst)
        return dst
    if isinstance(dst, Block):
        if dst.shape != src.shape:
            raise ShapeMismatchError(
                f"{kind} {src!r} -> new block {dst.name!r}: source shape {src.shape} "
                f"differs from the new block's shape {dst.shape}"
            )
        src.space.with_block(dst)  # raises BlockExistsError if the name is taken
        return dst
    raise OperandError(f"{kind} destination must be a Region, a Block or a name, not {type(dst).__name__}")


@dataclass(frozen=True, eq=True, repr=False)
class _Movement(LinearOperator):
    """Shared structure of a (src, dst) movement node: ``src`` a region, ``dst`` a region of
    the same space or a new block (a name given for it is made a block like ``src``)."""

    src: Region
    dst: Region | Block

    def __post_init__(self) -> None:
        object.__setattr__(self, "dst", _normalize_destination(type(self).__name__, self.src, self.dst))

    @property
    def out_of_place(self) -> bool:
        """True when the destination is a new block that the operator allocates."""
        return isinstance(self.dst, Block)

    @property
    def dst_worker(self) -> int:
        return self.dst.worker

    def _label(self, symbol: str) -> str:
        dst = self.dst.name if isinstance(self.dst, Block) else repr(self.dst)
        star = "new " if self.out_of_place else ""
        return f"{symbol}[{self.src!r} -> {star}{dst}]"


@dataclass(frozen=True, eq=True, repr=False)
class Copy(_Movement):
    r"""Copy a region into another region (in place) or into a new block (out of place).

    .. math::

        C_{a \to b} = S_{a \to b} K_b \quad (x_b \leftarrow x_a), \qquad
        C_{a \to b}^* = K_b S_{b \to a} \quad (x_a \leftarrow x_a + x_b,\ x_b \leftarrow 0)

    Out of place, :math:`C = S_{a \to b} A_b` and :math:`C^* = D_b S_{b \to a}`.

    Parameters
    ----------
    src : Region
        What to copy.
    dst : Region, Block or str
        Where to: a region of the same space (in place, disjoint from ``src``), or a new block
        (out of place; a name makes a block of the source's shape on the source's worker).

    Raises
    ------
    TypeError
        If ``src`` is not a :class:`~linop.Region`, or ``dst`` is not a region, block or name.
    SpaceMismatchError
        In place, if the regions come from different spaces.
    ShapeMismatchError
        If the destination's shape differs from the source's.
    OverlapError
        In place, if the regions share entries.
    BlockExistsError
        Out of place, if the new block's name is taken in the source's space.

    Examples
    --------
    >>> import numpy as np
    >>> from linop import Block, Copy, Space
    >>> space = Space([Block("a", (3,)), Block("b", (3,))])
    >>> copy = Copy(space["a"], space["b"])
    >>> copy({"a": np.array([1, 2, 3]), "b": np.array([7, 8, 9])})["b"]
    array([1, 2, 3])
    >>> print(copy.H, "=", copy.H.expand())
    C*[a -> b] = K[b] @ S[b -> a]
    >>> copy.H({"a": np.array([1, 2, 3]), "b": np.array([7, 8, 9])})
    {'a': array([ 8, 10, 12]), 'b': array([0, 0, 0])}

    Out of place, the destination is a new block, here given by name:

    >>> grown = Copy(space["a"][0:2], "c")
    >>> grown.range.names, grown.range.block("c").shape
    (('a', 'b', 'c'), (2,))
    """

    if TYPE_CHECKING:  # the constructor also takes a name for a new block (see Parameters)

        def __init__(self, src: Region, dst: Region | Block | str) -> None: ...

    @property
    def domain(self) -> Space:
        return self.src.space

    @cached_property
    def range(self) -> Space:
        return self.src.space.with_block(self.dst) if isinstance(self.dst, Block) else self.src.space

    def expand(self) -> LinearOperator:
        """S_{a->b} K_b in place; S_{a->b} A_b out of place."""
        if isinstance(self.dst, Region):
            return Composition((Add(self.src, self.dst), Clear(self.dst)))
        grown = self.range
        return Composition(
            (Add(self.src.in_space(grown), grown[self.dst.name]), Allocate(self.domain, self.dst))
        )

    def adjoint(self) -> LinearOperator:
        """C_{a->b}* = K_b S_{b->a} (in place) or D_b S_{b->a} (out of place)."""
        return CopyAdjoint(src=self.src, dst=self.dst)

    def __str__(self) -> str:
        return self._label("C")


@dataclass(frozen=True, eq=True, repr=False)
class CopyAdjoint(_Movement):
    r"""The adjoint of :class:`Copy`: add the destination back into the source, then clear
    it (in place) or drop it (out of place).

    .. math:: C_{a \to b}^* = K_b S_{b \to a}, \qquad (C^*)^* = C

    Parameters
    ----------
    src, dst
        The source and destination of the forward :class:`Copy` (the domain holds ``dst``, the
        range drops it when it is a new block).

    Examples
    --------
    >>> from linop import Block, Copy, CopyAdjoint, Space
    >>> space = Space([Block("a", (2,))])
    >>> adjoint = Copy(space["a"], "b").H
    >>> isinstance(adjoint, CopyAdjoint), adjoint.domain.names, adjoint.range.names
    (True, ('a', 'b'), ('a',))
    """

    @cached_property
    def domain(self) -> Space:
        return self.src.space.with_block(self.dst) if isinstance(self.dst, Block) else self.src.space

    @property
    def range(self) -> Space:
        return self.src.space

    def expand(self) -> LinearOperator:
        """K_b S_{b->a} in place; D_b S_{b->a} out of place."""
        if isinstance(self.dst, Region):
            return Composition((Clear(self.dst), Add(self.dst, self.src)))
        grown = self.domain
        return Composition(
            (Deallocate(grown, self.dst.name), Add(grown[self.dst.name], self.src.in_space(grown)))
        )

    def adjoint(self) -> LinearOperator:
        """(C*)* = C."""
        return Copy(src=self.src, dst=self.dst)

    def __str__(self) -> str:
        return self._label("C*")


@dataclass(frozen=True, eq=True, repr=False)
class Move(_Movement):
    r"""Move a region into another region (in place) or relabel a block (out of place).

    .. math::

        M_{a \to b} = K_a S_{a \to b} K_b \quad (x_b \leftarrow x_a,\ x_a \leftarrow 0),
        \qquad M_{a \to b}^* = M_{b \to a}

    Out of place, :math:`M = D_a S_{a \to b} A_b` relabels the whole block ``a`` as ``b``
    (its matrix is the identity); the adjoint relabels ``b`` back as ``a``.

    Parameters
    ----------
    src : Region
        What to move: a region (in place), or a whole block (out of place).
    dst : Region, Block or str
        Where to: a region of the same space, disjoint from ``src`` (in place), or a new block
        or the name of one (out of place).

    Raises
    ------
    TypeError, SpaceMismatchError, ShapeMismatchError, OverlapError, BlockExistsError
        As for :class:`Copy`.
    RegionError
        Out of place, if ``src`` is not a whole block (only whole blocks can be dropped).

    Examples
    --------
    >>> import numpy as np
    >>> from linop import Block, Move, Space
    >>> space = Space([Block("a", (2,)), Block("b", (2,))])
    >>> move = Move(space["a"], space["b"])
    >>> move({"a": np.array([1, 2]), "b": np.array([5, 6])})
    {'a': array([0, 0]), 'b': array([1, 2])}
    >>> move.H == Move(space["b"], space["a"])
    True
    >>> Move(space["b"], "d").range.names
    ('a', 'd')
    """

    if TYPE_CHECKING:  # the constructor also takes a name for a new block (see Parameters)

        def __init__(self, src: Region, dst: Region | Block | str) -> None: ...

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.dst, Block) and not self.src.is_whole:
            raise RegionError(
                f"Move {self.src!r} -> new block {self.dst.name!r}: an out-of-place move drops its "
                f"source, so it must be the whole block {self.src.name!r}"
            )

    @property
    def domain(self) -> Space:
        return self.src.space

    @cached_property
    def range(self) -> Space:
        if isinstance(self.dst, Region):
            return self.src.space
        return self.src.space.without(self.src.name).with_block(self.dst)

    def expand(self) -> LinearOperator:
        """K_a S_{a->b} K_b in place; D_a S_{a->b} A_b out of place."""
        if isinstance(self.dst, Region):
            return Composition((Clear(self.src), Add(self.src, self.dst), Clear(self.dst)))
        grown = self.domain.with_block(self.dst)
        return Composition(
            (
                Deallocate(grown, self.src.name),
                Add(self.src.in_space(grown), grown[self.dst.name]),
                Allocate(self.domain, self.dst),
            )
        )

    def adjoint(self) -> LinearOperator:
        """M_{a->b}* = M_{b->a}."""
        if isinstance(self.dst, Region):
            return Move(self.dst, self.src)
        return Move(self.range[self.dst.name], self.src.block)

    def __str__(self) -> str:
        return self._label("M")


def _require_other_worker(node: _Movement) -> None:
    if node.src.worker == node.dst_worker:
        raise WorkerError(
            f"{type(node).__name__} {node.src!r} -> {node.dst.name if isinstance(node.dst, Block) else node.dst!r}: "
            f"both live on worker {node.src.worker}; use Copy within a worker"
        )


@dataclass(frozen=True, eq=True, repr=False)
class SendRecv(Copy):
    r"""A copy whose source and destination live on different workers
    (``docs/theory.md#distributed-primitives``).

    .. math:: x_b \leftarrow x_a, \qquad \text{adjoint: } x_a \leftarrow x_a + x_b,\ x_b \leftarrow 0

    The adjoint is a receive-send (:class:`SendRecvAdjoint`) that *adds* into the source.

    Parameters
    ----------
    src : Region
        What to send, on one worker.
    dst : Region, Block or str
        Where it is received, on another worker: a region (in place) or a new block (out of
        place; a name makes a block on the *source's* worker, which is an error here, so pass
        a :class:`~linop.Block`).

    Raises
    ------
    TypeError, SpaceMismatchError, ShapeMismatchError, OverlapError, BlockExistsError
        As for :class:`Copy`.
    WorkerError
        If both regions live on the same worker.

    Examples
    --------
    >>> import numpy as np
    >>> from linop import Block, SendRecv, Space
    >>> space = Space([Block("a", (4,), worker=0), Block("b", (2,), worker=1)])
    >>> send = SendRecv(space["a"][2:4], space["b"])
    >>> send({"a": np.arange(4), "b": np.zeros(2, dtype=int)})["b"]
    array([2, 3])
    >>> print(send.H)
    SR*[a[2:4] -> b]
    >>> send.H({"a": np.zeros(4, dtype=int), "b": np.array([5, 6])})
    {'a': array([0, 0, 5, 6]), 'b': array([0, 0])}
    """

    def __post_init__(self) -> None:
        super().__post_init__()
        _require_other_worker(self)

    def adjoint(self) -> LinearOperator:
        """The receive-send that adds the destination back into the source."""
        return SendRecvAdjoint(src=self.src, dst=self.dst)

    def __str__(self) -> str:
        return self._label("SR")


@dataclass(frozen=True, eq=True, repr=False)
class SendRecvAdjoint(CopyAdjoint):
    """Adjoint of :class:`SendRecv`: send x_b back to x_a's worker, add it there, clear x_b.

    Parameters
    ----------
    src, dst
        The source and destination of the forward :class:`SendRecv`.

    Raises
    ------
    WorkerError
        If both regions live on the same worker.
    """

    def __post_init__(self) -> None:
        super().__post_init__()
        _require_other_worker(self)

    def adjoint(self) -> LinearOperator:
        """(SR*)* = SR."""
        return SendRecv(src=self.src, dst=self.dst)

    def __str__(self) -> str:
        return self._label("SR*")
