"""The ops of a plan for JAX devices: what every device runs alike inside ``shard_map``.

Each op holds its per-device geometry in small static tables (``(devices, ndim)`` starts, a
``(devices,)`` mask of the devices taking part); see :mod:`linop.backends.jax.plan` for
how a tree becomes ops and :mod:`linop.backends.jax.shard` for how they run. No JAX needed here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "Starts",
    "BoxOp",
    "Piece",
    "Exchange",
    "CollectivePiece",
    "CollectiveOp",
    "PsumOp",
    "ScaleOp",
    "ZeroOp",
    "SumOp",
    "KernelCall",
    "KernelOp",
    "collective_piece",
    "kernel_mode",
    "math_size",
]

Starts = np.ndarray
"""(devices, ndim) int32: each device's box start in a slot (zeros where it takes no part)."""


@dataclass(frozen=True, eq=False)
class BoxOp:
    """On each active device: ``dst[box] <- src[box]`` / ``+=`` / ``<- 0`` (``kind``)."""

    kind: str
    src: str | None
    src_starts: Starts | None
    dst: str
    dst_starts: Starts
    shape: tuple[int, ...]  # the destination box shape
    src_shape: tuple[int, ...] | None
    active: np.ndarray  # (devices,) bool
    extents: np.ndarray | None = None
    """(devices, ndim): where set, device ``d``'s source box is cut to its first
    ``extents[d]`` entries (the rest read as zeros): one op for boxes of several shapes."""


@dataclass(frozen=True, eq=False)
class Piece:
    """One transfer of every message of a round: its source and target box and mode."""

    src: str
    src_starts: Starts
    src_shape: tuple[int, ...]
    dst: str
    dst_starts: Starts
    dst_shape: tuple[int, ...]
    mode: str  # "set" or "add"


@dataclass(frozen=True, eq=False)
class Exchange:
    """One ``ppermute`` round: ``perm`` pairs (source device, target device), each message the
    same ``pieces``; ``receivers`` marks the devices that receive."""

    perm: tuple[tuple[int, int], ...]
    pieces: tuple[Piece, ...]
    receivers: np.ndarray


@dataclass(frozen=True, eq=False)
class CollectivePiece:
    """One transfer of a phase in which every device sends to every other device, as a native
    collective over all devices. ``sends[e, d]``: the start of the box device ``d`` sends to
    device ``e``; ``places[s, r]``: where device ``r`` puts the box it receives from ``s``
    (rows ``e == d`` and ``s == r``: a device's box to itself when ``with_self``, else unused).
    ``kind``:

    - ``"all_gather"`` (``set``, each device sends one box to all): ``lax.all_gather``;
    - ``"psum_scatter"`` (``add``, each device adds every box it receives into one place):
      ``lax.psum_scatter`` of the boxes, its own zeroed, added once;
    - ``"all_to_all"`` otherwise: ``lax.all_to_all`` of the boxes stacked by destination.
    """

    kind: str
    src: str
    sends: np.ndarray
    src_shape: tuple[int, ...]
    dst: str
    places: np.ndarray
    dst_shape: tuple[int, ...]
    mode: str
    with_self: bool

    def used(self) -> np.ndarray:
        """(devices, devices) bool: ``[e, d]`` (or ``[s, r]``) whether that box moves."""
        p = len(self.sends)
        return np.ones((p, p), dtype=bool) if self.with_self else ~np.eye(p, dtype=bool)


@dataclass(frozen=True, eq=False)
class CollectiveOp:
    """One phase as native collectives (every device sends to every other), one per piece."""

    pieces: tuple[CollectivePiece, ...]


@dataclass(frozen=True, eq=False)
class PsumOp:
    """A native all-reduce: ``slot <- psum(slot)`` over the mesh axes ``over`` (indices into
    the plan's mesh axes): an AllReduce with one block on every device whose groups are the
    devices that differ only along those axes."""

    slot: str
    over: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class ScaleOp:
    alpha: Any


@dataclass(frozen=True, eq=False)
class ZeroOp:
    pass


