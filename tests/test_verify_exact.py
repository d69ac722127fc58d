"""verify.exact_adjoint and verify.equal: exact proofs entry by entry, diffs as (block, index)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

import verify
from linop import Add, Block, Clear, Copy, Deallocate, Identity, LinearOperator, Move, SendRecv, Space, Zero
from verify.locate import Location, locate, locations


def space() -> Space:
    return Space([Block("x", (2, 3)), Block("y", (2, 3), 1), Block("s", ())])


CORRECT = [
    pytest.param(lambda: Copy(space()["x"], space()["y"]), id="copy"),
    pytest.param(lambda: Copy(space()["x"][1, :], "n"), id="copy-box-new"),
    pytest.param(lambda: Move(space()["y"][:, 1:], space()["x"][:, :2]), id="move-boxes"),
    pytest.param(lambda: SendRecv(space()["x"], space()["y"]), id="sendrecv"),
    pytest.param(lambda: Deallocate(space(), "s"), id="deallocate-scalar"),
    pytest.param(lambda: (1 - 2j) * Copy(space()["x"], space()["y"]) + Clear(space()["s"]), id="complex-sum"),
    pytest.param(
        lambda: 0.1 * Copy(space()["x"], space()["y"]) @ (0.3 * Add(space()["y"], space()["x"])),
        id="float-scalars",
    ),
]


@pytest.mark.parametrize("build", CORRECT)
def test_correct_adjoints_are_proven(build):
    proof = verify.exact_adjoint(build())
    assert proof, proof
    assert proof.count == 0 and proof.mismatches == ()
    assert verify.assert_exact_adjoint(build()) is not None


def test_data_movement_is_proven_with_integers():
    proof = verify.exact_adjoint(Copy(space()["x"], space()["y"]))
    assert proof.exact and proof.max_error == 0
    assert "int64" in proof.detail


def test_floating_scalars_allow_rounding_and_say_so():
    s = space()
    op = 0.1 * Copy(s["x"], s["y"]) @ (0.3 * Add(s["y"], s["x"])) + 0.7 * Clear(s["x"])
    proof = verify.exact_adjoint(op)
    assert proof
    assert proof.max_error < 1e-15


@dataclass(frozen=True, eq=True, repr=False)
class ClearWithPlainAdjoint(Clear):
    """Right matrix, but op.H.H is a plain Clear, not this node."""

    def adjoint(self) -> LinearOperator:
        return Clear(self.region)


@dataclass(frozen=True, eq=True, repr=False)
class CopyWithWrongSpaces(Copy):
    """An adjoint that does not even map the range back to the domain."""

    def adjoint(self) -> LinearOperator:
        return Copy(self.src, "zz")


def test_structure_of_the_adjoint_is_checked():
    proof = verify.exact_adjoint(ClearWithPlainAdjoint(space()["x"]))
    assert not proof
    assert "op.H.H is not structurally op" in proof.detail


def test_wrong_spaces_name_the_block():
    proof = verify.exact_adjoint(CopyWithWrongSpaces(space()["x"], space()["y"]))
    assert not proof
    assert "block 'zz'" in proof.detail


def test_equal_proves_a_definition():
    s = space()
    assert verify.equal(Copy(s["x"], s["y"]), Add(s["x"], s["y"]) @ Clear(s["y"]))


def test_equal_reports_differing_entries_as_block_and_index():
    s = space()
    proof = verify.equal(Copy(s["x"], s["y"]), Add(s["x"], s["y"]))  # forgot the clear
    assert not proof
    assert proof.count == 6
    first = proof.mismatches[0]
    assert first.row == Location("y", (0, 0)) and first.column == Location("y", (0, 0))
    assert (first.left, first.right) == (0, 1)
    assert "row y[0, 0], column y[0, 0]: 0 versus 1" in proof.detail
    assert "(and 1 more)" in proof.detail
    with pytest.raises(AssertionError, match=r"row y\[0, 0\]"):
        verify.assert_equal(Copy(s["x"], s["y"]), Add(s["x"], s["y"]))


def test_equal_reports_differing_spaces():
    s = space()
    proof = verify.equal(Copy(s["x"], "a"), Copy(s["x"], "b"))
    assert not proof
    assert "ranges differ" in proof.detail and "'a'" in proof.detail


def test_proof_repr_is_readable():
    text = repr(verify.exact_adjoint(Copy(space()["x"], space()["y"])))
    assert text.startswith("Proof(proven: C[x -> y]")


@pytest.mark.parametrize(
    ("position", "expected"),
    [
        (0, Location("s", ())),
        (1, Location("x", (0, 0))),
        (6, Location("x", (1, 2))),
        (7, Location("y", (0, 0))),
    ],
    ids=["scalar-block", "first", "last-of-x", "first-of-y"],
)
def test_locate_names_block_and_index(position, expected):
    assert locate(space(), position) == expected


def test_locations_skip_empty_blocks_and_format():
    s = Space([Block("e", (0, 3)), Block("f", (2,))])
    assert locations(s, [0, 1]) == [Location("f", (0,)), Location("f", (1,))]
    assert str(Location("x", (1, 2))) == "x[1, 2]"
    with pytest.raises(IndexError):
        locate(s, 2)


# (left, right) trees whose matrices differ by amounts that a rounding allowance would hide: a
# tolerance floored at 1 hides a tiny scale, one relative to the largest entry hides an
# off-by-one among huge integer-valued floats. (first differing row, how many differ, whether
# the comparison is exact: integer-valued matrices get no allowance at all)
NEARLY_EQUAL = [
    pytest.param(
        lambda: (1e-20 * Copy(space()["x"], space()["y"]), 1e-20 * Add(space()["x"], space()["y"])),
        Location("y", (0, 0)),
        6,
        False,
        id="tiny-scale",
    ),
    pytest.param(
        lambda: (
            2.0**50 * Copy(space()["x"], space()["y"]) + Clear(space()["y"]),
            # plus the 0/1 matrix with a single 1 at (s, s)
            2.0**50 * Copy(space()["x"], space()["y"])
            + Clear(space()["y"])
            + (Identity(space()) - Clear(space()["s"])),
        ),
        Location("s", ()),
        1,
        True,
        id="integer-valued-floats-large-scale",
    ),
]


@pytest.mark.parametrize(("build", "where", "count", "exact"), NEARLY_EQUAL)
def test_small_differences_are_not_taken_for_rounding(build, where, count, exact):
    left, right = build()
    proof = verify.equal(left, right)
    assert not proof, proof
    assert proof.count == count and proof.mismatches[0].row == where
    assert proof.exact is exact


# Integer scalars large enough to overflow int64 in the sparse interpreter: a wrapped matrix
# (2**80 is 0 modulo 2**64) must not become a proof. (left, right, whether they are equal)
LARGE_INTEGERS = [
    pytest.param(
        lambda: (
            (2**40 * Identity(space())) @ (2**40 * Copy(space()["x"], space()["y"])),
            Zero(space(), space()),
        ),
        False,
        id="product-wraps-to-zero",
    ),
    pytest.param(
        # 2**63 wraps to -2**63
        lambda: (
            2**62 * Clear(space()["x"]) + 2**62 * Clear(space()["x"]),
            -(2**62) * Clear(space()["x"]) + -(2**62) * Clear(space()["x"]),
        ),
        False,
        id="sum-wraps",
    ),
    pytest.param(
        lambda: (
            2**70 * Copy(space()["x"], space()["y"]),
            2**35 * (2**35 * Copy(space()["x"], space()["y"])),
        ),
        True,
        id="scalar-beyond-int64",
    ),
]


@pytest.mark.parametrize(("build", "same"), LARGE_INTEGERS)
def test_integer_overflow_is_no_proof(build, same):
    left, right = build()
    assert bool(verify.equal(left, right)) is same
