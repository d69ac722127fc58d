r"""The pieces the JAX layers (:mod:`linop.frameworks.jax_layers`) are built from.

A distributed layer on a mesh of JAX devices moves data with linop trees and computes with
``jax.lax`` on each device (``docs/theory.md#layers``):

.. math::

    \tilde x = W x, \qquad \tilde y_d = L(\tilde x_d, \tilde\theta_d) \;\text{on device } d,
    \qquad y = R\,\tilde y

- :class:`Tree`: a movement tree (a halo exchange, a broadcast, a sum-reduction, an
  all-reduce) lowered by :func:`~linop.frameworks.jax_sharded.sharded` into ``shard_map``
  collectives: a linear JAX primitive whose transpose is the lowering of the tree's adjoint
  (derived by linop's rules), so the backward of :math:`W` is :math:`W^{*}`.
- :func:`local_map`: the per-device compute :math:`L`, one SPMD ``shard_map`` over the stacked
  slots (each device's row its block, zero-padded to the slot's shape): every device runs the
  same ``jax.lax`` program on its row, and JAX differentiates it.
- :func:`split` and :func:`join`: a global array and the blocks of a
  :class:`~linop.DistributedTensor` (static slices and concatenations: the user's arrays are
  global, whatever their sharding).

Padding never reaches a result: the lowered trees mask it on entry and exit, and :func:`join`
reads each device's block from the leading corner of its row.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .extras import importing

with importing("jax", __name__):  # the jax extra: say so where it is missing
    import jax

import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from ..backends.jax.layout import Layout, space_layout
from ..errors import LayerError, MeshError
from ..operator import LinearOperator
from ..partition import DistributedTensor
from ..space import Block, Space
from .jax_sharded import ShardedOperator, sharded

__all__ = [
    "Tree",
    "block_mask",
    "fit",
    "join",
    "layout_of",
    "local_map",
    "mesh_axes",
    "mesh_devices",
    "placement",
    "require_global",
    "require_layer",
    "split",
]


def mesh_axes(mesh: Any) -> tuple[str, ...]:
    """The axis names of ``mesh`` (the devices linearized in their order), else a MeshError."""
    if not isinstance(mesh, Mesh):
        raise MeshError(f"mesh must be a jax.sharding.Mesh, not {type(mesh).__name__} {mesh!r:.60}")
    return tuple(mesh.axis_names)


def mesh_devices(mesh: Mesh) -> int:
    """The number of devices of ``mesh``."""
    return int(mesh.devices.size)


def placement(mesh: Any) -> tuple[tuple[str, ...], int]:
    """``(mesh_axes(mesh), mesh_devices(mesh))``: where a layer's workers run (worker w on
    device w, the devices counted over all axes in order)."""
    return mesh_axes(mesh), mesh_devices(mesh)


def require_layer(builder: str, layer: object, *kinds: type) -> None:
    """A LayerError unless ``layer`` is one of ``kinds`` (the layer descriptions the JAX
    ``builder`` takes), naming them and what was given."""
    if not isinstance(layer, kinds):
        wanted = " or ".join(k.__name__ for k in kinds)
        raise LayerError(f"{builder}() takes a linop.layers.{wanted}, not {type(layer).__name__}")


def require_global(layer: str, what: str, array: Any, shape: Sequence[int]) -> jax.Array:
    """``array`` as a JAX array of the global ``shape``, else a LayerError naming it."""
    array = jnp.asarray(array)
    if tuple(array.shape) != tuple(shape):
        raise LayerError(f"{layer}: {what} has shape {tuple(array.shape)}, expected {tuple(shape)}")
    if array.dtype.kind not in "iufc":
        raise LayerError(f"{layer}: {what} has dtype {array.dtype}, not a numeric dtype")
    return array


def split(tensor: DistributedTensor, array: jax.Array) -> dict[str, jax.Array]:
    """The blocks of ``tensor`` cut from its global ``array`` (static slices)."""
    return {
        tensor.block_name(i): array[tuple(slice(a, b) for a, b in zip(*tensor.box(i)))]
        for i in tensor.partition.indices()
    }


def join(tensor: DistributedTensor, blocks: Mapping[str, jax.Array]) -> jax.Array:
    """The global array of ``tensor`` from its blocks (concatenations along the grid; the
    transpose of :func:`split`)."""
    parts = tensor.partition.shape

    def build(prefix: tuple[int, ...]) -> jax.Array:
        dim = len(prefix)
        if dim == len(parts):
            return blocks[tensor.block_name(prefix)]
        pieces = [build((*prefix, k)) for k in range(parts[dim])]
        return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=dim)

    return build(())


def fit(array: jax.Array, shape: Sequence[int], lead: int = 1) -> jax.Array:
    """``array`` cut or zero-padded at the end of each axis after the first ``lead`` to ``shape``."""
    cut = tuple(slice(None) for _ in range(lead)) + tuple(slice(0, n) for n in shape)
    array = array[cut]
    pads = [(0, 0)] * lead + [(0, n - m) for n, m in zip(shape, array.shape[lead:])]
    return jnp.pad(array, pads) if any(p for _, p in pads) else array


def block_mask(extents: jax.Array, shape: Sequence[int]) -> jax.Array:
    """Inside :func:`local_map`: the entries of a device's slot row of ``shape`` that are its
    block's (``extents``: the block's shape, a row of :meth:`SlotSpec.extents`), the rest
    padding."""
    shape = tuple(shape)
    mask = jnp.ones(shape, dtype=bool)
    for axis in range(len(shape)):
        mask = mask & (lax.broadcasted_iota(jnp.int32, shape, axis) < extents[axis])
    return mask


class Tree:
    """A movement tree lowered onto ``mesh`` (worker w on device w), called on blocks or slots.

    Parameters
    ----------
    op : LinearOperator
        The tree (exact 0/1 data movement, or sums of it).
    mesh : jax.sharding.Mesh
    axes : tuple of str
        The mesh axes the devices are counted over (all of them, in order).
    """

    def __init__(self, op: LinearOperator, mesh: Mesh, axes: tuple[str, ...]) -> None:
        self.op = op
        self.function: ShardedOperator = sharded(op, mesh, axes=axes)
        self._apply = _with_adjoint(self.function)

    @property
    def domain(self) -> Layout:
        return self.function.domain

    @property
    def range(self) -> Layout:
        return self.function.range

    def slots(self, blocks: Mapping[str, Any]) -> dict[str, jax.Array]:
        """The tree on a state of blocks -> the range's stacked slots."""
        return self(self.function.pack(blocks))

    def __call__(self, slots: Mapping[str, Any]) -> dict[str, jax.Array]:
        """The tree on stacked slots -> the range's stacked slots."""
        names = self.function.domain.names
        missing = [n for n in names if n not in slots]
        if missing:
            raise LayerError(f"slots for {self.op}: missing slot(s) {missing}")
        common = jnp.result_type(*(slots[n] for n in names))
        out = self._apply(*(jnp.asarray(slots[n], common) for n in names))
        return dict(zip(self.function.range.names, out))

    def blocks(self, slots: Mapping[str, Any], layout: Layout | None = None) -> dict[str, jax.Array]:
        """Stacked slots of ``layout`` (default the range's) -> blocks by name."""
        return self.function.unpack(slots, layout)


