"""The overlapped halo exchange: a distributed 3 x 3 convolution step (forward + backward),
plain and overlapped, against a hand-written overlapped mpi4py + torch layer.

Run with 4 ranks (a 2 x 2 spatial grid) or 2 (2 x 1)::

    mpiexec -n 4 python benchmarks/bench_overlap.py [N C H W] [--samples K]

Each rank holds an ``N x C x H x W`` float32 block (default 4 x 16 x 256 x 256) of the input of a
``C -> C`` convolution with zero padding 1; one torch thread per rank. Printed on rank 0, the
time of one step (the maximum over the ranks, median over the samples; the methods interleaved
within each sample):

- ``exchange``: the halo exchange's messages alone, forward and adjoint, on a padded block
  built once: linop's ``HaloExchange`` of the layer, bound in place (persistent requests), and
  the hand-written ``Isend``/``Irecv`` of the same halos (corners included), the received
  halo gradients added;
- ``windows``: what a layer's forward and backward move around the products: the padded
  block built from the input block, the exchange, and in the backward the adjoint exchange and
  the input gradient taken out of the padded gradient. linop's is ``LayerModule``'s window
  stage as the plain module runs it (``plain.windows``: at this size, at least
  ``STRAIGHT_FROM`` bytes, the checked plan run on the tensors' memory: the padded block
  filled around the bulk and the bulk copied in, and back the bulk of the gradient copied
  out); the hand-written one builds the padded block (``np.zeros`` and a copy) and copies the
  bulk of the gradient out. An earlier version of this script compared linop's
  ``windows`` with the hand-written ``exchange`` alone (on a padded block it built, the
  gradient left in it): that set about eight 16 MiB memory passes against two, not the
  messages of the one against those of the other;
- ``compute``: the local products alone (torch's ``conv2d`` forward and one
  ``convolution_backward`` for the input, weights and bias on a padded block, no message);
- ``plain``: ``LayerModule(..., replicate=True, overlap=False)``: the exchange, then the
  products; every rank holds the parameters, and the backward all-reduces their gradients;
- ``overlapped``: ``LayerModule(..., overlap=True)``: the exchange started, the interior's
  products run while its messages are in flight, then the boundary strips; the backward with
  the adjoint exchange in flight;
- ``hand plain``: mpi4py + torch written out: the exchange, one ``conv2d`` on the padded
  block; backward: one ``convolution_backward`` (input, weights, bias), the adjoint exchange,
  and one ``Allreduce`` of the weight and bias gradients packed together (as the module, a
  data-parallel layer: each rank's gradients are partial sums);
- ``hand overlapped``: ``Isend``/``Irecv`` of the halos, the interior's ``conv2d``,
  ``Waitall``, the four boundary strips; backward: each strip's ``convolution_backward``
  (input, weights and bias in one call), the halo gradients sent back, the interior's
  ``convolution_backward`` in flight, ``Waitall``, the received gradients added, the
  ``Allreduce``.

and the ratios: the share of the exchange's messages hidden, ``(plain - overlapped) /
exchange``, and ``overlapped / hand overlapped``. The layers are checked equal first
(outputs, input and weight gradients, to float32 rounding). Nothing is asserted about speed.

At this size the messages are small beside the work around them: one 64 KiB row (and column)
per neighbour per direction against 16 MiB blocks, so the ``exchange`` is about a millisecond
of a step of a hundred or more, and most of ``windows`` is memory passes, which no overlap
hides (the same core makes them). On a machine with fewer cores than ranks a rank has no spare
core to progress its messages while it computes: MPICH moves data only inside MPI calls (no
progress thread), and messages above its shared-memory cell (8 KiB by default,
``MPIR_CVAR_CH4_SHM_POSIX_IQUEUE_CELL_SIZE``) need both ranks inside MPI calls to move (a
handshake, then the data). Without a test of the requests during the interior they travel at
the ``Waitall``, which then ties each rank to its peer's end of the interior; linop's schedule
tests them after each step of the work in flight (``Testall``), and the hand-written layer not
at all. Either way the figures measure the schedule's cost, not the hiding, and the share
hidden, with a millisecond of messages, is noise.

Memory pages weigh as much as the arithmetic here: glibc gives freed blocks this large back to
the system, so each step's temporaries (torch's outputs and gradients, the interpreter's
blocks) are faulted in afresh, 8 to 11 thousand minor page faults per step, a third or more of
a step on the 2-core machine this was written on (its page faults are slow). With glibc told to
keep freed memory (the ``MALLOC_*`` variables below) the same steps run with a few hundred
faults, and every figure drops (2 ranks, load 1.9: compute 60 ms against 113-174 ms without;
plain 79, overlapped 92, hand plain 68, hand overlapped 80 ms). Run both ways, on a quiet
machine (``uptime`` load well below the number of cores)::

    env -u MPIR_CVAR_CH4_PROGRESS_THROTTLE -u MPIR_CVAR_ENABLE_HEAVY_YIELD \\
        mpiexec -n 2 python benchmarks/bench_overlap.py
    env -u MPIR_CVAR_CH4_PROGRESS_THROTTLE -u MPIR_CVAR_ENABLE_HEAVY_YIELD \\
        mpiexec -genv MALLOC_MMAP_THRESHOLD_ 33554432 -genv MALLOC_TRIM_THRESHOLD_ 4000000000 \\
        -n 2 python benchmarks/bench_overlap.py

and likewise with ``-n 4``.
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

from linop import DistributedTensor, HaloExchange, Kernel, Partition
from linop.backends import mpi as mpi_backend
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
        g = torch.from_numpy(gy)
        gpad = torch.zeros((n, c, h + 2, w + 2))
        complete = self._exchange(padded, self.edge, self.halo, add=False)
        if not overlap:
            complete()
            y = torch.conv2d(xp, weight, bias)
            dx, dw, db = _backward(g, xp, weight)
            gpad += dx
            self._exchange(gpad.numpy(), self.halo, self.edge, add=True)()
            return (y, gpad[..., 1 : h + 1, 1 : w + 1], *self._summed(dw, db))
        y = torch.empty((n, weight.shape[0], h, w))
        strips = [
            ((slice(0, 1), slice(0, w)), (slice(0, 3), slice(0, w + 2))),
            ((slice(h - 1, h), slice(0, w)), (slice(h - 1, h + 2), slice(0, w + 2))),
            ((slice(1, h - 1), slice(0, 1)), (slice(1, h + 1), slice(0, 3))),
            ((slice(1, h - 1), slice(w - 1, w)), (slice(1, h + 1), slice(w - 1, w + 2))),
        ]
        inner_out, inner_in = (slice(1, h - 1), slice(1, w - 1)), (slice(1, h + 1), slice(1, w + 1))
        y[(..., *inner_out)] = torch.conv2d(xp[(..., *inner_in)], weight, bias)
        complete()
        for out, window in strips:
            y[(..., *out)] = torch.conv2d(xp[(..., *window)], weight, bias)
        # backward: each piece's input, weight and bias gradients in one call
        dw, db = torch.zeros_like(weight), torch.zeros_like(bias)
        for out, window in strips:
            dx, dws, dbs = _backward(g[(..., *out)], xp[(..., *window)], weight)
            gpad[(..., *window)] += dx
            dw += dws
            db += dbs
        complete = self._exchange(gpad.numpy(), self.halo, self.edge, add=True)
        dx, dws, dbs = _backward(g[(..., *inner_out)], xp[(..., *inner_in)], weight)
        gpad[(..., *inner_in)] += dx
        complete()
        return (y, gpad[..., 1 : h + 1, 1 : w + 1], *self._summed(dw + dws, db + dbs))

    def _summed(self, dw, db):
        """The weight and bias gradients summed over the ranks (the parameters are replicated,
        as in a data-parallel code): one ``Allreduce`` of both, packed."""
        packed = torch.cat((dw.reshape(-1), db.reshape(-1))).numpy()
        self.comm.Allreduce(MPI.IN_PLACE, packed)
        return torch.from_numpy(packed[: dw.numel()]).view_as(dw), torch.from_numpy(packed[dw.numel() :])

    def exchange_only(self, padded: np.ndarray) -> None:
        """The messages alone, forward and adjoint, on a padded block built once."""
        self._exchange(padded, self.edge, self.halo, add=False)()
        self._exchange(padded, self.halo, self.edge, add=True)()

    def windows(self, x: np.ndarray, gpad: np.ndarray) -> np.ndarray:
        """What the plain layer moves: the padded block built from ``x`` and exchanged; back:
        the adjoint exchange on ``gpad`` and the input gradient copied out."""
        n, c, h, w = self.shape
        padded = np.zeros((n, c, h + 2, w + 2), np.float32)
        padded[..., 1 : h + 1, 1 : w + 1] = x
        self._exchange(padded, self.edge, self.halo, add=False)()
        self._exchange(gpad, self.halo, self.edge, add=True)()
        return np.ascontiguousarray(gpad[..., 1 : h + 1, 1 : w + 1])


def _backward(grad, window, weight):
    """torch's convolution backward of one piece: (input, weight, bias) gradients."""
    c = weight.shape[0]
    return torch.ops.aten.convolution_backward(
        grad.contiguous(), window, weight, [c], [1, 1], [0, 0], [1, 1], False, [0, 0], 1, [True, True, True]
    )


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
    arguments = dict(weights=weights, bias=bias, comm=COMM, dtype=torch.float32, replicate=True)
    plain = LayerModule(layer, **arguments, overlap=False)
    overlapped = LayerModule(layer, **arguments, overlap=True)
    (name,) = plain.input_names
    block = rng.standard_normal((n, c, h, w)).astype(np.float32)
    gy = rng.standard_normal((n, c, h, w)).astype(np.float32)
    hand = HandLayer(COMM, grid, (n, c, h, w), torch.from_numpy(weights), torch.from_numpy(bias))
    out_name = plain.output_names[0]

    def module_step(module):
        tensor = torch.from_numpy(block).requires_grad_()  # the module never writes its input
        y = module({name: tensor})[out_name]
        y.backward(torch.from_numpy(gy))
        return (
            y.detach(),
            tensor.grad,
            [p.grad for n, p in module.parameter_state().items() if n.startswith("wt[")],
        )

    # equal first (float32 rounding): outputs, input gradients, weight gradients (summed over ranks)
    problems = []
    results = {}
    for label, module in (("plain", plain), ("overlapped", overlapped)):
        for p in module.parameters():
            p.grad = None
        results[label] = module_step(module)
    for overlap in (False, True):
        y, dx, dw, db = hand.step(block, gy, overlap=overlap)
        dw, db = dw.numpy(), db.numpy()
        hand_label = "hand overlapped" if overlap else "hand plain"
        for label, (my, mdx, grads) in results.items():
            if not np.allclose(my.numpy(), y.numpy(), atol=1e-4) or not np.allclose(
                mdx.numpy(), dx.numpy(), atol=1e-4
            ):
                problems.append(
                    f"{label}: the output or input gradient differs from the {hand_label} layer's"
                )
            if grads and RANK == 0 and not np.allclose(grads[0].numpy(), dw, rtol=1e-3, atol=1e-2):
                problems.append(f"{label}: the weight gradient differs from the {hand_label} layer's")
    problems = [p for ps in COMM.allgather(problems) for p in ps]
    if problems:
        raise SystemExit("bench_overlap: " + "; ".join(problems))

    def linop_windows():
        windows = plain.windows.run({name: torch.from_numpy(block)})
        plain.windows.run_adjoint(windows)

    # the exchange's messages alone: linop's HaloExchange bound in place on a padded block, and
    # the hand-written messages on another, checked equal first (forward, then adjoint)
    exchange = HaloExchange(layer.geometry)
    (local,) = [b for b in exchange.domain if b.worker == RANK]
    pads = {k: np.zeros(local.shape, np.float32) for k in ("linop", "hand")}
    for array in pads.values():
        array[..., 1 : h + 1, 1 : w + 1] = block
    bound = mpi_backend.plan_for(exchange, comm=COMM).bind({local.name: pads["linop"]})
    bound_adjoint = mpi_backend.plan_for(exchange.H, comm=COMM).bind({local.name: pads["linop"]})
    bound()
    hand._exchange(pads["hand"], hand.edge, hand.halo, add=False)()
    same = np.array_equal(pads["linop"], pads["hand"])
    bound_adjoint()
    hand._exchange(pads["hand"], hand.halo, hand.edge, add=True)()
    bulk = (..., slice(1, h + 1), slice(1, w + 1))  # linop's adjoint also clears the halos it sent
    same = same and np.array_equal(pads["linop"][bulk], pads["hand"][bulk])
    if not COMM.allreduce(same, op=MPI.LAND):
        raise SystemExit("bench_overlap: linop's exchange differs from the hand-written one")
    gpad = np.zeros((n, c, h + 2, w + 2), np.float32)
    gpad[..., 1 : h + 1, 1 : w + 1] = gy

    def linop_exchange():
        bound()
        bound_adjoint()

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
        "exchange (hand)": lambda: hand.exchange_only(pads["hand"]),
        "windows (linop)": linop_windows,
        "windows (hand)": lambda: hand.windows(block, gpad),
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
            print(f"  {who}: exchange hidden {hidden:6.1%} of its {exchange * 1e3:.2f} ms (messages alone)")
        ratios = np.asarray(times["overlapped (linop)"]) / np.asarray(times["overlapped (hand)"])
        print(
            f"  overlapped linop / overlapped hand: {float(np.median(ratios)):.3f} (median of per-sample ratios)"
        )
        ratios = np.asarray(times["plain (linop)"]) / np.asarray(times["plain (hand)"])
        print(f"  plain linop / plain hand:           {float(np.median(ratios)):.3f}")


if __name__ == "__main__":
    main()
