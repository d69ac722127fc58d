"""Halo exchange and its adjoint, for any kernel, tensor rank and decomposition
(``docs/theory.md#halo-exchange``).

Three operators take a distributed tensor to the *windows* a local sliding-window kernel needs:

=======================  ================================  ==============================================
operator                 maps                              adjoint
=======================  ================================  ==============================================
:func:`pad_shim`         bulk blocks -> local blocks       restrict each local block to its bulk
:class:`HaloExchange`    local -> local (in place)         send halos back, **add** them into owners' bulk
:func:`trim_shim`        local blocks -> windows           embed each window in a zero local block
=======================  ================================  ==============================================

:func:`halo_windows` composes them: each worker's window equals the global input, padded by the
kernel's boundary mode, restricted to the worker's needed range (:mod:`linop.halo_geometry`).

A *local* block holds, per dimension, ``[left pad | left halo | bulk | right halo | right pad]``
(the hull of the bulk and the needed range). The exchange writes the entries of each window that
lie outside the bulk (halo entries from their owners and, for the periodic and reflecting
boundaries, pad entries from the entries they wrap to; zero pads are left alone), and the halo
entries beside the bulk that the nested exchange relays to other workers; trimmed entries that
nobody reads are not exchanged.

Nested and direct exchange
--------------------------
The *nested* exchange is the paper's ``H = H_{d-1} ... H_1 H_0``: stage ``H_i`` fills halos along
dimension i, with the extent along earlier dimensions covering their (already filled) windows, so
corner entries travel in two hops. Each stage is ``H_i = K_T C_U C_E C_P K_S`` with explicit send and
receive buffers (see :class:`HaloStage`), so its adjoint ``H_i* = K_S C_P* C_E* C_U* K_T`` is derived
by the primitives' rules. A halo wider than the neighbour's bulk is fetched from every worker along
the dimension whose bulk it meets (multi-hop).

The *direct* exchange is one stage: every window entry outside the bulk is copied straight from
its owner, corners included (one box per pair of workers for zero padding). Both write the same
entries with the same values, so they are the same operator; the tests prove it with exact
matrices.
"""

from __future__ import annotations

import itertools
from abc import abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, NoReturn

import numpy as np

from .errors import OperandError
from .halo_geometry import HaloError, HaloGeometry, Kernel, Segment, halo_geometry
from .movement import Copy, Move, SendRecv
from .operator import Composition, Identity, LinearOperator, SameSpace
from .partition import DistributedTensor
from .pieces import fields_of
from .primitives import Allocate, Clear, Deallocate
from .space import Block, GridSpace, Region, Space

__all__ = [
    "HaloExchange",
    "HaloExchangeAdjoint",
    "HaloStage",
    "HaloStageAdjoint",
    "PadShim",
    "PadShimAdjoint",
    "TrimShim",
    "TrimShimAdjoint",
    "RegionCopy",
    "direct_transfers",
    "halo_windows",
    "local_space",
    "nested_transfers",
    "pad_expansion",
    "pad_shim",
    "trim_expansion",
    "trim_shim",
    "window_space",
    "worker_transfers",
]

Variant = Literal["nested", "direct"]
RegionCopy = tuple[Region, Region]
"""One copy of a halo exchange stage: (source region, destination region) in the local space."""


# -- names and spaces -------------------------------------------------------------------------
def _name(prefix: str, index: Sequence[int]) -> str:
    return f"{prefix}[{','.join(str(i) for i in index)}]"


def _require_geometry(geometry: object) -> None:
    if not isinstance(geometry, HaloGeometry):
        raise OperandError(f"a halo geometry is needed (see halo_geometry), not {type(geometry).__name__}")


def _local_prefix(geometry: HaloGeometry, name: str | None) -> str:
    _require_geometry(geometry)
    prefix = f"{geometry.tensor.name}_local" if name is None else name
    if prefix == geometry.tensor.name:
        raise HaloError(f"the local blocks need a name other than the tensor's own {prefix!r}")
    return prefix


def _window_prefix(geometry: HaloGeometry, name: str | None) -> str:
    _require_geometry(geometry)
    return f"{geometry.tensor.name}_window" if name is None else name


def local_space(geometry: HaloGeometry, name: str | None = None) -> Space:
    """The space of the local (pad + halo + bulk) blocks, ``name[i,j]`` on the bulk's worker
    (default name: the tensor's name + ``"_local"``)."""
    prefix = _local_prefix(geometry, name)
    extents = tuple(geometry.column(dim, "local_size") for dim in range(geometry.ndim))
    return GridSpace(prefix, geometry.tensor.partition, extents=extents)


def window_space(geometry: HaloGeometry, name: str | None = None) -> Space:
    """The space of the windows, one block per worker (empty for a worker without output;
    default name: the tensor's name + ``"_window"``)."""
    prefix = _window_prefix(geometry, name)
    extents = tuple(geometry.column(dim, "window_size") for dim in range(geometry.ndim))
    return GridSpace(prefix, geometry.tensor.partition, extents=extents)


def _cached(node: object, key: str, build: Callable[[], Any]) -> Any:
    """``build()``, computed once per (immutable) node and kept on it."""
    try:
        return object.__getattribute__(node, key)
    except AttributeError:
        value = build()
        object.__setattr__(node, key, value)
        return value


def _box(space: Space, name: str, slices: Sequence[slice]) -> Region:
    return Region(space, name, tuple(s.start for s in slices), tuple(s.stop for s in slices))


# -- one stage: a set of commuting copies, with explicit buffers --------------------------------
def _as_transfer(item: object, label: str) -> RegionCopy:
    """``item`` as a (source, destination) pair of regions."""
    if isinstance(item, (tuple, list)) and len(item) == 2 and all(isinstance(r, Region) for r in item):
        return (item[0], item[1])
    raise OperandError(f"stage {label}: a transfer is a (Region, Region) pair, not {item!r}")


