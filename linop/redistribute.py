r"""Redistribute a global array between two placements on one device mesh, exactly
(``docs/theory.md#collectives``; the layouts are :class:`~linop.mesh_layout.MeshLayout`).

For source layout :math:`A` and destination :math:`B` on one mesh, the destination block at
coordinate :math:`t` receives, from every *compatible* source block :math:`s`, the part of its
box that lies in its own box (:math:`\mathrm{box}_A(s) \cap \mathrm{box}_B(t)`), summed:

.. math::

    y_t = \sum_{s \sim t} E_t\, S_s\, x_s, \qquad
    s \sim t \iff \text{for every mesh dimension } i:
    \begin{cases}
    s_i = t_i & A_i \in \{R\} \text{ (read one's own replica), or } A_i = S, B_i = P, \text{ or } A_i = B_i = P \\
    \text{any } s_i & A_i = P \ne B_i \text{ (sum the partial terms)}, \text{ or } A_i = S \ne B_i \text{ (any overlapping piece)}
    \end{cases}

and, where :math:`A_i = R` and :math:`B_i = P`, only :math:`t_i = 0` (the value goes to
partial term 0, the others are zero). Every destination entry then holds the global value its
layout asks for, whatever the sizes (uneven, empty, nested): the boxes are intersected, never
assumed equal. Replacing ``Replicate`` by ``Partial`` and back (:meth:`MeshLayout.dual`)
leaves the compatibility relation symmetric, so

.. math:: \mathrm{Redistribute}(A, B)^* = \mathrm{Redistribute}(B^\dagger, A^\dagger)

with :math:`X^\dagger` the dual layout (the gradient of copies is a partial sum, that of a
partial sum copies): the adjoint is a redistribute too, derived by this rule.

A redistribute without partial terms to sum (no mesh dimension with :math:`A_i = P \ne B_i`)
is one copying movement (:class:`RedistributeCopies`: each destination entry receives one piece, a
source entry may feed several, e.g. an all-gather); one without new copies (no :math:`B_i = R
\ne A_i`) is one movement that adds (:class:`RedistributeSums`: e.g. a reduce-scatter). One that
needs both (``Partial -> Replicate``: an all-reduce) goes through the layout :math:`M` in which
those mesh dimensions shard instead (reduce-scatter, then all-gather), and expands into the two.

==================================  ==============================  ==================================
node                                forward                         adjoint
==================================  ==============================  ==================================
Redistribute(A, B)                  y = the array of x, placed B    Redistribute(B^dagger, A^dagger)
RedistributeCopies(A, B)            copy every compatible piece     RedistributeSums(B^dagger, A^dagger)
RedistributeSums(A, B)              add every compatible piece      RedistributeCopies(B^dagger, A^dagger)
==================================  ==============================  ==================================
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from .errors import GlobalShapeError, OperandError, PlacementError
from .mesh_layout import MeshLayout, Partial, Replicate, Shard
from .operator import Composition, LinearOperator, StoredSpaces
from .pieces import NO_OTHERS, Piece, PieceMover, make_piece
from .space import Space

__all__ = [
    "Redistribute",
    "RedistributeCopies",
    "RedistributeSums",
    "compatible_sources",
    "intermediate_layout",
]


def _check_pair(kind: str, source: object, destination: object) -> None:
    for what, layout in (("source", source), ("destination", destination)):
        if not isinstance(layout, MeshLayout):
            raise OperandError(f"{kind}: the {what} must be a MeshLayout, not {type(layout).__name__}")
    assert isinstance(source, MeshLayout) and isinstance(destination, MeshLayout)
    if source.global_shape != destination.global_shape:
        raise GlobalShapeError(
            f"{kind}: layout {source.name!r} has global shape {source.global_shape} but layout "
            f"{destination.name!r} has global shape {destination.global_shape}"
        )
    if source.mesh_shape != destination.mesh_shape:
        raise PlacementError(
            f"{kind}: layout {source.name!r} is on mesh {source.mesh_shape} but layout {destination.name!r} "
            f"on mesh {destination.mesh_shape} (a redistribute keeps the mesh)"
        )
    if source.ranks != destination.ranks:
        raise PlacementError(
            f"{kind}: layouts {source.name!r} and {destination.name!r} place the mesh on different ranks "
            f"({list(source.ranks)} and {list(destination.ranks)})"
        )
    if source.name == destination.name:
        raise OperandError(f"{kind}: source and destination layouts are both named {source.name!r}")


def compatible_sources(
    source: MeshLayout, destination: MeshLayout, t: tuple[int, ...]
) -> Iterator[tuple[int, ...]]:
    """The source coordinates ``s ~ t`` whose boxes meet destination block ``t``'s (see the
    module docstring), in C order."""
    lo, hi = destination.box(t)
    choices: list[list[int] | None] = []
    for i, (a, b) in enumerate(zip(source.placements, destination.placements)):
        if isinstance(a, Replicate):
            choices.append([t[i]] if not isinstance(b, Partial) or t[i] == 0 else [])
        elif isinstance(a, Partial):
            choices.append([t[i]] if isinstance(b, Partial) else list(range(source.mesh_shape[i])))
        else:
            choices.append([t[i]] if isinstance(b, Partial) else None)  # None: decided by the boxes
    # the Shard dimensions: per tensor dimension, the pieces of the source overlapping t's box
    per_dim = []
    for d in range(source.ndim):
        cuts = source.shard_mesh_dims(d)
        found = []
        for k in source.pieces_overlapping(d, lo[d], hi[d]):
            coordinates = source.piece_coordinates(d, k)
            if all(choices[i] is None or coordinates[n] in choices[i] for n, i in enumerate(cuts)):  # type: ignore[operator]
                found.append(dict(zip(cuts, coordinates)))
        if not found:
            return
        per_dim.append(found)
    free = [i for i, c in enumerate(choices) if c is not None]
    for shard_parts in itertools.product(*per_dim):
        s = [0] * len(source.mesh_shape)
        for part in shard_parts:
            for i, c in part.items():
                s[i] = c
        for values in itertools.product(*(choices[i] or () for i in free)):
            for i, c in zip(free, values):
                s[i] = c
            yield tuple(s)


def intermediate_layout(source: MeshLayout, destination: MeshLayout) -> MeshLayout:
    """The layout :math:`M` between ``source`` and ``destination`` when a mesh dimension goes
    from ``Partial`` to ``Replicate``: there :math:`M` shards (the largest tensor dimension);
    where the source is partial and the destination shards or stays partial, :math:`M` takes
    the destination's placement; elsewhere the source's. So ``source -> M`` only adds and
    ``M -> destination`` only copies. Sizes: the source's or the destination's where one of
    them cuts a tensor dimension along the same mesh dimensions, else ``torch.chunk``'s."""
    largest = max(range(source.ndim), key=lambda d: source.global_shape[d]) if source.ndim else None
    placements: list[Shard | Replicate | Partial] = []
    for i, (a, b) in enumerate(zip(source.placements, destination.placements)):
        if isinstance(a, Partial) and isinstance(b, Replicate):
            if largest is None:
                raise PlacementError(
                    f"redistribute {source.name!r} -> {destination.name!r}: mesh dimension {i} goes from Partial "
                    "to Replicate, which a 0-d tensor cannot shard on the way"
                )
            placements.append(Shard(largest))
        elif isinstance(a, Partial):
            placements.append(b)
        else:
            placements.append(a)
    draft = source.with_placements(placements, name=f"{source.name}_{destination.name}_mid")
    sizes = []
    for d in range(source.ndim):
        cuts = draft.shard_mesh_dims(d)
        if cuts == source.shard_mesh_dims(d):
            sizes.append(source.sizes[d])
        elif cuts == destination.shard_mesh_dims(d):
            sizes.append(destination.sizes[d])
        else:
            sizes.append(draft.sizes[d])
    return source.with_placements(placements, sizes, name=draft.name)


