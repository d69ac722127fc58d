r"""One JAX kernel for every worker: a template and each worker's parameters.

A layer builds one :class:`~linop.local.LocalOperator` per worker, usually from one formula
whose only per-worker inputs are the worker's parameters (its share of the weights) and its
blocks' shapes. Given to :meth:`LocalKernel.of <linop.local.LocalKernel.of>` as ``jax=``, a
:class:`KernelTemplate` says so, and the lowering onto JAX devices
(:mod:`linop.backends.jax.shard`) then runs the kernels of a round as ONE program on every
device (each on its own parameters, its blocks zero-padded to the slots' common shape) instead
of a ``lax.switch`` over per-device programs.

The contract a template's author promises (and the device tests check, the lowered program
against the numpy interpreter): with :math:`f_\theta` the forward of parameters :math:`\theta`,

- **padding-consistent**: for inputs zero-padded beyond their blocks (to larger shapes),
  parameters zero-padded likewise, and larger ``shapes`` asked of the outputs, the leading
  corner of each output (the block's own shape) is :math:`f_\theta` of the real blocks; the
  entries beyond it may be anything (linop zeroes them);
- the same of the adjoint :math:`f_\theta^{*}`.

A correlation is padding-consistent (an output entry reads only inputs at smaller or equal
positions than the block's last; padded channels meet zero weights), and so are elementwise
maps; a dense matrix of a worker's exact shape is not.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["KernelTemplate"]


@dataclass(frozen=True, eq=False)
class KernelTemplate:
    """A JAX kernel pair shared by workers up to their parameters and shapes.

    Parameters
    ----------
    forward, adjoint : callable
        ``forward(params, *blocks, shapes=...)`` returns one array per output block (a single
        array for one output) of the shapes ``shapes`` (a tuple of shape tuples, one per
        output); ``adjoint`` the same of the adjoint map. jnp code on blocks without a batch
        axis (linop maps them over batch axes with ``jax.vmap``). Both must be
        padding-consistent (see the module).
    params : tuple of arrays
        This worker's parameters (numbers: closed over by the switch path, stacked over the
        devices by the one-kernel path).
    key : hashable
        What else the callables depend on (stride, dilation, ...): workers whose templates
        have the same callables and equal keys run as one kernel.
    """

    forward: Callable[..., Any]
    adjoint: Callable[..., Any]
    params: tuple[Any, ...]
    key: Hashable = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", tuple(np.asarray(p) for p in self.params))

    def family(self) -> tuple[int, int, Hashable]:
        """What workers' templates must share to run as one kernel (with params of one rank
        and dtype each)."""
        return (id(self.forward), id(self.adjoint), self.key)

    def bound(self, adjoint: bool, shapes: Sequence[tuple[int, ...]]) -> Callable[..., Any]:
        """The forward (or adjoint) on this worker's parameters, for outputs of ``shapes``."""
        function = self.adjoint if adjoint else self.forward
        params, out = self.params, tuple(tuple(s) for s in shapes)
        return lambda *blocks: function(params, *blocks, shapes=out)
