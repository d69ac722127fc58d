r"""Run a compiled plan (:mod:`linop.backends.jax.plan`) inside ``shard_map`` under ``jit``.

:func:`local_function` is the per-device program: given the device's pieces of the domain's
interface slots it returns its pieces of the range's: box reads and writes on the device's slots
(:mod:`linop.backends.jax.slots`: static slices, tiles assembled by ``concatenate`` and
``pad``, in-place updates at per-device starts read from small constant tables at the device's
``lax.axis_index``), one ``lax.ppermute`` per round of transfers and one native collective
(``all_to_all``, ``all_gather``, ``psum_scatter``, ``psum``) per phase that is one, and the
local kernels of a round as one program on every device where they are one template up to
parameters and shapes (:class:`~linop.kernel_template.KernelTemplate`; the plan's
``KernelOp.mode`` says ``"spmd"``), else one ``lax.switch`` on the device index. Nothing
runs on the host and nothing is gathered onto one device. The device's leading axis (of length
1) is kept on every slot, so that an in-place update is never followed by a reshape (which
would make XLA copy the slot).

:data:`sharded_p` wraps the ``shard_map`` of that program into one linear JAX primitive on
arrays stacked over devices (leading axis sharded over the mesh), whose

- JVP is the primitive itself on the tangents (:math:`\dot y = A \dot x`: it is linear);
- transpose is the primitive of the *adjoint plan*, the lowering of ``op.H`` (derived by
  linop's rules, not by JAX): :math:`A^{T}\bar y = \overline{A^{*}\,\overline{\bar y}}`;
- batching rule runs every slot with extra leading batch axes (after the device axis).

So ``jax.grad``, ``jax.vjp``, ``jax.linear_transpose``, ``jax.jvp`` and ``jax.vmap`` work and
are exact for data movement.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.sharding import Mesh, PartitionSpec

from . import ops
from .integers import integer_cast
from .plan import Plan, SlotSpec
from .slots import DeviceView, Slots
from .transpose import transpose_by_adjoint

__all__ = ["local_function", "sharded_p", "sharded_call", "result_dtype"]


def result_dtype(plan: Plan, dtype: Any) -> Any:
    """The dtype the plan computes in for inputs of ``dtype``: promoted by its scalars, and an
    integer run widened where a sum may not fit (or refused: :func:`~.integers.integer_cast`)."""
    found = jnp.result_type(dtype, *plan.alphas) if plan.alphas else jnp.dtype(dtype)
    if found.kind in "iu":
        cast = integer_cast(plan.op, (dtype,))
        if cast is not None:
            return jnp.dtype(cast)
    return found


def _run(device: DeviceView, steps: Sequence[Any], slots: Slots) -> Slots:
    for op in steps:
        if isinstance(op, ops.BoxOp):
            if (
                op.src is not None
                and op.kind == "set"
                and op.active.all()
                and op.shape == device.plan.slots[op.dst]
                and op.src_shape == op.shape == device.plan.slots[op.src]
                and not op.src_starts.any()  # type: ignore[union-attr]
                and not op.dst_starts.any()
                and op.extents is None
            ):
                slots.alias(op.dst, op.src)  # a whole slot copied: no copy
                continue
            value, raw = None, None
            if op.src is not None:
                assert op.src_starts is not None and op.src_shape is not None
                value, raw = slots.read_masked(op.src, op.src_starts, op.active, op.src_shape)
                if op.extents is not None:  # each device's own box of the merged shapes
                    value, raw = device.mask(value, op.extents), None
            slots.write(op.dst, op.dst_starts, op.active, op.shape, value, op.kind, raw=raw)
        elif isinstance(op, ops.Exchange):
            senders = np.zeros(len(op.receivers), dtype=bool)
            senders[[s for s, _ in op.perm]] = True
            values = tuple(slots.read(p.src, p.src_starts, senders, p.src_shape) for p in op.pieces)
            received = lax.ppermute(values, device.axis, perm=device.ppermute_pairs(op.perm))
            for piece, value in zip(op.pieces, received):
                slots.write(
                    piece.dst, piece.dst_starts, op.receivers, piece.dst_shape, value, piece.mode, True
                )
        elif isinstance(op, ops.CollectiveOp):
            for part in op.pieces:
                _collective(device, slots, part)
        elif isinstance(op, ops.KernelOp):
            _kernels(device, slots, op)
        elif isinstance(op, ops.PsumOp):
            names = device.axis if isinstance(device.axis, tuple) else (device.axis,)
            over = tuple(names[i] for i in op.over)
            slots.set(op.slot, lax.psum(slots.value(op.slot), over[0] if len(over) == 1 else over))
        elif isinstance(op, ops.ScaleOp):
            scaled = Slots(device)
            for name in slots.names():
                scaled.set(name, (slots.value(name) * op.alpha).astype(device.dtype))
            slots = scaled
        elif isinstance(op, ops.ZeroOp):
            slots = Slots(device)
        elif isinstance(op, ops.SumOp):
            results = [_run(device, term, slots.copy()) for term in op.terms]
            summed = Slots(device)
            for slot in op.slots:
                present = [r.value(slot) for r in results if r.has(slot)]
                if present:
                    total = present[0]
                    for other in present[1:]:
                        total = total + other
                    summed.set(slot, total)
            slots = summed
        else:  # pragma: no cover - compile_plan emits nothing else
            raise TypeError(f"unknown op {op!r}")
    return slots


def _kernels(device: DeviceView, slots: Slots, op: ops.KernelOp) -> None:
    """The local kernels of a round: each device runs its own call (``lax.switch`` on its
    index; no switch when one call runs on every device), on its consumed blocks cut from
    their slots to the blocks' real shapes, and sets each produced slot to the block padded
    with zeros (on the devices that do not write a slot, its old value). One program for
    every device where the plan found the calls to be one template (:func:`_one_kernel`)."""
    if op.mode == "spmd":
        _one_kernel(device, slots, op)
        return
    p = device.plan.devices
    produced = sorted({slot for c in op.calls for slot, _ in c.produced})
    consumed = sorted({slot for c in op.calls for slot, _ in c.consumed})
    writers = {slot: {c.device for c in op.calls if slot in dict(c.produced)} for slot in produced}
    kept = [slot for slot in produced if len(writers[slot]) < p]  # old values, where not written
    names = [*consumed, *kept]
    operands = [slots.value(slot) for slot in names]
    lead = len(device.batch)

    def branch(call: ops.KernelCall | None) -> Any:
        def run(*arrays: jax.Array) -> tuple[jax.Array, ...]:
            given = dict(zip(names, arrays))
            if call is None:
                return tuple(given[slot] for slot in produced)
            blocks = [
                lax.slice(given[slot], (0,) * (lead + len(shape)), (*device.batch, *shape))
                for slot, shape in call.consumed
            ]
            shapes = [shape for _, shape in call.produced]
            results = dict(
                zip(
                    (slot for slot, _ in call.produced),
                    _call_kernel(device, call.node, _device_function(call), blocks, shapes),
                )
            )
            return tuple(
                device.place(results[slot], (0,) * len(device.plan.slots[slot]), device.plan.slots[slot])
                if slot in results
                else given[slot]
                for slot in produced
            )

        return run

    index = np.full(p, len(op.calls), dtype=np.int32)
    for k, call in enumerate(op.calls):
        index[call.device] = k
    branches = [branch(call) for call in op.calls]
    if len(op.calls) < p:
        branches.append(branch(None))
    if len(branches) == 1:
        values = branches[0](*operands)
    else:
        values = lax.switch(device.row(index), branches, *operands)
    for slot, value in zip(produced, values):
        slots.set(slot, value)


def _one_kernel(device: DeviceView, slots: Slots, op: ops.KernelOp) -> None:
    """The calls of a round as ONE program on every device (``op.mode == "spmd"``: one
    :class:`~linop.kernel_template.KernelTemplate` up to parameters and shapes): each consumed
    slot whole (zeroed outside the device's block where blocks are uneven, unless the plan
    knows it zero there: ``op.unmasked``), the device's
    parameters picked from their table stacked over the devices (zero-padded to the largest;
    a constant where every device has the same), the outputs asked at the slots' shapes and
    zeroed outside each device's block; the devices without a call keep their slots."""
    p = device.plan.devices
    first = op.calls[0]
    template = first.node.kernel.device_template
    active = np.zeros(p, dtype=bool)
    active[[c.device for c in op.calls]] = True

    def extents(i: int, which: str) -> tuple[np.ndarray, bool]:
        full = device.plan.slots[getattr(first, which)[i][0]]
        table = np.zeros((p, len(full)), dtype=np.int32)
        for c in op.calls:
            table[c.device] = getattr(c, which)[i][1]
        return table, any(tuple(table[c.device]) != tuple(full) for c in op.calls)

    blocks = []
    for i, (slot, _) in enumerate(first.consumed):
        value = slots.value(slot)
        table, uneven = extents(i, "consumed")
        known_zero = bool(op.unmasked) and op.unmasked[i]  # beyond each block (plan's support)
        blocks.append(device.mask(value, table) if uneven and not known_zero else value)
    params = []
    for k, param in enumerate(template.params):
        values = [c.node.kernel.device_template.params[k] for c in op.calls]
        if all(v.shape == param.shape and np.array_equal(v, param) for v in values):
            params.append(jnp.asarray(param))
            continue
        shape = tuple(max(v.shape[a] for v in values) for a in range(param.ndim))
        stacked = np.zeros((p, *shape), dtype=param.dtype)
        for c, v in zip(op.calls, values):
            corner: tuple[Any, ...] = (c.device, *(slice(0, n) for n in v.shape))
            stacked[corner] = v
        params.append(device.row(stacked))
    shapes = [device.plan.slots[slot] for slot, _ in first.produced]
    function = template.adjoint if first.node.adjointed else template.forward
    frozen = tuple(params)
    out = tuple(tuple(s) for s in shapes)
    results = _call_kernel(device, first.node, lambda *b: function(frozen, *b, shapes=out), blocks, shapes)
    for i, ((slot, _), value) in enumerate(zip(first.produced, results)):
        table, uneven = extents(i, "produced")
        if not active.all():
            value = jnp.where(device.row(active), value, slots.value(slot))
        if uneven:  # masked lazily (Slots.set_masked): where read beyond a block, or whole
            table[~active] = device.plan.slots[slot]  # the devices without a call: nothing
            slots.set_masked(slot, value, table)
        else:
            slots.set(slot, value)


