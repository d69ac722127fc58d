"""One rank's program for the torch.distributed executor: native or portable.

Both come from the distributed program of :mod:`linop.program`:

- **native**: this rank's own program with its fast paths
  (:func:`~linop.program.compile_for_rank`: the rank plans only its own part, in O(its own
  work), never the global program), used when every fast-path part in it has a row in
  :data:`CALLS` (part type -> the torch step that runs it with ``torch.distributed``
  collectives, looked up by the part's type; a part whose type has no row makes the rank's
  part portable): all-reduce (:class:`AllReduceStep`), broadcast and sum-reduce
  (:class:`BroadcastStep`) on a sub-group per group of ranks, and the copying plans whose every
  worker gives at most one block and gets at most one (repartition, scatter, gather,
  all-gather: :class:`AllToAllStep`, one ``all_to_all_single`` of packed buffers over the whole
  group, uneven splits included), and the all-gathers and reduce-scatters along one axis of
  equal shares (:class:`GatherStep`: ``all_gather_into_tensor`` and ``reduce_scatter_tensor``
  on the sub-group of each line of the partition). Because each rank sees only its own part,
  the ranks agree once, at a plan's first run after the entry check (:func:`agree_native`, one
  ``all_gather_object``), that every rank's part is native, and on the union of the groups'
  rank sets, which every rank then creates in one order (``new_group`` is collective over the
  world group);
- **portable** otherwise (halo exchanges, any tree; any
  worker-to-rank map): the program without fast paths
  (:func:`~linop.program.lower_portable`), the rank's part of it: local steps, point-to-point
  phases (one ``batch_isend_irecv`` each) and local moves between two workers of one rank. It
  is exact for every tree. The rank plans it as every executor does under a map
  (:func:`linop.program.mapped.compiled_for`, without a table of calls):
  a tree whose nodes lower per worker (:func:`~linop.program.lowers_per_worker`: halo
  exchanges, collectives, repartitions, local operators) from its own workers' part only
  (:func:`~linop.program.compile_for_rank`, O(its own work); a broadcast's, sum-reduce's or
  all-reduce's expansion included, :mod:`linop.program.lowering_pieces`), equal to the
  projection of the global portable program, which other trees are projected from. Without a
  map the group's identity map (:func:`identity_map`, described, O(1)) is used.

The choice depends only on the tree, the group and (for gloo's and NCCL's reductions) the
agreed run dtype, and is agreed by every rank, so every rank makes it alike.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final

from ...errors import LinopError, UnsupportedNodeError
from ...operator import LinearOperator
from ...program import RankBranches, RankPart, RankProgram, WorkerMap, compile_for_rank
from ...program.groups import listed_ranks
from ...program.mapped import compiled_for
from ...program.parts import (
    AllReducePart,
    AllToAllPart,
    LineGatherPart,
    LineReduceScatterPart,
    RootedGroup,
    RootedPart,
)
from ...space import Block

__all__ = [
    "identity_map",
    "AllReduceStep",
    "AllToAllStep",
    "BroadcastStep",
    "GatherStep",
    "ReduceScatterStep",
    "CALLS",
    "Compiled",
    "SUMMABLE",
    "agree_native",
    "native_program",
    "portable_program",
]

SUMMABLE = "bBhilqfdFD"
"""Dtypes (numpy type characters) that the native collectives use (gloo and NCCL move and add
them); a run in another dtype takes the portable program."""

Box = tuple[int, tuple[int, ...], tuple[int, ...]]
"""A peer (group rank) and a box of a block: its start and shape."""


@dataclass(frozen=True)
class AllReduceStep:
    """One rank's part of an all-reduce: ``all_reduce`` (sum, in place) of ``(block, ranks of
    its group)`` per group it belongs to, in the global order of the groups."""

    entries: tuple[tuple[str, tuple[int, ...]], ...]

    @classmethod
    def of(cls, part: AllReducePart) -> AllReduceStep:
        """The step of a part, each group's ranks listed (a rank's own lowering describes them:
        ``new_group`` takes a list, O(the group) here, from the group's runs)."""
        return cls(tuple((name, listed_ranks(ranks)) for name, ranks in part.entries))

    @property
    def rank_sets(self) -> list[tuple[int, ...]]:
        """The ranks of each group the step's collectives run on."""
        return [ranks for _, ranks in self.entries]


