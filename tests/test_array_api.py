"""Any array library in the numpy interpreter: the same library, dtype and device out."""

import numpy as np
import pytest

from linop import Add, Block, Clear, Copy, Move, SendRecv, Space, StateError
from linop.backends.array_api import ArrayLibraryError, library_of

xp = pytest.importorskip("array_api_strict", reason="array-api-strict is not installed (dev extra)")

SPACE = Space([Block("a", (4,), worker=0), Block("b", (4,), worker=1)])
TREE = 2 * SendRecv(SPACE["a"][0:2], SPACE["b"][2:4]) @ Copy(SPACE["a"], SPACE["b"]) - Clear(SPACE["a"])


def _strict(values, dtype):
    return xp.asarray(np.asarray(values, dtype=np.dtype(dtype)))


@pytest.mark.parametrize("dtype", ["float32", "float64", "int64", "complex128"], ids=str)
def test_strict_arrays_come_back_strict_with_their_dtype(dtype):
    state = {"a": _strict([1, 2, 3, 4], dtype), "b": _strict([5, 6, 7, 8], dtype)}
    result = TREE(state)
    expected = TREE({name: np.asarray([1, 2, 3, 4] if name == "a" else [5, 6, 7, 8], dtype) for name in "ab"})
    for name in "ab":
        assert type(result[name]) is type(state[name])
        assert result[name].dtype == state[name].dtype
        assert np.array_equal(np.from_dlpack(result[name]), expected[name])


def test_strict_device_is_kept():
    device = xp.Device("device1")
    state = {name: xp.asarray([1.0, 2.0, 3.0, 4.0], device=device) for name in "ab"}
    result = TREE(state)
    assert all(result[name].device == device for name in "ab")


def test_strict_input_is_not_mutated_and_passed_blocks_are_the_callers():
    state = {"a": _strict([1, 2, 3, 4], "float64"), "b": _strict([0, 0, 0, 0], "float64")}
    result = Move(SPACE["b"], "c")(state)
    assert result["a"] is state["a"] and result["c"] is state["b"]
    copied = Copy(SPACE["a"], SPACE["b"])(state)
    assert np.from_dlpack(state["b"]).tolist() == [0, 0, 0, 0]
    assert np.from_dlpack(copied["b"]).tolist() == [1, 2, 3, 4]


def test_strict_in_place_writes_the_callers_arrays():
    state = {"a": _strict([1, 2, 3, 4], "float64"), "b": _strict([0, 0, 0, 0], "float64")}
    b = state["b"]
    assert Add(SPACE["a"], SPACE["b"]).apply(state, inplace=True) is state
    assert state["b"] is b and np.from_dlpack(b).tolist() == [1, 2, 3, 4]


def test_plain_values_take_the_library_of_the_others():
    result = TREE({"a": _strict([1, 2, 3, 4], "float64"), "b": [0.0, 0.0, 0.0, 0.0]})
    assert type(result["b"]) is type(_strict([0], "float64"))


@pytest.mark.parametrize(
    "state, message",
    [
        ({"a": np.zeros(4), "b": "strict"}, "block 'a' is a numpy array"),
        ({"a": "strict", "b": np.zeros(4)}, "block 'b' is a numpy array"),
    ],
    ids=["numpy-then-strict", "strict-then-numpy"],
)
def test_mixing_numpy_and_another_library_is_a_typed_error(state, message):
    state = {k: (_strict([0, 0, 0, 0], "float64") if isinstance(v, str) else v) for k, v in state.items()}
    with pytest.raises(ArrayLibraryError, match=message):
        TREE(state)


def test_mixing_devices_is_a_typed_error():
    state = {"a": xp.asarray([1.0] * 4), "b": xp.asarray([1.0] * 4, device=xp.Device("device1"))}
    with pytest.raises(ArrayLibraryError, match="mixes devices"):
        TREE(state)


def test_numpy_states_take_the_plain_path():
    assert library_of({"a": np.zeros(4), "b": [1, 2]}) is None
    assert library_of({}) is None


def test_shape_errors_still_name_the_block():
    with pytest.raises(StateError, match="block 'b' has shape"):
        TREE({"a": _strict([1, 2, 3, 4], "float64"), "b": _strict([1, 2], "float64")})


