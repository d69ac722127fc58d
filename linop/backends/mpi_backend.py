"""The MPI interpreter: apply an operator tree across the ranks of a communicator.

Every rank builds the same tree and holds only its own blocks: worker ``w`` of the tree runs on
rank ``w`` of the communicator (ranks beyond the tree's workers take part in the checks and
hold nothing). The result on each rank is that rank's blocks of the range, equal to the numpy
interpreter's blocks for that worker.

How a call runs
---------------
1. :func:`compile` (cached per tree and communicator) lowers the tree into a global program
   and projects it onto this rank (:mod:`linop.backends.mpi_schedule`). Point-to-point moves
   are batched into phases of nonblocking receives (posted first) and sends and one wait, so
   no schedule can deadlock.
2. One small ``Allreduce`` checks, before any data moves, that every rank holds the same tree
   (a 128-bit fingerprint), that the communicator covers the tree's workers and that every
   rank's local blocks are right; it also agrees on the dtype of the run. When anything is
   wrong, every rank raises the same typed error (:class:`linop.errors.MPIError` and its subclasses).
3. The rank executes its schedule. Local steps use the numpy interpreter's handlers on a
   copy-on-write workspace, so caller arrays are never mutated (unless ``inplace=True``).
   Data moves straight from and into the blocks: contiguous regions as they are, strided
   boxes through cached MPI subarray datatypes; only thin boxes (contiguous runs shorter than
   :data:`PACK_BELOW` bytes, e.g. column strips) are packed with numpy, which is faster.
   Collectives and halo exchanges take the fast paths of :mod:`linop.backends.mpi_fastpaths`.
4. If a rank nevertheless fails during execution (a bug, or a user kernel raising), it prints
   its error and calls ``MPI_Abort``: its peers may be waiting for its messages, and ending
   the job is the only way not to hang it.

:meth:`Plan.bind` goes one step further for repeated application (a halo exchange in a time
loop): it checks once, then builds persistent requests on the caller's arrays (and, out of
place, on result arrays built once), so each call is ``Startall`` and ``Waitall`` and nothing
else.

Worker-to-rank mapping: identity. To place workers elsewhere, build the tree on the ranks you
want (e.g. ``Partition(shape, workers=...)``) or pass a communicator whose rank order is the
mapping (``comm.Split(0, key=...)``).

mpi4py is imported only when a function of this module runs.
"""

from __future__ import annotations

import sys
import traceback
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import (
    CommunicatorError,
    DistributedStateError,
    LinopError,
    MPIError,
    TreeMismatchError,
    UnsupportedNodeError,
)
from ..operator import LinearOperator, Scaled, walk
from ..space import Region, State
from . import (
    mpi_fastpaths,  # noqa: F401 - registers the fast paths' lowerings
    numpy_backend,
)
from .mpi_schedule import (
    Program,
    RankBranches,
    RankPhase,
    RankZero,
    Scale,
    compile_program,
    fingerprint,
    lowering,
)

__all__ = ["apply", "compile", "Plan", "BoundPlan", "lowering", "DTYPE_CHARS", "PACK_BELOW"]

DTYPE_CHARS = "bBhHiIlLqQefdgFDG"
"""The numeric dtypes (numpy type characters) that the interpreter moves."""


_MPI: Any = None


def _mpi() -> Any:
    """The mpi4py ``MPI`` module, imported on first use."""
    global _MPI
    if _MPI is None:
        try:
            from mpi4py import MPI
        except ImportError as error:  # pragma: no cover - the test environment has mpi4py
            raise ImportError("the MPI interpreter needs mpi4py: pip install 'linop[mpi]'") from error
        _MPI = MPI
    return _MPI


# -- datatypes ------------------------------------------------------------------------------
_BYTES: dict[str, Any] = {}
_SUBARRAYS: dict[tuple, Any] = {}


def _element(dtype: np.dtype) -> Any:
    """The MPI datatype of one entry: the predefined type of the dtype when MPI has one (the
    datatype engine moves those fastest), else ``itemsize`` raw bytes (data moves between
    identical machines, so no conversion is needed)."""
    element = _BYTES.get(dtype.char)
    if element is None:
        mpi = _mpi()
        try:
            element = mpi.Datatype.fromcode(dtype.char)
        except (KeyError, ValueError):
            element = mpi.BYTE.Create_contiguous(dtype.itemsize).Commit()
        if element.Get_size() != dtype.itemsize:
            element = mpi.BYTE.Create_contiguous(dtype.itemsize).Commit()
        _BYTES[dtype.char] = element
    return element


