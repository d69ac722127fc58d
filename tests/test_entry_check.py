"""The collective entry check without an engine (linop.backends.entry_check): a one-rank
agreement that counts its collectives."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from linop import Block, Copy, Space
from linop.backends.entry_check import VECTOR_LENGTH, EntryCheck
from linop.backends.entry_check.vector import UNSETTLED
from linop.errors import DistributedDtypeError, DtypeError, IntegerOverflowError
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


# -- the run dtype holds what the local kernels produce (docs/theory.md#dtypes) -----------------


class PeerAgreement(CountingAgreement):
    """Rank 0 of two: each ``allgather`` adds a peer's canned report (what rank 1's kernels
    gave when probed, or its error), counting the gathers."""

    def __init__(self, peer: Any = None) -> None:
        super().__init__()
        self.peer = peer
        self.gathers = 0
        self.fresh_peer = False  # the peer's plan has settled no candidate

    def reduce(self, timeout: float | None = None, doing: str = "the entry check") -> np.ndarray:
        np.copyto(self.received, self.send)
        if self.fresh_peer:
            self.received[UNSETTLED:] = 1
        return self.received

    def allgather(self, value: Any) -> list[Any]:
        self.gathers += 1
        return [value] if self.peer is None else [value, self.peer]


KERNEL_SPACE = Space([Block("a", (2, 3), 0), Block("z", (2, 3), 0)])


def _average(a: np.ndarray) -> np.ndarray:
    return a / 4


def _to_complex(a: np.ndarray) -> np.ndarray:
    return (1 + 2j) * a


def _from_complex(a: np.ndarray) -> np.ndarray:
    return (1 - 2j) * a


def _complex_for_floats(a: np.ndarray) -> np.ndarray:
    """Complex only for inexact input (integers pass as they are): the run widens twice."""
    return a.copy() if a.dtype.kind in "iu" else a * np.complex128(1)


def _kernel_tree(kind: str) -> Any:
    """A tree on worker 0 (``a`` -> ``b``, then ``b`` -> ``c`` for the two-step case)."""
    from linop import local_operator

    if kind == "int to float":
        return local_operator(KERNEL_SPACE, "a", ("b", (2, 3)), forward=_average, adjoint=_average)
    if kind == "float to complex":
        return local_operator(KERNEL_SPACE, "a", ("b", (2, 3)), forward=_to_complex, adjoint=_from_complex)
    if kind == "float matrix":
        return local_operator(KERNEL_SPACE, "a", ("b", (2,)), np.full((2, 6), 0.5))
    if kind == "integer matrix":
        return local_operator(KERNEL_SPACE, "a", ("b", (2,)), np.ones((2, 6), dtype=np.int32))
    first = local_operator(KERNEL_SPACE, "a", ("b", (2, 3)), forward=_average, adjoint=_average)
    second = local_operator(
        first.range, "b", ("c", (2, 3)), forward=_complex_for_floats, adjoint=_complex_for_floats
    )
    return second @ first


def _decide(op: Any, agreement: CountingAgreement, state: dict[str, np.ndarray], **kw: Any) -> Any:
    blocks = {b.name: b for b in op.domain}
    return EntryCheck(op, fingerprint(op), agreement, blocks, None, **kw).run(state)


KERNEL_CASES = [
    # kind, input dtype, run dtype, gathers (one per step of the fixed point)
    ("int to float", np.int64, np.float64, 2),
    ("int to float", np.float32, np.float32, 1),  # a / 4 keeps float32
    ("float to complex", np.float64, np.complex128, 2),
    ("float matrix", np.int64, np.float64, 0),  # known from the coefficients: no collective
    ("integer matrix", np.int8, np.int32, 0),
    ("int then complex for floats", np.int64, np.complex128, 3),  # int64 -> float64 -> complex128
]


@pytest.mark.parametrize(
    "kind, given, run, gathers", KERNEL_CASES, ids=[f"{c[0]}-{np.dtype(c[1])}" for c in KERNEL_CASES]
)
def test_the_run_dtype_holds_what_the_kernels_produce(kind, given, run, gathers):
    """The numpy interpreter is the reference: its results' dtype is the agreed run dtype."""
    op = _kernel_tree(kind)
    state = {name: np.ones((2, 3), dtype=given) for name in ("a", "z")}
    agreement = PeerAgreement()
    assert _decide(op, agreement, state).result() == run
    assert agreement.gathers == gathers
    produced = [name for name in op.range.names if name != "z"]
    assert {op(state)[name].dtype for name in produced} == {np.dtype(run)}


