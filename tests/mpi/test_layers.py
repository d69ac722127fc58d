"""Local operators and distributed layers under MPI equal the numpy interpreter, rank by rank
(forward and adjoint), at every rank count; parameter trees built from only the windows a rank
holds (as a real distributed run would) included."""

from __future__ import annotations

import os

import numpy as np
import pytest
from helpers import collective_assert, compare_with_numpy, local_part, same_blocks
from mpi4py import MPI

from linop import Block, DistributedTensor, Kernel, Partition, SendRecv, Space
from linop.backends import mpi as mpi_backend
from linop.layers import Affine, AveragePool, Convolution, MaxPoolJacobian
from linop.local import local_operator

LONG = os.environ.get("LINOP_LONG") == "1"
COMM = MPI.COMM_WORLD
SIZE = COMM.size
RANK = COMM.rank


def test_local_operators_run_on_their_owning_rank():
    """A kernel on every worker, then a ring of send-receives of the results."""
    space = Space(Block(f"x{w}", (3,), w) for w in range(SIZE))
    op = None
    for w in range(SIZE):
        matrix = np.arange(6).reshape(2, 3) + w
        current = space if op is None else op.range
        node = local_operator(current, f"x{w}", Block(f"y{w}", (2,), w), matrix, name=f"K{w}")
        op = node if op is None else node @ op
    if SIZE > 1:
        op = SendRecv(op.range["y0"], Block("z", (2,), SIZE - 1)) @ op
    compare_with_numpy(op, op.domain.random(1, np.int64))
    compare_with_numpy(op.H, op.range.random(2, np.int64))


def _conv_cases():
    cases = [("feature", (1, 1, SIZE, 1), None, 2)]
    if SIZE == 4:
        cases.append(("feature-2x2", (1, 1, 2, 2), None, 2))
        cases.append(("general", (1, 2, 1, 1), Partition((1, 2, 2, 1, 1), (0, 1, 2, 3)), 4))
    if SIZE == 2:
        cases.append(("channel", (1, 1, 1, 1), Partition((1, 2, 1, 1, 1), (1, 0)), 4))
    if SIZE == 3:
        cases.append(("channel-in", (1, 3, 1, 1), None, 2))
    return cases


@pytest.mark.parametrize(("label", "px", "pw", "out"), _conv_cases(), ids=[c[0] for c in _conv_cases()])
def test_convolution_trees_equal_numpy(label, px, pw, out):
    rng = np.random.default_rng(5)
    x = DistributedTensor("x", (2, 2 * px[1], 7, 6), Partition(px))
    layer = Convolution(x, out, Kernel(3, padding=1, stride=(2, 1)), workers=pw)
    w = rng.integers(-2, 3, layer.weights.global_shape)
    b = rng.integers(-2, 3, layer.bias.global_shape)
    data = rng.integers(-3, 4, x.global_shape)
    forward = layer.input_operator(w)
    compare_with_numpy(forward, x.scatter(data))
    compare_with_numpy(forward.H, layer.y.space.random(3, np.int64))

    # the parameter tree from this rank's windows only, as in a real run
    windows_everywhere = layer.window_operator(x.scatter(data))
    mine = mpi_backend.apply(layer.window_operator, local_part(x.space, x.scatter(data), RANK))
    parameters_here = layer.parameter_operator(mine)
    parameters = layer.parameter_operator(windows_everywhere)
    state = layer.scatter_parameters(w, b)
    expected = parameters(state)
    result = mpi_backend.apply(parameters_here, local_part(parameters.domain, state, RANK))
    names = tuple(blk.name for blk in parameters.range if blk.worker == RANK)
    problem = same_blocks(result, expected, names)
    dy = layer.y.space.random(4, np.int64)
    expected_gradient = parameters.H(dy)
    gradient = mpi_backend.apply(parameters_here.H, local_part(layer.y.space, dy, RANK))
    names = tuple(blk.name for blk in parameters.domain if blk.worker == RANK)
    problem = problem or same_blocks(gradient, expected_gradient, names)
    collective_assert(problem is None, f"{label}: {problem}")


