"""Interpolation, max pooling and repartition under MPI, at every rank count: the integer
interpolation trees (forward and adjoint) equal the numpy interpreter exactly, rank by rank, and
the torch modules (Interpolate, MaxPool, Repartition with ``comm=``) give torch's own layers'
outputs and input gradients, the module's second call running its bound plans."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import collective_assert, compare_with_numpy, local_part
from mpi4py import MPI

from linop import DistributedTensor, Partition
from linop.layers import Interpolate

torch = pytest.importorskip("torch")
from linop.frameworks.torch_pooling import MaxPool  # noqa: E402
from linop.frameworks.torch_repartition import Repartition  # noqa: E402
from linop.frameworks.torch_resample import Interpolate as InterpolateModule  # noqa: E402

COMM = MPI.COMM_WORLD
SIZE = COMM.size


def _grid_2d() -> tuple[int, int]:
    return (2, SIZE // 2) if SIZE % 2 == 0 else (SIZE, 1)


def _uneven(length: int, parts: int) -> tuple[int, ...]:
    """An uneven split of ``length`` over ``parts``: the first share the largest, the second
    empty when there are 3 or more, the others one entry each (9 over 4: 7, 0, 1, 1)."""
    if parts == 1:
        return (length,)
    rest = [0 if k == 1 and parts >= 3 else 1 for k in range(1, parts)]
    return (length - sum(rest), *rest)


CASES = [
    (
        "linear-x2-corners-uneven",
        lambda: DistributedTensor(
            "x", (1, 2, 9), Partition((1, 1, SIZE)), sizes=((1,), (2,), _uneven(9, SIZE))
        ),
        dict(scale_factor=2, mode="linear", align_corners=True),
    ),
    (
        "bilinear-to-11x5",
        lambda: DistributedTensor("x", (2, 2, 7, 6), Partition((1, 1, *_grid_2d()))),
        dict(size=(11, 5), mode="bilinear"),
    ),
    (  # scale 2 without align_corners: the modules' fast path (torch's interpolate of each window)
        "bilinear-x2-uneven",
        lambda: DistributedTensor(
            "x", (1, 2, 9, 6), Partition((1, 1, SIZE, 1)), sizes=((1,), (2,), _uneven(9, SIZE), (6,))
        ),
        dict(scale_factor=2, mode="bilinear"),
    ),
    (
        "nearest-1.5",
        lambda: DistributedTensor("x", (1, 1, 6, 5), Partition((1, 1, *_grid_2d()))),
        dict(scale_factor=1.5),
    ),
]


@pytest.mark.parametrize(("label", "build", "kwargs"), CASES, ids=[c[0] for c in CASES])
def test_integer_interpolation_trees_equal_numpy(label, build, kwargs):
    x = build()
    tree, _ = Interpolate(x, **kwargs).integer_operator()
    rng = np.random.default_rng(3)
    compare_with_numpy(tree, x.scatter(rng.integers(-5, 6, x.global_shape)))
    compare_with_numpy(tree.H, tree.range.random(4, np.int64))


def _module_against(module, x, y, reference, data, dy, *, exact=False):
    problems = []
    for call in range(2):  # the second call runs the bound plans (their buffers refilled: new data)
        data, dy = data * (call + 1) - call, dy * (1 - 2 * call)
        blocks = x.scatter(data)
        mine = {k: torch.from_numpy(blocks[k]).requires_grad_() for k in module.input_names}
        out = module(mine)
        cotangent = y.scatter(dy)
        loss = sum((v * torch.from_numpy(cotangent[k])).sum() for k, v in out.items())
        (loss + module.token.sum()).backward()
        t = torch.from_numpy(data).requires_grad_()
        expected = reference(t)
        expected.backward(torch.from_numpy(dy))
        want_y, want_dx = y.scatter(expected.detach().numpy()), x.scatter(t.grad.numpy())
        close = np.array_equal if exact else (lambda a, b: np.allclose(a, b, rtol=0, atol=1e-10))
        problems += [f"call {call} y {k}" for k, v in out.items() if not close(v.detach().numpy(), want_y[k])]
        problems += [f"call {call} dx {k}" for k, v in mine.items() if not close(v.grad.numpy(), want_dx[k])]
    collective_assert(not problems, "; ".join(problems))


@pytest.mark.parametrize(("label", "build", "kwargs"), CASES, ids=[c[0] for c in CASES])
def test_interpolate_module_gives_torch_interpolate(label, build, kwargs):
    x = build()
    module = InterpolateModule(x, **kwargs, comm=COMM)
    rng = np.random.default_rng(5)
    data, dy = rng.standard_normal(x.global_shape), rng.standard_normal(module.y.global_shape)
    _module_against(module, x, module.y, lambda t: torch.nn.functional.interpolate(t, **kwargs), data, dy)


def test_max_pool_module_gives_torch_max_pool():
    x = DistributedTensor("x", (2, 2, 9, 7), Partition((1, 1, *_grid_2d())))
    module = MaxPool(x, 3, stride=2, padding=1, comm=COMM)
    rng = np.random.default_rng(6)
    data, dy = rng.standard_normal(x.global_shape), rng.standard_normal(module.y.global_shape)
    _module_against(module, x, module.y, torch.nn.MaxPool2d(3, 2, 1), data, dy)


def _second_order(module, x, y, data, dy, w_blocks):
    """A module's backward recorded under create_graph, then differentiated again: the first
    loss ``sum(out * seeds) + token``, the second ``token + sum(dx * w)`` with only rank 0's
    gradient weighted (``w_blocks``, zero elsewhere: the other ranks use the token alone).
    This rank's seeds by name, and the second loss's gradients with respect to them."""
    blocks = {
        k: torch.from_numpy(v).requires_grad_()
        for k, v in local_part(x.space, x.scatter(data), COMM.rank).items()
    }
    seeds = {
        k: torch.from_numpy(v).requires_grad_()
        for k, v in local_part(y.space, y.scatter(dy), COMM.rank).items()
    }
    out = module(blocks)
    loss = sum((out[k] * seeds[k]).sum() for k in out) + module.token.sum()
    dx = torch.autograd.grad(loss, list(blocks.values()), create_graph=True)
    second = module.token.sum()  # the recorded backward's token now
    if COMM.rank == 0:
        second = second + sum((g * torch.from_numpy(w_blocks[k])).sum() for g, k in zip(dx, blocks))
    return seeds, torch.autograd.grad(second, list(seeds.values()), allow_unused=True)


def _weights_on_rank_0(x, rng):
    """Random weights on rank 0's block of x, zeros on every other block."""
    first = x.block((0,) * len(x.global_shape)).name
    return {
        k: (v if k == first else np.zeros_like(v))
        for k, v in x.scatter(rng.standard_normal(x.global_shape)).items()
    }


