"""Run the checks of ``checks.py`` on K gloo processes made by ``torch.multiprocessing`` (forked
from this one, which imports torch, linop and the checks first; spawned under NCCL):
``python spawn.py K [--nccl] [--dtensor]`` (``--nccl``: the NCCL backend, one CUDA device per
process, the blocks as CUDA tensors: the executor's device path; ``--dtensor``: then the checks
of ``tests/dtensor/checks.py`` on the same processes and group, so that the suite starts one
world of K processes for both).
The rendezvous is on 127.0.0.1 at a port this launcher holds (``rendezvous.py``); ``init_process_group`` has a 60 s
timeout, and the launcher test bounds the whole run."""

from __future__ import annotations

import datetime
import gc
import importlib.util
import os
import sys
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rendezvous import held_port


def dtensor_checks() -> None:
    """Run ``tests/dtensor/checks.py`` (loaded as ``dtensor_checks``: ``checks`` is ours)."""
    folder = Path(__file__).resolve().parent.parent / "dtensor"
    sys.path.insert(1, str(folder))  # its ``cases``, after ours
    spec = importlib.util.spec_from_file_location("dtensor_checks", folder / "checks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["dtensor_checks"] = module
    spec.loader.exec_module(module)
    module.main()


def process(rank: int, size: int, port: int, backend: str, dtensor: bool = False) -> None:
    if backend == "nccl":  # pragma: no cover - needs a GPU
        import torch

        torch.cuda.set_device(rank % torch.cuda.device_count())
        os.environ["LINOP_CHECKS_DEVICE"] = f"cuda:{torch.cuda.current_device()}"
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=300),  # generous: a loaded machine skews the ranks
    )
    finale = os.environ.get("LINOP_CHECKS_FINALE")
    try:
        import checks

        checks.main()
        if dtensor:
            dtensor_checks()
        if finale:  # the group is unusable afterwards: leave without shutting it down
            checks.FINALES[finale]()
            sys.stdout.flush()
            os._exit(0)
    finally:
        if not finale:
            dist.destroy_process_group()
    # every check passed and the group is destroyed: leave without the interpreter's teardown,
    # which torch's own threads once aborted (a 1-process launch in CI: "terminate called
    # without an active exception", SIGABRT, after CHECKS OK; linop starts no threads)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    size = int(sys.argv[1])
    backend = "nccl" if "--nccl" in sys.argv else "gloo"
    dtensor = "--dtensor" in sys.argv
    method = "spawn"  # a forked process cannot use CUDA
    if backend == "gloo":
        # forked, the processes start with what this one imported (torch, linop and the checks;
        # DTensor's torch.distributed.tensor) instead of each importing it again: 2-4 s of CPU
        # per process. Nothing here has started a thread or a process group yet.
        import checks  # noqa: F401

        if dtensor:
            import torch.distributed.tensor  # noqa: F401
        method = "fork"
        # what this process imported is frozen out of the garbage collector: a forked process's
        # collections neither walk it nor write to its pages (each write copies a page of this
        # one): about 10 % of the 4-process launch's CPU (21 s -> 19 s)
        gc.freeze()
    mp.start_processes(process, args=(size, held_port(), backend, dtensor), nprocs=size, start_method=method)
