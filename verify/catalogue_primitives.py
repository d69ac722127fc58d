"""Catalogue, ``docs/theory.md#primitives``: memory as a vector; the four primitives and copy/move.

Each row of the section's table becomes entries: the adjoint rule of the node (``op.H`` is the
conjugate transpose of ``op``), the node's definition by primitives (which also proves each
interpreter's fast path equal to the expansion), the stated matrix, and the adjoint's stated
form. Operators act on whole blocks wherever the identity allows it, so that the report proves
them for every block size too; entries on boxes (parts of blocks) check the same rules where
sizes matter.
"""

from __future__ import annotations

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
    Space,
)

from .catalogue import Entry, adjoint_entry, equal_entry

__all__ = ["ENTRIES"]

SECTION = "primitives"


def _space() -> Space:
    """x_a and x_b of one shape, and an unrelated block x_c elsewhere."""
    return Space([Block("a", (2, 3)), Block("b", (2, 3)), Block("c", (4,), 1)])


def _new_b() -> Block:
    return Block("b", (2, 3))


def _without_b() -> Space:
    return _space().without("b")


def _copy() -> LinearOperator:
    s = _space()
    return Copy(s["a"], s["b"])


def _move() -> LinearOperator:
    s = _space()
    return Move(s["a"], s["b"])


def _copy_new() -> LinearOperator:
    return Copy(_without_b()["a"], _new_b())


def _move_new() -> LinearOperator:
    return Move(_without_b()["a"], _new_b())


def _copy_definition() -> tuple[LinearOperator, LinearOperator]:
    s = _space()
    return Copy(s["a"], s["b"]), Add(s["a"], s["b"]) @ Clear(s["b"])


def _copy_adjoint_form() -> tuple[LinearOperator, LinearOperator]:
    s = _space()
    return Copy(s["a"], s["b"]).H, Clear(s["b"]) @ Add(s["b"], s["a"])


def _copy_matrix() -> tuple[LinearOperator, LinearOperator]:
    # [[I, O], [I, O]] = S_{a->b} + K_b - I  (S = [[I, O], [I, I]], K_b = [[I, O], [O, O]])
    s = _space()
    return Copy(s["a"], s["b"]), Add(s["a"], s["b"]) + Clear(s["b"]) - Identity(s)


def _copy_new_definition() -> tuple[LinearOperator, LinearOperator]:
    small = _without_b()
    grown = small.with_block(_new_b())
    return Copy(small["a"], _new_b()), Add(grown["a"], grown["b"]) @ Allocate(small, _new_b())


def _copy_new_adjoint_form() -> tuple[LinearOperator, LinearOperator]:
    small = _without_b()
    grown = small.with_block(_new_b())
    return Copy(small["a"], _new_b()).H, Deallocate(grown, "b") @ Add(grown["b"], grown["a"])


def _move_definition() -> tuple[LinearOperator, LinearOperator]:
    s = _space()
    return Move(s["a"], s["b"]), Clear(s["a"]) @ Add(s["a"], s["b"]) @ Clear(s["b"])


def _move_adjoint_form() -> tuple[LinearOperator, LinearOperator]:
    s = _space()
    return Move(s["a"], s["b"]).H, Clear(s["b"]) @ Add(s["b"], s["a"]) @ Clear(s["a"])


def _move_matrix() -> tuple[LinearOperator, LinearOperator]:
    # [[O, O], [I, O]] = S_{a->b} + K_a + K_b - 2 I
    s = _space()
    return Move(s["a"], s["b"]), Add(s["a"], s["b"]) + Clear(s["a"]) + Clear(s["b"]) - 2 * Identity(s)


def _move_as_copy() -> tuple[LinearOperator, LinearOperator]:
    s = _space()
    return Move(s["a"], s["b"]), Clear(s["a"]) @ Copy(s["a"], s["b"])


def _move_new_definition() -> tuple[LinearOperator, LinearOperator]:
    small = _without_b()
    grown = small.with_block(_new_b())
    return (
        Move(small["a"], _new_b()),
        Deallocate(grown, "a") @ Add(grown["a"], grown["b"]) @ Allocate(small, _new_b()),
    )


