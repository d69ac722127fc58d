"""The torch modules Interpolate / Upsample, MaxPool and Repartition in one process (the numpy
interpreter over every partition) equal torch's own layers on the whole tensor, forward and
input gradient: float64 to 1e-10, float32 to torch's tolerances, over uneven shares, 1-4 workers
per dimension and workers without output; and the launch of their torch.distributed checks
(``tests/torchdist/resample_checks.py``, 2 processes)."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import verify
from linop import DistributedTensor, Partition, StateError
from linop.errors import DtypeError, LinopError
from linop.layers import LayerError

torch = pytest.importorskip("torch", reason="torch is not installed (the torch extra)")
from linop.frameworks.torch_pooling import MaxPool  # noqa: E402
from linop.frameworks.torch_repartition import Repartition  # noqa: E402
from linop.frameworks.torch_resample import Interpolate, Upsample  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
F64 = dict(rtol=0, atol=1e-10)


def tensor(shape, grid, sizes=None, name="x"):
    if sizes is None:
        return DistributedTensor(name, shape, Partition(grid))
    return DistributedTensor(name, shape, Partition(grid), sizes=sizes)


def distributed_run(module, x, y, data, dy, dtype=torch.float64):
    """The module on x's blocks of ``data``, then backward with ``dy``: (y, dx) gathered."""
    blocks = {k: torch.from_numpy(v).to(dtype).requires_grad_() for k, v in x.scatter(data).items()}
    out = module(blocks)
    cotangent = y.scatter(dy)
    loss = sum((out[k] * torch.from_numpy(cotangent[k]).to(dtype)).sum() for k in out)
    loss.backward()
    gathered = y.gather({k: v.detach().numpy() for k, v in out.items()})
    return gathered, x.gather({k: v.grad.numpy() for k, v in blocks.items()})


def torch_run(layer, data, dy, dtype=torch.float64):
    t = torch.from_numpy(data).to(dtype).requires_grad_()
    out = layer(t)
    out.backward(torch.from_numpy(dy).to(dtype))
    return out.detach().numpy(), t.grad.numpy()


# -- Interpolate / Upsample -------------------------------------------------------------------
INTERPOLATIONS = {
    "1d-nearest-x2-4-workers-empty": (
        ((1, 2, 9), (1, 1, 4), ((1,), (2,), (4, 0, 2, 3))),
        dict(scale_factor=2),
    ),
    "1d-linear-to-20-corners": (((2, 1, 7), (1, 1, 3)), dict(size=20, mode="linear", align_corners=True)),
    "1d-linear-down-x0.5": (((1, 3, 12), (1, 3, 4)), dict(scale_factor=0.5, mode="linear")),
    "2d-bilinear-x2-3x2": (((2, 2, 7, 6), (1, 2, 3, 2)), dict(scale_factor=2, mode="bilinear")),
    "2d-bilinear-uneven-corners": (
        ((1, 2, 5, 6), (1, 1, 2, 3), ((1,), (2,), (4, 1), (1, 3, 2))),
        dict(size=(9, 4), mode="bilinear", align_corners=True),
    ),
    "2d-nearest-1.5x0.5": (((1, 2, 6, 8), (1, 1, 4, 2)), dict(scale_factor=(1.5, 0.5))),
    "2d-nearest-exact-recomputed": (
        ((1, 1, 5, 7), (1, 1, 2, 2)),
        dict(scale_factor=1.7, mode="nearest-exact", recompute_scale_factor=True),
    ),
    "2d-batch-channel-partitioned": (
        ((3, 3, 5, 4), (2, 2, 1, 2), ((2, 1), (0, 3), (5,), (3, 1))),
        dict(scale_factor=2, mode="bilinear", align_corners=True),
    ),
    "3d-trilinear-x2": (((1, 2, 4, 5, 3), (1, 1, 2, 2, 1)), dict(scale_factor=2, mode="trilinear")),
    "3d-nearest-size": (((1, 1, 4, 5, 3), (1, 1, 2, 1, 2)), dict(size=(7, 3, 5))),
}


