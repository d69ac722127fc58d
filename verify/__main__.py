"""Demo (to become the full verification report): build a copy/broadcast-like tree, print it
and its adjoint, and prove the adjoint exactly."""

import sys

from linop import Block, Copy, Space


def main() -> int:
    space = Space([Block("x", (3,), worker=0)])
    to_one = Copy(space["x"], Block("x1", (3,), worker=1))
    broadcast = Copy(to_one.range["x"], Block("x2", (3,), worker=2)) @ to_one
    matrix, adjoint = broadcast.to_sparse(), broadcast.H.to_sparse()
    print("operator:", broadcast)
    print("adjoint: ", broadcast.H)
    print(matrix.toarray())
    ok = (adjoint != matrix.T).nnz == 0
    print("adjoint equals the transpose exactly:", ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
