"""verify.identities: the catalogue is well formed, selectable, and every entry builds."""

from __future__ import annotations

import re

import pytest
from test_docs import theory_anchors

from linop import LinearOperator
from verify import identities
from verify.catalogue import Entry, adjoint_entry, equal_entry


def test_names_are_unique_and_well_formed():
    names = [e.name for e in identities.ENTRIES]
    assert len(names) == len(set(names))
    assert all(re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", n) for n in names)


def test_primitives_and_collectives_are_covered_and_sections_are_theory_anchors():
    assert {"primitives", "distributed-primitives", "collectives"} <= set(identities.sections())
    assert all(e.section in theory_anchors() for e in identities.ENTRIES)  # real sections of docs/theory.md


@pytest.mark.parametrize("entry", identities.ENTRIES, ids=lambda e: e.name)
def test_every_entry_builds_operators_of_its_kind(entry):
    assert isinstance(entry, Entry) and entry.statement
    operators = entry.build()
    assert len(operators) == (1 if entry.kind == "adjoint" else 2)
    assert all(isinstance(op, LinearOperator) for op in operators)


def test_size_free_entries_of_section_one_include_the_table():
    size_free = {e.name for e in identities.ENTRIES if e.size_free is not None}
    for name in ("copy-inplace-adjoint-form", "broadcast-adjoint-is-sum-reduce", "allreduce-self-adjoint"):
        assert name in size_free


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        ("copy-inplace-adjoint", {"copy-inplace-adjoint", "copy-inplace-adjoint-form"}),
        ("copy-inplace-adjoint-f*", {"copy-inplace-adjoint-form"}),
        ("allocate-adjoint,deallocate-adjoint", {"allocate-adjoint", "deallocate-adjoint"}),
    ],
    ids=["substring", "glob", "comma"],
)
def test_select(pattern, expected):
    assert {e.name for e in identities.select(pattern)} == expected


def test_select_a_section_and_everything():
    chosen = identities.select("section:primitives")
    assert chosen and all(e.section == "primitives" for e in chosen)
    assert identities.select(None) == identities.ENTRIES
    assert identities.select("no-such-identity") == ()


def test_get():
    assert identities.get("add-adjoint").statement == "S_{a->b}* = S_{b->a}"
    with pytest.raises(KeyError, match="no identity called"):
        identities.get("nope")


def test_duplicate_names_are_refused():
    with pytest.raises(ValueError, match="defined in both"):
        identities.load(("verify.catalogue_primitives", "verify.catalogue_primitives"))


def test_a_missing_source_is_an_error_not_a_silent_gap():
    with pytest.raises(ModuleNotFoundError):
        identities.load(("verify.catalogue_primitives", "verify.catalogue_that_does_not_exist"))


def test_entry_helpers_attach_size_free_proofs():
    from linop import Block, Copy, Space

    space = Space([Block("a", (2,)), Block("b", (2,))])
    adjoint = adjoint_entry("t", "primitives", "t", lambda: Copy(space["a"], space["b"]), size_free=True)
    assert adjoint.kind == "adjoint" and adjoint.size_free is not None and adjoint.size_free()
    equal = equal_entry("u", "primitives", "u", lambda: (Copy(space["a"], space["b"]),) * 2)
    assert equal.kind == "equal" and equal.size_free is None