def _unbalanced_conv_cases():
    """Channels that do not divide over their workers: balanced shares (7 over 3 is 3, 2, 2),
    explicit uneven ones and empty ones, at every rank count. (label, x shape, P_x, x sizes,
    P_w, its workers, C_out, out_sizes)"""
    if SIZE == 1:
        return [("ci3/1-co5/1", (2, 3, 6, 5), (1, 1, 1, 1), None, (1, 1, 1, 1, 1), (0,), 5, None)]
    cases = [
        ("ci3/2", (2, 3, 6, 5), (1, 2, 1, 1), None, (1, 1, 2, 1, 1), (0, 1), 2, None),
        ("co5/2", (1, 2, 6, 5), (1, 1, 1, 1), None, (1, 2, 1, 1, 1), (1, 0), 5, None),
    ]
    if SIZE >= 3:
        cases.append(("ci7/3", (1, 7, 6, 5), (1, 3, 1, 1), None, (1, 1, 3, 1, 1), (0, 1, 2), 3, None))
        cases.append(
            (
                "explicit-ci0,2,1",
                (2, 3, 6, 5),
                (1, 3, 1, 1),
                ((2,), (0, 2, 1), (6,), (5,)),
                (1, 1, 3, 1, 1),
                (2, 0, 1),
                3,
                None,
            )
        )
        cases.append(
            ("explicit-co2,0,1", (2, 3, 6, 5), (1, 1, 1, 1), None, (1, 3, 1, 1, 1), (1, 2, 0), 3, (2, 0, 1))
        )
    if SIZE == 4:
        cases.append(
            ("general-ci5/2-co7/2", (1, 5, 7, 6), (1, 2, 1, 1), None, (1, 2, 2, 1, 1), (0, 1, 2, 3), 7, None)
        )
        cases.append(
            (
                "general-explicit-co1,6",
                (1, 5, 7, 6),
                (1, 2, 1, 1),
                ((1,), (4, 1), (7,), (6,)),
                (1, 2, 2, 1, 1),
                (3, 1, 2, 0),
                7,
                (1, 6),
            )
        )
    return cases


@pytest.mark.parametrize(
    ("label", "shape", "px", "sizes", "pw", "workers", "out", "out_sizes"),
    _unbalanced_conv_cases(),
    ids=[c[0] for c in _unbalanced_conv_cases()],
)
def test_unbalanced_channel_shares_equal_numpy(label, shape, px, sizes, pw, workers, out, out_sizes):
    rng = np.random.default_rng(8)
    x = DistributedTensor("x", shape, Partition(px), sizes=sizes or ())
    layer = Convolution(
        x, out, Kernel(3, padding=1, stride=(2, 1)), workers=Partition(pw, workers), out_sizes=out_sizes
    )
    w = rng.integers(-2, 3, layer.weights.global_shape)
    b = rng.integers(-2, 3, layer.bias.global_shape)
    data = rng.integers(-3, 4, x.global_shape)
    forward = layer.input_operator(w)
    compare_with_numpy(forward, x.scatter(data))
    compare_with_numpy(forward.H, layer.y.space.random(3, np.int64))
    mine = mpi_backend.apply(layer.window_operator, local_part(x.space, x.scatter(data), RANK))
    parameters_here = layer.parameter_operator(mine)
    parameters = layer.parameter_operator(layer.window_operator(x.scatter(data)))
    state = layer.scatter_parameters(w, b)
    result = mpi_backend.apply(parameters_here, local_part(parameters.domain, state, RANK))
    problem = same_blocks(
        result, parameters(state), tuple(b.name for b in parameters.range if b.worker == RANK)
    )
    dy = layer.y.space.random(4, np.int64)
    gradient = mpi_backend.apply(parameters_here.H, local_part(layer.y.space, dy, RANK))
    names = tuple(blk.name for blk in parameters.domain if blk.worker == RANK)
    problem = problem or same_blocks(gradient, parameters.H(dy), names)
    compare_with_numpy(layer.copy_gradient_sum, layer.copy_gradient_sum.domain.random(5, np.int64))
    collective_assert(problem is None, f"{label}: {problem}")


