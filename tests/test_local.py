"""LocalOperator: a user's kernel on one worker's blocks, in every interpreter, and verify
catching a forward/adjoint pair that is not adjoint."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as spla
from hypothesis import given, settings
from hypothesis import strategies as st

import verify
from linop import Block, Copy, LinopError, SendRecv, Space, UnknownBlockError, WorkerError
from linop.local import (
    KERNEL_KINDS,
    KernelOutputError,
    LocalKernel,
    LocalOperator,
    LocalOperatorError,
    NoMatrixError,
    local_operator,
    matrix_callables,
)
from linop.program import Local, fingerprint, lower
from verify.node_examples import example_strategy
from verify.strategies_local import local_operators

M = np.array([[1, 0, 2], [0, -1, 3]])


def space() -> Space:
    return Space([Block("x", (3,), 1), Block("z", (2,), 0)])


def made(kind: str) -> LocalOperator:
    s, out = space(), Block("y", (2,), 1)
    if kind == "dense":
        return local_operator(s, "x", out, M)
    if kind == "sparse":
        return local_operator(s, "x", out, sp.csr_array(M))
    if kind == "scipy":
        return local_operator(s, "x", out, spla.aslinearoperator(M))
    forward, adjoint = matrix_callables(M, (s.block("x"),), (out,), vectorized=kind == "vectorized")
    return local_operator(s, "x", out, forward=forward, adjoint=adjoint, vectorized=kind == "vectorized")


@pytest.mark.parametrize("kind", KERNEL_KINDS)
def test_every_kind_applies_the_kernel_and_passes_the_rest_through(kind):
    op = made(kind)
    x = {"x": np.array([1, 2, 3]), "z": np.array([7.0, 8.0])}
    y = op(x)
    assert y["y"].tolist() == [7, 7] and y["z"].tolist() == [7.0, 8.0]
    assert x["x"].tolist() == [1, 2, 3]  # never mutated
    assert op.range.names == ("y", "z") and op.H.domain == op.range and op.H.range == op.domain
    back = op.H({"y": np.array([1, 1]), "z": np.zeros(2)})
    assert back["x"].tolist() == (M.T @ [1, 1]).tolist()


@pytest.mark.parametrize("kind", KERNEL_KINDS)
def test_every_kind_has_an_exact_integer_matrix_and_adjoint(kind):
    op = made(kind)
    matrix = op.to_sparse()
    assert matrix.dtype.kind == "i", matrix.dtype
    expected = np.zeros((4, 5), dtype=int)  # rows y, z; columns x, z
    expected[:2, :3] = M
    expected[2:, 3:] = np.eye(2, dtype=int)
    assert np.array_equal(matrix.toarray(), expected)
    assert verify.exact_adjoint(op), verify.exact_adjoint(op)


@settings(max_examples=25)
@given(local_operators())
def test_numpy_equals_the_sparse_matrix_on_random_examples(op):
    for node in (op, op.H):
        x = node.domain.random(3, np.int64)
        assert np.array_equal(node.range.flatten(node(x)), node.to_sparse() @ node.domain.flatten(x))
    assert verify.exact_adjoint(op)


def test_the_registry_has_examples_for_local_operators():
    strategy = example_strategy(LocalOperator)
    assert strategy is not None

    @settings(max_examples=5)
    @given(strategy)
    def drawn(op):
        assert isinstance(op, LocalOperator)

    drawn()


# -- structure: equality, hashing, adjoint of the adjoint ------------------------------------
def test_adjoint_of_adjoint_is_the_operator_and_hashable_with_arrays():
    op = made("dense")
    assert op.H.H == op and hash(op.H.H) == hash(op) and op.H != op
    same = local_operator(space(), "x", Block("y", (2,), 1), M.copy())  # equal content, other array
    assert same == op and hash(same) == hash(op)
    other = local_operator(space(), "x", Block("y", (2,), 1), M + 1)
    assert other != op
    assert len({op, same, other, op.H}) == 3


def test_callables_compare_by_identity():
    forward, adjoint = matrix_callables(M, (space().block("x"),), (Block("y", (2,), 1),))
    a = local_operator(space(), "x", Block("y", (2,), 1), forward=forward, adjoint=adjoint)
    b = local_operator(space(), "x", Block("y", (2,), 1), forward=forward, adjoint=adjoint)
    f2, g2 = matrix_callables(M, (space().block("x"),), (Block("y", (2,), 1),))
    c = local_operator(space(), "x", Block("y", (2,), 1), forward=f2, adjoint=g2)
    assert a == b and a.H.H == a and a != c


def test_kernel_matrix_is_copied_and_read_only():
    matrix = M.copy()
    op = local_operator(space(), "x", Block("y", (2,), 1), matrix)
    matrix[0, 0] = 100
    assert op.kernel.matrix[0, 0] == 1 and not op.kernel.matrix.flags.writeable


def test_a_local_operator_is_a_leaf_and_composes():
    op = made("dense")
    assert op.expand() is op
    copy = Copy(space()["z"], "c")
    tree = SendRecv(op.within(copy.range).range["y"], Block("w", (2,), 0)) @ op.within(copy.range) @ copy
    y = tree({"x": np.array([1, 2, 3]), "z": np.array([1.0, 2.0])})
    assert y["w"].tolist() == [7, 7] and y["c"].tolist() == [1.0, 2.0]
    assert verify.exact_adjoint(tree)
    assert op.within(op.domain) == op and op.H.within(op.range) == op.H


def test_an_identity_kernel_returning_its_input_never_aliases_the_caller():
    s = Space([Block("x", (3,))])
    op = local_operator(s, "x", Block("y", (3,)), forward=lambda u: u, adjoint=lambda v: v)
    x = {"x": np.arange(3.0)}
    tree = 2 * (Copy(Space([Block("y", (3,))])["y"], "w") @ op)
    y = tree(x)
    assert x["x"].tolist() == [0.0, 1.0, 2.0] and y["y"].tolist() == [0.0, 2.0, 4.0]


# -- verify catches a wrong adjoint, with the entry located -----------------------------------
def wrong_pair(dtype=int) -> LocalOperator:
    """Forward M, adjoint M^T plus one stray entry at (x[2], y[0])."""
    stray = np.zeros((3, 2), dtype=dtype)
    stray[2, 0] = 5
    return local_operator(
        space(), "x", Block("y", (2,), 1), forward=lambda u: M @ u, adjoint=lambda v: M.T @ v + stray @ v
    )


def test_exact_adjoint_locates_the_wrong_entry_of_an_integer_pair():
    proof = verify.exact_adjoint(wrong_pair())
    assert not proof and proof.count == 1
    (mismatch,) = proof.mismatches
    assert (str(mismatch.row), str(mismatch.column)) == ("x[2]", "y[0]")
    assert (mismatch.left, mismatch.right) == (M[0, 2] + 5, M[0, 2])


def test_adjoint_test_catches_a_wrong_float_pair_and_locates_it():
    result = verify.adjoint_test(wrong_pair(float))
    assert not result
    assert "row x[2], column y[0]" in result.detail


def test_a_right_float_pair_passes_the_adjoint_test():
    rng = np.random.default_rng(1)
    a = rng.standard_normal((2, 3))
    op = local_operator(space(), "x", Block("y", (2,), 1), forward=lambda u: a @ u, adjoint=lambda v: a.T @ v)
    assert verify.adjoint_test(op, dtype=np.float32) and verify.adjoint_test(op)


# -- sympy ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_a_matrix_kernel_works_on_symbols(kind):
    op = made(kind)
    y = verify.symbolic.apply(op)["y"]
    assert [str(e) for e in y] == ["x_0 + 2*x_2", "-x_1 + 3*x_2"]
    assert verify.symbolic.dot_test(op)


@pytest.mark.parametrize("kind", ["callables", "vectorized", "scipy"])
def test_a_kernel_without_its_matrix_raises_a_typed_error_on_symbols(kind):
    with pytest.raises(NoMatrixError, match=r"L\[x -> y\]"):
        verify.symbolic.apply(made(kind))


# -- bad kernels and bad construction -----------------------------------------------------------
BAD_OUTPUTS = [
    pytest.param(
        lambda u: np.zeros(3), r"block 'y' came back with shape \(3,\), expected \(2,\)", id="shape"
    ),
    pytest.param(lambda u: np.zeros(2, np.float16), r"block 'y' came back with dtype float16", id="dtype"),
    pytest.param(lambda u: (np.zeros(2), np.zeros(2)), r"returned 2 arrays for the 1 blocks", id="count"),
    pytest.param(lambda u: np.array(["a", "b"]), r"block 'y' came back with dtype <U1", id="strings"),
]


@pytest.mark.parametrize(("forward", "message"), BAD_OUTPUTS)
def test_a_kernel_returning_the_wrong_thing_raises_naming_node_and_block(forward, message):
    op = local_operator(space(), "x", Block("y", (2,), 1), forward=forward, adjoint=lambda v: v, name="conv")
    with pytest.raises(KernelOutputError, match=r"conv\[x -> y\]") as caught:
        op({"x": np.ones(3), "z": np.zeros(2)})
    assert caught.match(message)


def test_probing_a_kernel_of_the_wrong_shape_raises_a_typed_error():
    op = local_operator(space(), "x", Block("y", (2,), 1), forward=lambda u: u, adjoint=lambda v: v)
    with pytest.raises(KernelOutputError, match="when probed"):
        op.to_sparse()


BAD_BUILDS = [
    pytest.param(
        lambda: local_operator(space(), "x", Block("y", (2,), 0), M), WorkerError, "worker 0", id="worker"
    ),
    pytest.param(
        lambda: local_operator(space(), ["x", "z"], ("y", 2), np.ones((2, 5))),
        WorkerError,
        "'z'",
        id="inputs-workers",
    ),
    pytest.param(
        lambda: local_operator(space(), "x", ("y", 2), np.ones((3, 3))),
        LocalOperatorError,
        r"shape \(3, 3\)",
        id="matrix-shape",
    ),
    pytest.param(
        lambda: local_operator(space(), "q", ("y", 2), M), UnknownBlockError, "'q'", id="unknown-input"
    ),
    pytest.param(
        lambda: local_operator(space(), "x", ("z", 2), M), LinopError, "'z' is already", id="output-taken"
    ),
    pytest.param(
        lambda: local_operator(space(), "x", ("y", 2), M, forward=abs, adjoint=abs),
        LocalOperatorError,
        "not both",
        id="both",
    ),
    pytest.param(
        lambda: local_operator(space(), "x", ("y", 2), forward=abs),
        LocalOperatorError,
        "adjoint missing",
        id="no-adjoint",
    ),
    pytest.param(
        lambda: local_operator(space(), "x", ("y", 2), np.ones(6)), LocalOperatorError, "2-D", id="vector"
    ),
]


@pytest.mark.parametrize(("build", "error", "message"), BAD_BUILDS)
def test_bad_construction_raises_typed_errors(build, error, message):
    with pytest.raises(error, match=message):
        build()


def test_an_output_may_reuse_its_input_name():
    s = Space([Block("x", (3,))])
    op = local_operator(s, "x", Block("x", (2,)), M)
    assert op.range == Space([Block("x", (2,))]) and op({"x": np.ones(3)})["x"].tolist() == [3, 2]
    assert verify.exact_adjoint(op)


# -- MPI lowering and fingerprint (the MPI runs are in tests/mpi/test_layers.py) ---------------
def test_mpi_lowering_is_one_local_step_on_the_owning_worker():
    op = made("dense")
    (step,) = lower(op)
    assert isinstance(step, Local) and step.worker == 1 and step.node == op
    assert ("x", None, None) in step.footprint.reads and ("y", None, None) in step.footprint.writes


@given(st.integers(0, 3))
@settings(max_examples=3)
def test_fingerprint_depends_on_the_matrix_content_only(seed):
    rng = np.random.default_rng(seed)
    a = rng.integers(-3, 4, (2, 3))
    one = local_operator(space(), "x", ("y", 2), a)
    two = local_operator(space(), "x", ("y", 2), a.copy())
    three = local_operator(space(), "x", ("y", 2), a + 1)
    assert fingerprint(one) == fingerprint(two) != fingerprint(three)
    assert repr(LocalKernel.of(a)) == repr(LocalKernel.of(a.copy()))
