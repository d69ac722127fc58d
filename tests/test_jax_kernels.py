"""Local kernels inside the lowering onto JAX devices: ``tests/jax_devices/check_kernels.py D
K1 K2 ...`` (not collected by pytest) proves, in one process of 4 host devices, for the counts
1, 2 and 4, stencils (dense, ``jax=True``, a jnp pair) and :class:`~linop.layers.Convolution`
trees equal to the numpy interpreter and their transposes equal to ``op.H``, and catches wrong
JAX kernels. The contract (which kernels run inside jit, the typed errors) is tested here on
the host, without devices."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from linop import Block, LocalKernel, Space, local_operator
from linop.errors import DeviceKernelError, LocalOperatorError

HERE = Path(__file__).resolve().parent
COUNTS = (1, 2, 4)


LONG = os.environ.get("LINOP_LONG") == "1"


def run_kernels(counts: tuple[int, ...], x64: bool = False) -> subprocess.CompletedProcess[str]:
    """``check_kernels.py`` in one process of 4 host devices for ``counts`` (``jax_enable_x64``
    on if ``x64``)."""
    pytest.importorskip("jax", reason="jax is not installed (the jax extra: pip install -e '.[jax]')")
    environment = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    environment["JAX_ENABLE_X64"] = "1" if x64 else "0"
    environment["PYTHONPATH"] = os.pathsep.join(
        [str(HERE.parent), str(HERE), str(HERE / "jax_devices"), environment.get("PYTHONPATH", "")]
    )
    return subprocess.run(
        [sys.executable, str(HERE / "jax_devices" / "check_kernels.py"), "4", *map(str, counts)],
        capture_output=True,
        text=True,
        timeout=1200,
        env=environment,
        stdin=subprocess.DEVNULL,
    )


@pytest.fixture(scope="module")
def device_run() -> subprocess.CompletedProcess[str]:
    return run_kernels(COUNTS)


def _kernels_proven(done: subprocess.CompletedProcess[str], count: int) -> None:
    printed = done.stdout.split(f"== {count} devices", 1)[-1].split("== ", 1)[0]
    assert f"trees proven on {count} devices" in printed, done.stdout[-4000:] + done.stderr[-4000:]
    assert "control caught: adjoint twice" in printed and "control caught: forward twice" in printed, printed


@pytest.mark.timeout(1500)  # one subprocess: minutes on the loaded 2-core machine
@pytest.mark.parametrize("count", COUNTS)
def test_kernels_lower_exactly_and_wrong_jax_kernels_are_caught(device_run, count):
    _kernels_proven(device_run, count)


@pytest.mark.timeout(1500)
@pytest.mark.skipif(
    not LONG,
    reason="LINOP_LONG=1: the kernels again with jax_enable_x64 (CI proves the x64 lowering in test_jax_shard)",
)
def test_kernels_lower_exactly_with_x64():
    """The same on 4 devices with ``jax_enable_x64`` on (float64 transposes, int64 sums)."""
    _kernels_proven(run_kernels((4,), x64=True), 4)


def _space() -> Space:
    return Space([Block("a", (3,))])


def test_an_unmarked_callable_kernel_is_refused_naming_the_way_to_mark_it():
    from linop.backends.jax.plan import compile_plan

    op = local_operator(_space(), "a", {"b": (3,)}, forward=lambda a: a, adjoint=lambda b: b)
    with pytest.raises(DeviceKernelError, match=r"cannot run inside jit on JAX devices.*jax="):
        compile_plan(op, 1)


def test_a_sparse_matrix_kernel_is_refused_and_a_dense_one_is_one_kernel_op():
    import scipy.sparse as sp

    from linop.backends.jax.plan import KernelOp, compile_plan

    with pytest.raises(DeviceKernelError, match="cannot run inside jit"):
        compile_plan(local_operator(_space(), "a", {"b": (2,)}, sp.csr_array(np.ones((2, 3)))), 1)
    plan = compile_plan(local_operator(_space(), "a", {"b": (2,)}, np.ones((2, 3))), 1)
    (op,) = [op for op in plan.ops if isinstance(op, KernelOp)]
    assert [(c.device, c.consumed, c.produced) for c in op.calls] == [(0, (("a", (3,)),), (("b", (2,)),))]
    assert [type(o).__name__ for o in plan.adjoint().ops] == ["KernelOp"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(kernel=np.ones((3, 3)), jax=True), "a dense matrix runs on JAX devices as it is"),
        (dict(forward=abs, adjoint=abs, jax=(abs,)), "jax= must be True or a pair"),
        (dict(forward=abs, adjoint=abs, jax=(abs, 3)), "jax= must be True or a pair"),
    ],
    ids=["matrix", "one-callable", "not-callable"],
)
def test_jax_is_refused_where_it_means_nothing(kwargs, message):
    with pytest.raises(LocalOperatorError, match=message):
        LocalKernel.of(**kwargs)


def test_a_jax_pair_is_part_of_the_kernels_identity():
    def forward(a):
        return a

    def adjoint(b):
        return b

    plain = LocalKernel.of(forward=forward, adjoint=adjoint)
    traced = LocalKernel.of(forward=forward, adjoint=adjoint, jax=True)
    paired = LocalKernel.of(forward=forward, adjoint=adjoint, jax=(adjoint, forward))
    assert plain.device_callables is None and not plain.runs_on_jax
    assert traced.device_callables == (forward, adjoint) and traced.runs_on_jax
    assert len({plain, traced, paired}) == 3 and plain != traced != paired
    assert repr(plain).endswith("adjoint)") and "(jax)" in repr(traced) and "(jax " in repr(paired)
