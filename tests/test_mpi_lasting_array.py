"""linop.backends.mpi.memory.lasting_array: a bound plan's large buffers start on a huge page."""

from __future__ import annotations

import numpy as np
import pytest

from linop.backends.mpi.memory import HUGE_PAGE, lasting_array


@pytest.mark.parametrize("shape", [(HUGE_PAGE // 8,), (3, HUGE_PAGE // 16 + 5)])
@pytest.mark.parametrize("dtype", [np.float64, np.complex64])
def test_a_large_array_starts_on_a_huge_page(shape, dtype):
    """At least one huge page: aligned to it, the asked shape and dtype, C-ordered, writeable,
    independent of another one (each call, its own memory)."""
    array = lasting_array(shape, dtype)
    other = lasting_array(shape, dtype)
    assert array.ctypes.data % HUGE_PAGE == 0
    assert array.shape == shape and array.dtype == np.dtype(dtype)
    assert array.flags.c_contiguous and array.flags.writeable
    array[...] = 1
    other[...] = 2
    assert np.all(array == 1)


def test_a_small_array_is_plain():
    """Below a huge page, or of objects: a plain ``np.empty`` (no slack)."""
    small = lasting_array((HUGE_PAGE // 8 - 1,), np.float64)
    assert small.base is None and small.shape == (HUGE_PAGE // 8 - 1,)
    objects = lasting_array((HUGE_PAGE,), object)
    assert objects.base is None and objects.dtype == object
