"""The overlapped halo exchange: a distributed 3 x 3 convolution step (forward + backward),
plain and overlapped, against a hand-written overlapped mpi4py + torch layer.

Run with 4 ranks (a 2 x 2 spatial grid) or 2 (2 x 1)::

    mpiexec -n 4 python benchmarks/bench_overlap.py [N C H W] [--samples K]

Each rank holds an ``N x C x H x W`` float32 block (default 4 x 16 x 256 x 256) of the input of a
``C -> C`` convolution with zero padding 1; one torch thread per rank. Printed on rank 0, the
time of one step (the maximum over the ranks, median over the samples; the methods interleaved
within each sample):

- ``exchange``: the halo exchange alone, forward and adjoint (linop's bound window plans; the
  hand-written ``Isend``/``Irecv`` of the same halos, corners included);
- ``compute``: the local products alone (torch's ``conv2d`` forward and its backward for the
  input and the weights on a padded block, no message);
- ``plain``: ``LayerModule(..., overlap=False)``: the exchange, then the products;
- ``overlapped``: ``LayerModule(..., overlap=True)``: the exchange started, the interior's
  products run while its messages are in flight, then the boundary strips; the backward with
  the adjoint exchange in flight;
- ``hand overlapped``: mpi4py + torch written out: ``Isend``/``Irecv`` of the halos, the interior
  ``conv2d``, ``Waitall``, the four boundary strips; backward: the strips' input gradients, the
  halo gradients sent back, the interior's input gradient and the weight gradient in flight,
  ``Waitall``, the received gradients added.

and the ratios: the share of the exchange hidden, ``(plain - overlapped) / exchange``, and
``overlapped / hand overlapped``. The three layers are checked equal first (outputs, input and
weight gradients, to float32 rounding). Nothing is asserted about speed.

On a machine with fewer cores than ranks a rank has no spare core to progress its messages
while it computes: MPICH moves data only inside MPI calls (no progress thread), so the
messages of a nonblocking exchange travel mostly at the ``Waitall``, and the overlap hides
little; the figures then measure the schedule's cost, not the hiding.
"""

from __future__ import annotations

import sys

import numpy as np
from mpi4py import MPI

try:
    import torch
except ImportError:  # pragma: no cover - the torch extra is not installed
    if MPI.COMM_WORLD.rank == 0:
        print("bench_overlap: torch is not installed (pip install -e '.[torch]'); skipped")
    sys.exit(0)

from _timing import interleaved_over_ranks

from linop import DistributedTensor, Kernel, Partition
from linop.frameworks.torch_layers import LayerModule
from linop.layers import Convolution

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size
GRID = {1: (1, 1), 2: (2, 1), 4: (2, 2)}


def _arguments() -> tuple[tuple[int, int, int, int], int]:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    shape = tuple(int(a) for a in args[:4]) if len(args) >= 4 else (4, 16, 256, 256)
    samples = int(sys.argv[sys.argv.index("--samples") + 1]) if "--samples" in sys.argv else 5
    return shape, samples  # type: ignore[return-value]


