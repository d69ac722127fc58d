r"""Operator trees inside ``jit`` on JAX devices: the lowering of :mod:`linop.backends.jax.shard`.

:func:`sharded` compiles a tree for a device :class:`~jax.sharding.Mesh` into a
:class:`ShardedOperator`, a JAX function of the domain's *slots*: each slot is one array
stacked over the devices, ``(devices, *slot.shape)``, its leading axis sharded over the mesh,
device ``d``'s row holding its block of the slot in the leading corner (padded with zeros to
the slot's shape when blocks are uneven). Blocks are grouped into slots by name prefix
(``x[0]``, ``x[1]``, ... form the slot ``x``). Worker ``w`` runs on device ``w`` of the mesh
(its axes linearized in order) unless ``workers=`` maps it elsewhere.

- ``f(slots)`` runs ``shard_map`` under ``jit``: ``lax.ppermute`` rounds and slices on each
  device, nothing on the host; its derivative and transpose are the lowering of ``op.H``
  (derived by linop's rules): :math:`A^{T}\bar y = \overline{A^{*}\,\overline{\bar y}}`;
  ``jax.grad``, ``jax.vjp``, ``jax.linear_transpose``, ``jax.jvp`` and ``jax.vmap`` work.
- ``f.blocks(state)`` does the same for a state of per-worker arrays keyed by block name.
- :func:`tensor_function` takes and returns global arrays of :class:`~linop.DistributedTensor`
  s whose partitions match mesh axes, mapping tensor dimensions to mesh axes explicitly.
- ``f.local`` is the per-device function, to call inside a ``shard_map`` of your own.

Padding never leaks into a result or a gradient: entries outside each device's block are
masked on entry and exit.

Dtypes: float32/64, complex64/128 and integers, with ``jax_enable_x64`` on or off (index
arithmetic is int32 in both modes). Integer sums are exact or refused, never wrapped: JAX fixes
the dtypes before it sees the values, so a tree that sums entries (an all-reduce, an adjoint
halo exchange) computes in a dtype wide enough for every value of the input dtype, as
:mod:`linop.dtypes` decides for the largest such value (``uint8`` or ``int16`` summed over 4
devices: int64 with x64, int32 without), and refuses with
:class:`~linop.errors.IntegerOverflowError` what no dtype JAX holds can take (an ``int32`` sum
without x64, an ``int64`` sum); see :mod:`linop.backends.jax.integers`.

Mesh axes may be named in any order (``axes=("c", "r")`` on a mesh ``("r", "c")``): devices
are counted row-major over ``axes`` as given, by every collective.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from typing import Any

from .extras import importing

with importing("jax", __name__):  # the jax extra: say so where it is missing
    import jax

import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..backends.jax.plan import Layout, Plan, compile_plan
from ..backends.jax.shard import local_function, sharded_call
from ..dtypes import NUMERIC_KINDS, check_block_dtype
from ..errors import DtypeError, IntegerOverflowError, MeshError, OperandError, StateError, WorkerError
from ..operator import LinearOperator
from ..partition import DistributedTensor

__all__ = ["ShardedOperator", "sharded", "tensor_function"]


def _device_map(workers: Sequence[int] | Mapping[int, int] | None, devices: int) -> tuple[int, ...] | None:
    if workers is None:
        return None
    if isinstance(workers, Mapping):
        size = max(workers, default=-1) + 1
        return tuple(int(workers.get(w, w)) for w in range(size))
    return tuple(int(d) for d in workers)


class ShardedOperator:
    """A tree compiled for a mesh of JAX devices; see the module docstring.

    Parameters
    ----------
    op : LinearOperator
    mesh : jax.sharding.Mesh
    axes : sequence of str, optional
        The mesh axes the devices are counted over (linearized in this order); default all.
    workers : sequence or dict of int, optional
        Worker -> device (an index along ``axes``); default worker w on device w.
    """

    def __init__(
        self,
        op: LinearOperator,
        mesh: Mesh,
        *,
        axes: Sequence[str] | None = None,
        workers: Sequence[int] | Mapping[int, int] | None = None,
        plan: Plan | None = None,
    ) -> None:
        self.op = op
        self.mesh = mesh
        self.axes = tuple(mesh.axis_names if axes is None else axes)
        for axis in self.axes:
            if axis not in mesh.shape:
                raise MeshError(f"mesh axis {axis!r} is not an axis of the mesh {dict(mesh.shape)}")
        self.devices = int(np.prod([mesh.shape[a] for a in self.axes]))
        if plan is None:
            shape = tuple(mesh.shape[a] for a in self.axes)
            plan = compile_plan(op, self.devices, _device_map(workers, self.devices), shape)
        self.plan = plan
        self.sharding = NamedSharding(mesh, PartitionSpec(self.axes[0] if len(self.axes) == 1 else self.axes))

    @property
    def domain(self) -> Layout:
        """The input slots (names, padded shapes, the block of each device)."""
        return self.plan.domain

    @property
    def range(self) -> Layout:
        """The output slots."""
        return self.plan.range

    @property
    def H(self) -> ShardedOperator:  # noqa: N802 - the conventional name
        """The adjoint (the plan of ``op.H``), on the same mesh."""
        return ShardedOperator(self.op.H, self.mesh, axes=self.axes, plan=self.plan.adjoint())

    @property
    def local(self) -> Callable[..., tuple[jax.Array, ...]]:
        """The per-device function (inside ``shard_map`` over :attr:`axes`): this device's
        pieces ``(1, *slot.shape)`` of the domain slots, positionally -> the range's."""
        return local_function(self.plan, self.axes)

    # -- slots ----------------------------------------------------------------------------
    def _check_slots(self, slots: Mapping[str, Any]) -> list[Any]:
        if not isinstance(slots, Mapping):
            raise StateError(f"slots must be a dict of arrays keyed by slot name, not {type(slots).__name__}")
        names = self.domain.names
        missing = [n for n in names if n not in slots]
        extra = [n for n in slots if n not in names]
        if missing or extra:
            raise StateError(f"slots for {self.op}: missing slot(s) {missing}, unexpected slot(s) {extra}")
        arrays = []
        for spec in self.domain.slots:
            value = slots[spec.name]
            shape = tuple(getattr(value, "shape", np.shape(value)))
            want = (self.devices, *spec.shape)
            if shape != want:
                raise StateError(
                    f"slot {spec.name!r} has shape {shape}, expected {want} (devices x the slot's padded shape)"
                )
            dtype = _dtype_of(value)
            if dtype.kind not in NUMERIC_KINDS:
                raise DtypeError(f"slot {spec.name!r} has dtype {dtype}; linop computes in numeric dtypes")
            arrays.append(value)
        if arrays:
            common = jnp.result_type(*arrays)
            arrays = [jnp.asarray(a, dtype=common) for a in arrays]
        return arrays

    def arrays(self, *arrays: Any) -> tuple[jax.Array, ...]:
        """Apply to stacked slot arrays in the order of ``domain.names``."""
        return tuple(sharded_call(self.plan, self.mesh, self.axes)(*arrays))

    def __call__(self, slots: Mapping[str, Any]) -> dict[str, jax.Array]:
        """``op`` on stacked slots (a dict by slot name) -> the range's stacked slots."""
        return dict(zip(self.range.names, self.arrays(*self._check_slots(slots))))

    def pack(self, state: Mapping[str, Any], layout: Layout | None = None) -> dict[str, jax.Array]:
        """A state of per-worker arrays (by block name) as stacked, padded slots, sharded over
        the mesh (jitted; works on tracers too)."""
        layout = self.domain if layout is None else layout
        names = tuple(b.name for s in layout.slots for b in s.blocks if b is not None)
        shapes = {b.name: b.shape for s in layout.slots for b in s.blocks if b is not None}
        if not isinstance(state, Mapping):
            shape = getattr(state, "shape", None)
            raise StateError(
                f"a state must be a dict of per-worker arrays keyed by block name ({list(names)[:4]}"
                f"{' ...' if len(names) > 4 else ''}), not {type(state).__name__}"
                + (f" of shape {tuple(shape)}" if shape is not None else "")
                + "; for a global array use linop.frameworks.jax_sharded.tensor_function, or split it "
                "with DistributedTensor.scatter"
            )
        missing = [n for n in names if n not in state]
        extra = [n for n in state if n not in shapes]
        if missing or extra:
            raise StateError(f"state for {self.op}: missing block(s) {missing}, unexpected block(s) {extra}")
        values = [state[n] for n in names]
        for name, value in zip(names, values):
            shape = _shape_of(name, value)
            if shape != shapes[name]:
                raise StateError(f"block {name!r} has shape {shape}, the space expects {shapes[name]}")
            check_block_dtype(name, _dtype_of(value))
            _refuse_narrowing(name, value)
        return dict(zip(layout.names, _packer(layout, names, self.sharding)(*values)))

    def unpack(self, slots: Mapping[str, Any], layout: Layout | None = None) -> dict[str, jax.Array]:
        """Stacked slots back to per-worker arrays by block name (padding cut off; jitted)."""
        layout = self.range if layout is None else layout
        if not isinstance(slots, Mapping):
            raise StateError(f"slots must be a dict of arrays keyed by slot name, not {type(slots).__name__}")
        names = tuple(b.name for s in layout.slots for b in s.blocks if b is not None)
        return dict(zip(names, _unpacker(layout)(*(slots[n] for n in layout.names))))

    def blocks(self, state: Mapping[str, Any]) -> dict[str, jax.Array]:
        """``op(state)`` for per-worker arrays keyed by block name, through the slots."""
        return self.unpack(self(self.pack(state)))

    def __repr__(self) -> str:
        return f"ShardedOperator({self.op}, {self.devices} devices, {self.plan.rounds} ppermute rounds)"