def _check_transfers(space: Space, transfers: tuple[RegionCopy, ...], label: str) -> None:
    """Sources and destinations live in ``space``, shapes match, and no destination meets a
    source or another destination (so the copies of a stage commute)."""
    by_block: dict[str, tuple[list[Region], list[Region]]] = {}
    for src, dst in transfers:
        for region in (src, dst):
            if region.space != space:
                raise HaloError(f"stage {label}: region {region!r} is not a region of the stage's space")
        if src.shape != dst.shape:
            raise HaloError(
                f"stage {label}: transfer {src!r} -> {dst!r} has shapes {src.shape} and {dst.shape}"
            )
        if all(a < b for a, b in zip(src.start, src.stop)):  # empty boxes meet nothing
            by_block.setdefault(src.name, ([], []))[0].append(src)
            by_block.setdefault(dst.name, ([], []))[1].append(dst)
    for sources, destinations in by_block.values():
        _check_block(sources, destinations, label)


def _check_block(sources: list[Region], destinations: list[Region], label: str) -> None:
    """No destination box of one block meets a source or an earlier destination.

    The boxes are marked on the grid of cells cut by their own boundaries (at most one cell per
    entry of the block, usually a handful), so the check costs one small slice per box rather
    than a comparison per pair of boxes: a reflected halo is thousands of one-entry copies.
    """
    if not destinations:
        return
    regions = sources + destinations
    cuts = [
        {c: i for i, c in enumerate(sorted({r.start[d] for r in regions} | {r.stop[d] for r in regions}))}
        for d in range(len(regions[0].start))
    ]

    def cells(region: Region) -> tuple[slice, ...]:
        return tuple(slice(cut[a], cut[b]) for cut, a, b in zip(cuts, region.start, region.stop))

    written = np.zeros(tuple(len(cut) - 1 for cut in cuts), dtype=bool)
    for k, dst in enumerate(destinations):
        box = cells(dst)
        if written[box].any():
            _overlap(label, dst, next(other for other in destinations[:k] if other.overlaps(dst)))
        written[box] = True
    for src in sources:
        if written[cells(src)].any():
            _overlap(label, next(dst for dst in destinations if dst.overlaps(src)), src)


def _overlap(label: str, destination: Region, other: Region) -> NoReturn:
    raise HaloError(
        f"stage {label}: destination {destination!r} overlaps {other!r} in block {destination.name!r}; "
        "the copies of a stage must not read or write each other's destinations"
    )


def _buffer_names(space: Space, label: str, count: int) -> list[tuple[str, str]]:
    names = [(f"{label}.send{t}", f"{label}.recv{t}") for t in range(count)]
    for pair in names:
        for name in pair:
            if name in space:
                raise HaloError(f"stage {label}: buffer name {name!r} is already a block of the space")
    return names


def _stage_expansion(space: Space, transfers: tuple[RegionCopy, ...], label: str) -> LinearOperator:
    """H_i = D K_T C_U C_E C_P K_S A: allocate the buffers, clear them (K_S), pack (C_P),
    send-receive (C_E), unpack (C_U), clear (K_T) and drop them. A copy within one worker
    needs no buffer: it is part of C_U."""
    remote = [(s, d) for s, d in transfers if s.worker != d.worker]
    local = [(s, d) for s, d in transfers if s.worker == d.worker]
    names = _buffer_names(space, label, len(remote))
    grown = space
    allocate: list[LinearOperator] = []
    for (src, dst), (send, recv) in zip(remote, names):
        for name, worker in ((send, src.worker), (recv, dst.worker)):
            allocate.append(Allocate(grown, Block(name, src.shape, worker)))
            grown = allocate[-1].range
    buffers = [grown[n] for pair in names for n in pair]
    setup = [Clear(b) for b in buffers]
    pack = [Copy(src.in_space(grown), grown[send]) for (src, _), (send, _) in zip(remote, names)]
    exchange = [SendRecv(grown[send], grown[recv]) for send, recv in names]
    unpack = [Copy(grown[recv], dst.in_space(grown)) for (_, dst), (_, recv) in zip(remote, names)]
    unpack += [Copy(src.in_space(grown), dst.in_space(grown)) for src, dst in local]
    teardown = [Clear(b) for b in buffers]
    deallocate: list[LinearOperator] = []
    for b in reversed(buffers):
        deallocate.append(Deallocate(grown, b.name))
        grown = deallocate[-1].range
    factors = [*reversed(deallocate), *teardown, *unpack, *exchange, *pack, *setup, *reversed(allocate)]
    if not factors:
        return Identity(space)
    return Composition(tuple(factors))


class _StageBase(SameSpace):
    """Fields and spaces shared by :class:`HaloStage` and :class:`HaloStageAdjoint`."""

    space: Space
    transfers: tuple[RegionCopy, ...]
    label: str = "H"

    def __post_init__(self) -> None:
        object.__setattr__(self, "transfers", tuple(_as_transfer(t, self.label) for t in self.transfers))
        _check_transfers(self.space, self.transfers, self.label)

    @property
    def moves(self) -> tuple[tuple[str, tuple[slice, ...], str, tuple[slice, ...]], ...]:
        """The transfers as ``(source block, source index, destination block, destination
        index)`` with numpy indices, for interpreters."""
        return _cached(
            self, "_moves", lambda: tuple((s.name, s.index, d.name, d.index) for s, d in self.transfers)
        )


