"""The torch.distributed executor on gloo, at 1-4 processes: one launch per process count, each
running every check of ``tests/torchdist/checks.py`` (halo exchanges, collectives,
repartitions, worker maps, a sub-group, bound plans, autograd, typed errors on every rank,
random trees; against the numpy interpreter, exactly in integers).

Processes 1, 3 and 4 are made by ``torch.multiprocessing.spawn`` (``tests/torchdist/spawn.py``;
at 3 the CPU tensors take the device path, the one CUDA tensors take under NCCL; the 4 processes
then run the DTensor checks of ``tests/test_dtensor.py`` too, one world of 4 for both; at 3 and 4
the all-gathers and reduce-scatters of equal shares run as the collectives, at 2 as gloo's
default for small groups, point-to-point),
2 by ``python -m torch.distributed.run`` (torchrun), which also runs the README's "Run under
torchrun" script and, last, a rank that never arrives (the others must raise
``PeerTimeoutError`` naming the deadline while it is still alive: only the deadline can have
ended their wait). Rendezvous on 127.0.0.1: the spawn launcher hosts its store
(``tests/torchdist/rendezvous.py``), torchrun's agent binds a free port picked at run time;
every launch is bounded by a timeout and ``init_process_group(timeout=60 s)``.
``LINOP_LONG=1`` draws more random trees.

Also here, in this process: the errors raised before any process group exists.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (the torch extra)")
dist = pytest.importorskip("torch.distributed")

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "torchdist"
LAUNCH_TIMEOUT = 1200
"""Seconds one launch may take: generous (a shared, loaded 2-core machine imports torch slowly,
and the 4-process launch runs the DTensor checks too); past it the test reports "timed out"."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _environment() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _run(command: list[str]) -> subprocess.CompletedProcess[str]:
    try:
        result = subprocess.run(
            command, cwd=SCRIPTS, env=_environment(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT
        )
    except subprocess.TimeoutExpired as expired:
        out = expired.stdout.decode() if isinstance(expired.stdout, bytes) else expired.stdout
        pytest.fail(f"{' '.join(command[1:])} timed out after {LAUNCH_TIMEOUT} s\n{out}")
    assert result.returncode == 0, (
        f"exit {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}"
    )
    return result


@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
@pytest.mark.parametrize(
    "processes, path", [(4, "host"), (3, "device"), (1, "host")], ids=["4-host", "3-device", "1-host"]
)
def test_checks_under_spawn(processes, path, monkeypatch, tmp_path):
    """``device``: CPU tensors forced through the device path (torch ops, tensors kept where
    they are), which CUDA tensors take under NCCL."""
    if path == "device":
        monkeypatch.setenv("LINOP_TORCH_DEVICE_PATH", "1")
    if processes > 1:  # the collectives' gathers (small gloo groups gather point-to-point by default)
        monkeypatch.setenv("LINOP_TORCH_GATHERS", "native")
    finale = {1: None, 3: "bound-timeout", 4: "failure"}[processes]  # the launch's last case
    if finale:
        monkeypatch.setenv("LINOP_CHECKS_FINALE", finale)
        monkeypatch.setenv("LINOP_CHECKS_MARKERS", str(tmp_path))
    with_dtensor = ["--dtensor"] if processes == 4 else []
    result = _run([sys.executable, "spawn.py", str(processes), *with_dtensor])
    assert _passed(result.stdout) == set(range(processes)), result.stdout
    if with_dtensor:
        from test_dtensor import assert_dtensor_checks_passed

        assert_dtensor_checks_passed(result.stdout, processes)
    if finale == "failure":  # a rank failing after the check: every rank raised RankFailedError
        assert set(map(int, re.findall(r"FAILURE OK rank (\d+)", result.stdout))) == set(range(processes))
    if finale == "bound-timeout":  # a bound plan's first call without the last rank
        found = set(map(int, re.findall(r"BOUND TIMEOUT OK rank (\d+)", result.stdout)))
        assert found == set(range(processes - 1)), result.stdout
        assert f"BOUND TIMEOUT ABSENT rank {processes - 1}" in result.stdout, result.stdout


def _passed(out: str) -> set[int]:
    """The ranks that printed ``CHECKS OK <count> rank <r>`` (lines of processes may run into
    each other)."""
    return {int(rank) for rank in re.findall(r"CHECKS OK \d+ rank (\d+)", out)}


@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_checks_readme_and_a_missing_peer_under_torchrun(tmp_path, monkeypatch):
    from test_readme_torchrun import torchrun_block

    processes, block = torchrun_block()
    assert processes == 2
    script = tmp_path / "readme_torchrun.py"
    script.write_text(block)
    markers = tmp_path / "markers"
    markers.mkdir()
    monkeypatch.setenv("LINOP_CHECKS_MARKERS", str(markers))
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(processes),
        "--master-addr=127.0.0.1",
        "--master-port",
        str(_free_port()),
        "checks.py",
        str(script),
        "--timeout-case",
    ]
    result = _run(command)
    out = result.stdout
    assert _passed(out) == set(range(processes)), out
    assert "TIMEOUT OK rank 0" in out and "TIMEOUT ABSENT rank 1" in out, out
    assert "PeerTimeoutError" not in result.stderr