def test_unbalanced_feature_shares_equal_numpy():
    rng = np.random.default_rng(9)
    p_fi = 2 if SIZE % 2 == 0 else 1
    p_fo = SIZE // p_fi
    x = DistributedTensor("x", (3, 7), Partition((1, p_fi)))  # 7 features: 4, 3 over 2 workers
    for out, out_sizes in ((2 * p_fo + 1, None), (5, (5,) + (0,) * (p_fo - 1))):
        layer = Affine(x, out, workers=Partition((p_fo, p_fi)), out_sizes=out_sizes)
        data, w, b = (
            rng.integers(-3, 4, (3, 7)),
            rng.integers(-3, 4, layer.weights.global_shape),
            rng.integers(-3, 4, out),
        )
        forward = layer.input_operator(w)
        compare_with_numpy(forward, x.scatter(data))
        compare_with_numpy(forward.H, layer.y.space.random(1, np.int64))
        parameters = layer.parameter_operator(layer.window_operator(x.scatter(data)))
        compare_with_numpy(parameters, layer.scatter_parameters(w, b))
        compare_with_numpy(parameters.H, layer.y.space.random(2, np.int64))


def test_affine_trees_equal_numpy():
    rng = np.random.default_rng(6)
    p_fi = 2 if SIZE % 2 == 0 else 1
    p_fo = SIZE // p_fi
    x = DistributedTensor("x", (3, 4), Partition((1, p_fi)))
    layer = Affine(x, 2 * p_fo, workers=Partition((p_fo, p_fi)))
    data, w, b = (
        rng.integers(-3, 4, (3, 4)),
        rng.integers(-3, 4, layer.weights.global_shape),
        rng.integers(-3, 4, 2 * p_fo),
    )
    forward = layer.input_operator(w)
    compare_with_numpy(forward, x.scatter(data))
    compare_with_numpy(forward.H, layer.y.space.random(1, np.int64))
    parameters = layer.parameter_operator(layer.window_operator(x.scatter(data)))
    compare_with_numpy(parameters, layer.scatter_parameters(w, b))
    compare_with_numpy(parameters.H, layer.y.space.random(2, np.int64))


def test_pooling_trees_equal_numpy():
    rng = np.random.default_rng(7)
    x = DistributedTensor("x", (1, 2, 4 * SIZE + 1, 5), Partition((1, 1, SIZE, 1)))
    average = AveragePool(x, Kernel(2, stride=2, padding=(1, 0))).operator
    data = rng.integers(-5, 6, x.global_shape).astype(float)
    compare_with_numpy(average, x.scatter(data))
    compare_with_numpy(average.H, average.range.random(3))
    pool = MaxPoolJacobian(x, Kernel(3, stride=2, padding=1))
    jacobian = pool.at(pool.window_operator(x.scatter(data)))
    compare_with_numpy(jacobian, x.scatter(rng.integers(-5, 6, x.global_shape)))
    compare_with_numpy(jacobian.H, jacobian.range.random(4, np.int64))


def _overlap_cases():
    """(label, global shape, partition, kernel, sizes): 1-d and 2-d, kernels and paddings,
    unbalanced shares, a channel split (a reduction after the product)."""
    cases = [("1d-k3", (2, 2, 4 * SIZE + 1), (1, 1, SIZE), Kernel(3, padding=1), None)]
    if LONG:
        cases.append(
            ("1d-k5-stride2", (1, 1, 5 * SIZE + 2), (1, 1, SIZE), Kernel(5, stride=2, padding=2), None)
        )
        cases.append(("2d-rows", (1, 2, 3 * SIZE + 2, 6), (1, 1, SIZE, 1), Kernel(3, padding=1), None))
    if SIZE > 1:
        sizes = ((1,), (1,), tuple(range(1, SIZE + 1)), (7,))
        cases.append(
            ("2d-unbalanced", (1, 1, sum(sizes[2]), 7), (1, 1, SIZE, 1), Kernel(3, padding=1), sizes)
        )
    if SIZE == 4:
        cases.append(("2d-2x2-k3", (1, 2, 9, 8), (1, 1, 2, 2), Kernel(3, padding=1), None))
        if LONG:
            cases.append(("2d-2x2-k5", (1, 1, 10, 9), (1, 1, 2, 2), Kernel(5, padding=2), None))
        cases.append(("2d-channels", (1, 2, 8, 7), (1, 2, 2, 1), Kernel(3, padding=1), None))
    return cases


