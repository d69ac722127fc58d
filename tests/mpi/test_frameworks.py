"""Torch tensors through the MPI interpreter, and trees as torch autograd functions across ranks.

Forward and backward run on every rank together; the results equal the numpy interpreter's
(exactly: data movement on integer-valued floats).
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import collective_assert, count_agreements, local_part, same_blocks

from linop import Broadcast, DistributedTensor, HaloExchange, Kernel, Partition, halo_geometry, halo_windows

torch = pytest.importorskip("torch", reason="torch is not installed (the torch extra)")
from linop.frameworks.torch_function import TorchOperator  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def _trees(size: int):
    u = DistributedTensor("u", (7, 5), Partition.grid((size, 1)))
    w = DistributedTensor("w", (2, 3), Partition.grid((1, 1)))
    return {
        "halo-windows": halo_windows(u, Kernel(3, padding=1)),
        "broadcast": Broadcast(w, Partition.grid((size, 1)), "w_copy"),
        "halo-exchange": HaloExchange(halo_geometry(u, Kernel(3, padding=1))),
    }


NAMES = ["halo-windows", "broadcast", "halo-exchange"]


def _integers(space, seed):
    return space.random(np.random.default_rng(seed), dtype=np.int64)


def max_op():
    from mpi4py import MPI

    return MPI.MAX


def _as_torch(state):
    return {name: torch.from_numpy(np.asarray(value, dtype=np.float64)) for name, value in state.items()}


@pytest.mark.parametrize("name", NAMES, ids=NAMES)
def test_apply_mpi_takes_and_gives_torch_tensors(comm, name):
    op = _trees(comm.size)[name]
    full = _integers(op.domain, 0)
    expected = op({k: v.astype(np.float64) for k, v in full.items()})
    local = _as_torch(local_part(op.domain, full, comm.rank))
    result = op.apply_mpi(local, comm=comm)
    mine = tuple(b.name for b in op.range if b.worker == comm.rank)
    # A rank that passes no block cannot know the library: it gets numpy arrays back.
    kinds = not local or all(
        isinstance(v, torch.Tensor) and v.dtype == torch.float64 for v in result.values()
    )
    collective_assert(kinds, f"{name}: not all results are float64 tensors: {result}")
    problem = same_blocks({k: np.asarray(v) for k, v in result.items()}, expected, mine)
    collective_assert(problem is None, f"{name}: {problem}")


def test_bound_in_place_halo_exchange_on_torch_tensors(comm):
    op = _trees(comm.size)["halo-exchange"]
    full = _integers(op.domain, 1)
    expected = op({k: v.astype(np.float64) for k, v in full.items()})
    local = _as_torch(local_part(op.domain, full, comm.rank))
    tensors = dict(local)
    from linop.backends import mpi as mpi_backend

    bound = mpi_backend.plan_for(op, comm=comm).bind(local)
    result = bound()
    bound.free()
    same_objects = all(result[k] is tensors[k] for k in tensors)
    problem = same_blocks({k: v.numpy() for k, v in local.items()}, expected, tuple(local))
    collective_assert(same_objects and problem is None, f"bound: {problem}, same tensors {same_objects}")


STRAIGHT = ["default", "always", "largest rank"]


@pytest.mark.parametrize("straight", STRAIGHT, ids=STRAIGHT)
@pytest.mark.parametrize("name", NAMES, ids=NAMES)
def test_torch_operator_forward_and_backward_across_ranks(comm, name, straight, monkeypatch):
    """Forward and backward equal the numpy interpreter's, bound on the runner's buffers or,
    from ``STRAIGHT_FROM`` bytes on any rank (here: every rank, or the rank with the most),
    run straight on the tensors on every rank alike."""
    from linop.frameworks import torch_function

    op = _trees(comm.size)[name]
    f = TorchOperator(op, comm=comm)
    if straight != "default":
        plan = f._runner.plan
        mine = sum(b.size for b in op.domain if b.worker == comm.rank)
        mine += sum(b.size for b in op.range if b.worker == comm.rank)
        threshold = 0 if straight == "always" else comm.allreduce(mine * 8, op=max_op())
        monkeypatch.setattr(torch_function, "STRAIGHT_FROM", threshold)
        assert plan is not None
    full = _integers(op.domain, 2)
    cotangent = _integers(op.range, 3)
    forward = op({k: v.astype(np.float64) for k, v in full.items()})
    backward = op.H({k: v.astype(np.float64) for k, v in cotangent.items()})
    for _ in range(2):  # the second call runs the same bound plans
        x = {k: v.requires_grad_() for k, v in _as_torch(local_part(op.domain, full, comm.rank)).items()}
        y = f(x)
        weights = _as_torch(local_part(op.range, cotangent, comm.rank))
        loss = sum((y[k] * weights[k]).sum() for k in y)
        loss.backward()  # on every rank: the anchor makes y require a gradient even without inputs
        grads = {k: (torch.zeros_like(v) if v.grad is None else v.grad) for k, v in x.items()}
        problem = same_blocks(
            {k: v.detach().numpy() for k, v in y.items()}, forward, f.outputs
        ) or same_blocks({k: v.numpy() for k, v in grads.items()}, backward, f.inputs)
        collective_assert(problem is None, f"{name}: {problem}")
    bound = f._runner.bound_tensors([torch.float64] * len(f.inputs))  # as bound by the calls
    expected = straight == "default"  # these blocks are small
    collective_assert(bound.persistent == expected, f"{name}, {straight}: persistent {bound.persistent}")


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device (torch CUDA tensors are staged through host memory)"
)
def test_cuda_tensors_come_back_on_their_device(comm):  # pragma: no cover - needs a GPU
    op = _trees(comm.size)["halo-windows"]
    full = _integers(op.domain, 4)
    local = {k: v.cuda() for k, v in _as_torch(local_part(op.domain, full, comm.rank)).items()}
    result = op.apply_mpi(local, comm=comm)
    expected = op({k: v.astype(np.float64) for k, v in full.items()})
    mine = tuple(b.name for b in op.range if b.worker == comm.rank)
    on_device = all(v.is_cuda for v in result.values())
    problem = same_blocks({k: v.cpu().numpy() for k, v in result.items()}, expected, mine)
    collective_assert(on_device and problem is None, f"cuda: {problem}")


def _conv_model(size, rng):
    """Two feature-partitioned convolutions (spatial rows over the ranks) and their torch twin."""
    from linop.layers import Convolution

    x = DistributedTensor("x", (2, 2, 2 * size + 3, 5), Partition((1, 1, size, 1)))
    first = Convolution(x, 3, Kernel(3, padding=1), name="y")
    second = Convolution(first.y, 2, Kernel(3, padding=1), name="z")
    params = [
        (rng.standard_normal(first.weights.global_shape), rng.standard_normal(first.bias.global_shape)),
        (rng.standard_normal(second.weights.global_shape), rng.standard_normal(second.bias.global_shape)),
    ]
    twin = torch.nn.Sequential(
        torch.nn.Conv2d(2, 3, 3, padding=1, dtype=torch.float64),
        torch.nn.Tanh(),
        torch.nn.Conv2d(3, 2, 3, padding=1, dtype=torch.float64),
    )
    with torch.no_grad():
        for conv, (w, b) in zip((twin[0], twin[2]), params):
            conv.weight.copy_(torch.from_numpy(w))
            conv.bias.copy_(torch.from_numpy(b))
    return x, (first, second), params, twin


def _held(module, blocks):
    """The parameters a module holds from the global ones' blocks: the blocks themselves, or
    with ``replicate=True`` the copies the layer moves them to."""
    return module.layer.parameter_movement(blocks) if module.replicate else blocks


@pytest.mark.parametrize("replicate", [False, True], ids=["owners", "replicated"])
def test_distributed_convolutions_train_like_one_process(comm, monkeypatch, replicate):
    """Gradients (input, weights, bias) of the wrapped layers equal torch's Conv2d, three
    SGD steps of a conv-tanh-conv model trained across the ranks equal the one-process run
    (parameters held by their owners, or replicated as the copies each rank uses), and after the first step no call plans or binds anything (the movement trees are built,
    compiled and bound once)."""
    from linop.backends import mpi as mpi_backend
    from linop.backends.mpi import plan as mpi_plan
    from linop.frameworks.torch_layers import LayerModule

    rng = np.random.default_rng(11)
    x, layers, params, twin = _conv_model(comm.size, rng)
    modules = [
        LayerModule(layer, weights=w, bias=b, comm=comm, replicate=replicate)
        for layer, (w, b) in zip(layers, params)
    ]
    data = rng.standard_normal(x.global_shape)
    local = {
        k: torch.from_numpy(v).requires_grad_()
        for k, v in local_part(x.space, x.scatter(data), comm.rank).items()
    }
    mine = [p for m in modules for p in m.parameters()]  # feature partitions: the weights live on rank 0
    reference_parameters = list(twin.parameters())

    def sgd_step(parameters):  # torch.optim.SGD's step without momentum; its construction would
        with torch.no_grad():  # import torch._dynamo, seconds of CPU on each rank
            for parameter in (p for p in parameters if p.grad is not None):
                parameter -= 0.01 * parameter.grad
                parameter.grad = None

    reference_input = torch.from_numpy(data).requires_grad_()
    problems = []
    planned: list[str] = []

    def counting(function, what):
        def counted(*args, **kwargs):
            planned.append(what)
            return function(*args, **kwargs)

        return counted

    for step in range(3):
        if step == 1:
            monkeypatch.setattr(mpi_backend, "plan_for", counting(mpi_backend.plan_for, "plan_for"))
            bind = mpi_plan.DistributedPlan.bind
            monkeypatch.setattr(mpi_plan.DistributedPlan, "bind", counting(bind, "bind"))
        hidden = {k: torch.tanh(v) for k, v in modules[0](local).items()}
        out = modules[1](hidden)
        sum((v * v).sum() for v in out.values()).backward()  # each rank its share of the loss
        (twin(reference_input) ** 2).sum().backward()
        if step == 0:  # the input gradient, on this rank's blocks
            expected = x.scatter(reference_input.grad.numpy())
            problems += [f"dx {k}" for k, v in local.items() if not np.allclose(v.grad.numpy(), expected[k])]
        for module, conv in zip(modules, (twin[0], twin[2])):
            grads = {n: p.grad.numpy() for n, p in module.parameter_state().items()}
            reference = _held(
                module,
                {
                    **module.layer.weights.scatter(conv.weight.grad.numpy()),
                    **module.layer.bias.scatter(conv.bias.grad.numpy()),
                },
            )
            problems += [f"step {step} d{n}" for n, g in grads.items() if not np.allclose(g, reference[n])]
        sgd_step(mine)
        sgd_step(reference_parameters)
    for module, conv in zip(modules, (twin[0], twin[2])):
        trained = _held(
            module,
            {
                **module.layer.weights.scatter(conv.weight.detach().numpy()),
                **module.layer.bias.scatter(conv.bias.detach().numpy()),
            },
        )
        problems += [
            f"trained {n}"
            for n, p in module.parameter_state().items()
            if not np.allclose(p.detach(), trained[n])
        ]
    problems += [f"steps 2-3 called {sorted(set(planned))}"] if planned else []
    collective_assert(not problems, "; ".join(problems))


def test_distributed_affine_gives_torch_linear_gradients(comm):
    """The affine layer on a P_fo x P_fi work partition of every rank: output, input, weight
    and bias gradients equal torch's Linear."""
    from linop.frameworks.torch_layers import LayerModule
    from linop.layers import Affine

    p_fi = 2 if comm.size % 2 == 0 else 1
    p_fo = comm.size // p_fi
    rng = np.random.default_rng(12)
    x = DistributedTensor("x", (3, 4), Partition((1, p_fi)))
    layer = Affine(x, 2 * p_fo, workers=Partition((p_fo, p_fi)))
    w, b = rng.standard_normal(layer.weights.global_shape), rng.standard_normal(2 * p_fo)
    data, dy = rng.standard_normal((3, 4)), rng.standard_normal(layer.y.global_shape)
    module = LayerModule(layer, weights=w, bias=b, comm=comm)
    local = {
        k: torch.from_numpy(v).requires_grad_()
        for k, v in local_part(x.space, x.scatter(data), comm.rank).items()
    }
    y = module(local)
    dys = layer.y.scatter(dy)
    # P_y is the fi = 0 column of P_w: a rank without output joins the backward through the token
    (sum((v * torch.from_numpy(dys[k])).sum() for k, v in y.items()) + module.token.sum()).backward()
    linear = torch.nn.Linear(4, 2 * p_fo, dtype=torch.float64)
    with torch.no_grad():
        linear.weight.copy_(torch.from_numpy(w))
        linear.bias.copy_(torch.from_numpy(b))
    reference = torch.from_numpy(data).requires_grad_()
    out = linear(reference)
    out.backward(torch.from_numpy(dy))
    expected_y = layer.y.scatter(out.detach().numpy())
    expected_dx = x.scatter(reference.grad.numpy())
    expected_params = {
        **layer.weights.scatter(linear.weight.grad.numpy()),
        **layer.bias.scatter(linear.bias.grad.numpy()),
    }
    problems = [f"y {k}" for k, v in y.items() if not np.allclose(v.detach().numpy(), expected_y[k])]
    problems += [f"dx {k}" for k, v in local.items() if not np.allclose(v.grad.numpy(), expected_dx[k])]
    problems += [
        f"d{k}"
        for k, v in module.parameter_state().items()
        if not np.allclose(v.grad.numpy(), expected_params[k])
    ]
    collective_assert(not problems, "; ".join(problems))


