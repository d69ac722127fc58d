"""Strategies for framework users: st.from_type for linop's types, and property tests of a
framework's backward over random shard layouts by lifting."""

import numpy as np
import pytest
from hypothesis import find, given, settings
from hypothesis import strategies as st

import verify
from linop import Block, DistributedTensor, LinearOperator, Partition, Region, Space
from verify.lift import Lifted, lift
from verify.strategies_frameworks import lifted_cases, shard_sizes, shard_spaces


@pytest.mark.parametrize(
    "node_type",
    [Block, Space, Region, LinearOperator, Partition, DistributedTensor, Lifted],
    ids=lambda t: t.__name__,
)
def test_from_type_draws_valid_instances(node_type):
    @settings(max_examples=10)
    @given(st.from_type(node_type))
    def run(value):
        assert isinstance(value, node_type)
        if isinstance(value, LinearOperator):
            assert verify.exact_adjoint(value)

    run()


@settings(max_examples=30)
@given(shard_sizes(max_total=9, max_ranks=4))
def test_shard_sizes_are_a_split_of_the_total(sizes):
    assert 1 <= len(sizes) <= 4 and all(s >= 0 for s in sizes) and sum(sizes) <= 9


def _all_gather(torch, *, wrong):
    """make(sizes) -> (AllGather.apply, shards, copies). The wrong backward assumes even shards
    (total // ranks rows each), the bug the uneven layouts expose."""

    def make(sizes):
        total, ranks = sum(sizes), len(sizes)
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int).tolist()

        class AllGather(torch.autograd.Function):
            @staticmethod
            def forward(ctx, *shards):
                full = torch.cat(shards)
                return tuple(full.clone() for _ in range(ranks))

            @staticmethod
            def backward(ctx, *grads):
                summed = sum(grads)
                back = []
                for offset, size in zip(offsets, sizes):
                    rows = min(size, total // ranks) if wrong else size
                    piece = torch.zeros(size, dtype=summed.dtype)
                    piece[:rows] = summed[offset : offset + rows]
                    back.append(piece)
                return tuple(back)

        return AllGather.apply, shard_spaces(sizes, "x"), shard_spaces((total,) * ranks, "g")

    return make


def test_a_correct_autograd_function_is_proven_on_every_layout():
    torch = pytest.importorskip("torch", reason="torch is not installed (the torch extra)")

    @settings(max_examples=15)
    @given(lifted_cases(_all_gather(torch, wrong=False), shard_sizes(min_total=1, max_total=7, max_ranks=3)))
    def run(lifted):
        verify.exact_adjoint(lifted).check()

    run()


def test_a_wrong_autograd_function_is_refuted_on_an_uneven_layout():
    torch = pytest.importorskip("torch", reason="torch is not installed (the torch extra)")
    make = _all_gather(torch, wrong=True)
    sizes = find(
        shard_sizes(min_total=1, max_total=7, max_ranks=3),
        lambda s: not verify.exact_adjoint(lift(*make(s), framework="torch")),
        settings=settings(max_examples=200, database=None),
    )
    assert len(set(sizes)) > 1  # even shards pass; the counterexample is uneven
    proof = verify.exact_adjoint(lift(*make(sizes), framework="torch"))
    assert not proof and proof.mismatches[0].row.block.startswith("x")
