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
from typing import Any, NoReturn

import torch

from ..errors import StateError
from ..operator import LinearOperator
from .torch_function import TorchOperator, collective_anchor, engine_arguments
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
        whose outputs do not enter it, so that its collective backward runs); after a
        backward under ``create_graph`` (MaxPool, Repartition), that recorded backward's,
        for a second-order loss alike.

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
        self.placement = Placement(mapping, comm, group, lambda: workers_of(tree))
        self.function = TorchOperator(tree, comm=comm, group=group, mapping=self.placement.map)
        self.input_names: tuple[str, ...] = self.function.inputs
        self.output_names: tuple[str, ...] = self.function.outputs
        self._anchor = collective_anchor(comm, group)  # for a subclass that is its own node
        self._token: torch.Tensor | None = None  # such a subclass's last token (see _outputs)

    @property
    def token(self) -> torch.Tensor:
        """The empty output of the last call (see the class)."""
        return self.function.token if self._token is None else self._token

    def check(self, x: Mapping[str, torch.Tensor]) -> None:
        """A subclass's own refusals of a call's ``x``, before the function's (none here). A
        call that goes through :meth:`tensors_of` meets it only when ``x`` is not a dict of
        tensors by exactly the input names: what it refuses of such a dict (a dtype, a shape)
        the subclass checks in its own node."""

    def tensors_of(self, x: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """This process's blocks in ``x``, in the order of :attr:`input_names`, for a subclass
        that is its own autograd node: a dict of tensors by exactly those names as it is, else
        through :meth:`check` and the function's checks and errors
        (:meth:`~linop.frameworks.torch_function.TorchOperator.state_tensors`)."""
        if type(x) is dict and len(x) == len(self.input_names):
            tensors = [x.get(name) for name in self.input_names]
            if all(isinstance(t, torch.Tensor) for t in tensors):
                return tensors  # type: ignore[return-value]
        self.check(x)
        return list(self.function.state_tensors(x))

    def _outputs(self, result: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
        """The blocks of a subclass's node's ``result`` (its outputs, then its token, kept as
        :attr:`token`), by :attr:`output_names`."""
        *outputs, token = result
        self.__dict__["_token"] = token  # not through nn.Module.__setattr__ (a tensor, no parameter)
        return dict(zip(self.output_names, outputs))


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


class WindowWorkspace:
    r"""A halo window tree :math:`W = T H E` (:func:`linop.halo.halo_windows`: the pad shim,
    the in-place exchange, the trim shim) run on local blocks this process owns and reuses
    from call to call, on a gloo process group (:meth:`of`).

    .. math::

        W x = T\,H\,E\,x, \qquad W^{*} \bar w = E^{*} H^{*} T^{*} \bar w

    - :math:`E`: each input block copied into the bulk box of its local block (the shim's link);
      the local block's other entries are not written: the halo's are :math:`H`'s, and the
      padding's (zero boundary) keep ``fill``, written once when the blocks are allocated:
      :math:`H` moves a padding entry only into another padding entry (an entry keeps its global
      position), so a padding entry holds ``fill`` after every call, as :math:`E`'s zeros would
      hold zero (with ``fill = 0`` the windows are exactly :math:`W x`; max pooling passes
      :math:`-\infty`, its padding's value);
    - :math:`H`: the exchange's tree bound in place on the local blocks
      (:meth:`~linop.frameworks.torch_function.TorchOperator.run_in_place`: prepared once, the
      phases' messages start straight on the group);
    - :math:`T`: each window a view of its box of the local block (:meth:`windows`), valid
      until the next call: a caller computes from it and keeps nothing of it.

    The adjoint's local blocks are another set: :meth:`gradient_windows` zeroes them and gives
    the views at the window boxes (:math:`T^{*}`: the caller writes the windows' gradients
    there), :meth:`input_gradients` runs :math:`H^{*}` in place and returns each input block's
    gradient as a copy of its bulk box (:math:`E^{*}`: tensors of their own, never a view of
    the blocks the next call overwrites). The blocks are allocated again (and the plans bound
    again, collectively) when the dtype changes.

    Parameters
    ----------
    trim, exchange, pad : LinearOperator
        The tree's factors (:class:`~linop.halo.TrimShim`, :class:`~linop.halo.HaloExchange`,
        :class:`~linop.halo.PadShim`).
    inputs : tuple of str
        This process's input blocks, in the order :meth:`windows` takes them.
    group, mapping
        As :class:`BlockModule`.
    fill : float
        The value of the forward local blocks' padding entries.
    """

    def __init__(
        self,
        trim: Any,
        exchange: LinearOperator,
        pad: Any,
        inputs: tuple[str, ...],
        *,
        group: Any,
        mapping: Any,
        fill: float = 0.0,
    ) -> None:
        self.exchange = TorchOperator(exchange, group=group, mapping=mapping)
        self.fill = fill
        self.locals = self.exchange.inputs  # this process's local blocks, in the plan's order
        held = set(self.locals)
        shapes = exchange.domain
        self._shapes = {name: tuple(shapes.block(name).shape) for name in self.locals}
        bulk = {source: (local, box) for source, _, local, box in pad.links() if local in held}
        # E, in the order of the inputs: (local block, bulk box, the input's shape)
        self._pads = tuple(
            (bulk[name][0], bulk[name][1], torch.Size(pad.domain.block(name).shape)) for name in inputs
        )
        # T: each window's local block and box
        self._trims = {window: (local, box) for local, box, window, _ in trim.links() if local in held}
        self._forward: tuple[torch.dtype, dict[str, torch.Tensor]] | None = None
        self._backward: tuple[torch.dtype, dict[str, torch.Tensor]] | None = None
        # whether some rank of the group holds none of the blocks (a worker map leaving it
        # none): it cannot see a dtype change, so every call agrees on one (the same on every
        # rank: from the tree's workers and the map)
        from ..backends import torch_distributed

        size = torch_distributed.plan_context(group).size
        ranks = {worker if mapping is None else mapping.rank_of(worker) for worker in exchange.domain.workers}
        self.blind = len(ranks) < size

    @staticmethod
    def of(
        tree: LinearOperator, inputs: tuple[str, ...], *, group: Any, mapping: Any, fill: float = 0.0
    ) -> WindowWorkspace | None:
        """The workspace of ``tree`` when it is a halo window tree ``T H E`` run on a gloo
        process group (alike on every rank: the tree and the group's backend), else None."""
        import torch.distributed as dist

        factors = halo_factors(tree)
        if group is None or group is False or factors is None:
            return None
        trim, exchange, pad = factors
        try:
            backend = dist.get_backend(None if group is True else group)
        except (ValueError, RuntimeError):  # not a member: the windows' function says so at its call
            return None
        if backend != "gloo":
            return None
        return WindowWorkspace(trim, exchange, pad, inputs, group=group, mapping=mapping, fill=fill)

    def _blocks(self, dtype: torch.dtype, adjoint: bool) -> dict[str, torch.Tensor]:
        """The local blocks of this call, kept for ``dtype``, else allocated (so bound again,
        collectively); where a rank holds none, on every rank as they agree (collective)."""
        kept = self._backward if adjoint else self._forward
        if kept is not None:  # (the first call binds on every rank)
            changed = kept[0] != dtype
            if self.blind:
                changed = self.exchange.agree_changed(changed, adjoint=adjoint)
            if not changed:
                return kept[1]
        value = 0.0 if adjoint else self.fill
        blocks = {name: torch.full(self._shapes[name], value, dtype=dtype) for name in self.locals}
        if adjoint:
            self._backward = (dtype, blocks)
        else:
            self._forward = (dtype, blocks)
        return blocks

    def windows(self, tensors: Any, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """:math:`T H E x` of this process's input blocks ``tensors`` (in the order of the
        inputs, of the shapes checked by the caller) in ``dtype``: views of the local blocks,
        overwritten by the next call (collective)."""
        blocks = self._blocks(dtype, adjoint=False)
        for (local, box, _), tensor in zip(self._pads, tensors):
            blocks[local][box].copy_(tensor)
        self.exchange.run_in_place(blocks)
        return {window: blocks[local][box] for window, (local, box) in self._trims.items()}

    @property
    def window_names(self) -> tuple[str, ...]:
        """This process's windows (the views :meth:`windows` gives)."""
        return tuple(self._trims)

    def refuse(self, error: StateError, dtype: torch.dtype) -> NoReturn:
        """Raise ``error``, found by the caller's check of a call's blocks (in ``dtype``) before
        any communication: through the exchange's collective check when the peers are in it
        (the first call: every rank raises the agreed error naming this one), else reported to
        the group's store, as a refused call of the windows' function
        (:meth:`~linop.frameworks.torch_function.TorchOperator.refuse`).

        The local blocks are stood in for by one zero of ``dtype`` broadcast to each block's
        shape: the collective check reads only their shapes and dtypes (and this rank's error
        flag decides it), a later refusal nothing of them; no block is allocated, and the kept
        ones (another dtype's, bound) stay."""
        zero = torch.zeros((), dtype=dtype)
        self.exchange.refuse(error, {name: zero.expand(self._shapes[name]) for name in self.locals})

    def input_shapes(self) -> tuple[torch.Size, ...]:
        """The shapes of the input blocks, in the order :meth:`windows` takes them."""
        return tuple(shape for *_, shape in self._pads)

    def gradient_windows(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """:math:`T^{*}`: the adjoint's local blocks zeroed, as views at each window's box
        (write each window's gradient into its view, then call :meth:`input_gradients`)."""
        blocks = self._blocks(dtype, adjoint=True)
        for block in blocks.values():
            block.zero_()
        return {window: blocks[local][box] for window, (local, box) in self._trims.items()}

    def input_gradients(self) -> tuple[torch.Tensor, ...]:
        """:math:`E^{*} H^{*}` of the gradients written into :meth:`gradient_windows`' views:
        each input block's gradient (in the order of the inputs), a tensor of its own
        (collective)."""
        assert self._backward is not None, "gradient_windows first"
        blocks = self._backward[1]
        self.exchange.run_in_place(blocks, adjoint=True)
        return tuple(blocks[local][box].clone() for local, box, _ in self._pads)


def halo_factors(tree: LinearOperator) -> tuple[Any, LinearOperator, Any] | None:
    """The factors ``(T, H, E)`` of a halo window tree (:func:`linop.halo.halo_windows`: the
    trim shim, the exchange, the pad shim), or None for any other tree."""
    from ..halo import HaloExchange, PadShim, TrimShim
    from ..operator import Composition

    if not isinstance(tree, Composition) or len(tree.factors) != 3:
        return None
    trim, exchange, pad = tree.factors
    if type(trim) is TrimShim and type(exchange) is HaloExchange and type(pad) is PadShim:
        return trim, exchange, pad
    return None
