"""dAD: the all-reduced per-site gradients equal the product of the all-gathered factors (as
operators, exactly for integers), the traffic the trees count, the crossover, and rank-r dAD."""

from __future__ import annotations

import numpy as np
import pytest

import verify
from linop.layers import LayerError, dad

SHAPES = [
    pytest.param(2, 3, 4, 5, id="S2-N3-h4x5"),
    pytest.param(3, 2, 4, 5, id="S3-N2-h4x5"),
    pytest.param(4, 1, 3, 2, id="S4-N1-h3x2"),
    pytest.param(1, 4, 2, 3, id="S1-N4-h2x3"),
]


@pytest.mark.parametrize(("sites", "samples", "h_in", "h_out"), SHAPES)
def test_allreduce_and_gathered_gradients_are_the_same_operator(sites, samples, h_in, h_out):
    rng = np.random.default_rng(3)
    activations = [rng.integers(-3, 4, (samples, h_in)) for _ in range(sites)]
    d = dad.deltas(sites, samples, h_out)
    reduced, gathered = dad.allreduce_gradient(activations, d), dad.gathered_gradient(activations, d)
    proof = verify.equal(reduced, gathered)
    assert proof and proof.exact, proof
    assert verify.exact_adjoint(reduced) and verify.exact_adjoint(gathered)
    data = rng.integers(-3, 4, d.global_shape)
    expected = sum(a.T @ data[s * samples : (s + 1) * samples] for s, a in enumerate(activations))
    for op in (reduced, gathered):
        result = op(d.scatter(data))
        assert all(np.array_equal(result[f"G[{s}]"], expected) for s in range(sites))


def test_float_gradients_agree_numerically_and_a_wrong_one_is_caught():
    rng = np.random.default_rng(4)
    activations = [rng.standard_normal((3, 4)) for _ in range(3)]
    d = dad.deltas(3, 3, 5)
    assert verify.numeric_equal(dad.allreduce_gradient(activations, d), dad.gathered_gradient(activations, d))
    wrong = [activations[0], activations[1], activations[2] + 1e-3]
    assert not verify.numeric_equal(dad.allreduce_gradient(activations, d), dad.gathered_gradient(wrong, d))


@pytest.mark.parametrize(("sites", "samples", "h_in", "h_out"), SHAPES)
def test_traffic_per_site_is_counted_from_the_trees(sites, samples, h_in, h_out):
    activations = [np.ones((samples, h_in))] * sites
    d = dad.deltas(sites, samples, h_out)
    reduced = dad.traffic(dad.allreduce_gradient(activations, d))
    deltas = dad.traffic(dad.gathered_gradient(activations, d))
    factors = dad.traffic(dad.factor_gather(sites, samples, h_in))
    if sites == 1:
        assert reduced.per_site() == deltas.per_site() == factors.per_site() == 0
        return
    assert all(v == h_in * h_out for v in reduced.distinct.values())
    assert all(deltas.distinct[s] + factors.distinct[s] == samples * (h_in + h_out) for s in range(sites))
    # every site sends its factors to every other site; the all-reduce's root sends the sum back
    assert all(deltas.sent[s] == (sites - 1) * samples * h_out for s in range(sites))
    assert reduced.sent[0] == (sites - 1) * h_in * h_out


@pytest.mark.parametrize("samples", [1, 2, 3, 5, 8])
def test_gathering_is_cheaper_exactly_below_the_crossover(samples):
    h_in, h_out, sites = 6, 4, 2
    activations = [np.ones((samples, h_in))] * sites
    d = dad.deltas(sites, samples, h_out)
    reduce_cost = dad.traffic(dad.allreduce_gradient(activations, d)).per_site()
    gather_cost = (
        dad.traffic(dad.gathered_gradient(activations, d)).per_site()
        + dad.traffic(dad.factor_gather(sites, samples, h_in)).per_site()
    )
    assert dad.crossover(h_in, h_out) == 2.4
    assert (gather_cost < reduce_cost) == (samples < dad.crossover(h_in, h_out))


def test_rank_dad_traffic_bound_and_error():
    rng = np.random.default_rng(5)
    u, v = rng.standard_normal((30, 3)), rng.standard_normal((20, 3))
    activations, deltas = [], []
    for _ in range(4):  # per-site factors whose summed gradient is nearly rank 3
        mix = rng.standard_normal((8, 3))
        activations.append(mix @ u.T + 1e-3 * rng.standard_normal((8, 30)))
        deltas.append(rng.standard_normal((8, 3)) @ v.T)
    low = dad.rank_dad(activations, deltas, 3, iterations=3)
    assert low.sent_per_site == low.bound == 3 * 3 * (30 + 20)
    assert low.best <= low.error < low.best + 1e-6
    full = dad.rank_dad(activations, deltas, 20, iterations=2)
    assert full.error < 1e-10 and full.best < 1e-12
    rough = dad.rank_dad(activations, deltas, 1, iterations=1)
    assert rough.error >= rough.best > 0


def test_bad_dad_arguments_raise_layer_errors():
    d = dad.deltas(2, 3, 4)
    with pytest.raises(LayerError, match="3 activation blocks for 2 sites"):
        dad.allreduce_gradient([np.ones((3, 2))] * 3, d)
    with pytest.raises(LayerError, match=r"activations of site 1 have shape \(2, 2\)"):
        dad.gathered_gradient([np.ones((3, 2)), np.ones((2, 2))], d)
    with pytest.raises(LayerError, match="rank"):
        dad.rank_dad([np.ones((3, 2))], [np.ones((3, 2))], 0)
