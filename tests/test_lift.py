"""Proving other frameworks' backward passes: lifting black boxes into operators by probing."""

import numpy as np
import pytest

import verify
from linop import Block, Copy, Space
from verify.lift import Lifted, LiftError, lift, probe, prove_backward

SHARDS = 4
BULK = 3


# -- numpy callables with a second callable as the claimed adjoint ------------------------------
def test_numpy_roll_with_the_opposite_roll_is_proven():
    proof = prove_backward(
        lambda x: np.roll(x, 1), {"x": (5,)}, {"y": (5,)}, adjoint=lambda y: np.roll(y, -1)
    )
    assert proof and proof.exact and "5x5 int64" in proof.detail


def test_numpy_roll_with_itself_as_adjoint_is_refuted_with_named_entries():
    proof = prove_backward(lambda x: np.roll(x, 1), {"x": (4,)}, {"y": (4,)}, adjoint=lambda y: np.roll(y, 1))
    assert not proof
    first = proof.mismatches[0]
    assert (str(first.row), str(first.column), first.left, first.right) == ("x[0]", "y[1]", 0, 1)
    assert proof.count == 8


def test_probing_is_exact_in_integers_and_matches_the_linop_tree():
    space = Space([Block("a", (3,)), Block("b", (3,))])
    copy = Copy(space["a"], space["b"])
    lifted = lift(
        lambda a, b: (a, a.copy()), space, space, adjoint=lambda a, b: (a + b, np.zeros_like(b)), label="copy"
    )
    assert lifted.matrix.dtype == np.int64
    assert verify.equal(lifted, copy) and verify.exact_adjoint(lifted)
    assert lifted.H.H == lifted and str(lifted.H) == "Lifted[copy]*"
    state = space.random(np.random.default_rng(0))
    assert all(np.array_equal(lifted(state)[n], copy(state)[n]) for n in space.names)


def test_a_nonlinear_function_is_refused_naming_the_entry():
    with pytest.raises(LiftError, match=r"not linear: .* at y\[1\]"):
        lift(lambda x: x * np.array([1.0, 2.0]) ** np.abs(x), {"x": (2,)}, {"y": (2,)}, adjoint=lambda y: y)


@pytest.mark.parametrize(
    "forward, message",
    [
        (lambda x: np.zeros(3), "returned shape"),
        (lambda x: (x, x), "returned 2 array"),
        (lambda x: {"z": x}, "returned blocks"),
    ],
    ids=["shape", "count", "names"],
)
def test_wrong_outputs_are_typed_errors(forward, message):
    with pytest.raises(LiftError, match=message):
        lift(forward, {"x": (2,)}, {"y": (2,)}, adjoint=lambda y: y)


def test_numpy_needs_an_adjoint():
    with pytest.raises(LiftError, match="pass adjoint="):
        lift(lambda x: x, {"x": (2,)}, {"y": (2,)})


def test_probe_batches_give_the_same_matrix():
    rng = np.random.default_rng(3)
    dense = rng.integers(-2, 3, size=(5, 7))
    matrices = [probe(lambda v: v @ dense.T, 7, 5, batch=b) for b in (1, 3, 64)]
    assert all((m != matrices[0]).nnz == 0 for m in matrices) and np.array_equal(matrices[0].toarray(), dense)


# -- torch: its own functions and autograd backward are proven ------------------------------
def _torch():
    return pytest.importorskip("torch", reason="torch is not installed (the torch extra)")