def _shape_of(name: str, value: Any) -> tuple[int, ...]:
    """The shape of a block's value; a ragged nest of lists is a :class:`StateError` naming the
    block (numpy's own ``ValueError`` says neither which block nor why)."""
    try:
        return tuple(np.shape(value))
    except ValueError:
        raise StateError(
            f"block {name!r} is a ragged nest of sequences, not an array: its rows differ in length"
        ) from None


def _refuse_narrowing(name: str, value: Any) -> None:
    """Refuse a host integer block that JAX would narrow with wrap-around: with
    ``jax_enable_x64`` off JAX holds int64/uint64 entries as 32-bit ones, so an entry beyond
    int32's (uint32's) range would arrive wrapped. Values that fit pass (they are exact);
    values on a device or traced already have JAX's dtype."""
    if not isinstance(value, np.ndarray | np.generic | list | tuple | int):
        return
    array = np.asarray(value)
    if array.dtype.kind not in "iu" or array.size == 0:
        return
    held = np.dtype(jax.dtypes.canonicalize_dtype(array.dtype))
    if held == array.dtype:
        return
    info = np.iinfo(held)
    low, high = int(array.min()), int(array.max())
    if low < info.min or high > info.max:
        raise IntegerOverflowError(
            f"block {name!r} holds {array.dtype} entries in [{low}, {high}], beyond {held}, which is "
            f"what JAX keeps of {array.dtype} with jax_enable_x64 off: they would wrap. Enable x64 "
            "(jax.config.update('jax_enable_x64', True)) or pass floats"
        )


