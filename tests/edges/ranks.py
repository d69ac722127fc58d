"""One rank of the framework-edge table (``tests/test_framework_edges.py``): ``python ranks.py
RANK SIZE PORT OUT``. Joins a gloo group of SIZE processes (rendezvous on 127.0.0.1:PORT,
60 s), makes each mistake of :data:`CASES` in order through linop's differentiable wrappers
(torch ``function``, ``OperatorModule``, ``LayerModule``, the DTensor bridge) and the executor,
and appends what it raised (``TypeName: message``, or ``ok``) to ``OUT/rank<RANK>.jsonl``, one
line per case, as it goes. The last case ends rank 1's process after a reported error of its
own: rank 0, waiting for it in an entry check, must name it."""

from __future__ import annotations

import datetime
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from linop import DistributedTensor, Kernel, Partition, Redistribute
from linop.backends import torch_distributed as td
from linop.frameworks.dtensor import redistribute, redistribute_local, to_dtensor
from linop.frameworks.torch_function import OperatorModule, function
from linop.frameworks.torch_layers import LayerModule
from linop.layers import Convolution
from linop.mesh_layout import MeshLayout, Shard

RANK, SIZE, PORT, OUT = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])


def rows(workers: int, length: int, name: str = "a") -> MeshLayout:
    """``length`` x 4 by rows on ``workers`` workers (torch.chunk sizes)."""
    return MeshLayout.from_placements((workers,), [Shard(0)], (length, 4), name=name)


def tree(workers: int, length: int) -> Redistribute:
    """Rows to columns of a ``length`` x 4 on ``workers`` workers: one block per worker."""
    source = rows(workers, length)
    return Redistribute(source, source.with_placements([Shard(1)], name="b"))


def own(op: Redistribute, rank: int = RANK) -> dict[str, torch.Tensor]:
    """This rank's blocks of ``op``'s domain (ones)."""
    return {b.name: torch.ones(b.shape, dtype=torch.float64) for b in op.domain if b.worker == rank}


def convolution(workers: int) -> Convolution:
    x = DistributedTensor("x", (1, 1, 2 * workers, 4), Partition((1, 1, workers, 1)))
    return Convolution(x, 1, Kernel(3, padding=1))


SUB = None  # new_group([0]): rank 0's group of one; NON_GROUP_MEMBER on the other ranks


def mine_or(rank0: Callable[[], Any], others: Callable[[], Any]) -> Callable[[], Any]:
    return lambda: rank0() if RANK == 0 else others()


def bound_then(mistake: Callable[[Any], Any]) -> Callable[[], Any]:
    """A function bound by a first good call on every rank, then ``mistake(f)`` on every rank."""

    def run() -> Any:
        op = tree(SIZE, 6)
        f = function(op, group=True)
        f(own(op))
        return mistake(f)

    return run


def uneven_rows() -> MeshLayout:
    return MeshLayout.from_placements((SIZE,), [Shard(0)], (7, 3), {0: (1,) * (SIZE - 1) + (8 - SIZE,)})


def dtensor_mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (SIZE,))


def redistribute_to_uneven() -> Any:
    from torch.distributed.tensor import Shard as TorchShard
    from torch.distributed.tensor import distribute_tensor

    x = distribute_tensor(torch.zeros(7, 3), dtensor_mesh(), [TorchShard(1)])
    return redistribute(x, [TorchShard(0)], {0: uneven_rows().sizes[0]})


def to_uneven_dtensor() -> Any:
    layout = uneven_rows()
    return to_dtensor(torch.zeros(layout.block_of(RANK).shape), layout, dtensor_mesh())


def report_withdrawn() -> Any:
    """A rank's error of its own is recorded in the store, and withdrawn once the rank
    completes a check again (it lived on): no stale record can name it later."""
    from linop.backends.torch_distributed.check import FAILURE_KEY

    store = dist.distributed_c10d._get_default_store()
    key = FAILURE_KEY.format(rank=RANK)
    try:
        bound_then(lambda f: f.tensors())()
    except Exception:
        pass
    recorded = store.check([key])
    op = tree(SIZE, 13)
    function(op, group=True)(own(op))  # a first call: the entry check completes
    if not recorded or store.check([key]):
        raise AssertionError(f"recorded {recorded}, still there {store.check([key])}")
    return "ok"


def failed_peer() -> Any:
    """Rank 1 binds a function, then passes it a string (an error of its own, reported) and
    its process ends; rank 0 meanwhile makes the first call of another tree."""
    op = tree(SIZE, 6)
    f = function(op, group=True)
    f(own(op))
    if RANK == 0:
        other = tree(SIZE, 10)
        return function(other, group=True)(own(other))
    return f.tensors("not a tensor")  # type: ignore[arg-type]


