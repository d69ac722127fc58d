"""LayerModule's backward without the input gradient: skipped on every rank alike when no
rank's input needs one, computed on every rank when one does, the parameters' gradients
exactly those of the full path."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import collective_assert, local_part

from linop import DistributedTensor, Kernel, Partition

torch = pytest.importorskip("torch", reason="torch is not installed (the torch extra)")

pytestmark = pytest.mark.timeout(60)


def _skip_cases(size: int):
    """Layers whose backward may skip the input gradient: a convolution cut along its rows (a
    halo exchange between the ranks), one whose last rank holds no input block (it joins
    through the token), and an affine layer cut along its features (identity windows)."""
    from linop.layers import Affine, Convolution

    rows = DistributedTensor("x", (2, 2, 3 * size + 1, 4), Partition((1, 1, size, 1)))
    fewer = DistributedTensor("x", (1, 2, 5, 4), Partition((1, 1, max(size - 1, 1), 1)))
    features = DistributedTensor("x", (3, 2 * size), Partition((1, size)))
    return {
        "conv-rows": Convolution(rows, 3, Kernel(3, padding=1)),
        "conv-fewer": Convolution(fewer, 2, Kernel(3, padding=1)),
        "affine": Affine(features, 3, workers=Partition((1, size))),
    }


@pytest.mark.parametrize("case", ["conv-rows", "conv-fewer", "affine"])
@pytest.mark.parametrize("replicate", [False, True], ids=["owners", "replicated"])
def test_the_input_gradient_is_skipped_only_when_no_rank_needs_it(comm, case, replicate):
    """With no rank's input requiring a gradient the backward runs neither the local input
    gradients nor the adjoint window movement, on every rank; with rank 0's alone requiring
    one, every rank runs both (rank 0's gradient needs its neighbours' halo gradients), except
    where the windows are an identity (nothing moves between ranks: rank 0 alone). Once some
    rank needed one, later calls compute it without asking. The parameters' gradients equal,
    exactly, those of the path that does not skip."""
    from linop.frameworks.torch_layers import LayerModule

    layer = _skip_cases(comm.size)[case]
    if replicate and case == "affine":
        pytest.skip("an affine layer's parameters have one copy: replicate changes nothing")
    rng = np.random.default_rng(21)
    w, b = rng.standard_normal(layer.weights.global_shape), rng.standard_normal(layer.bias.global_shape)
    data = local_part(layer.x.space, layer.x.scatter(rng.standard_normal(layer.x.global_shape)), comm.rank)
    module = LayerModule(layer, weights=w, bias=b, comm=comm, replicate=replicate)
    adjoints = []
    run = module.windows.run

    def counted(tensors, *, adjoint=False):
        adjoints.append(adjoint)
        return run(tensors, adjoint=adjoint)

    module.windows.run = counted  # type: ignore[method-assign]
    results = {}
    for pattern in ("none", "none", "first", "all", "none after"):
        module.zero_grad()
        adjoints.clear()
        wanted = pattern == "all" or (pattern == "first" and comm.rank == 0)
        x = {k: torch.from_numpy(v).requires_grad_(wanted) for k, v in data.items()}
        y = module(x)
        (sum((v * v).sum() for v in y.values()) + module.token.sum()).backward()
        grads = {n: p.grad.clone() for n, p in module.parameter_state().items()}
        results[pattern] = (grads, {k: v.grad for k, v in x.items()}, adjoints.count(True))
    full, _, full_adjoints = results["all"]
    # identity windows (the affine layer) move nothing between the ranks: each decides alone;
    # else, once some rank needed the gradient, every later call computes it on every rank
    identity = module.windows.identity
    first_adjoints = full_adjoints if not identity else int(comm.rank == 0)
    after_adjoints = 0 if identity else 1
    problems = [
        f"{pattern}: d{n} not equal"
        for pattern in ("none", "first", "none after")
        for n, g in full.items()
        if not torch.equal(results[pattern][0][n], g)
    ]
    problems += [f"none: dx of {k} given" for k, g in results["none"][1].items() if g is not None]
    problems += [f"none after: dx of {k} given" for k, g in results["none after"][1].items() if g is not None]
    problems += [
        f"first: dx of {k} differs"
        for k, g in results["first"][1].items()
        if comm.rank == 0 and not torch.equal(g, results["all"][1][k])
    ]
    problems += (
        [f"adjoint movements: {[results[p][2] for p in ('all', 'none', 'first', 'none after')]}"]
        if (
            results["none"][2] != 0
            or results["first"][2] != first_adjoints
            or full_adjoints != 1
            or results["none after"][2] != after_adjoints
        )
        else []
    )
    collective_assert(not problems, f"rank {comm.rank}: " + "; ".join(problems))


@pytest.mark.parametrize("replicate", [False, True], ids=["owners", "replicated"])
def test_an_input_declared_data_starts_no_agreement_and_skips_the_input_path(comm, replicate, monkeypatch):
    """``input_gradient=False`` on every rank: no call starts an agreement, none runs the
    adjoint window movement, and the parameters' gradients equal, exactly, those of a module
    that decides by agreement (here: no rank's input needs a gradient)."""
    import linop.frameworks.torch_layers as torch_layers

    layer = _skip_cases(comm.size)["conv-rows"]
    rng = np.random.default_rng(22)
    w, b = rng.standard_normal(layer.weights.global_shape), rng.standard_normal(layer.bias.global_shape)
    data = local_part(layer.x.space, layer.x.scatter(rng.standard_normal(layer.x.global_shape)), comm.rank)
    started = []
    start = torch_layers.start_agreement
    monkeypatch.setattr(torch_layers, "start_agreement", lambda *a, **k: started.append(1) or start(*a, **k))
    results = []
    for declared in (None, False):
        module = torch_layers.LayerModule(
            layer, weights=w, bias=b, comm=comm, replicate=replicate, input_gradient=declared
        )
        adjoints = []
        run = module.windows.run
        module.windows.run = lambda tensors, *, adjoint=False, run=run, adjoints=adjoints: (  # type: ignore[method-assign]
            adjoints.append(adjoint) or run(tensors, adjoint=adjoint)
        )
        started.clear()
        grads = []
        for _ in range(2):
            module.zero_grad()
            x = {k: torch.from_numpy(v) for k, v in data.items()}
            y = module(x)
            (sum((v * v).sum() for v in y.values()) + module.token.sum()).backward()
            grads.append({n: p.grad.clone() for n, p in module.parameter_state().items()})
        results.append((grads, len(started), adjoints.count(True)))
    (agreed, agreements, agreed_adjoints), (declared, none, declared_adjoints) = results
    problems = [f"agreements {agreements}, {none}"] if (agreements, none) != (2, 0) else []
    problems += (
        [f"adjoints {agreed_adjoints}, {declared_adjoints}"]
        if (agreed_adjoints, declared_adjoints) != (0, 0)
        else []
    )
    problems += [f"d{n} differs" for a, d in zip(agreed, declared) for n in a if not torch.equal(a[n], d[n])]
    collective_assert(not problems, f"rank {comm.rank}: " + "; ".join(problems))