def _dtype_of(value: Any) -> np.dtype:
    """The dtype of an array (numpy, JAX, a tracer) or of what numpy makes of a list."""
    dtype = getattr(value, "dtype", None)
    return np.dtype(dtype) if dtype is not None else np.asarray(value).dtype


@lru_cache(maxsize=256)
def _packer(
    layout: Layout, names: tuple[str, ...], sharding: NamedSharding
) -> Callable[..., tuple[jax.Array, ...]]:
    def pack(*values: Any) -> tuple[jax.Array, ...]:
        by_name = dict(zip(names, values))
        dtype = jnp.result_type(*values) if values else jnp.float32
        out = []
        for spec in layout.slots:
            rows = []
            for block in spec.blocks:
                if block is None:
                    rows.append(jnp.zeros(spec.shape, dtype))
                    continue
                pads = [(0, n - m) for n, m in zip(spec.shape, block.shape)]
                value = jnp.asarray(by_name[block.name]).astype(dtype)
                rows.append(jnp.pad(value, pads) if any(p for _, p in pads) else value)
            out.append(jax.lax.with_sharding_constraint(jnp.stack(rows), sharding))
        return tuple(out)

    return jax.jit(pack)


@lru_cache(maxsize=256)
def _unpacker(layout: Layout) -> Callable[..., tuple[jax.Array, ...]]:
    def unpack(*arrays: Any) -> tuple[jax.Array, ...]:
        out = []
        for spec, array in zip(layout.slots, arrays):
            for d, block in enumerate(spec.blocks):
                if block is not None:
                    index = (d, *(slice(0, n) for n in block.shape))
                    out.append(array[index])
        return tuple(out)

    return jax.jit(unpack)


