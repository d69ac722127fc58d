"""Distributed interpolation (linop.layers.Interpolate) as an operator tree: torch's entries for
the nearest modes, exact rational weights for the linear ones (against an independent hat
formula), exact integer adjoint proofs over uneven partitions, uneven windows that hold what the
outputs read, and controls that catch a wrong adjoint and a wrong halo."""

from __future__ import annotations

import os
from fractions import Fraction

import numpy as np
import pytest

import verify
from linop import DistributedTensor, Partition
from linop.layers import Interpolate, LayerError
from linop.layers import interpolate as interpolate_module
from linop.layers.resample_maps import axis_map, scaled_length

torch = pytest.importorskip("torch", reason="torch is not installed (the torch extra)")

LONG = os.environ.get("LINOP_LONG") == "1"
SCALES = (0.3, 0.5, 0.7, 0.9, 1.1, 1.3, 1.5, 1.7, 2.5, 3.0, 1 / 3, 2 / 3, 4.1, 7 / 3)


def tensor(shape, grid, sizes=None, name="x"):
    if sizes is None:
        return DistributedTensor(name, shape, Partition(grid))
    return DistributedTensor(name, shape, Partition(grid), sizes=sizes)


# (x, keyword arguments) with uneven shares, empty shares, 1-4 workers per dimension
CASES = {
    "1d-linear-x2-corners-empty-share": (
        lambda: tensor((1, 2, 9), (1, 1, 4), ((1,), (2,), (4, 0, 2, 3))),
        dict(scale_factor=2, mode="linear", align_corners=True),
    ),
    "1d-linear-down-to-5": (lambda: tensor((2, 1, 11), (1, 1, 3)), dict(size=5, mode="linear")),
    "1d-nearest-to-20-given-shares": (
        lambda: tensor((1, 1, 9), (1, 1, 4)),
        dict(size=20, mode="nearest", output_sizes=((0, 10, 8, 2),)),
    ),
    "2d-bilinear-x2": (lambda: tensor((2, 2, 7, 6), (1, 2, 3, 2)), dict(scale_factor=2, mode="bilinear")),
    "2d-bilinear-size-corners": (
        lambda: tensor((1, 1, 5, 6), (1, 1, 2, 3), ((1,), (1,), (4, 1), (1, 3, 2))),
        dict(size=(9, 4), mode="bilinear", align_corners=True),
    ),
    "2d-nearest-1.5x0.5": (lambda: tensor((1, 2, 6, 8), (1, 1, 4, 2)), dict(scale_factor=(1.5, 0.5))),
    "2d-batch-partitioned": (
        lambda: tensor((3, 2, 5, 4), (3, 1, 1, 2), ((2, 0, 1), (2,), (5,), (3, 1))),
        dict(scale_factor=2, mode="bilinear", align_corners=True),
    ),
    "3d-trilinear-x2-corners": (
        lambda: tensor((1, 1, 4, 5, 3), (1, 1, 2, 2, 1)),
        dict(scale_factor=2, mode="trilinear", align_corners=True),
    ),
    "3d-nearest-exact": (
        lambda: tensor((1, 1, 4, 5, 3), (1, 1, 2, 1, 2)),
        dict(size=(7, 3, 5), mode="nearest-exact"),
    ),
}


def torch_interpolate(data, kwargs, dtype=torch.float64):
    options = {k: v for k, v in kwargs.items() if k != "output_sizes"}
    return torch.nn.functional.interpolate(torch.from_numpy(data).to(dtype), **options).numpy()


def hat_matrix(m, n, scale_factor, align_corners):
    """Linear interpolation as rationals, written independently of linop: the hat function
    max(0, 1 - |src - i|) around the source coordinate, clamped to [0, m - 1]."""
    matrix = np.full((n, m), Fraction(0), dtype=object)
    for o in range(n):
        if align_corners:
            src = Fraction(o * (m - 1), n - 1) if n > 1 else Fraction(0)
        else:
            scale = 1 / Fraction(scale_factor) if scale_factor else Fraction(m, n)
            src = scale * (o + Fraction(1, 2)) - Fraction(1, 2)
        src = min(max(src, Fraction(0)), Fraction(m - 1))
        for i in range(m):
            matrix[o, i] = max(Fraction(0), 1 - abs(src - i))
    return matrix


def exact_reference(layer, data):
    """D * (W_{d-1} x ... x W_0) x in Python integers, from the hat matrices (or torch's nearest
    entries) of each spatial dimension."""
    result = np.asarray(data, dtype=object)
    for d, axis in enumerate(layer.maps):
        if layer.mode.startswith("nearest"):
            matrix = np.zeros((axis.output_length, axis.input_length), dtype=object)
            matrix[np.arange(axis.output_length), list(axis.first)] = 1
        else:
            m, n = axis.input_length, axis.output_length
            scale = layer.scales[d]
            matrix = hat_matrix(m, n, scale, layer.align_corners)
        result = np.moveaxis(np.tensordot(matrix, np.moveaxis(result, 2 + d, 0), axes=1), 0, 2 + d)
    denominator = int(np.prod(layer.denominators))
    scaled = result * denominator
    assert all(value.denominator == 1 for value in scaled.ravel() if isinstance(value, Fraction))
    return scaled.astype(np.int64)


