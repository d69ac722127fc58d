"""Collective algorithms (linop.algorithms): every variant is exactly its collective, its
adjoint is the reverse algorithm, and the modeled costs reproduce the closed forms.

The proofs are exact (integer sparse matrices). By default a sample of worker counts runs
(small ones, non-powers of two, 8 and 16); ``LINOP_LONG=1`` runs every P = 1 .. 16.
"""

from __future__ import annotations

import os

import pytest

import verify
from linop import Broadcast, Partition, Repartition
from linop.accounting import CostModel, account, account_schedule
from linop.algorithms import COLLECTIVES, VARIANTS, AlgorithmError, fold, problem
from linop.algorithms.allreduce import allreduce_ring, reference
from linop.algorithms.alltoall import alltoall_bruck, alltoall_tensors
from linop.algorithms.broadcast import broadcast_binomial, broadcast_scatter_allgather, reduce_linear
from linop.algorithms.chooser import choose, modeled_times
from linop.algorithms.common import Steps
from linop.algorithms.formulas import FORMULAS, formula_time
from linop.algorithms.gather import allgather_ring
from linop.collectives import BlockGrid
from linop.partition import DistributedTensor

LONG = os.environ.get("LINOP_LONG") == "1"
ALL_SIZES = tuple(range(1, 17))
# light variants: a spread of sizes; heavy ones (P^2 messages or many chunks) fewer
LIGHT = ALL_SIZES if LONG else (1, 2, 3, 5, 8, 16)
HEAVY = ALL_SIZES if LONG else (1, 3, 6, 8)
HEAVY_VARIANTS = {
    ("allreduce", "ring"),
    ("broadcast", "scatter_allgather"),
    ("reduce", "reduce_scatter_gather"),
}


def _unequal_shares(size: int) -> tuple[int, ...]:
    """Shares 0, 3, 2, 1, 0, 3, ...: unequal, with empty ones (the first is always empty)."""
    return tuple((3 * i) % 4 for i in range(size))


def _length(collective: str, size: int) -> int | tuple[int, ...]:
    if collective in ("broadcast", "reduce", "allreduce"):
        return 2 * size + 1  # does not divide evenly into chunks
    return _unequal_shares(size)


def _heavy(collective: str, name: str) -> bool:
    return collective in ("allgather", "reduce_scatter", "alltoall", "alltoall_reverse") or (
        (collective, name) in HEAVY_VARIANTS
    )


def _sizes(collective: str, name: str) -> tuple[int, ...]:
    if collective == "alltoall_reverse" and not LONG:  # the adjoint side: the reverse test covers it
        return (5,)
    return HEAVY if _heavy(collective, name) else LIGHT


CASES = [
    pytest.param(collective, name, size, id=f"{collective}-{name}-P{size}")
    for collective, variants in VARIANTS.items()
    for name in variants
    for size in _sizes(collective, name)
]


def _built(collective: str, name: str, size: int, length=None):
    length = _length(collective, size) if length is None else length
    case = problem(collective, size, length)
    try:
        return case, case.variant(name)
    except AlgorithmError:
        if VARIANTS[collective][name].needs:
            return case, None
        raise


@pytest.mark.parametrize(("collective", "name", "size"), CASES)
def test_every_variant_equals_its_collective(collective, name, size):
    case, op = _built(collective, name, size)
    assert op is not None
    assert verify.equal(op, case.reference)


@pytest.mark.parametrize("size", [3, 4, 6], ids=lambda p: f"P{p}")
@pytest.mark.parametrize("name", ["ring", "rabenseifner", "recursive_doubling"])
def test_all_reduce_with_fewer_entries_than_workers(name, size):
    """Blocks shorter than the worker count: some chunks are empty and are not sent."""
    case = problem("allreduce", size, 2)
    assert verify.equal(case.variant(name), case.reference)


def test_root_outside_the_destination_and_on_another_worker():
    source = BlockGrid("x", Partition((1,), (6,)), ((5,),))
    for root_elsewhere in (source, BlockGrid("x", Partition((1,), (2,)), ((5,),))):
        for name in ("linear", "binomial", "scatter_allgather"):
            case_op = VARIANTS["broadcast"][name].build(root_elsewhere, Partition.grid(4), "y")
            assert verify.equal(case_op, Broadcast(root_elsewhere, Partition.grid(4), "y"))