def sharded(
    op: LinearOperator,
    mesh: Mesh,
    *,
    axes: Sequence[str] | None = None,
    workers: Sequence[int] | Mapping[int, int] | None = None,
) -> ShardedOperator:
    """Compile ``op`` for ``mesh``; see :class:`ShardedOperator`.

    Compiled once per (tree, mesh, axes, workers): an equal tree built again (a step function
    that builds its operators on every call) gets the same :class:`ShardedOperator`, so its
    plan is not compiled again and XLA compiles nothing new.

    Raises
    ------
    OperandError
        If ``op`` is not a LinearOperator.
    MeshError
        If ``mesh`` is not a ``jax.sharding.Mesh``, or ``axes`` is not a sequence of distinct
        axis names of the mesh.
    WorkerError
        If ``workers`` is not a dict or list of non-negative integers, or a block lives on a
        worker that the map does not place on a device.
    DeviceKernelError
        If the tree holds a LocalOperator (a numpy kernel cannot run inside jit).
    """
    if not isinstance(op, LinearOperator):
        raise OperandError(f"sharded() compiles a LinearOperator, not {type(op).__name__} {op!r:.60}")
    if not isinstance(mesh, Mesh):
        raise MeshError(f"mesh must be a jax.sharding.Mesh, not {type(mesh).__name__} {mesh!r:.60}")
    return _sharded(op, mesh, _axes(axes, mesh), _placement(workers))


def _axes(axes: Any, mesh: Mesh) -> tuple[str, ...] | None:
    """``axes`` as a tuple of the mesh's axis names (None: all of them)."""
    if axes is None:
        return None
    if isinstance(axes, str) or not isinstance(axes, Sequence):
        raise MeshError(f"axes must be a sequence of mesh axis names, not {type(axes).__name__} {axes!r:.60}")
    for axis in axes:
        if not isinstance(axis, str) or axis not in mesh.shape:
            raise MeshError(f"mesh axis {axis!r:.40} is not an axis of the mesh {dict(mesh.shape)}")
    if not axes or len(set(axes)) != len(axes):
        raise MeshError(
            f"axes {list(axes)} must name distinct axes of the mesh {dict(mesh.shape)}, at least one"
        )
    return tuple(axes)


def _placement(workers: Any) -> tuple[tuple[int, int], ...] | None:
    """The worker map's items, sorted (a list is the map of its indices: either form, one
    entry of the cache)."""
    if workers is None:
        return None
    if isinstance(workers, Mapping):
        pairs = list(workers.items())
    elif isinstance(workers, Sequence) and not isinstance(workers, str | bytes):
        pairs = list(enumerate(workers))
    else:
        raise WorkerError(
            f"workers must map workers to device indices (a dict or a list), not {type(workers).__name__} "
            f"{workers!r:.60}"
        )
    for worker, device in pairs:
        for what, value in (("worker", worker), ("device index", device)):
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
                raise WorkerError(f"workers: {what} {value!r:.40} is not a non-negative integer")
    return tuple(sorted((int(w), int(d)) for w, d in pairs))


@lru_cache(maxsize=256)
def _sharded(
    op: LinearOperator,
    mesh: Mesh,
    axes: tuple[str, ...] | None,
    placement: tuple[tuple[int, int], ...] | None,
) -> ShardedOperator:
    """:func:`sharded` with hashable arguments (``placement``: the worker map's items, sorted)."""
    workers = None if placement is None else dict(placement)
    return ShardedOperator(op, mesh, axes=axes, workers=workers)


