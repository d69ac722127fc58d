"""Halo benchmark: the windows of a 4096 x 4096 float64 tensor over a 2 x 2 partition.

Compares the numpy interpreter running :func:`linop.halo.halo_windows` (nested and direct
exchange) with hand-written numpy slicing of the same moves (zero-initialised local arrays, the
bulk copied in, then every halo strip and corner sliced out of the neighbours' bulks), and the
in-place exchange on local blocks with hand-written in-place halo copies. Both sides are first
checked to give the same windows; then prints medians and ratios. Run:
``python benchmarks/bench_halo.py``.
"""

from __future__ import annotations

import numpy as np
from _timing import compare

from linop.halo import HaloExchange, halo_windows, pad_shim
from linop.halo_geometry import Kernel, halo_geometry
from linop.partition import DistributedTensor, Partition

N = 4096
REPEATS = 21


def _sides(i: int, n: int, h: int) -> tuple[slice, slice, slice, int]:
    """For grid coordinate i (0 or 1) along a dimension of 2n entries and halo h: the local
    slice of the bulk, the local slice of the one halo strip, the slice of the neighbour's bulk
    that fills it, and the neighbour's coordinate."""
    if i == 0:  # pad on the left (zeros), halo on the right from worker 1
        return slice(h, h + n), slice(h + n, 2 * h + n), slice(0, h), 1
    return slice(h, h + n), slice(0, h), slice(n - h, n), 0


def _local_name(index: tuple[int, int]) -> str:
    return f"x_local[{index[0]},{index[1]}]"


def hand_windows(bulks: dict[tuple[int, int], np.ndarray], n: int, h: int) -> dict:
    """Windows of a 2 x 2 decomposition with zero padding h, written out by hand."""
    out = {}
    for (i, j), bulk in bulks.items():
        local = np.zeros((n + 2 * h, n + 2 * h))
        rb, rh, rsrc, ri = _sides(i, n, h)
        cb, ch, csrc, cj = _sides(j, n, h)
        local[rb, cb] = bulk
        local[rh, cb] = bulks[ri, j][rsrc, :]
        local[rb, ch] = bulks[i, cj][:, csrc]
        local[rh, ch] = bulks[ri, cj][rsrc, csrc]
        out[i, j] = local
    return out


def hand_exchange(locals_: dict[tuple[int, int], np.ndarray], n: int, h: int) -> None:
    """The same halo strips and corners, copied in place between local arrays."""
    for (i, j), local in locals_.items():
        rb, rh, rsrc, ri = _sides(i, n, h)
        cb, ch, csrc, cj = _sides(j, n, h)
        shift = slice(rsrc.start + h, rsrc.stop + h), slice(csrc.start + h, csrc.stop + h)
        local[rh, cb] = locals_[ri, j][shift[0], cb]
        local[rb, ch] = locals_[i, cj][rb, shift[1]]
        local[rh, ch] = locals_[ri, cj][shift[0], shift[1]]


def main() -> None:
    tensor = DistributedTensor("x", (N, N), Partition((2, 2)))
    rng = np.random.default_rng(0)
    state = tensor.scatter(rng.standard_normal((N, N)))
    n = N // 2
    bulks = {index: state[tensor.block_name(index)] for index in tensor.partition.indices()}
    print(
        f"windows of a {N} x {N} float64 tensor over a 2 x 2 partition, zero padding "
        f"(medians of {REPEATS} alternating samples; ratio = median of per-sample ratios)"
    )
    for size in (3, 7):
        h = size // 2
        kernel = Kernel(size, padding=h)
        reference = hand_windows(bulks, n, h)
        for variant in ("nested", "direct"):
            op = halo_windows(tensor, kernel, variant=variant)
            result = op(state)
            assert all(np.array_equal(result[f"x_window[{i},{j}]"], reference[i, j]) for i, j in reference)
            t_ours, t_hand, ratio = compare(
                lambda op=op: op(state), lambda h=h: hand_windows(bulks, n, h), REPEATS
            )
            print(
                f"  kernel {size}, windows, {variant:6s}            linop {t_ours * 1e3:8.2f} ms   "
                f"numpy {t_hand * 1e3:8.2f} ms   ratio {ratio:5.2f}x"
            )
        geometry = halo_geometry(tensor, kernel)
        bare = pad_shim(geometry)(state)  # local blocks: bulk in place, halos and pads zero
        for variant in ("nested", "direct"):
            exchange = HaloExchange(geometry, variant)
            local_state = {name: np.array(array) for name, array in bare.items()}
            hand_locals = {index: np.array(bare[_local_name(index)]) for index in reference}
            exchange.apply(local_state, inplace=True)
            hand_exchange(hand_locals, n, h)
            for index, window in reference.items():
                assert np.array_equal(local_state[_local_name(index)], window)
                assert np.array_equal(hand_locals[index], window)
            t_ours, t_hand, ratio = compare(
                lambda exchange=exchange, state=local_state: exchange.apply(state, inplace=True),
                lambda h=h, arrays=hand_locals: hand_exchange(arrays, n, h),
                REPEATS,
            )
            print(
                f"  kernel {size}, in-place exchange, {variant:6s}  linop {t_ours * 1e6:8.1f} us   "
                f"numpy {t_hand * 1e6:8.1f} us   ratio {ratio:5.2f}x"
            )


if __name__ == "__main__":
    main()