def _device_function(call: ops.KernelCall) -> Any:
    """The traceable function of ``call``'s kernel in its direction, on the call's blocks."""
    node = call.node
    kernel = node.kernel
    if kernel.kind == "dense":
        matrix = np.asarray(kernel.matrix)
        matrix = matrix.conj().T if node.adjointed else matrix
        sizes = [int(np.prod(shape, dtype=np.int64)) for _, shape in call.produced]
        shapes = [shape for _, shape in call.produced]

        def function(*arrays: jax.Array) -> tuple[jax.Array, ...]:
            flat = jnp.concatenate([jnp.ravel(a) for a in arrays])
            out = jnp.asarray(matrix) @ flat
            splits = np.cumsum(sizes)[:-1].tolist()
            return tuple(part.reshape(shape) for part, shape in zip(jnp.split(out, splits), shapes))

        return function
    if kernel.device_template is not None:
        return kernel.device_template.bound(node.adjointed, [shape for _, shape in call.produced])
    pair = kernel.device_callables
    assert pair is not None  # compile_plan refuses the kernels that do not run on JAX
    return pair[1] if node.adjointed else pair[0]


def _call_kernel(
    device: DeviceView,
    node: Any,
    function: Any,
    blocks: list[jax.Array],
    shapes: Sequence[tuple[int, ...]],
) -> list[jax.Array]:
    """``function`` (a kernel of ``node`` in its direction) on ``blocks`` (each ``(*batch,
    *block)``), mapped over the batch axes by ``jax.vmap``; its results checked to have
    ``shapes`` and cast to the program's dtype (which must hold them)."""
    from ...errors import KernelOutputError

    batch = device.batch
    count = int(np.prod(batch, dtype=np.int64))
    flat = [b.reshape(count, *b.shape[len(batch) :]) for b in blocks]

    def one(*arrays: jax.Array) -> tuple[jax.Array, ...]:
        results = function(*arrays)
        if not isinstance(results, (tuple, list)):
            results = (results,)
        return tuple(results)

    results = jax.vmap(one)(*flat)
    if len(results) != len(shapes):
        raise KernelOutputError(
            f"local operator {node}: its kernel for JAX devices returned {len(results)} arrays for the "
            f"{len(shapes)} blocks {[b.name for b in node.produced]}"
        )
    out = []
    for block, shape, result in zip(node.produced, shapes, results):
        if tuple(result.shape[1:]) != tuple(shape):
            raise KernelOutputError(
                f"local operator {node}: block {block.name!r} came back from its kernel for JAX devices "
                f"with shape {tuple(result.shape[1:])}, expected {tuple(shape)}"
            )
        if not jnp.can_cast(result.dtype, device.dtype, casting="safe"):
            raise KernelOutputError(
                f"local operator {node}: block {block.name!r} came back from its kernel for JAX devices "
                f"with dtype {result.dtype}, which the program's dtype {device.dtype} cannot hold; "
                f"pass the inputs as {result.dtype}"
            )
        out.append(result.astype(device.dtype).reshape(*batch, *shape))
    return out


