"""The JAX executor compiles once: a jitted step that applies a tree on a mesh (forward and its
gradient, the adjoint) traces and compiles on its first call only; an equal tree built again
(a step that builds its operators on every call) reuses the compiled operator, so XLA compiles
nothing new; a different tree is compiled on its own. XLA's compilations are
counted with ``jax.monitoring`` (its backend-compile events), on this process's one device
(two workers placed on it), so the counts do not depend on the machine's speed."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="jax is not installed (the jax extra)")
jnp = pytest.importorskip("jax.numpy")

from jax.sharding import Mesh  # noqa: E402

from linop import DistributedTensor, HaloExchange, Kernel, Partition, halo_geometry  # noqa: E402
from linop.frameworks.jax_sharded import sharded  # noqa: E402

COMPILES: list[str] = []
"""Every XLA backend compilation of this process since the module was imported."""


def _count(event: str, seconds: float, **kwargs: object) -> None:
    if "backend_compile" in event:
        COMPILES.append(event)


jax.monitoring.register_event_duration_secs_listener(_count)
MESH = Mesh(np.array(jax.devices()[:1]), ("d",))
WORKERS = {0: 0, 1: 0}
"""Both workers on the one device: the exchange between them is a real message of the plan."""


def _halo(size: int = 12, padding: int = 1) -> HaloExchange:
    """A new tree on every call (equal trees for equal arguments)."""
    tensor = DistributedTensor("t", (size,), Partition((2,)))
    return HaloExchange(halo_geometry(tensor, Kernel(2 * padding + 1, padding=padding)))


def _state(op: HaloExchange, offset: float) -> dict[str, np.ndarray]:
    return {b.name: np.arange(b.size, dtype=np.float64).reshape(b.shape) + offset for b in op.domain}


def _compiles_during(call) -> int:
    before = len(COMPILES)
    call()
    return len(COMPILES) - before


def test_eager_calls_of_a_rebuilt_equal_tree_compile_nothing_new():
    first = sharded(_halo(), MESH, workers=WORKERS)
    first.blocks(_state(_halo(), 0.0))  # the first call compiles
    first.H.blocks(_state(_halo().H, 0.0))
    for call in range(1, 4):
        again = sharded(_halo(), MESH, workers=dict(WORKERS))  # equal tree, equal map: new objects
        assert again is first
        result: dict = {}
        forward = lambda s=again, c=call, r=result: r.update(s.blocks(_state(_halo(), c)))  # noqa: E731
        adjoint = lambda s=again, c=call: s.H.blocks(_state(_halo().H, c))  # noqa: E731
        assert _compiles_during(forward) == 0
        assert _compiles_during(adjoint) == 0
        expected = _halo()(_state(_halo(), call))
        for name, value in expected.items():
            np.testing.assert_array_equal(np.asarray(result[name]), value)


def test_a_different_tree_is_compiled_on_its_own_and_a_list_is_its_map():
    base = sharded(_halo(), MESH, workers=WORKERS)
    assert sharded(_halo(padding=2, size=16), MESH, workers=WORKERS) is not base
    assert sharded(_halo(), MESH, workers=[0, 0]) is base  # the same placement, given as a list
    wider = sharded(_halo(padding=2, size=16), MESH, workers=WORKERS)
    assert _compiles_during(lambda: wider.blocks(_state(_halo(padding=2, size=16), 0.0))) > 0  # control


def test_a_jitted_step_and_its_gradient_trace_and_compile_once():
    traces: list[int] = []
    shapes = {b.name: b.shape for b in _halo().domain}

    @jax.jit
    def loss(x0, x1):
        traces.append(1)
        blocks = sharded(_halo(), MESH, workers=WORKERS).blocks(dict(zip(shapes, (x0, x1))))
        return sum(jnp.sum(v * v) for v in blocks.values())

    gradient = jax.jit(jax.grad(loss, argnums=(0, 1)))
    counts = []
    for call in range(4):
        x0, x1 = (jnp.full(shape, float(call + i)) for i, shape in enumerate(shapes.values()))
        counts.append(_compiles_during(lambda a=x0, b=x1: (loss(a, b), gradient(a, b))))
    assert counts[0] > 0 and counts[1:] == [0, 0, 0], counts
    # once: the gradient differentiates the jitted step's own trace
    assert len(traces) == 1, f"the step was traced {len(traces)} times"