class HandLayer:
    """The hand-written overlapped layer on a (py, px) grid of ranks, halo width 1, zero padding."""

    def __init__(self, comm, grid, shape, weight, bias):
        self.comm, self.weight, self.bias = comm, weight, bias
        _, _, h, w = shape
        self.shape = shape
        py, px = grid
        i, j = divmod(comm.rank, px)
        self.neighbours = []  # (rank, (di, dj))
        for di in (-1, 0, 1):
            for dj in (-1, 0, 1):
                if (di, dj) != (0, 0) and 0 <= i + di < py and 0 <= j + dj < px:
                    self.neighbours.append(((i + di) * px + (j + dj), (di, dj)))
        rows = {-1: slice(0, 1), 0: slice(1, h + 1), 1: slice(h + 1, h + 2)}
        cols = {-1: slice(0, 1), 0: slice(1, w + 1), 1: slice(w + 1, w + 2)}
        edge_rows = {-1: slice(1, 2), 0: slice(1, h + 1), 1: slice(h, h + 1)}
        edge_cols = {-1: slice(1, 2), 0: slice(1, w + 1), 1: slice(w, w + 1)}
        self.halo = {d: (..., rows[d[0]], cols[d[1]]) for _, d in self.neighbours}
        self.edge = {d: (..., edge_rows[d[0]], edge_cols[d[1]]) for _, d in self.neighbours}

    def _exchange(self, padded, regions_out, regions_in, add):
        """Post the sends of ``regions_out`` and the receives into buffers for ``regions_in``
        (tag: the direction seen from the receiver); return the completion."""
        requests, buffers = [], []
        for rank, d in self.neighbours:
            buffer = np.empty(padded[regions_in[d]].shape, np.float32)
            requests.append(self.comm.Irecv(buffer, rank, tag=_tag(d)))
            buffers.append((d, buffer))
        for rank, d in self.neighbours:
            out = np.ascontiguousarray(padded[regions_out[d]])
            requests.append(self.comm.Isend(out, rank, tag=_tag((-d[0], -d[1]))))

        def complete():
            MPI.Request.Waitall(requests)
            for d, buffer in buffers:
                if add:
                    padded[regions_in[d]] += buffer
                else:
                    padded[regions_in[d]] = buffer

        return complete

    def step(self, x: np.ndarray, gy: np.ndarray, overlap: bool = True):
        """Forward and backward: (y, dx, dw, db)."""
        n, c, h, w = self.shape
        weight, bias = self.weight, self.bias
        padded = np.zeros((n, c, h + 2, w + 2), np.float32)
        padded[..., 1 : h + 1, 1 : w + 1] = x
        xp = torch.from_numpy(padded)
        y = torch.empty((n, weight.shape[0], h, w))
        strips = [
            ((slice(0, 1), slice(0, w)), (slice(0, 3), slice(0, w + 2))),
            ((slice(h - 1, h), slice(0, w)), (slice(h - 1, h + 2), slice(0, w + 2))),
            ((slice(1, h - 1), slice(0, 1)), (slice(1, h + 1), slice(0, 3))),
            ((slice(1, h - 1), slice(w - 1, w)), (slice(1, h + 1), slice(w - 1, w + 2))),
        ]
        inner_out, inner_in = (slice(1, h - 1), slice(1, w - 1)), (slice(1, h + 1), slice(1, w + 1))
        complete = self._exchange(padded, self.edge, self.halo, add=False)
        if not overlap:
            complete()
        y[(..., *inner_out)] = torch.conv2d(xp[(..., *inner_in)], weight, bias)
        if overlap:
            complete()
        for out, window in strips:
            y[(..., *out)] = torch.conv2d(xp[(..., *window)], weight, bias)
        # backward
        g = torch.from_numpy(gy)
        gpad = np.zeros_like(padded)
        gp = torch.from_numpy(gpad)
        for out, window in strips:
            gp[(..., *window)] += torch.nn.grad.conv2d_input(
                (n, c, *_shape(window)), weight, g[(..., *out)].contiguous()
            )
        complete = self._exchange(gpad, self.halo, self.edge, add=True)
        if not overlap:
            complete()
        gp[(..., *inner_in)] += torch.nn.grad.conv2d_input(
            (n, c, h, w), weight, g[(..., *inner_out)].contiguous()
        )
        _, dw, db = torch.ops.aten.convolution_backward(
            g, xp, weight, [weight.shape[0]], [1, 1], [0, 0], [1, 1], False, [0, 0], 1, [False, True, True]
        )
        if overlap:
            complete()
        return y, gp[..., 1 : h + 1, 1 : w + 1], dw, db

    def exchange_only(self, x: np.ndarray, gy: np.ndarray):
        n, c, h, w = self.shape
        padded = np.zeros((n, c, h + 2, w + 2), np.float32)
        padded[..., 1 : h + 1, 1 : w + 1] = x
        self._exchange(padded, self.edge, self.halo, add=False)()
        self._exchange(padded, self.halo, self.edge, add=True)()


def _tag(d):
    return (d[0] + 1) * 3 + (d[1] + 1)


def _shape(window):
    return tuple(s.stop - s.start for s in window)


