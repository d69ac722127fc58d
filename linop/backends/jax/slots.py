r"""The slots of one device while a plan runs inside ``shard_map``: boxes read and written.

:class:`DeviceView` is the running device (its index along the mesh axes, the leading batch
shape and the dtype) with the elementary box operations on one array: read a box, write one
(an in-place ``dynamic_update_slice`` at per-device starts), blend one (the same at static
starts as a pad and a select, which XLA fuses), mask the padding of uneven blocks.

:class:`Slots` holds the device's slots and defers work so that XLA sees the simplest code:

- a slot is its *base* and the writes since (*pending*); a read of a box that no pending
  write touches comes from the base; a read that contains every pending write it meets is the
  base's box with those writes applied to it, not the whole slot;
- a slot built from scratch (never written, or made by a copy into a fresh slot) is a set of
  disjoint static *tiles* and zeros elsewhere: a set or add into its zero region adds a tile,
  a clear there is nothing, a read inside one tile is a slice of that tile's value, and the
  slot is assembled by ``concatenate`` and ``pad`` (a guillotine cut of the tiles), which XLA
  sees through: a later slice of the assembly is the tile itself, as in hand-written code;
- a box at per-device starts of a few values (uneven blocks) is read as that many static
  slices, each device picking its own; a kernel's output on uneven blocks is masked lazily
  (where a read goes beyond a block), so that XLA fuses the mask into its reader.

Every decision is taken on the host from the plan's static tables (boxes meet on some device
or not), so the traced program holds no test. Values on devices that take no part in a step
are never observed: a ppermute delivers zeros there, and every other write is masked.
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .passes import boxes_meet
from .plan import Plan

__all__ = ["DeviceView", "Slots"]

Box = tuple[np.ndarray, np.ndarray, tuple[int, ...]]


class DeviceView:
    """The running device: its index, the leading (batch) shape and dtype, box operations."""

    def __init__(self, plan: Plan, axes: tuple[str, ...], batch: tuple[int, ...], dtype: Any) -> None:
        self.plan = plan
        self.axis = axes[0] if len(axes) == 1 else axes
        self.index = lax.axis_index(self.axis)
        self.batch = batch
        self.dtype = dtype

    def ppermute_pairs(self, perm: tuple[tuple[int, int], ...]) -> list[tuple[int, int]]:
        """The (source, target) pairs of ``perm`` (devices counted row-major over the plan's
        axes, as ``lax.axis_index``, ``all_gather``, ``all_to_all`` and ``psum_scatter`` count
        them) as ``lax.ppermute`` counts devices over several axes: row-major in the order
        the axes have in the mesh. The same pairs when the axes come in the mesh's order."""
        if not isinstance(self.axis, tuple):
            return list(perm)
        mesh = jax.sharding.get_abstract_mesh()
        names = tuple(getattr(mesh, "axis_names", ()))
        if not all(a in names for a in self.axis):
            return list(perm)
        order = sorted(range(len(self.axis)), key=lambda k: names.index(self.axis[k]))
        if order == sorted(order):
            return list(perm)
        sizes = [mesh.shape[a] for a in self.axis]
        coordinates = np.unravel_index(np.arange(int(np.prod(sizes))), sizes)
        linear = np.ravel_multi_index([coordinates[k] for k in order], [sizes[k] for k in order])
        return [(int(linear[s]), int(linear[r])) for s, r in perm]

    def row(self, table: np.ndarray) -> Any:
        return jnp.asarray(table)[self.index]

    def zeros(self, shape: tuple[int, ...]) -> jax.Array:
        return jnp.zeros((*self.batch, *shape), self.dtype)

    def starts(self, table: np.ndarray, mask: np.ndarray) -> tuple[Any, ...]:
        """Per dimension, a Python int where every masked device starts at the same place,
        else the device's start, traced."""
        rows = table[mask]
        if len(rows) and (rows == rows[0]).all():
            return tuple(int(v) for v in rows[0])
        row = self.row(table)
        return tuple(
            int(rows[0, k]) if len(rows) and (rows[:, k] == rows[0, k]).all() else row[k]
            for k in range(table.shape[1])
        )

    def mask(self, array: jax.Array, extents: np.ndarray, *, split: bool = False) -> jax.Array:
        """Zero the entries outside this device's block (extents: (devices, ndim)): a select
        on the whole array, which XLA fuses into its consumers; with ``split``, along each
        dimension only the part beyond the smallest extent of any device is selected and
        written back in place (``dynamic_update_slice`` at a static start: the rest is not
        copied), where blocks are uneven by a few rows: for a box assembled into a slot by
        ``concatenate`` and ``pad``, and a kernel's output that XLA cannot fuse a select into
        (a convolution's)."""
        lead = len(self.batch)
        shape = array.shape[lead:]
        extent = self.row(extents)
        zero = jnp.zeros((), array.dtype)
        if not split:  # along the dimensions some device's block does not fill alone
            cut = [k for k, n in enumerate(shape) if len(extents) and int(extents[:, k].min()) < n]
            if not cut:
                return array
            valid = functools.reduce(
                operator.and_, (lax.broadcasted_iota(jnp.int32, shape, k) < extent[k] for k in cut)
            )
            return jnp.where(valid, array, zero)
        for k, n in enumerate(shape):
            low = int(np.clip(extents[:, k], 0, n).min()) if len(extents) else 0
            if low >= n:
                continue
            tail = lax.slice_in_dim(array, low, n, axis=lead + k)
            position = lax.broadcasted_iota(jnp.int32, tail.shape[lead:], k) + low
            tail = jnp.where(position < extent[k], tail, zero)
            starts = [0] * array.ndim
            starts[lead + k] = low
            array = lax.dynamic_update_slice(array, tail, starts)  # static start: in place
        return array

    def pick(self, groups: list[np.ndarray], values: list[jax.Array]) -> jax.Array:
        """On the devices of ``groups[k]``, ``values[k]`` (the groups disjoint; on the devices
        of none, any of them): selects, which XLA fuses into their consumers."""
        value = values[-1]
        for group, other in zip(groups[:-1], values[:-1]):
            value = jnp.where(self.row(group), other, value)
        return value

    def read_at(
        self, array: jax.Array, table: np.ndarray, mask: np.ndarray, shape: tuple[int, ...]
    ) -> jax.Array:
        """The box at each active device's row of ``table``: at static starts where they
        take one value or a few (:meth:`pick`), else a ``dynamic_slice``."""
        starts = self.starts(table, mask)
        groups = None if _static(starts) else _groups(table, mask)
        if groups is None:
            return self.read(array, starts, shape)
        return self.pick(groups, [self.read(array, self.starts(table, g), shape) for g in groups])

    def read(self, array: jax.Array, starts: tuple[Any, ...], shape: tuple[int, ...]) -> jax.Array:
        lead = (0,) * len(self.batch)
        if _static(starts):
            if tuple(starts) == (0,) * len(starts) and tuple(shape) == array.shape[len(self.batch) :]:
                return array
            return lax.slice(array, (*lead, *starts), (*self.batch, *(s + n for s, n in zip(starts, shape))))
        return lax.dynamic_slice(array, _indices(*lead, *starts), (*self.batch, *shape))

    def write(
        self,
        array: jax.Array,
        starts: tuple[Any, ...],
        shape: tuple[int, ...],
        value: jax.Array | None,
        kind: str,
        active: np.ndarray,
    ) -> jax.Array:
        """``array[box] <- value`` (set), ``+= value`` (add) or ``<- 0`` (clear) on the active
        devices, as an in-place update (``dynamic_update_slice``)."""
        everyone = bool(active.all())
        old = self.read(array, starts, shape)
        if value is None:  # clear
            new = jnp.zeros_like(old)
        else:
            new = old + value if kind == "add" else value.astype(array.dtype)
        if not everyone:
            new = jnp.where(self.row(active), new, old)
        lead = (0,) * len(self.batch)
        return lax.dynamic_update_slice(array, new, _indices(*lead, *starts))

    def blend(
        self,
        array: jax.Array,
        starts: tuple[int, ...],
        shape: tuple[int, ...],
        value: jax.Array | None,
        kind: str,
        active: np.ndarray,
    ) -> jax.Array:
        """:meth:`write` at static starts as elementwise code (a pad of the value, a select on
        the box), which XLA fuses with its neighbours into one pass over the array instead
        of an in-place update that needs the array's buffer to itself."""
        full = array.shape[len(self.batch) :]
        everyone = bool(active.all())
        zero = jnp.zeros((), array.dtype)
        if kind == "add" and value is not None:  # no select: the pad is zero outside the box
            placed = self.place(value.astype(array.dtype), starts, full)
            return array + (placed if everyone else jnp.where(self.row(active), placed, zero))
        inside = jnp.ones(full, dtype=bool)
        for k, (a, n) in enumerate(zip(starts, shape)):
            if a == 0 and n >= full[k]:  # the whole dimension: no test
                continue
            position = lax.broadcasted_iota(jnp.int32, full, k)
            inside = inside & (position >= a) & (position < a + n)
        if not everyone:
            inside = inside & self.row(active)
        if value is None:
            return jnp.where(inside, zero, array)
        return jnp.where(inside, self.place(value.astype(array.dtype), starts, full), array)

    def place(self, value: jax.Array, starts: tuple[int, ...], full: tuple[int, ...]) -> jax.Array:
        """``value`` at ``starts`` in zeros of shape ``full`` (a pad; nothing when it fills)."""
        shape = value.shape[len(self.batch) :]
        if tuple(shape) == tuple(full):
            return value
        pads = [(0, 0, 0)] * len(self.batch) + [(a, m - a - n, 0) for a, n, m in zip(starts, shape, full)]
        return lax.pad(value, jnp.zeros((), value.dtype), pads)

    def assemble(self, full: tuple[int, ...], tiles: list[tuple[tuple[int, ...], jax.Array]]) -> jax.Array:
        """Disjoint tiles (start, value) in zeros of shape ``full``: the tiles' bounding box
        padded, cut into two along a dimension where no tile straddles the cut, each part
        assembled likewise and the two concatenated (blended one by one when no cut exists)."""
        if not tiles:
            return self.zeros(full)
        lead = len(self.batch)
        ndim = len(full)
        low = [min(a[k] for a, _ in tiles) for k in range(ndim)]
        high = [max(a[k] + v.shape[lead + k] for a, v in tiles) for k in range(ndim)]
        if low != [0] * ndim or high != list(full):
            inner = [(tuple(s - b for s, b in zip(a, low)), v) for a, v in tiles]
            box = self.assemble(tuple(h - b for h, b in zip(high, low)), inner)
            return self.place(box, tuple(low), full)
        if len(tiles) == 1:
            return tiles[0][1]
        for k in range(ndim):
            for cut in sorted({a[k] for a, _ in tiles} - {0}):
                if all(a[k] + v.shape[lead + k] <= cut or a[k] >= cut for a, v in tiles):
                    first = [(a, v) for a, v in tiles if a[k] < cut]
                    second = [
                        (tuple(s - cut if j == k else s for j, s in enumerate(a)), v)
                        for a, v in tiles
                        if a[k] >= cut
                    ]
                    part = tuple(cut if j == k else n for j, n in enumerate(full))
                    rest = tuple(n - cut if j == k else n for j, n in enumerate(full))
                    return jnp.concatenate(
                        [self.assemble(part, first), self.assemble(rest, second)], axis=lead + k
                    )
        everyone = np.ones(self.plan.devices, dtype=bool)
        array = self.zeros(full)
        for a, v in tiles:
            array = self.blend(array, a, v.shape[lead:], v, "add", everyone)
        return array