def test_errors_before_any_process_group():
    from linop import Block, Space
    from linop.backends import torch_distributed as td
    from linop.errors import ProcessGroupArgumentError, ProcessGroupError
    from linop.frameworks.torch_function import function

    op = Space([Block("a", (2,), 0)]).identity() if hasattr(Space, "identity") else None
    if op is None:
        from linop import Identity

        op = Identity(Space([Block("a", (2,), 0)]))
    if dist.is_initialized():  # pragma: no cover - a plain pytest process has no group
        pytest.skip("a process group exists in this process")
    with pytest.raises(ProcessGroupError, match="not initialized"):
        td.apply(op, {"a": torch.zeros(2)})
    with pytest.raises(ProcessGroupArgumentError, match="ProcessGroup"):
        td.plan_for(op, group="world")
    with pytest.raises(ProcessGroupArgumentError, match="not both"):
        function(op, comm=object(), group=True)
    with pytest.raises(ProcessGroupArgumentError, match="positive"):
        td.apply(op, {"a": torch.zeros(2)}, timeout=-1)
    os.environ["LINOP_TIMEOUT"] = "soon"
    try:
        with pytest.raises(ProcessGroupArgumentError, match="LINOP_TIMEOUT"):
            td.apply(op, {"a": torch.zeros(2)})
    finally:
        del os.environ["LINOP_TIMEOUT"]


