"""What ``ShardedOperator.pack`` refuses on this process's one device (three workers placed on
it): host int64 blocks beyond int32 with ``jax_enable_x64`` off (JAX would keep them wrapped),
and ragged nests of lists. Found by the fuzz campaign (tests/test_fuzz_engines.py)."""

from __future__ import annotations

import re

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="jax is not installed (the jax extra)")

from jax.sharding import Mesh  # noqa: E402

from linop import DistributedTensor, Partition, Repartition  # noqa: E402
from linop.errors import IntegerOverflowError, StateError  # noqa: E402
from linop.frameworks.jax_sharded import sharded  # noqa: E402

MESH = Mesh(np.array(jax.devices()[:1]), ("d",))


def _tree() -> Repartition:
    x = DistributedTensor("x", (6,), Partition((2,)))
    y = DistributedTensor("y", (6,), Partition((3,)))
    return Repartition(x, y)


def _state(op: Repartition, value: int, dtype: type) -> dict[str, np.ndarray]:
    return {b.name: np.full(b.shape, value, dtype=dtype) + np.arange(b.size, dtype=dtype) for b in op.domain}


def test_int64_entries_beyond_int32_are_refused_with_x64_off_and_exact_with_it_on():
    op = _tree()
    run = sharded(op, MESH, workers={0: 0, 1: 0, 2: 0})
    with jax.enable_x64(False):
        with pytest.raises(IntegerOverflowError, match=r"block '.*' holds int64 entries .* beyond int32"):
            run.blocks(_state(op, 2**40, np.int64))
        small = run.blocks(_state(op, 5, np.int64))  # within int32: exact
    with jax.enable_x64(True):
        large = run.blocks(_state(op, 2**40, np.int64))
    for got, value in ((small, 5), (large, 2**40)):
        for name, expected in op.apply(_state(op, value, np.int64)).items():
            np.testing.assert_array_equal(np.asarray(got[name]), expected)


def test_a_ragged_block_is_a_state_error_naming_it():
    op = _tree()
    run = sharded(op, MESH, workers={0: 0, 1: 0, 2: 0})
    state: dict = _state(op, 0, np.float32)
    name = next(iter(state))
    state[name] = [[1.0, 2.0], [3.0]]
    with pytest.raises(StateError, match=re.escape(f"block {name!r} is a ragged nest")):
        run.blocks(state)
