"""The fuzz campaign on the engines' surface (issue 41, item 5): hostile inputs drawn for the
torch.distributed executor and the DTensor bridge on 2 gloo processes, the JAX lowering in x32
and x64 (4 host devices), black-box linearity (local operators, ``verify.exact_adjoint``,
``lift``, ``prove_backward``, ``linearity_problem``), DTensor layouts and ``python -m verify``.

Every call gets a verdict class (:func:`verify.strategies_malformed_engines.classify`):
``ok`` (equal to the numpy interpreter, exactly for integers), ``typed`` (a LinopError with a
message, the same on every rank), ``refuted`` (a failed verdict); never ``FAILED`` (a wrong
answer, a raw exception, silent acceptance of a map that is not linear, a caller's array
changed, ranks that disagree). Launches are bounded by timeouts.

CI runs a few calls of each (about 15 s of CPU in all, most of it importing torch and JAX and
compiling XLA programs); ``LINOP_LONG=1`` runs the long campaign, ``LINOP_FUZZ_SEED=n`` draws
from seed ``n`` instead of hypothesis' derandomized examples, and ``LINOP_FUZZ_LOG=path``
appends every outcome to ``path`` as JSON lines (for the review in docs/reliability.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

from verify.strategies_malformed import Call, FuzzFailure
from verify.strategies_malformed_engines import ENGINE_ENTRY_POINTS, Outcome, campaign, classify

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "fuzz_engines"
LONG = os.environ.get("LINOP_LONG") == "1"
SEED = int(os.environ["LINOP_FUZZ_SEED"]) if os.environ.get("LINOP_FUZZ_SEED") else None
LOG = os.environ.get("LINOP_FUZZ_LOG")
LAUNCH_TIMEOUT = 1800 if LONG else 300
"""Seconds one launch may take (CI: about 5 s of CPU each; generous for a loaded machine)."""

EXAMPLES = {
    "linearity": 1500 if LONG else 60,
    "DTensor layouts": 1500 if LONG else 60,
    "command line": 300 if LONG else 20,
    "torch.distributed": 500 if LONG else 30,
    "JAX": 250 if LONG else 8,
}

KNOWN: list[tuple[str, str, str]] = []
"""Wrong answers found by the campaign in files this change does not own, reported for their
owners (launch, a piece of the description, a piece of the evidence): counted and printed, not
failed; any other failure fails."""


def _known(outcome: dict[str, str]) -> bool:
    return any(
        outcome["launch"] == launch and what in outcome["description"] and why in outcome["evidence"]
        for launch, what, why in KNOWN
    )


def _judge(outcomes: list[dict[str, str]], label: str) -> None:
    """Log, count and print the outcomes; fail on any FAILED that is not :data:`KNOWN`; both a
    success and a refusal must have been drawn (the campaign is neither all junk nor all valid)."""
    if LOG:
        with open(LOG, "a") as log:
            for outcome in outcomes:
                log.write(json.dumps(outcome) + "\n")
    counts = Counter(o["verdict"] for o in outcomes)
    known = [o for o in outcomes if o["verdict"] == "FAILED" and _known(o)]
    failures = [o for o in outcomes if o["verdict"] == "FAILED" and not _known(o)]
    print(f"\n{label}: {len(outcomes)} calls: {dict(sorted(counts.items()))}, {len(known)} known findings")
    assert not failures, "\n".join(
        f"{o['entry']}: {o['description']}\n  {o['evidence']}" for o in failures[:10]
    )
    assert counts["ok"] > 0 and counts["typed"] + counts["refuted"] > 0, counts


def _as_dicts(label: str, outcomes: list[Outcome]) -> list[dict[str, str]]:
    return [{"launch": label, **asdict(o)} for o in outcomes]


@pytest.mark.parametrize("name", sorted(ENGINE_ENTRY_POINTS))
def test_in_process_surfaces_are_exact_typed_or_refuted(name):
    """Linearity, DTensor layouts and the command line, in this process."""
    outcomes = campaign(ENGINE_ENTRY_POINTS[name](), EXAMPLES[name], seed=SEED)
    _judge(_as_dicts(name, outcomes), name)


def _launch(script: str, examples: int, **environment: str) -> list[dict[str, str]]:
    env = dict(os.environ, **environment)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    arguments = [sys.executable, script, str(examples)] + ([str(SEED)] if SEED is not None else [])
    try:
        result = subprocess.run(
            arguments,
            cwd=SCRIPTS,
            env=env,
            capture_output=True,
            text=True,
            timeout=LAUNCH_TIMEOUT,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{script} did not end within {LAUNCH_TIMEOUT} s")
    assert result.returncode == 0, (
        f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    )
    prefix = "OUTCOME "  # tests/fuzz_engines/report.py
    outcomes = [
        json.loads(line[len(prefix) :]) for line in result.stdout.splitlines() if line.startswith(prefix)
    ]
    assert len(outcomes) == examples or (SEED is None and len(outcomes) >= 0.8 * examples), result.stdout[
        -2000:
    ]
    return outcomes


@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_torch_distributed_and_dtensor_on_two_gloo_processes():
    """One launch of 2 processes: the executor and the DTensor bridge with hostile inputs,
    every verdict agreed by both ranks."""
    pytest.importorskip("torch", reason="torch is not installed (the torch extra)")
    outcomes = _launch("group.py", EXAMPLES["torch.distributed"])
    _judge(outcomes, "torch.distributed 2 ranks")


@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
@pytest.mark.parametrize("x64", [False, True], ids=["x32", "x64"])
def test_the_jax_lowering_on_four_host_devices(x64):
    pytest.importorskip("jax", reason="jax is not installed (the jax extra)")
    outcomes = _launch("jax_lowering.py", EXAMPLES["JAX"], JAX_ENABLE_X64="1" if x64 else "0")
    _judge(outcomes, f"JAX {'x64' if x64 else 'x32'}")


# -- the judge and the fixes it found --------------------------------------------------------------
def _raises(error: Exception):
    def call():
        raise error

    return call


@pytest.mark.parametrize(
    ("function", "why"),
    [
        (_raises(IndexError("inside")), "raised IndexError"),
        (_raises(__import__("linop").errors.StateError("")), "empty message"),
        (lambda: type("V", (), {"passed": False, "detail": ""})(), "no detail"),
    ],
    ids=["bare", "typed-without-message", "verdict-without-detail"],
)
def test_classify_catches_what_is_bare(function, why):
    with pytest.raises(FuzzFailure, match=why):
        classify(Call("control", function, why))


def test_the_linearity_campaign_catches_an_accepted_map_that_is_not_linear(monkeypatch):
    """Control: a checker that accepts everything is caught (silent acceptance)."""
    import verify.lift

    monkeypatch.setattr(verify.lift, "linearity_problem", lambda *a, **k: None)
    outcomes = campaign(ENGINE_ENTRY_POINTS["linearity"](), 60)
    assert any(o.verdict == "FAILED" and "was accepted" in o.evidence for o in outcomes)


def test_an_antilinear_map_whose_integer_probe_lies_in_the_kernel_is_refused():
    """Found by the campaign: ``K conj(x)`` with one dyadic row K was proven linear, because the
    complex state ``b + i a`` had ``K a`` small enough to pass at bfloat16's tolerance (the
    images' few significant bits read as bfloat16); the state ``w + i u`` catches it."""
    from verify.lift import LiftError, prove_backward

    matrix = np.array([[-0.5, 0.75, 0.0, 0.25]])
    with pytest.raises(LiftError, match=r"complex state .* antilinear"):
        prove_backward(
            lambda x: matrix @ np.conj(x), {"x": (4,)}, {"y": (1,)}, adjoint=lambda y: matrix.T @ y
        )


