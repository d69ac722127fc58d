r"""Local operators: a user's sequential linear kernel on one worker's blocks.

A :class:`LocalOperator` carries computation into an operator tree: it consumes named *input*
blocks of its domain (all on one worker), produces named *output* blocks (new blocks on that
worker) and passes every other block through unchanged. With ``u`` the inputs raveled and
concatenated in the order given, ``v`` the outputs likewise, and ``K`` the kernel,

.. math::

    L : (x_{\text{others}}, u) \mapsto (x_{\text{others}}, v = K u), \qquad
    L^* : (x_{\text{others}}, v) \mapsto (x_{\text{others}}, u = K^* v)

(docs/theory.md#local-operators). The adjoint swaps the roles of inputs and outputs and uses
the kernel's adjoint: the conjugate transpose for a dense matrix, a ``scipy.sparse`` matrix or a
``scipy.sparse.linalg.LinearOperator``; the user's adjoint callable otherwise. Whether a
forward/adjoint pair of callables really is adjoint is a claim that ``verify`` checks
(``verify.exact_adjoint`` probes both callables into matrices; ``verify.adjoint_test`` uses
random states), never an assumption.

A local operator is not data movement, so it has no expansion into the primitives: it is a
*leaf* of every tree (its :meth:`~LocalOperator.expand` returns itself), and each interpreter
has a handler for it: numpy calls the kernel (:mod:`linop.backends.numpy.local`), sparse
materializes its matrix (:mod:`linop.backends.sparse.local`; callables are probed with unit
vectors), sympy (numpy over object arrays) uses its matrix, and MPI runs it on its owning rank
only (:mod:`linop.program.lowering_local`).

Equality is structural: two kernels are equal when they hold the same matrix content (a
stable content digest, never ``ndarray.__eq__``) or the very same callables / scipy operator
(identity), so ``L.H.H == L`` and local operators are hashable.
"""

from __future__ import annotations

import hashlib
import operator
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from .errors import (
    BlockExistsError,
    KernelOutputError,
    KernelWriteError,
    LocalOperatorError,
    NoMatrixError,
    NotLinearError,
    OperandError,
    SpaceMismatchError,
    UnknownBlockError,
    WorkerError,
)
from .kernel_template import KernelTemplate
from .linearity import linearity_problem
from .operator import LinearOperator
from .space import Block, Space

if TYPE_CHECKING:
    import scipy.sparse as sp

__all__ = [
    "KERNEL_KINDS",
    "KernelOutputError",
    "LocalKernel",
    "LocalOperator",
    "LocalOperatorError",
    "NoMatrixError",
    "local_operator",
    "matrix_callables",
]

_NO_OTHERS = Space()

PROBE_BATCH = 1024
"""How many unit vectors a vectorized callable is probed with per call."""


def _digest(*parts: bytes) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for part in parts:
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.hexdigest()


def _array_digest(array: np.ndarray) -> str:
    array = np.ascontiguousarray(array)
    if array.dtype == object:
        return _digest(b"object", repr(array.shape).encode(), repr(array.tolist()).encode())
    return _digest(array.dtype.str.encode(), repr(array.shape).encode(), array.tobytes())


def _qualname(function: object) -> str:
    module = getattr(function, "__module__", "") or ""
    name = getattr(function, "__qualname__", None) or type(function).__qualname__
    return f"{module}.{name}"


