"""The runtime of the MPI interpreter: execute one rank's schedule on its workspace.

A rank's schedule (:meth:`linop.program.Program.for_rank`) is a sequence of

- local nodes, run with the numpy interpreter's handlers;
- :class:`~linop.program.RankPhase`: post every receive, then every send, wait
  once, then add or store what needed a buffer and clear or drop the sources, as the phase's
  recipe says (:mod:`linop.backends.mpi.phase_recipe`: data moves straight from and into the
  blocks where it can);
- the algebra steps, with the numpy interpreter's semantics (the same functions):
  :class:`~linop.program.Scale` (:func:`~linop.backends.numpy.scale_blocks`),
  :class:`~linop.program.RankBranches`
  (:func:`~linop.backends.numpy.sum_branches`) and
  :class:`~linop.program.RankZero`;
- :class:`~linop.program.RankOverlap`: the phase posted (:func:`start_phase`), its local
  nodes run while the messages are in flight, then the wait and the finish;
- fast-path steps (:class:`~linop.backends.mpi.steps.RankStep`), which run themselves;
- under a worker-to-rank map, :class:`~linop.program.LocalMoves`: transfers
  between two workers of this rank, run as local copies.

Every message travels in the run's dtype, agreed by all ranks before the run (it holds what the
tree's local kernels produce: :mod:`linop.backends.entry_check.kernels`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ...program import RankPhase, Transfer
from .. import numpy as numpy_backend
from ..host_phase import BUFFER
from ..host_schedule import Started, finish_phase, run_on_engine
from .datatypes import mpi, raw_spec
from .mpi_types import Intracomm
from .phase_recipe import direct_spec, phase_recipe
from .steps import RankStep

__all__ = ["run_schedule", "run_phase"]


def run_schedule(
    schedule: Sequence[Any], work: numpy_backend.Workspace, comm: Intracomm, dtype: np.dtype
) -> None:
    """Run a rank's schedule on ``work`` (:func:`~linop.backends.host_schedule.run_rank_schedule`:
    phases by :func:`run_phase`, fast-path steps by themselves); collective with the other ranks'
    schedules."""

    run_on_engine(schedule, work, dtype, comm, start=start_phase, part=_run_part)


def _run_part(step: Any, work: numpy_backend.Workspace, comm: Intracomm, dtype: np.dtype) -> None:
    if not isinstance(step, RankStep):  # pragma: no cover - projection emits nothing else
        raise TypeError(f"the MPI runtime cannot run the step {step!r}")
    step.run(work, comm, dtype)


def run_phase(phase: RankPhase, work: numpy_backend.Workspace, comm: Intracomm, dtype: np.dtype) -> None:
    """Post every receive, then every send, wait once, then add/store what needs a buffer and
    clear or drop the sources."""
    start_phase(phase, work, comm, dtype)()


def start_phase(phase: RankPhase, work: numpy_backend.Workspace, comm: Intracomm, dtype: np.dtype) -> Started:
    """Post every receive, then every send (nonblocking), as the phase's recipe says
    (:func:`~linop.backends.mpi.phase_recipe.phase_recipe`), and return what completes the
    phase: wait once, then add/store what needs a buffer and clear or drop the sources. Local
    work that touches none of the phase's regions may run in between (a
    :class:`~linop.program.RankOverlap`), calling its ``progress()`` between steps."""
    recipe = phase_recipe(
        phase, dtype, target=lambda name: work.writable(name, dtype), source=work.arrays.__getitem__
    )
    requests = []
    finish: list[tuple[Transfer, np.ndarray]] = []
    arrays = work.arrays
    for message in recipe.receives:
        peer, tag, t, name = message.peer, message.tag, message.transfer, message.name
        if message.route == BUFFER:
            buffer = np.empty(t.shape, dtype)
            if buffer.size:
                requests.append(comm.Irecv(raw_spec(buffer), peer, tag))
            finish.append((t, buffer))
        else:
            requests.append(comm.Irecv(direct_spec(arrays[name], message), peer, tag))
    for message in recipe.sends:
        array = arrays[message.name]
        if message.route == BUFFER:
            spec = raw_spec(np.ascontiguousarray(array[message.box], dtype=dtype))
        else:
            spec = direct_spec(array, message)
        requests.append(comm.Isend(spec, message.peer, message.tag))

    # progress() (between the steps of the local work in flight) tests the requests, so that
    # MPICH, which moves data only inside MPI calls, can move messages above its eager size (a
    # handshake, then the data, each needing both peers in a call) while the work runs rather
    # than all at the wait, where a rank would wait for its peer to finish its own work
    module = mpi()
    return Started(
        requests,
        lambda: finish_phase(phase, work, finish, dtype),
        wait=module.Request.Waitall,
        test=module.Request.Testall,
    )
