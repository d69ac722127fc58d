"""Halo geometry: the formulas of docs/theory.md#halo-geometry, kernels, boundary modes and typed errors."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import Phase, find, given, settings

from linop import LinopError
from linop.halo_geometry import (
    BOUNDARY_MODES,
    DimGeometry,
    HaloError,
    Kernel,
    KernelError,
    halo_geometry,
    output_length,
    source_index,
)
from linop.partition import DistributedTensor, Partition, balanced_sizes
from verify.strategies_halo import halo_cases

NUMPY_MODE = {"zero": "constant", "periodic": "wrap", "reflect": "reflect", "symmetric": "symmetric"}


def tensor(shape, grid, sizes=()):
    return DistributedTensor("x", shape, Partition(grid), sizes)


# -- the rows of a small case, worked out by hand --------------------------------------------
def test_two_workers_kernel3_padding1_rows():
    geometry = halo_geometry(tensor((10,), (2,)), Kernel(3, padding=1))
    left, right = geometry.rows[0]
    assert (left.output_start, left.output_stop, left.need_start, left.need_stop) == (0, 5, -1, 6)
    assert (left.left_pad, left.left_halo, left.right_halo, left.right_pad) == (1, 0, 1, 0)
    assert (right.need_start, right.need_stop) == (4, 11)
    assert (right.left_pad, right.left_halo, right.right_halo, right.right_pad) == (0, 1, 0, 1)
    assert left.local_size == right.local_size == 7 and left.window_size == 7


def test_stride_and_trims():
    # 12 inputs over 3 workers, kernel 2 stride 4: outputs (0,4,8) -> 3 outputs, one per worker;
    # each reads 2 entries of its 4-entry bulk, so the rest is trimmed.
    geometry = halo_geometry(tensor((12,), (3,)), Kernel(2, stride=4))
    assert geometry.output_shape == (3,)
    for g, row in enumerate(geometry.rows[0]):
        assert (row.need_start, row.need_stop) == (4 * g, 4 * g + 2)
        assert (row.left_halo, row.right_halo, row.left_trim, row.right_trim) == (0, 0, 0, 2)
        assert row.window_size == 2 and row.window == slice(0, 2)


def test_worker_without_output():
    # 5 inputs, kernel 5: one output, owned by worker 0 of 3; the others get empty windows.
    geometry = halo_geometry(tensor((5,), (3,)), Kernel(5))
    rows = geometry.rows[0]
    assert [r.has_output for r in rows] == [True, False, False]
    assert (rows[0].left_halo, rows[0].right_halo) == (0, 3)
    for r in rows[1:]:
        assert (r.left_halo, r.right_halo, r.left_pad, r.right_pad) == (0, 0, 0, 0)
        assert r.window_size == 0 and r.right_trim == r.bulk_size
    assert geometry.window_shape((2,)) == (0,)


def test_needed_range_that_misses_the_bulk():
    """Shares (1, 2, 9) of 12, kernel 3: worker 1 owns [1, 3) but needs [4, 9). Its right halo
    spans [3, 9) and its left trim [1, 4), so only the window's 5 entries are exchanged."""
    geometry = halo_geometry(tensor((12,), (3,), ((1, 2, 9),)), Kernel(3))
    row = geometry.rows[0][1]
    assert (row.need_start, row.need_stop, row.right_halo, row.left_trim) == (4, 9, 6, 3)
    assert row.local_size == 8 and row.window_size == 5
    assert sum(segment.size for segment in geometry.fills[0][1]) == 5


def test_multi_hop_halo_is_wider_than_the_neighbour():
    geometry = halo_geometry(tensor((8,), (3,), ((6, 1, 1),)), Kernel(5, padding=2))
    last = geometry.rows[0][2]
    assert last.left_halo > geometry.rows[0][1].bulk_size
    owners = {segment.owner for segment in geometry.fills[0][2]}
    assert owners == {0, 1}


