"""Piece movements: the one definition shared by every out-of-place collective.

A :class:`PieceMovement` says what an out-of-place collective does: allocate the new blocks,
move *pieces* (:class:`Piece`: a box of an old block copied, or added, into a box of a new
block) and drop the old blocks. :class:`PieceMover` is the base of the nodes defined this way
(broadcast, sum-reduce, all-gather, reduce-scatter, repartition, scatter, gather): the movement
expands into the primitives (Allocate; Copy or SendRecv in place, or their adjoints that add;
Deallocate), and the interpreters' fast paths read the same movement, so one handler per
interpreter serves every such collective.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from abc import abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from .errors import OperandError
from .layout import union_space
from .movement import Copy, CopyAdjoint, SendRecv, SendRecvAdjoint
from .operator import Composition, Identity, LinearOperator, StoredSpaces
from .partition import WorkerRange
from .primitives import Allocate, Deallocate
from .space import Block, GridSpace, Space, natural_key

__all__ = [
    "NO_OTHERS",
    "JoinedSpace",
    "PieceMovement",
    "Piece",
    "PieceMover",
    "fields_of",
    "make_piece",
    "nonempty_pieces",
    "origin",
]


# -- pieces and their movements -------------------------------------
@dataclass(frozen=True, slots=True)
class Piece:
    """A box of an old block (``source``) that goes to a box of a new block (``target``)."""

    source: str
    source_start: tuple[int, ...]
    target: str
    target_start: tuple[int, ...]
    shape: tuple[int, ...]

    def source_index(self) -> tuple[slice, ...]:
        """The numpy index of the box inside the source block."""
        return tuple(slice(a, a + n) for a, n in zip(self.source_start, self.shape))

    def target_index(self) -> tuple[slice, ...]:
        """The numpy index of the box inside the target block."""
        return tuple(slice(a, a + n) for a, n in zip(self.target_start, self.shape))

    def reversed(self) -> Piece:
        """The same box travelling the other way (target to source): the piece of the dual."""
        return Piece(self.target, self.target_start, self.source, self.source_start, self.shape)


@dataclass(frozen=True)
class PieceMovement:
    """An out-of-place data movement: allocate ``created``, move ``pieces``, drop ``dropped``.

    With ``adds=False`` each piece is *copied* into its target (targets are disjoint; a source
    box may be copied several times). With ``adds=True`` each piece is *added* into its target
    and its source box cleared (the adjoint of a copy); targets may receive several pieces.
    Either way the matrix is the identity on pass-through blocks plus a one at (target entry,
    source entry) for every entry of every piece.
    """

    created: tuple[Block, ...]
    pieces: tuple[Piece, ...]
    dropped: tuple[str, ...]
    adds: bool = False

    def expand(self, domain: Space) -> LinearOperator:
        """The movement as primitives on ``domain``: Allocate, in-place Copy / SendRecv (or their
        adjoints, which add), Deallocate; SendRecv wherever the two blocks' workers differ."""
        factors: list[LinearOperator] = []
        space = domain
        for block in self.created:
            node: LinearOperator = Allocate(space, block)
            factors.append(node)
            space = node.range
        for piece in self.pieces:
            old = space[piece.source][piece.source_index()]
            new = space[piece.target][piece.target_index()]
            remote = old.worker != new.worker
            if self.adds:
                factors.append(SendRecvAdjoint(new, old) if remote else CopyAdjoint(new, old))
            else:
                factors.append(SendRecv(old, new) if remote else Copy(old, new))
        for name in self.dropped:
            node = Deallocate(space, name)
            factors.append(node)
            space = node.range
        if not factors:
            return Identity(domain)
        return Composition(tuple(reversed(factors)))


def fields_of(node: Any) -> dict[str, Any]:
    """The constructor fields of a dataclass node, by name: what its twin (its adjoint, which
    declares the same fields) is built from, by keyword, so that no field order is relied on."""
    return {field.name: getattr(node, field.name) for field in dataclasses.fields(node) if field.init}


def origin(block: Block) -> tuple[int, ...]:
    """The start of a whole block: zeros, one per dimension."""
    return (0,) * block.ndim