@dataclass(frozen=True)
class BroadcastStep:
    """One rank's part of a broadcast (``reduce=False``) or sum-reduce (``reduce=True``): per
    group (``ranks[0]`` the root, whole blocks), a ``broadcast`` from the root's block into new
    blocks of the copies, or a ``reduce`` of the copies into a new root block; then the blocks
    the node drops are dropped and those it creates but no group fills are zeros."""

    groups: tuple[RootedGroup, ...]
    rank: int
    dropped: tuple[str, ...]
    created: tuple[Block, ...]
    reduce: bool

    @classmethod
    def of(cls, part: RootedPart) -> BroadcastStep:
        return cls(tuple(part.groups), part.rank, tuple(part.dropped), tuple(part.created), part.reduce)

    @property
    def rank_sets(self) -> list[tuple[int, ...]]:
        """The ranks of each group the step's collectives run on."""
        return [tuple(group.ranks) for group in self.groups]


@dataclass(frozen=True)
class AllToAllStep:
    """One rank's part of a copying plan in which every worker gives at most one block and gets
    at most one (a repartition, scatter, gather or all-gather): the boxes of its one old block
    ``source`` sent to each peer (``sends``), the boxes of its one new block ``target`` received
    from each peer (``receives``), at most one box per peer each way; the old block is dropped.

    Run as one ``all_to_all_single`` over the group: the boxes packed in peer order into one
    buffer (or sent straight from the block when they lie one after the other in its memory,
    as rows do), received likewise (straight into the new block when its boxes are consecutive
    rows), with uneven split sizes. In the maths: the plan's copy ``y[box_j] = x_j[box]`` for
    every piece; its adjoint (another plan of the same kind) sends the boxes back."""

    source: str | None
    target: Block | None
    sends: tuple[Box, ...]
    receives: tuple[Box, ...]

    @classmethod
    def of(cls, part: AllToAllPart) -> AllToAllStep:
        return cls(part.source, part.target, tuple(part.sends), tuple(part.receives))

    @property
    def rank_sets(self) -> list[tuple[int, ...]]:
        """No sub-group: the one ``all_to_all_single`` runs over the whole group."""
        return []

    @property
    def covered(self) -> bool:
        """Whether the received boxes fill the new block (else it starts as zeros)."""
        if self.target is None:
            return True
        total = 0
        for _, _, shape in self.receives:
            count = 1
            for n in shape:
                count *= n
            total += count
        return total == self.target.size


def _line(members: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A line's ranks listed in coordinate order, and each one's rank in the line's sub-group
    (whose ranks are in increasing order)."""
    listed = tuple(members)
    rank_of = {rank: position for position, rank in enumerate(sorted(listed))}
    return listed, tuple(rank_of[rank] for rank in listed)


@dataclass(frozen=True)
class _LineStep:
    """The fields of a step whose group is one line of the partition (:class:`GatherStep`,
    :class:`ReduceScatterStep`): the rank's blocks ``source`` and ``target`` (None on a rank
    outside the layout), the line's ranks ``members`` in coordinate order along ``axis``, each
    one's rank in the line's sub-group ``positions[k]``, and the node's point-to-point program
    ``fallback``."""

    source: str | None
    target: Block | None
    members: tuple[int, ...]
    axis: int
    positions: tuple[int, ...]
    fallback: Any = field(compare=False, repr=False)

    @staticmethod
    def fields_of(
        part: LineGatherPart | LineReduceScatterPart,
    ) -> tuple[str | None, Block | None, tuple[int, ...], int, tuple[int, ...], Any]:
        """These fields of a line's part, in order (a subclass's own field follows)."""
        members, positions = _line(part.members)
        return part.source, part.target, members, part.axis, positions, part.fallback

    @property
    def rank_sets(self) -> list[tuple[int, ...]]:
        """The line's ranks (its sub-group)."""
        return [self.members]


@dataclass(frozen=True)
class GatherStep(_LineStep):
    """One rank's part of an all-gather (``reduce=False``) or reduce-scatter (``reduce=True``)
    along one axis of equal shares: its group is one line of the partition, ``members`` the
    line's ranks in coordinate order (member ``k`` owns entries ``[k n, (k + 1) n)`` of the
    gathered block along ``axis``).

    Run as one ``all_gather_into_tensor`` (the rank's block ``source`` into the gathered block
    ``target``) or one ``reduce_scatter_tensor`` (the gathered block ``source``, summed over the
    line, scattered into the rank's block ``target``) on the cached sub-group of the line. In
    the maths: the all-gather copies ``g[share k] = x_k`` for every member ``k`` on every
    member; its adjoint, the reduce-scatter, gives member ``k`` the sum over the line of
    ``g[share k]``. ``source`` and ``target`` are None on a rank outside the layout.

    ``positions[k]`` is member ``k``'s rank in the line's sub-group (whose ranks are in
    increasing order): the collectives order shares by it, the partition by coordinate.
    ``fallback`` gives the rank's schedule of the node's point-to-point program (built on
    first use), run instead where the collective is slower
    (:attr:`~linop.backends.torch_distributed.group.GroupContext.native_gathers`)."""

    reduce: bool

    @classmethod
    def of(cls, part: LineGatherPart) -> GatherStep:
        return cls(*_LineStep.fields_of(part), part.reduce)

    @property
    def in_order(self) -> bool:
        """Whether the members' coordinates and their ranks in the sub-group agree."""
        return all(k == position for k, position in enumerate(self.positions))


