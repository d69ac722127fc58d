r"""Distributed verification under MPI: the adjoint test across ranks, and a cross-check of the
MPI interpreter against the numpy interpreter.

Both are collective: every rank calls them with the same tree, and every rank gets the same
result.

Adjoint test
    The dot test of ``docs/theory.md#adjoint-test`` with the operator and its adjoint applied by the MPI
    interpreter. Each rank holds only its own blocks, so each inner product is a sum over ranks:
    every rank sums its blocks in float64 / complex128 and one ``Allreduce`` adds the partial
    sums. The verdict is broadcast from rank 0, so no two ranks can disagree.

    .. math::

        \frac{|\sum_r \langle (F x)_r, y_r\rangle - \sum_r \langle x_r, (F^* y)_r\rangle|}
             {\max(\|F x\|\,\|y\|,\ \|x\|\,\|F^* y\|)} < \varepsilon

Cross-check
    Apply the tree under MPI, gather every rank's result blocks on rank 0, and compare them with
    the numpy interpreter's result for the same global state: entry by entry for integer dtypes
    (data movement is exact), within a few units of the dtype's precision otherwise.

Random states are drawn block by block from a seed and the block's name, so every rank draws
its own blocks of one global state without drawing the others, and rank 0 can rebuild the whole
state for the reference. ``mpiexec -n 4 python -m verify.distributed`` runs both checks over the
catalogue's entries whose workers fit the communicator.
"""

from __future__ import annotations

import sys
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from linop import LinearOperator, Space

from ._text import short
from .errors import CheckOptionError
from .numeric import AdjointTestResult, check_trials, threshold_for
from .verdict import Verdict

__all__ = [
    "CrossCheckResult",
    "distributed_adjoint_test",
    "cross_check",
    "local_random",
    "global_random",
    "main",
]


def _world(comm: Any) -> Any:
    if comm is None:
        from mpi4py import MPI

        return MPI.COMM_WORLD
    return comm


def _block_rng(seed: int, trial: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, trial, zlib.crc32(name.encode())])


def _draw(shape: tuple[int, ...], rng: np.random.Generator, dtype: np.dtype) -> np.ndarray:
    if dtype.kind in "iu":
        return rng.integers(0 if dtype.kind == "u" else -9, 10, size=shape).astype(dtype)
    if dtype.kind == "c":
        parts = rng.standard_normal((2, *shape))
        return (parts[0] + 1j * parts[1]).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def local_random(
    space: Space, rank: int, *, seed: int = 0, trial: int = 0, dtype: npt.DTypeLike = np.float64
) -> dict[str, np.ndarray]:
    """This rank's blocks of the global random state (seed, trial): drawn per block, so the
    same entries whichever rank draws them."""
    dtype = np.dtype(dtype)
    return {b.name: _draw(b.shape, _block_rng(seed, trial, b.name), dtype) for b in space if b.worker == rank}


def global_random(
    space: Space, *, seed: int = 0, trial: int = 0, dtype: npt.DTypeLike = np.float64
) -> dict[str, np.ndarray]:
    """The whole global random state (seed, trial), as :func:`local_random` draws it."""
    dtype = np.dtype(dtype)
    return {b.name: _draw(b.shape, _block_rng(seed, trial, b.name), dtype) for b in space}


def _partial_inner(x: Mapping[str, np.ndarray], y: Mapping[str, np.ndarray]) -> complex:
    """sum(conj(x) * y) over this rank's blocks, accumulated in complex128."""
    total = 0j
    for name, a in x.items():
        total += complex(np.vdot(a.astype(np.complex128).ravel(), y[name].astype(np.complex128).ravel()))
    return total


