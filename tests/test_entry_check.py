"""The collective entry check without an engine (linop.backends.entry_check): a one-rank
agreement that counts its collectives."""

from __future__ import annotations

from typing import Any

import numpy as np

from linop import Block, Copy, Space
from linop.backends.entry_check import VECTOR_LENGTH, EntryCheck
from linop.program import fingerprint


class CountingAgreement:
    """One rank's agreement (every reduction returns this rank's vector), counting the
    collectives the check makes."""

    request = None

    def __init__(self) -> None:
        self.send = np.zeros(VECTOR_LENGTH, dtype=np.int64)
        self.received = np.zeros(VECTOR_LENGTH, dtype=np.int64)
        self.signature: Any = None
        self.sent = b""
        self.rank = 0
        self.growth: dict[bytes, bool] = {}
        self.minimums = 0

    def reduce(self, timeout: float | None = None, doing: str = "the entry check") -> np.ndarray:
        np.copyto(self.received, self.send)
        return self.received

    def minimum(self, value: int) -> int:
        self.minimums += 1
        return value

    def allgather(self, value: Any) -> list[Any]:
        return [value]


SPACE = Space([Block("a", (3, 4), 0), Block("b", (3, 4), 0)])
OP = 3 * Copy(SPACE["a"][0:1], SPACE["b"][2:3])


def check(agreement: CountingAgreement, state: dict[str, np.ndarray]) -> np.dtype:
    blocks = {b.name: b for b in SPACE}
    return EntryCheck(OP, fingerprint(OP), agreement, blocks, None).run(state).result()


def test_the_growth_agreement_is_made_once_per_tree_and_communicator_not_per_plan():
    """A rank may evict and rebuild a plan that another rank still holds: the rebuilt plan's
    check must not enter the growth collective again (that rank would enter it alone)."""
    agreement = CountingAgreement()
    state = {name: np.ones((3, 4), dtype=np.int16) for name in ("a", "b")}
    first = check(agreement, state)
    assert agreement.minimums == 1  # integer blocks: the growth bound is agreed
    again = check(agreement, state)  # a new plan of the same tree on the same communicator
    assert agreement.minimums == 1, "a rebuilt plan agreed the growth again"
    assert first == again
    other = CountingAgreement()  # another communicator agrees on its own
    check(other, state)
    assert other.minimums == 1


def test_float_blocks_need_no_growth_agreement():
    agreement = CountingAgreement()
    assert check(agreement, {name: np.ones((3, 4)) for name in ("a", "b")}) == np.float64
    assert agreement.minimums == 0
