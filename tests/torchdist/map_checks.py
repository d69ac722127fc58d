"""The torch modules under a worker map on a torch.distributed group: ``python map_checks.py
K`` forks K gloo processes (rendezvous on 127.0.0.1 at a port this launcher holds,
``rendezvous.py``; 120 s timeout). Every process
builds a few cases of ``tests/module_map_cases.py`` (:data:`GROUP_CASES`) with ``group=True`` and every worker on
another rank (worker w on rank K - 1 - w), checks that it takes the blocks the map puts on its
rank and that its forward and backward equal the same module in one process; then that a map
leaving a worker out is a WorkerMapError on every process when a module is built, and maps
differing between processes a WorkerMapMismatchError at the first call. The verdicts are
agreed over the group; each process prints ``MAPS OK rank <r>`` when every check passed
everywhere. Launched by ``tests/test_torch_module_maps.py``."""

from __future__ import annotations

import datetime
import os
import sys
import traceback
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: the shared cases
import module_map_cases as cases

from linop.errors import WorkerMapError, WorkerMapMismatchError

TIMEOUT = datetime.timedelta(seconds=120)
GROUP_CASES = ("conv-overlap-replicate", "batchnorm", "loss", "interpolate", "repartition")
"""A few modules (every one runs under MPI at 1-4 ranks: tests/mpi/test_module_maps.py)."""


def _raises(error_type: type, call) -> str | None:
    try:
        call()
    except error_type:
        return None
    except Exception as error:  # reported with the others
        return f"{type(error).__name__} instead of {error_type.__name__}: {error}"
    return f"no {error_type.__name__}"


def checks(rank: int, size: int) -> list[tuple[str, str | None]]:
    ranks = cases.reversed_ranks(size)
    results = []
    for name in GROUP_CASES:
        build, exact = cases.CASES[name]
        try:
            module, got = build(size, group=True, mapping=ranks)
            problems = cases.placed(module, rank, ranks)
            expected = cases.serial_run(name, size)
            if name.startswith("batchnorm"):
                expected = cases.running_expected(got, expected)
            problems += cases.compare(got, expected, exact)
            if name == "loss" and module.is_root != (rank == ranks[module.layer.root]):
                problems.append(f"is_root {module.is_root} on rank {rank}")
            problem = "; ".join(problems) or None
        except Exception:
            problem = traceback.format_exc(limit=4)
        results.append((f"{name} reversed", problem))
    mine = ranks if rank == 0 else list(range(size))  # rank 0 alone reverses the workers
    for name in ("conv", "loss"):
        build = cases.CASES[name][0]
        short = _raises(WorkerMapError, lambda b=build: b(size, group=True, mapping=[0] * (size - 1)))
        differing = _raises(WorkerMapMismatchError, lambda b=build: b(size, group=True, mapping=mine))
        results += [(f"{name} short map", short), (f"{name} differing maps", differing)]
    return results


def process(rank: int, size: int, port: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size, timeout=TIMEOUT
    )
    try:
        results = checks(rank, size)
        gathered: list = [None] * size
        dist.all_gather_object(gathered, [(name, problem) for name, problem in results if problem])
        failures = [
            f"rank {r}: {name}: {problem}" for r, found in enumerate(gathered) for name, problem in found
        ]
        if failures:
            print("\n".join(failures), flush=True)
            raise SystemExit(1)
        print(f"MAPS OK rank {rank} ({len(results)} checks)", flush=True)
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    from rendezvous import held_port

    mp.start_processes(
        process, args=(int(sys.argv[1]), held_port()), nprocs=int(sys.argv[1]), start_method="fork"
    )
