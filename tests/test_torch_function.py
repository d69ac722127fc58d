"""Trees as PyTorch autograd functions: forward the interpreter, backward the adjoint tree."""

import numpy as np
import pytest

from linop import (
    Block,
    Broadcast,
    Clear,
    Copy,
    DistributedTensor,
    Kernel,
    Move,
    Partition,
    Repartition,
    SendRecv,
    Space,
    StateError,
    halo_windows,
)

torch = pytest.importorskip(
    "torch", reason="torch is not installed (the torch extra: pip install -e '.[torch]')"
)
from linop.frameworks.torch_function import OperatorModule, TorchOperator, function  # noqa: E402

SPACE = Space([Block("a", (4,), worker=0), Block("b", (4,), worker=1)])


def _trees():
    u = DistributedTensor("u", (6, 5), Partition.grid((2, 2)))
    x = DistributedTensor("x", (7, 5), Partition.grid((3, 1)))
    y = DistributedTensor("y", (7, 5), Partition.grid((1, 2), first=3))
    w = DistributedTensor("w", (2, 3), Partition.grid((1, 1)))
    return {
        "copy-sendrecv-clear": 2 * SendRecv(SPACE["a"][0:2], SPACE["b"][2:4]) @ Copy(SPACE["a"], SPACE["b"])
        - Clear(SPACE["a"]),
        "move-out-of-place": Move(SPACE["b"], "c"),
        "halo-windows-3x3": halo_windows(u, Kernel(3, padding=1)),
        "repartition-3x1-to-1x2": Repartition(x, y),
        "broadcast-2x2": Broadcast(w, Partition.grid((2, 2)), "w_copy"),
    }


TREES = _trees()
SECOND_ORDER = ("copy-sendrecv-clear", "broadcast-2x2")


def _inputs(op, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(b.shape, dtype=dtype, generator=generator, requires_grad=True) for b in op.domain
    )


@pytest.mark.parametrize("name", list(TREES), ids=list(TREES))
def test_gradcheck_and_gradgradcheck_in_float64(name):
    f = function(TREES[name])
    inputs = _inputs(TREES[name], torch.float64)
    assert torch.autograd.gradcheck(f.tensors, inputs)
    if name in SECOND_ORDER:  # the backward is the same Function on op.H: two trees suffice
        assert torch.autograd.gradgradcheck(f.tensors, inputs)


def test_gradcheck_complex_scaled_tree():
    op = (1 + 2j) * TREES["copy-sendrecv-clear"]
    inputs = _inputs(op, torch.complex128)
    assert torch.autograd.gradcheck(function(op).tensors, inputs)
    assert torch.autograd.gradgradcheck(function(op).tensors, inputs)


@pytest.mark.parametrize("name", list(TREES), ids=list(TREES))
def test_backward_is_the_adjoint_tree_exactly(name):
    """The gradient of <y_bar, A x> is A* y_bar, entry for entry what op.H computes (integers)."""
    op = TREES[name]
    x = {b.name: torch.zeros(b.shape, dtype=torch.float64, requires_grad=True) for b in op.domain}
    cotangent = op.range.random(np.random.default_rng(1), dtype=np.int64)
    y = function(op)(x)
    sum((y[n] * torch.from_numpy(cotangent[n]).double()).sum() for n in op.range.names).backward()
    expected = op.H({n: v.astype(np.float64) for n, v in cotangent.items()})
    for block in op.domain:
        assert np.array_equal(x[block.name].grad.numpy(), expected[block.name]), block.name


def test_a_wrong_backward_would_be_caught():
    """gradcheck is a real check here: the same Function with a deliberately wrong adjoint fails."""
    op = TREES["copy-sendrecv-clear"]
    f = TorchOperator(op)
    wrong = TorchOperator(op)._runner.adjoint.__class__(op, None, None)  # forward tree in place of op.H
    f._runner._adjoint = wrong
    inputs = _inputs(op, torch.float64)
    assert not torch.autograd.gradcheck(f.tensors, inputs, raise_exception=False)


def test_module_composes_with_torch_layers_and_trains():
    op = Copy(SPACE["a"], SPACE["b"])
    module = OperatorModule(op)
    scale = torch.nn.Parameter(torch.tensor(3.0, dtype=torch.float64))
    x = torch.arange(4.0, dtype=torch.float64)
    out = module({"a": scale * x, "b": torch.zeros(4, dtype=torch.float64)})
    out["b"].sum().backward()
    assert scale.grad.item() == pytest.approx(float(x.sum()))
    assert "C[a -> b]" in repr(module)


def test_outputs_do_not_alias_inputs():
    a = torch.arange(4.0, requires_grad=True)
    result = function(Move(SPACE["b"], "c"))({"a": a, "b": torch.zeros(4)})
    assert result["a"].data_ptr() != a.data_ptr()


@pytest.mark.parametrize(
    "state, message",
    [
        ({"a": "tensor"}, "missing block"),
        ({"a": "tensor", "b": "tensor", "z": "tensor"}, "unexpected block"),
        ({"a": "tensor", "b": np.zeros(4)}, "must be a torch tensor"),
    ],
    ids=["missing", "extra", "not-a-tensor"],
)
def test_bad_states_are_typed_errors(state, message):
    state = {k: (torch.zeros(4) if isinstance(v, str) else v) for k, v in state.items()}
    with pytest.raises(StateError, match=message):
        function(Copy(SPACE["a"], SPACE["b"]))(state)


def test_float32_stays_float32_and_the_adjoint_wrapper():
    f = function(Copy(SPACE["a"], SPACE["b"]))
    y = f({"a": torch.arange(4.0), "b": torch.zeros(4)})
    assert y["b"].dtype == torch.float32
    back = f.H(y)
    assert back["a"].tolist() == [0.0, 2.0, 4.0, 6.0] and back["b"].tolist() == [0.0] * 4


def test_the_dtype_agreement_is_one_reduction_per_call_and_only_where_a_rank_has_no_inputs(monkeypatch):
    """``_Runner.agree`` with a stand-in for the MPI reduction (``_comm_max``), the peers' flag
    given: nothing is sent for a tree whose every rank has inputs, nor before the first binding;
    for a tree that leaves a rank without inputs, one reduction per call however many steps of
    the call ask for it (a kept call's test, ``bound_views``, the general path), the next call
    its own; a peer's change frees this rank's binding although its own dtypes did not change."""
    from linop.frameworks import torch_function

    sent, peers = [], [0]

    def reduction(plan, value, doing):
        sent.append(value)
        return max(value, peers[0])

    monkeypatch.setattr(torch_function, "_comm_max", reduction)
    freed = []

    class Bound:
        def free(self):
            freed.append(self)

    runner = torch_function._Runner(TREES["broadcast-2x2"])
    for blind in (None, False):  # before the first binding; every rank has inputs
        runner._blind, runner._bound = blind, Bound()
        for _ in range(3):
            runner.agree(True)
    assert sent == [] and not runner._agreed
    runner._blind = True
    runner._bound = None  # no binding: every rank binds anyway
    runner.agree(False)
    assert sent == []
    bound = runner._bound = Bound()
    for call in range(2):
        for _ in range(3):  # the steps of one call
            runner.agree(False)
        assert sent == [0] * (call + 1) and runner._bound is bound
        runner._agreed = False  # the call ran
    peers[0] = 1  # a peer's inputs changed dtype
    runner.agree(False)
    assert sent == [0, 0, 0] and runner._bound is None and freed == [bound]
