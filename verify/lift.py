r"""Prove another framework's backward pass: lift a black-box linear map into an operator.

A framework's function :math:`f` (a numpy callable, a torch function or
``torch.autograd.Function``, a JAX function) and the backward it claims, :math:`g` (its
autograd backward / VJP, or a second callable), are *probed* with unit vectors, in batches:
column :math:`j` of :math:`F` is :math:`f(e_j)` and column :math:`i` of :math:`G` is
:math:`g(e_i)`. For data movement every entry is 0 or 1 (small integers for sums), computed
exactly in floating point, so both matrices are stored as integers and compared exactly. The
result is a :class:`Lifted` operator over named blocks,

.. math::

    \mathcal{L} : x \mapsto F x, \qquad \mathcal{L}^{*} : y \mapsto G y
    \quad(\text{the claimed adjoint, not derived}),

which composes with linop trees like any node. ``verify.exact_adjoint(lifted)`` then proves
:math:`G = F^{H}` or refutes it, naming the first wrong entries as (block, index) pairs: a row
is an entry of the function's input, a column an entry of its output
(``docs/theory.md#adjoint-test``). :func:`prove_backward` does both steps.

Probing assumes :math:`f` is linear; the lift checks that claim (:math:`f(x) = F x`) by the
rule every checker shares, :func:`linop.linearity.linearity_problem`: zero, random integer
states, their sum and a multiple (exactly when the entries are integers), a random
non-integer state, its copies scaled by :math:`2^{-40} .. 2^{40}` and a complex state when the
map accepts one (up to rounding in the dtype the map computed in), and raises
:class:`LiftError` when it fails, naming the state and the entry.
Domains and ranges above :data:`MAX_ENTRIES` entries are refused before any call (probing
costs one call per entry).

Conventions for the callables: they take the domain's blocks as positional arrays in the
domain's order, and return one array (a range of one block), a tuple or list in the range's
order, or a dict keyed by the range's block names.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import numpy.typing as npt
import scipy.sparse as sp

from linop import Block, LinearOperator, Space
from linop.backends import numpy as numpy_backend
from linop.backends import sparse as sparse_backend
from linop.linearity import linearity_problem
from linop.progress import Progress, ProgressOption

from .errors import LiftError
from .exact import Proof, exact_adjoint
from .locate import locate

__all__ = ["FRAMEWORKS", "MAX_ENTRIES", "LiftError", "Lifted", "lift", "lift_mpi", "prove_backward", "probe"]

FRAMEWORKS = ("numpy", "torch", "jax")
"""The frameworks whose functions :func:`lift` can call (and whose autodiff it can probe)."""

MAX_ENTRIES = 1 << 14
"""The largest domain or range (in entries) that :func:`lift` and :func:`lift_mpi` probe by
default: probing calls the function once per entry, each on a dense vector, so the work grows
as the square of the size (16384 entries: about 2.7e8 multiply-adds and 16384 calls)."""


def _digest(matrix: sp.csr_array) -> str:
    matrix = sp.csr_array(matrix)
    matrix.sort_indices()
    h = hashlib.blake2b(digest_size=16)
    for part in (np.asarray(matrix.shape), matrix.indptr, matrix.indices, matrix.data):
        h.update(np.ascontiguousarray(part).tobytes())
    h.update(str(matrix.dtype).encode())
    return h.hexdigest()


@dataclass(frozen=True, eq=False)
class Lifted(LinearOperator):
    """A linear map known by its probed matrix, with a claimed adjoint known likewise.

    Parameters
    ----------
    domain, range : Space
    matrix : scipy.sparse array, shape (range.size, domain.size)
        :math:`F` over the canonical flattenings.
    claimed : scipy.sparse array, shape (domain.size, range.size)
        :math:`G`, the claimed adjoint (what :meth:`adjoint` applies): it is *not* derived,
        which is the point: ``verify.exact_adjoint`` checks it.
    label : str
        The name shown in trees (``"torch.roll"``).

    Equality is structural (spaces, label and the two matrices' content digests), so
    ``L.H.H == L``.
    """

    domain: Space
    range: Space
    matrix: sp.csr_array = field(repr=False)
    claimed: sp.csr_array = field(repr=False)
    label: str = "f"
    adjoint_of: bool = False

    def __post_init__(self) -> None:
        if self.matrix.shape != (self.range.size, self.domain.size):
            raise LiftError(
                f"{self.label}: matrix shape {self.matrix.shape} is not (range size, domain size) "
                f"= {(self.range.size, self.domain.size)}"
            )
        if self.claimed.shape != (self.domain.size, self.range.size):
            raise LiftError(
                f"{self.label}: claimed adjoint shape {self.claimed.shape} is not (domain size, range "
                f"size) = {(self.domain.size, self.range.size)}"
            )

    @cached_property
    def _key(self) -> tuple[Any, ...]:
        return (
            self.domain,
            self.range,
            self.label,
            self.adjoint_of,
            _digest(self.matrix),
            _digest(self.claimed),
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Lifted) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def adjoint(self) -> Lifted:
        """The claimed adjoint: the lifted backward, whose own adjoint is the forward again."""
        return Lifted(self.range, self.domain, self.claimed, self.matrix, self.label, not self.adjoint_of)

    def __str__(self) -> str:
        return f"Lifted[{self.label}]" + ("*" if self.adjoint_of else "")


@numpy_backend.handler(Lifted)
def _numpy_lifted(op: Lifted, work: numpy_backend.Workspace) -> None:
    vector = op.domain.flatten({b.name: work.arrays[b.name] for b in op.domain})
    result = op.range.unflatten(np.asarray(op.matrix @ vector))
    work.arrays.clear()
    work.owned.clear()
    for name, array in result.items():
        work.set(name, np.asarray(array))


@sparse_backend.handler(Lifted)
def _sparse_lifted(op: Lifted) -> sp.csr_array:
    return sp.csr_array(op.matrix)


# -- calling the black box -------------------------------------------------------------------
Batch = Callable[[np.ndarray], np.ndarray]
"""Applies a map to a batch of flat vectors: (B, n) -> (B, m)."""


def _as_space(space: Space | Mapping[str, Sequence[int]], what: str = "space", label: str = "lift") -> Space:
    """A Space, or a dict of block name to shape as blocks on worker 0.

    Raises
    ------
    LiftError
        For anything else (a block's malformed name or shape: a :class:`~linop.errors.BlockError`).
    """
    if isinstance(space, Space):
        return space
    if not isinstance(space, Mapping):
        raise LiftError(
            f"{label}: the {what} must be a Space or a dict of block name to shape, not "
            f"{type(space).__name__} {space!r:.40}"
        )
    blocks = []
    for name, given in space.items():
        shape: Any = given
        if isinstance(shape, int | np.integer) and not isinstance(shape, bool):
            shape = (shape,)
        if isinstance(shape, str | bytes) or not isinstance(shape, Sequence | np.ndarray):
            raise LiftError(
                f"{label}: block {name!r} of the {what} has shape {shape!r}, not a sequence of integers"
            )
        blocks.append(Block(name, tuple(shape)))
    return Space(blocks)


def _outputs(
    result: Any, space: Space, label: str, to_numpy: Callable[[Any], np.ndarray]
) -> list[np.ndarray]:
    """The function's result as numpy arrays in ``space``'s order, checked block by block."""
    names = space.names
    if isinstance(result, Mapping):
        missing = [n for n in names if n not in result]
        if missing or len(result) != len(names):
            raise LiftError(f"{label} returned blocks {sorted(result)}; the space holds {list(names)}")
        values = [result[n] for n in names]
    elif isinstance(result, tuple | list):
        values = list(result)
    else:
        values = [result]
    if len(values) != len(names):
        raise LiftError(
            f"{label} returned {len(values)} array(s); the space holds {len(names)} block(s) {list(names)}"
        )
    arrays = [to_numpy(v) for v in values]
    for name, array in zip(names, arrays):
        if array.shape != space.block(name).shape:
            raise LiftError(
                f"{label} returned shape {array.shape} for block {name!r}; the space expects "
                f"{space.block(name).shape}"
            )
    return arrays


def _read_only(array: np.ndarray) -> np.ndarray:
    view = np.asarray(array).view()
    view.flags.writeable = False
    return view


def _numpy_batch(fn: Callable[..., Any], inside: Space, outside: Space, label: str) -> Batch:
    def run(vectors: np.ndarray) -> np.ndarray:
        rows = []
        for vector in vectors:
            state = inside.unflatten(vector)
            try:
                result = fn(*(_read_only(state[n]) for n in inside.names))
            except ValueError as error:
                if "read-only" not in str(error):
                    raise
                raise LiftError(
                    f"{label} writes into its input (blocks {list(inside.names)}): it is given read-only "
                    "arrays and must return new ones (a function that changes its argument cannot be probed)"
                ) from error
            arrays = _outputs(result, outside, label, np.asarray)
            rows.append(outside.flatten(dict(zip(outside.names, arrays))))
        return np.stack(rows) if rows else np.zeros((0, outside.size))

    return run


def _blocks_of(vectors: np.ndarray, space: Space) -> list[np.ndarray]:
    """A batch of flat vectors (B, n) as one batched array (B, *shape) per block."""
    return [
        vectors[:, space.offset(b.name) : space.offset(b.name) + b.size].reshape((len(vectors), *b.shape))
        for b in space
    ]


def _flat_of(blocks: Sequence[np.ndarray], space: Space, count: int) -> np.ndarray:
    return (
        np.concatenate([np.reshape(a, (count, -1)) for a in blocks], axis=1)
        if blocks
        else np.zeros((count, 0))
    )


def _torch_batches(
    fn: Callable[..., Any], domain: Space, range_: Space, label: str, adjoint: Callable[..., Any] | None
) -> tuple[Batch, Batch]:
    import torch

    def to_numpy(value: Any) -> np.ndarray:
        if not isinstance(value, torch.Tensor):
            raise LiftError(f"{label} returned a {type(value).__name__}, not a torch tensor")
        return value.detach().cpu().resolve_conj().resolve_neg().numpy()

    def writes(name: str, inside: Space) -> LiftError:
        return LiftError(
            f"{name} writes into its input (blocks {list(inside.names)}) in place: a function that "
            "changes its argument cannot be probed, nor differentiated by autograd; return new tensors"
        )

    def looped(call: Callable[..., Any], inside: Space, outside: Space, name: str) -> Batch:
        def run(vectors: np.ndarray) -> np.ndarray:
            rows = []
            for vector in vectors:
                state = inside.unflatten(vector)
                tensors = [torch.from_numpy(np.array(state[n])) for n in inside.names]
                result = call(*tensors)
                if any(t._version for t in tensors):  # an in-place write bumps the version counter
                    raise writes(name, inside)
                arrays = _outputs(result, outside, name, to_numpy)
                rows.append(outside.flatten(dict(zip(outside.names, arrays))))
            return np.stack(rows) if rows else np.zeros((0, outside.size))

        return run

    def vmapped(call: Callable[..., Any], inside: Space, outside: Space, name: str) -> Batch:
        loop = looped(call, inside, outside, name)

        def run(vectors: np.ndarray) -> np.ndarray:
            try:
                batched = [torch.from_numpy(np.array(a)) for a in _blocks_of(vectors, inside)]
                result = torch.func.vmap(call)(*batched)
            except Exception:  # not vmap-able (a custom autograd.Function, data-dependent code)
                return loop(vectors)
            if any(t._version for t in batched):
                raise writes(name, inside)
            values = [result[n] for n in outside.names] if isinstance(result, Mapping) else result
            values = list(values) if isinstance(values, tuple | list) else [values]
            if len(values) != len(outside.names):
                return loop(vectors)
            return _flat_of([to_numpy(v) for v in values], outside, len(vectors))

        return run

    forward = vmapped(fn, domain, range_, label)
    if adjoint is not None:
        return forward, vmapped(adjoint, range_, domain, f"the adjoint of {label}")

    def backward(vectors: np.ndarray) -> np.ndarray:
        """The autograd backward at 0 (the map is linear, so at any point), one cotangent
        after another."""
        rows = []
        for vector in vectors:
            inputs = [torch.zeros(b.shape, dtype=torch.float64, requires_grad=True) for b in domain]
            try:
                outputs = fn(*inputs)
            except RuntimeError as error:
                if "in-place" in str(error):
                    raise writes(label, domain) from error
                raise
            values = [outputs[n] for n in range_.names] if isinstance(outputs, Mapping) else outputs
            values = list(values) if isinstance(values, tuple | list) else [values]
            cut = [
                n for n, v in zip(range_.names, values) if isinstance(v, torch.Tensor) and not v.requires_grad
            ]
            if cut:
                raise LiftError(
                    f"{label}: output block(s) {cut} do not depend on the input through autograd (the "
                    "function detaches them: .detach(), .numpy(), torch.no_grad()), so autograd claims no "
                    "backward to prove; keep them in the graph, or pass adjoint="
                )
            state = range_.unflatten(vector)
            if np.iscomplexobj(vector) and not any(v.is_complex() for v in values):
                raise TypeError(f"{label} computes over the reals: no complex cotangent")
            cotangents = [
                torch.from_numpy(np.array(state[n])).to(v.dtype) for n, v in zip(range_.names, values)
            ]
            grads = torch.autograd.grad(values, inputs, cotangents, allow_unused=True)
            arrays = [np.zeros(b.shape) if g is None else to_numpy(g) for b, g in zip(domain, grads)]
            rows.append(domain.flatten(dict(zip(domain.names, arrays))))
        return np.stack(rows) if rows else np.zeros((0, domain.size))

    return forward, backward


def _jax_batches(
    fn: Callable[..., Any], domain: Space, range_: Space, label: str, adjoint: Callable[..., Any] | None
) -> tuple[Batch, Batch]:
    import jax
    import jax.numpy as jnp

    def as_tuple(result: Any, outside: Space) -> tuple[Any, ...]:
        if isinstance(result, Mapping):
            return tuple(result[n] for n in outside.names)
        return tuple(result) if isinstance(result, tuple | list) else (result,)

    def batched(call: Callable[..., Any], inside: Space, outside: Space, name: str) -> Batch:
        # compiled: a probe batch through an un-jitted shard_map or a chain of small ops would
        # be dispatched op by op (a halo exchange on 4 devices: 4.4 s, under jit 0.5 s); a
        # function vmap can trace, jit can trace too
        mapped = jax.jit(jax.vmap(lambda *xs: as_tuple(call(*xs), outside)))

        def run(vectors: np.ndarray) -> np.ndarray:
            values = mapped(*(jnp.asarray(a) for a in _blocks_of(vectors, inside)))
            if len(values) != len(outside.names):
                raise LiftError(
                    f"{name} returned {len(values)} array(s); the space holds {list(outside.names)}"
                )
            for block, value in zip(outside, values):
                if tuple(value.shape[1:]) != block.shape:
                    raise LiftError(
                        f"{name} returned shape {tuple(value.shape[1:])} for block {block.name!r}; the space "
                        f"expects {block.shape}"
                    )
            return _flat_of([np.asarray(v) for v in values], outside, len(vectors))

        return run

    forward = batched(fn, domain, range_, label)
    if adjoint is not None:
        return forward, batched(adjoint, range_, domain, f"the adjoint of {label}")
    zeros = tuple(jnp.zeros(b.shape) for b in domain)
    _, vjp = jax.vjp(lambda *xs: as_tuple(fn(*xs), range_), *zeros)
    mapped_vjp = jax.jit(jax.vmap(lambda *cts: vjp(tuple(cts))))

    def backward(vectors: np.ndarray) -> np.ndarray:
        grads = mapped_vjp(*(jnp.asarray(a) for a in _blocks_of(vectors, range_)))
        return _flat_of([np.asarray(g) for g in grads], domain, len(vectors))

    return forward, backward


def probe(
    apply_batch: Batch,
    size_in: int,
    size_out: int,
    *,
    batch: int = 256,
    dtype: npt.DTypeLike = np.float64,
    tick: Callable[[int], None] | None = None,
) -> sp.csr_array:
    """The matrix of a linear map by probing: column ``j`` is the map of the unit vector
    ``e_j``, ``batch`` columns per call. Integer-valued matrices (data movement) are returned as
    int64, so that the proof compares them exactly.

    Parameters
    ----------
    apply_batch : callable
        The map on a batch of flat vectors, (B, size_in) -> (B, size_out).
    size_in, size_out : int
        The sizes of its domain and range.
    batch : int
        Unit vectors per call.
    dtype : dtype
        The unit vectors' dtype.
    tick : callable, optional
        Called with the number of columns just probed after each call (progress).
    """
    columns = []
    for start in range(0, size_in, batch):
        stop = min(size_in, start + batch)
        units = np.zeros((stop - start, size_in), dtype=dtype)
        units[np.arange(stop - start), np.arange(start, stop)] = 1
        images = np.asarray(apply_batch(units))
        if images.shape != (stop - start, size_out):
            raise LiftError(
                f"probing gave images of shape {images.shape}, expected {(stop - start, size_out)}"
            )
        columns.append(sp.csr_array(images.T))
        if tick is not None:
            tick(stop - start)
    matrix = sp.csr_array(sp.hstack(columns)) if columns else sp.csr_array((size_out, size_in), dtype=dtype)
    matrix.eliminate_zeros()
    data = matrix.data
    if data.dtype.kind == "c" and not np.any(data.imag):
        matrix = matrix.real
        data = matrix.data
    if data.dtype.kind == "f" and np.all(data == np.round(data)) and np.all(np.abs(data) < 2.0**53):
        matrix = matrix.astype(np.int64)
    return matrix


def _check_linear(
    apply_batch: Batch, matrix: sp.csr_array, inside: Space, outside: Space, label: str
) -> None:
    """``f(x) == F x`` by :func:`linop.linearity.linearity_problem` (the rule every checker
    shares: integer, non-integer, scaled and complex states)."""
    problem = linearity_problem(apply_batch, matrix, inside.size)
    if problem is not None:
        raise LiftError(f"{label} is not linear: {problem.describe(str(locate(outside, problem.index)))}")


def _require_options(batch: object, max_entries: object, domain: Space, range_: Space, label: str) -> None:
    for name, value in (("batch", batch), ("max_entries", max_entries)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
            raise LiftError(f"{label}: {name} must be a positive integer, not {value!r}")
    for what, space in (("domain", domain), ("range", range_)):
        if space.size > max_entries:  # type: ignore[operator]
            raise LiftError(
                f"{label}: the {what} holds {space.size} entries, more than max_entries={max_entries}: "
                f"probing calls the function once per entry on dense vectors of that size (pass a larger "
                f"max_entries= to lift it anyway, or lift a smaller instance of the same map)"
            )


def lift(
    forward: Callable[..., Any],
    domain: Space | Mapping[str, Sequence[int]],
    range: Space | Mapping[str, Sequence[int]],
    *,
    adjoint: Callable[..., Any] | None = None,
    framework: str = "numpy",
    batch: int = 256,
    label: str | None = None,
    check_linear: bool = True,
    max_entries: int = MAX_ENTRIES,
    progress: ProgressOption = None,
) -> Lifted:
    """Lift a black-box linear map and its claimed adjoint into a :class:`Lifted` operator.

    Parameters
    ----------
    forward : callable
        The linear map: positional arrays in ``domain`` order -> array(s) in ``range`` order
        (or a dict by range block names).
    domain, range : Space or dict of name to shape
        The named blocks of its input and output (a dict gives blocks on worker 0).
    adjoint : callable, optional
        The claimed adjoint, range -> domain, in the same conventions. Default: the
        framework's own backward (``torch.autograd.grad``, ``jax.vjp``); required for numpy.
    framework : {"numpy", "torch", "jax"}
        What the callables take and return. Torch and JAX callables are probed in batches
        (``torch.func.vmap`` / ``jax.vmap``, falling back to one probe at a time for what
        does not vectorize, such as a custom ``autograd.Function``).
    batch : int
        Unit vectors per call (a positive integer).
    label : str, optional
        The name shown in trees and proofs (default the callable's name).
    check_linear : bool
        Check ``f(x) == F x`` for both callables (default True), by
        :func:`linop.linearity.linearity_problem`: zero, random integer states, their sum and
        a multiple (exactly for an integer ``F``), a random non-integer state and its copies
        scaled across magnitudes, and a complex state when the callable accepts one.
    max_entries : int
        The largest domain or range size probed (default :data:`MAX_ENTRIES`): probing costs
        one call per entry on dense vectors, so larger maps are refused before any call.
    progress : None, bool or callable
        Progress of the probing (one step per unit vector, forward then adjoint, then the
        linearity check), :mod:`linop.progress`: None (default) reports on stderr only once
        the lift has run 2 s, True always, False never; a callable is called as
        ``progress(done, total, what)`` instead. Ctrl-C while probing writes one line on
        stderr (unless ``progress=False``) saying how far it got (``lift of f: interrupted
        after 1,536 of 32,768 probes (forward)``) and re-raises the ``KeyboardInterrupt``.

    Returns
    -------
    Lifted
        The probed operator, whose adjoint is the claimed one.

    Raises
    ------
    LiftError
        When the map is not linear, writes into its input (numpy arrays are given read-only),
        returns the wrong blocks or shapes, is larger than ``max_entries``, ``batch`` is not a
        positive integer, or numpy is given no adjoint.
    KeyboardInterrupt
        On Ctrl-C, after the line saying how far the probing got.
    """
    label = label or getattr(forward, "__qualname__", None) or type(forward).__name__
    domain, range_ = _as_space(domain, "domain", label), _as_space(range, "range", label)
    _require_options(batch, max_entries, domain, range_, label)
    if framework not in FRAMEWORKS:
        raise LiftError(f"unknown framework {framework!r}; expected one of {FRAMEWORKS}")
    if framework == "numpy":
        if adjoint is None:
            raise LiftError(f"{label}: a numpy callable has no backward of its own; pass adjoint=")
        apply_forward = _numpy_batch(forward, domain, range_, label)
        apply_adjoint = _numpy_batch(adjoint, range_, domain, f"the adjoint of {label}")
    elif framework == "torch":
        apply_forward, apply_adjoint = _torch_batches(forward, domain, range_, label, adjoint)
    else:
        apply_forward, apply_adjoint = _jax_batches(forward, domain, range_, label, adjoint)
    with Progress(f"lift of {label}", domain.size + range_.size, "probes", progress=progress) as report:
        report.update(0, "forward")
        matrix = probe(apply_forward, domain.size, range_.size, batch=batch, tick=report.advance)
        report.update(report.done, "adjoint")
        claimed = probe(apply_adjoint, range_.size, domain.size, batch=batch, tick=report.advance)
        if check_linear:
            report.update(report.done, "checking linearity")
            _check_linear(apply_forward, matrix, domain, range_, label)
            _check_linear(apply_adjoint, claimed, range_, domain, f"the adjoint of {label}")
    return Lifted(domain, range_, matrix, claimed, label)


def prove_backward(
    forward: Callable[..., Any],
    domain: Space | Mapping[str, Sequence[int]],
    range: Space | Mapping[str, Sequence[int]],
    **options: Any,
) -> Proof:
    """Lift ``forward`` with its claimed adjoint (:func:`lift`, same options) and prove the
    adjoint exactly: a :class:`~verify.exact.Proof` whose failure lists the first wrong
    entries, each a row (block, index) of the function's input and a column (block, index) of
    its output, with the claimed backward's value and the true adjoint's.

    Progress (``progress=``, as in :func:`lift`) covers the probing; the exact proof that
    follows is a few whole-matrix scipy operations (:func:`verify.exact.exact_adjoint`) and
    reports none."""
    return exact_adjoint(lift(forward, domain, range, **options))


# -- across MPI ranks -----------------------------------------------------------------------
def _call_on_rank(call: Callable[..., Any], arguments: Sequence[Any], comm: Any, label: str) -> Any:
    """``call(*arguments)`` on this rank, its failure a :class:`LiftError` that names the rank
    at fault. A rank whose function raises says so (``comm.announce``, where the communicator
    can: a torch.distributed group's store) and raises naming itself; a peer blocked in the
    function's own collective fails once that rank's process ends (or at the group's
    timeout), and raises naming the rank that announced its failure, not the engine's raw
    "connection closed". (Under MPI the peers stay blocked: run under ``mpi_backend.guard()``,
    which ends the job.)"""
    try:
        return call(*arguments)
    except Exception as error:
        heard = getattr(comm, "announced", None)
        others = heard() if heard is not None else {}
        others.pop(comm.rank, None)
        text = str(error).splitlines()[0] if str(error) else ""
        if others:
            failed = "; ".join(f"rank {r}: {m}" for r, m in sorted(others.items()))
            raise LiftError(
                f"rank {comm.rank}: {label} could not complete because rank(s) {sorted(others)} failed "
                f"({failed}); here: {type(error).__name__}: {text}"
            ) from error
        announce = getattr(comm, "announce", None)
        if announce is not None:
            announce(f"{label} raised {type(error).__name__}: {text}")
        raise LiftError(
            f"rank {comm.rank}: {label} raised {type(error).__name__}: {text} (while probing; the other "
            "ranks cannot finish the collective probing: end the job)"
        ) from error


def _probe_ranks(
    call: Callable[..., Any],
    inside: Space,
    outside: Space,
    comm: Any,
    label: str,
    to_input: Callable[[np.ndarray], Any],
    to_numpy: Callable[[Any], np.ndarray],
    tick: Callable[[], None] | None = None,
) -> sp.csr_array:
    """The global matrix of a per-rank function by probing: for each global entry ``j`` of
    ``inside`` every rank calls ``call`` together on its blocks (all zero but entry ``j`` on its
    owner), records its own output column, and the columns are gathered on every rank;
    ``tick()`` after each entry (progress)."""
    rank = comm.rank
    mine_in = [b for b in inside if b.worker == rank]
    mine_out = [b for b in outside if b.worker == rank]
    mine_space = Space(mine_out)
    offsets = np.array([outside.offset(b.name) for b in mine_out], dtype=np.int64)
    rows: list[np.ndarray] = []
    cols: list[np.ndarray] = []
    vals: list[np.ndarray] = []
    problem = None
    for j in range(inside.size):
        where = locate(inside, j)
        arrays = {b.name: np.zeros(b.shape) for b in mine_in}
        if where.block in arrays:
            arrays[where.block][where.index] = 1.0
        result = _call_on_rank(call, [to_input(arrays[b.name]) for b in mine_in], comm, label)
        if problem is None:
            try:
                outputs = _outputs(result, mine_space, label, to_numpy) if mine_out else []
            except LiftError as error:
                problem = f"rank {rank}: {error}"
                outputs = []
        for offset, array in zip(offsets, outputs):
            flat = np.ravel(array)
            nonzero = np.flatnonzero(flat)
            rows.append(nonzero + offset)
            cols.append(np.full(nonzero.size, j))
            vals.append(flat[nonzero])
        if tick is not None:
            tick()
    problems = [p for p in comm.allgather(problem) if p is not None]
    if problems:
        raise LiftError("; ".join(problems))
    pieces = comm.allgather(
        (
            np.concatenate(rows or [np.zeros(0, np.int64)]),
            np.concatenate(cols or [np.zeros(0, np.int64)]),
            np.concatenate(vals or [np.zeros(0)]),
        )
    )
    r, c, v = (np.concatenate([p[k] for p in pieces]) for k in range(3))
    matrix = sp.csr_array((v, (r, c)), shape=(outside.size, inside.size))
    if (
        matrix.dtype.kind == "f"
        and np.all(matrix.data == np.round(matrix.data))
        and np.all(np.abs(matrix.data) < 2.0**53)
    ):
        matrix = matrix.astype(np.int64)
    return matrix


def lift_mpi(
    forward: Callable[..., Any],
    domain: Space,
    range: Space,
    *,
    adjoint: Callable[..., Any] | None = None,
    comm: Any = None,
    framework: str = "numpy",
    label: str | None = None,
    max_entries: int = MAX_ENTRIES,
    progress: ProgressOption = None,
) -> Lifted:
    """Lift a per-rank function that communicates (hand-written mpi4py code) and its claimed
    adjoint into one :class:`Lifted` operator, the same on every rank; collective.

    Each rank's callables take this rank's blocks of the domain (worker == rank, in the
    domain's order) and return this rank's blocks of the range, communicating as they like.
    Every rank calls them together once per global entry (one unit vector at a time), so the
    functions must be collective in the usual SPMD way; a function that raises on one rank only
    leaves the others waiting (run under ``mpi_backend.guard()``). ``framework="torch"`` passes
    and expects tensors; its default adjoint is autograd's backward, run on every rank together.

    ``max_entries`` bounds the domain and range sizes as in :func:`lift` (the spaces are the
    same on every rank, so every rank refuses alike, before any call).

    Parameters
    ----------
    forward : callable
        This rank's part of the map: this rank's domain blocks -> this rank's range blocks.
    domain, range : Space
        The global spaces, whose blocks name their workers (ranks).
    adjoint : callable, optional
        The claimed adjoint's part on this rank (default for torch: autograd's backward).
    comm : mpi4py communicator, optional
        Default ``MPI.COMM_WORLD``.
    framework : {"numpy", "torch"}
        What the callables take and return.
    label : str, optional
        The name shown in trees and proofs.
    max_entries : int
        The largest domain or range size probed.
    progress : None, bool or callable
        As in :func:`lift` (one step per global entry, forward then adjoint); only rank 0
        reports. Ctrl-C that reaches this code writes rank 0's line saying how far the
        probing got and re-raises; one inside linop's own collective sections aborts the job
        (:mod:`linop.backends.mpi.guards`).

    Returns
    -------
    Lifted
        The same on every rank.

    Raises
    ------
    LiftError
        On every rank together, when a rank's function returns the wrong blocks or shapes, or
        a space holds more than ``max_entries`` entries.
    """
    if comm is None:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    label = label or getattr(forward, "__qualname__", None) or type(forward).__name__
    _require_options(1, max_entries, domain, range, label)
    if framework == "numpy":
        if adjoint is None:
            raise LiftError(f"{label}: a numpy callable has no backward of its own; pass adjoint=")
        to_input: Callable[[np.ndarray], Any] = np.asarray
        to_numpy: Callable[[Any], np.ndarray] = np.asarray
    elif framework == "torch":
        import torch

        def to_input(array: np.ndarray) -> Any:
            return torch.from_numpy(np.array(array))

        def to_numpy(value: Any) -> np.ndarray:
            if isinstance(value, torch.Tensor):
                return value.detach().cpu().resolve_conj().resolve_neg().numpy()
            return np.asarray(value)

        if adjoint is None:
            adjoint = _torch_backward_of(forward, domain, range, comm)
    else:
        raise LiftError(f"lift_mpi supports the numpy and torch frameworks, not {framework!r}")
    adjoint_label = f"the adjoint of {label}"
    with Progress(
        f"lift of {label}", domain.size + range.size, "probes", progress=progress, report=comm.rank == 0
    ) as report:
        report.update(0, "forward")
        matrix = _probe_ranks(forward, domain, range, comm, label, to_input, to_numpy, report.advance)
        report.update(report.done, "adjoint")
        claimed = _probe_ranks(
            adjoint, range, domain, comm, adjoint_label, to_input, to_numpy, report.advance
        )
        report.update(report.done, "checking linearity")
        _check_linear_ranks(forward, matrix, domain, range, comm, label, to_input, to_numpy)
        _check_linear_ranks(adjoint, claimed, range, domain, comm, adjoint_label, to_input, to_numpy)
    return Lifted(domain, range, matrix, claimed, label)


def _check_linear_ranks(
    call: Callable[..., Any],
    matrix: sp.csr_array,
    inside: Space,
    outside: Space,
    comm: Any,
    label: str,
    to_input: Callable[[np.ndarray], Any],
    to_numpy: Callable[[Any], np.ndarray],
) -> None:
    """The linearity check of :func:`lift` for a per-rank function: every rank calls it
    together on its blocks of each state of :func:`linop.linearity.linearity_problem` and
    compares its own output blocks with the gathered matrix; the ranks agree on the verdict
    (and on whether every rank's function accepted the complex state)."""
    rank = comm.rank
    mine_in = [b for b in inside if b.worker == rank]
    mine_out = [b for b in outside if b.worker == rank]
    rows = np.concatenate(
        [np.arange(outside.offset(b.name), outside.offset(b.name) + b.size) for b in mine_out]
        or [np.zeros(0, int)]
    )
    failures: list[str] = []

    def apply_states(states: np.ndarray) -> np.ndarray:
        """This rank's rows of the images (the other rows zero); every state is passed to
        ``call`` even after one came back wrong, so that the ranks' collectives stay in step."""
        results = []
        for state in states:
            blocks = inside.unflatten(state)
            arguments = [to_input(np.array(blocks[b.name])) for b in mine_in]
            # complex states: a function that refuses them is judged on the real ones (agreed)
            result = (
                call(*arguments) if np.iscomplexobj(state) else _call_on_rank(call, arguments, comm, label)
            )
            try:
                outputs = _outputs(result, Space(mine_out), label, to_numpy) if mine_out else []
            except LiftError as error:
                failures.append(str(error))
                outputs = [np.zeros(b.shape) for b in mine_out]
            results.append(np.concatenate([np.ravel(a) for a in outputs]) if outputs else np.zeros(0))
        kind = np.result_type(np.float64, *(r.dtype for r in results))
        images = np.zeros((len(states), outside.size), dtype=kind)
        for k, values in enumerate(results):
            images[k, rows] = values
        return images

    def agree(accepted: bool) -> bool:
        return all(comm.allgather(accepted))

    found = linearity_problem(apply_states, matrix, inside.size, rows=rows, agree=agree)
    problem = None
    if failures:
        problem = f"rank {rank}: {failures[0]}"
    elif found is not None:
        problem = f"rank {rank}: {label} is not linear: {found.describe(str(locate(outside, found.index)))}"
    problems = [p for p in comm.allgather(problem) if p is not None]
    if problems:
        raise LiftError("; ".join(problems))


def _torch_backward_of(
    forward: Callable[..., Any], domain: Space, range_: Space, comm: Any
) -> Callable[..., Any]:
    """The autograd backward of a per-rank torch function as a callable of this rank's
    cotangents (forward at zero, then ``torch.autograd.backward`` on every rank)."""
    import torch

    mine_in = [b for b in domain if b.worker == comm.rank]
    mine_out = [b for b in range_ if b.worker == comm.rank]

    def backward(*cotangents: Any) -> tuple[Any, ...]:
        inputs = [torch.zeros(b.shape, dtype=torch.float64, requires_grad=True) for b in mine_in]
        outputs = forward(*inputs)
        values = list(outputs) if isinstance(outputs, tuple | list) else [outputs]
        if any(c.is_complex() for c in cotangents) and not any(v.is_complex() for v in values):
            raise TypeError("the forward computes over the reals: no complex cotangent")
        pairs = [(v, c.to(v.dtype)) for v, c in zip(values[: len(mine_out)], cotangents) if v.requires_grad]
        if pairs:
            torch.autograd.backward([v for v, _ in pairs], [c for _, c in pairs])
        return tuple(torch.zeros(b.shape) if t.grad is None else t.grad for b, t in zip(mine_in, inputs))

    return backward
