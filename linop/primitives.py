"""The four trusted primitives: allocate, deallocate, clear and add (``docs/theory.md#primitives``).

Every other operator of linop expands into these four, so they are the whole trust base:
each is small enough to check by eye, and each interpreter implements them directly.

==================  ==========================  ====================  ==================
operator            action                      matrix on (x_a, x_b)  adjoint
==================  ==========================  ====================  ==================
Allocate A_b        bring x_b = 0 into scope    [I_a ; O_b]           Deallocate D_b
Deallocate D_b      drop x_b                    [I_a  O_b]            Allocate A_b
Clear K_b           x_b <- 0                    diag(I_a, O_b)        K_b
Add S_{a->b}        x_b <- x_b + x_a            [[I, O], [I, I]]      S_{b->a}
==================  ==========================  ====================  ==================
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, field

from .errors import OperandError, OverlapError, ShapeMismatchError, SpaceMismatchError
from .operator import LinearOperator, SameSpace, StoredSpaces
from .space import Block, Region, Space

__all__ = ["Allocate", "Deallocate", "Clear", "Add", "check_pair"]


def check_pair(kind: str, src: Region, dst: Region) -> None:
    """Validate two regions of one space that a primitive relates (same shape, disjoint)."""
    if not isinstance(src, Region) or not isinstance(dst, Region):
        raise OperandError(f"{kind} relates two regions, got {type(src).__name__} and {type(dst).__name__}")
    if src.space != dst.space:
        diff = src.space.difference(dst.space)
        raise SpaceMismatchError(
            f"{kind} {src!r} -> {dst!r}: the regions come from different spaces ({diff})"
        )
    if src.shape != dst.shape:
        raise ShapeMismatchError(
            f"{kind} {src!r} -> {dst!r}: source shape {src.shape} differs from destination shape {dst.shape}"
        )
    if src.overlaps(dst):
        raise OverlapError(f"{kind} {src!r} -> {dst!r}: the regions overlap in block {src.name!r}")


class _ScopeChange(StoredSpaces):
    """Fields and spaces shared by :class:`Allocate` and :class:`Deallocate`: the domain is
    ``space``, the range (computed once, by :meth:`_new_range`) that space with one block more
    or one less."""

    space: Space

    def __post_init__(self) -> None:
        if not isinstance(self.space, Space):
            raise OperandError(
                f"{type(self).__name__}: the space must be a Space, not {type(self.space).__name__}"
            )
        object.__setattr__(self, "_domain", self.space)
        object.__setattr__(self, "_range", self._new_range())

    @abstractmethod
    def _new_range(self) -> Space:
        """The range, from the checked fields."""


@dataclass(frozen=True, eq=True, repr=False)
class Allocate(_ScopeChange):
    r"""Bring a new block of zeros into scope.

    .. math:: A_b : x \mapsto (x, x_b = 0), \qquad A_b^* = D_b

    Parameters
    ----------
    space : Space
        The domain; the range is ``space`` plus ``block``.
    block : Block
        The new block (its name must not exist in ``space``).

    Raises
    ------
    BlockExistsError
        If ``space`` already holds a block of that name.

    Examples
    --------
    >>> import numpy as np
    >>> from linop import Allocate, Block, Space
    >>> space = Space([Block("a", (2,))])
    >>> grow = Allocate(space, Block("b", (3,)))
    >>> print(grow.range.names, grow.H)
    ('a', 'b') D[b]
    >>> grow({"a": np.array([1.0, 2.0])})["b"]
    array([0., 0., 0.])
    >>> grow.to_sparse().toarray()
    array([[1, 0],
           [0, 1],
           [0, 0],
           [0, 0],
           [0, 0]])
    """

    space: Space
    block: Block
    _range: Space = field(init=False, repr=False, compare=False)

    def _new_range(self) -> Space:
        if not isinstance(self.block, Block):
            raise OperandError(f"Allocate: the new block must be a Block, not {type(self.block).__name__}")
        return self.space.with_block(self.block)

    def adjoint(self) -> LinearOperator:
        """A_b* = D_b."""
        return Deallocate(self.range, self.block.name)

    def __str__(self) -> str:
        return f"A[{self.block.name}]"


@dataclass(frozen=True, eq=True, repr=False)
class Deallocate(_ScopeChange):
    r"""Drop a block from scope.

    .. math:: D_b : (x, x_b) \mapsto x, \qquad D_b^* = A_b

    Parameters
    ----------
    space : Space
        The domain; the range is ``space`` without the block.
    name : str
        The name of the block to drop.

    Raises
    ------
    UnknownBlockError
        If ``space`` holds no block called ``name``.

    Examples
    --------
    >>> from linop import Block, Deallocate, Space
    >>> space = Space([Block("a", (2,)), Block("b", (3,))])
    >>> drop = Deallocate(space, "b")
    >>> print(drop.range.names, drop.H)
    ('a',) A[b]
    >>> (drop.H.to_sparse() != drop.to_sparse().T).nnz
    0
    """

    space: Space
    name: str
    _range: Space = field(init=False, repr=False, compare=False)

    def _new_range(self) -> Space:
        return self.space.without(self.name)

    def adjoint(self) -> LinearOperator:
        """D_b* = A_b."""
        return Allocate(self.range, self.space.block(self.name))

    def __str__(self) -> str:
        return f"D[{self.name}]"


@dataclass(frozen=True, eq=True, repr=False)
class Clear(SameSpace):
    r"""Set a region to zero.

    .. math:: K_b : x_b \mapsto 0 \text{ (all else unchanged)}, \qquad K_b^* = K_b

    Parameters
    ----------
    region : Region
        The entries to zero (a whole block or a box of one); domain and range are its space.

    Raises
    ------
    TypeError
        If ``region`` is not a :class:`~linop.Region`.

    Examples
    --------
    >>> import numpy as np
    >>> from linop import Block, Clear, Space
    >>> space = Space([Block("a", (4,))])
    >>> clear = Clear(space["a"][1:3])
    >>> clear({"a": np.arange(4.0)})["a"]
    array([0., 0., 0., 3.])
    >>> clear.H == clear
    True
    """

    region: Region

    def __post_init__(self) -> None:
        if not isinstance(self.region, Region):
            raise OperandError(f"Clear needs a region, not {type(self.region).__name__}")

    @property
    def space(self) -> Space:
        """The region's space: domain and range."""
        return self.region.space

    def adjoint(self) -> LinearOperator:
        """K_b* = K_b."""
        return self

    def __str__(self) -> str:
        return f"K[{self.region!r}]"


