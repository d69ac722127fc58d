"""verify.strategies: every strategy draws valid objects and passes hypothesis' health checks.

No health check is suppressed here: a strategy that filters too much or generates too
slowly fails these tests.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import find, given, settings
from hypothesis import strategies as st

import verify
from linop import (
    Add,
    Allocate,
    Block,
    Clear,
    Copy,
    Deallocate,
    LinearOperator,
    Move,
    Region,
    SendRecv,
    Space,
    walk,
)
from verify import strategies as lst

EXAMPLES = settings(max_examples=40, deadline=None)


@EXAMPLES
@given(lst.dtypes())
def test_dtypes_are_floating(dtype):
    assert dtype.kind in "fc"


def test_dtype_options():
    assert find(lst.dtypes(real=False), lambda d: True).kind == "c"
    assert find(lst.dtypes(complex=False, single=False), lambda d: True) == np.dtype(np.float64)


@EXAMPLES
@given(lst.spaces())
def test_spaces_are_valid(space):
    assert isinstance(space, Space) and 1 <= len(space) <= 4
    assert all(b.ndim in (1, 2) and all(n <= 4 for n in b.shape) for b in space.blocks)


@EXAMPLES
@given(lst.spaces(same_shape=True))
def test_same_shape_spaces(space):
    assert len({b.shape for b in space.blocks}) == 1


@EXAMPLES
@given(lst.spaces().flatmap(lambda s: st.tuples(st.just(s), lst.regions(s))))
def test_regions_lie_inside_their_block(pair):
    space, region = pair
    assert isinstance(region, Region) and region.space == space
    assert all(0 <= a <= b <= n for a, b, n in zip(region.start, region.stop, region.block.shape))


@EXAMPLES
@given(lst.spaces().flatmap(lambda s: lst.region_pairs(s)))
def test_region_pairs_are_disjoint_and_of_one_shape(pair):
    src, dst = pair
    assert src.shape == dst.shape
    assert not src.overlaps(dst)
    Add(src, dst)  # accepted by the primitive


@EXAMPLES
@given(lst.spaces(max_workers=4, min_blocks=2).flatmap(lambda s: st.tuples(st.just(s), lst.movements(s))))
def test_movements_have_their_domain(pair):
    space, op = pair
    assert isinstance(op, (Copy, Move, SendRecv)) and op.domain == space


@EXAMPLES
@given(lst.spaces().flatmap(lambda s: st.tuples(st.just(s), lst.primitives(s))))
def test_primitives_have_their_domain(pair):
    space, op = pair
    assert isinstance(op, (Allocate, Deallocate, Clear, Add)) and op.domain == space


@EXAMPLES
@given(lst.spaces().flatmap(lambda s: st.tuples(st.just(s), lst.endomorphisms(s))))
def test_endomorphisms_map_a_space_to_itself(pair):
    space, op = pair
    assert op.domain == space and op.range == space


@EXAMPLES
@given(lst.operators(max_depth=3, max_leaves=5))
def test_operator_trees_are_bounded_and_have_exact_adjoints(op):
    assert isinstance(op, LinearOperator)
    leaves = [n for n in walk(op) if not n.children()]
    assert len(leaves) <= 5
    assert verify.exact_adjoint(op)


@EXAMPLES
@given(lst.operators(whole=True))
def test_whole_block_trees_have_only_whole_regions(op):
    regions = [value for node in walk(op) for value in vars(node).values() if isinstance(value, Region)]
    assert all(region.is_whole for region in regions), [r for r in regions if not r.is_whole]
    assert verify.symbolic.prove_adjoint(op)


def test_operator_trees_reach_every_algebra_node():
    seen: set[str] = set()

    @settings(max_examples=60, deadline=None, derandomize=True)
    @given(lst.operators())
    def collect(op):
        for node in walk(op):
            seen.add(type(node).__name__)
            if isinstance(getattr(node, "alpha", None), complex):
                seen.add("complex scalar")

    collect()
    assert {"Composition", "Sum", "Scaled", "complex scalar", "Add", "Copy", "Move"} <= seen


@EXAMPLES
@given(lst.spaces().flatmap(lambda s: st.tuples(st.just(s), lst.states(s, dtype=lst.dtypes()))))
def test_states_match_their_space(pair):
    space, state = pair
    arrays = space.check_state(state)
    dtypes = {a.dtype for a in arrays.values()}
    assert len(dtypes) == 1 and dtypes.pop().kind in "fc"
    # complex64 may round a magnitude of exactly 1e3 up by an ulp
    assert all(np.isfinite(a).all() and (np.abs(a) <= 1e3 * (1 + 1e-6)).all() for a in arrays.values())


@EXAMPLES
@given(lst.operators(max_leaves=4).flatmap(lambda op: st.tuples(st.just(op), lst.states(op.domain))))
def test_states_feed_operators(pair):
    op, state = pair
    result = op(state)
    op.range.check_state(result)
    assert all(np.isfinite(a).all() for a in result.values())


@pytest.mark.parametrize("module_name", lst.FEATURE_MODULES)
def test_feature_strategies_are_reexported(module_name):
    import importlib

    module = importlib.import_module(module_name)
    for name in module.__all__:
        assert getattr(lst, name) is getattr(module, name)
        assert name in lst.__all__


@pytest.mark.parametrize(
    "leaves, kinds, node_types",
    [
        (lst.primitives, ("add",), (Add,)),
        (lst.primitives, ("allocate", "clear"), (Allocate, Clear)),
        (lst.movements, ("move", "move-new"), (Move,)),
        (lst.movements, ("sendrecv", "sendrecv-new"), (SendRecv,)),
    ],
)
def test_kinds_draw_only_those_leaves(leaves, kinds, node_types):
    @EXAMPLES
    @given(lst.spaces().flatmap(lambda space: leaves(space, kinds=kinds)))
    def drawn(op):
        assert isinstance(op, node_types), op

    drawn()
    with pytest.raises(ValueError, match="unknown kinds"):
        find(lst.spaces().flatmap(lambda space: leaves(space, kinds=("swap",))), lambda op: True)


def test_kinds_a_space_cannot_hold_are_rejected():
    """A space of one 0-d block holds no pair of regions: an Add cannot be drawn on it."""
    from hypothesis.errors import Unsatisfiable

    point = Space([Block("a", ())])
    with pytest.raises(Unsatisfiable):
        find(lst.primitives(point, kinds=("add",)), lambda op: True)


@pytest.mark.parametrize("adjoint", [False, True])
def test_collectives_of_a_kind_and_direction(adjoint):
    from linop import AllGather, Broadcast, ReduceScatter, SumReduce

    expected = {False: (AllGather, Broadcast), True: (ReduceScatter, SumReduce)}[adjoint]

    @EXAMPLES
    @given(lst.collectives(("allgather", "broadcast"), adjoint))
    def drawn(op):
        assert isinstance(op, expected), op

    drawn()
    with pytest.raises(ValueError, match="the kinds are"):
        find(lst.collectives(("gossip",)), lambda op: True)


def test_strategies_are_built_once_per_arguments():
    """A factory called inside draws returns one strategy object per arguments (hypothesis
    validates each new object on its first draw); unhashable arguments still work."""
    assert lst.spaces(max_blocks=3) is lst.spaces(max_blocks=3)
    assert lst.spaces(max_blocks=3) is not lst.spaces(max_blocks=2)
    assert lst.partitions((2, 2)) is lst.partitions((2, 2))
    assert find(lst.partitions([2, 2]), lambda p: True).shape == (2, 2)  # a list: built anew