@dataclass(frozen=True, eq=True, repr=False)
class HaloStage(_StageBase):
    r"""One exchange stage: a set of copies between regions of one space that commute.

    .. math::

        H_i = K_T\, C_U\, C_E\, C_P\, K_S: \quad x_{\mathrm{dst}_t} \leftarrow x_{\mathrm{src}_t}
        \text{ for every transfer } t, \qquad
        H_i^* : x_{\mathrm{src}_t} \leftarrow x_{\mathrm{src}_t} + x_{\mathrm{dst}_t},\
        x_{\mathrm{dst}_t} \leftarrow 0

    No destination meets a source or another destination, so the copies (and the adds of the
    adjoint) may run in any order. The expansion packs each transfer between two workers into a
    send buffer on the source's worker, send-receives it into a receive buffer on the
    destination's worker and unpacks it; the buffers are allocated, cleared and dropped inside
    the stage, so they are not part of the domain or range.

    Parameters
    ----------
    space : Space
        Domain and range (the local blocks).
    transfers : tuple of (Region, Region)
        ``(source, destination)`` pairs of regions of ``space``; a pair on two workers is a
        message, a pair on one worker a local copy.
    label : str, optional
        Name of the stage (prefix of its buffer names), e.g. ``"H0"``.

    Raises
    ------
    TypeError
        If a transfer is not a (Region, Region) pair.
    HaloError
        If a region is not in ``space``, shapes differ, or a destination overlaps a source or
        another destination.

    Examples
    --------
    One halo entry from worker 0 to worker 1; the expansion shows the five steps over explicit
    buffers (allocated first and dropped last), and the stage equals it exactly:

    >>> import numpy as np
    >>> import verify
    >>> from linop import Block, HaloStage, Space
    >>> space = Space([Block("u", (3,), 0), Block("v", (3,), 1)])
    >>> stage = HaloStage(space, ((space["u"][2:3], space["v"][0:1]),), "H0")
    >>> stage({"u": np.array([1, 2, 3]), "v": np.array([0, 5, 6])})
    {'u': array([1, 2, 3]), 'v': array([3, 5, 6])}
    >>> stage.H({"u": np.array([1, 2, 3]), "v": np.array([4, 5, 6])})
    {'u': array([1, 2, 7]), 'v': array([0, 5, 6])}
    >>> print(stage.expand())  # doctest: +NORMALIZE_WHITESPACE
    D[H0.send0] @ D[H0.recv0] @ K[H0.send0] @ K[H0.recv0] @ C[H0.recv0 -> v[0:1]] @
    SR[H0.send0 -> H0.recv0] @ C[u[2:3] -> H0.send0] @ K[H0.send0] @ K[H0.recv0] @
    A[H0.recv0] @ A[H0.send0]
    >>> bool(verify.equal(stage, stage.expand()))
    True
    """

    space: Space
    transfers: tuple[RegionCopy, ...]
    label: str = "H"

    def expand(self) -> LinearOperator:
        """D K_T C_U C_E C_P K_S A over explicit buffers."""
        return _cached(self, "_expansion", lambda: _stage_expansion(self.space, self.transfers, self.label))

    def adjoint(self) -> LinearOperator:
        """H_i* = K_S C_P* C_E* C_U* K_T: each destination is sent back and added into its source."""
        return HaloStageAdjoint(**fields_of(self))

    def __str__(self) -> str:
        return f"{self.label}[{len(self.transfers)} copies]"


@dataclass(frozen=True, eq=True, repr=False)
class HaloStageAdjoint(_StageBase):
    r"""Adjoint of :class:`HaloStage`: for every transfer, ``x_src += x_dst`` and ``x_dst = 0``.

    ``transfers`` are the forward pairs. Its expansion is the adjoint of the forward expansion,
    derived node by node (receive-sends that add into the sources).
    """

    space: Space
    transfers: tuple[RegionCopy, ...]
    label: str = "H"

    def expand(self) -> LinearOperator:
        """(D K_T C_U C_E C_P K_S A)* = D K_S C_P* C_E* C_U* K_T A."""
        return _cached(self, "_expansion", lambda: self.adjoint().expand().H)

    def adjoint(self) -> LinearOperator:
        """(H_i*)* = H_i."""
        return HaloStage(**fields_of(self))

    def __str__(self) -> str:
        return f"{self.label}*[{len(self.transfers)} copies]"


# -- transfer segments -------------------------------------------------------------------------
def _whole_segment(start: int, stop: int, g: int) -> list[Segment]:
    """Positions ``[start, stop)`` of worker g's own local layout, as one segment it owns."""
    return [Segment(start, stop - start, g, start)]


def _segments_covering(geometry: HaloGeometry, dim: int, g: int) -> list[Segment]:
    """The window's data positions along ``dim``, split by owner (own bulk and fills)."""
    data, bulk = geometry.data_range(dim, g), geometry.rows[dim][g].bulk
    start, stop = max(bulk.start, data.start), min(bulk.stop, data.stop)
    own = _whole_segment(start, stop, g) if stop > start else []
    return own + list(geometry.fills[dim][g])


def _relayed(geometry: HaloGeometry, dim: int, g: int) -> list[Segment]:
    """The window's data positions along ``dim`` as one segment of the receiver's own layout
    (filled by the stage of ``dim``, so a later stage's owner holds them too)."""
    data = geometry.data_range(dim, g)
    return _whole_segment(data.start, data.stop, g)


def _receiver_transfers(
    geometry: HaloGeometry,
    space: Space,
    prefix: str,
    receiver: tuple[int, ...],
    dim: int,
    earlier: Callable[[HaloGeometry, int, int], list[Segment]],
) -> list[RegionCopy]:
    """The boxes one receiver gets filled along ``dim``: along earlier dimensions the segments
    ``earlier`` gives, along ``dim`` the fill segments, along later dimensions its whole bulk.
    Each box is copied from the same box of the local block of its segments' owners."""
    per_dim: list[list[Segment]] = []
    for j, g in enumerate(receiver):
        if j < dim:
            per_dim.append(earlier(geometry, j, g))
        elif j == dim:
            per_dim.append(list(geometry.fills[j][g]))
        else:
            bulk = geometry.rows[j][g].bulk
            per_dim.append(_whole_segment(bulk.start, bulk.stop, g))
    transfers = []
    for combo in itertools.product(*per_dim):
        if any(seg.size == 0 for seg in combo):
            continue
        owner = tuple(seg.owner for seg in combo)
        src = _box(space, _name(prefix, owner), [slice(s.src_start, s.src_start + s.size) for s in combo])
        dst = _box(space, _name(prefix, receiver), [slice(s.dst_start, s.dst_start + s.size) for s in combo])
        transfers.append((src, dst))
    return transfers