# -- torch (CPU) ---------------------------------------------------------------------------------
def _torch():
    return pytest.importorskip("torch", reason="torch is not installed (the torch extra)")


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "complex64"], ids=str)
def test_torch_tensors_come_back_as_tensors(dtype):
    torch = _torch()
    torch_dtype = getattr(torch, dtype)
    state = {"a": torch.arange(4).to(torch_dtype), "b": torch.arange(4, 8).to(torch_dtype)}
    result = TREE(state)
    expected = TREE({k: v.numpy() for k, v in state.items()})
    for name in "ab":
        assert isinstance(result[name], torch.Tensor) and result[name].dtype == torch_dtype
        assert result[name].device == state[name].device
        assert np.array_equal(result[name].numpy(), expected[name])
    assert state["b"].tolist() == [4, 5, 6, 7]


def test_torch_in_place_writes_the_tensors():
    torch = _torch()
    state = {"a": torch.arange(4.0), "b": torch.zeros(4)}
    b = state["b"]
    Add(SPACE["a"], SPACE["b"]).apply(state, inplace=True)
    assert state["b"] is b and b.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_torch_requiring_a_gradient_is_differentiated_not_refused():
    torch = _torch()
    a = torch.arange(4.0, requires_grad=True)
    result = Copy(SPACE["a"], SPACE["b"])({"a": a, "b": torch.zeros(4)})
    result["b"].sum().backward()
    assert a.grad.tolist() == [1.0, 1.0, 1.0, 1.0]  # C* = K_b S_{b->a}: each a_i reached b_i once


def test_the_numpy_interpreter_alone_refuses_a_state_needing_a_gradient():
    """Only the entry point (``op(state)``, :mod:`linop.entry`) reaches the frameworks; the
    interpreter called directly refuses rather than dropping the gradient."""
    from linop.backends import numpy as numpy_backend

    torch = _torch()
    state = {"a": torch.arange(4.0, requires_grad=True), "b": torch.zeros(4)}
    with pytest.raises(StateError, match="requires a gradient"):
        numpy_backend.apply(Copy(SPACE["a"], SPACE["b"]), state)
    detached = numpy_backend.apply(Copy(SPACE["a"], SPACE["b"]), {k: v.detach() for k, v in state.items()})
    assert detached["b"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_torch_in_place_on_a_tensor_requiring_a_gradient_is_refused():
    torch = _torch()
    state = {"a": torch.arange(4.0, requires_grad=True), "b": torch.zeros(4)}
    with pytest.raises(StateError, match="cannot be differentiated"):
        Add(SPACE["a"], SPACE["b"]).apply(state, inplace=True)


def test_torch_bfloat16_is_a_typed_error_naming_the_block():
    torch = _torch()
    state = {"a": torch.zeros(4, dtype=torch.bfloat16), "b": torch.zeros(4, dtype=torch.bfloat16)}
    with pytest.raises(ArrayLibraryError, match="block 'a'"):
        TREE(state)


def test_torch_and_jax_in_one_state_is_a_typed_error():
    torch = _torch()
    jnp = pytest.importorskip("jax.numpy", reason="jax is not installed (the jax extra)")
    with pytest.raises(ArrayLibraryError, match="mixes array libraries"):
        TREE({"a": torch.zeros(4), "b": jnp.zeros(4)})


def test_jax_arrays_come_back_as_jax_arrays_and_in_place_is_refused():
    jax = pytest.importorskip("jax", reason="jax is not installed (the jax extra)")
    state = {"a": jax.numpy.arange(4.0), "b": jax.numpy.zeros(4)}
    result = TREE(state)
    assert all(isinstance(result[name], jax.Array) for name in "ab")
    assert np.array_equal(np.asarray(result["b"]), TREE({k: np.asarray(v) for k, v in state.items()})["b"])
    with pytest.raises(StateError, match="immutable"):
        Add(SPACE["a"], SPACE["b"]).apply(state, inplace=True)


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@pytest.mark.skipif(
    not _has_cuda(),
    reason="no CUDA device: torch CUDA tensors are staged through host memory and come back on their device",
)
def test_torch_cuda_tensors_come_back_on_their_device():  # pragma: no cover - needs a GPU
    import torch

    state = {"a": torch.arange(4.0, device="cuda"), "b": torch.zeros(4, device="cuda")}
    result = TREE(state)
    assert all(result[name].device == state[name].device for name in "ab")
    Add(SPACE["a"], SPACE["b"]).apply(state, inplace=True)
    assert state["b"].cpu().tolist() == [0.0, 1.0, 2.0, 3.0]
