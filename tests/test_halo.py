"""Halo exchange: windows equal the padded global input, exact adjoints, nested == direct, fast
paths equal to their expansions, convolutions per worker equal the global one, typed errors."""

from __future__ import annotations

import itertools
import tracemalloc
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import verify
from linop import Block, Clear, Composition, Copy, LinearOperator, Space, expand_all
from linop.halo import (
    HaloExchange,
    HaloExchangeAdjoint,
    HaloStage,
    HaloStageAdjoint,
    halo_windows,
    local_space,
    pad_shim,
    trim_shim,
    window_space,
)
from linop.halo_geometry import HaloError, Kernel, halo_geometry
from linop.partition import DistributedTensor, Partition
from verify import symbolic
from verify.strategies_halo import halo_cases

NUMPY_MODE = {"zero": "constant", "periodic": "wrap", "reflect": "reflect", "symmetric": "symmetric"}


def padded_global(array: np.ndarray, kernel: Kernel) -> np.ndarray:
    """The global input padded per dimension by the kernel's boundary mode, with numpy.pad."""
    for dim in range(array.ndim):
        widths = [(0, 0)] * array.ndim
        widths[dim] = (kernel.padding[dim], kernel.padding[dim])
        array = np.pad(array, widths, mode=NUMPY_MODE[kernel.boundary[dim]])
    return array


def expected_windows(t: DistributedTensor, kernel: Kernel, array: np.ndarray) -> dict[str, np.ndarray]:
    geometry = halo_geometry(t, kernel)
    k = geometry.kernel
    padded = padded_global(array, k)
    windows = {}
    for index in t.partition.indices():
        rows = geometry.worker_rows(index)
        box = tuple(
            slice(r.need_start + k.padding[d], r.need_stop + k.padding[d]) for d, r in enumerate(rows)
        )
        windows[f"x_window[{','.join(map(str, index))}]"] = padded[box]
    return windows


def global_input(t: DistributedTensor) -> np.ndarray:
    return np.arange(1, 1 + int(np.prod(t.global_shape)), dtype=np.int64).reshape(t.global_shape)


# -- windows ------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["nested", "direct"])
@settings(max_examples=60, deadline=None)
@given(case=halo_cases())
def test_windows_equal_the_padded_global_input(case, variant):
    t, kernel = case
    array = global_input(t)
    windows = halo_windows(t, kernel, variant=variant)(t.scatter(array))
    expected = expected_windows(t, kernel, array)
    assert windows.keys() == expected.keys()
    for name, window in windows.items():
        assert window.shape == expected[name].shape, name
        assert np.array_equal(window, expected[name]), name


@settings(max_examples=30, deadline=None)
@given(case=halo_cases(max_dims=3))
def test_exact_adjoints_and_nested_equals_direct(case):
    t, kernel = case
    geometry = halo_geometry(t, kernel)
    nested, direct = HaloExchange(geometry, "nested"), HaloExchange(geometry, "direct")
    verify.exact_adjoint(nested).check()
    verify.exact_adjoint(direct).check()
    verify.equal(nested, direct).check()
    verify.exact_adjoint(halo_windows(t, kernel)).check()
    verify.equal(halo_windows(t, kernel), halo_windows(t, kernel, variant="direct")).check()


@settings(max_examples=8, deadline=None)
@given(case=halo_cases(min_dims=4, max_dims=4))
def test_exact_adjoint_rank_four(case):
    t, kernel = case
    verify.exact_adjoint(halo_windows(t, kernel, variant="direct")).check()


@pytest.mark.parametrize("mode", ["zero", "periodic", "reflect", "symmetric"])
def test_windows_adjoint_adds_wrapped_entries_back(mode):
    """W* of all-ones windows counts, per global entry, how many window entries read it
    (wrapped and reflected pad entries included)."""
    t = DistributedTensor("x", (5, 4), Partition((2, 2)))
    kernel = halo_geometry(t, Kernel(3, padding=2, boundary=mode)).kernel
    op = halo_windows(t, kernel)
    counts = t.gather(op.H({b.name: np.ones(b.shape, dtype=np.int64) for b in op.range}))
    labels = np.arange(1, 21).reshape(5, 4)  # 0 marks a zero pad entry
    expected = np.zeros(20, dtype=np.int64)
    pad_entries = 0
    for window in expected_windows(t, kernel, labels).values():
        np.add.at(expected, window[window > 0] - 1, 1)
        pad_entries += int((window == 0).sum())
    assert np.array_equal(counts, expected.reshape(5, 4))
    assert counts.sum() + pad_entries == sum(b.size for b in op.range)
    assert (pad_entries == 0) == (mode != "zero")


