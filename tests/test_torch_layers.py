"""Distributed layers wrapped as torch modules give torch's own gradients (input, weights, bias)."""

import numpy as np
import pytest

from linop import DistributedTensor, Kernel, Partition, StateError
from linop.layers import Affine, Convolution, LayerError

torch = pytest.importorskip("torch", reason="torch is not installed (the torch extra)")
from linop.frameworks.torch_layers import LayerModule  # noqa: E402

CONVOLUTIONS = {
    "feature-2x2": ((2, 2, 8, 6), (1, 1, 2, 2), None, Kernel(3, padding=1)),
    "feature-3x1-stride": ((2, 2, 9, 5), (1, 1, 3, 1), None, Kernel(3, padding=1, stride=(2, 1))),
    "channel-in-2": ((1, 4, 6, 6), (1, 2, 1, 1), None, Kernel(3, padding=1)),
    "general-2x2": (
        (1, 2, 6, 5),
        (1, 2, 1, 1),
        Partition((1, 2, 2, 1, 1), (0, 1, 2, 3)),
        Kernel(3, padding=1),
    ),
}


def _gather(tensor, state):
    return tensor.gather({b.name: state[b.name] for b in tensor.blocks})


def _backward(module, tensor, inputs, dy):
    outputs = module(inputs)
    sum((outputs[k] * torch.from_numpy(dy[k])).sum() for k in outputs).backward()
    return outputs


def _convolution_case(name, seed):
    """The convolution of CONVOLUTIONS[name] with 4 output channels, random weights and bias."""
    shape, grid, workers, kernel = CONVOLUTIONS[name]
    rng = np.random.default_rng(seed)
    x = DistributedTensor("x", shape, Partition(grid))
    layer = Convolution(x, 4, kernel, workers=workers)
    w, b = rng.standard_normal(layer.weights.global_shape), rng.standard_normal(layer.bias.global_shape)
    return rng, x, layer, w, b


@pytest.mark.parametrize("name", list(CONVOLUTIONS), ids=list(CONVOLUTIONS))
def test_convolution_module_matches_torch_conv2d(name):
    rng, x, layer, w, b = _convolution_case(name, 1)
    module = LayerModule(layer, weights=w, bias=b)
    data, dy = rng.standard_normal(x.global_shape), rng.standard_normal(layer.y.global_shape)
    inputs = {k: torch.from_numpy(v).requires_grad_() for k, v in x.scatter(data).items()}
    outputs = _backward(module, torch, inputs, layer.y.scatter(dy))

    stride = CONVOLUTIONS[name][3].stride
    conv = torch.nn.Conv2d(x.global_shape[1], 4, 3, padding=1, stride=stride, dtype=torch.float64)
    with torch.no_grad():
        conv.weight.copy_(torch.from_numpy(w))
        conv.bias.copy_(torch.from_numpy(b))
    reference = torch.from_numpy(data).requires_grad_()
    expected = conv(reference)
    expected.backward(torch.from_numpy(dy))

    parameters = {k: v.grad.numpy() for k, v in module.parameter_state().items()}
    assert np.allclose(layer.y.gather({k: v.detach().numpy() for k, v in outputs.items()}), expected.detach())
    assert np.allclose(x.gather({k: v.grad.numpy() for k, v in inputs.items()}), reference.grad)
    assert np.allclose(_gather(layer.weights, parameters), conv.weight.grad)
    assert np.allclose(_gather(layer.bias, parameters), conv.bias.grad)