def test_unbalanced_channel_convolution_gives_torch_conv2d_gradients(comm):
    """A general convolution whose 5 input and 7 output channels do not divide over their
    workers (shares 3, 2 and 4, 3 or 7 over 1; 3 over 3 ranks: 2, 2, 1 of 5 and 3, 2, 2 of 7):
    output, input, weight and bias gradients across the ranks equal torch's Conv2d."""
    from linop.frameworks.torch_layers import LayerModule
    from linop.layers import Convolution

    p_ci = 2 if comm.size % 2 == 0 else 1
    p_co = comm.size // p_ci
    rng = np.random.default_rng(13)
    x = DistributedTensor("x", (1, 5, 6, 5), Partition((1, p_ci, 1, 1)))
    workers = Partition((1, p_co, p_ci, 1, 1), tuple(reversed(range(comm.size))))
    layer = Convolution(x, 7, Kernel(3, padding=1), workers=workers)
    w, b = rng.standard_normal(layer.weights.global_shape), rng.standard_normal(7)
    data, dy = rng.standard_normal(x.global_shape), rng.standard_normal(layer.y.global_shape)
    module = LayerModule(layer, weights=w, bias=b, comm=comm)
    local = {
        k: torch.from_numpy(v).requires_grad_()
        for k, v in local_part(x.space, x.scatter(data), comm.rank).items()
    }
    y = module(local)
    dys = layer.y.scatter(dy)
    (sum((v * torch.from_numpy(dys[k])).sum() for k, v in y.items()) + module.token.sum()).backward()
    conv = torch.nn.Conv2d(5, 7, 3, padding=1, dtype=torch.float64)
    with torch.no_grad():
        conv.weight.copy_(torch.from_numpy(w))
        conv.bias.copy_(torch.from_numpy(b))
    reference = torch.from_numpy(data).requires_grad_()
    out = conv(reference)
    out.backward(torch.from_numpy(dy))
    expected_y = layer.y.scatter(out.detach().numpy())
    expected_dx = x.scatter(reference.grad.numpy())
    expected_params = layer.scatter_parameters(conv.weight.grad.numpy(), conv.bias.grad.numpy())
    problems = [f"y {k}" for k, v in y.items() if not np.allclose(v.detach().numpy(), expected_y[k])]
    problems += [f"dx {k}" for k, v in local.items() if not np.allclose(v.grad.numpy(), expected_dx[k])]
    problems += [
        f"d{k}"
        for k, v in module.parameter_state().items()
        if not np.allclose(v.grad.numpy(), expected_params[k])
    ]
    collective_assert(not problems, "; ".join(problems))