def test_windows_of_workers_without_output_are_empty():
    t = DistributedTensor("x", (5, 4), Partition((3, 1)))
    op = halo_windows(t, Kernel((5, 1)))
    shapes = {b.name: b.shape for b in op.range}
    assert shapes == {"x_window[0,0]": (5, 4), "x_window[1,0]": (0, 4), "x_window[2,0]": (0, 4)}
    verify.exact_adjoint(op).check()


def test_multi_hop_halo_from_two_workers_away():
    t = DistributedTensor("x", (8,), Partition((3,)), ((6, 1, 1),))
    kernel = Kernel(5, padding=2)
    exchange = HaloExchange(halo_geometry(t, kernel))
    (stage,) = exchange.stages()
    senders = {src.name for src, dst in stage.transfers if dst.name == "x_local[2]"}
    assert senders == {"x_local[0]", "x_local[1]"}
    array = global_input(t)
    windows = halo_windows(t, kernel)(t.scatter(array))
    assert np.array_equal(windows["x_window[2]"], expected_windows(t, kernel, array)["x_window[2]"])


def grid_index(region) -> tuple[int, ...]:
    """The grid index in a local block's name ``x_local[i,j]``."""
    return tuple(int(i) for i in region.name[region.name.index("[") + 1 : -1].split(","))


@pytest.mark.parametrize("variant", ["nested", "direct"])
@pytest.mark.parametrize("boundary", ["zero", "periodic", "reflect"])
def test_multi_hop_corners_in_two_dimensions(variant, boundary):
    """Shares (6, 1, 1) x (1, 1, 6), kernel 5, padding 2: the corner worker's window reaches two
    workers away along both dimensions, so corner entries come from diagonal workers."""
    t = DistributedTensor("x", (8, 8), Partition((3, 3)), ((6, 1, 1), (1, 1, 6)))
    kernel = Kernel(5, padding=2, boundary=boundary)
    exchange = HaloExchange(halo_geometry(t, kernel), variant)
    pairs = {
        (grid_index(src), grid_index(dst)) for stage in exchange.stages() for src, dst in stage.transfers
    }
    diagonal = {(a, b) for a, b in pairs if a[0] != b[0] and a[1] != b[1]}
    if variant == "nested":  # corners in two hops: worker [0,2] -> [2,2] -> [2,0]
        assert diagonal == set() and {((0, 2), (2, 2)), ((2, 2), (2, 0))} <= pairs
    else:  # corners in one message from the worker two away along both dimensions
        assert ((0, 2), (2, 0)) in diagonal
    array = global_input(t)
    windows = halo_windows(t, kernel, variant=variant)(t.scatter(array))
    expected = expected_windows(t, kernel, array)
    assert all(np.array_equal(windows[name], expected[name]) for name in expected)


@settings(max_examples=30, deadline=None)
@given(case=halo_cases(min_dims=2, max_dims=3))
def test_nested_stage_moves_data_along_its_own_dimension_only(case):
    """H_i copies only between workers whose grid indices differ in coordinate i at most:
    corner data reaches a diagonal worker in two hops, relayed by the earlier stage."""
    t, kernel = case
    for stage in HaloExchange(halo_geometry(t, kernel)).stages():
        dim = int(stage.label.removeprefix("H"))
        for src, dst in stage.transfers:
            source, destination = grid_index(src), grid_index(dst)
            assert all(a == b for j, (a, b) in enumerate(zip(source, destination)) if j != dim)