@pytest.mark.parametrize("name", list(INTERPOLATIONS))
def test_interpolate_module_equals_torch_interpolate(name):
    (shape, grid, *sizes), kwargs = INTERPOLATIONS[name]
    x = tensor(shape, grid, *sizes)
    module = Interpolate(x, **kwargs)
    rng = np.random.default_rng(3)
    data, dy = rng.standard_normal(shape), rng.standard_normal(module.y.global_shape)
    y, dx = distributed_run(module, x, module.y, data, dy)
    expected_y, expected_dx = torch_run(lambda t: torch.nn.functional.interpolate(t, **kwargs), data, dy)
    assert np.allclose(y, expected_y, **F64) and np.allclose(dx, expected_dx, **F64)
    # the backward is the tree's adjoint
    assert np.allclose(dx, x.gather(module.layer.operator.H(module.y.scatter(dy))), **F64)


@pytest.mark.parametrize("name", ["1d-linear-to-20-corners", "2d-bilinear-x2-3x2", "3d-nearest-size"])
def test_float32_interpolation_equals_torch_within_its_tolerance(name):
    (shape, grid, *sizes), kwargs = INTERPOLATIONS[name]
    x = tensor(shape, grid, *sizes)
    module = Upsample(x, **kwargs, dtype=torch.float32)
    rng = np.random.default_rng(4)
    data, dy = rng.standard_normal(shape), rng.standard_normal(module.y.global_shape)
    y, dx = distributed_run(module, x, module.y, data, dy, torch.float32)
    expected_y, expected_dx = torch_run(
        lambda t: torch.nn.functional.interpolate(t, **kwargs), data, dy, torch.float32
    )
    assert y.dtype == np.float32 and dx.dtype == np.float32
    torch.testing.assert_close(torch.from_numpy(y), torch.from_numpy(expected_y))
    torch.testing.assert_close(torch.from_numpy(dx), torch.from_numpy(expected_dx))


def test_random_partitions_of_upsampling_equal_torch():
    """Seeded draws: shapes, 1-4 workers per spatial dimension, uneven (possibly empty)
    shares, every mode, float64."""
    rng = np.random.default_rng(2026)
    for _ in range(12):
        dims = int(rng.integers(1, 4))
        spatial = tuple(int(n) for n in rng.integers(2, 7, dims))
        grid = (1, int(rng.integers(1, 3)), *(int(p) for p in rng.integers(1, 5, dims)))
        shape = (int(rng.integers(1, 3)), 2, *spatial)
        sizes = tuple(
            tuple(int(s) for s in np.diff(np.sort(rng.integers(0, n + 1, p - 1)), prepend=0, append=n))
            for n, p in zip(shape, grid)
        )
        x = tensor(shape, grid, sizes)
        mode = str(rng.choice(["nearest", "nearest-exact", ("linear", "bilinear", "trilinear")[dims - 1]]))
        kwargs: dict = {"mode": mode}
        if rng.random() < 0.5:
            kwargs["scale_factor"] = float(rng.choice([0.5, 1.5, 2.0, 3.0]))
        else:
            kwargs["size"] = tuple(int(n) for n in rng.integers(1, 9, dims))
        if mode not in ("nearest", "nearest-exact"):
            kwargs["align_corners"] = bool(rng.random() < 0.5)
        try:
            module = Interpolate(x, **kwargs)
        except LayerError:  # a scale factor that leaves no output along some dimension
            continue
        data, dy = rng.standard_normal(shape), rng.standard_normal(module.y.global_shape)
        y, dx = distributed_run(module, x, module.y, data, dy)
        expected_y, expected_dx = torch_run(
            lambda t, options=kwargs: torch.nn.functional.interpolate(t, **options), data, dy
        )
        assert np.allclose(y, expected_y, **F64), (shape, grid, sizes, kwargs)
        assert np.allclose(dx, expected_dx, **F64), (shape, grid, sizes, kwargs)


def test_a_nearest_module_refuses_the_other_dtype():
    module = Interpolate(tensor((1, 1, 6), (1, 1, 2)), scale_factor=1.3)
    blocks = {k: torch.from_numpy(v).float() for k, v in module.x.scatter(np.zeros((1, 1, 6))).items()}
    with pytest.raises(StateError, match=r"built for torch\.float64"):
        module(blocks)


