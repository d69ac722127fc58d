r"""Compile an operator tree into a static SPMD plan for JAX devices (no JAX needed here).

The portable global program of the tree (:func:`~linop.program.lower_portable`,
batched: local steps, phases of transfers, scalings, zeros, sums) becomes a list of *ops* that
every device runs alike inside ``shard_map`` (:mod:`linop.backends.jax_shard` runs them).

State. Worker ``w`` lives on device ``device_of[w]``. Every block of the program gets a *slot*:
an array of one static shape on every device, the largest shape of the blocks sharing it, so
that device ``d``'s copy of slot ``s`` holds the block of ``s`` on ``d`` in its leading corner
and zeros (padding) elsewhere. Blocks are grouped into slots by name prefix (``x[0,1]`` ->
``x``), one block per device and slot. The slots of the domain and of the range are the
*interface* (:func:`space_layout`): what the caller passes and gets, stacked over devices.

Ops. Each op is the same code on every device, its per-device geometry in small static tables
(a device reads its own row by ``lax.axis_index``):

- :class:`BoxOp`: on each device taking part, ``dst_box <- src_box`` (``set``),
  ``dst_box <- dst_box + src_box`` (``add``) or ``dst_box <- 0`` (``clear``), every box of one
  shape (their starts may differ per device); the local steps of a run are grouped into rounds
  (each device's steps in order, one per round) and a round's steps of one kind into one op.
- :class:`Exchange`: one ``lax.ppermute`` round of a phase. The transfers of a phase between a
  pair of devices form one message; messages of the same structure are coloured into rounds in
  which each device sends at most one message and receives at most one (a bipartite edge
  colouring with as many colours as the largest degree, by alternating paths), so each round
  is a permutation.
- :class:`ScaleOp`, :class:`ZeroOp`, :class:`SumOp` (branches on the same input, added slot
  by slot over the range's slots).

Padding never leaks: steps touch only block entries, the interface's padding is masked on entry
and exit, and a block allocated again after being dropped is cleared first. The adjoint's plan
is the plan of ``op.H`` (derived by linop's rules), whose interface is this plan's swapped.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..collectives import AllReduce
from ..errors import DeviceKernelError, WorkerError
from ..local import LocalOperator
from ..movement import Copy, CopyAdjoint, Move
from ..operator import Composition, LinearOperator
from ..primitives import Add, Allocate, Clear, Deallocate
from ..program import (
    Branches,
    FastPathStep,
    Local,
    Phase,
    Scale,
    Transfer,
    ZeroState,
    batch,
    lower_portable,
)
from ..space import Block, Region, Space, natural_key

__all__ = [
    "DeviceKernelError",
    "SlotSpec",
    "Layout",
    "BoxOp",
    "Piece",
    "Exchange",
    "PsumOp",
    "ScaleOp",
    "ZeroOp",
    "SumOp",
    "Plan",
    "space_layout",
    "compile_plan",
    "edge_colouring",
]


_PREFIX = re.compile(r"^(.*?)(\[[^\[\]]*\])?$")


def _prefix(name: str) -> str:
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


def _device(worker: int, device_of: Sequence[int], what: str) -> int:
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
            (_prefix(block.name), block.ndim, _device(block.worker, device_of, f"block {block.name!r}")), []
        ).append(block)
    groups: dict[tuple[str, int, int], list] = {}
    for (prefix, ndim, device), found in per.items():
        for k, block in enumerate(found):
            groups.setdefault((prefix, ndim, k), [None] * devices)[device] = block
    return groups


def _slot_names(keys: Iterable[tuple[str, int, int]]) -> dict[tuple[str, int, int], str]:
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


# -- ops ------------------------------------------------------------------------------------
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
class PsumOp:
    """A native all-reduce: ``slot <- psum(slot)`` over every device (an AllReduce whose one
    group is every device, one block each)."""

    slot: str


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
class Plan:
    """A tree compiled for ``devices`` JAX devices (see the module docstring)."""

    op: LinearOperator
    devices: int
    device_of: tuple[int, ...]
    domain: Layout
    range: Layout
    slots: dict[str, tuple[int, ...]]  # internal slot -> padded shape
    inputs: tuple[str, ...]  # internal slot of each domain interface slot
    outputs: tuple[
        tuple[tuple[str | None, ...], np.ndarray], ...
    ]  # per range slot: internal slot per device, extents
    ops: tuple[Any, ...]
    alphas: tuple[Any, ...]
    rounds: int = 0
    adjoint_cache: list = field(default_factory=list, repr=False)

    def adjoint(self) -> Plan:
        """The plan of ``op.H`` on the same devices (built once)."""
        if not self.adjoint_cache:
            self.adjoint_cache.append(compile_plan(self.op.H, self.devices, self.device_of))
        return self.adjoint_cache[0]


# -- edge colouring -------------------------------------------------------------------------
def edge_colouring(edges: Sequence[tuple[int, int]]) -> list[int]:
    """A proper colouring of a simple bipartite graph's edges (sender, receiver) with as many
    colours as its largest degree (König), by alternating-path recolouring."""
    at_u: dict[tuple[int, int], int] = {}
    at_v: dict[tuple[int, int], int] = {}
    colour: dict[tuple[int, int], int] = {}

    def free(table: dict[tuple[int, int], int], node: int) -> int:
        c = 0
        while (node, c) in table:
            c += 1
        return c

    for u, v in edges:
        a, b = free(at_u, u), free(at_v, v)
        if (v, a) in at_v:  # a is used at v: flip the a/b path from v, then a is free at both
            path, node, on_v, c = [], v, True, a
            while True:
                if on_v:
                    other = at_v.get((node, c))
                    if other is None:
                        break
                    path.append((other, node, c))
                else:
                    other = at_u.get((node, c))
                    if other is None:
                        break
                    path.append((node, other, c))
                node, on_v, c = other, not on_v, b if c == a else a
            for pu, pv, c in path:
                del at_u[(pu, c)], at_v[(pv, c)]
            for pu, pv, c in path:
                swapped = b if c == a else a
                at_u[(pu, swapped)], at_v[(pv, swapped)] = pv, pu
                colour[(pu, pv)] = swapped
        at_u[(u, a)], at_v[(v, a)] = v, u
        colour[(u, v)] = a
    return [colour[e] for e in edges]


# -- compilation ----------------------------------------------------------------------------
@dataclass
class _Micro:
    """One device's local step: kind, source (slot, start, shape) or None, target likewise."""

    kind: str
    src: tuple[str, tuple[int, ...], tuple[int, ...]] | None
    dst: tuple[str, tuple[int, ...], tuple[int, ...]]

    @property
    def key(self) -> tuple:
        return (self.kind, None if self.src is None else (self.src[0], self.src[2]), self.dst[0], self.dst[2])


