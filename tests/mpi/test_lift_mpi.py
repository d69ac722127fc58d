"""Proving a hand-written mpi4py halo exchange's backward across ranks by lifting (verify.lift_mpi).

Each rank holds one block of BULK entries with one halo cell on each side of a periodic 1-D
array; the forward fills the halos from the neighbours with Sendrecv. The true backward sends
each halo's gradient back to the neighbour, adds it into the bulk entry it came from and
clears the halos; the wrong one re-applies the forward exchange to the gradient.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import collective_assert
from mpi4py import MPI

import verify
from linop import Block, Space
from verify.lift import LiftError, lift_mpi

pytestmark = pytest.mark.timeout(60)
BULK = 3


def _neighbours(comm):
    return (comm.rank - 1) % comm.size, (comm.rank + 1) % comm.size


def halo_forward(comm):
    def forward(x):
        left, right = _neighbours(comm)
        y = np.array(x, dtype=np.float64)
        from_left, from_right = np.empty(1), np.empty(1)
        comm.Sendrecv(y[BULK : BULK + 1].copy(), dest=right, recvbuf=from_left, source=left)
        comm.Sendrecv(y[1:2].copy(), dest=left, recvbuf=from_right, source=right)
        y[0], y[BULK + 1] = from_left[0], from_right[0]
        return y

    return forward


def halo_adjoint(comm):
    def adjoint(g):
        left, right = _neighbours(comm)
        x = np.array(g, dtype=np.float64)
        to_left, to_right = x[0:1].copy(), x[BULK + 1 : BULK + 2].copy()
        x[0] = x[BULK + 1] = 0
        from_right, from_left = np.empty(1), np.empty(1)
        comm.Sendrecv(to_left, dest=left, recvbuf=from_right, source=right)  # my bulk end fed right's halo
        comm.Sendrecv(to_right, dest=right, recvbuf=from_left, source=left)
        x[BULK] += from_right[0]
        x[1] += from_left[0]
        return x

    return adjoint


def _space(comm):
    return Space([Block(f"x{r}", (BULK + 2,), worker=r) for r in range(comm.size)])


def test_hand_written_halo_exchange_and_its_adjoint_are_proven(comm):
    space = _space(comm)
    lifted = lift_mpi(halo_forward(comm), space, space, adjoint=halo_adjoint(comm), comm=comm, label="halo")
    proof = verify.exact_adjoint(lifted)
    collective_assert(bool(proof), proof.detail)


def test_progress_is_reported_on_rank_0_only(comm):
    space = _space(comm)
    seen = []
    lift_mpi(
        halo_forward(comm),
        space,
        space,
        adjoint=halo_adjoint(comm),
        comm=comm,
        label="halo",
        progress=lambda done, total, what: seen.append((done, total)),
    )
    counts = [done for done, _ in seen]
    if comm.rank == 0:
        ok = counts == sorted(counts) and seen[-1] == (2 * space.size, 2 * space.size)
    else:
        ok = seen == []
    collective_assert(ok, f"rank {comm.rank} saw {seen[:3]}...{seen[-3:]}")


def test_backward_that_reapplies_the_forward_is_refuted_with_named_entries(comm):
    space = _space(comm)
    lifted = lift_mpi(halo_forward(comm), space, space, adjoint=halo_forward(comm), comm=comm, label="halo")
    proof = verify.exact_adjoint(lifted)
    # Rank 0's halo cell x0[0] holds a copy of the left neighbour's last bulk entry.
    last = f"x{comm.size - 1}[{BULK}]"
    ok = (
        not proof
        and proof.count == 4 * comm.size
        and str(proof.mismatches[0]) == f"row x0[0], column {last}: 1 versus 0"
    )
    collective_assert(ok, proof.detail)


def test_torch_autograd_backward_across_ranks():
    torch = pytest.importorskip("torch", reason="torch is not installed (the torch extra)")
    comm = MPI.COMM_WORLD
    forward_numpy, adjoint_numpy = halo_forward(comm), halo_adjoint(comm)

    class Halo(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return torch.from_numpy(forward_numpy(x.detach().numpy()))

        @staticmethod
        def backward(ctx, g):
            return torch.from_numpy(adjoint_numpy(g.detach().numpy()))

    space = _space(comm)
    proof = verify.exact_adjoint(lift_mpi(Halo.apply, space, space, comm=comm, framework="torch"))
    collective_assert(bool(proof), proof.detail)


def test_wrong_output_shape_fails_on_every_rank(comm):
    space = _space(comm)
    with pytest.raises(LiftError, match="returned shape"):
        lift_mpi(lambda x: np.zeros(2), space, space, adjoint=lambda y: y, comm=comm)


def test_a_per_rank_map_that_is_not_linear_is_refused_on_every_rank():
    """Issue 22: lift_mpi checks linearity as lift does (probe states, every rank together):
    the halo exchange plus one on the last rank's bulk is affine, and never proven."""
    comm = MPI.COMM_WORLD
    space = _space(comm)
    exchange = halo_forward(comm)

    def affine(x):
        y = exchange(x)
        return y + 1 if comm.rank == comm.size - 1 else y

    try:
        lift_mpi(affine, space, space, adjoint=halo_adjoint(comm), comm=comm)
        message = "NO ERROR"
    except LiftError as error:
        message = str(error)
    messages = comm.allgather(message)
    collective_assert(all(m == messages[0] for m in messages), f"ranks disagree: {messages}")
    collective_assert(f"rank {comm.size - 1}:" in message and "is not linear" in message, message)
    lifted = lift_mpi(exchange, space, space, adjoint=halo_adjoint(comm), comm=comm)  # control
    collective_assert(bool(verify.exact_adjoint(lifted)), "the true backward is no longer proven")


