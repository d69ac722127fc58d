"""Result arrays the caller gives a bound plan: ``DistributedPlan.bind(state, out={name: array})``.

Out of place, a bound plan returns the same result arrays on every call, overwritten. With
``out`` the caller chooses that memory for some of this rank's range blocks (pinned or shared
memory, a CPU tensor's storage through its ``.numpy()`` view, the very buffer a hand-written
baseline uses): every call leaves block ``name``'s result in ``out[name]`` and returns that
array as the block.

How a result gets there, in a compiled bound plan (:mod:`linop.backends.mpi.compiled`):

- *straight*: a native collective that writes the whole block on every call (a non-root's
  copy of a broadcast, a root's sum of a sum-reduce: :mod:`linop.backends.mpi.native.rooted`)
  takes the caller's array as its result array, when it is that block's array at the end of
  the run. Taking it is the same run on other memory: the array shares memory with nothing
  else of the run (checked here) and is written whole before it is read. Which blocks go
  straight is found by the dry run of the binding (:func:`straight`) and given to the real
  one alone, so the array is taken once, by the step whose result is the block's at the end;
- *copied*: any other block (built by the compiler, a root's own copy of a broadcast, which
  is its source, or one a step does not take) is copied into the caller's array as the last
  call of the run (:func:`deliver`).

Uncompiled (integer blocks, ``persistent=False``, a schedule the compiler declines) each call
runs the ordinary application and copies into the caller's arrays. In place there is nothing
to give: the results are the bound arrays.

Checked at binding, on this rank before the collective check (:func:`check_out`): each name
is a range block of this rank, each array a numpy array of the block's shape, C-contiguous and
writeable, sharing no memory with a bound array nor with another of ``out``. A rank's refusal
is raised after the check, on every rank together, with the binding's agreement (one small
``Allreduce``, :func:`linop.backends.mpi.bound._agree`): its own typed error on that rank,
:class:`~linop.errors.DistributedStateError` naming it on the others; so is the dtype (the
run's, known after the check: :class:`~linop.errors.DistributedDtypeError`,
:func:`dtype_problem`). A rank's mistake thus never leaves the others waiting.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import OverlapError, ShapeMismatchError, StateError, UnknownBlockError
from .compiled import CompiledRun, PreparedCall
from .steps import OutOfPlaceBinding, Persistent, RankStep

if TYPE_CHECKING:  # pragma: no cover - annotations only
    from ..numpy import Workspace
    from .mpi_types import Intracomm
    from .plan import DistributedPlan

__all__ = ["check_out", "dtype_problem", "Pool", "placing", "straight", "deliver"]


def check_out(
    plan: DistributedPlan, out: Any, arrays: Mapping[str, np.ndarray], *, inplace: bool
) -> dict[str, np.ndarray]:
    """``out`` checked against this rank's range blocks and bound ``arrays`` (see the module
    docstring), as a dict; typed errors name the block and the rank."""
    rank = plan.comm.Get_rank()
    if out is None:
        return {}
    if not isinstance(out, Mapping):
        raise StateError(f"bind(out=) takes a dict of range block names to arrays, not {type(out).__name__}")
    if out and inplace:
        raise StateError(
            f"rank {rank}: bind(out=) is for out-of-place plans; in place the results are the bound "
            f"arrays themselves (blocks {sorted(map(str, out))})"
        )
    names = set(plan.range_names)
    checked: dict[str, np.ndarray] = {}
    for name, array in out.items():
        if name not in names:
            raise UnknownBlockError(
                f"rank {rank}: bind(out=) names block {name!r}, which is not a range block of this rank "
                f"(its range blocks: {sorted(names)})"
            )
        if not isinstance(array, np.ndarray):
            raise StateError(
                f"rank {rank}: bind(out=) block {name!r}: a numpy array is needed, not "
                f"{type(array).__name__} (a CPU tensor's .numpy() view shares its memory)"
            )
        shape = plan.op.range.block(name).shape
        if array.shape != shape:
            raise ShapeMismatchError(
                f"rank {rank}: bind(out=) block {name!r}: the array has shape {array.shape}, the block {shape}"
            )
        if not array.flags.c_contiguous or not array.flags.writeable:
            raise StateError(
                f"rank {rank}: bind(out=) block {name!r}: the array must be C-contiguous and writeable "
                f"(C-contiguous: {array.flags.c_contiguous}, writeable: {array.flags.writeable})"
            )
        for other, given in (*arrays.items(), *checked.items()):
            if np.may_share_memory(array, given):
                kind = "the bound array" if other in arrays and given is arrays[other] else "the out array"
                raise OverlapError(
                    f"rank {rank}: bind(out=) block {name!r}: the array shares memory with {kind} "
                    f"of block {other!r}"
                )
        checked[name] = array
    return checked


def dtype_problem(out: Mapping[str, np.ndarray], dtype: np.dtype, rank: int) -> str | None:
    """Why ``out`` does not fit the run's ``dtype`` on this rank, or None when it does."""
    wrong = {name: str(array.dtype) for name, array in out.items() if array.dtype != dtype}
    if not wrong:
        return None
    return f"rank {rank}: bind(out=): the run's dtype is {dtype}, the arrays of {wrong} are not"


