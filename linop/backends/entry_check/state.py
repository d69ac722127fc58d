"""This rank's part of the entry check: is its local state right for the tree?

The problems are the numpy interpreter's (missing, extra, wrongly shaped or non-numeric
blocks; in place, a read-only array, one whose entries overlap in memory, or one array passed
for two blocks), worded with the rank, for the error every rank raises together.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ... import dtypes
from ...errors import DistributedDtypeError, DistributedStateError, DtypeError, LinopError
from ...operator import LinearOperator
from ...space import Block, closest_name
from ..numpy import first_shared_memory, overlaps_itself
from .vector import FLAG_OF

__all__ = ["Problem", "LocalStateCheck", "Refused"]

Problem = tuple[str, type[LinopError]]
"""What is wrong on a rank: the message and the error class every rank raises for it."""


class Refused:
    """A block an engine's entry will not run on, in place of its array, and why (``reason``
    completes "block 'x' ..."): the check reports it as this rank's problem, so every rank
    raises the same :class:`~linop.errors.DistributedStateError` before any data moves."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


class LocalStateCheck:
    """The local test of one tree's domain blocks on one rank.

    Parameters
    ----------
    op : LinearOperator
        The tree.
    domain_blocks : dict of str to Block
        The blocks of ``op.domain`` that this rank owns.
    rank : int
        This rank (named in the messages).
    """

    def __init__(self, op: LinearOperator, domain_blocks: dict[str, Block], rank: int) -> None:
        self.op = op
        self.domain_blocks = domain_blocks
        self.rank = rank
        self.expected = tuple((name, block.shape) for name, block in domain_blocks.items())
        self._same_space: bool | None = None  # domain == range, decided on first in-place use

    def arrays_if_valid(self, state: Any, inplace: bool) -> list[np.ndarray] | None:
        """This rank's arrays, in domain order, when a few cheap tests show the state right
        (a dict holding exactly the rank's blocks as numpy arrays of the right shapes and
        numeric dtypes; writeable, and one block in place or not); None otherwise, and then
        :meth:`problem` decides (and words the error)."""
        if type(state) is not dict or len(state) != len(self.expected):
            return None
        arrays = []
        for name, shape in self.expected:
            array = state.get(name)
            if type(array) is not np.ndarray or array.shape != shape or array.dtype.char not in FLAG_OF:
                return None
            if inplace and not (array.flags.writeable and array.flags.contiguous):
                return None  # read-only, or perhaps overlapping itself: the full test
            arrays.append(array)
        if inplace and (len(arrays) > 1 or not self.domain_is_range()):
            return None  # blocks sharing memory, or domain != range: the full test
        return arrays

    def domain_is_range(self) -> bool:
        """Whether the tree's domain equals its range (compared once)."""
        if self._same_space is None:
            self._same_space = bool(self.op.domain == self.op.range)
        return self._same_space

    def problem(self, state: Any, inplace: bool) -> Problem | None:
        """What is wrong with this rank's local state (None when nothing is), and the error
        class to raise for it."""
        rank = self.rank
        if not isinstance(state, Mapping):
            return (
                f"rank {rank}: the local state must be a dict of arrays, not {type(state).__name__}",
                DistributedStateError,
            )
        for name, block in self.domain_blocks.items():
            if name not in state:
                typo = closest_name(name, [str(n) for n in state if n not in self.op.domain])
                hint = ""
                if typo is not None:  # a misspelt key ('bb' for 'b'): name both
                    hint = f"; it holds {typo!r}, which the domain lacks: did you mean {name!r}?"
                return (
                    f"rank {rank}: local state is missing block {name!r} {block.shape}{hint}",
                    DistributedStateError,
                )
        for name in state:
            if name not in self.domain_blocks:
                if name in self.op.domain:
                    owner = self.op.domain.block(name).worker
                    message = (
                        f"rank {rank}: local state holds block {name!r}, which belongs to worker {owner}"
                    )
                else:
                    message = f"rank {rank}: local state holds block {name!r}, which the domain does not hold"
                return message, DistributedStateError
        for name, block in self.domain_blocks.items():
            array = state[name]
            if isinstance(array, Refused):
                return f"rank {rank}: block {name!r} {array.reason}", DistributedStateError
            if not isinstance(array, np.ndarray):
                return (
                    f"rank {rank}: block {name!r} is a {type(array).__name__}, not a numpy array",
                    DistributedStateError,
                )
            if array.shape != block.shape:
                return (
                    f"rank {rank}: block {name!r} has shape {array.shape}, the domain expects {block.shape}",
                    DistributedStateError,
                )
            try:
                dtypes.check_block_dtype(name, array.dtype)
            except DtypeError as error:
                return f"rank {rank}: {error}", DistributedDtypeError
            if inplace and not array.flags.writeable:
                return (
                    f"rank {rank}: in-place application needs a writeable array for block {name!r}",
                    DistributedStateError,
                )
            if inplace and overlaps_itself(array):
                return (
                    f"rank {rank}: in-place application cannot write block {name!r}: its entries overlap "
                    f"in memory (strides {array.strides} for shape {array.shape}, a broadcast or expanded view)",
                    DistributedStateError,
                )
        if inplace:
            if self.op.domain != self.op.range:
                return f"in-place application of {self.op}: domain and range differ", DistributedStateError
            shared = (
                first_shared_memory({name: state[name] for name in self.domain_blocks})
                if len(self.domain_blocks) > 1
                else None
            )
            if shared is not None:
                return (
                    f"rank {rank}: in-place application needs separate memory per block; blocks "
                    f"{shared[0]!r} and {shared[1]!r} share entries",
                    DistributedStateError,
                )
        return None
