"""LayerModule's bound plans run on buffers they own, overwritten by each call: a backward that
is still to come when the layer runs again (two calls before one backward, a retained graph)
reads the windows and parameter copies of its own forward."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import collective_assert, local_part

from linop import DistributedTensor, Kernel, Partition

torch = pytest.importorskip("torch", reason="torch is not installed (the torch extra)")

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("replicate", [False, True], ids=["owners", "replicated"])
def test_backwards_after_later_calls_read_their_own_forward(comm, replicate):
    """Two calls, then their backwards in reverse order, then one of them again (its graph
    retained) after a third call: every input and parameter gradient equals, exactly, that of
    the same call alone (a call, its backward, the next)."""
    from linop.frameworks.torch_layers import LayerModule
    from linop.layers import Convolution

    x = DistributedTensor("x", (2, 2, 3 * comm.size + 1, 5), Partition((1, 1, comm.size, 1)))
    layer = Convolution(x, 3, Kernel(3, padding=1))
    rng = np.random.default_rng(7)
    w, b = rng.standard_normal(layer.weights.global_shape), rng.standard_normal(layer.bias.global_shape)
    data = [local_part(x.space, x.scatter(rng.standard_normal(x.global_shape)), comm.rank) for _ in range(3)]

    def call(module, k):
        given = {n: torch.from_numpy(v.copy()).requires_grad_() for n, v in data[k].items()}
        y = module(given)
        return given, sum((v * v).sum() for v in y.values()) + module.token.sum()

    def gradients(module, given):
        found = {n: t.grad.clone() for n, t in given.items()}
        found.update({n: p.grad.clone() for n, p in module.parameter_state().items()})
        return found

    alone = LayerModule(layer, weights=w, bias=b, comm=comm, replicate=replicate)
    expected = []
    for k in range(3):
        alone.zero_grad()
        given, loss = call(alone, k)
        loss.backward()
        expected.append(gradients(alone, given))
    module = LayerModule(layer, weights=w, bias=b, comm=comm, replicate=replicate)
    found = {}
    first, loss0 = call(module, 0)
    second, loss1 = call(module, 1)
    module.zero_grad()
    loss1.backward()
    found["second"] = (gradients(module, second), expected[1])
    module.zero_grad()
    loss0.backward(retain_graph=True)
    found["first"] = (gradients(module, first), expected[0])
    third, loss2 = call(module, 2)
    module.zero_grad()
    for t in first.values():
        t.grad = None
    loss0.backward()
    found["first again"] = (gradients(module, first), expected[0])
    module.zero_grad()
    loss2.backward()
    found["third"] = (gradients(module, third), expected[2])
    problems = [
        f"{case}: d{n} differs"
        for case, (got, want) in found.items()
        for n in want
        if not torch.equal(got[n], want[n])
    ]
    collective_assert(not problems, f"rank {comm.rank}: " + "; ".join(problems))
