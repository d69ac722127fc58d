"""A rendezvous whose port cannot be taken before it is used: the launcher hosts the store.

Picking a free port (bind to port 0, read it, close) and letting rank 0 bind it seconds later,
once its process has started and imported torch, races with every other process on the machine
that binds a port meanwhile: gloo's own connections take ports from the same range (seen once
on the loaded machine: ``EADDRINUSE`` at rank 0's store, the launch failed). :func:`held_port`
binds the port first and keeps it: the launcher process hosts the ``TCPStore`` itself, and
``TORCHELASTIC_USE_AGENT_STORE`` (as ``torchrun``'s agent sets it) makes every process's
``tcp://127.0.0.1:PORT`` rendezvous a client of it, rank 0 included. The processes inherit the
variable (forked or spawned); the store lives until the launcher exits.
"""

from __future__ import annotations

import os

from torch.distributed import TCPStore

_HELD: list[TCPStore] = []


def held_port() -> int:
    """The port of a store this process hosts on 127.0.0.1 for the processes it starts."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    _HELD.append(store)
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    return int(store.port)
