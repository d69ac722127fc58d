"""The multi-process checks of the DTensor bridge and of lifting across a process group, run on
every rank of a gloo world by ``spawn.py``. Each check computes on every rank; failures are
counted, gathered and raised on every rank together at the end (so no rank waits for another
that failed), each named with its case."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from cases import cases

import verify
from linop import PlacementError, Redistribute
from linop.frameworks.dtensor import (
    LocalShard,
    UnevenShardError,
    chunk_layout,
    from_dtensor,
    mesh_layout,
    redistribute,
    redistribute_local,
    to_dtensor,
    torch_placements,
)
from linop.mesh_layout import MeshLayout, Partial, Replicate, Shard
from verify.lift_group import lift_group, prove_backward_group

FAILURES: list[str] = []
COUNT = [0]


def check(condition: bool, what: str) -> None:
    COUNT[0] += 1
    if not condition:
        FAILURES.append(f"rank {dist.get_rank()}: {what}")


def tensors(state: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {name: torch.from_numpy(np.asarray(a, dtype=np.float64)) for name, a in state.items()}


# -- linop's redistribute on the process group, against the numpy interpreter ------------------
def check_redistribute(label: str, source: MeshLayout, destination: MeshLayout, seed: int) -> None:
    rank = dist.get_rank()
    rng = np.random.default_rng(seed)  # the same draws on every rank
    data = rng.integers(-99, 100, source.global_shape)
    state = source.scatter(data, rng=rng)
    tree = Redistribute(source, destination)
    expected = tree(state)
    mine_in, mine_out = source.block_of(rank).name, destination.block_of(rank).name
    local = torch.tensor(state[mine_in], dtype=torch.float64, requires_grad=True)
    out = redistribute_local(local, source, destination)
    check(
        torch.equal(out.detach(), torch.from_numpy(expected[mine_out].astype(np.float64))),
        f"{label}: forward",
    )
    everything = [None] * dist.get_world_size()
    dist.all_gather_object(everything, (mine_out, out.detach().numpy()))
    check(np.array_equal(destination.gather(dict(everything)), data), f"{label}: global array")
    cotangent = {b.name: rng.integers(-9, 10, b.shape) for b in destination.blocks}
    (out * torch.from_numpy(cotangent[mine_out].astype(np.float64))).sum().backward()
    back = tree.H(cotangent)[mine_in]
    check(
        local.grad is not None and torch.equal(local.grad, torch.from_numpy(back.astype(np.float64))),
        f"{label}: backward",
    )


# -- the DTensor side ---------------------------------------------------------------------------
def check_dtensor_interop(size: int, mesh: Any) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torch.distributed.tensor import Replicate as TorchReplicate
    from torch.distributed.tensor import Shard as TorchShard

    full = torch.arange(77 * 9, dtype=torch.float64).reshape(77, 9)
    x = distribute_tensor(full, mesh, [TorchShard(0)])
    local, layout = from_dtensor(x)
    check(layout == mesh_layout(mesh, [Shard(0)], (77, 9)), "from_dtensor: the layout of a chunked DTensor")
    check(tuple(local.shape) == layout.block_of(dist.get_rank()).shape, "from_dtensor: the local shape")
    y = redistribute(x, [TorchShard(1)])
    check(torch.equal(y.full_tensor(), full), "redistribute(DTensor) S0->S1: full_tensor")
    z = redistribute(y, [TorchReplicate()])
    check(torch.equal(z.to_local(), full), "redistribute(DTensor) S1->R: the replica")
    # differentiable through DTensor's own to_local / from_local
    d = distribute_tensor(full.clone(), mesh, [TorchShard(0)]).requires_grad_()
    (redistribute(d, [TorchShard(1)]).to_local() * 2).sum().backward()
    check(
        d.grad is not None and torch.equal(d.grad.full_tensor(), torch.full_like(full, 2.0)),
        "redistribute(DTensor): gradient",
    )
    # a DTensor made by from_local on sizes that are not torch.chunk's needs sizes=
    if size > 1:
        rows = MeshLayout.from_placements((size,), [Shard(0)], (77, 9), {0: _rows(size)})
        mine = rows.block_of(dist.get_rank())
        start, stop = rows.box((dist.get_rank(),))
        # what a user builds with DTensor's own from_local: a DTensor that DTensor misreads
        uneven = DTensor.from_local(
            full[start[0] : stop[0]].clone(),
            mesh,
            [TorchShard(0)],
            run_check=False,
            shape=torch.Size((77, 9)),
            stride=(9, 1),
        )
        try:
            from_dtensor(uneven)
            raised = ""
        except PlacementError as error:
            raised = str(error)
        chunked = MeshLayout.from_placements((size,), [Shard(0)], (77, 9)).block_of(dist.get_rank())
        if chunked.shape != mine.shape:
            check(
                "tensor dimension 0" in raised and "sizes=" in raised,
                f"from_dtensor without sizes: {raised!r}",
            )
        local, layout = from_dtensor(uneven, {0: _rows(size)})
        columns = redistribute_local(local, layout, [Shard(1)])
        expected = MeshLayout.from_placements((size,), [Shard(1)], (77, 9)).box((dist.get_rank(),))
        check(
            torch.equal(columns, full[:, expected[0][1] : expected[1][1]]),
            "redistribute_local of a from_local DTensor on rows 10/30/7/30",
        )


def check_bridge_returns(size: int, mesh: Any) -> None:
    """Every DTensor the bridge returns reads back right through DTensor's own ``full_tensor()``
    (on each layout of the cases, built by ``to_dtensor`` and by ``redistribute``); a layout
    whose pieces are not torch.chunk's is refused with :class:`UnevenShardError` and stays
    local (:class:`LocalShard`)."""
    rank = dist.get_rank()
    for k, (label, source, destination) in enumerate(cases(size)):
        if source.mesh_shape != (size,) and size != 4:
            continue
        layout_mesh = mesh if source.mesh_shape == (size,) else _grid(mesh)
        rng = np.random.default_rng(100 + k)
        data = rng.integers(-99, 100, source.global_shape)
        state = source.scatter(data, rng=rng)
        full = torch.from_numpy(data.astype(np.float64))
        for layout, local_state in ((source, state), (destination, destination.scatter(data, rng=rng))):
            local = torch.from_numpy(np.asarray(local_state[layout.block_of(rank).name], dtype=np.float64))
            if chunk_layout(layout):
                made = to_dtensor(local, layout, layout_mesh)
                check(
                    torch.equal(made.full_tensor(), full), f"{label}: to_dtensor({layout.name}).full_tensor()"
                )
            else:
                try:
                    to_dtensor(local, layout, layout_mesh)
                    refused = ""
                except UnevenShardError as error:
                    refused = str(error)
                check(
                    "redistribute_local" in refused and "torch.chunk" in refused,
                    f"{label}: to_dtensor({layout.name}) refused ({refused!r})",
                )
        if not chunk_layout(source):
            continue
        x = to_dtensor(
            torch.from_numpy(np.asarray(state[source.block_of(rank).name], dtype=np.float64)),
            source,
            layout_mesh,
        )
        sizes = {d: destination.sizes[d] for d in range(len(destination.global_shape))}
        if chunk_layout(destination):
            y = redistribute(x, torch_placements(destination))
            check(torch.equal(y.full_tensor(), full), f"{label}: redistribute(DTensor).full_tensor()")
        else:
            try:
                redistribute(x, torch_placements(destination), sizes)
                refused = ""
            except UnevenShardError as error:
                refused = str(error)
            check(
                "keep it local" in refused.lower(),
                f"{label}: redistribute to uneven sizes refused ({refused!r})",
            )
            kept = LocalShard(*from_dtensor(x)).redistribute(destination)
            assert isinstance(kept, LocalShard)
            expected = Redistribute(source, destination)(state)[destination.block_of(rank).name]
            check(
                torch.equal(kept.local, torch.from_numpy(np.asarray(expected, dtype=np.float64))),
                f"{label}: LocalShard.redistribute keeps the uneven result local, exactly",
            )


_GRIDS: dict[int, Any] = {}


def _grid(mesh: Any) -> Any:
    """A 2 x 2 DeviceMesh of the 4 ranks (made once: init_device_mesh is collective)."""
    if 4 not in _GRIDS:
        from torch.distributed.device_mesh import init_device_mesh

        _GRIDS[4] = init_device_mesh("cpu", (2, 2))
    return _GRIDS[4]


def _rows(size: int) -> tuple[int, ...]:
    from cases import uneven

    return uneven(77, size)


# -- lifting across the group -----------------------------------------------------------------
class GatherRows(torch.autograd.Function):
    """A hand-written all-gather of equal row blocks; ``forget`` makes the backward forget the
    reduction (each rank keeps its own rows of its own gradient)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, forget: bool) -> torch.Tensor:  # type: ignore[override]
        ctx.forget = forget
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, local.contiguous())
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        rows = grad.shape[0] // dist.get_world_size()
        rank = dist.get_rank()
        if not ctx.forget:
            grad = grad.contiguous().clone()
            dist.all_reduce(grad)  # the sum over the copies: the adjoint of a gather
        return grad[rank * rows : (rank + 1) * rows].clone(), None


