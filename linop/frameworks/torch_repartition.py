r"""A repartition between two layouts of one tensor, as a PyTorch module: :class:`Repartition`.

Between two layers whose partitions differ (a convolution on spatial workers, an affine map on
feature workers), the tensor is re-decomposed: :class:`linop.Repartition` :math:`T`, a
permutation of the entries, so :math:`T^{*} = T^{-1}` is the reverse repartition. The module is
that tree as a differentiable function: forward :math:`y = T x`, backward
:math:`\bar x = T^{*} \bar y` (the reverse repartition of the gradient).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..partition import DistributedTensor
from ..repartition import Repartition as RepartitionOperator
from .torch_function import TorchOperator, engine_arguments

__all__ = ["Repartition"]


class Repartition(torch.nn.Module):
    r"""Re-decompose a distributed tensor from ``source``'s layout to ``destination``'s:
    ``module(x)`` takes this process's blocks of ``source`` (a dict of tensors) and returns its
    blocks of ``destination``; gradients flow back through the reverse repartition.

    Parameters
    ----------
    source, destination : DistributedTensor
        Two layouts of the same global shape (any partitions and shares, empty ones
        included), with different names.
    comm : mpi4py communicator, optional
        Run across its ranks.
    group : torch.distributed ProcessGroup or True, optional
        Run across the ranks of this process group (``True``: the world group).

    Attributes
    ----------
    operator : linop.Repartition
        The tree run here (``operator.H``: the reverse repartition).
    input_names, output_names : tuple of str
        The blocks this process passes in and gets back.
    token : torch.Tensor
        An empty output of the last call (add ``module.token.sum()`` to the loss of a process
        that owns no block of ``destination``, so that its collective backward runs).

    Raises
    ------
    GlobalShapeError, BlockExistsError
        As :class:`linop.Repartition`.
    """

    def __init__(
        self,
        source: DistributedTensor,
        destination: DistributedTensor,
        *,
        comm: Any = None,
        group: Any = None,
    ) -> None:
        super().__init__()
        engine_arguments(comm, group)
        self.source, self.destination = source, destination
        self.operator = RepartitionOperator(source, destination)
        self.function = TorchOperator(self.operator, comm=comm, group=group)
        self.input_names, self.output_names = self.function.inputs, self.function.outputs

    @property
    def token(self) -> torch.Tensor:
        """The empty output of the last call (see the class)."""
        return self.function.token

    def forward(self, x: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.function(x)

    def extra_repr(self) -> str:
        return f"{self.source} -> {self.destination}"