def test_max_pool_double_backward_runs_on_a_rank_whose_loss_ignores_its_gradient():
    """Under create_graph the module's backward is recorded, and its backward (the windows'
    exchange again) is collective. Only rank 0's second-order loss depends on its input
    gradient (the others' weights are zero: they do not use theirs); every other rank adds
    the module's token (the recorded backward's, after it), runs the exchange with rank 0, and
    every rank's gradient with respect to its output gradient is torch's."""
    x = DistributedTensor("x", (2, 1, 9, 5), Partition((1, 1, SIZE, 1)))
    module = MaxPool(x, 3, stride=2, padding=1, comm=COMM)
    rng = np.random.default_rng(13)
    data, dy = rng.standard_normal(x.global_shape), rng.standard_normal(module.y.global_shape)
    w_blocks = _weights_on_rank_0(x, rng)
    w = x.gather(w_blocks)
    seeds, grads = _second_order(module, x, module.y, data, dy, w_blocks)
    t, seed = torch.from_numpy(data).requires_grad_(), torch.from_numpy(dy).requires_grad_()
    (grad,) = torch.autograd.grad(torch.nn.functional.max_pool2d(t, 3, 2, 1), t, seed, create_graph=True)
    (expected,) = torch.autograd.grad((grad * torch.from_numpy(w)).sum(), seed)
    want = module.y.scatter(expected.numpy())
    wrong = [
        k
        for k, g in zip(seeds, grads)
        if not np.allclose(0 if g is None else g.numpy(), want[k], rtol=0, atol=1e-10)
    ]
    collective_assert(not wrong, f"rank {COMM.rank}: second-order gradients differ from torch's: {wrong}")
    collective_assert(SIZE == 1 or np.abs(expected.numpy()).max() > 0, "torch's gradient is zero")