def make_piece(
    source: Block | str,
    source_start: Sequence[int],
    target: Block | str,
    target_start: Sequence[int],
    shape: Sequence[int],
) -> Piece | None:
    """The piece moving the box of ``shape`` at ``source_start`` of ``source`` to
    ``target_start`` of ``target``, or None when the box is empty."""
    shape = tuple(shape)
    if any(n == 0 for n in shape):
        return None
    return Piece(
        source if isinstance(source, str) else source.name,
        tuple(source_start),
        target if isinstance(target, str) else target.name,
        tuple(target_start),
        shape,
    )


def nonempty_pieces(items: Iterable[Piece | None]) -> tuple[Piece, ...]:
    """The pieces that are not None (empty boxes move nothing)."""
    return tuple(p for p in items if p is not None)


class PieceMover(StoredSpaces):
    """Base of the out-of-place collectives: a node defined by a :class:`PieceMovement`.

    Subclasses provide ``_setup`` (validation, called after construction) and the forward
    direction of their geometry: :meth:`_forward_layouts` (the layout whose blocks are consumed,
    the one whose blocks are produced) and :meth:`_forward_pieces`. The twin that runs the
    geometry backwards (``BACKWARD``: a sum-reduce, a reduce-scatter, a gather) swaps the two
    layouts and reverses every piece; ``ADDS`` says whether the pieces are added (the adjoint of
    a copy) or copied. ``others`` are pass-through blocks. Interpreters may register one fast
    path for this base class and serve every subclass.
    """

    others: Space
    ADDS: ClassVar[bool] = False
    BACKWARD: ClassVar[bool] = False

    def __post_init__(self) -> None:
        self._setup()

    @abstractmethod
    def _setup(self) -> None:
        """Check the fields, then :meth:`_validate` the spaces."""

    @abstractmethod
    def _forward_layouts(self) -> tuple[Any, Any]:
        """The (source, target) layouts of the geometry's forward direction (each a
        :class:`~linop.layout.Layout`, or one :class:`~linop.Block`: a scatter's root)."""

    @abstractmethod
    def _forward_pieces(self) -> tuple[Piece, ...]:
        """The boxes that travel from the forward source's blocks to the forward target's."""

    def layouts(self) -> tuple[Any, Any]:
        """The (source, target) layouts: the node consumes the first one's blocks and produces
        the second one's (each a :class:`~linop.layout.Layout`, or one :class:`~linop.Block`:
        a scatter's root or a gather's)."""
        source, target = self._forward_layouts()
        return (target, source) if self.BACKWARD else (source, target)

    def _oriented(self, forward: tuple[Piece, ...]) -> tuple[Piece, ...]:
        """Pieces of the forward direction as this node moves them (reversed when ``BACKWARD``)."""
        return tuple(p.reversed() for p in forward) if self.BACKWARD else forward

    def _pieces(self) -> tuple[Piece, ...]:
        """The boxes that travel from consumed to produced blocks."""
        return self._oriented(self._forward_pieces())

    def _sources(self) -> tuple[Block, ...]:
        """The blocks the operator consumes."""
        return _blocks(self.layouts()[0])

    def _targets(self) -> tuple[Block, ...]:
        """The blocks the operator produces."""
        return _blocks(self.layouts()[1])

    def rank_pieces(self, worker: int) -> tuple[Piece, ...] | None:
        """The pieces that move data of ``worker``'s blocks (from or into them), in the order of
        :attr:`movement`, found without the whole movement; None when the node cannot tell (then
        only the whole movement says)."""
        return None

    def _validate(self) -> None:
        if not isinstance(self.others, Space):
            raise OperandError(
                f"{type(self).__name__}: others must be a Space, not {type(self.others).__name__}"
            )
        kind = type(self).__name__
        source, target = (Space([x]) if isinstance(x, Block) else x.space for x in self.layouts())
        others = self.others
        if _disjoint(source, target) and (
            not len(others) or (_disjoint(others, source) and _disjoint(others, target))
        ):
            # the spaces are the layouts' own (and the pass-through blocks), described by their
            # rules: no union of P blocks built to find a repeated name that cannot be there
            object.__setattr__(self, "_domain", joined(kind, others, source))
            object.__setattr__(self, "_range", joined(kind, others, target))
            return
        union_space(kind, self._sources(), self._targets(), self.others)
        object.__setattr__(self, "_domain", union_space(kind, self.others, self._sources()))
        object.__setattr__(self, "_range", union_space(kind, self.others, self._targets()))

    @functools.cached_property
    def movement(self) -> PieceMovement:
        """The node's movement (computed once): create the targets, move the pieces, drop the
        sources."""
        return PieceMovement(
            self._targets(), self._pieces(), tuple(b.name for b in self._sources()), adds=self.ADDS
        )

    def expand(self) -> LinearOperator:
        """The movement in primitives (see :meth:`PieceMovement.expand`)."""
        return self.movement.expand(self.domain)