def _subarray(shape: tuple[int, ...], start: tuple[int, ...], sub: tuple[int, ...], dtype: np.dtype) -> Any:
    """A cached, committed subarray datatype for a box of a C-ordered array."""
    key = (shape, start, sub, dtype.char)
    datatype = _SUBARRAYS.get(key)
    if datatype is None:
        datatype = _element(dtype).Create_subarray(list(shape), list(sub), list(start)).Commit()
        _SUBARRAYS[key] = datatype
    return datatype


PACK_BELOW = 512
"""Boxes whose contiguous runs are shorter than this many bytes (thin column strips) are
packed with numpy into a contiguous buffer: measured faster here than MPI's datatype engine
walking thousands of tiny runs. Longer runs move through subarray datatypes, unpacked."""


def _contiguous_run(shape: tuple[int, ...], extents: tuple[int, ...], itemsize: int) -> int:
    """Bytes in one contiguous run of a box of a C-ordered array."""
    run = itemsize
    for n, e in zip(reversed(shape), reversed(extents)):
        run *= e
        if e != n:
            break
    return run


def _region_spec(array: np.ndarray, region: Region, index: tuple | None = None) -> Any:
    """An MPI buffer spec for ``array[region.index]`` without copying, or None when the box
    is better (or can only be) packed into a buffer."""
    view = array[(*region.index, Ellipsis) if index is None else index]  # a view even for integers
    if view.flags.c_contiguous:
        return [view, view.nbytes, _mpi().BYTE]
    if array.flags.c_contiguous:
        extents = tuple(b - a for a, b in zip(region.start, region.stop))
        if _contiguous_run(array.shape, extents, array.itemsize) < PACK_BELOW:
            return None
        return [array, 1, _subarray(array.shape, region.start, extents, array.dtype)]
    return None


def _read_only(array: np.ndarray) -> np.ndarray:
    """A read-only view: how a caller's array passed through comes back."""
    view = array.view()
    view.flags.writeable = False
    return view


def _raw(array: np.ndarray) -> Any:
    return [array, array.nbytes, _mpi().BYTE]


# -- communicators and plans ----------------------------------------------------------------
class _Context:
    """Per user communicator: a private duplicate (our messages never meet the user's) and the
    plans compiled for it."""

    def __init__(self, comm: Any) -> None:
        self.user = comm
        self.comm = comm.Dup()
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.by_id: dict[int, tuple[weakref.ref, Plan]] = {}
        self.by_tree: dict[tuple[LinearOperator, tuple[type, ...]], Plan] = {}


_CONTEXTS: dict[int, tuple[weakref.ref, int, _Context]] = {}


def _context(comm: Any) -> _Context:
    """The context of a user communicator: found by the Python object (weakly held) and its
    handle, so that a freed communicator whose handle MPI reuses never finds a stale one."""
    mpi = _mpi()
    comm = mpi.COMM_WORLD if comm is None else comm
    handle = mpi.Comm.py2f(comm)
    if handle == mpi.Comm.py2f(mpi.COMM_NULL):
        raise CommunicatorError("the communicator is MPI.COMM_NULL (freed, or this rank is not in it)")
    key = id(comm)
    entry = _CONTEXTS.get(key)
    if entry is not None and entry[0]() is comm and entry[1] == handle:
        return entry[2]
    context = _Context(comm)
    _CONTEXTS[key] = (weakref.ref(comm, lambda _ref, key=key: _CONTEXTS.pop(key, None)), handle, context)
    return context