# -- MaxPool ------------------------------------------------------------------------------------
POOLS = {
    "1d-k3-s2-p1-uneven": (
        ((2, 2, 11), (1, 1, 4), ((2,), (2,), (1, 5, 0, 5))),
        dict(kernel_size=3, stride=2, padding=1),
    ),
    "1d-k2-workers-without-output": (((1, 1, 5), (1, 1, 4)), dict(kernel_size=2)),
    "2d-k2-2x2": (((2, 3, 8, 6), (1, 1, 2, 2)), dict(kernel_size=2)),
    "2d-k3-s1-p1-4x3": (((1, 2, 7, 5), (1, 1, 4, 3)), dict(kernel_size=3, stride=1, padding=1)),
    "2d-k3-s2-dilated-channels": (
        ((1, 4, 9, 9), (1, 2, 2, 1), ((1,), (3, 1), (5, 4), (9,))),
        dict(kernel_size=(3, 2), stride=2, padding=(1, 0), dilation=(2, 1)),
    ),
    "3d-k2-s1": (((1, 1, 4, 5, 3), (1, 1, 2, 2, 1)), dict(kernel_size=2, stride=1)),
}


@pytest.mark.parametrize("name", list(POOLS))
def test_max_pool_module_equals_torch_max_pool(name):
    (shape, grid, *sizes), kwargs = POOLS[name]
    x = tensor(shape, grid, *sizes)
    module = MaxPool(x, **kwargs)
    rng = np.random.default_rng(5)
    data, dy = rng.standard_normal(shape), rng.standard_normal(module.y.global_shape)
    reference = {1: torch.nn.MaxPool1d, 2: torch.nn.MaxPool2d, 3: torch.nn.MaxPool3d}[len(shape) - 2](
        **kwargs
    )
    y, dx = distributed_run(module, x, module.y, data, dy)
    expected_y, expected_dx = torch_run(reference, data, dy)
    assert np.array_equal(y, expected_y)  # a selection: the same entries
    assert np.allclose(dx, expected_dx, **F64)
    # the input gradient is the adjoint of the layer's Jacobian at the input (proven exactly)
    jacobian = module.layer.at(module.layer.window_operator(x.scatter(data)))
    assert np.allclose(dx, x.gather(jacobian.H(module.y.scatter(dy))), **F64)
    assert verify.exact_adjoint(jacobian)


def test_float32_max_pool_and_its_refusals():
    x = tensor((1, 2, 9, 8), (1, 1, 3, 2))
    module = MaxPool(x, 3, 2, 1)
    rng = np.random.default_rng(6)
    data, dy = rng.standard_normal((1, 2, 9, 8)), rng.standard_normal(module.y.global_shape)
    y, dx = distributed_run(module, x, module.y, data, dy, torch.float32)
    expected_y, expected_dx = torch_run(torch.nn.MaxPool2d(3, 2, 1), data, dy, torch.float32)
    assert np.array_equal(y, expected_y) and np.allclose(dx, expected_dx)
    with pytest.raises(LayerError, match="at most half"):
        MaxPool(x, 2, padding=2)
    with pytest.raises(LayerError, match="1 to 3 spatial"):
        MaxPool(tensor((1, 1, 2, 2, 2, 2), (1, 1, 1, 1, 1, 1)), 2)


def test_max_pool_without_its_padding_mask_is_caught():
    """Control: on negative data, zero padding taken as data (no -inf mask) wins the border
    windows, which the comparison with torch sees."""
    x = tensor((1, 1, 6, 6), (1, 1, 2, 2))
    module = MaxPool(x, 3, stride=2, padding=1)
    data = -1 - np.random.default_rng(8).random((1, 1, 6, 6))
    dy = np.ones(module.y.global_shape)
    expected_y, _ = torch_run(torch.nn.MaxPool2d(3, 2, 1), data, dy)
    assert np.array_equal(distributed_run(module, x, module.y, data, dy)[0], expected_y)
    module._products = [(out, window, shape, None) for out, window, shape, _ in module._products]
    assert not np.array_equal(distributed_run(module, x, module.y, data, dy)[0], expected_y)