@pytest.mark.parametrize(
    ("label", "shape", "px", "kernel", "sizes"), _overlap_cases(), ids=[c[0] for c in _overlap_cases()]
)
def test_overlapped_convolution_under_mpi_equals_the_plain_one(label, shape, px, kernel, sizes):
    """The overlapped tree under MPI (interior in flight) gives, rank by rank and entry by
    entry, the numpy interpreter's plain tree: forward and adjoint, integers."""
    from linop.program import RankOverlap, compile_for_rank

    rng = np.random.default_rng(11)
    partition = Partition(px)
    x = (
        DistributedTensor("x", shape, partition)
        if sizes is None
        else DistributedTensor("x", shape, partition, sizes=sizes)
    )
    layer = Convolution(x, 2, kernel, bias=False)
    w = rng.integers(-2, 3, layer.weights.global_shape)
    plain, overlapped = layer.input_operator(w), layer.input_operator(w, overlap=True)
    problem = None
    for forward, (op, reference) in enumerate(((overlapped, plain), (overlapped.H, plain.H))):
        state = op.domain.random(5 + forward, np.int64)
        expected = reference(state)
        result = mpi_backend.apply(op, local_part(op.domain, state, RANK))
        names = tuple(b.name for b in op.range if b.worker == RANK)
        problem = problem or same_blocks(result, expected, names)
        if SIZE > 1 and RANK < partition.size:  # the rank really overlaps: its interior in flight
            schedule = compile_for_rank(op, RANK).schedule
            if not any(isinstance(s, RankOverlap) and s.phase is not None and s.during for s in schedule):
                problem = problem or f"rank {RANK}: no phase with work in flight in {label}"
    collective_assert(problem is None, f"{label}: {problem}")


@pytest.mark.parametrize(
    "parts", [(1, 1, 1, 1), (1, 1, 2, 1), (1, 1, 2, 2)], ids=["one-block", "rows", "rows-and-columns"]
)
def test_the_bound_window_plans_fill_only_the_pads_and_copy_the_bulk_back(parts):
    """A convolution's window movement bound (what LayerModule runs): forward, the padded block
    is zeroed around the bulk only (the bulk is copied in next) and, adjoint, the bulk's
    gradient copied out (or, where the window's block is the run's own, handed out as its
    view), with no whole-block fill, add or clearing before the block is dropped; the results
    equal the numpy interpreter's (integers, every rank count), at each of two calls."""
    if parts[2] * parts[3] > SIZE:
        pytest.skip(f"needs {parts[2] * parts[3]} ranks")  # the same on every rank
    rng = np.random.default_rng(17)
    x = DistributedTensor("x", (2, 2, 6 * parts[2], 5 * parts[3]), Partition(parts))
    layer = Convolution(x, 2, Kernel(3, padding=1), bias=False)
    problem = None
    for op in (layer.window_operator, layer.window_operator.H):
        state = {b.name: rng.integers(-5, 6, b.shape).astype(float) for b in op.domain}
        mine = {b.name: state[b.name].copy() for b in op.domain if b.worker == RANK}
        bound = mpi_backend.plan_for(op, comm=COMM).bind(mine, inplace=False)
        names = tuple(b.name for b in op.range if b.worker == RANK)
        problem = problem or same_blocks(bound(), op(state), names)
        problem = problem or same_blocks(bound(), op(state), names)  # the second call alike
        blocks = [op.domain.block(n).shape for n in mine] + [op.range.block(n).shape for n in names]
        for function, arguments in bound._calls or []:
            array = getattr(function, "__self__", None)
            if getattr(function, "__name__", "") == "fill" and array is not None and array.shape in blocks:
                problem = problem or f"a whole-block fill {array.shape} in {op}"
            if function is np.add and any(a.shape in blocks for a in arguments):
                problem = problem or f"a whole-block add in {op}"
        if RANK < x.partition.size and not bound.persistent:
            problem = problem or f"{op} not compiled"
        bound.free()
    collective_assert(problem is None, str(problem))