def compile(op: LinearOperator, *, comm: Any = None) -> Plan:
    """The plan of ``op`` on ``comm`` (default ``MPI.COMM_WORLD``), compiled once and cached.

    Compiling is local (no communication), except that the first use of a communicator
    duplicates it (``MPI_Comm_dup``, collective), so that linop's messages never meet the
    caller's; the first application checks collectively that every rank compiled the same
    tree. The cache holds the tree object (by identity) and structurally equal trees whose
    scalars have the same types (``==`` alone would take ``2 * A`` for ``2.0 * A``, whose
    results have another dtype).
    """
    context = _context(comm)
    entry = context.by_id.get(id(op))
    if entry is not None and entry[0]() is op:
        return entry[1]
    tree_key = (op, tuple(type(node.alpha) for node in walk(op) if isinstance(node, Scaled)))
    plan = context.by_tree.get(tree_key)
    if plan is None:
        plan = context.by_tree[tree_key] = Plan(op, context)
    key = id(op)
    context.by_id[key] = (weakref.ref(op, lambda _ref, key=key, ids=context.by_id: ids.pop(key, None)), plan)
    return plan


def apply(
    op: LinearOperator,
    local_state: Mapping[str, Any],
    *,
    comm: Any = None,
    inplace: bool = False,
    dtype: npt.DTypeLike | None = None,
) -> State:
    """Apply ``op`` across the ranks of ``comm``; collective.

    Parameters
    ----------
    op : LinearOperator
        The same tree on every rank.
    local_state : dict of str to array
        The blocks of ``op.domain`` that this rank owns (worker == rank), and no others.
    comm : mpi4py communicator, optional
        Default ``MPI.COMM_WORLD``; it must have more ranks than the tree's largest worker.
    inplace : bool, optional
        Write the result into the caller's arrays (domain must equal range).
    dtype : dtype, optional
        Dtype of newly allocated blocks; default the run's dtype: the common dtype of all
        ranks' blocks and the tree's scalars (data moves between ranks in the run's dtype).

    Returns
    -------
    dict of str to array
        This rank's blocks of ``op.range``.

    Raises
    ------
    TreeMismatchError, CommunicatorError, DistributedStateError, UnsupportedNodeError
        On every rank together, before any data moves.
    """
    return compile(op, comm=comm).apply(local_state, inplace=inplace, dtype=dtype)


