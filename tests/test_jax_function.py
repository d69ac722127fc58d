"""Trees as JAX functions with their transpose registered: grad, vjp, linear_transpose, jit, vmap."""

import numpy as np
import pytest

from linop import (
    Block,
    Clear,
    Copy,
    DistributedTensor,
    Kernel,
    Move,
    Partition,
    SendRecv,
    Space,
    halo_windows,
)

jax = pytest.importorskip("jax", reason="jax is not installed (the jax extra: pip install -e '.[jax]')")
import jax.numpy as jnp  # noqa: E402
from jax.test_util import check_grads  # noqa: E402

from linop.frameworks.jax_function import JaxOperator, function  # noqa: E402

jax.config.update("jax_enable_x64", True)  # float64 checks (this process runs jax only for these tests)

SPACE = Space([Block("a", (4,), worker=0), Block("b", (4,), worker=1)])
U = DistributedTensor("u", (6, 5), Partition.grid((2, 2)))
TREES = {
    "copy-sendrecv-clear": 2 * SendRecv(SPACE["a"][0:2], SPACE["b"][2:4]) @ Copy(SPACE["a"], SPACE["b"])
    - Clear(SPACE["a"]),
    "move-out-of-place": Move(SPACE["b"], "c"),
    "halo-windows-3x3": halo_windows(U, Kernel(3, padding=1)),
    "complex-scaled": (1 + 2j) * Copy(SPACE["a"], SPACE["b"]),
}


def _state(space, dtype, seed=0):
    return {
        name: jnp.asarray(v) for name, v in space.random(np.random.default_rng(seed), dtype=dtype).items()
    }


def _dtype(name):
    return np.complex128 if name.startswith("complex") else np.float64


def _flat(space, state):
    return space.flatten({name: np.asarray(value) for name, value in state.items()})


@pytest.mark.parametrize("name", list(TREES), ids=list(TREES))
def test_forward_equals_the_numpy_interpreter(name):
    op = TREES[name]
    x = _state(op.domain, _dtype(name))
    expected = op({k: np.asarray(v) for k, v in x.items()})
    for jitted in (False, True):
        f = jax.jit(function(op)) if jitted else function(op)
        got = f(x)
        assert all(np.array_equal(np.asarray(got[n]), expected[n]) for n in op.range.names)