def main() -> None:
    (n, c, h, w), samples = _arguments()
    torch.set_num_threads(1)
    grid = GRID[SIZE]
    x = DistributedTensor("x", (n, c, h * grid[0], w * grid[1]), Partition((1, 1, *grid)))
    layer = Convolution(x, c, Kernel(3, padding=1))
    rng = np.random.default_rng(0)
    weights = (rng.standard_normal(layer.weights.global_shape) / (3 * np.sqrt(c))).astype(np.float32)
    bias = rng.standard_normal(layer.bias.global_shape).astype(np.float32)
    plain = LayerModule(layer, weights=weights, bias=bias, comm=COMM, dtype=torch.float32, overlap=False)
    overlapped = LayerModule(layer, weights=weights, bias=bias, comm=COMM, dtype=torch.float32, overlap=True)
    (name,) = plain.input_names
    block = rng.standard_normal((n, c, h, w)).astype(np.float32)
    gy = rng.standard_normal((n, c, h, w)).astype(np.float32)
    hand = HandLayer(COMM, grid, (n, c, h, w), torch.from_numpy(weights), torch.from_numpy(bias))
    out_name = plain.output_names[0]

    def module_step(module):
        tensor = torch.from_numpy(block.copy()).requires_grad_()
        y = module({name: tensor})[out_name]
        y.backward(torch.from_numpy(gy))
        return y.detach(), tensor.grad, [p.grad for n, p in module.parameter_state().items() if "_w[" in n]

    # equal first (float32 rounding): outputs, input gradients, weight gradients (summed over ranks)
    problems = []
    results = {}
    for label, module in (("plain", plain), ("overlapped", overlapped)):
        for p in module.parameters():
            p.grad = None
        results[label] = module_step(module)
    y, dx, dw, db = hand.step(block, gy)
    dw, db = COMM.allreduce(dw.numpy()), COMM.allreduce(db.numpy())
    for label, (my, mdx, grads) in results.items():
        if not np.allclose(my.numpy(), y.numpy(), atol=1e-4) or not np.allclose(
            mdx.numpy(), dx.numpy(), atol=1e-4
        ):
            problems.append(f"{label}: the output or input gradient differs from the hand-written layer's")
        if grads and RANK == 0 and not np.allclose(grads[0].numpy(), dw, rtol=1e-3, atol=1e-2):
            problems.append(f"{label}: the weight gradient differs from the hand-written layer's")
    problems = [p for ps in COMM.allgather(problems) for p in ps]
    if problems:
        raise SystemExit("bench_overlap: " + "; ".join(problems))

    def linop_exchange():
        windows = plain.windows.run({name: torch.from_numpy(block)})
        plain.windows.run_adjoint(windows)

    padded = torch.zeros((n, c, h + 2, w + 2))
    weight = torch.from_numpy(weights)
    grad = torch.from_numpy(gy)

    def compute():
        torch.conv2d(padded, weight, torch.from_numpy(bias))
        torch.ops.aten.convolution_backward(
            grad, padded, weight, [c], [1, 1], [0, 0], [1, 1], False, [0, 0], 1, [True, True, True]
        )

    methods = {
        "exchange (linop)": linop_exchange,
        "exchange (hand)": lambda: hand.exchange_only(block, gy),
        "compute": compute,
        "plain (linop)": lambda: module_step(plain),
        "overlapped (linop)": lambda: module_step(overlapped),
        "plain (hand)": lambda: hand.step(block, gy, overlap=False),
        "overlapped (hand)": lambda: hand.step(block, gy, overlap=True),
    }
    times = interleaved_over_ranks(methods, COMM, samples, 1)
    if RANK == 0:
        med = {k: float(np.median(v)) for k, v in times.items()}
        print(
            f"bench_overlap: {SIZE} ranks, grid {grid}, per rank {n}x{c}x{h}x{w} float32, 3x3 conv {c}->{c}"
        )
        for k, v in med.items():
            print(f"  {k:22s} {v * 1e3:9.2f} ms")
        for who in ("linop", "hand"):
            exchange = med[f"exchange ({who})"]
            hidden = (med[f"plain ({who})"] - med[f"overlapped ({who})"]) / exchange
            print(f"  {who}: exchange hidden {hidden:6.1%} of its {exchange * 1e3:.2f} ms")
        ratios = np.asarray(times["overlapped (linop)"]) / np.asarray(times["overlapped (hand)"])
        print(
            f"  overlapped linop / overlapped hand: {float(np.median(ratios)):.3f} (median of per-sample ratios)"
        )
        ratios = np.asarray(times["plain (linop)"]) / np.asarray(times["plain (hand)"])
        print(f"  plain linop / plain hand:           {float(np.median(ratios)):.3f}")


if __name__ == "__main__":
    main()
