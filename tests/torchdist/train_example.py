"""Run ``examples/train_spatial.py`` on K gloo processes forked from this one, as torchrun
would (its ``main`` reads ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``):
``python train_example.py K [the example's options]``. Used by
``tests/test_example_training.py``.

The processes are forked after this one has imported torch, linop, the example and
``torch._dynamo`` (which ``torch.optim`` imports on an optimizer's construction: seconds per
process on a loaded machine without bytecode caches), so each process does not import them
again. The rendezvous is on 127.0.0.1 at a port this launcher holds (``rendezvous.py``); the
example's ``--timeout`` bounds it, and the launching test bounds the whole run."""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import train_spatial
from rendezvous import held_port


def process(rank: int, size: int, port: int, argv: list[str]) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    train_spatial.main(argv)  # destroys its process group at the end
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown (see tests/torchdist/spawn.py)


if __name__ == "__main__":
    size = int(sys.argv[1])
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # torch._dynamo imported once, here
    gc.freeze()  # the forked processes' collections skip what this one imported (tests/torchdist/spawn.py)
    mp.start_processes(process, args=(size, held_port(), sys.argv[2:]), nprocs=size, start_method="fork")
