"""The recycled result memory of the MPI interpreter (linop.backends.mpi.memory): an array's
memory goes back to the free list only once the array and every view of it are gone."""

from __future__ import annotations

import numpy as np
import pytest

from linop.backends.mpi import memory as mpi_memory
from linop.backends.mpi.memory import POOL_FROM, new_array


@pytest.fixture(autouse=True)
def empty_pool(monkeypatch):
    monkeypatch.setattr(mpi_memory, "_FREE", {})


COUNT = POOL_FROM // 8  # float64 entries of the smallest pooled array


def test_memory_is_recycled_only_after_every_view_is_gone():
    a = new_array((COUNT,), np.float64)
    view = a.reshape(-1, 8)[::2]
    del a
    assert mpi_memory.free_buffers() == 0  # the view keeps it
    other = new_array((COUNT,), np.float64)
    other.fill(1)
    assert not np.shares_memory(other, view)
    del view
    assert mpi_memory.free_buffers() == 1
    again = new_array((COUNT,), np.float64)
    assert mpi_memory.free_buffers() == 0
    again.fill(2)
    assert np.all(other == 1)  # the live array is untouched by the recycled one


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((COUNT,), np.float64), ((3, COUNT), np.complex128), ((COUNT, 2), np.int8), ((4,), np.float64)],
    ids=["float64", "complex128-2d", "int8", "small"],
)
def test_an_array_is_like_np_empty(shape, dtype):
    a = new_array(shape, dtype)
    assert a.shape == shape and a.dtype == np.dtype(dtype)
    assert a.flags.c_contiguous and a.flags.writeable and a.flags.aligned
    a[...] = 3
    assert np.all(a == 3)


def test_small_arrays_are_plain_and_the_free_list_is_bounded():
    small = new_array((4,), np.float64)
    assert small.base is None
    arrays = [new_array((COUNT,), np.float64) for _ in range(mpi_memory.KEEP_FREE + 3)]
    del arrays
    assert mpi_memory.free_buffers() == mpi_memory.KEEP_FREE