# -- global arrays of distributed tensors --------------------------------------------------
def _tensor_devices(
    tensor: DistributedTensor, mesh: Mesh, dims: Sequence[str | None], axes: tuple[str, ...]
) -> dict[int, int]:
    """Worker -> device for the tensor's blocks, block at grid index i on the device at mesh
    coordinate i[dim] along the axis ``dims[dim]`` (0 along the other axes)."""
    dims = tuple(dims)
    if len(dims) != tensor.ndim:
        raise MeshError(
            f"tensor {tensor.name!r} has {tensor.ndim} dimensions but the mesh mapping {dims} names {len(dims)}"
        )
    for dim, (axis, parts) in enumerate(zip(dims, tensor.partition.shape)):
        if axis is None:
            if parts != 1:
                raise MeshError(
                    f"tensor {tensor.name!r}: dimension {dim} is cut into {parts} parts but mapped to no mesh axis"
                )
        elif axis not in axes:
            raise MeshError(
                f"tensor {tensor.name!r}: dimension {dim} is mapped to {axis!r}, not a mesh axis {axes}"
            )
        elif mesh.shape[axis] != parts:
            raise MeshError(
                f"tensor {tensor.name!r}: dimension {dim} is cut into {parts} parts but mesh axis {axis!r} has "
                f"{mesh.shape[axis]} devices"
            )
    used = [a for a in dims if a is not None]
    if len(set(used)) != len(used):
        raise MeshError(f"tensor {tensor.name!r}: a mesh axis is mapped to two dimensions in {dims}")
    for axis in axes:
        if axis not in used and mesh.shape[axis] != 1:
            raise MeshError(
                f"tensor {tensor.name!r}: mesh axis {axis!r} ({mesh.shape[axis]} devices) holds no dimension of the "
                f"tensor (replicated tensors are not supported)"
            )
    found: dict[int, int] = {}
    for index in tensor.partition.indices():
        coordinate = {axis: index[dims.index(axis)] if axis in used else 0 for axis in axes}
        device = 0
        for axis in axes:
            device = device * mesh.shape[axis] + coordinate[axis]
        found[tensor.partition.worker(index)] = device
    return found


def tensor_function(
    op: LinearOperator,
    mesh: Mesh,
    source: DistributedTensor,
    target: DistributedTensor,
    source_axes: Sequence[str | None],
    target_axes: Sequence[str | None] | None = None,
) -> Callable[[Any], jax.Array]:
    """``op`` (from ``source``'s space to ``target``'s) as a function of a global array.

    ``source_axes[k]`` is the mesh axis that tensor dimension ``k`` is cut along (None: not
    cut); likewise ``target_axes`` (default ``source_axes``). The block at grid index ``i``
    runs on the device at mesh coordinate ``i[k]`` along ``source_axes[k]``. The function
    takes the global array (any sharding; for even shards sharded over the mesh the
    conversion to slots moves nothing) and returns the target's global array; it is
    differentiable by ``op.H`` like :class:`ShardedOperator`.

    Raises
    ------
    MeshError
        If a partition does not fit the mesh: a dimension cut into a number of parts other
        than its axis's devices, a cut dimension mapped to no axis, a mesh axis holding no
        dimension, or the two tensors placing one worker on two devices.
    SpaceMismatchError
        If ``op`` does not map the source's space to the target's.
    """
    axes = tuple(mesh.axis_names)
    target_axes = source_axes if target_axes is None else target_axes
    placed = _tensor_devices(source, mesh, source_axes, axes)
    for worker, device in _tensor_devices(target, mesh, target_axes, axes).items():
        if placed.setdefault(worker, device) != device:
            raise MeshError(
                f"worker {worker} holds a block of {source.name!r} on device {placed[worker]} and of "
                f"{target.name!r} on device {device}: the mesh mappings disagree"
            )
    op.domain.require_equal(
        source.space, f"tensor_function: the domain of {op} and the space of {source.name!r}"
    )
    op.range.require_equal(
        target.space, f"tensor_function: the range of {op} and the space of {target.name!r}"
    )
    function = sharded(op, mesh, axes=axes, workers=placed)

    to_slot = _even_reshape(source, source_axes, axes, function.domain)
    from_slot = _even_reshape(target, target_axes, axes, function.range)

    def apply(array: Any) -> jax.Array:
        array = jnp.asarray(array)
        if tuple(array.shape) != source.global_shape:
            raise StateError(
                f"tensor {source.name!r}: array of shape {tuple(array.shape)} does not match global shape "
                f"{source.global_shape}"
            )
        if to_slot is not None and from_slot is not None:  # even shards: reshapes, nothing moves
            (stacked,) = function.arrays(to_slot(array))
            return from_slot.inverse(stacked)
        state = {
            source.block_name(i): array[tuple(slice(a, b) for a, b in zip(*source.box(i)))]
            for i in source.partition.indices()
        }
        blocks = function.blocks(state)
        out = jnp.zeros(
            target.global_shape, dtype=next(iter(blocks.values())).dtype if blocks else array.dtype
        )
        for i in target.partition.indices():
            out = out.at[tuple(slice(a, b) for a, b in zip(*target.box(i)))].set(blocks[target.block_name(i)])
        return out

    apply.sharded = function  # type: ignore[attr-defined]
    apply.reshapes = to_slot is not None and from_slot is not None  # type: ignore[attr-defined]
    return apply


