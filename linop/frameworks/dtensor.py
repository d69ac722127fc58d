"""PyTorch's DTensor and linop: device meshes and placements as linop layouts, and an exact,
differentiable redistribute between any two of them on a torch.distributed process group.

The layout maths is :mod:`linop.mesh_layout` (no torch needed: test it in one process); the
tree is :class:`linop.redistribute.Redistribute`; this module connects them to torch:

- :func:`mesh_layout`: a ``DeviceMesh`` (or a mesh shape) + placements (torch's or ours) + a
  global shape (+ explicit uneven sizes) -> :class:`~linop.mesh_layout.MeshLayout`, whose
  workers are the mesh's ranks; :func:`torch_placements` goes back.
- :func:`from_dtensor` / :func:`to_dtensor`: a DTensor <-> (this rank's local tensor, its
  layout), through DTensor's own differentiable ``to_local`` / ``from_local``.
- :func:`redistribute_local` (local tensors) and :func:`redistribute` (DTensors): the tree
  run by :mod:`linop.backends.torch_distributed` through
  :func:`linop.frameworks.torch_function.function` (``group=``), so the backward is the
  adjoint tree ``Redistribute(B^dagger, A^dagger)``, derived by rules and exact.

DTensor computes shard boxes with ``torch.chunk`` sizes only; a DTensor built with
``from_local`` on other uneven sizes (rows 10/30/7/30) silently gets wrong results from its own
redistribute and ``full_tensor()`` (public thread pytorch#144109). This module therefore never
returns such a DTensor: :func:`to_dtensor` and :func:`redistribute` raise
:class:`UnevenShardError` for a layout whose pieces are not ``torch.chunk``'s, and such tensors
stay local, as (local tensor, layout) or :class:`LocalShard`: :func:`redistribute_local` moves
them exactly (the tree intersects the real boxes), :func:`from_dtensor` reads a DTensor made on
such sizes when they are passed as ``sizes=``.

Replicate <-> Partial: linop's ``Replicate -> Partial`` keeps the value on partial term 0 and
zeros elsewhere (exact in integers) where DTensor divides by the mesh extent; both stand for the
same global array.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

try:
    import torch
except ModuleNotFoundError as error:  # the torch extra is not installed: say which
    from .extras import missing_extra

    raise missing_extra(error, "torch", __name__) from error

from ..errors import PlacementError
from ..mesh_layout import MeshLayout, Partial, Replicate, Shard, as_placement
from ..redistribute import Redistribute
from .torch_function import TorchOperator, function

__all__ = [
    "LocalShard",
    "UnevenShardError",
    "chunk_layout",
    "from_dtensor",
    "mesh_layout",
    "redistribute",
    "redistribute_local",
    "redistribute_operator",
    "to_dtensor",
    "torch_placements",
]

SizesLike = Mapping[int, Sequence[int]] | Sequence[Sequence[int] | None] | None


class UnevenShardError(PlacementError):
    """A DTensor was asked for on a layout whose pieces are not ``torch.chunk``'s: DTensor
    would misread it (its ``full_tensor()``, ``redistribute`` and operators assume chunk
    sizes). The message says how to keep the tensor local."""


@dataclass(frozen=True, slots=True)
class LocalShard:
    """This rank's local tensor and the layout it belongs to: what stays of a tensor whose
    pieces are not ``torch.chunk``'s, where a DTensor would be misread.

    Attributes
    ----------
    local : torch.Tensor
        This rank's piece (its shape is the one ``layout`` gives this rank).
    layout : MeshLayout
        The global shape, the placements and the real piece sizes.
    """

    local: torch.Tensor
    layout: MeshLayout

    def redistribute(
        self, destination: MeshLayout | Sequence[Any], *, group: Any = None
    ) -> torch.Tensor | LocalShard:
        """:func:`redistribute_local` of this piece; a :class:`LocalShard` when ``destination``
        is a layout, else (placements, ``torch.chunk`` sizes) the local tensor."""
        result = redistribute_local(self.local, self.layout, destination, group=group)
        return LocalShard(result, destination) if isinstance(destination, MeshLayout) else result


def chunk_layout(layout: MeshLayout) -> bool:
    """Whether every piece of ``layout`` has ``torch.chunk``'s size (nested on a dimension that
    several mesh dimensions shard), the only sizes a DTensor reads correctly."""
    return layout.sizes == layout.with_placements(layout.placements).sizes


def _refuse_uneven(layout: MeshLayout, doing: str) -> None:
    if not chunk_layout(layout):
        chunks = layout.with_placements(layout.placements).sizes
        wrong = next(d for d, (a, b) in enumerate(zip(layout.sizes, chunks)) if a != b)
        raise UnevenShardError(
            f"{doing}: layout {layout.name!r} cuts tensor dimension {wrong} into pieces {layout.sizes[wrong]}, "
            f"not torch.chunk's {chunks[wrong]}; a DTensor on it would be misread (full_tensor(), its "
            "redistribute and operators assume torch.chunk sizes). Keep it local: redistribute_local(local, "
            "source, destination) or LocalShard(local, layout).redistribute(destination) take and give "
            "local tensors, or choose a destination with torch.chunk sizes (sizes=None)"
        )


def mesh_layout(
    mesh: Any,
    placements: Sequence[Any],
    global_shape: Sequence[int],
    sizes: SizesLike = None,
    *,
    name: str = "x",
) -> MeshLayout:
    """The layout of a global shape on ``mesh`` with ``placements``.

    Parameters
    ----------
    mesh : DeviceMesh or sequence of int
        A torch ``DeviceMesh`` (its shape and its ranks, ``mesh.mesh.flatten()``, become the
        layout's mesh and workers) or a plain mesh shape (workers ``0 .. size - 1``).
    placements : sequence
        torch's ``Shard(d)``, ``Replicate()``, ``Partial()`` or :mod:`linop.mesh_layout`'s.
    global_shape : sequence of int
    sizes : mapping or sequence, optional
        Explicit uneven piece sizes per sharded tensor dimension (default ``torch.chunk``'s).

    Raises
    ------
    PlacementError
        When mesh, placements, shape and sizes do not fit (naming the mesh or tensor dimension).
    """
    if hasattr(mesh, "mesh") and hasattr(mesh, "shape"):
        ranks = tuple(int(r) for r in mesh.mesh.flatten().tolist())
        shape = tuple(int(n) for n in mesh.mesh.shape)
    else:
        ranks, shape = (), tuple(mesh)
    return MeshLayout.from_placements(shape, placements, tuple(global_shape), sizes, ranks=ranks, name=name)


def torch_placements(layout: MeshLayout) -> tuple[Any, ...]:
    """The layout's placements as torch's (``Shard``, ``Replicate``, ``Partial``)."""
    from torch.distributed.tensor import Partial as TorchPartial
    from torch.distributed.tensor import Replicate as TorchReplicate
    from torch.distributed.tensor import Shard as TorchShard

    result: list[Any] = []
    for placement in layout.placements:
        if isinstance(placement, Shard):
            result.append(TorchShard(placement.dim))
        elif isinstance(placement, Replicate):
            result.append(TorchReplicate())
        else:
            assert isinstance(placement, Partial)
            result.append(TorchPartial())
    return tuple(result)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _check_local(local: torch.Tensor, layout: MeshLayout, rank: int) -> None:
    if rank not in layout.partition:
        raise PlacementError(f"layout {layout.name!r}: rank {rank} is not in the mesh {list(layout.ranks)}")
    if not hasattr(local, "shape"):  # junk: refused as a wrong shape is, through the group's check
        raise PlacementError(
            f"layout {layout.name!r}: rank {rank} holds {type(local).__name__} {local!r:.40} as its local "
            "tensor, not a torch.Tensor"
        )
    expected = layout.block_of(rank).shape
    if tuple(local.shape) != expected:
        wrong = [d for d, (a, b) in enumerate(zip(local.shape, expected)) if a != b]
        where = f"tensor dimension {wrong[0]}" if wrong else f"rank {len(local.shape)} versus {len(expected)}"
        raise PlacementError(
            f"layout {layout.name!r}: rank {rank} holds a local tensor of shape {tuple(local.shape)}, the layout "
            f"gives it {expected} ({where}; pass sizes= for uneven shards that are not torch.chunk's)"
        )


def from_dtensor(x: Any, sizes: SizesLike = None, *, name: str = "x") -> tuple[torch.Tensor, MeshLayout]:
    """This rank's local tensor of DTensor ``x`` (``x.to_local()``, differentiable) and its
    layout (``sizes``: the uneven piece sizes it was built with, default ``torch.chunk``'s).

    Raises
    ------
    PlacementError
        When the local tensor's shape is not the one the layout gives this rank (naming the
        tensor dimension): a DTensor built by ``from_local`` on other sizes needs ``sizes=``.
    """
    layout = mesh_layout(x.device_mesh, x.placements, tuple(x.shape), sizes, name=name)
    local = x.to_local()
    _check_local(local, layout, _rank())
    return local, layout


def to_dtensor(local: torch.Tensor, layout: MeshLayout, mesh: Any) -> Any:
    """A DTensor from this rank's local tensor in ``layout`` on ``mesh`` (``DTensor.from_local``
    with the global shape given; differentiable). Only for layouts with ``torch.chunk`` sizes
    (:func:`chunk_layout`): the only DTensors torch reads correctly.

    Raises
    ------
    UnevenShardError
        When ``layout``'s pieces are not ``torch.chunk``'s (keep the tensor local: the message
        says how).
    PlacementError
        When ``local`` does not have the shape ``layout`` gives this rank.
    """
    from torch.distributed.tensor import DTensor

    _refuse_uneven(layout, "to_dtensor")
    _check_local(local, layout, _rank())
    shape = layout.global_shape
    stride = tuple(int(torch.tensor(shape[d + 1 :]).prod()) for d in range(len(shape)))
    return DTensor.from_local(
        local, mesh, torch_placements(layout), run_check=False, shape=torch.Size(shape), stride=stride
    )


def redistribute_operator(source: MeshLayout, destination: MeshLayout) -> Redistribute:
    """The tree: :class:`~linop.redistribute.Redistribute` (exact for every layout)."""
    return Redistribute(source, destination)


_FUNCTIONS: OrderedDict[tuple[Any, ...], TorchOperator] = OrderedDict()
_FUNCTIONS_KEPT = 64


def _function(tree: Redistribute, group: Any) -> TorchOperator:
    """The differentiable wrapper of ``tree`` on ``group``, built (and its plans bound) once."""
    key = (tree, id(group) if group is not None else None)
    found = _FUNCTIONS.get(key)
    if found is None:
        found = function(tree, group=True if group is None else group)
        _FUNCTIONS[key] = found
        if len(_FUNCTIONS) > _FUNCTIONS_KEPT:
            _FUNCTIONS.popitem(last=False)
    else:
        _FUNCTIONS.move_to_end(key)
    return found


def redistribute_local(
    local: torch.Tensor, source: MeshLayout, destination: MeshLayout | Sequence[Any], *, group: Any = None
) -> torch.Tensor:
    """This rank's local tensor in layout ``destination`` (a layout, or placements on the
    source's mesh with torch.chunk sizes) from its local tensor in ``source``; collective over
    ``group`` (default the world group), whose rank ``w`` runs the layout's worker ``w`` (a
    DeviceMesh's ranks are global ranks: pass a group whose ranks are the global ones, such as
    the world group, or layouts with ``ranks=`` renumbered). Differentiable: the backward runs
    the adjoint tree. The wrapper is built (and its plans bound) once per tree and group.

    Any piece sizes work here (the result is a local tensor, never a DTensor that torch could
    misread: see :class:`UnevenShardError`).

    Raises
    ------
    ProcessGroupError
        This rank is not a member of ``group``, or ``group`` has fewer ranks than the layouts'
        workers (on every rank, as :func:`linop.backends.torch_distributed.apply` raises it).
    PlacementError
        When ``local`` does not have the shape ``source`` gives this rank, or the layouts do not
        fit (different meshes, placements that do not match the mesh).
    """
    if not isinstance(destination, MeshLayout):
        destination = source.with_placements(destination, name=f"{source.name}_out")
    tree = redistribute_operator(source, destination)
    wrapped = _function(tree, group)  # the group's checks first: membership, argument
    rank = _rank()
    try:
        _check_local(local, source, rank)
    except PlacementError as error:  # through the group's check, else reported: no peer waits blind
        wrapped.refuse(error, {source.block_of(rank).name: local} if rank in source.partition else {})
    result = wrapped({source.block_of(rank).name: local})
    return result[destination.block_of(rank).name]


def redistribute(
    x: Any,
    placements: Sequence[Any],
    sizes: SizesLike = None,
    *,
    source_sizes: SizesLike = None,
    group: Any = None,
) -> Any:
    """DTensor ``x`` redistributed to ``placements`` by linop's tree (exact, differentiable):
    a DTensor on the same mesh. ``source_sizes``: the piece sizes ``x`` was built with, when
    they are not ``torch.chunk``'s (a DTensor made by ``from_local``); ``sizes``: the result's,
    which must be ``torch.chunk``'s for a DTensor (None, the default, gives them).

    Raises
    ------
    UnevenShardError
        When ``sizes`` are not ``torch.chunk``'s (checked before any data moves): for such a
        result keep it local, ``local, layout = from_dtensor(x)`` then
        ``redistribute_local(local, layout, destination_layout)``.
    PlacementError
        As :func:`from_dtensor` and :func:`mesh_layout`.
    """
    local, source = from_dtensor(x, source_sizes, name="x")
    destination = mesh_layout(
        x.device_mesh,
        [as_placement(p, i) for i, p in enumerate(placements)],
        source.global_shape,
        sizes,
        name="y",
    )
    _refuse_uneven(destination, "redistribute")
    return to_dtensor(redistribute_local(local, source, destination, group=group), destination, x.device_mesh)