def build(name):
    factory, kwargs = CASES[name]
    x = factory()
    return x, Interpolate(x, **kwargs), kwargs


# -- the maps against torch and an independent formula ---------------------------------------------
@pytest.mark.parametrize("mode", ["nearest", "nearest-exact"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_nearest_maps_pick_torchs_entries(mode, dtype):
    top_m, top_n = (70, 150) if LONG else (24, 60)
    differ = []
    for m in range(1, top_m):
        cases = [(n, None) for n in range(1, top_n)] + [(scaled_length(m, s), s) for s in SCALES]
        for n, scale in cases:
            if n < 1:
                continue
            data = torch.arange(m, dtype=getattr(torch, np.dtype(dtype).name)).reshape(1, 1, m)
            options = dict(scale_factor=scale) if scale else dict(size=n)
            expected = torch.nn.functional.interpolate(data, mode=mode, **options).reshape(-1).long().tolist()
            if list(axis_map(mode, m, n, scale, False, dtype).first) != expected:
                differ.append((m, n, scale))
    assert not differ, differ[:10]


def test_nearest_maps_depend_on_the_dtype_as_torchs_do():
    """m = 2, n = 82, o = 41: 41 * 2/82 is 1 exactly; torch picks entry 1 for float64 data and
    entry 0 for float32 data (the float32 product is just below 1)."""
    assert axis_map("nearest", 2, 82, None, False, np.float64).first[41] == 1
    assert axis_map("nearest", 2, 82, None, False, np.float32).first[41] == 0
    for dtype, entry in ((torch.float64, 1), (torch.float32, 0)):
        data = torch.arange(2, dtype=dtype).reshape(1, 1, 2)
        assert torch.nn.functional.interpolate(data, size=82)[0, 0, 41] == entry


@pytest.mark.parametrize("align_corners", [False, True], ids=["centres", "corners"])
def test_linear_maps_are_the_hat_weights_exactly(align_corners):
    for m in range(1, 13):
        cases = [(n, None) for n in range(1, 25)]
        cases += [(scaled_length(m, s), s) for s in (0.5, 1.5, 2.0, 2.5, 3.0) if not align_corners]
        for n, scale in cases:
            if n < 1:
                continue
            axis = axis_map("linear", m, n, scale, align_corners)
            mine = np.full((n, m), Fraction(0), dtype=object)
            for o, (i0, i1, lam) in enumerate(zip(axis.first, axis.second, axis.weights)):
                mine[o, i0] += 1 - lam
                mine[o, i1] += lam
            assert (mine == hat_matrix(m, n, scale, align_corners)).all(), (m, n, scale)


# -- the trees ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CASES))
def test_integer_trees_equal_the_exact_reference_and_are_exactly_adjoint(name):
    x, layer, _ = build(name)
    rng = np.random.default_rng(7)
    data = rng.integers(-5, 6, x.global_shape)
    tree, denominator = layer.integer_operator()
    assert denominator == int(np.prod(layer.denominators))
    result = layer.y.gather(tree(x.scatter(data)))
    assert result.dtype.kind == "i"
    assert np.array_equal(result, exact_reference(layer, data))
    proof = verify.exact_adjoint(tree)
    assert proof and proof.exact, proof
    assert verify.exact_adjoint(layer.window_operator)


@pytest.mark.parametrize("name", list(CASES))
def test_float_trees_equal_torch_and_their_integer_twin(name):
    x, layer, kwargs = build(name)
    data = np.random.default_rng(8).standard_normal(x.global_shape)
    result = layer.y.gather(layer.operator(x.scatter(data)))
    assert np.allclose(result, torch_interpolate(data, kwargs), rtol=0, atol=1e-12)
    tree, denominator = layer.integer_operator()
    assert verify.equal(layer.operator, (1 / denominator) * tree)
    assert verify.adjoint_test(layer.operator) and verify.adjoint_test(layer.operator, dtype=np.float32)


def test_output_driven_windows_are_uneven_and_hold_what_is_read():
    """Up-sampling 9 entries by 2 (align_corners) onto 4 workers owning 4, 0, 2, 3 of them:
    each worker's window is the range its 18 / 4 outputs read, not its bulk."""
    x, layer, _ = build("1d-linear-x2-corners-empty-share")
    rows = [layer.geometry.row((0, 0, g), 2) for g in range(4)]
    assert [(r.output_start, r.output_stop) for r in rows] == [(0, 5), (5, 10), (10, 14), (14, 18)]
    assert [(r.bulk_start, r.bulk_stop) for r in rows] == [(0, 4), (4, 4), (4, 6), (6, 9)]
    assert [(r.need_start, r.need_stop) for r in rows] == [(0, 3), (2, 6), (4, 8), (6, 9)]
    assert [(r.left_halo, r.right_halo) for r in rows] == [(0, 0), (2, 2), (0, 2), (0, 0)]
    assert [(r.left_trim, r.right_trim) for r in rows] == [(0, 1), (0, 0), (0, 0), (0, 0)]
    data = np.arange(18).reshape(x.global_shape)
    windows = layer.window_operator(x.scatter(data))
    for g, r in enumerate(rows):
        assert np.array_equal(windows[layer.window_name((0, 0, g))], data[..., r.need_start : r.need_stop])


def test_a_wrong_adjoint_is_caught_exactly():
    """Control: the adjoint kernel with its two weights swapped fails the exact proof."""
    x, _, _ = build("2d-bilinear-x2")
    honest = interpolate_module._kernels

    def swapped(parts, out_shape, window):
        forward, _ = honest(parts, out_shape, window)
        wrong = tuple(type(p)(p.window, p.first, p.second, p.weight_second, p.weight_first) for p in parts)
        return forward, honest(wrong, out_shape, window)[1]

    try:
        interpolate_module._kernels = swapped
        broken, _ = Interpolate(x, scale_factor=2, mode="bilinear").integer_operator()
    finally:
        interpolate_module._kernels = honest
    proof = verify.exact_adjoint(broken)
    assert not proof and proof.count > 0


def test_a_wrong_halo_is_caught_by_the_reference():
    """Control: one worker's window shifted one entry to the right (its halo one entry off)
    reads the wrong entries: still a linear map with its exact adjoint, but the exact
    reference sees it."""
    x, layer, kwargs = build("1d-linear-x2-corners-empty-share")

    class Short(Interpolate):
        def _rows(self):
            rows = [list(r) for r in super()._rows()]
            r = rows[2][1]
            rows[2][1] = interpolate_module.need_row(
                2,
                1,
                r.length,
                (r.output_start, r.output_stop),
                (r.bulk_start, r.bulk_stop),
                (r.need_start + 1, r.need_stop + 1),
            )
            return tuple(tuple(r) for r in rows)

    short = Short(x, **kwargs)  # the same window shapes, one of them one entry off
    data = np.random.default_rng(9).integers(-5, 6, x.global_shape)
    local = layer.local_operator(layer.denominators)
    honest, broken = local @ layer.window_operator, local @ short.window_operator
    assert np.array_equal(layer.y.gather(honest(x.scatter(data))), exact_reference(layer, data))
    assert verify.exact_adjoint(broken)  # still a linear map with its adjoint
    assert not np.array_equal(layer.y.gather(broken(x.scatter(data))), exact_reference(layer, data))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(), "one of size and scale_factor"),
        (dict(size=4, scale_factor=2), "one of size and scale_factor"),
        (dict(size=4, mode="bicubic"), "not one of"),
        (dict(size=4, mode="bilinear"), "interpolates 2 spatial"),
        (dict(size=4, align_corners=True), "align_corners is for the linear modes"),
        (dict(size=(4, 4)), "2 entries for 1 spatial"),
        (dict(scale_factor=0.05), "at least 1 is needed"),
        (dict(scale_factor=-1.0), "must be positive"),
        (dict(size=4, recompute_scale_factor=True), "recompute_scale_factor"),
        (dict(size=4, name="x"), "taken by x's blocks"),
        (dict(size=4, dtype=np.int64), "float32 or float64"),
        (dict(size=4, output_sizes=((3, 3),)), "output_sizes"),
        (dict(size=4, output_sizes=(4,)), "output_sizes"),
    ],
    ids=str,
)
def test_bad_arguments_raise_layer_errors(kwargs, message):
    x = tensor((1, 1, 6), (1, 1, 3))
    with pytest.raises(LayerError, match=message):
        Interpolate(x, **kwargs)


def test_an_irrational_looking_scale_has_no_integer_tree():
    x = tensor((1, 1, 6), (1, 1, 2))
    layer = Interpolate(x, scale_factor=1 / 3 * 7, mode="linear")
    with pytest.raises(LayerError, match="common denominator"):
        layer.integer_operator()
    data = np.random.default_rng(1).standard_normal(x.global_shape)
    expected = torch_interpolate(data, dict(scale_factor=1 / 3 * 7, mode="linear"))
    assert np.allclose(layer.y.gather(layer.operator(x.scatter(data))), expected, rtol=0, atol=1e-12)
