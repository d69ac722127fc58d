"""The primitives and derived movements have exactly the block matrices of docs/theory.md#primitives."""

import numpy as np
import pytest

from linop import (
    Add,
    Allocate,
    Block,
    Clear,
    Copy,
    CopyAdjoint,
    Deallocate,
    Move,
    SendRecv,
    SendRecvAdjoint,
    Space,
    expand_all,
)

N = 3
ONE, NIL = np.eye(N, dtype=np.int64), np.zeros((N, N), dtype=np.int64)  # I and O of docs/theory.md#primitives
AB = Space([("a", (N,)), ("b", (N,), 1)])
A_ONLY = Space([("a", (N,))])

# name, operator, expected block matrix over (a, b) in canonical order
BLOCK_FORMS = [
    ("allocate", Allocate(A_ONLY, Block("b", (N,), 1)), np.block([[ONE], [NIL]])),
    ("deallocate", Deallocate(AB, "b"), np.block([[ONE, NIL]])),
    ("clear", Clear(AB["b"]), np.block([[ONE, NIL], [NIL, NIL]])),
    ("add", Add(AB["a"], AB["b"]), np.block([[ONE, NIL], [ONE, ONE]])),
    ("add adjoint", Add(AB["b"], AB["a"]), np.block([[ONE, ONE], [NIL, ONE]])),
    ("copy in place", Copy(AB["a"], AB["b"]), np.block([[ONE, NIL], [ONE, NIL]])),
    ("copy in place adjoint", CopyAdjoint(AB["a"], AB["b"]), np.block([[ONE, ONE], [NIL, NIL]])),
    ("copy out of place", Copy(A_ONLY["a"], Block("b", (N,), 1)), np.block([[ONE], [ONE]])),
    ("copy out of place adjoint", CopyAdjoint(A_ONLY["a"], Block("b", (N,), 1)), np.block([[ONE, ONE]])),
    ("move in place", Move(AB["a"], AB["b"]), np.block([[NIL, NIL], [ONE, NIL]])),
    ("send-recv", SendRecv(AB["a"], AB["b"]), np.block([[ONE, NIL], [ONE, NIL]])),
    ("send-recv adjoint", SendRecvAdjoint(AB["a"], AB["b"]), np.block([[ONE, ONE], [NIL, NIL]])),
]


@pytest.mark.parametrize(("op", "expected"), [c[1:] for c in BLOCK_FORMS], ids=[c[0] for c in BLOCK_FORMS])
def test_matrix_equals_the_block_form_of_theory(op, expected):
    matrix = op.to_sparse()
    assert matrix.dtype == np.int64
    assert np.array_equal(matrix.toarray(), expected)


def test_move_out_of_place_relabels_with_the_identity_matrix():
    # D_a S_{a->b} A_b is "relabel a as b": with b taking a's place, the matrix is I.
    space = Space([("a", (N,)), ("c", (2,))])
    move = Move(space["a"], "b")
    assert move.range == Space([("b", (N,)), ("c", (2,))])
    assert np.array_equal(move.to_sparse().toarray(), np.eye(N + 2, dtype=np.int64))


BIG = Space([("a", (4, 5)), ("b", (3, 3), 1), ("c", (2,), 2)])
MOVEMENTS = [
    ("allocate", Allocate(BIG, Block("d", (2, 2), 3))),
    ("deallocate", Deallocate(BIG, "b")),
    ("clear part", Clear(BIG["a"][1:3, 2:])),
    ("add within a block", Add(BIG["a"][0:2, 0:2], BIG["a"][2:4, 3:5])),
    ("add between blocks", Add(BIG["a"][1:4, 0:3], BIG["b"])),
    ("copy in place", Copy(BIG["b"][0:2, :], BIG["a"][2:4, 1:4])),
    ("copy out of place", Copy(BIG["a"][1:3, 1:3], Block("d", (2, 2), 5))),
    ("copy to a name", Copy(BIG["c"], "d")),
    ("copy adjoint in place", CopyAdjoint(BIG["a"][0, 0:2], BIG["a"][3, 3:5])),
    ("copy adjoint out of place", CopyAdjoint(BIG["a"][1:3, 1:3], Block("d", (2, 2), 5))),
    ("move in place", Move(BIG["a"][0:3, 0:3], BIG["b"])),
    ("move within a block", Move(BIG["a"][0, :], BIG["a"][3, :])),
    ("move out of place", Move(BIG["b"], Block("z", (3, 3), 0))),
    ("send-recv", SendRecv(BIG["c"], BIG["a"][0, 3:5])),
    ("send-recv out of place", SendRecv(BIG["b"][0], Block("r", (3,), 2))),
    ("send-recv adjoint", SendRecvAdjoint(BIG["c"], BIG["a"][0, 3:5])),
]
IDS = [c[0] for c in MOVEMENTS]
OPS = [c[1] for c in MOVEMENTS]


@pytest.mark.parametrize("op", OPS, ids=IDS)
def test_adjoint_rule_is_the_exact_transpose(op):
    assert (op.H.to_sparse() != op.to_sparse().T).nnz == 0
    assert op.H.H == op
    assert op.H.domain == op.range and op.H.range == op.domain


@pytest.mark.parametrize("dtype", [np.int64, np.float32, np.complex128])
@pytest.mark.parametrize("op", OPS, ids=IDS)
def test_numpy_fast_path_equals_the_expansion_and_the_matrix(op, dtype):
    state = op.domain.random(7, dtype)
    fast, slow = op(state), expand_all(op)(state)
    by_matrix = op.range.unflatten(op.to_sparse(dtype) @ op.domain.flatten(state))
    for name in op.range.names:
        assert fast[name].dtype == dtype
        assert np.array_equal(fast[name], slow[name])
        assert np.array_equal(fast[name], by_matrix[name])