@dataclass(frozen=True, eq=True, repr=False)
class Add(SameSpace):
    r"""Add one region into another of the same shape.

    .. math:: S_{a \to b} : x_b \mapsto x_b + x_a, \qquad S_{a \to b}^* = S_{b \to a}

    Parameters
    ----------
    src : Region
        The region added (unchanged by the operator).
    dst : Region
        The region added into; same space and shape as ``src``, disjoint from it.

    Raises
    ------
    TypeError
        If ``src`` or ``dst`` is not a :class:`~linop.Region`.
    SpaceMismatchError
        If the regions come from different spaces.
    ShapeMismatchError
        If the regions' shapes differ.
    OverlapError
        If the regions share entries.

    Examples
    --------
    >>> import numpy as np
    >>> from linop import Add, Block, Space
    >>> space = Space([Block("a", (2,)), Block("b", (2,))])
    >>> add = Add(space["a"], space["b"])
    >>> add({"a": np.array([1, 2]), "b": np.array([10, 20])})["b"]
    array([11, 22])
    >>> print(add.H)
    S[b -> a]
    >>> add.to_sparse().toarray()
    array([[1, 0, 0, 0],
           [0, 1, 0, 0],
           [1, 0, 1, 0],
           [0, 1, 0, 1]])
    """

    src: Region
    dst: Region

    def __post_init__(self) -> None:
        check_pair("Add", self.src, self.dst)

    @property
    def space(self) -> Space:
        """The regions' space: domain and range."""
        return self.src.space

    def adjoint(self) -> LinearOperator:
        """S_{a->b}* = S_{b->a}."""
        return Add(self.dst, self.src)

    def __str__(self) -> str:
        return f"S[{self.src!r} -> {self.dst!r}]"