def _move_new_as_copy() -> tuple[LinearOperator, LinearOperator]:
    small = _without_b()
    copy = Copy(small["a"], _new_b())
    return Move(small["a"], _new_b()), Deallocate(copy.range, "a") @ copy


def _relabel_back() -> tuple[LinearOperator, LinearOperator]:
    move = _move_new()
    return move.H @ move, Identity(move.domain)


def _relabel_forth() -> tuple[LinearOperator, LinearOperator]:
    move = _move_new()
    return move @ move.H, Identity(move.range)


def _allocate_then_drop() -> tuple[LinearOperator, LinearOperator]:
    allocate = Allocate(_without_b(), _new_b())
    return Deallocate(allocate.range, "b") @ allocate, Identity(_without_b())


def _drop_then_allocate() -> tuple[LinearOperator, LinearOperator]:
    s = _space()
    drop = Deallocate(s, "b")
    return Allocate(drop.range, _new_b()) @ drop, Clear(s["b"])


def _clear_idempotent() -> tuple[LinearOperator, LinearOperator]:
    s = _space()
    return Clear(s["b"]) @ Clear(s["b"]), Clear(s["b"])


def _composition() -> LinearOperator:
    s = _space()
    return Add(s["b"], s["a"]) @ Copy(s["a"], s["b"]) @ Clear(s["c"])


def _sum() -> LinearOperator:
    s = _space()
    return Copy(s["a"], s["b"]) + Move(s["b"], s["a"]) + Clear(s["c"])


def _scaled() -> LinearOperator:
    s = _space()
    return (2 - 3j) * Copy(s["a"], s["b"]) + 0.5 * Add(s["b"], s["a"])


def _boxes() -> Space:
    return Space([Block("a", (3, 4)), Block("b", (2, 5), 1)])