class _Write:
    """A write not yet applied to its slot: ``box <- value`` / ``+= value`` / ``<- 0``."""

    def __init__(self, box: Box, value: jax.Array | None, kind: str, zeros_elsewhere: bool) -> None:
        self.box = box
        self.value = value
        self.kind = kind
        # a value that is zero on the inactive devices (a ppermute's output) is added unmasked
        self.unmasked = zeros_elsewhere and kind == "add"


class _Tiles:
    """A slot built from scratch: disjoint static boxes with values, zeros elsewhere.

    ``raw[start]``, where present, is the tile at ``start`` before its mask: ``(array,
    extents)``, the tile's value being ``array`` with the entries beyond each device's
    ``extents`` (from the tile's origin) zeroed. A read inside the extents slices ``array``,
    so that the masked value has one consumer, the assembly, into which XLA fuses the mask
    (a box of uneven blocks masked once, not a whole slot written and read again)."""

    def __init__(
        self,
        tiles: tuple[tuple[tuple[int, ...], jax.Array], ...] = (),
        raw: dict[tuple[int, ...], tuple[jax.Array, np.ndarray]] | None = None,
    ) -> None:
        self.tiles = tiles
        self.raw = {} if raw is None else raw


class Slots:
    """The slot arrays of one device, writes deferred (see the module docstring)."""

    def __init__(self, device: DeviceView) -> None:
        self.device = device
        self.base: dict[str, jax.Array | _Tiles] = {}
        self.pending: dict[str, list[_Write]] = {}
        self.masks: dict[str, np.ndarray] = {}  # base arrays whose padding is not yet masked

    def copy(self) -> Slots:
        other = Slots(self.device)
        other.base = dict(self.base)
        other.pending = {k: list(v) for k, v in self.pending.items()}
        other.masks = dict(self.masks)
        return other

    def set_masked(self, slot: str, array: jax.Array, extents: np.ndarray) -> None:
        """The slot is ``array`` with its entries beyond each device's ``extents`` zeroed:
        lazily, so that a read inside the extents is a slice of ``array`` itself, a read
        beyond masks its box alone, and the whole slot is masked only where it is used whole."""
        self.set(slot, array)
        self.masks[slot] = extents

    def has(self, slot: str) -> bool:
        return slot in self.base or slot in self.pending

    def names(self) -> list[str]:
        return sorted(set(self.base) | set(self.pending))

    def shape(self, slot: str) -> tuple[int, ...]:
        return self.device.plan.slots[slot]

    def set(self, slot: str, array: jax.Array) -> None:
        """The slot is ``array`` (its every entry)."""
        self.base[slot] = array
        self.pending.pop(slot, None)
        self.masks.pop(slot, None)

    def alias(self, dst: str, src: str) -> None:
        """Slot ``dst`` becomes slot ``src`` (same shape), its structure kept: its base, its
        pending writes and a padding not yet masked stay lazy (applied here, they would copy
        the whole slot where its boxes alone are read, or where its reader fuses them)."""
        base = self.base.get(src)
        self.base[dst] = base if base is not None else _Tiles()
        if self.pending.get(src):
            self.pending[dst] = list(self.pending[src])
        else:
            self.pending.pop(dst, None)
        if src in self.masks:
            self.masks[dst] = self.masks[src]
        else:
            self.masks.pop(dst, None)

    def value(self, slot: str, *, tail: bool = False) -> jax.Array:
        """The slot with every pending write applied (zeros if never written). ``tail``: a
        padding not yet masked is zeroed beyond the smallest block alone, in place
        (:meth:`DeviceView.mask` with ``split``), for a slot that leaves the program (a
        kernel's output: a select over the whole of it costs XLA one more pass there)."""
        device = self.device
        array = self._base_array(slot, tail)
        everyone = np.ones(device.plan.devices, dtype=bool)
        for w in self.pending.pop(slot, []):
            array = self._apply(array, (0,) * len(w.box[2]), w, everyone)
        self.base[slot] = array
        return array

    def _base_array(self, slot: str, tail: bool = False) -> jax.Array:
        base = self.base.get(slot)
        if slot in self.masks:
            assert base is not None and not isinstance(base, _Tiles)
            base = self.device.mask(base, self.masks.pop(slot), split=tail)
            self.base[slot] = base
        if isinstance(base, _Tiles) or base is None:
            tiles = list(base.tiles) if isinstance(base, _Tiles) else []
            base = self.device.assemble(self.shape(slot), tiles)
            self.base[slot] = base
        return base

    def _apply(self, array: jax.Array, origin: tuple[int, ...], w: _Write, everyone: np.ndarray) -> jax.Array:
        """``w`` applied to ``array``, which holds the slot's box starting at ``origin``."""
        device = self.device
        table, mask, shape = w.box
        starts = device.starts(table, mask)
        active = everyone if w.unmasked else mask
        if _static(starts):
            local = tuple(s - o for s, o in zip(starts, origin))
            return device.blend(array, local, shape, w.value, w.kind, active)
        local_starts = tuple(s - o for s, o in zip(starts, origin))
        return device.write(array, local_starts, shape, w.value, w.kind, active)

    def _read_base(
        self, slot: str, starts: tuple[Any, ...], shape: tuple[int, ...], table: np.ndarray, mask: np.ndarray
    ) -> jax.Array:
        """The box at ``starts`` of the slot's base (``table``: its starts on each device,
        ``mask``: the active devices)."""
        device = self.device
        base = self.base.get(slot)
        rows = table[mask]
        if isinstance(base, _Tiles) and not _static(starts):  # inside one tile on every device:
            for a, v in base.tiles:  # a slice of that tile, the slot not assembled
                inner = v.shape[len(device.batch) :]
                if len(rows) and ((rows >= a) & (rows + shape <= np.add(a, inner))).all():
                    return self._tile_box(base, a, v, starts, shape, table, mask)
        if slot in self.masks:  # the box of the unmasked array, masked beyond the extents
            assert base is not None and not isinstance(base, _Tiles)
            extents = self.masks[slot]
            box = device.read(base, starts, shape)
            if (table[mask] + shape <= extents[mask]).all():  # inside every active block
                return box
            return device.mask(box, np.clip(extents - table, 0, None).astype(np.int32), split=True)
        if (base is None or isinstance(base, _Tiles)) and _static(starts):
            tiles = base.tiles if isinstance(base, _Tiles) else ()
            meets = [(a, v) for a, v in tiles if _overlap(starts, shape, a, v.shape[len(device.batch) :])]
            if not meets:
                return device.zeros(shape)
            if len(meets) == 1:
                a, v = meets[0]
                inner = v.shape[len(device.batch) :]
                if all(s >= b and s + n <= b + m for s, n, b, m in zip(starts, shape, a, inner)):
                    assert isinstance(base, _Tiles)
                    return self._tile_box(base, a, v, starts, shape, table, mask)
        return device.read(self._base_array(slot), starts, shape)

    def _tile_box(
        self,
        tiles: _Tiles,
        start: tuple[int, ...],
        value: jax.Array,
        starts: tuple[Any, ...],
        shape: tuple[int, ...],
        table: np.ndarray,
        mask: np.ndarray,
    ) -> jax.Array:
        """The box at ``starts`` (per device: ``table``) inside the tile at ``start``: a slice
        of the tile's value, or of its unmasked array where the box lies inside its extents
        on every active device."""
        inner = tuple(s - b for s, b in zip(starts, start))
        raw = tiles.raw.get(start)
        if raw is not None and ((table[mask] - np.asarray(start) + shape) <= raw[1][mask]).all():
            return self.device.read(raw[0], inner, shape)
        return self.device.read(value, inner, shape)

    def read_masked(
        self, slot: str, table: np.ndarray, mask: np.ndarray, shape: tuple[int, ...]
    ) -> tuple[jax.Array, tuple[jax.Array, np.ndarray] | None]:
        """:meth:`read`, and where the box was masked beyond the blocks of a padded
        interface slot, the box unmasked with each device's extents from the box's origin
        (for :meth:`write` to keep beside its tile), else None."""
        lazy = slot in self.masks and not self.pending.get(slot)
        value = self.read(slot, table, mask, shape)
        if not lazy or slot not in self.masks:
            return value, None
        extents = self.masks[slot]
        if (table[mask] + shape <= extents[mask]).all():
            return value, None
        base = self.base[slot]
        assert not isinstance(base, _Tiles)
        unmasked = self.device.read_at(base, table, mask, shape)
        return value, (unmasked, np.clip(extents - table, 0, None).astype(np.int32))

    def read(self, slot: str, table: np.ndarray, mask: np.ndarray, shape: tuple[int, ...]) -> jax.Array:
        """The box of ``slot`` on each active device (other devices: any value); at starts
        that differ by device but take a few values, one read at static starts per value,
        each device picking its own (:func:`_groups`)."""
        device = self.device
        starts = device.starts(table, mask)
        groups = None if _static(starts) else _groups(table, mask)
        if groups is not None:
            parts = [self.read(slot, table, group, shape) for group in groups]
            return device.pick(groups, parts)
        box = (table, mask, shape)
        writes = self.pending.get(slot, [])
        meeting = [w for w in writes if boxes_meet(box, w.box)]
        if meeting and not (_static(starts) and all(_contains_on(starts, shape, mask, w) for w in meeting)):
            self.value(slot)
            meeting = []
        array = self._read_base(slot, starts, shape, table, mask)
        everyone = np.ones(device.plan.devices, dtype=bool)
        for w in meeting:  # each inside the box: applied to the box alone
            array = self._apply(array, starts, w, everyone)
        return array

    def write(
        self,
        slot: str,
        table: np.ndarray,
        mask: np.ndarray,
        shape: tuple[int, ...],
        value: jax.Array | None,
        kind: str,
        zeros_elsewhere: bool = False,
        raw: tuple[jax.Array, np.ndarray] | None = None,
    ) -> None:
        """``box <- value`` (set), ``+= value`` (add) or ``<- 0`` (clear) on the active
        devices; ``zeros_elsewhere``: the value is zero on the inactive ones (a ppermute);
        ``raw``: the value before a mask, with its extents (see :class:`_Tiles`)."""
        device = self.device
        if value is not None:
            value = value.reshape(*device.batch, *shape).astype(device.dtype)
        starts = device.starts(table, mask)
        full = self.shape(slot)
        everyone = bool(mask.all())
        if everyone and _static(starts) and not any(starts) and tuple(shape) == full:
            if kind == "set" or (kind == "add" and not self.has(slot)):
                assert value is not None
                self.set(slot, value)
                return
            if kind == "clear":
                self.base[slot] = _Tiles()
                self.pending.pop(slot, None)
                self.masks.pop(slot, None)  # zeros everywhere: nothing left to mask
                return
        base = self.base.get(slot)
        box = (table, mask, shape)
        pending = self.pending.get(slot, [])
        if (
            (base is None or isinstance(base, _Tiles))
            and _static(starts)
            and not any(boxes_meet(box, w.box) for w in pending)  # disjoint writes commute
        ):
            tiles = base.tiles if isinstance(base, _Tiles) else ()
            lead = len(device.batch)
            if not any(_overlap(starts, shape, a, v.shape[lead:]) for a, v in tiles):
                if kind == "clear":  # already zero
                    self.base[slot] = _Tiles(tiles, dict(base.raw) if isinstance(base, _Tiles) else None)
                    return
                if 0 in shape:
                    return
                assert value is not None
                if not (everyone or zeros_elsewhere):
                    value = jnp.where(device.row(mask), value, jnp.zeros((), value.dtype))
                kept = dict(base.raw) if isinstance(base, _Tiles) else {}
                if raw is not None and everyone and tuple(raw[0].shape) == tuple(value.shape):
                    kept[tuple(starts)] = (raw[0].astype(device.dtype), raw[1])
                self.base[slot] = _Tiles((*tiles, (tuple(starts), value)), kept)
                return
        self.pending.setdefault(slot, []).append(_Write((table, mask, shape), value, kind, zeros_elsewhere))


