"""Run ``checks.main()`` (or, with ``--bench``, another module's ``main()``) on K gloo processes
made by ``torch.multiprocessing.spawn``: ``python spawn.py K [module]``. The rendezvous is on
127.0.0.1 at a port this launcher holds (tests/torchdist/rendezvous.py); ``init_process_group``
has a 60 s timeout, and the launcher bounds the whole run."""

from __future__ import annotations

import datetime
import importlib
import sys
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE.parent / "torchdist"))  # rendezvous, last: no shadowing

from rendezvous import held_port  # noqa: E402


def process(rank: int, size: int, port: int, module: str) -> None:
    sys.path.insert(0, str(HERE))
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=300),  # generous: a loaded machine skews the ranks
    )
    try:
        importlib.import_module(module).main()
    finally:
        dist.destroy_process_group()


def launch(size: int, module: str = "checks") -> None:
    mp.spawn(process, args=(size, held_port(), module), nprocs=size)


if __name__ == "__main__":
    launch(int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "checks")