def check_lifting(size: int, mesh: Any) -> None:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Shard as TorchShard

    # DTensor's own redistribute Shard(0) -> Shard(1) of a 5 x 4 (torch.chunk sizes): proven
    rows = mesh_layout(mesh, [Shard(0)], (5, 4), name="x")
    columns = rows.with_placements([Shard(1)], name="y")

    def dtensor_redistribute(local: torch.Tensor) -> torch.Tensor:
        x = DTensor.from_local(local, mesh, [TorchShard(0)], shape=torch.Size((5, 4)), stride=(4, 1))
        return x.redistribute(mesh, [TorchShard(1)]).to_local()

    proof = prove_backward_group(dtensor_redistribute, rows.space, columns.space, label="DTensor S0->S1")
    check(bool(proof), f"lift: DTensor S0->S1 backward proven ({proof})")
    # a hand-written all-gather: proven with the reduction, refuted without, entry named
    shards = MeshLayout.from_placements((size,), [Shard(0)], (2 * size, 2), name="x").space
    gathered = MeshLayout.from_placements((size,), [Replicate()], (2 * size, 2), name="g").space
    proof = prove_backward_group(lambda t: GatherRows.apply(t, False), shards, gathered, label="all_gather")
    check(bool(proof), f"lift: all_gather with the reduction proven ({proof})")
    lifted = lift_group(
        lambda t: GatherRows.apply(t, True), shards, gathered, label="all_gather, no reduction"
    )
    proof = verify.exact_adjoint(lifted)
    if size == 1:
        check(bool(proof), "lift: on one rank nothing is forgotten")
    else:
        first = proof.mismatches[0] if proof.mismatches else None
        check(not proof, "lift: the backward that forgets the reduction is refuted")
        # x[0][0,0] is copied into every rank's g: its gradient must add g[1]'s entry (0, 0)
        check(
            first is not None
            and (
                first.row.block,
                first.row.index,
                first.column.block,
                first.column.index,
                first.left,
                first.right,
            )
            == ("x[0]", (0, 0), "g[1]", (0, 0), 0, 1),
            f"lift: the first wrong entry is named ({first})",
        )
    # linop's own redistribute (uneven, partial sums to copies) through autograd: proven
    source = MeshLayout.from_placements((size,), [Shard(0)], (5, 2), {0: (0,) * (size - 1) + (5,)}, name="a")
    destination = source.with_placements([Replicate()], name="b")
    proof = prove_backward_group(
        lambda t: redistribute_local(t, source, destination),
        source.space,
        destination.space,
        label="linop S0->R",
    )
    check(bool(proof), f"lift: linop's redistribute backward proven ({proof})")
    partial = source.with_placements([Partial()], name="b")
    proof = prove_backward_group(
        lambda t: redistribute_local(t, source, partial), source.space, partial.space, label="linop S0->P"
    )
    check(bool(proof), f"lift: linop's S0->P backward proven ({proof})")