def test_torch_operator_under_a_worker_map(comm):
    from linop.program import WorkerMap

    u = DistributedTensor("u", (9, 7), Partition.grid((4, 4)))
    op = halo_windows(u, Kernel(3, padding=1))
    mapping = WorkerMap.round_robin(16, comm.size)
    held = set(mapping.workers_on(comm.rank))
    f = TorchOperator(op, comm=comm, mapping=mapping)
    full, cotangent = _integers(op.domain, 5), _integers(op.range, 6)
    forward = op({k: v.astype(np.float64) for k, v in full.items()})
    backward = op.H({k: v.astype(np.float64) for k, v in cotangent.items()})
    x = {
        b.name: torch.from_numpy(full[b.name].astype(np.float64)).requires_grad_()
        for b in op.domain
        if b.worker in held
    }
    y = f(x)
    weights = {k: torch.from_numpy(cotangent[k].astype(np.float64)) for k in y}
    sum((y[k] * weights[k]).sum() for k in y).backward()
    grads = {k: (torch.zeros_like(v) if v.grad is None else v.grad) for k, v in x.items()}
    problem = same_blocks({k: v.detach().numpy() for k, v in y.items()}, forward, f.outputs) or same_blocks(
        {k: v.numpy() for k, v in grads.items()}, backward, f.inputs
    )
    names = tuple(b.name for b in op.range if b.worker in held)
    collective_assert(problem is None and f.outputs == names, f"mapped torch: {problem}")
    result = op.apply_mpi({k: v.detach() for k, v in x.items()}, comm=comm, mapping=mapping)
    collective_assert(
        same_blocks({k: np.asarray(v) for k, v in result.items()}, forward, names) is None, "apply_mpi"
    )