def test_leading_dimensions_act_as_kernel_one():
    kernel = Kernel(3, stride=2, padding=1, leading=2).resolve(4)
    assert kernel.size == (1, 1, 3, 3) and kernel.stride == (1, 1, 2, 2) and kernel.padding == (0, 0, 1, 1)
    assert kernel.resolve(4) == kernel
    geometry = halo_geometry(tensor((2, 3, 8, 8), (2, 1, 2, 2)), Kernel(3, padding=1, leading=2))
    for dim in (0, 1):
        for row in geometry.rows[dim]:
            assert (row.left_halo, row.right_halo, row.left_pad, row.right_pad) == (0, 0, 0, 0)


def test_table_is_printable():
    geometry = halo_geometry(tensor((10, 7), (2, 2)), Kernel(3, padding=1))
    text = str(geometry)
    lines = text.splitlines()
    assert "halo" in lines[1] and "trim" in lines[1]
    assert len(lines) == 2 + 4 * 2
    assert "[-1,6)" in text


# -- the formulas, for random cases -----------------------------------------------------------
@settings(max_examples=80, deadline=None)
@given(halo_cases())
def test_rows_follow_the_formulas(case):
    t, kernel = case
    geometry = halo_geometry(t, kernel)
    k = geometry.kernel
    for dim, rows in enumerate(geometry.rows):
        m = t.global_shape[dim]
        n = output_length(m, k.size[dim], k.stride[dim], k.padding[dim], k.dilation[dim])
        assert geometry.output_shape[dim] == n
        assert tuple(r.output_stop - r.output_start for r in rows) == balanced_sizes(n, len(rows))
        for r in rows:
            assert r.bulk_stop - r.bulk_start == t.sizes[dim][r.index]
            if r.has_output:
                s, p = k.stride[dim], k.padding[dim]
                assert r.need_start == r.output_start * s - p
                assert r.need_stop == (r.output_stop - 1) * s - p + k.extent(dim)
                assert r.left_halo == max(0, r.bulk_start - max(r.need_start, 0))
                assert r.right_halo == max(0, min(r.need_stop, m) - r.bulk_stop)
            else:
                assert r.window_size == 0 and r.left_halo == r.right_halo == 0
            assert r.left_pad == max(0, -r.need_start) and r.right_pad == max(0, r.need_stop - m)
            assert r.left_trim == max(0, r.need_start - r.bulk_start)
            assert r.right_trim == max(0, r.bulk_stop - r.need_stop)
            layout = r.left_pad + r.left_halo + r.bulk_size + r.right_halo + r.right_pad
            if (r.need_start <= r.bulk_stop and r.bulk_start <= r.need_stop) or not r.has_output:
                assert r.local_size == layout
            assert r.window_size == r.local_size - r.left_trim - r.right_trim
            assert r.local_size >= max(r.bulk_size, r.window_size)


@settings(max_examples=60, deadline=None)
@given(halo_cases())
def test_fill_segments_read_the_wrapped_owner(case):
    """Every window entry outside the bulk that holds data is filled exactly once, from the
    owner of the global entry that the boundary mode maps it to."""
    t, kernel = case
    geometry = halo_geometry(t, kernel)
    for dim, rows in enumerate(geometry.rows):
        mode = geometry.kernel.boundary[dim]
        for g, row in enumerate(rows):
            filled = {}
            for seg in geometry.fills[dim][g]:
                owner = rows[seg.owner]
                for i in range(seg.size):
                    position = seg.dst_start + i
                    assert position not in filled
                    filled[position] = owner.local_start + seg.src_start + i
                    assert owner.bulk_start <= filled[position] < owner.bulk_stop
            expected = {}
            if row.has_output:
                for x in range(row.need_start, row.need_stop):
                    source = source_index(x, row.length, mode)
                    if not row.bulk_start <= x < row.bulk_stop and source is not None:
                        expected[x - row.local_start] = source
            assert filled == expected


