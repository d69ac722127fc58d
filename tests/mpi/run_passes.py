"""One ``mpiexec`` launch of the MPI suite (tests/mpi) at several communicator sizes.

::

    mpiexec -n 4 python tests/mpi/run_passes.py 4 3 2 1 -- [pytest arguments]

runs the whole suite once for each size (here 4, 3, 2 and 1 ranks), in passes: a pass splits the
launch's ranks into consecutive groups of the sizes that fit side by side (on 4 ranks: 4; then 3
and 1 together; then 2), and each group runs the suite as a launch of that many ranks would. For
the pass, ``MPI.COMM_WORLD`` *is* the group's communicator: mpi4py's module attribute is set to
it, so the tests' communicator and every default of linop (``comm=None``) are the group's, and a
group never waits for another. A rank in no group of a pass waits for the next, asleep
(:func:`wait_for_every_rank`). The interpreter's start, its imports (torch among them) and
mpiexec's start are paid once instead of once per size.

Between passes the test modules and their helpers are imported afresh (they read
``MPI.COMM_WORLD`` when imported). The groups' communicators are never freed: linop keeps a
context per communicator, and a freed handle could be reused by a later one. Each group's first
rank prints a line ``== N ranks: ranks a-b of the launch`` before its pass. The exit status is 0
when every pass this rank took part in passed, else 1 (the launcher's ``mpiexec`` then fails).
A test stuck past pytest-timeout's bound ends its process, and ``mpiexec`` the job.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from mpi4py import MPI

HERE = Path(__file__).resolve().parent


def passes(sizes: list[int], ranks: int) -> list[list[int]]:
    """The sizes grouped into passes: each pass the largest sizes left that fit side by side in
    ``ranks`` ranks (first fit, largest first).

    >>> passes([4, 3, 2, 1], 4)
    [[4], [3, 1], [2]]
    """
    left = sorted(sizes, reverse=True)
    if any(size > ranks or size < 1 for size in left):
        raise SystemExit(f"run_passes: sizes {sizes} do not fit a launch of {ranks} ranks")
    grouped = []
    while left:
        taken, free = [], ranks
        for size in list(left):
            if size <= free:
                taken.append(size)
                free -= size
                left.remove(size)
        grouped.append(taken)
    return grouped


def _forget_test_modules() -> None:
    """Drop the suite's modules (helpers, strategies, the test modules, conftest files) so that
    the next pass imports them afresh; this module stays."""
    tests = HERE.parent
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None) or ""
        if name != "__main__" and Path(path).resolve().is_relative_to(tests):
            del sys.modules[name]


def wait_for_every_rank(world: MPI.Comm, pause: float = 0.01) -> None:
    """Return when every rank of ``world`` has called this, checking every ``pause`` seconds
    and sleeping in between. A rank waiting inside an MPI call polls for progress (under
    tests/conftest.py's ``MPICH_YIELDING``, about a quarter of a core), and a rank whose group
    finished first waits for the others' pass: the 1-rank group beside the 3-rank one, about
    20 s on the idle machine."""
    request = world.Ibarrier()
    while not request.Test():
        time.sleep(pause)


def main(argv: list[str]) -> int:
    sizes, _, pytest_args = (" ".join(argv)).partition("--")
    world = MPI.COMM_WORLD
    worst = 0
    for group_sizes in passes([int(s) for s in sizes.split()], world.size):
        starts = [sum(group_sizes[:i]) for i in range(len(group_sizes))]
        mine = [i for i, start in enumerate(starts) if start <= world.rank < start + group_sizes[i]]
        color = mine[0] if mine else MPI.UNDEFINED
        wait_for_every_rank(world)
        sub = world.Split(color, world.rank)  # collective over the launch: the passes stay in step
        if sub == MPI.COMM_NULL:
            continue
        MPI.COMM_WORLD = world if sub.size == world.size else sub  # type: ignore[misc]
        if sub.rank == 0:
            first = starts[color]
            print(f"\n== {sub.size} ranks: ranks {first}-{first + sub.size - 1} of the launch", flush=True)
        _forget_test_modules()
        status = pytest.main([str(HERE), *pytest_args.split()])
        worst = max(worst, int(status != 0))
        MPI.COMM_WORLD = world  # type: ignore[misc]
    return worst


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
