r"""A chain of sliding-window layers with one fused halo exchange, as a trainable PyTorch module:
:class:`ChainModule`.

The chain (:class:`linop.layers.WindowChain`: convolutions, average and max pools) runs as one
halo exchange of the fused window and the stages on each enlarged window
(``docs/theory.md#layers``):

.. math::

    \tilde x = W x, \qquad y_j = L_L M_L \cdots M_2 L_1\, \tilde x_j, \qquad
    \bar x = W^{*} \big(\partial (L_L M_L \cdots L_1)_j\big)^{*} \bar y_j

:math:`W` is the chain's ``window_operator`` (exact 0/1 data movement), run as a differentiable
:class:`~linop.frameworks.torch_function.TorchOperator` (under MPI through this module's own
node, ``_ChainWindows``: after the first call its halo exchange alone, bound in place on local
blocks the module keeps, ``_KeptWindows``); the stages are torch's own
``conv{1,2,3}d``, ``avg_pool{1,2,3}d`` and ``max_pool{1,2,3}d`` on the window, unpadded, and
:math:`M_i` sets the entries of an intermediate field that lie outside its global domain to zero
(``-inf`` before a max pool, as torch pads it; one node ``_Outside``); torch's autograd gives the local
vector-Jacobian product, the adjoint exchange adds each halo entry's gradient into its owner.

The convolution weights are replicated: every process holds all of them as ``nn.Parameter``\ s
and its backward gives the gradient of its own outputs; :meth:`ChainModule.sum_gradients`
all-reduces them over the processes (a data-parallel step: every process then applies the same
update). In one process (no ``comm``, no ``group``) every worker runs here and the gradients are
already the sums.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ..backends.torch_distributed.device import torch_dtype
from ..errors import LayerError
from ..layers.chain import WindowChain
from ..partition import grid_block_name
from .torch_function import BoundCall, TorchOperator, fitted_gradient
from .torch_strips import PaddingStrips, padding_strips
from .torch_windows import WindowModule, halo_factors

__all__ = ["ChainModule"]

_F = torch.nn.functional
_CONV = {1: _F.conv1d, 2: _F.conv2d, 3: _F.conv3d}
_AVG = {1: _F.avg_pool1d, 2: _F.avg_pool2d, 3: _F.avg_pool3d}
_MAX = {1: _F.max_pool1d, 2: _F.max_pool2d, 3: _F.max_pool3d}


class ChainModule(WindowModule):
    """A :class:`linop.layers.WindowChain` as a module: ``module(x)`` takes this process's
    blocks of x (a dict of tensors) and returns its blocks of y, one halo exchange per call.

    Parameters
    ----------
    chain : WindowChain
        The chain (its convolution weights are the initial parameters).
    comm, group, mapping
        As :class:`~linop.frameworks.torch_windows.BlockModule` (so are ``input_names``,
        ``output_names`` and ``token``): ``mapping`` places the workers of x's partition on
        the ranks, this process running the chain for the output blocks of the workers on its
        rank (:meth:`sum_gradients` sums over the processes, whichever workers they hold).
    dtype : torch.dtype
        The parameters' dtype (default float64).

    Attributes
    ----------
    weights : torch.nn.ParameterList
        The convolution stages' weights, in order.

    Raises
    ------
    LayerError
        More than 3 spatial dimensions, or an average pool with a dilation (torch has none).
    WorkerMapError, WorkerMapMismatchError
        A bad ``mapping``, as :class:`~linop.frameworks.torch_windows.BlockModule`.
    """

    def __init__(
        self,
        chain: WindowChain,
        *,
        comm: Any = None,
        group: Any = None,
        dtype: torch.dtype = torch.float64,
        mapping: Any = None,
    ) -> None:
        if not isinstance(chain, WindowChain):
            raise LayerError(f"ChainModule: chain must be a WindowChain, not {type(chain).__name__}")
        dims = chain.dims
        if dims not in _CONV:
            raise LayerError(f"ChainModule: torch has layers of 1 to 3 spatial dimensions, not {dims}")
        for i, stage in enumerate(chain.stages):
            if stage.kind == "avg" and any(d != 1 for d in stage.kernel.resolve(dims).dilation):  # type: ignore[union-attr]
                raise LayerError(
                    f"ChainModule: stage {i} is an average pool with a dilation; torch's has none"
                )
        super().__init__(chain.window_operator, comm=comm, group=group, mapping=mapping)
        self.chain, self.dims = chain, dims
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.from_numpy(np.array(s.weights)).to(dtype))
            for s in chain.stages
            if s.kind == "conv"
        )
        self._products = []
        for g in self.placement.held(chain.y.partition):  # this process's blocks alone
            out = chain.y.block(g)
            # per stage, the entries of its input window outside the global field, as strips
            # along its spatial axes (the global field is a box: so is each window's part of it)
            outside: list[PaddingStrips | None] = []
            for i, field in enumerate(chain.fields(g)):
                first_zero = i > 0 or chain.stages[0].kind == "max"
                if 0 in field.shape or field.real.all() or not first_zero:
                    outside.append(None)
                else:
                    outside.append(padding_strips(field.real, g, "ChainModule", empty=True))
            self._products.append(
                (out.name, grid_block_name(f"{chain.x.name}_window", g), out.shape, outside)
            )
        self.output_names = tuple(name for name, *_ in self._products)
        # per stage: convolution or not, torch's function, its arguments after the input (and
        # a convolution's weight), the value of its input's entries outside the global field
        self._stages: list[tuple[bool, Any, tuple[Any, ...], float]] = []
        for stage in chain.stages:
            k = stage.kernel.resolve(dims)
            size, stride = tuple(k.size), tuple(k.stride)  # type: ignore[arg-type]
            dilation = tuple(k.dilation)  # type: ignore[arg-type]
            entry: tuple[bool, Any, tuple[Any, ...], float]
            if stage.kind == "conv":
                entry = (True, _CONV[dims], (None, stride, 0, dilation), 0.0)
            elif stage.kind == "avg":
                entry = (False, _AVG[dims], (size, stride, 0), 0.0)
            else:
                entry = (False, _MAX[dims], (size, stride, 0, dilation), float("-inf"))
            self._stages.append(entry)
        # under MPI: the exchange alone, bound in place (_KeptWindows), per direction
        self._exchange: TorchOperator | None = None
        self._kept: list[_KeptWindows | None] = [None, None]
        self._declined: list[Any] = [None, None]  # the tree's binding the exchange was declined for

    def forward(self, x: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The windows' tree, then the stages on each output block's window
        (:class:`~linop.frameworks.torch_windows.WindowModule`); under MPI the tree is this
        module's own node (:class:`_ChainWindows`: the bound plan's calls, lean)."""
        if self.comm is None:
            return super().forward(x)
        tensors = self.tensors_of(x)
        *windows, token = _ChainWindows.apply(self, self._anchor, *tensors)
        self.__dict__["_token"] = token  # not through nn.Module.__setattr__ (a tensor, no parameter)
        found = dict(zip(self.function.outputs, windows))
        result = {}
        for out, window_name, shape, outside in self._products:
            window = found[window_name]
            if 0 in shape:  # no output here: an empty block, still tied to the windows' graph
                result[out] = window.reshape(-1)[:0].reshape(shape)
                continue
            result[out] = self.local(window, outside)
        return result

    def local(self, window: torch.Tensor, outside: list[PaddingStrips | None]) -> torch.Tensor:
        """The chain's stages on the window, the entries outside the global field of each
        stage's input set (0, or -inf before a max pool; :class:`_Outside`): on a copy of the
        window, in place on a stage's output (no stage keeps its output for its backward)."""
        v, weights, first = window, iter(self._weights()), True
        for (conv, function, arguments, value), strips in zip(self._stages, outside):
            if strips is not None:
                v = _Outside.apply(v.clone() if first else v, strips, value)
            if conv:
                w = next(weights)
                v = function(v, w if w.dtype == v.dtype else w.to(v.dtype), *arguments)
            else:
                v = function(v, *arguments)
            first = False
        return v

    def _weights(self) -> tuple[torch.nn.Parameter, ...]:
        """:attr:`weights`' parameters in order, as they are now (its own table of them, read in
        one step: iterating a ``ParameterList`` makes several Python calls per entry)."""
        return tuple(self._modules["weights"]._parameters.values())  # type: ignore[union-attr,arg-type]

    def sum_gradients(self) -> None:
        """All-reduce the weights' gradients over the processes (a missing gradient counts as
        zero), so that each holds the gradient of the whole chain's output; nothing to do in
        one process. The gradients of one dtype and device (all of them, as built) go in one
        all-reduce of a buffer holding them one after the other: one collective a step, not one
        per weight (on oversubscribed cores each collective waits for every process to be
        scheduled)."""
        if self.comm is None and self.group is None:
            return
        grads = []
        for weight in self._weights():
            if weight.grad is None:
                weight.grad = torch.zeros_like(weight)
            grads.append(weight.grad)
        groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for grad in grads:
            groups.setdefault((grad.dtype, grad.device), []).append(grad)
        for together in groups.values():
            self._all_reduce(together)

    def _all_reduce(self, grads: list[torch.Tensor]) -> None:
        """Sum ``grads`` (one dtype and device) over the processes, in place: one all-reduce of
        their entries one after the other (a lone contiguous gradient reduced in place), the
        sums copied back."""
        alone = len(grads) == 1 and grads[0].is_contiguous()
        buffer = grads[0].detach() if alone else torch.cat([g.detach().reshape(-1) for g in grads])
        if self.comm is not None:
            from mpi4py import MPI

            host = buffer if buffer.device.type == "cpu" else buffer.cpu()
            self.comm.Allreduce(MPI.IN_PLACE, host.numpy(), op=MPI.SUM)
            if host is not buffer:
                buffer.copy_(host)
        else:
            torch.distributed.all_reduce(buffer, group=None if self.group is True else self.group)
        if alone:
            return
        offset = 0
        for grad in grads:
            count = grad.numel()
            grad.copy_(buffer[offset : offset + count].view(grad.shape))
            offset += count

    def extra_repr(self) -> str:
        stages = ", ".join(f"{s.kind} {s.kernel}" for s in self.chain.stages)
        return f"{stages}: {self.chain.x} -> {self.chain.y}, fused window {self.chain.kernel}"


