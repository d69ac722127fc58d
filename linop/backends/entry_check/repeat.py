"""The same arrays again: :class:`Repeat`, what a passed entry check remembers of its call.

A time loop passes the same arrays to the same plan call after call. The check's collective
must still run on every call (it keeps the ranks in step and finds a rank whose input
differs), but the local work around it need not: a call that passes what the previous passed
call did (the same array object under the same name, with the same shape, strides, dtype object
and, in place, writeability) has the same local verdict, sends the same vector, and, when the
reduced vector comes back equal to it, gets the same outcome. :meth:`Repeat.same` tests that
in a few comparisons; :meth:`EntryCheck.again <linop.backends.entry_check.EntryCheck.again>`
then reduces the kept vector.

What makes a kept decision stale, and how each is caught:

- another array, or the same under another name, or a dict with more keys: the object test
  (the array is held by a weak reference, so a new array that reuses a collected one's
  ``id`` is never taken for it: the reference is dead then);
- ``a.shape = ...``, ``a.strides = ...``, ``a.dtype = ...`` on the same object: compared each
  call (contiguity follows from shape and strides; the dtype by object, so a byte-order or
  metadata change is a miss too);
- ``a.flags.writeable = False`` before an in-place call: compared each call;
- ``a.resize(...)`` (which could move the memory under an unchanged object): numpy refuses it
  for an array with weak references unless ``refcheck=False``, which numpy documents as unsafe;
- the tree's local kernels settling a dtype (the vector's unsettled flags change): the kept
  version is compared before any communication (:meth:`Repeat.current`);
- another rank's input changing: that rank's vector differs, so the reduced vector differs
  from the kept one on every rank, and the outcome is decoded afresh from it.

An engine may keep its own prepared run of these arrays in :attr:`Repeat.run` (the MPI
executor's in-place binding, the torch.distributed executor's prepared phases): valid exactly
as long as the repeat is, since it depends on nothing else the repeat does not compare.
"""

from __future__ import annotations

import weakref
from dataclasses import InitVar, dataclass, field
from typing import Any

import numpy as np

from .outcome import CheckOutcome

__all__ = ["Repeat"]


class _WeaklyReferenced:
    """A base whose slot lets a slotted dataclass be weakly referenced (``weakref_slot=True``
    needs Python 3.11)."""

    __slots__ = ("__weakref__",)


@dataclass(eq=False, repr=False, slots=True)
class Repeat(_WeaklyReferenced):
    """One passed call of a single-block state (the common case), kept for the next.

    Parameters
    ----------
    name : str
        The block's name.
    array : numpy.ndarray
        The array passed (held by a weak reference: the repeat never keeps it alive).
    inplace : bool
        Whether the call was in place (then writeability was part of the verdict).
    signature, sent, vector
        The check vector the call sent (the agreement's ``signature`` and ``sent`` for it, and
        the vector itself), as :meth:`EntryCheck._run_single
        <linop.backends.entry_check.EntryCheck._run_single>` prepared it.
    version : int
        The kernels' version the vector's unsettled flags say.
    outcome : CheckOutcome
        What the ranks agreed when every rank sent this very vector.
    """

    name: str
    array: InitVar[np.ndarray]
    inplace: bool
    signature: Any
    sent: bytes
    vector: np.ndarray
    version: int
    outcome: CheckOutcome
    ref: Any = field(init=False)
    shape: tuple[int, ...] = field(init=False)
    strides: tuple[int, ...] = field(init=False)
    dtype: np.dtype = field(init=False)
    run: Any = field(default=None, init=False)
    """The engine's prepared run of these arrays (set by the engine after its first run)."""
    hits: int = field(default=0, init=False)
    """How many calls this repeat has served (for tests and benchmarks)."""

    def __post_init__(self, array: np.ndarray) -> None:
        self.ref = weakref.ref(array)
        self.shape = array.shape
        self.strides = array.strides
        self.dtype = array.dtype

    def same(self, state: Any, inplace: bool) -> bool:
        """Whether ``state`` holds exactly the kept array, unchanged in every property the
        check's local verdict depends on (see the module docstring), for a call ``inplace``
        alike. Reads nothing else and communicates nothing."""
        if type(state) is not dict or len(state) != 1 or inplace is not self.inplace:
            return False
        array, kept = state.get(self.name), self.ref()  # kept: None once the array is collected
        if array is None or kept is not array:
            return False
        if array.shape != self.shape or array.strides != self.strides or array.dtype is not self.dtype:
            return False
        return not inplace or bool(array.flags.writeable)
