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

A call is one autograd node (:class:`_MaxPoolFunction`): the windows' tree run untracked,
the strips filled in place on the windows the run made (never the caller's memory), torch's
pool with its indices (on a gloo process group the tree runs on local blocks the module owns,
:class:`~linop.frameworks.torch_windows.WindowWorkspace`: the input copied into their bulk,
the exchange bound in place on them, their padding :math:`-\infty` from the start, so no
strip is filled per call and no block allocated); its backward adds each output gradient into the window entry the
indices name (:math:`(\partial \max_k)^{*}`, a scatter-add) and runs the windows' adjoint
tree, on the same bound plans as :class:`~linop.frameworks.torch_function.TorchOperator`'s
calls. What depends on the shapes and the plan alone (the blocks' names and order, the
windows' and outputs' shapes, the strips) is worked out once, when the module is built. Under
``create_graph`` the backward is itself recorded (the scatter and the adjoint tree, through
:meth:`~linop.frameworks.torch_function.TorchOperator.adjoint_tensors`): double backward, as
``torch.nn.MaxPool``. Across processes that recorded backward is a collective call too, and
its backward (the windows again) is collective: after it, :attr:`MaxPool.token` is *its*
token, which a process whose second-order loss does not depend on this module's input
gradients adds to that loss (as the forward's token to the first), so that every process
runs the windows' exchange of the second-order backward.

A call this module refuses on one process (a block of another shape or dtype, a missing
block) goes through the tree its peers are in: at the first call the collective entry check
(every process raises the agreed error, and the module goes on), later through the bound
exchange's failure record in the group's store (the peers, waiting in the exchange, name this
process and its error). Such a later refusal is kept: every later call of the module on that
process raises it again without communicating (its peers still wait in the refused call, which
a retry would complete out of step, or, refused anew, replace the record they read).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

import numpy as np
import torch

from ..errors import DtypeError, LayerError, LinopError, StateError
from ..halo_geometry import Kernel
from ..layers import MaxPoolJacobian
from ..partition import DistributedTensor
from .torch_function import fitted_gradient
from .torch_strips import PaddingStrips, padding_strips
from .torch_windows import WindowModule, WindowWorkspace

__all__ = ["MaxPool"]

_POOLS_WITH_INDICES = {
    1: torch.nn.functional.max_pool1d_with_indices,
    2: torch.nn.functional.max_pool2d_with_indices,
    3: torch.nn.functional.max_pool3d_with_indices,
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
        ``output_names`` and ``token``, which after a backward under ``create_graph`` is that
        backward's token: see the module docstring): ``mapping`` places the workers of x's
        partition on the ranks, this process pooling the output blocks of the workers on its
        rank.

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
        if dims not in _POOLS_WITH_INDICES:
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
        self._pool_with_indices = _POOLS_WITH_INDICES[dims]
        self._products = []
        windows = {}
        for g in self.placement.held(self.y.partition):  # this process's blocks alone
            out = self.y.block(g)
            window = self.layer.geometry.window_shape(g)
            real = self.layer.real_entries(g)  # over every dimension: batch and channels all real
            padded = None
            if 0 not in window and not real.all():
                padded = padding_strips(np.broadcast_to(real, window)[(0,) * 2], g, "MaxPool")
            self._products.append((out.name, self.layer.window_name(g), out.shape, padded))
            windows[self.layer.window_name(g)] = tuple(window)
        self.output_names = tuple(name for name, *_ in self._products)
        adjoint_inputs = self.function.names(adjoint=True)[0]
        if set(adjoint_inputs) != set(windows):  # pragma: no cover - the geometry and the tree agree
            raise LayerError(
                f"MaxPool: this process's windows {sorted(adjoint_inputs)} are not those of its outputs {sorted(windows)}"
            )
        # the backward's windows, in the order of the adjoint tree's inputs: each one's product
        # (its output's place in _products) and shape
        slot = {window_name: k for k, (_, window_name, *_) in enumerate(self._products)}
        self._adjoint_inputs = tuple(adjoint_inputs)
        self._window_order = tuple((slot[name], windows[name]) for name in adjoint_inputs)
        # on a gloo group: the windows on local blocks this module owns, their padding -inf
        # once (no strips to fill per call), the exchange bound in place on them
        self._workspace = WindowWorkspace.of(
            self.function.op, self.input_names, group=group, mapping=self.placement.map, fill=float("-inf")
        )
        self._input_shapes: tuple[torch.Size, ...] = ()
        self._failed: StateError | None = None  # a refusal of this rank alone, after binding
        self._scratch: tuple[torch.dtype, tuple[torch.Tensor | None, ...]] | None = None  # _scratch_for
        if self._workspace is not None:
            self._input_shapes = self._workspace.input_shapes()
            if set(self._workspace.window_names) != set(windows):  # pragma: no cover - one geometry
                raise LayerError(f"MaxPool: the workspace's windows are not those of {sorted(windows)}")

    def forward(self, x: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self._failed is not None:
            self._refused_before()
        tensors = self.tensors_of(x)
        for name, tensor in zip(self.input_names, tensors):
            if not tensor.is_floating_point():  # the pool pads with -inf
                self._refuse(
                    DtypeError(
                        f"MaxPool: block {name!r} is {tensor.dtype}: the pool takes floating-point blocks"
                    ),
                    tensors,
                )
        return self._outputs(_MaxPoolFunction.apply(self, self._anchor, *tensors))

    def tensors_of(self, x: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """This process's blocks in ``x`` (:meth:`BlockModule.tensors_of
        <linop.frameworks.torch_windows.BlockModule.tensors_of>`); on a process group, what
        is no dict of them is refused through :meth:`_refuse` (on a gloo group the tree its
        peers wait in is the workspace's exchange, not the windows' function)."""
        if self.function.group is None:
            return super().tensors_of(x)
        if type(x) is dict and len(x) == len(self.input_names):
            tensors = [x.get(name) for name in self.input_names]
            if all(isinstance(t, torch.Tensor) for t in tensors):
                return tensors  # type: ignore[return-value]
        if not isinstance(x, Mapping):
            self._refuse(
                StateError(
                    f"MaxPool takes a dict of blocks {list(self.input_names)}, not {type(x).__name__}"
                ),
                [],
            )
        missing = [name for name in self.input_names if name not in x]
        extra = [name for name in x if name not in self.input_names]
        if missing or extra:
            self._refuse(
                StateError(
                    f"state for {self.function.op}: missing block(s) {missing}, unexpected block(s) {extra} "
                    "(across ranks pass only this rank's blocks)"
                ),
                [],
            )
        for name in self.input_names:
            if not isinstance(x[name], torch.Tensor):
                self._refuse(
                    StateError(f"block {name!r} must be a torch tensor, not {type(x[name]).__name__}"), []
                )
        return [x[name] for name in self.input_names]

    def _refuse(
        self, error: StateError, tensors: Sequence[torch.Tensor], dtype: torch.dtype = torch.float64
    ) -> NoReturn:
        """Raise ``error``, found by this module's own check of a call's blocks, as the windows'
        function refuses a call (on a gloo group through the workspace's exchange, whose
        binding its peers are in; stand-ins of ``dtype`` that allocate nothing take the refused
        blocks' place, :meth:`WindowWorkspace.refuse
        <linop.frameworks.torch_windows.WindowWorkspace.refuse>`: the forward's promoted dtype
        for a shape refusal, float64 otherwise, a dtype the peers' check takes, so that it names
        this rank's ``error`` and not the stand-ins).

        On a process group a refusal after binding is this rank's alone (reported to the
        group's store: the peers, waiting in the bound exchange, name this rank and
        ``error``); it is kept, and every later call of this module on this rank raises it
        again (:meth:`_refused_before`) without communicating: a retry would otherwise
        complete the peers' waiting call out of step (or, refused again, replace the record
        they read, so that they could no longer name this rank)."""
        try:
            if self._workspace is not None:
                self._workspace.refuse(error, dtype)
            self.function.refuse(error, dict(zip(self.input_names, tensors)))
        except LinopError as raised:
            if raised is error and self.function.group is not None:  # alone: not the agreed error
                self._failed = error
            raise

    def _refused_before(self) -> NoReturn:
        """Raise the refusal this rank made alone after binding, again (see :meth:`_refuse`)."""
        failed = self._failed
        assert failed is not None
        raise type(failed)(
            f"{failed} (an earlier call of this module on this rank, refused on this rank alone "
            "after its peers had bound its exchange: they wait in that call, so this module "
            "refuses every later call; end the job)"
        ) from failed

    def local(self, window: torch.Tensor, padded: PaddingStrips | None) -> torch.Tensor:
        """torch's max pool of one window, its padding strips set to -inf on a copy, recorded by
        autograd: the generic window-module step (:class:`WindowModule`), which this module's
        own forward replaces by one node computing the same."""
        if padded is not None:
            window = padded.fill_(window.clone())
        return self._pool_with_indices(window, self.size, self.stride, (0,) * len(self.size), self.dilation)[
            0
        ]

    def pooled(self, window: torch.Tensor, padded: PaddingStrips | None) -> tuple[torch.Tensor, torch.Tensor]:
        """torch's max pool of a window the windows' tree made (untracked), its padding strips
        set to -inf in place first, and the flat spatial index of each output's entry."""
        if padded is not None:
            padded.fill_(window)
        return self._pool_with_indices(window, self.size, self.stride, (0,) * len(self.size), self.dilation)

    def _scratch_for(
        self, dtype: torch.dtype, windows: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor | None, ...]:
        """Per output of :attr:`_products`, in their order: when its window in the backward's
        ``windows`` (:meth:`WindowWorkspace.gradient_windows
        <linop.frameworks.torch_windows.WindowWorkspace.gradient_windows>`, in ``dtype``) is a
        box inside a larger block, not contiguous, a contiguous tensor of its shape and dtype
        to scatter into first (:func:`_add_chosen`), else None. They are views of one buffer,
        as large as the largest such window (the windows take turns, each used up before the
        next), kept from call to call for the dtype last used, instead of a block allocated
        per window and call (for a large window, fresh pages faulted in on every call)."""
        kept = self._scratch
        if kept is not None and kept[0] == dtype:
            return kept[1]
        boxes = [None if w.is_contiguous() else w for w in (windows[name] for _, name, *_ in self._products)]
        buffer = torch.empty(max((w.numel() for w in boxes if w is not None), default=0), dtype=dtype)
        views = tuple(None if w is None else buffer[: w.numel()].view(w.shape) for w in boxes)
        self._scratch = (dtype, views)
        return views

    def extra_repr(self) -> str:
        return f"{self.layer.kernel}: {self.layer.x} -> {self.layer.y}"


class _MaxPoolFunction(torch.autograd.Function):
    r"""forward(module, anchor, \*x blocks) -> (\*y blocks, token): :math:`y_j = \max_k (W x)_j`
    with the windows :math:`W x` run untracked; backward :math:`\bar x = W^{*} S^{*} \bar y`,
    :math:`S^{*}` adding each output's gradient into the window entry its index names."""

    @staticmethod
    def forward(ctx: Any, module: MaxPool, anchor: torch.Tensor | None, *tensors: torch.Tensor) -> Any:
        function, workspace = module.function, module._workspace
        dtype = tensors[0].dtype if tensors else torch.float64
        if workspace is None:
            views = function.bound_views(tensors) if module.comm is not None else None
            if views is None:
                windows = function.untracked(dict(zip(function.inputs, tensors)))
            else:  # the binding's result buffers: pooled below (the -inf strips, the pool) and let go
                windows = dict(zip(function.outputs, views))
        else:
            for name, tensor, shape in zip(module.input_names, tensors, module._input_shapes):
                dtype = torch.promote_types(dtype, tensor.dtype)
                if tensor.shape != shape:
                    module._refuse(
                        StateError(
                            f"MaxPool: block {name!r} has shape {tuple(tensor.shape)}, the layer takes {tuple(shape)}"
                        ),
                        tensors,
                        dtype,
                    )
            windows = workspace.windows(tensors, dtype)  # their padding -inf already
        outputs = []
        chosen: list[torch.Tensor | None] = []
        for _, window_name, shape, padded in module._products:
            window = windows[window_name]
            if 0 in shape:  # no output here: an empty block (the window's gradient is zero)
                outputs.append(window.new_empty(shape))
                chosen.append(None)
                continue
            y, indices = module.pooled(window, None if workspace is not None else padded)
            outputs.append(y)
            chosen.append(indices)
        if workspace is not None and tensors and tensors[0].device.type != "cpu":
            outputs = [y.to(tensors[0].device) for y in outputs]
        ctx.module, ctx.chosen, ctx.dtype = module, chosen, dtype
        ctx.fit = [(t.dtype, t.device) for t in tensors]
        return (*outputs, torch.zeros(0, dtype=torch.float64))  # the last: the token

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        module, chosen = ctx.module, ctx.chosen
        workspace = module._workspace
        back: tuple[torch.Tensor, ...]
        if workspace is not None and not torch.is_grad_enabled():
            targets = workspace.gradient_windows(ctx.dtype)  # T*: zeroed, each window's view
            scratch = module._scratch_for(ctx.dtype, targets)
            for (_, window_name, _, _), indices, grad, added in zip(module._products, chosen, grads, scratch):
                if indices is not None:
                    _add_chosen(targets[window_name], indices, grad, scratch=added)
            back = workspace.input_gradients()  # H* in place, then E*: copies
        else:
            window_grads = []
            for k, shape in module._window_order:
                window = torch.zeros(shape, dtype=grads[k].dtype, device=grads[k].device)
                if chosen[k] is not None:
                    # S^*: recorded under create_graph (differentiable in the output gradient)
                    window = _add_chosen(window, chosen[k], grads[k], inplace=not torch.is_grad_enabled())
                window_grads.append(window)
            function = module.function
            if torch.is_grad_enabled():  # create_graph: the adjoint tree recorded too
                back = function.adjoint_tensors(*window_grads)
                if module._anchor is not None:  # its token, the module's now (for the next loss)
                    module.__dict__["_token"] = function.token
            else:
                views = function.bound_views(window_grads, adjoint=True) if module.comm is not None else None
                if views is not None:  # the binding's result buffers, copied
                    adjoint = {n: v.clone() for n, v in zip(function.names(adjoint=True)[1], views)}
                else:
                    adjoint = function.untracked(
                        dict(zip(module._adjoint_inputs, window_grads)), adjoint=True
                    )
                back = tuple(adjoint[name] for name in function.inputs)
        fitted = [fitted_gradient(gradient, *fit) for gradient, fit in zip(back, ctx.fit)]
        return (None, None, *fitted)  # the module; the anchor: no gradient (see anchor())


def _add_chosen(
    window: torch.Tensor,
    indices: torch.Tensor,
    grad: torch.Tensor,
    *,
    inplace: bool = True,
    scratch: torch.Tensor | None = None,
) -> torch.Tensor:
    """:math:`S^{*}`: each output's gradient added into the window entry it chose (``indices``:
    flat over the spatial axes, as torch's pools give them); in place into ``window`` (a view
    of a zeroed block, say), or out of place (recorded by autograd). A window that is not
    contiguous (a box inside a larger block) is scattered into a zeroed contiguous tensor
    first, ``scratch`` (of the window's shape and dtype, kept by the caller) when given, else
    a new one, and added into the window from there."""
    n, c = window.shape[:2]
    grad = grad.to(dtype=window.dtype, device=window.device).flatten(2)
    if not inplace:
        return window.reshape(n, c, -1).scatter_add(2, indices.flatten(2), grad).view(window.shape)
    if window.is_contiguous():
        window.view(n, c, -1).scatter_add_(2, indices.flatten(2), grad)
    else:  # a window box inside a larger block: through a contiguous block
        if scratch is None:
            added = torch.zeros(window.shape, dtype=window.dtype, device=window.device)
        else:
            added = scratch.zero_()
        window.add_(added.view(n, c, -1).scatter_add_(2, indices.flatten(2), grad).view(window.shape))
    return window