def run_readme_blocks(size: int) -> None:
    """The README's ``# dtensor: K`` blocks for this world size, as written."""
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    blocks = [
        b for b in re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL) if b.startswith("# dtensor: ")
    ]
    check(bool(blocks), "the README has a '# dtensor: K' block")
    for block in blocks:
        if int(block.split("\n", 1)[0].split(":")[1]) == size:
            exec(compile(block, "README.md", "exec"), {})
            check(True, "the README's DTensor block ran")


def main() -> None:
    size = dist.get_world_size()
    started = time.perf_counter()
    for k, (label, source, destination) in enumerate(cases(size)):
        check_redistribute(label, source, destination, seed=k)
    timings = [("redistribute cases", time.perf_counter() - started)]
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (size,))  # one mesh (and its group) for every check
    check_dtensor_interop(size, mesh)
    timings.append(("DTensor interop", time.perf_counter() - started - sum(t for _, t in timings)))
    check_bridge_returns(size, mesh)
    timings.append(
        ("full_tensor of the bridge's DTensors", time.perf_counter() - started - sum(t for _, t in timings))
    )
    check_lifting(size, mesh)
    timings.append(("lifting", time.perf_counter() - started - sum(t for _, t in timings)))
    run_readme_blocks(size)
    timings.append(("README", time.perf_counter() - started - sum(t for _, t in timings)))
    failures: list[list[str]] = [[] for _ in range(size)]
    dist.all_gather_object(failures, FAILURES)
    found = [f for per_rank in failures for f in per_rank]
    if found:
        raise AssertionError(f"{len(found)} failed check(s):\n" + "\n".join(found))
    if dist.get_rank() == 0:
        spent = ", ".join(f"{what} {seconds:.1f} s" for what, seconds in timings)
        print(f"dtensor checks: {COUNT[0]} checks on each of {size} ranks passed ({spent})", flush=True)