REVERSE_SIZES = ALL_SIZES if LONG else (3, 4)
REVERSE_CASES = [
    pytest.param(collective, name, size, id=f"{collective}-{name}-P{size}")
    for collective, variants in VARIANTS.items()
    for name in variants
    for size in REVERSE_SIZES
]
ALPHA_ONLY = CostModel(1.0, 0.0, 0.0)
BETA_ONLY = CostModel(0.0, 1.0, 0.0)


@pytest.mark.parametrize(("collective", "name", "size"), REVERSE_CASES)
def test_the_adjoint_is_the_reverse_algorithm(collective, name, size):
    """variant.H equals the reverse variant exactly; as built, both send the same messages and
    bytes, with the same alpha and beta terms on the critical path and the same dependent
    phases. Under MPI both send messages of the same sizes (the interpreter's batching may
    group the derived adjoint's rounds differently)."""
    _, op = _built(collective, name, size)
    other_collective, other_name = VARIANTS[collective][name].reverse
    _, reverse = _built(other_collective, other_name, size)
    assert verify.equal(op.H, reverse)
    mine, theirs = account(op.H), account(reverse)
    assert (mine.total_messages, mine.total_bytes, mine.phases) == (
        theirs.total_messages,
        theirs.total_bytes,
        theirs.phases,
    )
    for model in (ALPHA_ONLY, BETA_ONLY):
        assert mine.critical_path(model).time(model) == theirs.critical_path(model).time(model)
    scheduled, reverse_scheduled = account_schedule(op.H), account_schedule(reverse)
    assert sorted(m.nbytes for m in scheduled.messages) == sorted(
        m.nbytes for m in reverse_scheduled.messages
    )


def test_different_algorithms_of_one_operator_have_different_costs():
    """The binomial broadcast's adjoint equals the linear reduce as an operator, but not in
    cost: the accounting tells the reverse algorithm from another one."""
    source = BlockGrid("x", Partition((1,), (0,)), ((4,),))
    tree, linear = (
        broadcast_binomial(source, Partition.grid(8), "y").H,
        reduce_linear(source, Partition.grid(8), "y"),
    )
    assert verify.equal(tree, linear)
    assert account(tree).critical_path(ALPHA_ONLY).messages == 3
    assert account(linear).critical_path(ALPHA_ONLY).messages == 7


def test_a_wrong_algorithm_is_caught():
    """A ring all-reduce missing one reduce-scatter step is not the all-reduce, and the proof
    names an entry where it differs."""
    layout = BlockGrid.uniform("x", Partition.grid(4), (8,))
    good = allreduce_ring(layout)
    factors = list(good.factors)
    del factors[-2]  # the second reduce-scatter message (factors run last-first)
    steps = Steps(layout.space)
    for f in reversed(factors):
        steps.push(f)
    broken = steps.operator()
    proof = verify.equal(broken, reference(layout))
    assert not proof and "differ" in proof.detail


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: alltoall_bruck(*alltoall_tensors((1, 2, 1), (1, 1, 1))), "row shares"),
        (
            lambda: allgather_ring(DistributedTensor("x", (4, 4), Partition.grid((2, 2))), "g"),
            r"cut along dimensions \[0, 1\]",
        ),
        (
            lambda: broadcast_scatter_allgather(
                BlockGrid("x", Partition((1,)), ((),)), Partition.grid(2), "y"
            ),
            "is a scalar",
        ),
        (lambda: problem("allgather", 3, (1, 2)), "2 shares for 3 workers"),
        (lambda: problem("gossip", 3, 4), "no collective 'gossip'"),
        (lambda: problem(["allgather"], 3, 4), r"no collective \['allgather'\]"),  # was a bare TypeError
        (lambda: problem("allreduce", 3, 4).variant("magic"), "no variant 'magic'"),
        (
            lambda: broadcast_binomial(
                BlockGrid.uniform("x", Partition.grid(2), (3,)), Partition.grid(2), "y"
            ),
            "one block",
        ),
    ],
    ids=[
        "bruck-unequal-rows",
        "gather-2d-cut",
        "scatter-scalar",
        "share-count",
        "unknown-collective",
        "unhashable-collective",
        "unknown-variant",
        "two-roots",
    ],
)
def test_layouts_an_algorithm_cannot_serve_raise_algorithm_error(build, message):
    with pytest.raises(AlgorithmError, match=message):
        build()


def test_bruck_is_left_out_where_it_does_not_apply_but_pairwise_serves():
    x, y = alltoall_tensors((1, 2, 1), (2, 0, 1))
    assert verify.equal(VARIANTS["alltoall"]["pairwise"].build(x, y), Repartition(x, y))


