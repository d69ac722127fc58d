r"""Prove a torch.distributed code's backward across processes: :func:`verify.lift.lift_mpi`
over a ``torch.distributed`` process group instead of an MPI communicator.

Every rank of the group probes together, one global entry at a time: the rank owning entry
:math:`j` of the domain passes the unit vector there, every other rank zeros, each calls its
per-rank function (which communicates as it likes: DTensor's ``redistribute``, a hand-written
``all_gather``, linop's own trees) and keeps its column of the output; the columns are gathered
on every rank (``all_gather_object``). The claimed backward (autograd's, run on every rank
together, or a second callable) is probed likewise, so every rank holds the same
:class:`~verify.lift.Lifted` for :func:`verify.exact_adjoint`, which proves
:math:`G = F^{H}` or names the first wrong entries as (block, index) pairs: a row is an entry
of the function's input, a column an entry of its output.

The inner product is the sum over every rank's blocks (each block an independent variable). A
layout with ``Replicate`` copies thus has a cotangent per copy: DTensor, which treats the
copies as one value and its cotangent as replicated, gives the local slice of the gradient
where this adjoint sums over the copies (``Shard -> Replicate``); a layout without copies
(``Shard(0) -> Shard(1)``) compares directly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from linop import Space
from linop.progress import ProgressOption

from .exact import Proof, exact_adjoint
from .lift import Lifted, lift_mpi

__all__ = ["GroupComm", "lift_group", "prove_backward_group"]


_LIFTS: dict[tuple[Any, ...], int] = {}
"""Lifts made so far in this process, per group (its world ranks): the key of a lift's
announced failures in the store."""


class GroupComm:
    """What probing needs of a communicator (``rank`` and a pickled ``allgather``), over a
    torch.distributed process group (default the world group), and a way to say which rank
    failed (``announce`` and ``announced``, through the group's store) so that a peer blocked
    on a failed rank names it in its :class:`~verify.lift.LiftError`."""

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group) if group is not None else dist.get_rank()
        self.size = dist.get_world_size(group) if group is not None else dist.get_world_size()
        members = tuple(dist.get_process_group_ranks(group)) if group is not None else ("world",)
        _LIFTS[members] = _LIFTS.get(members, 0) + 1
        # every rank of the group makes its lifts over it in one order: the same key on each
        self.serial = f"{'-'.join(map(str, members))}/{_LIFTS[members]}"

    def _key(self, rank: int) -> str:
        return f"linop/lift/{self.serial}/failed/{rank}"

    def announce(self, message: str) -> None:
        """Tell the group, through its store (which outlives this rank's collectives), that this
        rank failed and why: its peers, blocked on it, name it in their error."""
        try:
            self._store().set(self._key(self.rank), message)
        except Exception:  # pragma: no cover - no store (the peers then name no rank)
            pass

    def announced(self) -> dict[int, str]:
        """The failures the group's ranks announced in this lift (empty when the store is gone:
        it lives in the process of rank 0 of the world)."""
        found: dict[int, str] = {}
        try:
            store = self._store()
            for rank in range(self.size):
                key = self._key(rank)
                if store.check([key]):
                    found[rank] = store.get(key).decode(errors="replace")
        except Exception:  # the store's host is gone
            pass
        return found

    def _store(self) -> Any:
        return self._dist.distributed_c10d._get_default_store()

    def allgather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order, on every rank."""
        gathered: list[Any] = [None] * self.size
        self._dist.all_gather_object(gathered, value, group=self.group)
        return gathered


def lift_group(
    forward: Callable[..., Any],
    domain: Space,
    range: Space,
    *,
    adjoint: Callable[..., Any] | None = None,
    group: Any = None,
    framework: str = "torch",
    label: str | None = None,
    progress: ProgressOption = None,
) -> Lifted:
    """Lift a per-rank function that communicates over a torch.distributed process group, and
    its claimed adjoint, into one :class:`~verify.lift.Lifted`, the same on every rank;
    collective over ``group``.

    ``domain`` and ``range`` are spaces whose blocks name their workers (a
    :class:`~linop.MeshLayout`'s ``space``, say). Each rank's callables take this rank's blocks
    of ``domain`` (worker == group rank, in the domain's order) and return this rank's blocks of ``range``. With ``framework="torch"``
    (default) they take and return tensors and the default adjoint is autograd's backward;
    ``"numpy"`` takes arrays and needs ``adjoint=``.

    ``progress=`` is as in :func:`verify.lift.lift_mpi`: group rank 0 reports the probing
    (None: once it has run 2 s; True, False, or a callable of ``(done, total, what)``).

    Raises
    ------
    LiftError
        On every rank together, when a rank's function returns the wrong blocks or shapes. When
        a rank's function raises, that rank raises naming itself (chained from its error) and
        announces it in the group's store; a peer blocked in the function's collective raises
        naming that rank once its process ends (or at the group's timeout). The group is
        unusable afterwards.
    """
    return lift_mpi(
        forward,
        domain,
        range,
        adjoint=adjoint,
        comm=GroupComm(group),
        framework=framework,
        label=label,
        progress=progress,
    )


def prove_backward_group(
    forward: Callable[..., Any],
    domain: Space,
    range: Space,
    **options: Any,
) -> Proof:
    """Lift ``forward`` across the group (:func:`lift_group`, same options) and prove its
    claimed backward exactly; the same :class:`~verify.exact.Proof` on every rank."""
    return exact_adjoint(lift_group(forward, domain, range, **options))