CASES: list[tuple[str, Callable[[], Any]]] = [
    (
        "function: group smaller than the tree",
        lambda: function(tree(SIZE + 1, 9), group=True)(own(tree(SIZE + 1, 9))),
    ),
    (
        "OperatorModule: group smaller than the tree",
        lambda: OperatorModule(tree(SIZE + 1, 12), group=True)(own(tree(SIZE + 1, 12))),
    ),
    ("LayerModule: group smaller than the layer", lambda: LayerModule(convolution(SIZE + 1), group=True)),
    (
        "redistribute_local: sub-group smaller than the layouts",
        lambda: redistribute_local(torch.ones(2, 4), rows(SIZE, 2 * SIZE), [Shard(1)], group=SUB),
    ),
    ("function: this rank not in the group", lambda: function(tree(1, 3), group=SUB)),
    ("OperatorModule: this rank not in the group", lambda: OperatorModule(tree(1, 3), group=SUB)),
    ("LayerModule: this rank not in the group", lambda: LayerModule(convolution(1), group=SUB)),
    (
        "executor apply: this rank not in the group",
        mine_or(lambda: "ok", lambda: td.apply(tree(1, 3), {}, group=SUB)),
    ),
    ("function: group= not a process group", lambda: function(tree(SIZE, 4), group="world")),
    ("function: comm= and group= together", lambda: function(tree(SIZE, 4), comm=object(), group=True)),
    (
        "LayerModule: comm= and group= together",
        lambda: LayerModule(convolution(SIZE), comm=object(), group=True),
    ),
    (
        "function: a block missing on rank 1 (first call)",
        lambda: function(tree(SIZE, 5), group=True)(own(tree(SIZE, 5)) if RANK == 0 else {}),
    ),
    (
        "function: an unexpected block on rank 1 (first call)",
        lambda: function(tree(SIZE, 7), group=True)(
            {**own(tree(SIZE, 7)), **(own(tree(SIZE, 7), 0) if RANK else {})}
        ),
    ),
    (
        "function: not a dict on rank 1 (first call)",
        lambda: function(tree(SIZE, 8), group=True)(own(tree(SIZE, 8)) if RANK == 0 else [torch.ones(4, 4)]),
    ),
    (
        "function: a numpy array for a tensor on rank 1 (first call)",
        lambda: function(tree(SIZE, 14), group=True)(
            {n: t if RANK == 0 else t.numpy() for n, t in own(tree(SIZE, 14)).items()}
        ),
    ),
    (
        "function: positional tensors, one too few on rank 1 (first call)",
        lambda: function(tree(SIZE, 15), group=True).tensors(
            *own(tree(SIZE, 15)).values() if RANK == 0 else ()
        ),
    ),
    (
        "redistribute_local: a wrong local shape on rank 1",
        lambda: redistribute_local(
            torch.ones(rows(SIZE, 11).block_of(RANK).shape if RANK == 0 else (1, 4)),
            rows(SIZE, 11),
            [Shard(1)],
        ),
    ),
    ("to_dtensor: pieces that are not torch.chunk's", to_uneven_dtensor),
    ("redistribute: a DTensor result on pieces that are not torch.chunk's", redistribute_to_uneven),
    (
        "LayerModule: input blocks of another layer",
        lambda: LayerModule(convolution(SIZE), group=True)({"z": torch.ones(1)}),
    ),
    ("function: a bound call with a tensor too few", bound_then(lambda f: f.tensors())),
    ("a rank's reported error is withdrawn at its next check", report_withdrawn),
    ("function: a peer failed before the entry check", failed_peer),
]


def main() -> None:
    global SUB
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{PORT}",
        rank=RANK,
        world_size=SIZE,
        timeout=datetime.timedelta(seconds=60),
    )
    SUB = dist.new_group([0])
    with (OUT / f"rank{RANK}.jsonl").open("w") as out:
        for label, call in CASES:
            try:
                result = call()
                found = "ok"
                del result
            except Exception as error:
                found = f"{type(error).__name__}: {error}"
            out.write(json.dumps({"case": label, "raised": found}) + "\n")
            out.flush()
            print(f"rank {RANK}: {label}: {found.splitlines()[0][:100]}", flush=True)
    os._exit(0)  # the last case leaves the group unusable: no destroy_process_group


if __name__ == "__main__":
    main()
