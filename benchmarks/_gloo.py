"""Launching a torch.distributed (gloo) benchmark on this machine: under ``torchrun`` (its
environment: ``--master-addr 127.0.0.1``) or as K local processes whose rendezvous is a free
port of the loopback address, each process bounded by a 300 s process-group timeout."""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Callable

TIMEOUT = datetime.timedelta(seconds=300)


def _process(rank: int, size: int, port: int, main: Callable[[], None]) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size, timeout=TIMEOUT
    )
    try:
        main()
    finally:
        dist.destroy_process_group()


def launch(main: Callable[[], None], processes: int = 4, *, start_method: str = "spawn") -> None:
    """Run ``main`` on every process of a gloo group: this one and its peers under ``torchrun``
    (``RANK`` in the environment), else ``processes`` new ones (``start_method``: ``spawn``, or
    ``fork`` to share what this process imported) meeting on a free port of 127.0.0.1."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if "RANK" in os.environ:
        dist.init_process_group("gloo", timeout=TIMEOUT)
        try:
            main()
        finally:
            dist.destroy_process_group()
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_process, args=(processes, port, main), nprocs=processes, start_method=start_method)
