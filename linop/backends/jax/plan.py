r"""Compile an operator tree into a static SPMD plan for JAX devices (no JAX needed here).

The modules: :mod:`~linop.backends.jax.layout` (slots), :mod:`~linop.backends.jax.ops`
(ops), :mod:`~linop.backends.jax.colouring` (rounds), :mod:`~linop.backends.jax.passes`
(passes over ops); this one compiles a tree. The portable global program of the tree (:func:`~linop.program.lower_portable`,
batched: local steps, phases of transfers, scalings, zeros, sums) becomes a list of *ops* that
every device runs alike inside ``shard_map`` (:mod:`linop.backends.jax.shard` runs them).

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
- :class:`CollectiveOp`: a phase in which every device sends one message of one structure to
  every other device, as native collectives (``all_to_all``, ``all_gather``,
  ``psum_scatter``; :class:`CollectivePiece`); each device's local copy of the same structure
  next to it joins it as the device's box to itself (:func:`fold_self_boxes`).
- :class:`PsumOp`: an all-reduce whose groups are the devices along some mesh axes.
- :class:`KernelOp`: the local kernels (:class:`~linop.local.LocalOperator`) of a round, each
  device running its own (:class:`KernelCall`) on its blocks cut from the leading corners of
  their slots, the produced blocks written back with zeros in the rest of their slots. A kernel
  runs on JAX devices when it is a dense matrix or callables marked traceable (``jax=`` of
  :meth:`~linop.local.LocalKernel.of`); the adjoint plan runs the kernel's adjoint.
- :class:`ScaleOp`, :class:`ZeroOp`, :class:`SumOp` (branches on the same input, added slot
  by slot over the range's slots).

Padding never leaks: steps touch only block entries, the interface's padding is masked on entry
and exit, and a block allocated again after being dropped is cleared first. A clear whose
entries no later op reads is dropped (:func:`drop_dead_clears`, decided box by box). The adjoint's plan
is the plan of ``op.H`` (derived by linop's rules), whose interface is this plan's swapped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np

from ...errors import DeviceKernelError, WorkerError
from ...local import LocalOperator
from ...movement import Copy, CopyAdjoint, Move
from ...operator import Composition, LinearOperator, Scaled, Sum
from ...primitives import Add, Allocate, Clear, Deallocate
from ...program import (
    Branches,
    FastPathStep,
    Local,
    Phase,
    Scale,
    Transfer,
    ZeroState,
    batch,
    lower,
    lower_portable,
)
from ...program.parts import AllReducePart
from ...space import Block, Region, natural_key
from .colouring import edge_colouring
from .layout import (
    Layout,
    SlotSpec,
    block_prefix,
    device_of_worker,
    space_layout,
)
from .ops import (
    BoxOp,
    CollectiveOp,
    CollectivePiece,
    Exchange,
    KernelCall,
    KernelOp,
    Piece,
    PsumOp,
    ScaleOp,
    SumOp,
    ZeroOp,
    collective_piece,
    kernel_mode,
    math_size,
)
from .passes import Support, boxes_meet, drop_dead_clears, fold_self_boxes, widen_boxes

__all__ = [
    "DeviceKernelError",
    "SlotSpec",
    "Layout",
    "BoxOp",
    "Piece",
    "Exchange",
    "PsumOp",
    "CollectiveOp",
    "CollectivePiece",
    "ScaleOp",
    "ZeroOp",
    "SumOp",
    "KernelCall",
    "KernelOp",
    "Plan",
    "space_layout",
    "compile_plan",
    "edge_colouring",
    "boxes_meet",
    "drop_dead_clears",
    "fold_self_boxes",
    "widen_boxes",
    "collective_piece",
]


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
    mesh_shape: tuple[int, ...] = ()
    output_masks: tuple[bool, ...] = ()
    """Per range slot, whether its padding must be masked on exit (empty: every padded
    one); False where the entries outside each device's block are known to be zero."""
    adjoint_cache: list = field(default_factory=list, repr=False)

    def adjoint(self) -> Plan:
        """The plan of ``op.H`` on the same devices (built once)."""
        if not self.adjoint_cache:
            self.adjoint_cache.append(
                compile_plan(self.op.H, self.devices, self.device_of, self.mesh_shape or None)
            )
        return self.adjoint_cache[0]


# -- compilation ----------------------------------------------------------------------------
@dataclass
class _Micro:
    """One device's local step: kind, source (slot, start, shape) or None, target likewise."""

    kind: str
    src: tuple[str, tuple[int, ...], tuple[int, ...]] | None
    dst: tuple[str, tuple[int, ...], tuple[int, ...]]

    @property
    def key(self) -> tuple:
        return (
            self.kind,
            None if self.src is None else (self.src[0], self.src[2]),
            self.dst[0],
            self.dst[2],
        )