def test_overlapped_layer_module_equals_the_plain_one(comm):
    """LayerModule with the halo exchange overlapped (the interior's torch products run while
    the exchange's messages are in flight, the backward with the adjoint exchange in flight)
    gives exactly the plain module's outputs and gradients (integer-valued float64), on the
    first call and on the bound plans of the second; the default turns it on where it pays."""
    from linop.frameworks.torch_layers import LayerModule
    from linop.layers import Convolution

    rng = np.random.default_rng(13)
    parts = (1, 1, 2, 2) if comm.size == 4 else (1, 1, comm.size, 1)
    x = DistributedTensor("x", (2, 2, 6 * parts[2] + 1, 6 * parts[3]), Partition(parts))
    layer = Convolution(x, 3, Kernel(3, padding=1))
    w = rng.integers(-2, 3, layer.weights.global_shape).astype(float)
    b = rng.integers(-2, 3, layer.bias.global_shape).astype(float)
    data = x.scatter(rng.integers(-3, 4, x.global_shape).astype(float))
    runs = []
    for overlap in (False, True):
        module = LayerModule(layer, weights=w, bias=b, comm=comm, overlap=overlap)
        for _ in range(2):
            inputs = {n: torch.from_numpy(data[n].copy()).requires_grad_() for n in module.input_names}
            out = module(inputs)
            (sum(((i + 1) * v).sum() for i, v in enumerate(out.values())) + module.token.sum()).backward()
            runs.append(
                (
                    {n: v.detach().numpy() for n, v in out.items()},
                    {n: t.grad.numpy() for n, t in inputs.items()},
                    {n: p.grad.numpy().copy() for n, p in module.parameter_state().items()},
                )
            )
            for p in module.parameters():
                p.grad = None
    problem = None
    for plain, overlapped in zip(runs[:2], runs[2:]):
        for a, c in zip(plain, overlapped):
            if sorted(a) != sorted(c) or any(not np.array_equal(a[n], c[n]) for n in a):
                problem = problem or f"outputs or gradients differ: {sorted(a)}"
    if LayerModule(layer, weights=w, bias=b, comm=comm).overlap:
        problem = problem or "overlap chosen by default (it is opt-in)"
    default = LayerModule(layer, weights=w, bias=b, comm=comm, overlap=None)  # by the rule
    small = Convolution(
        # one row per worker: no output's reach stays in its own bulk, so no interior to overlap
        DistributedTensor("s", (1, 1, comm.size, 4), Partition((1, 1, comm.size, 1))),
        1,
        Kernel(3, padding=1),
    )
    expected = comm.size > 1
    if default.overlap != expected or LayerModule(small, comm=comm, overlap=None).overlap:
        problem = problem or f"the overlap default: {default.overlap} (expected {expected}), small layer"
    if LayerModule(layer, weights=w, bias=b, overlap=None).overlap:  # one process: nothing to hide
        problem = problem or "overlap chosen without a communicator"
    collective_assert(problem is None, str(problem))


