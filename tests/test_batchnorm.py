"""Distributed batch normalization: its trees proven exactly (the statistics' all-reduce, the
parameters' broadcast, the all-reduce of the copies' gradients equal to M M*), and the layer
equal to torch's BatchNorm{1,2,3}d on one process over many partitions (uneven and empty
shares, 1-4 workers per dimension): forward, input and parameter gradients, running
statistics, train and eval, through the numpy interpreter and as a torch module. A control: the
statistics of each block alone (the channel groups not reduced) are caught."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import verify
from linop import DistributedTensor, Identity, Partition
from linop.layers import BatchNorm, LayerError
from linop.layers.base import share_slices
from linop.layers.batchnorm import GATHER_LIMIT, statistics_path

torch = pytest.importorskip("torch", reason="torch is not installed (the torch extra)")
from linop.frameworks.torch_norm import BatchNormModule  # noqa: E402

TORCH_NORMS = {
    1: torch.nn.BatchNorm1d,
    2: torch.nn.BatchNorm1d,
    3: torch.nn.BatchNorm1d,
    4: torch.nn.BatchNorm2d,
}
TORCH_NORMS[5] = torch.nn.BatchNorm3d

CASES = {
    # name: (global shape, partition, sizes or None)
    "1d-features-only": ((4, 3), (2, 1), None),
    "1d-batch-channels": ((5, 4, 7), (2, 2, 3), None),
    "2d-uneven-empty": ((5, 4, 6, 3), (2, 3, 2, 1), ((4, 1), (2, 0, 2), (3, 3), (3,))),
    "2d-channels-4": ((3, 5, 4, 4), (1, 4, 1, 2), ((3,), (2, 1, 0, 2), (4,), (1, 3))),
    "2d-batch-4-empty": ((3, 2, 3, 5), (4, 1, 1, 1), ((1, 0, 2, 0), (2,), (3,), (5,))),
    "3d-spatial": ((2, 3, 4, 3, 5), (1, 1, 2, 1, 3), None),
    "3d-everything": ((3, 2, 3, 4, 2), (2, 2, 1, 2, 2), ((2, 1), (1, 1), (3,), (3, 1), (1, 1))),
}


def _tensor(name):
    shape, grid, sizes = CASES[name]
    return DistributedTensor("x", shape, Partition(grid), sizes=sizes or ())


def _torch_twin(x, w, b, **options):
    norm = TORCH_NORMS[x.ndim](x.global_shape[1], dtype=torch.float64, **options)
    if norm.affine:
        with torch.no_grad():
            norm.weight.copy_(torch.from_numpy(w))
            norm.bias.copy_(torch.from_numpy(b))
    return norm


def _torch_step(norm, data, dy):
    """torch's y, dx, dw, db for one call."""
    image = torch.from_numpy(data).requires_grad_()
    for p in norm.parameters():
        p.grad = None
    y = norm(image)
    y.backward(torch.from_numpy(dy))
    grads = (None, None) if not norm.affine else (norm.weight.grad.numpy(), norm.bias.grad.numpy())
    return y.detach().numpy(), image.grad.numpy(), *grads


def _close(a, b, what, tol=1e-10):
    assert np.allclose(a, b, rtol=tol, atol=tol), f"{what}: max difference {np.max(np.abs(a - b))}"


# -- the trees, proven exactly -------------------------------------------------------------------
@pytest.mark.parametrize("name", ["2d-uneven-empty", "3d-everything", "1d-features-only"])
def test_the_reductions_and_broadcasts_are_exact_and_the_all_reduce_is_m_m_star(name):
    layer = BatchNorm(_tensor(name))
    for op in (
        layer.statistics_reduction,
        layer.totals_reduction,
        layer.moments_reduction,
        layer.gradient_reduction,
        layer.parameter_movement,
    ):
        assert verify.exact_adjoint(op), (op, verify.exact_adjoint(op))
    movement = layer.parameter_movement
    # the all-reduce over a channel group is M M*: the copies' gradients summed onto the owner
    # (the parameters' gradient) and broadcast back
    assert verify.equal(layer.gradient_reduction, movement @ movement.H)
    assert layer.parameter_gradient_reduction == movement.H
    # each owner's copy after the all-reduce is its block of M* (what the module reads)
    state = layer.copies.space.random(3, np.int64)
    reduced, summed = layer.gradient_reduction(state), movement.H(state)
    for block in layer.parameters.space.names:
        assert np.array_equal(reduced[layer.owner_copy(block)], summed[block])


