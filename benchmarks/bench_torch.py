"""PyTorch benchmark: a tree wrapped as an autograd function, forward + backward, against the
same moves written by hand in torch (autograd deriving the backward).

The tree is the halo windows of an N x N float64 tensor on a 2 x 2 partition for a 3 x 3
kernel with padding 1 (:func:`linop.halo.halo_windows`), run by
:class:`linop.frameworks.torch_function.TorchOperator`: forward the numpy interpreter on the
tensors' memory, backward the adjoint tree (which adds the halos back). The hand-written side
builds each window with torch slicing (zeros, the bulk, the halo strips and corners from the
neighbours) and lets autograd run the backward. Both are first checked to give the same
windows and the same gradients; then medians and ratios are printed. Run:
``python benchmarks/bench_torch.py``.
"""

from __future__ import annotations

import sys

import numpy as np
from _timing import compare

try:
    import torch
except ImportError:  # pragma: no cover - the torch extra is not installed
    print("bench_torch: torch is not installed (pip install -e '.[torch]'); skipped")
    sys.exit(0)

from linop import DistributedTensor, Kernel, Partition, halo_windows
from linop.frameworks.torch_function import TorchOperator

REPEATS = 11
H = 1


def _sides(i: int, n: int) -> tuple[slice, slice, slice, int]:
    """Grid coordinate i (0 or 1) of a dimension of 2n entries: local bulk slice, local halo
    slice, the neighbour's bulk slice that fills it, and the neighbour's coordinate."""
    if i == 0:
        return slice(H, H + n), slice(H + n, 2 * H + n), slice(0, H), 1
    return slice(H, H + n), slice(0, H), slice(n - H, n), 0


def hand_windows(bulks: dict[tuple[int, int], torch.Tensor], n: int) -> dict[tuple[int, int], torch.Tensor]:
    out = {}
    for (i, j), bulk in bulks.items():
        local = torch.zeros((n + 2 * H, n + 2 * H), dtype=bulk.dtype)
        rb, rh, rsrc, ri = _sides(i, n)
        cb, ch, csrc, cj = _sides(j, n)
        local[rb, cb] = bulk
        local[rh, cb] = bulks[ri, j][rsrc, :]
        local[rb, ch] = bulks[i, cj][:, csrc]
        local[rh, ch] = bulks[ri, cj][rsrc, csrc]
        out[i, j] = local
    return out


def bench(size: int) -> None:
    """Time and print one size."""
    n = size // 2
    tensor = DistributedTensor("x", (size, size), Partition.grid((2, 2)))
    windows = halo_windows(tensor, Kernel(3, padding=1))
    f = TorchOperator(windows)
    rng = np.random.default_rng(0)
    field = rng.standard_normal((size, size))
    weights = {b.name: torch.from_numpy(rng.standard_normal(b.shape)) for b in windows.range}
    state = {k: torch.from_numpy(v) for k, v in tensor.scatter(field).items()}
    grid = {tuple(int(c) for c in k[2:-1].split(",")): k for k in state}
    window_of = {ij: f"x_window[{ij[0]},{ij[1]}]" for ij in grid}

    def ours() -> dict[str, torch.Tensor]:
        x = {k: v.requires_grad_() if not v.requires_grad else v for k, v in state.items()}
        for v in x.values():
            v.grad = None
        y = f(x)
        sum((y[k] * weights[k]).sum() for k in y).backward()
        return {k: v.grad for k, v in x.items()} | {"y": y}

    def theirs() -> dict[str, torch.Tensor]:
        bulks = {ij: state[name].detach().clone().requires_grad_() for ij, name in grid.items()}
        y = hand_windows(bulks, n)
        sum((y[ij] * weights[window_of[ij]]).sum() for ij in y).backward()
        return {grid[ij]: b.grad for ij, b in bulks.items()} | {
            "y": {window_of[ij]: v for ij, v in y.items()}
        }

    mine, hand = ours(), theirs()
    assert all(torch.equal(mine["y"][k].detach(), hand["y"][k].detach()) for k in mine["y"])
    assert all(torch.allclose(mine[k], hand[k], rtol=0, atol=1e-12) for k in state)
    t_ours, t_hand, ratio = compare(ours, theirs, REPEATS)
    print(f"{size:>6} {t_ours * 1e3:>11.2f} ms {t_hand * 1e3:>11.2f} ms {ratio:>6.2f}x")


def main() -> None:
    torch.set_num_threads(1)
    print(f"{'N':>6} {'linop fwd+bwd':>14} {'torch fwd+bwd':>14} {'ratio':>7}")
    for size in (256, 1024, 2048):
        bench(size)


if __name__ == "__main__":
    main()