class Plan:
    """A tree compiled for one communicator: the global program and this rank's schedule."""

    def __init__(self, op: LinearOperator, context: _Context) -> None:
        self.op = op
        self.context = context
        self.fingerprint = fingerprint(op)
        words = np.frombuffer(self.fingerprint, dtype=np.uint32).astype(np.int64)
        self._vector = np.concatenate([words, -words, np.zeros(1 + len(DTYPE_CHARS), dtype=np.int64)])
        self._dtypes: dict[bytes, np.dtype] = {}
        self.problem: MPIError | None = None
        self.program: Program | None = None
        self.schedule: tuple[Any, ...] = ()
        self.domain_blocks: dict[str, Any] = {}
        self.range_names: tuple[str, ...] = ()
        try:
            self.program = compile_program(op)
        except Exception as error:  # raised collectively by check(), after the fingerprint test
            self.problem = (
                error
                if isinstance(error, LinopError)
                else UnsupportedNodeError(
                    f"the MPI interpreter cannot compile {op}: {type(error).__name__}: {error}"
                )
            )
            return
        if self.program.max_worker >= context.size:
            self.problem = CommunicatorError(
                f"the tree names worker {self.program.max_worker} but the communicator has "
                f"{context.size} rank(s); run with at least {self.program.max_worker + 1} ranks"
            )
            return
        self.schedule = self.program.for_rank(context.rank)
        self.domain_blocks = {b.name: b for b in op.domain if b.worker == context.rank}
        self.range_names = tuple(b.name for b in op.range if b.worker == context.rank)

    @property
    def comm(self) -> Any:
        """The plan's private communicator (a duplicate of the user's)."""
        return self.context.comm

    # -- the collective check ---------------------------------------------------------------
    def _local_problem(self, state: Any, inplace: bool) -> str | None:
        rank = self.context.rank
        if not isinstance(state, Mapping):
            return f"rank {rank}: the local state must be a dict of arrays, not {type(state).__name__}"
        for name, block in self.domain_blocks.items():
            if name not in state:
                return f"rank {rank}: local state is missing block {name!r} {block.shape}"
        for name in state:
            if name not in self.domain_blocks:
                if name in self.op.domain:
                    owner = self.op.domain.block(name).worker
                    return f"rank {rank}: local state holds block {name!r}, which belongs to worker {owner}"
                return f"rank {rank}: local state holds block {name!r}, which the domain does not hold"
        for name, block in self.domain_blocks.items():
            array = state[name]
            if not isinstance(array, np.ndarray):
                return f"rank {rank}: block {name!r} is a {type(array).__name__}, not a numpy array"
            if array.shape != block.shape:
                return (
                    f"rank {rank}: block {name!r} has shape {array.shape}, the domain expects {block.shape}"
                )
            if array.dtype.char not in DTYPE_CHARS:
                return f"rank {rank}: block {name!r} has dtype {array.dtype}, which is not numeric"
            if inplace and not array.flags.writeable:
                return f"rank {rank}: in-place application needs a writeable array for block {name!r}"
        return None

    def check(self, state: Any, *, inplace: bool = False, dtype: npt.DTypeLike | None = None) -> np.dtype:
        """Collectively validate the tree and every rank's local state; return the run's dtype.

        One ``Allreduce`` (maximum) of a short integer vector: the fingerprint and its
        negation (so maximum and minimum agree only when every rank has the same tree), an
        error flag, and one flag per dtype present. A second collective, only when something
        is wrong, gathers the ranks' messages so that every rank raises the same error.
        """
        mpi = _mpi()
        problem = str(self.problem) if self.problem is not None else None
        if problem is None:
            problem = self._local_problem(state, inplace)
        if problem is None and inplace:
            if self.op.domain != self.op.range:
                problem = f"in-place application of {self.op}: domain and range differ"
        vector = self._vector.copy()  # fingerprint words and their negation, then flags
        present = vector[9:]
        if problem is None:
            for name in self.domain_blocks:
                present[DTYPE_CHARS.index(state[name].dtype.char)] = 1
        if dtype is not None:
            try:
                char = np.dtype(dtype).char
            except TypeError:
                char = None
            if char is not None and char in DTYPE_CHARS:
                present[DTYPE_CHARS.index(char)] = 1
            elif problem is None:
                problem = f"rank {self.context.rank}: dtype {dtype!r} is not a numeric dtype"
        vector[8] = problem is not None
        reduced = np.empty_like(vector)
        self.comm.Allreduce(vector, reduced, op=mpi.MAX)
        same_tree = bool(np.array_equal(reduced[:4], -reduced[4:8]))
        if not same_tree or reduced[8]:
            self._raise_collectively(same_tree, problem)
        key = reduced[9:].tobytes()
        run = self._dtypes.get(key)
        if run is None:
            chars = [c for c, flag in zip(DTYPE_CHARS, reduced[9:]) if flag]
            run = np.result_type(*chars) if chars else np.dtype(np.float64)
            for alpha in self.program.alphas:
                run = np.result_type(run, alpha)
            run = self._dtypes[key] = np.dtype(run)
        if inplace:  # decided from global facts only, so every rank decides alike
            narrow = [
                c
                for c, flag in zip(DTYPE_CHARS, reduced[9:])
                if flag and not np.can_cast(run, c, "same_kind")
            ]
            if narrow:
                raise DistributedStateError(
                    f"in-place application of {self.op} computes in {run}, which the callers' "
                    f"{np.dtype(narrow[0])} arrays cannot hold"
                )
        return run

    def _raise_collectively(self, same_tree: bool, problem: str | None) -> None:
        reports = self.comm.allgather((self.fingerprint, problem))
        if not same_tree:
            reference = reports[0][0]
            others = [r for r, (fp, _) in enumerate(reports) if fp != reference]
            raise TreeMismatchError(
                f"the ranks hold different operator trees: rank(s) {others} differ from rank 0 "
                "(every rank must build the same tree)"
            )
        messages = [(r, p) for r, (_, p) in enumerate(reports) if p is not None]
        first = messages[0][1]
        if self.problem is not None:
            raise type(self.problem)(first)
        more = f" (and {len(messages) - 1} more rank(s) at fault)" if len(messages) > 1 else ""
        raise DistributedStateError(first + more)

    # -- application -------------------------------------------------------------------------
    def apply(
        self,
        local_state: Mapping[str, Any],
        *,
        inplace: bool = False,
        dtype: npt.DTypeLike | None = None,
    ) -> State:
        """Apply the plan to this rank's blocks; collective. See :func:`apply`."""
        run_dtype = self.check(local_state, inplace=inplace, dtype=dtype)
        alloc = np.dtype(dtype) if dtype is not None else run_dtype
        arrays = {name: local_state[name] for name in self.domain_blocks}
        if not inplace:
            return self._out_of_place(arrays, run_dtype, alloc)
        self._in_place(arrays, run_dtype, alloc)
        return local_state  # type: ignore[return-value]

    def _out_of_place(self, arrays: dict[str, np.ndarray], dtype: np.dtype, alloc: np.dtype) -> State:
        """Run on copy-on-write arrays; blocks passed through come back as read-only views."""
        work = numpy_backend.Workspace(dict(arrays), set(), alloc)
        self._execute(work, dtype)
        result: State = {}
        for name in self.range_names:
            array = work.arrays[name]
            result[name] = array if name in work.owned else _read_only(array)
        return result

    def _in_place(self, arrays: dict[str, np.ndarray], dtype: np.dtype, alloc: np.dtype) -> None:
        """Run on the caller's arrays, then write back the blocks that ended in other arrays.

        A result may be another caller array (blocks swapped by out-of-place moves): it is
        copied before any write-back, or the first write would clobber it."""
        work = numpy_backend.Workspace(dict(arrays), set(arrays), alloc)
        self._execute(work, dtype)
        pending = {}
        for name, target in arrays.items():
            result_array = work.arrays[name]
            if result_array is not target:
                aliased = any(np.may_share_memory(result_array, other) for other in arrays.values())
                pending[name] = result_array.copy() if aliased else result_array
        for name, result_array in pending.items():
            np.copyto(arrays[name], result_array, casting="unsafe")

    def _execute(self, work: numpy_backend.Workspace, dtype: np.dtype) -> None:
        try:
            _run(self.schedule, work, self.comm, dtype)
        except Exception:
            # After the collective check nothing should fail; if it does, peers may be waiting
            # for this rank's messages, so the only way not to hang is to end the job loudly.
            rank = self.context.rank
            sys.stderr.write(
                f"linop MPI interpreter: rank {rank} failed while applying {self.op}; aborting\n"
            )
            traceback.print_exc()
            sys.stderr.flush()
            self.comm.Abort(1)
            raise  # pragma: no cover - Abort does not return

    def bind(self, local_state: Mapping[str, Any], *, inplace: bool | None = None) -> BoundPlan:
        """Prepare repeated application to these very arrays; collective.

        The check runs once, here; the returned callable then applies the operator with no
        further checks. In place (the default when domain equals range), a schedule of phases
        of stores, adds and clears between blocks that exist before and after (a halo
        exchange, an in-place copy) and native all-reduces becomes persistent requests straight
        on the caller's arrays. Out of place, a native broadcast (a blocking ``Bcast`` per
        call: measured faster than ``Bcast_init`` here) or sum-reduce (persistent
        ``Allreduce_init``) writes into result arrays prebuilt once: each call returns the same
        arrays, overwritten. Any other schedule runs the ordinary application without its
        check on each call.
        """
        if inplace is None:
            inplace = self.op.domain == self.op.range
        dtype = self.check(local_state, inplace=inplace)
        return BoundPlan(self, {name: local_state[name] for name in self.domain_blocks}, dtype, inplace)