# -- the two-worker case, symbolically ------------------------------------------------------------
def test_two_workers_symbolic_adjoint_adds_the_halo_into_the_neighbour():
    """Six entries over two workers, kernel 3, padding 1: windows [0 x0 x1 x2 x3] and
    [x2 x3 x4 x5 0]. The adjoint adds each halo entry back into its owner's bulk."""
    t = DistributedTensor("x", (6,), Partition((2,)))
    op = halo_windows(t, Kernel(3, padding=1))
    x = symbolic.symbols(op.domain)
    forward = symbolic.apply(op, x)
    a, b = x["x[0]"], x["x[1]"]
    assert list(forward["x_window[0]"]) == [0, a[0], a[1], a[2], b[0]]
    assert list(forward["x_window[1]"]) == [a[2], b[0], b[1], b[2], 0]
    y = symbolic.symbols(op.range)
    back = symbolic.apply(op.H, y)
    u, v = y["x_window[0]"], y["x_window[1]"]
    assert list(back["x[0]"]) == [u[1], u[2], u[3] + v[0]]
    assert list(back["x[1]"]) == [u[4] + v[1], v[2], v[3]]
    assert symbolic.dot_test(op)


def test_exchange_adjoint_on_local_blocks_symbolically():
    t = DistributedTensor("x", (6,), Partition((2,)))
    exchange = HaloExchange(halo_geometry(t, Kernel(3, padding=1)))
    h = symbolic.symbols(exchange.domain)
    back = symbolic.apply(exchange.H, h)
    left, right = h["x_local[0]"], h["x_local[1]"]
    # local blocks: [pad a0 a1 a2 | halo] and [halo | b0 b1 b2 pad]
    assert list(back["x_local[0]"]) == [left[0], left[1], left[2], left[3] + right[0], 0]
    assert list(back["x_local[1]"]) == [0, right[1] + left[4], right[2], right[3], right[4]]


# -- convolution per worker equals the global convolution -------------------------------------------
def correlate(padded: np.ndarray, weights: np.ndarray, stride, dilation, out_shape) -> np.ndarray:
    """Strided, dilated cross-correlation of an already padded array (no padding of its own)."""
    out = np.zeros(out_shape, dtype=np.result_type(padded, weights))
    if 0 in out_shape:
        return out
    for offset in itertools.product(*(range(k) for k in weights.shape)):
        box = tuple(
            slice(o * d, o * d + (n - 1) * s + 1, s)
            for o, d, s, n in zip(offset, dilation, stride, out_shape)
        )
        out += weights[offset] * padded[box]
    return out


def check_convolution(t: DistributedTensor, kernel: Kernel, seed: int = 0) -> None:
    geometry = halo_geometry(t, kernel)
    k = geometry.kernel
    rng = np.random.default_rng(seed)
    array = rng.integers(-9, 10, size=t.global_shape)
    weights = rng.integers(-3, 4, size=k.size)
    expected = correlate(padded_global(array, k), weights, k.stride, k.dilation, geometry.output_shape)
    windows = halo_windows(t, kernel)(t.scatter(array))
    for index in t.partition.indices():
        start, stop = geometry.output_box(index)
        shape = tuple(b - a for a, b in zip(start, stop))
        local = correlate(
            windows[f"x_window[{','.join(map(str, index))}]"], weights, k.stride, k.dilation, shape
        )
        assert np.array_equal(local, expected[tuple(slice(a, b) for a, b in zip(start, stop))]), index


@pytest.mark.parametrize(
    ("shape", "grid", "kernel", "sizes"),
    [
        pytest.param((10, 10), (2, 2), Kernel(3, padding=1), (), id="2x2-10x10-k3-p1"),
        pytest.param((10, 10), (2, 2), Kernel(5, stride=2, padding=2), (), id="2x2-k5-s2-p2"),
        pytest.param(
            (11, 9),
            (3, 2),
            Kernel((3, 2), dilation=(2, 3), padding=(2, 1)),
            ((1, 7, 3), (0, 9)),
            id="unbalanced-dilated",
        ),
        pytest.param(
            (9, 8), (2, 3), Kernel(4, stride=3, padding=3, boundary="periodic"), (), id="periodic-stride3"
        ),
        pytest.param(
            (7, 6),
            (3, 2),
            Kernel(3, padding=2, boundary=("reflect", "symmetric")),
            (),
            id="reflect-symmetric",
        ),
        pytest.param((2, 3, 8, 7), (2, 1, 2, 2), Kernel(3, padding=1, leading=2), (), id="batch-channel-4d"),
    ],
)
def test_convolution_per_worker_equals_global(shape, grid, kernel, sizes):
    check_convolution(DistributedTensor("x", shape, Partition(grid), sizes), kernel)


@settings(max_examples=25, deadline=None)
@given(case=halo_cases(max_dims=3))
def test_convolution_random_cases(case):
    check_convolution(*case)