@pytest.mark.parametrize("straight", [False, True], ids=["bound", "straight"])
@pytest.mark.parametrize("replicate", [False, True], ids=["owners", "replicated"])
def test_layer_module_calls_outstanding_together_keep_their_operands(comm, replicate, straight, monkeypatch):
    """The module's bound plans write into buffers it owns, overwritten by each call: two
    calls whose backward runs after both forwards (one loss over both), then a second step,
    give the gradients of the same calls run one at a time; the gradients handed to autograd
    are fresh (an earlier step's stay as they were), and the input tensors are never written.
    Alike when the stages run straight on the tensors (``STRAIGHT_FROM`` reached), where a
    gradient may be a view of a block the run allocated."""
    from linop.frameworks import torch_function
    from linop.frameworks.torch_layers import LayerModule
    from linop.layers import Convolution

    if straight:
        monkeypatch.setattr(torch_function, "STRAIGHT_FROM", 0)

    x = DistributedTensor("x", (2, 3, 4 * comm.size, 5), Partition((1, 1, comm.size, 1)))
    layer = Convolution(x, 2, Kernel(3, padding=1))
    rng = np.random.default_rng(5)
    w, b = rng.standard_normal(layer.weights.global_shape), rng.standard_normal(layer.bias.global_shape)
    module = LayerModule(layer, weights=w, bias=b, comm=comm, replicate=replicate)
    (name,) = module.input_names
    inputs = [torch.from_numpy(x.scatter(rng.standard_normal(x.global_shape))[name]) for _ in range(2)]
    kept = [t.clone() for t in inputs]

    def gradients(*groups):
        found = []
        for group in groups:
            module.zero_grad()
            leaves = [t.detach().requires_grad_() for t in group]
            loss = module.token.sum() * 0
            for k, leaf in enumerate(leaves):
                (y,) = module({name: leaf}).values()
                loss = loss + (k + 1) * (y * y).sum() + module.token.sum()
            loss.backward()
            found.append([leaf.grad for leaf in leaves] + [p.grad for p in module.parameters()])
        return found

    (together,) = gradients(inputs)
    first, second = gradients(inputs[:1], inputs[1:])
    again = [g.clone() for g in together]
    gradients(inputs)  # another step: the first step's gradients must not change
    problems = [f"input {k} written" for k, (t, c) in enumerate(zip(inputs, kept)) if not torch.equal(t, c)]
    problems += [
        f"step gradient {k} changed" for k, (g, h) in enumerate(zip(together, again)) if not torch.equal(g, h)
    ]
    problems += [
        f"dx {k}" for k in range(2) if not torch.allclose(together[k], [first, second][k][0] * (k + 1))
    ]
    params = [a + 2 * c for a, c in zip(first[1:], second[1:])]
    problems += [
        f"dtheta {k}" for k, (g, h) in enumerate(zip(together[2:], params)) if not torch.allclose(g, h)
    ]
    collective_assert(not problems, "; ".join(problems))


