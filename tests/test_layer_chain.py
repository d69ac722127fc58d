"""A chain of sliding-window layers with one fused halo exchange (linop.layers.chain): the
fused window is the chain's receptive field, the fused tree is the layer-by-layer tree (exact
sparse matrices, integer weights), max pools agree by value and by Jacobian, the fused tree
sends fewer messages, and a fused halo one entry too narrow is caught."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import verify
from linop import DistributedTensor, Kernel, Partition, halo_windows
from linop.accounting import account, account_schedule
from linop.halo_geometry import output_length
from linop.layers import LayerError
from linop.layers.base import LocalStep, local_stage
from linop.layers.chain import ChainStage, WindowChain, fused_window
from linop.partition import grid_block_name
from linop.space import Block

torch = pytest.importorskip("torch")

RNG_SEED = 37


# -- the fused window is the receptive field ----------------------------------------------------
def receptive_field(kernels: list[tuple[int, int, int, int]], length: int) -> list[tuple[int, int]]:
    """Per output of the chain on one dimension of ``length``, the lowest and highest padded
    input coordinate it reads, by following every tap through every stage (no formula)."""
    lengths = [length]
    for k, s, p, d in kernels:
        lengths.append(output_length(lengths[-1], k, s, p, d))
    fields = []
    for o in range(lengths[-1]):
        reached = {o}
        for k, s, p, d in reversed(kernels):
            reached = {q * s - p + d * t for q in reached for t in range(k)}
        fields.append((min(reached), max(reached)))
    return fields


CHAINS_1D = [
    [(3, 1, 1, 1), (3, 1, 1, 1), (2, 2, 0, 1)],
    [(3, 2, 1, 1), (3, 1, 1, 1)],
    [(2, 2, 0, 1), (3, 2, 1, 1), (3, 1, 0, 2)],
    [(5, 3, 2, 1), (2, 1, 1, 3), (3, 2, 1, 1), (1, 1, 0, 1)],
]


@pytest.mark.parametrize("stages", CHAINS_1D, ids=lambda c: "-".join("".join(map(str, k)) for k in c))
@pytest.mark.parametrize("length", [7, 16, 23])
def test_the_fused_window_is_the_chains_receptive_field(stages, length):
    fused = fused_window([Kernel(k, s, p, d) for k, s, p, d in stages], 1)
    size, stride, padding = fused.size[0], fused.stride[0], fused.padding[0]
    fields = receptive_field(stages, length)
    assert len(fields) == output_length(length, size, stride, padding)  # the chain's output length
    for o, (low, high) in enumerate(fields):
        assert (low, high + 1) == (o * stride - padding, o * stride - padding + size)


# -- the fused tree equals the layer-by-layer tree ---------------------------------------------
def conv(rng, c_out, c_in, k, dims=1, **kw):
    """A convolution stage with random integer weights (an int ``k`` for each of ``dims``)."""
    size = (k,) * dims if isinstance(k, int) else k
    return ChainStage.conv(rng.integers(-2, 3, (c_out, c_in, *size)), **kw)


LINEAR_CASES = [
    pytest.param(
        lambda: DistributedTensor("x", (2, 2, 12, 10), Partition((1, 1, 2, 2))),
        lambda rng: [
            conv(rng, 3, 2, 3, 2, padding=1),
            conv(rng, 2, 3, 3, 2, padding=1),
            ChainStage.avg(Kernel(2, stride=2)),
        ],
        id="conv-conv-avg-2x2",
    ),
    pytest.param(
        lambda: DistributedTensor("x", (1, 1, 17), Partition((1, 1, 3)), sizes=((1,), (1,), (4, 8, 5))),
        lambda rng: [conv(rng, 2, 1, 3, stride=2, padding=1), conv(rng, 1, 2, 3, padding=2, dilation=2)],
        id="1d-unbalanced-stride-then-dilation",
    ),
    pytest.param(
        lambda: DistributedTensor("x", (1, 1, 9), Partition((1, 1, 4))),
        lambda rng: [conv(rng, 1, 1, 3, padding=1), ChainStage.avg(Kernel(2, stride=2)), conv(rng, 1, 1, 2)],
        id="1d-workers-without-output",
    ),
    pytest.param(
        lambda: DistributedTensor("x", (1, 2, 8, 9), Partition((1, 1, 2, 2))),
        lambda rng: [
            conv(rng, 2, 2, 3, 2, padding=1, boundary="periodic"),
            conv(rng, 1, 2, (3, 1), padding=(1, 0)),
        ],
        id="periodic-first-stage",
    ),
    pytest.param(
        lambda: DistributedTensor("x", (1, 4, 11, 6), Partition((1, 2, 3, 1))),
        lambda rng: [ChainStage.avg(Kernel(3, padding=1)), ChainStage.avg(Kernel(2, stride=2, padding=1))],
        id="pools-channels-partitioned",
    ),
    pytest.param(
        lambda: DistributedTensor("x", (1, 1, 6, 5, 6), Partition((1, 1, 2, 1, 2))),
        lambda rng: [conv(rng, 2, 1, 3, 3, padding=1), conv(rng, 1, 2, 2, 3, stride=2, padding=(1, 0, 1))],
        id="3d",
    ),
]


@pytest.mark.parametrize(("tensor", "stages"), LINEAR_CASES)
def test_the_fused_chain_is_the_layer_by_layer_chain_exactly(tensor, stages):
    rng = np.random.default_rng(RNG_SEED)
    x = tensor()
    chain = WindowChain(x, stages(rng))
    fused, layered = chain.operator, chain.layered_operator()
    proof = verify.equal(fused, layered)
    assert proof and proof.exact, proof
    assert verify.exact_adjoint(fused)
    data = rng.integers(-3, 4, x.global_shape)
    state = x.scatter(data)
    assert np.array_equal(chain.y.gather(fused(state)), chain.y.gather(chain.forward(state)))


# -- max pools: outputs by value, Jacobians exactly ---------------------------------------------
def sequential(data: np.ndarray, stages: list[ChainStage]) -> np.ndarray:
    """The chain on one process with torch's own layers (float64, integer values: exact)."""
    dims = data.ndim - 2
    v = torch.from_numpy(data.astype(np.float64))
    for stage in stages:
        k = stage.kernel.resolve(dims)
        args = dict(stride=k.stride, padding=k.padding, dilation=k.dilation)
        if stage.kind == "conv":
            weights = torch.from_numpy(np.asarray(stage.weights, dtype=np.float64))
            v = getattr(torch.nn.functional, f"conv{dims}d")(v, weights, **args)
        elif stage.kind == "avg":
            assert all(d == 1 for d in k.dilation)
            pool = getattr(torch.nn.functional, f"avg_pool{dims}d")
            v = pool(v, k.size, k.stride, k.padding, count_include_pad=True)
        else:
            v = getattr(torch.nn.functional, f"max_pool{dims}d")(v, k.size, **args)
    return v.numpy()