class _CountedAverage:
    """``a / 4``, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, a: np.ndarray) -> np.ndarray:
        self.calls += 1
        return a / 4


def test_kernels_are_gathered_once_per_plan_and_dtype_and_run_once_per_node_and_dtype():
    from linop import local_operator

    kernel = _CountedAverage()
    op = local_operator(KERNEL_SPACE, "a", ("b", (2, 3)), forward=kernel, adjoint=kernel)
    agreement = PeerAgreement()
    floats = {name: np.ones((2, 3)) for name in ("a", "z")}
    check = EntryCheck(op, fingerprint(op), agreement, {b.name: b for b in op.domain}, None)
    for _ in range(3):
        assert check.run(floats).result() == np.float64
    assert (agreement.gathers, kernel.calls) == (1, 1)  # float64 probed once: float64 out, settled
    integers = {n: a.astype(np.int64) for n, a in floats.items()}
    assert check.run(integers).result() == np.float64  # (the integer growth bound probes its matrix too)
    assert agreement.gathers == 2  # int64 probed: float64, settled already
    assert set(op._produced_dtypes) == {np.dtype(np.float64), np.dtype(np.int64)}
    assert check.run(integers).result() == np.float64 and agreement.gathers == 2
    calls = kernel.calls
    assert _decide(op, agreement, floats).result() == np.float64  # a rebuilt plan asks its peers again
    assert (agreement.gathers, kernel.calls) == (3, calls)  # but the node's probe is remembered


def test_a_plan_settled_here_gathers_again_while_a_peer_has_not_settled_the_candidate():
    """A peer that evicted and rebuilt its plan gathers on its next call: so must this rank,
    which learns it from the reduced vector's unsettled flags, not from its own memory."""
    op = _kernel_tree("int to float")
    agreement = PeerAgreement(peer=([], None))
    state = {name: np.ones((2, 3), dtype=np.int64) for name in ("a", "z")}
    check = EntryCheck(op, fingerprint(op), agreement, {b.name: b for b in op.domain}, None)
    assert check.run(state).result() == np.float64
    gathers = agreement.gathers
    assert check.run(state).result() == np.float64 and agreement.gathers == gathers  # all settled
    agreement.fresh_peer = True  # the peer's plan is new: its vector says int64 is unsettled
    assert check.run(state).result() == np.float64
    assert agreement.gathers == gathers + 2  # int64, then float64 (which the peer has not settled either)
    agreement.fresh_peer = False
    assert check.run(state).result() == np.float64 and agreement.gathers == gathers + 2


def test_integers_into_a_complex_kernel_are_refused_as_the_numpy_interpreter_refuses_them():
    op = _kernel_tree("float to complex")
    state = {name: np.ones((2, 3), dtype=np.int16) for name in ("a", "z")}
    with pytest.raises(IntegerOverflowError) as numpy_error:
        op(state)
    with pytest.raises(IntegerOverflowError) as agreed:
        _decide(op, PeerAgreement(), state).result()
    assert str(agreed.value) == str(numpy_error.value)


def test_a_tree_without_kernels_takes_no_gather():
    agreement = PeerAgreement()
    state = {name: np.ones((3, 4), dtype=np.int16) for name in ("a", "b")}
    blocks = {b.name: b for b in SPACE}
    assert EntryCheck(OP, fingerprint(OP), agreement, blocks, None).run(state).result() == np.int16
    assert agreement.gathers == 0


class _RankOneData:
    """A kernel holding rank 1's data only: calling it on rank 0 is a mistake."""

    def __call__(self, a: np.ndarray) -> np.ndarray:
        raise AssertionError("rank 0 ran a kernel of rank 1's worker")


RANK_ONE_KERNEL = _RankOneData()


def test_only_the_rank_running_a_kernel_probes_it_and_every_rank_adopts_its_answer():
    from linop import local_operator

    space = Space([Block("a", (2, 3), 1), Block("z", (2, 3), 0)])
    op = local_operator(space, "a", ("b", (2, 3)), forward=RANK_ONE_KERNEL, adjoint=RANK_ONE_KERNEL)
    state = {"z": np.ones((2, 3), dtype=np.int64)}
    blocks = {"z": space.block("z")}
    agreement = PeerAgreement(peer=([np.dtype(np.float64).str], None))  # rank 1 found float64
    outcome = EntryCheck(op, fingerprint(op), agreement, blocks, None).run(state)
    assert outcome.result() == np.float64
    # under a map that puts worker 1 on rank 0, rank 0 probes it (and here the kernel refuses)
    failing = PeerAgreement(peer=([], None))
    outcome = EntryCheck(op, fingerprint(op), failing, blocks, None, rank_of=lambda worker: 0).run(state)
    with pytest.raises(DistributedDtypeError, match=r"rank 0: local operator L\[a -> b\] failed"):
        outcome.result()


def test_a_probe_failing_on_another_rank_is_every_ranks_typed_error():
    op = _kernel_tree("int to float")
    state = {name: np.ones((2, 3), dtype=np.int64) for name in ("a", "z")}
    agreement = PeerAgreement(peer=([], "rank 1: local operator L[q -> r] failed when run on zeros"))
    outcome = _decide(op, agreement, state)
    with pytest.raises(DistributedDtypeError, match="rank 1: local operator"):
        outcome.result()
    assert isinstance(outcome.error, DtypeError)  # as the numpy interpreter's dtype errors


def test_in_place_integers_a_kernel_makes_floats_are_refused_before_the_run_as_numpy_refuses_them():
    from linop import local_operator
    from linop.errors import DistributedStateError, StateError

    op = local_operator(KERNEL_SPACE, "a", ("a", (2, 3)), forward=_average, adjoint=_average)
    state = {name: np.ones((2, 3), dtype=np.int64) for name in ("a", "z")}
    with pytest.raises(StateError, match="'a'"):
        op.apply({n: v.copy() for n, v in state.items()}, inplace=True)
    check = EntryCheck(op, fingerprint(op), PeerAgreement(), {b.name: b for b in op.domain}, None)
    with pytest.raises(DistributedStateError, match="computes in float64"):
        check.run(state, inplace=True).result()


def test_integers_beyond_the_float_precision_are_refused_when_a_kernel_makes_the_run_float():
    """Blocks a kernel does not touch stay exact int64 in the numpy interpreter, but would
    travel as float64 here: beyond 2**53 they are refused, not rounded."""
    op = _kernel_tree("int to float")
    state = {"a": np.ones((2, 3), dtype=np.int64), "z": np.full((2, 3), 2**53 + 1, dtype=np.int64)}
    assert int(op(state)["z"][0, 0]) == 2**53 + 1
    with pytest.raises(IntegerOverflowError, match=r"exactly below 2\*\*53"):
        _decide(op, PeerAgreement(), state).result()
    state["z"][:] = 2**52
    assert _decide(op, PeerAgreement(), state).result() == np.float64
