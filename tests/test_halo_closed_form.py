"""Halo fill segments in closed form (``docs/theory.md#halo-geometry``): equal, on many random
cases, to the per-position rule they replace (kept here as the oracle), and O(1) in the padding."""

from __future__ import annotations

import bisect
import itertools
import pickle
import random

import numpy as np
import pytest

from linop import BOUNDARY_MODES, DistributedTensor, Kernel, Partition, halo_geometry
from linop.halo_geometry import Fills, Segment, source_index


def per_position_segments(rows, g, boundary, data):
    """The former computation: one position at a time, merging runs of increasing sources."""
    me = rows[g]
    owners = [h for h, r in enumerate(rows) if r.bulk_size]
    starts = [rows[h].bulk_start for h in owners]
    segments: list[Segment] = []
    outside = itertools.chain(
        range(data.start, min(data.stop, me.bulk.start)), range(max(data.start, me.bulk.stop), data.stop)
    )
    for position in outside:
        source = source_index(position + me.local_start, me.length, boundary)
        if source is None:
            continue
        h = owners[bisect.bisect_right(starts, source) - 1]
        src = source - rows[h].local_start
        if segments:
            last = segments[-1]
            if (
                last.owner == h
                and last.dst_start + last.size == position
                and last.src_start + last.size == src
            ):
                segments[-1] = Segment(last.dst_start, last.size + 1, h, last.src_start)
                continue
        segments.append(Segment(position, 1, h, src))
    return tuple(segments)


def _random_case(rng: random.Random):
    ndim = rng.choice([1, 1, 2])
    shape = tuple(rng.choice([0, 1, 2, 3, 4, 5, 7, 10]) for _ in range(ndim))
    grid = tuple(rng.randint(1, 4) for _ in range(ndim))
    sizes = ()
    if rng.random() < 0.5:  # unbalanced shares, empty ones included
        sizes = []
        for m, p in zip(shape, grid):
            cuts = sorted(rng.randint(0, m) for _ in range(p - 1))
            sizes.append(tuple(b - a for a, b in zip([0, *cuts], [*cuts, m])))
        sizes = tuple(sizes)
    tensor = DistributedTensor("x", shape, Partition(grid), sizes)
    kernel = Kernel(
        tuple(rng.randint(1, 4) for _ in range(ndim)),
        stride=tuple(rng.randint(1, 3) for _ in range(ndim)),
        padding=tuple(rng.choice([0, 1, 2, 5, 13, 40, 97]) for _ in range(ndim)),
        dilation=tuple(rng.randint(1, 2) for _ in range(ndim)),
        boundary=tuple(rng.choice(BOUNDARY_MODES) for _ in range(ndim)),
    )
    return tensor, kernel


def _random_geometries(draw_case, seed: int, cases: int = 1500):
    """``(tensor, kernel, geometry)`` of ``cases`` random cases drawn by ``draw_case`` from a
    generator seeded ``seed``; kernels that do not fit are refused and skipped (other tests
    cover the errors)."""
    rng = random.Random(seed)
    for _ in range(cases):
        tensor, kernel = draw_case(rng)
        try:
            geometry = halo_geometry(tensor, kernel)
        except Exception:
            continue
        yield tensor, kernel, geometry


def test_closed_form_fills_equal_the_per_position_rule_on_random_cases():
    compared = repeated = 0
    for _, _, geometry in _random_geometries(_random_case, 20261201):
        for dim, rows in enumerate(geometry.rows):
            for g in range(len(rows)):
                expected = per_position_segments(
                    rows, g, geometry.kernel.boundary[dim], geometry.data_range(dim, g)
                )
                got = geometry.fills[dim][g]
                assert isinstance(got, Fills)
                assert tuple(got) == expected and got == expected and len(got) == len(expected)
                assert [got[i] for i in range(-len(expected), 0)] == list(expected)
                compared += 1
                repeated += "parts" in repr(got)
    assert compared > 2000 and repeated > 20  # both the explicit and the repeated forms were met


@pytest.mark.parametrize("boundary", ["periodic", "reflect", "symmetric"])
def test_huge_padding_on_a_short_tensor_is_built_without_visiting_each_position(boundary):
    tensor = DistributedTensor("x", (10,), Partition((2,)))
    geometry = halo_geometry(tensor, Kernel(3, padding=10**8, boundary=boundary))  # O(padding) took minutes
    fills = geometry.fills[0][0]
    period = {"periodic": 10, "reflect": 18, "symmetric": 20}[boundary]
    assert len(fills) > 10**8 // period
    # spot checks against the rule, position by position, at the far end of the padding
    last = fills[-1]
    row = geometry.rows[0][0]
    for offset in (0, last.size - 1):
        x = last.dst_start + offset + row.local_start
        source = source_index(x, 10, boundary)
        owner = geometry.rows[0][last.owner]
        assert last.src_start + offset + owner.local_start == source