class BoundPlan:
    """A plan bound to fixed arrays for repeated application (see :meth:`Plan.bind`).

    Call it with no arguments: it returns this rank's blocks of the range (in place: the bound
    arrays). ``free()`` releases its persistent requests.
    """

    def __init__(
        self, plan: Plan, arrays: dict[str, np.ndarray], dtype: np.dtype, inplace: bool = True
    ) -> None:
        self.plan = plan
        self.arrays = arrays
        self.dtype = dtype
        self.inplace = inplace
        self.outputs: dict[str, np.ndarray] = {}
        build = _persistent_phases if inplace else _persistent_out_of_place
        possible = build(plan.schedule, arrays, plan.comm, dtype, dry=True) is not None
        if plan.comm.allreduce(possible, op=_mpi().LAND):  # every rank binds, or none does
            self._phases = build(plan.schedule, arrays, plan.comm, dtype, dry=False)
        else:
            self._phases = None
        if not inplace and self._phases is not None:
            self.outputs = self._phases.pop()

    @property
    def persistent(self) -> bool:
        """True when every call runs only MPI calls prepared at binding (persistent requests,
        broadcasts between prebuilt buffers) and local clears/adds."""
        return self._phases is not None

    def __call__(self) -> dict[str, np.ndarray]:
        if self._phases is None:
            if not self.inplace:
                return self.plan._out_of_place(self.arrays, self.dtype, self.dtype)
            self.plan._in_place(self.arrays, self.dtype, self.dtype)
            return self.arrays
        startall, waitall = _mpi().Prequest.Startall, _mpi().Request.Waitall
        for requests, finish in self._phases:
            if requests:
                startall(requests)
                waitall(requests)
            for action in finish:
                action()
        return self.outputs if not self.inplace else self.arrays

    def free(self) -> None:
        """Release the persistent requests."""
        for requests, _ in self._phases or ():
            for request in requests:
                request.Free()
        self._phases = None