class _EvenReshape:
    """Global array <-> its one stacked slot, for a tensor cut evenly along mesh axes: the
    global array reshaped to (parts, block) per dimension, the parts moved to the front in
    mesh-axis order (the devices' linear order), then merged into the device axis."""

    def __init__(
        self, tensor: DistributedTensor, dims: tuple[str | None, ...], axes: tuple[str, ...]
    ) -> None:
        self.parts = tensor.partition.shape
        self.block = tuple(sizes[0] for sizes in tensor.sizes)
        order = [dims.index(a) for a in axes if a in dims]  # tensor dims in device order
        split = [n for pair in zip(self.parts, self.block) for n in pair]
        leading = [2 * k for k in order] + [2 * k for k in range(len(self.parts)) if k not in order]
        self.split = tuple(split)
        self.permutation = tuple(leading + [2 * k + 1 for k in range(len(self.parts))])
        self.global_shape = tensor.global_shape

    def __call__(self, array: jax.Array) -> jax.Array:
        moved = jnp.transpose(array.reshape(self.split), self.permutation)
        return moved.reshape(-1, *self.block)

    def inverse(self, stacked: jax.Array) -> jax.Array:
        ordered = [self.split[k] for k in self.permutation]
        back = tuple(int(k) for k in np.argsort(self.permutation))
        return jnp.transpose(stacked.reshape(ordered), back).reshape(self.global_shape)


def _even_reshape(
    tensor: DistributedTensor, dims: Sequence[str | None], axes: tuple[str, ...], layout: Layout
) -> _EvenReshape | None:
    """The reshape for an evenly cut tensor whose slot holds exactly its blocks, else None."""
    if any(len(set(sizes)) != 1 for sizes in tensor.sizes) or len(layout.slots) != 1:
        return None
    (slot,) = layout.slots
    if slot.padded or len(slot.blocks) != tensor.partition.size:
        return None
    reshape = _EvenReshape(tensor, tuple(dims), axes)
    expected = [tensor.block_name(index) for index in _device_ordered(tensor, tuple(dims), axes)]
    if [b.name if b is not None else None for b in slot.blocks] != expected:
        return None
    return reshape


def _device_ordered(tensor: DistributedTensor, dims: tuple[str | None, ...], axes: tuple[str, ...]) -> list:
    """The tensor's grid indices in the order of their devices (row-major over the mapped mesh axes)."""
    import itertools

    order = [dims.index(a) for a in axes if a in dims]
    ranges = [range(tensor.partition.shape[k]) for k in order]
    out = []
    for coordinate in itertools.product(*ranges):
        index = [0] * tensor.ndim
        for k, c in zip(order, coordinate):
            index[k] = c
        out.append(tuple(index))
    return out
