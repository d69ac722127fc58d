"""Spaces, blocks and regions: canonical order, states, indexing and their errors."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from linop import Block, BlockExistsError, RegionError, Space, StateError, UnknownBlockError


def test_blocks_are_kept_in_natural_name_order():
    space = Space([("x10", (1,)), ("x2", (2,)), ("a", (3,), 1)])
    assert space.names == ("a", "x2", "x10")
    assert [space.offset(n) for n in space.names] == [0, 3, 5]
    assert space.size == 6


def test_names_with_equal_numbers_have_one_order_whatever_the_construction():
    one, two = Space([("x1", (1,)), ("x01", (2,))]), Space([("x01", (2,)), ("x1", (1,))])
    assert one == two and one.names == two.names == ("x01", "x1")
    grown = Space([("x1", (1,))]).with_block(Block("x01", (2,)))
    assert grown == one and grown.names == one.names and grown.offset("x1") == one.offset("x1")


def test_equality_ignores_construction_order_and_hashes_alike():
    one = Space([("x", (2,)), ("y", (3,), 1)])
    two = Space([Block("y", (3,), worker=1), Block("x", (2,))])
    assert one == two and hash(one) == hash(two)
    assert one != Space([("x", (2,)), ("y", (3,), 2)])


def test_repr_and_str_are_readable():
    space = Space([("x", (2, 3)), ("y", (), 1)])
    assert repr(space) == "Space([Block('x', (2, 3)), Block('y', (), worker=1)])"
    assert str(space) == "{x:2x3@0, y:scalar@1}"


def test_flatten_and_unflatten_round_trip_in_canonical_order():
    space = Space([("b", (2,)), ("a", (2, 2))])
    state = {"a": np.arange(4).reshape(2, 2), "b": np.array([7, 8])}
    vector = space.flatten(state)
    assert vector.tolist() == [0, 1, 2, 3, 7, 8]
    back = space.unflatten(vector)
    assert all(np.array_equal(back[n], state[n]) for n in space.names)


def test_inner_is_conjugate_linear_in_the_first_argument():
    space = Space([("x", (2,)), ("y", (1,))])
    x = {"x": np.array([1j, 2]), "y": np.array([3])}
    y = {"x": np.array([1, 1j]), "y": np.array([1j])}
    assert space.inner(x, y) == np.conj(1j) * 1 + 2 * 1j + 3 * 1j


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.complex128, np.int64])
def test_random_states_have_the_requested_dtype(dtype):
    state = Space([("x", (3, 2)), ("y", (0,))]).random(0, dtype)
    assert all(a.dtype == dtype for a in state.values())
    assert state["y"].shape == (0,)


REGION_CASES = [
    ("whole", (), (0, 0), (4, 6)),
    ("rows", (slice(1, 3),), (1, 0), (3, 6)),
    ("negative", (slice(-2, None), -1), (2, 5), (4, 6)),
    ("int", (2, slice(None)), (2, 0), (3, 6)),
    ("ellipsis", (Ellipsis, slice(0, 2)), (0, 0), (4, 2)),
    ("empty", (slice(3, 3),), (3, 0), (3, 6)),
]


@pytest.mark.parametrize(
    ("key", "start", "stop"), [c[1:] for c in REGION_CASES], ids=[c[0] for c in REGION_CASES]
)
def test_region_indexing_normalizes_to_boxes(key, start, stop):
    region = Space([("x", (4, 6))])["x"][key] if key else Space([("x", (4, 6))])["x"]
    assert (region.start, region.stop) == (start, stop)


def test_integer_indices_drop_their_dimension_like_numpy():
    space = Space([("x", (4, 6))])
    row = space["x"][2]
    assert row.shape == (6,) and repr(row) == "x[2, 0:6]"
    element = row[-1]
    assert element.shape == () and repr(element) == "x[2, 5]"
    block = np.arange(24).reshape(4, 6)
    assert np.array_equal(block[row.index], block[2]) and block[element.index] == block[2, 5]


def test_regions_index_relative_to_themselves():
    region = Space([("x", (10,))])["x"][2:8][1:3]
    assert (region.start, region.stop) == ((3,), (5,))
    assert repr(region) == "x[3:5]"


def test_flat_indices_follow_the_canonical_layout():
    space = Space([("a", (2,)), ("b", (3, 4))])
    region = space["b"][1:3, 2:4]
    expected = 2 + np.arange(12).reshape(3, 4)[1:3, 2:4].ravel()
    assert region.flat_indices().tolist() == expected.tolist()


def test_overlap_detection():
    x = Space([("x", (6, 6)), ("y", (6, 6))])
    assert x["x"][0:3, 0:3].overlaps(x["x"][2:4, 2:4])
    assert not x["x"][0:3].overlaps(x["x"][3:6])
    assert not x["x"].overlaps(x["y"])
    assert not x["x"][2:2].overlaps(x["x"])


ERROR_CASES = [
    ("step", lambda s: s["x"][::2], RegionError, "step 2"),
    ("out of bounds", lambda s: s["x"][0:9], RegionError, "out of bounds for dimension 0 of extent 4"),
    ("index out of bounds", lambda s: s["x"][:, 7], RegionError, "index 7 is out of bounds for dimension 1"),
    ("too many indices", lambda s: s["x"][0, 0, 0], RegionError, "3 indices for 2 dimensions"),
    ("fancy index", lambda s: s["x"][[0, 1]], RegionError, "only integers and slices"),
    ("unknown block", lambda s: s["z"], UnknownBlockError, "unknown block 'z'"),
    ("duplicate block", lambda s: s.with_block(Block("x", (1,))), BlockExistsError, "'x'"),
]


@pytest.mark.parametrize(
    ("make", "error", "text"), [c[1:] for c in ERROR_CASES], ids=[c[0] for c in ERROR_CASES]
)
def test_bad_regions_and_names_raise_typed_errors(make, error, text):
    with pytest.raises(error, match=text.replace("[", r"\[")):
        make(Space([("x", (4, 6))]))


STATE_CASES = [
    ("missing", {}, "missing block 'x'"),
    ("extra", {"x": np.zeros(2), "q": np.zeros(1)}, "block 'q'"),
    ("shape", {"x": np.zeros(3)}, r"block 'x' has shape \(3,\), the space expects \(2,\)"),
]


@pytest.mark.parametrize(("state", "text"), [c[1:] for c in STATE_CASES], ids=[c[0] for c in STATE_CASES])
def test_states_that_do_not_match_raise_state_errors(state, text):
    with pytest.raises(StateError, match=text):
        Space([("x", (2,))]).check_state(state)


@given(
    st.lists(st.sampled_from(["a", "b", "x1", "x01", "x2", "x10", "y", "b2"]), min_size=1, unique=True),
    st.data(),
)
def test_growing_and_shrinking_a_space_equals_building_it(names, data):
    blocks = [Block(n, (i % 3,), i % 2) for i, n in enumerate(names)]
    built = Space(blocks)
    grown = Space()
    for block in blocks:
        grown = grown.with_block(block)
    assert grown == built and grown.names == built.names and hash(grown) == hash(built)
    assert [grown.offset(n) for n in grown.names] == [built.offset(n) for n in built.names]
    dropped = data.draw(st.sampled_from(names))
    assert built.without(dropped) == Space(b for b in blocks if b.name != dropped)
    assert built.without(dropped).names == Space(b for b in blocks if b.name != dropped).names


def test_a_misspelt_block_name_is_named_with_the_block_it_stands_for():
    from linop import Copy

    space = Space([Block("a", (2,)), Block("b", (2,))])
    op = Copy(space["a"], space["b"])
    with pytest.raises(StateError, match=r"missing block 'b' .*the state has 'bb'.*did you mean 'b'\?"):
        op.apply({"a": np.ones(2), "bb": np.ones(2)})
    with pytest.raises(StateError, match=r"has block 'bb' that the space does not hold; did you mean 'b'\?"):
        op.apply({"a": np.ones(2), "b": np.ones(2), "bb": np.ones(2)})
    with pytest.raises(StateError, match=r"missing block 'b' \(missing: \['b'\]\)$"):
        op.apply({"a": np.ones(2)})
    with pytest.raises(StateError) as info:  # no close name: no guess
        op.apply({"a": np.ones(2), "weights": np.ones(2)})
    assert "'weights'" in str(info.value) and "did you mean" not in str(info.value)