def test_max_pool_module_double_backward_and_repeated_calls():
    """The module's one autograd node: double backward (its backward recorded under
    create_graph) passes gradgradcheck, and a second call on other data and a third in another
    dtype give torch's results (nothing of an earlier call is reused wrongly)."""
    x = tensor((1, 1, 5, 4), (1, 1, 2, 2), ((1,), (1,), (3, 2), (1, 3)))
    module = MaxPool(x, 3, stride=2, padding=1)
    rng = np.random.default_rng(9)
    names = module.input_names
    blocks = {
        k: torch.from_numpy(v).requires_grad_()
        for k, v in x.scatter(rng.standard_normal(x.global_shape)).items()
    }

    def pooled(*tensors):
        out = module(dict(zip(names, tensors)))
        return tuple(out[k] for k in module.output_names)

    assert torch.autograd.gradgradcheck(pooled, tuple(blocks[k] for k in names), fast_mode=True)
    for dtype in (torch.float64, torch.float64, torch.float32):
        data, dy = rng.standard_normal(x.global_shape), rng.standard_normal(module.y.global_shape)
        y, dx = distributed_run(module, x, module.y, data, dy, dtype)
        expected_y, expected_dx = torch_run(torch.nn.MaxPool2d(3, 2, 1), data, dy, dtype)
        assert np.array_equal(y, expected_y) and np.allclose(dx, expected_dx, **F64)


def test_a_recorded_backward_hands_its_token_on():
    """Across processes (here MPI's COMM_SELF, both workers on rank 0) the backward recorded
    under create_graph is a collective call: its token becomes the module's (and the
    function's) token, and it is tied to the second-order graph, which reaches the output
    gradients through the windows' exchange (a process whose second-order loss adds it runs
    that exchange with its peers); the second-order gradient is torch's."""
    mpi = pytest.importorskip("mpi4py.MPI")
    from linop.frameworks.torch_function import function

    x = tensor((1, 1, 5, 4), (1, 1, 2, 1))
    module = MaxPool(x, 3, stride=2, padding=1, comm=mpi.COMM_SELF, mapping=[0, 0])
    rng = np.random.default_rng(12)
    data, dy, w = (rng.standard_normal(s) for s in (x.global_shape, module.y.global_shape, x.global_shape))
    blocks = {k: torch.from_numpy(v).requires_grad_() for k, v in x.scatter(data).items()}
    seeds = {k: torch.from_numpy(v).requires_grad_() for k, v in module.y.scatter(dy).items()}
    out = module(blocks)
    first = module.token
    loss = sum((out[k] * seeds[k]).sum() for k in out) + first.sum()
    dx = torch.autograd.grad(loss, list(blocks.values()), create_graph=True)
    assert module.token is not first
    # the token alone reaches the output gradients (zero): the recorded adjoint's backward runs
    alone = torch.autograd.grad(module.token.sum(), list(seeds.values()), retain_graph=True)
    assert all(not g.any() for g in alone)
    weights = x.scatter(w)
    second = sum((g * torch.from_numpy(weights[k])).sum() for g, k in zip(dx, blocks)) + module.token.sum()
    mine = module.y.gather(
        dict(zip(seeds, (g.numpy() for g in torch.autograd.grad(second, list(seeds.values())))))
    )
    t, seed = torch.from_numpy(data).requires_grad_(), torch.from_numpy(dy).requires_grad_()
    (grad,) = torch.autograd.grad(torch.nn.functional.max_pool2d(t, 3, 2, 1), t, seed, create_graph=True)
    (expected,) = torch.autograd.grad((grad * torch.from_numpy(w)).sum(), seed)
    assert np.abs(expected.numpy()).max() > 0 and np.allclose(mine, expected.numpy(), **F64)
    # a TorchOperator's own double backward alike: its token after the recorded backward
    f = function(module.function.op, comm=mpi.COMM_SELF, mapping=[0, 0])
    windows = f.tensors(*(blocks[k] for k in f.inputs))
    cotangents = [torch.ones_like(v).requires_grad_() for v in windows]
    torch.autograd.grad(windows, [blocks[k] for k in f.inputs], cotangents, create_graph=True)
    assert all(not g.any() for g in torch.autograd.grad(f.token.sum(), cotangents))


def test_max_pool_module_refuses_what_is_no_dict_of_its_blocks():
    x = tensor((1, 1, 4, 4), (1, 1, 2, 1))
    module = MaxPool(x, 2)
    blocks = {k: torch.from_numpy(v) for k, v in x.scatter(np.ones(x.global_shape)).items()}
    with pytest.raises(StateError, match="takes a dict of blocks"):
        module([blocks[k] for k in module.input_names])
    with pytest.raises(StateError, match="missing block"):
        module({k: blocks[k] for k in list(blocks)[:1]})
    with pytest.raises(StateError, match="must be a torch tensor"):
        module({k: v.numpy() for k, v in blocks.items()})
    for dtype in (torch.int64, torch.complex128):  # the pool pads with -inf: no integer or complex
        with pytest.raises(DtypeError, match=f"is {dtype}.*floating-point"):
            module({k: v.to(dtype) for k, v in blocks.items()})