class Pool:
    """The caller's arrays a compile may give the steps (:func:`placing`): those not taken
    yet (:attr:`free`), and those taken, by block name (:attr:`taken`). Each is taken once."""

    def __init__(self, out: Mapping[str, np.ndarray]) -> None:
        self.free = dict(out)
        self.taken: dict[str, np.ndarray] = {}

    def took(self, results: Mapping[str, np.ndarray]) -> None:
        """Note the arrays a step's binding took as its ``results``."""
        for name, array in results.items():
            if self.free.get(name) is array:
                self.taken[name] = self.free.pop(name)


@dataclass
class _Placing(RankStep):
    """A fast-path step offered the pool's free arrays when it binds out of place; otherwise
    the step itself."""

    step: RankStep
    pool: Pool

    def run(self, work: Workspace, comm: Intracomm, dtype: np.dtype) -> None:
        self.step.run(work, comm, dtype)

    def written(self) -> tuple[str, ...] | None:
        return self.step.written()

    def persistent(
        self, arrays: dict[str, np.ndarray], comm: Intracomm, dtype: np.dtype, *, dry: bool = False
    ) -> Persistent | None:
        return self.step.persistent(arrays, comm, dtype, dry=dry)

    def reads(self) -> tuple[str, ...] | None:
        return self.step.reads()

    def bind_out_of_place(
        self,
        arrays: dict[str, np.ndarray],
        comm: Intracomm,
        dtype: np.dtype,
        *,
        dry: bool = False,
        out: Mapping[str, np.ndarray] | None = None,
    ) -> OutOfPlaceBinding | None:
        binding = self.step.bind_out_of_place(arrays, comm, dtype, dry=dry, out=self.pool.free)
        if binding is not None:
            self.pool.took(binding.results)
        return binding


def placing(schedule: Sequence[Any], pool: Pool) -> tuple[Any, ...]:
    """``schedule`` with its fast-path steps offered ``pool``'s arrays (the schedule itself
    when the pool is empty)."""
    if not pool.free:
        return tuple(schedule)
    return tuple(_Placing(step, pool) if isinstance(step, RankStep) else step for step in schedule)


def straight(run: CompiledRun, taken: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Of the arrays a (dry) compile's steps took, those that are their block's result at the
    end of the run and no other block's: these go straight (the real compile gives them to
    the steps); the others are copied into (:func:`deliver`)."""
    found = {}
    for name, array in taken.items():
        if run.outputs.get(name) is array and not any(
            other != name and np.may_share_memory(result, array) for other, result in run.outputs.items()
        ):
            found[name] = array
    return found


def deliver(run: CompiledRun, out: Mapping[str, np.ndarray], straight: Mapping[str, np.ndarray]) -> None:
    """End ``run`` (compiled with ``straight`` given to its steps) with a copy into each other
    array of ``out``, and make ``out``'s arrays its outputs."""
    calls: list[PreparedCall] = run.calls
    for name, array in out.items():
        result = run.outputs[name]
        if name in straight:
            if result is not array:  # the real compile follows the dry one: a bug if not
                raise AssertionError(f"block {name!r} did not land in its out array")
            continue
        calls.append((np.copyto, (array, result)))
        run.outputs[name] = array


def copy_into(results: Mapping[str, Any], out: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """An uncompiled call's ``results`` copied into ``out``'s arrays, which replace them."""
    delivered = dict(results)
    for name, array in out.items():
        np.copyto(array, results[name])
        delivered[name] = array
    return delivered