@pytest.mark.parametrize("name", list(TREES), ids=list(TREES))
def test_linear_transpose_is_the_exact_transpose(name):
    op = TREES[name]
    x = _state(op.domain, _dtype(name))
    cotangent = _state(op.range, _dtype(name), seed=1)
    (back,) = jax.linear_transpose(function(op), x)(cotangent)
    matrix = op.to_sparse()
    assert np.allclose(_flat(op.domain, back), matrix.T @ _flat(op.range, cotangent), rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", list(TREES), ids=list(TREES))
def test_check_grads_forward_and_reverse(name):
    op = TREES[name]
    order = 1 if name == "halo-windows-3x3" else 2  # the largest tree: first order only
    check_grads(function(op), (_state(op.domain, _dtype(name)),), order=order, modes=("fwd", "rev"))


def test_grad_through_op_call_and_under_jit():
    """op(state) itself is differentiable: tracers route through the primitive."""
    op = TREES["copy-sendrecv-clear"]
    weights = _state(op.range, np.float64, seed=2)

    def loss(state):
        y = op(state)
        return sum(jnp.vdot(weights[n], y[n]) for n in op.range.names)

    x = _state(op.domain, np.float64)
    expected = op.H({n: np.asarray(v) for n, v in weights.items()})
    for gradient in (jax.grad(loss)(x), jax.jit(jax.grad(loss))(x)):
        assert all(
            np.allclose(np.asarray(gradient[n]), expected[n], rtol=0, atol=1e-12) for n in op.domain.names
        )


def test_grad_with_respect_to_one_input_block_only():
    """The gradient of one domain block, the other held fixed (a defined primal: it gets no
    cotangent; jax.core.get_aval, which the rule once called for it, is gone from JAX)."""
    op = TREES["copy-sendrecv-clear"]
    weights = _state(op.range, np.float64, seed=3)
    x = _state(op.domain, np.float64)

    def loss(a):
        y = function(op)({**x, "a": a})
        return sum(jnp.vdot(weights[n], y[n]) for n in op.range.names)

    expected = op.H({n: np.asarray(v) for n, v in weights.items()})["a"]
    assert np.allclose(np.asarray(jax.jit(jax.grad(loss))(x["a"])), expected, rtol=0, atol=1e-12)


def test_vmap_maps_over_a_batch():
    op = TREES["copy-sendrecv-clear"]
    batch = {
        n: jnp.stack([_state(op.domain, np.float64, seed=s)[n] for s in range(3)]) for n in op.domain.names
    }
    got = jax.vmap(function(op))(batch)
    for i in range(3):
        expected = op({n: np.asarray(batch[n][i]) for n in op.domain.names})
        assert all(np.array_equal(np.asarray(got[n][i]), expected[n]) for n in op.range.names)


def test_a_wrong_transpose_would_be_caught():
    """check_grads is a real check: a function whose registered transpose is the forward fails."""
    op = TREES["copy-sendrecv-clear"]
    assert op.H != op
    wrong = jax.custom_vjp(lambda x: function(op)(x))
    wrong.defvjp(lambda x: (function(op)(x), None), lambda _, ct: (function(op.H.H)(_pad(ct, op)),))
    with pytest.raises(AssertionError):
        check_grads(wrong, (_state(op.domain, np.float64),), order=1, modes=("rev",))


def _pad(ct, op):
    return {n: ct[n] for n in op.domain.names}


def test_repr_and_adjoint_wrapper():
    f = function(Copy(SPACE["a"], SPACE["b"]))
    assert isinstance(f.H, JaxOperator) and "C[a -> b]" in repr(f)


REDUCE = __import__("linop").AllReduce(DistributedTensor("t", (8,), Partition.grid((4,))), (0,))
"""An all-reduce over 4 workers (each output entry the sum of 4 input entries)."""


@pytest.mark.parametrize(
    ("dtype", "value", "x64"),
    [
        (np.uint8, 200, True),
        (np.uint8, 200, False),
        (np.int16, 30000, True),
        (np.int16, 30000, False),
        (np.int32, 2**30 + 5, True),
        (np.int32, 2**30 + 5, False),
        (np.int64, 3, True),  # no int64 arrays in JAX without x64
    ],
    ids=["uint8-x64", "uint8-x32", "int16-x64", "int16-x32", "int32-x64", "int32-x32", "int64-x64"],
)
def test_integer_sums_are_exact_or_refused_never_wrapped(dtype, value, x64):
    """The host callback's output dtype is the interpreters' for every value of the input
    dtype (fixed before the values are known): uint8 and int16 sums widen (int64 with x64,
    int32 without); an int32 sum widens to int64 with x64 and is refused without (JAX holds
    no wider integer); an int64 sum may pass 2**62 and is refused. Before, the dtype came from
    a run on zeros and the exact result was cast back: 200 x 4 in uint8 gave 32."""
    from linop.errors import IntegerOverflowError

    with jax.enable_x64(x64):
        state = {b.name: jnp.full(b.shape, value, dtype) for b in REDUCE.domain}
        widened = np.dtype(np.int64 if x64 else np.int32)
        for f in (function(REDUCE), jax.jit(function(REDUCE))):
            if dtype == np.int64:
                with pytest.raises(IntegerOverflowError, match="beyond int64"):
                    f(state)
            elif dtype == np.int32 and not x64:
                with pytest.raises(IntegerOverflowError, match="enable x64"):
                    f(state)
            else:
                got = f(state)
                for name in REDUCE.range.names:
                    assert got[name].dtype == widened, (name, got[name].dtype)
                    assert np.asarray(got[name]).tolist() == [4 * value] * 2, (name, got[name])


def test_a_copy_keeps_the_integer_dtype_even_at_its_extremes():
    """A tree that only copies keeps int32 without x64, the most negative int32 included."""
    op = Copy(SPACE["a"], SPACE["b"])
    with jax.enable_x64(False):
        extreme = np.iinfo(np.int32).min
        got = function(op)({"a": jnp.full(4, extreme, jnp.int32), "b": jnp.zeros(4, jnp.int32)})
    assert got["b"].dtype == np.int32 and np.asarray(got["b"]).tolist() == [extreme] * 4


def test_string_blocks_get_linops_dtype_error():
    from linop.errors import DtypeError

    op = Copy(SPACE["a"], SPACE["b"])
    with pytest.raises(DtypeError, match=r"block 'a' has dtype <U1 \(string\)"):
        function(op)({"a": np.full(4, "a"), "b": np.zeros(4)})