class LocalKernel:
    r"""A sequential linear map :math:`K : \mathbb{F}^n \to \mathbb{F}^m` and its adjoint.

    Made with :meth:`of` from a dense matrix, a ``scipy.sparse`` matrix, a
    ``scipy.sparse.linalg.LinearOperator`` or a pair of callables. Immutable: a matrix is
    copied and made read-only.

    Callables take one array per input block (in order) and return one array per output block
    (a single array when there is one output); the adjoint callable the other way round. With
    ``vectorized=True`` they also accept a leading batch axis (``(b, *shape)`` in, ``(b,
    *shape)`` out), which the sparse interpreter uses to probe ``PROBE_BATCH`` unit vectors per
    call.

    On JAX devices (:mod:`linop.frameworks.jax_sharded`, inside ``jit``) a dense matrix runs as
    it is; callables run only when marked traceable by JAX with ``jax=``: ``True`` (the
    callables themselves trace: jnp code, or array-API code without numpy calls) or a pair
    ``(forward, adjoint)`` of jnp callables doing what the numpy pair does. Device callables
    take one array per block *of the block's shape* (no batch axis: linop maps them over batch
    axes with ``jax.vmap``) and return new arrays likewise. That a device pair equals the numpy
    pair and is adjoint is a claim the tests of the lowering check (the lowered program against
    the numpy interpreter, its transpose against ``op.H``), never an assumption.

    Equality: same kind and same content digest (matrices), or the same callables or scipy
    operator object (identity). ``repr`` is stable across processes (digest or qualified
    names), which is what the MPI interpreter's tree fingerprint reads.
    """

    __slots__ = (
        "_adjoint",
        "_device",
        "_dtype",
        "_forward",
        "_key",
        "_kind",
        "_matrix",
        "_structure",
        "_template",
        "_text",
        "_vectorized",
    )

    def __init__(
        self,
        kind: str,
        *,
        matrix: Any = None,
        forward: Callable | None = None,
        adjoint: Callable | None = None,
        dtype: npt.DTypeLike | None = None,
        vectorized: bool = False,
        device: tuple[Callable, Callable] | KernelTemplate | None = None,
    ) -> None:
        self._kind = kind
        self._template = device if isinstance(device, KernelTemplate) else None
        device = None if isinstance(device, KernelTemplate) else device
        self._device = device
        self._matrix = matrix
        self._forward = forward
        self._adjoint = adjoint
        self._dtype = None if dtype is None else np.dtype(dtype)
        self._vectorized = bool(vectorized)
        self._structure = ""
        if kind == "dense":
            self._key: Any = _array_digest(matrix)
            self._text = f"dense {matrix.shape[0]}x{matrix.shape[1]} {matrix.dtype} #{self._key[:12]}"
        elif kind == "sparse":
            self._key = _digest(
                matrix.dtype.str.encode(),
                repr(matrix.shape).encode(),
                matrix.indptr.tobytes(),
                matrix.indices.tobytes(),
                np.ascontiguousarray(matrix.data).tobytes(),
            )
            self._text = f"sparse {matrix.shape[0]}x{matrix.shape[1]} {matrix.dtype} #{self._key[:12]}"
        elif kind == "scipy":
            self._key = id(matrix)
            self._text = f"scipy {matrix.shape[0]}x{matrix.shape[1]} {_qualname(matrix)}"
        else:
            self._key = (id(forward), id(adjoint), self._vectorized, self._dtype)
            self._text = f"callables {_qualname(forward)} / {_qualname(adjoint)}"
            self._structure = self._text  # before the JAX forms: see the property
            if device is not None and not (device[0] is forward and device[1] is adjoint):
                self._key = (*self._key, id(device[0]), id(device[1]))
                self._text += f" (jax {_qualname(device[0])} / {_qualname(device[1])})"
            elif device is not None:
                self._key = (*self._key, "jax")
                self._text += " (jax)"
            template = self._template
            if template is not None:
                digest = _digest(*(_array_digest(np.asarray(p)).encode() for p in template.params))
                self._key = (*self._key, *template.family(), digest)
                self._text += (
                    f" (jax template {_qualname(template.forward)} / {_qualname(template.adjoint)}"
                    f" {template.key!r} #{digest[:12]})"
                )

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def of(
        cls,
        kernel: Any = None,
        *,
        forward: Callable | None = None,
        adjoint: Callable | None = None,
        dtype: npt.DTypeLike | None = None,
        vectorized: bool = False,
        jax: bool | tuple[Callable, Callable] | KernelTemplate = False,
    ) -> LocalKernel:
        """A kernel from a matrix (dense array, scipy.sparse, scipy LinearOperator) or from
        ``forward`` and ``adjoint`` callables (exactly one of the two ways); ``jax`` marks
        callables as traceable by JAX (``True``) or gives their JAX pair (see the class), or a
        :class:`~linop.kernel_template.KernelTemplate` (one JAX kernel shared by workers, each
        with its own parameters: run as one program on every device).

        Raises
        ------
        LocalOperatorError
            If both or neither way is given, a callable is missing, a matrix is not 2-D
            numeric, or ``jax`` is given for a matrix or is not a pair of callables.
        """
        if isinstance(kernel, LocalKernel):
            return kernel
        if kernel is not None and (forward is not None or adjoint is not None):
            raise LocalOperatorError(
                "give a kernel either as a matrix or as forward/adjoint callables, not both"
            )
        if kernel is None:
            if forward is None or adjoint is None:
                missing = "forward" if forward is None else "adjoint"
                raise LocalOperatorError(
                    f"a kernel given as callables needs both forward and adjoint ({missing} missing)"
                )
            if not callable(forward) or not callable(adjoint):
                raise LocalOperatorError("forward and adjoint must be callable")
            device = _device_pair(jax, forward, adjoint)
            return cls(
                "callables",
                forward=forward,
                adjoint=adjoint,
                dtype=dtype,
                vectorized=vectorized,
                device=device,
            )
        if jax is not False and jax is not None:
            raise LocalOperatorError(
                "jax= marks callables as traceable by JAX; a dense matrix runs on JAX devices as it is"
            )
        # a scipy LinearOperator implies scipy.sparse.linalg is loaded (slow to import: not here)
        linalg = sys.modules.get("scipy.sparse.linalg")
        if linalg is not None and isinstance(kernel, linalg.LinearOperator):
            return cls("scipy", matrix=kernel, dtype=kernel.dtype)
        sparse = sys.modules.get("scipy.sparse")  # a sparse matrix implies scipy.sparse is loaded
        if sparse is not None and sparse.issparse(kernel):
            matrix = sparse.csr_array(kernel, copy=True)
            matrix.sum_duplicates()
            matrix.sort_indices()
            if matrix.ndim != 2:
                raise LocalOperatorError(f"a kernel matrix must be 2-D, not of shape {matrix.shape}")
            for part in (matrix.data, matrix.indices, matrix.indptr):
                part.flags.writeable = False
            return cls("sparse", matrix=matrix, dtype=matrix.dtype)
        if callable(kernel):
            raise LocalOperatorError(
                "a callable kernel needs forward= and adjoint= (the adjoint is not derived)"
            )
        matrix = np.array(kernel, copy=True)
        if matrix.ndim != 2:
            raise LocalOperatorError(f"a kernel matrix must be 2-D, not of shape {matrix.shape}")
        if matrix.dtype.kind not in "biufcO":
            raise LocalOperatorError(f"a kernel matrix must be numeric, not of dtype {matrix.dtype}")
        matrix.flags.writeable = False
        return cls("dense", matrix=matrix, dtype=matrix.dtype)

    # -- structure --------------------------------------------------------------------------------
    @property
    def kind(self) -> str:
        """``"dense"``, ``"sparse"``, ``"scipy"`` or ``"callables"``."""
        return self._kind

    @property
    def has_matrix(self) -> bool:
        """True when the kernel holds its matrix (dense or sparse): usable on symbols."""
        return self._kind in ("dense", "sparse")

    @property
    def matrix(self) -> Any:
        """The matrix (dense array, csr_array or scipy LinearOperator); None for callables."""
        return self._matrix

    @property
    def dtype(self) -> np.dtype | None:
        """The dtype of the kernel's coefficients, when known."""
        return self._dtype

    @property
    def vectorized(self) -> bool:
        return self._vectorized

    @property
    def device_callables(self) -> tuple[Callable, Callable] | None:
        """The ``(forward, adjoint)`` pair traceable by JAX (``jax=`` of :meth:`of`), or None."""
        return self._device

    @property
    def structure(self) -> str:
        """What the kernel computes on the host, as a tree's fingerprint reads it: its ``repr``
        without the JAX forms given as ``jax=``. Those choose how JAX devices run it, not what it
        computes, and may depend on data only one rank holds (a convolution's parameter tree
        built from a rank's own windows has a one-program template where it holds the window
        and the worker's pair where it does not), so every rank must fingerprint it alike."""
        return self._structure or self._text

    @property
    def device_template(self) -> KernelTemplate | None:
        """The :class:`~linop.kernel_template.KernelTemplate` given as ``jax=``, or None."""
        return self._template

    def with_template(self, template: KernelTemplate) -> LocalKernel:
        """The same callables (the same numpy forward and adjoint, dtype and ``vectorized``)
        with ``template`` as their JAX form (``jax=`` of :meth:`of`), replacing any other.

        Raises
        ------
        LocalOperatorError
            If the kernel is a matrix (its JAX form is the matrix itself).
        """
        if self._kind != "callables":
            raise LocalOperatorError(
                f"a {self._kind} kernel runs on JAX devices as it is; it takes no template"
            )
        return LocalKernel(
            "callables",
            forward=self._forward,
            adjoint=self._adjoint,
            dtype=self._dtype,
            vectorized=self._vectorized,
            device=template,
        )

    @property
    def runs_on_jax(self) -> bool:
        """Whether the kernel can run inside ``jit`` on JAX devices: a dense numeric matrix,
        or callables marked with ``jax=`` (True, a pair or a template)."""
        if self._kind == "dense":
            return self._matrix.dtype.kind in "biufc"
        return self._device is not None or self._template is not None

    @property
    def shape(self) -> tuple[int, int] | None:
        """(m, n) for matrix kernels, None for callables."""
        return None if self._matrix is None else tuple(self._matrix.shape)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LocalKernel):
            return NotImplemented
        return (
            self._kind == other._kind
            and self._key == other._key
            and (
                self._kind not in ("scipy", "callables")
                or (
                    self._matrix is other._matrix
                    and self._forward is other._forward
                    and self._adjoint is other._adjoint
                )
            )
        )

    def __hash__(self) -> int:
        return hash((self._kind, self._key))

    def __repr__(self) -> str:
        return f"LocalKernel({self._text})"

    # -- action on flat vectors -----------------------------------------------------------------
    def apply_matrix(self, vector: np.ndarray, *, adjoint: bool) -> np.ndarray:
        """``K u`` (or ``K^* v``) for a matrix kernel; ``vector`` may hold columns (n x b)."""
        matrix = self._matrix
        if self._kind == "scipy":
            operator_ = matrix.H if adjoint else matrix
            return operator_.matmat(vector) if vector.ndim == 2 else operator_.matvec(vector)
        if vector.dtype == object:
            dense = matrix.toarray() if self._kind == "sparse" else matrix
            dense = dense.conj().T if adjoint else dense
            return np.dot(dense.astype(object), vector)
        if adjoint:
            matrix = matrix.conj().T
        return np.asarray(matrix @ vector)

    def call(self, arrays: Sequence[np.ndarray], *, adjoint: bool) -> Any:
        """Call the forward (or adjoint) callable on one array per block."""
        function = self._adjoint if adjoint else self._forward
        return function(*arrays)  # type: ignore[misc]


