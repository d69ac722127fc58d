"""The MPI calls of the rooted groups' parts (:mod:`linop.program.lowering_rooted` plans
them): :class:`~linop.collectives.Broadcast` (``Bcast`` per source block) and
:class:`~linop.collectives.SumReduce` (``Allreduce`` per target block; bound, a large block over
a few ranks as messages, :mod:`~linop.backends.mpi.native.reduce_messages`), each on a cached
sub-communicator; under a worker map the copies a rank holds are filled or summed locally
around one collective over the group's distinct ranks."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from ....program.parts import MappedRootedPart, RootedGroup, RootedPart
from ....space import Block
from ...host_schedule import root_buffer, store_results
from ..context import subcommunicator
from ..datatypes import element_type, mpi, predefined_type
from ..memory import lasting_array, new_array
from ..runtime import run_schedule
from ..steps import OutOfPlaceBinding, RankStep
from .common import REDUCIBLE
from .reduce_messages import bind_reduce, by_messages

if TYPE_CHECKING:  # pragma: no cover - mpi4py is optional at run time
    from mpi4py.MPI import Intracomm

    from ...numpy import Workspace

__all__ = ["rank_rooted", "rank_mapped_rooted"]


def _refuses(
    reduce: bool, arrays: dict[str, np.ndarray], dtype: np.dtype, created: tuple[Block, ...]
) -> bool:
    """True when a rooted step cannot bind ``arrays`` out of place: a sum in a dtype MPI does
    not reduce, an array of another dtype or not C-contiguous, or an empty new block."""
    return (
        (reduce and dtype.char not in REDUCIBLE)
        or any(a.dtype != dtype or not a.flags.c_contiguous for a in arrays.values())
        or any(b.size == 0 for b in created)
    )


def _placeholders(
    created: tuple[Block, ...], dtype: np.dtype, dropped: tuple[str, ...], taken: Mapping[str, np.ndarray]
) -> OutOfPlaceBinding:
    """A dry binding: the results' names and shapes (untouched memory; the caller's arrays
    the binding would take, :func:`_take`), nothing bound."""
    return OutOfPlaceBinding(
        results={b.name: _result_array(taken, b.name, b.shape, dtype, np.empty) for b in created},
        dropped=dropped,
    )


def _take(
    out: Mapping[str, np.ndarray] | None, names: Iterator[tuple[str, tuple[int, ...]]], dtype: np.dtype
) -> dict[str, np.ndarray]:
    """The caller's result arrays (``bind(..., out=)``) a rooted binding takes: those given for
    the ``(name, shape)`` blocks it would otherwise build and whose every entry each call
    writes (a non-root's received copy, a root's sum), when of that shape and ``dtype``."""
    if not out:
        return {}
    taken = {}
    for name, shape in names:
        array = out.get(name)
        if array is not None and array.shape == shape and array.dtype == dtype:
            taken[name] = array
    return taken


def _result_array(
    taken: Mapping[str, np.ndarray],
    name: str,
    shape: tuple[int, ...],
    dtype: np.dtype,
    build: Callable[..., np.ndarray] = lasting_array,
) -> np.ndarray:
    """Block ``name``'s result array: the caller's one taken for it, else one built."""
    return taken[name] if name in taken else build(shape, dtype)


class _Member(NamedTuple):
    """This rank in one rooted group: the group, its sub-communicator (None for a group on one
    rank), the copies this rank holds, and whether this rank is the root's."""

    group: RootedGroup
    sub: Intracomm | None
    mine: list[str]
    is_root: bool