@pytest.mark.parametrize("path", ["gather", "two_pass"])
@pytest.mark.parametrize("name", ["2d-uneven-empty", "3d-everything", "2d-channels-4"])
def test_the_moments_all_reduce_of_the_owners_rows_is_the_parameters_broadcast(name, path):
    """The training forward's (first) all-reduce moves θ too: the owners write it into the
    moments blocks' last rows (gather path) or the totals blocks' rows 1-2 (two-pass path),
    zeros elsewhere, and those rows after the all-reduce are M θ. Checked on every basis vector
    of the parameters in integers: the two linear maps' matrices are equal, exactly."""
    layer = BatchNorm(_tensor(name), statistics=path)
    zeros = {b.name: np.zeros(b.shape, dtype=np.int64) for b in layer.x.blocks}
    gather = path == "gather"
    rows = 2 * layer.group_size if gather else 1
    local, reduction, named = (
        (layer.local_moments, layer.moments_reduction, layer.moments_name)
        if gather
        else (layer.local_totals, layer.totals_reduction, layer.totals_name)
    )
    names = layer.parameters.space.names
    for block in names:
        shape = layer.parameters.space[block].shape
        for entry in np.ndindex(*shape):
            theta = {n: np.zeros(layer.parameters.space[n].shape, dtype=np.int64) for n in names}
            theta[block][entry] = 1
            reduced = reduction(local(zeros, theta))
            moved = layer.parameter_movement(theta)
            for x_block in layer.x.blocks:
                got = reduced[named(x_block.name)]
                assert got.dtype == np.int64
                assert np.array_equal(got[rows:], moved[layer.copy_name(x_block.name)])
                assert not got[:rows].any()


def test_the_statistics_are_reduced_over_exactly_the_workers_of_a_channel():
    x = _tensor("3d-everything")
    layer = BatchNorm(x)
    for reduction in (layer.statistics_reduction, layer.totals_reduction, layer.moments_reduction):
        groups = {tuple(sorted(g)) for g in reduction.groups}
        by_channel = {
            tuple(sorted(j for j in x.partition.indices() if j[1] == c)) for c in range(x.partition.shape[1])
        }
        assert groups == by_channel


# -- equal to torch on one process, through the numpy interpreter ---------------------------------
@pytest.mark.parametrize("path", ["gather", "two_pass"])
@pytest.mark.parametrize("name", list(CASES))
def test_numpy_description_equals_torch_batchnorm_train_then_eval(name, path):
    rng = np.random.default_rng(7)
    x = _tensor(name)
    layer = BatchNorm(x, momentum=0.3, statistics=path)
    assert layer.statistics_path == path
    c = x.global_shape[1]
    w, b = rng.standard_normal(c), rng.standard_normal(c)
    norm = _torch_twin(x, w, b, momentum=0.3)
    theta = layer.scatter_parameters(w, b)
    running = (np.zeros(c), np.ones(c))
    for step in range(2):
        data = rng.standard_normal(x.global_shape) * 3 + 2
        dy = rng.standard_normal(x.global_shape)
        y, saved, running = layer.forward(x.scatter(data), theta, running=running)
        dx, dtheta = layer.backward(layer.y.scatter(dy), saved)
        ty, tdx, tdw, tdb = _torch_step(norm, data, dy)
        _close(layer.y.gather(y), ty, f"step {step} y")
        _close(x.gather(dx), tdx, f"step {step} dx")
        dw, db = layer.gather_parameters(dtheta)
        _close(dw, tdw, f"step {step} dw")
        _close(db, tdb, f"step {step} db")
        _close(running[0], norm.running_mean.numpy(), "running mean")
        _close(running[1], norm.running_var.numpy(), "running var")
    norm.eval()
    data, dy = rng.standard_normal(x.global_shape), rng.standard_normal(x.global_shape)
    y, saved, _ = layer.forward(x.scatter(data), theta, training=False, running=running)
    dx, dtheta = layer.backward(layer.y.scatter(dy), saved, training=False)
    ty, tdx, tdw, tdb = _torch_step(norm, data, dy)
    _close(layer.y.gather(y), ty, "eval y")
    _close(x.gather(dx), tdx, "eval dx")
    dw, db = layer.gather_parameters(dtheta)
    _close(dw, tdw, "eval dw")
    _close(db, tdb, "eval db")


