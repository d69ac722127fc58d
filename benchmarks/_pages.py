"""Where an array's memory lies: the share of its pages in transparent huge pages.

For the MPI benchmarks, whose 8 MB calls run slower from memory in 4 KB pages
(``benchmarks/bench_mpi_buffer_placement.py``, ``benchmarks/bench_mpi_collectives.py``).
"""

from __future__ import annotations

import struct

import numpy as np

__all__ = ["huge_share"]


def huge_share(arrays: list[np.ndarray]) -> float | None:
    """The smallest share of an array's 4 KB pages that lie in a transparent huge page, over
    ``arrays`` (``/proc/kpageflags`` bit 22 of the frames ``/proc/self/pagemap`` gives), or
    None where they cannot be read (not root)."""
    page, shares = 4096, []
    try:
        with open("/proc/self/pagemap", "rb") as pagemap, open("/proc/kpageflags", "rb") as flags:
            for array in arrays:
                first = array.ctypes.data // page
                count = (array.ctypes.data + array.nbytes - 1) // page - first + 1
                pagemap.seek(first * 8)
                huge = 0
                for entry in struct.unpack(f"{count}Q", pagemap.read(count * 8)):
                    frame = entry & ((1 << 55) - 1)
                    if not entry >> 63 or not frame:
                        continue
                    flags.seek(frame * 8)
                    huge += struct.unpack("Q", flags.read(8))[0] >> 22 & 1
                shares.append(huge / count)
    except OSError:
        return None
    return min(shares, default=None)
