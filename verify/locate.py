"""Positions in a flattened state, named as (block, index) pairs.

Every verification level reports a wrong entry by the block that holds it and the index inside
that block, never by a flat position: ``x[1, 2]`` says where to look, ``17`` does not.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from linop import Space

__all__ = ["Location", "locate", "locations"]


@dataclass(frozen=True, slots=True)
class Location:
    """One entry of a state: the block's name and the index inside the block."""

    block: str
    index: tuple[int, ...]

    def __str__(self) -> str:
        if not self.index:
            return f"{self.block}[()]"
        return f"{self.block}[{', '.join(map(str, self.index))}]"

    def __repr__(self) -> str:
        return f"Location({self.block!r}, {self.index})"


def locations(space: Space, positions: np.ndarray) -> list[Location]:
    """The (block, index) of each flat position of ``space``'s canonical flattening."""
    positions = np.asarray(positions, dtype=np.int64)
    if positions.size and (positions.min() < 0 or positions.max() >= space.size):
        raise IndexError(f"flat positions out of range for a space of size {space.size}")
    blocks = [b for b in space.blocks if b.size]
    offsets = np.array([space.offset(b.name) for b in blocks], dtype=np.int64)
    found: list[Location] = []
    for position in positions.tolist():
        at = int(np.searchsorted(offsets, position, side="right")) - 1
        block = blocks[at]
        index = np.unravel_index(position - offsets[at], block.shape) if block.ndim else ()
        found.append(Location(block.name, tuple(int(i) for i in index)))
    return found


def locate(space: Space, position: int) -> Location:
    """The (block, index) of one flat position of ``space``."""
    return locations(space, np.array([position]))[0]
