"""The overlapped halo exchange (linop.overlap, linop.layers.overlap_split): the overlapped
convolution tree equals the plain one exactly (integers, entry by entry, numpy and sparse),
forward and adjoint; a split whose interior reaches into a halo is caught; the program runs the
interior while the exchange's messages are in flight and nothing that conflicts with them."""

from __future__ import annotations

import numpy as np
import pytest

import verify
from linop import Block, Copy, DistributedTensor, HaloExchange, Kernel, Partition, Space, halo_geometry
from linop.errors import LayerError, SpaceMismatchError
from linop.layers import Convolution, overlap_split
from linop.overlap import OverlappedHalo, OverlappedHaloAdjoint
from linop.program import Local, Phase, RankOverlap, batch, compile_for_rank, compile_program, lower
from linop.program.steps import Footprint, Transfer

RNG = np.random.default_rng(7)

CASES = [
    # (global shape, partition, kernel, sizes)
    ((1, 2, 10), (1, 1, 2), Kernel(3, padding=1), None),
    ((1, 1, 13), (1, 1, 3), Kernel(5, padding=2), None),
    ((1, 1, 12), (1, 1, 3), Kernel(3, stride=2, padding=1), None),
    ((1, 1, 12), (1, 1, 4), Kernel(3, padding=1), ((1,), (1,), (2, 5, 4, 1))),  # unbalanced
    ((1, 1, 9), (1, 1, 2), Kernel(3, padding=1, boundary="periodic"), None),
    ((2, 2, 8, 9), (1, 1, 2, 2), Kernel(3, padding=1), None),
    ((1, 1, 9, 8), (1, 1, 2, 2), Kernel(5, padding=2), None),
    ((1, 1, 7, 6), (1, 1, 2, 3), Kernel(3), None),
    ((1, 1, 9, 10), (1, 1, 3, 2), Kernel(3, padding=1), ((1,), (1,), (2, 4, 3), (6, 4))),  # unbalanced
    ((1, 2, 8, 8), (1, 2, 2, 1), Kernel(3, padding=1, dilation=2), None),  # channel split: a reduction
]


def _layer(shape, parts, kernel, sizes) -> Convolution:
    x = (
        DistributedTensor("x", shape, Partition(parts))
        if sizes is None
        else DistributedTensor("x", shape, Partition(parts), sizes=sizes)
    )
    return Convolution(x, 2, kernel, bias=False)


def _weights(layer: Convolution) -> np.ndarray:
    return RNG.integers(-3, 4, size=layer.weights.global_shape)


def _state(space: Space) -> dict[str, np.ndarray]:
    return {b.name: RNG.integers(-5, 6, size=b.shape) for b in space.blocks}


def _assert_same_state(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype.kind in "iu" and b[name].dtype.kind in "iu"
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in CASES])
def test_overlapped_convolution_equals_the_plain_one_exactly(case):
    layer = _layer(*case)
    weights = _weights(layer)
    plain, overlapped = layer.input_operator(weights), layer.input_operator(weights, overlap=True)
    assert verify.equal(overlapped, plain)  # sparse matrices, entry by entry
    assert verify.equal(overlapped.H, plain.H)
    assert verify.exact_adjoint(overlapped)
    x = _state(plain.domain)
    _assert_same_state(overlapped(x), plain(x))  # numpy, integers
    y = _state(plain.range)
    _assert_same_state(overlapped.H(y), plain.H(y))


def _widened(layer: Convolution):
    """A wrong split: every interior widened by one output along the last dimension, into the
    halo (where the worker has a right neighbour)."""

    def interior(g, dims):
        box = overlap_split.interior_box(layer.geometry, g, dims)
        if box is None:
            return None
        start, stop = box
        row = layer.geometry.row(g, dims[-1])
        widened = min(stop[-1] + 1, row.output_stop)
        return start, (*stop[:-1], widened)

    return interior


def test_a_split_whose_interior_reaches_into_the_halo_is_caught():
    layer = _layer((1, 1, 8, 9), (1, 1, 2, 2), Kernel(3, padding=1), None)
    weights = _weights(layer)
    plain = layer.input_operator(weights)
    stride, dilation = layer.kernel.stride[2:], layer.kernel.dilation[2:]

    from linop.layers.conv import _input_kernels

    def kernels(j, window):
        return _input_kernels(layer._part(weights, j), window, stride, dilation)

    outputs = [((0, 0, *g[1:]), layer.partial_block((0, 0, *g[1:]))) for g in layer.x.partition.indices()]
    wrong = overlap_split.overlapped_products(layer.geometry, outputs, kernels, interior=_widened(layer))
    proof = verify.equal(wrong, plain)
    assert not proof
    x = _state(plain.domain)
    got, want = wrong(x), plain(x)
    assert any(not np.array_equal(got[n], want[n]) for n in want)
    assert not verify.equal(wrong.H, plain.H)
    # the right split, built the same way, passes
    right = overlap_split.overlapped_products(layer.geometry, outputs, kernels)
    assert verify.equal(right, plain)