class _Compiler:
    def __init__(
        self, op: LinearOperator, devices: int, device_of: Sequence[int], mesh_shape: tuple[int, ...]
    ) -> None:
        self.op = op
        self.mesh_shape = mesh_shape
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
        return device_of_worker(worker, self.device_of, f"block {name!r}")

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
            prefix, k = f"~{block_prefix(block.name)}.{block.ndim}d", 0
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
        return self._dev(block.worker, block.name), (
            self.slot(block),
            region.start,
            shape,
        )

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

        def drain(kind: str, src: Region | Block, dst: Region | Block, whole: Block | None) -> None:
            """src's values into dst (``kind``), then src emptied: the ``whole`` block dead
            where one is given, else the region cleared."""
            step(kind, src, dst)
            if whole is not None:
                dead(whole)
            else:
                step("clear", None, src)

        if isinstance(node, Add):
            step("add", node.src, node.dst)
        elif isinstance(node, Clear):
            step("clear", None, node.region)
        elif isinstance(node, Allocate):
            born(node.block, written=False)
        elif isinstance(node, Deallocate):
            dead(node.space.block(node.name))
        elif isinstance(node, CopyAdjoint):  # dst's values added into src, dst emptied
            if isinstance(node.dst, Block):
                drain("add", node.domain[node.dst.name], node.src, node.dst)
            else:
                drain("add", node.dst, node.src, None)
        elif isinstance(node, Move):  # src's values set into dst, src emptied
            if isinstance(node.dst, Block):
                born(node.dst, written=True)
                drain("set", node.src, node.dst, node.src.block)
            else:
                drain("set", node.src, node.dst, None)
        elif isinstance(node, Copy):
            if isinstance(node.dst, Block):
                born(node.dst, written=True)
            step("set", node.src, node.dst)
        elif isinstance(node, LocalOperator):
            out.extend(self.kernel(node))
        else:
            expanded = node.expand()
            if expanded is node:
                raise DeviceKernelError(f"{type(node).__name__} ({node}) has no lowering to JAX devices")
            for inner in batch(lower_portable(expanded)):
                if not isinstance(inner, Local):  # pragma: no cover - a local node expands locally
                    raise DeviceKernelError(f"{node} expands into a non-local step {inner!r}")
                out.extend(self.micro(inner.node))
        return out

    def kernel(self, node: LocalOperator) -> list[tuple[int, Any]]:
        """A local kernel as one call on its worker's device, then the liveness of its blocks
        (the consumed dropped, the produced born: written whole by the call, so never cleared)."""
        if not node.kernel.runs_on_jax:
            raise DeviceKernelError(
                f"{node} runs a numpy kernel ({node.kernel!r}) on worker {node.worker}, which cannot run "
                "inside jit on JAX devices: give its kernel as a dense matrix or mark its callables "
                "traceable with jax= (True, or a (forward, adjoint) pair of jnp callables; see "
                "linop.local.LocalKernel), or run the tree with linop.frameworks.jax_function instead"
            )
        device = self._dev(node.worker, node.name)
        consumed = tuple((self.slot(b), tuple(b.shape)) for b in node.consumed)
        produced = tuple((self.slot(b), tuple(b.shape)) for b in node.produced)
        out: list[tuple[int, Any]] = [(device, KernelCall(device, node, consumed, produced))]
        out.extend((device, ("dead", b.name)) for b in node.consumed)
        out.extend((device, ("live", b.name)) for b in node.produced)
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
            groups: dict[tuple, list[tuple[int, Any]]] = {}
            for d in sorted(heads):
                m = queues[d][heads[d]]
                groups.setdefault(("kernel",) if isinstance(m, KernelCall) else m.key, []).append((d, m))
            for key, members in groups.items():
                if key == ("kernel",):
                    calls = tuple(m for _, m in members)
                    ops.append(KernelOp(calls, self.devices, kernel_mode(calls, self.devices)))
                else:
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
                {d: m.src[1] for d, m in members if m.src is not None},
                len(first.src[1]),
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
        collective = self._collective(messages)
        self.local_run(local, ops)
        if collective is not None:
            ops.append(collective)
            self.local_run(after, ops)
            return
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
                            self._starts(
                                {s: messages[(s, r)][i][0][1] for s, r in chosen},
                                len(src_shape),
                            ),
                            src_shape,
                            dst_slot,
                            self._starts(
                                {r: messages[(s, r)][i][1][1] for s, r in chosen},
                                len(dst_shape),
                            ),
                            dst_shape,
                            mode,
                        )
                    )
                receivers = np.zeros(self.devices, dtype=bool)
                receivers[[r for _, r in chosen]] = True
                ops.append(Exchange(tuple(chosen), tuple(round_pieces), receivers))
                self.rounds += 1
        self.local_run(after, ops)

    def _collective(self, messages: Mapping[tuple[int, int], list[tuple]]) -> CollectiveOp | None:
        """A phase in which every device sends one message of one structure to every other
        device, as one native collective per piece (see :class:`CollectivePiece`), else None."""
        p = self.devices
        if p < 2 or len(messages) != p * (p - 1):
            return None
        signatures = {
            tuple((s[0], s[2], t[0], t[2], mode) for s, t, mode in pieces) for pieces in messages.values()
        }
        if len(signatures) != 1:
            return None
        (signature,) = signatures
        pieces = []
        for i, (src_slot, src_shape, dst_slot, dst_shape, mode) in enumerate(signature):
            sends = np.zeros((p, p, len(src_shape)), dtype=np.int32)  # [destination, sender]
            places = np.zeros((p, p, len(dst_shape)), dtype=np.int32)  # [sender, receiver]
            for (sender, receiver), found in messages.items():
                sends[receiver, sender] = found[i][0][1]
                places[sender, receiver] = found[i][1][1]
            pieces.append(
                collective_piece(
                    src_slot,
                    sends,
                    tuple(src_shape),
                    dst_slot,
                    places,
                    tuple(dst_shape),
                    mode,
                    False,
                )
            )
        return CollectiveOp(tuple(pieces))

    # -- the program ----------------------------------------------------------------------
    def tree(self, op: LinearOperator) -> list[Any]:
        """The ops of ``op``: native collectives where the program's fast-path part has a row in
        :data:`PART_CALLS` and the layout allows (an all-reduce whose groups are the devices
        along some mesh axes), the portable program of the rest."""
        if isinstance(op, Composition):
            natives = [self._native(f) for f in op.factors]
            if any(native is not None for native in natives):
                ops: list[Any] = []
                for factor, native in zip(reversed(op.factors), reversed(natives)):
                    ops.extend([native] if native is not None else self.tree(factor))
                return ops
        native = self._native(op)
        if native is not None:
            return [native]
        return self.steps(batch(lower_portable(op)))

    def _native(self, op: LinearOperator) -> Any:
        """The op of a node whose program is one fast-path step whose parts (one per worker it
        involves) have a row in :data:`PART_CALLS` that accepts them, else None. Algebra nodes
        (compositions, sums, scalings) are not lowered here: :meth:`tree` takes compositions
        apart, and the rest run their portable program."""
        if isinstance(op, (Composition, Sum, Scaled)):
            return None
        steps = lower(op)  # the program with its fast paths: the node's own lowering
        if len(steps) != 1 or not isinstance(steps[0], FastPathStep):
            return None
        runner = steps[0].runner
        parts = {worker: runner.project(worker) for worker in runner.workers}
        kinds = {type(part) for part in parts.values()}
        call = PART_CALLS.get(kinds.pop()) if len(kinds) == 1 else None
        return None if call is None else call(self, op, parts)

    def psum(self, op: LinearOperator, parts: Mapping[int, AllReducePart]) -> PsumOp | None:
        """The all-reduce's parts as one ``psum`` over some mesh axes: one entry (block, its
        group's workers) per worker, one block of one slot on every device, each group the
        devices that differ only along those axes (all of them for one group), else None."""
        entries = [entry for part in parts.values() for entry in part.entries]
        if len(entries) != len(parts):  # a worker in two groups (several blocks on one worker)
            return None
        blocks = [op.domain.block(name) for name, _ in entries]
        devices = [self._dev(b.worker, b.name) for b in blocks]
        slots = {self.slot(b) for b in blocks}
        if len(blocks) != self.devices or len(set(devices)) != self.devices or len(slots) != 1:
            return None
        device_of = {b.worker: d for b, d in zip(blocks, devices)}
        groups = sorted({tuple(sorted(device_of[w] for w in ranks)) for _, ranks in entries})
        for over in self._axis_sets():
            if _classes(self.mesh_shape, over) == [list(g) for g in groups]:
                return PsumOp(slots.pop(), over)
        return None

    def _axis_sets(self) -> list[tuple[int, ...]]:
        """Every set of mesh axes, all of them first."""
        k = len(self.mesh_shape)
        found = [tuple(i for i in range(k) if m >> i & 1) for m in range(1, 1 << k)]
        return sorted(found, key=len, reverse=True)

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


