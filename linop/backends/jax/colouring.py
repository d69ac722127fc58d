"""Rounds of a phase: a proper edge colouring of its bipartite (sender, receiver) graph.

Each colour class is a permutation (each device sends at most one message and receives at most
one), so one ``lax.ppermute`` runs it; König's theorem gives as many colours as the largest
degree, reached by alternating-path recolouring.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["edge_colouring"]


def edge_colouring(edges: Sequence[tuple[int, int]]) -> list[int]:
    """A proper colouring of a simple bipartite graph's edges (sender, receiver) with as many
    colours as its largest degree (König), by alternating-path recolouring."""
    at_u: dict[tuple[int, int], int] = {}
    at_v: dict[tuple[int, int], int] = {}
    colour: dict[tuple[int, int], int] = {}

    def free(table: dict[tuple[int, int], int], node: int) -> int:
        c = 0
        while (node, c) in table:
            c += 1
        return c

    for u, v in edges:
        a, b = free(at_u, u), free(at_v, v)
        if (
            v,
            a,
        ) in at_v:  # a is used at v: flip the a/b path from v, then a is free at both
            path, node, on_v, c = [], v, True, a
            while True:
                if on_v:
                    other = at_v.get((node, c))
                    if other is None:
                        break
                    path.append((other, node, c))
                else:
                    other = at_u.get((node, c))
                    if other is None:
                        break
                    path.append((node, other, c))
                node, on_v, c = other, not on_v, b if c == a else a
            for pu, pv, c in path:
                del at_u[(pu, c)], at_v[(pv, c)]
            for pu, pv, c in path:
                swapped = b if c == a else a
                at_u[(pu, swapped)], at_v[(pv, swapped)] = pv, pu
                colour[(pu, pv)] = swapped
        at_u[(u, a)], at_v[(v, a)] = v, u
        colour[(u, v)] = a
    return [colour[e] for e in edges]
