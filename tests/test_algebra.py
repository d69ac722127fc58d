"""Operator algebra, the numpy interpreter's guarantees, in-place application and errors."""

from dataclasses import dataclass

import numpy as np
import pytest
import scipy.sparse.linalg as spla
import sympy

from linop import (
    Add,
    Block,
    Clear,
    Composition,
    Copy,
    Deallocate,
    Identity,
    LinearOperator,
    Move,
    OverlapError,
    ScalarError,
    ShapeMismatchError,
    Space,
    SpaceMismatchError,
    StateError,
    Sum,
    UnknownBlockError,
    WorkerError,
    Zero,
    aslinearoperator,
)

SPACE = Space([("a", (4,)), ("b", (4,), 1), ("c", (2, 2), 2)])


def copy_then_add():
    return Add(SPACE["a"][0:2], SPACE["b"][2:4]) @ Copy(SPACE["a"], SPACE["b"])


def test_composition_applies_right_to_left_and_flattens():
    first, second, third = (
        Clear(SPACE["a"]),
        Copy(SPACE["b"], SPACE["a"]),
        Add(SPACE["c"][0], SPACE["a"][1:3]),
    )
    assert (first @ second) @ third == first @ (second @ third)
    assert (first @ second @ third).factors == (first, second, third)
    x = {"a": np.arange(4.0), "b": np.arange(4.0) + 10, "c": np.ones((2, 2))}
    assert np.array_equal((second @ first)(x)["a"], x["b"])
    assert np.array_equal((first @ second)(x)["a"], np.zeros(4))


def test_adjoint_of_an_adjoint_is_the_same_tree():
    tree = 2j * copy_then_add() - Move(SPACE["a"][0:2], SPACE["c"][1]) + Identity(SPACE)
    assert tree.H.H == tree
    assert hash(tree.H.H) == hash(tree)


def test_algebra_matches_the_matrices():
    a, b = copy_then_add(), Move(SPACE["c"][0], SPACE["b"][1:3])
    ma, mb = a.to_sparse(), b.to_sparse()
    assert ((a @ b).to_sparse() != ma @ mb).nnz == 0
    assert ((a + b).to_sparse() != ma + mb).nnz == 0
    assert ((a - b).to_sparse() != ma - mb).nnz == 0
    assert ((-a).to_sparse() != -ma).nnz == 0
    assert ((3 * a).to_sparse() != 3 * ma).nnz == 0
    scaled = ((1 + 2j) * a).to_sparse()
    assert scaled.dtype == np.complex128 and (scaled != (1 + 2j) * ma).nnz == 0
    assert ((1 + 2j) * a).H.to_sparse().toarray().tolist() == scaled.conj().T.toarray().tolist()
    assert (Zero(SPACE, Space([("q", (1,))])).to_sparse()).nnz == 0
    assert np.array_equal(Identity(SPACE).to_sparse().toarray(), np.eye(SPACE.size))


def test_str_uses_operator_notation():
    assert str(copy_then_add()) == "S[a[0:2] -> b[2:4]] @ C[a -> b]"
    assert str(copy_then_add().H) == "C*[a -> b] @ S[b[2:4] -> a[0:2]]"
    assert str(2 * (Clear(SPACE["a"]) + Clear(SPACE["b"]))) == "2 * (K[a] + K[b])"


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.complex128, np.int32])
def test_numpy_interpreter_keeps_dtypes_and_never_mutates_its_input(dtype):
    tree = -copy_then_add() + 2 * Move(SPACE["c"][0], SPACE["b"][1:3])
    x = SPACE.random(3, dtype)
    before = {n: a.copy() for n, a in x.items()}
    y = tree(x)
    assert all(np.array_equal(x[n], before[n]) for n in x)
    assert all(y[n].dtype == dtype for n in y)
    expected = SPACE.unflatten(tree.to_sparse(dtype) @ SPACE.flatten(before))
    assert all(np.array_equal(y[n], expected[n]) for n in y)


def test_pass_through_blocks_are_read_only_views_of_the_input():
    x = SPACE.random(0)
    y = Copy(SPACE["a"], SPACE["b"])(x)
    assert np.shares_memory(y["c"], x["c"]) and not y["c"].flags.writeable
    assert not np.shares_memory(y["b"], x["b"]) and y["b"].flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        y["c"][0, 0] = 1.0


def test_relabel_is_free_and_promotions_follow_the_mathematics():
    space = Space([("a", (3,)), ("b", (3,))])
    x = {"a": np.ones(3, dtype=np.float32), "b": np.ones(3, dtype=np.complex64)}
    y = Add(space["b"], space["a"])(x)
    assert y["a"].dtype == np.complex64  # complex added into real becomes complex
    x["b"] = np.ones(3, dtype=np.float32)
    z = Move(space["a"], "r")(x)
    assert np.shares_memory(z["r"], x["a"])  # an out-of-place move is a relabel: no copy