@dataclass(frozen=True)
class ReduceScatterStep(_LineStep):
    r"""One rank's part of a reduce-scatter along one axis of uneven shares (some may be empty):
    its group is one line of the partition, ``members`` the line's ranks in coordinate order,
    member ``k`` owning ``shares[k]`` entries along ``axis`` of the gathered block, after
    those of members ``0 .. k - 1``.

    Run as one ``reduce_scatter`` on the cached sub-group of the line: the gathered block
    ``source`` cut into its shares, listed in the sub-group's rank order (``positions[k]`` is
    member ``k``'s), summed over the line, member ``k`` receiving its own share into its block
    ``target``. In the maths: :math:`x_k = \sum_{j \in \text{line}} g_j[o_k : o_k + n_k]`
    along ``axis``; its adjoint, the all-gather of the same shares, is another node (one
    all-to-all). ``source`` and ``target`` are None on a rank outside the layout. As for
    :class:`GatherStep`, ``fallback`` gives the node's point-to-point program, run where the
    collectives are slower (:attr:`~linop.backends.torch_distributed.group.GroupContext.native_gathers`)."""

    shares: tuple[int, ...]

    @classmethod
    def of(cls, part: LineReduceScatterPart) -> ReduceScatterStep:
        return cls(*_LineStep.fields_of(part), part.shares)


TorchStep = AllReduceStep | BroadcastStep | AllToAllStep | GatherStep | ReduceScatterStep
"""The torch.distributed executor's steps: each runs one fast-path part with its collectives."""

CALLS: Final[Mapping[type, Callable[[Any], TorchStep]]] = MappingProxyType(
    {
        AllReducePart: AllReduceStep.of,
        RootedPart: BroadcastStep.of,
        LineGatherPart: GatherStep.of,
        LineReduceScatterPart: ReduceScatterStep.of,
        AllToAllPart: AllToAllStep.of,
    }
)
"""Part type (:data:`linop.program.parts.Part`) -> the torch step that runs it. The mapped parts
(:class:`~linop.program.parts.MappedAllReducePart`, :class:`~linop.program.parts.MappedRootedPart`)
have no row: a plan under a worker map runs the portable program, and so does a rank whose part
holds any part type without a row."""


def _translate(
    schedule: tuple[Any, ...], found: list[tuple[int, ...]], calls: Mapping[type, Callable[[Any], TorchStep]]
) -> tuple[Any, ...] | None:
    """A rank schedule with every fast-path part replaced by its torch step (its row of
    ``calls``; collecting the rank sets of its groups), or None when some part's type has no
    row (the rank's part is then portable)."""
    out: list[Any] = []
    for step in schedule:
        if isinstance(step, RankBranches):
            terms = []
            for term in step.terms:
                translated = _translate(term, found, calls)
                if translated is None:
                    return None
                terms.append(translated)
            out.append(RankBranches(tuple(terms), step.names))
        elif isinstance(step, RankPart):
            call = calls.get(type(step))
            if call is None:
                return None
            mine = call(step)
            for ranks in mine.rank_sets:
                key = tuple(sorted(ranks))
                if len(key) > 1 and key not in found:
                    found.append(key)
            out.append(mine)
        else:
            out.append(step)
    return tuple(out)


def native_program(
    op: LinearOperator,
    rank: int,
    program: RankProgram | None = None,
    calls: Mapping[type, Callable[[Any], TorchStep]] | None = None,
) -> tuple[RankProgram, tuple[tuple[int, ...], ...]] | None:
    """``rank``'s native program (compiled for this rank alone; ``program``: already compiled,
    :func:`~linop.program.compile_for_rank` of ``op`` and ``rank``) and the rank sets of its
    own collectives' groups, or None when its part holds a fast-path part whose type has no row
    in ``calls`` (default :data:`CALLS`, read at the call). Only every rank's agreement
    (:func:`agree_native`) makes it run."""
    if program is None:
        program = compile_for_rank(op, rank)
    found: list[tuple[int, ...]] = []
    schedule = _translate(program.schedule, found, CALLS if calls is None else calls)
    if schedule is None:
        return None
    return RankProgram(schedule, program.max_worker), tuple(found)


