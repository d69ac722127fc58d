"""The layers' local kernels as one program on every JAX device (:mod:`linop.layers.templates`):
``tests/jax_devices/check_layer_templates.py D K1 K2 ...`` (not collected by pytest) proves, in
one process of 4 host devices, the affine, max-pool, average-pool, interpolation and batch-norm
Jacobian trees run ``"spmd"``, equal to the numpy interpreter and ``op.H`` exactly and to the same plans under
``lax.switch``; with ``jax_enable_x64`` off, on 4 devices, where the max pool, interpolation
and batch-norm templates (those whose dtypes x64 changes) run again under ``jax.enable_x64``,
exact in float64 on values float32 cannot hold (``check_under_x64``). With ``LINOP_LONG=1``
the counts 2 and 4 each way, x64 on in a process of its own (the CI suite's time: about 11 s
of CPU; the lowering's own x64 paths are proven in tests/test_jax_shard.py). The host-side
contract of :func:`~linop.layers.templates.templated` is tested here without devices."""

from __future__ import annotations

import os
import subprocess

import numpy as np
import pytest
from jax_device_runs import run_device_check

from linop import DistributedTensor, Kernel, Partition
from linop.errors import LayerError
from linop.layers import Affine, AveragePool, MaxPoolJacobian
from linop.layers.templates import templated
from linop.local import LocalOperator


def run_templates(counts: tuple[int, ...], x64: bool) -> subprocess.CompletedProcess[str]:
    return run_device_check("check_layer_templates.py", counts, x64)


def _proven(done: subprocess.CompletedProcess[str], count: int) -> None:
    printed = done.stdout.split(f"== {count} devices", 1)[-1].split("== ", 1)[0]
    assert f"trees proven on {count} devices" in printed, done.stdout[-4000:] + done.stderr[-4000:]


LONG = os.environ.get("LINOP_LONG") == "1"
COUNTS = (2, 4) if LONG else (4,)  # x64 off
X64_COUNTS = (2, 4)  # x64 on, LINOP_LONG=1 only


@pytest.mark.timeout(1500)  # one subprocess of about 20 CPU seconds; minutes on the loaded machine
def test_layer_kernels_run_as_one_program_exactly():
    done = run_templates(COUNTS, x64=False)
    for count in COUNTS:
        _proven(done, count)
    assert "x64: 3 templates proven under jax.enable_x64" in done.stdout, (
        done.stdout[-4000:] + done.stderr[-4000:]
    )


@pytest.mark.timeout(1500)
@pytest.mark.skipif(
    not LONG,
    reason="LINOP_LONG=1: the templates in a process with x64 on (CI runs them under jax.enable_x64 on 4 devices)",
)
def test_layer_kernels_run_as_one_program_exactly_with_x64():
    done = run_templates(X64_COUNTS, x64=True)
    for count in X64_COUNTS:
        _proven(done, count)


def _kernels(op) -> list[LocalOperator]:
    """The local operators of a tree of compositions (at least one, or the check is empty)."""
    if isinstance(op, LocalOperator):
        return [op]
    found = [k for f in getattr(op, "factors", ()) for k in _kernels(f)]
    return found


def _every(op, has_template: bool) -> bool:
    nodes = _kernels(op)
    return bool(nodes) and all((k.kernel.device_template is not None) == has_template for k in nodes)


def test_templated_adds_the_jax_form_and_keeps_the_value():
    x = DistributedTensor("x", (1, 2, 7, 5), Partition((1, 1, 2, 1)))
    layer = AveragePool(x, Kernel(2, stride=2))
    plain, op = layer.operator, templated(layer, layer.operator)
    assert _every(plain, False) and _every(op, True)
    data = x.scatter(np.arange(70.0).reshape(1, 2, 7, 5))
    assert all(np.array_equal(op(data)[n], plain(data)[n]) for n in plain.range.names)
    assert op.H.domain == plain.H.domain
    # the selection read from the worker's own numpy kernel
    selection = MaxPoolJacobian(x, Kernel(2, stride=2))
    windows = selection.window_operator(x.scatter(np.random.default_rng(0).random((1, 2, 7, 5))))
    jacobian = templated(selection, selection.at(windows))
    assert _every(jacobian, True)
    for node in _kernels(jacobian):
        window = node.consumed[0].shape
        (positions,) = node.kernel.device_template.params
        flat = np.ravel_multi_index(tuple(positions), window)
        assert np.array_equal(
            flat, node.kernel.call([np.arange(np.prod(window)).reshape(window)], adjoint=False)
        )


def test_affine_gives_its_kernels_templates_and_templated_refuses_other_layers():
    x = DistributedTensor("x", (3, 5), Partition((1, 2)))
    layer = Affine(x, 4)
    assert _every(layer.input_operator(np.ones((4, 5))), True)
    with pytest.raises(
        LayerError, match="templated\\(\\) takes an AveragePool, MaxPoolJacobian or Interpolate, not Affine"
    ):
        templated(layer, layer.input_operator(np.ones((4, 5))))


def test_with_template_keeps_the_callables_and_refuses_a_matrix():
    from linop import LocalKernel
    from linop.errors import LocalOperatorError
    from linop.kernel_template import KernelTemplate

    def forward(a):
        return 2 * a

    def adjoint(b):
        return 2 * b

    template = KernelTemplate(forward, adjoint, (np.ones(2),), "twice")
    kernel = LocalKernel.of(forward=forward, adjoint=adjoint, vectorized=True).with_template(template)
    assert kernel.device_template is template and kernel.vectorized
    assert kernel.call([np.arange(3)], adjoint=True).tolist() == [0, 2, 4]
    with pytest.raises(LocalOperatorError, match="a dense kernel runs on JAX devices as it is"):
        LocalKernel.of(np.eye(2)).with_template(template)


def test_batch_norm_jacobian_kernels_get_templates_from_the_saved_forward():
    from linop.layers import BatchNorm

    x = DistributedTensor("x", (2, 3, 5, 2), Partition((1, 2, 2, 1)))
    layer = BatchNorm(x)
    data = np.random.default_rng(0).standard_normal(x.global_shape)
    _, saved, _ = layer.forward(x.scatter(data), training=True)
    jacobian = layer.jacobian(saved)
    assert _every(jacobian, True) and len(_kernels(jacobian)) == 2 * 4
    gathers = [k for k in _kernels(jacobian) if k.consumed[0].name in saved]
    assert len(gathers) == 4
    for node in gathers:  # each worker's own saved xhat is its parameter
        assert np.array_equal(node.kernel.device_template.params[0], saved[node.consumed[0].name].xhat)
    # a block whose saved forward another process holds: no template, its kernel raises when run
    missing = dict(saved)
    missing.pop(next(iter(missing)))
    assert not _every(layer.jacobian(missing), True)
