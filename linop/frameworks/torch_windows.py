r"""What the torch modules of this process's blocks share: :class:`BlockModule` (a tree run as a
differentiable function on the blocks a process holds, its ``token``, the engine arguments)
and :class:`WindowModule` (a halo window tree, then a local step per output block: max
pooling, interpolation, a fused chain of window layers).

A window module computes, for each output block :math:`j` this process owns,

.. math::

    \tilde x = W x, \qquad y_j = f_j(\tilde x_j), \qquad
    \bar x = W^{*} \big( (\partial f_j)^{*} \bar y_j \big)_j

with :math:`W` the layer's ``window_operator`` (an exactly proven tree, run as a
:class:`~linop.frameworks.torch_function.TorchOperator` whose backward is its adjoint) and
:math:`f_j` the subclass's local step (:meth:`WindowModule.local`), torch's own kernel on the
window whose autograd gives the local vector-Jacobian product.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import StateError
from ..operator import LinearOperator
from .torch_function import TorchOperator, engine_arguments
from .torch_placement import Placement, workers_of

__all__ = ["BlockModule", "WindowModule"]


class BlockModule(torch.nn.Module):
    """A module whose calls take this process's blocks (a dict of tensors) and return its
    blocks, around one tree run as a differentiable function (:attr:`function`).

    Parameters
    ----------
    tree : LinearOperator
        The tree (its backward: the adjoint).
    comm : mpi4py communicator, optional
        Run across its ranks.
    group : torch.distributed ProcessGroup or True, optional
        Run across the ranks of this process group (``True``: the world group).
    mapping : WorkerMap, sequence of int or dict of int to int, optional
        Across processes, the rank of each worker of the tree (default worker ``w`` on rank
        ``w``; a rank may hold several workers or none), as the executors' ``mapping=``
        (:func:`linop.backends.mpi.plan_for`): this process passes and gets back the blocks
        of the workers on its rank (:class:`~linop.frameworks.torch_placement.Placement`).
        Not used in one process.

    Attributes
    ----------
    function : TorchOperator
        The tree as a differentiable function of this process's blocks.
    input_names, output_names : tuple of str
        The blocks this process passes in and gets back.
    token : torch.Tensor
        An empty output of the last call (add ``module.token.sum()`` to the loss of a process
        whose outputs do not enter it, so that its collective backward runs).

    Raises
    ------
    ProcessGroupArgumentError
        ``comm`` and ``group`` both given.
    WorkerMapError
        Across processes, a malformed ``mapping``, or one that leaves a worker of the tree out
        or names a rank the communicator or group lacks (on every rank given it, when the
        module is built).
    WorkerMapMismatchError
        The ranks were given different maps (at the first call, on every rank: the executor's
        entry check).
    """

    def __init__(
        self, tree: LinearOperator, *, comm: Any = None, group: Any = None, mapping: Any = None
    ) -> None:
        super().__init__()
        engine_arguments(comm, group)
        self.comm, self.group = comm, group
        self.placement = Placement(mapping, comm, group, workers_of(tree))
        self.function = TorchOperator(tree, comm=comm, group=group, mapping=self.placement.map)
        self.input_names: tuple[str, ...] = self.function.inputs
        self.output_names: tuple[str, ...] = self.function.outputs

    @property
    def token(self) -> torch.Tensor:
        """The empty output of the last call (see the class)."""
        return self.function.token


class WindowModule(BlockModule, metaclass=abc.ABCMeta):
    """A :class:`BlockModule` whose tree is a layer's halo windows, followed on each output
    block by a local step (the subclass's :meth:`local`).

    Subclasses list their output blocks in ``_products`` (this process's only): tuples
    ``(output name, window name, output shape, *arguments)``; ``arguments`` are passed to
    :meth:`local` with the block's window. A block with no outputs is an empty tensor still
    tied to the windows' graph (so that every process's backward runs).
    """

    _products: list[tuple[Any, ...]]

    @property
    def windows(self) -> TorchOperator:
        """The windows' tree as a differentiable function."""
        return self.function

    @abc.abstractmethod
    def local(self, window: torch.Tensor, *arguments: Any) -> torch.Tensor:
        """The local step on one output block's window (each subclass's own)."""

    def check(self, x: Mapping[str, torch.Tensor]) -> None:
        """Refuse what is no dict of blocks (before any communication); subclasses add their
        own checks.

        Raises
        ------
        StateError
            ``x`` is not a mapping.
        """
        if not isinstance(x, Mapping):
            raise StateError(
                f"{type(self).__name__} takes a dict of blocks {list(self.input_names)}, not {type(x).__name__}"
            )

    def forward(self, x: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self.check(x)
        windows = self.function(x)
        result = {}
        for out, window_name, shape, *arguments in self._products:
            window = windows[window_name]
            if 0 in shape:  # no output here: an empty block, still tied to the windows' graph
                result[out] = window.reshape(-1)[:0].reshape(shape)
                continue
            result[out] = self.local(window, *arguments)
        return result
