"""What every layer shares: its typed error, argument checks, and the stage of local kernels.

A layer is two operator trees (docs/theory.md#layers): one linear in the input for fixed
parameters (its adjoint is the input gradient), and one linear in the parameters for a fixed
input (its adjoint is the weight gradient). Both are ordinary trees of collectives, halo
exchanges and :class:`~linop.local.LocalOperator` leaves, so every interpreter runs them and
``verify`` proves them.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import LayerError
from ..kernel_template import KernelTemplate
from ..local import LocalKernel, LocalOperator
from ..operator import Composition, Identity, LinearOperator
from ..partition import DistributedTensor, Partition, balanced_sizes, grid_block_name
from ..space import Block, Space, as_array

__all__ = [
    "LayerError",
    "LocalStep",
    "local_stage",
    "partial_sums_reduction",
    "window_stage",
    "require_int",
    "require_shape",
    "scatter_weights_and_bias",
    "require_tensor",
    "share_slices",
    "shares",
]


def require_tensor(layer: str, what: str, value: object) -> DistributedTensor:
    if not isinstance(value, DistributedTensor):
        raise LayerError(f"{layer}: {what} must be a DistributedTensor, not {type(value).__name__}")
    return value


def require_int(layer: str, what: str, value: object, low: int = 1) -> int:
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise LayerError(f"{layer}: {what} must be an integer, not {value!r}") from None
    if number < low:
        raise LayerError(f"{layer}: {what} is {number}; it must be >= {low}")
    return number


def require_shape(layer: str, what: str, array: Any, expected: Sequence[int]) -> np.ndarray:
    """``array`` as an ndarray of shape ``expected`` and of a numeric dtype (numbers, or
    objects such as symbols), else a LayerError naming it."""
    array = as_array(array, lambda reason: LayerError(f"{layer}: {what} is not an array ({reason})"))
    if array.shape != tuple(expected):
        raise LayerError(f"{layer}: {what} has shape {array.shape}, expected {tuple(expected)}")
    if array.dtype.kind not in "biufcO":
        raise LayerError(f"{layer}: {what} has dtype {array.dtype}, not a numeric dtype")
    return array


def scatter_weights_and_bias(
    layer: str,
    weights_tensor: DistributedTensor,
    bias_tensor: DistributedTensor | None,
    weights: Any,
    bias: Any = None,
    held: Callable[[Partition], Iterable[Sequence[int]]] | None = None,
) -> dict[str, np.ndarray]:
    """A layer's parameter state from its global weights (and bias): the blocks of
    ``weights_tensor`` and ``bias_tensor``; with ``held`` (a partition's grid indices a process
    holds: :meth:`~linop.frameworks.torch_placement.Placement.held`), only the blocks at those
    indices of each partition.

    Raises
    ------
    LayerError
        A bias given to a layer without one, or an array of the wrong shape.
    """
    if bias_tensor is None and bias is not None:
        raise LayerError(
            f"{layer}: a bias was given to scatter_parameters, but the layer was built with bias=False "
            "(it has no bias to scatter)"
        )
    weights = require_shape(layer, "weights", weights, weights_tensor.global_shape)
    state = weights_tensor.scatter(weights, None if held is None else held(weights_tensor.partition))
    if bias_tensor is not None:
        bias = require_shape(layer, "bias", bias, bias_tensor.global_shape)
        state.update(bias_tensor.scatter(bias, None if held is None else held(bias_tensor.partition)))
    return state


def shares(layer: str, what: str, total: int, parts: int, given: object = None) -> tuple[int, ...]:
    """The shares of ``total`` ``what`` (channels, features) over ``parts`` workers: the
    balanced split (:func:`~linop.partition.balanced_sizes`: sizes differing by at most one,
    larger first, e.g. 7 over 3 is 3, 2, 2) when ``given`` is None, else ``given`` checked
    (one non-negative integer per worker, adding up to ``total``; shares may be empty).

    Raises
    ------
    LayerError
        If ``given`` is not a sequence of integers, has the wrong count, a negative entry or
        the wrong sum (the message names ``what``).
    """
    if given is None:
        return balanced_sizes(total, parts)
    not_one_axis = isinstance(given, np.ndarray) and given.ndim != 1
    if isinstance(given, (str, bytes)) or not isinstance(given, (Sequence, np.ndarray)) or not_one_axis:
        raise LayerError(f"{layer}: the {what} shares must be a sequence of integers, not {given!r}")
    values: list[int] = []
    for value in given:
        try:
            if isinstance(value, (bool, np.bool_)):
                raise TypeError
            values.append(operator.index(value))
        except TypeError:
            raise LayerError(f"{layer}: the {what} shares {given!r} must be integers (not bools)") from None
    if len(values) != parts:
        raise LayerError(f"{layer}: {len(values)} {what} shares {tuple(values)} for {parts} workers")
    if any(v < 0 for v in values):
        raise LayerError(f"{layer}: the {what} shares {tuple(values)} have a negative entry")
    if sum(values) != total:
        raise LayerError(f"{layer}: the {what} shares {tuple(values)} add up to {sum(values)}, not {total}")
    return tuple(values)


def share_slices(sizes: Sequence[int]) -> tuple[slice, ...]:
    """The consecutive ranges of global indices the shares ``sizes`` hold: ``(3, 2, 2)`` gives
    ``0:3, 3:5, 5:7``."""
    stops = tuple(itertools.accumulate(sizes))
    return tuple(slice(stop - size, stop) for size, stop in zip(sizes, stops))


def require_partition(layer: str, what: str, partition: object, rank: int) -> Partition:
    if not isinstance(partition, Partition):
        raise LayerError(f"{layer}: {what} must be a Partition, not {type(partition).__name__}")
    if partition.ndim != rank:
        raise LayerError(f"{layer}: {what} {partition.shape} has rank {partition.ndim}, expected rank {rank}")
    return partition


@dataclass(frozen=True)
class LocalStep:
    """One local kernel of a stage: consume ``inputs`` (names), produce ``outputs`` (blocks);
    ``jax``: its pair for JAX devices, or a :class:`~linop.kernel_template.KernelTemplate`
    (one kernel for every worker, each with its parameters), if any (``jax=`` of
    :meth:`LocalKernel.of`)."""

    inputs: tuple[str, ...]
    outputs: tuple[Block, ...]
    forward: Callable[..., Any]
    adjoint: Callable[..., Any]
    label: str
    jax: tuple[Callable[..., Any], Callable[..., Any]] | KernelTemplate | None = None


def local_stage(space: Space, steps: Sequence[LocalStep]) -> LinearOperator:
    """The local kernels of a stage, one :class:`LocalOperator` per step, composed in order on
    ``space`` (each passes every other block through)."""
    factors: list[LinearOperator] = []
    for step in steps:
        kernel = LocalKernel.of(
            forward=step.forward, adjoint=step.adjoint, vectorized=True, jax=step.jax or False
        )
        op = LocalOperator(tuple(space.block(n) for n in step.inputs), step.outputs, kernel, name=step.label)
        op = op.within(space)
        factors.append(op)
        space = op.range
    if not factors:
        return Identity(space)
    return Composition(tuple(reversed(factors)))


def window_stage(
    space: Space,
    partition: Partition,
    output: DistributedTensor,
    window_name: Callable[[tuple[int, ...]], str],
    kernels: Callable[[tuple[int, ...], Block], tuple[Callable[..., Any], Callable[..., Any]]],
    label: str,
) -> LinearOperator:
    """The local stage of a window layer on ``space`` (the windows' tree's range): for each
    worker g of ``partition``, one kernel from its window ``window_name(g)`` to its block of
    ``output``; ``kernels(g, block)`` gives the (forward, adjoint) pair, labelled ``label[g]``."""
    steps = []
    for g in partition.indices():
        out = output.block(g)
        forward, adjoint = kernels(g, out)
        block = Block(out.name, out.shape, out.worker)
        steps.append(LocalStep((window_name(g),), (block,), forward, adjoint, grid_block_name(label, g)))
    return local_stage(space, steps)


def partial_sums_reduction(
    y: DistributedTensor, shape: tuple[int, ...], workers: Iterable[int], space: Space, partials: str = "yt"
) -> LinearOperator:
    """The sum-reduce onto y of a layer's partial outputs ``partials[...]``, one per worker of
    the partition ``shape`` (``workers`` in its order), passing the other blocks of ``space``
    through: :math:`R` of an affine or convolution layer whose input features are cut."""
    from ..collectives import SumReduce

    # consecutive workers stay a range (the partition describes them, none listed or checked
    # one by one); nothing passes through an empty space (the module's reduction: none listed)
    given = workers if isinstance(workers, range) else tuple(workers)
    others = Space(b for b in space if not b.name.startswith(f"{partials}[")) if len(space) else Space()
    return SumReduce(y, Partition(shape, given), partials, others=others)