class _Outside(torch.autograd.Function):
    r"""forward(v, strips, value) -> v: a stage's input field :math:`v` with its entries outside
    the global field (``strips``, :class:`~linop.frameworks.torch_strips.PaddingStrips`) set to
    ``value``, in place (:math:`M v`; ``-inf`` before a max pool); backward :math:`M \bar v`:
    those entries' gradients zero, in place on the incoming gradient (the next stage's
    backward's own fresh result, which nothing else holds), on a copy of it under
    ``create_graph``. One node a stage, where autograd's record of the strips' fills makes a
    view and a copy of the whole gradient per strip."""

    @staticmethod
    def forward(ctx: Any, v: torch.Tensor, strips: PaddingStrips, value: float) -> torch.Tensor:
        ctx.strips = strips
        ctx.mark_dirty(v)
        return strips.fill_(v, value)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        if torch.is_grad_enabled():  # create_graph: the gradient may be recorded elsewhere
            grad = grad.clone()
        return ctx.strips.fill_(grad, 0.0), None, None


class _ChainWindows(torch.autograd.Function):
    r"""Under MPI, forward(module, anchor, \*x blocks) -> (\*windows, token): :math:`\tilde x = W x`
    (the module's windows' tree); backward :math:`\bar x = W^{*} \bar{\tilde x}`. Each through
    the module's kept exchange (:class:`_KeptWindows`) where it takes the tensors, else through
    the tree's persistent binding (:meth:`~linop.frameworks.torch_function.TorchOperator.bound_views`,
    its result buffers copied: the stages keep the windows for their backward, autograd keeps
    the input gradients) or the function's untracked call (which binds), after which the
    exchange is kept for the next calls. A backward under ``create_graph`` runs the adjoint
    recorded (:meth:`~linop.frameworks.torch_function.TorchOperator.adjoint_tensors`), its token
    the module's, as :class:`~linop.frameworks.torch_function.TorchOperator`'s own node does."""

    @staticmethod
    def forward(ctx: Any, module: ChainModule, anchor: torch.Tensor | None, *tensors: torch.Tensor) -> Any:
        ctx.module = module
        ctx.fit = [(t.dtype, t.device) for t in tensors]
        kept = module._kept[0]
        if kept is not None and kept.takes(tensors):
            windows = kept.run(tensors)
        else:
            windows = _general(module, tensors, adjoint=False)
        return (*windows, torch.zeros(0, dtype=torch.float64))  # the last: the token

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        module = ctx.module
        function = module.function
        grads = grads[:-1]  # the token's: none
        kept = module._kept[1]
        if kept is not None and not torch.is_grad_enabled() and kept.takes(grads):
            back = kept.run(grads)
        else:
            inputs, outputs = function.names(adjoint=True)
            order = dict(zip(function.outputs, grads))
            seeds = [order[name] for name in inputs]
            if torch.is_grad_enabled():  # create_graph: the adjoint recorded
                found = dict(zip(outputs, function.adjoint_tensors(*seeds)))
                module.__dict__["_token"] = function.token
                back = [found[name] for name in function.inputs]
            else:
                back = _general(module, seeds, adjoint=True)
        fitted = [fitted_gradient(g, *fit) for g, fit in zip(back, ctx.fit)]
        return (None, None, *fitted)


