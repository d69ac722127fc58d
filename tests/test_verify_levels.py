"""Each verification level catches a deliberately wrong adjoint, naming the block and index.

The wrong operators are subclasses of real nodes whose ``adjoint()`` returns something
plausible but false, the kind of slip a new node's author makes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

import verify
from linop import Add, Block, Clear, Copy, LinearOperator, Move, Scaled, Space
from verify import symbolic


@dataclass(frozen=True, eq=True, repr=False)
class CopyForgetsClear(Copy):
    """Claims C_{a->b}* = S_{b->a}: forgets to clear x_b (the true adjoint is K_b S_{b->a})."""

    def adjoint(self) -> LinearOperator:
        return Add(self.dst, self.src)


@dataclass(frozen=True, eq=True, repr=False)
class CopyAdjointMovesBack(Copy):
    """Claims C_{a->b}* = M_{b->a}: overwrites x_a instead of adding into it."""

    def adjoint(self) -> LinearOperator:
        return Move(self.dst, self.src)


@dataclass(frozen=True, eq=True, repr=False)
class AddSameDirection(Add):
    """Claims S_{a->b}* = S_{a->b} (the true adjoint adds the other way)."""

    def adjoint(self) -> LinearOperator:
        return Add(self.src, self.dst)


@dataclass(frozen=True, eq=True, repr=False)
class ScaledNoConjugate(Scaled):
    """Claims (alpha F)* = alpha F*: forgets the conjugate."""

    def adjoint(self) -> LinearOperator:
        return Scaled(self.alpha, self.operator.H)


def space() -> Space:
    return Space([Block("a", (2, 3)), Block("b", (2, 3), 1)])


# (id, wrong operator, one wrong entry of op.H as (row block, row index, column block, column index),
#  whether every region is a whole block)
BROKEN = [
    pytest.param(
        lambda: CopyForgetsClear(space()["a"], space()["b"]),
        ("b", (0, 0), "b", (0, 0)),
        True,
        id="copy-forgets-clear",
    ),
    pytest.param(
        lambda: CopyAdjointMovesBack(space()["a"], space()["b"]),
        ("a", (0, 0), "a", (0, 0)),
        True,
        id="copy-adjoint-moves-back",
    ),
    pytest.param(
        lambda: CopyForgetsClear(space()["a"][1, 1:], space()["b"][0, :2]),
        ("b", (0, 0), "b", (0, 0)),
        False,
        id="copy-box-forgets-clear",
    ),
    pytest.param(
        lambda: AddSameDirection(space()["a"][:, 2], space()["b"][:, 0]),
        ("a", (0, 2), "b", (0, 0)),
        False,
        id="add-same-direction",
    ),
    pytest.param(
        lambda: ScaledNoConjugate(2j, Clear(space()["b"])),
        ("a", (0, 0), "a", (0, 0)),
        True,
        id="scaled-no-conjugate",
    ),
]


def entry_text(where: tuple) -> tuple[str, str]:
    row_block, row_index, column_block, column_index = where
    return (
        f"{row_block}[{', '.join(map(str, row_index))}]",
        f"{column_block}[{', '.join(map(str, column_index))}]",
    )


@pytest.mark.parametrize(("build", "where", "whole"), BROKEN)
def test_exact_level_catches_and_names_entry(build, where, whole):
    op = build()
    proof = verify.exact_adjoint(op)
    assert not proof
    row, column = entry_text(where)
    first = proof.mismatches[0]
    assert (str(first.row), str(first.column)) == (row, column)
    assert f"row {row}, column {column}" in proof.detail
    with pytest.raises(AssertionError, match=r"row \w\[[\d, ]+\], column \w\["):
        verify.assert_exact_adjoint(op)


@pytest.mark.parametrize(("build", "where", "whole"), BROKEN)
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.complex128], ids=str)
def test_numeric_level_catches_and_names_entry(build, where, whole, dtype):
    op = build()
    result = verify.adjoint_test(op, dtype=dtype)
    assert not result
    assert result.measured >= result.threshold
    row, column = entry_text(where)
    assert f"first: row {row}, column {column}" in result.detail
    with pytest.raises(AssertionError, match=r"relative error .* is not below the threshold") as info:
        verify.assert_adjoint(op, dtype=dtype)
    assert f"row {row}, column {column}" in str(info.value)


@pytest.mark.parametrize(("build", "where", "whole"), BROKEN)
def test_symbolic_dot_test_catches_and_names_entry(build, where, whole):
    op = build()
    result = symbolic.dot_test(op)
    assert not result
    assert result.residual != 0
    row, column = entry_text(where)
    assert f"row {row}, column {column}: op.H is off by" in result.detail
    with pytest.raises(AssertionError, match=r"op\.H is off by"):
        result.check()


@pytest.mark.parametrize(("build", "where", "whole"), BROKEN)
def test_size_free_level_catches_and_names_block(build, where, whole):
    op = build()
    if not whole:
        with pytest.raises(verify.NotSizeFreeError, match="part of block"):
            symbolic.prove_adjoint(op)
        return
    proof = symbolic.prove_adjoint(op)
    assert not proof
    assert f"block (row {where[0]}, column {where[2]})" in proof.detail
    with pytest.raises(AssertionError, match="blocks differ"):
        proof.check()


def test_numeric_level_without_localization_still_fails():
    op = CopyForgetsClear(space()["a"], space()["b"])
    result = verify.adjoint_test(op, localize=False)
    assert not result
    assert "row" not in result.detail
    assert "<F x, y> =" in result.detail


@dataclass(frozen=True, eq=True, repr=False)
class ScaledSlightlyOff(Scaled):
    """Claims (alpha F)* = conj(alpha) (1 + 1e-10) F*: a real error, ten digits down."""

    def adjoint(self) -> LinearOperator:
        return Scaled(complex(self.alpha).conjugate() * (1 + 1e-10), self.operator.H)


def large_space() -> Space:
    return Space([Block("a", (100, 100)), Block("b", (100, 100), 1)])


# Wrong adjoints whose error is small: relative 1e-10, or one wrong entry of op.H among
# 20000 x 20000 (relative error about 1 / 20000). float64 must catch both.
SMALL_ERRORS = [
    pytest.param(lambda: ScaledSlightlyOff(1.5, Copy(space()["a"], space()["b"])), id="scalar-off-by-1e-10"),
    pytest.param(
        lambda: ScaledSlightlyOff(0.5 - 2j, Copy(space()["a"], space()["b"])),
        id="complex-scalar-off-by-1e-10",
    ),
    pytest.param(
        lambda: CopyForgetsClear(large_space()["a"][0:1, 0:1], large_space()["b"][7:8, 3:4]),
        id="one-entry-in-20000",
    ),
]


@pytest.mark.parametrize("build", SMALL_ERRORS)
def test_numeric_level_catches_small_errors_in_float64(build):
    result = verify.adjoint_test(build(), dtype=np.float64)
    assert not result, result
    assert result.measured > 10 * result.threshold


def test_numeric_level_localizes_a_wrong_adjoint_of_tiny_scale():
    # the localization's allowance follows the operator's own scale, not a floor of 1
    result = verify.adjoint_test(1e-20 * CopyForgetsClear(space()["a"], space()["b"]))
    assert not result
    assert "first: row b[0, 0], column b[0, 0]" in result.detail


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the overflow to inf/NaN is the point
def test_numeric_equal_needs_a_trial_and_fails_on_nan():
    s = space()
    with pytest.raises(ValueError, match="trials"):
        verify.numeric_equal(Copy(s["a"], s["b"]), Clear(s["b"]), trials=0)
    overflowed = 1e200 * (1e200 * Copy(s["a"], s["b"]))  # inf entries; a NaN scalar is refused
    result = verify.numeric_equal(overflowed - overflowed, Copy(s["a"], s["b"]))
    assert not result and result.measured == float("inf")