def _with_adjoint(function: ShardedOperator) -> Callable[..., tuple[jax.Array, ...]]:
    r"""``function`` on stacked slots (positionally) with its vector-Jacobian product the lowering
    of the adjoint tree, :math:`\bar x = A^{*} \bar y` (``function.H``; the movement trees are
    real, so :math:`A^{T} = A^{*}`), given explicitly by ``custom_vjp``: whichever of the
    inputs are differentiated, the backward is one call of the adjoint's lowering."""
    adjoint = function.H

    @jax.custom_vjp
    def apply(*arrays: jax.Array) -> tuple[jax.Array, ...]:
        return function.arrays(*arrays)

    def forward(*arrays: jax.Array) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
        return apply(*arrays), tuple(jnp.zeros((0,), a.dtype) for a in arrays)

    def backward(dtypes: tuple[jax.Array, ...], cotangents: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        back = adjoint(dict(zip(function.range.names, cotangents)))
        return tuple(back[n].astype(d.dtype) for n, d in zip(function.domain.names, dtypes))

    apply.defvjp(forward, backward)
    return apply


def layout_of(blocks: Sequence[Block], devices: int) -> Layout:
    """The stacked slots of ``blocks``, worker w on device w."""
    return space_layout(Space(blocks), tuple(range(devices)), devices)


def local_map(
    function: Callable[..., jax.Array | tuple[jax.Array, ...]],
    mesh: Mesh,
    axes: tuple[str, ...],
    stacked: int,
    replicated: int = 0,
    outputs: int = 1,
) -> Callable[..., Any]:
    """``function`` run on every device: its first ``stacked`` arguments are arrays stacked over
    the devices (leading axis sharded over ``axes``; the function sees its row, leading axis 1),
    the next ``replicated`` the same on every device; it returns ``outputs`` stacked arrays
    (one array when ``outputs`` is 1). Inside ``shard_map``, the same program on every device;
    the transpose of a replicated argument is JAX's sum over the devices."""
    spec = PartitionSpec(axes[0] if len(axes) == 1 else axes)
    out_specs: Any = spec if outputs == 1 else (spec,) * outputs
    return jax.shard_map(
        function,
        mesh=mesh,
        in_specs=(spec,) * stacked + (PartitionSpec(),) * replicated,
        out_specs=out_specs,
        check_vma=False,
    )