def test_fused_chain_module_gives_torchs_gradients_across_ranks(comm):
    """ChainModule (one fused halo exchange for conv -> conv -> max pool) across the ranks:
    outputs, input gradients and, after sum_gradients, weight gradients equal torch's layers on
    the whole input, for five calls on inputs 0, 1, 2, 1, 3 before one backward of all (input
    1's gradient the sum of two). The first call binds the windows' plans (the backward's first,
    the last call's, the adjoint's), the others run through their buffers (``bound_views``): a
    window the stages keep (call 1's, then call 2's), or a gradient autograd holds until the
    other of its input arrives (call 3's, then call 2's adjoint), left in those buffers
    uncopied is overwritten by the next call (fails)."""
    from linop.frameworks.torch_chain import ChainModule
    from linop.layers import ChainStage, WindowChain

    rng = np.random.default_rng(41)
    grid = (2, 2) if comm.size == 4 else (comm.size, 1)
    x = DistributedTensor("x", (1, 2, 10, 9), Partition((1, 1, *grid)))
    stages = [
        ChainStage.conv(rng.standard_normal((2, 2, 3, 3)), padding=1),
        ChainStage.conv(rng.standard_normal((2, 2, 3, 3)), padding=1),
        ChainStage.max(Kernel(2, stride=2)),
    ]
    chain = WindowChain(x, stages)
    module = ChainModule(chain, comm=comm)
    functional = torch.nn.functional
    weights = [torch.from_numpy(np.array(s.weights)).requires_grad_() for s in stages[:2]]
    inputs = []
    for _ in range(4):
        data = rng.standard_normal(x.global_shape)
        local = {
            k: torch.from_numpy(np.array(v)).requires_grad_()
            for k, v in local_part(x.space, x.scatter(data), comm.rank).items()
        }
        inputs.append((local, torch.from_numpy(data).requires_grad_()))
    outputs, loss = [], torch.zeros(())
    for local, reference in (inputs[i] for i in (0, 1, 2, 1, 3)):
        dy = rng.standard_normal(chain.y.global_shape)
        y = module(local)
        dys = chain.y.scatter(dy)
        loss = loss + sum((v * torch.from_numpy(dys[k])).sum() for k, v in y.items()) + module.token.sum()
        convolved = functional.conv2d(
            functional.conv2d(reference, weights[0], padding=1), weights[1], padding=1
        )
        out = functional.max_pool2d(convolved, 2)
        out.backward(torch.from_numpy(dy))  # the gradients: the sums over the calls
        outputs.append((y, chain.y.scatter(out.detach().numpy())))
    loss.backward()
    module.sum_gradients()
    problems = []
    for call, (y, expected_y) in enumerate(outputs):
        problems += [
            f"call {call}: y {k}" for k, v in y.items() if not np.allclose(v.detach().numpy(), expected_y[k])
        ]
    for i, (local, reference) in enumerate(inputs):
        expected_dx = x.scatter(reference.grad.numpy())
        problems += [
            f"input {i}: dx {k}" for k, v in local.items() if not np.allclose(v.grad.numpy(), expected_dx[k])
        ]
    problems += [
        f"dw{i}" for i, (w, r) in enumerate(zip(module.weights, weights)) if not np.allclose(w.grad, r.grad)
    ]
    collective_assert(not problems, "; ".join(problems))


DTYPE_CHANGES = (torch.float64, torch.float64, torch.float32, torch.float32, torch.float64)
"""The dtypes of consecutive calls: a change after a kept binding, twice."""


def unfit_here(monkeypatch) -> None:
    """This rank's tensors never fit a kept binding (as a CUDA tensor's would not): its calls
    take the general path while its peers' take the kept calls."""
    from linop.frameworks import torch_function, torch_losses, torch_repartition

    for module in (torch_function, torch_losses, torch_repartition):
        monkeypatch.setattr(module, "tensors_fit", lambda *args, **kwargs: False)


@pytest.mark.parametrize("unfit", [False, True], ids=["kept", "one-rank-unfit"])
def test_trees_leaving_a_rank_without_inputs_follow_dtype_changes(comm, unfit, monkeypatch):
    """A TorchOperator of a broadcast (only its root has an input block) and a Repartition from
    one worker onto one per rank, called forward and backward at float64, float64, float32,
    float32, float64: on every rank exactly the one-process results (integers), of the call's
    dtype. A rank without inputs cannot see the change: the ranks agree on it at the start of
    each call of such a tree, one all-reduce counted here (from the second call, forward only:
    the adjoints give every rank inputs), once per call on every rank also where one rank's
    tensors take the general path while its peers' take the kept calls (``unfit``: rank
    ``call % size``, with inputs or without). A halo exchange's windows (every rank has
    inputs) agree on nothing. Before the agreement the first float32 call ended the job
    (PeerMismatchError: a rank without inputs ran its float64 binding)."""
    from linop.frameworks.torch_repartition import Repartition

    size, rank = comm.size, comm.rank
    sent = count_agreements(monkeypatch)
    source = DistributedTensor("a", (5, 3), Partition((1, 1)))
    destination = DistributedTensor("b", (5, 3), Partition((size, 1)))
    repartition = Repartition(source, destination, comm=comm)
    trees = {name: _trees(size)[name] for name in ("broadcast", *(() if unfit else ("halo-windows",)))}
    trees["repartition"] = repartition.operator
    functions = {name: TorchOperator(op, comm=comm) for name, op in trees.items() if name != "repartition"}
    functions["repartition"] = repartition
    problems = []
    for call, dtype in enumerate(DTYPE_CHANGES):
        with monkeypatch.context() as patch:
            if unfit and call % size == rank:
                unfit_here(patch)
            for name, f in functions.items():
                op = trees[name]
                full, cotangent = _integers(op.domain, 10 + call), _integers(op.range, 20 + call)
                forward = op({k: v.astype(np.float64) for k, v in full.items()})
                backward = op.H({k: v.astype(np.float64) for k, v in cotangent.items()})
                x = {
                    k: v.to(dtype).requires_grad_()
                    for k, v in _as_torch(local_part(op.domain, full, rank)).items()
                }
                y = f(x)
                weights = {
                    k: v.to(dtype) for k, v in _as_torch(local_part(op.range, cotangent, rank)).items()
                }
                (sum((y[k] * weights[k]).sum() for k in y) + f.token.sum()).backward()
                grads = {k: (torch.zeros_like(v) if v.grad is None else v.grad) for k, v in x.items()}
                wrong = [k for k, v in (*y.items(), *grads.items()) if v.dtype != dtype]
                problem = same_blocks(
                    {k: v.detach().numpy() for k, v in y.items()}, forward, tuple(y)
                ) or same_blocks({k: v.numpy() for k, v in grads.items()}, backward, tuple(x))
                if problem or wrong:
                    problems.append(f"call {call} {name}: {problem or ''} dtypes of {wrong}")
    expected = {"repartition": 4, "broadcast": 4} if size > 1 else {}
    counts = {name: sent.count(str(op)) for name, op in trees.items() if sent.count(str(op))}
    collective_assert(
        not problems and counts == expected, f"{problems}; agreements {counts}, expected {expected}"
    )


