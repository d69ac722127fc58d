r"""Distributed max pooling as a trainable PyTorch module: :class:`MaxPool`.

Max pooling is not linear; on a partition 1 x P_c x P_0 x ... it is a halo exchange followed by
a local max pool on each worker's window (``docs/theory.md#layers``):

.. math::

    y_j = \max\nolimits_{k}\big(\tilde x_j\big), \quad \tilde x = W x, \qquad
    \bar x = W^{*}\, \big(\partial \max\nolimits_k\big)^{*} \bar y

The windows :math:`W x` are the tree :attr:`linop.layers.MaxPoolJacobian.window_operator`
(pad shim, halo exchange, trim shim: exact 0/1 data movement), run as a differentiable
:class:`~linop.frameworks.torch_function.TorchOperator`; the local pool is torch's own
``max_pool{1,2,3}d`` on the window (no padding: the window holds it), whose autograd gives the
local vector-Jacobian product, and the backward of the windows is the adjoint exchange, adding
each halo entry's gradient back into its owner. Zero padding counts as minus infinity, as in
``torch.nn.MaxPool``: the padded entries of each window are set to ``-inf`` before the
pool (:meth:`linop.layers.MaxPoolJacobian.real_entries`). A window's padding lies only at the
global boundary, in strips: its real entries are a box (a product of one range per spatial
axis), so the module copies the window and fills only the strips outside the box with ``-inf``
(a plain copy and a few slice fills, cheaper than masking the whole window).
The layer's Jacobian at an input is
:class:`linop.layers.MaxPoolJacobian`, which ``verify`` proves; the tests check this module
against it and against ``torch.nn.MaxPool{1,2,3}d``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import LayerError
from ..halo_geometry import Kernel
from ..layers import MaxPoolJacobian
from ..partition import DistributedTensor
from .torch_windows import WindowModule

__all__ = ["MaxPool"]

_POOLS = {
    1: torch.nn.functional.max_pool1d,
    2: torch.nn.functional.max_pool2d,
    3: torch.nn.functional.max_pool3d,
}


def _entries(value: int | Sequence[int], dims: int) -> tuple[int, ...]:
    return tuple(value) if isinstance(value, Sequence) else (int(value),) * dims


class MaxPool(WindowModule):
    r"""``torch.nn.MaxPool{1,2,3}d`` of a distributed tensor, as a module: ``module(x)`` takes
    this process's blocks of x (a dict of tensors) and returns its blocks of y.

    Parameters
    ----------
    x : DistributedTensor
        The input's layout (N, C, S_0, ...), 1-3 spatial dimensions, on a partition 1 x P_c x
        P_0 x ... (any shares); y keeps x's channel shares, its spatial outputs balanced.
    kernel_size, stride, padding, dilation : int or sequence of int
        As ``torch.nn.MaxPool2d`` (``stride`` defaults to ``kernel_size``; the padding at most
        half the dilated kernel, as torch requires). No ``ceil_mode``, no ``return_indices``.
    name : str
        The output tensor's name (default ``"y"``).
    comm, group, mapping
        As :class:`~linop.frameworks.torch_windows.BlockModule` (so are ``input_names``,
        ``output_names`` and ``token``): ``mapping`` places the workers of x's partition on
        the ranks, this process pooling the output blocks of the workers on its rank.

    Attributes
    ----------
    layer : linop.layers.MaxPoolJacobian
        The description (its ``window_operator`` is the halo run here).
    x, y : DistributedTensor

    Raises
    ------
    LayerError
        More than 3 spatial dimensions, a padding wider than half the dilated kernel, or as
        :class:`linop.layers.MaxPoolJacobian`.
    WorkerMapError, WorkerMapMismatchError
        A bad ``mapping``, as :class:`~linop.frameworks.torch_windows.BlockModule`.
    """

    def __init__(
        self,
        x: DistributedTensor,
        kernel_size: int | Sequence[int],
        stride: int | Sequence[int] | None = None,
        padding: int | Sequence[int] = 0,
        dilation: int | Sequence[int] = 1,
        *,
        name: str = "y",
        comm: Any = None,
        group: Any = None,
        mapping: Any = None,
    ) -> None:
        dims = x.ndim - 2 if isinstance(x, DistributedTensor) else 0
        if dims not in _POOLS:
            raise LayerError(f"MaxPool: torch pools 1 to 3 spatial dimensions, not {dims}")
        size, pad, dilate = (_entries(v, dims) for v in (kernel_size, padding, dilation))
        step = size if stride is None else _entries(stride, dims)
        for k, p, d in zip(size, pad, dilate):
            if 2 * p > d * (k - 1) + 1:
                raise LayerError(
                    f"MaxPool: padding {pad} must be at most half the dilated kernel (size {size}, dilation {dilate})"
                )
        layer = MaxPoolJacobian(x, Kernel(size, step, pad, dilate), name=name)
        super().__init__(layer.window_operator, comm=comm, group=group, mapping=mapping)
        self.layer = layer
        self.x, self.y = self.layer.x, self.layer.y
        self.size, self.stride, self.dilation = size, step, dilate
        self._pool = _POOLS[dims]
        self._products = []
        for g in x.partition.indices():
            out = self.y.block(g)
            if not self.placement.holds(out.worker):
                continue
            window = self.layer.geometry.window_shape(g)
            real = self.layer.real_entries(g)  # over every dimension: batch and channels all real
            padded = None
            if 0 not in window and not real.all():
                padded = _strips(np.broadcast_to(real, window)[(0,) * 2], g)
            self._products.append((out.name, self.layer.window_name(g), out.shape, padded))
        self.output_names = tuple(name for name, *_ in self._products)

    def local(self, window: torch.Tensor, padded: _Strips | None) -> torch.Tensor:
        """torch's max pool of the window, its padding strips set to -inf first."""
        if padded is not None:
            window = padded.fill(window)
        return self._pool(window, self.size, self.stride, 0, self.dilation)

    def extra_repr(self) -> str:
        return f"{self.layer.kernel}: {self.layer.x} -> {self.layer.y}"