GROUPS = 3
"""The most distinct starts a per-device box may have to be read as that many boxes at
static starts (see :func:`_groups`)."""


def _groups(table: np.ndarray, mask: np.ndarray) -> list[np.ndarray] | None:
    """Where the active devices' starts (``table[mask]``) take 2 .. :data:`GROUPS` distinct
    values (uneven blocks: the first device's block a row longer, say): per value, the mask
    of the devices that start there; else None. A box read at such starts is then that many
    slices at static starts, each device picking its own by a select, instead of a
    ``dynamic_slice`` at a traced start: XLA fuses them with their neighbours (a halo row
    sent from each device's own last row). Writes stay one in-place ``dynamic_update_slice``:
    as selects at static starts they made XLA fuse a whole slot's assembly into one slower
    pass (uneven halo windows: forward 1.6x of the in-place write; a convolution's window:
    1.25x against 1.15x, A/B in one process)."""
    rows = table[mask]
    if not len(rows):
        return None
    distinct = np.unique(rows, axis=0)
    if not 2 <= len(distinct) <= GROUPS:
        return None
    return [mask & (table == value).all(axis=1) for value in distinct]


def _indices(*starts: Any) -> tuple[Any, ...]:
    """Start indices for ``dynamic_slice``/``dynamic_update_slice``, all int32: JAX wants one
    integer type, and a Python int is int64 under ``jax_enable_x64`` while the per-device
    starts read from the plan's int32 tables stay int32 (so int32 in both modes)."""
    return tuple(jnp.asarray(s, dtype=jnp.int32) for s in starts)


def _static(starts: tuple[Any, ...]) -> bool:
    return all(isinstance(s, int) for s in starts)


def _overlap(a: tuple[int, ...], n: tuple[int, ...], b: tuple[int, ...], m: tuple[int, ...]) -> bool:
    if 0 in n or 0 in m:
        return False
    return all(x < y + q and y < x + p for x, p, y, q in zip(a, n, b, m))


def _contains_on(starts: tuple[int, ...], shape: tuple[int, ...], mask: np.ndarray, w: _Write) -> bool:
    """Whether the write ``w`` lies inside the box at the static ``starts`` on every device
    that reads the box (``mask``; the others read any value) and that ``w`` writes: then
    ``w`` applies to the box alone, also at per-device starts (a halo row added at each
    device's own end of an uneven block), and the slot is not assembled whole."""
    table, active, size = w.box
    both = mask & active
    rows = table[both]
    low, high = np.asarray(starts), np.asarray(starts) + np.asarray(shape)
    return bool(((rows >= low) & (rows + np.asarray(size) <= high)).all())