@pytest.mark.parametrize("grid", [(1, 1), (2, 2), (3, 1)], ids=["1x1", "2x2", "3x1"])
def test_affine_module_matches_torch_linear(grid):
    p_fo, p_fi = grid
    rng = np.random.default_rng(2)
    x = DistributedTensor("x", (3, 6), Partition((1, p_fi)))
    layer = Affine(x, 6, workers=Partition((p_fo, p_fi)))
    w, b = rng.standard_normal((6, 6)), rng.standard_normal(6)
    module = LayerModule(layer, weights=w, bias=b)
    data, dy = rng.standard_normal((3, 6)), rng.standard_normal((3, 6))
    inputs = {k: torch.from_numpy(v).requires_grad_() for k, v in x.scatter(data).items()}
    outputs = _backward(module, torch, inputs, layer.y.scatter(dy))
    linear = torch.nn.Linear(6, 6, dtype=torch.float64)
    with torch.no_grad():
        linear.weight.copy_(torch.from_numpy(w))
        linear.bias.copy_(torch.from_numpy(b))
    reference = torch.from_numpy(data).requires_grad_()
    expected = linear(reference)
    expected.backward(torch.from_numpy(dy))
    parameters = {k: v.grad.numpy() for k, v in module.parameter_state().items()}
    assert np.allclose(layer.y.gather({k: v.detach().numpy() for k, v in outputs.items()}), expected.detach())
    assert np.allclose(x.gather({k: v.grad.numpy() for k, v in inputs.items()}), reference.grad)
    assert np.allclose(_gather(layer.weights, parameters), linear.weight.grad)
    assert np.allclose(_gather(layer.bias, parameters), linear.bias.grad)


def test_layer_module_trains_with_a_torch_optimizer_and_refuses_wrong_blocks():
    x = DistributedTensor("x", (3, 4), Partition((1, 2)))
    module = LayerModule(Affine(x, 2), weights=np.ones((2, 4)))
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    inputs = {k: torch.from_numpy(v) for k, v in x.scatter(np.ones((3, 4))).items()}
    before = [p.detach().clone() for p in module.parameters()]
    sum(v.sum() for v in module(inputs).values()).backward()
    optimizer.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, module.parameters()))
    assert module._anchor.requires_grad and module._anchor.grad is None  # it only ties the graph
    with pytest.raises(StateError, match="takes blocks"):
        module({"x[0,0]": inputs["x[0,0]"]})


@pytest.mark.parametrize("name", ["feature-3x1-stride", "general-2x2"], ids=["feature-stride", "general"])
def test_convolution_module_runs_the_adjoints_of_the_layer_trees(name):
    """The module's torch kernels and movement trees compute what the layer's whole trees
    (numpy kernels, proven by verify) compute: y = P(x) theta, dx = A(w)^* dy, dtheta = P(x)^* dy."""
    rng, x, layer, w, b = _convolution_case(name, 3)
    module = LayerModule(layer, weights=w, bias=b)
    data, dy = (
        x.scatter(rng.standard_normal(x.global_shape)),
        layer.y.scatter(rng.standard_normal(layer.y.global_shape)),
    )
    inputs = {k: torch.from_numpy(v).requires_grad_() for k, v in data.items()}
    outputs = _backward(module, torch, inputs, dy)

    parameters = layer.parameter_operator(layer.window_operator(data))
    theta = layer.scatter_parameters(w, b)
    expected_y = parameters(theta)
    expected_dx = layer.input_operator(w).H(dy)
    expected_dtheta = parameters.H(dy)
    for k, v in outputs.items():
        assert np.allclose(v.detach().numpy(), expected_y[k]), k
    for k, v in inputs.items():
        assert np.allclose(v.grad.numpy(), expected_dx[k]), k
    for k, v in module.parameter_state().items():
        assert np.allclose(v.grad.numpy(), expected_dtheta[k]), k


def test_layer_module_refuses_a_convolution_torch_has_no_kernel_for():
    x = DistributedTensor("x", (1, 1, 3, 3, 3, 3), Partition((1, 1, 1, 1, 1, 1)))
    with pytest.raises(LayerError, match="4 spatial dimensions"):
        LayerModule(Convolution(x, 1, Kernel(1)))