MAX_CASES = [
    pytest.param(
        lambda: DistributedTensor("x", (2, 1, 11, 10), Partition((1, 1, 2, 2))),
        lambda rng: [
            conv(rng, 2, 1, 3, 2, padding=1),
            conv(rng, 2, 2, 3, 2, padding=1),
            ChainStage.max(Kernel(2, stride=2)),
        ],
        id="conv-conv-max-2x2",
    ),
    pytest.param(
        lambda: DistributedTensor("x", (1, 2, 13), Partition((1, 1, 3)), sizes=((1,), (2,), (6, 2, 5))),
        lambda rng: [
            conv(rng, 2, 2, 3, padding=1),
            ChainStage.max(Kernel(3, stride=2, padding=1)),
            conv(rng, 1, 2, 3, padding=1),
        ],
        id="1d-max-in-the-middle-padded",
    ),
    pytest.param(
        lambda: DistributedTensor("x", (1, 3, 9, 8), Partition((1, 3, 1, 2))),
        lambda rng: [
            ChainStage.max(Kernel(3, padding=1)),
            ChainStage.avg(2),
            ChainStage.max(Kernel(2, padding=1)),
        ],
        id="pools-channels-partitioned",
    ),
]


@pytest.mark.parametrize(("tensor", "stages"), MAX_CASES)
def test_a_chain_with_max_pools_equals_torch_and_its_jacobian_the_layer_by_layer_one(tensor, stages):
    rng = np.random.default_rng(RNG_SEED)
    x = tensor()
    built = stages(rng)
    chain = WindowChain(x, built)
    data = rng.integers(-9, 10, x.global_shape)  # ties and negative values next to the padding
    state = x.scatter(data)
    result = chain.y.gather(chain.forward(state))
    assert np.array_equal(result, sequential(data, built))
    fused = chain.at(chain.window_operator(state))
    layered = chain.layered_at(state)
    proof = verify.equal(fused, layered)
    assert proof and proof.exact, proof
    assert verify.exact_adjoint(fused)
    assert np.array_equal(chain.y.gather(fused(state)), result)  # J(x0) x0 is the output here


