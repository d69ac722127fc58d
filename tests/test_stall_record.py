"""The stall diagnosis's words (linop.backends.stall_record.words): a rank with no input blocks
of the tree is named as the one that cannot see a dtype change."""

from __future__ import annotations

from types import SimpleNamespace

from linop.backends.stall_record import NO_INPUTS, CallRecord, words

CALL = SimpleNamespace(rank=0, size=4, plan=SimpleNamespace(op="T[a -> b]"))


def test_a_peer_without_inputs_is_named_as_blind_to_the_dtype_change():
    mine = CallRecord("ab", 3, "checked", "a[0,0] float32 (4, 3)")
    theirs = CallRecord("ab", 3, "bound", NO_INPUTS)
    text = words(CALL, mine, 3, theirs)
    assert "rank 3 has no input blocks of this tree" in text and "one rank alone" not in text, text


def test_this_rank_without_inputs_names_itself():
    mine = CallRecord("ab", 3, "bound", NO_INPUTS)
    theirs = CallRecord("ab", 3, "checked", "a[1,0] float32 (4, 3)")
    assert "rank 0 has no input blocks of this tree" in words(CALL, mine, 1, theirs)


def test_ranks_with_inputs_get_the_advice_to_pass_one_dtype():
    mine = CallRecord("ab", 3, "checked", "a[0,0] float32 (4, 3)")
    theirs = CallRecord("ab", 3, "bound", "a[1,0] float64 (4, 3)")
    text = words(CALL, mine, 1, theirs)
    assert "one rank alone changed its inputs' dtypes" in text and "no input blocks of" not in text, text
