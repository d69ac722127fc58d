"""A tree compiled for one communicator: :class:`DistributedPlan`.

The plan holds this rank's schedule (:func:`linop.program.compile_for_rank`:
the rank's own steps, compiled without the global program, which :attr:`DistributedPlan.program`
builds on demand), and the entry check (:mod:`linop.backends.mpi.check`). Applying it checks
collectively, then runs the schedule (:mod:`linop.backends.mpi.runtime`) on a copy-on-write
workspace, so caller arrays are never mutated, except in place, where the results are written
back into the caller's arrays with the numpy interpreter's rules
(:func:`~linop.backends.numpy.write_back`).

Once the check has passed every rank is committed to the schedule: anything raised on a rank
after it (a bug, a user kernel raising, ``KeyboardInterrupt``) ends the job with that rank's
message (:func:`linop.backends.mpi.guards.abort_for`), since its peers may be waiting for it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NoReturn, cast

import numpy as np
import numpy.typing as npt

from ... import dtypes
from ...errors import (
    CommunicatorError,
    IntegerOverflowError,
    LinopError,
    UnsupportedNodeError,
    WorkerMapError,
)
from ...operator import LinearOperator
from ...program import Program, RankProgram, WorkerMap, compile_for_rank, compile_program, fingerprint
from ...program.cache import PlanCache
from ...program.executor_plan import ExecutorPlan
from ...space import State
from .. import array_api
from .. import numpy as numpy_backend
from ..host_fusion import fused
from ..host_schedule import cast_copies, outputs
from . import mapping as mpi_mapping
from .check import CheckOutcome, DistributedOverflowError, MPIEntryCheck
from .deadline import resolve_timeout
from .guards import abort_for
from .inplace_phases import InPlaceLayouts
from .native import mpi_schedule
from .repeated import OneStep, RepeatedCall
from .runtime import run_schedule

if TYPE_CHECKING:  # pragma: no cover - mpi4py is optional at run time
    from mpi4py.MPI import Intracomm

    from ..entry_check.repeat import Repeat
    from .bound import BoundPlan
    from .context import CommContext

__all__ = ["DistributedPlan"]


class Compiled:
    """A tree's fingerprint, and per rank its program or the error compiling it raised (the
    rank's program does not depend on the communicator: plans on several communicators share
    it)."""

    def __init__(self, op: LinearOperator) -> None:
        self.fingerprint = fingerprint(op)
        self.ranks: dict[int, tuple[RankProgram | None, LinopError | None]] = {}

    def for_rank(self, op: LinearOperator, rank: int) -> tuple[RankProgram | None, LinopError | None]:
        """``rank``'s program (:func:`~linop.program.compile_for_rank`: its own
        steps only, O(its own work); its fast-path parts turned into MPI steps,
        :func:`~linop.backends.mpi.native.mpi_schedule`), or the error compiling it raised."""
        found = self.ranks.get(rank)
        if found is None:
            program: RankProgram | None = None
            problem: LinopError | None = None
            try:
                program = compile_for_rank(op, rank)
                program = RankProgram(mpi_schedule(program.schedule), program.max_worker)
            except Exception as error:  # raised collectively by the check, after the tree test
                problem = (
                    error
                    if isinstance(error, LinopError)
                    else UnsupportedNodeError(
                        f"the MPI interpreter cannot compile {op}: {type(error).__name__}: {error}"
                    )
                )
            found = self.ranks[rank] = (program, problem)
        return found


_PROGRAMS: PlanCache[Compiled] = PlanCache()


def _compiled(op: LinearOperator) -> Compiled:
    """The fingerprint and rank programs of ``op``, kept once per process."""
    return _PROGRAMS.kept(op, lambda: Compiled(op))


class DistributedPlan(ExecutorPlan["CommContext"]):
    """A tree compiled for one communicator: the global program and this rank's schedule.

    Built by :func:`linop.backends.mpi.plan_for` (cached per communicator). Compiling
    is local; a tree the interpreter cannot compile (or a communicator too small for it) is
    reported by the first application's check, on every rank alike.
    """

    def __init__(
        self, op: LinearOperator, context: CommContext, mapping: WorkerMap | WorkerMapError | None = None
    ) -> None:
        super().__init__(op, context, mapping)
        self.schedule: tuple[Any, ...] = ()
        self._host_steps: tuple[Any, ...] | None = None
        self._program: Program | None = None
        self._timeout: Any = None
        self.fast: OneStep | None = None
        """The repeated call prepared for the entry check's kept repeat (:attr:`fast_record`'s
        :attr:`~linop.backends.mpi.repeated.RepeatedCall.call`, :mod:`linop.backends.mpi.repeated`),
        built by :meth:`repeated`; it answers a call passing the same arrays again when it is
        current, else None."""
        self.fast_record: RepeatedCall | None = None
        """The record :attr:`fast` belongs to (its repeat and deadline), or None. It may
        outlive the entry check's kept repeat (another array's call since: it still answers
        calls on its own array) and a failed call
        (nothing it compares changes); it is dropped when it can never answer again (its array
        collected, the communicator freed) and when the deadline it was built with changes
        (:mod:`linop.backends.mpi.repeated`)."""
        if mapping is not None:
            self._init_mapped(op, context, mapping)
            return
        compiled = _compiled(op)
        self.fingerprint = compiled.fingerprint
        self.rank_program, self.problem = compiled.for_rank(op, context.rank)
        if self.rank_program is not None:
            if self.rank_program.max_worker >= context.size:
                self.problem = CommunicatorError(
                    f"the tree names worker {self.rank_program.max_worker} but the communicator has "
                    f"{context.size} rank(s); run with at least {self.rank_program.max_worker + 1} ranks"
                )
            else:
                self.schedule = self.rank_program.schedule
                self.domain_blocks = {b.name: b for b in op.domain.owned(context.rank)}
                self.range_names = tuple(b.name for b in op.range.owned(context.rank))
        self.entry = MPIEntryCheck(op, self.fingerprint, context.reducer, self.domain_blocks, self.problem)
        self.layouts = InPlaceLayouts(self.schedule, context.comm)
        """The in-place schedules compiled per layout of the caller's arrays
        (:mod:`linop.backends.mpi.inplace_phases`)."""

    def _init_mapped(
        self, op: LinearOperator, context: CommContext, mapping: WorkerMap | WorkerMapError
    ) -> None:
        """A plan under a worker-to-rank map (:mod:`linop.backends.mpi.mapping`); a map that
        could not be built (``mapping`` is its error) is reported by the check on every rank."""
        tree = fingerprint(op)
        if isinstance(mapping, WorkerMapError):
            self.fingerprint = hashlib.blake2b(tree + b"invalid map", digest_size=16).digest()
            self.rank_program, self.problem = None, mapping
        else:
            compiled = mpi_mapping.compiled_for(op, mapping)
            self.fingerprint = compiled.fingerprint
            self.rank_program, self.problem = compiled.for_rank(context.rank, context.size)
            if self.rank_program is not None:
                self.schedule = self.rank_program.schedule
                self.domain_blocks = compiled.domain_blocks(context.rank)
                self.range_names = compiled.range_names(context.rank)
        self.entry = MPIEntryCheck(
            op,
            self.fingerprint,
            context.reducer,
            self.domain_blocks,
            self.problem,
            tree_fingerprint=tree,
            rank_of=None if isinstance(mapping, WorkerMapError) else mapping.rank_of,
        )
        self.layouts = InPlaceLayouts(self.schedule, context.comm)

    @property
    def program(self) -> Program:
        """The global program of the tree (every rank's steps; built on first use, for
        inspection: the plan runs :attr:`schedule`, which this rank compiled on its own)."""
        if self._program is None:
            self._program = compile_program(self.op)
        return self._program

    @property
    def timeout(self) -> Any:
        """The default deadline of this plan's checks and bound plans' first starts, in seconds
        (set by ``plan_for(..., timeout=)``; None: ``LINOP_TIMEOUT``, see
        :mod:`linop.backends.mpi.deadline`). Setting it to another object drops the repeated
        call's record (:attr:`fast`, built with the deadline as it was)."""
        return self._timeout

    @timeout.setter
    def timeout(self, value: Any) -> None:
        if value is not self._timeout:
            self.drop_fast()
        self._timeout = value

    def _keep_fast(self, record: RepeatedCall | None) -> None:
        """Keep ``record`` as the repeated call (:attr:`fast`, :attr:`fast_record`)."""
        self.fast_record = record
        self.fast = record.call if record is not None else None

    def drop_fast(self) -> None:
        """Let the repeated call's record go (:attr:`fast`, :attr:`fast_record`): the next call
        on the same arrays goes the general way and builds it again."""
        self.fast_record = None
        self.fast = None

    @property
    def comm(self) -> Intracomm:
        """The plan's private communicator (a duplicate of the user's)."""
        return self.context.comm

    def check(
        self, state: Any, *, inplace: bool = False, dtype: npt.DTypeLike | None = None, timeout: Any = None
    ) -> np.dtype:
        """Collectively validate the tree and every rank's local state; return the run's dtype
        (see :mod:`linop.backends.mpi.check`).

        Raises
        ------
        TreeMismatchError, CommunicatorError, DistributedStateError, UnsupportedNodeError
            On every rank together, before any data moves.
        PeerTimeoutError
            Printed by every rank that arrived, naming those that did not within ``timeout``
            seconds (default :attr:`timeout`, else ``LINOP_TIMEOUT``), before the job is aborted.
        """
        return self.agree(state, inplace=inplace, dtype=dtype, timeout=timeout).result()

    def deadline(self, timeout: Any = None) -> float | None:
        """The deadline in seconds of a call given ``timeout`` (None: :attr:`timeout`, else
        ``LINOP_TIMEOUT``); None for none.

        Raises
        ------
        TimeoutArgumentError
            If it is not a positive number of seconds.
        """
        return resolve_timeout(self.timeout if timeout is None else timeout)

    def agree(
        self, state: Any, *, inplace: bool = False, dtype: npt.DTypeLike | None = None, timeout: Any = None
    ) -> CheckOutcome:
        """The collective check's outcome (its error raised by :meth:`CheckOutcome.result`)."""
        if self.context.freed:
            self._freed()
        seconds = self.deadline(timeout)
        try:
            return self.entry.run(state, inplace=inplace, dtype=dtype, timeout=seconds)
        except BaseException as error:  # PeerTimeoutError included: the missing ranks may never come
            abort_for(self.comm, f"checking {self.op}", error)

    def repeated(self, local_state: Any, inplace: bool, timeout: Any = None) -> State | None:
        """The call (``dtype=None``) when it passes exactly the arrays of the entry check's kept
        repeat (:meth:`EntryCheck.repeat <linop.backends.entry_check.EntryCheck.repeat>`,
        inline): the check's collective (:meth:`EntryCheck.again
        <linop.backends.entry_check.EntryCheck.again>`), then the run kept with the repeat (the
        in-place binding), or the ordinary run of the agreed outcome. None when the arrays are
        not the kept ones: nothing was communicated, and :meth:`apply` checks the call.

        The general way of a repeated call (any ``timeout``); a passed call with the plan's
        own deadline prepares :attr:`fast`, which answers the next calls on these arrays in
        one step (:mod:`linop.backends.mpi.repeated`)."""
        entry = self.entry
        repeat = entry.last
        if repeat is None or repeat.version != entry.kernels.version or not repeat.same(local_state, inplace):
            return None
        if self.context.freed:
            self._freed()
        seconds = self.deadline(timeout)
        try:
            outcome, agreed = entry.again(repeat, seconds)
        except BaseException as error:  # PeerTimeoutError included: the missing ranks may never come
            abort_for(self.comm, f"checking {self.op}", error)
        if agreed and timeout is None:  # the next call on these arrays: in one step
            self._keep_fast(RepeatedCall.of(self, repeat, seconds))
        return self.after_again(local_state, repeat, outcome, agreed, inplace)

    def after_again(
        self, local_state: Any, repeat: Repeat, outcome: CheckOutcome, agreed: bool, inplace: bool
    ) -> State:
        """A repeated call after its check: the run kept with ``repeat`` when every rank sent
        its vector (``agreed``) and the run is live, else the ordinary run of ``outcome``."""
        run = repeat.run
        if agreed and run is not None:
            try:
                if run.run():
                    return local_state  # in place: the caller's dict
            except BaseException as error:  # the ranks are committed: see guards
                abort_for(self.comm, f"applying {self.op}", error)
        return self._applied(local_state, outcome, inplace, None)

    def _freed(self) -> NoReturn:
        self.drop_fast()  # it can never answer again
        raise CommunicatorError(
            f"the communicator of this plan of {self.op} has been freed; build the plan again "
            "on a live communicator"
        )

    def _keep_binding(self, arrays: dict[str, np.ndarray], dtype: np.dtype) -> None:
        """Keep the in-place binding this call ran on with the entry check's repeat of these
        very arrays (:mod:`linop.backends.entry_check.repeat`), so that the next call passing
        them again runs it straight after the check's collective."""
        repeat, last = self.entry.last, self.layouts.last
        if (
            repeat is not None
            and repeat.inplace
            and last is not None
            and last[0] is dtype
            and repeat.outcome.dtype is dtype
            and repeat.same(arrays, True)
            and repeat.run is not last[2]
            and last[2].holds(arrays)
        ):
            repeat.run = last[2]

    # -- application -------------------------------------------------------------------------
    def apply(
        self,
        local_state: Mapping[str, Any],
        *,
        inplace: bool = False,
        dtype: npt.DTypeLike | None = None,
        timeout: Any = None,
    ) -> State:
        """Check collectively, then apply the plan to this rank's blocks; collective. See
        :func:`linop.backends.mpi.apply` (which calls this).

        Out of place the caller's arrays are never written (results are new arrays, or
        read-only views of blocks passed through). In place a schedule of point-to-point phases
        runs as compiled once per layout of the caller's arrays
        (:mod:`linop.backends.mpi.inplace_phases`); any other schedule runs the ordinary
        runtime, and the results are written back into the caller's arrays.

        Raises
        ------
        TreeMismatchError, CommunicatorError, DistributedStateError, UnsupportedNodeError
            On every rank together, before any data moves.
        """
        if dtype is None:
            fast = self.fast
            if fast is not None and timeout is None:
                done = fast(local_state, inplace)
                if done is not None:
                    return done
            done = self.repeated(local_state, inplace, timeout)
            if done is not None:
                return done
        return self.apply_checked(local_state, inplace=inplace, dtype=dtype, timeout=timeout)

    def apply_checked(
        self,
        local_state: Mapping[str, Any],
        *,
        inplace: bool = False,
        dtype: npt.DTypeLike | None = None,
        timeout: Any = None,
    ) -> State:
        """:meth:`apply` for a call that :meth:`repeated` has found not to pass the kept arrays
        (or with ``dtype=``): the whole check, then the run."""
        outcome = self.agree(local_state, inplace=inplace, dtype=dtype, timeout=timeout)
        return self._applied(local_state, outcome, inplace, dtype)

    def _applied(
        self,
        local_state: Mapping[str, Any],
        outcome: CheckOutcome,
        inplace: bool,
        dtype: npt.DTypeLike | None,
    ) -> State:
        """The call after its check: the agreed error raised on every rank, or the run in the
        agreed dtype (in place: by the compiled phases, :meth:`apply`)."""
        if outcome.error is not None:
            raise outcome.error
        run_dtype = outcome.dtype
        assert run_dtype is not None
        if inplace and outcome.cast is None:
            if not self.schedule:
                return local_state  # type: ignore[return-value]  # in place: the caller's mapping
            # the check passed: a dict holds exactly this rank's blocks (any mapping: copied)
            given = type(local_state) is dict
            arrays = (
                cast(dict, local_state) if given else {name: local_state[name] for name in self.domain_blocks}
            )
            try:
                if self.layouts.run(arrays, run_dtype, remember=given):
                    self._keep_binding(arrays, run_dtype)
                    return local_state  # type: ignore[return-value]
            except BaseException as error:  # the ranks are committed: see guards
                abort_for(self.comm, f"applying {self.op}", error)
        arrays = {name: local_state[name] for name in self.domain_blocks}
        alloc = np.dtype(dtype) if dtype is not None else run_dtype
        if not inplace:
            return self.run_out_of_place(cast_copies(arrays, outcome.cast), run_dtype, alloc)
        failure = self.run_in_place(arrays, run_dtype, alloc, cast=outcome.cast)
        if failure is not None:
            raise failure
        return local_state  # type: ignore[return-value]

    @property
    def host_steps(self) -> tuple[Any, ...]:
        """:attr:`schedule` as the interpreter runs it: consecutive movement steps fused
        (:func:`~linop.backends.host_fusion.fused`; built on first use)."""
        if self._host_steps is None:
            self._host_steps = fused(self.schedule)
        return self._host_steps

    def run_out_of_place(self, arrays: dict[str, np.ndarray], dtype: np.dtype, alloc: np.dtype) -> State:
        """Run (no check) on copy-on-write arrays; blocks passed through come back as
        read-only views. Collective; aborts the job if anything fails."""
        try:
            work = numpy_backend.Workspace(dict(arrays), set(), alloc)
            run_schedule(self.host_steps, work, self.comm, dtype)
            return outputs(work, self.range_names)
        except BaseException as error:
            abort_for(self.comm, f"applying {self.op}", error)

    def run_in_place(
        self, arrays: dict[str, np.ndarray], dtype: np.dtype, alloc: np.dtype, *, cast: np.dtype | None = None
    ) -> LinopError | None:
        """Run (no check) on the caller's arrays, then write back the blocks that ended in other
        arrays (:func:`~linop.backends.numpy.write_back`). Collective; aborts the job if
        anything fails.

        With ``cast`` (an integer run widened by :func:`linop.dtypes.cast_dtype`) the run is on
        widened copies, and the ranks agree whether every result fits its caller's array
        (:func:`linop.dtypes.fit_back`) before any writes back: if one does not, nothing is
        written and the error every rank raises is returned."""
        try:
            work = numpy_backend.Workspace(cast_copies(arrays, cast), set(arrays), alloc)
            run_schedule(self.host_steps, work, self.comm, dtype)
            if cast is not None:
                failure = self._fit_back(work, arrays)
                if failure is not None:
                    return failure
            numpy_backend.write_back(arrays, work)
            return None
        except BaseException as error:
            abort_for(self.comm, f"applying {self.op}", error)

    def _fit_back(self, work: numpy_backend.Workspace, arrays: dict[str, np.ndarray]) -> LinopError | None:
        problem = None
        try:
            dtypes.fit_back(work.arrays, arrays)
        except IntegerOverflowError as error:
            problem = f"rank {self.context.rank}: {error}"
        problems = [p for p in self.comm.allgather(problem) if p is not None]
        return DistributedOverflowError(problems[0]) if problems else None

    def bind(
        self,
        local_state: Mapping[str, Any],
        *,
        inplace: bool | None = None,
        timeout: Any = None,
        donate: bool = False,
        persistent: bool = True,
        every_call: bool = False,
        out: Mapping[str, np.ndarray] | None = None,
    ) -> BoundPlan:
        """Prepare repeated application to these very arrays; collective.

        The check runs once, here; the returned callable then applies the operator with no
        further checks. In place (the default when domain equals range), a schedule of phases
        of stores, adds and clears between blocks that exist before and after (a halo
        exchange, an in-place copy) and native all-reduces becomes persistent requests straight
        on the caller's arrays. Out of place, a native broadcast (a persistent ``Bcast_init``)
        or sum-reduce (a large block over a few ranks as persistent messages, a reduce-scatter
        and a gather onto the root; else a persistent ``Allreduce_init``) writes into result
        arrays prebuilt once: each call returns the same arrays, overwritten. Any other
        schedule runs the ordinary application without its check on each call.

        ``donate=True`` (out of place) gives the bound arrays to the plan, as JAX's donated
        arguments: a compiled plan may then write into them instead of copying a block before
        its first change, and a result may be one of them. For a caller that refills its own
        buffers before each call (the torch adapter's bound tensors); the caller's arrays are
        otherwise never written out of place.

        ``persistent=False`` (the same on every rank) only checks: each call runs the ordinary
        application, unchecked, with no prebuilt requests or buffers (for a caller that runs
        the checked plan on other arrays of the same blocks, see :attr:`BoundPlan.plan`).

        ``timeout`` (seconds; default :attr:`timeout`, else ``LINOP_TIMEOUT``) bounds the wait
        of the check here and of the bound plan's first call for every rank to arrive
        (:mod:`linop.backends.mpi.deadline`); with ``every_call=True`` (alike on every rank),
        of every call (one more nonblocking barrier per call: :mod:`linop.backends.mpi.bound`).

        ``out`` (out of place; numpy arrays, by range block of this rank): the caller's arrays
        for those blocks' results. Each call leaves them there and returns them as the blocks
        (:mod:`linop.backends.mpi.out_arrays`: a native broadcast's or sum-reduce's result is
        written there straight, any other block copied there at the end of the call). Each
        must have its block's shape and the run's dtype, be C-contiguous and writeable, and
        share no memory with a bound array or another of them. A wrong name, shape or layout
        is found on its rank before the check and raised on every rank after it, with the
        binding's agreement (the rank's own :class:`~linop.errors.UnknownBlockError`,
        :class:`~linop.errors.ShapeMismatchError`, :class:`~linop.errors.StateError` or
        :class:`~linop.errors.OverlapError` there, :class:`~linop.errors.DistributedStateError`
        naming it on the others); a wrong dtype likewise
        (:class:`~linop.errors.DistributedDtypeError`).
        """
        from .bound import AgreedRefusalError, BoundPlan
        from .out_arrays import check_out

        if inplace is None:
            inplace = self.op.domain == self.op.range
        entry = array_api.mpi_entry(local_state)  # torch, CuPy, ... arrays: bound on numpy views
        local_state = entry.arrays
        refused: LinopError | None = None  # this rank's out=, refused: raised with every rank's agreement
        if out is not None:
            given = {name: a for name, a in local_state.items() if isinstance(a, np.ndarray)}
            try:
                out = check_out(self, out, given, inplace=inplace)
            except LinopError as error:
                refused, out = error, None
        outcome = self.agree(local_state, inplace=inplace, timeout=timeout)
        dtype = outcome.result()
        try:
            arrays = {name: local_state[name] for name in self.domain_blocks}
            bound = BoundPlan(
                self,
                arrays,
                dtype,
                inplace,
                checked=outcome.integers,
                timeout=self.deadline(timeout),
                donate=donate,
                persistent=persistent,
                every_call=every_call,
                out=out,
                refused=refused,
            )
            return entry.bound(bound, inplace=inplace)
        except AgreedRefusalError as agreed:  # the out arrays refused: raised on every rank together
            raise agreed.error from None
        except BaseException as error:
            abort_for(self.comm, f"binding {self.op}", error)