# -- fast paths equal their expansions; in place without copying the bulk ---------------------------
@settings(max_examples=15, deadline=None)
@given(case=halo_cases(max_dims=2))
def test_stage_fast_paths_equal_their_expansions(case):
    """The numpy and sparse fast paths of the stages equal the expansions into primitives
    (whose adjoints are derived by the primitives' rules)."""
    t, kernel = case
    geometry = halo_geometry(t, kernel)
    for variant in ("nested", "direct"):
        for op in (HaloExchange(geometry, variant), HaloExchangeAdjoint(geometry, variant)):
            state = op.domain.random(1, dtype=np.int64)
            fast = op(state)
            slow = expand_all(op)(state)
            assert all(np.array_equal(fast[n], slow[n]) for n in op.range.names)
            in_place = {n: a.copy() for n, a in state.items()}
            op.apply(in_place, inplace=True)
            assert all(np.array_equal(in_place[n], slow[n]) for n in op.range.names)
            verify.equal(op, expand_all(op)).check()  # the sparse fast paths
        verify.exact_adjoint(expand_all(HaloExchange(geometry, variant))).check()


@pytest.mark.parametrize("variant", ["nested", "direct"])
@settings(max_examples=30, deadline=None)
@given(case=halo_cases())
def test_in_place_exchange_on_the_callers_arrays(case, variant):
    """In place, every stage writes into the caller's local arrays while other workers' copies
    of the same stage read them; the windows still equal numpy.pad of the global input, and
    the in-place adjoint equals the transpose of the exact matrix of the forward exchange."""
    t, kernel = case
    geometry = halo_geometry(t, kernel)
    exchange = HaloExchange(geometry, variant)
    array = global_input(t)
    local = {name: np.array(a) for name, a in pad_shim(geometry)(t.scatter(array)).items()}
    arrays = dict(local)
    assert exchange.apply(local, inplace=True) is local
    assert all(local[name] is arrays[name] for name in arrays)
    windows = trim_shim(geometry)(local)
    expected = expected_windows(t, kernel, array)
    assert all(np.array_equal(windows[name], expected[name]) for name in expected)

    space = exchange.domain
    back = space.random(7, dtype=np.int64)
    transposed = space.unflatten(exchange.to_sparse().T @ space.flatten(back))
    exchange.H.apply(back, inplace=True)
    assert all(np.array_equal(back[name], transposed[name]) for name in space.names)


def test_stage_expansion_has_explicit_buffers():
    t = DistributedTensor("x", (6, 6), Partition((2, 2)))
    exchange = HaloExchange(halo_geometry(t, Kernel(3, padding=1)))
    stage = exchange.stages()[0]
    names = {type(f).__name__ for f in stage.expand().factors}
    assert {"Allocate", "Clear", "Copy", "SendRecv", "Deallocate"} <= names
    assert isinstance(stage.H, HaloStageAdjoint) and stage.H.H == stage
    assert exchange.H.H == exchange


@pytest.mark.parametrize(
    ("variant", "boundary"),
    [("nested", "zero"), ("direct", "zero"), ("nested", "reflect"), ("direct", "periodic")],
)
def test_in_place_exchange_does_not_copy_the_bulk(variant, boundary):
    t = DistributedTensor("x", (512, 512), Partition((2, 2)))
    exchange = HaloExchange(halo_geometry(t, Kernel(3, padding=1, boundary=boundary)), variant)
    adjoint = exchange.H
    state = exchange.domain.random(0)
    arrays = dict(state)
    exchange.apply(state, inplace=True)  # warm up caches (stages, their moves)
    adjoint.apply(state, inplace=True)
    tracemalloc.start()
    exchange.apply(state, inplace=True)
    adjoint.apply(state, inplace=True)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert all(state[n] is arrays[n] for n in arrays)
    assert peak < min(a.nbytes for a in arrays.values()) / 20


# -- shims ----------------------------------------------------------------------------------------
def test_shims_compose_to_the_windows_operator():
    t = DistributedTensor("x", (7, 5), Partition((2, 2)), ((2, 5), (5, 0)))
    kernel = Kernel(3, stride=2, padding=1)
    geometry = halo_geometry(t, kernel)
    embed, trim = pad_shim(geometry), trim_shim(geometry)
    assert embed.domain == t.space and embed.range == local_space(geometry)
    assert trim.domain == local_space(geometry) and trim.range == window_space(geometry)
    verify.equal(trim @ HaloExchange(geometry) @ embed, halo_windows(t, kernel)).check()
    verify.exact_adjoint(embed).check()
    verify.exact_adjoint(trim).check()


