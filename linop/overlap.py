r"""A halo exchange overlapped with the local work that needs none of its messages.

A distributed sliding-window product runs the halo exchange :math:`X`, then the local product.
A worker's *interior* outputs read only entries the exchange does not write (its bulk, and the
zero pads at the global edge), so that part of the product, :math:`D`, commutes with the
exchange and may run while the exchange's messages are in flight; the *boundary* strips run
after it. :class:`OverlappedHalo` is the product

.. math::

    O = X' D, \qquad O^* = D^* X'^*

where :math:`X'` is the exchange acting on the blocks of :math:`D`'s range (its stages lifted
to that space, every other block passed through). The numpy and sparse interpreters run (and
build the matrix of) exactly that product: :math:`D` sees the halos *before* the exchange, so a
split whose interior reaches into a halo gives another operator, and ``verify.equal`` against
the plain tree catches it. The distributed program lowers :math:`D`'s local steps as work that
may run while the exchange's first phase is in flight (:class:`~linop.program.Local`
``in_flight``; batching overlaps it only where it conflicts with no transfer of the phase, so
every executor's result is the product's), and the adjoint :math:`D^*` during the adjoint
exchange's last phase (``docs/theory.md#overlapped-halo-exchange``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from .errors import OperandError, SpaceMismatchError
from .halo import HaloExchange, HaloStage
from .operator import Composition, Identity, LinearOperator, OperandSpaces
from .pieces import fields_of
from .space import Space

__all__ = ["OverlappedHalo", "OverlappedHaloAdjoint", "lifted_exchange"]


def lifted_exchange(exchange: HaloExchange, space: Space) -> LinearOperator:
    """The exchange's stages on ``space`` (which holds every local block of the exchange as
    it is): the same copies, every other block of ``space`` passed through."""
    stages = [
        HaloStage(
            space, tuple((s.in_space(space), d.in_space(space)) for s, d in stage.transfers), stage.label
        )
        for stage in exchange.stages()
    ]
    if not stages:
        return Identity(space)
    return Composition(tuple(reversed(stages)))


class _OverlapBase(LinearOperator):
    exchange: HaloExchange
    during: LinearOperator

    def __post_init__(self) -> None:
        if not isinstance(self.exchange, HaloExchange):
            raise OperandError(
                f"{type(self).__name__}: exchange must be a HaloExchange, not {type(self.exchange).__name__}"
            )
        if not isinstance(self.during, LinearOperator):
            raise OperandError(
                f"{type(self).__name__}: during must be a LinearOperator, not {type(self.during).__name__}"
            )
        for side, space in (("domain", self.during.domain), ("range", self.during.range)):
            for block in self.exchange.domain.blocks:
                if block.name not in space or space.block(block.name) != block:
                    raise SpaceMismatchError(
                        f"{type(self).__name__}: the {side} of the work in flight lacks the local block "
                        f"{block!r} of the exchange (it must hold every one, unchanged)"
                    )


@dataclass(frozen=True, eq=True, repr=False)
class OverlappedHalo(_OverlapBase, OperandSpaces):
    r"""The halo exchange ``exchange`` with the local work ``during`` run while its messages
    are in flight: :math:`O = X' D` (``during`` first, on the unexchanged halos).

    Parameters
    ----------
    exchange : HaloExchange
        The exchange :math:`X` (in place on its local blocks).
    during : LinearOperator
        :math:`D`: local work whose domain and range hold every local block of the exchange
        unchanged (it reads them and adds blocks of its own, e.g. the interior of a
        convolution's output).

    Raises
    ------
    TypeError
        If ``exchange`` is not a :class:`~linop.halo.HaloExchange` or ``during`` not an operator.
    SpaceMismatchError
        If ``during``'s domain or range lacks a local block of the exchange.

    Examples
    --------
    >>> import numpy as np
    >>> import verify
    >>> from linop import Copy, DistributedTensor, HaloExchange, Kernel, Partition, halo_geometry
    >>> from linop.overlap import OverlappedHalo
    >>> exchange = HaloExchange(halo_geometry(DistributedTensor("x", (6,), Partition((2,))), Kernel(3)))
    >>> space = exchange.domain
    >>> interior = Copy(space["x_local[0]"][1:2], "inner")  # reads the bulk only
    >>> overlapped = OverlappedHalo(exchange, interior)
    >>> bool(verify.equal(overlapped, Copy(space["x_local[0]"][1:2], "inner") @ exchange))
    True
    >>> reaching = OverlappedHalo(exchange, Copy(space["x_local[0]"][3:4], "inner"))  # the halo
    >>> bool(verify.equal(reaching, Copy(space["x_local[0]"][3:4], "inner") @ exchange))
    False
    """

    exchange: HaloExchange
    during: LinearOperator

    def _spaces_from(self) -> LinearOperator:
        return self.during

    def children(self) -> tuple[LinearOperator, ...]:
        return (self.exchange, self.during)

    def expand(self) -> LinearOperator:
        """:math:`X' D`: the work in flight first, then the exchange lifted to its range."""
        return self._expansion

    @cached_property
    def _expansion(self) -> LinearOperator:
        return lifted_exchange(self.exchange, self.during.range) @ self.during

    def adjoint(self) -> LinearOperator:
        """:math:`D^* X'^*`: the adjoint exchange, with :math:`D^*` in flight during it."""
        return OverlappedHaloAdjoint(**fields_of(self))

    def __str__(self) -> str:
        return f"Overlap[{self.exchange} || {self.during}]"


@dataclass(frozen=True, eq=True, repr=False)
class OverlappedHaloAdjoint(_OverlapBase, OperandSpaces):
    r"""Adjoint of :class:`OverlappedHalo`: :math:`D^* X'^*`, the adjoint exchange posted first
    and :math:`D^*` run while its messages are in flight.

    Parameters
    ----------
    exchange, during
        Those of the forward node.
    """

    exchange: HaloExchange
    during: LinearOperator

    SWAPPED = True  # the spaces of the work in flight's adjoint

    def _spaces_from(self) -> LinearOperator:
        return self.during

    def children(self) -> tuple[LinearOperator, ...]:
        return (self.exchange.H, self.during.H)

    def expand(self) -> LinearOperator:
        """:math:`(X' D)^* = D^* X'^*`, derived by the rules."""
        return self._expansion

    @cached_property
    def _expansion(self) -> LinearOperator:
        return self.adjoint().expand().H

    def adjoint(self) -> LinearOperator:
        """:math:`(O^*)^* = O`."""
        return OverlappedHalo(**fields_of(self))

    def __str__(self) -> str:
        return f"Overlap*[{self.exchange} || {self.during}]"