def _persistent_out_of_place(
    schedule: tuple[Any, ...], arrays: dict[str, np.ndarray], comm: Any, dtype: np.dtype, *, dry: bool = False
) -> list | None:
    """Persistent collectives for a schedule of one native broadcast or sum-reduce, writing
    into prebuilt result arrays: the phases, then the results dict last; None when the
    schedule cannot be bound so (``dry``: decide only)."""
    if len(schedule) != 1 or not hasattr(schedule[0], "bind_out_of_place"):
        return None
    prepared = schedule[0].bind_out_of_place(arrays, comm, dtype, dry=dry)
    if prepared is None:
        return None
    requests, results = prepared
    outputs = {name: _read_only(a) for name, a in arrays.items() if name not in schedule[0].dropped}
    outputs.update(results)
    # one collective at a time, in the global order of the groups (a callable is a blocking
    # collective call, a request a persistent one)
    return [*(([], [r]) if callable(r) else ([r], []) for r in requests), outputs]


def _persistent_phases(
    schedule: tuple[Any, ...], arrays: dict[str, np.ndarray], comm: Any, dtype: np.dtype, *, dry: bool = False
) -> list | None:
    """Persistent requests and post-actions for each phase, or None when the schedule has
    steps other than phases of in-place stores/adds between existing blocks and native
    all-reduces. ``dry``: only decide, create nothing (collective initializations must be
    made by every member or none, so the ranks agree on the decision first)."""
    if not all(array.dtype == dtype for array in arrays.values()):
        return None
    phases = []
    for step in schedule:
        if hasattr(step, "persistent"):
            prepared = step.persistent(arrays, comm, dtype, dry=dry)
            if prepared is None:
                return None
            requests, finish = prepared
            # collectives on several sub-communicators: one at a time, in the global order
            phases.extend(([request], []) for request in requests)
            phases.append(([], finish))
            continue
        if not isinstance(step, RankPhase):
            return None
        requests, finish = [], []
        for peer, tag, t in step.receives:
            if t.mode == "new" or t.target.name not in arrays:
                return None
            if t.source.size == 0:
                continue
            target = arrays[t.target.name]
            spec = _region_spec(target, t.target) if t.mode == "store" else None
            if spec is None:
                buffer = np.empty(t.shape, dtype)
                spec = _raw(buffer)
                finish.append(_unpack(target, t.target.index, buffer, add=t.mode == "add"))
            if not dry:
                requests.append(comm.Recv_init(spec, peer, tag))
        packs = []
        for peer, tag, t in step.sends:
            if t.after == "drop" or t.source.name not in arrays:
                return None
            source = arrays[t.source.name]
            if t.source.size:
                spec = _region_spec(source, t.source)
                if spec is None:  # a thin box: packed into a buffer before each start
                    buffer = np.empty(t.shape, dtype)
                    packs.append(_packer(source, t.source.index, buffer))
                    spec = _raw(buffer)
                if not dry:
                    requests.append(comm.Send_init(spec, peer, tag))
            if t.after == "clear" and t.source.size:
                finish.append(_clearer(source, t.source.index))
        if packs:
            phases.append(([], packs))
        phases.append((requests, finish))
    return phases


