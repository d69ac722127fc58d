"""The fingerprint of a tree: a stable digest of its structure, the same on every process.

Executors compare it across ranks before any data moves (the entry check), so that ranks
holding different trees fail together with one clear message instead of hanging.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from typing import Any

import numpy as np

from ..halo_geometry import GeometryRows
from ..local import LocalKernel
from ..operator import LinearOperator
from ..partition import Partition
from ..pieces import JoinedSpace
from ..space import Block, GridSpace, Region, Space

__all__ = ["fingerprint"]


def fingerprint(op: LinearOperator) -> bytes:
    """A stable 16-byte digest of the tree's structure (types, spaces, regions with the shape
    and worker of their block, scalars with their type: ``2`` and ``2.0`` differ).

    The same on every process for the same tree (it does not use Python's randomized
    ``hash``); different trees differ with overwhelming probability. A space is read in the
    form the tree holds it: a grid by its rule, a joined space by its parts (in natural order
    of their first names), any other by its blocks. The form is fixed by how the layouts were
    built (:func:`~linop.pieces.joined` joins exactly when a part is a grid), the same on every
    rank, so equal trees of two ranks hold their spaces in the same form.
    """
    digest = hashlib.blake2b(digest_size=16)
    memo: dict[int, bytes] = {}
    _feed(op, digest, memo)
    return digest.digest()


@functools.lru_cache(maxsize=256)
def _fields_of(kind: type) -> tuple[str, ...]:
    """The names of the fields a dataclass type is built from (``init=False`` fields are
    derived from them, so they add nothing to a digest)."""
    return tuple(field.name for field in dataclasses.fields(kind) if field.init)


def _block_bytes(block: Block, memo: dict[int, bytes]) -> bytes:
    """``repr(block)`` encoded, once per block object (spaces of a tree share their blocks)."""
    text = memo.get(id(block))
    if text is None:
        text = memo[id(block)] = repr(block).encode()
    return text


def _space_bytes(space: Space, memo: dict[int, bytes]) -> bytes:
    """A space as bytes, once per space object: a grid's rule, a joined space's parts (each
    described so, none listed), any other space's blocks listed."""
    text = memo.get(id(space))
    if text is None:
        if isinstance(space, GridSpace):
            text = space.description()
        elif isinstance(space, JoinedSpace):
            text = space.description(lambda part: _space_bytes(part, memo))
        else:
            text = b"S%d:" % len(space) + b",".join(_block_bytes(b, memo) for b in space.blocks)
        memo[id(space)] = text
    return text


def _feed(value: Any, digest: Any, memo: dict[int, bytes]) -> None:
    # memo: bytes by object id, for the spaces and blocks of the tree (alive while it is fed)
    if isinstance(value, (GridSpace, Partition, GeometryRows)):  # described by their rules, not one by one
        digest.update(value.description())
    elif isinstance(value, Space):
        digest.update(_space_bytes(value, memo))
    elif isinstance(value, Region):
        # the block's shape and worker too: a box means a different program on another layout
        digest.update(f"R{value.start}{value.stop}{value.dropped}".encode())
        digest.update(_block_bytes(value.block, memo))
    elif isinstance(value, Block):
        digest.update(b"B" + _block_bytes(value, memo))
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        # a node, layout or geometry: digested once per object (a tree shares its tensors and
        # geometries between nodes), the sub-digest fed wherever it appears
        known = memo.get(id(value))
        if known is None:
            fields = _fields_of(type(value))
            values = [getattr(value, name) for name in fields]
            head = f"<{type(value).__module__}.{type(value).__qualname__}".encode()
            if all(type(v) is int for v in values):  # a row of ints (a geometry row): one buffer
                try:
                    known = head + np.asarray(values, dtype=np.int64).tobytes()
                except OverflowError:
                    known = head + repr(values).encode()
            else:
                sub = hashlib.blake2b(digest_size=16)
                sub.update(head)
                for name, item in zip(fields, values):
                    sub.update(name.encode())
                    _feed(item, sub, memo)
                known = b"D" + sub.digest()
            memo[id(value)] = known
        digest.update(known)
    elif isinstance(value, tuple) and len(value) > 8 and all(type(v) is int for v in value):
        # a long tuple of ints (a partition's workers, a decomposition's sizes): one buffer
        try:
            digest.update(b"I%d:" % len(value) + np.asarray(value, dtype=np.int64).tobytes())
        except OverflowError:  # beyond int64: item by item
            digest.update(repr(value).encode())
    elif type(value) is tuple and len(value) > 8 and value.count(value[0]) == len(value):
        # P equal items (a block grid's uniform shapes): the item once and the count
        digest.update(b"U%d:" % len(value))
        _feed(value[0], digest, memo)
    elif isinstance(value, (tuple, list)):
        digest.update(f"({len(value)}".encode())
        for item in value:
            _feed(item, digest, memo)
        digest.update(b")")
    elif isinstance(value, LocalKernel):  # what it computes, not how JAX runs it
        digest.update(f"K{value.structure}".encode())
    elif isinstance(value, np.ndarray):
        digest.update(f"A{value.dtype.str}{value.shape}".encode())
        digest.update(np.ascontiguousarray(value).tobytes())
    elif callable(value):
        digest.update(
            f"F{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', type(value).__name__)}".encode()
        )
    else:
        digest.update(f"V{type(value).__name__}:{value!r}".encode())