@dataclass(frozen=True)
class _Strips:
    """A window's padding as strips: per spatial axis, the number of padded entries before and
    after its real entries."""

    before: tuple[int, ...]
    after: tuple[int, ...]

    def fill(self, window: torch.Tensor) -> torch.Tensor:
        """``window`` (N, C, spatial...) with its strips set to ``-inf``; the gradient flows to
        the real entries alone. In place when the window is an output of the windows' tree
        function (not a leaf: a fresh block of this call, never the caller's memory; autograd
        records the fills), else on a copy."""
        out = window.clone() if window.is_leaf else window
        spatial = len(self.before)
        for d, (low, high) in enumerate(zip(self.before, self.after)):
            axis = out.ndim - spatial + d
            if low:
                out.narrow(axis, 0, low).fill_(float("-inf"))
            if high:
                out.narrow(axis, out.shape[axis] - high, high).fill_(float("-inf"))
        return out


def _strips(real: np.ndarray, g: Sequence[int]) -> _Strips:
    """The strips of a window whose real spatial entries are ``real`` (a box: one range of
    entries per axis, the padding before and after it).

    Raises
    ------
    LayerError
        If the real entries are not a box (worker ``g``'s geometry would be inconsistent).
    """
    before, after = [], []
    for d in range(real.ndim):
        along = real.any(axis=tuple(k for k in range(real.ndim) if k != d))
        entries = np.flatnonzero(along)
        if entries.size == 0:
            raise LayerError(f"MaxPool: worker {tuple(g)}'s window has no real entry along spatial axis {d}")
        before.append(int(entries[0]))
        after.append(real.shape[d] - int(entries[-1]) - 1)
    box = tuple(slice(low, n - high) for low, high, n in zip(before, after, real.shape))
    expected = np.zeros(real.shape, dtype=bool)
    expected[box] = True
    if not np.array_equal(real, expected):
        raise LayerError(f"MaxPool: worker {tuple(g)}'s real window entries are not a box")
    return _Strips(tuple(before), tuple(after))