def distributed_adjoint_test(
    op: LinearOperator,
    *,
    comm: Any = None,
    seed: int = 0,
    dtype: npt.DTypeLike = np.float64,
    trials: int = 3,
    threshold: float | None = None,
) -> AdjointTestResult:
    """The adjoint (dot) test of ``op`` run by the MPI interpreter; collective.

    Parameters
    ----------
    op : LinearOperator
        The same tree on every rank.
    comm : mpi4py communicator, optional
        Default ``MPI.COMM_WORLD``.
    seed : int, optional
        Seed of the random states (the same on every rank).
    dtype : dtype, optional
        Real or complex floating dtype of the states. Default float64.
    trials : int, optional
        Number of random (x, y) pairs; the worst counts.
    threshold : float, optional
        Override the pass threshold (default :func:`verify.numeric.threshold_for`).

    Returns
    -------
    AdjointTestResult
        The same on every rank; truthy when the test passes.

    Raises
    ------
    CheckOptionError
        If ``dtype`` is not a floating dtype or ``trials`` is below 1 (on every rank alike:
        the arguments are the same everywhere).
    """
    from linop.backends import mpi as mpi_backend

    comm = _world(comm)
    rank = comm.Get_rank()
    dtype = np.dtype(dtype)
    if dtype.kind not in "fc":
        raise CheckOptionError(f"the adjoint test needs a real or complex floating dtype, not {dtype}")
    trials = check_trials("the distributed adjoint test", trials)
    adjoint = op.H
    claim = f"distributed adjoint test of {short(op, 70)} on {comm.Get_size()} rank(s)"
    limit = threshold_for(dtype, max(op.domain.size, op.range.size)) if threshold is None else threshold
    worst, worst_detail = 0.0, ""
    for trial in range(trials):
        x = local_random(op.domain, rank, seed=seed, trial=2 * trial, dtype=dtype)
        y = local_random(op.range, rank, seed=seed, trial=2 * trial + 1, dtype=dtype)
        forward = mpi_backend.apply(op, x, comm=comm)
        backward = mpi_backend.apply(adjoint, y, comm=comm)
        partial = np.array(
            [
                _partial_inner(forward, y),
                _partial_inner(x, backward),
                _partial_inner(forward, forward),
                _partial_inner(y, y),
                _partial_inner(x, x),
                _partial_inner(backward, backward),
            ],
            dtype=np.complex128,
        )
        total = np.empty_like(partial)
        comm.Allreduce(partial, total)
        comm.Bcast(total, root=0)  # one verdict: every rank uses rank 0's sums
        left, right = total[0], total[1]
        norm_fx, norm_y, norm_x, norm_aty = (float(np.sqrt(abs(v))) for v in total[2:])
        scale = max(norm_fx * norm_y, norm_x * norm_aty)
        gap = abs(left - right)
        error = float(gap / scale) if scale > 0 else float(gap)
        if not np.isfinite(error):
            error = float("inf")
        if error >= worst:
            worst = error
            worst_detail = f"<F x, y> = {left:.6g}, <x, F* y> = {right:.6g}"
    passed = worst < limit or worst == 0.0
    return AdjointTestResult(claim, worst, limit, passed, dtype, trials, worst_detail)


@dataclass(frozen=True)
class CrossCheckResult(Verdict):
    """Outcome of :func:`cross_check`, the same on every rank.

    Attributes
    ----------
    claim : str
        What was checked.
    passed : bool
        True when every rank's blocks equal the numpy interpreter's.
    exact : bool
        True when compared entry by entry (integer dtype), False within a tolerance.
    detail : str
        On failure, the first block (and rank) that differs, and the largest difference.
    """

    claim: str
    passed: bool
    exact: bool
    detail: str = ""