def _general(module: ChainModule, tensors: Any, *, adjoint: bool) -> list[torch.Tensor]:
    """The windows' tree (``adjoint=True``: its adjoint) on ``tensors`` (in the order of the
    direction's inputs) without the kept exchange: through the tree's binding
    (:meth:`~linop.frameworks.torch_function.TorchOperator.bound_views`, the results copied)
    where it takes them, else untracked (binding, collectively, where the dtypes are new);
    then the exchange kept for the binding's dtypes (:meth:`_KeptWindows.of`, collective where
    it binds). The results in the order of :attr:`ChainModule.function`'s outputs (forward) or
    inputs (adjoint)."""
    function = module.function
    inputs, outputs = function.names(adjoint=adjoint)
    views = function.bound_views(tensors, adjoint=adjoint)
    if views is None:
        found = function.untracked(dict(zip(inputs, tensors)), adjoint=adjoint)
    else:
        found = {name: view.clone() for name, view in zip(outputs, views)}
    module._kept[adjoint] = _KeptWindows.of(module, adjoint)
    return [found[name] for name in (function.inputs if adjoint else function.outputs)]


class _KeptWindows:
    r"""Under MPI, the windows' tree :math:`W = T H E` (:func:`linop.halo.halo_windows`) run as
    its exchange :math:`H` alone, bound in place on that binding's own local blocks (kept from
    call to call while the tree's binding is for the same dtypes):

    .. math::

        W x = T\,H\,E\,x, \qquad W^{*} \bar w = E^{*} H^{*} T^{*} \bar w

    - forward: :math:`E`, each input block copied into the bulk box of its local block; the
      local blocks' other entries are zero from binding or :math:`H`'s: :math:`H` writes every
      halo entry whole on every call (a copy of its owner entry) and moves a padding entry
      only into another padding entry, and nothing else writes the blocks, so they hold
      :math:`E x` when :math:`H` runs; :math:`T`, each window a copy of its box (one pass:
      the copy the stages keep for their backward);
    - backward: :math:`T^{*}`, each window's gradient copied into its box (a local block no
      window covers whole zeroed first); :math:`H^{*}` in place; :math:`E^{*}`, each input's
      gradient a copy of its bulk box.

    Two passes over the blocks a direction, where the tree's binding makes three (its inputs
    copied into its buffers, its result copied out of its own bulk copy, and copied again for
    autograd) and rewrites the windows' padding on every call.
    """

    __slots__ = ("call", "dtypes", "into", "out", "shapes", "tree", "zeroed")

    def __init__(
        self,
        tree: BoundCall,
        call: BoundCall,
        dtypes: tuple[torch.dtype, ...],
        shapes: tuple[torch.Size, ...],
        into: list[torch.Tensor],
        out: list[torch.Tensor],
        zeroed: list[torch.Tensor],
    ) -> None:
        self.tree, self.call = tree, call
        self.dtypes, self.shapes = dtypes, shapes
        self.into, self.out, self.zeroed = into, out, zeroed

    def takes(self, tensors: Any) -> bool:
        """Whether ``tensors`` (the direction's inputs, in order) go through: the dtypes and
        shapes of the tree's binding it was kept for (any device: copied), that binding and the
        exchange's current. Where the tree leaves a rank without inputs, first the call's
        agreement on dtypes (collective: a change on any rank frees the tree's binding on every
        rank, and every rank takes the general path)."""
        tree = self.tree
        same = len(tensors) == len(self.dtypes) and all(t.dtype == d for t, d in zip(tensors, self.dtypes))
        if tree.blind:  # a binding made since (a create_graph backward's) counts as a change
            tree.agree_on(not same or not tree.current)
        if not same or not tree.current or not self.call.current:
            return False
        for tensor, shape in zip(tensors, self.shapes):
            if tensor.shape != shape:
                return False
        if tree.blind:
            tree.ran()  # this call runs the exchange's binding, not the tree's
        return True

    def run(self, tensors: Any) -> list[torch.Tensor]:
        """The direction on ``tensors``: its results, tensors of their own (on the first
        tensor's device)."""
        for block in self.zeroed:
            block.zero_()
        for view, tensor in zip(self.into, tensors):
            view.copy_(tensor)
        self.call()
        device = tensors[0].device if len(tensors) else _HOST
        if device == _HOST:
            return [view.clone(memory_format=torch.contiguous_format) for view in self.out]
        return [view.to(device) for view in self.out]

    @staticmethod
    def of(module: ChainModule, adjoint: bool) -> _KeptWindows | None:
        """After a call of the windows' tree in that direction: its exchange bound in place
        for the dtypes of the tree's binding, or None where the tree has no persistent binding
        (one process, a process group, blocks run straight) or the exchange is declined (no
        pad-exchange-trim tree, an exchange that runs straight or out of place, a window or
        input moved in part, two windows in one local block). Collective where it binds and
        decides (every rank alike, after the same call): then kept; declined for these dtypes,
        not tried again."""
        function = module.function
        # keyed on the tree's binding, not its dtypes: a rank without inputs binds again with
        # its peers (the dtype agreement) though its own dtypes, none, stay
        binding = function.binding(adjoint=adjoint)
        kept = module._kept[adjoint]
        if kept is not None and kept.tree.bound is binding and kept.call.current:
            return kept
        if binding is None or module._declined[adjoint] is binding:
            return None
        tree = function.bound_call(adjoint=adjoint)
        if tree is None:
            return None
        module._declined[adjoint] = binding
        factors = halo_factors(function.op)
        if factors is None:  # the same tree on every rank
            return None
        trim, exchange, pad = factors
        if module._exchange is None:
            module._exchange = TorchOperator(exchange, comm=module.comm, mapping=module.placement.map)
        runner = module._exchange
        run_dtype = function.bound_dtype(adjoint=adjoint)
        assert run_dtype is not None  # the tree is bound
        dtype = torch_dtype(run_dtype)
        locals_, results = runner.names(adjoint=adjoint)
        runner.bound_tensors([dtype] * len(locals_), adjoint=adjoint)  # collective where it binds
        call = runner.bound_call(adjoint=adjoint)  # None on every rank, or on none
        if call is None:
            return None
        built = _KeptWindows._build(function, call, locals_, results, trim, pad, adjoint)
        if runner.largest(int(built is None), f"keeping the halo exchange of {function.op}"):
            return None  # declined on some rank: on every rank
        assert built is not None
        into, out, zeroed = built
        dtypes, shapes = tree.dtypes, tuple(b.shape for b in tree.inputs)
        if adjoint:  # in the order the backward has the windows' gradients: the tree's outputs
            seeds = function.names(adjoint=True)[0]
            order = [seeds.index(name) for name in function.outputs]
            dtypes, shapes = tuple(dtypes[i] for i in order), tuple(shapes[i] for i in order)
        return _KeptWindows(tree, call, dtypes, shapes, into, out, zeroed)

    @staticmethod
    def _build(
        function: TorchOperator,
        call: BoundCall,
        locals_: tuple[str, ...],
        results: tuple[str, ...],
        trim: Any,
        pad: Any,
        adjoint: bool,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]] | None:
        """This rank's views for :meth:`run` (the direction's inputs' boxes, its results' boxes,
        the local blocks zeroed on each call), or None where it declines (see :meth:`of`)."""
        if results != locals_ or any(a.data_ptr() != b.data_ptr() for a, b in zip(call.inputs, call.outputs)):
            return None  # not in place
        blocks = dict(zip(locals_, call.inputs))
        for block in blocks.values():
            block.zero_()  # E's zeros (the binding's buffers are zero: made sure)
        bulk: dict[str, tuple[str, Any]] = {}  # E: input block -> (local block, bulk box)
        for name, box, local, local_box in pad.links():
            if local in blocks:
                if not _spans(box, pad.domain.block(name).shape):
                    return None
                bulk[name] = (local, local_box)
        boxes: dict[str, tuple[str, Any]] = {}  # T: window -> (local block, box)
        for local, local_box, window, box in trim.links():
            if local in blocks:
                if not _spans(box, trim.range.block(window).shape):
                    return None
                boxes[window] = (local, local_box)
        if set(bulk) != set(function.inputs) or set(boxes) != set(function.outputs):
            return None
        if len({local for local, _ in boxes.values()}) != len(boxes):
            return None  # two windows in one local block: their adjoint adds
        inputs_at = [blocks[bulk[name][0]][bulk[name][1]] for name in function.inputs]
        windows_at = {name: blocks[local][box] for name, (local, box) in boxes.items()}
        if not adjoint:
            return inputs_at, [windows_at[name] for name in function.outputs], []
        covered = {
            boxes[name][0] for name, view in windows_at.items() if view.shape == blocks[boxes[name][0]].shape
        }
        zeroed = [block for name, block in blocks.items() if name not in covered]
        return [windows_at[name] for name in function.outputs], inputs_at, zeroed


def _spans(box: Any, shape: tuple[int, ...]) -> bool:
    """Whether ``box`` (a tuple of slices) is the whole of a block of ``shape``."""
    return len(box) == len(shape) and all(
        (s.start or 0) == 0 and s.stop == n and s.step in (None, 1) for s, n in zip(box, shape)
    )


_HOST = torch.device("cpu")