@pytest.mark.parametrize("name", ["feature-2x2", "general-2x2"], ids=["feature", "general"])
def test_replicated_copies_get_the_summed_gradient_of_their_block(name):
    """replicate=True: the module holds the parameter copies; each gets the gradient of its
    block (M M^* of the copies' gradients, proven equal to the layer's AllReduce tree), so an
    SGD step keeps the copies equal to the moved, updated blocks of the default module."""
    import verify

    rng, x, layer, w, b = _convolution_case(name, 4)
    movement = layer.parameter_movement
    assert verify.equal(layer.copy_gradient_sum, movement @ movement.H)
    owners = LayerModule(layer, weights=w, bias=b)
    copies = LayerModule(layer, weights=w, bias=b, replicate=True)
    data, dy = (
        x.scatter(rng.standard_normal(x.global_shape)),
        layer.y.scatter(rng.standard_normal(layer.y.global_shape)),
    )
    results = []
    for module in (owners, copies):
        inputs = {k: torch.from_numpy(v).requires_grad_() for k, v in data.items()}
        out = _backward(module, torch, inputs, dy)
        results.append(
            ({k: v.detach().numpy() for k, v in out.items()}, {k: v.grad for k, v in inputs.items()})
        )
        torch.optim.SGD(module.parameters(), lr=0.1).step()
    assert set(copies.parameter_names) == set(movement.range.names)
    (y_owners, dx_owners), (y_copies, dx_copies) = results
    assert all(np.allclose(y_owners[k], y_copies[k]) for k in y_owners)
    assert all(torch.allclose(dx_owners[k], dx_copies[k]) for k in dx_owners)
    moved = movement({k: v.detach().numpy() for k, v in owners.parameter_state().items()})
    for k, v in copies.parameter_state().items():
        assert np.allclose(v.detach().numpy(), moved[k]), k


def test_float32_parameters_with_float64_input_compute_in_float64():
    x = DistributedTensor("x", (3, 4), Partition((1, 2)))
    module = LayerModule(Affine(x, 2), weights=np.ones((2, 4)), bias=np.ones(2), dtype=torch.float32)
    inputs = {k: torch.from_numpy(v).requires_grad_() for k, v in x.scatter(np.full((3, 4), 0.1)).items()}
    outputs = module(inputs)
    assert all(v.dtype == torch.float64 for v in outputs.values())
    sum(v.sum() for v in outputs.values()).backward()
    assert all(p.grad.dtype == torch.float32 for p in module.parameters())
    assert all(v.grad.dtype == torch.float64 for v in inputs.values())


@pytest.mark.parametrize("kind", ["convolution", "affine"])
def test_complex_layers_give_torch_autograds_gradients(kind):
    """complex128 data and parameters: the module's explicit backward of its local products
    (conjugated operands) equals torch autograd through the same layer in one piece."""
    rng = np.random.default_rng(5)

    def draw(*shape):
        return rng.standard_normal(shape) + 1j * rng.standard_normal(shape)

    if kind == "convolution":
        x = DistributedTensor("x", (1, 2, 6, 5), Partition((1, 1, 2, 1)))
        layer = Convolution(x, 3, Kernel(3, padding=1))
        reference = lambda data, w, b: torch.nn.functional.conv2d(data, w, b, padding=1)  # noqa: E731
    else:
        x = DistributedTensor("x", (3, 4), Partition((1, 2)))
        layer = Affine(x, 2, workers=Partition((1, 2)))
        reference = torch.nn.functional.linear
    w, b = draw(*layer.weights.global_shape), draw(*layer.bias.global_shape)
    data, dy = draw(*x.global_shape), draw(*layer.y.global_shape)
    module = LayerModule(layer, weights=w, bias=b, dtype=torch.complex128)
    inputs = {k: torch.from_numpy(v).requires_grad_() for k, v in x.scatter(data).items()}
    outputs = module(inputs)
    dys = layer.y.scatter(dy)
    sum((v * torch.from_numpy(dys[k]).conj()).real.sum() for k, v in outputs.items()).backward()

    tensors = [torch.from_numpy(a).requires_grad_() for a in (data, w, b)]
    out = reference(*tensors)
    (out * torch.from_numpy(dy).conj()).real.sum().backward()
    assert np.allclose(layer.y.gather({k: v.detach().numpy() for k, v in outputs.items()}), out.detach())
    assert np.allclose(x.gather({k: v.grad.numpy() for k, v in inputs.items()}), tensors[0].grad)
    parameters = {k: v.grad.numpy() for k, v in module.parameter_state().items()}
    assert np.allclose(_gather(layer.weights, parameters), tensors[1].grad)
    assert np.allclose(_gather(layer.bias, parameters), tensors[2].grad)