@pytest.mark.parametrize("path", ["gather", "two_pass"])
@pytest.mark.parametrize(
    "options",
    [{"affine": False}, {"track_running_stats": False}, {"momentum": None}],
    ids=["no-affine", "untracked", "cumulative"],
)
def test_numpy_description_options_equal_torch(options, path):
    rng = np.random.default_rng(8)
    x = _tensor("2d-uneven-empty")
    layer = BatchNorm(x, statistics=path, **options)
    c = x.global_shape[1]
    w, b = rng.standard_normal(c), rng.standard_normal(c)
    norm = _torch_twin(x, w, b, **options)
    theta = layer.scatter_parameters(w, b)
    running = (np.zeros(c), np.ones(c)) if layer.track_running_stats else None
    for step in range(3):
        if step == 2:
            norm.eval()
        training = step < 2
        data, dy = rng.standard_normal(x.global_shape), rng.standard_normal(x.global_shape)
        y, saved, running = layer.forward(
            x.scatter(data), theta, training=training, running=running, batches=step + 1
        )
        dx, dtheta = layer.backward(layer.y.scatter(dy), saved, training=training)
        ty, tdx, tdw, tdb = _torch_step(norm, data, dy)
        _close(layer.y.gather(y), ty, f"step {step} y")
        _close(x.gather(dx), tdx, f"step {step} dx")
        if layer.affine:
            dw, db = layer.gather_parameters(dtheta)
            _close(dw, tdw, "dw")
            _close(db, tdb, "db")
        else:
            assert dtheta == {}
        if running is not None:
            _close(running[0], norm.running_mean.numpy(), "running mean")
            _close(running[1], norm.running_var.numpy(), "running var")


class _LocalStatistics(BatchNorm):
    """A deliberately wrong layer: each block's statistics from its own entries (the channel
    groups not reduced, the count still global)."""

    @property
    def moments_reduction(self):
        return Identity(self.moments.space)

    @property
    def totals_reduction(self):
        return Identity(self.totals.space)

    @property
    def statistics_reduction(self):
        return Identity(self.sums.space)

    @property
    def gradient_reduction(self):
        return Identity(self.copies.space)


@pytest.mark.parametrize("path", ["gather", "two_pass"])
@pytest.mark.parametrize(
    ("name", "caught"), [("2d-uneven-empty", True), ("1d-batch-channels", True), ("channels-only", False)]
)
def test_a_layer_that_reduces_over_the_local_block_only_is_caught(name, caught, path):
    """The comparison with torch fails for the wrong layer wherever a channel's entries are
    cut (and passes where each channel lives on one worker: the control has no blind spot
    that the real cases share), on both statistics paths."""
    rng = np.random.default_rng(9)
    x = DistributedTensor("x", (3, 4, 5), Partition((1, 2, 1))) if name == "channels-only" else _tensor(name)
    c = x.global_shape[1]
    w, b = rng.standard_normal(c), rng.standard_normal(c)
    data, dy = rng.standard_normal(x.global_shape), rng.standard_normal(x.global_shape)
    ty, tdx, _, _ = _torch_step(_torch_twin(x, w, b), data, dy)
    wrong = _LocalStatistics(x, statistics=path)
    y, saved, _ = wrong.forward(
        x.scatter(data), wrong.scatter_parameters(w, b), running=(np.zeros(c), np.ones(c))
    )
    dx, _ = wrong.backward(wrong.y.scatter(dy), saved)
    same = np.allclose(wrong.y.gather(y), ty, atol=1e-10) and np.allclose(x.gather(dx), tdx, atol=1e-10)
    assert same is not caught


