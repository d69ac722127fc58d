r"""Prove a user's own ``shard_map`` function and its transpose, entry by entry.

A JAX function on a device mesh takes arrays stacked over the devices (the leading axis
sharded over the mesh) and returns such arrays. Here its input and output are described by
linop spaces: each block lives on a worker, worker ``w`` on device ``w`` (or ``workers=``), and
the blocks are laid out in stacked, zero-padded *slots* exactly as
:mod:`linop.frameworks.jax_sharded` does (:func:`linop.backends.jax.plan.space_layout`:
the blocks ``x[0]``, ``x[1]``, ... of one prefix form the slot ``x``, device ``d``'s block in
row ``d``). :func:`lift_shard_map` wraps the function as a function of the blocks and lifts it
with :func:`verify.lift.lift` (``framework="jax"``): its matrix by probing the forward, the
claimed adjoint by probing its VJP (whatever JAX runs for it: its own transposes of
``ppermute`` and friends, or a ``custom_vjp`` / ``custom_transpose`` the user wrote), or a
claimed transpose given as ``adjoint=``. ``verify.exact_adjoint`` then proves the claim or
refutes it naming the first wrong (block, index) entries; :func:`prove_shard_map` does both.

Entries in the padding of a slot are never probed: the lifted map sees only the blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from linop import Space
from linop.backends.jax.plan import Layout, space_layout
from linop.progress import ProgressOption

from .exact import Proof, exact_adjoint
from .lift import Lifted, lift

__all__ = ["lift_shard_map", "prove_shard_map", "slot_functions"]


def _device_map(workers: Sequence[int] | None, devices: int) -> tuple[int, ...]:
    return tuple(range(devices)) if workers is None else tuple(int(w) for w in workers)


def slot_functions(
    space: Space, devices: int, workers: Sequence[int] | None = None
) -> tuple[Layout, Callable[..., tuple[Any, ...]], Callable[..., tuple[Any, ...]]]:
    """The slot layout of ``space`` on ``devices`` devices, and the JAX functions packing its
    blocks (positional, in ``space`` order) into the stacked slots and back."""
    import jax.numpy as jnp

    layout = space_layout(space, _device_map(workers, devices), devices)
    names = space.names

    def pack(*blocks: Any) -> tuple[Any, ...]:
        by_name = dict(zip(names, blocks))
        dtype = jnp.result_type(*blocks) if blocks else jnp.float32
        out = []
        for spec in layout.slots:
            rows = []
            for block in spec.blocks:
                if block is None:
                    rows.append(jnp.zeros(spec.shape, dtype))
                    continue
                value = jnp.asarray(by_name[block.name], dtype)
                pads = [(0, n - m) for n, m in zip(spec.shape, block.shape)]
                rows.append(jnp.pad(value, pads) if any(p for _, p in pads) else value)
            out.append(jnp.stack(rows))
        return tuple(out)

    def unpack(*slots: Any) -> tuple[Any, ...]:
        by_name = {}
        for spec, array in zip(layout.slots, slots):
            for d, block in enumerate(spec.blocks):
                if block is not None:
                    index = (d, *(slice(0, n) for n in block.shape))
                    by_name[block.name] = array[index]
        return tuple(by_name[name] for name in names)

    return layout, pack, unpack


def _as_tuple(result: Any, layout: Layout) -> tuple[Any, ...]:
    if isinstance(result, Mapping):
        return tuple(result[name] for name in layout.names)
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


def lift_shard_map(
    forward: Callable[..., Any],
    domain: Space,
    range: Space,
    devices: int,
    *,
    adjoint: Callable[..., Any] | None = None,
    workers: Sequence[int] | None = None,
    label: str | None = None,
    batch: int = 64,
    progress: ProgressOption = None,
) -> Lifted:
    """Lift a function of stacked slots (``forward(*domain_slots) -> range slots``: one array,
    a tuple in slot order, or a dict by slot name) and its claimed transpose (its JAX VJP, or
    ``adjoint(*range_slots) -> domain slots``) into a :class:`~verify.lift.Lifted` operator
    from ``domain`` to ``range``, on ``devices`` devices (worker w on device ``workers[w]``).
    ``progress=`` reports the probing as in :func:`verify.lift.lift`."""
    source, pack_in, unpack_in = slot_functions(domain, devices, workers)
    target, pack_out, unpack_out = slot_functions(range, devices, workers)

    def on_blocks(*blocks: Any) -> tuple[Any, ...]:
        return unpack_out(*_as_tuple(forward(*pack_in(*blocks)), target))

    claimed = None
    if adjoint is not None:

        def claimed(*blocks: Any) -> tuple[Any, ...]:
            return unpack_in(*_as_tuple(adjoint(*pack_out(*blocks)), source))

    name = label or getattr(forward, "__qualname__", None) or type(forward).__name__
    return lift(
        on_blocks, domain, range, adjoint=claimed, framework="jax", label=name, batch=batch, progress=progress
    )


def prove_shard_map(
    forward: Callable[..., Any], domain: Space, range: Space, devices: int, **options: Any
) -> Proof:
    """:func:`lift_shard_map` then :func:`verify.exact_adjoint`: proven, or refuted with the
    first wrong entries (a row is an entry of the function's input, a column of its output)."""
    return exact_adjoint(lift_shard_map(forward, domain, range, devices, **options))
