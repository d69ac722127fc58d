"""Transposed broadcasts route as DistDL's ``transpose_src``: checked against DistDL's rule
restated as data (the source's index reversed and flattened in Fortran order over the matched
dimensions, equal to the destination's index flattened in C order over the same dimensions)."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import verify
from linop import Broadcast, DistributedTensor, Partition
from linop.layout import broadcast_map


def _flat(index, shape, order):
    return int(np.ravel_multi_index(tuple(index), tuple(shape), order=order)) if len(shape) else 0


def distdl_routes(source: Partition, destination: Partition) -> dict:
    """DistDL's pairing for transpose_src=True, transpose_dest=False, restated."""
    pad = destination.ndim - source.ndim
    src_shape = np.array((1,) * pad + source.shape[::-1])
    dest_shape = np.array(destination.shape)
    match = np.where(src_shape == dest_shape)[0]
    source_of_flat = {}
    for i in itertools.product(*(range(n) for n in source.shape)):
        cart = np.array((0,) * pad + i[::-1])
        source_of_flat.setdefault(_flat(cart[match], src_shape[match], "F"), []).append(i)
    routes = {}
    for j in itertools.product(*(range(n) for n in destination.shape)):
        (i,) = source_of_flat[_flat(np.array(j)[match], dest_shape[match], "C")]
        routes[j] = i
    return routes


CASES = {
    "issue-2x2x1-to-3x2x2": ((2, 2, 1), (3, 2, 2)),
    "2x3-to-3x2": ((2, 3), (3, 2)),
    "3x1-to-2x1x3": ((3, 1), (2, 1, 3)),
    "1x4-to-4x2": ((1, 4), (4, 2)),
}


@pytest.mark.parametrize(("source", "destination"), CASES.values(), ids=CASES.keys())
def test_routing_is_distdls(source, destination):
    routes = broadcast_map(Partition(source), Partition(destination), transpose=True)
    assert routes == distdl_routes(Partition(source), Partition(destination))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 3), min_size=1, max_size=3), st.data())
def test_routing_is_distdls_on_drawn_partitions(source_shape, data):
    reversed_shape = source_shape[::-1]
    extra = data.draw(st.lists(st.integers(1, 3), max_size=1))
    widened = (n if n > 1 else data.draw(st.integers(1, 3)) for n in reversed_shape)  # 1 broadcasts
    destination = tuple(extra) + tuple(widened)
    source = Partition(tuple(source_shape))
    assert broadcast_map(source, Partition(destination), transpose=True) == distdl_routes(
        source, Partition(destination)
    )


def test_issue_case_is_a_reshape_not_a_transpose():
    """The issue's case: from 2 x 2 x 1 on workers 4..7 to 3 x 2 x 2 on 0..11 (local blocks
    1 x 7 x 5). The transposed broadcast equals a plain broadcast from the reshaped source
    partition (reversed shape, workers in the same C order), exactly; and it differs from
    transposing the grid on half of the copies."""
    source = Partition((2, 2, 1), tuple(range(4, 8)))
    destination = Partition((3, 2, 2), tuple(range(12)))
    x = DistributedTensor("x", (2, 14, 5), source)
    transposed = Broadcast(x, destination, "y", transpose=True)
    routes = broadcast_map(source, destination, transpose=True)
    grid_transpose = {j: i[::-1] for j, i in broadcast_map(Partition((1, 2, 2)), destination).items()}
    assert sum(routes[j] != grid_transpose[j] for j in routes) == 6
    for j in destination.indices():
        copy = transposed.copies.block(j)
        assert copy.shape == x.block(routes[j]).shape
    assert verify.exact_adjoint(transposed)
