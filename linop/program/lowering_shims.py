"""The lowering of the halo shims: the steps of each per-worker part, one after the other.

Every part of a :class:`~linop.halo.PadShim` or :class:`~linop.halo.TrimShim` (and of their
adjoints) lives on one worker, so it lowers to local steps on that worker only: the shim's
program is O(P) steps of O(1) blocks each, with no space of all P blocks per step (the O(P^2)
of lowering its expansion); one rank's lowering (:func:`~linop.program.lowering.lower_for`)
builds that rank's part only, a mapped rank's (:func:`~linop.program.lowering.lower_for_workers`)
the parts of its workers, in grid order. Proven equal to the expansion under mpiexec
(``tests/mpi/test_registry.py``).
"""

from __future__ import annotations

from ..halo import PadShim, PadShimAdjoint, TrimShim, TrimShimAdjoint
from .lowering import lower, lowering, lowering_rank, lowering_workers, note_workers, per_worker
from .steps import Step

__all__: list[str] = []

for _shim in (PadShim, PadShimAdjoint, TrimShim, TrimShimAdjoint):
    per_worker(_shim)


@lowering(PadShim)
@lowering(PadShimAdjoint)
@lowering(TrimShim)
@lowering(TrimShimAdjoint)
def _lower_shim(op: PadShim) -> list[Step]:
    rank = lowering_rank()
    if rank is not None:  # one rank's lowering: its own part only
        partition = op.geometry.tensor.partition
        note_workers(partition.max_worker)
        position = partition.position(rank)
        if position is None:
            return []
        return lower(op.part(partition.index(rank)))
    workers = lowering_workers()
    if workers is not None:  # a mapped rank's lowering: its workers' parts, in grid order
        partition = op.geometry.tensor.partition
        note_workers(partition.max_worker)
        indices = sorted(partition.index(w) for w in workers if partition.position(w) is not None)
        steps: list[Step] = []
        for index in indices:
            steps.extend(lower(op.part(index)))
        return steps
    steps = []
    for part in op.parts():
        steps.extend(lower(part))
    return steps