def nested_transfers(geometry: HaloGeometry, space: Space, prefix: str, dim: int) -> tuple[RegionCopy, ...]:
    """Transfers of stage H_dim of the nested exchange.

    A receiver's destination spans, along earlier dimensions, the data range of its window
    (filled by earlier stages), along ``dim`` one fill segment, and along later dimensions its
    whole bulk (later stages relay it). The source is the same box in the local block of the
    segment's owner along ``dim``, which shares the receiver's layout in every other dimension.
    """
    return tuple(
        transfer
        for receiver in geometry.tensor.partition.indices()
        for transfer in _receiver_transfers(geometry, space, prefix, receiver, dim, _relayed)
    )


def direct_transfers(geometry: HaloGeometry, space: Space, prefix: str) -> tuple[RegionCopy, ...]:
    """Transfers of the direct exchange: every entry the nested exchange writes, copied from its
    owner's bulk in one hop (for each dimension i, the boxes whose last non-bulk dimension is i:
    along earlier dimensions the window's data split by owner instead of relayed)."""
    return tuple(
        transfer
        for receiver in geometry.tensor.partition.indices()
        for dim in range(geometry.ndim)
        for transfer in _receiver_transfers(geometry, space, prefix, receiver, dim, _segments_covering)
    )


# -- one worker's share of the transfers --------------------------------------------------------
def _readers(
    geometry: HaloGeometry, dim: int, segments: Callable[[HaloGeometry, int, int], list[Segment]], owner: int
) -> list[int]:
    """Along ``dim``: the receiver coordinates whose ``segments`` read from coordinate
    ``owner`` (sorted), computed once per geometry, kind of segment and owner. Only the owner's
    neighbours are visited (:meth:`~linop.halo_geometry.HaloGeometry.fill_readers`)."""
    table: dict[tuple[int, str, int], list[int]] = _cached(geometry, "_readers", dict)
    key = (dim, segments.__name__, owner)
    found = table.get(key)
    if found is None:
        if segments is _relayed:  # a receiver's own layout: read by itself alone
            data = geometry.data_range(dim, owner)
            found = [owner] if data.stop > data.start else []
        else:
            found = geometry.fill_readers(dim, owner)
            if (
                segments is _segments_covering
                and owner not in found
                and _segments_covering_own(geometry, dim, owner)
            ):
                found = sorted([*found, owner])
        table[key] = found
    return found


def _segments_covering_own(geometry: HaloGeometry, dim: int, g: int) -> bool:
    """Whether the window's data along ``dim`` meets worker g's own bulk (the own segment of
    :func:`_segments_covering`)."""
    data, bulk = geometry.data_range(dim, g), geometry.rows[dim][g].bulk
    return min(bulk.stop, data.stop) > max(bulk.start, data.start)


def _fill_segments_of(geometry: HaloGeometry, dim: int, g: int) -> list[Segment]:
    return list(geometry.fills[dim][g])


def worker_transfers(
    geometry: HaloGeometry, space: Space, prefix: str, variant: Variant, index: tuple[int, ...]
) -> tuple[tuple[RegionCopy, ...], ...]:
    """The transfers of each exchange stage (in the order of :meth:`HaloExchange.stages`, empty
    stages included) that the worker at grid ``index`` takes part in, as receiver or source, in
    the order the whole stage lists them (:func:`nested_transfers`, :func:`direct_transfers`).

    Only the worker's neighbours are visited: the receivers that read from the worker are found
    per dimension from the fill segments (``docs/theory.md#halo-geometry``), so the cost is the
    worker's own transfers, not the job's.
    """
    ndim = geometry.ndim
    stages: list[tuple[RegionCopy, ...]] = []
    mine = _name(prefix, index)
    dims_of_stage = [tuple(range(ndim))] if variant == "direct" else [(d,) for d in range(ndim)]
    earlier = _segments_covering if variant == "direct" else _relayed
    for dims in dims_of_stage:
        receivers: set[tuple[int, ...]] = {index}
        for dim in dims:
            choices: list[list[int]] = []
            for j, g in enumerate(index):
                if j < dim:
                    choices.append([g] if variant == "nested" else _readers(geometry, j, earlier, g))
                elif j == dim:
                    choices.append(_readers(geometry, j, _fill_segments_of, g))
                else:
                    choices.append([g])
            receivers.update(itertools.product(*choices))
        transfers: list[RegionCopy] = []
        for receiver in sorted(receivers):
            for dim in dims:
                for src, dst in _receiver_transfers(geometry, space, prefix, receiver, dim, earlier):
                    if receiver == index or src.name == mine:
                        transfers.append((src, dst))
        stages.append(tuple(transfers))
    return tuple(stages)


# -- the exchange -----------------------------------------------------------------------------
class _ExchangeBase(SameSpace):
    """Fields and spaces shared by :class:`HaloExchange` and :class:`HaloExchangeAdjoint`."""

    geometry: HaloGeometry
    variant: Variant = "nested"
    local_name: str | None = None
    _space: Space  # set by __post_init__

    def __post_init__(self) -> None:
        if not isinstance(self.geometry, HaloGeometry):
            raise OperandError(
                f"{type(self).__name__}: geometry must be a HaloGeometry, not {type(self.geometry).__name__}"
            )
        if not isinstance(self.variant, str) or self.variant not in ("nested", "direct"):
            raise HaloError(f"halo exchange variant must be 'nested' or 'direct', not {self.variant!r}")
        object.__setattr__(self, "local_name", _local_prefix(self.geometry, self.local_name))
        object.__setattr__(self, "_space", local_space(self.geometry, self.local_name))

    @property
    def space(self) -> Space:
        """The local blocks (:func:`local_space`): domain and range."""
        return self._space

    def stages(self) -> tuple[HaloStage, ...]:
        """The forward stages in the order they run (H_0 first); empty stages are left out."""
        return _cached(self, "_stages", self._build_stages)

    def worker_stages(self, index: tuple[int, ...]) -> tuple[tuple[RegionCopy, ...], ...]:
        """The transfers of each forward stage that the worker at grid ``index`` takes part in
        (see :func:`worker_transfers`), checked as :class:`HaloStage` checks a stage: every
        region in the space, shapes equal, and in the worker's own block no destination meets
        a source or another destination (the whole stage's check is the union of these)."""
        prefix = _local_prefix(self.geometry, self.local_name)
        found = worker_transfers(self.geometry, self.domain, prefix, self.variant, index)
        labels = ["H"] if self.variant == "direct" else [f"H{d}" for d in range(self.geometry.ndim)]
        for label, transfers in zip(labels, found):
            _check_transfers(self.domain, transfers, label)
        return found

    def _build_stages(self) -> tuple[HaloStage, ...]:
        space, prefix = self.domain, _local_prefix(self.geometry, self.local_name)
        if self.variant == "direct":
            candidates = [HaloStage(space, direct_transfers(self.geometry, space, prefix), "H")]
        else:
            candidates = [
                HaloStage(space, nested_transfers(self.geometry, space, prefix, d), f"H{d}")
                for d in range(self.geometry.ndim)
            ]
        return tuple(s for s in candidates if s.transfers)


