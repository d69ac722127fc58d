r"""Run a compiled plan (:mod:`linop.backends.jax_shard_plan`) inside ``shard_map`` under ``jit``.

:func:`local_function` is the per-device program: given the device's pieces of the domain's
interface slots it returns its pieces of the range's, by static slices, ``lax.dynamic_slice`` /
``dynamic_update_slice`` at per-device starts (a small constant table read at the device's
``lax.axis_index``) and one ``lax.ppermute`` per round of transfers. Nothing runs on the host
and nothing is gathered onto one device.

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

from .jax_shard_plan import BoxOp, Exchange, Plan, PsumOp, ScaleOp, SlotSpec, SumOp, ZeroOp

__all__ = ["local_function", "sharded_p", "sharded_call", "result_dtype"]


def result_dtype(plan: Plan, dtype: Any) -> Any:
    """The dtype the plan computes in for inputs of ``dtype`` (promoted by its scalars)."""
    return jnp.result_type(dtype, *plan.alphas) if plan.alphas else jnp.dtype(dtype)


class _Device:
    """The running device's view: its index, the batch shape and dtype, and the slot arrays."""

    def __init__(self, plan: Plan, axes: tuple[str, ...], batch: tuple[int, ...], dtype: Any) -> None:
        self.plan = plan
        self.axis = axes[0] if len(axes) == 1 else axes
        self.index = lax.axis_index(self.axis)
        self.batch = batch
        self.dtype = dtype

    def row(self, table: np.ndarray) -> Any:
        return jnp.asarray(table)[self.index]

    def zeros(self, slot: str) -> jax.Array:
        return jnp.zeros((*self.batch, *self.plan.slots[slot]), self.dtype)

    def starts(self, table: np.ndarray, mask: np.ndarray) -> tuple[Any, ...]:
        """Python ints when every masked device starts at the same place, else traced."""
        rows = table[mask]
        if len(rows) and (rows == rows[0]).all():
            return tuple(int(v) for v in rows[0])
        return tuple(self.row(table)[k] for k in range(table.shape[1]))

    def mask(self, array: jax.Array, extents: np.ndarray) -> jax.Array:
        """Zero the entries outside this device's block (extents: (devices, ndim))."""
        shape = array.shape[len(self.batch) :]
        extent = self.row(extents)
        valid = jnp.ones(shape, dtype=bool)
        for k in range(len(shape)):
            valid = valid & (lax.broadcasted_iota(jnp.int32, shape, k) < extent[k])
        return jnp.where(valid, array, jnp.zeros((), array.dtype))

    def read(self, array: jax.Array, starts: tuple[Any, ...], shape: tuple[int, ...]) -> jax.Array:
        lead = (0,) * len(self.batch)
        if all(isinstance(s, int) for s in starts):
            return lax.slice(array, (*lead, *starts), (*self.batch, *(s + n for s, n in zip(starts, shape))))
        return lax.dynamic_slice(array, (*lead, *starts), (*self.batch, *shape))

    def write(
        self,
        array: jax.Array,
        starts: tuple[Any, ...],
        shape: tuple[int, ...],
        value: jax.Array | None,
        kind: str,
        active: np.ndarray,
    ) -> jax.Array:
        """``array[box] <- value`` (set), ``+= value`` (add) or ``<- 0`` (clear) on active devices."""
        everyone = bool(active.all())
        static = all(isinstance(s, int) for s in starts)
        if value is not None:
            value = value.reshape(*self.batch, *shape)
        if static and everyone:
            index = (Ellipsis, *(slice(s, s + n) for s, n in zip(starts, shape)))
            if kind == "add":
                return array.at[index].add(value)
            return array.at[index].set(jnp.zeros((), array.dtype) if value is None else value)
        old = self.read(array, starts, shape)
        if value is None:  # clear
            new = jnp.zeros_like(old)
        else:
            new = old + value if kind == "add" else value
        if not everyone:
            new = jnp.where(self.row(active), new, old)
        lead = (0,) * len(self.batch)
        return lax.dynamic_update_slice(array, new, (*lead, *starts))


def _run(device: _Device, ops: Sequence[Any], state: dict[str, jax.Array]) -> dict[str, jax.Array]:
    def get(slot: str) -> jax.Array:
        found = state.get(slot)
        return device.zeros(slot) if found is None else found

    for op in ops:
        if isinstance(op, BoxOp):
            starts = device.starts(op.dst_starts, op.active)
            value = None
            if op.src is not None:
                assert op.src_starts is not None and op.src_shape is not None
                src_starts = device.starts(op.src_starts, op.active)
                into_zeros = op.dst not in state and op.kind in ("set", "add")  # 0 + v = v
                if (
                    (op.kind == "set" or into_zeros)
                    and op.active.all()
                    and _static(starts)
                    and _static(src_starts)
                ):
                    whole = _whole(src_starts, op.src_shape, device.plan.slots[op.src])
                    if whole and _whole(starts, op.shape, device.plan.slots[op.dst]):
                        state[op.dst] = get(op.src).reshape(*device.batch, *op.shape)  # no copy
                        continue
                    if into_zeros:  # one pad, not zeros and an update
                        box = device.read(get(op.src), src_starts, op.src_shape).reshape(
                            *device.batch, *op.shape
                        )
                        high = [n - a - m for n, a, m in zip(device.plan.slots[op.dst], starts, op.shape)]
                        pads = [(0, 0, 0)] * len(device.batch) + [(a, h, 0) for a, h in zip(starts, high)]
                        state[op.dst] = lax.pad(box, jnp.zeros((), box.dtype), pads)
                        continue
                value = device.read(get(op.src), src_starts, op.src_shape)
            state[op.dst] = device.write(get(op.dst), starts, op.shape, value, op.kind, op.active)
        elif isinstance(op, Exchange):
            senders = np.zeros(len(op.receivers), dtype=bool)
            senders[[s for s, _ in op.perm]] = True
            values = tuple(
                device.read(get(p.src), device.starts(p.src_starts, senders), p.src_shape) for p in op.pieces
            )
            received = lax.ppermute(values, device.axis, perm=list(op.perm))
            for piece, value in zip(op.pieces, received):
                starts = device.starts(piece.dst_starts, op.receivers)
                state[piece.dst] = device.write(
                    get(piece.dst), starts, piece.dst_shape, value, piece.mode, op.receivers
                )
        elif isinstance(op, PsumOp):
            state[op.slot] = lax.psum(get(op.slot), device.axis)
        elif isinstance(op, ScaleOp):
            state = {k: (v * op.alpha).astype(device.dtype) for k, v in state.items()}
        elif isinstance(op, ZeroOp):
            state = {}
        elif isinstance(op, SumOp):
            results = [_run(device, term, dict(state)) for term in op.terms]
            summed = {}
            for slot in op.slots:
                present = [r[slot] for r in results if slot in r]
                if present:
                    total = present[0]
                    for other in present[1:]:
                        total = total + other
                    summed[slot] = total
            state = summed
        else:  # pragma: no cover - compile_plan emits nothing else
            raise TypeError(f"unknown op {op!r}")
    return state


