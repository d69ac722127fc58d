"""Reliability at scale (issue 22): building long compositions costs one junction check per
new factor, not one per factor already there. No wall-clock assertion: the tests count the
space comparisons and check the result."""

from __future__ import annotations

import numpy as np
import pytest

import verify
from linop import Block, Composition, SendRecv, Space
from linop.errors import SpaceMismatchError

SPACE = Space(Block(f"x{w}", (4,), w) for w in range(4))
NODES = [SendRecv(SPACE[f"x{w}"][0:1], SPACE[f"x{(w + 1) % 4}"][3:4]) for w in range(4)]


def _chain(count: int):
    op = None
    for i in range(count):
        node = NODES[i % 4]
        op = node if op is None else node @ op
    return op


def test_composing_onto_a_long_composition_checks_one_junction(monkeypatch):
    long = _chain(1000)
    compared = []
    original = Space.__eq__

    def counting(self, other):
        compared.append(1)
        return original(self, other)

    monkeypatch.setattr(Space, "__eq__", counting)
    longer = NODES[0] @ long
    both = long @ long
    assert len(compared) <= 2, f"{len(compared)} space comparisons for two junctions"
    assert len(longer.factors) == 1001 and len(both.factors) == 2000
    assert longer.factors[1:] == long.factors and both.factors[:1000] == long.factors


def test_two_thousand_factors_built_one_at_a_time_are_right():
    op = _chain(2000)
    assert isinstance(op, Composition) and len(op.factors) == 2000
    assert op.factors == tuple(NODES[i % 4] for i in reversed(range(2000)))
    state = {name: np.arange(4) + 10 * i for i, name in enumerate(SPACE.names)}
    by_hand = dict(state)
    for node in reversed(op.factors):  # the rightmost factor acts first
        by_hand = node(by_hand)
    result = op(state)
    assert all(np.array_equal(result[name], by_hand[name]) for name in SPACE.names)
    assert verify.exact_adjoint(_chain(40))  # a shorter one, proven (the proof multiplies matrices)


def test_a_mismatch_deep_in_a_long_composition_is_still_named():
    other = Space([Block("y", (2,))])
    from linop import Identity

    with pytest.raises(SpaceMismatchError, match="cannot compose"):
        Identity(other) @ _chain(50)
    with pytest.raises(SpaceMismatchError, match="cannot compose"):
        _chain(50) @ Identity(other)