class _Compiler:
    def __init__(self, op: LinearOperator, devices: int, device_of: Sequence[int]) -> None:
        self.op = op
        self.devices = devices
        self.device_of = tuple(device_of)
        self.domain = space_layout(op.domain, device_of, devices)
        self.range = space_layout(op.range, device_of, devices)
        self.slot_of: dict[tuple[int, str], str] = {}  # (device, block name) -> internal slot
        self.shapes: dict[str, list[int]] = {}
        self.taken: set[tuple[int, str]] = set()  # (device, slot) with a block assigned
        for spec in self.domain.slots:
            self.shapes[spec.name] = list(spec.shape)
            for d, b in enumerate(spec.blocks):
                if b is not None:
                    self.slot_of[(d, b.name)] = spec.name
                    self.taken.add((d, spec.name))
        for spec in self.range.slots:
            for d, b in enumerate(spec.blocks):
                if b is not None and (d, b.name) not in self.slot_of and (d, spec.name) not in self.taken:
                    self.slot_of[(d, b.name)] = spec.name
                    self.taken.add((d, spec.name))
                    self._grow(spec.name, b.shape)
        self.live: set[tuple[int, str]] = {(self._dev(b.worker, b.name), b.name) for b in op.domain}
        self.ever: set[tuple[int, str]] = set(self.live)
        self.rounds = 0
        self.alphas: list[Any] = []

    def _dev(self, worker: int, name: str) -> int:
        return _device(worker, self.device_of, f"block {name!r}")

    def _grow(self, slot: str, shape: Sequence[int]) -> None:
        known = self.shapes.setdefault(slot, list(shape))
        if len(known) != len(shape):  # pragma: no cover - slots group one rank
            raise AssertionError(slot)
        for i, n in enumerate(shape):
            known[i] = max(known[i], n)

    def slot(self, block: Block) -> str:
        device = self._dev(block.worker, block.name)
        found = self.slot_of.get((device, block.name))
        if found is None:
            prefix, k = f"~{_prefix(block.name)}.{block.ndim}d", 0
            while (device, f"{prefix}#{k}") in self.taken:
                k += 1
            found = f"{prefix}#{k}"
            self.slot_of[(device, block.name)] = found
            self.taken.add((device, found))
        self._grow(found, block.shape)
        return found

    def box(self, region: Region | Block) -> tuple[int, tuple[str, tuple[int, ...], tuple[int, ...]]]:
        """(device, (slot, start, box shape in block dimensions))."""
        if isinstance(region, Block):
            return self._dev(region.worker, region.name), (
                self.slot(region),
                (0,) * region.ndim,
                region.shape,
            )
        block = region.block
        shape = tuple(b - a for a, b in zip(region.start, region.stop))
        return self._dev(block.worker, block.name), (self.slot(block), region.start, shape)

    # -- local nodes ----------------------------------------------------------------------
    def micro(self, node: LinearOperator) -> list[tuple[int, _Micro | tuple[str, str]]]:
        """A local node as per-device micro steps ((device, _Micro) or (device, ("live"|"dead", name)))."""
        out: list[tuple[int, Any]] = []

        def step(kind: str, src: Region | Block | None, dst: Region | Block) -> None:
            d, target = self.box(dst)
            if math_size(target[2]) == 0:
                return
            out.append((d, _Micro(kind, None if src is None else self.box(src)[1], target)))

        def born(block: Block, written: bool) -> None:
            d = self._dev(block.worker, block.name)
            self.slot(block)
            if not written and (d, block.name) in self.ever:
                step("clear", None, block)
            out.append((d, ("live", block.name)))

        def dead(block: Block) -> None:
            out.append((self._dev(block.worker, block.name), ("dead", block.name)))

        if isinstance(node, Add):
            step("add", node.src, node.dst)
        elif isinstance(node, Clear):
            step("clear", None, node.region)
        elif isinstance(node, Allocate):
            born(node.block, written=False)
        elif isinstance(node, Deallocate):
            dead(node.space.block(node.name))
        elif isinstance(node, CopyAdjoint):
            if isinstance(node.dst, Block):
                step("add", node.domain[node.dst.name], node.src)
                dead(node.dst)
            else:
                step("add", node.dst, node.src)
                step("clear", None, node.dst)
        elif isinstance(node, Move):
            if isinstance(node.dst, Block):
                born(node.dst, written=True)
                step("set", node.src, node.dst)
                dead(node.src.block)
            else:
                step("set", node.src, node.dst)
                step("clear", None, node.src)
        elif isinstance(node, Copy):
            if isinstance(node.dst, Block):
                born(node.dst, written=True)
            step("set", node.src, node.dst)
        elif isinstance(node, LocalOperator):
            raise DeviceKernelError(
                f"{node} runs a numpy kernel on worker {node.worker}, which cannot run inside jit on "
                "JAX devices; run the tree with linop.frameworks.jax_function instead"
            )
        else:
            expanded = node.expand()
            if expanded is node:
                raise DeviceKernelError(f"{type(node).__name__} ({node}) has no lowering to JAX devices")
            for inner in batch(lower_portable(expanded)):
                if not isinstance(inner, Local):  # pragma: no cover - a local node expands locally
                    raise DeviceKernelError(f"{node} expands into a non-local step {inner!r}")
                out.extend(self.micro(inner.node))
        return out

    def local_run(self, items: list[tuple[int, Any]], ops: list[Any]) -> None:
        """Per-device micro steps in program order -> rounds -> one BoxOp per kind of a round."""
        queues: dict[int, list[Any]] = {}
        for d, item in items:
            if isinstance(item, tuple):  # liveness: applies in order, no op
                kind, name = item
                (self.live.add if kind == "live" else self.live.discard)((d, name))
                if kind == "live":
                    self.ever.add((d, name))
                continue
            queues.setdefault(d, []).append(item)
        heads = {d: 0 for d in queues}
        while heads:
            groups: dict[tuple, list[tuple[int, _Micro]]] = {}
            for d in sorted(heads):
                m = queues[d][heads[d]]
                groups.setdefault(m.key, []).append((d, m))
            for members in groups.values():
                ops.append(self._box_op(members))
            heads = {d: i + 1 for d, i in heads.items() if i + 1 < len(queues[d])}

    def _starts(self, rows: Mapping[int, tuple[int, ...]], ndim: int) -> np.ndarray:
        table = np.zeros((self.devices, ndim), dtype=np.int32)
        for d, start in rows.items():
            table[d] = start
        return table

    def _box_op(self, members: list[tuple[int, _Micro]]) -> BoxOp:
        first = members[0][1]
        active = np.zeros(self.devices, dtype=bool)
        active[[d for d, _ in members]] = True
        src_starts = None
        if first.src is not None:
            src_starts = self._starts(
                {d: m.src[1] for d, m in members if m.src is not None}, len(first.src[1])
            )
        dst_starts = self._starts({d: m.dst[1] for d, m in members}, len(first.dst[1]))
        return BoxOp(
            first.kind,
            None if first.src is None else first.src[0],
            src_starts,
            first.dst[0],
            dst_starts,
            first.dst[2],
            None if first.src is None else first.src[2],
            active,
        )

    # -- phases ---------------------------------------------------------------------------
    def phase(self, transfers: Sequence[Transfer], ops: list[Any]) -> None:
        local: list[tuple[int, Any]] = []
        after: list[tuple[int, Any]] = []
        messages: dict[tuple[int, int], list[tuple]] = {}
        for t in transfers:
            s_dev, source = self.box(t.source)
            d_dev, target = self.box(t.target)
            mode = "add" if t.mode == "add" else "set"
            if t.mode == "new":
                after.append((d_dev, ("live", t.target.name)))
            if t.source.size and s_dev == d_dev:
                local.append((s_dev, _Micro(mode, source, target)))
            elif t.source.size:
                messages.setdefault((s_dev, d_dev), []).append((source, target, mode))
            if t.after == "clear" and t.source.size:
                after.append((s_dev, _Micro("clear", None, source)))
            elif t.after == "drop":
                after.append((s_dev, ("dead", t.source.name)))
        self.local_run(local, ops)
        by_signature: dict[tuple, list[tuple[int, int]]] = {}
        for pair, pieces in messages.items():
            signature = tuple((s[0], s[2], t[0], t[2], mode) for s, t, mode in pieces)
            by_signature.setdefault(signature, []).append(pair)
        for signature, pairs in by_signature.items():
            colours = edge_colouring(pairs)
            for c in range(max(colours) + 1):
                chosen = [p for p, k in zip(pairs, colours) if k == c]
                round_pieces: list[Piece] = []
                for i, (src_slot, src_shape, dst_slot, dst_shape, mode) in enumerate(signature):
                    round_pieces.append(
                        Piece(
                            src_slot,
                            self._starts({s: messages[(s, r)][i][0][1] for s, r in chosen}, len(src_shape)),
                            src_shape,
                            dst_slot,
                            self._starts({r: messages[(s, r)][i][1][1] for s, r in chosen}, len(dst_shape)),
                            dst_shape,
                            mode,
                        )
                    )
                receivers = np.zeros(self.devices, dtype=bool)
                receivers[[r for _, r in chosen]] = True
                ops.append(Exchange(tuple(chosen), tuple(round_pieces), receivers))
                self.rounds += 1
        self.local_run(after, ops)

    # -- the program ----------------------------------------------------------------------
    def tree(self, op: LinearOperator) -> list[Any]:
        """The ops of ``op``: native collectives where the layout allows (an all-reduce over
        every device), the portable program of everything else."""
        if isinstance(op, Composition) and any(self._native(f) is not None for f in op.factors):
            ops: list[Any] = []
            for factor in reversed(op.factors):
                ops.extend(self.tree(factor))
            return ops
        slot = self._native(op)
        if slot is not None:
            return [PsumOp(slot)]
        return self.steps(batch(lower_portable(op)))

    def _native(self, op: LinearOperator) -> str | None:
        """The slot of an AllReduce that ``psum`` computes exactly (one group of every device,
        one block of one slot on each), else None."""
        if not isinstance(op, AllReduce) or len(op.others) or len(op.groups) != 1:
            return None
        blocks = [op.tensor.block(index) for index in op.groups[0]]
        devices = {self._dev(b.worker, b.name) for b in blocks}
        slots = {self.slot(b) for b in blocks}
        if len(blocks) != self.devices or len(devices) != self.devices or len(slots) != 1:
            return None
        return slots.pop()

    def steps(self, steps: Iterable[Any]) -> list[Any]:
        ops: list[Any] = []
        pending: list[tuple[int, Any]] = []
        for step in steps:
            if isinstance(step, Local):
                pending.extend(self.micro(step.node))
                continue
            self.local_run(pending, ops)
            pending = []
            if isinstance(step, Phase):
                self.phase(step.transfers, ops)
            elif isinstance(step, Transfer):
                self.phase((step,), ops)
            elif isinstance(step, Scale):
                ops.append(ScaleOp(step.alpha))
                self.alphas.append(step.alpha)
            elif isinstance(step, ZeroState):
                ops.append(ZeroOp())
                self.live = {(self._dev(b.worker, b.name), b.name) for b in step.space}
                self.ever |= self.live
            elif isinstance(step, Branches):
                start = set(self.live)
                terms = []
                for term in step.terms:
                    self.live = set(start)
                    terms.append(tuple(self.steps(term)))
                self.live = {(self._dev(b.worker, b.name), b.name) for b in step.space}
                self.ever |= self.live
                slots = sorted({self.slot(b) for b in step.space}, key=natural_key)
                ops.append(SumOp(tuple(terms), tuple(slots)))
            elif isinstance(step, FastPathStep):  # pragma: no cover - lower_portable emits none
                raise DeviceKernelError(f"a fast-path step {step!r} has no portable lowering")
            else:  # pragma: no cover
                raise TypeError(f"unknown step {step!r}")
        self.local_run(pending, ops)
        return ops