def test_object_arrays_of_symbols_run_through_the_same_interpreter():
    space = Space([("a", (2,)), ("b", (2,), 1)])
    symbols = {n: np.array(sympy.symbols(f"{n}0:2"), dtype=object) for n in space.names}
    y = copy_then_add_on(space).H(symbols)
    a0, a1, b0, b1 = (*symbols["a"], *symbols["b"])
    assert list(y["a"]) == [a0 + b0, a1 + b1] and list(y["b"]) == [0, 0]


def copy_then_add_on(space):
    return Copy(space["a"], space["b"])


def test_inplace_application_reuses_the_callers_arrays():
    tree = Move(SPACE["a"][0:2], SPACE["b"][2:4]) @ Copy(SPACE["c"][1], SPACE["a"][0:2])
    x = SPACE.random(1)
    expected = tree(x)
    arrays = dict(x)
    out = tree.apply(x, inplace=True)
    assert out is x and all(out[n] is arrays[n] for n in x)
    assert all(np.array_equal(out[n], expected[n]) for n in x)


def test_inplace_swap_through_relabels_is_correct():
    space = Space([("x", (3,)), ("y", (3,))])
    first = Move(space["x"], "t")
    second = Move(first.range["y"], "x")
    swap = Move(second.range["t"], "y") @ second @ first
    x = {"x": np.arange(3.0), "y": np.arange(3.0) + 10}
    swap.apply(x, inplace=True)
    assert x["x"].tolist() == [10, 11, 12] and x["y"].tolist() == [0, 1, 2]


def test_inplace_accepts_disjoint_views_of_one_buffer():
    buffer = np.arange(16.0)
    state = {"a": buffer[0:4], "b": buffer[4:8], "c": buffer[8:12].reshape(2, 2)}
    expected = Copy(SPACE["a"], SPACE["b"])(state)
    Copy(SPACE["a"], SPACE["b"]).apply(state, inplace=True)
    assert buffer[4:8].tolist() == expected["b"].tolist() == [0.0, 1.0, 2.0, 3.0]


INPLACE_ERRORS = [
    (
        "domain differs from range",
        Copy(SPACE["a"], "z"),
        lambda: SPACE.random(0),
        SpaceMismatchError,
        "block 'z'",
    ),
    (
        "read-only array",
        Clear(SPACE["a"]),
        lambda: {**SPACE.random(0), "a": np.broadcast_to(np.zeros(1), (4,))},
        StateError,
        "writeable numpy array for block 'a'",
    ),
    (
        "one array for two blocks",
        Copy(SPACE["a"], SPACE["b"]),
        lambda: (lambda shared: {"a": shared, "b": shared, "c": np.zeros((2, 2))})(np.zeros(4)),
        StateError,
        "blocks 'a' and 'b' share entries",
    ),
    (
        "overlapping views",
        Clear(SPACE["a"]),
        lambda: (lambda buf: {"a": buf[0:4], "b": buf[2:6], "c": np.zeros((2, 2))})(np.zeros(8)),
        StateError,
        "blocks 'a' and 'b' share entries",
    ),
    (
        "result needs a wider dtype",
        1j * Identity(SPACE),
        lambda: SPACE.random(0),
        StateError,
        "block 'a' has dtype complex128",
    ),
]


@pytest.mark.parametrize(
    ("op", "make", "error", "text"), [c[1:] for c in INPLACE_ERRORS], ids=[c[0] for c in INPLACE_ERRORS]
)
def test_inplace_errors_are_typed(op, make, error, text):
    with pytest.raises(error, match=text):
        op.apply(make(), inplace=True)