@pytest.mark.parametrize(
    "name, call, shape_in, shape_out",
    [
        ("roll", lambda t, nnf: t.roll(2, 0), (5,), (5,)),
        ("roll-2d", lambda t, nnf: t.roll((1, -2), (0, 1)), (3, 4), (3, 4)),
        ("pad-reflect", lambda t, nnf: nnf.pad(t, (2, 3), mode="reflect"), (2, 6), (2, 11)),
        ("pad-circular", lambda t, nnf: nnf.pad(t, (2, 3), mode="circular"), (2, 6), (2, 11)),
        ("pad-reflect-2d", lambda t, nnf: nnf.pad(t, (1, 2, 2, 1), mode="reflect"), (1, 4, 5), (1, 7, 8)),
        ("pad-circular-2d", lambda t, nnf: nnf.pad(t, (1, 2, 2, 1), mode="circular"), (1, 4, 5), (1, 7, 8)),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_torch_functions_and_their_autograd_backward_are_proven(name, call, shape_in, shape_out):
    torch = _torch()
    functional = torch.nn.functional
    proof = prove_backward(
        lambda x: call(x, functional), {"x": shape_in}, {"y": shape_out}, framework="torch"
    )
    assert proof and proof.exact, proof.detail


def _halo_function(torch, *, wrong):
    """A periodic 1-D halo exchange over SHARDS shards, each a block of BULK entries with one halo
    cell on each side, as a torch autograd.Function; the wrong backward re-applies the forward
    exchange to the gradient (as if the exchange were self-adjoint), the right one adds each
    received halo's gradient back into the bulk entry it was copied from, then clears the halos."""

    def exchange(shards):
        out = [s.clone() for s in shards]
        for r in range(SHARDS):
            out[r][0] = shards[(r - 1) % SHARDS][BULK]
            out[r][BULK + 1] = shards[(r + 1) % SHARDS][1]
        return out

    def exchange_adjoint(grads):
        back = [g.clone() for g in grads]
        for b in back:
            b[0] = 0
            b[BULK + 1] = 0
        for r in range(SHARDS):
            back[(r - 1) % SHARDS][BULK] += grads[r][0]
            back[(r + 1) % SHARDS][1] += grads[r][BULK + 1]
        return back

    class Halo(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *shards):
            return tuple(exchange(shards))

        @staticmethod
        def backward(ctx, *grads):
            return tuple(exchange(grads) if wrong else exchange_adjoint(grads))

    return Halo


def _shard_spaces(sizes, name):
    return Space([Block(f"{name}{r}", (size,), worker=r) for r, size in enumerate(sizes)])


def test_halo_exchange_backward_that_reapplies_the_forward_is_refuted():
    torch = _torch()
    shards = _shard_spaces([BULK + 2] * SHARDS, "x")
    halo = _halo_function(torch, wrong=True)
    proof = prove_backward(halo.apply, shards, shards, framework="torch", label="halo")
    assert not proof
    # Halo cell x0[0] received x3[3] (the last bulk entry of its left neighbour). The claimed
    # backward copies gradient y3[3] into x0[0] (whose value the forward overwrote: its true
    # gradient is 0) and never adds y0[0]'s gradient back into x3[3]: 4 wrong entries per shard.
    assert proof.count == 4 * SHARDS
    assert "row x0[0], column x3[3]: 1 versus 0" in proof.detail
    assert any((str(m.row), str(m.column)) == ("x1[0]", "x0[3]") for m in proof.mismatches)
    missing = verify.exact_adjoint(proof_operator := lift(halo.apply, shards, shards, framework="torch"))
    assert (
        not missing and proof_operator.H.to_sparse()[shards.offset("x3") + 3, 0] == 0
    )  # x3[3] <- y0[0] lost


def test_halo_exchange_with_the_true_adjoint_is_proven():
    torch = _torch()
    shards = _shard_spaces([BULK + 2] * SHARDS, "x")
    assert prove_backward(_halo_function(torch, wrong=False).apply, shards, shards, framework="torch")


def _all_gather_function(torch, sizes, *, wrong):
    """All-gather of uneven shards (torch.chunk's sizes) into a full copy per rank; the wrong
    backward assumes every shard has total // ranks rows, so a longer shard's last row gets no
    gradient."""
    total, ranks = sum(sizes), len(sizes)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).tolist()

    class AllGather(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *shards):
            full = torch.cat(shards)
            return tuple(full.clone() for _ in range(ranks))

        @staticmethod
        def backward(ctx, *grads):
            summed = sum(grads)
            back = []
            for offset, size in zip(offsets, sizes):
                rows = total // ranks if wrong else size
                piece = torch.zeros(size, dtype=summed.dtype)
                piece[:rows] = summed[offset : offset + rows]
                back.append(piece)
            return tuple(back)

    return AllGather


def test_uneven_all_gather_backward_that_drops_a_row_is_refuted():
    torch = _torch()
    sizes = [len(c) for c in torch.arange(8).chunk(3)]  # (3, 3, 2)
    shards, copies = _shard_spaces(sizes, "x"), _shard_spaces([8] * 3, "g")
    proof = prove_backward(
        _all_gather_function(torch, sizes, wrong=True).apply, shards, copies, framework="torch"
    )
    assert not proof
    assert {str(m.row) for m in proof.mismatches} == {"x0[2]", "x1[2]"}
    assert proof.count == 6  # two rows, each copied to three ranks
    right = _all_gather_function(torch, sizes, wrong=False).apply
    assert prove_backward(right, shards, copies, framework="torch")


def test_torch_second_callable_as_the_claimed_adjoint():
    _torch()
    proof = prove_backward(
        lambda x: x.roll(1), {"x": (4,)}, {"y": (4,)}, adjoint=lambda y: y.roll(1), framework="torch"
    )
    assert not proof and str(proof.mismatches[0].row) == "x[0]"


# -- jax ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, call, shape_out",
    [
        ("roll", lambda x, jnp: jnp.roll(x, 2), (5,)),
        ("pad-reflect", lambda x, jnp: jnp.pad(x, 2, mode="reflect"), (9,)),
        ("pad-wrap", lambda x, jnp: jnp.pad(x, (1, 3), mode="wrap"), (9,)),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_jax_functions_and_their_vjp_are_proven(name, call, shape_out):
    jnp = pytest.importorskip("jax.numpy", reason="jax is not installed (the jax extra)")
    assert prove_backward(lambda x: call(x, jnp), {"x": (5,)}, {"y": shape_out}, framework="jax")


def test_jax_custom_vjp_with_a_wrong_backward_is_refuted():
    jax = pytest.importorskip("jax", reason="jax is not installed (the jax extra)")
    shift = jax.custom_vjp(lambda x: jax.numpy.roll(x, 1))
    shift.defvjp(lambda x: (jax.numpy.roll(x, 1), None), lambda _, ct: (jax.numpy.roll(ct, 1),))
    proof = prove_backward(shift, {"x": (4,)}, {"y": (4,)}, framework="jax")
    assert not proof and proof.count == 8


def test_lifted_is_a_node_like_any_other():
    lifted = lift(lambda x: x[::-1].copy(), {"x": (3,)}, {"x": (3,)}, adjoint=lambda y: y[::-1].copy())
    assert isinstance(lifted, Lifted)
    assert verify.exact_adjoint(lifted @ lifted) and verify.adjoint_test(2 * lifted + lifted.H)