@pytest.mark.parametrize("ndim", [1, 2, 3, 4])
@pytest.mark.parametrize(
    ("what", "extreme"),
    [("size", 7), ("size", 1), ("stride", 4), ("dilation", 3), ("padding", 3), ("padding", 0)],
)
def test_cases_reach_the_kernel_ranges_at_every_rank(ndim, what, extreme):
    """The strategy behind the random tests draws the issue's ranges (size 1-7, stride 1-4,
    dilation 1-3, padding 0-3) in tensors of every rank, on grids of 3 workers."""
    t, _ = find(
        halo_cases(min_dims=ndim, max_dims=ndim),
        lambda case: extreme in getattr(case[1], what) and 3 in case[0].partition.shape,
        settings=settings(database=None, max_examples=2000, phases=[Phase.generate]),
        random=random.Random(0),
    )
    assert t.ndim == ndim


# -- boundary modes -----------------------------------------------------------------------------
@pytest.mark.parametrize("mode", BOUNDARY_MODES)
@pytest.mark.parametrize("length", [1, 2, 3, 5])
def test_source_index_matches_numpy_pad(mode, length):
    pad = 2 * length + 3
    padded = np.pad(np.arange(length) + 1, pad, mode=NUMPY_MODE[mode])
    ours = [source_index(x, length, mode) for x in range(-pad, length + pad)]
    assert [0 if s is None else s + 1 for s in ours] == list(padded)


# -- typed errors naming the dimension ----------------------------------------------------------
@pytest.mark.parametrize(
    ("kernel", "match"),
    [
        pytest.param(Kernel((3, 9)), "dimension 1.*extent 9", id="kernel-larger-than-input"),
        pytest.param(Kernel(3, dilation=(1, 4)), "dimension 1.*extent 9", id="dilated-kernel-too-large"),
        pytest.param(Kernel(3, stride=(1, 0)), "stride in dimension 1 is 0", id="stride-below-1"),
        pytest.param(Kernel(3, dilation=(0, 1)), "dilation in dimension 0 is 0", id="dilation-below-1"),
        pytest.param(Kernel(3, padding=(0, -1)), "padding in dimension 1 is -1", id="negative-padding"),
        pytest.param(Kernel(0), "size in dimension 0 is 0", id="size-below-1"),
        pytest.param(Kernel((3, 3, 3)), "size has 3 entries for 2 dimensions", id="list-too-long"),
        pytest.param(Kernel(3, padding=(1,)), "padding has 1 entries for 2 dimensions", id="list-too-short"),
        pytest.param(Kernel(3, boundary="mirror"), "'mirror' in dimension 0", id="unknown-boundary"),
        pytest.param(Kernel(3, leading=3), "3 leading dimensions", id="too-many-leading"),
        pytest.param(Kernel(3.5), "size in dimension 0 must be an integer", id="float-size"),
        pytest.param(
            Kernel(3, stride=(1, 2.0)), "stride in dimension 1 must be an integer", id="float-stride"
        ),
        pytest.param(Kernel(3, padding=None), "padding in dimension 0 must be an integer", id="none-padding"),
        pytest.param(Kernel(3, boundary=None), "None in dimension 0", id="none-boundary"),
        pytest.param(Kernel(3, leading=1.5), "leading dimensions must be an integer", id="float-leading"),
    ],
)
def test_kernel_errors(kernel, match):
    with pytest.raises(KernelError, match=match) as caught:
        halo_geometry(tensor((6, 5), (2, 1)), kernel)
    assert isinstance(caught.value, LinopError) and isinstance(caught.value, ValueError)


@pytest.mark.parametrize(
    ("kernel", "text"),
    [
        pytest.param(Kernel(3), "Kernel(size=3)", id="scalar"),
        pytest.param(Kernel([3, 3], stride=[2, 2]), "Kernel(size=[3, 3], stride=[2, 2])", id="lists"),
        pytest.param(Kernel((3, 3), padding=(0, 0)), "Kernel(size=(3, 3))", id="default-tuple-omitted"),
        pytest.param(Kernel(3, padding=1, leading=2), "Kernel(size=3, padding=1, leading=2)", id="leading"),
        pytest.param(
            Kernel(3, boundary=("zero", "reflect")),
            "Kernel(size=3, boundary=('zero', 'reflect'))",
            id="modes",
        ),
    ],
)
def test_kernel_prints_its_parameters(kernel, text):
    assert str(kernel) == text