ENTRIES: list[Entry] = [
    # -- the four primitives -----------------------------------------------------------------
    adjoint_entry(
        "allocate-adjoint", SECTION, "A_b* = D_b", lambda: Allocate(_without_b(), _new_b()), size_free=True
    ),
    adjoint_entry(
        "deallocate-adjoint", SECTION, "D_b* = A_b", lambda: Deallocate(_space(), "b"), size_free=True
    ),
    adjoint_entry("clear-adjoint", SECTION, "K_b* = K_b", lambda: Clear(_space()["b"]), size_free=True),
    adjoint_entry(
        "clear-box-adjoint", SECTION, "K_b* = K_b on a box x_b", lambda: Clear(_boxes()["a"][1:, 1:3])
    ),
    adjoint_entry(
        "add-adjoint",
        SECTION,
        "S_{a->b}* = S_{b->a}",
        lambda: Add(_space()["a"], _space()["b"]),
        size_free=True,
    ),
    adjoint_entry(
        "add-box-adjoint",
        SECTION,
        "S_{a->b}* = S_{b->a} between boxes of two blocks",
        lambda: Add(_boxes()["a"][0:2, 1:4], _boxes()["b"][:, 2:]),
    ),
    adjoint_entry(
        "add-within-block-adjoint",
        SECTION,
        "S_{a->b}* = S_{b->a} between disjoint boxes of one block",
        lambda: Add(_boxes()["a"][0, :2], _boxes()["a"][2, 2:]),
    ),
    equal_entry("allocate-then-drop", SECTION, "D_b A_b = I", _allocate_then_drop, size_free=True),
    equal_entry("drop-then-allocate", SECTION, "A_b D_b = K_b", _drop_then_allocate, size_free=True),
    equal_entry("clear-idempotent", SECTION, "K_b K_b = K_b", _clear_idempotent, size_free=True),
    # -- copy ----------------------------------------------------------------------------------
    equal_entry(
        "copy-inplace-definition", SECTION, "C_{a->b} = S_{a->b} K_b", _copy_definition, size_free=True
    ),
    equal_entry("copy-inplace-matrix", SECTION, "C_{a->b} = [[I, O], [I, O]]", _copy_matrix, size_free=True),
    adjoint_entry(
        "copy-inplace-adjoint", SECTION, "C_{a->b}* is the adjoint of C_{a->b}", _copy, size_free=True
    ),
    equal_entry(
        "copy-inplace-adjoint-form",
        SECTION,
        "C_{a->b}* = K_b S_{b->a}: x_a += x_b, x_b <- 0",
        _copy_adjoint_form,
        size_free=True,
    ),
    adjoint_entry(
        "copy-box-adjoint",
        SECTION,
        "C_{a->b}* = K_b S_{b->a} between boxes",
        lambda: Copy(_boxes()["b"][:, 1:3], _boxes()["a"][1:, :2]),
    ),
    equal_entry(
        "copy-outofplace-definition",
        SECTION,
        "C_{a->b} = S_{a->b} A_b (out of place)",
        _copy_new_definition,
        size_free=True,
    ),
    adjoint_entry(
        "copy-outofplace-adjoint",
        SECTION,
        "C_{a->b}* is the adjoint of C_{a->b} (out of place)",
        _copy_new,
        size_free=True,
    ),
    equal_entry(
        "copy-outofplace-adjoint-form",
        SECTION,
        "C_{a->b}* = D_b S_{b->a} (out of place): x_a + x_b, x_b dropped",
        _copy_new_adjoint_form,
        size_free=True,
    ),
    adjoint_entry(
        "copy-box-outofplace-adjoint",
        SECTION,
        "C_{a->b}* = D_b S_{b->a} from a box into a new block",
        lambda: Copy(_boxes()["a"][1:3, 2], "n"),
    ),
    # -- move ------------------------------------------------------------------------------------
    equal_entry(
        "move-inplace-definition", SECTION, "M_{a->b} = K_a S_{a->b} K_b", _move_definition, size_free=True
    ),
    equal_entry("move-inplace-matrix", SECTION, "M_{a->b} = [[O, O], [I, O]]", _move_matrix, size_free=True),
    equal_entry("move-as-copy-then-clear", SECTION, "M_{a->b} = K_a C_{a->b}", _move_as_copy, size_free=True),
    adjoint_entry("move-inplace-adjoint", SECTION, "M_{a->b}* = M_{b->a}", _move, size_free=True),
    equal_entry(
        "move-inplace-adjoint-form",
        SECTION,
        "M_{a->b}* = K_b S_{b->a} K_a = M_{b->a}",
        _move_adjoint_form,
        size_free=True,
    ),
    adjoint_entry(
        "move-box-adjoint",
        SECTION,
        "M_{a->b}* = M_{b->a} between boxes",
        lambda: Move(_boxes()["a"][:2, :2], _boxes()["b"][:, 3:]),
    ),
    equal_entry(
        "move-outofplace-definition",
        SECTION,
        "M_{a->b} = D_a S_{a->b} A_b (out of place)",
        _move_new_definition,
        size_free=True,
    ),
    equal_entry(
        "move-outofplace-as-copy-then-drop",
        SECTION,
        "M_{a->b} = D_a C_{a->b} (out of place)",
        _move_new_as_copy,
        size_free=True,
    ),
    adjoint_entry(
        "move-outofplace-adjoint", SECTION, "M_{a->b}* = M_{b->a} (out of place)", _move_new, size_free=True
    ),
    equal_entry(
        "move-outofplace-relabel-back",
        SECTION,
        "M_{a->b}* M_{a->b} = I (a relabelling)",
        _relabel_back,
        size_free=True,
    ),
    equal_entry(
        "move-outofplace-relabel-forth",
        SECTION,
        "M_{a->b} M_{a->b}* = I (a relabelling)",
        _relabel_forth,
        size_free=True,
    ),
    # -- the algebra of adjoints -----------------------------------------------------------------
    adjoint_entry("composition-adjoint", SECTION, "(F G)* = G* F*", _composition, size_free=True),
    adjoint_entry("sum-adjoint", SECTION, "(F + G)* = F* + G*", _sum, size_free=True),
    adjoint_entry("scaled-adjoint", SECTION, "(alpha F)* = conj(alpha) F*", _scaled, size_free=True),
]