def test_batchnorm_arguments_are_checked():
    x = DistributedTensor("x", (1, 2), Partition((1, 1)))
    with pytest.raises(LayerError, match="more than 1 value per channel"):
        BatchNorm(x).forward(x.scatter(np.ones((1, 2))), running=(np.zeros(2), np.ones(2)))
    with pytest.raises(LayerError, match="eps"):
        BatchNorm(x, eps=0)
    with pytest.raises(LayerError, match="momentum"):
        BatchNorm(x, momentum=2)
    with pytest.raises(LayerError, match="other than x's"):
        BatchNorm(x, name="x")
    with pytest.raises(LayerError, match="batch, channel"):
        BatchNorm(DistributedTensor("x", (4,), Partition((1,))))
    with pytest.raises(LayerError, match="affine=False"):
        _ = BatchNorm(x, affine=False).parameter_movement
    with pytest.raises(LayerError, match="needs running"):
        BatchNorm(DistributedTensor("x", (2, 2), Partition((1, 1)))).forward(
            {"x[0,0]": np.ones((2, 2))}, training=False
        )
    with pytest.raises(LayerError, match="BatchNorm layer"):
        BatchNormModule(object())


# -- the statistics path: the rule, the override, and a layer whose size does not grow with P ------
def test_the_rule_picks_the_gather_path_for_small_groups_and_two_passes_beyond():
    """|G| up to GATHER_LIMIT (16): one all-reduce of the moments; beyond, two of O(c); the
    keyword overrides the rule either way, and the module runs the chosen path's trees only."""
    assert GATHER_LIMIT == 16
    cases = {(1, 2, 4, 4): "gather", (2, 1, 2, 4): "gather", (1, 1, 3, 6): "two_pass", (17, 1): "two_pass"}
    for grid, path in cases.items():
        shape = (17, 2, 6, 6)[: len(grid)] if len(grid) == 4 else (17, 2)
        layer = BatchNorm(DistributedTensor("x", shape, Partition(grid)))
        assert layer.statistics_path == path == statistics_path(layer.group_size), grid
        assert [op for op in layer.statistics_trees] == (
            [layer.moments_reduction]
            if path == "gather"
            else [layer.totals_reduction, layer.statistics_reduction]
        )
    x = DistributedTensor("x", (17, 2), Partition((17, 1)))
    assert BatchNorm(x, statistics="gather").statistics_path == "gather"
    small = BatchNorm(_tensor("3d-everything"), statistics="two_pass")
    assert small.statistics_path == "two_pass"
    module = BatchNormModule(small)
    assert module.statistics_trees == (small.totals_reduction, small.statistics_reduction)
    assert "moments" not in small.__dict__  # the gather path's blocks never built


@pytest.mark.parametrize("wrong", ["Gather", "two-pass", "", 2, True])
def test_a_statistics_path_other_than_the_two_is_a_layer_error(wrong):
    with pytest.raises(LayerError, match=r"statistics must be None, 'gather' or 'two_pass', not"):
        BatchNorm(_tensor("1d-features-only"), statistics=wrong)


def test_a_layer_of_a_million_workers_builds_no_table_over_them():
    """x on 1024 x 1024 spatial workers (|G| = 2^20): the layer takes the two-pass path, and
    building it and looking up one block's names, slot and copy work out that block alone: no
    list of x's blocks, no table over the workers (before, the slots' dict and the names'
    table held every one of the P blocks)."""
    x = DistributedTensor("x", (2, 3, 2048, 2048), Partition((1, 1, 1024, 1024)))
    layer = BatchNorm(x)
    assert layer.group_size == 2**20 and layer.statistics_path == "two_pass"
    last = x.block_name((0, 0, 1023, 1023))
    assert layer.slot(layer.index(last)) == 2**20 - 1
    assert layer.copy_name(last) == "y_theta_copy[0,0,1023,1023]"
    assert layer.totals_name(last) == "y_totals[0,0,1023,1023]"
    assert layer.sums_name(layer.y.block_name((0, 0, 5, 7))) == "y_sums[0,0,5,7]"
    assert layer.totals.block((0, 0, 1023, 1023)).shape == (3, 3)
    assert len(layer.__dict__["_names_table"]) == 4  # two blocks, each by x's and y's name
    assert "blocks" not in x.__dict__ and "slot_counts" not in layer.__dict__
    for wrong in ("x[0,0,1024,0]", "x[0,0,1,1,0]", "x[0,0,01,1]", "x[0,0,-1,1]", "z[0,0,0,0]", "x[0, 0,0,0]"):
        with pytest.raises(LayerError, match="is not a block of"):
            layer.index(wrong)


