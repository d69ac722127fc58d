"""README's MPI example (``halo.py``), run as written inside the MPI suite's launch at the rank
count its header names (``mpiexec -n 4``), so it needs no launch of its own."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from helpers import collective_assert
from mpi4py import MPI

README = Path(__file__).resolve().parents[2] / "README.md"
MPI_MARK = re.compile(r"^# \S+ — run with: \.venv/bin/mpiexec -n (\d+)")


def mpi_example() -> tuple[int, str]:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    ((ranks, block),) = [(int(m.group(1)), b) for b in blocks if (m := MPI_MARK.match(b))]
    return ranks, block


RANKS, BLOCK = mpi_example()


@pytest.mark.skipif(MPI.COMM_WORLD.size != RANKS, reason=f"the example runs on {RANKS} ranks")
def test_the_readme_mpi_example_runs_and_says_so(capsys):
    namespace: dict = {"__name__": "__main__"}
    hook = sys.excepthook  # the example installs linop's hook: keep pytest's process as it was
    try:
        exec(compile(BLOCK, str(README), "exec"), namespace)
    finally:
        sys.excepthook = hook
    printed = capsys.readouterr().out
    mine, back = namespace["mine"], namespace["back"]
    collective_assert(
        back[mine.name].shape == mine.shape, f"the adjoint's block {mine.name} has the wrong shape"
    )
    if MPI.COMM_WORLD.rank == 0:
        assert f"on {RANKS} ranks: 102 forward runs and the adjoint done" in printed, printed
    else:
        assert printed == "", printed