UNBALANCED = {
    # name: (x shape, x partition, x sizes or None, P_w, C_out, out_sizes or None)
    "ci7/3-co5/2": ((2, 7, 6, 5), (1, 3, 1, 1), None, (1, 2, 3, 1, 1), 5, None),
    "explicit-ci1,4,1-co3,1": (
        (1, 6, 6, 5),
        (1, 3, 1, 1),
        ((1,), (1, 4, 1), (6,), (5,)),
        (1, 2, 3, 1, 1),
        4,
        (3, 1),
    ),
    "general-ci5/2-co4/3": ((1, 5, 7, 6), (1, 2, 2, 1), None, (1, 3, 2, 2, 1), 4, None),
    "empty-shares-ci2/3-co2/3": ((1, 2, 5, 5), (1, 3, 1, 1), None, (1, 3, 3, 1, 1), 2, None),
}


@pytest.mark.parametrize("replicate", [False, True], ids=["owners", "replicated"])
@pytest.mark.parametrize("name", list(UNBALANCED), ids=list(UNBALANCED))
def test_unbalanced_channel_shares_give_torch_conv2d_gradients(name, replicate):
    """Channels that do not divide over their workers (balanced 3, 2, 2 shares, explicit uneven
    ones, empty ones): the module's output and input, weight and bias gradients are torch's."""
    shape, grid, sizes, pw, out, out_sizes = UNBALANCED[name]
    rng = np.random.default_rng(7)
    x = DistributedTensor("x", shape, Partition(grid), sizes=sizes or ())
    workers = Partition(pw, tuple(range(int(np.prod(pw)))))
    layer = Convolution(x, out, Kernel(3, padding=1), workers=workers, out_sizes=out_sizes)
    w, b = rng.standard_normal(layer.weights.global_shape), rng.standard_normal(out)
    module = LayerModule(layer, weights=w, bias=b, replicate=replicate)
    data, dy = rng.standard_normal(shape), rng.standard_normal(layer.y.global_shape)
    inputs = {k: torch.from_numpy(v).requires_grad_() for k, v in x.scatter(data).items()}
    outputs = _backward(module, torch, inputs, layer.y.scatter(dy))

    conv = torch.nn.Conv2d(shape[1], out, 3, padding=1, dtype=torch.float64)
    with torch.no_grad():
        conv.weight.copy_(torch.from_numpy(w))
        conv.bias.copy_(torch.from_numpy(b))
    reference = torch.from_numpy(data).requires_grad_()
    expected = conv(reference)
    expected.backward(torch.from_numpy(dy))
    assert np.allclose(layer.y.gather({k: v.detach().numpy() for k, v in outputs.items()}), expected.detach())
    assert np.allclose(x.gather({k: v.grad.numpy() for k, v in inputs.items()}), reference.grad)
    grads = {k: v.grad.numpy() for k, v in module.parameter_state().items()}
    if replicate:  # every copy holds its block's gradient: read the owners' copies (ci = 0, s = 0)
        owners = {
            layer.local_operands(j)[1]: layer.weights.block_name((*j[1:3], 0, 0))
            for j in layer.work_indices()
        }
        grads = {owners[k]: v for k, v in grads.items() if k in owners and k.endswith(",0,0]")} | {
            layer.bias.block_name((co,)): grads[f"bt[0,0,{co}]"] for co in range(pw[1])
        }
    assert np.allclose(_gather(layer.weights, grads), conv.weight.grad)
    assert np.allclose(_gather(layer.bias, grads), conv.bias.grad)