def test_results_written_by_the_caller_do_not_reach_the_next_bound_call():
    """A caller may write into a bound plan's result arrays between calls (MaxPool sets the
    windows' padding to -inf in them): the next call's results are the tree's again, padding
    and halo included, so the window plan (a chain's fused windows, 2 x 2 or rows) rewrites its
    pads on every call; its adjoint's, whose result may be a view of the window gradient's
    block, alike. Control: the window plan with its zero fills dropped (pads zeroed once, at
    binding) hands the scribbled values on, and this test reports them."""
    from linop.layers import ChainStage, WindowChain

    parts = (1, 1, 2, 2) if SIZE >= 4 else (1, 1, SIZE, 1)
    rng = np.random.default_rng(23)
    x = DistributedTensor("x", (1, 2, 5 * parts[2], 4 * parts[3]), Partition(parts))
    stages = [ChainStage.conv(np.ones((2, 2, 3, 3)), padding=1) for _ in range(2)]
    windows = WindowChain(x, stages).window_operator
    problems = {}
    for op, hoisted in ((windows, False), (windows.H, False), (windows, True)):
        names = tuple(b.name for b in op.range if b.worker == RANK)
        mine = {b.name: np.zeros(b.shape) for b in op.domain if b.worker == RANK}
        bound = mpi_backend.plan_for(op, comm=COMM).bind(mine, inplace=False)
        if hoisted and bound._calls is not None:  # the pads zeroed at binding only
            bound._calls[:] = [c for c in bound._calls if getattr(c[0], "__name__", "") != "fill"]
        problem = None
        for _ in range(2):
            state = {b.name: rng.integers(-5, 6, b.shape).astype(float) for b in op.domain}
            for name in mine:
                np.copyto(mine[name], state[name])
            results = bound()
            problem = problem or same_blocks(results, op(state), names)
            for array in results.values():  # the caller's scribbles
                if array.flags.writeable:
                    array.fill(np.nan)
        problems[(op is windows, hoisted)] = problem
        bound.free()
    reported = COMM.allreduce(problems.pop((True, True)) is not None, op=MPI.LOR)
    collective_assert(not any(problems.values()), str(problems))
    collective_assert(reported, "a pad zeroed once at binding went unnoticed")


def test_fused_window_chain_equals_numpy():
    """A conv -> conv -> pool chain with one fused halo exchange (linop.layers.WindowChain):
    forward and adjoint under MPI equal the numpy interpreter, rank by rank."""
    from linop.layers import ChainStage, WindowChain

    rng = np.random.default_rng(37)
    grid = (2, 2) if SIZE == 4 else (SIZE, 1)
    x = DistributedTensor("x", (1, 2, 11, 9), Partition((1, 1, *grid)))
    chain = WindowChain(
        x,
        [
            ChainStage.conv(rng.integers(-2, 3, (2, 2, 3, 3)), padding=1),
            ChainStage.conv(rng.integers(-2, 3, (1, 2, 3, 3)), stride=2, padding=1),
            ChainStage.avg(Kernel(2, stride=1, padding=1)),
        ],
    )
    op = chain.operator
    # integer-valued floats: the pool's 1/4 makes the results floats (exact: dyadic)
    compare_with_numpy(op, x.scatter(rng.integers(-3, 4, x.global_shape).astype(np.float64)))
    compare_with_numpy(op.H, chain.y.scatter(rng.integers(-3, 4, chain.y.global_shape).astype(np.float64)))
