"""Passes over a plan's ops, decided on the host from their static per-device boxes.

A *box* is ``(starts table (devices, ndim), active mask (devices,), shape)``: on each active
device, the entries ``starts[d] .. starts[d] + shape`` of a slot. Two boxes meet when they
share an entry on some device active in both. From the boxes each op reads and writes:

- :func:`drop_dead_clears` drops the clears whose entries no later op reads;
- :func:`fold_self_boxes` moves each device's local copy next to a collective into it;
- :func:`widen_boxes` merges the box ops that differ only by the shapes of uneven blocks
  into one op of the largest shape, where the entries it adds are known to be zero.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from .ops import BoxOp, CollectiveOp, Exchange, KernelOp, PsumOp, ScaleOp, SumOp, ZeroOp, collective_piece

__all__ = ["Box", "Support", "boxes_meet", "drop_dead_clears", "fold_self_boxes", "widen_boxes"]

Box = tuple[np.ndarray, np.ndarray, tuple[int, ...]]
"""A per-device box: (starts table (devices, ndim), active mask (devices,), shape)."""

_BEYOND = 1 << 30
"""An extent past the end of every slot: a box of it from the origin is the whole slot."""


def _device_box(devices: int, device: int, shape: tuple[int, ...]) -> Box:
    """The box ``0 .. shape`` on ``device`` alone."""
    active = np.zeros(devices, dtype=bool)
    active[device] = True
    return (np.zeros((devices, len(shape)), np.int32), active, shape)


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
    if isinstance(op, KernelOp):  # each call's blocks (the rest of their slots is not read,
        # except a slot read whole, unmasked, by one program: its zeros there are read)
        whole = op.unmasked or (False,) * len(op.calls[0].consumed)
        return [
            (slot, _device_box(op.devices, c.device, (_BEYOND,) * len(shape) if whole[i] else shape))
            for c in op.calls
            for i, (slot, shape) in enumerate(c.consumed)
        ]
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
    if isinstance(op, KernelOp):  # each produced slot: its block set, the rest of it cleared
        written: list[tuple[str, Box, str]] = []
        for c in op.calls:
            for slot, shape in c.produced:
                written.append((slot, _device_box(op.devices, c.device, (_BEYOND,) * len(shape)), "clear"))
                written.append((slot, _device_box(op.devices, c.device, shape), "set"))
        return written
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
                    and box.extents is None
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


Support = dict[str, list[tuple[int, tuple[int, ...], tuple[int, ...]]]]
"""Per slot, the boxes ``(device, start, stop)`` outside which its entries are known to be
zero on that device."""


def widen_boxes(
    ops: Sequence[Any], support: Support, slots: dict[str, tuple[int, ...]], devices: int
) -> tuple[tuple[Any, ...], Support]:
    """``ops`` with each run of consecutive box ops that differ only by their shapes (one
    kind, source and target slot, on disjoint devices: the same step on uneven blocks) made
    one op of their largest shape, on every device of the run, where that is exact: the
    entries a device's box gains lie inside both slots, are zero in the source, and (for a
    set or a clear) are zero in the target, so the op writes zeros onto zeros. One op where
    there were several: XLA then sees static slices and whole-slot copies (aliases) as for
    even blocks, instead of per-device boxes blended into the whole slot.

    ``support`` (not modified) says where each slot may be nonzero as the ops start (for the
    interface's slots, masked on entry: the blocks); the support after the ops is returned
    with them. Run it before :func:`drop_dead_clears`: the clears it counts on are then read
    by the widened ops, so they are kept.
    """
    support = {slot: list(boxes) for slot, boxes in support.items()}
    out: list[Any] = []
    i = 0
    while i < len(ops):
        op = ops[i]
        if isinstance(op, SumOp):
            terms = []
            after: Support = {}
            for term in op.terms:
                widened, found = widen_boxes(term, support, slots, devices)
                terms.append(widened)
                for slot in op.slots:
                    after.setdefault(slot, []).extend(found.get(slot, []))
            out.append(SumOp(tuple(terms), op.slots))
            support = after
            i += 1
            continue
        if isinstance(op, KernelOp) and op.mode == "spmd":
            op = _unmasked(op, support)
        run = [op]
        if isinstance(op, BoxOp):
            covered = op.active.copy()
            while i + len(run) < len(ops):
                other = ops[i + len(run)]
                if not _same_step(op, other) or (other.active & covered).any():
                    break
                run.append(other)
                covered |= other.active
        merged = _widened(run, support, slots, devices) if len(run) > 1 else None
        if merged is None:
            run = run[:1]
        out.append(op if merged is None else merged)
        for done in run:  # the entries gained are zeros: the support grows by the boxes alone
            _update_support(done, support, slots, devices)
        i += len(run)
    return tuple(out), support


def _unmasked(op: KernelOp, support: Support) -> KernelOp:
    """``op`` (one program for every device) told which consumed slots are zero beyond each
    device's block (``support``: where they may be nonzero), so as not to mask them."""
    flags = []
    for i, (slot, _) in enumerate(op.calls[0].consumed):
        shapes = {c.device: c.consumed[i][1] for c in op.calls}
        flags.append(
            all(
                d in shapes and all(b <= n for b, n in zip(stop, shapes[d]))
                for d, _, stop in support.get(slot, [])
            )
        )
    return dataclasses.replace(op, unmasked=tuple(flags))


def _same_step(first: BoxOp, other: Any) -> bool:
    """Whether ``other`` is the step of ``first`` (one kind, source and target slot, a box of
    as many dimensions, source and target boxes of one shape in both)."""
    if not isinstance(other, BoxOp) or (other.kind, other.src, other.dst) != (
        first.kind,
        first.src,
        first.dst,
    ):
        return False
    if len(other.shape) != len(first.shape):
        return False
    return first.src is None or (first.shape == first.src_shape and other.shape == other.src_shape)


def _widened(
    run: list[BoxOp], support: Support, slots: dict[str, tuple[int, ...]], devices: int
) -> BoxOp | None:
    """The ops of ``run`` (one step on disjoint devices) as one op of their largest shape, or
    None where a device's box would leave its slot or, for a set or a clear, gain an entry of
    the target not known to be zero. Where a source box gains an entry not known to be
    zero, the op cuts each device's source box to its own shape (``extents``)."""
    first = run[0]
    shape = tuple(int(n) for n in np.max([op.shape for op in run], axis=0))
    active = np.zeros(devices, dtype=bool)
    dst_starts = np.zeros_like(first.dst_starts)
    src_starts = None if first.src_starts is None else np.zeros_like(first.src_starts)
    extents = np.zeros_like(first.dst_starts)
    cut = False
    for op in run:
        for d in np.flatnonzero(op.active):
            if np.any(op.dst_starts[d] + np.asarray(shape) > slots[op.dst]):
                return None
            if op.kind != "add" and not _gains_zeros(
                support.get(op.dst, []), int(d), op.dst_starts[d], op.shape, shape
            ):
                return None
            if op.src is not None:
                assert op.src_starts is not None and src_starts is not None
                if np.any(op.src_starts[d] + np.asarray(shape) > slots[op.src]):
                    return None
                if not _gains_zeros(support.get(op.src, []), int(d), op.src_starts[d], op.shape, shape):
                    cut = True
                src_starts[d] = op.src_starts[d]
            dst_starts[d] = op.dst_starts[d]
            extents[d] = op.shape
            active[d] = True
    src_shape = None if first.src is None else shape
    return BoxOp(
        first.kind,
        first.src,
        src_starts,
        first.dst,
        dst_starts,
        shape,
        src_shape,
        active,
        extents if cut else None,
    )


def _gains_zeros(
    boxes: list[tuple[int, tuple[int, ...], tuple[int, ...]]],
    device: int,
    start: np.ndarray,
    narrow: tuple[int, ...],
    wide: tuple[int, ...],
) -> bool:
    """Whether on ``device`` the entries of the box ``start + wide`` outside ``start + narrow``
    lie outside every box of ``boxes`` (so are zero)."""
    start = np.asarray(start)
    wide_stop, narrow_stop = start + np.asarray(wide), start + np.asarray(narrow)
    for d, low, high in boxes:
        if d != device:
            continue
        meet_low, meet_high = np.maximum(low, start), np.minimum(high, wide_stop)
        if (meet_low < meet_high).all() and (meet_high > narrow_stop).any():
            return False
    return True


def _update_support(op: Any, support: Support, slots: dict[str, tuple[int, ...]], devices: int) -> None:
    """``support`` (in place) after ``op``: grown by the boxes it sets or adds, cut by the
    boxes it clears."""
    if isinstance(op, ZeroOp):
        support.clear()
        return
    if isinstance(op, ScaleOp):
        return
    written = _modes(op)
    if isinstance(op, PsumOp) or written is None:  # a psum sums a device's slot over its group
        named = [op.slot] if isinstance(op, PsumOp) else list(slots)
        for slot in named:
            support[slot] = [(d, (0,) * len(slots[slot]), slots[slot]) for d in range(devices)]
        return
    for slot, (starts, mask, shape), mode in written:
        if 0 in shape:
            continue
        for d in np.flatnonzero(mask):
            low = tuple(int(v) for v in starts[d])
            high = tuple(a + n for a, n in zip(low, shape))
            boxes = support.setdefault(slot, [])
            if mode == "clear":
                boxes[:] = [kept for box in boxes for kept in _minus(box, int(d), low, high)]
            else:
                boxes.append((int(d), low, high))


def _minus(
    box: tuple[int, tuple[int, ...], tuple[int, ...]],
    device: int,
    low: tuple[int, ...],
    high: tuple[int, ...],
) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """``box`` without the entries of ``low .. high`` on ``device``, as disjoint boxes."""
    d, start, stop = box
    if d != device or not all(a < top and bottom < b for a, b, bottom, top in zip(start, stop, low, high)):
        return [box]
    pieces = []
    first, last = list(start), list(stop)  # the part not yet cut off, narrowed dimension by dimension
    for k in range(len(first)):
        if first[k] < low[k]:
            pieces.append((d, tuple(first), (*last[:k], low[k], *last[k + 1 :])))
            first[k] = low[k]
        if last[k] > high[k]:
            pieces.append((d, (*first[:k], high[k], *first[k + 1 :]), tuple(last)))
            last[k] = high[k]
    return pieces