@dataclass(frozen=True, eq=True, repr=False)
class HaloExchange(_ExchangeBase):
    r"""The in-place halo exchange on the local blocks of a halo geometry.

    .. math::

        H = H_{d-1} \cdots H_1 H_0 \ (\text{nested}), \qquad
        H^* = H_0^* H_1^* \cdots H_{d-1}^*

    Forward, every window entry outside a worker's bulk receives its value (halo entries from
    their owners; periodic or reflected pad entries from the entries they wrap to). Adjoint, each
    such entry is sent back and added into the bulk entry it came from, then cleared.

    Parameters
    ----------
    geometry : HaloGeometry
        From :func:`~linop.halo_geometry.halo_geometry`.
    variant : {"nested", "direct"}, optional
        ``"nested"`` (default): one :class:`HaloStage` per dimension, corners in two hops.
        ``"direct"``: one stage, every entry straight from its owner. Same operator.
    local_name : str, optional
        Name of the local blocks (default the tensor's name + ``"_local"``).

    Raises
    ------
    TypeError
        If ``geometry`` is not a :class:`~linop.halo_geometry.HaloGeometry`.
    HaloError
        If the variant is unknown or ``local_name`` is the tensor's own name.

    Examples
    --------
    Six entries on two workers and a kernel of size 3: each local block holds the bulk and one
    halo entry beside it.

    >>> import numpy as np
    >>> import verify
    >>> from linop import DistributedTensor, HaloExchange, Kernel, Partition, halo_geometry
    >>> tensor = DistributedTensor("x", (6,), Partition((2,)))
    >>> exchange = HaloExchange(halo_geometry(tensor, Kernel(3)))
    >>> exchange.domain.names
    ('x_local[0]', 'x_local[1]')
    >>> state = {"x_local[0]": np.array([1, 2, 3, 0]), "x_local[1]": np.array([0, 4, 5, 6])}
    >>> exchange(state)
    {'x_local[0]': array([1, 2, 3, 4]), 'x_local[1]': array([3, 4, 5, 6])}

    The adjoint sends each halo back, adds it into its owner's bulk and clears it:

    >>> exchange.H(exchange(state))
    {'x_local[0]': array([1, 2, 6, 0]), 'x_local[1]': array([0, 8, 5, 6])}
    >>> bool(verify.exact_adjoint(exchange))
    True
    >>> bool(verify.equal(exchange, HaloExchange(exchange.geometry, "direct")))
    True
    """

    geometry: HaloGeometry
    variant: Variant = "nested"
    local_name: str | None = None

    def expand(self) -> LinearOperator:
        """H_{d-1} ... H_0 (nested) or the single direct stage."""
        return _cached(self, "_expansion", self._build_expansion)

    def _build_expansion(self) -> LinearOperator:
        stages = self.stages()
        if not stages:
            return Identity(self.domain)
        return Composition(tuple(reversed(stages)))

    def adjoint(self) -> LinearOperator:
        """H* = H_0* ... H_{d-1}*."""
        return HaloExchangeAdjoint(**fields_of(self))

    def __str__(self) -> str:
        return f"H_{self.variant}[{self.local_name}]"


@dataclass(frozen=True, eq=True, repr=False)
class HaloExchangeAdjoint(_ExchangeBase):
    """Adjoint of :class:`HaloExchange`: halos sent back and added into their owners' bulk.

    Parameters
    ----------
    geometry, variant, local_name
        Those of the forward :class:`HaloExchange`.
    """

    geometry: HaloGeometry
    variant: Variant = "nested"
    local_name: str | None = None

    def expand(self) -> LinearOperator:
        """H_0* ... H_{d-1}*, derived from the forward stages."""
        return _cached(self, "_expansion", lambda: self.adjoint().expand().H)

    def adjoint(self) -> LinearOperator:
        """(H*)* = H."""
        return HaloExchange(**fields_of(self))

    def __str__(self) -> str:
        return f"H_{self.variant}*[{self.local_name}]"