@pytest.mark.parametrize("straight", [False, True], ids=["bound", "straight"])
def test_layer_module_follows_dtype_changes_of_parameters_held_by_their_owner(comm, monkeypatch, straight):
    """A convolution whose weights and bias live on their owner (rank 0: the other ranks hold
    no input blocks of the parameters' copies), its module cast to float64, float64, float32,
    float32, float64 between calls: forward and backward equal the one-process module's in
    each dtype, with nothing sent for it: every rank knows the parameters' dtype
    (``LayerModule.parameters_dtype``) and drops a copies' binding of another alike. Before,
    the owner alone bound again for float32 while its peers ran their float64 binding, and the
    job ended at the deadline. Alike where the stages run straight on the tensors
    (``STRAIGHT_FROM`` reached)."""
    from linop.frameworks import torch_function
    from linop.frameworks.torch_layers import LayerModule
    from linop.layers import Convolution

    if straight:
        monkeypatch.setattr(torch_function, "STRAIGHT_FROM", 0)

    size, rank = comm.size, comm.rank
    sent = count_agreements(monkeypatch)
    x = DistributedTensor("x", (2, 3, 3 * size, 4), Partition((1, 1, size, 1)))
    layer = Convolution(x, 2, Kernel(3, padding=1))
    rng = np.random.default_rng(3)
    w, b = rng.standard_normal(layer.weights.global_shape), rng.standard_normal(layer.bias.global_shape)
    module = LayerModule(layer, weights=w, bias=b, comm=comm)
    alone = LayerModule(layer, weights=w, bias=b)
    data = x.scatter(rng.standard_normal(x.global_shape))
    problems = []
    for call, dtype in enumerate(DTYPE_CHANGES):
        module.to(dtype)
        alone.to(dtype)
        module.zero_grad()
        alone.zero_grad()
        mine = {
            k: torch.from_numpy(v).to(dtype).requires_grad_()
            for k, v in local_part(x.space, data, rank).items()
        }
        every = {k: torch.from_numpy(v).to(dtype).requires_grad_() for k, v in data.items()}
        y, reference = module(mine), alone(every)
        sum((v * v).sum() for v in y.values()).backward()
        sum((v * v).sum() for v in reference.values()).backward()
        tolerance = {"rtol": 1e-10, "atol": 1e-10} if dtype == torch.float64 else {"rtol": 1e-4, "atol": 1e-4}
        pairs = [(f"y {k}", v, reference[k]) for k, v in y.items()]
        pairs += [(f"dx {k}", v.grad, every[k].grad) for k, v in mine.items()]
        held = dict(module.named_parameters())
        pairs += [(f"d{k}", p.grad, dict(alone.named_parameters())[k].grad) for k, p in held.items()]
        for what, got, want in pairs:
            if got.dtype != dtype or not torch.allclose(got, want, **tolerance):
                problems.append(f"call {call} {what}: {got.dtype}, largest error {(got - want).abs().max()}")
    collective_assert(not problems and not sent, f"{problems}; agreements {sent}, expected none")


