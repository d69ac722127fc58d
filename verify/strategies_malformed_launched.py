"""The fuzz campaign of the engines that need a launch (issue 41): the torch.distributed
executor and the DTensor bridge on a gloo group of 2 processes, and the JAX lowering
(:func:`linop.frameworks.jax_sharded.sharded`) on host devices, in x32 and x64. The launches
(``tests/fuzz_engines/``) draw from these strategies and judge each call with
:func:`verify.strategies_malformed_engines.classify`.

A case is drawn alike on every rank (hypothesis, derandomized: the same data, the same
draws); its call reads the rank from the process group. Hostile inputs:

- torch.distributed: a tree (send-receive, all-reduce, broadcast, sum-reduce, all-gather,
  repartition, scatter, halo exchange and its adjoint, a worker map of 3 workers on 2 ranks)
  with, on one rank or both, a block missing, extra, misshapen, of a dtype linop does not
  compute in (bool, strings, complex beside integers), a meta tensor, a leaf requiring a
  gradient written in place, integers whose sum leaves int64, a junk object; a ``mapping``
  that is junk or differs between the ranks; a junk ``timeout`` or ``group``; ``inplace``
  where domain and range differ.
- DTensor: ``redistribute_local`` between two layouts of a global array on the 2-rank mesh
  (uneven and empty pieces, ``Partial``), with this rank's local tensor misshapen, of the wrong
  dtype, a meta tensor or junk on one rank; ``redistribute`` of a DTensor to drawn placements
  (some junk, some uneven ``sizes``).
- JAX: a tree on 2 or 4 devices (1-d mesh or 2 x 2, ``axes`` in either order), integer blocks
  near their dtype's bounds (int8, uint8, int16, int32, int64), floats, bool, strings, a
  missing or misshapen block, junk ``axes`` and ``workers``.

The verdict of every call is the same on every rank: exact (gathered results equal the numpy
interpreter's, integers compared as Python integers), or the same typed error; the caller's
arrays unchanged when not in place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from hypothesis import strategies as st

import linop
from linop import Block, DistributedTensor, Kernel, Partition, Space

from .strategies_malformed import Call, FuzzFailure, check_against_matrix, junk, show_arguments

__all__ = ["group_cases", "jax_cases", "BLOCK_FORMS"]


def _trees_2() -> dict[str, linop.LinearOperator]:
    """Trees on workers 0 and 1 (and one on 3 workers, for a worker map onto 2 ranks)."""
    from linop.collectives import AllGather, AllReduce, BlockGrid, Broadcast, SumReduce
    from linop.repartition import Repartition, Scatter

    space = Space([Block("a", (4,), 0), Block("b", (4,), 1)])
    halo = linop.HaloExchange(
        linop.halo_geometry(DistributedTensor("t", (7,), Partition((2,))), Kernel(3, padding=1))
    )
    w = DistributedTensor("w", (3, 2), Partition.grid((1, 1)))
    three = Space([Block("p", (2,), 0), Block("q", (3,), 1), Block("s", (2,), 2)])
    return {
        "send-receive": linop.SendRecv(space["a"][0:2], space["b"][2:4]),
        "all-reduce": AllReduce(BlockGrid.uniform("r", Partition((2,)), (3,)), (0,)),
        "broadcast": Broadcast(w, Partition.grid((2, 1)), "w_copy"),
        "sum-reduce": SumReduce(w, Partition.grid((2, 1)), "w_copy"),
        "all-gather": AllGather(DistributedTensor("g", (5, 2), Partition((2, 1))), (0,), "g_all"),
        "repartition": Repartition(
            DistributedTensor("x", (5, 3), Partition((2, 1))),
            DistributedTensor("z", (5, 3), Partition((1, 2))),
        ),
        "scatter": Scatter(Block("root", (5,), 1), DistributedTensor("sc", (5,), Partition((2,)))),
        "halo": halo,
        "halo adjoint": halo.H,
        "three workers": linop.Move(three["p"], three["s"]) + linop.Copy(three["q"][0:2], three["p"]),
    }


BLOCK_FORMS = (
    "int64",
    "float64",
    "float32",
    "uint8 near 255",
    "int64 near 2**62",
    "missing",
    "extra",
    "misshapen",
    "bool",
    "strings",
    "complex",
    "meta",
    "requires_grad",
    "non-contiguous",
    "numpy",
    "junk",
)
"""What a rank passes as one of its blocks (``int64``, ``float64``: honest)."""


def _block(form: str, values: np.ndarray, junk_value: Any) -> Any:
    """One block of the state in ``form``, holding ``values`` (small integers)."""
    import torch

    if form == "numpy":
        return values.astype(np.int64)
    if form == "junk":
        return junk_value
    if form == "uint8 near 255":
        return torch.from_numpy((250 + np.abs(values) % 6).astype(np.uint8))
    if form == "int64 near 2**62":
        return torch.from_numpy((values.astype(np.int64) + 2**62).astype(np.int64))
    if form == "misshapen":
        return torch.zeros(values.size + 1, dtype=torch.int64)
    if form == "bool":
        return torch.from_numpy(values % 2 == 0)
    if form == "strings":
        return np.full(values.shape, "w")
    if form == "complex":
        return torch.from_numpy(values.astype(np.complex128) * 1j)
    if form == "meta":
        return torch.empty(values.shape, dtype=torch.float64, device="meta")
    if form == "requires_grad":
        return torch.from_numpy(values.astype(np.float64)).requires_grad_(True)
    if form == "non-contiguous":
        return torch.from_numpy(np.repeat(values.astype(np.int64), 2))[::2].reshape(values.shape)
    dtype = {"int64": np.int64, "float64": np.float64, "float32": np.float32}[form]
    return torch.from_numpy(values.astype(dtype))


def _numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):
        return value.detach().cpu().numpy()
    return np.asarray(value)


def _gathered(item: Any) -> list[Any]:
    import torch.distributed as dist

    everything: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everything, item)
    return everything


@st.composite
def _executor_cases(draw: st.DrawFn) -> Call:
    """``torch_distributed.apply`` on the 2-rank group with hostile blocks on one rank or both,
    hostile ``mapping`` / ``timeout`` / ``group`` alike on both, ``inplace`` either way."""
    import torch.distributed as dist

    from linop.backends import torch_distributed as td

    trees = _trees_2()
    name = draw(st.sampled_from(sorted(trees)))
    op = trees[name]
    honest = draw(st.booleans())
    # one thing hostile at a time (a junk timeout is refused before any block is looked at)
    attack = (
        "none"
        if honest
        else draw(st.sampled_from(["block", "block", "block", "mapping", "timeout", "group"]))
    )
    victims = draw(st.sampled_from([(0,), (1,), (0, 1)]))
    form = draw(st.sampled_from(BLOCK_FORMS)) if attack == "block" else "int64"
    honest_form = draw(st.sampled_from(["int64", "float64"]))
    junk_value = draw(junk())
    two_ranks = name != "three workers"
    mapping_kind = (
        draw(st.sampled_from(["junk", "differs", "valid list"])) if attack == "mapping" else "default"
    )
    mapping: Any = None if two_ranks else [0, 1, 1]
    if mapping_kind == "junk":
        mapping = draw(junk())
    elif mapping_kind == "valid list":
        mapping = [0, 1] if two_ranks else {0: 0, 1: 1, 2: 1}
    timeout: Any = (
        draw(st.sampled_from([None, 60, 1e300, float("inf")]) | junk()) if attack == "timeout" else 60
    )
    group: Any = draw(junk().filter(lambda v: v is not None)) if attack == "group" else None
    inplace = draw(st.booleans())
    seed = draw(st.integers(0, 99))
    description = show_arguments(
        name,
        form,
        victims=victims,
        mapping=mapping if mapping_kind != "differs" else "differs",
        timeout=timeout,
        group=group,
        inplace=inplace,
        honest_form=honest_form,
    )

    def run() -> Any:
        rank = dist.get_rank()
        ranks = [0, 1] if two_ranks else [0, 1, 1]
        mine_mapping = mapping
        if mapping_kind == "differs":
            mine_mapping = (
                ([0, 1] if rank == 0 else [1, 0]) if two_ranks else ([0, 1, 1] if rank == 0 else [0, 0, 1])
            )
        rng = np.random.default_rng(seed)
        values = {b.name: rng.integers(-9, 10, b.shape) for b in op.domain}
        state: dict[str, Any] = {}
        for block in op.domain:
            if ranks[block.worker] != rank:
                continue
            chosen = form if rank in victims else honest_form
            if chosen == "missing":
                continue
            if chosen == "extra":
                state[block.name] = _block(honest_form, values[block.name], junk_value)
                state["extra"] = _block(honest_form, values[block.name], junk_value)
                continue
            state[block.name] = _block(chosen, values[block.name], junk_value)
        if not state and rank in victims and form == "extra":
            state["extra"] = _block(honest_form, np.zeros(2, np.int64), junk_value)
        before = _copies(state)
        result = td.apply(op, state, group=group, mapping=mine_mapping, timeout=timeout, inplace=inplace)
        # success: every rank's result, gathered, is the numpy interpreter's on every rank's input
        everything = _gathered((before, {n: _numpy(v) for n, v in result.items()}))
        global_in = {n: a for ins, _ in everything for n, a in ins.items()}
        global_out = {n: a for _, outs in everything for n, a in outs.items()}
        if set(global_in) != set(op.domain.names) or set(global_out) != set(op.range.names):
            raise FuzzFailure(f"blocks {sorted(global_in)} in, {sorted(global_out)} out: not the tree's")
        check_against_matrix(op, global_in, global_out, None)
        if not inplace:
            for n, array in before.items():
                if not np.array_equal(_numpy(state[n]), array):
                    raise FuzzFailure(f"rank {rank}: block {n!r} of the caller changed")
        return result

    return Call(f"torch.distributed apply ({name})", run, description)


def _copies(state: dict[str, Any]) -> dict[str, np.ndarray]:
    """Copies of the blocks of ``state`` that hold values (not meta tensors, not junk), taken
    before the call: the reference input, whatever an in-place call writes."""
    copies = {}
    for name, value in state.items():
        if str(getattr(value, "device", "")) == "meta":
            continue
        try:
            copies[name] = np.array(_numpy(value))
        except Exception:  # junk that no array holds: the call must refuse it
            continue
    return copies


@st.composite
def _bridge_cases(draw: st.DrawFn, dtensors: bool) -> Call:
    """``redistribute_local`` between two layouts on the mesh of 2 ranks (torch.chunk pieces,
    uneven, empty, ``Partial``), this rank's local tensor hostile on a victim rank; or
    ``redistribute`` of a DTensor to drawn placements and sizes."""
    import torch
    import torch.distributed as dist

    from linop.frameworks import dtensor
    from linop.mesh_layout import MeshLayout, Partial, Replicate, Shard

    placement = st.sampled_from([Shard(0), Shard(1), Replicate(), Partial()])
    rows, columns = draw(st.integers(0, 5)), draw(st.integers(1, 3))

    def sizes_for(chosen: Any) -> Any:
        if not isinstance(chosen, Shard) or chosen.dim != 0 or draw(st.booleans()):
            return None
        first = draw(st.integers(0, rows))
        return {0: (first, rows - first)}

    source_placement, destination_placement = draw(placement), draw(placement)
    source_sizes, destination_sizes = sizes_for(source_placement), sizes_for(destination_placement)
    kind = draw(st.sampled_from(["local", "local", "dtensor"] if dtensors else ["local"]))
    honest = draw(st.booleans())
    form = (
        "float64"
        if honest
        else draw(st.sampled_from(["misshapen", "int64", "bool", "meta", "junk", "transposed", "float32"]))
    )
    victim = draw(st.sampled_from([0, 1]))
    # numpy values pass the group's check, then the wrapper refuses them on this rank alone and
    # the peer waits (reported): junk without a shape only
    junk_value = draw(junk().filter(lambda v: not isinstance(v, np.ndarray | np.generic)))
    junk_placements = (
        None if honest else draw(st.sampled_from([None, ["S"], [Shard(2)], [], [Shard(0), Shard(0)]]))
    )
    seed = draw(st.integers(0, 99))
    description = show_arguments(
        kind,
        (rows, columns),
        str(source_placement),
        str(destination_placement),
        form,
        victim=victim,
        sizes=(source_sizes, destination_sizes),
        placements=junk_placements,
    )

    def run() -> Any:
        rank = dist.get_rank()
        # a tree of its own per call (the same on both ranks, which draw the same calls): a
        # later call of a cached wrapper skips the entry check, so a local refusal there leaves
        # the peer waiting in the data movement (reported; bound plans have no per-call check)
        _CALLS.append(None)
        a, b = f"a{len(_CALLS)}", f"b{len(_CALLS)}"
        source = MeshLayout.from_placements((2,), [source_placement], (rows, columns), source_sizes, name=a)
        destination = MeshLayout.from_placements(
            (2,), [destination_placement], (rows, columns), destination_sizes, name=b
        )
        rng = np.random.default_rng(seed)
        data = rng.integers(-9, 10, (rows, columns))
        state = source.scatter(data, rng=rng)
        mine = state[source.block_of(rank).name]
        local: Any = torch.from_numpy(mine.astype(np.float64))
        if form in ("int64", "bool", "float32"):  # on every rank: a dtype differing between the ranks
            local = torch.from_numpy(mine).to(getattr(torch, form))  # hangs torch_function (reported)
        elif rank == victim:
            if form == "misshapen":
                local = torch.zeros(mine.shape[0] + 1, columns, dtype=torch.float64)
            elif form == "transposed":
                local = local.T if mine.shape[0] != columns else torch.zeros(columns + 1, 1)
            elif form == "meta":
                local = torch.empty(mine.shape, dtype=torch.float64, device="meta")
            elif form == "junk":
                local = junk_value
        kept = (
            _numpy(local).copy() if isinstance(local, torch.Tensor) and local.device.type != "meta" else None
        )
        if kind == "dtensor":
            mesh = _device_mesh()
            # to_dtensor is local (no collective): built from the true piece on every rank, so
            # that no rank goes on to a collective its peer never reaches; the hostile part of
            # this kind is the placements and sizes asked of redistribute
            x = dtensor.to_dtensor(torch.from_numpy(mine.astype(np.float64)), source, mesh)
            target = junk_placements if junk_placements is not None else [destination_placement]
            out = dtensor.redistribute(x, target, destination_sizes, source_sizes=source_sizes)
            result = out.to_local()
            got_layout = dtensor.mesh_layout(
                mesh, out.placements, (rows, columns), destination_sizes, name="b"
            )
        else:
            result = dtensor.redistribute_local(local, source, destination)
            got_layout = destination
        if kept is not None and not np.array_equal(_numpy(local), kept):
            raise FuzzFailure(f"rank {rank}: the caller's local tensor changed")
        pieces = dict(_gathered((got_layout.block_of(rank).name, _numpy(result).astype(np.int64))))
        if not np.array_equal(got_layout.gather(pieces), data):
            raise FuzzFailure(f"redistributed {got_layout.gather(pieces).tolist()} is not {data.tolist()}")
        return result

    return Call(f"DTensor bridge ({kind})", run, description)


_MESHES: list[Any] = []
_CALLS: list[None] = []  # the bridge's calls so far in this process


def _device_mesh() -> Any:
    """The DeviceMesh of the world's 2 ranks, made once (each mesh made is kept by torch)."""
    if not _MESHES:
        from torch.distributed.device_mesh import init_device_mesh

        _MESHES.append(init_device_mesh("cpu", (2,)))
    return _MESHES[0]


