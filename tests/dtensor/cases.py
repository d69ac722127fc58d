"""The redistribute cases of the multi-process checks and of ``benchmarks/bench_dtensor.py``:
(source, destination) layouts on the world's ranks, uneven shards first (torch.chunk sizes
and others: rows 10/30/7/30, empty shards, nested shards). Built from plain data."""

from __future__ import annotations

from linop.mesh_layout import MeshLayout, Partial, Replicate, Shard

S0, S1, R, P = Shard(0), Shard(1), Replicate(), Partial()


def uneven(length: int, parts: int) -> tuple[int, ...]:
    """A cut that is not torch.chunk's: 10/30/7/30 for 77 over 4, else the rest on the last."""
    if (length, parts) == (77, 4):
        return (10, 30, 7, 30)
    first = [min(3 * (k + 1), length // parts) for k in range(parts - 1)]
    return (*first, length - sum(first))


def cases(size: int) -> list[tuple[str, MeshLayout, MeshLayout]]:
    """(label, source, destination) for a world of ``size`` ranks."""

    def one(placements, shape, sizes=None, name="a"):
        return MeshLayout.from_placements((size,), placements, shape, sizes, name=name)

    rows = uneven(77, size)
    found = [
        ("77x9 chunk S0->S1", one([S0], (77, 9)), one([S1], (77, 9), name="b")),
        ("77x9 rows 10/30/7/30 S0->S1", one([S0], (77, 9), {0: rows}), one([S1], (77, 9), name="b")),
        ("77x9 S1->rows 10/30/7/30 S0", one([S1], (77, 9)), one([S0], (77, 9), {0: rows}, name="b")),
        ("77x9 rows 10/30/7/30 -> chunk S0", one([S0], (77, 9), {0: rows}), one([S0], (77, 9), name="b")),
        ("77x9 rows 10/30/7/30 S0->R", one([S0], (77, 9), {0: rows}), one([R], (77, 9), name="b")),
        ("77x9 R->rows 10/30/7/30 S0", one([R], (77, 9)), one([S0], (77, 9), {0: rows}, name="b")),
        ("77x9 P->rows 10/30/7/30 S0", one([P], (77, 9)), one([S0], (77, 9), {0: rows}, name="b")),
        ("13x6 P->R", one([P], (13, 6)), one([R], (13, 6), name="b")),
        ("5x7 chunk S0 (empty shard)->S1", one([S0], (5, 7)), one([S1], (5, 7), name="b")),
        (
            "13x3 S0 empty-first -> chunk S0",
            one([S0], (13, 3), {0: (0,) * (size - 1) + (13,)}),
            one([S0], (13, 3), name="b"),
        ),
        (
            "9x10 S1 uneven -> S0 uneven",
            one([S1], (9, 10), {1: uneven(10, size)}),
            one([S0], (9, 10), {0: uneven(9, size)}, name="b"),
        ),
    ]
    if size == 4:

        def two(placements, shape, sizes=None, name="a"):
            return MeshLayout.from_placements((2, 2), placements, shape, sizes, name=name)

        found += [
            ("2x2 11x7 (S0,S1)->(S1,S0)", two([S0, S1], (11, 7)), two([S1, S0], (11, 7), name="b")),
            ("2x2 11x7 nested (S0,S0)->(R,S1)", two([S0, S0], (11, 7)), two([R, S1], (11, 7), name="b")),
            (
                "2x2 11x7 nested (0,1,2,8) -> (S0,R)",
                two([S0, S0], (11, 7), {0: (0, 1, 2, 8)}),
                two([S0, R], (11, 7), name="b"),
            ),
            (
                "2x2 11x7 (S0 3/8,R)->(S1,S1)",
                two([S0, R], (11, 7), {0: (3, 8)}),
                two([S1, S1], (11, 7), name="b"),
            ),
            (
                "2x2 11x7 (S1,S0)->nested (S0,S0) 1/5/4/1",
                two([S1, S0], (11, 7)),
                two([S0, S0], (11, 7), {0: (1, 5, 4, 1)}, name="b"),
            ),
            ("2x2 9x5 (P,S0)->(R,R)", two([P, S0], (9, 5)), two([R, R], (9, 5), name="b")),
            ("2x2 9x5 (R,P)->(S0,S1)", two([R, P], (9, 5)), two([S0, S1], (9, 5), name="b")),
            ("2x2 9x5 (S1,P)->(P,S1)", two([S1, P], (9, 5)), two([P, S1], (9, 5), name="b")),
            (
                "2x2 9x5 (S0 2/7,S1 4/1)->(S1,S0)",
                two([S0, S1], (9, 5), {0: (2, 7), 1: (4, 1)}),
                two([S1, S0], (9, 5), name="b"),
            ),
            (
                "2x2 6x6x4 (S2,S0)->(S0,S2)",
                two([Shard(2), S0], (6, 6, 4)),
                two([S0, Shard(2)], (6, 6, 4), name="b"),
            ),
        ]
    return found
