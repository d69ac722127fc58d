"""The local movements whose rule is the same on every block workspace: the numpy
interpreter's handlers and the torch.distributed device path's run them, each with its own
indexing of a region (:class:`~linop.backends.host_schedule.BlockWorkspace`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..movement import CopyAdjoint
from ..space import Block, Region

if TYPE_CHECKING:  # pragma: no cover - annotations only
    from .host_schedule import BlockWorkspace
    from .host_workspace import OwnedBlocks

__all__ = ["add_back", "relabel"]


def add_back(op: CopyAdjoint, work: BlockWorkspace, index: Callable[[Region], Any]) -> None:
    r"""The adjoint of a copy, :math:`C_{a \to b}^* = K_b S_{b \to a}`: the destination added
    into the source, then zeroed (in place) or dropped (a new block, out of place)."""
    back = work.arrays[op.dst.name]
    if isinstance(op.dst, Region):
        back = back[index(op.dst)]
    work.writable(op.src.name, back.dtype)[index(op.src)] += back
    if isinstance(op.dst, Block):
        work.drop(op.dst.name)
    elif op.dst.size:
        work.writable(op.dst.name)[index(op.dst)] = 0


def relabel(
    work: OwnedBlocks[Any],
    source: str,
    target: str,
    widened: Callable[[Any], Any | None],
) -> None:
    """An out-of-place move of a whole block: block ``source`` becomes block ``target``, not
    copied; ``widened(block)`` gives it converted to the run's dtype when that is wider (then
    owned), None when it holds it already."""
    owned = source in work.owned
    block = work.drop(source)
    wider = widened(block)
    if wider is not None:
        block, owned = wider, True
    work.set(target, block, owned=owned)