def _fans(source: MeshLayout, destination: MeshLayout) -> tuple[bool, bool]:
    """(partial terms to sum, new copies to make)."""
    fan_in = any(
        isinstance(a, Partial) and not isinstance(b, Partial)
        for a, b in zip(source.placements, destination.placements)
    )
    fan_out = any(
        isinstance(b, Replicate) and not isinstance(a, Replicate)
        for a, b in zip(source.placements, destination.placements)
    )
    return fan_in, fan_out


@dataclass(frozen=True, eq=True, repr=False)
class _RedistributeGeometry(PieceMover):
    """The fields and pieces shared by :class:`RedistributeCopies` and
    :class:`RedistributeSums` (each builds the other's dual from them)."""

    source: MeshLayout
    destination: MeshLayout
    others: Space = NO_OTHERS

    def _setup(self) -> None:
        kind = type(self).__name__
        _check_pair(kind, self.source, self.destination)
        fan_in, fan_out = _fans(self.source, self.destination)
        if fan_in if not self.ADDS else fan_out:
            raise PlacementError(
                f"{kind}: {self.source} -> {self.destination} needs "
                + (
                    "partial terms summed (use RedistributeSums or Redistribute)"
                    if not self.ADDS
                    else "copies made (use RedistributeCopies or Redistribute)"
                )
            )
        self._validate()

    def _forward_layouts(self) -> tuple[MeshLayout, MeshLayout]:
        return self.source, self.destination

    def _forward_pieces(self) -> tuple[Piece, ...]:
        pieces = []
        for t in self.destination.partition.indices():
            lo_t, hi_t = self.destination.box(t)
            target = self.destination.block_name(t)
            for s in compatible_sources(self.source, self.destination, t):
                lo_s, hi_s = self.source.box(s)
                start = tuple(max(a, b) for a, b in zip(lo_s, lo_t))
                stop = tuple(min(a, b) for a, b in zip(hi_s, hi_t))
                piece = make_piece(
                    self.source.block_name(s),
                    tuple(a - b for a, b in zip(start, lo_s)),
                    target,
                    tuple(a - b for a, b in zip(start, lo_t)),
                    tuple(b - a for a, b in zip(start, stop)),
                )
                if piece is not None:
                    pieces.append(piece)
        return tuple(pieces)