def test_fills_index_like_a_tuple():
    geometry = halo_geometry(
        DistributedTensor("x", (5,), Partition((2,))), Kernel(3, padding=30, boundary="periodic")
    )
    fills = geometry.fills[0][1]
    as_tuple = tuple(fills)
    assert fills[1:4] == as_tuple[1:4]
    with pytest.raises(IndexError):
        fills[len(as_tuple)]
    assert np.array_equal([s.size for s in fills], [s.size for s in as_tuple])


def _wide_random_case(rng: random.Random):
    """As :func:`_random_case` with more workers per dimension (up to 9), so that a receiver's
    neighbours are a few of many."""
    tensor, kernel = _random_case(rng)
    grid = tuple(rng.randint(1, 9) for _ in range(tensor.ndim))
    shape = tuple(rng.randint(0, 40) for _ in range(tensor.ndim))
    sizes = ()
    if rng.random() < 0.5:
        sizes = tuple(
            tuple(b - a for a, b in zip([0, *cuts], [*cuts, m]))
            for m, p in zip(shape, grid)
            for cuts in [sorted(rng.randint(0, m) for _ in range(p - 1))]
        )
    return DistributedTensor("x", shape, Partition(grid), sizes), kernel


def test_fill_readers_equal_a_scan_of_every_receiver_on_random_cases():
    """``fill_readers`` bisects for candidates; the oracle scans every receiver's fills."""
    compared = with_readers = wrapped = 0
    for tensor, kernel, geometry in _random_geometries(_wide_random_case, 20260424):
        for dim, rows in enumerate(geometry.rows):
            for owner in range(len(rows)):
                expected = [
                    h
                    for h in range(len(rows))
                    if any(s.owner == owner and s.size for s in geometry.fills[dim][h])
                ]
                assert geometry.fill_readers(dim, owner) == expected, (tensor, kernel, dim, owner)
                compared += 1
                with_readers += bool(expected)
                wrapped += bool(expected) and geometry.kernel.boundary[dim] != "zero"
    assert compared > 3000 and with_readers > 1000 and wrapped > 300


def test_the_reader_scan_control_catches_a_missed_reader():
    """Control: dropping the wrapped receivers (the candidates padding before 0) from the
    bisection misses the left edge's reader of the last owner under a periodic boundary."""
    geometry = halo_geometry(
        DistributedTensor("x", (40,), Partition((8,))), Kernel(3, padding=1, boundary="periodic")
    )
    rows = geometry.rows[0]
    assert geometry.fill_readers(0, 7) == [0, 6]
    interior = rows.readers(rows[7].bulk_start, rows[7].bulk_stop, "zero")
    assert 0 not in [h for h in interior if 7 in geometry.fills[0][h].owners()]


def test_described_rows_equal_the_rows_built_one_by_one():
    rng = random.Random(7)
    checked = 0
    for _ in range(300):
        tensor, kernel = _wide_random_case(rng)
        try:
            geometry = halo_geometry(tensor, kernel)
        except Exception:
            continue
        again = halo_geometry(tensor, kernel)
        assert geometry == again and hash(geometry) == hash(again)
        for dim, rows in enumerate(geometry.rows):
            listed = tuple(rows[g] for g in range(len(rows)))
            assert rows == listed and list(rows) == list(listed) and rows[-1] == listed[-1]
            assert all(row.index == g and row.dim == dim for g, row in enumerate(listed))
            for name in ("local_size", "window_size"):
                assert geometry.column(dim, name) == tuple(getattr(r, name) for r in listed)
            assert geometry.output_sizes[dim] == tuple(r.output_stop - r.output_start for r in listed)
            assert pickle.loads(pickle.dumps(rows)) == rows
            with pytest.raises(IndexError):
                rows[len(rows)]
            checked += 1
    assert checked > 200


def test_geometries_of_other_shares_differ_and_fingerprint_apart():
    from linop import HaloExchange
    from linop.program import fingerprint

    balanced = halo_geometry(DistributedTensor("x", (10,), Partition((2,))), Kernel(3, padding=1))
    shifted = halo_geometry(DistributedTensor("x", (10,), Partition((2,)), ((4, 6),)), Kernel(3, padding=1))
    assert balanced.rows[0] != shifted.rows[0] and balanced != shifted
    assert fingerprint(HaloExchange(balanced)) != fingerprint(HaloExchange(shifted))
    assert fingerprint(HaloExchange(balanced)) == fingerprint(
        HaloExchange(halo_geometry(DistributedTensor("x", (10,), Partition((2,))), Kernel(3, padding=1)))
    )