def test_a_crop_is_not_the_adjoint():
    """pylops-mpi's halo 'adjoint' only crops; the exact check catches it."""
    t = DistributedTensor("x", (6,), Partition((2,)))
    geometry = halo_geometry(t, Kernel(3, padding=1))
    op = halo_windows(t, Kernel(3, padding=1))
    crop = pad_shim(geometry).H @ trim_shim(geometry).H
    assert not verify.equal(crop, op.H)
    assert verify.equal(op.H, op.H)


# -- errors -----------------------------------------------------------------------------------------
STAGE_SPACE = Space([Block("a", (4,)), Block("b", (4,), 1), Block("c", (3, 3), 1)])
A, B, C = STAGE_SPACE["a"], STAGE_SPACE["b"], STAGE_SPACE["c"]


@pytest.mark.parametrize(
    ("transfers", "match"),
    [
        pytest.param(
            [(A[0:2], B[0:2]), (B[1:3], A[2:4])],
            r"destination b\[0:2\] overlaps b\[1:3\]",
            id="reads-a-destination",
        ),
        pytest.param(
            [(A[0:2], B[1:3]), (A[2:3], B[2:3])], r"destination b\[2:3\] overlaps b\[1:3\]", id="two-writes"
        ),
        pytest.param([(A[0:3], A[1:4])], r"destination a\[1:4\] overlaps a\[0:3\]", id="self-overlap"),
        pytest.param(
            [(C[0:2, 0:1], C[1:3, 2:3]), (A[0:2], C[2, 1:3])],
            r"destination c\[2, 1:3\] overlaps c\[1:3, 2:3\]",
            id="corner-of-two-boxes",
        ),
        pytest.param([(A[0:2], B[0:3])], "shapes", id="shapes-differ"),
    ],
)
def test_stage_rejects_conflicting_copies(transfers, match):
    with pytest.raises(HaloError, match=match):
        HaloStage(STAGE_SPACE, tuple(transfers))


@st.composite
def random_copies(draw: st.DrawFn) -> list[tuple]:
    """A few same-shape box pairs in the 2-d blocks of a small space (overlapping or not)."""
    space = Space([Block("p", (4, 5)), Block("q", (3, 4), 1)])
    copies = []
    for _ in range(draw(st.integers(1, 5))):
        shape = (draw(st.integers(0, 3)), draw(st.integers(0, 3)))
        regions = []
        for _ in range(2):
            name = draw(st.sampled_from(["p", "q"]))
            block = space.block(name).shape
            start = [draw(st.integers(0, max(0, n - k))) for n, k in zip(block, shape)]
            if any(k > n for n, k in zip(block, shape)):
                start, shape = [0, 0], (0, 0)
            regions.append(space[name][start[0] : start[0] + shape[0], start[1] : start[1] + shape[1]])
        if regions[0].shape == regions[1].shape:
            copies.append(tuple(regions))
    return copies


@settings(max_examples=200, deadline=None)
@given(copies=random_copies())
def test_commuting_check_agrees_with_comparing_every_pair(copies):
    """The stage's check (boxes marked on a grid of cells) against the plain definition: some
    destination overlaps a source or another destination."""
    conflict = any(
        dst.overlaps(other)
        for k, (_, dst) in enumerate(copies)
        for other in [src for src, _ in copies] + [d for _, d in copies[k + 1 :]]
    )
    if not copies:
        return
    space = copies[0][0].space
    if conflict:
        with pytest.raises(HaloError, match="overlaps"):
            HaloStage(space, tuple(copies))
    else:
        HaloStage(space, tuple(copies))


@pytest.mark.timeout(10)
def test_stage_of_thousands_of_one_entry_copies_is_checked_quickly():
    """A reflected halo is a run of one-entry copies (the sources run backwards): checking that
    the copies commute must not compare every pair (4000 copies: over a minute pairwise)."""
    n = 4000
    space = Space([Block("a", (n,)), Block("b", (n,), 1)])
    stage = HaloStage(space, tuple((space["a"][i : i + 1], space["b"][n - 1 - i : n - i]) for i in range(n)))
    reversed_copy = stage({"a": np.arange(n), "b": np.zeros(n, dtype=np.int64)})["b"]
    assert np.array_equal(reversed_copy, np.arange(n)[::-1])


