r"""Distributed pooling as operator trees: average pooling, and max pooling's Jacobian.

On a partition 1 x P_c x P_0 x ... (docs/theory.md#layers) pooling is a halo exchange followed
by a local kernel on each worker's window:

.. math::

    y = L\, H\, x, \qquad x^{*} = H^{*} L^{*} y

* :class:`AveragePool`: L takes the mean of each window (linear; with 2^k taps its entries are
  dyadic, so the matrices are exact in floating point).
* :class:`MaxPoolJacobian`: max pooling is not linear, but its Jacobian at a given input x_0 is:
  a *selection* operator, each output taking the entry of its window where x_0 is largest (the
  first one on ties). Zero padding counts as minus infinity, as in torch and DistDL: a window
  that touches the padding selects its largest real entry, however negative.
  Its matrix has one 1 per output row, so it is proven exactly; applied to x_0 itself it gives
  max pooling of x_0.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..halo import halo_windows
from ..halo_geometry import Kernel, halo_geometry
from ..operator import LinearOperator
from ..partition import DistributedTensor, grid_block_name
from . import kernels
from .base import LayerError, require_shape, require_tensor, window_stage

__all__ = ["AveragePool", "MaxPoolJacobian"]


class _Pool:
    layer = "Pool"
    label: str  # the short name of each subclass's local steps

    def __init__(self, x: DistributedTensor, kernel: Kernel | int, *, name: str = "y") -> None:
        self.x = require_tensor(self.layer, "x", x)
        dims = x.ndim - 2
        if dims < 1:
            raise LayerError(
                f"{self.layer}: x {x.global_shape} needs (batch, channel, spatial...) dimensions"
            )
        if x.partition.shape[0] != 1:
            raise LayerError(
                f"{self.layer}: the batch dimension of x's partition {x.partition.shape} must have extent 1"
            )
        if not isinstance(kernel, Kernel):
            kernel = Kernel(kernel)
        if kernel.leading not in (0, 2):
            raise LayerError(
                f"{self.layer}: the kernel acts on the spatial dimensions; leading must be 0, not {kernel.leading}"
            )
        self.kernel = Kernel(
            kernel.size, kernel.stride, kernel.padding, kernel.dilation, kernel.boundary, leading=2
        ).resolve(x.ndim)
        # batch and channels stay where x has them (its shares, balanced or not: no halo along
        # them); the spatial outputs are balanced
        self._window_shares = (x.sizes[0], x.sizes[1], *(None,) * dims)
        self.geometry = halo_geometry(x, self.kernel, output_sizes=self._window_shares)
        self.y = DistributedTensor(
            name, self.geometry.output_shape, x.partition, sizes=self.geometry.output_sizes
        )
        self.dims = dims
        self._window_name = f"{x.name}_window"

    @property
    def window_operator(self) -> LinearOperator:
        """The halo exchange x -> the windows (exact 0/1 data movement)."""
        return halo_windows(
            self.x, self.kernel, window_name=self._window_name, output_sizes=self._window_shares
        )

    def window_name(self, g) -> str:
        return grid_block_name(self._window_name, g)

    def _parts(self):
        k = self.kernel
        return k.size[2:], k.stride[2:], k.dilation[2:]

    def _stage(self, kernels_of) -> LinearOperator:
        moving = self.window_operator
        stage = window_stage(
            moving.range,
            self.x.partition,
            self.y,
            self.window_name,
            lambda g, _: kernels_of(g, self.geometry.window_shape(g)),
            self.label,
        )
        return stage @ moving


class AveragePool(_Pool):
    r"""Distributed average pooling :math:`y = L_{\text{mean}} H x` on 1 x P_c x P_0 x ...

    Parameters
    ----------
    x : DistributedTensor
        Input (N, C, S_0, ...), batch not partitioned; y keeps its channel shares (balanced or
        not), its spatial outputs balanced.
    kernel : Kernel or int
        Spatial pooling window (size, stride, padding, dilation; padding counts as zeros).
    name : str, optional
        Output tensor name.

    Raises
    ------
    LayerError
        If the batch dimension is partitioned or x has no spatial dimension.
    """

    layer = "AveragePool"
    label = "avg"

    @property
    def operator(self) -> LinearOperator:
        """The tree x -> y (linear)."""
        size, stride, dilation = self._parts()

        def kernels_of(g, window):
            def forward(x: np.ndarray) -> np.ndarray:
                return kernels.average_pool(x, size, stride, dilation)

            def adjoint(y: np.ndarray) -> np.ndarray:
                return kernels.average_pool_adjoint(y, window[2:], size, stride, dilation)

            return forward, adjoint

        return self._stage(kernels_of)


class MaxPoolJacobian(_Pool):
    r"""The Jacobian of distributed max pooling at a given input: :math:`J = S_{x_0} H` with
    :math:`S_{x_0}` selecting, per output, the first largest entry of its window of
    :math:`x_0` (:func:`~linop.layers.kernels.max_selection`); :math:`J^* = H^* S^*` adds each
    output gradient into the entry it came from.

    Build it with :meth:`at`, from the windows of x_0 (``window_operator(x0)``; under MPI the
    windows a rank holds are enough).
    """

    layer = "MaxPoolJacobian"
    label = "max"

    def real_entries(self, g: Sequence[int]) -> np.ndarray:
        """Which entries of worker ``g``'s window are x's own (True) rather than zero padding
        (False): padding positions lie outside ``[0, length)`` in a dimension whose boundary
        is ``"zero"`` (other boundaries fill the padding with x's entries)."""
        boundary = self.kernel.boundary
        masks = []
        for d, row in enumerate(self.geometry.worker_rows(g)):
            coords = np.arange(row.need_start, row.need_stop)
            mode = boundary if isinstance(boundary, str) else boundary[d]
            masks.append(
                (coords >= 0) & (coords < row.length) if mode == "zero" else np.ones(coords.size, bool)
            )
        real = np.ones((1,) * len(masks), dtype=bool)
        for d, mask in enumerate(masks):
            real = real & mask.reshape([-1 if k == d else 1 for k in range(len(masks))])
        return real

    def at(self, windows: Mapping[str, Any]) -> LinearOperator:
        """The Jacobian at the input whose windows are ``windows`` (a state of the windows, or
        the blocks of it this rank holds).

        Raises
        ------
        LayerError
            If a window has the wrong shape, or a missing one is needed.
        """
        size, stride, dilation = self._parts()
        selections = {}
        for g in self.x.partition.indices():
            name = self.window_name(g)
            if name in windows:
                window = require_shape(
                    self.layer, f"window {name!r}", windows[name], self.geometry.window_shape(g)
                )
                selections[name] = kernels.max_selection(
                    np.asarray(window), size, stride, dilation, self.real_entries(g)
                )

        def kernels_of(g, window):
            name = self.window_name(g)

            def chosen() -> np.ndarray:
                if name not in selections:
                    raise LayerError(f"{self.layer}: the window {name!r} of x0 was not given to at()")
                return selections[name]

            def forward(x: np.ndarray) -> np.ndarray:
                return kernels.select(x, chosen(), window)

            def adjoint(y: np.ndarray) -> np.ndarray:
                return kernels.select_adjoint(y, chosen(), window)

            return forward, adjoint

        return self._stage(kernels_of)