def _collective(device: DeviceView, slots: Slots, piece: ops.CollectivePiece) -> None:
    """One piece of a phase in which every device sends to every other (see
    :class:`~linop.backends.jax.plan.CollectivePiece`), by one native collective."""
    p = device.plan.devices
    everyone = np.ones(p, dtype=bool)
    used = piece.used()
    step = (np.arange(p) + 1) % p  # for device d, some other device
    if piece.kind == "all_gather":
        box = slots.read(piece.src, piece.sends[step, np.arange(p)], everyone, piece.src_shape)
        along = _side_by_side(piece)
        if along is not None:  # the boxes land side by side in sender order: one tiled gather
            shape = tuple(n * p if k == along else n for k, n in enumerate(piece.dst_shape))
            box = box.reshape(*device.batch[1:], *piece.dst_shape)  # without the device axis,
            # so that XLA gathers along a major dimension in the default layout (no copies)
            whole = lax.all_gather(box, device.axis, axis=len(device.batch) - 1 + along, tiled=True)
            slots.write(piece.dst, piece.places[0], everyone, shape, whole[None], "set")
            return
        received = lax.all_gather(box, device.axis, axis=0, tiled=False)
    else:
        along = _side_by_side(piece, piece.sends, piece.src_shape) if piece.kind == "psum_scatter" else None
        if along is not None:  # the boxes sent lie side by side in receiver order: one tiled scatter
            shape = tuple(n * p if k == along else n for k, n in enumerate(piece.src_shape))
            region = slots.read(piece.src, piece.sends[0], everyone, shape)[0]  # no device axis
            total = lax.psum_scatter(
                region, device.axis, scatter_dimension=len(device.batch) - 1 + along, tiled=True
            )
            place = piece.places[step, np.arange(p)]
            slots.write(piece.dst, place, everyone, piece.dst_shape, total[None], "add")
            return
        chunks = [slots.read(piece.src, piece.sends[e], used[e], piece.src_shape) for e in range(p)]
        if piece.kind == "psum_scatter":
            if not piece.with_self:  # a device's own box is not sent
                zero = jnp.zeros((), device.dtype)
                chunks = [jnp.where(device.index == e, zero, c) for e, c in enumerate(chunks)]
            total = lax.psum_scatter(jnp.stack(chunks), device.axis, scatter_dimension=0, tiled=True)
            place = piece.places[step, np.arange(p)]
            slots.write(piece.dst, place, everyone, piece.dst_shape, total[0], "add")
            return
        received = lax.all_to_all(jnp.stack(chunks), device.axis, 0, 0, tiled=True)
    for sender in range(p):
        slots.write(
            piece.dst, piece.places[sender], used[sender], piece.dst_shape, received[sender], piece.mode
        )


