r"""Distributed interpolation as PyTorch modules: :class:`Interpolate` and :class:`Upsample`.

The layer is linear, one operator tree :math:`y = L W x` (:class:`linop.layers.Interpolate`:
the windows of the inputs each worker's outputs read, then the local interpolation), so the
module is that tree as a differentiable function (:class:`~linop.frameworks.torch_function.
TorchOperator`): the forward runs it, the backward its adjoint :math:`W^{*} L^{*}` (the local
transposes, then the adjoint halo exchange adding each window entry back into its owner). In
one process the numpy interpreter runs it; across MPI ranks (``comm=``) or a torch.distributed
process group (``group=``) each process passes its own blocks of x and gets its own blocks of y.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..errors import StateError
from ..layers import Interpolate as InterpolateLayer
from ..partition import DistributedTensor
from .torch_function import TorchOperator, engine_arguments

__all__ = ["Interpolate", "Upsample"]

_NUMPY_DTYPES = {torch.float32: "float32", torch.float64: "float64"}


class Interpolate(torch.nn.Module):
    r"""``torch.nn.functional.interpolate`` of a distributed tensor, as a module: ``module(x)``
    takes this process's blocks of x (a dict of tensors) and returns its blocks of y.

    Parameters
    ----------
    x : DistributedTensor
        The input's layout (N, C, *spatial), any partition.
    size, scale_factor, mode, align_corners, recompute_scale_factor
        As ``torch.nn.functional.interpolate`` (modes nearest, nearest-exact, linear,
        bilinear, trilinear).
    name : str
        The output tensor's name (default ``"y"``).
    output_sizes : sequence, optional
        The output's shares per spatial dimension (None entries balanced).
    dtype : torch.dtype
        float64 (default) or float32: the data's dtype, whose rounding torch's nearest modes
        follow; a module of a nearest mode refuses data of the other floating dtype.
    comm : mpi4py communicator, optional
        Run across its ranks.
    group : torch.distributed ProcessGroup or True, optional
        Run across the ranks of this process group (``True``: the world group).

    Attributes
    ----------
    layer : linop.layers.Interpolate
        The description (its ``operator`` is the tree run here).
    x, y : DistributedTensor
    input_names, output_names : tuple of str
        The blocks this process passes in and gets back.
    token : torch.Tensor
        An empty output of the last call, for a process that owns no block of y (it adds
        ``module.token.sum()`` to its loss so that its collective backward runs).

    Raises
    ------
    LayerError
        As :class:`linop.layers.Interpolate`.
    ProcessGroupArgumentError
        ``comm`` and ``group`` both given.
    """

    def __init__(
        self,
        x: DistributedTensor,
        size: int | Sequence[int] | None = None,
        scale_factor: float | Sequence[float] | None = None,
        mode: str = "nearest",
        align_corners: bool | None = None,
        recompute_scale_factor: bool | None = None,
        *,
        name: str = "y",
        output_sizes: Sequence[Sequence[int] | None] | None = None,
        dtype: torch.dtype = torch.float64,
        comm: Any = None,
        group: Any = None,
    ) -> None:
        super().__init__()
        engine_arguments(comm, group)
        self.layer = InterpolateLayer(
            x,
            size=size,
            scale_factor=scale_factor,
            mode=mode,
            align_corners=align_corners,
            recompute_scale_factor=recompute_scale_factor,
            name=name,
            output_sizes=output_sizes,
            dtype=_NUMPY_DTYPES.get(dtype, dtype),
        )
        self.dtype = dtype
        self.x, self.y = self.layer.x, self.layer.y
        self.function = TorchOperator(self.layer.operator, comm=comm, group=group)
        self.input_names, self.output_names = self.function.inputs, self.function.outputs

    @property
    def token(self) -> torch.Tensor:
        """The empty output of the last call (see the class)."""
        return self.function.token

    def forward(self, x: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.layer.mode.startswith("nearest") and isinstance(x, Mapping):
            for name, tensor in x.items():
                if (
                    tensor.is_floating_point()
                    and tensor.dtype in _NUMPY_DTYPES
                    and tensor.dtype != self.dtype
                ):
                    raise StateError(
                        f"Interpolate ({self.layer.mode}): block {name!r} is {tensor.dtype}, the module was built "
                        f"for {self.dtype} (torch's nearest entries depend on the dtype's rounding)"
                    )
        return self.function(x)

    def extra_repr(self) -> str:
        layer = self.layer
        corners = (
            f", align_corners={layer.align_corners}" if layer.mode not in ("nearest", "nearest-exact") else ""
        )
        return f"{layer.mode}{corners}: {layer.x} -> {layer.y}"


class Upsample(Interpolate):
    """``torch.nn.Upsample`` of a distributed tensor: :class:`Interpolate` under torch's module
    name (the same parameters)."""