def _blocks(side: Any) -> tuple[Block, ...]:
    """The blocks of one side of a movement: a layout's, or the one block."""
    return (side,) if isinstance(side, Block) else tuple(side.blocks)


SMALL = 8
"""The most blocks a plain space may hold for :func:`_disjoint` to look its names up in a grid
one by one (a pass-through space of a few parameter blocks, a scatter's root)."""


def _disjoint(a: Space, b: Space) -> bool:
    """True when two spaces, at least one a grid (or a :class:`JoinedSpace` of grids and small
    spaces), share no block name, found without listing a grid's blocks: two grids with
    different prefixes share none, and a small space's names are looked up in the grid; False
    when not sure."""
    if isinstance(a, JoinedSpace):
        return all(_disjoint(part, b) for part in a.parts)
    if isinstance(b, JoinedSpace):
        return all(_disjoint(a, part) for part in b.parts)
    if isinstance(a, GridSpace) and isinstance(b, GridSpace):
        return a.prefix != b.prefix
    if isinstance(b, GridSpace) and len(a) <= SMALL:
        return not any(name in b for name in a.names)
    if isinstance(a, GridSpace) and len(b) <= SMALL:
        return not any(name in a for name in b.names)
    return False


def joined(kind: str, *spaces: Space) -> Space:
    """The union of spaces known to share no block name: one of them when the others are
    empty, a plain space when none is a grid (small: checked again by
    :func:`~linop.layout.union_space`), else a :class:`JoinedSpace` described by its parts."""
    parts: list[Space] = []
    for space in spaces:
        parts.extend(space.parts if isinstance(space, JoinedSpace) else (space,) if len(space) else ())
    if len(parts) <= 1:
        return parts[0] if parts else Space()
    if not any(isinstance(part, GridSpace) for part in parts):
        return union_space(kind, *parts)
    return JoinedSpace(tuple(parts))


