"""The bookkeeping every host-side workspace shares: blocks by name, and which of them it owns.

A workspace may change a block in place only when it owns it (made during the run, or the
caller's under ``inplace=True``); a block it does not own is the caller's and is copied before
its first change. Three workspaces keep this record: the numpy interpreter's
(:class:`~linop.backends.numpy.Workspace`, which the MPI executor and the torch.distributed host
path run on), the torch.distributed device path's (tensors where they are) and the MPI bound
plan's symbolic run (which records the copies as calls). Each copies in its own way
(``writable``); binding and dropping blocks are the same, here (:class:`OwnedBlocks`).
"""

from __future__ import annotations

from typing import Generic, TypeVar

__all__ = ["OwnedBlocks"]

A = TypeVar("A")


class OwnedBlocks(Generic[A]):
    """Blocks by name (``arrays``) and the names of those the workspace owns (``owned``)."""

    __slots__ = ("arrays", "owned")

    def __init__(self, arrays: dict[str, A], owned: set[str]) -> None:
        self.arrays = arrays
        self.owned = owned

    def set(self, name: str, array: A, *, owned: bool = True) -> None:
        """Bind block ``name`` to ``array`` (``owned``: the workspace may change it in place)."""
        self.arrays[name] = array
        if owned:
            self.owned.add(name)
        else:
            self.owned.discard(name)

    def drop(self, name: str) -> A:
        """Remove block ``name`` and return its array."""
        self.owned.discard(name)
        return self.arrays.pop(name)
