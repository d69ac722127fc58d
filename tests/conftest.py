"""Test-suite settings: reproducible hypothesis examples, MPICH settings for the MPI launches, and
the grouping and order of tests for a parallel run (``make test`` runs ``pytest -n auto --dist
loadgroup`` with pytest-xdist).

Hypothesis draws the same examples on every run (reproducible CI). Set
``HYPOTHESIS_PROFILE=explore`` to draw fresh random examples (and more of them) instead.

MPICH (the mpich wheel: ch4, shared memory between the ranks on one machine) waits for messages
by polling without pause. The suite starts 4 ranks on a 2-core machine, where a rank polling
for a message holds a core the rank that would send it needs. :data:`MPICH_YIELDING` makes a
rank that finds nothing give up the processor instead (the settings MPICH's own CI uses for
mpi4py's tests at 3 to 5 ranks on 2 cores, and a sleep rather than ``sched_yield``, which
hardly yields under Linux's scheduler). They are set here, for every process the tests start
(``mpiexec`` in tests/test_mpi.py, the notebooks' kernels and their launches, the CLI); users'
own runs are left alone. A variable already set in the environment is kept. Likewise every JAX
program the suite compiles is compiled at XLA's optimization level 0 (:data:`XLA_TEST_FLAGS`).

Parallel runs (pytest-xdist): tests that share work run on one worker, in one group
(:data:`GROUPS`): the notebooks, executed once and both checked (tests/test_notebooks.py) and
built into the docs (tests/test_docs.py); the wheel and sdist of tests/test_packaging.py; the
JAX device processes of tests/test_jax_shard.py (one process for the tests of its device counts),
test_jax_kernels.py, test_jax_layers.py and test_jax_modules.py (one each, a module fixture); the
framework edges' launch; the one process of tests/test_registry.py's two handler-list checks
(tests/test_suite_groups.py: every module that shares such a result is in a group).
Launches of many processes (:data:`LAUNCHES`) are collected first, so that the workers start
the longest tests first and finish together (``make test`` passes ``--no-loadscope-reorder``:
xdist would otherwise hand out the groups with the most tests first, and the MPI suite, the
longest test, started a minute or two into the run).
"""

from __future__ import annotations

import gc
import os
from typing import Any

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None, deadline=None)
settings.register_profile("explore", max_examples=500, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

MPICH_YIELDING = {
    "MPIR_CVAR_CH4_PROGRESS_THROTTLE": "1",
    "MPIR_CVAR_CH4_PROGRESS_THROTTLE_NO_PROGRESS_COUNT": "1",
    "MPIR_CVAR_POLLS_BEFORE_YIELD": "1",
    "MPIR_CVAR_ENABLE_HEAVY_YIELD": "1",
}
"""MPICH control variables (``mpivars`` lists them): after one poll that found nothing
(``..._NO_PROGRESS_COUNT``), throttle the progress loop (``..._THROTTLE``) by yielding the
processor, with a sleep (``ENABLE_HEAVY_YIELD``) rather than ``sched_yield``."""

for _name, _value in MPICH_YIELDING.items():
    os.environ.setdefault(_name, _value)

XLA_TEST_FLAGS = "--xla_backend_optimization_level=0"
"""XLA's flags for every JAX program the suite compiles (in its own processes and the JAX
processes it starts, which add their host device count to them): LLVM's optimization level 0
for XLA's CPU code. The suite compiles hundreds of small programs and runs each once or twice;
at level 0 compiling takes about 30 % less CPU (tests/jax_devices/layer_checks.py: 18-20 s
against 25-28 s), and the programs compute the same values (an optimization level changes how
fast the machine code runs, not what it computes; the checks are exact on integers and on
floats holding integers, the rest within float tolerances). Not added where ``XLA_FLAGS``
already sets an optimization level."""

if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {XLA_TEST_FLAGS}".strip()

GROUPS = {
    "test_docs.py": "notebooks",
    "test_notebooks.py": "notebooks",
    "test_packaging.py": "packaging",
    "test_registry.py::test_the_handler_module_list_is_complete": "handler-modules",
    "test_registry.py::test_a_handler_module_missing_from_the_list_is_caught": "handler-modules",
    "test_jax_shard.py": "jax devices",
    "test_jax_kernels.py": "jax kernels",
    "test_jax_layers.py": "jax layers",
    "test_jax_modules.py": "jax modules",
    "test_framework_edges.py": "framework edges",
}
"""Test modules (``test_x.py``) or single tests (``test_x.py::test_name``) that share one costly
result (a module fixture or a per-process cache), and the group that keeps them on one worker
(:func:`pytest_xdist_make_scheduler`)."""

LAUNCHES = (
    "test_mpi.py",
    "test_torch_distributed.py",
    "test_dtensor.py",
    "test_framework_edges.py",
    "test_jax_shard.py",
    "test_jax_kernels.py",
    "test_fuzz_engines.py",  # a 2-process gloo launch and two JAX processes
    "test_example_training.py",  # 4 processes, and torch.compile
    "test_notebooks.py",
    "test_docs.py",
)
"""Test modules that launch many processes or run long (in this order: the longest first)."""


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist; without it, never called
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under ``--dist loadgroup``: every test a unit of its own, but the tests of a module of
    :data:`GROUPS`, and the single tests it names, in that group's one unit (on one worker).
    xdist's own grouping by ``xdist_group`` marks renames the tests' node ids, which pytest 9
    no longer takes."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupedScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path, _, name = nodeid.partition("::")
            module = path.rsplit("/", 1)[-1]
            return GROUPS.get(module) or GROUPS.get(f"{module}::{name}", nodeid)

    return GroupedScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LAUNCHES)}
    # sorted is stable: the order within a module, and of every other module, is kept
    items[:] = sorted(items, key=lambda item: rank.get(item.path.name, len(LAUNCHES)))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what collection made (the imported packages: torch, sympy, scipy, linop and the test
    modules), so that the garbage collector stops walking it: the MPI suite's ``gc.collect()``
    calls (tests that count what a freed plan releases) took 0.13 s each over it, and every
    automatic full collection walked it too. Objects made by the tests are collected as before."""
    gc.freeze()


@pytest.fixture
def one_process_group() -> Any:
    """torch.distributed with a world of one process (gloo, rendezvous on 127.0.0.1 at a free
    port), destroyed afterwards, so that the rest of this process sees none."""
    dist = pytest.importorskip("torch.distributed")
    import datetime
    import socket

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        yield
    finally:
        dist.destroy_process_group()