def test_pieces_cover_the_output_box_once():
    output = ((0, 0), (5, 7))
    inner = ((1, 2), (4, 6))
    cover = np.zeros((5, 7), dtype=int)
    for (a, b), (c, d) in boundary_boxes(output, inner):
        cover[a:c, b:d] += 1
    cover[1:4, 2:6] += 1
    assert (cover == 1).all()
    assert overlap_split.boundary_strips(output, None) == [output]


def boundary_boxes(output, inner):
    return [(s, t) for s, t in overlap_split.boundary_strips(output, inner)]


def test_overlap_needs_a_layer_that_does_not_broadcast_its_input():
    x = DistributedTensor("x", (1, 2, 8), Partition((1, 1, 2)))
    layer = Convolution(x, 2, Kernel(3, padding=1), workers=Partition((1, 2, 1, 2)), bias=False)
    assert not layer.overlappable
    with pytest.raises(LayerError, match="broadcast"):
        layer.input_operator(_weights(layer), overlap=True)


def test_the_node_checks_its_operands():
    exchange = HaloExchange(halo_geometry(DistributedTensor("x", (6,), Partition((2,))), Kernel(3)))
    with pytest.raises(TypeError):
        OverlappedHalo(exchange.H, Copy(exchange.domain["x_local[0]"][1:2], "u"))  # type: ignore[arg-type]
    other = Space([Block("v", (2,), 0)])
    with pytest.raises(SpaceMismatchError, match="x_local"):
        OverlappedHalo(exchange, Copy(other["v"], "u"))
    node = OverlappedHalo(exchange, Copy(exchange.domain["x_local[0]"][1:2], "u"))
    assert isinstance(node.H, OverlappedHaloAdjoint) and node.H.H == node


def _overlaps(schedule):
    return [s for s in schedule if isinstance(s, RankOverlap)]


@pytest.mark.parametrize("parts", [(1, 1, 2), (1, 1, 2, 2)])
def test_the_program_runs_the_interior_while_the_exchange_is_in_flight(parts):
    shape = (1, 1, 10) if len(parts) == 3 else (1, 1, 8, 8)
    layer = _layer(shape, parts, Kernel(3, padding=1), None)
    tree = layer.input_operator(_weights(layer), overlap=True)
    for op in (tree, tree.H):
        program = compile_program(op)
        phases = [s for s in program.steps if isinstance(s, Phase)]
        assert sum(bool(p.during) for p in phases) == 1  # one phase carries the interior work
        for rank in range(layer.x.partition.size):
            mine = compile_for_rank(op, rank).schedule
            (overlap,) = _overlaps(mine)
            assert overlap.phase is not None and overlap.phase.sends and overlap.phase.receives
            assert any("conv_in" in str(node) for node in overlap.during)
            assert mine == program.for_rank(rank)


def test_batching_keeps_conflicting_work_out_of_the_phase():
    """Control: an in-flight local step that reads what a transfer of the phase writes is not
    run during it (it stays in program order)."""
    space = Space([Block("a", (4,), 0), Block("b", (4,), 1)])
    transfer = Transfer(space["a"][0:2], space["b"][0:2], "store", "keep")
    reads_target = Local(Copy(space["b"][0:1], "c"), 1, Footprint(reads=(("b", (0,), (1,)),)), True)
    reads_other = Local(Copy(space["b"][3:4], "d"), 1, Footprint(reads=(("b", (3,), (4,)),)), True)
    batched = batch([reads_other, transfer, reads_target])
    assert isinstance(batched[0], Phase) and batched[0].during == (reads_other,)
    assert batched[1] == reads_target  # after the phase, in order
    batched = batch([reads_target, transfer])
    assert batched[0] == reads_target and isinstance(batched[1], Phase) and not batched[1].during


def test_a_plain_program_has_no_overlap():
    layer = _layer((1, 1, 10), (1, 1, 2), Kernel(3, padding=1), None)
    plain = layer.input_operator(_weights(layer))
    assert not any(isinstance(s, Phase) and s.during for s in batch(lower(plain)))


def test_the_work_in_flight_tests_the_messages_after_each_of_its_steps():
    """A rank runs the interior between the phase's start and its completion, and calls the
    started phase's ``progress()`` (MPI: ``Testall``, so that MPICH moves the messages while
    the work runs) after each step of it, then waits for it once."""
    from linop.backends import numpy as numpy_backend
    from linop.backends.host_schedule import run_rank_schedule

    layer = _layer((1, 1, 10), (1, 1, 2), Kernel(3, padding=1), None)
    tree = layer.input_operator(_weights(layer), overlap=True)
    (overlap,) = _overlaps(compile_for_rank(tree, 0).schedule)
    (local,) = [b for b in HaloExchange(layer.geometry).domain if b.worker == 0]
    events: list[str] = []

    class Started:
        def progress(self) -> None:
            events.append("progress")

        def __call__(self) -> None:
            events.append("wait")

    def never(step, work):
        raise AssertionError(f"unexpected step {step!r}")

    work = numpy_backend.Workspace({local.name: np.ones(local.shape)}, {local.name}, np.dtype(float))
    run_rank_schedule([overlap], work, np.dtype(float), phase=never, part=never, start=lambda p, w: Started())
    assert events == ["progress"] * len(overlap.during) + ["wait"]
    assert len(overlap.during) >= 2 and any(n.startswith("y") for n in work.arrays)  # the interior ran
