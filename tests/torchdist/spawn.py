"""Run the checks of ``checks.py`` on K gloo processes made by ``torch.multiprocessing.spawn``:
``python spawn.py K [--nccl]`` (``--nccl``: the NCCL backend, one CUDA device per process, the
blocks as CUDA tensors: the executor's device path).
The rendezvous is on 127.0.0.1 at a free port picked here; ``init_process_group`` has a 60 s
timeout, and the launcher test bounds the whole run."""

from __future__ import annotations

import datetime
import socket
import sys
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def process(rank: int, size: int, port: int, backend: str) -> None:
    if backend == "nccl":  # pragma: no cover - needs a GPU
        import os

        import torch

        torch.cuda.set_device(rank % torch.cuda.device_count())
        os.environ["LINOP_CHECKS_DEVICE"] = f"cuda:{torch.cuda.current_device()}"
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=60),
    )
    import os

    finale = os.environ.get("LINOP_CHECKS_FINALE")
    try:
        import checks

        checks.main()
        if finale:  # the group is unusable afterwards: leave without shutting it down
            checks.FINALES[finale]()
            sys.stdout.flush()
            os._exit(0)
    finally:
        if not finale:
            dist.destroy_process_group()


if __name__ == "__main__":
    size = int(sys.argv[1])
    backend = "nccl" if "--nccl" in sys.argv else "gloo"
    mp.spawn(process, args=(size, free_port(), backend), nprocs=size)