class JoinedSpace(Space):
    r"""The union of spaces that share no block name (a movement's pass-through blocks next to
    the grid of its copies), described by its parts instead of a list of blocks.

    It is the :class:`~linop.Space` of all the parts' blocks: it compares, hashes, iterates
    and flattens as that space does, its blocks merged into natural order on first use (as a
    :class:`~linop.space.GridSpace` lists its blocks). Looking up a block, membership, the
    length, the size, the blocks a worker owns and the largest worker ask the parts
    (:math:`O(\text{parts})` each, no grid listed); two joined spaces of the same parts are
    equal without either being listed. As for a grid space, a name found in no part (the
    error names the closest blocks) and a block's offset in the flattened state list the
    blocks, once.

    The caller has checked that no two parts share a name (:func:`_disjoint`).
    """

    __slots__ = ("_parts",)

    def __init__(self, parts: tuple[Space, ...]) -> None:
        self._parts = parts

    def __getattr__(self, name: str) -> Any:
        # the slots of a plain space (every block, and the hash of them) are filled on first use
        if name in ("_blocks", "_by_name", "_offsets", "_hash"):
            ordered = self._ordered_parts()  # part after part when they do not interleave
            if ordered is not None:
                merged = tuple(itertools.chain.from_iterable(part.blocks for part in ordered))
            else:
                merged = tuple(sorted(itertools.chain.from_iterable(self._parts), key=_name_key))
            self._adopt(merged)
            return object.__getattribute__(self, name)
        raise AttributeError(name)

    @staticmethod
    def union(kind: str, *spaces: Space) -> Space:
        """The union of ``spaces``: joined (:func:`joined`, no grid listed) when no two share
        a block name, known without listing a grid (two grids of different prefixes, a few
        names looked up in a grid); else :func:`~linop.layout.union_space`, which lists them and
        raises its :class:`~linop.BlockExistsError` naming ``kind`` and a repeated name."""
        if all(_disjoint(a, b) for a, b in itertools.combinations(spaces, 2)):
            return joined(kind, *spaces)
        return union_space(kind, *spaces)

    @property
    def parts(self) -> tuple[Space, ...]:
        """The spaces joined, as given."""
        return self._parts

    def _part_of(self, name: object) -> Space | None:
        return next((part for part in self._parts if name in part), None)

    def block(self, name: str) -> Block:
        """The block called ``name``."""
        part = self._part_of(name)
        return super().block(name) if part is None else part.block(name)  # raises when none

    def __contains__(self, name: object) -> bool:
        return self._part_of(name) is not None

    def __len__(self) -> int:
        return sum(len(part) for part in self._parts)

    @property
    def size(self) -> int:
        """Total number of entries."""
        return sum(part.size for part in self._parts)

    @property
    def max_worker(self) -> int:
        """The largest worker that owns a block."""
        return max(part.max_worker for part in self._parts)

    @property
    def workers(self) -> Sequence[int]:
        """The workers that own a block, sorted: a part's described range when it holds the
        others' workers, else listed."""
        large = [part for part in self._parts if len(part) > SMALL]
        if len(large) == 1 and isinstance(large[0].workers, WorkerRange):
            found = large[0].workers
            if all(w in found for part in self._parts if part is not large[0] for w in part.workers):
                return found
        return tuple(sorted(set(itertools.chain.from_iterable(part.workers for part in self._parts))))

    def owned(self, worker: int) -> tuple[Block, ...]:
        """The blocks ``worker`` owns, in canonical order."""
        found = itertools.chain.from_iterable(part.owned(worker) for part in self._parts)
        return tuple(sorted(found, key=_name_key))

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if isinstance(other, JoinedSpace) and len(self._parts) == len(other._parts):
            if all(any(mine == theirs for theirs in other._parts) for mine in self._parts):
                return True  # the same parts (each equal to one of the other's; all disjoint)
        return super().__eq__(other)

    def __hash__(self) -> int:
        ordered = self._ordered_parts()
        if ordered is None:
            return self._hash  # the parts interleave: hashed as the listed space is
        # a space's hash (linop.space): its length and its first, middle and last blocks
        length = len(self)
        picks = (_nth(ordered, 0), _nth(ordered, length // 2), _nth(ordered, length - 1))
        return hash((length, *picks))

    def description(self, describe: Callable[[Space], bytes]) -> bytes:
        """The parts' descriptions as bytes (what a fingerprint reads), in natural order of
        each part's first block name: ``J<count>:`` then, for each part, the length of
        ``describe(part)`` and those bytes (no part's bytes can be read as another's).

        Equal for two joined spaces of the same parts in any order (disjoint parts have
        distinct first names) and the same on every rank. ``describe`` is the fingerprint's
        description of one part (a grid's rule, a small space's listing); a part that is
        itself joined is described by its parts (``joined`` never nests them).
        """
        parts = [part for part in self._flat_parts() if len(part)]  # an empty part holds nothing
        parts.sort(key=lambda part: natural_key(_nth([part], 0).name))
        described = [describe(part) for part in parts]
        return b"J%d:" % len(parts) + b"".join(b"%d:" % len(text) + text for text in described)

    def _flat_parts(self) -> list[Space]:
        """The parts, a joined part replaced by its own parts."""
        flat: list[Space] = []
        for part in self._parts:
            flat.extend(part._flat_parts() if isinstance(part, JoinedSpace) else (part,))
        return flat

    def _ordered_parts(self) -> list[Space] | None:
        """The parts in natural order of their names when each part's names all sort before the
        next part's (a grid's blocks are in C order of the grid index, so its first and last
        blocks bound it); None when they interleave."""
        ends = sorted(
            ((_nth([part], 0), _nth([part], len(part) - 1), part) for part in self._parts),
            key=lambda e: natural_key(e[0].name),
        )
        for (_, last, _), (first, _, _) in itertools.pairwise(ends):
            if natural_key(last.name) >= natural_key(first.name):
                return None
        return [part for _, _, part in ends]


def _name_key(block: Block) -> tuple[Any, ...]:
    """The canonical order of blocks in a space: natural order of their names."""
    return natural_key(block.name)


def _nth(parts: list[Space], position: int) -> Block:
    """The block at ``position`` of the parts' blocks, part after part (a grid's block found
    from its C-order position, none other built)."""
    for part in parts:
        if position < len(part):
            if not isinstance(part, GridSpace):
                return part.blocks[position]
            index = []
            for n in reversed(part.partition.shape):
                position, i = divmod(position, n)
                index.append(i)
            return part.block_of(tuple(reversed(index)))
        position -= len(part)
    raise IndexError(position)


NO_OTHERS = Space()
