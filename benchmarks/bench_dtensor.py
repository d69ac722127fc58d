"""linop's redistribute against DTensor's on 4 gloo processes, in one run:
``python benchmarks/bench_dtensor.py`` (spawns the processes; rendezvous on 127.0.0.1).

1. Time: a 4096 x 4096 float32 tensor row-sharded -> column-sharded: linop's bound plan
   (``torch_distributed.plan_for(Redistribute(rows, columns)).bind``), ``DTensor.redistribute``
   and a hand-written ``all_to_all_single`` with packing, interleaved in each sample; the time
   of a sample is the maximum over the ranks, the table shows medians and ratios.
2. Correctness: on the 21 layouts of ``tests/dtensor/cases.py`` (uneven shards, torch.chunk
   and other sizes, empty and nested shards, Replicate, Partial), the entries DTensor gets
   wrong and those linop gets wrong, forward (every case: each replica group's global array
   against the input) and backward (the cases without copies or partial sums, whose
   per-rank gradient is unique: against the exact adjoint). DTensor is given the source by
   ``DTensor.from_local`` with the global shape, and its result is read in its own layout
   (torch.chunk sizes): a wrong entry is a value that is not the input's at that place.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from statistics import median

import numpy as np
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "dtensor")]

from cases import cases  # noqa: E402

from linop import Redistribute, Repartition  # noqa: E402
from linop.backends import torch_distributed  # noqa: E402
from linop.frameworks.dtensor import redistribute_local, torch_placements  # noqa: E402
from linop.mesh_layout import MeshLayout, Partial, Replicate, Shard  # noqa: E402

N = 4096
SAMPLES = 7


def interleaved(methods: dict[str, object], samples: int) -> dict[str, list[float]]:
    """Per method, the seconds of one call in each sample, the maximum over the ranks."""
    times: dict[str, list[float]] = {name: [] for name in methods}
    for function in methods.values():
        function()  # type: ignore[operator]
    for _ in range(samples):
        for name, function in methods.items():
            dist.barrier()
            start = time.perf_counter()
            function()  # type: ignore[operator]
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[name].append(float(elapsed))
    return times


def timing(mesh: object) -> None:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Shard as TorchShard

    rank, size = dist.get_rank(), dist.get_world_size()
    rows = MeshLayout.from_placements((size,), [Shard(0)], (N, N), name="r")
    columns = rows.with_placements([Shard(1)], name="c")
    local = torch.randn(rows.block_of(rank).shape, generator=torch.Generator().manual_seed(rank))
    bound = torch_distributed.plan_for(Redistribute(rows, columns)).bind({rows.block_of(rank).name: local})
    tensors = rows.tensor("r"), columns.tensor("c")  # the same boxes as DistributedTensors
    repartition = torch_distributed.plan_for(Repartition(*tensors)).bind(
        {tensors[0].block((*rows.coordinate(rank), 0)).name: local}
    )
    x = DTensor.from_local(local, mesh, [TorchShard(0)], shape=torch.Size((N, N)), stride=(N, 1))
    width = N // size
    send = torch.empty(size, local.shape[0], width)
    receive = torch.empty_like(send)

    def hand_written() -> torch.Tensor:
        for k in range(size):  # pack: the column block of every destination, contiguous
            send[k].copy_(local[:, k * width : (k + 1) * width])
        dist.all_to_all_single(receive, send)
        return receive.reshape(N, width)  # the row blocks of every source, in order

    out = bound()[columns.block_of(rank).name]
    check = torch.equal(torch.as_tensor(out), hand_written()) and torch.equal(
        x.redistribute(mesh, [TorchShard(1)]).to_local(), hand_written()
    )
    times = interleaved(
        {
            "linop bound plan": bound,
            "linop Repartition, bound": repartition,
            "DTensor.redistribute": lambda: x.redistribute(mesh, [TorchShard(1)]).to_local(),
            "all_to_all_single + packing": hand_written,
        },
        SAMPLES,
    )
    bound.free()
    repartition.free()
    if rank == 0:
        base = median(times["all_to_all_single + packing"])
        print(
            f"\n{N}x{N} float32, Shard(0) -> Shard(1) on {size} gloo processes ({SAMPLES} samples, max over ranks)"
        )
        print(f"{'method':32s} {'median ms':>10s} {'min ms':>8s} {'vs hand':>8s} {'vs DTensor':>10s}")
        dtensor = median(times["DTensor.redistribute"])
        for name, values in times.items():
            m = median(values)
            print(f"{name:32s} {1e3 * m:10.1f} {1e3 * min(values):8.1f} {m / base:8.2f} {m / dtensor:10.3f}")
        print(f"results equal to the hand-written all-to-all: {check}")


def wrong_entries(layout: MeshLayout, blocks: dict[str, np.ndarray], data: np.ndarray) -> int:
    """Entries of ``blocks`` (all ranks', read in ``layout``) that are not ``data``'s: per
    replica group, the sum of its partial terms against the data; a block of the wrong shape
    counts whole."""
    replicate = [i for i, p in enumerate(layout.placements) if isinstance(p, Replicate)]
    wrong = 0
    groups: dict[tuple[int, ...], np.ndarray] = {}
    for c in layout.partition.indices():
        block = blocks[layout.block_name(c)]
        expected = layout.block(c).shape
        if block.shape != expected:
            wrong += int(np.prod(expected))
            continue
        key = tuple(c[i] for i in replicate)
        total = groups.setdefault(key, np.zeros(data.shape))
        start, stop = layout.box(c)
        total[tuple(slice(a, b) for a, b in zip(start, stop))] += block
    return wrong + sum(int(np.count_nonzero(total != data)) for total in groups.values())


def correctness(mesh2: dict[tuple[int, ...], object]) -> None:
    from torch.distributed.tensor import DTensor

    rank, size = dist.get_rank(), dist.get_world_size()
    rows = []
    errors: list[str] = []
    for k, (label, source, destination) in enumerate(cases(size)):
        rng = np.random.default_rng(k)
        integers = rng.integers(-99, 100, source.global_shape)
        state = {name: block.astype(np.float64) for name, block in source.scatter(integers, rng=rng).items()}
        data = integers.astype(np.float64)  # integer partial terms: every sum exact
        mine = source.block_of(rank).name
        theirs = destination.with_placements(destination.placements)  # DTensor's own sizes
        mesh = mesh2[source.mesh_shape]
        results = {}
        for who in ("DTensor", "linop"):
            local = torch.tensor(state[mine], requires_grad=True)
            if who == "DTensor":
                x = DTensor.from_local(
                    local,
                    mesh,
                    torch_placements(source),
                    shape=torch.Size(source.global_shape),
                    stride=tuple(int(np.prod(source.global_shape[d + 1 :])) for d in range(source.ndim)),
                )
                layout = theirs
                try:
                    out = x.redistribute(mesh, torch_placements(destination)).to_local()
                except RuntimeError as error:  # DTensor on sizes it does not expect: all wrong
                    errors.append(f"{label}: {who} forward raised {str(error)[:90]}")
                    out = torch.full(layout.block_of(rank).shape, float("nan"))
            else:
                out, layout = redistribute_local(local, source, destination), destination
            gathered: list[object] = [None] * size
            dist.all_gather_object(gathered, (layout.block_of(rank).name, out.detach().numpy()))
            forward = wrong_entries(layout, dict(gathered), data)  # type: ignore[arg-type]
            backward = None
            plain = not any(
                isinstance(p, (Replicate, Partial)) for p in (*source.placements, *destination.placements)
            )
            if plain:
                cotangent = {b.name: rng.integers(-9, 10, b.shape).astype(np.float64) for b in layout.blocks}
                mine_out = cotangent[layout.block_of(rank).name]
                count = torch.tensor([int(np.prod(source.block_of(rank).shape))])  # unless computed
                if tuple(out.shape) == mine_out.shape and out.requires_grad:
                    try:
                        (out * torch.from_numpy(mine_out)).sum().backward()
                    except RuntimeError as error:  # DTensor's backward on sizes it does not expect
                        errors.append(f"{label}: {who} backward raised {str(error)[:90]}")
                    else:
                        exact = Redistribute(source, layout).H(cotangent)[mine]
                        got = local.grad.numpy() if local.grad is not None else np.zeros_like(exact)
                        count = torch.tensor([int(np.count_nonzero(got != exact))])
                dist.all_reduce(count)
                backward = int(count)
            results[who] = (forward, backward)
        rows.append((label, results))
    if rank == 0:
        print(f"\nwrong entries on {len(rows)} layouts ({size} gloo processes; backward: cases without R/P)")
        print(f"{'case':44s} {'DTensor fwd':>11s} {'bwd':>6s} {'linop fwd':>9s} {'bwd':>5s}")
        totals = {"DTensor": [0, 0, 0], "linop": [0, 0, 0]}
        for label, results in rows:
            cells = []
            for who in ("DTensor", "linop"):
                forward, backward = results[who]
                totals[who][0] += forward
                totals[who][1] += backward or 0
                totals[who][2] += int(forward > 0 or bool(backward))
                cells.append((forward, "-" if backward is None else backward))
            print(f"{label:44s} {cells[0][0]:11d} {cells[0][1]!s:>6s} {cells[1][0]:9d} {cells[1][1]!s:>5s}")
        for line in errors:
            print(f"  rank 0: {line} (its entries counted wrong)")
        for who, (forward, backward, cases_wrong) in totals.items():
            print(
                f"{who}: {forward} wrong entries forward, {backward} backward, {cases_wrong} of {len(rows)} layouts wrong"
            )


def main() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    size = dist.get_world_size()
    meshes = {(size,): init_device_mesh("cpu", (size,))}
    if size == 4:
        meshes[(2, 2)] = init_device_mesh("cpu", (2, 2))
    correctness(meshes)
    timing(meshes[(size,)])


if __name__ == "__main__":
    import spawn

    spawn.launch(4, "bench_dtensor")