@pytest.mark.parametrize(
    ("features", "grid", "sizes", "out", "out_sizes"),
    [(7, (2, 3), None, 5, None), (7, (3, 2), (6, 1), 4, (0, 3, 1)), (12, (3, 4), None, 7, None)],
    ids=["fi7/3-fo5/2", "explicit-fi6,1-fo0,3,1", "distdl-12-to-7"],
)
def test_unbalanced_feature_shares_give_torch_linear_gradients(features, grid, sizes, out, out_sizes):
    p_fi = grid[1]
    rng = np.random.default_rng(8)
    x = DistributedTensor("x", (3, features), Partition((1, p_fi)), sizes=((3,), sizes) if sizes else ())
    layer = Affine(x, out, workers=Partition(grid), out_sizes=out_sizes)
    w, b = rng.standard_normal((out, features)), rng.standard_normal(out)
    module = LayerModule(layer, weights=w, bias=b)
    data, dy = rng.standard_normal((3, features)), rng.standard_normal((3, out))
    inputs = {k: torch.from_numpy(v).requires_grad_() for k, v in x.scatter(data).items()}
    outputs = _backward(module, torch, inputs, layer.y.scatter(dy))
    linear = torch.nn.Linear(features, out, dtype=torch.float64)
    with torch.no_grad():
        linear.weight.copy_(torch.from_numpy(w))
        linear.bias.copy_(torch.from_numpy(b))
    reference = torch.from_numpy(data).requires_grad_()
    expected = linear(reference)
    expected.backward(torch.from_numpy(dy))
    parameters = {k: v.grad.numpy() for k, v in module.parameter_state().items()}
    assert np.allclose(layer.y.gather({k: v.detach().numpy() for k, v in outputs.items()}), expected.detach())
    assert np.allclose(x.gather({k: v.grad.numpy() for k, v in inputs.items()}), reference.grad)
    assert np.allclose(_gather(layer.weights, parameters), linear.weight.grad)
    assert np.allclose(_gather(layer.bias, parameters), linear.bias.grad)


@pytest.mark.parametrize("kind", ["convolution", "affine"])
def test_an_input_without_gradient_skips_the_input_path_with_equal_parameter_gradients(kind):
    """In one process: an input that needs no gradient runs no adjoint window movement and no
    local input gradient; the parameters' gradients equal, exactly, the full path's."""
    rng = np.random.default_rng(4)
    if kind == "convolution":
        x = DistributedTensor("x", (2, 3, 7, 6), Partition((1, 1, 2, 2)))
        layer = Convolution(x, 2, Kernel(3, padding=1))
    else:
        x = DistributedTensor("x", (3, 6), Partition((1, 2)))
        layer = Affine(x, 4, workers=Partition((2, 2)))
    w, b = rng.standard_normal(layer.weights.global_shape), rng.standard_normal(layer.bias.global_shape)
    module = LayerModule(layer, weights=w, bias=b)
    blocks = x.scatter(rng.standard_normal(x.global_shape))
    adjoints = []
    run = module.windows.run
    module.windows.run = lambda tensors, *, adjoint=False: (
        adjoints.append(adjoint) or run(tensors, adjoint=adjoint)
    )
    found = []
    for wanted in (True, False):
        module.zero_grad()
        adjoints.clear()
        given = {k: torch.from_numpy(v).requires_grad_(wanted) for k, v in blocks.items()}
        (sum((v * v).sum() for v in module(given).values())).backward()
        found.append(([p.grad for p in module.parameters()], adjoints.count(True)))
        assert all((t.grad is not None) == wanted for t in given.values())
    (full, full_adjoints), (skipped, skipped_adjoints) = found
    assert (full_adjoints, skipped_adjoints) == (1, 0)
    assert all(torch.equal(a, b) for a, b in zip(full, skipped))


