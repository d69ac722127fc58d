"""Local kernels inside the lowering onto JAX devices: ``tests/jax_devices/check_kernels.py D
K1 K2 ...`` (not collected by pytest) proves, in one process of 4 host devices, for the counts
1 and 4 (2 as well with ``LINOP_LONG=1``), stencils (dense, ``jax=True``, a jnp pair) and
:class:`~linop.layers.Convolution` trees equal to the numpy interpreter and their transposes
equal to ``op.H``, and catches wrong JAX kernels. The contract (which kernels run inside jit, the typed errors) is tested here on
the host, without devices."""

from __future__ import annotations

import os
import subprocess
from typing import Any

import numpy as np
import pytest
from jax_device_runs import run_device_check

from linop import Block, LocalKernel, Space, local_operator
from linop.errors import DeviceKernelError, LocalOperatorError
from linop.kernel_template import KernelTemplate

LONG = os.environ.get("LINOP_LONG") == "1"
COUNTS = (1, 2, 4) if LONG else (1, 4)
"""The device counts proven. The count 2 only with ``LINOP_LONG=1`` (the CI suite's time: about
10 s of CPU): every branch it takes (the stencils, the convolution trees, a pair per worker
lowered to a ``lax.switch``, a template equal to the switch path) the count 4 takes as well, on
4 uneven blocks whose end workers have one neighbour each, as both of the count 2's have; the
count 1 proves the single-device program."""


def run_kernels(counts: tuple[int, ...], x64: bool = False) -> subprocess.CompletedProcess[str]:
    """``check_kernels.py`` in one process of 4 host devices for ``counts`` (``jax_enable_x64``
    on if ``x64``)."""
    return run_device_check("check_kernels.py", counts, x64)


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


def _taps(params, a, *, shapes):  # a template's callables (never called on the host)
    return a


def _other(params, a, *, shapes):
    return a


def _template_tree(templates: list[KernelTemplate]) -> Any:
    """Per worker one local operator ``a[w] -> b[w]`` whose jax= is ``templates[w]``."""
    from linop.operator import Composition

    space = Space([Block(f"a[{w}]", (3 + w,), w) for w in range(len(templates))])
    factors = []
    for w, template in enumerate(templates):
        op = local_operator(
            space, f"a[{w}]", (f"b[{w}]", (3 + w,)), forward=abs, adjoint=abs, jax=template, name=f"t{w}"
        )
        factors.append(op)
        space = op.range
    return Composition(tuple(reversed(factors)))


def _modes(op: Any, devices: int) -> set[str]:
    from linop.backends.jax.plan import KernelOp, compile_plan

    plan = compile_plan(op, devices)
    return {o.mode for o in (*plan.ops, *plan.adjoint().ops) if isinstance(o, KernelOp)}


def test_one_template_up_to_parameters_is_one_program_and_the_plan_says_so():
    """Workers' templates with the same callables and key, parameters of one rank and dtype
    (shapes may differ: zero-padded) run as one program ("spmd"); a different key, callable,
    parameter dtype or a plain pair keep the switch; one call on one device is "single"."""
    same = [KernelTemplate(_taps, _taps, (np.full(w + 1, w),), "k") for w in range(4)]
    assert _modes(_template_tree(same), 4) == {"spmd"}
    assert _modes(_template_tree(same[:1]), 1) == {"single"}
    keys = [KernelTemplate(_taps, _taps, (np.ones(2),), k) for k in ("k", "k", "k", "other")]
    assert _modes(_template_tree(keys), 4) == {"switch"}
    functions = [KernelTemplate(f, f, (np.ones(2),), "k") for f in (_taps, _taps, _other, _taps)]
    assert _modes(_template_tree(functions), 4) == {"switch"}
    dtypes = [KernelTemplate(_taps, _taps, (np.ones(2, dtype=t),), "k") for t in ("f4", "f4", "f8", "f4")]
    assert _modes(_template_tree(dtypes), 4) == {"switch"}
    ranks = [KernelTemplate(_taps, _taps, (np.ones((2,) * r),), "k") for r in (1, 1, 2, 1)]
    assert _modes(_template_tree(ranks), 4) == {"switch"}
    from linop.backends.jax.plan import KernelOp, compile_plan

    (op,) = [o for o in compile_plan(_template_tree(same), 4).ops if isinstance(o, KernelOp)]
    assert repr(op) == "KernelOp(spmd: 4 calls on 4 devices, 4 kernels)"


def test_a_convolution_layer_runs_its_kernels_as_one_program():
    from linop import DistributedTensor, Kernel, Partition
    from linop.layers import Convolution

    for rows in (16, 15):  # even and uneven row blocks
        x = DistributedTensor("x", (1, 2, rows, 5), Partition((1, 1, 4, 1)))
        layer = Convolution(x, 3, Kernel(3, padding=1))
        assert _modes(layer.input_operator(np.ones(layer.weights.global_shape)), 4) == {"spmd"}


def test_a_template_is_part_of_the_kernels_identity():
    one = KernelTemplate(_taps, _taps, (np.arange(3),), "k")
    kernel = LocalKernel.of(forward=abs, adjoint=abs, jax=one)
    again = LocalKernel.of(forward=abs, adjoint=abs, jax=KernelTemplate(_taps, _taps, (np.arange(3),), "k"))
    other = LocalKernel.of(
        forward=abs, adjoint=abs, jax=KernelTemplate(_taps, _taps, (np.arange(3) + 1,), "k")
    )
    assert kernel.runs_on_jax and kernel.device_template is one and kernel.device_callables is None
    assert kernel == again and hash(kernel) == hash(again) and kernel != other
    assert "(jax template " in repr(kernel) and "'k'" in repr(kernel)


def test_one_program_masks_a_consumed_slot_unless_its_padding_is_known_zero():
    """``widen_boxes`` marks a consumed slot unmasked only where every device's entries
    beyond its block are known zero; a slot that may hold a stale nonzero entry there (a
    control) stays masked, and its whole slot then counts as read (its clears kept)."""
    from linop.backends.jax.passes import _reads, widen_boxes
    from linop.backends.jax.plan import KernelOp, compile_plan

    same = [KernelTemplate(_taps, _taps, (np.ones(2),), "k") for _ in range(4)]
    plan = compile_plan(_template_tree(same), 4)
    (op,) = [o for o in plan.ops if isinstance(o, KernelOp)]
    (slot, _), *_ = op.calls[0].consumed
    blocks = {slot: [(c.device, (0,), c.consumed[0][1]) for c in op.calls]}
    ((clean,), _) = widen_boxes([op], blocks, plan.slots, 4)
    assert clean.unmasked == (True,)
    stale = {slot: [*blocks[slot], (0, (0,), plan.slots[slot])]}  # device 0's slot whole (6 > 3)
    ((dirty,), _) = widen_boxes([op], stale, plan.slots, 4)
    assert dirty.unmasked == (False,)
    assert [box[2] for _, box in _reads(dirty)] == [c.consumed[0][1] for c in op.calls]
    assert all(box[2][0] > 10**6 for _, box in _reads(clean))  # read whole: beyond every block