def _field_exchange(comm, last_rank_map):
    """The halo exchange over any field (complex buffers pass through), with ``last_rank_map``
    applied to the last rank's output."""

    def forward(x):
        left, right = _neighbours(comm)
        y = np.array(x)
        from_left, from_right = np.empty(1, y.dtype), np.empty(1, y.dtype)
        comm.Sendrecv(y[BULK : BULK + 1].copy(), dest=right, recvbuf=from_left, source=left)
        comm.Sendrecv(y[1:2].copy(), dest=left, recvbuf=from_right, source=right)
        y[0], y[BULK + 1] = from_left[0], from_right[0]
        return last_rank_map(y) if comm.rank == comm.size - 1 else y

    return forward


@pytest.mark.parametrize(
    ("what", "last_rank_map"),
    [("antilinear", np.conj), ("saturating", lambda y: np.clip(y, -30, 30))],
)
def test_a_per_rank_map_antilinear_or_saturating_on_one_rank_is_refused_on_every_rank(what, last_rank_map):
    """Issue 41: the rule of linop.linearity across ranks: complex and scaled states, each rank
    comparing its own rows, every rank raising the same error naming the last rank."""
    comm = MPI.COMM_WORLD
    space = _space(comm)

    def adjoint(g):
        return halo_adjoint(comm)(np.real(g))

    try:
        lift_mpi(_field_exchange(comm, last_rank_map), space, space, adjoint=adjoint, comm=comm)
        message = "NO ERROR"
    except LiftError as error:
        message = str(error)
    messages = comm.allgather(message)
    collective_assert(all(m == messages[0] for m in messages), f"ranks disagree: {messages}")
    collective_assert(
        f"rank {comm.size - 1}:" in message and "is not linear" in message, f"{what}: {message}"
    )
    honest = lift_mpi(_field_exchange(comm, lambda y: y), space, space, adjoint=adjoint, comm=comm)  # control
    collective_assert(bool(verify.exact_adjoint(honest)), "the honest exchange is no longer proven")