def group_cases(dtensors: bool = True) -> st.SearchStrategy[Call]:
    """One case of the 2-rank gloo launch: the executor (two thirds) or the DTensor bridge
    (``dtensors``: DTensors too, not only local tensors and their layouts; the first DTensor
    costs each process about 2 s of CPU, importing ``torch.distributed.tensor``)."""
    return st.one_of(_executor_cases(), _executor_cases(), _bridge_cases(dtensors))


# -- JAX ------------------------------------------------------------------------------------------
def _jax_trees(devices: int) -> dict[str, linop.LinearOperator]:
    from linop.collectives import AllReduce, BlockGrid, Broadcast, SumReduce
    from linop.repartition import Repartition

    tensor = DistributedTensor("t", (7,), Partition((2,)))
    windows = linop.halo_windows(DistributedTensor("u", (7,), Partition((2,))), Kernel(3, padding=1))
    w = DistributedTensor("w", (3, 2), Partition.grid((1, 1)))
    space = Space([Block("a", (4,), 0), Block("b", (4,), 1)])
    trees: dict[str, linop.LinearOperator] = {
        "send-receive": linop.SendRecv(space["a"][0:2], space["b"][2:4]),
        "all-reduce": AllReduce(BlockGrid.uniform("r", Partition((devices,)), (3,)), (0,)),
        "broadcast": Broadcast(w, Partition.grid((devices, 1)), "w_copy"),
        "sum-reduce": SumReduce(w, Partition.grid((devices, 1)), "w_copy"),
        "halo": linop.HaloExchange(linop.halo_geometry(tensor, Kernel(3, padding=1))),
        "uneven windows w.H @ w": windows.H @ windows,
        "repartition": Repartition(
            DistributedTensor("x", (5, 3), Partition((2, 1))),
            DistributedTensor("z", (5, 3), Partition((1, 2))),
        ),
    }
    if devices == 4:
        trees["2x2 repartition"] = Repartition(
            DistributedTensor("X", (4, 5), Partition((2, 2))),
            DistributedTensor("Y", (4, 5), Partition((1, 4))),
        )
    return trees


