"""The interface of a space on JAX devices: blocks grouped into stacked, padded *slots*.

Worker ``w`` lives on device ``device_of[w]``. The blocks of one name prefix (``x[0,1]`` ->
``x``) and rank form slots, the k-th block of that prefix on each device in slot k, each slot
padded to its largest block: device ``d``'s row of a slot holds its block in the leading
corner and zeros elsewhere. No JAX needed here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from ...errors import WorkerError
from ...space import Block, Space, natural_key

__all__ = ["SlotSpec", "Layout", "space_layout", "block_prefix", "device_of_worker"]


_PREFIX = re.compile(r"^(.*?)(\[[^\[\]]*\])?$")


def block_prefix(name: str) -> str:
    match = _PREFIX.match(name)
    return match.group(1) if match and match.group(1) else name


@dataclass(frozen=True)
class SlotSpec:
    """One interface slot: its name, padded shape, and per device the block it holds (or None)."""

    name: str
    shape: tuple[int, ...]
    blocks: tuple[Block | None, ...]

    @property
    def padded(self) -> bool:
        """True when some device's block is smaller than the slot (or absent)."""
        return any(b is None or b.shape != self.shape for b in self.blocks)

    def extents(self) -> np.ndarray:
        """(devices, ndim) int32: each device's block shape (zeros where absent)."""
        rows = [b.shape if b is not None else (0,) * len(self.shape) for b in self.blocks]
        return np.asarray(rows, dtype=np.int32).reshape(len(self.blocks), len(self.shape))


@dataclass(frozen=True)
class Layout:
    """The interface of a space on the devices: its slots in order."""

    slots: tuple[SlotSpec, ...]
    devices: int

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.slots)

    def slot_of(self) -> dict[str, tuple[str, int]]:
        """Block name -> (slot name, device)."""
        return {b.name: (s.name, d) for s in self.slots for d, b in enumerate(s.blocks) if b is not None}


def device_of_worker(worker: int, device_of: Sequence[int], what: str) -> int:
    if not 0 <= worker < len(device_of):
        raise WorkerError(
            f"{what} lives on worker {worker}, but the worker-to-device map covers workers "
            f"0 .. {len(device_of) - 1} only (more workers than devices: pass workers=)"
        )
    return device_of[worker]


def _grouped(
    blocks: Iterable[Block], device_of: Sequence[int], devices: int
) -> dict[tuple[str, int, int], list]:
    """(prefix, ndim, k) -> per-device block, the k-th block of that prefix on each device."""
    per: dict[tuple[str, int, int], list[Block]] = {}
    for block in sorted(blocks, key=lambda b: natural_key(b.name)):
        per.setdefault(
            (
                block_prefix(block.name),
                block.ndim,
                device_of_worker(block.worker, device_of, f"block {block.name!r}"),
            ),
            [],
        ).append(block)
    groups: dict[tuple[str, int, int], list] = {}
    for (prefix, ndim, device), found in per.items():
        for k, block in enumerate(found):
            groups.setdefault((prefix, ndim, k), [None] * devices)[device] = block
    return groups


def _slot_names(
    keys: Iterable[tuple[str, int, int]],
) -> dict[tuple[str, int, int], str]:
    keys = sorted(keys, key=lambda key: (natural_key(key[0]), key[1], key[2]))
    ndims: dict[str, set[int]] = {}
    for prefix, ndim, _ in keys:
        ndims.setdefault(prefix, set()).add(ndim)
    names = {}
    for prefix, ndim, k in keys:
        name = prefix if len(ndims[prefix]) == 1 else f"{prefix}.{ndim}d"
        names[(prefix, ndim, k)] = name if k == 0 else f"{name}#{k}"
    return names


def space_layout(space: Space, device_of: Sequence[int], devices: int) -> Layout:
    """The interface slots of ``space``: blocks grouped by name prefix and rank, the k-th
    block of a prefix on each device in slot k, each slot padded to its largest block."""
    groups = _grouped(space.blocks, device_of, devices)
    names = _slot_names(groups)
    slots = []
    for key in sorted(groups, key=lambda key: names[key]):
        members = groups[key]
        ndim = key[1]
        shape = tuple(max((b.shape[i] for b in members if b is not None), default=0) for i in range(ndim))
        slots.append(SlotSpec(names[key], shape, tuple(members)))
    slots.sort(key=lambda s: natural_key(s.name))
    return Layout(tuple(slots), devices)