# -- shims ------------------------------------------------------------------------------------
def pad_shim(geometry: HaloGeometry, *, local_name: str | None = None) -> LinearOperator:
    r"""The operator from the tensor's bulk blocks to zero-initialised local blocks.

    .. math::

        E = \prod_w D_{x_w}\, C_{x_w \to \ell_w[\mathrm{bulk}]}\, A_{\ell_w}, \qquad
        E^* : x_w \leftarrow \ell_w[\mathrm{bulk}] \ (\text{halo and pad entries dropped})

    A worker whose local block is its bulk keeps its array (a relabelling move). The result is
    one :class:`PadShim` node: its per-worker parts act on that worker's blocks only, so
    building, fingerprinting and planning it are linear in the number of workers; its
    expansion into primitives (:func:`pad_expansion`) is built only when asked for.

    Parameters
    ----------
    geometry : HaloGeometry
        From :func:`~linop.halo_geometry.halo_geometry`.
    local_name : str, optional
        Name of the local blocks (default the tensor's name + ``"_local"``).

    Returns
    -------
    LinearOperator
        From the tensor's space to :func:`local_space`.

    Raises
    ------
    HaloError
        If ``local_name`` is the tensor's own name.

    Examples
    --------
    >>> import numpy as np
    >>> from linop import DistributedTensor, Kernel, Partition, halo_geometry, pad_shim
    >>> tensor = DistributedTensor("x", (6,), Partition((2,)))
    >>> pad = pad_shim(halo_geometry(tensor, Kernel(3, padding=1)))
    >>> pad(tensor.scatter(np.arange(1, 7)))
    {'x_local[0]': array([0, 1, 2, 3, 0]), 'x_local[1]': array([0, 4, 5, 6, 0])}
    """
    return PadShim(geometry, _local_prefix(geometry, local_name))


def trim_shim(
    geometry: HaloGeometry, *, local_name: str | None = None, window_name: str | None = None
) -> LinearOperator:
    r"""The operator from the local blocks to the windows: each local block restricted to its
    window (the trims dropped).

    .. math::

        T = \prod_w D_{\ell_w}\, C_{\ell_w[\mathrm{window}] \to y_w}, \qquad
        T^* : \ell_w \leftarrow \text{zeros with } y_w \text{ at the window}

    A worker whose window is its whole local block keeps its array (a relabelling move). The
    result is one :class:`TrimShim` node (per-worker parts; see :func:`pad_shim`).

    Parameters
    ----------
    geometry : HaloGeometry
        From :func:`~linop.halo_geometry.halo_geometry`.
    local_name, window_name : str, optional
        Names of the local blocks and of the windows (default the tensor's name + ``"_local"``
        and + ``"_window"``).

    Returns
    -------
    LinearOperator
        From :func:`local_space` to the windows.

    Raises
    ------
    HaloError
        If the windows would take the local blocks' name.

    Examples
    --------
    Ten entries, kernel 2, stride 2 on three workers: worker 2 trims the first entry of its
    bulk (``docs/theory.md#halo-geometry``).

    >>> from linop import DistributedTensor, Kernel, Partition, halo_geometry, trim_shim
    >>> tensor = DistributedTensor("x", (10,), Partition((3,)))
    >>> trim = trim_shim(halo_geometry(tensor, Kernel(2, stride=2)))
    >>> [trim.range.block(n).shape for n in trim.range.names]
    [(4,), (4,), (2,)]
    """
    prefix, window_prefix = _local_prefix(geometry, local_name), _window_prefix(geometry, window_name)
    if window_prefix == prefix:
        raise HaloError(f"the windows need a name other than the local blocks' {prefix!r}")
    return TrimShim(geometry, prefix, window_prefix)


def pad_expansion(geometry: HaloGeometry, local_name: str | None = None) -> LinearOperator:
    """The pad shim as primitives on the whole space, one worker after the other:
    ``prod_w D_{x_w} C_{x_w -> l_w[bulk]} A_{l_w}`` (each factor on a space of all P blocks, so
    this costs O(P^2); the interpreters use the per-worker parts of :class:`PadShim` instead)."""
    prefix = _local_prefix(geometry, local_name)
    tensor = geometry.tensor
    space = tensor.space
    factors: list[LinearOperator] = []
    for g in tensor.partition.indices():
        bulk_name, local = (
            tensor.block_name(g),
            Block(_name(prefix, g), geometry.local_shape(g), tensor.partition.worker(g)),
        )
        if local.shape == space.block(bulk_name).shape:
            factors.append(Move(space[bulk_name], local))
            space = factors[-1].range
            continue
        allocate = Allocate(space, local)
        grown = allocate.range
        box = [r.bulk for r in geometry.worker_rows(g)]
        copy = Copy(grown[bulk_name], _box(grown, local.name, box))
        drop = Deallocate(grown, bulk_name)
        factors += [allocate, copy, drop]
        space = drop.range
    if not factors:
        return Identity(space)
    return Composition(tuple(reversed(factors)))


def trim_expansion(
    geometry: HaloGeometry, local_name: str | None = None, window_name: str | None = None
) -> LinearOperator:
    """The trim shim as primitives on the whole space, one worker after the other:
    ``prod_w D_{l_w} C_{l_w[window] -> y_w}`` (O(P^2), see :func:`pad_expansion`)."""
    prefix, window_prefix = _local_prefix(geometry, local_name), _window_prefix(geometry, window_name)
    if window_prefix == prefix:
        raise HaloError(f"the windows need a name other than the local blocks' {prefix!r}")
    space = local_space(geometry, prefix)
    factors: list[LinearOperator] = []
    for g in geometry.tensor.partition.indices():
        local_name_g = _name(prefix, g)
        window = Block(_name(window_prefix, g), geometry.window_shape(g), geometry.tensor.partition.worker(g))
        box = [r.window for r in geometry.worker_rows(g)]
        region = _box(space, local_name_g, box)
        if region.is_whole:
            factors.append(Move(region, window))
            space = factors[-1].range
            continue
        copy = Copy(region, window)
        drop = Deallocate(copy.range, local_name_g)
        factors += [copy, drop]
        space = drop.range
    if not factors:
        return Identity(space)
    return Composition(tuple(reversed(factors)))


# -- the shims as nodes: per-worker parts, the global expansion built lazily -------------------
def _pad_part(geometry: HaloGeometry, prefix: str, g: tuple[int, ...]) -> LinearOperator:
    """Worker g's part of the pad shim, on a space of its own blocks only."""
    bulk = geometry.tensor.block(g)  # not tensor.space: that builds all P blocks
    local = Block(_name(prefix, g), geometry.local_shape(g), bulk.worker)
    space = Space([bulk])
    if local.shape == bulk.shape:
        return Move(space[bulk.name], local)
    allocate = Allocate(space, local)
    grown = allocate.range
    copy = Copy(grown[bulk.name], _box(grown, local.name, [r.bulk for r in geometry.worker_rows(g)]))
    return Composition((Deallocate(grown, bulk.name), copy, allocate))