JAX_FORMS = (
    "int8 near 127",
    "uint8 near 255",
    "int16 near 2**15",
    "int32 near 2**30",
    "int64 near 2**40",
    "int64",
    "float32",
    "float64",
    "jax int32",
    "bool",
    "strings",
    "missing",
    "misshapen",
    "junk",
)


def _jax_block(form: str, values: np.ndarray, junk_value: Any) -> Any:
    import jax.numpy as jnp

    bounds = {
        "int8 near 127": (np.int8, 120),
        "uint8 near 255": (np.uint8, 250),
        "int16 near 2**15": (np.int16, 2**15 - 10),
        "int32 near 2**30": (np.int32, 2**30 + 5),
        "int64 near 2**40": (np.int64, 2**40 + 3),
    }
    if form in bounds:
        dtype, top = bounds[form]
        return (top - np.abs(values) % 5).astype(dtype)
    if form == "junk":
        return junk_value
    if form == "misshapen":
        return np.zeros(values.size + 1, np.int64)
    if form == "bool":
        return values % 2 == 0
    if form == "strings":
        return np.full(values.shape, "w")
    if form == "jax int32":
        return jnp.asarray(values.astype(np.int32))
    return values.astype({"int64": np.int64, "float32": np.float32, "float64": np.float64}[form])