@pytest.mark.parametrize(("tensor", "stages"), LINEAR_CASES[:1] + LINEAR_CASES[4:5])
def test_linear_chains_equal_torch(tensor, stages):
    rng = np.random.default_rng(RNG_SEED)
    x = tensor()
    built = stages(rng)
    data = rng.integers(-3, 4, x.global_shape)
    chain = WindowChain(x, built)
    # torch sums in another order: equal to rounding (the exact proof is against the layers)
    np.testing.assert_allclose(
        chain.y.gather(chain.operator(x.scatter(data))), sequential(data, built), rtol=1e-13
    )


# -- the control: a fused halo one entry too narrow ----------------------------------------------
def narrowed(chain: WindowChain, shortfall: int):
    """The fused tree with its halo ``shortfall`` entries too narrow on each side of every
    spatial dimension, the missing entries filled with zeros locally."""
    k = chain.kernel
    dims = range(2, chain.x.ndim)
    size = tuple(s - 2 * shortfall if d in dims else s for d, s in enumerate(k.size))
    padding = tuple(p - shortfall if d in dims else p for d, p in enumerate(k.padding))
    narrow = Kernel(size, k.stride, padding, k.dilation, k.boundary)
    windows = halo_windows(chain.x, narrow, window_name="narrow", output_sizes=chain.window_shares)
    steps = []
    for g in chain.x.partition.indices():
        full = chain.geometry.window_shape(g)
        widths = [(0, 0), (0, 0), *((shortfall, shortfall),) * (len(full) - 2)]

        def pad(v, widths=widths):
            return np.pad(v, [(0, 0)] * (v.ndim - len(widths)) + widths)

        def crop(v, widths=widths):
            inner = tuple(slice(a, v.shape[v.ndim - len(widths) + i] - b) for i, (a, b) in enumerate(widths))
            return v[(Ellipsis, *inner)]

        target = chain.window_name(g)
        steps.append(
            LocalStep(
                (grid_block_name("narrow", g),),
                (Block(target, full, chain.x.block(g).worker),),
                pad,
                crop,
                "pad",
            )
        )
    padded = local_stage(windows.range, steps) @ windows
    return chain.local_operator(padded.range) @ padded


def test_a_fused_halo_one_entry_too_narrow_is_caught():
    rng = np.random.default_rng(RNG_SEED)
    x = DistributedTensor("x", (1, 1, 12, 10), Partition((1, 1, 2, 2)))
    chain = WindowChain(
        x,
        [
            conv(rng, 1, 1, 3, 2, padding=1),
            conv(rng, 1, 1, 3, 2, padding=1),
            ChainStage.avg(Kernel(2, stride=2)),
        ],
    )
    layered = chain.layered_operator()
    assert verify.equal(narrowed(chain, 0), layered)  # the harness itself: no shortfall, equal
    proof = verify.equal(narrowed(chain, 1), layered)
    assert not proof
    assert proof.count > 0 and "differ" in proof.detail


# -- messages: one exchange instead of one per layer ------------------------------------------
@pytest.mark.parametrize(("tensor", "stages"), [LINEAR_CASES[0], LINEAR_CASES[1], LINEAR_CASES[3]])
def test_the_fused_chain_sends_fewer_messages(tensor, stages):
    rng = np.random.default_rng(RNG_SEED)
    chain = WindowChain(tensor(), stages(rng))
    fused, layered = account(chain.operator), account(chain.layered_operator())
    exchanges = [account(layer.window_operator) for layer in chain.layers()]
    assert fused.total_messages == account(chain.window_operator).total_messages  # one exchange, no more
    assert layered.total_messages == sum(e.total_messages for e in exchanges)
    assert sum(e.total_messages > 0 for e in exchanges) >= 2
    assert fused.total_messages < layered.total_messages
    assert fused.phases < layered.phases
    scheduled_fused = account_schedule(chain.operator)
    assert scheduled_fused.total_messages < account_schedule(chain.layered_operator()).total_messages