def _trim_part(geometry: HaloGeometry, prefix: str, window_prefix: str, g: tuple[int, ...]) -> LinearOperator:
    """Worker g's part of the trim shim, on a space of its own blocks only."""
    worker = geometry.tensor.partition.worker(g)
    local = Block(_name(prefix, g), geometry.local_shape(g), worker)
    window = Block(_name(window_prefix, g), geometry.window_shape(g), worker)
    space = Space([local])
    region = _box(space, local.name, [r.window for r in geometry.worker_rows(g)])
    if region.is_whole:
        return Move(region, window)
    copy = Copy(region, window)
    return Composition((Deallocate(copy.range, local.name), copy))


ShimLink = tuple[str, tuple[slice, ...], str, tuple[slice, ...]]
"""One worker's box of a shim: (domain block, box, range block, box), boxes as slices."""


class _ShimBase(LinearOperator):
    """A shim as one node: the direct sum of per-worker parts, each on its worker's blocks.

    ``parts()`` are operators on disjoint sets of blocks (one worker's bulk, local or window
    blocks); the shim applies each to its blocks. Interpreters run the parts (linear in the
    number of workers); :meth:`expand` gives the primitives on the whole space, built on first
    use only (``docs/theory.md#halo-geometry``)."""

    ADJOINT: ClassVar[bool] = False
    geometry: HaloGeometry  # a field of every shim

    @abstractmethod
    def _forward_part(self, index: tuple[int, ...]) -> LinearOperator:
        """The forward shim's part of the worker at grid ``index``, on its blocks only."""

    def _forward_parts(self) -> tuple[LinearOperator, ...]:
        """The forward shim's per-worker parts, each on its worker's blocks."""
        return tuple(self._forward_part(g) for g in self.geometry.tensor.partition.indices())

    def part(self, index: tuple[int, ...]) -> LinearOperator:
        """The part of the worker at grid ``index`` alone (the adjoint's: the forward part's
        adjoint), built without the other workers' parts."""
        forward = self._forward_part(index)
        return forward.H if self.ADJOINT else forward

    @abstractmethod
    def _forward_expansion(self) -> LinearOperator:
        """The forward shim in primitives on the whole space."""

    @abstractmethod
    def _forward_spaces(self) -> tuple[Space, Space]:
        """The forward shim's (domain, range)."""

    @abstractmethod
    def _forward_links(self) -> Iterator[ShimLink]:
        """The forward shim's boxes, one per worker (see :meth:`links`)."""

    def links(self) -> Iterator[ShimLink]:
        """The entries the shim moves, one box per worker: ``(domain block, box in it, range
        block, box in it)`` with boxes as tuples of slices of equal shape; every other entry is
        dropped (forward) or zero (adjoint). The shim's matrix is the 0/1 matrix with a one at
        (range entry, domain entry) of each box pair."""
        for link in self._forward_links():
            yield (link[2], link[3], link[0], link[1]) if self.ADJOINT else link

    def parts(self) -> tuple[LinearOperator, ...]:
        """The per-worker parts, in grid order (the adjoint's are the forward parts' adjoints)."""

        def build() -> tuple[LinearOperator, ...]:
            forward = self._forward_parts()
            return tuple(p.H for p in forward) if self.ADJOINT else forward

        return _cached(self, "_parts", build)

    @property
    def domain(self) -> Space:
        spaces = _cached(self, "_spaces", self._forward_spaces)
        return spaces[1] if self.ADJOINT else spaces[0]

    @property
    def range(self) -> Space:
        spaces = _cached(self, "_spaces", self._forward_spaces)
        return spaces[0] if self.ADJOINT else spaces[1]

    def expand(self) -> LinearOperator:
        """The primitives on the whole space (the forward expansion, or its adjoint)."""

        def build() -> LinearOperator:
            forward = self._forward_expansion()
            return forward.H if self.ADJOINT else forward

        return _cached(self, "_expansion", build)


@dataclass(frozen=True, eq=True, repr=False)
class PadShim(_ShimBase):
    r"""The pad shim :math:`E` of :func:`pad_shim` as one node.

    .. math::

        E = \bigoplus_w E_w, \quad E_w = D_{x_w} C_{x_w \to \ell_w[\mathrm{bulk}]} A_{\ell_w},
        \qquad E^* = \bigoplus_w E_w^*

    Parameters
    ----------
    geometry : HaloGeometry
        From :func:`~linop.halo_geometry.halo_geometry`.
    local_name : str, optional
        Name of the local blocks (default the tensor's name + ``"_local"``).
    """

    geometry: HaloGeometry
    local_name: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "local_name", _local_prefix(self.geometry, self.local_name))

    def _forward_spaces(self) -> tuple[Space, Space]:
        return self.geometry.tensor.space, local_space(self.geometry, self.local_name)

    def _forward_part(self, index: tuple[int, ...]) -> LinearOperator:
        return _pad_part(self.geometry, str(self.local_name), index)

    def _forward_expansion(self) -> LinearOperator:
        return pad_expansion(self.geometry, self.local_name)

    def _forward_links(self) -> Iterator[ShimLink]:
        tensor, prefix = self.geometry.tensor, str(self.local_name)
        for g in tensor.partition.indices():
            bulk = tensor.block(g)
            whole = tuple(slice(0, n) for n in bulk.shape)
            yield bulk.name, whole, _name(prefix, g), tuple(r.bulk for r in self.geometry.worker_rows(g))

    def adjoint(self) -> LinearOperator:
        """E* = the direct sum of the parts' adjoints (each local block restricted to its bulk)."""
        return PadShimAdjoint(**fields_of(self))

    def __str__(self) -> str:
        return f"E[{self.geometry.tensor.name} -> {self.local_name}]"