def _side_by_side(
    piece: ops.CollectivePiece, table: np.ndarray | None = None, shape: tuple[int, ...] | None = None
) -> int | None:
    """The dimension along which the boxes of ``table`` (default the places: ``[sender,
    receiver]``; or the sends: ``[destination, sender]``) lie one after the other in the order
    of its first index, at the same starts on every device, else None."""
    table = piece.places if table is None else table
    shape = piece.dst_shape if shape is None else shape
    if not piece.with_self:
        return None
    first = table[:, 0]  # [first index] -> start, if every device agrees
    if not (table == first[:, None]).all():
        return None
    steps = first - first[0]
    for k, n in enumerate(shape):
        expected = np.zeros_like(steps)
        expected[:, k] = np.arange(len(steps)) * n
        if (steps == expected).all():
            return k
    return None


def _fit(array: jax.Array, batch: int, shape: tuple[int, ...]) -> jax.Array:
    """Crop or zero-pad the trailing dimensions of ``array`` to ``shape``."""
    have = array.shape[batch:]
    if have == shape:
        return array
    index = (Ellipsis, *(slice(0, min(a, b)) for a, b in zip(have, shape)))
    cropped = array[index]
    pads = [(0, 0)] * batch + [(0, max(0, b - a)) for a, b in zip(have, shape)]
    return jnp.pad(cropped, pads)