@pytest.mark.parametrize("name", ["2d-uneven-empty", "3d-everything", "1d-features-only"])
def test_slots_and_their_counts_in_closed_form_are_the_blocks(name):
    """Each block's slot is its C-order position along the axes other than the channel's, and
    the slots' counts are its entries per channel (empty shares included)."""
    x = _tensor(name)
    layer = BatchNorm(x)
    others = tuple(n for a, n in enumerate(x.partition.shape) if a != 1)
    counts = [0] * layer.group_size
    for j in x.partition.indices():
        slot = int(np.ravel_multi_index(tuple(k for a, k in enumerate(j) if a != 1), others))
        assert layer.slot(j) == slot
        block = x.block(j).shape
        counts[slot] = math.prod(block) // block[1] if block[1] else counts[slot]
    assert layer.slot_counts == tuple(counts)


def _module_step(module, norm, rng, step, shift=0.0):
    """Step ``step`` of a module test (from step 2 on, both in evaluation): one call of the
    module on random data (mean ``shift``) and its backward, gradients cleared first, against
    torch's layer ``norm`` on the whole field: y and dx compared; torch's (dw, db) returned."""
    layer = module.layer
    x = layer.x
    if step == 2:
        module.eval()
        norm.eval()
    data, dy = rng.standard_normal(x.global_shape) + shift, rng.standard_normal(x.global_shape)
    module.zero_grad()
    inputs = {k: torch.from_numpy(v).requires_grad_() for k, v in x.scatter(data).items()}
    out = module(inputs)
    dys = layer.y.scatter(dy)
    sum((out[k] * torch.from_numpy(dys[k])).sum() for k in out).backward()
    ty, tdx, tdw, tdb = _torch_step(norm, data, dy)
    _close(layer.y.gather({k: v.detach().numpy() for k, v in out.items()}), ty, f"step {step} y")
    _close(x.gather({k: v.grad.numpy() for k, v in inputs.items()}), tdx, f"step {step} dx")
    return tdw, tdb


# -- the torch module on one process ------------------------------------------------------------------
@pytest.mark.parametrize("path", ["gather", "two_pass"])
@pytest.mark.parametrize(
    "name", ["1d-batch-channels", "2d-uneven-empty", "2d-channels-4", "2d-batch-4-empty", "3d-everything"]
)
def test_module_equals_torch_batchnorm_in_train_and_eval(name, path):
    rng = np.random.default_rng(10)
    x = _tensor(name)
    c = x.global_shape[1]
    w, b = rng.standard_normal(c), rng.standard_normal(c)
    layer = BatchNorm(x, statistics=path)
    module = BatchNormModule(layer, weight=w, bias=b)
    norm = _torch_twin(x, w, b)
    for step in range(3):
        tdw, tdb = _module_step(module, norm, rng, step, shift=step)
        dw, db = layer.gather_parameters({k: p.grad.numpy() for k, p in module.parameter_state().items()})
        _close(dw, tdw, f"step {step} dw")
        _close(db, tdb, f"step {step} db")
        _close(module.running_mean.numpy(), norm.running_mean.numpy(), "running mean")
        _close(module.running_var.numpy(), norm.running_var.numpy(), "running var")
        assert int(module.num_batches_tracked) == int(norm.num_batches_tracked)
    assert module._anchor.requires_grad and module._anchor.grad is None  # it only ties the graph


