"""The torch modules' ``mapping=`` in one process and on a torch.distributed group.

In one process every worker runs here and a map is not used (as for ``TorchOperator``): the
modules built with one equal those built without. On two gloo processes (127.0.0.1,
``tests/torchdist/map_checks.py``) a few modules of ``tests/module_map_cases.py`` under
reversed ranks equals the same module in one process, and bad maps raise the typed errors on both
processes. The MPI engine's tests, at 1-4 ranks: ``tests/mpi/test_module_maps.py``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch is not installed (the torch extra)")
sys.path.insert(0, str(Path(__file__).resolve().parent))
import module_map_cases as cases

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", ["conv", "batchnorm", "loss", "maxpool", "repartition"])
def test_a_map_in_one_process_changes_nothing(name):
    build, _ = cases.CASES[name]
    module, got = build(2, mapping=[1, 0])
    assert module.input_names == build(2)[0].input_names
    assert cases.compare(got, cases.serial_run(name, 2), exact=True) == []


@pytest.mark.timeout(400)
def test_modules_under_a_worker_map_on_torch_distributed():
    """Two gloo processes: a few modules under reversed ranks equals one process; a short map
    and differing maps raise WorkerMapError and WorkerMapMismatchError on both."""
    pytest.importorskip("torch.distributed")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    command = [sys.executable, "map_checks.py", "2"]
    try:
        result = subprocess.run(
            command, cwd=ROOT / "tests" / "torchdist", env=env, capture_output=True, text=True, timeout=360
        )
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"the torch.distributed map checks timed out after 360 s\n{expired.stdout}")
    assert result.returncode == 0, f"{result.stdout[-4000:]}\n{result.stderr[-6000:]}"
    assert sorted(result.stdout.count(f"MAPS OK rank {r}") for r in range(2)) == [1, 1], result.stdout