@dataclass(frozen=True, eq=True, repr=False)
class PadShimAdjoint(PadShim):
    """Adjoint of :class:`PadShim`: each local block restricted to its bulk (halo and pad
    entries dropped).

    Parameters
    ----------
    geometry, local_name
        Those of the forward :class:`PadShim`.
    """

    ADJOINT: ClassVar[bool] = True

    def adjoint(self) -> LinearOperator:
        """The forward pad shim."""
        return PadShim(**fields_of(self))

    def __str__(self) -> str:
        return f"E*[{self.local_name} -> {self.geometry.tensor.name}]"


@dataclass(frozen=True, eq=True, repr=False)
class TrimShim(_ShimBase):
    r"""The trim shim :math:`T` of :func:`trim_shim` as one node.

    .. math::

        T = \bigoplus_w D_{\ell_w} C_{\ell_w[\mathrm{window}] \to y_w}, \qquad
        T^* = \bigoplus_w (\text{zeros with } y_w \text{ at the window})

    Parameters
    ----------
    geometry : HaloGeometry
        From :func:`~linop.halo_geometry.halo_geometry`.
    local_name, window_name : str
        Names of the local blocks and of the windows.
    """

    geometry: HaloGeometry
    local_name: str | None = None
    window_name: str | None = None

    def __post_init__(self) -> None:
        prefix = _local_prefix(self.geometry, self.local_name)
        window_prefix = _window_prefix(self.geometry, self.window_name)
        if window_prefix == prefix:
            raise HaloError(f"the windows need a name other than the local blocks' {prefix!r}")
        object.__setattr__(self, "local_name", prefix)
        object.__setattr__(self, "window_name", window_prefix)

    def _forward_spaces(self) -> tuple[Space, Space]:
        return local_space(self.geometry, self.local_name), window_space(self.geometry, self.window_name)

    def _forward_part(self, index: tuple[int, ...]) -> LinearOperator:
        return _trim_part(self.geometry, str(self.local_name), str(self.window_name), index)

    def _forward_expansion(self) -> LinearOperator:
        return trim_expansion(self.geometry, self.local_name, self.window_name)

    def _forward_links(self) -> Iterator[ShimLink]:
        prefix, window_prefix = str(self.local_name), str(self.window_name)
        for g in self.geometry.tensor.partition.indices():
            window = tuple(slice(0, n) for n in self.geometry.window_shape(g))
            rows = tuple(r.window for r in self.geometry.worker_rows(g))
            yield _name(prefix, g), rows, _name(window_prefix, g), window

    def adjoint(self) -> LinearOperator:
        """T* = the direct sum of the parts' adjoints (each window embedded in zeros)."""
        return TrimShimAdjoint(**fields_of(self))

    def __str__(self) -> str:
        return f"T[{self.local_name} -> {self.window_name}]"


@dataclass(frozen=True, eq=True, repr=False)
class TrimShimAdjoint(TrimShim):
    """Adjoint of :class:`TrimShim`: each window embedded in a zero local block.

    Parameters
    ----------
    geometry, local_name, window_name
        Those of the forward :class:`TrimShim`.
    """

    ADJOINT: ClassVar[bool] = True

    def adjoint(self) -> LinearOperator:
        """The forward trim shim."""
        return TrimShim(**fields_of(self))

    def __str__(self) -> str:
        return f"T*[{self.window_name} -> {self.local_name}]"


def halo_windows(
    tensor: DistributedTensor,
    kernel: Kernel | int,
    *,
    variant: Variant = "nested",
    local_name: str | None = None,
    window_name: str | None = None,
    output_sizes: Sequence[Sequence[int] | None] | None = None,
) -> LinearOperator:
    r"""The operator from a distributed tensor's bulk blocks to its windows, ``T H E``.

    .. math::

        W = T\, H\, E, \qquad W^* = E^* H^* T^*

    Worker w's window is ``pad(X)[need_w]``: the global input X padded by the kernel's boundary
    mode, restricted to the input range the worker's outputs read (empty without output). A
    local sliding-window kernel applied to it with no padding gives the worker's share of the
    global output. The adjoint adds every window entry back into the bulk entry it came from
    (wrapped pad entries included).

    Parameters
    ----------
    tensor : DistributedTensor
        The input, decomposed over its partition (balanced or not).
    kernel : Kernel or int
        The sliding-window kernel (an int is a kernel size for every dimension).
    variant : {"nested", "direct"}, optional
        Which :class:`HaloExchange` to use (same operator).
    local_name, window_name : str, optional
        Names of the local blocks and windows (default ``<tensor>_local``, ``<tensor>_window``).
    output_sizes : sequence, optional
        The output's shares per dimension (None entries balanced), as
        :func:`~linop.halo_geometry.halo_geometry` takes them.

    Returns
    -------
    LinearOperator
        ``T H E``, from the tensor's space to the windows' space.

    Raises
    ------
    TypeError, KernelError, HaloError
        As :func:`~linop.halo_geometry.halo_geometry` and :class:`HaloExchange`.

    Examples
    --------
    >>> import numpy as np
    >>> import verify
    >>> from linop import DistributedTensor, Kernel, Partition, halo_windows
    >>> tensor = DistributedTensor("x", (6,), Partition((2,)))
    >>> windows = halo_windows(tensor, Kernel(3, padding=1))
    >>> windows(tensor.scatter(np.arange(1, 7)))
    {'x_window[0]': array([0, 1, 2, 3, 4]), 'x_window[1]': array([3, 4, 5, 6, 0])}
    >>> periodic = halo_windows(tensor, Kernel(3, padding=1, boundary="periodic"))
    >>> periodic(tensor.scatter(np.arange(1, 7)))["x_window[0]"]
    array([6, 1, 2, 3, 4])
    >>> bool(verify.exact_adjoint(periodic))
    True
    """
    geometry = halo_geometry(tensor, kernel, output_sizes=output_sizes)
    return Composition(
        (
            trim_shim(geometry, local_name=local_name, window_name=window_name),
            HaloExchange(geometry, variant, local_name),
            pad_shim(geometry, local_name=local_name),
        )
    )