def test_max_pool_refused_alone_after_binding_stays_refused(one_process_group):
    """On a gloo group (one process holding both workers), after the exchange is bound: a dict
    missing a block is refused through the workspace's exchange (the tree the peers wait in:
    its ``failed`` record, not the windows' function's collective check), and every later call
    raises that StateError again without a new record (the peers' waiting call keeps naming
    this rank). A refusal at the first call is the agreed one, and the module goes on."""
    from linop.backends.stall_record import CallRecord
    from linop.backends.torch_distributed import stall
    from linop.errors import DistributedStateError

    x = tensor((1, 1, 6, 4), (1, 1, 2, 1))
    blocks = {k: torch.from_numpy(v) for k, v in x.scatter(np.ones(x.global_shape)).items()}
    module = MaxPool(x, 3, stride=2, padding=1, group=True, mapping=[0, 0])
    module(blocks)  # binds
    plan = module._workspace.exchange._runner.torch_plan
    with pytest.raises(StateError, match="missing block") as refused:
        module({})
    assert type(refused.value) is StateError

    def record():
        return CallRecord.parse(stall._store().get(stall._key(plan.context, 0)).decode())

    failed = record()
    assert (failed.identity, failed.kind) == (plan.fingerprint.hex(), "failed")
    for again in (blocks, {}):
        with pytest.raises(StateError, match=r"missing block.*an earlier call"):
            module(again)
    assert record() == failed
    fresh = MaxPool(x, 3, stride=2, padding=1, group=True, mapping=[0, 0])
    with pytest.raises(DistributedStateError):
        fresh({k: torch.zeros(1, 1, 1, 1) for k in blocks})
    y = fresh(blocks)
    assert all(torch.equal(v, torch.ones_like(v)) for v in y.values())


# -- Repartition --------------------------------------------------------------------------------
def test_repartition_module_moves_forward_and_repartitions_the_gradient_back():
    x = tensor((2, 3, 7, 5), (1, 1, 3, 2))
    z = tensor((2, 3, 7, 5), (2, 1, 1, 2), ((0, 2), (3,), (7,), (4, 1)), name="z")
    module = Repartition(x, z)
    rng = np.random.default_rng(7)
    data, dy = rng.standard_normal(x.global_shape), rng.standard_normal(z.global_shape)
    y, dx = distributed_run(module, x, z, data, dy)
    assert np.array_equal(y, data) and np.array_equal(dx, dy)
    back = Repartition(z, x)
    assert back.operator == module.operator.H and set(back.output_names) == set(x.space.names)
    # the module's own node under create_graph: dx is linear in dy, its derivative the
    # repartition back (recorded); any mapping takes the checked way, a non-tensor is refused
    blocks = {k: torch.from_numpy(v) for k, v in x.scatter(data).items()}
    seeds = {k: torch.from_numpy(v).requires_grad_() for k, v in z.scatter(dy).items()}
    inputs = {k: v.clone().requires_grad_() for k, v in blocks.items()}
    out = module(types.MappingProxyType(inputs))
    dx = torch.autograd.grad(
        [out[k] for k in seeds], list(inputs.values()), [seeds[k] for k in seeds], create_graph=True
    )
    weights = x.scatter(rng.standard_normal(x.global_shape))
    again = torch.autograd.grad(
        sum((g * torch.from_numpy(weights[k])).sum() for g, k in zip(dx, inputs)), list(seeds.values())
    )
    assert np.array_equal(z.gather({k: g.numpy() for k, g in zip(seeds, again)}), x.gather(weights))
    with pytest.raises(StateError, match="must be a torch tensor"):
        module(dict(blocks, **{next(iter(blocks)): np.zeros(1)}))