@pytest.mark.parametrize("path", ["gather", "two_pass"])
def test_module_in_float32_within_torch_tolerances(path):
    rng = np.random.default_rng(11)
    x = _tensor("2d-uneven-empty")
    layer = BatchNorm(x, statistics=path)
    module = BatchNormModule(layer, dtype=torch.float32)
    norm = torch.nn.BatchNorm2d(4)
    data = rng.standard_normal(x.global_shape).astype(np.float32)
    inputs = {k: torch.from_numpy(v).requires_grad_() for k, v in x.scatter(data).items()}
    out = module(inputs)
    sum((v * v).sum() for v in out.values()).backward()
    image = torch.from_numpy(data).requires_grad_()
    expected = norm(image)
    (expected * expected).sum().backward()
    got = layer.y.gather({k: v.detach().numpy() for k, v in out.items()})
    torch.testing.assert_close(torch.from_numpy(got), expected.detach())
    grad = x.gather({k: v.grad.numpy() for k, v in inputs.items()})
    torch.testing.assert_close(torch.from_numpy(grad), image.grad, atol=1e-4, rtol=1e-4)
    assert out[next(iter(out))].dtype == torch.float32
    running = np.concatenate([module.running_mean.numpy(), module.running_var.numpy()])
    expected_running = np.concatenate([norm.running_mean.numpy(), norm.running_var.numpy()])
    torch.testing.assert_close(torch.from_numpy(running), torch.from_numpy(expected_running))