@pytest.mark.parametrize(
    ("length", "workers", "fused", "layered"), [(12, 4, 6, 18), (8, 4, 10, 18), (6, 6, 24, 30)]
)
def test_a_fused_halo_wider_than_a_neighbours_bulk_still_sends_fewer_messages(
    length, workers, fused, layered
):
    """Three 3-tap convolutions: the fused halo is 3 entries a side. Over bulks of 3 it comes
    from one neighbour (6 messages for 3 x 6); over bulks of 2 or 1 it is fetched from two or
    three workers a side (multi-hop), still fewer messages than three exchanges of one entry,
    and one dependent phase instead of three."""
    rng = np.random.default_rng(RNG_SEED)
    x = DistributedTensor("x", (1, 1, length), Partition((1, 1, workers)))
    chain = WindowChain(x, [conv(rng, 1, 1, 3, padding=1) for _ in range(3)])
    a, b = account(chain.operator), account(chain.layered_operator())
    assert (a.total_messages, b.total_messages, a.phases, b.phases) == (fused, layered, 1, 3)
    assert verify.equal(chain.operator, chain.layered_operator())


def test_redundancy_counts_the_overlap_of_the_enlarged_windows():
    rng = np.random.default_rng(RNG_SEED)
    x = DistributedTensor("x", (1, 1, 12), Partition((1, 1, 2)))
    chain = WindowChain(x, [conv(rng, 1, 1, 3, padding=1), conv(rng, 1, 1, 3, padding=1)])
    # each worker computes its 6 entries of the middle field, one neighbour entry and one entry
    # beyond the global boundary (masked to zero): 8 each
    assert chain.redundancy() == ((16, 12),)


# -- errors -------------------------------------------------------------------------------------
def test_arguments_that_do_not_fit_are_layer_errors():
    rng = np.random.default_rng(RNG_SEED)
    x = DistributedTensor("x", (1, 2, 8, 8), Partition((1, 2, 2, 1)))
    with pytest.raises(LayerError, match="channels must not be partitioned"):
        WindowChain(x, [conv(rng, 1, 2, 3, 2)])
    y = DistributedTensor("y", (1, 2, 8, 8), Partition((1, 1, 2, 1)))
    with pytest.raises(LayerError, match="take 3 channels"):
        WindowChain(y, [conv(rng, 1, 3, 3, 2)])
    with pytest.raises(LayerError, match="only the first stage"):
        WindowChain(y, [ChainStage.avg(2), ChainStage.avg(Kernel(3, padding=1, boundary="periodic"))])
    with pytest.raises(LayerError, match="leaves no output"):
        WindowChain(y, [ChainStage.avg(Kernel(4, stride=4)), ChainStage.avg(3)])
    with pytest.raises(LayerError, match=r"build it with ChainStage\.conv"):
        WindowChain(y, [ChainStage("conv", Kernel(5), np.ones((1, 2, 3, 3)))])
    with pytest.raises(LayerError, match="non-empty sequence"):
        WindowChain(y, [])
    chain = WindowChain(y, [ChainStage.max(2)])
    with pytest.raises(LayerError, match="not linear"):
        _ = chain.operator
    with pytest.raises(LayerError, match="not given to at"):
        chain.at({}).H(chain.y.scatter(np.zeros(chain.y.global_shape)))


def test_every_parameter_combination_of_a_small_grid_agrees():
    """A small sweep of two-stage 1-d chains over two workers (strides, paddings, dilations)."""
    rng = np.random.default_rng(RNG_SEED)
    x = DistributedTensor("x", (1, 1, 10), Partition((1, 1, 2)))
    for (s1, p1), (s2, p2, d2) in itertools.product([(1, 0), (2, 1)], [(1, 1, 1), (2, 0, 2)]):
        chain = WindowChain(
            x,
            [
                conv(rng, 1, 1, 3, stride=s1, padding=p1),
                conv(rng, 1, 1, 2, stride=s2, padding=p2, dilation=d2),
            ],
        )
        assert verify.equal(chain.operator, chain.layered_operator()), (s1, p1, s2, p2, d2)