@pytest.mark.parametrize("case", ["2d", "1d-wide-locals"])
def test_chain_windows_kept_exchange_are_the_tree_on_every_call(comm, case):
    """ChainModule's windows under MPI after their first call run as the exchange alone, bound
    in place on its own local blocks (``torch_chain._KeptWindows``: the padding zeroed once, the
    bulk and halo rewritten, each window and gradient a copy; kept again when the dtypes
    change). Five calls on new integer data (float64, float64, float32, float32, float64): the
    windows and their adjoint equal the tree's exactly on each, the previous call's results
    are still right after the next call, and what the caller writes into them (NaN, as MaxPool
    writes -inf into its windows) reaches no later call. In ``1d-wide-locals`` the local blocks
    are wider than their windows (two workers; ranks 2 and 3 hold none: they follow the dtypes
    through the ranks' agreement on each call), so the backward zeroes them on each call."""
    from linop.frameworks.torch_chain import ChainModule, _ChainWindows
    from linop.layers import ChainStage, WindowChain

    rng = np.random.default_rng(43)
    if case == "2d":
        grid = (2, 2) if comm.size == 4 else (comm.size, 1)
        x = DistributedTensor("x", (1, 2, 5 * grid[0], 4 * grid[1]), Partition((1, 1, *grid)))
        stages = [ChainStage.conv(np.ones((2, 2, 3, 3)), padding=1), ChainStage.avg(Kernel(2, stride=2))]
        mapping = None
    else:
        x = DistributedTensor("x", (1, 1, 7), Partition((1, 1, 2)))
        stages = [ChainStage.avg(Kernel(2)), ChainStage.avg(Kernel(2, stride=3))]
        mapping = [0, min(1, comm.size - 1)]
    chain = WindowChain(x, stages)
    op = chain.window_operator
    module = ChainModule(chain, comm=comm, mapping=mapping)
    names, windows_of = module.input_names, module.function.outputs
    problems, before = [], None
    dtypes = (np.float64, np.float64, np.float32, np.float32, np.float64)
    for call, dtype in enumerate(dtypes):
        state = x.scatter(rng.integers(-9, 10, x.global_shape).astype(np.float64))
        seeds = {b.name: rng.integers(-9, 10, b.shape).astype(np.float64) for b in op.range}
        blocks = [torch.from_numpy(np.array(state[k], dtype=dtype)).requires_grad_() for k in names]
        *windows, token = _ChainWindows.apply(module, module._anchor, *blocks)
        loss = sum((w * torch.from_numpy(seeds[k])).sum() for k, w in zip(windows_of, windows))
        (loss + token.sum()).backward()  # the token: a rank holding no block runs it too
        grads = [b.grad for b in blocks]
        now = (
            dict(zip(windows_of, windows)),
            op(state),
            dict(zip(names, grads)),
            op.H(seeds),
        )
        checked = [(call, now)] if before is None else [(call, now), (call - 1, before)]
        for done, (got, expected, got_back, expected_back) in checked:
            problems += [
                f"call {done}: window {k}"
                for k, w in got.items()
                if not np.array_equal(w.detach(), expected[k])
            ]
            problems += [
                f"call {done}: dx {k}" for k, g in got_back.items() if not np.array_equal(g, expected_back[k])
            ]
        mine = (torch.from_numpy(np.zeros(0, dtype)).dtype,) * len(names)
        if any(k is None or k.dtypes != mine for k in module._kept):  # kept for this call's dtype
            problems.append(f"call {call}: no exchange kept for {dtype.__name__}")
        if before is not None:  # the caller's scribbles, into the results it has
            for t in (*before[0].values(), *before[2].values()):
                t.detach().fill_(float("nan"))
        before = now
    collective_assert(not problems, str(problems))


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_chain_kept_exchange_after_a_create_graph_backward_in_another_dtype(comm):
    """A ChainModule whose windows' tree leaves ranks without inputs (two workers: at 3-4 ranks
    ranks 2 and 3 hold none): a float64 backward (the adjoint's exchange kept), a float32
    backward under ``create_graph`` (the adjoint recorded: it binds again, the kept exchange
    not renewed), then a float64 backward: its gradients exact on every rank. Before, that last
    call's agreement compared the dtypes with the stale kept exchange's (float64: no change),
    the ranks with inputs bound again for float64 and those without ran their float32 binding:
    the job ended at the deadline."""
    from linop.frameworks.torch_chain import ChainModule, _ChainWindows
    from linop.layers import ChainStage, WindowChain

    x = DistributedTensor("x", (1, 1, 7), Partition((1, 1, 2)))
    chain = WindowChain(x, [ChainStage.avg(Kernel(2)), ChainStage.avg(Kernel(2, stride=3))])
    op = chain.window_operator
    module = ChainModule(chain, comm=comm, mapping=[0, min(1, comm.size - 1)])
    rng = np.random.default_rng(1)
    problems = []
    for call, (dtype, graph) in enumerate([(np.float64, False), (np.float32, True), (np.float64, False)]):
        state = x.scatter(rng.integers(-9, 10, x.global_shape).astype(np.float64))
        seeds = {b.name: rng.integers(-9, 10, b.shape).astype(np.float64) for b in op.range}
        blocks = [
            torch.from_numpy(np.array(state[k], dtype=dtype)).requires_grad_() for k in module.input_names
        ]
        *windows, token = _ChainWindows.apply(module, module._anchor, *blocks)
        loss = sum((w * torch.from_numpy(seeds[k])).sum() for k, w in zip(module.function.outputs, windows))
        (loss + token.sum()).backward(create_graph=graph)  # the token: a rank holding no block too
        expected = op.H(seeds)
        problems += [
            f"call {call}: dx {k}"
            for k, b in zip(module.input_names, blocks)
            if not np.array_equal(b.grad.detach().numpy(), expected[k])
        ]
    collective_assert(not problems, str(problems))