def _static(starts: tuple[Any, ...]) -> bool:
    return all(isinstance(s, int) for s in starts)


def _whole(starts: tuple[Any, ...], shape: tuple[int, ...], slot: tuple[int, ...]) -> bool:
    return not any(starts) and tuple(shape) == tuple(slot)


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
        dtype = result_dtype(plan, pieces[0].dtype) if pieces else jnp.dtype(jnp.float32)
        batch = tuple(pieces[0].shape[1 : 1 + batch_dims]) if pieces else ()
        device = _Device(plan, axes, batch, dtype)
        state: dict[str, jax.Array] = {}
        for spec, slot, piece in zip(plan.domain.slots, plan.inputs, pieces):
            array = piece[0].astype(dtype)
            if spec.padded:
                array = device.mask(array, spec.extents())
            state[slot] = _fit(array, batch_dims, plan.slots[slot])
        state = _run(device, plan.ops, state)
        return tuple(
            _output(device, state, spec, internal, extents)
            for spec, (internal, extents) in zip(plan.range.slots, plan.outputs)
        )

    return run


def _output(
    device: _Device,
    state: dict[str, jax.Array],
    spec: SlotSpec,
    internal: tuple[str | None, ...],
    extents: np.ndarray,
) -> jax.Array:
    batch = len(device.batch)
    used = sorted({s for s in internal if s is not None})
    if not used:
        return jnp.zeros((1, *device.batch, *spec.shape), device.dtype)

    def value(slot: str) -> jax.Array:
        found = state.get(slot)
        return _fit(device.zeros(slot) if found is None else found, batch, spec.shape)

    array = value(used[0])
    for slot in used[1:]:
        chosen = np.asarray([s == slot for s in internal])
        array = jnp.where(device.row(chosen), value(slot), array)
    if spec.padded or len(used) > 1:
        array = device.mask(array, extents)
    return array[None]


# -- the primitive --------------------------------------------------------------------------
sharded_p = Primitive("linop_sharded")
"""``sharded_p.bind(*pieces, plan=, axes=, batch_dims=)``, inside ``shard_map`` over ``axes``:
this device's pieces of the range slots of ``plan`` (``(1, *batch, *slot.shape)``) for its
pieces of the domain slots."""
sharded_p.multiple_results = True


def _abstract(*pieces: Any, plan: Plan, axes: tuple[str, ...], batch_dims: int) -> list[Any]:
    dtype = result_dtype(plan, pieces[0].dtype) if pieces else jnp.dtype(jnp.float32)
    batch = tuple(pieces[0].shape[1 : 1 + batch_dims]) if pieces else ()
    return [jax.core.ShapedArray((1, *batch, *s.shape), dtype) for s in plan.range.slots]


def _lowering(*pieces: Any, plan: Plan, axes: tuple[str, ...], batch_dims: int) -> list[Any]:
    return list(local_function(plan, axes, batch_dims)(*pieces))


def _transpose(
    cotangents: Any, *primals: Any, plan: Plan, axes: tuple[str, ...], batch_dims: int
) -> list[Any]:
    cotangents = [
        jnp.zeros(ct.aval.shape, ct.aval.dtype) if type(ct) is ad.Zero else ct  # type: ignore[attr-defined]
        for ct in cotangents
    ]
    complex_ = any(jnp.iscomplexobj(ct) for ct in cotangents)
    if complex_:
        cotangents = [jnp.conj(ct) for ct in cotangents]
    if cotangents:
        common = jnp.result_type(*cotangents)
        cotangents = [ct.astype(common) for ct in cotangents]
    back = sharded_p.bind(*cotangents, plan=plan.adjoint(), axes=axes, batch_dims=batch_dims)
    result = []
    for value, primal in zip(back, primals):
        aval = primal.aval if ad.is_undefined_primal(primal) else jax.core.get_aval(primal)  # type: ignore[attr-defined]
        if complex_:
            value = jnp.conj(value)
        if jnp.iscomplexobj(value) and not jnp.issubdtype(aval.dtype, jnp.complexfloating):
            value = jnp.real(value)
        result.append(value.astype(aval.dtype))
    return result


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