PART_CALLS: Mapping[type, Callable[[_Compiler, LinearOperator, Any], Any]] = MappingProxyType(
    {AllReducePart: _Compiler.psum}
)
"""JAX's table of calls: part type (:data:`linop.program.parts.Part`) -> the op that runs the
parts of one fast-path step on every device (or None where the layout does not allow it), read
by the part's type. One row: the all-reduce, a ``psum`` over the mesh axes its groups span. The
other parts have no row and run the portable program, whose phases become native collectives
where every device sends one message of one structure to every other (:class:`CollectiveOp`:
``all_to_all``, ``all_gather``, ``psum_scatter``), else ``ppermute`` rounds: a rooted part's
groups (a root block and its copies) are not the devices along mesh axes in general, and the
uneven shares of a :class:`~linop.program.parts.LineReduceScatterPart` have no
``psum_scatter`` (whose tiles are equal)."""


def _classes(mesh_shape: tuple[int, ...], over: tuple[int, ...]) -> list[list[int]]:
    """The devices (linearized row-major over ``mesh_shape``) grouped by their coordinates
    along the axes not in ``over``."""
    coordinates = np.array(np.unravel_index(np.arange(int(np.prod(mesh_shape))), mesh_shape)).T
    kept = [i for i in range(len(mesh_shape)) if i not in over]
    classes: dict[tuple[int, ...], list[int]] = {}
    for device, coordinate in enumerate(coordinates):
        classes.setdefault(tuple(int(coordinate[i]) for i in kept), []).append(device)
    return sorted(classes.values())


