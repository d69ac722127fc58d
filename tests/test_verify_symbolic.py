"""verify.symbolic: actions on named symbols, the symbolic dot test, and size-free proofs."""

from __future__ import annotations

from dataclasses import dataclass
from functools import reduce

import pytest
import sympy
from hypothesis import given, settings

import verify
from linop import (
    Add,
    Allocate,
    Block,
    Clear,
    Copy,
    Deallocate,
    Identity,
    LinearOperator,
    Move,
    SendRecv,
    Space,
)
from verify import strategies as lst
from verify import symbolic
from verify.sizefree import block_forms, canonical_block


def space() -> Space:
    return Space([Block("a", (2,)), Block("b", (2,), 1)])


# -- entry-wise symbols --------------------------------------------------------------------------
def test_symbols_are_named_after_block_and_index():
    state = symbolic.symbols(Space([Block("x", (2, 3)), Block("s", ())]))
    assert str(state["x"][0, 1]) == "x_0_1"
    assert str(state["s"][()]) == "s"
    assert state["x"].dtype == object and state["x"][1, 2].is_real


def test_apply_shows_the_copy_adjoint_adding_back():
    s = space()
    result = symbolic.apply(Copy(s["a"], s["b"]).H)
    a0, b0 = sympy.symbols("a_0 b_0", real=True)
    assert result["a"][0] == a0 + b0
    assert result["b"][0] == 0


def test_apply_keeps_complex_scalars_exactly():
    s = space()
    result = symbolic.apply(2j * Copy(s["a"], s["b"]))
    assert sympy.expand(result["b"][1] - 2 * sympy.I * sympy.Symbol("a_1", real=True)) == 0


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(lambda: Copy(space()["a"], space()["b"]), id="copy"),
        pytest.param(lambda: Move(space()["a"][1:], space()["b"][:1]), id="move-box"),
        pytest.param(lambda: (1 - 3j) * SendRecv(space()["a"], Block("c", (2,), 2)), id="sendrecv"),
        pytest.param(lambda: Deallocate(space(), "a"), id="deallocate"),
    ],
)
def test_dot_test_expands_to_zero(build):
    result = symbolic.dot_test(build())
    assert result, result
    assert result.residual == 0


def test_dot_test_names_do_not_clash():
    # a domain block called "da" must not collide with the range's "d" + "a" symbols
    s = Space([Block("a", (1,)), Block("da", (1,))])
    assert symbolic.dot_test(Copy(s["a"], s["da"]))


def test_symbolic_equal_names_the_first_differing_entry():
    s = space()
    assert symbolic.equal(Copy(s["a"], s["b"]).H, Clear(s["b"]) @ Add(s["b"], s["a"]))
    result = symbolic.equal(Copy(s["a"], s["b"]).H, Add(s["b"], s["a"]) @ Clear(s["b"]))
    assert not result
    assert "a[0]: a_0 + b_0 versus a_0" in result.detail


# -- size-free ---------------------------------------------------------------------------------------
def test_block_matrix_has_symbolic_identity_blocks():
    s = space()
    matrix = symbolic.block_matrix(Copy(s["a"], s["b"]))
    n = sympy.Symbol("n_a", integer=True, nonnegative=True)
    assert isinstance(matrix, sympy.BlockMatrix)
    assert matrix.blocks[0, 0] == sympy.Identity(n)
    assert matrix.blocks[1, 0] == sympy.Identity(n)
    assert matrix.blocks[0, 1] == sympy.ZeroMatrix(n, n)


def test_inplace_copy_adjoint_is_clear_after_reverse_add_for_all_sizes():
    s = space()
    proof = symbolic.prove_equal(Copy(s["a"], s["b"]).H, Clear(s["b"]) @ Add(s["b"], s["a"]))
    assert proof, proof
    assert "n_a" in proof.detail
    assert symbolic.prove_adjoint(Copy(s["a"], s["b"]))


def broadcast(k: int):
    space_ = Space([Block("a", (3,))])
    factors = []
    for i in range(1, k + 1):
        step = SendRecv(space_["a"], Block(f"b{i}", (3,), i))
        factors.insert(0, step)
        space_ = step.range
    return reduce(lambda f, g: f @ g, factors)


def sum_reduce(k: int):
    space_ = broadcast(k).range
    factors = []
    for i in range(1, k + 1):
        factors.insert(0, Deallocate(space_, f"b{i}") @ Add(space_[f"b{i}"], space_["a"]))
        space_ = space_.without(f"b{i}")
    return reduce(lambda f, g: f @ g, factors)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_broadcast_adjoint_is_sum_reduce_for_all_sizes(k):
    assert symbolic.prove_equal(broadcast(k).H, sum_reduce(k))
    assert symbolic.prove_adjoint(broadcast(k))


def test_allreduce_is_self_adjoint_for_all_sizes():
    allreduce = broadcast(3) @ sum_reduce(3)
    assert symbolic.prove_equal(allreduce.H, allreduce)
    assert symbolic.prove_adjoint(allreduce)


def test_sum_reduce_of_a_broadcast_is_k_plus_one_times_identity():
    form = symbolic.block_form(sum_reduce(3) @ broadcast(3))
    assert dict(form.coefficients) == {("a", "a"): 4}


def test_prove_equal_failure_names_the_blocks():
    s = space()
    proof = symbolic.prove_equal(Copy(s["a"], s["b"]), Move(s["a"], s["b"]))
    assert not proof
    assert "block (row a, column a)" in proof.detail
    with pytest.raises(AssertionError):
        proof.check()


def test_boxes_are_refused_with_a_typed_error():
    s = space()
    with pytest.raises(verify.NotSizeFreeError, match=r"a\[0:1\], a part of block 'a'"):
        symbolic.prove_adjoint(Copy(s["a"][:1], s["b"][1:]))