def test_an_input_declared_data_runs_no_input_path_and_one_that_needs_a_gradient_is_refused():
    """``input_gradient=False``: no adjoint window movement, the parameters' gradients exactly
    the full path's; an input block that requires a gradient is refused, not given none.
    ``input_gradient=True``: the adjoint runs even for an input that needs no gradient."""
    rng = np.random.default_rng(5)
    x = DistributedTensor("x", (2, 3, 7, 6), Partition((1, 1, 2, 2)))
    layer = Convolution(x, 2, Kernel(3, padding=1))
    w, b = rng.standard_normal(layer.weights.global_shape), rng.standard_normal(layer.bias.global_shape)
    blocks = x.scatter(rng.standard_normal(x.global_shape))
    found = []
    for declared, wanted in ((None, True), (False, False), (True, False)):
        module = LayerModule(layer, weights=w, bias=b, input_gradient=declared)
        adjoints = []
        run = module.windows.run
        module.windows.run = lambda tensors, *, adjoint=False, run=run, adjoints=adjoints: (
            adjoints.append(adjoint) or run(tensors, adjoint=adjoint)
        )
        given = {k: torch.from_numpy(v).requires_grad_(wanted) for k, v in blocks.items()}
        (sum((v * v).sum() for v in module(given).values())).backward()
        found.append(([p.grad for p in module.parameters()], adjoints.count(True)))
    assert [count for _, count in found] == [1, 0, 1]
    assert all(torch.equal(a, b) for grads, _ in found[1:] for a, b in zip(found[0][0], grads))
    module = LayerModule(layer, weights=w, bias=b, input_gradient=False)
    needing = {k: torch.from_numpy(v).requires_grad_() for k, v in blocks.items()}
    with pytest.raises(LayerError, match="input_gradient=False"):
        module(needing)
    with torch.no_grad():  # nothing recorded: nothing to refuse
        module(needing)
    with pytest.raises(LayerError, match="True, False or None"):
        LayerModule(layer, weights=w, bias=b, input_gradient=0)


def test_an_input_passed_through_and_changed_in_place_before_the_backward_is_refused():
    """An affine layer's windows are its input blocks themselves (an identity moves nothing):
    changed in place between forward and backward, the backward raises instead of giving the
    gradient of other values."""
    x = DistributedTensor("x", (3, 4), Partition((1, 2)))
    module = LayerModule(Affine(x, 2, workers=Partition((1, 2))), weights=np.ones((2, 4)))
    given = {k: torch.from_numpy(v).requires_grad_() for k, v in x.scatter(np.ones((3, 4))).items()}
    leaves = {k: v * 1 for k, v in given.items()}
    out = module(leaves)
    next(iter(leaves.values())).mul_(2)
    with pytest.raises(StateError, match="changed in place"):
        sum(v.sum() for v in out.values()).backward()


def test_a_backward_under_create_graph_gives_the_gradients_and_refuses_a_second_differentiation():
    """The module's node is differentiable once: under ``create_graph=True`` (gradients on in
    the backward) it gives the same gradients as a plain backward, and differentiating them
    again raises (``once_differentiable``'s error), as a plain backward skips that wrapper."""
    rng, x, layer, w, b = _convolution_case("feature-2x2", 3)
    module = LayerModule(layer, weights=w, bias=b)
    data = x.scatter(rng.standard_normal(x.global_shape))
    names = sorted(data)
    grads = []
    for create_graph in (False, True):
        inputs = [torch.from_numpy(data[k]).requires_grad_() for k in names]
        out = module(dict(zip(names, inputs)))
        loss = sum((y * y).sum() for y in out.values())
        grads.append(torch.autograd.grad(loss, inputs, create_graph=create_graph))
    assert all(torch.equal(g, h) for g, h in zip(*grads))
    assert all(g.requires_grad for g in grads[1])
    with pytest.raises(RuntimeError, match="differentiate twice"):
        sum(g.sum() for g in grads[1]).backward()
