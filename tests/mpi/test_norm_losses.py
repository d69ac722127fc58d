"""Batch normalization and the distributed losses across MPI ranks: their trees equal the numpy
interpreter exactly (integers), and the torch modules (``comm=``) equal torch's BatchNorm2d and
losses on one process: outputs, input gradients, parameter gradients and running statistics on
every rank, a rank holding an empty block or no block at all included."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import collective_assert, compare_with_numpy, count_agreements, local_part
from mpi4py import MPI

from linop import DistributedTensor, Partition
from linop.layers import BatchNorm, Loss

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: the shared cases
import module_map_cases as cases  # noqa: E402

COMM = MPI.COMM_WORLD
SIZE = COMM.size
RANK = COMM.rank


def _batchnorm_cases():
    """(label, x): 4 channels of (N, 4, 5, 4) over every rank, unevenly, empty shares and (on 4
    ranks) a rank with no block."""
    cases = {
        1: [("one", ((1, 1, 1, 1), ()))],
        2: [("batch-empty", ((2, 1, 1, 1), ((3, 0), (4,), (5,), (4,))))],
        3: [("features", ((1, 1, 3, 1), ((3,), (4,), (2, 2, 1), (4,))))],
        4: [
            ("batch-channels", ((2, 2, 1, 1), ((2, 1), (3, 1), (5,), (4,)))),
            ("three-of-four", ((1, 1, 1, 3), ((3,), (4,), (5,), (1, 1, 2)))),
        ],
    }[SIZE]
    return [
        (label, DistributedTensor("x", (3, 4, 5, 4), Partition(grid), sizes=sizes))
        for label, (grid, sizes) in cases
    ]


@pytest.mark.parametrize(("label", "x"), _batchnorm_cases(), ids=[c[0] for c in _batchnorm_cases()])
def test_batchnorm_trees_equal_numpy_exactly(label, x):
    layer = BatchNorm(x)
    trees = (
        layer.statistics_reduction,
        layer.totals_reduction,
        layer.moments_reduction,
        layer.gradient_reduction,
        layer.parameter_movement,
    )
    for op in trees:
        compare_with_numpy(op, op.domain.random(1, np.int64))
        compare_with_numpy(op.H, op.range.random(2, np.int64))


def _batchnorm_module_problems(layer, module, rng):
    """Three steps of ``module`` (the third in evaluation) against torch's BatchNorm2d of the
    same parameters: what differs on this rank (y, dx and the parameter gradients of its
    blocks, its channels' running statistics)."""
    x = layer.x
    w, b = layer.gather_parameters(layer.scatter_parameters(*_parameters(rng)))
    norm = torch.nn.BatchNorm2d(4, dtype=torch.float64)
    with torch.no_grad():
        norm.weight.copy_(torch.from_numpy(w))
        norm.bias.copy_(torch.from_numpy(b))
    problems = []
    for step in range(3):
        if step == 2:
            module.eval()
            norm.eval()
        data, dy = rng.standard_normal(x.global_shape) + step, rng.standard_normal(x.global_shape)
        blocks = x.scatter(data)
        inputs = {k: torch.from_numpy(blocks[k]).requires_grad_() for k in module.input_names}
        module.zero_grad()
        out = module(inputs)
        dys = layer.y.scatter(dy)
        (sum((v * torch.from_numpy(dys[k])).sum() for k, v in out.items()) + module.token.sum()).backward()
        image = torch.from_numpy(data).requires_grad_()
        norm.zero_grad()
        reference = norm(image)
        reference.backward(torch.from_numpy(dy))
        expected_y = layer.y.scatter(reference.detach().numpy())
        expected_dx = x.scatter(image.grad.numpy())
        expected_theta = layer.scatter_parameters(norm.weight.grad.numpy(), norm.bias.grad.numpy())
        problems += [
            f"{step} y {k}" for k, v in out.items() if not np.allclose(v.detach(), expected_y[k], atol=1e-10)
        ]
        problems += [
            f"{step} dx {k}" for k, v in inputs.items() if not np.allclose(v.grad, expected_dx[k], atol=1e-10)
        ]
        problems += [
            f"{step} dtheta {k}"
            for k, v in module.parameter_state().items()
            if not np.allclose(v.grad, expected_theta[k], atol=1e-10)
        ]
        slices = [
            np.arange(sum(layer.channel_sizes[:c]), sum(layer.channel_sizes[: c + 1]))
            for c in module.channels
        ]
        mine = np.concatenate(slices) if slices else np.zeros(0, dtype=int)
        if not np.allclose(module.running_mean, norm.running_mean.numpy()[mine], atol=1e-12):
            problems.append(f"{step} running mean")
        if not np.allclose(module.running_var, norm.running_var.numpy()[mine], atol=1e-12):
            problems.append(f"{step} running var")
    return problems


def _parameters(rng):
    return rng.standard_normal(4), rng.standard_normal(4)


@pytest.mark.parametrize("path", ["gather", "two_pass"])
@pytest.mark.parametrize(("label", "x"), _batchnorm_cases(), ids=[c[0] for c in _batchnorm_cases()])
def test_batchnorm_module_equals_torch_batchnorm2d(label, x, path):
    """Both statistics paths (one all-reduce of the moments, or two of O(c)) over every rank:
    three steps (two in training) against torch's BatchNorm2d."""
    from linop.frameworks.torch_norm import BatchNormModule

    layer = BatchNorm(x, statistics=path)
    w, b = _parameters(np.random.default_rng(21))
    module = BatchNormModule(layer, weight=w, bias=b, comm=COMM)
    problems = _batchnorm_module_problems(layer, module, np.random.default_rng(21))
    collective_assert(not problems, f"{label} {path}: {problems}")


@pytest.mark.parametrize("path", [None, "two_pass"])
def test_batchnorm_module_with_more_workers_than_ranks_equals_torch(path):
    """4 x SIZE + 1 spatial workers (|G| = 5, 9, 13, 17: by the rule the gather path up to 3
    ranks and the two-pass path at 4; the two-pass path forced), dealt round robin over the ranks (uneven shares, some empty): each
    rank passes the blocks of its workers, and the module equals torch's BatchNorm2d."""
    from linop.frameworks.torch_norm import BatchNormModule
    from linop.program import WorkerMap

    workers = 4 * SIZE + 1
    x = DistributedTensor(
        "x", (3, 4, 5, 4), Partition((1, 1, workers, 1)), sizes=((3,), (4,), _cut(5, workers), (4,))
    )
    layer = BatchNorm(x, statistics=path)
    w, b = _parameters(np.random.default_rng(24))
    module = BatchNormModule(layer, weight=w, bias=b, comm=COMM, mapping=WorkerMap.round_robin(workers, SIZE))
    problems = _batchnorm_module_problems(layer, module, np.random.default_rng(24))
    if path is None and layer.statistics_path != ("two_pass" if workers > 16 else "gather"):
        problems.append(f"path {layer.statistics_path}")
    collective_assert(not problems, f"{path}: {problems}")


def _cut(total, parts):
    """``total`` over ``parts`` shares, the first ones 1 and the rest 0 (empty shares)."""
    return tuple(1 if k < total else 0 for k in range(parts))


LOSSES = [
    ("mse", "mean", {}),
    ("kl_div", "batchmean", {}),
    ("bce_with_logits", "sum", {}),
    ("l1", "none", {}),
]


FUNCTIONS = {
    "mse": "mse_loss",
    "kl_div": "kl_div",
    "l1": "l1_loss",
    "bce_with_logits": "binary_cross_entropy_with_logits",
}


def _loss_tensor():
    rows = {1: (5,), 2: (4, 1), 3: (2, 0, 3), 4: (1, 2, 0, 2)}[SIZE]
    return DistributedTensor("x", (5, 3), Partition((SIZE, 1)), sizes=(rows, (3,)))


def _loss_problems(module, layer, x, data, target, root):
    """What differs between one call of ``module`` (forward and backward) and torch's loss."""
    kind, reduction = layer.kind, layer.reduction
    inputs = {
        k: torch.from_numpy(v).requires_grad_() for k, v in local_part(x.space, x.scatter(data), RANK).items()
    }
    targets = {k: torch.from_numpy(v) for k, v in local_part(x.space, x.scatter(target), RANK).items()}
    out = module(inputs, targets)
    reference = torch.from_numpy(data).requires_grad_()
    expected = getattr(torch.nn.functional, FUNCTIONS[kind])(
        reference, torch.from_numpy(target), reduction=reduction
    )
    problems = []
    if reduction == "none":
        sum(v.sum() for v in out.values()).backward()
        expected.sum().backward()
        terms = layer.y.scatter(expected.detach().numpy())
        problems += [k for k, v in out.items() if not np.allclose(v.detach(), terms[k], atol=1e-12)]
    else:
        out.backward()  # on every rank: the root's seeds the broadcast, the others' is unused
        expected.backward()
        if module.is_root != (RANK == root):
            problems.append("root")
        if RANK == root and not np.isclose(
            float(out.detach()), float(expected.detach()), rtol=1e-12, atol=1e-12
        ):
            problems.append(f"loss {float(out.detach())} against {float(expected.detach())}")
        if RANK != root and float(out.detach()) != 0.0:
            problems.append(f"a non-root rank got {float(out.detach())}")
    grads = x.scatter(reference.grad.numpy())
    problems += [f"dx {k}" for k, v in inputs.items() if not np.allclose(v.grad, grads[k], atol=1e-12)]
    return problems


@pytest.mark.parametrize(("kind", "reduction", "options"), LOSSES, ids=[f"{k}-{r}" for k, r, _ in LOSSES])
def test_loss_module_equals_torch(kind, reduction, options):
    from linop.frameworks.torch_losses import LossModule

    rng = np.random.default_rng(22)
    x = _loss_tensor()
    root = SIZE - 1
    layer = Loss(x, kind, reduction=reduction, root=root, **options)
    if reduction != "none":
        op = layer.reduction_operator
        compare_with_numpy(op, op.domain.random(3, np.int64))
        compare_with_numpy(op.H, op.range.random(4, np.int64))
    module = LossModule(layer, comm=COMM)
    problems = []
    for call in range(2):  # the second call runs the bound plans (their result buffers, refilled)
        data = rng.standard_normal(x.global_shape)
        target = rng.uniform(0, 1, x.global_shape)
        problems += [f"call {call}: {p}" for p in _loss_problems(module, layer, x, data, target, root)]
    collective_assert(not problems, f"{kind} {reduction}: {problems}")


def test_loss_module_keeps_its_bound_calls_only_while_they_fit(monkeypatch):
    """Two blocks on each rank (a worker map). From its second call a LossModule runs the bound
    sum-reduce and broadcast it keeps (new
    data each call, forward and backward); then float32 (the kept calls' dtype no longer fits:
    bound again, the broadcast on every rank although only the root has its input), float32
    again after its tree was bound for float64 and again for float32 behind its back (a kept
    call of the right dtype, no longer current: not used), and float64 again. The root's loss
    equals torch's, of the input's dtype, and so do every rank's gradients. (Before the
    backward dropped a binding of another dtype on every rank, the first float32 backward
    ended the job: the ranks other than the root kept their float64 broadcast.)"""
    from linop.frameworks.torch_losses import LossModule
    from linop.program import WorkerMap

    sent = count_agreements(monkeypatch)  # every rank holds input blocks: no agreement on dtypes
    # 5 rows over two workers per rank (a worker map; empty shares from 3 ranks)
    rows = (
        tuple(max(0, min(1, 5 - k)) for k in range(2 * SIZE))
        if SIZE >= 3
        else (3, 2)
        if SIZE == 1
        else (2, 1, 1, 1)
    )
    x = DistributedTensor("x", (5, 3), Partition((2 * SIZE, 1)), sizes=(rows, (3,)))
    module = LossModule(
        Loss(x, "mse", root=2 * SIZE - 1), comm=COMM, mapping=WorkerMap.round_robin(2 * SIZE, SIZE)
    )
    rng = np.random.default_rng(29)
    problems = []
    for call, dtype in enumerate((np.float64, np.float64, np.float32, np.float32, np.float64)):
        for other in (torch.float64, torch.float32) if call == 3 else ():  # bound again elsewhere
            module.reduce.untracked({n: torch.zeros(1, dtype=other) for n in module.reduce.names()[0]})
        data, target = (rng.standard_normal(x.global_shape).astype(dtype) for _ in range(2))
        blocks, target_blocks = x.scatter(data), x.scatter(target)
        inputs = {k: torch.from_numpy(blocks[k]).requires_grad_() for k in module.input_names}
        targets = {k: torch.from_numpy(target_blocks[k]) for k in module.input_names}
        reference = torch.from_numpy(data).requires_grad_()
        expected = torch.nn.functional.mse_loss(reference, torch.from_numpy(target))
        rtol = 1e-12 if dtype == np.float64 else 1e-5
        out = module(inputs, targets)
        out.backward()
        expected.backward()
        grads = x.scatter(reference.grad.numpy())
        problems += [
            f"call {call}: dx {k}"
            for k, v in inputs.items()
            if v.grad.dtype != v.dtype or not np.allclose(v.grad, grads[k], rtol=rtol)
        ]
        out, expected = out.detach(), expected.detach()
        if module.is_root and (
            out.dtype != expected.dtype or not np.isclose(float(out), float(expected), rtol=rtol)
        ):
            problems.append(f"call {call}: loss {out} against {expected}")
    # a new module on ranks of different dtypes (rank 0 float32, the others float64, from its
    # first call: the sum runs in float64 on every rank), kept from call to call: no rank drops
    # its broadcast (a rank keying it on its own partial sums' dtype ended the job here)
    module = LossModule(
        Loss(x, "mse", root=2 * SIZE - 1), comm=COMM, mapping=WorkerMap.round_robin(2 * SIZE, SIZE)
    )
    mixed = torch.float32 if RANK == 0 else torch.float64
    for call in range(3):
        data, target = (rng.standard_normal(x.global_shape) for _ in range(2))
        blocks, target_blocks = x.scatter(data), x.scatter(target)
        inputs = {k: torch.from_numpy(blocks[k]).to(mixed).requires_grad_() for k in module.input_names}
        module(
            inputs, {k: torch.from_numpy(target_blocks[k]).to(mixed) for k in module.input_names}
        ).backward()
        grads = x.scatter(2 * (data - target) / data.size)
        problems += [
            f"mixed call {call}: dx {k}"
            for k, v in inputs.items()
            if v.grad.dtype != mixed or not np.allclose(v.grad, grads[k], rtol=1e-5, atol=1e-6)
        ]
    problems += [f"agreed on dtypes: {sent}"] if sent else []
    collective_assert(not problems, "; ".join(problems))


def test_loss_module_follows_dtype_changes_where_a_rank_holds_no_input_block(monkeypatch):
    """x's two workers on rank 0 and the root worker on the last rank (a worker map): the other
    ranks, the root's included, hold none of x's blocks, so they cannot see the input's dtype
    change. Forward and backward at float64, float64, float32, float32, float64: the root's loss
    equals torch's of the input's dtype, and so do rank 0's gradients. The forward's sum-reduce
    agrees on dtypes at each call from the second (one all-reduce); its backward's broadcast
    needs none (every rank knows the forward's dtype). Before the agreement the first float32
    call ended the job (PeerMismatchError)."""
    from linop.frameworks.torch_losses import LossModule

    sent = count_agreements(monkeypatch)
    x = DistributedTensor("x", (5, 3), Partition((2, 1)), sizes=((3, 2), (3,)))
    module = LossModule(Loss(x, "mse", root=2), comm=COMM, mapping={0: 0, 1: 0, 2: SIZE - 1})
    rng = np.random.default_rng(33)
    problems = []
    for call, dtype in enumerate((torch.float64, torch.float64, torch.float32, torch.float32, torch.float64)):
        problems += cases.mse_step_problems(module, x, dtype, rng, f"call {call}")
    if (RANK == 0) != bool(module.input_names) or module.is_root != (RANK == SIZE - 1):
        problems.append(f"blocks {module.input_names}, root {module.is_root}")
    expected_sent = [str(module.reduce.op)] * 4 if SIZE > 1 else []
    problems += [f"agreed {sent}, expected {expected_sent}"] if sent != expected_sent else []
    collective_assert(not problems, "; ".join(problems))


@pytest.mark.parametrize(("label", "x"), _batchnorm_cases(), ids=[c[0] for c in _batchnorm_cases()])
def test_batchnorm_jacobian_tree_from_this_ranks_blocks_equals_numpy(label, x):
    """The training Jacobian built from the saved forward of this rank's blocks only (as a real
    run holds them) equals the whole tree's numpy result, forward and adjoint."""
    from linop.backends import mpi as mpi_backend

    rng = np.random.default_rng(23)
    layer = BatchNorm(x)
    theta = layer.scatter_parameters(rng.standard_normal(4), rng.standard_normal(4))
    _, saved, _ = layer.forward(x.scatter(rng.standard_normal(x.global_shape)), theta)
    whole = layer.jacobian(saved)
    mine = layer.jacobian({b.name: saved[b.name] for b in x.blocks if b.worker == RANK})
    tangent, dy = (
        x.scatter(rng.standard_normal(x.global_shape)),
        layer.y.scatter(rng.standard_normal(x.global_shape)),
    )
    problems = []
    for op, full, state in ((mine, whole, tangent), (mine.H, whole.H, dy)):
        expected = full(state)
        result = mpi_backend.apply(op, local_part(op.domain, state, RANK))
        problems += [k for k, v in result.items() if not np.allclose(v, expected[k], atol=1e-12)]
    collective_assert(not problems, f"{label}: {problems}")


def test_loss_double_backward_runs_on_a_rank_whose_loss_ignores_its_gradient():
    """Under create_graph the broadcast of the loss's gradient is recorded, and its backward (a
    sum-reduce onto the root) is collective: only the root's second-order loss uses its input
    gradients, every other rank adds the module's token (its backward, not a gradient of a
    tensor the token does not reach, runs the token's node), and the root's derivative in the
    loss's seed is that loss at seed 1 (the gradient is linear in the seed)."""
    import torch

    from linop.frameworks.torch_losses import LossModule

    x = _loss_tensor()
    rng = np.random.default_rng(19)
    data, target = rng.standard_normal(x.global_shape), rng.standard_normal(x.global_shape)
    module = LossModule(Loss(x, "mse"), comm=COMM)
    mine = local_part(x.space, x.scatter(data), COMM.rank)
    inputs = {k: torch.from_numpy(v).requires_grad_() for k, v in mine.items()}
    targets = {k: torch.from_numpy(v) for k, v in local_part(x.space, x.scatter(target), COMM.rank).items()}
    out = module(inputs, targets)
    seed = torch.tensor(1.0, dtype=torch.float64, requires_grad=True)
    grads = torch.autograd.grad(out, list(inputs.values()), seed, create_graph=True)
    collective_assert(module.token is not None, f"rank {COMM.rank}: no token after create_graph")
    second = module.token.sum()
    if module.is_root:
        second = second + sum((g * g.detach()).sum() for g in grads)
    second.backward()  # every node the loss reaches (the token's only, off the root)
    expected = float(sum((g.detach() * g.detach()).sum() for g in grads)) if module.is_root else 0.0
    got = None if seed.grad is None else float(seed.grad)
    collective_assert(
        not module.is_root or (got is not None and abs(got - expected) <= 1e-12 * max(1.0, expected)),
        f"rank {COMM.rank}: d/dseed {got} against {expected}",
    )