def _unpack(target: np.ndarray, index: tuple[slice, ...], buffer: np.ndarray, *, add: bool) -> Any:
    view = target[(*index, Ellipsis)]
    if add:
        return lambda: np.add(view, buffer, out=view)
    return lambda: np.copyto(view, buffer)


def _packer(source: np.ndarray, index: tuple[slice, ...], buffer: np.ndarray) -> Any:
    view = source[(*index, Ellipsis)]
    return lambda: np.copyto(buffer, view)


def _clearer(array: np.ndarray, index: tuple[slice, ...]) -> Any:
    view = array[(*index, Ellipsis)]
    return lambda: view.fill(0)


# -- execution ------------------------------------------------------------------------------
def _run(schedule: tuple[Any, ...], work: numpy_backend.Workspace, comm: Any, dtype: np.dtype) -> None:
    for step in schedule:
        kind = type(step)
        if kind is RankPhase:
            _run_phase(step, work, comm, dtype)
        elif isinstance(step, LinearOperator):
            numpy_backend.run(step, work)
        elif kind is Scale:
            _scale(step.alpha, work)
        elif kind is RankZero:
            work.arrays.clear()
            work.owned.clear()
            for block in step.blocks:
                work.set(block.name, np.zeros(block.shape, dtype=work.dtype))
        elif kind is RankBranches:
            _run_branches(step, work, comm, dtype)
        else:
            step.run(work, comm, dtype)


def _scale(alpha: Any, work: numpy_backend.Workspace) -> None:
    for name, array in list(work.arrays.items()):
        if name in work.owned and np.result_type(array, alpha) == array.dtype:
            array *= alpha
        else:
            work.set(name, np.asarray(alpha * array))


def _run_branches(step: RankBranches, work: numpy_backend.Workspace, comm: Any, dtype: np.dtype) -> None:
    results = []
    for term in step.terms:
        branch = work.borrowed()
        _run(term, branch, comm, dtype)
        results.append(branch.arrays)
    work.arrays.clear()
    work.owned.clear()
    for name in step.names:
        total = (
            np.asarray(results[0][name] + results[1][name]) if len(results) > 1 else results[0][name].copy()
        )
        for other in results[2:]:
            total += other[name]
        work.set(name, total)


def _run_phase(phase: RankPhase, work: numpy_backend.Workspace, comm: Any, dtype: np.dtype) -> None:
    """Post every receive, then every send, wait once, then add/store what needs a buffer and
    clear or drop the sources."""
    requests = []
    finish: list[tuple[Any, np.ndarray]] = []
    for peer, tag, t in phase.receives:
        if t.mode == "new":
            buffer = np.empty(t.shape, dtype)
            if buffer.size:
                requests.append(comm.Irecv(_raw(buffer), peer, tag))
            finish.append((t, buffer))
            continue
        if phase.empty(t):
            continue
        target = work.writable(t.target.name, dtype)
        if t.mode == "store" and target.dtype == dtype:
            spec = _region_spec(target, t.target, phase.index(t.target))
            if spec is not None:
                requests.append(comm.Irecv(spec, peer, tag))
                continue
        buffer = np.empty(t.shape, dtype)
        requests.append(comm.Irecv(_raw(buffer), peer, tag))
        finish.append((t, buffer))
    for peer, tag, t in phase.sends:
        if phase.empty(t):
            continue
        array = work.arrays[t.source.name]
        spec = None
        if array.dtype == dtype:
            spec = _region_spec(array, t.source, phase.index(t.source))
        if spec is None:
            spec = _raw(np.ascontiguousarray(array[phase.index(t.source)], dtype=dtype))
        requests.append(comm.Isend(spec, peer, tag))
    if requests:
        _mpi().Request.Waitall(requests)
    for t, buffer in finish:
        if t.mode == "new":
            work.set(t.target.name, buffer)
        elif t.mode == "add":
            work.writable(t.target.name, dtype)[phase.index(t.target)] += buffer
        else:
            work.writable(t.target.name, dtype)[phase.index(t.target)] = buffer
    for _, _, t in phase.sends:
        if t.after == "clear":
            if not phase.empty(t):
                work.writable(t.source.name)[phase.index(t.source)] = 0
        elif t.after == "drop":
            work.drop(t.source.name)