def _device_pair(
    jax: Any, forward: Callable, adjoint: Callable
) -> tuple[Callable, Callable] | KernelTemplate | None:
    """The JAX pair (or template) that ``jax=`` of :meth:`LocalKernel.of` gives (None: not
    traceable)."""
    if isinstance(jax, KernelTemplate):
        return jax
    if jax is False or jax is None:
        return None
    if jax is True:
        return (forward, adjoint)
    if not (isinstance(jax, tuple) and len(jax) == 2 and all(callable(f) for f in jax)):
        raise LocalOperatorError(
            f"jax= must be True or a pair (forward, adjoint) of callables traceable by JAX, not {jax!r}"
        )
    return (jax[0], jax[1])


def _as_blocks(items: Any, what: str) -> tuple[Any, ...]:
    if isinstance(items, (str, Block)):
        return (items,)
    if (
        isinstance(items, tuple)
        and len(items) == 2
        and isinstance(items[0], str)
        and not isinstance(items[1], str)
    ):
        return (items,)  # one (name, shape) pair
    if isinstance(items, Mapping):
        return tuple(items.items())
    try:
        return tuple(items)
    except TypeError:
        raise OperandError(
            f"{what}s must be block names, Blocks or (name, shape) pairs (or a sequence of them), not {items!r}"
        ) from None