@dataclass(frozen=True, eq=False)
class SumOp:
    terms: tuple[tuple[Any, ...], ...]
    slots: tuple[str, ...]  # the range's internal slots, summed


@dataclass(frozen=True, eq=False)
class KernelCall:
    """One device's local kernel: ``node`` (a :class:`~linop.local.LocalOperator` in this
    direction) reads its consumed blocks from the leading corners of their slots (``(slot,
    block shape)``) and writes each produced block into the leading corner of its slot, zeros
    in the rest of the slot."""

    device: int
    node: Any
    consumed: tuple[tuple[str, tuple[int, ...]], ...]
    produced: tuple[tuple[str, tuple[int, ...]], ...]


@dataclass(frozen=True, eq=False)
class KernelOp:
    """The local kernels of one round, at most one per device; a produced slot keeps its
    value on the devices that do not write it. ``mode`` says how they run:

    - ``"single"``: one call, on the only device;
    - ``"spmd"``: the calls are one :class:`~linop.kernel_template.KernelTemplate` (the same
      callables and key, parameters of one rank and dtype, the same slots): ONE program on
      every device, on the slots' common shapes (blocks zero-padded, each device's
      parameters picked from a table stacked over the devices, the results masked to each
      device's blocks);
    - ``"switch"``: each device runs its own call (a ``lax.switch`` on the device index).
    """

    calls: tuple[KernelCall, ...]
    devices: int
    mode: str = "switch"
    unmasked: tuple[bool, ...] = ()
    """``"spmd"``: per consumed slot (in the order of the first call's), True where the slot is
    known to be zero beyond every device's block as the round starts (``widen_boxes`` tracks
    it), so the program reads it whole without masking it; empty: mask every padded one."""

    def __repr__(self) -> str:
        kernels = len({c.node.kernel for c in self.calls})
        return f"KernelOp({self.mode}: {len(self.calls)} calls on {self.devices} devices, {kernels} kernels)"


def kernel_mode(calls: Sequence[KernelCall], devices: int) -> str:
    """How the calls of a round run (see :class:`KernelOp`): ``"spmd"`` where they are one
    template up to parameters and shapes, ``"single"`` for one call on one device, else
    ``"switch"``."""
    if len(calls) == 1 and devices == 1:
        return "single"
    templates = [c.node.kernel.device_template for c in calls]
    first = calls[0]
    if templates[0] is None or any(t is None for t in templates):
        return "switch"
    family = templates[0].family()
    same = all(
        t.family() == family
        and c.node.adjointed == first.node.adjointed
        and [s for s, _ in c.consumed] == [s for s, _ in first.consumed]
        and [s for s, _ in c.produced] == [s for s, _ in first.produced]
        and len(t.params) == len(templates[0].params)
        and all(p.ndim == q.ndim and p.dtype == q.dtype for p, q in zip(t.params, templates[0].params))
        for t, c in zip(templates, calls)
    )
    return "spmd" if same else "switch"


def collective_piece(
    src: str,
    sends: np.ndarray,
    src_shape: tuple[int, ...],
    dst: str,
    places: np.ndarray,
    dst_shape: tuple[int, ...],
    mode: str,
    with_self: bool,
) -> CollectivePiece:
    """The piece, its kind chosen from its tables (see :class:`CollectivePiece`)."""
    p = len(sends)
    used = np.ones((p, p), dtype=bool) if with_self else ~np.eye(p, dtype=bool)
    one_send = all((sends[:, d][used[d]] == sends[(d + 1) % p, d]).all() for d in range(p))
    one_place = all((places[:, r][used[r]] == places[(r + 1) % p, r]).all() for r in range(p))
    same_size = math_size(src_shape) == math_size(dst_shape)
    if mode == "set" and one_send and same_size:
        kind = "all_gather"
    elif mode == "add" and one_place and same_size:
        kind = "psum_scatter"
    else:
        kind = "all_to_all"
    return CollectivePiece(kind, src, sends, src_shape, dst, places, dst_shape, mode, with_self)


def math_size(shape: Sequence[int]) -> int:
    return int(np.prod(shape, dtype=np.int64)) if shape else 1
