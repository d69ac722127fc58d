"""Passes over a plan's ops, decided on the host from their static per-device boxes.

A *box* is ``(starts table (devices, ndim), active mask (devices,), shape)``: on each active
device, the entries ``starts[d] .. starts[d] + shape`` of a slot. Two boxes meet when they
share an entry on some device active in both. From the boxes each op reads and writes:

- :func:`drop_dead_clears` drops the clears whose entries no later op reads;
- :func:`fold_self_boxes` moves each device's local copy next to a collective into it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .ops import BoxOp, CollectiveOp, Exchange, collective_piece

__all__ = ["Box", "boxes_meet", "drop_dead_clears", "fold_self_boxes"]

Box = tuple[np.ndarray, np.ndarray, tuple[int, ...]]
"""A per-device box: (starts table (devices, ndim), active mask (devices,), shape)."""


def boxes_meet(a: Box, b: Box) -> bool:
    """Whether two per-device boxes share an entry on some device active in both."""
    both = a[1] & b[1]
    if not both.any() or 0 in a[2] or 0 in b[2]:
        return False
    first, second = a[0][both], b[0][both]
    overlap = (first < second + np.asarray(b[2])) & (second < first + np.asarray(a[2]))
    return bool(overlap.all(axis=1).any())


def _reads(op: Any) -> list[tuple[str, Box]] | None:
    """The boxes whose values ``op`` observes (None: every slot). Writes observe nothing:
    an add or a masked set keeps the old entries, which count only if a later op reads them."""
    if isinstance(op, BoxOp):
        if op.src is None:
            return []
        assert op.src_starts is not None and op.src_shape is not None
        return [(op.src, (op.src_starts, op.active, op.src_shape))]
    if isinstance(op, Exchange):
        senders = np.zeros(len(op.receivers), dtype=bool)
        senders[[s for s, _ in op.perm]] = True
        return [(p.src, (p.src_starts, senders, p.src_shape)) for p in op.pieces]
    if isinstance(op, CollectiveOp):
        found: list[tuple[str, Box]] = []
        for piece in op.pieces:
            used = piece.used()
            found.extend((piece.src, (piece.sends[e], used[e], piece.src_shape)) for e in range(len(used)))
        return found
    return None


def _modes(op: Any) -> list[tuple[str, Box, str]] | None:
    """The boxes ``op`` writes, each with its mode ("set", "add" or "clear")."""
    if isinstance(op, BoxOp):
        return [(op.dst, (op.dst_starts, op.active, op.shape), op.kind)]
    if isinstance(op, Exchange):
        return [(p.dst, (p.dst_starts, op.receivers, p.dst_shape), p.mode) for p in op.pieces]
    if isinstance(op, CollectiveOp):
        found: list[tuple[str, Box, str]] = []
        for piece in op.pieces:
            used = piece.used()
            found.extend(
                (piece.dst, (piece.places[s], used[s], piece.dst_shape), piece.mode) for s in range(len(used))
            )
        return found
    return None


def _conflict(a: Any, b: Any) -> bool:
    """Whether swapping the order of ``a`` and ``b`` (or running them as one) may change a
    result: a box one writes meets a box the other reads or writes (two adds commute)."""
    a_reads, a_writes, b_reads, b_writes = _reads(a), _modes(a), _reads(b), _modes(b)
    if a_reads is None or a_writes is None or b_reads is None or b_writes is None:
        return True
    for slot, box, mode in a_writes:
        if any(slot == other and boxes_meet(box, found) for other, found in b_reads):
            return True
        if any(
            slot == other and boxes_meet(box, found) and not mode == kind == "add"
            for other, found, kind in b_writes
        ):
            return True
    for slot, box in a_reads:
        if any(slot == other and boxes_meet(box, found) for other, found, _ in b_writes):
            return True
    return False


def fold_self_boxes(ops: Sequence[Any], devices: int) -> tuple[Any, ...]:
    """``ops`` with each device's local copy (or add) of a collective's structure, in the box
    ops right before or after it, made the device's box to itself inside the collective (one
    ``all_to_all`` moving every box, not a collective and a local update at per-device starts)
    where the copies commute with the ops they cross and with the collective."""
    ops = list(ops)
    i = 0
    while i < len(ops):
        op = ops[i]
        if not (isinstance(op, CollectiveOp) and len(op.pieces) == 1 and not op.pieces[0].with_self):
            i += 1
            continue
        piece = op.pieces[0]
        chosen: list[int] = []
        covered = np.zeros(devices, dtype=bool)
        for direction in (-1, 1):
            j = i + direction
            crossed: list[BoxOp] = []
            while 0 <= j < len(ops) and isinstance(ops[j], BoxOp):
                box = ops[j]
                if (
                    box.kind == piece.mode
                    and box.src == piece.src
                    and box.dst == piece.dst
                    and box.src_shape == piece.src_shape
                    and box.shape == piece.dst_shape
                    and not (box.active & covered).any()
                    and not _conflict(box, op)
                    and not any(_conflict(box, other) for other in crossed)
                ):
                    chosen.append(j)
                    covered |= box.active
                else:
                    crossed.append(box)
                j += direction
        if not covered.all():
            i += 1
            continue
        sends, places = piece.sends.copy(), piece.places.copy()
        for j in chosen:
            box = ops[j]
            assert box.src_starts is not None
            for d in np.flatnonzero(box.active):
                sends[d, d] = box.src_starts[d]
                places[d, d] = box.dst_starts[d]
        folded = collective_piece(
            piece.src,
            sends,
            piece.src_shape,
            piece.dst,
            places,
            piece.dst_shape,
            piece.mode,
            True,
        )
        ops[i] = CollectiveOp((folded,))
        for j in sorted(chosen, reverse=True):
            del ops[j]
        i = i - sum(j < i for j in chosen) + 1
    return tuple(ops)


def _overwrites(op: Any, slots: dict[str, tuple[int, ...]]) -> str | None:
    """The slot that ``op`` overwrites whole on every device (earlier values unobservable)."""
    if (
        isinstance(op, BoxOp)
        and op.kind != "add"
        and op.active.all()
        and not op.dst_starts.any()
        and op.shape == slots[op.dst]
    ):
        return op.dst
    return None


def drop_dead_clears(
    ops: Sequence[Any],
    live_at_end: set[str],
    slots: dict[str, tuple[int, ...]],
    devices: int,
) -> tuple[Any, ...]:
    """``ops`` without the clears whose entries no later op reads before the slot is
    overwritten whole (the halo cells the adjoint of a halo exchange clears before its bulk
    is read, a block cleared and then dropped): decided box by box, on every device."""
    everyone = np.ones(devices, dtype=bool)
    kept: list[Any] = []
    later: dict[str, list[Box]] | None = {
        s: [(np.zeros((devices, len(slots[s])), np.int32), everyone, slots[s])] for s in live_at_end
    }
    for op in reversed(ops):
        if isinstance(op, BoxOp) and op.kind == "clear" and later is not None:
            box = (op.dst_starts, op.active, op.shape)
            if not any(boxes_meet(box, other) for other in later.get(op.dst, ())):
                continue
        kept.append(op)
        if later is None:
            continue
        whole = _overwrites(op, slots)
        if whole is not None:
            later.pop(whole, None)
        used = _reads(op)
        if used is None:
            later = None
            continue
        for slot, box in used:
            later.setdefault(slot, []).append(box)
    return tuple(reversed(kept))