def test_the_gathers_rule_and_its_variable(monkeypatch):
    """gloo groups of at most GLOO_POINT_TO_POINT_GROUP ranks gather point-to-point (measured
    faster there), larger ones and NCCL with the collectives; $LINOP_TORCH_GATHERS overrides,
    and a value it does not know is a typed error naming the variable."""
    from linop.backends.torch_distributed import group
    from linop.errors import ProcessGroupArgumentError

    small, large = group.GLOO_POINT_TO_POINT_GROUP, group.GLOO_POINT_TO_POINT_GROUP + 1
    monkeypatch.delenv(group.GATHERS_VARIABLE, raising=False)
    assert not group._native_gathers("gloo", small) and group._native_gathers("gloo", large)
    assert group._native_gathers("nccl", 2)
    monkeypatch.setenv(group.GATHERS_VARIABLE, "native")
    assert group._native_gathers("gloo", 2)
    monkeypatch.setenv(group.GATHERS_VARIABLE, "point-to-point")
    assert not group._native_gathers("nccl", 1024)
    monkeypatch.setenv(group.GATHERS_VARIABLE, "ring")
    with pytest.raises(ProcessGroupArgumentError, match="LINOP_TORCH_GATHERS='ring'"):
        group._native_gathers("gloo", 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (the NCCL path needs a GPU)")
def test_nccl_device_path():  # pragma: no cover - needs a GPU
    result = _run([sys.executable, "spawn.py", "1", "--nccl"])
    assert "CHECKS OK" in result.stdout


# -- the portable program, planned per rank (no process group needed) ---------------------------
def _portable_trees():
    from linop import (
        AllGather,
        AllReduce,
        Broadcast,
        DistributedTensor,
        HaloExchange,
        Kernel,
        Partition,
        Repartition,
        halo_geometry,
        halo_windows,
    )

    def tensor(name="x", grid=(4, 4), shape=(12, 9)):
        return DistributedTensor(name, shape, Partition(grid))

    exchange = HaloExchange(halo_geometry(tensor(), Kernel(3, padding=1, boundary="periodic")))
    return {
        "halo-windows": halo_windows(tensor(), Kernel(3, padding=1)),
        "stages-periodic": exchange.expand(),
        "all-reduce": AllReduce(tensor(), 0),
        "broadcast-row": Broadcast(tensor("x", (1, 4), (3, 9)), Partition((4, 4)), "y"),
        "all-gather": AllGather(tensor(), 0, "g"),
        "repartition": Repartition(tensor(), tensor("z", (2, 8))),
        "sum": 2 * AllReduce(tensor(shape=(12, 8)), 0) + AllReduce(tensor(shape=(12, 8)), 1),
    }


@pytest.mark.parametrize("adjoint", [False, True], ids=["forward", "adjoint"])
def test_a_mapped_rank_plans_its_portable_program_per_rank_equal_to_the_global_route(adjoint, monkeypatch):
    """Under blocked and round-robin maps, each rank's portable program (what a
    torch.distributed plan under a map runs) is planned from its own workers' part, without
    the global program ever built, and equals the projection of the global portable program:
    messages per peer in order with their tags, local moves, local nodes, the largest worker.
    Controls: another map's program differs from the reference, and so does a tag one off."""
    from test_worker_map import _mutations, _normalized

    from linop import AllReduce
    from linop.backends.torch_distributed.schedule import portable_program
    from linop.pieces import PieceMovement
    from linop.program import WorkerMap, mapped_global_program
    from linop.program import mapped as program_mapped

    for name, op in _portable_trees().items():
        op = op.H if adjoint else op
        for kind in ("blocked", "round_robin"):
            mapping = getattr(WorkerMap, kind)(16, 3)
            monkeypatch.setattr(program_mapped, "_COMPILED", {})  # no plan kept from elsewhere
            with monkeypatch.context() as probes:  # neither the global program nor an expansion
                probes.setattr(program_mapped, "lower_portable", _no_global_program)
                probes.setattr(AllReduce, "expand", _no_global_program)
                probes.setattr(PieceMovement, "expand", _no_global_program)
                mine = [portable_program(op, mapping, rank, 3) for rank in range(3)]
            for rank, (program, problem) in enumerate(mine):
                assert problem is None and program is not None
                reference = mapped_global_program(op, rank, mapping, mapped_fast_paths=False)
                assert _normalized(program.schedule) == _normalized(reference.schedule), (name, kind, rank)
                assert program.max_worker == reference.max_worker == 15
        other = mapped_global_program(op, 1, WorkerMap.blocked(16, 3), mapped_fast_paths=False)
        assert _normalized(mine[1][0].schedule) != _normalized(other.schedule), name  # control: round-robin
        wrong = list(_mutations(mine[1][0].schedule))
        reference = _normalized(mapped_global_program(op, 1, mapping, mapped_fast_paths=False).schedule)
        assert all(_normalized(schedule) != reference for schedule in wrong), name  # control


def _no_global_program(*args, **kwargs):
    raise AssertionError("the global portable program was built (or a whole expansion)")


def test_an_unmapped_plan_compiles_its_portable_program_per_rank(monkeypatch):
    """Without a map a torch.distributed plan compiles its portable program (a run in a dtype
    the collectives do not move) under the group's identity map, described (O(1)), per rank:
    the global program is never built, and the schedule is the global projection's."""
    from test_worker_map import _normalized

    from linop.backends.torch_distributed.schedule import Compiled, identity_map
    from linop.program import WorkerMap, mapped_global_program
    from linop.program import mapped as program_mapped

    assert (
        identity_map(16) == WorkerMap(list(range(16)))
        and identity_map(16).description() == WorkerMap(list(range(16))).description()
    )
    monkeypatch.setattr(program_mapped, "_COMPILED", {})
    global_route = program_mapped.lower_portable
    for name, op in _portable_trees().items():
        monkeypatch.setattr(program_mapped, "lower_portable", _no_global_program)
        compiled = Compiled(op, 5, 16, world=True)
        assert compiled.problem is None and compiled.max_worker == 15, name
        program = compiled.portable()
        monkeypatch.setattr(program_mapped, "lower_portable", global_route)
        reference = mapped_global_program(op, 5, identity_map(16), mapped_fast_paths=False)
        assert _normalized(program.schedule) == _normalized(reference.schedule), name
    monkeypatch.setattr(program_mapped, "lower_portable", _no_global_program)  # control: the probe
    error = program_mapped.compiled_for(op, WorkerMap.round_robin(16, 3)).error
    assert "the global portable program was built" in str(error)