@pytest.mark.parametrize(
    "transfer",
    [
        pytest.param((A[0:2], B[0:2], B[2:4]), id="three-regions"),
        pytest.param((A[0:2],), id="one-region"),
        pytest.param(("a", B[0:2]), id="name-not-region"),
        pytest.param(A[0:2], id="region-not-pair"),
    ],
)
def test_stage_rejects_a_transfer_that_is_not_a_pair_of_regions(transfer):
    with pytest.raises(TypeError, match=r"stage H: a transfer is a \(Region, Region\) pair"):
        HaloStage(STAGE_SPACE, (transfer,))


def test_stage_accepts_regions_that_only_touch():
    transfers = (
        (A[0:2], A[2:4]),
        (A[0:2], B[0:2]),
        (B[2:4], C[0, 0:2]),
        (C[1:3, 0], C[1:3, 1]),
        (A[2:2], B[2:2]),
    )
    stage = HaloStage(STAGE_SPACE, transfers)
    verify.exact_adjoint(stage).check()
    verify.equal(stage, Composition(tuple(Copy(src, dst) for src, dst in transfers))).check()


def test_exchange_errors():
    t = DistributedTensor("x", (6,), Partition((2,)))
    geometry = halo_geometry(t, Kernel(3, padding=1))
    with pytest.raises(HaloError, match="variant"):
        HaloExchange(geometry, "diagonal")  # type: ignore[arg-type]
    with pytest.raises(HaloError, match="variant"):  # found by the long fuzz campaign: a bare ValueError
        HaloExchange(geometry, np.array(["nested", "direct"]))  # type: ignore[arg-type]
    with pytest.raises(HaloError, match="other than the tensor"):
        HaloExchange(geometry, local_name="x")
    with pytest.raises(HaloError, match="other than the local"):
        trim_shim(geometry, local_name="y", window_name="y")
    with pytest.raises(
        TypeError, match="HaloExchange: geometry must be a HaloGeometry, not DistributedTensor"
    ):
        HaloExchange(t)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="halo_geometry: tensor must be a DistributedTensor, not ndarray"):
        halo_geometry(np.zeros(6), Kernel(3))  # type: ignore[arg-type]


def test_stage_is_a_plain_copy_set():
    space = Space([Block("a", (4,)), Block("b", (4,), 1)])
    stage = HaloStage(space, ((space["a"][0:2], space["b"][2:4]), (space["b"][0:1], space["a"][3:4])))
    copies = Copy(space["a"][0:2], space["b"][2:4]) @ Copy(space["b"][0:1], space["a"][3:4])
    verify.equal(stage, copies).check()
    verify.exact_adjoint(stage).check()


@dataclass(frozen=True, eq=True, repr=False)
class _CropOnlyStage(HaloStage):
    """A deliberately wrong stage: its 'adjoint' clears the halos but never adds them back."""

    def adjoint(self) -> LinearOperator:
        clears = [Clear(dst) for _, dst in self.transfers]
        return Composition(tuple(clears)) if len(clears) > 1 else clears[0]


def test_exact_check_catches_a_stage_adjoint_that_does_not_add_back():
    t = DistributedTensor("x", (6,), Partition((2,)))
    (stage,) = HaloExchange(halo_geometry(t, Kernel(3, padding=1))).stages()
    wrong = _CropOnlyStage(stage.space, stage.transfers, stage.label)
    proof = verify.exact_adjoint(wrong)
    assert not proof
    assert "x_local" in proof.detail
    assert verify.exact_adjoint(stage)


@settings(max_examples=40, deadline=None)
@given(case=halo_cases(modes=("zero",)))
def test_direct_exchange_sends_one_box_per_pair_of_workers(case):
    """With zero padding, each worker's window meets each owner's bulk in one box: the direct
    exchange sends corners and edges from one owner in a single message."""
    t, kernel = case
    (stage,) = HaloExchange(halo_geometry(t, kernel), "direct").stages() or (None,)
    if stage is None:
        return
    pairs = [(src.name, dst.name) for src, dst in stage.transfers]
    assert len(pairs) == len(set(pairs))
    assert all(src != dst for src, dst in pairs)
