"""Core benchmark: exact proof of a 1e6-entry copy, and the numpy interpreter against numpy.

Prints figures; nothing is asserted. Run: ``python benchmarks/bench_core.py``.
"""

from __future__ import annotations

import time

import numpy as np
from _timing import compare

from linop import Block, Copy, Space

N = 1_000_000
REPEATS = 15


def prove(op) -> bool:
    return (op.H.to_sparse() != op.to_sparse().T).nnz == 0


def main() -> None:
    space = Space([Block("a", (N,)), Block("b", (N,), worker=1)])
    in_place = Copy(space["a"], space["b"])
    out_of_place = Copy(Space([Block("a", (N,))])["a"], Block("b", (N,), worker=1))

    print(f"exact adjoint proof of a copy between two blocks of {N:.0e} entries")
    for label, op in (("in place", in_place), ("out of place", out_of_place)):
        start = time.perf_counter()
        ok = prove(op)
        print(
            f"  {label:13s} proven={ok}  {time.perf_counter() - start:.3f} s (materialize A and A.H, compare)"
        )

    state = space.random(0)
    a, b = state["a"], state["b"]
    print(f"\nnumpy interpreter against plain numpy ({N:.0e} float64, median of {REPEATS})")
    rows = [
        ("copy, out of place", lambda: out_of_place({"a": a}), lambda: a.copy()),
        ("copy, in place (new result)", lambda: in_place(state), lambda: (a, a.copy())),
        (
            "copy, in place (inplace=True)",
            lambda: in_place.apply(state, inplace=True),
            lambda: np.copyto(b, a),
        ),
    ]
    for label, ours, theirs in rows:
        t_ours, t_theirs, ratio = compare(ours, theirs, REPEATS)
        print(
            f"  {label:30s} linop {t_ours * 1e3:7.3f} ms   numpy {t_theirs * 1e3:7.3f} ms   ratio {ratio:5.2f}x"
        )


if __name__ == "__main__":
    main()