@dataclass(frozen=True, eq=True, repr=False)
class LocalOperator(LinearOperator):
    r"""A user's sequential linear kernel on one worker's blocks (a leaf of every tree).

    .. math::

        L : (x_{\text{others}}, u) \mapsto (x_{\text{others}}, K u), \qquad
        L^* : (x_{\text{others}}, v) \mapsto (x_{\text{others}}, K^* v)

    where ``u`` is the ``inputs`` blocks raveled (C order) and concatenated in the order given,
    and ``v`` the ``outputs`` likewise (docs/theory.md#local-operators). The inputs are
    consumed (dropped) and the outputs are new blocks; ``others`` pass through unchanged. An
    output may reuse an input's name (the block is replaced).

    Not data movement, so no expansion: :meth:`expand` returns the node itself (a leaf). Every
    interpreter has a handler (numpy, sparse, symbolic through numpy over object arrays, MPI on
    the owning rank). Build one with :func:`local_operator`.

    Parameters
    ----------
    inputs : tuple of Block
        The blocks consumed (forward), all on one worker.
    outputs : tuple of Block
        The blocks produced (forward), on the same worker.
    kernel : LocalKernel
    others : Space
        Blocks passed through unchanged.
    name : str, optional
        Label used in ``str`` and in error messages.
    adjointed : bool, optional
        True for the adjoint node: the domain holds the outputs and the range the inputs.

    Raises
    ------
    WorkerError
        If the inputs and outputs do not all live on one worker.
    BlockExistsError
        If a name is used twice among the inputs, among the outputs, or by a pass-through block.
    LocalOperatorError
        If a matrix kernel's shape is not (output size, input size).
    """

    inputs: tuple[Block, ...]
    outputs: tuple[Block, ...]
    kernel: LocalKernel
    others: Space = _NO_OTHERS
    name: str = "L"
    adjointed: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise LocalOperatorError(
                f"a local operator's name must be a non-empty string, not {self.name!r:.60}"
            )
        inputs, outputs = tuple(self.inputs), tuple(self.outputs)
        object.__setattr__(self, "inputs", inputs)
        object.__setattr__(self, "outputs", outputs)
        if not isinstance(self.kernel, LocalKernel):
            raise LocalOperatorError(
                f"local operator {self.name!r}: kernel must be a LocalKernel (see LocalKernel.of)"
            )
        if not isinstance(self.others, Space):
            raise OperandError(f"local operator {self.name!r}: others must be a Space")
        for group, what in ((inputs, "input"), (outputs, "output")):
            if not group:
                raise LocalOperatorError(f"local operator {self.name!r} needs at least one {what} block")
            seen: set[str] = set()
            for block in group:
                if not isinstance(block, Block):
                    raise OperandError(f"local operator {self.name!r}: {what}s must be Blocks, not {block!r}")
                if block.name in seen:
                    raise BlockExistsError(
                        f"local operator {self.name!r}: {what} block {block.name!r} is listed twice"
                    )
                seen.add(block.name)
                if block.name in self.others:
                    raise BlockExistsError(
                        f"local operator {self.name!r}: {what} block {block.name!r} is also a pass-through block"
                    )
        worker = inputs[0].worker
        for block in (*inputs, *outputs):
            if block.worker != worker:
                raise WorkerError(
                    f"local operator {self.name!r}: block {block.name!r} lives on worker {block.worker}, "
                    f"but {inputs[0].name!r} on worker {worker}; a local operator acts on one worker's blocks"
                )
        shape = self.kernel.shape
        n_in, n_out = sum(b.size for b in inputs), sum(b.size for b in outputs)
        if shape is not None and shape != (n_out, n_in):
            raise LocalOperatorError(
                f"local operator {self.name!r}: kernel matrix has shape {shape}, but the outputs "
                f"{[b.name for b in outputs]} hold {n_out} entries and the inputs {[b.name for b in inputs]} {n_in}"
            )

    # -- structure ------------------------------------------------------------------------------
    @property
    def worker(self) -> int:
        """The worker that owns every block the kernel touches."""
        return self.inputs[0].worker

    @property
    def consumed(self) -> tuple[Block, ...]:
        """The blocks this node consumes: the inputs (forward) or the outputs (adjoint)."""
        return self.outputs if self.adjointed else self.inputs

    @property
    def produced(self) -> tuple[Block, ...]:
        """The blocks this node produces: the outputs (forward) or the inputs (adjoint)."""
        return self.inputs if self.adjointed else self.outputs

    @cached_property
    def domain(self) -> Space:
        return Space((*self.others.blocks, *self.consumed))

    @cached_property
    def range(self) -> Space:
        return Space((*self.others.blocks, *self.produced))

    def within(self, space: Space) -> LocalOperator:
        """The same kernel on another domain ``space`` that holds the consumed blocks (every
        other block of ``space`` passes through).

        Raises
        ------
        SpaceMismatchError
            If ``space`` lacks a consumed block or holds it with another shape or worker.
        """
        for block in self.consumed:
            if block.name not in space or space.block(block.name) != block:
                raise SpaceMismatchError(
                    f"local operator {self}: the space {space} does not hold block {block!r}"
                )
        names = {b.name for b in self.consumed}
        others = Space(b for b in space.blocks if b.name not in names)
        if self.adjointed:
            return LocalOperator(self.inputs, self.outputs, self.kernel, others, self.name, True)
        return LocalOperator(self.inputs, self.outputs, self.kernel, others, self.name)

    def expand(self) -> LinearOperator:
        """A local operator is a leaf (not data movement): it expands to itself."""
        return self

    def adjoint(self) -> LinearOperator:
        """L* = the same kernel's adjoint, with inputs and outputs swapped; (L*)* = L."""
        return LocalOperator(
            self.inputs, self.outputs, self.kernel, self.others, self.name, not self.adjointed
        )

    def __str__(self) -> str:
        star = "*" if self.adjointed else ""
        consumed = ", ".join(b.name for b in self.consumed)
        produced = ", ".join(b.name for b in self.produced)
        return f"{self.name}{star}[{consumed} -> {produced}]"

    # -- the kernel's action ------------------------------------------------------------------
    def evaluate(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Apply the kernel (or its adjoint) to the consumed blocks' arrays (in order), and
        return the produced blocks' arrays, checked.

        Raises
        ------
        NoMatrixError
            For object arrays (symbols) when the kernel has no matrix.
        KernelOutputError
            If a callable returns the wrong number of arrays, a wrong shape, or a dtype that
            cannot safely hold the input dtype (names this node and the block).
        """
        produced = self.produced
        symbolic = any(np.asarray(a).dtype == object for a in arrays)
        if self.kernel.kind == "callables":
            if symbolic:
                raise NoMatrixError(
                    f"local operator {self} is given as callables, which cannot act on symbols; "
                    "give the kernel as a matrix to use it in the symbolic interpreter"
                )
            results = [np.asarray(r) for r in self._call(arrays)]
        else:
            if self.kernel.kind == "scipy" and symbolic:
                raise NoMatrixError(
                    f"local operator {self} holds a scipy LinearOperator, which cannot act on symbols; "
                    "give the kernel as a dense or sparse matrix"
                )
            flat = np.concatenate([np.asarray(a).reshape(-1) for a in arrays])
            out = self.kernel.apply_matrix(flat, adjoint=self.adjointed)
            splits = np.cumsum([b.size for b in produced])[:-1]
            results = [part.reshape(b.shape) for part, b in zip(np.split(np.asarray(out), splits), produced)]
        source = np.result_type(*arrays) if arrays else np.dtype(np.float64)
        for block, result in zip(produced, results):
            if result.shape != block.shape:
                raise KernelOutputError(
                    f"local operator {self}: block {block.name!r} came back with shape {result.shape}, "
                    f"expected {block.shape}"
                )
            if not symbolic and (
                result.dtype.kind not in "biufc" or not np.can_cast(source, result.dtype, "safe")
            ):
                raise KernelOutputError(
                    f"local operator {self}: block {block.name!r} came back with dtype {result.dtype}, "
                    f"which cannot hold the input dtype {source} without loss"
                )
        return results

    @property
    def coefficients_known(self) -> bool:
        """Whether :meth:`produced_dtype` follows from the kernel's coefficient dtype alone (a
        dense or sparse numeric matrix: the same on every rank that holds the tree), rather
        than from running the kernel."""
        dtype = self.kernel.dtype
        return self.kernel.kind in ("dense", "sparse") and dtype is not None and dtype.kind in "biufc"

    def produced_dtype(self, dtype: npt.DTypeLike) -> np.dtype:
        """The dtype of the blocks this node produces from consumed blocks of ``dtype``
        (docs/theory.md#dtypes): a kernel may widen it (an average of integers is a float, a
        complex kernel makes floats complex), and a distributed run must move its results in
        a dtype that holds them.

        For a dense or sparse numeric matrix (:attr:`coefficients_known`) it is
        ``numpy.result_type(dtype, coefficients)``, as ``K @ u`` computes. Otherwise (callables,
        a scipy operator) the kernel is run once on zeros of ``dtype`` (checked as
        :meth:`evaluate` checks every result) and the common dtype of its results is
        remembered per node and dtype. Only a process that may run the kernel should ask: a
        kernel may hold one rank's data only.

        Raises
        ------
        KernelOutputError, NoMatrixError, KernelWriteError
            As :meth:`evaluate`; and whatever the kernel raises on zeros of ``dtype``.
        """
        dtype = np.dtype(dtype)
        if self.coefficients_known:
            return np.result_type(dtype, self.kernel.dtype)
        known = self._produced_dtypes.get(dtype)
        if known is None:
            zeros = [np.zeros(block.shape, dtype) for block in self.consumed]
            with np.errstate(all="ignore"):
                results = self.evaluate(zeros)
            known = self._produced_dtypes[dtype] = np.result_type(dtype, *(r.dtype for r in results))
        return known

    @cached_property
    def _produced_dtypes(self) -> dict[np.dtype, np.dtype]:
        return {}

    def kernel_matrix(self) -> sp.csr_array:
        """The kernel's matrix for this node's direction (``K`` forward, ``K^*`` adjoint), shape
        (produced size, consumed size): the matrix itself, or probed with unit vectors (int64,
        so integer kernels give integer matrices) for scipy operators and callables. For
        callables the adjoint is probed from the adjoint callable, never derived, so a wrong
        pair shows in ``verify.exact_adjoint``."""
        return self._kernel_matrix

    @cached_property
    def _kernel_matrix(self) -> sp.csr_array:
        import scipy.sparse as sp

        kernel = self.kernel
        if kernel.kind == "dense":
            matrix = sp.csr_array(kernel.matrix)
            return sp.csr_array(matrix.conj().T) if self.adjointed else matrix
        if kernel.kind == "sparse":
            return sp.csr_array(kernel.matrix.conj().T) if self.adjointed else kernel.matrix
        consumed, produced = self.consumed, self.produced
        n = sum(b.size for b in consumed)
        m = sum(b.size for b in produced)
        if kernel.kind == "scipy":
            columns = [
                np.asarray(
                    kernel.apply_matrix(
                        np.eye(n, dtype=np.int64)[:, s : s + PROBE_BATCH], adjoint=self.adjointed
                    )
                )
                for s in range(0, n, PROBE_BATCH)
            ]
            return sp.csr_array(np.hstack(columns).reshape(m, n) if columns else np.zeros((m, n)))
        matrix = _probe(self, consumed, produced, n, m)
        self._require_linear(matrix, n)
        return matrix

    # -- calling the callables ------------------------------------------------------------------
    @property
    def _direction(self) -> str:
        return "adjoint" if self.adjointed else "forward"

    def _call(self, arrays: Sequence[np.ndarray]) -> list[Any]:
        """Call the kernel's callable for this direction on read-only views of ``arrays`` and
        return its results as a list, one per produced block (their count checked).

        Raises
        ------
        KernelWriteError
            If the callable tries to write into an argument.
        KernelOutputError
            If it returns another number of arrays than there are produced blocks.
        """
        views = []
        for array in arrays:
            view = np.asarray(array).view()
            view.flags.writeable = False
            views.append(view)
        try:
            results = self.kernel.call(views, adjoint=self.adjointed)
        except ValueError as error:
            if "read-only" not in str(error):
                raise
            raise KernelWriteError(
                f"local operator {self}: the {self._direction} kernel "
                f"{_qualname(self.kernel._adjoint if self.adjointed else self.kernel._forward)} tried to write "
                f"into its argument (block(s) {[b.name for b in self.consumed]}); kernels are given read-only "
                "views and must return new arrays, so that the caller's arrays never change"
            ) from error
        if isinstance(results, np.ndarray) or not isinstance(results, (tuple, list)):
            results = (results,)
        produced = self.produced
        if len(results) != len(produced):
            raise KernelOutputError(
                f"local operator {self}: the {self._direction} kernel returned {len(results)} arrays for the "
                f"{len(produced)} blocks {[b.name for b in produced]}"
            )
        return list(results)

    def _require_linear(self, matrix: sp.csr_array, n: int) -> None:
        """Check that the callables act as their probed ``matrix``
        (:func:`linop.linearity.linearity_problem`, the rule every checker shares), called one
        state at a time as the numpy interpreter calls them (so a false ``vectorized=True``
        shows too).

        Raises
        ------
        NotLinearError
            Naming the state and the first differing produced entry.
        """
        consumed, produced = self.consumed, self.produced
        offsets = np.cumsum([0, *(b.size for b in consumed)])

        def apply_states(states: np.ndarray) -> np.ndarray:
            rows = []
            for state in states:
                arrays = [state[a:b].reshape(blk.shape) for a, b, blk in zip(offsets, offsets[1:], consumed)]
                flat = []
                for block, result in zip(produced, self._call(arrays)):
                    result = np.asarray(result)
                    if result.shape != block.shape:
                        raise KernelOutputError(
                            f"local operator {self}: block {block.name!r} came back with shape {result.shape}, "
                            f"expected {block.shape}"
                        )
                    flat.append(result.reshape(-1))
                rows.append(np.concatenate(flat) if flat else np.zeros(0))
            return np.stack(rows)

        problem = linearity_problem(apply_states, matrix, n)
        if problem is None:
            return
        index, where = problem.index, None
        for block in produced:
            if index < block.size:
                where = (
                    f"{block.name}[{', '.join(str(int(i)) for i in np.unravel_index(index, block.shape))}]"
                )
                break
            index -= block.size
        claim = (
            " (it is vectorized=True, so it was probed in batches: it may not act on a leading batch axis "
            "as it claims)"
            if self.kernel.vectorized
            else ""
        )
        raise NotLinearError(
            f"local operator {self}: the {self._direction} kernel is not linear{claim}: "
            f"{problem.describe(str(where))}; its probed matrix does not describe it"
        )


def _probe(
    op: LocalOperator, consumed: tuple[Block, ...], produced: tuple[Block, ...], n: int, m: int
) -> sp.csr_array:
    """The matrix of a callable kernel, probed with int64 unit vectors (batched when vectorized)."""
    import scipy.sparse as sp

    offsets = np.cumsum([0, *(b.size for b in consumed)])
    batch = PROBE_BATCH if op.kernel.vectorized else 1
    parts: list[sp.csr_array] = []
    for start in range(0, n, batch):
        stop = min(n, start + batch)
        units = np.zeros((stop - start, n), dtype=np.int64)
        units[np.arange(stop - start), np.arange(start, stop)] = 1
        arrays = [
            units[:, a:b].reshape(stop - start, *blk.shape)
            for a, b, blk in zip(offsets, offsets[1:], consumed)
        ]
        if not op.kernel.vectorized:
            arrays = [a[0] for a in arrays]
        results = op._call(arrays)
        flat = []
        for block, result in zip(produced, results):
            result = np.asarray(result)
            expected = (stop - start, *block.shape) if op.kernel.vectorized else block.shape
            if result.shape != expected:
                raise KernelOutputError(
                    f"local operator {op}: block {block.name!r} came back with shape {result.shape} when "
                    f"probed, expected {expected}"
                )
            flat.append(result.reshape(stop - start, block.size))
        parts.append(sp.csr_array(np.concatenate(flat, axis=1).T if flat else np.zeros((m, stop - start))))
    if not parts:
        return sp.csr_array((m, n), dtype=np.int64)
    return sp.csr_array(sp.hstack(parts, format="csr"))


def _block_list(space: Space, items: Any, what: str, worker: int | None) -> tuple[Block, ...]:
    blocks = []
    for item in _as_blocks(items, what):
        if isinstance(item, Block):
            blocks.append(item)
        elif isinstance(item, str):
            if what != "input":
                raise LocalOperatorError(
                    f"output {item!r} needs a shape: give a Block or a (name, shape) pair"
                )
            blocks.append(space.block(item))
        elif isinstance(item, tuple) and len(item) == 2:
            name, shape = item
            try:
                shape = (
                    (shape,)
                    if isinstance(shape, (int, np.integer))
                    else tuple(operator.index(s) for s in shape)
                )
            except TypeError:
                raise LocalOperatorError(
                    f"{what} {name!r}: its shape must be a sequence of integers, not {shape!r}"
                ) from None
            blocks.append(Block(name, shape, 0 if worker is None else worker))
        else:
            raise OperandError(f"{what} must be a block name, a Block or a (name, shape) pair, not {item!r}")
    return tuple(blocks)


def local_operator(
    space: Space,
    inputs: str | Iterable[str],
    outputs: Any,
    kernel: Any = None,
    *,
    forward: Callable | None = None,
    adjoint: Callable | None = None,
    dtype: npt.DTypeLike | None = None,
    vectorized: bool = False,
    jax: bool | tuple[Callable, Callable] | KernelTemplate = False,
    name: str = "L",
) -> LocalOperator:
    """A :class:`LocalOperator` on ``space``: consume ``inputs`` (names of blocks of ``space``),
    produce ``outputs``, pass every other block of ``space`` through.

    Parameters
    ----------
    space : Space
        The domain.
    inputs : str or sequence of str
        Names of the consumed blocks (one worker).
    outputs : Block, (name, shape), sequence of them, or a dict name -> shape
        The produced blocks; names and shapes alone put them on the inputs' worker.
    kernel : array, scipy.sparse matrix or scipy LinearOperator, optional
        The kernel's matrix, shape (output size, input size); or give ``forward`` and ``adjoint``.
    forward, adjoint : callable, optional
        One array per input in, one per output out (and the reverse for ``adjoint``).
    dtype : dtype, optional
        Coefficient dtype of callables (informative).
    vectorized : bool, optional
        The callables accept a leading batch axis (faster probing by the sparse interpreter).
    jax : bool or (callable, callable), optional
        The callables trace under JAX (``True``), or their JAX pair: the kernel then runs
        inside ``jit`` on JAX devices (:class:`LocalKernel`).
    name : str, optional
        Label in ``str`` and errors.

    Raises
    ------
    UnknownBlockError
        If an input is not a block of ``space``.
    LocalOperatorError, WorkerError, BlockExistsError
        As for :class:`LocalOperator` and :meth:`LocalKernel.of`; also a ``name`` that is not a
        non-empty string.

    Examples
    --------
    >>> space = Space([Block("x", (3,)), Block("z", (2,))])
    >>> op = local_operator(space, "x", ("y", (2,)), np.ones((2, 3), dtype=int))
    >>> state = op(dict(x=np.arange(3), z=np.zeros(2, dtype=int)))  # y = K x; z passes through
    >>> state["y"].tolist(), sorted(state)
    ([3, 3], ['y', 'z'])
    """
    if not isinstance(name, str) or not name:
        raise LocalOperatorError(f"a local operator's name must be a non-empty string, not {name!r:.60}")
    names = _as_blocks(inputs, "input")
    for item in names:
        if not isinstance(item, str):
            raise OperandError(f"inputs must be names of blocks of the space, not {item!r}")
        if item not in space:
            raise UnknownBlockError(f"local operator {name!r}: input {item!r} is not a block of {space}")
    input_blocks = tuple(space.block(n) for n in names)
    output_blocks = _block_list(space, outputs, "output", input_blocks[0].worker if input_blocks else None)
    others = Space(b for b in space.blocks if b.name not in names)
    for block in output_blocks:
        if block.name in others:
            raise BlockExistsError(
                f"local operator {name!r}: output {block.name!r} is already a block of the space"
            )
    made = LocalKernel.of(
        kernel, forward=forward, adjoint=adjoint, dtype=dtype, vectorized=vectorized, jax=jax
    )
    return LocalOperator(input_blocks, output_blocks, made, others, name)


KERNEL_KINDS: tuple[str, ...] = ("dense", "sparse", "scipy", "callables", "vectorized")
"""The ways a kernel can be given (``"vectorized"``: callables with a leading batch axis)."""


@dataclass(frozen=True, eq=False)
class _MatrixAction:
    """``arrays -> m @ concat(arrays)`` split into the ``target`` blocks: one direction of
    :func:`matrix_callables` (a class rather than a closure, so the operators built on it
    pickle, as they are sent between processes)."""

    matrix: np.ndarray
    source: tuple[Block, ...]
    target: tuple[Block, ...]
    vectorized: bool

    def __call__(self, *arrays: np.ndarray) -> tuple[np.ndarray, ...]:
        first = np.asarray(arrays[0])
        lead = first.shape[: first.ndim - self.source[0].ndim] if self.vectorized else ()
        flat = np.concatenate(
            [np.asarray(a).reshape(*lead, b.size) for a, b in zip(arrays, self.source)], axis=-1
        )
        out = flat @ self.matrix.T
        splits = np.cumsum([b.size for b in self.target])[:-1]
        parts = np.split(out, splits, axis=-1)
        return tuple(p.reshape(*lead, *b.shape) for p, b in zip(parts, self.target))


def matrix_callables(
    matrix: npt.ArrayLike,
    inputs: Sequence[Block],
    outputs: Sequence[Block],
    *,
    vectorized: bool = False,
) -> tuple[Callable[..., tuple[np.ndarray, ...]], Callable[..., tuple[np.ndarray, ...]]]:
    """Forward and adjoint callables (``K u`` and ``K^H v`` on one array per block) acting as
    ``matrix`` does: a way to give a known matrix as callables, for tests and examples.

    With ``vectorized`` they accept a leading batch axis. Both callables pickle.
    """
    matrix = np.array(matrix, copy=True)
    matrix.flags.writeable = False
    adjoint_matrix = matrix.conj().T
    inputs, outputs = tuple(inputs), tuple(outputs)
    forward = _MatrixAction(matrix, inputs, outputs, vectorized)
    adjoint = _MatrixAction(adjoint_matrix, outputs, inputs, vectorized)
    return forward, adjoint
