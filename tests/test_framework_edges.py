"""The framework edge: a table of the mistakes a user makes where linop meets torch.distributed
and JAX, each with the typed error it must raise (and, across processes, on which rank).

torch.distributed: one launch of 2 gloo processes (``tests/edges/ranks.py``, rendezvous on
127.0.0.1 at a store this process hosts, ``init_process_group(timeout=60 s)``, the launch bounded by
:data:`LAUNCH_TIMEOUT`) makes every mistake of :data:`TORCH_EDGES` in order through the
differentiable wrappers (torch ``function``, ``OperatorModule``, ``LayerModule``, the DTensor
bridge) and the executor: the executor's own errors come first (a group smaller than the tree,
a rank off the group), a mistake on one rank is raised on every rank naming that rank, and a
peer that failed is a :class:`~linop.errors.RankFailedError` naming it and its error, not a
timeout. JAX: the wrapper's mistakes of ``linop.frameworks.jax_function`` (those of
``jax_sharded`` are tested with it), in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "edges" / "ranks.py"
LAUNCH_TIMEOUT = 300
"""Seconds the launch may take (a shared, loaded 2-core machine imports torch slowly)."""

EVERY = "every"
TORCH_EDGES: dict[str, dict[str, tuple[str, tuple[str, ...]]]] = {
    # case -> {rank ("0", "1" or EVERY): (error type, substrings of its message)}
    "function: group smaller than the tree": {EVERY: ("ProcessGroupError", ("launch at least 3",))},
    "OperatorModule: group smaller than the tree": {EVERY: ("ProcessGroupError", ("launch at least 3",))},
    "LayerModule: group smaller than the layer": {EVERY: ("ProcessGroupError", ("launch at least 3",))},
    "redistribute_local: sub-group smaller than the layouts": {
        "0": ("ProcessGroupError", ("has 1 rank(s)", "launch at least 2")),
        "1": ("ProcessGroupError", ("this rank (world rank 1) is not a member of the group",)),
    },
    "function: this rank not in the group": {
        "0": ("ok", ()),
        "1": ("ProcessGroupError", ("is not a member of the group",)),
    },
    "OperatorModule: this rank not in the group": {
        "0": ("ok", ()),
        "1": ("ProcessGroupError", ("is not a member of the group",)),
    },
    "LayerModule: this rank not in the group": {
        "0": ("ok", ()),
        "1": ("ProcessGroupError", ("is not a member of the group",)),
    },
    "executor apply: this rank not in the group": {
        "0": ("ok", ()),
        "1": ("ProcessGroupError", ("is not a member of the group",)),
    },
    "function: group= not a process group": {EVERY: ("ProcessGroupArgumentError", ("not str",))},
    "function: comm= and group= together": {EVERY: ("ProcessGroupArgumentError", ("not both",))},
    "LayerModule: comm= and group= together": {EVERY: ("ProcessGroupArgumentError", ("not both",))},
    "function: a block missing on rank 1 (first call)": {
        EVERY: ("DistributedStateError", ("rank 1: local state is missing block 'a[1]'",))
    },
    "function: an unexpected block on rank 1 (first call)": {
        EVERY: ("DistributedStateError", ("rank 1: local state holds block 'a[0]'",))
    },
    "function: not a dict on rank 1 (first call)": {
        EVERY: ("DistributedStateError", ("rank 1: local state is missing block 'a[1]'",))
    },
    "function: a numpy array for a tensor on rank 1 (first call)": {
        EVERY: ("DistributedStateError", ("rank 1: block 'a[1]' is refused", "must be a torch tensor"))
    },
    "function: positional tensors, one too few on rank 1 (first call)": {
        EVERY: ("DistributedStateError", ("rank 1: local state is missing block 'a[1]'",))
    },
    "redistribute_local: a wrong local shape on rank 1": {
        EVERY: ("DistributedStateError", ("rank 1: block 'a[1]' has shape (1, 4)",))
    },
    "to_dtensor: pieces that are not torch.chunk's": {
        EVERY: ("UnevenShardError", ("not torch.chunk's", "Keep it local", "redistribute_local"))
    },
    "redistribute: a DTensor result on pieces that are not torch.chunk's": {
        EVERY: ("UnevenShardError", ("not torch.chunk's", "Keep it local"))
    },
    "LayerModule: input blocks of another layer": {
        EVERY: ("StateError", ("layer takes blocks", "not ['z']"))
    },
    "function: a bound call with a tensor too few": {EVERY: ("StateError", ("takes 1 tensor(s)", "not 0"))},
    "a rank's reported error is withdrawn at its next check": {EVERY: ("ok", ())},
    "function: a peer failed before the entry check": {
        "0": (
            "RankFailedError",
            (
                "a peer of the group of 2 failed",
                "rank 1 raised StateError",
                "must be a torch tensor, not str",
            ),
        ),
        "1": ("StateError", ("must be a torch tensor, not str",)),
    },
}


@pytest.fixture(scope="module")
def torch_edges(tmp_path_factory) -> dict[int, dict[str, str]]:
    """What each rank raised, by case: one launch of 2 gloo processes."""
    pytest.importorskip("torch", reason="torch is not installed (the torch extra)")
    from torch.distributed import TCPStore

    out = tmp_path_factory.mktemp("edges")
    # the store hosted here, on a port bound before it is named (tests/torchdist/rendezvous.py:
    # a port picked free and bound later by rank 0 races with every process binding one)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = int(store.port)
    env = dict(os.environ)
    env["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # every rank a client of it, rank 0 included
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    ranks = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), str(rank), "2", str(port), str(out)],
            cwd=SCRIPT.parent,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    logs = []
    try:
        for process in ranks:
            logs.append(process.communicate(timeout=LAUNCH_TIMEOUT)[0])
    except subprocess.TimeoutExpired:
        for process in ranks:
            process.kill()
        pytest.fail(f"the 2-process launch timed out after {LAUNCH_TIMEOUT} s")
    assert all(p.returncode == 0 for p in ranks), "\n".join(log[-4000:] for log in logs)
    found: dict[int, dict[str, str]] = {}
    for rank in range(2):
        lines = (out / f"rank{rank}.jsonl").read_text().splitlines()
        found[rank] = {row["case"]: row["raised"] for row in map(json.loads, lines)}
    return found


def test_the_launch_ran_every_case_of_the_table(torch_edges):
    for rank in range(2):
        assert list(torch_edges[rank]) == list(TORCH_EDGES), rank


@pytest.mark.parametrize("case", list(TORCH_EDGES), ids=list(TORCH_EDGES))
def test_torch_distributed_edge(torch_edges, case):
    for rank in range(2):
        kind, parts = TORCH_EDGES[case].get(str(rank)) or TORCH_EDGES[case][EVERY]
        raised = torch_edges[rank].get(case, "not run")
        name, _, message = raised.partition(": ")
        assert name == kind, f"rank {rank}: {raised}"
        for part in parts:
            assert part in message, f"rank {rank}: {part!r} not in {raised!r}"
        assert "timed out" not in message and " within " not in message, raised


def _jax_function():
    pytest.importorskip("jax", reason="jax is not installed (the jax extra)")
    from linop.frameworks.jax_function import function
    from linop.mesh_layout import MeshLayout, Shard
    from linop.redistribute import Redistribute

    source = MeshLayout.from_placements((2,), [Shard(0)], (4, 2))
    return function(Redistribute(source, source.with_placements([Shard(1)], name="b")))


JAX_EDGES = {
    # case -> (call on f, the JAX function of a 2-worker redistribute, substrings of the StateError)
    "state not a dict": (lambda f: f([np.ones((2, 2))]), ("must be a dict of arrays", "not list")),
    "a block missing": (lambda f: f({"x[0]": np.ones((2, 2))}), ("missing block(s) ['x[1]']",)),
    "an unexpected block": (
        lambda f: f({"x[0]": np.ones((2, 2)), "x[1]": np.ones((2, 2)), "y": np.ones(1)}),
        ("unexpected block(s) ['y']",),
    ),
    "a wrong block shape": (
        lambda f: f({"x[0]": np.ones((2, 2)), "x[1]": np.ones((3, 2))}),
        ("block 'x[1]' has shape (3, 2)", "expects (2, 2)"),
    ),
    "positional arrays, one too few": (lambda f: f.arrays(np.ones((2, 2))), ("takes 2 array(s)", "not 1")),
}


@pytest.mark.parametrize("case", list(JAX_EDGES), ids=list(JAX_EDGES))
def test_jax_function_edge(case):
    from linop.errors import StateError

    call, parts = JAX_EDGES[case]
    with pytest.raises(StateError) as raised:
        call(_jax_function())
    assert type(raised.value) is StateError
    for part in parts:
        assert part in str(raised.value), str(raised.value)
