"""Any array library at the interpreters' edge, through the array API standard.

The numpy and MPI interpreters compute on numpy arrays. A state may instead hold arrays of any
library that ``array-api-compat`` recognizes (PyTorch tensors, JAX arrays, CuPy arrays,
``array-api-strict`` arrays, or any object with ``__array_namespace__``): at the entry they are
viewed as numpy arrays (without a copy where the library allows: torch CPU tensors, DLPack
exporters), the tree runs, and at the exit every block comes back as an array of the same
library, dtype and device. One state holds one library: blocks of two libraries (numpy among
them) are an :class:`ArrayLibraryError` naming one block of each.

Plain Python values (lists, numbers) are neutral: they take the library of the other blocks.
Blocks passed through unchanged come back as the caller's own array objects (the numpy
interpreter returns read-only views instead; other libraries have no read-only view).

Differentiation is the entry point's business (:mod:`linop.entry`, which sends a torch state
that requires a gradient and a state of JAX tracers to ``linop.frameworks``): this module never
imports the frameworks, and :func:`apply` refuses a state that needs differentiation
(:func:`needs_autodiff`) rather than silently dropping its gradient.

Arrays on an accelerator (torch CUDA tensors, CuPy arrays) are staged through host memory:
copied to numpy, computed, copied back to their device.

The MPI interpreter calls :func:`mpi_entry` at its public entry (``mpi_backend.apply`` and
``DistributedPlan.bind``): a rank's torch CPU tensors are sent and received straight from and
into their own memory (numpy views, which mpi4py sends as buffers), in place and through bound
plans included; accelerator arrays are staged through host memory, which works with any MPI
(a CUDA-aware MPI could take DLPack / ``__cuda_array_interface__`` buffers directly, but the
interpreter's local steps run on numpy, so the host copy is needed anyway). A rank that holds
no block cannot know the library and gets numpy arrays back.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import array_api_compat as compat
import numpy as np

from ..errors import ArrayLibraryError, StateError

__all__ = [
    "ArrayLibraryError",
    "Library",
    "library_of",
    "to_numpy",
    "from_numpy",
    "needs_autodiff",
    "apply",
    "mpi_entry",
    "MPIEntry",
    "ForeignBoundPlan",
]


@dataclass(frozen=True)
class Library:
    """The array library, namespace and device of a state's blocks.

    Attributes
    ----------
    kind : str
        ``"torch"``, ``"jax"``, ``"cupy"`` or ``"array-api"`` (any other library, through the
        standard's namespace: ``array-api-strict`` is one).
    namespace : module
        The array API namespace (``array_api_compat.array_namespace``).
    device : object
        The device of every block.
    """

    kind: str
    namespace: Any
    device: Any


def _kind(array: Any) -> str:
    if compat.is_torch_array(array):
        return "torch"
    if compat.is_jax_array(array):
        return "jax"
    if compat.is_cupy_array(array):
        return "cupy"
    return "array-api"


def _is_foreign(value: Any) -> bool:
    return not isinstance(value, np.ndarray | np.generic) and compat.is_array_api_obj(value)


def library_of(state: Mapping[str, Any]) -> Library | None:
    """The library of a state's arrays, or None when every block is numpy (or a plain value).

    Raises
    ------
    ArrayLibraryError
        When blocks come from two libraries (numpy included) or lie on two devices.
    """
    values = state.values()
    if all(type(v) is np.ndarray for v in values):  # the common case, decided cheaply
        return None
    foreign = [(name, v) for name, v in state.items() if _is_foreign(v)]
    if not foreign:
        return None
    name, first = foreign[0]
    namespace = compat.array_namespace(first)
    device = compat.device(first)
    for other_name, other in state.items():
        if isinstance(other, np.ndarray | np.generic):
            raise ArrayLibraryError(
                f"the state mixes array libraries: block {other_name!r} is a numpy array, block "
                f"{name!r} a {type(first).__module__}.{type(first).__name__} (use one library per state)"
            )
    for other_name, other in foreign[1:]:
        if compat.array_namespace(other) is not namespace:
            raise ArrayLibraryError(
                f"the state mixes array libraries: block {name!r} is a {type(first).__module__}."
                f"{type(first).__name__}, block {other_name!r} a {type(other).__module__}."
                f"{type(other).__name__} (use one library per state)"
            )
        if compat.device(other) != device:
            raise ArrayLibraryError(
                f"the state mixes devices: block {name!r} is on {device}, block {other_name!r} on "
                f"{compat.device(other)} (move them to one device)"
            )
    return Library(_kind(first), namespace, device)


def _on_host(library: Library) -> bool:
    if library.kind == "torch":
        return library.device.type == "cpu"
    if library.kind == "cupy":
        return False
    return True


def to_numpy(name: str, value: Any, library: Library) -> np.ndarray:
    """Block ``name``'s array as a numpy array: a view sharing memory where the library
    allows (torch CPU tensors, DLPack exporters on the CPU), else a host copy.

    Raises
    ------
    ArrayLibraryError
        When numpy has no equivalent of the array's dtype.
    """
    if not _is_foreign(value):
        return np.asarray(value)
    try:
        if library.kind == "torch":
            tensor = value.detach()
            if tensor.is_conj() or tensor.is_neg():
                tensor = tensor.resolve_conj().resolve_neg()
            return tensor.cpu().numpy()
        if library.kind == "cupy":
            return value.get()
        if library.kind == "jax":
            return np.asarray(value)
        try:
            return np.from_dlpack(value)
        except (BufferError, TypeError, RuntimeError, ValueError):
            return np.asarray(compat.to_device(value, "cpu") if not _on_host(library) else value)
    except (TypeError, RuntimeError, BufferError, ValueError) as error:
        raise ArrayLibraryError(
            f"block {name!r}: the interpreter cannot read a {type(value).__name__} of dtype "
            f"{getattr(value, 'dtype', '?')} as a numpy array ({error})"
        ) from error


def from_numpy(array: np.ndarray, library: Library) -> Any:
    """A numpy result as an array of ``library`` on its device (same dtype). Torch CPU tensors
    share the numpy array's memory when it is writeable; other libraries copy."""
    if library.kind == "torch":
        import torch

        if not array.flags.writeable or any(s < 0 for s in array.strides):
            array = np.array(array)
        tensor = torch.from_numpy(array)
        return tensor if _on_host(library) else tensor.to(library.device)
    if library.kind == "jax":
        import jax

        return jax.device_put(array, library.device)
    if library.kind == "cupy":
        with library.device:
            return library.namespace.asarray(array)
    return library.namespace.asarray(np.array(array), device=library.device)


def _numpy_dtype(dtype: Any, library: Library) -> Any:
    """A library's dtype object (``torch.float32``) as numpy's; numpy-readable ones as they are."""
    if dtype is None or library.kind != "torch":
        return dtype
    import torch

    if isinstance(dtype, torch.dtype):
        return torch.empty(0, dtype=dtype).numpy().dtype
    return dtype


def needs_autodiff(state: Mapping[str, Any], library: Library) -> bool:
    """True when a block of ``state`` requires a gradient (torch, grad mode on) or is a JAX tracer."""
    if library.kind == "torch":
        import torch

        return torch.is_grad_enabled() and any(getattr(v, "requires_grad", False) for v in state.values())
    if library.kind == "jax":
        import jax

        return any(isinstance(v, jax.core.Tracer) for v in state.values())
    return False


Interpreter = Callable[..., dict[str, np.ndarray]]


def apply(
    op: Any,
    state: Mapping[str, Any],
    library: Library,
    interpret: Interpreter,
    *,
    inplace: bool = False,
    dtype: Any = None,
) -> dict[str, Any]:
    """Apply ``op`` to a state of ``library``'s arrays with a numpy interpreter ``interpret``
    (``interpret(op, numpy_state, inplace=..., dtype=...)``); the result in ``library``.

    Out of place, the result's blocks are arrays of ``library`` on its device; blocks passed
    through unchanged are the caller's own objects. In place, the caller's arrays receive the
    result (torch tensors and writeable DLPack views directly, accelerator arrays through a
    host copy written back); JAX arrays are immutable and tensors that require a gradient
    cannot be written behind autograd's back: both are a :class:`StateError`.
    """
    if needs_autodiff(state, library):
        raise StateError(
            "a block requires a gradient: apply with op(state), which differentiates through "
            "linop.frameworks (or detach the tensors)"
        )
    dtype = _numpy_dtype(dtype, library)
    arrays = {name: to_numpy(name, value, library) for name, value in state.items()}
    if inplace:
        # in place, the result is the caller's own state object (a dict, as LinearOperator.apply takes)
        return cast(dict[str, Any], _apply_in_place(op, state, arrays, library, interpret, dtype))
    result = interpret(op, arrays, dtype=dtype)
    return _wrap_result(result, state, arrays, library)


def _wrap_result(
    result: Mapping[str, np.ndarray],
    state: Mapping[str, Any],
    arrays: Mapping[str, np.ndarray],
    library: Library,
) -> dict[str, Any]:
    originals = {
        _signature(array): state[name]
        for name, array in arrays.items()
        if array.size and _is_foreign(state[name])
    }
    wrapped: dict[str, Any] = {}
    for name, array in result.items():
        original = originals.get(_signature(array))
        wrapped[name] = original if original is not None else from_numpy(array, library)
    return wrapped


def _signature(array: np.ndarray) -> tuple[Any, ...]:
    """What identifies a view of exactly one array's memory: its address, shape, strides and dtype."""
    return (array.__array_interface__["data"][0], array.shape, array.strides, array.dtype.str)


def _apply_in_place(
    op: Any,
    state: Mapping[str, Any],
    arrays: dict[str, np.ndarray],
    library: Library,
    interpret: Interpreter,
    dtype: Any,
) -> Mapping[str, Any]:
    if library.kind == "jax":
        raise StateError("in-place application needs writeable arrays; JAX arrays are immutable")
    shared = _shares_caller_memory(state, arrays, library)
    copies = {name: arrays[name] if name in shared else np.array(arrays[name]) for name in arrays}
    interpret(op, copies, inplace=True, dtype=dtype)
    for name, host in copies.items():
        if name in shared:
            continue
        target = state[name]
        if library.kind == "torch":
            import torch

            target.copy_(torch.from_numpy(host))
        else:
            try:
                target[...] = from_numpy(host, library)
            except (TypeError, ValueError, AttributeError) as error:
                raise StateError(
                    f"in-place application cannot write block {name!r}: its "
                    f"{type(target).__name__} does not support assignment ({error})"
                ) from error
    return state


def _shares_caller_memory(
    state: Mapping[str, Any], arrays: Mapping[str, np.ndarray], library: Library
) -> set[str]:
    """Blocks whose numpy view is the caller's own memory, writeable."""
    if not _on_host(library):
        return set()
    return {name for name, array in arrays.items() if array.flags.writeable}


class MPIEntry:
    """A rank's local state at the MPI interpreter's entry, as numpy arrays, and the way back.

    Built by :func:`mpi_entry`. ``arrays`` is what the interpreter runs on: the caller's own
    numpy state, or numpy views of another library's arrays (their memory itself for torch CPU
    tensors and writeable DLPack exporters, so in-place runs and bound plans act on it; host
    copies for accelerator arrays). :meth:`result` and :meth:`bound` turn what the interpreter
    returns back into the caller's library.
    """

    def __init__(self, state: Any, arrays: Any, library: Library | None) -> None:
        self.state = state
        self.arrays = arrays
        self.library = library
        self.staged = (
            set()
            if library is None
            else {name for name in arrays if name not in _shares_caller_memory(state, arrays, library)}
        )

    def result(self, result: Any, *, inplace: bool) -> Any:
        """The interpreter's result in the caller's library (in place: the caller's dict, its
        staged blocks written back)."""
        if self.library is None:
            return result
        if inplace:
            self.write_back()
            return self.state
        return _wrap_result(result, self.state, self.arrays, self.library)

    def write_back(self) -> None:
        """Copy staged host arrays back into the caller's (accelerator) arrays."""
        for name in self.staged:
            target, host = self.state[name], self.arrays[name]
            if self.library is not None and self.library.kind == "torch":
                import torch

                target.copy_(torch.from_numpy(host))
            else:
                target[...] = from_numpy(host, self.library)  # type: ignore[arg-type]

    def stage_in(self) -> None:
        """Refresh staged host arrays from the caller's arrays (before a bound call)."""
        for name in self.staged:
            np.copyto(self.arrays[name], to_numpy(name, self.state[name], self.library))  # type: ignore[arg-type]

    def bound(self, bound: Any, *, inplace: bool) -> Any:
        """A bound plan whose calls take and give the caller's library (itself for numpy)."""
        return bound if self.library is None else ForeignBoundPlan(bound, self, inplace)


class ForeignBoundPlan:
    """A bound MPI plan (:class:`linop.backends.mpi.bound.BoundPlan`) on another library's
    arrays: each call refreshes staged host copies, runs the plan, and returns this rank's
    blocks in that library (in place: the caller's own arrays, updated)."""

    def __init__(self, bound: Any, entry: MPIEntry, inplace: bool) -> None:
        self.plan = bound
        self.entry = entry
        self.inplace = inplace

    @property
    def persistent(self) -> bool:
        """Whether the underlying bound plan runs persistent requests only."""
        return bool(self.plan.persistent)

    def __call__(self) -> Any:
        self.entry.stage_in()
        return self.entry.result(self.plan(), inplace=self.inplace)

    def free(self) -> None:
        """Release the persistent requests."""
        self.plan.free()


def mpi_entry(state: Any) -> MPIEntry:
    """For the MPI interpreter's public entry (``apply``, ``bind``): a rank's local state as
    numpy arrays, and the way back to the caller's library.

    Never raises: a state that cannot be converted (mixed libraries, an unreadable dtype) is
    passed on as it is, so that the interpreter's collective check fails on every rank
    together, naming the block, instead of this rank alone raising while its peers wait.
    Tensors that require a gradient are read detached (differentiate across ranks with
    :class:`linop.frameworks.torch_function.TorchOperator` and ``comm=``).
    """
    if not isinstance(state, Mapping):
        return MPIEntry(state, state, None)
    try:
        library = library_of(state)
        if library is None:
            return MPIEntry(state, state, None)
        arrays = {name: to_numpy(name, value, library) for name, value in state.items()}
    except (ArrayLibraryError, TypeError, ValueError):  # e.g. a ragged list beside a tensor
        return MPIEntry(state, state, None)
    return MPIEntry(state, arrays, library)