def test_repartition_module_moves_forward_and_back_exactly():
    """Forward and back exactly, call after call, two blocks of x on each rank (a worker map):
    the second and third calls through the bound calls the module keeps, new data each call;
    then float32 (the kept calls' dtypes no longer fit: bound again), float32 again after the
    function was bound for float64 and again for float32 behind the module's back (a kept call
    of the right dtypes, no longer current: not used), and a block of a wrong shape (refused,
    never copied into a kept buffer). Outputs and gradients have the input's dtype and memory of
    their own (each call's still right after the next)."""
    from linop.errors import StateError
    from linop.program import WorkerMap

    x = DistributedTensor("x", (2, 3, 8, 5), Partition((1, 1, 2 * SIZE, 1)))  # two blocks per rank
    z = DistributedTensor(
        "z", (2, 3, 8, 5), Partition((SIZE, 1, 1, 1)), sizes=((2, *(0,) * (SIZE - 1)), (3,), (8,), (5,))
    )
    module = Repartition(x, z, comm=COMM, mapping=WorkerMap.round_robin(2 * SIZE, SIZE))
    rng = np.random.default_rng(7)
    problems, kept = [], []
    for call, dtype in enumerate((np.float64, np.float64, np.float64, np.float32, np.float32)):
        for other in (torch.float64, torch.float32) if call == 4 else ():  # bound again elsewhere
            for adjoint, names, space in (
                (False, module.input_names, x.space),
                (True, module.output_names, z.space),
            ):
                module.function.untracked(
                    {n: torch.zeros(space[n].shape, dtype=other) for n in names}, adjoint=adjoint
                )
        data, dy = (rng.standard_normal(x.global_shape).astype(dtype) for _ in range(2))
        blocks = x.scatter(data)
        mine = {k: torch.from_numpy(blocks[k]).requires_grad_() for k in module.input_names}
        seen: dict[str, torch.Tensor] = {}  # the gradients as they reach the inputs (a hook keeps them)
        for k, v in mine.items():
            v.register_hook(lambda g, k=k, seen=seen: seen.__setitem__(k, g))
        out = module(mine)
        cotangent = z.scatter(dy)
        loss = sum((v * torch.from_numpy(cotangent[k])).sum() for k, v in out.items())
        (loss + module.token.sum()).backward()
        want_y, want_dx = z.scatter(data), x.scatter(dy)
        kept.append((call, out, seen, want_y, want_dx))  # each call's results, checked after the next too
        for at, y, dx, y_want, dx_want in kept[-2:]:
            problems += [
                f"call {at} y {k}" for k, v in y.items() if not np.array_equal(v.detach(), y_want[k])
            ]
            problems += [f"call {at} dx {k}" for k, v in dx.items() if not np.array_equal(v, dx_want[k])]
        problems += [f"call {call} dx {k}" for k, v in mine.items() if not np.array_equal(v.grad, want_dx[k])]
        problems += [
            f"call {call} dtype {k}"
            for k, v in [*out.items(), *((k, v.grad) for k, v in mine.items())]
            if v.dtype != torch.from_numpy(data).dtype
        ]
    collective_assert(not problems, "; ".join(problems))
    wrong = {k: torch.zeros(v.shape[0] + 1, *v.shape[1:], dtype=torch.float32) for k, v in mine.items()}
    refused = None
    try:
        module(wrong)
    except StateError as error:
        refused = error
    collective_assert(refused is not None or not wrong, "a block of a wrong shape went through")


def test_repartition_double_backward_runs_on_a_rank_whose_loss_ignores_its_gradient():
    """Under create_graph the reverse repartition is recorded, and its backward (the
    repartition again) is collective: only rank 0's second-order loss uses its input gradient,
    every other rank adds the module's token (the recorded backward's), and every rank's
    gradient with respect to its output gradient is the repartition of rank 0's weights."""
    x = DistributedTensor("x", (2, 3, 7, 5), Partition((1, 1, SIZE, 1)))
    z = DistributedTensor("z", (2, 3, 7, 5), Partition((SIZE, 1, 1, 1)))
    module = Repartition(x, z, comm=COMM)
    rng = np.random.default_rng(17)
    w_blocks = _weights_on_rank_0(x, rng)
    data, dy = rng.standard_normal(x.global_shape), rng.standard_normal(z.global_shape)
    seeds, grads = _second_order(module, x, z, data, dy, w_blocks)
    want = z.scatter(x.gather(w_blocks))
    wrong = [k for k, g in zip(seeds, grads) if not np.array_equal(0 if g is None else g.numpy(), want[k])]
    collective_assert(not wrong, f"rank {COMM.rank}: second-order gradients differ: {wrong}")
