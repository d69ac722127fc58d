"""The fused chain as a torch module (linop.frameworks.torch_chain.ChainModule): forward, input
gradient and weight gradients equal the same chain of torch's own layers on one process."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from linop import DistributedTensor, Kernel, Partition  # noqa: E402
from linop.frameworks.torch_chain import ChainModule  # noqa: E402
from linop.layers import ChainStage, LayerError, WindowChain  # noqa: E402

F = torch.nn.functional


def sequential(x: torch.Tensor, stages, weights) -> torch.Tensor:
    """The chain with torch's layers, padding included (the reference)."""
    dims = x.ndim - 2
    v, ws = x, iter(weights)
    for stage in stages:
        k = stage.kernel.resolve(dims)
        if stage.kind == "conv":
            v = getattr(F, f"conv{dims}d")(v, next(ws), None, k.stride, k.padding, k.dilation)
        elif stage.kind == "avg":
            v = getattr(F, f"avg_pool{dims}d")(v, k.size, k.stride, k.padding)
        else:
            v = getattr(F, f"max_pool{dims}d")(v, k.size, k.stride, k.padding, k.dilation)
    return v


def conv(rng, c_out, c_in, size, **kw):
    return ChainStage.conv(rng.standard_normal((c_out, c_in, *size)), **kw)


CASES = [
    pytest.param(
        lambda: DistributedTensor("x", (2, 2, 12, 11), Partition((1, 1, 2, 2))),
        lambda rng: [
            conv(rng, 3, 2, (3, 3), padding=1),
            conv(rng, 2, 3, (3, 3), padding=1),
            ChainStage.max(Kernel(2, stride=2)),
        ],
        id="conv-conv-max-2x2",
    ),
    pytest.param(
        lambda: DistributedTensor("x", (1, 2, 19), Partition((1, 1, 3)), sizes=((1,), (2,), (9, 3, 7))),
        lambda rng: [
            ChainStage.max(Kernel(3, padding=1)),
            conv(rng, 2, 2, (3,), stride=2, padding=1),
            ChainStage.avg(Kernel(3, padding=1)),
            conv(rng, 1, 2, (2,), padding=1, dilation=2),
        ],
        id="1d-max-first-unbalanced",
    ),
    pytest.param(  # the second stage's wide padding: the last worker's window of it is all padding
        lambda: DistributedTensor("x", (1, 1, 6), Partition((1, 1, 4))),
        lambda rng: [conv(rng, 1, 1, (3,), padding=1), conv(rng, 1, 1, (3,), padding=5)],
        id="1d-a-window-of-padding-alone",
    ),
]


@pytest.mark.parametrize(("tensor", "stages"), CASES)
def test_the_module_equals_torchs_layers_forward_and_backward(tensor, stages):
    rng = np.random.default_rng(3)
    x = tensor()
    built = stages(rng)
    chain = WindowChain(x, built)
    module = ChainModule(chain)
    data = torch.from_numpy(rng.standard_normal(x.global_shape)).requires_grad_()
    blocks = {
        n: torch.tensor(np.asarray(t)).requires_grad_() for n, t in x.scatter(data.detach().numpy()).items()
    }
    out = module(blocks)
    weights = [w.detach().clone().requires_grad_() for w in module.weights]
    expected = sequential(data, built, weights)
    got = torch.from_numpy(chain.y.gather({n: t.detach().numpy() for n, t in out.items()}))
    torch.testing.assert_close(got, expected.detach(), rtol=1e-10, atol=1e-10)

    grad = torch.from_numpy(rng.standard_normal(chain.y.global_shape))
    scattered = chain.y.scatter(grad.numpy())
    loss = sum((out[n] * torch.from_numpy(np.asarray(scattered[n]))).sum() for n in out)
    loss.backward()
    (expected * grad).sum().backward()
    module.sum_gradients()  # one process: already the sums
    dx = torch.from_numpy(x.gather({n: t.grad.numpy() for n, t in blocks.items()}))
    torch.testing.assert_close(dx, data.grad, rtol=1e-10, atol=1e-10)
    for mine, theirs in zip(module.weights, weights, strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-10, atol=1e-10)


def test_the_module_refuses_what_torch_cannot_run():
    x = DistributedTensor("x", (1, 1, 8), Partition((1, 1, 2)))
    with pytest.raises(LayerError, match="dilation"):
        ChainModule(WindowChain(x, [ChainStage.avg(Kernel(2, dilation=2))]))
    with pytest.raises(LayerError, match="must be a WindowChain"):
        ChainModule(object())  # type: ignore[arg-type]


def test_a_recorded_backward_across_processes_is_torchs_and_hands_its_token_on():
    """Under MPI (here COMM_SELF, the four workers on rank 0) the windows are the module's own
    node: a backward under create_graph runs the adjoint recorded, its token becomes the
    module's, and the second-order gradient (in the upstream gradient) is torch's; a second
    call, through the bound plans' buffers, gives torch's first-order results again."""
    mpi = pytest.importorskip("mpi4py.MPI")
    rng = np.random.default_rng(5)
    x = DistributedTensor("x", (1, 2, 7, 6), Partition((1, 1, 2, 2)))
    built = [conv(rng, 2, 2, (3, 3), padding=1), ChainStage.avg(Kernel(2, stride=2))]
    chain = WindowChain(x, built)
    module = ChainModule(chain, comm=mpi.COMM_SELF, mapping=[0, 0, 0, 0])
    weights = [w.detach().clone() for w in module.weights]
    for call in range(2):
        data, dy, w = (rng.standard_normal(s) for s in (x.global_shape, chain.y.global_shape, x.global_shape))
        blocks = {k: torch.from_numpy(np.array(v)).requires_grad_() for k, v in x.scatter(data).items()}
        seeds = {k: torch.from_numpy(np.array(v)).requires_grad_() for k, v in chain.y.scatter(dy).items()}
        out = module(blocks)
        first = module.token
        loss = sum((out[k] * seeds[k]).sum() for k in out) + first.sum()
        dx = torch.autograd.grad(loss, list(blocks.values()), create_graph=call == 0)
        t, seed = torch.from_numpy(data).requires_grad_(), torch.from_numpy(dy).requires_grad_()
        (grad,) = torch.autograd.grad(sequential(t, built, weights), t, seed, create_graph=True)
        mine = x.gather({k: g.detach().numpy() for k, g in zip(blocks, dx)})
        torch.testing.assert_close(torch.from_numpy(mine), grad.detach(), rtol=1e-10, atol=1e-10)
        if call == 0:
            assert module.token is not first
            scattered = x.scatter(w)
            second = sum((g * torch.from_numpy(scattered[k])).sum() for g, k in zip(dx, blocks))
            got = torch.autograd.grad(second + module.token.sum(), list(seeds.values()))
            (expected,) = torch.autograd.grad((grad * torch.from_numpy(w)).sum(), seed)
            mine = chain.y.gather(dict(zip(seeds, (g.numpy() for g in got))))
            assert np.abs(expected.numpy()).max() > 0
            torch.testing.assert_close(torch.from_numpy(mine), expected, rtol=1e-10, atol=1e-10)