@pytest.mark.parametrize(
    ("kernel", "ndim"),
    [
        pytest.param(Kernel((3, 3)), 2, id="size-list"),
        pytest.param(Kernel((3, 3), leading=2), 4, id="leading"),
        pytest.param(Kernel(3, stride=(1, 2, 1)), 3, id="stride-list"),
        pytest.param(Kernel(3, padding=1, leading=2).resolve(4), 4, id="resolved"),
    ],
)
def test_kernel_rank(kernel, ndim):
    assert kernel.ndim == ndim
    assert kernel.resolve(ndim).ndim == ndim


def test_a_kernel_of_scalars_has_no_rank():
    with pytest.raises(KernelError, match="no rank"):
        _ = Kernel(3, padding=1).ndim


def test_padding_makes_a_large_kernel_fit():
    geometry = halo_geometry(tensor((6, 5), (2, 1)), Kernel((3, 9), padding=(0, 2)))
    assert geometry.output_shape == (4, 1)


def test_wrapping_an_empty_dimension_is_an_error():
    with pytest.raises(HaloError, match=r"dimension 0.*periodic"):
        halo_geometry(tensor((0,), (2,)), Kernel(1, padding=1, boundary="periodic"))


def test_zero_padding_an_empty_dimension_gives_zero_windows():
    geometry = halo_geometry(tensor((0,), (2,)), Kernel(3, padding=2))
    assert geometry.output_shape == (2,)
    assert [r.window_size for r in geometry.rows[0]] == [3, 3]


def test_rows_are_frozen_values():
    row = halo_geometry(tensor((4,), (1,)), Kernel(3, padding=1)).rows[0][0]
    assert isinstance(row, DimGeometry)
    with pytest.raises(AttributeError):
        row.left_pad = 3  # type: ignore[misc]


def test_explicit_output_sizes_keep_an_identity_dimension_where_it_is():
    """Channels (1, 4, 1) under a kernel that leaves them alone: balanced outputs (2, 2, 2)
    would need a halo along the channels; explicit output sizes equal to the input's need none."""
    x = tensor((1, 6, 8), (1, 3, 2), ((1,), (1, 4, 1), (5, 3)))
    kernel = Kernel(3, padding=1, leading=2)
    balanced = halo_geometry(x, kernel)
    assert balanced.output_sizes[1] == (2, 2, 2) and balanced.row((0, 0, 0), 1).right_halo == 1
    kept = halo_geometry(x, kernel, output_sizes=(None, (1, 4, 1), None))
    assert kept.output_sizes == ((1,), (1, 4, 1), (4, 4))
    rows = [kept.row((0, c, 0), 1) for c in range(3)]
    assert all(r.left_halo == r.right_halo == r.left_trim == r.right_trim == 0 for r in rows)
    assert [kept.window_shape((0, c, 0))[1] for c in range(3)] == [1, 4, 1]


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        ((None, (2, 2, 1), None), r"dimension 1 sizes \(2, 2, 1\) add up to 5"),
        ((None, (3, 3), None), "dimension 1 has 2 sizes for 3 workers"),
        ((None, (7, -1, 0), None), "negative size"),
        ((None, None), "one entry .* for each of the 3 dimensions"),
        ("abc", "one entry .* for each of the 3 dimensions"),
        ((None, (1.5, 4.5, 0), None), "must be integers"),
    ],
    ids=["sum", "count", "negative", "rank", "string", "floats"],
)
def test_bad_output_sizes_raise_decomposition_errors(sizes, message):
    from linop import DecompositionError

    x = tensor((1, 6, 8), (1, 3, 2))
    with pytest.raises(DecompositionError, match=message):
        halo_geometry(x, Kernel(3, leading=2), output_sizes=sizes)
