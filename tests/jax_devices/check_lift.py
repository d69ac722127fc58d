"""``verify.lift_jax`` on a user's own ``shard_map`` functions (run by check_lowering.py for the
count 4, in its process, on its mesh over the first 4 devices): a hand-written periodic ``ppermute`` halo exchange is proven with
JAX's own transpose, refuted with a ``custom_vjp`` that re-applies the forward (naming the
entry), and linop's lowering is proven with its transpose by ``op.H``."""

from __future__ import annotations

import jax
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from linop import Block, DistributedTensor, Kernel, Partition, Space, halo_windows
from linop.frameworks.jax_sharded import sharded
from verify.lift_jax import prove_shard_map


def periodic_halo(mesh: Mesh, n: int):
    """Each device holds ``n`` entries and a halo cell at each end, filled from its neighbours
    around the ring."""
    devices = mesh.devices.size

    def local(piece):
        block = piece[0]
        left = lax.ppermute(block[n : n + 1], "d", [(i, (i + 1) % devices) for i in range(devices)])
        right = lax.ppermute(block[1:2], "d", [(i, (i - 1) % devices) for i in range(devices)])
        return block.at[0:1].set(left).at[n + 1 :].set(right)[None]

    return jax.shard_map(local, mesh=mesh, in_specs=PartitionSpec("d"), out_specs=PartitionSpec("d"))


def check_lift(mesh: Mesh) -> None:
    devices, n = mesh.devices.size, 3
    space = Space([Block(f"x[{d}]", (n + 2,), d) for d in range(devices)])
    exchange = periodic_halo(mesh, n)
    proof = prove_shard_map(exchange, space, space, devices, label="ppermute halo")
    assert proof, proof
    print(proof)

    @jax.custom_vjp
    def wrong(x):
        return exchange(x)

    wrong.defvjp(lambda x: (exchange(x), None), lambda _, g: (exchange(g),))  # forward as backward
    refuted = prove_shard_map(wrong, space, space, devices, label="halo, forward as backward")
    assert not refuted and refuted.mismatches, refuted
    first = refuted.mismatches[0]
    print("refuted:", first)
    assert "x[0][0]" in str(first) or "x[" in str(first), first

    u = DistributedTensor("u", (4 * devices - 1, 3), Partition.grid((devices, 1)))  # uneven
    f = sharded(halo_windows(u, Kernel((3, 1), padding=(1, 0))), mesh)
    lowered = prove_shard_map(f.arrays, f.op.domain, f.op.range, devices, label="linop lowering")
    assert lowered, lowered
    print(lowered)


if __name__ == "__main__":  # pragma: no cover - run through check_lowering.py
    check_lift(Mesh(np.array(jax.devices()), ("d",)))