@pytest.mark.parametrize(
    "arguments",
    [
        {"mesh_shape": False},
        {"mesh_shape": 3.0},
        {"global_shape": None},
        {"ranks": 2**63},
        {"ranks": None},
        {"sizes": 0.0},
        {"sizes": False},
        {"mesh_shape": b"\x02"},
        {"global_shape": b"\x04\x02"},
        {"mesh_shape": b""},
    ],
    ids=str,
)
def test_a_mesh_layout_of_junk_is_a_placement_error(arguments):
    """Found by the campaign: ``MeshLayout.from_placements`` raised a bare TypeError on a
    number where a sequence belongs, took ``sizes=False`` or ``0.0`` for no sizes, and bytes
    for a shape (``b"\x02"``: a mesh of 2)."""
    from linop.errors import PlacementError
    from linop.mesh_layout import MeshLayout, Shard

    given = {"mesh_shape": (2,), "placements": [Shard(0)], "global_shape": (4, 2), **arguments}
    with pytest.raises(PlacementError):
        MeshLayout.from_placements(
            given["mesh_shape"],
            given["placements"],
            given["global_shape"],
            given.get("sizes"),
            ranks=given.get("ranks", ()),
        )


@pytest.mark.parametrize("name", [None, -(2**63) - 1, np.array(["a", "b"]), ""], ids=repr)
def test_a_local_operator_named_by_junk_is_refused(name):
    """Found by the campaign: ``local_operator(..., name=junk)`` was accepted and printed the
    junk in every message (``local operator None[x -> y]``)."""
    from linop import Block, Space, local_operator
    from linop.errors import LocalOperatorError

    with pytest.raises(LocalOperatorError, match="name must be a non-empty string"):
        local_operator(Space([Block("x", (2,))]), "x", ("y", (2,)), np.eye(2, dtype=int), name=name)


def test_a_local_tensor_of_junk_is_a_placement_error():
    """Found by the campaign: ``redistribute_local(None, ...)`` raised a bare AttributeError on
    that rank alone (its peer waited); now a PlacementError, which goes through the group's
    check (on a group, every rank raises; the 2-process launch above draws such calls)."""
    pytest.importorskip("torch", reason="torch is not installed (the torch extra)")
    from linop.errors import PlacementError
    from linop.frameworks.dtensor import _check_local
    from linop.mesh_layout import MeshLayout, Shard

    layout = MeshLayout.from_placements((2,), [Shard(0)], (4, 2), name="a")
    for junk_value in (None, [1.0, 2.0], "x"):
        with pytest.raises(PlacementError, match="rank 0 holds"):
            _check_local(junk_value, layout, 0)