def agree_native(
    local: tuple[tuple[int, ...], ...] | None, size: int, *, world: bool, reduce_max: Any, gather: Any
) -> tuple[tuple[int, ...], ...] | None:
    """Whether every rank runs its native program, and then the sorted union of every rank's
    sub-group rank sets (each rank creates them all, in that order), else None.

    ``local`` is this rank's rank sets (None: its part is not native). Collective: one
    ``reduce_max`` (the maximum over ranks of a short int64 vector) says whether some rank is
    not native and whether some rank needs sub-groups; only then ``gather`` (an
    ``all_gather_object``) collects the rank sets. Off the world group, only collectives over
    the whole group are native (a sub-group would need every world rank)."""
    import numpy as np

    if local is not None and not world and any(len(ranks) not in (1, size) for ranks in local):
        local = None
    sets = () if local is None else tuple(r for r in local if 1 < len(r) < size)
    flags = np.array([local is None, bool(sets)], dtype=np.int64)
    if size > 1:
        flags = reduce_max(flags)
    if flags[0]:
        return None
    if not flags[1]:
        return ()
    every = gather(sets) if size > 1 else [sets]
    return tuple(sorted({ranks for mine in every for ranks in mine}))


def identity_map(size: int) -> WorkerMap:
    """Worker ``w`` on rank ``w`` of a group of ``size`` ranks, described by its rule (O(1)
    whatever ``size``; equal to the table ``WorkerMap(range(size))``)."""
    return WorkerMap.blocked(size, size)


def portable_program(
    op: LinearOperator, mapping: WorkerMap, rank: int, size: int
) -> tuple[RankProgram | None, LinopError | None]:
    """``rank``'s portable program under ``mapping`` on ``size`` ranks, or the error to raise
    on every rank (a worker unmapped or beyond the group).

    Planned per rank as every executor plans under a map
    (:meth:`linop.program.mapped.MappedCompiled.for_rank`, kept once per process per tree and
    map), without a table of calls: a tree whose nodes lower per worker from
    the rank's workers' part only (O(its own work)), other trees projected from the global
    portable program. Either way the schedule equals the projection of the global portable
    program (:func:`~linop.program.mapped_global_program` with ``mapped_fast_paths=False``)."""
    return compiled_for(op, mapping).for_rank(rank, size)


class Compiled:
    """A tree's programs for one rank of a group of ``size`` ranks (see the module docstring):
    this rank's native candidate (None when its part does not allow it), the portable program
    (built on first use), or the error compiling raised.

    Attributes
    ----------
    max_worker : int
        The largest worker the tree names (the group must have more ranks).
    local_sets : tuple of tuple of int
        The ranks of this rank's own native collectives' groups.

    ``calls``: the table of calls (default :data:`CALLS`); a rank whose part holds a part type
    without a row has no native candidate.
    """

    def __init__(
        self,
        op: LinearOperator,
        rank: int,
        size: int,
        *,
        world: bool,
        calls: Mapping[type, Callable[[Any], TorchStep]] | None = None,
    ) -> None:
        self.op, self.rank, self.size, self.world = op, rank, size, world
        self.native: RankProgram | None = None
        self.local_sets: tuple[tuple[int, ...], ...] = ()
        self.problem: LinopError | None = None
        self._portable: RankProgram | None = None
        self.max_worker = max(op.domain.max_worker, op.range.max_worker)
        try:
            program = compile_for_rank(op, rank)  # the rank's own part: O(its own work)
            self.max_worker = max(self.max_worker, program.max_worker)
            found = native_program(op, rank, program, calls)
            if found is not None:
                self.native, self.local_sets = found
            elif self.max_worker < size:  # else the plan reports the group too small
                self.portable()  # planned now, so that a compile error is the check's
        except Exception as error:  # raised collectively by the entry check
            self.native = None
            self.problem = (
                error
                if isinstance(error, LinopError)
                else UnsupportedNodeError(
                    f"the torch.distributed executor cannot compile {op}: {type(error).__name__}: {error}"
                )
            )

    def portable(self) -> RankProgram:
        """The portable program (worker ``w`` on rank ``w``; the group covers the workers)."""
        if self._portable is None:
            program, problem = portable_program(self.op, identity_map(self.size), self.rank, self.size)
            if problem is not None:
                raise problem
            assert program is not None
            self._portable = program
        return self._portable