def test_scalars_stay_exact_in_block_forms():
    s = space()
    form = symbolic.block_form(0.1 * Identity(s))
    assert form.coefficients[("a", "a")] == sympy.Rational(0.1)  # the exact binary value of 0.1
    assert symbolic.prove_adjoint((0.1 - 2j) * Copy(s["a"], s["b"]))


@settings(max_examples=40, deadline=None)
@given(lst.operators(whole=True, max_leaves=5))
def test_size_free_agrees_with_exact_on_random_whole_block_trees(op):
    assert symbolic.prove_adjoint(op)
    assert verify.exact_adjoint(op)


@settings(max_examples=25, deadline=None)
@given(lst.operators(whole=True, max_leaves=3), lst.operators(whole=True, max_leaves=3))
def test_block_forms_multiply_like_block_collapse(first, second):
    # composing second after first, as the forms do it and as sympy's block_collapse does it
    if second.domain != first.range:
        second = Identity(first.range)
    product, left, right = block_forms(second @ first, second, first)
    if not (left.range.names and left.domain.names and right.domain.names):
        return
    collapsed = sympy.block_collapse(left.as_blockmatrix() * right.as_blockmatrix())

    def block(i: int, j: int) -> sympy.Expr:
        if isinstance(collapsed, sympy.BlockMatrix):
            return collapsed.blocks[i, j]
        assert (i, j) == (0, 0)  # a 1 x 1 block matrix collapses to its one block
        return collapsed

    for i, row in enumerate(product.range.names):
        for j, column in enumerate(product.domain.names):
            expected = product.coefficients.get((row, column), 0)
            assert sympy.expand(canonical_block(block(i, j)) - expected) == 0


def test_allocate_and_deallocate_forms():
    small = Space([Block("a", (2,))])
    allocate = Allocate(small, Block("b", (2,)))
    assert symbolic.prove_equal(Deallocate(allocate.range, "b") @ allocate, Identity(small))
    assert symbolic.prove_equal(allocate @ Deallocate(allocate.range, "b"), Clear(allocate.range["b"]))


def test_canonical_block_reduces_what_block_collapse_returns():
    n = sympy.Symbol("n", integer=True, nonnegative=True)
    identity = sympy.Identity(n)
    assert canonical_block(sympy.MatPow(sympy.Rational(3, 16) * identity, 2)) == sympy.Rational(9, 256)
    assert canonical_block(sympy.MatAdd(sympy.MatMul(2, identity), identity, sympy.ZeroMatrix(n, n))) == 3
    assert canonical_block(sympy.Adjoint(sympy.MatMul(sympy.I, identity))) == -sympy.I
    with pytest.raises(verify.NotSizeFreeError, match="not a multiple of an identity block"):
        canonical_block(sympy.MatrixSymbol("W", n, n))


def clashing_space() -> Space:
    # entry (0, 1) of block x and entry 1 of block x_0 would both be the symbol x_0_1
    return Space([Block("x", (1, 2)), Block("x_0", (2,))])


@pytest.mark.parametrize(
    "check",
    [
        pytest.param(lambda s: symbolic.symbols(s), id="symbols"),
        pytest.param(lambda s: symbolic.equal(Copy(s["x"][0, :], s["x_0"]), Identity(s)), id="equal"),
        pytest.param(lambda s: symbolic.dot_test(Copy(s["x"][0, :], s["x_0"])), id="dot-test"),
    ],
)
def test_clashing_symbol_names_are_refused(check):
    # with one symbol for two entries, copying x[0, :] onto x_0 would look like the identity
    with pytest.raises(verify.SymbolicError, match=r"entries x\[0, 0\] and x_0\[0\] would both be"):
        check(clashing_space())


def test_size_free_proofs_do_not_use_the_concrete_sizes():
    # on empty blocks a copy and the identity are both the 0 x 0 matrix, so the exact level
    # rightly proves them equal; for any other size they differ, and the size-free level says so
    empty = Space([Block("a", (0,)), Block("b", (0,))])
    copy, identity = Copy(empty["a"], empty["b"]), Identity(empty)
    assert verify.equal(copy, identity)
    proof = symbolic.prove_equal(copy, identity)
    assert not proof
    assert "block (row b, column a): left has I, right has 0" in proof.detail
    n_a = sympy.Symbol("n_a", integer=True, nonnegative=True)
    assert symbolic.block_matrix(copy).blocks[1, 0] == sympy.Identity(n_a)


@dataclass(frozen=True, eq=True, repr=False)
class CopyWithWrongSpaces(Copy):
    """An adjoint that does not even map the range back to the domain."""

    def adjoint(self) -> LinearOperator:
        return Copy(self.src, "zz")


@pytest.mark.parametrize(
    ("check", "expected"),
    [
        pytest.param(
            lambda: symbolic.dot_test(CopyWithWrongSpaces(space()["a"], space()["b"])),
            "op.H's range is not op's domain: block 'zz'",
            id="dot-test",
        ),
        pytest.param(
            lambda: symbolic.equal(Copy(space()["a"], "y"), Copy(space()["a"], "z")),
            "ranges differ: block 'y'",
            id="equal",
        ),
        pytest.param(
            lambda: symbolic.prove_adjoint(CopyWithWrongSpaces(space()["a"], space()["b"])),
            "ranges differ: block 'zz'",
            id="prove-adjoint",
        ),
        pytest.param(
            lambda: symbolic.prove_equal(Copy(space()["a"], "y"), Copy(space()["a"], "z")),
            "ranges differ: block 'y'",
            id="prove-equal",
        ),
    ],
)
def test_differing_spaces_name_the_block(check, expected):
    result = check()
    assert not result
    assert expected in result.detail