def local_function(plan: Plan, axes: Sequence[str], batch_dims: int = 0) -> Any:
    """The per-device program of ``plan``, to call inside ``shard_map`` over mesh ``axes``
    (linearized in mesh order: device ``d`` is the d-th of those axes together).

    It takes one array per domain interface slot (``plan.domain.names``), this device's piece
    of shape ``(1, *batch, *slot.shape)``, and returns the range's pieces likewise. JAX
    differentiates it by its own (exact) rules; :data:`sharded_p` differentiates by ``op.H``.
    """
    axes = tuple(axes)

    def run(*pieces: jax.Array) -> tuple[jax.Array, ...]:
        dtype = result_dtype(plan, jnp.result_type(*pieces)) if pieces else jnp.dtype(jnp.float32)
        # the device's leading axis (of length 1) is kept as a batch axis: an in-place update
        # of a slot is then the last op of its fusion, never followed by a reshape (a copy)
        batch = (1, *pieces[0].shape[1 : 1 + batch_dims]) if pieces else (1,)
        device = DeviceView(plan, axes, batch, dtype)
        slots = Slots(device)
        for spec, slot, piece in zip(plan.domain.slots, plan.inputs, pieces):
            array = _fit(piece.astype(dtype), len(batch), plan.slots[slot])
            if spec.padded:  # masked where read beyond a block (see Slots.set_masked)
                slots.set_masked(slot, array, spec.extents())
            else:
                slots.set(slot, array)
        slots = _run(device, plan.ops, slots)
        masks = plan.output_masks or (True,) * len(plan.outputs)
        outputs = tuple(
            _output(device, slots, spec, internal, extents, masked)
            for spec, (internal, extents), masked in zip(plan.range.slots, plan.outputs, masks)
        )
        return outputs

    return run


def _output(
    device: DeviceView,
    slots: Slots,
    spec: SlotSpec,
    internal: tuple[str | None, ...],
    extents: np.ndarray,
    masked: bool = True,
) -> jax.Array:
    """The range slot ``spec`` from its internal slot on each device, its padding masked
    unless ``masked`` is False (known to be zero already)."""
    batch = len(device.batch)
    used = sorted({s for s in internal if s is not None})
    if not used:
        return jnp.zeros((*device.batch, *spec.shape), device.dtype)

    def value(slot: str) -> jax.Array:
        return _fit(slots.value(slot, tail=True), batch, spec.shape)

    array = value(used[0])
    for slot in used[1:]:
        chosen = np.asarray([s == slot for s in internal])
        array = jnp.where(device.row(chosen), value(slot), array)
    if masked and (spec.padded or len(used) > 1):
        array = device.mask(array, extents)
    return array


