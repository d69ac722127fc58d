"""verify.adjoint_test: the coherence test of docs/theory.md#adjoint-test in every floating dtype."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import verify
from linop import Block, Clear, Copy, LinopError, Move, SendRecv, Space
from verify.numeric import threshold_for

DTYPES = [np.float32, np.float64, np.complex64, np.complex128]


def space() -> Space:
    return Space([Block("x", (3, 4)), Block("y", (3, 4), 1)])


OPERATORS = [
    pytest.param(lambda: Copy(space()["x"], space()["y"]), id="copy"),
    pytest.param(lambda: Move(space()["x"][:, :2], space()["y"][:, 2:]), id="move-boxes"),
    pytest.param(lambda: SendRecv(space()["x"][0], Block("z", (4,), 2)), id="sendrecv-new"),
    pytest.param(lambda: (2 - 1j) * Copy(space()["x"], space()["y"]) + Clear(space()["x"][1:]), id="complex"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("build", OPERATORS)
def test_correct_adjoints_pass_in_every_dtype(build, dtype):
    result = verify.adjoint_test(build(), dtype=dtype)
    assert result, result
    assert result.dtype == np.dtype(dtype)
    assert result.measured < result.threshold or result.measured == 0


def test_threshold_follows_machine_epsilon():
    assert threshold_for(np.float32, 100) == pytest.approx(10 * np.finfo(np.float32).eps * 10)
    assert threshold_for(np.float64, 1) == pytest.approx(10 * np.finfo(np.float64).eps)
    assert threshold_for(np.complex64, 4) == threshold_for(np.float32, 4)
    single = verify.adjoint_test(Copy(space()["x"], space()["y"]), dtype=np.float32)
    double = verify.adjoint_test(Copy(space()["x"], space()["y"]), dtype=np.float64)
    assert single.threshold > 1e6 * double.threshold


def test_float32_runs_in_float32():
    # the error of a float32 run is float32 rounding, not zero and not float64-sized
    result = verify.adjoint_test(
        (0.5 + 0.25j) * Copy(space()["x"], space()["y"]), dtype=np.complex64, trials=5
    )
    assert result
    assert 1e-12 < result.measured < 1e-5


def test_result_is_a_frozen_readable_dataclass():
    result = verify.adjoint_test(Copy(space()["x"], space()["y"]))
    assert dataclasses.is_dataclass(result)
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.passed = False  # type: ignore[misc]
    text = repr(result)
    assert text.startswith("AdjointTestResult(passed: adjoint test of C[x -> y]")
    assert "threshold" in text and "dtype=float64" in text


def test_results_repeat_for_a_seed():
    op = (1 + 1j) * Copy(space()["x"], space()["y"])
    first = verify.adjoint_test(op, rng=7, dtype=np.complex64)
    again = verify.adjoint_test(op, rng=np.random.default_rng(7), dtype=np.complex64)
    assert first.measured == again.measured


@pytest.mark.parametrize("dtype", [np.int64, np.bool_], ids=["int64", "bool"])
def test_non_floating_dtypes_are_refused(dtype):
    with pytest.raises(verify.CheckOptionError, match="floating dtype"):
        verify.adjoint_test(Copy(space()["x"], space()["y"]), dtype=dtype)
    with pytest.raises(verify.CheckOptionError, match="floating dtype"):
        verify.numeric_equal(Copy(space()["x"], space()["y"]), Copy(space()["x"], space()["y"]), dtype=dtype)


def test_trials_must_be_positive():
    with pytest.raises(verify.CheckOptionError, match="trials"):
        verify.adjoint_test(Copy(space()["x"], space()["y"]), trials=0)


def test_trials_beyond_the_most_are_refused():
    """Found by the long fuzz campaign: ``trials=10**30`` ran for ever."""
    from verify.numeric import MAX_TRIALS

    op = Copy(space()["x"], space()["y"])
    for check in (verify.adjoint_test, lambda op, trials: verify.numeric_equal(op, op, trials=trials)):
        with pytest.raises(verify.CheckOptionError, match=f"at most {MAX_TRIALS:,}, not {10**30}"):
            check(op, trials=10**30)


def test_option_errors_are_typed():
    assert issubclass(verify.CheckOptionError, LinopError)
    assert issubclass(verify.CheckOptionError, TypeError) and issubclass(verify.CheckOptionError, ValueError)


def test_empty_spaces_pass():
    empty = Space([Block("e", (0,)), Block("f", (0,))])
    assert verify.adjoint_test(Copy(empty["e"], empty["f"]))


def test_numeric_equal_finds_the_largest_difference():
    s = space()
    good = verify.numeric_equal(Move(s["x"], s["y"]), Clear(s["x"]) @ Copy(s["x"], s["y"]), dtype=np.float32)
    assert good
    bad = verify.numeric_equal(Move(s["x"], s["y"]), Copy(s["x"], s["y"]))
    assert not bad
    assert "largest difference at x[" in bad.detail