@pytest.mark.parametrize("path", ["gather", "two_pass"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_statistics_of_data_far_from_zero_keep_the_two_pass_accuracy(dtype, path):
    """Data of mean 1e5 (float64; 100 in float32) and unit spread: the moments combined across
    the workers (gather path), or the squares centred on the global mean (two-pass path), give
    torch's output to 1e-10 (float64; torch's tolerances in float32). A control: the one-pass
    formula E[x^2] - mu^2 in the same dtype is off by far more (catastrophic cancellation), so
    the data does test the combine."""
    rng = np.random.default_rng(17)
    offset = 1e5 if dtype == np.float64 else 100.0
    x = _tensor("2d-uneven-empty")
    layer = BatchNorm(x, statistics=path)
    data = (rng.standard_normal(x.global_shape) + offset).astype(dtype)
    module = BatchNormModule(layer, dtype=torch.float32 if dtype == np.float32 else torch.float64)
    out = module({k: torch.from_numpy(v) for k, v in x.scatter(data).items()})
    got = layer.y.gather({k: v.detach().numpy() for k, v in out.items()})
    expected = torch.nn.BatchNorm2d(4, dtype=torch.from_numpy(data).dtype)(torch.from_numpy(data))
    if dtype == np.float64:
        _close(got, expected.detach().numpy(), "y")
    else:
        torch.testing.assert_close(torch.from_numpy(got), expected.detach())
    axes = (0, 2, 3)
    naive = (data * data).mean(axis=axes) - data.mean(axis=axes) ** 2  # in the data's dtype
    true = data.astype(np.float64).var(axis=axes)
    for library in (np.asarray, torch.from_numpy):  # the numpy interpreter's and the module's moments
        state = {k: library(v) for k, v in x.scatter(data).items()}
        statistics, _ = layer.statistics(state, lambda op, blocks: op(dict(blocks)))
        ours = np.zeros(4)
        for block, (_, variance) in statistics.items():
            ours[share_slices(layer.channel_sizes)[layer.channel(block)]] = np.asarray(variance)
        ours_error, naive_error = np.max(np.abs(ours - true)), np.max(np.abs(naive - true))
        assert ours_error < (1e-10 if dtype == np.float64 else 1e-3), library
        assert naive_error > 100 * ours_error, library


@pytest.mark.parametrize(("name", "path"), [("2d-uneven-empty", "gather"), ("3d-everything", "two_pass")])
def test_module_with_replicated_parameters_equals_torch_and_keeps_copies_equal(name, path):
    """replicate=True: every copy holds (w; b) of its channels and gets the whole gradient (the
    sum over its channel group), in training and evaluation; the copies, updated alike by SGD,
    stay equal to torch's parameters."""
    rng = np.random.default_rng(19)
    x = _tensor(name)
    c = x.global_shape[1]
    w, b = rng.standard_normal(c), rng.standard_normal(c)
    layer = BatchNorm(x, statistics=path)
    module = BatchNormModule(layer, weight=w, bias=b, replicate=True)
    assert set(module.parameter_names) == set(layer.copies.space.names)
    norm = _torch_twin(x, w, b)
    ours = torch.optim.SGD(module.parameters(), lr=0.1)
    theirs = torch.optim.SGD(norm.parameters(), lr=0.1)
    for step in range(3):
        tdw, tdb = _module_step(module, norm, rng, step, shift=step)
        grads = {k: p.grad.numpy() for k, p in module.parameter_state().items()}
        expected = layer.parameter_movement(layer.scatter_parameters(tdw, tdb))
        for k, g in grads.items():
            _close(g, expected[k], f"step {step} gradient of copy {k}")
        ours.step()
        theirs.step()
        values = {k: p.detach().numpy() for k, p in module.parameter_state().items()}
        moved = layer.parameter_movement(
            layer.scatter_parameters(norm.weight.detach().numpy(), norm.bias.detach().numpy())
        )
        for k, v in values.items():
            _close(v, moved[k], f"step {step} copy {k}")
        dw, db = layer.gather_parameters(module.owned_state(values))
        _close(dw, norm.weight.detach().numpy(), "w")
        _close(db, norm.bias.detach().numpy(), "b")
        _close(module.running_var.numpy(), norm.running_var.numpy(), "running var")


# -- the training Jacobian as a tree -------------------------------------------------------------------
@pytest.mark.parametrize("name", ["2d-uneven-empty", "1d-batch-channels"])
def test_the_jacobian_tree_is_torchs_derivative_and_its_adjoint_the_backward(name):
    """J (local kernels around the all-reduce) applied to a tangent is torch's forward-mode
    derivative of BatchNorm, its adjoint (derived by rules) torch's input gradient; the dot test
    checks the kernels' adjoints, and J is symmetric (BatchNorm's Jacobian is, per channel)."""
    rng = np.random.default_rng(12)
    x = _tensor(name)
    c = x.global_shape[1]
    w, b = rng.standard_normal(c), rng.standard_normal(c)
    layer = BatchNorm(x)
    data, tangent, dy = (rng.standard_normal(x.global_shape) for _ in range(3))
    _, saved, _ = layer.forward(x.scatter(data), layer.scatter_parameters(w, b))
    jacobian = layer.jacobian(saved)
    assert verify.adjoint_test(jacobian)
    norm = _torch_twin(x, w, b)

    def f(t):
        return norm(t)

    _, jvp = torch.autograd.functional.jvp(f, torch.from_numpy(data), torch.from_numpy(tangent))
    _close(layer.y.gather(jacobian(x.scatter(tangent))), jvp.numpy(), "J t")
    _, tdx, _, _ = _torch_step(_torch_twin(x, w, b), data, dy)
    _close(x.gather(jacobian.H(layer.y.scatter(dy))), tdx, "J* dy")
    matrix = jacobian.to_sparse().toarray()
    _close(matrix, matrix.T, "J = J^T")
    with pytest.raises(LayerError, match=r"saved forward of block 'x\[0,0,0"):
        layer.jacobian({})(x.scatter(tangent))


@pytest.mark.parametrize("path", ["gather", "two_pass"])
@pytest.mark.parametrize(
    "options",
    [{"affine": False}, {"track_running_stats": False}, {"momentum": None}],
    ids=["no-affine", "untracked", "cumulative"],
)
def test_module_options_equal_torch(options, path):
    rng = np.random.default_rng(13)
    x = _tensor("3d-everything")
    c = x.global_shape[1]
    w, b = rng.standard_normal(c), rng.standard_normal(c)
    layer = BatchNorm(x, statistics=path, **options)
    module = BatchNormModule(layer, **({} if not layer.affine else {"weight": w, "bias": b}))
    norm = _torch_twin(x, w, b, **options)
    for step in range(3):
        tdw, tdb = _module_step(module, norm, rng, step)
        if layer.affine:
            dw, db = layer.gather_parameters({k: p.grad.numpy() for k, p in module.parameter_state().items()})
            _close(dw, tdw, "dw")
            _close(db, tdb, "db")
            module.zero_grad()
        else:
            assert not list(module.parameters())
        if layer.track_running_stats:
            _close(module.running_var.numpy(), norm.running_var.numpy(), "running var")
        else:
            assert module.running_mean is None and norm.running_mean is None


def test_module_blocks_of_a_wrong_name_or_shape_are_state_errors():
    from linop import StateError

    x = _tensor("1d-batch-channels")
    module = BatchNormModule(BatchNorm(x))
    good = {b.name: torch.zeros(b.shape, dtype=torch.float64) for b in x.blocks}
    with pytest.raises(StateError, match="takes blocks"):
        module({})
    with pytest.raises(StateError, match="takes blocks"):
        module(list(good.values()))
    with pytest.raises(StateError, match="takes blocks"):
        module(dict(good, extra=torch.zeros(1)))
    renamed = dict(good)
    renamed["other"] = renamed.pop(x.blocks[0].name)
    with pytest.raises(StateError, match="takes blocks"):
        module(renamed)
    name = x.blocks[0].name
    with pytest.raises(StateError, match=rf"block '{name[:1]}\[0,0,0\]' has shape \(1, 1, 1\)"):
        module(dict(good, **{name: torch.zeros(1, 1, 1, dtype=torch.float64)}))


# -- random partitions ---------------------------------------------------------------------------------
def _shares(total, parts, cuts):
    """``total`` split over ``parts`` workers at the sorted cut points (empty shares allowed)."""
    points = sorted(c % (total + 1) for c in cuts[: parts - 1])
    bounds = [0, *points, total]
    return tuple(bounds[k + 1] - bounds[k] for k in range(parts))


@st.composite
def _layouts(draw):
    dims = draw(st.integers(0, 3))
    shape = (
        draw(st.integers(1, 4)),
        draw(st.integers(1, 4)),
        *(draw(st.integers(1, 5)) for _ in range(dims)),
    )
    if math.prod(shape[:1] + shape[2:]) < 2:
        shape = (shape[0] + 1, *shape[1:])
    grid = [draw(st.integers(1, 4)) for _ in shape]
    for d in reversed(range(len(grid))):  # at most 16 workers: small and fast
        if math.prod(grid) > 16:
            grid[d] = 1
    sizes = tuple(
        _shares(n, p, draw(st.lists(st.integers(0, 9), min_size=3, max_size=3))) for n, p in zip(shape, grid)
    )
    return DistributedTensor("x", shape, Partition(tuple(grid)), sizes=sizes)


@settings(max_examples=12, deadline=None)
@given(_layouts(), st.integers(0, 2**16))
def test_random_partitions_equal_torch_batchnorm(x, seed):
    """Any shape (1-3 feature dimensions or none), 1-4 workers per dimension, shares cut at
    random (empty ones included), either statistics path (by the seed's parity): a training
    step and an evaluation step equal torch's."""
    rng = np.random.default_rng(seed)
    c = x.global_shape[1]
    w, b = rng.standard_normal(c), rng.standard_normal(c)
    layer = BatchNorm(x, statistics=("gather", "two_pass")[seed % 2])
    norm = TORCH_NORMS[x.ndim](c, dtype=torch.float64)
    with torch.no_grad():
        norm.weight.copy_(torch.from_numpy(w))
        norm.bias.copy_(torch.from_numpy(b))
    running = (np.zeros(c), np.ones(c))
    for training in (True, False):
        norm.train(training)
        data, dy = rng.standard_normal(x.global_shape), rng.standard_normal(x.global_shape)
        y, saved, running = layer.forward(
            x.scatter(data), layer.scatter_parameters(w, b), training=training, running=running
        )
        dx, dtheta = layer.backward(layer.y.scatter(dy), saved, training=training)
        ty, tdx, tdw, tdb = _torch_step(norm, data, dy)
        _close(layer.y.gather(y), ty, "y")
        _close(x.gather(dx), tdx, "dx")
        dw, db = layer.gather_parameters(dtheta)
        _close(dw, tdw, "dw")
        _close(db, tdb, "db")
