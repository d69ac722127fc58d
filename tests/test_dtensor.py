"""The DTensor bridge and lifting across a process group on gloo: one launch of 4 processes
(``tests/dtensor/spawn.py``, ``torch.multiprocessing.spawn``, rendezvous on 127.0.0.1 at a free
port, ``init_process_group(timeout=60 s)``, the launch bounded by a timeout) running every
check of ``tests/dtensor/checks.py``: linop's redistribute on the 21 layouts of
``tests/dtensor/cases.py`` (torch.chunk sizes, rows 10/30/7/30, empty and nested shards,
Replicate and Partial on 1-d and 2 x 2 meshes) against the numpy interpreter, forward and
backward, exactly; DTensor in and out; DTensor's own ``Shard(0) -> Shard(1)`` backward and a
hand-written all-gather proven across processes, the all-gather that forgets its reduction
refuted with the wrong entry named.

In CI the 4 processes are those of the torch.distributed executor's 4-process launch
(``tests/test_torch_distributed.py``, ``tests/torchdist/spawn.py 4 --dtensor``: its checks, then
these on the same group), so the suite starts one world of 4 torch processes for both; its
output is checked by :func:`assert_dtensor_checks_passed`. ``LINOP_LONG=1`` adds launches of
1, 2 and 3 processes of their own (``tests/dtensor/spawn.py``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch is not installed (the torch extra)")
pytest.importorskip("torch.distributed")

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "dtensor"
LAUNCH_TIMEOUT = 600  # seconds: a shared, loaded 2-core machine imports torch slowly
COUNTS = [1, 2, 3] if os.environ.get("LINOP_LONG") == "1" else []
"""The launches of their own (4 processes: in tests/test_torch_distributed.py's launch)."""


def assert_dtensor_checks_passed(stdout: str, processes: int) -> None:
    """The launch printed that every check passed on each of ``processes`` ranks."""
    found = re.search(r"dtensor checks: (\d+) checks on each of (\d+) ranks passed.*", stdout)
    assert found and int(found.group(2)) == processes, stdout
    assert int(found.group(1)) >= 30, stdout  # the checks ran, not an empty launch
    print(found.group(0))  # the checks' count and where the time went


@pytest.mark.parametrize("processes", COUNTS)
def test_dtensor_checks(processes):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    env["LINOP_DTENSOR_TESTS"] = "1"
    result = subprocess.run(
        [sys.executable, "spawn.py", str(processes)],
        cwd=SCRIPTS,
        env=env,
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT,
    )
    assert result.returncode == 0, (
        f"exit {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}"
    )
    assert_dtensor_checks_passed(result.stdout, processes)
