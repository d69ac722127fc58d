"""The fuzz campaign: malformed arguments to every public constructor and entry point either
succeed with the sparse interpreter's result or raise a LinopError (verify/strategies_malformed.py).

A CI-sized run (1,000 seeded calls, about 10-20 s) is part of the suite; ``LINOP_LONG=1`` runs
the long one (10,000, states of torch and JAX arrays included). Both print how many inputs were
tried per entry point and their outcomes. The groups of verify/strategies_malformed_surface.py
(local operators, layers, layers with unbalanced channel and feature shares from
verify/strategies_malformed_layers.py, lift / prove_backward, worker maps, the display, the accounting and
the chooser) are part of both; the torch and JAX states have a small seeded run of their own."""

from __future__ import annotations

import os
import time
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings

from verify.strategies_malformed import Call, FuzzFailure, calls, outcome

LONG = os.environ.get("LINOP_LONG") == "1"
EXAMPLES = int(os.environ.get("LINOP_FUZZ_EXAMPLES", 10_000 if LONG else 1_000))


def _table(counts: Counter, seconds: float) -> str:
    entries = sorted({entry for entry, _ in counts})
    lines = [
        f"fuzz campaign: {sum(counts.values())} inputs in {seconds:.1f} s (ok = equal to the sparse "
        "interpreter, typed = LinopError)"
    ]
    for entry in entries:
        ok, typed = counts[(entry, "ok")], counts[(entry, "typed")]
        lines.append(f"  {entry:28s} tried {ok + typed:6d}   ok {ok:6d}   typed {typed:6d}")
    return "\n".join(lines)


# the long campaign runs for minutes (13 on a loaded 2-core machine at nice 19): a runaway
# bound above the suite's 900 s per test, which it crossed there
@pytest.mark.timeout(3600 if LONG else 900)
def test_malformed_calls_succeed_exactly_or_raise_a_linop_error(capsys):
    counts: Counter = Counter()

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=not LONG,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(calls(frameworks=LONG))
    def campaign(call: Call) -> None:
        counts[(call.entry, outcome(call))] += 1

    start = time.perf_counter()
    campaign()
    seconds = time.perf_counter() - start
    with capsys.disabled():
        print("\n" + _table(counts, seconds))
    assert sum(counts.values()) >= 0.9 * EXAMPLES
    outcomes = Counter(result for _, result in counts.elements())
    assert outcomes["ok"] > 0.05 * EXAMPLES and outcomes["typed"] > 0.3 * EXAMPLES  # both outcomes are common


@pytest.mark.parametrize(
    "call",
    [
        Call("deliberately untyped", lambda: [][1], "an IndexError from inside"),
        Call("deliberately wrong", lambda: (_ for _ in ()).throw(ValueError("bare")), "a bare ValueError"),
    ],
    ids=["index-error", "value-error"],
)
def test_the_campaign_catches_an_untyped_error(call):
    with pytest.raises(FuzzFailure, match="raised"):
        outcome(call)


def test_the_campaign_catches_a_wrong_result():
    import numpy as np

    from linop import Identity, Space
    from linop.backends import numpy as numpy_backend

    space = Space([("a", (2,))])
    op = Identity(space)
    wrong = numpy_backend.apply

    def apply_wrongly():
        result = wrong(op, {"a": np.ones(2)})
        result = {"a": result["a"] * 2}
        from verify.strategies_malformed import check_against_matrix

        check_against_matrix(op, {"a": np.ones(2)}, result, None)

    with pytest.raises(FuzzFailure, match="differs from the matrix"):
        outcome(Call("wrong result", apply_wrongly, "doubled identity"))


FRAMEWORK_EXAMPLES = 0 if LONG else 40  # the long campaign draws framework states itself


@pytest.mark.skipif(LONG, reason="LINOP_LONG=1: the main campaign includes framework states")
@pytest.mark.parametrize(
    ("library", "group"),
    [("torch", "torch states"), ("jax", "JAX states"), ("jax", "JAX device executor")],
    ids=["torch-states", "jax-states", "jax-device-executor"],
)
def test_framework_states_succeed_exactly_or_raise_a_linop_error(library, group, capsys):
    """States of torch tensors (requires_grad, non-contiguous, stride 0, float16, bfloat16, int,
    mixed with numpy) and JAX arrays, in place or not; and the JAX device executor (a tree
    compiled for a one-device mesh with a junk mesh, axes or worker map half the time, applied
    to numpy, JAX or junk blocks)."""
    pytest.importorskip(library)
    from verify.strategies_malformed_surface import FRAMEWORK_ENTRY_POINTS

    _side_campaign(FRAMEWORK_ENTRY_POINTS[group](), FRAMEWORK_EXAMPLES, group, capsys)


def _side_campaign(strategy, examples: int, label: str, capsys) -> None:
    """``examples`` calls drawn from ``strategy``: each exact or typed (:func:`outcome`), both
    outcomes seen; the counts printed."""
    counts: Counter = Counter()

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=not LONG,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def campaign(call: Call) -> None:
        counts[outcome(call)] += 1

    campaign()
    with capsys.disabled():
        print(f"\n{label}: {dict(counts)}")
    assert counts["ok"] > 0 and counts["typed"] > 0


def test_the_campaign_catches_a_false_proof():
    """Control of the surface checks: accepting a kernel known not to be linear is a failure."""
    import numpy as np

    from linop import Block, Space, local_operator
    from verify.strategies_malformed_surface import _refused

    space = Space([Block("x", (4,))])
    accepted = _refused(lambda: local_operator(space, "x", ("y", (4,)), np.eye(4, dtype=int)), "affine")
    with pytest.raises(FuzzFailure, match="was accepted"):
        outcome(Call("false proof", accepted, "a linear kernel posing as an affine one"))


@pytest.mark.skipif(LONG, reason="LINOP_LONG=1 runs it with more examples below")
def test_the_torch_distributed_executor_succeeds_exactly_or_raises_a_linop_error(one_process_group, capsys):
    """``torch_distributed.apply`` on a one-process group, both workers mapped onto rank 0,
    with a junk group, mapping or timeout half the time and torch, numpy or junk blocks."""
    _group_campaign(FRAMEWORK_EXAMPLES, capsys)


@pytest.mark.skipif(not LONG, reason="the long campaign: LINOP_LONG=1")
def test_the_torch_distributed_executor_long_campaign(one_process_group, capsys):
    _group_campaign(EXAMPLES // 10, capsys)


def _group_campaign(examples: int, capsys) -> None:
    from verify.strategies_malformed_surface import GROUP_ENTRY_POINTS

    group = "torch.distributed executor"
    _side_campaign(GROUP_ENTRY_POINTS[group](), examples, group, capsys)