ERRORS = [
    (
        "compose mismatched spaces",
        lambda: Clear(SPACE["a"]) @ Deallocate(SPACE, "c"),
        SpaceMismatchError,
        "block 'c' is missing on the right",
    ),
    (
        "add mismatched spaces",
        lambda: Clear(SPACE["a"]) + Clear(Space([("a", (4,))])["a"]),
        SpaceMismatchError,
        "block 'b' is missing on the right",
    ),
    (
        "different shapes",
        lambda: Add(SPACE["a"], SPACE["c"]),
        ShapeMismatchError,
        r"\(4,\) differs from .* \(2, 2\)",
    ),
    ("overlap in add", lambda: Add(SPACE["a"][0:3], SPACE["a"][1:4]), OverlapError, "overlap in block 'a'"),
    ("overlap in move", lambda: Move(SPACE["a"][0:2], SPACE["a"][1:3]), OverlapError, "overlap in block 'a'"),
    ("allocate an existing block", lambda: Copy(SPACE["a"], "b"), Exception, "'b'"),
    ("deallocate an unknown block", lambda: Deallocate(SPACE, "q"), UnknownBlockError, "unknown block 'q'"),
    ("partial out-of-place move", lambda: Move(SPACE["a"][0:2], "z"), Exception, "whole block 'a'"),
    (
        "send-recv on one worker",
        lambda: __import__("linop").SendRecv(SPACE["a"][0:2], SPACE["a"][2:4]),
        WorkerError,
        "worker 0",
    ),
    (
        "multiply by an array",
        lambda: np.ones(2) * Clear(SPACE["a"]) if False else Clear(SPACE["a"]) * "2",
        ScalarError,
        "str",
    ),
    ("multiply two operators", lambda: Clear(SPACE["a"]) * Clear(SPACE["a"]), ScalarError, "compose"),
    (
        "state with a missing block",
        lambda: Clear(SPACE["a"])({"a": np.zeros(4)}),
        StateError,
        "missing block 'b'",
    ),
    (
        "state with a wrong shape",
        lambda: Clear(SPACE["a"])({**SPACE.zeros(), "c": np.zeros(4)}),
        StateError,
        "block 'c'",
    ),
]


@pytest.mark.parametrize(("make", "error", "text"), [c[1:] for c in ERRORS], ids=[c[0] for c in ERRORS])
def test_errors_name_what_is_at_fault(make, error, text):
    with pytest.raises(error, match=text) as info:
        make()
    assert isinstance(info.value, __import__("linop").LinopError)


def test_aslinearoperator_wraps_matvec_and_rmatvec():
    tree = copy_then_add() + 0.5 * Move(SPACE["c"][0], SPACE["b"][1:3])
    wrapped = aslinearoperator(tree, dtype=np.float64)
    dense = tree.to_sparse().toarray()
    vector = np.random.default_rng(0).standard_normal(SPACE.size)
    assert wrapped.shape == dense.shape
    assert np.allclose(wrapped.matvec(vector), dense @ vector)
    assert np.allclose(wrapped.rmatvec(vector), dense.T @ vector)
    solution = spla.lsqr(aslinearoperator(Identity(SPACE) + tree), vector, atol=1e-12, btol=1e-12)[0]
    assert np.allclose(solution, np.linalg.lstsq(np.eye(SPACE.size) + dense, vector, rcond=None)[0])


@dataclass(frozen=True, eq=True, repr=False)
class CopyWithWrongAdjoint(Copy):
    """A deliberately wrong adjoint rule: claims the adjoint of a copy is the reverse copy."""

    def adjoint(self) -> LinearOperator:
        return Copy(self.dst, self.src)


def test_a_wrong_adjoint_rule_is_caught_by_the_exact_check():
    wrong = CopyWithWrongAdjoint(SPACE["a"], SPACE["b"])
    difference = wrong.H.to_sparse() != wrong.to_sparse().T
    assert difference.nnz > 0
    right = Copy(SPACE["a"], SPACE["b"])
    assert (right.H.to_sparse() != right.to_sparse().T).nnz == 0


@dataclass(frozen=True, eq=True, repr=False)
class Opaque(LinearOperator):
    """A node with neither an interpreter handler nor an expansion."""

    space: Space

    @property
    def domain(self) -> Space:
        return self.space

    @property
    def range(self) -> Space:
        return self.space

    def adjoint(self) -> LinearOperator:
        return self

    def __str__(self) -> str:
        return "Opaque"


@pytest.mark.parametrize(
    "interpret", [lambda op: op(SPACE.zeros()), lambda op: op.to_sparse()], ids=["numpy", "sparse"]
)
def test_a_node_without_handler_or_expansion_is_a_typed_error(interpret):
    from linop import UnsupportedNodeError

    with pytest.raises(UnsupportedNodeError, match=r"no handler for Opaque \(Opaque\)"):
        interpret(Clear(SPACE["a"]) @ Opaque(SPACE))


def test_sum_of_terms_does_not_let_one_term_see_anothers_changes():
    tree = Sum((Clear(SPACE["a"]), Copy(SPACE["a"], SPACE["b"]), Identity(SPACE)))
    x = SPACE.random(5)
    y = tree(x)
    expected = SPACE.unflatten(tree.to_sparse() @ SPACE.flatten(x))
    assert all(np.allclose(y[n], expected[n]) for n in y)
    assert isinstance(tree.H, Sum) and isinstance(copy_then_add().H, Composition)
    assert Block("z", (1,)) not in SPACE.blocks
