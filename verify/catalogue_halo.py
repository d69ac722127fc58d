"""Catalogue, ``docs/theory.md#halo-exchange``: the halo exchange, its adjoint, and the windows operator.

The exchange ``H = H_{d-1} ... H_0`` is proven at two levels: expanded into primitives (each
stage ``H_i = K_T C_U C_E C_P K_S`` with explicit send and receive buffers, adjoint derived by
the primitives' rules), and as the stage nodes the interpreters run directly (whose fast paths
are proven equal to the expansion). The windows operator ``W = T H E`` (pad shim, exchange,
trim shim) has an exact adjoint for every boundary mode; the adjoint of the periodic and
reflecting modes adds wrapped entries back into their owners.
"""

from __future__ import annotations

import functools

from linop import LinearOperator, expand_all
from linop.halo import HaloExchange, halo_windows
from linop.halo_geometry import Kernel, halo_geometry
from linop.partition import DistributedTensor, Partition

from .catalogue import Entry, adjoint_entry, equal_entry

__all__ = ["ENTRIES"]

SECTION = "halo-exchange"


def _two_workers() -> DistributedTensor:
    return DistributedTensor("x", (6,), Partition((2,)))


def _grid() -> DistributedTensor:
    return DistributedTensor("x", (5, 4), Partition((2, 2)))


def _exchange(variant: str = "nested") -> HaloExchange:
    return HaloExchange(halo_geometry(_grid(), Kernel(3, padding=1)), variant)  # type: ignore[arg-type]


def _expanded_stage() -> LinearOperator:
    (stage,) = HaloExchange(halo_geometry(_two_workers(), Kernel(3, padding=1))).stages()
    return stage.expand()


def _windows(mode: str) -> LinearOperator:
    return halo_windows(_grid(), Kernel(3, padding=2, boundary=mode))


ENTRIES: list[Entry] = [
    adjoint_entry(
        "halo-stage-expanded-adjoint",
        SECTION,
        "H_0 = D K_T C_U C_E C_P K_S A (two workers, explicit buffers); H_0* = D K_S C_P* C_E* C_U* K_T A",
        _expanded_stage,
    ),
    adjoint_entry(
        "halo-exchange-nested-adjoint",
        SECTION,
        "H = H_1 H_0 on a 2 x 2 partition, kernel 3, padding 1: H* = H_0* H_1* adds halos into owners' bulk",
        _exchange,
    ),
    adjoint_entry(
        "halo-exchange-nested-expanded-adjoint",
        SECTION,
        "H_1 H_0 expanded into primitives: its derived adjoint is its transpose",
        lambda: expand_all(_exchange()),
    ),
    equal_entry(
        "halo-exchange-fastpath-equals-expansion",
        SECTION,
        "the stage nodes H_1 H_0 equal their expansion K_T C_U C_E C_P K_S into primitives",
        lambda: (_exchange(), expand_all(_exchange())),
    ),
    equal_entry(
        "halo-exchange-nested-equals-direct",
        SECTION,
        "H_1 H_0 (corners in two hops) == the direct exchange (corners in one message)",
        lambda: (_exchange("nested"), _exchange("direct")),
    ),
    adjoint_entry(
        "halo-windows-two-workers-adjoint",
        SECTION,
        "W = T H E, 6 entries over 2 workers, kernel 3, padding 1: W* adds the halo into the neighbour",
        lambda: halo_windows(_two_workers(), Kernel(3, padding=1)),
    ),
    *(
        adjoint_entry(
            f"halo-windows-{mode}-adjoint",
            SECTION,
            f"W = T H E with {mode} boundary on a 2 x 2 partition, kernel 3, padding 2: W* is its transpose",
            functools.partial(_windows, mode),
        )
        for mode in ("zero", "periodic", "reflect", "symmetric")
    ),
    adjoint_entry(
        "halo-windows-multi-hop-adjoint",
        SECTION,
        "W for shares (6, 1, 1), kernel 5, padding 2: a halo wider than the neighbour comes from two workers",
        lambda: halo_windows(
            DistributedTensor("x", (8,), Partition((3,)), ((6, 1, 1),)), Kernel(5, padding=2)
        ),
    ),
    adjoint_entry(
        "halo-windows-empty-output-adjoint",
        SECTION,
        "W for 5 x 4 over 3 x 1 workers, kernel (5, 1): workers without output get empty windows",
        lambda: halo_windows(DistributedTensor("x", (5, 4), Partition((3, 1))), Kernel((5, 1))),
    ),
]
