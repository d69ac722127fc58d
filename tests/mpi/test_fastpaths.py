"""Each MPI fast path equals the fully expanded tree under MPI and the numpy interpreter."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import collective_assert, compare_with_numpy, local_part, same_blocks
from mpi4py import MPI

from linop import expand_all
from linop.backends import mpi as mpi_backend
from linop.collectives import AllGather, AllReduce, BlockGrid, Broadcast, ReduceScatter, SumReduce
from linop.halo import HaloExchange, local_space
from linop.halo_geometry import Kernel, halo_geometry
from linop.partition import DistributedTensor, Partition
from linop.program import FastPathStep, Phase
from linop.repartition import Gather, Repartition, Scatter

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size

GRIDS = {1: [(1,)], 2: [(2,), (2, 1), (1, 2)], 3: [(3,), (3, 1)], 4: [(4,), (2, 2), (4, 1), (1, 4)]}
DTYPES = [np.int64, np.float64, np.complex128, np.float32, np.float16]


def grids() -> list[tuple[int, ...]]:
    return GRIDS[SIZE]


def check_fast_path_equals_expansion(op, state, *, exact: bool) -> None:
    """The fast-pathed tree, its full expansion (primitives only) and numpy agree."""
    compare_with_numpy(op, state, exact=exact)
    expanded = expand_all(op)
    expected = op(state)
    local = local_part(op.domain, state, RANK)
    result = mpi_backend.apply(expanded, local, comm=COMM)
    names = tuple(b.name for b in op.range if b.worker == RANK)
    collective_assert(same_blocks(result, expected, names, exact=exact) is None, f"expansion of {op}")


def tensor_2d(grid, shape=(9, 7), name="x") -> DistributedTensor:
    grid = grid if len(grid) == 2 else (grid[0], 1)
    return DistributedTensor(name, shape, Partition(grid))


@pytest.mark.parametrize("variant", ["nested", "direct"])
@pytest.mark.parametrize("grid", grids(), ids=str)
@pytest.mark.parametrize("size", [3, 5])
def test_halo_exchange(variant, grid, size):
    geometry = halo_geometry(tensor_2d(grid), Kernel(size, padding=size // 2))
    op = HaloExchange(geometry, variant)
    state = op.domain.random(1, dtype=np.int64)
    check_fast_path_equals_expansion(op, state, exact=True)
    check_fast_path_equals_expansion(op.H, state, exact=True)
    plan = mpi_backend.plan_for(op, comm=COMM)
    collective_assert(plan.program.phases <= len(op.stages()), f"{plan.program.phases} phases")


@pytest.mark.parametrize("boundary", ["periodic", "reflect"])
def test_halo_exchange_wrapping_boundaries(boundary):
    geometry = halo_geometry(tensor_2d(grids()[-1]), Kernel(3, padding=1, boundary=boundary))
    op = HaloExchange(geometry)
    state = op.domain.random(2, dtype=np.int64)
    check_fast_path_equals_expansion(op, state, exact=True)
    check_fast_path_equals_expansion(op.H, state, exact=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_halo_exchange_dtypes(dtype):
    geometry = halo_geometry(tensor_2d(grids()[-1]), Kernel(3, padding=1))
    op = HaloExchange(geometry)
    compare_with_numpy(op, op.domain.random(3, dtype=dtype))
    compare_with_numpy(op.H, op.domain.random(4, dtype=dtype), exact=np.dtype(dtype).kind in "iu")


def test_bound_halo_exchange_is_persistent_and_copies_no_bulk():
    geometry = halo_geometry(tensor_2d(grids()[-1], (40, 30)), Kernel(3, padding=1))
    for op in (HaloExchange(geometry), HaloExchange(geometry).H):
        state = op.domain.random(5)
        expected = op(state)
        local = local_part(op.domain, state, RANK)
        arrays = dict(local)
        bound = mpi_backend.plan_for(op, comm=COMM).bind(local)
        bound()
        problem = same_blocks(local, expected, tuple(local))
        if problem is None and not bound.persistent:
            problem = "not persistent"
        if problem is None and any(local[n] is not arrays[n] for n in local):
            problem = "arrays replaced"
        bound.free()
        collective_assert(problem is None, str(problem))


def partitions_for_broadcast():
    if SIZE == 1:
        return [(Partition((1,)), Partition((1,)))]
    cases = [(Partition((1,)), Partition((SIZE,)))]
    if SIZE == 4:
        cases += [(Partition((1, 2)), Partition((2, 2))), (Partition((2, 1)), Partition((2, 2)))]
        # the root among the copies but not first (its sub-communicator's runs split around it),
        # and the root outside them
        cases += [(Partition((1,), (2,)), Partition((SIZE,))), (Partition((1,), (3,)), Partition((3,)))]
    return cases


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("case", range(len(partitions_for_broadcast())))
def test_broadcast_and_sum_reduce(case, dtype):
    source, destination = partitions_for_broadcast()[case]
    tensor = DistributedTensor("x", (5, 4)[: source.ndim] if source.ndim == 1 else (5, 4), source)
    if destination.ndim != tensor.ndim:
        tensor = DistributedTensor("x", (5,) * destination.ndim, source)
    broadcast = Broadcast(tensor, destination, "y")
    exact = np.dtype(dtype).kind in "iu"
    for op in (broadcast, broadcast.H, SumReduce(tensor, destination, "y")):
        state = op.domain.random(6, dtype=dtype)
        check_fast_path_equals_expansion(op, state, exact=exact or op is broadcast)
    for op in (broadcast, SumReduce(tensor, destination, "y")):
        plan = mpi_backend.plan_for(op, comm=COMM)
        collective_assert(any(isinstance(s, FastPathStep) for s in plan.program.steps), f"{op}: not native")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("grid", grids(), ids=str)
def test_all_reduce(grid, dtype):
    grid = grid if len(grid) == 2 else (grid[0], 1)
    layout = BlockGrid.uniform("x", Partition(grid), (6, 5))
    for axes in [(0,), (1,), (0, 1)]:
        op = AllReduce(layout, axes)
        check_fast_path_equals_expansion(
            op, op.domain.random(7, dtype=dtype), exact=np.dtype(dtype).kind in "iu"
        )
        if np.prod([grid[a] for a in axes]) > 1:  # some group has two members: the native path
            plan = mpi_backend.plan_for(op, comm=COMM)
            collective_assert(
                any(isinstance(s, FastPathStep) for s in plan.program.steps), f"{op}: not native"
            )


@pytest.mark.parametrize("channels", [1, 2], ids=["channels-whole", "channels-cut"])
@pytest.mark.parametrize("dtype", [np.int64, np.float16], ids=lambda d: np.dtype(d).name)
def test_all_reduce_over_every_axis_but_the_channels(channels, dtype):
    """A batch norm's statistics: (3, 2) blocks on a (1, c, a, b) grid reduced over every axis
    but the channel axis, one group of every rank (channels whole: the communicator itself) or
    one per channel (cut in two: sub-communicators of runs of ranks), native and exact
    (float16 through the expansion)."""
    if SIZE % channels:
        pytest.skip(f"{SIZE} ranks do not split into {channels} channel groups")
    rest = SIZE // channels
    grid = (1, channels, 2, rest // 2) if rest % 2 == 0 else (1, channels, 1, rest)
    op = AllReduce(BlockGrid.uniform("t", Partition(grid), (3, 2)), (0, 2, 3))
    check_fast_path_equals_expansion(op, op.domain.random(5, dtype=dtype), exact=True)
    check_fast_path_equals_expansion(op.H, op.domain.random(6, dtype=dtype), exact=True)
    if rest > 1:
        plan = mpi_backend.plan_for(op, comm=COMM)
        collective_assert(any(isinstance(s, FastPathStep) for s in plan.program.steps), f"{op}: not native")


@pytest.mark.parametrize("grid", grids(), ids=str)
def test_all_gather_reduce_scatter_and_repartition(grid):
    tensor = tensor_2d(grid, (7, 6))
    other = DistributedTensor("z", (7, 6), Partition(tuple(reversed(tensor.partition.shape))))
    for op in (AllGather(tensor, (0,), "g"), ReduceScatter(tensor, (0, 1), "g"), Repartition(tensor, other)):
        for node in (op, op.H):
            check_fast_path_equals_expansion(node, node.domain.random(8, dtype=np.int64), exact=True)
        plan = mpi_backend.plan_for(op, comm=COMM)
        collective_assert(sum(isinstance(s, Phase) for s in plan.program.steps) <= 1, str(plan.program.steps))
        if not isinstance(op, ReduceScatter):  # copying plans: one Alltoallw
            collective_assert(
                any(isinstance(s, FastPathStep) for s in plan.program.steps), f"{op}: no Alltoallw"
            )


@pytest.mark.parametrize("dtype", [np.int64, np.float16], ids=["int64", "float16"])
@pytest.mark.parametrize("grid", grids(), ids=str)
def test_native_all_gather_and_reduce_scatter_on_equal_shares(grid, dtype):
    """Along one axis of equal shares an all-gather is one ``Allgather`` and a reduce-scatter
    one ``Reduce_scatter_block`` per line of the partition (float16, which MPI cannot sum,
    runs the expansion): equal to the expansion and to numpy, both axes, exactly (integer
    entries)."""
    grid = grid if len(grid) == 2 else (grid[0], 1)
    tensor = DistributedTensor("x", (2 * grid[0], 3 * grid[1]), Partition(grid))
    for axis in (0, 1):
        for op in (AllGather(tensor, (axis,), "g"), ReduceScatter(tensor, (axis,), "g")):
            if grid[axis] < 2:
                continue
            plan = mpi_backend.plan_for(op, comm=COMM)
            collective_assert(
                any(
                    type(s.runner).__name__ in ("_GatherRunner", "Projected")
                    for s in plan.program.steps
                    if isinstance(s, FastPathStep)
                ),
                f"{op}: not native",
            )
            for node in (op, op.H):  # small integers: float16 sums exactly too
                state = {k: v.astype(dtype) for k, v in node.domain.random(11, dtype=np.int64).items()}
                check_fast_path_equals_expansion(node, state, exact=True)


UNEVEN = {  # (global shape, grid, axis): uneven shares along the axis, some empty at 3-4 ranks
    "rows": ((2 * SIZE + 1, 3), (SIZE, 1), 0),
    "a middle axis": ((2, SIZE + 1, 3), (1, SIZE, 1), 1),
    "empty shares": ((2, max(SIZE - 1, 1)), (1, SIZE), 1),
    "two lines": ((3, 2 * SIZE + 1), (2, SIZE // 2), 1) if SIZE % 2 == 0 else ((5, 3), (SIZE, 1), 0),
}


@pytest.mark.parametrize("dtype", [np.int64, np.float16], ids=["int64", "float16"])
@pytest.mark.parametrize("case", list(UNEVEN))
def test_native_reduce_scatter_on_uneven_shares(case, dtype):
    """Along one axis of uneven shares (some empty) a reduce-scatter is one ``Reduce_scatter``
    per line of the partition (the line's counts; float16, which MPI cannot sum, runs the
    expansion): the part in every rank's schedule, and the result equal entry by entry to the
    portable program (the expansion's primitives) and to the numpy interpreter, in integers;
    its adjoint (an all-gather of the same shares, one all-to-all) likewise; a bound plan too."""
    from linop.backends.mpi.steps import RankStep
    from linop.program.parts import LineReduceScatterPart

    shape, grid, axis = UNEVEN[case]
    tensor = DistributedTensor("x", shape, Partition(grid))
    op = ReduceScatter(tensor, (axis,), "g")
    sizes = tensor.sizes[axis]
    uneven = len(set(sizes)) > 1
    plan = mpi_backend.plan_for(op, comm=COMM)
    parts = [s.part for s in plan.schedule if isinstance(s, RankStep)]
    collective_assert(
        not uneven or [type(p) for p in parts] == [LineReduceScatterPart],
        f"{op} over shares {sizes}: not one native reduce-scatter ({plan.schedule})",
    )
    for node in (op, op.H):
        state = {k: v.astype(dtype) for k, v in node.domain.random(13, dtype=np.int64).items()}
        check_fast_path_equals_expansion(node, state, exact=True)
    if dtype is np.int64:  # a bound plan (checked once) runs the step on every call too
        state = op.domain.random(14, dtype=np.int64)
        bound = plan.bind(local_part(op.domain, state, RANK), inplace=False)
        names = tuple(b.name for b in op.range if b.worker == RANK)
        problem = bound_problem(bound, op, state, names, inplace=False)
        bound.free()
        collective_assert(problem is None, f"bound {op}: {problem}")


def test_scatter_and_gather():
    from linop import Block

    tensor = DistributedTensor("x", (6, 5), Partition((SIZE, 1)))
    root = Block("r", (6, 5), SIZE - 1)
    for op in (Scatter(root, tensor), Gather(root, tensor)):
        check_fast_path_equals_expansion(op, op.domain.random(9, dtype=np.int64), exact=True)
        check_fast_path_equals_expansion(op.H, op.range.random(9, dtype=np.int64), exact=True)


def test_local_space_of_halo_matches():
    geometry = halo_geometry(tensor_2d(grids()[-1]), Kernel(3, padding=1))
    assert HaloExchange(geometry).domain == local_space(geometry)


@pytest.mark.parametrize("case", range(len(partitions_for_broadcast())))
def test_bound_out_of_place_broadcast_and_sum_reduce(case):
    source, destination = partitions_for_broadcast()[case]
    shape = (5,) * destination.ndim
    broadcast = Broadcast(DistributedTensor("x", shape, source), destination, "y")
    for op in (broadcast, broadcast.H):
        problem = None
        for seed in (1, 2):  # twice: the prebuilt results are overwritten, not stale
            state = op.domain.random(seed, dtype=np.float64)
            local = local_part(op.domain, state, RANK)
            if seed == 1:
                bound = mpi_backend.plan_for(op, comm=COMM).bind(local)
            else:
                for name in local:
                    bound.arrays[name][...] = local[name]
            result = bound()
            names = tuple(b.name for b in op.range if b.worker == RANK)
            problem = problem or same_blocks(result, op(state), names, exact=op is broadcast)
        collective_assert(problem is None, f"{op}: {problem}")
        collective_assert(bound.persistent or SIZE == 1 or op is not broadcast, f"{op} not persistent")
        bound.free()


@pytest.mark.parametrize("adjoint", [False, True], ids=["forward", "adjoint"])
def test_in_place_halo_exchange_copies_no_bulk(adjoint):
    """Applied in place, the exchange allocates halo-sized buffers at most, never a block."""
    import tracemalloc

    geometry = halo_geometry(tensor_2d(grids()[-1], (512, 512)), Kernel(3, padding=1))
    op = HaloExchange(geometry).H if adjoint else HaloExchange(geometry)
    local = local_part(op.domain, op.domain.random(3), RANK)
    mpi_backend.apply(op, local, comm=COMM, inplace=True)  # compile and cache outside the measure
    block_bytes = max((a.nbytes for a in local.values()), default=0)
    tracemalloc.start()
    mpi_backend.apply(op, local, comm=COMM, inplace=True)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    collective_assert(peak < block_bytes / 8, f"peak allocation {peak} bytes for blocks of {block_bytes}")


def test_fast_paths_inside_sums_and_scalings():
    source, destination = partitions_for_broadcast()[0]
    broadcast = Broadcast(DistributedTensor("x", (5,), source), destination, "y")
    layout = BlockGrid.uniform("a", Partition((SIZE,)), (3, 2))
    all_reduce = AllReduce(layout, (0,))
    halo = HaloExchange(halo_geometry(tensor_2d(grids()[-1]), Kernel(3, padding=1)))
    for op in (
        broadcast + 2 * broadcast,
        broadcast.H - broadcast.H,
        all_reduce - 3 * all_reduce,
        halo + halo.H,
    ):
        # the reference is the exact matrix: independent of both interpreters' fast paths
        state = op.domain.random(10, dtype=np.int64)
        expected = op.range.unflatten(op.to_sparse() @ op.domain.flatten(state))
        local = local_part(op.domain, state, RANK)
        names = tuple(b.name for b in op.range if b.worker == RANK)
        for tree in (op, expand_all(op)):
            result = mpi_backend.apply(tree, local, comm=COMM)
            collective_assert(
                same_blocks(result, expected, names) is None,
                f"{tree}: {same_blocks(result, expected, names)}",
            )


def test_a_bound_sum_reduce_frees_its_scratch():
    """A bound native sum-reduce writes each non-root rank's sum into an array of the result's
    size on every call: the binding holds it (not the plan's step, which would keep one per
    bind for the plan's life) and ``free()`` releases it."""
    import gc
    import weakref

    tensor = DistributedTensor("x", (64,), Partition((1,)))
    op = Broadcast(tensor, Partition((SIZE,)), "y").H  # the sum of every copy onto worker 0
    local = local_part(op.domain, op.domain.random(4), RANK)
    plan = mpi_backend.plan_for(op, comm=COMM)
    bindings = [plan.bind(local, inplace=False) for _ in range(3)]
    scratch = [weakref.ref(a) for bound in bindings for a in bound._scratch]
    expected = 3 if RANK != 0 and SIZE > 1 and all(b.persistent for b in bindings) else 0
    problem = None if len(scratch) == expected else f"{len(scratch)} scratch arrays, expected {expected}"
    steps_hold = [name for step in plan.schedule for name in vars(step) if "scratch" in name]
    problem = problem or (f"the plan's step holds {steps_hold}" if steps_hold else None)
    for bound in bindings:
        bound.free()
    del bindings
    gc.collect()
    alive = sum(ref() is not None for ref in scratch)
    problem = problem or (f"{alive} scratch arrays alive after free()" if alive else None)
    collective_assert(problem is None, str(problem))


# -- bound plans compiled into prepared calls (mpi.compiled) -------------------------------------
def compiled_trees() -> list:
    """Trees whose rank schedules compile: halo windows (allocate, copy, a phase, moves) and
    their adjoints (copy-adjoints, adds and clears), a layer's parameter broadcasts and their
    sums, a scaled halo exchange, a repartition."""
    from linop import halo_windows
    from linop.layers import Convolution

    grid = grids()[-1]
    tensor = tensor_2d(grid, (12, 10))
    windows = halo_windows(tensor, Kernel(3, padding=1))
    image = DistributedTensor("c", (2, 3, 4 * SIZE, 5), Partition((1, 1, SIZE, 1)))
    layer = Convolution(image, 2, Kernel(3, padding=1))
    halo = HaloExchange(halo_geometry(tensor, Kernel(3, padding=1)))
    other = DistributedTensor("z", (12, 10), Partition(tuple(reversed(tensor.partition.shape))))
    return [
        windows,
        windows.H,
        layer.window_operator,
        layer.window_operator.H,
        layer.parameter_movement,
        layer.parameter_movement.H,
        2.0 * halo,
        Repartition(tensor, other),
        Repartition(tensor, other).H,
    ]


def bound_problem(bound, op, state, names, *, inplace: bool) -> str | None:
    """None when two calls of ``bound`` (on its arrays holding ``state``, then ``2 state + 1``)
    give ``op``'s results exactly and leave the inputs unchanged out of place."""
    for values in (state, {k: 2 * v + 1 for k, v in state.items()}):
        for name, array in bound.arrays.items():
            array[...] = values[name]
        before = {name: array.copy() for name, array in bound.arrays.items()}
        result = bound()
        expected = op(values)
        problem = same_blocks(result, expected, names)
        if problem is None and not inplace:
            changed = [n for n, a in bound.arrays.items() if not np.array_equal(a, before[n])]
            problem = f"inputs {changed} written out of place" if changed else None
        if problem is not None:
            return problem
    return None


@pytest.mark.parametrize("case", range(9))
def test_compiled_bound_plans_equal_the_tree(case):
    """Every rank compiles (persistent), and two calls give the tree's results exactly
    (integer values in float64), out of place and, where domain equals range, in place."""
    op = compiled_trees()[case]
    state = {k: v.astype(np.float64) for k, v in op.domain.random(case, dtype=np.int64).items()}
    names = tuple(b.name for b in op.range if b.worker == RANK)
    modes = [False, True] if op.domain == op.range else [False]
    for inplace in modes:
        local = local_part(op.domain, state, RANK)
        bound = mpi_backend.plan_for(op, comm=COMM).bind(local, inplace=inplace)
        one_rank_sum = SIZE == 1 and "R[" in str(op)  # a sum of one copy: declined on one rank
        problem = None if bound.persistent or one_rank_sum else "not compiled"
        problem = problem or bound_problem(
            bound, op, state, names if not inplace else tuple(local), inplace=inplace
        )
        bound.free()
        collective_assert(problem is None, f"{op} (inplace={inplace}): {problem}")


def test_a_wrong_prepared_call_is_caught():
    """Control: a compiled window exchange whose copy of the bulk writes one row too low gives
    results that the equality test of the compiled plans reports."""
    from linop import halo_windows

    op = halo_windows(tensor_2d(grids()[-1], (12, 10)), Kernel(3, padding=1))
    state = {k: v.astype(np.float64) for k, v in op.domain.random(3, dtype=np.int64).items()}
    names = tuple(b.name for b in op.range if b.worker == RANK)
    bound = mpi_backend.plan_for(op, comm=COMM).bind(local_part(op.domain, state, RANK), inplace=False)
    calls = bound._calls
    for i, (function, arguments) in enumerate(calls):
        if function is np.copyto and arguments[0].ndim == 2 and arguments[0].shape[0] > 1:
            target, source = arguments  # the bulk into the window: shifted by one row
            calls[i] = (np.copyto, (target[1:], source[:-1]))
            break
    problem = bound_problem(bound, op, state, names, inplace=False)
    bound.free()
    collective_assert(problem is not None, "a shifted copy went unnoticed")


@pytest.mark.parametrize("strategy", ["packed", "subarray", "peers"])
def test_repartition_strategies_equal_the_tree(strategy, monkeypatch):
    """Forced packed ``Alltoallv``, forced subarray ``Alltoallw`` and forced point-to-point
    messages with each rank's peers move exactly the tree's entries (int64 through the checked
    apply, float64 through a bound plan) for layouts whose boxes are strided on one side and
    contiguous on the other, or on both."""
    from linop.backends.mpi.native import all_to_all

    monkeypatch.setattr(all_to_all, "ALLTOALL_STRATEGY", strategy)
    for grid in grids():
        tensor = tensor_2d(grid, (9, 7))
        for other_grid in {tuple(reversed(tensor.partition.shape)), tensor.partition.shape}:
            other = DistributedTensor("z", (9, 7), Partition(other_grid))
            for op in (Repartition(tensor, other), Repartition(tensor, other).H):
                state = op.domain.random(5, dtype=np.int64)
                local = local_part(op.domain, state, RANK)
                names = tuple(b.name for b in op.range if b.worker == RANK)
                problem = same_blocks(mpi_backend.apply(op, local, comm=COMM), op(state), names)
                floats = {k: v.astype(np.float64) for k, v in state.items()}
                bound = mpi_backend.plan_for(op, comm=COMM).bind(local_part(op.domain, floats, RANK))
                problem = problem or bound_problem(bound, op, floats, names, inplace=False)
                bound.free()
                collective_assert(problem is None, f"{op} ({strategy}): {problem}")


def test_the_alltoall_strategy_is_recorded_and_a_wrong_displacement_is_caught(monkeypatch):
    """The plan records each all-to-all's strategy (a repartition between two grids: messages
    with each rank's peers; the measured rule of the collective); control: a packed all-to-all
    whose send displacements are off by one entry is caught by the same check."""
    from linop.backends.mpi.native import all_to_all

    tensor = tensor_2d(grids()[-1], (9, 7))
    other = DistributedTensor("z", (9, 7), Partition(tuple(reversed(tensor.partition.shape))))
    op = Repartition(tensor, other)
    plan = mpi_backend.plan_for(op, comm=COMM)
    steps = [s for s in plan.schedule if hasattr(s, "strategy")]
    collective_assert(len(steps) == 1 and steps[0].strategy == "peers", f"no recorded strategy: {steps}")
    rule = all_to_all.alltoall_strategy
    long_runs = all_to_all.PACKED_RUNS_BELOW
    choices = (
        rule(
            (8, 2 * long_runs), (8, long_runs), ((0, (0, 0), (8, long_runs)),), ((0, (0, 0), (8, long_runs)),)
        ),
        rule((8, 16), (8, 8), ((0, (0, 0), (8, 8)),), ((0, (0, 0), (8, 8)),)),  # strided, short runs
        rule((8, 16), (4, 16), ((0, (0, 0), (4, 16)),), ((0, (0, 0), (4, 16)),)),  # all contiguous
    )
    collective_assert(choices == ("subarray", "packed", "packed"), f"the rule chose {choices}")
    if SIZE == 1:
        return  # one peer at displacement 0: nothing to shift
    real = all_to_all._packed_side

    def shifted(block, boxes, size, dtype, *, pack):
        side = real(block, boxes, size, dtype, pack=pack)
        if pack and max(side.displacements) > 0:  # one entry early: inside the buffer still
            peer = side.displacements.index(max(side.displacements))
            side.displacements[peer] -= 1
        return side

    monkeypatch.setattr(all_to_all, "ALLTOALL_STRATEGY", "packed")
    monkeypatch.setattr(all_to_all, "_packed_side", shifted)
    state = op.domain.random(6, dtype=np.int64)
    names = tuple(b.name for b in op.range if b.worker == RANK)
    result = mpi_backend.apply(op, local_part(op.domain, state, RANK), comm=COMM)
    caught = same_blocks(result, op(state), names) is not None
    collective_assert(any(COMM.allgather(caught)), "a wrong displacement went unnoticed")


def _call_names(bound) -> list[str]:
    """The names of a bound plan's prepared calls (a partial's function's)."""
    return [getattr(getattr(function, "func", function), "__name__", "") for function, _ in bound._calls]


def test_independent_all_reduces_are_started_together():
    """A layer's replicated gradient sum (one all-reduce of the weight copies, one of the bias
    copies: disjoint blocks) starts both persistent requests, then waits for them together, and
    equals the tree exactly (integer values in float64, two calls). The control: an all-reduce
    applied twice to the same block waits for the first before starting the second (the second
    reads what the first writes), also exact."""
    from linop.layers import Convolution

    image = DistributedTensor("c", (2, 3, 4 * SIZE, 5), Partition((1, 1, SIZE, 1)))
    layer = Convolution(image, 2, Kernel(3, padding=1))
    layout = BlockGrid.uniform("a", Partition((SIZE,)), (3, 2))
    twice = AllReduce(layout, (0,)) @ AllReduce(layout, (0,))
    for op, together in ((layer.copy_gradient_sum, True), (twice, False)):
        state = {k: v.astype(np.float64) for k, v in op.domain.random(4, dtype=np.int64).items()}
        local = local_part(op.domain, state, RANK)
        bound = mpi_backend.plan_for(op, comm=COMM).bind(local)
        names = _call_names(bound)
        starts = [i for i, name in enumerate(names) if name == "Start"]
        if SIZE == 1:
            shape_ok = True  # a sum over one rank: no request
        elif together:
            shape_ok = len(starts) == 2 and names[starts[-1] + 1] == "Waitall" and starts[1] == starts[0] + 1
        else:
            shape_ok = len(starts) == 2 and all(names[i + 1] in ("Wait", "Waitall") for i in starts)
        wrong = bound_problem(bound, op, state, tuple(local), inplace=True)  # collective: every rank
        problem = wrong if shape_ok else f"calls {names}"
        bound.free()
        collective_assert(problem is None, f"{op}: {problem}")


def test_peer_messages_of_a_repartition_and_a_packed_box_astray_caught(monkeypatch):
    """A repartition between two grids runs as point-to-point messages with each rank's own
    peers (its bound on any rank's boxes is small), exactly equal to the tree through the
    checked apply and through a bound plan, for boxes contiguous in their block, strided with
    long runs (subarray datatypes) or with short ones (packed), as the layouts give them; a
    scatter keeps the collective (its root talks to every rank). Control: a packed box whose
    message leaves from another buffer than the one packed is caught."""
    from linop.backends.mpi.native import all_to_all, all_to_all_peers

    tensor = tensor_2d(grids()[-1], (9, 200))  # runs of 50-200 float64: packed or subarray
    for other_grid in ((1, SIZE), (SIZE, 1), tuple(reversed(tensor.partition.shape))):
        other = DistributedTensor("z", (9, 200), Partition(other_grid))
        for op in (Repartition(tensor, other), Repartition(tensor, other).H):
            plan = mpi_backend.plan_for(op, comm=COMM)
            chosen = [s.strategy for s in plan.schedule if hasattr(s, "strategy")]
            collective_assert(chosen == ["peers"], f"{op}: chose {chosen}")
            state = op.domain.random(4, dtype=np.int64)
            names = tuple(b.name for b in op.range if b.worker == RANK)
            problem = same_blocks(plan.apply(local_part(op.domain, state, RANK)), op(state), names)
            floats = {k: v.astype(np.float64) for k, v in state.items()}
            bound = plan.bind(local_part(op.domain, floats, RANK))
            problem = problem or bound_problem(bound, op, floats, names, inplace=False)
            bound.free()
            collective_assert(problem is None, f"{op}: {problem}")
    from linop import Block

    root = Block("r", (9, 7), worker=0)
    scatter = Scatter(root, tensor_2d(grids()[-1], (9, 7)))
    chosen = [s.strategy for s in mpi_backend.plan_for(scatter, comm=COMM).schedule if hasattr(s, "strategy")]
    collective_assert(chosen and chosen[0] in ("packed", "subarray"), f"the scatter chose {chosen}")
    if SIZE == 1:
        return  # no message: the rank's own box is a local copy
    real = all_to_all_peers._box_spec

    def astray(block, start, shape, dtype):  # a packed box's message from another buffer
        spec, buffer = real(block, start, shape, dtype)
        return ([np.zeros_like(buffer), spec[1], spec[2]] if buffer is not None else spec), buffer

    monkeypatch.setattr(all_to_all, "ALLTOALL_STRATEGY", "peers")
    monkeypatch.setattr(all_to_all_peers, "_box_spec", astray)
    rows = DistributedTensor("x", (9, 7), Partition((SIZE, 1)))
    op = Repartition(rows, DistributedTensor("z", (9, 7), Partition((1, SIZE))))  # thin sends: packed
    state = op.domain.random(6, dtype=np.int64)
    names = tuple(b.name for b in op.range if b.worker == RANK)
    result = mpi_backend.apply(op, local_part(op.domain, state, RANK), comm=COMM)
    caught = same_blocks(result, op(state), names) is not None
    collective_assert(any(COMM.allgather(caught)), "a packed box sent from the wrong buffer went unnoticed")


def test_independent_sum_reduces_out_of_place_are_in_flight_together():
    """A layer's parameter gradients summed onto their owners (the adjoint of its parameter
    movement: a sum-reduce of the weight copies, one of the bias copies) bound out of place
    starts both persistent requests, then waits for them together, and equals the tree
    exactly (integer values in float64, two calls, inputs unchanged). The control: a
    broadcast of a sum-reduce's result (reading what the sum fills) started on the root after
    the sum is waited for, also exact."""
    from linop.layers import Convolution

    image = DistributedTensor("c", (2, 3, 4 * SIZE, 5), Partition((1, 1, SIZE, 1)))
    layer = Convolution(image, 2, Kernel(3, padding=1))
    total = DistributedTensor("t", (3, 2), Partition((1, 1)))
    spread = Broadcast(total, Partition((SIZE, 1)), "s")
    chained = spread @ spread.H
    for op, together in ((layer.parameter_movement.H, True), (chained, False)):
        state = {k: v.astype(np.float64) for k, v in op.domain.random(5, dtype=np.int64).items()}
        local = local_part(op.domain, state, RANK)
        bound = mpi_backend.plan_for(op, comm=COMM).bind(local, inplace=False)
        names = _call_names(bound) if bound.persistent else []  # one rank: nothing to compile
        starts = [i for i, name in enumerate(names) if name == "Start"]
        if SIZE == 1 or not together:
            # the sum's root waits for it before broadcasting it; the other ranks read nothing
            # it fills, and may start the broadcast while the sum is in flight
            shape_ok = RANK != 0 or all(names[i + 1] in ("Wait", "Waitall") for i in starts)
        else:
            shape_ok = len(starts) == 2 and starts[1] == starts[0] + 1 and names[starts[1] + 1] == "Waitall"
        names_out = tuple(name for name in op.range.names if op.range.block(name).worker == RANK)
        wrong = bound_problem(bound, op, state, names_out, inplace=False)  # collective: every rank
        problem = wrong if shape_ok else f"calls {names}"
        bound.free()
        collective_assert(problem is None, f"{op}: {problem}")


@pytest.mark.parametrize("case", range(len(partitions_for_broadcast())))
def test_bound_sum_reduce_by_messages_equals_the_tree(case, monkeypatch):
    """A bound sum-reduce of a large block over a few ranks runs as messages (a reduce-scatter
    and a gather onto the root, native.reduce_messages; here every size is made large): its
    calls are ``Startall``/``Waitall`` and adds; two calls give the
    tree's results exactly (integer values in float64 and float32, uneven shares included:
    blocks of 5 and 7 x 3 entries), the inputs unchanged; ``free()`` releases its buffers. So
    do a layer's two parameter-gradient sums one after the other, and a broadcast of a sum
    (which reads what the messages fill). The control: below the size, the persistent
    ``Allreduce_init``."""
    import gc
    import weakref

    from linop.backends.mpi.native import reduce_messages
    from linop.layers import Convolution

    source, destination = partitions_for_broadcast()[case]
    image = DistributedTensor("c", (2, 3, 4 * SIZE, 5), Partition((1, 1, SIZE, 1)))
    layer = Convolution(image, 2, Kernel(3, padding=1))
    total = DistributedTensor("t", (7, 3), Partition((1, 1)))
    spread = Broadcast(total, Partition((SIZE, 1)), "s")
    trees = [Broadcast(DistributedTensor("x", (5,) * destination.ndim, source), destination, "y").H]
    if case == 0:
        trees += [spread.H, layer.parameter_movement.H, spread @ spread.H]
    for threshold, messages in ((0, True), (1 << 40, False)):
        monkeypatch.setattr(reduce_messages, "FROM_BYTES", threshold)
        for op in trees if messages else trees[:1]:
            for dtype in (np.float64, np.float32):
                state = {k: v.astype(dtype) for k, v in op.domain.random(7, dtype=np.int64).items()}
                local = local_part(op.domain, state, RANK)
                bound = mpi_backend.plan_for(op, comm=COMM).bind(local, inplace=False)
                names = _call_names(bound) if bound.persistent else []
                sums = any(len(group.ranks) > 1 for step in bound.plan.schedule for group in _groups(step))
                if not sums or not bound.persistent:  # one rank; a root without a copy: declined
                    shape_ok = True
                elif messages:
                    shape_ok = "Startall" in names and "add" in names
                else:  # a persistent collective's Start, no messages
                    shape_ok = "Start" in names and "Startall" not in names and "add" not in names
                out = tuple(name for name in op.range.names if op.range.block(name).worker == RANK)
                wrong = bound_problem(bound, op, state, out, inplace=False)  # collective: every rank
                problem = wrong if shape_ok else f"calls {names}"
                scratch = [weakref.ref(a) for a in bound._scratch]
                bound.free()
                gc.collect()
                alive = sum(ref() is not None for ref in scratch)
                problem = problem or (f"{alive} scratch arrays alive after free()" if alive else None)
                collective_assert(
                    problem is None, f"{op} ({np.dtype(dtype).name}, messages {messages}): {problem}"
                )


def _groups(step) -> list:
    """The rooted groups of a schedule step (none for other steps)."""
    part = getattr(step, "part", None)
    return list(getattr(part, "groups", ()))