def compile_plan(
    op: LinearOperator,
    devices: int,
    device_of: Sequence[int] | None = None,
    mesh_shape: Sequence[int] | None = None,
) -> Plan:
    """Compile ``op`` for ``devices`` JAX devices, worker ``w`` on device ``device_of[w]``
    (default: worker w on device w), the devices linearized row-major over mesh axes of sizes
    ``mesh_shape`` (default one axis of ``devices``).

    Raises
    ------
    WorkerError
        If a block lives on a worker the map does not cover, or the map names a device
        outside ``0 .. devices - 1``.
    DeviceKernelError
        If the tree holds a node that cannot run inside jit (a LocalOperator whose kernel is
        neither a dense matrix nor callables marked traceable by JAX).
    """
    if device_of is None:
        device_of = tuple(range(devices))
    device_of = tuple(int(d) for d in device_of)
    bad = [w for w, d in enumerate(device_of) if not 0 <= d < devices]
    if bad:
        raise WorkerError(
            f"worker {bad[0]} is mapped to device {device_of[bad[0]]}, outside 0 .. {devices - 1}"
        )
    mesh_shape = (devices,) if mesh_shape is None else tuple(int(n) for n in mesh_shape)
    if int(np.prod(mesh_shape)) != devices:
        raise WorkerError(f"mesh axes of sizes {mesh_shape} do not hold {devices} devices")
    compiler = _Compiler(op, devices, device_of, mesh_shape)
    ops = compiler.tree(op)
    outputs = []
    for spec in compiler.range.slots:
        internal = tuple(None if b is None else compiler.slot(b) for b in spec.blocks)
        outputs.append((internal, spec.extents()))
    inputs = tuple(spec.name for spec in compiler.domain.slots)
    shapes = {name: tuple(shape) for name, shape in compiler.shapes.items()}
    live = {s for internal, _ in outputs for s in internal if s is not None}
    widened, support = widen_boxes(ops, _entry_support(compiler.domain), shapes, devices)
    ops = list(drop_dead_clears(widened, live, shapes, devices))  # a dead clear may sit between
    ops = list(drop_dead_clears(fold_self_boxes(ops, devices), live, shapes, devices))
    masks = tuple(not _inside_extents(support, internal, extents, devices) for internal, extents in outputs)
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
        mesh_shape,
        masks,
    )


def _entry_support(domain: Layout) -> Support:
    """Where the interface's slots may be nonzero on entry (masked there): each device's block."""
    support: Support = {}
    for spec in domain.slots:
        for d, block in enumerate(spec.blocks):
            if block is not None:
                support.setdefault(spec.name, []).append((d, (0,) * len(spec.shape), tuple(block.shape)))
    return support


def _inside_extents(
    support: Support, internal: tuple[str | None, ...], extents: np.ndarray, devices: int
) -> bool:
    """Whether on every device the entries of its internal slot outside its block's extent
    are known to be zero (so the mask on exit changes nothing)."""
    for d in range(devices):
        slot = internal[d]
        if slot is None:
            continue
        for device, _, stop in support.get(slot, []):
            if device == d and any(b > n for b, n in zip(stop, extents[d])):
                return False
    return True