@dataclass(frozen=True, eq=True, repr=False)
class RedistributeCopies(_RedistributeGeometry):
    r"""A redistribute without partial terms to sum: every compatible piece copied.

    .. math:: y_t\big|_{b} = x_s\big|_{b}, \quad b = \mathrm{box}_A(s) \cap \mathrm{box}_B(t),
       \ s \sim t; \qquad C^* = \mathrm{RedistributeSums}(B^\dagger, A^\dagger)

    Raises
    ------
    PlacementError
        If a mesh dimension goes from ``Partial`` to something else (there are sums to make),
        or the layouts are on different meshes.
    GlobalShapeError
        If the global shapes differ.
    """

    def adjoint(self) -> LinearOperator:
        """The copies' adjoint adds the pieces back: the sums from the dual layouts."""
        return RedistributeSums(self.destination.dual(), self.source.dual(), self.others)

    def __str__(self) -> str:
        return f"RC[{self.source} -> {self.destination}]"


@dataclass(frozen=True, eq=True, repr=False)
class RedistributeSums(_RedistributeGeometry):
    r"""A redistribute without new copies: every compatible piece added into its target.

    .. math:: y_t\big|_{b} \mathrel{+}= x_s\big|_{b}, \quad s \sim t; \qquad
       S^* = \mathrm{RedistributeCopies}(B^\dagger, A^\dagger)

    Raises
    ------
    PlacementError
        If a mesh dimension becomes ``Replicate`` from something else (there are copies to
        make), or the layouts are on different meshes.
    GlobalShapeError
        If the global shapes differ.
    """

    ADDS = True

    def adjoint(self) -> LinearOperator:
        """The sums' adjoint copies: the copies from the dual layouts."""
        return RedistributeCopies(self.destination.dual(), self.source.dual(), self.others)

    def __str__(self) -> str:
        return f"RS[{self.source} -> {self.destination}]"


@dataclass(frozen=True, eq=True, repr=False)
class Redistribute(StoredSpaces):
    r"""Move a global array from layout ``source`` to layout ``destination`` on one mesh.

    .. math:: \mathrm{Redistribute}(A, B)^* = \mathrm{Redistribute}(B^\dagger, A^\dagger)

    Out of place: the source blocks are dropped, the destination blocks are new (names must
    differ). It expands into one :class:`RedistributeCopies` or :class:`RedistributeSums`, or
    both through ``middle`` (default :func:`intermediate_layout`) when partial terms become
    copies; the adjoint goes through the dual of ``middle``.

    Raises
    ------
    OperandError
        If a layout is not a :class:`~linop.mesh_layout.MeshLayout` or the names are equal.
    GlobalShapeError
        If the global shapes differ.
    PlacementError
        If the meshes (shapes or ranks) differ.

    Examples
    --------
    Rows 10/30/7/30 over 4 workers to columns (torch's chunk sizes), and back by the adjoint:

    >>> import numpy as np
    >>> import verify
    >>> from linop.mesh_layout import MeshLayout, Shard
    >>> rows = MeshLayout.from_placements((4,), [Shard(0)], (77, 6), {0: (10, 30, 7, 30)}, name="r")
    >>> columns = rows.with_placements([Shard(1)], name="c")
    >>> move = Redistribute(rows, columns)
    >>> data = np.arange(77 * 6).reshape(77, 6)
    >>> bool((columns.gather(move(rows.scatter(data))) == data).all()), bool(verify.exact_adjoint(move))
    (True, True)
    """

    source: MeshLayout
    destination: MeshLayout
    middle: MeshLayout | None = None

    def __post_init__(self) -> None:
        _check_pair("Redistribute", self.source, self.destination)
        fan_in, fan_out = _fans(self.source, self.destination)
        if fan_in and fan_out and self.middle is None:
            object.__setattr__(self, "middle", intermediate_layout(self.source, self.destination))
        elif self.middle is not None and not (fan_in and fan_out):
            object.__setattr__(self, "middle", None)  # one stage: no layout in between
        object.__setattr__(self, "_domain", self.source.space)
        object.__setattr__(self, "_range", self.destination.space)

    def stages(self) -> tuple[LinearOperator, ...]:
        """The one or two piece movers it expands into, in order of application."""
        fan_in, fan_out = _fans(self.source, self.destination)
        if not fan_in:
            return (RedistributeCopies(self.source, self.destination),)
        if not fan_out:
            return (RedistributeSums(self.source, self.destination),)
        assert self.middle is not None
        return RedistributeSums(self.source, self.middle), RedistributeCopies(self.middle, self.destination)

    def expand(self) -> LinearOperator:
        stages = self.stages()
        return stages[0] if len(stages) == 1 else Composition(tuple(reversed(stages)))

    def adjoint(self) -> LinearOperator:
        """The redistribute between the dual layouts, the other way (through the dual of the
        layout in between: the adjoint of sums-then-copies is sums-then-copies of the duals)."""
        middle = None if self.middle is None else self.middle.dual()
        return Redistribute(self.destination.dual(), self.source.dual(), middle)

    def __str__(self) -> str:
        return f"Redistribute[{self.source} -> {self.destination}]"