def _reads(op: Any, slots: dict[str, tuple[int, ...]]) -> set[str] | None:
    """The slots whose values ``op`` uses (None: all of them)."""
    if isinstance(op, BoxOp):
        used = set() if op.src is None else {op.src}
        whole = op.kind != "add" and op.active.all() and not op.dst_starts.any() and op.shape == slots[op.dst]
        if not whole:
            used.add(op.dst)
        return used
    if isinstance(op, Exchange):
        return {p.src for p in op.pieces} | {p.dst for p in op.pieces}
    return None


def drop_dead_clears(
    ops: Sequence[Any], live_at_end: set[str], slots: dict[str, tuple[int, ...]]
) -> tuple[Any, ...]:
    """``ops`` without the clears of slots that no later op reads (a block cleared and then
    dropped, as the adjoint of a copy leaves its source): a slot is reborn only by a step
    that clears or overwrites it, so the clear is never observed."""
    kept: list[Any] = []
    read_later: set[str] | None = set(live_at_end)
    for op in reversed(ops):
        if (
            isinstance(op, BoxOp)
            and op.kind == "clear"
            and read_later is not None
            and op.dst not in read_later
        ):
            continue
        kept.append(op)
        used = _reads(op, slots)
        read_later = None if used is None or read_later is None else read_later | used
    return tuple(reversed(kept))