@pytest.mark.parametrize("size", [1, 2, 3, 5, 6, 7, 8, 12, 16], ids=lambda p: f"P{p}")
def test_fold_covers_every_worker_once(size):
    plan = fold(size)
    assert plan.p2 <= size < 2 * plan.p2 and len(plan.participants) == plan.p2
    covered = [r for lo, hi in plan.chunks for r in range(lo, hi)]
    assert covered == list(range(size))


# -- modeled costs ------------------------------------------------------------------------------
MODELS = [CostModel(2e-6, 1e-9, 3e-10), CostModel(5e-5, 2e-10, 0.0)]


@pytest.mark.parametrize("size", [1, 2, 4, 8, 16] if LONG else [1, 2, 8], ids=lambda p: f"P{p}")
@pytest.mark.parametrize("key", FORMULAS)
def test_modeled_costs_reproduce_the_closed_forms_for_powers_of_two(key, size):
    collective, name = key.split("/")
    length = 16 * size  # chunks divide evenly
    op = problem(collective, size, length).variant(name)
    for model in MODELS:
        expected = formula_time(collective, name, size, length * 8, model)
        for how in (account, account_schedule):
            assert how(op).time(model) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_the_survey_formulas_for_all_reduce():
    """The survey's four all-reduce formulas with gamma = 0 (their gamma m is our n bytes)."""
    model, size, n = CostModel(3e-6, 1e-9, 0.0), 8, 1 << 16
    a, b, log = model.alpha, model.beta, 3
    expected = {
        "reduce_broadcast_binomial": 2 * log * (a + n * b),
        "recursive_doubling": log * (a + n * b),
        "ring": 2 * (size - 1) * (a + n / size * b),
        "rabenseifner": 2 * a * log + 2 * n * b * (size - 1) / size,
    }
    case = problem("allreduce", size, n // 8)
    for name, value in expected.items():
        assert account_schedule(case.variant(name)).time(model) == pytest.approx(value, rel=1e-12)


def test_closed_forms_refuse_other_sizes():
    with pytest.raises(AlgorithmError, match="powers of two"):
        formula_time("allreduce", "ring", 6, 64, MODELS[0])


# -- the chooser ---------------------------------------------------------------------------------
LATENCY_BOUND = CostModel(1e-4, 1e-10, 1e-11)
BANDWIDTH_BOUND = CostModel(1e-6, 1e-8, 1e-10)


@pytest.mark.parametrize(
    ("collective", "size", "nbytes", "model", "expected"),
    [
        ("allreduce", 8, 8, LATENCY_BOUND, "recursive_doubling"),
        ("allreduce", 8, 1 << 23, BANDWIDTH_BOUND, "rabenseifner"),
        ("allreduce", 2, 1 << 23, BANDWIDTH_BOUND, "ring"),
        ("broadcast", 8, 8, LATENCY_BOUND, "binomial"),
        ("broadcast", 16, 1 << 23, BANDWIDTH_BOUND, "scatter_allgather"),
        ("allgather", 8, 1 << 20, LATENCY_BOUND, "recursive_doubling"),
        ("alltoall", 16, 64, LATENCY_BOUND, "bruck"),
        ("alltoall", 4, 1 << 22, BANDWIDTH_BOUND, "pairwise"),
    ],
    ids=["ar-small", "ar-large", "ar-two", "bc-small", "bc-large", "ag-latency", "a2a-small", "a2a-large"],
)
def test_the_chooser_picks_the_cheapest_modeled_variant(collective, size, nbytes, model, expected):
    choice = choose(collective, size, nbytes, model)
    times = modeled_times(collective, size, nbytes, model)
    assert choice.variant == expected
    assert choice.time == min(times.values()) == times[expected]
    assert [t for _, t in choice.ranking] == sorted(times.values())
    assert set(times) <= set(VARIANTS[collective])


def test_the_chooser_models_non_powers_of_two_from_the_trees():
    """For P = 6 recursive doubling folds two workers: two more messages on the critical path."""
    model = CostModel(1.0, 0.0, 0.0)
    times = modeled_times("allreduce", 6, 64, model)
    assert times["recursive_doubling"] == 2 + 2  # fold in, two rounds, fold out
    assert times["ring"] == 2 * 5


def test_every_collective_has_variants():
    assert set(COLLECTIVES) >= {"broadcast", "reduce", "allreduce", "allgather", "reduce_scatter", "alltoall"}