def _compare(op: LinearOperator, gathered: list[dict[str, np.ndarray]], expected: dict, exact: bool) -> str:
    for rank, blocks in enumerate(gathered):
        owned = [b.name for b in op.range if b.worker == rank]
        if sorted(blocks) != sorted(owned):
            return f"rank {rank} returned blocks {sorted(blocks)}, expected {sorted(owned)}"
        for name in owned:
            got, want = np.asarray(blocks[name]), np.asarray(expected[name])
            if got.shape != want.shape:
                return f"block {name!r} on rank {rank} has shape {got.shape}, expected {want.shape}"
            if exact:
                wrong = np.argwhere(got != want)
                if wrong.size:
                    index = tuple(int(i) for i in wrong[0])
                    return (
                        f"block {name!r} on rank {rank} differs at {index}: {got[index]} versus {want[index]}"
                    )
            else:
                eps = float(np.finfo(np.result_type(got.dtype, np.float16)).eps)
                scale = max(1.0, float(np.abs(want).max(initial=0)))
                error = float(np.abs(got - want).max(initial=0))
                if error > 64 * eps * scale:
                    return f"block {name!r} on rank {rank} differs by up to {error:.3g}"
    return ""


def cross_check(
    op: LinearOperator, *, comm: Any = None, seed: int = 0, dtype: npt.DTypeLike = np.int64
) -> CrossCheckResult:
    """Apply ``op`` under MPI, gather the result on rank 0 and compare it with the numpy
    interpreter's; collective. Integer dtypes (the default) compare exactly."""
    from linop.backends import mpi as mpi_backend

    comm = _world(comm)
    rank = comm.Get_rank()
    dtype = np.dtype(dtype)
    exact = dtype.kind in "iu"
    claim = f"MPI cross-check of {short(op, 70)} on {comm.Get_size()} rank(s) ({dtype})"
    result = mpi_backend.apply(op, local_random(op.domain, rank, seed=seed, dtype=dtype), comm=comm)
    gathered = comm.gather({name: np.asarray(array) for name, array in result.items()}, root=0)
    detail = ""
    if rank == 0:
        expected = op(global_random(op.domain, seed=seed, dtype=dtype))
        detail = _compare(op, gathered, expected, exact)
    detail = comm.bcast(detail, root=0)
    return CrossCheckResult(claim, not detail, exact, detail)


def _catalogue_operators(entry: Any) -> list[LinearOperator]:
    built = entry.build()
    return list(built) if entry.kind == "equal" else [built[0]]


def main(argv: list[str] | None = None) -> int:
    """Run the distributed checks over the catalogue (``mpiexec -n K python -m verify.distributed
    [PATTERN]``); rank 0 prints one line per identity. Exit status 0 when all pass, 1 when one
    fails, 2 when ``PATTERN`` selects no identity."""
    from mpi4py import MPI

    from linop.errors import CommunicatorError

    from . import identities

    comm = MPI.COMM_WORLD
    argv = sys.argv[1:] if argv is None else argv
    entries = identities.select(argv[0] if argv else None)
    if argv and argv[0] and not entries:  # every rank alike: a typo must not pass having checked nothing
        if comm.Get_rank() == 0:
            print(f"python -m verify --mpi: no identity matches {argv[0]!r}", file=sys.stderr)
        return 2
    failures = skipped = checked = 0
    for entry in entries:
        for op in _catalogue_operators(entry):
            workers = max((b.worker for s in (op.domain, op.range) for b in s), default=0)
            if workers >= comm.Get_size():
                skipped += 1
                continue
            try:
                results: list[Any] = [cross_check(op, comm=comm)]
            except CommunicatorError:  # raised on every rank: the tree needs more ranks
                skipped += 1
                continue
            checked += 1
            if entry.kind == "adjoint":
                results.append(distributed_adjoint_test(op, comm=comm, dtype=np.complex128))
            ok = all(results)
            failures += not ok
            if comm.Get_rank() == 0:
                verdict = "ok  " if ok else "FAIL"
                notes = "; ".join(getattr(r, "detail", "") for r in results if not r)
                print(f"{verdict} {entry.name:<40} {short(op, 50)}" + (f"  {notes}" if notes else ""))
    if comm.Get_rank() == 0:
        print(
            f"{checked} operator(s) checked on {comm.Get_size()} rank(s), {failures} failed, "
            f"{skipped} skipped (more workers than ranks)"
        )
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
