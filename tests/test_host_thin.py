"""The prepared local moves on thin strided boxes (linop.backends.host_thin): bit for bit
numpy's copy, zero fill and add, on column strips of every width, dtype and offset, with NaN
payloads and signed zeros in the copied bits."""

from __future__ import annotations

import numpy as np
import pytest

from linop.backends.host_thin import add_call, add_rows, as_words, copy_call, fill_call

DTYPES = [np.float32, np.float64, np.complex64, np.int16, np.uint8]


def bits(rng: np.random.Generator, shape: tuple[int, ...], dtype: type) -> np.ndarray:
    """Random bytes as an array of ``dtype`` (NaNs with payloads and negative zeros included)."""
    itemsize = np.dtype(dtype).itemsize
    return rng.integers(0, 256, (*shape, itemsize), dtype=np.uint8).view(dtype).reshape(shape)


def run(call: tuple) -> None:
    function, arguments = call
    function(*arguments)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_copies_fills_and_adds_of_column_strips_are_numpys(dtype):
    rng = np.random.default_rng(0)
    taken = 0
    for width in range(1, 10):
        for start in (0, 1, 2):
            block, other = bits(rng, (3, 2, 7, 16), dtype), bits(rng, (3, 2, 7, 16), dtype)
            box = (slice(None), slice(None), slice(1, 6), slice(start, start + width))
            buffer = bits(rng, block[box].shape, dtype)
            for target, source in ((buffer, block[box]), (block[box], buffer), (block[box], other[box])):
                expected = target.copy()
                np.copyto(expected, source)
                call = copy_call(target, source)
                run(call)
                assert target.view(np.uint8).tobytes() == expected.view(np.uint8).tobytes()
                taken += call[1][0] is not target
            zeros = block.copy()
            zeros[box] = 0
            call = fill_call(block[box])
            run(call)
            assert np.array_equal(block.view(np.uint8), zeros.view(np.uint8))
            taken += call[0].__self__.dtype != block.dtype
            if np.dtype(dtype).kind in "fc":  # arithmetic on finite values
                values, addend = (
                    rng.standard_normal(block.shape).astype(dtype),
                    rng.standard_normal(buffer.shape),
                )
                addend = addend.astype(dtype)
                expected = values.copy()
                np.add(expected[box], addend, expected[box])
                call = add_call(values[box], addend)
                run(call)
                assert np.array_equal(values, expected)
                taken += call[0] is add_rows
    assert taken > 0  # the fast forms were taken somewhere (else this test proves nothing)


def test_the_fast_forms_are_taken_for_a_halo_column():
    """A 4 x 16 x 34 x 2 float32 column of a 36 x 36 block: copies and fills through 8-byte
    words, the add innermost along the rows; a row strip or a contiguous block keeps numpy's
    own calls."""
    block = np.zeros((4, 16, 36, 36), np.float32)
    column, buffer = block[:, :, 2:36, 34:36], np.zeros((4, 16, 34, 2), np.float32)
    words = as_words(column)
    assert words is not None and words.dtype == np.uint64 and words.shape == (4, 16, 34, 1)
    assert copy_call(buffer, column)[1][1].dtype == np.uint64
    assert add_call(column, buffer)[0] is add_rows
    assert as_words(block[:, :, 0:2, :]) is None and add_call(block, block)[0] is np.add