# -- torch.distributed ------------------------------------------------------------------------
@pytest.mark.timeout(660)
def test_resample_modules_under_torch_distributed():
    """Two gloo processes (127.0.0.1): Interpolate, MaxPool and Repartition with ``group=True``
    equal torch's layers on the whole tensor, forward and backward."""
    pytest.importorskip("torch.distributed")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    command = [sys.executable, "resample_checks.py", "2"]
    try:
        result = subprocess.run(
            command, cwd=ROOT / "tests" / "torchdist", env=env, capture_output=True, text=True, timeout=600
        )
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"the torch.distributed resample checks timed out after 600 s\n{expired.stdout}")
    assert result.returncode == 0, f"{result.stdout[-4000:]}\n{result.stderr[-6000:]}"
    assert sorted(result.stdout.count(f"RESAMPLE OK rank {r}") for r in range(2)) == [1, 1], result.stdout


def test_the_anchor_of_a_collective_call_gets_no_gradient(one_process_group):
    """The empty anchor that ties every process's outputs to the graph only ties it: a
    backward gives it no gradient (none allocated or accumulated per call)."""
    from linop.frameworks.torch_function import TorchOperator
    from linop.halo import HaloExchange
    from linop.halo_geometry import Kernel, halo_geometry

    x = DistributedTensor("x", (4, 4), Partition((1, 1)))
    f = TorchOperator(HaloExchange(halo_geometry(x, Kernel(3, padding=1))), group=True)
    (name,) = f.inputs
    t = torch.randn(f.op.domain.block(name).shape, dtype=torch.float64, requires_grad=True)
    for _ in range(2):
        sum(v.sum() for v in f({name: t}).values()).backward()
    assert f._anchor is not None and f._anchor.grad is None
    assert t.grad is not None


def test_a_max_pool_refusal_on_a_gloo_group_allocates_no_blocks(one_process_group):
    """A refusal goes through the workspace's exchange on stand-ins that allocate nothing: at
    the first call (the agreed error) no local blocks are made, and after binding in float32 a
    refusal (no tensors to take a dtype from) leaves the bound float32 blocks in place, where
    float64 blocks used to be allocated in their stead."""
    x = tensor((1, 1, 6, 4), (1, 1, 2, 1))
    blocks = {k: torch.from_numpy(v) for k, v in x.scatter(np.ones(x.global_shape)).items()}
    module = MaxPool(x, 3, stride=2, padding=1, group=True, mapping=[0, 0])
    with pytest.raises(LinopError, match="floating-point"):
        module({k: v.to(torch.int64) for k, v in blocks.items()})
    assert module._workspace._forward is None
    module({k: v.float() for k, v in blocks.items()})  # binds in float32
    kept = module._workspace._forward
    with pytest.raises(StateError, match="missing block"):
        module({})
    assert module._workspace._forward is kept and kept[0] == torch.float32


def test_max_pool_sub_box_windows_on_a_gloo_group_reuse_no_stale_gradient(one_process_group):
    """On a gloo group the backward scatters into windows that are boxes inside larger local
    blocks (2 of the 4 here) through one buffer the module keeps: calls on new data, and in
    another dtype, give torch's gradients (nothing of an earlier call's scatter is left)."""
    x = tensor((1, 2, 9, 8), (1, 1, 2, 2))
    module = MaxPool(x, 3, stride=2, group=True, mapping=[0, 0, 0, 0])
    rng = np.random.default_rng(14)
    for dtype in (torch.float64, torch.float64, torch.float32):
        data, dy = rng.standard_normal(x.global_shape), rng.standard_normal(module.y.global_shape)
        y, dx = distributed_run(module, x, module.y, data, dy, dtype)
        expected_y, expected_dx = torch_run(torch.nn.MaxPool2d(3, 2), data, dy, dtype)
        assert np.array_equal(y, expected_y) and np.allclose(dx, expected_dx, **F64)
    assert module._scratch is not None and sum(v is not None for v in module._scratch[1]) == 2


def test_a_dtype_numpy_lacks_is_a_typed_error_under_mpi():
    """bfloat16 has no numpy dtype: under MPI (COMM_SELF) a Repartition's call says so, a
    DtypeError naming it, not torch's bare TypeError."""
    mpi = pytest.importorskip("mpi4py.MPI")
    a = DistributedTensor("a", (4, 3), Partition((2, 1)))
    b = DistributedTensor("b", (4, 3), Partition((1, 2)))
    module = Repartition(a, b, comm=mpi.COMM_SELF, mapping=[0, 0])
    blocks = {k: torch.from_numpy(v).to(torch.bfloat16) for k, v in a.scatter(np.zeros((4, 3))).items()}
    with pytest.raises(DtypeError, match="bfloat16 has no numpy dtype"):
        module(blocks)
