r"""Device-mesh layouts: a mesh of workers, one placement per mesh dimension and a global shape,
as a linop layout (the data model of PyTorch's DTensor, without torch).

A mesh of shape :math:`(m_0, \dots, m_{k-1})` holds one block per mesh coordinate :math:`c`
(its worker ``ranks[c]``). Each mesh dimension :math:`i` has a placement:

- ``Shard(d)``: tensor dimension :math:`d` is cut along mesh dimension :math:`i`. Several mesh
  dimensions may cut one tensor dimension; they nest in mesh order (the first cuts the global
  extent, the next cuts each of those pieces), so the pieces of dimension :math:`d` are
  numbered in C order of the coordinates of the mesh dimensions that cut it. By default each
  cut follows ``torch.chunk`` (:func:`chunk_sizes`: pieces of ``ceil(n / m)``, the last ones
  shorter or empty: 77 over 4 is 20/20/20/17); ``sizes`` gives any other piece sizes.
- ``Replicate()``: every coordinate along :math:`i` holds a copy of the same values.
- ``Partial()``: the global value is the sum over the coordinates along :math:`i` of the
  blocks' values (partial sums).

So block :math:`c` covers the global box :math:`\mathrm{box}(c)` given by its coordinates on
the ``Shard`` dimensions, and the global array it stands for is

.. math::

    X\big|_{\mathrm{box}(s)} = \sum_{p} x_{(s, r, p)} \quad \text{for any replica } r,

with :math:`s, r, p` the coordinates on the ``Shard``, ``Replicate`` and ``Partial`` mesh
dimensions. A :class:`MeshLayout` is a :class:`~linop.layout.Layout` (one block per worker of
its :attr:`~MeshLayout.partition`), so collectives accept it, and :class:`~linop.redistribute.Redistribute`
moves data between two of them exactly.
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from .errors import PlacementError, StateError
from .layout import BlockGrid
from .partition import DistributedTensor, Partition
from .space import Block, Space, State, strict_ints

__all__ = [
    "MeshLayout",
    "Partial",
    "Placement",
    "Replicate",
    "Shard",
    "as_placement",
    "chunk_sizes",
]


@dataclass(frozen=True)
class Shard:
    """Cut tensor dimension ``dim`` along a mesh dimension."""

    dim: int

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True)
class Replicate:
    """Copies of the same values along a mesh dimension."""

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Partial:
    """Partial sums along a mesh dimension: the global value is their sum (only ``"sum"``:
    the other reductions of DTensor are not linear)."""

    def __str__(self) -> str:
        return "P"


Placement = Shard | Replicate | Partial


def as_placement(value: Any, mesh_dim: int = 0) -> Placement:
    """A placement of this module from ours or from torch's (``torch.distributed.tensor``
    ``Shard``, ``Replicate``, ``Partial("sum")``), read by class name and fields so that torch
    need not be imported.

    Raises
    ------
    PlacementError
        For anything else (naming ``mesh_dim``): ``_StridedShard``, a ``Partial`` reducing by
        something other than a sum, a string.
    """
    if isinstance(value, (Shard, Replicate, Partial)):
        return value
    kind = type(value).__name__
    if kind == "Shard" and hasattr(value, "dim"):
        return Shard(operator.index(value.dim))
    if kind == "Replicate":
        return Replicate()
    if kind in ("Partial", "_Partial") and getattr(value, "reduce_op", "sum") == "sum":
        return Partial()
    raise PlacementError(
        f"mesh dimension {mesh_dim}: placement {value!r} is not Shard(d), Replicate() or Partial('sum')"
    )


def chunk_sizes(length: int, parts: int) -> tuple[int, ...]:
    """The sizes ``torch.chunk`` gives (pieces of ``ceil(length / parts)``, the last shorter),
    padded with empty pieces to ``parts``: what DTensor's ``Shard`` holds.

    >>> chunk_sizes(77, 4), chunk_sizes(5, 4), chunk_sizes(6, 4)
    ((20, 20, 20, 17), (2, 2, 1, 0), (2, 2, 2, 0))
    """
    if length < 0 or parts < 1:
        raise PlacementError(f"cannot cut length {length} into {parts} pieces")
    full = -(-length // parts)
    return tuple(max(0, min(length, full * (k + 1)) - full * k) for k in range(parts))


def _as_tuple(values: Any) -> Any:
    """``values`` as a tuple when it is a list or tuple, else unchanged (for the layout's own
    checks to name: a number or None where a sequence belongs is a PlacementError)."""
    return tuple(values) if isinstance(values, list | tuple) else values


def _ints(values: Any, what: str) -> tuple[int, ...]:
    try:
        if isinstance(values, str | bytes | bytearray):
            raise TypeError  # b"\x04" is a sequence of integers, not a shape
        return strict_ints(values)
    except TypeError:
        raise PlacementError(f"{what} {values!r} must be a sequence of integers") from None


@dataclass(frozen=True, eq=True)
class MeshLayout:
    """A global array on a device mesh: one block per mesh coordinate, placed as DTensor places
    a tensor (see the module docstring).

    Parameters
    ----------
    name : str
        Prefix of the block names: block ``name[c0,c1]`` is the local tensor at mesh
        coordinate ``(c0, c1)``.
    mesh_shape : tuple of int
    placements : sequence of placements
        One per mesh dimension: :class:`Shard`, :class:`Replicate`, :class:`Partial` (or
        torch's, converted by :func:`as_placement`).
    global_shape : tuple of int
    sizes : mapping or sequence, optional
        Explicit piece sizes of sharded tensor dimensions: ``{d: (10, 30, 7, 30)}`` or one entry
        per tensor dimension (``None`` for the default). A dimension cut by mesh dimensions
        ``i < j`` has ``m_i * m_j`` pieces, in C order of ``(c_i, c_j)``. Default
        :func:`chunk_sizes`, nested.
    ranks : sequence of int, optional
        The worker of each mesh coordinate in C order (a DeviceMesh's ``mesh.flatten()``);
        default ``0 .. prod(mesh_shape) - 1``.

    Raises
    ------
    PlacementError
        When the placements do not match the mesh (their count), a ``Shard`` names a tensor
        dimension the shape lacks, or sizes are given for a dimension no mesh dimension cuts,
        have the wrong count, a negative entry or the wrong sum; the message names the mesh or
        tensor dimension.
    PartitionError
        When the ranks do not fit the mesh shape.

    Examples
    --------
    >>> from linop.mesh_layout import MeshLayout, Replicate, Shard
    >>> rows = MeshLayout("x", (4,), [Shard(0)], (77, 5))
    >>> [rows.block((c,)).shape for c in range(4)]
    [(20, 5), (20, 5), (20, 5), (17, 5)]
    >>> grid = MeshLayout("y", (2, 2), [Shard(0), Replicate()], (6, 4), sizes={0: (1, 5)})
    >>> grid.box((1, 0)), grid.box((1, 1))
    (((1, 0), (6, 4)), ((1, 0), (6, 4)))
    """

    name: str
    mesh_shape: tuple[int, ...]
    placements: tuple[Placement, ...]
    global_shape: tuple[int, ...]
    sizes: Any = ()  # given as a mapping or per dimension; stored as a tuple per dimension
    ranks: tuple[int, ...] = ()
    _cuts: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)
    _offsets: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)
    _partition: Partition = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise PlacementError(f"a mesh layout's name must be a non-empty string, not {self.name!r}")
        mesh = _ints(self.mesh_shape, f"layout {self.name!r}: mesh shape")
        if any(m < 1 for m in mesh):
            raise PlacementError(f"layout {self.name!r}: mesh shape {mesh} has an extent below 1")
        shape = _ints(self.global_shape, f"layout {self.name!r}: global shape")
        if any(n < 0 for n in shape):
            raise PlacementError(f"layout {self.name!r}: negative extent in global shape {shape}")
        if isinstance(self.placements, (str, bytes)) or not isinstance(self.placements, Sequence):
            raise PlacementError(
                f"layout {self.name!r}: placements must be a sequence, one per mesh dimension, not {self.placements!r}"
            )
        if not isinstance(self.sizes, Mapping) and (
            isinstance(self.sizes, (str, bytes)) or not isinstance(self.sizes, Sequence)
        ):
            raise PlacementError(
                f"layout {self.name!r}: sizes must be a mapping or a sequence (one entry per tensor "
                f"dimension), not {type(self.sizes).__name__} {self.sizes!r:.60}"
            )
        if len(self.placements) != len(mesh):
            raise PlacementError(
                f"layout {self.name!r}: {len(self.placements)} placements for the {len(mesh)} dimensions "
                f"of mesh {mesh}"
            )
        placements = []
        for i, value in enumerate(self.placements):
            placement = as_placement(value, i)
            if isinstance(placement, Shard):
                d = placement.dim
                if not -len(shape) <= d < len(shape):
                    raise PlacementError(
                        f"layout {self.name!r}: mesh dimension {i} is Shard({d}) but the tensor of shape "
                        f"{shape} has {len(shape)} dimension(s)"
                    )
                placement = Shard(d % len(shape))
            placements.append(placement)
        cuts = tuple(
            tuple(i for i, p in enumerate(placements) if isinstance(p, Shard) and p.dim == d)
            for d in range(len(shape))
        )
        pieces = tuple(
            self._piece_sizes(d, shape[d], tuple(mesh[i] for i in cuts[d])) for d in range(len(shape))
        )
        object.__setattr__(self, "mesh_shape", mesh)
        object.__setattr__(self, "global_shape", shape)
        object.__setattr__(self, "placements", tuple(placements))
        object.__setattr__(self, "sizes", pieces)
        object.__setattr__(self, "_cuts", cuts)
        object.__setattr__(self, "_offsets", tuple(tuple(int(o) for o in np.cumsum((0, *p))) for p in pieces))
        given = () if isinstance(self.ranks, tuple) and not self.ranks else self.ranks  # () is the default
        partition = Partition(mesh, _ints(given, f"layout {self.name!r}: ranks") if given != () else ())
        object.__setattr__(self, "ranks", partition.workers)
        object.__setattr__(self, "_partition", partition)

    def _piece_sizes(self, d: int, length: int, extents: tuple[int, ...]) -> tuple[int, ...]:
        """The piece sizes of tensor dimension ``d`` (cut by mesh extents ``extents``)."""
        given: Any = None
        if isinstance(self.sizes, Mapping):
            for key in self.sizes:
                if not isinstance(key, int) or not -len(self.global_shape) <= key < len(self.global_shape):
                    raise PlacementError(
                        f"layout {self.name!r}: sizes given for tensor dimension {key!r}, the tensor has "
                        f"{len(self.global_shape)}"
                    )
            given = self.sizes.get(d, self.sizes.get(d - len(self.global_shape)))
        elif len(self.sizes):
            if len(self.sizes) != len(self.global_shape):
                raise PlacementError(
                    f"layout {self.name!r}: sizes given for {len(self.sizes)} tensor dimensions, the tensor "
                    f"has {len(self.global_shape)}"
                )
            given = self.sizes[d]
        count = math.prod(extents)
        sizes: tuple[int, ...]
        if given is None:
            sizes = (length,)
            for m in extents:
                sizes = tuple(s for size in sizes for s in chunk_sizes(size, m))
            return sizes
        sizes = _ints(given, f"layout {self.name!r}: tensor dimension {d} sizes")
        if not extents and sizes != (length,):
            raise PlacementError(
                f"layout {self.name!r}: sizes {sizes} given for tensor dimension {d}, which no mesh "
                "dimension shards"
            )
        if len(sizes) != count:
            raise PlacementError(
                f"layout {self.name!r}: tensor dimension {d} is cut into {count} pieces by mesh extents "
                f"{extents}, but {len(sizes)} sizes are given"
            )
        if any(s < 0 for s in sizes):
            raise PlacementError(f"layout {self.name!r}: tensor dimension {d} has a negative size in {sizes}")
        if sum(sizes) != length:
            raise PlacementError(
                f"layout {self.name!r}: tensor dimension {d} sizes {sizes} add up to {sum(sizes)}, not the "
                f"global extent {length}"
            )
        return sizes

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def from_placements(
        cls,
        mesh_shape: Sequence[int],
        placements: Sequence[Any],
        global_shape: Sequence[int],
        sizes: Mapping[int, Sequence[int]] | Sequence[Sequence[int] | None] | None = None,
        *,
        ranks: Sequence[int] = (),
        name: str = "x",
    ) -> MeshLayout:
        """The layout of a mesh shape, placements and a global shape, as plain data."""
        return cls(
            name,
            _as_tuple(mesh_shape),
            _as_tuple(placements),
            _as_tuple(global_shape),
            () if sizes is None else sizes,
            _as_tuple(ranks),
        )

    @classmethod
    def from_distributed_tensor(cls, tensor: DistributedTensor, name: str | None = None) -> MeshLayout:
        """The layout of a linop :class:`~linop.partition.DistributedTensor`: a mesh of the
        partition's shape, ``Shard(d)`` on mesh dimension ``d`` where the partition cuts
        (``Replicate()`` where its extent is 1), the tensor's sizes and workers."""
        placements = tuple(Shard(d) if n > 1 else Replicate() for d, n in enumerate(tensor.partition.shape))
        sizes = tuple(s if n > 1 else None for s, n in zip(tensor.sizes, tensor.partition.shape))
        return cls(
            tensor.name if name is None else name,
            tensor.partition.shape,
            placements,
            tensor.global_shape,
            sizes,
            tuple(tensor.partition.workers),
        )

    def with_placements(
        self,
        placements: Sequence[Any],
        sizes: Mapping[int, Sequence[int]] | Sequence[Sequence[int] | None] | None = None,
        *,
        name: str | None = None,
    ) -> MeshLayout:
        """The same array on the same mesh with other placements (and sizes)."""
        return MeshLayout(
            self.name if name is None else name,
            self.mesh_shape,
            tuple(placements),
            self.global_shape,
            sizes or (),
            self.ranks,
        )

    def dual(self) -> MeshLayout:
        """The layout of the gradients: ``Replicate`` and ``Partial`` swapped (the adjoint of
        copying is summing), the same blocks."""
        swapped = tuple(
            Partial() if isinstance(p, Replicate) else Replicate() if isinstance(p, Partial) else p
            for p in self.placements
        )
        return MeshLayout(self.name, self.mesh_shape, swapped, self.global_shape, self.sizes, self.ranks)

    # -- geometry -----------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        """Number of tensor dimensions."""
        return len(self.global_shape)

    @property
    def partition(self) -> Partition:
        """The mesh as a partition of workers (C order of mesh coordinates)."""
        return self._partition

    def shard_mesh_dims(self, d: int) -> tuple[int, ...]:
        """The mesh dimensions that cut tensor dimension ``d``, in nesting order."""
        return self._cuts[d]

    def kinds(self) -> tuple[type, ...]:
        """The placement class of every mesh dimension."""
        return tuple(type(p) for p in self.placements)

    def piece(self, d: int, coordinate: Sequence[int]) -> int:
        """The index of the piece of tensor dimension ``d`` that mesh coordinate ``coordinate``
        holds (mixed radix over the mesh dimensions that cut it)."""
        k = 0
        for i in self._cuts[d]:
            k = k * self.mesh_shape[i] + coordinate[i]
        return k

    def piece_coordinates(self, d: int, piece: int) -> tuple[int, ...]:
        """The coordinates, on the mesh dimensions cutting ``d``, of piece ``piece``."""
        cuts = self._cuts[d]
        return (
            tuple(int(c) for c in np.unravel_index(piece, [self.mesh_shape[i] for i in cuts])) if cuts else ()
        )

    def pieces_overlapping(self, d: int, lo: int, hi: int) -> range:
        """The pieces of tensor dimension ``d`` that hold some of ``[lo, hi)`` (empty pieces
        excluded at the ends)."""
        offsets = self._offsets[d]
        if lo >= hi:
            return range(0)
        first = bisect.bisect_right(offsets, lo) - 1
        last = bisect.bisect_left(offsets, hi)
        return range(max(first, 0), min(last, len(offsets) - 1))

    def box(self, coordinate: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The global box (start, stop) held by the block at a mesh coordinate."""
        coordinate = self.partition.checked_index(coordinate)
        offsets = self._offsets
        start, stop = [], []
        for d in range(self.ndim):
            k = self.piece(d, coordinate)
            start.append(offsets[d][k])
            stop.append(offsets[d][k + 1])
        return tuple(start), tuple(stop)

    def local_shape(self, coordinate: Sequence[int]) -> tuple[int, ...]:
        """The shape of the local tensor at a mesh coordinate."""
        start, stop = self.box(coordinate)
        return tuple(b - a for a, b in zip(start, stop))

    def coordinate(self, worker: int) -> tuple[int, ...]:
        """The mesh coordinate of a worker (rank)."""
        return self.partition.index(worker)

    # -- the Layout protocol ------------------------------------------------------------
    @cached_property
    def grid(self) -> BlockGrid:
        """The blocks as a :class:`~linop.layout.BlockGrid` on the mesh partition."""
        return BlockGrid(
            self.name, self.partition, tuple(self.local_shape(c) for c in self.partition.indices())
        )

    def block_name(self, index: Sequence[int]) -> str:
        """Name of the block at a mesh coordinate, e.g. ``x[0,1]``."""
        return self.grid.block_name(index)

    def block(self, index: Sequence[int]) -> Block:
        """The block at a mesh coordinate."""
        return self.grid.block(index)

    @property
    def blocks(self) -> tuple[Block, ...]:
        """All blocks, in C order of mesh coordinate."""
        return self.grid.blocks

    @property
    def space(self) -> Space:
        """The space of the blocks."""
        return self.grid.space

    def block_of(self, worker: int) -> Block:
        """The block of a worker (rank)."""
        return self.block(self.coordinate(worker))

    def tensor(self, name: str | None = None) -> DistributedTensor:
        """The distinct boxes as a :class:`~linop.partition.DistributedTensor`: one block per
        piece of the sharded dimensions, on the worker at coordinate 0 of every ``Replicate``
        and ``Partial`` mesh dimension (replica 0, partial term 0)."""
        counts = tuple(len(s) for s in self.sizes)
        workers = []
        for index in itertools.product(*(range(n) for n in counts)):
            coordinate = [0] * len(self.mesh_shape)
            for d, k in enumerate(index):
                for i, c in zip(self._cuts[d], self.piece_coordinates(d, k)):
                    coordinate[i] = c
            workers.append(self.partition.worker(coordinate))
        return DistributedTensor(
            f"{self.name}_global" if name is None else name,
            self.global_shape,
            Partition(counts, tuple(workers)),
            self.sizes,
        )

    # -- global arrays --------------------------------------------------------------------
    def scatter(self, array: Any, *, rng: np.random.Generator | None = None) -> State:
        """The blocks of a global array: copies along ``Replicate`` dimensions, and along
        ``Partial`` dimensions the whole value on coordinate 0 and zeros elsewhere, or (with
        ``rng``) random partial terms (integers for an integer array) that add up to it."""
        array = np.asarray(array)
        if array.shape != self.global_shape:
            raise PlacementError(
                f"layout {self.name!r}: array of shape {array.shape} does not match global shape {self.global_shape}"
            )
        partial = [i for i, p in enumerate(self.placements) if isinstance(p, Partial)]
        replicate = [i for i, p in enumerate(self.placements) if isinstance(p, Replicate)]
        state: State = {}
        for c in self.partition.indices():
            start, stop = self.box(c)
            state[self.block_name(c)] = np.array(array[tuple(slice(a, b) for a, b in zip(start, stop))])
        if not partial:
            return state
        terms: dict[tuple[int, ...], np.ndarray] = {}  # by coordinate with replica 0: one term for all copies
        for c in self.partition.indices():
            if all(c[i] == 0 for i in partial):
                continue
            key = tuple(0 if i in replicate else k for i, k in enumerate(c))
            block = state[self.block_name(c)]
            if key not in terms:
                if rng is None:
                    terms[key] = np.zeros_like(block)
                elif block.dtype.kind in "iu":
                    terms[key] = rng.integers(-5, 6, block.shape).astype(block.dtype)
                else:
                    terms[key] = rng.standard_normal(block.shape).astype(block.dtype)
            state[self.block_name(c)] = terms[key].copy()
            root = list(c)
            for i in partial:
                root[i] = 0
            state[self.block_name(root)] = state[self.block_name(root)] - terms[key]
        return state

    def gather(self, state: Any, *, check: bool = True) -> np.ndarray:
        """The global array the blocks stand for: replica 0 of every box, partial terms summed.

        Raises
        ------
        StateError
            With ``check``, when two replicas of one box differ (naming both blocks).
        """
        arrays = self.space.check_state(state)
        replicate = [i for i, p in enumerate(self.placements) if isinstance(p, Replicate)]
        dtype = np.result_type(*arrays.values()) if arrays else np.float64
        out = np.zeros(self.global_shape, dtype=dtype)
        for c in self.partition.indices():
            if any(c[i] != 0 for i in replicate):
                continue
            start, stop = self.box(c)
            out[tuple(slice(a, b) for a, b in zip(start, stop))] += arrays[self.block_name(c)]
        if check:
            for c in self.partition.indices():
                root = list(c)
                for i in replicate:
                    root[i] = 0
                mine, first = arrays[self.block_name(c)], arrays[self.block_name(root)]
                if not np.array_equal(mine, first):
                    raise StateError(
                        f"layout {self.name!r}: replicas {self.block_name(root)!r} and {self.block_name(c)!r} differ"
                    )
        return out

    def __str__(self) -> str:
        placements = ", ".join(map(str, self.placements))
        chunked = MeshLayout(self.name, self.mesh_shape, self.placements, self.global_shape, (), self.ranks)
        uneven = {d: s for d, (s, c) in enumerate(zip(self.sizes, chunked.sizes)) if s != c}
        sizes = f" sizes {uneven}" if uneven else ""
        return f"{self.name}{list(self.global_shape)} on mesh {self.mesh_shape} [{placements}]{sizes}"