@st.composite
def _jax_case(draw: st.DrawFn, devices: int) -> Call:
    """``sharded(op, mesh, axes=, workers=).blocks(state)`` with hostile blocks and options."""
    import jax
    from jax.sharding import Mesh

    from linop.frameworks.jax_sharded import sharded

    trees = _jax_trees(devices)
    name = draw(st.sampled_from(sorted(trees)))
    op = trees[name]
    workers_used = 1 + max(b.worker for b in op.domain)
    honest = draw(st.booleans())
    form = draw(
        st.sampled_from(["int64", "float64", "int32 near 2**30", "int8 near 127"] if honest else JAX_FORMS)
    )
    victim = draw(st.sampled_from(sorted({b.name for b in op.domain})))
    every_block = draw(st.booleans())
    junk_value = draw(junk())
    grid = name == "2x2 repartition"
    axes_kind = draw(
        st.sampled_from(["none", "in order", "reversed"] + ([] if honest else ["junk", "missing axis"]))
    )
    axes: Any = None
    if axes_kind == "in order":
        axes = ("r", "c") if grid else ("d",)
    elif axes_kind == "reversed":
        axes = ("c", "r") if grid else ["d"]
    elif axes_kind == "junk":
        axes = draw(junk())
    elif axes_kind == "missing axis":
        axes = ("q",)
    workers_kind = draw(
        st.sampled_from(["none"] if honest else ["none", "none", "junk", "too few", "identity"])
    )
    workers: Any = None
    if workers_kind == "junk":
        workers = draw(junk())
    elif workers_kind == "too few":
        workers = {0: 0}
    elif workers_kind == "identity":
        workers = list(range(workers_used))
    seed = draw(st.integers(0, 99))
    description = show_arguments(
        name, form, victim=victim if not every_block else "every block", axes=axes, workers=workers
    )

    def run() -> Any:
        shape = (2, 2) if grid else (devices,)
        mesh = Mesh(np.array(jax.devices()[:devices]).reshape(shape), ("r", "c") if grid else ("d",))
        rng = np.random.default_rng(seed)
        values = {b.name: rng.integers(-9, 10, b.shape) for b in op.domain}
        state: dict[str, Any] = {}
        for block in op.domain:
            chosen = form if (every_block or block.name == victim) else "int64"
            if chosen != "missing":
                state[block.name] = _jax_block(chosen, values[block.name], junk_value)
        kept = {n: np.array(v) for n, v in state.items() if isinstance(v, np.ndarray)}
        result = sharded(op, mesh, axes=axes, workers=workers).blocks(state)
        for n, array in kept.items():
            if not np.array_equal(np.asarray(state[n]), array):
                raise FuzzFailure(f"block {n!r} of the caller changed")
        inputs = {n: np.asarray(v) for n, v in state.items()}
        got = {n: np.asarray(result[n]) for n in op.range.names}
        integers = all(a.dtype.kind in "iu" for a in inputs.values())
        if integers:
            wrong = [n for n, a in got.items() if a.dtype.kind not in "iu"]
            if wrong:
                raise FuzzFailure(f"integer blocks gave {got[wrong[0]].dtype} for {wrong[0]!r}")
        check_against_matrix(op, inputs, got, np.float32 if not integers else None)
        return result

    return Call(f"JAX sharded ({name})", run, description)


def jax_cases(devices: int) -> st.SearchStrategy[Call]:
    """One call of the JAX lowering on the first ``devices`` host devices (2 or 4)."""
    return _jax_case(devices)


ENTRY_POINTS: dict[str, Callable[..., st.SearchStrategy[Call]]] = {
    "torch.distributed and DTensor (2 ranks)": group_cases,
    "JAX lowering": jax_cases,
}