# -- the primitive --------------------------------------------------------------------------
sharded_p = Primitive("linop_sharded")
"""``sharded_p.bind(*pieces, plan=, axes=, batch_dims=)``, inside ``shard_map`` over ``axes``:
this device's pieces of the range slots of ``plan`` (``(1, *batch, *slot.shape)``) for its
pieces of the domain slots."""
sharded_p.multiple_results = True


def _abstract(*pieces: Any, plan: Plan, axes: tuple[str, ...], batch_dims: int) -> list[Any]:
    dtype = result_dtype(plan, jnp.result_type(*pieces)) if pieces else jnp.dtype(jnp.float32)
    batch = tuple(pieces[0].shape[1 : 1 + batch_dims]) if pieces else ()
    return [jax.core.ShapedArray((1, *batch, *s.shape), dtype) for s in plan.range.slots]


def _lowering(*pieces: Any, plan: Plan, axes: tuple[str, ...], batch_dims: int) -> list[Any]:
    return list(local_function(plan, axes, batch_dims)(*pieces))


def _transpose(
    cotangents: Any, *primals: Any, plan: Plan, axes: tuple[str, ...], batch_dims: int
) -> list[Any]:
    def adjoint(cotangents: list[Any]) -> Any:
        return sharded_p.bind(*cotangents, plan=plan.adjoint(), axes=axes, batch_dims=batch_dims)

    return transpose_by_adjoint(cotangents, primals, adjoint)


def _batched(
    arguments: Sequence[Any], dims: Sequence[Any], *, plan: Plan, axes: tuple[str, ...], batch_dims: int
) -> Any:
    size = next(a.shape[d] for a, d in zip(arguments, dims) if d is not None)
    moved = []
    for a, d in zip(arguments, dims):
        if d is None:
            a = jnp.broadcast_to(a[:, None], (a.shape[0], size, *a.shape[1:]))
        else:
            a = jnp.moveaxis(a, d, 1)
        moved.append(a)
    out = sharded_p.bind(*moved, plan=plan, axes=axes, batch_dims=batch_dims + 1)
    return list(out), [1] * len(out)


sharded_p.def_abstract_eval(_abstract)
mlir.register_lowering(sharded_p, mlir.lower_fun(_lowering, multiple_results=True))
ad.deflinear2(sharded_p, _transpose)
batching.primitive_batchers[sharded_p] = _batched


@lru_cache(maxsize=256)
def _mapped(plan: Plan, mesh: Mesh, axes: tuple[str, ...], batch_dims: int, adjoint_by_tree: bool) -> Any:
    spec = PartitionSpec(axes[0] if len(axes) == 1 else axes)
    if adjoint_by_tree:

        def kernel(*pieces: jax.Array) -> tuple[jax.Array, ...]:
            return tuple(sharded_p.bind(*pieces, plan=plan, axes=axes, batch_dims=batch_dims))

    else:
        kernel = local_function(plan, axes, batch_dims)
    mapped = jax.shard_map(
        kernel,
        mesh=mesh,
        in_specs=(spec,) * len(plan.domain.slots),
        out_specs=(spec,) * len(plan.range.slots),
        check_vma=False,
    )
    return jax.jit(mapped)


def sharded_call(
    plan: Plan, mesh: Mesh, axes: tuple[str, ...], batch_dims: int = 0, *, adjoint_by_tree: bool = True
) -> Any:
    """The jitted ``shard_map`` of the plan over ``mesh`` (cached), a function of the domain's
    interface slots stacked over devices (``(devices, *batch, *slot.shape)``, the leading axis
    sharded over ``axes``) returning the range's likewise. With ``adjoint_by_tree`` (default)
    it runs :data:`sharded_p`, so JAX transposes it by the plan of ``op.H``; without, JAX
    transposes the lowered program by its own rules."""
    return _mapped(plan, mesh, tuple(axes), batch_dims, adjoint_by_tree)