def math_size(shape: Sequence[int]) -> int:
    return int(np.prod(shape, dtype=np.int64)) if shape else 1


def compile_plan(op: LinearOperator, devices: int, device_of: Sequence[int] | None = None) -> Plan:
    """Compile ``op`` for ``devices`` JAX devices, worker ``w`` on device ``device_of[w]``
    (default: worker w on device w).

    Raises
    ------
    WorkerError
        If a block lives on a worker the map does not cover, or the map names a device
        outside ``0 .. devices - 1``.
    DeviceKernelError
        If the tree holds a node that cannot run inside jit (a LocalOperator's numpy kernel).
    """
    if device_of is None:
        device_of = tuple(range(devices))
    device_of = tuple(int(d) for d in device_of)
    bad = [w for w, d in enumerate(device_of) if not 0 <= d < devices]
    if bad:
        raise WorkerError(
            f"worker {bad[0]} is mapped to device {device_of[bad[0]]}, outside 0 .. {devices - 1}"
        )
    compiler = _Compiler(op, devices, device_of)
    ops = compiler.tree(op)
    outputs = []
    for spec in compiler.range.slots:
        internal = tuple(None if b is None else compiler.slot(b) for b in spec.blocks)
        outputs.append((internal, spec.extents()))
    inputs = tuple(spec.name for spec in compiler.domain.slots)
    shapes = {name: tuple(shape) for name, shape in compiler.shapes.items()}
    ops = list(
        drop_dead_clears(ops, {s for internal, _ in outputs for s in internal if s is not None}, shapes)
    )
    return Plan(
        op,
        devices,
        device_of,
        compiler.domain,
        compiler.range,
        shapes,
        inputs,
        tuple(outputs),
        tuple(ops),
        tuple(compiler.alphas),
        compiler.rounds,
    )