@dataclass
class _RankBroadcast(RankStep):
    """One rank's part of a broadcast or sum-reduce (:class:`~linop.program.parts.RootedPart`)."""

    part: RootedPart

    def _mine(self) -> list[list[str]]:
        """Per group, the copies this rank holds: found once (a 1 -> P group lists P copies),
        not on every call."""
        found = self.__dict__.get("_mine_of_groups")
        if found is None:
            found = [group.copy_on(self.part.rank) for group in self.part.groups]
            self.__dict__["_mine_of_groups"] = found
        return found

    def run(self, work: Workspace, comm: Intracomm, dtype: np.dtype) -> None:
        if self.part.reduce and dtype.char not in REDUCIBLE:
            run_schedule(self.part.fallback.schedule(), work, comm, dtype)
            return
        lib = mpi()
        results: list[tuple[str, np.ndarray, bool]] = []
        for member in self._members(comm):  # blocking, in the global order of the groups
            if self.part.reduce:
                self._reduce(member, work, dtype, results, lib)
            else:
                self._broadcast(member, work, dtype, results)
        store_results(work, self.part.dropped, results, self.part.created)

    def reads(self) -> tuple[str, ...]:
        """A sum-reduce reads the copies this rank holds; a broadcast the roots it holds."""
        if self.part.reduce:
            return tuple(name for mine in self._mine() for name in mine)
        return tuple(group.root_name for group in self.part.groups if group.ranks[0] == self.part.rank)

    def bind_out_of_place(
        self,
        arrays: dict[str, np.ndarray],
        comm: Intracomm,
        dtype: np.dtype,
        *,
        dry: bool = False,
        out: Mapping[str, np.ndarray] | None = None,
    ) -> OutOfPlaceBinding | None:
        """Persistent ``Bcast_init`` / ``Allreduce_init`` requests between the bound input
        arrays and result arrays built once, or None when the dtype or layout does not allow
        it (``dry``: decide only, create nothing). A sum of a large block over a few ranks is
        messages instead, a reduce-scatter and a gather onto the root that copy nothing
        (:mod:`~linop.backends.mpi.native.reduce_messages`).

        The binding's results map each new block this rank owns to its array (the root's own
        broadcast copy is a read-only view of its source). ``out``: a non-root's copy and a
        root's sum are written straight into the caller's array given for them (each call
        writes all of it), the root's own copy is not (it is its source)."""
        if _refuses(self.part.reduce, arrays, dtype, self.part.created):
            return None
        for group in self.part.groups:
            root_has_copy = bool(group.copy_on(group.ranks[0]))
            if self.part.reduce and (not root_has_copy or len(group.ranks) == 1):
                return None  # would need zeros or a copy made on every call
        taken = _take(out, self._built(), dtype)
        if dry:
            return _placeholders(self.part.created, dtype, self.part.dropped, taken)
        lib = mpi()
        binding = OutOfPlaceBinding(dropped=self.part.dropped)  # filled as the groups are bound
        requests, results, scratch = binding.calls, binding.results, binding.scratch
        for group, sub, mine, is_root in self._members(comm):
            if not self.part.reduce:
                if is_root:
                    buffer = arrays[group.root_name]
                    if mine:
                        view = buffer.view()
                        view.flags.writeable = False
                        results[mine[0]] = view
                else:
                    buffer = _result_array(taken, mine[0], group.shape, dtype)
                    results[mine[0]] = buffer
                if sub is not None:
                    # persistent, typed by entry, 8 MB, each batch after calls of its own (see
                    # benchmarks/bench_mpi_collectives.py): 0.98-1.01x of a blocking Bcast on the
                    # same arrays on 2 ranks, 0.8-1.0x on 4 (oversubscribed); as bytes instead of
                    # typed made no difference beyond the noise (0.96-1.04x)
                    requests.append(sub.Bcast_init([buffer, buffer.size, element_type(dtype)], root=0))
                continue
            assert sub is not None  # a group of one was declined above
            copy = arrays[mine[0]]
            if by_messages(len(group.ranks), copy.nbytes):  # large, few ranks: no copy of the block
                total = _result_array(taken, group.root_name, group.shape, dtype) if is_root else None
                calls, made, buffers = bind_reduce(sub, copy, total, dtype)
                requests.extend(calls)
                binding.requests.extend(made)
                scratch.extend(buffers)
                if total is not None:
                    results[group.root_name] = total
                continue
            total = (
                _result_array(taken, group.root_name, group.shape, dtype)
                if is_root
                else lasting_array(group.shape, dtype)
            )
            mpi_type = predefined_type(dtype)
            requests.append(sub.Allreduce_init([copy, mpi_type], [total, mpi_type], op=lib.SUM))
            if is_root:
                results[group.root_name] = total
            else:  # the request writes into it on every call: kept alive with the binding
                scratch.append(total)
        return binding

    def _built(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        """The blocks this rank's binding builds and every call writes whole, with their shapes:
        per group, a non-root's copy of a broadcast, the root's sum of a sum-reduce."""
        for group, mine in zip(self.part.groups, self._mine()):
            is_root = group.ranks[0] == self.part.rank
            if self.part.reduce and is_root:
                yield group.root_name, group.shape
            elif not self.part.reduce and not is_root and mine:
                yield mine[0], group.shape

    def _members(self, comm: Intracomm) -> Iterator[_Member]:
        """This rank in each of the part's groups, in the global order of the groups."""
        for group, mine in zip(self.part.groups, self._mine()):
            sub = subcommunicator(comm, group.ranks) if len(group.ranks) > 1 else None
            yield _Member(group, sub, mine, group.ranks[0] == self.part.rank)

    def _broadcast(
        self, member: _Member, work: Workspace, dtype: np.dtype, results: list[tuple[str, np.ndarray, bool]]
    ) -> None:
        """Root: send its block as it is (it also becomes the root's own copy, uncopied);
        others: receive into a new block."""
        group, sub, mine, is_root = member
        if is_root:
            buffer, owned = root_buffer(work, group.root_name, dtype)
            if mine:
                results.append((mine[0], buffer, owned))
        else:
            buffer = new_array(group.shape, dtype)  # recycled memory: no page faults per call
            results.append((mine[0], buffer, True))
        if sub is not None and buffer.size:
            sub.Bcast([buffer, buffer.size, element_type(dtype)], root=0)

    def _reduce(
        self,
        member: _Member,
        work: Workspace,
        dtype: np.dtype,
        results: list[tuple[str, np.ndarray, bool]],
        lib: Any,
    ) -> None:
        """Every member adds its copy with ``Allreduce``: on this MPICH it reaches the sum
        faster than ``Reduce`` (see benchmarks/bench_mpi_collectives.py); non-roots discard it."""
        group, sub, mine, is_root = member
        mpi_type = predefined_type(dtype)
        total = new_array(group.shape, dtype)  # recycled memory: no page faults per call
        if mine:
            send = work.arrays[mine[0]]
            if send.dtype != dtype or not send.flags.c_contiguous:
                send = np.ascontiguousarray(send, dtype=dtype)
        else:  # the root holds no copy: it contributes zeros
            total.fill(0)
            send = None
        if sub is not None and total.size:
            if send is None:
                sub.Allreduce(lib.IN_PLACE, [total, mpi_type], op=lib.SUM)
            else:
                sub.Allreduce([send, mpi_type], [total, mpi_type], op=lib.SUM)
        elif send is not None:
            np.copyto(total, send)
        if is_root:
            results.append((group.root_name, total, True))


# -- broadcast and sum-reduce under a worker map --------------------------------------------------
@dataclass
class _RankMappedRooted(RankStep):
    """One rank's part of a broadcast or sum-reduce under a worker map, per group it takes
    part in (in the global order of the groups).

    Broadcast: the root's rank sends its block with one ``Bcast`` over the group's distinct
    ranks (none when the group lives on one rank); a rank's copies are the block it received
    (several copies on one rank share one read-only buffer, copied only by a later step that
    writes one, as the root's own copy is its source, read-only). Sum-reduce: a rank adds the copies it holds (zeros when it holds
    none), one ``Allreduce`` over the distinct ranks adds the ranks' partial sums, and the
    root's rank keeps the total as the root block. The same sums as the expansion's adds, in
    another order (exact for integers)."""

    part: MappedRootedPart

    def run(self, work: Workspace, comm: Intracomm, dtype: np.dtype) -> None:
        if self.part.reduce and dtype.char not in REDUCIBLE:
            run_schedule(self.part.fallback(), work, comm, dtype)
            return
        lib = mpi()
        results: list[tuple[str, np.ndarray, bool]] = []
        for group in self.part.groups:  # blocking, in the global order of the groups
            sub = subcommunicator(comm, group.ranks) if len(group.ranks) > 1 else None
            if self.part.reduce:
                total = new_array(group.shape, dtype)
                _local_sum(total, [work.arrays[name] for name in group.copies])
                if sub is not None and total.size:
                    sub.Allreduce(lib.IN_PLACE, [total, predefined_type(dtype)], op=lib.SUM)
                if group.is_root:
                    results.append((group.root_name, total, True))
                continue
            if group.is_root:
                buffer, owned = root_buffer(work, group.root_name, dtype)
            else:
                buffer, owned = new_array(group.shape, dtype), True
            if sub is not None and buffer.size:
                sub.Bcast([buffer, buffer.size, element_type(dtype)], root=0)
            shared = owned and len(group.copies) == 1  # several copies: one read-only buffer
            results.extend((name, buffer, shared) for name in group.copies)
        store_results(work, self.part.dropped, results, self.part.created)

    def bind_out_of_place(
        self,
        arrays: dict[str, np.ndarray],
        comm: Intracomm,
        dtype: np.dtype,
        *,
        dry: bool = False,
        out: Mapping[str, np.ndarray] | None = None,
    ) -> OutOfPlaceBinding | None:
        """Per group one collective (a blocking in-place ``Allreduce`` of the local sum, a
        persistent ``Bcast_init``) between the bound arrays and result arrays built once,
        with the local copies or sums around it, or None when the dtype or layout does
        not allow it (``dry``: decide only, create nothing). ``out``: a root's sum and a
        non-root's only copy of a group are written straight into the caller's array given
        for them (each call writes all of it); copies sharing one buffer are not."""
        if _refuses(self.part.reduce, arrays, dtype, self.part.created):
            return None
        taken = _take(out, self._built(), dtype)
        if dry:
            return _placeholders(self.part.created, dtype, self.part.dropped, taken)
        lib = mpi()
        binding = OutOfPlaceBinding(dropped=self.part.dropped)  # filled as the groups are bound
        calls, results, scratch = binding.calls, binding.results, binding.scratch
        for group in self.part.groups:
            sub = subcommunicator(comm, group.ranks) if len(group.ranks) > 1 else None
            if self.part.reduce:
                total = _result_array(taken, group.root_name, group.shape, dtype, np.empty)
                calls.append(functools.partial(_local_sum, total, [arrays[name] for name in group.copies]))
                if sub is not None and total.size:
                    calls.append(
                        functools.partial(
                            sub.Allreduce, lib.IN_PLACE, [total, predefined_type(dtype)], op=lib.SUM
                        )
                    )
                if group.is_root:
                    results[group.root_name] = total
                else:  # the calls write into it on every call: kept alive with the binding
                    scratch.append(total)
                continue
            if group.is_root:
                buffer = arrays[group.root_name]
            else:  # the caller's array only for a group's one copy here (not a shared buffer)
                buffer = _result_array(taken, group.copies[0], group.shape, dtype, np.empty)
            if sub is not None and buffer.size:
                calls.append(sub.Bcast_init([buffer, buffer.size, element_type(dtype)], root=0))
            if group.is_root or len(group.copies) > 1:  # the root's source, or one buffer shared
                view = buffer.view()
                view.flags.writeable = False
                results.update((name, view) for name in group.copies)
                if not group.is_root:  # written by every call: kept alive with the binding
                    scratch.append(buffer)
            else:
                results[group.copies[0]] = buffer
        return binding

    def _built(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        """As :meth:`_RankBroadcast._built`: per group, the root's sum of a sum-reduce, or a
        non-root's copy of a broadcast when it is the group's only copy here."""
        for group in self.part.groups:
            if self.part.reduce and group.is_root:
                yield group.root_name, group.shape
            elif not self.part.reduce and not group.is_root and len(group.copies) == 1:
                yield group.copies[0], group.shape


def _local_sum(total: np.ndarray, copies: Sequence[np.ndarray]) -> None:
    """``total`` = the sum of ``copies`` (zeros when there is none)."""
    if not copies:
        total.fill(0)
    elif len(copies) == 1:
        np.copyto(total, copies[0])
    else:  # the first add writes the total: one pass over memory per copy after the first
        np.add(copies[0], copies[1], out=total)
        for other in copies[2:]:
            np.add(total, other, out=total)


def rank_rooted(part: RootedPart) -> RankStep:
    """The MPI step of a broadcast's or sum-reduce's part."""
    return _RankBroadcast(part)


def rank_mapped_rooted(part: MappedRootedPart) -> RankStep:
    """The MPI step of a mapped broadcast's or sum-reduce's part."""
    return _RankMappedRooted(part)
