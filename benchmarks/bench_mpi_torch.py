"""MPI + PyTorch benchmark: a halo-window tree as a TorchOperator across ranks, forward +
backward, against the same moves hand-written with mpi4py in a torch autograd.Function.

Run with 2 or 4 ranks::

    mpiexec -n 4 python benchmarks/bench_mpi_torch.py
    mpiexec -n 4 python benchmarks/bench_mpi_torch.py --convolution   # the second table alone

An N x N float64 tensor is cut into row strips over the ranks; each rank's window for a 3 x 3
kernel with zero padding 1 is its strip with one halo row from each neighbour (zeros at the ends,
and a zero column on each side). ``linop``: ``TorchOperator(halo_windows(...), comm=comm)``: a plan
checked once per direction; at these sizes (at least ``STRAIGHT_FROM`` bytes per rank) each call
runs it on the tensors' memory, smaller blocks are copied into buffers bound with persistent
requests and the results out (``linop.frameworks.torch_function.BoundTensors``). ``hand``: an
``autograd.Function`` that allocates the window, copies the strip in and exchanges halo rows with
``Isend``/``Irecv`` (backward: sends the halo rows' gradients back and adds them into the
neighbours' edge rows). Both are checked equal first (windows and gradients); a sample's time is
the maximum over ranks of one forward + backward; medians and the ratio linop / hand are printed on
rank 0. Nothing is asserted about speed.

Second table: a row-partitioned 3 x 3 convolution, ``LayerModule(Convolution(...), comm=)``
against a hand-written halo exchange (``Isend``/``Irecv`` in an autograd.Function) + ``conv2d``
+ ``Allreduce`` of the weight gradients. The module moves data with linop trees on plans bound
once (the input's halo windows, the parameters' broadcast from their owner, and the adjoints of
both in the backward) and computes with torch's ``conv2d`` and its backward, as the hand-written
layer does. ``owners``: the parameters live on their owner (rank 0), broadcast in each forward
and their gradients summed back (two more collective rounds than the hand-written layer);
``replicated`` (``replicate=True``): every rank holds the copies it uses and the backward
all-reduces their gradients, the hand-written layer's own scheme. Outputs, input gradients and
the held weight gradients are checked equal to the hand-written layer's first.
"""

from __future__ import annotations

import sys
import time
from statistics import median

import numpy as np
from mpi4py import MPI

try:
    import torch
except ImportError:  # pragma: no cover - the torch extra is not installed
    if MPI.COMM_WORLD.rank == 0:
        print("bench_mpi_torch: torch is not installed (pip install -e '.[torch]'); skipped")
    sys.exit(0)

from linop import DistributedTensor, Kernel, Partition, halo_windows
from linop.frameworks.torch_function import TorchOperator

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size
SAMPLES = 15


def hand_function(comm):
    up, down = RANK - 1, RANK + 1
    neighbours = [(up, 0, 1), (down, -1, -2)]  # (rank, halo row, edge row of the bulk)

    class Windows(torch.autograd.Function):
        @staticmethod
        def forward(ctx, strip):
            rows, cols = strip.shape
            window = torch.zeros((rows + 2, cols + 2), dtype=strip.dtype)
            window[1:-1, 1:-1] = strip
            w = window.numpy()
            halos: dict[int, np.ndarray] = {}
            requests = []
            for peer, halo, edge in neighbours:
                if 0 <= peer < SIZE:
                    requests.append(comm.Irecv(halos.setdefault(halo, np.empty(cols)), source=peer))
                    requests.append(comm.Isend(np.ascontiguousarray(w[edge, 1:-1]), dest=peer))
            MPI.Request.Waitall(requests)
            for halo, row in halos.items():
                w[halo, 1:-1] = row
            return window

        @staticmethod
        def backward(ctx, grad):
            g = grad.numpy()
            back = torch.from_numpy(np.array(g[1:-1, 1:-1]))
            b = back.numpy()
            received = {}
            requests = []
            for peer, halo, edge in neighbours:
                if 0 <= peer < SIZE:
                    received[edge] = np.empty(b.shape[1])
                    requests.append(comm.Irecv(received[edge], source=peer))
                    requests.append(comm.Isend(np.ascontiguousarray(g[halo, 1:-1]), dest=peer))
            MPI.Request.Waitall(requests)
            for edge, row in received.items():
                b[0 if edge == 1 else -1] += row
            return back

    return Windows.apply


def timed(call) -> float:
    COMM.Barrier()
    start = time.perf_counter()
    call()
    return COMM.allreduce(time.perf_counter() - start, op=MPI.MAX)


def main() -> None:
    torch.set_num_threads(1)
    if RANK == 0:
        print(f"{SIZE} ranks: {'N':>6} {'linop fwd+bwd':>14} {'hand fwd+bwd':>13} {'ratio':>6}")
    for size in (1024, 4096):
        tensor = DistributedTensor("x", (size, size), Partition.grid((SIZE, 1)))
        windows = halo_windows(tensor, Kernel(3, padding=1))
        f = TorchOperator(windows, comm=COMM)
        (x_name,), (y_name,) = f.inputs, f.outputs
        rng = np.random.default_rng(RANK)
        strip = torch.from_numpy(rng.standard_normal(tensor.space.block(x_name).shape))
        weight = torch.from_numpy(rng.standard_normal(windows.range.block(y_name).shape))
        hand = hand_function(COMM)

        def ours(strip=strip, weight=weight, f=f, x_name=x_name, y_name=y_name):
            x = strip.detach().requires_grad_()
            y = f({x_name: x})[y_name]
            (y * weight).sum().backward()
            return y.detach(), x.grad

        def theirs(strip=strip, weight=weight, hand=hand):
            x = strip.detach().requires_grad_()
            y = hand(x)
            (y * weight).sum().backward()
            return y.detach(), x.grad

        (y1, g1), (y2, g2) = ours(), theirs()
        same = bool(torch.equal(y1, y2) and torch.allclose(g1, g2, rtol=0, atol=1e-12))
        if not COMM.allreduce(same, op=MPI.LAND):
            raise SystemExit("bench_mpi_torch: linop and the hand-written exchange differ")
        mine, hand_times, ratios = [], [], []
        for _ in range(SAMPLES):
            a, b = timed(ours), timed(theirs)
            mine.append(a)
            hand_times.append(b)
            ratios.append(a / b)
        if RANK == 0:
            print(
                f"{'':>9}{size:>6} {median(mine) * 1e3:>11.2f} ms {median(hand_times) * 1e3:>10.2f} ms"
                f" {median(ratios):>5.2f}x"
            )


def hand_conv(comm, weight: torch.Tensor, bias: torch.Tensor):
    """A row-partitioned 3 x 3 convolution (padding 1) written by hand: a halo exchange of one
    row each way as an autograd.Function (Isend/Irecv), then torch's conv2d; the weight and bias
    gradients are summed over the ranks (Allreduce), as a data-parallel code would."""
    up, down = RANK - 1, RANK + 1

    class Halo(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            n, c, rows, cols = x.shape
            window = torch.zeros((n, c, rows + 2, cols), dtype=x.dtype)
            window[:, :, 1:-1] = x
            w = window.numpy()
            received = {}
            requests = []
            for peer, halo, edge in ((up, 0, 1), (down, -1, -2)):
                if 0 <= peer < SIZE:
                    received[halo] = np.empty((n, c, cols))
                    requests.append(comm.Irecv(received[halo], source=peer))
                    requests.append(comm.Isend(np.ascontiguousarray(w[:, :, edge]), dest=peer))
            MPI.Request.Waitall(requests)
            for halo, rows_in in received.items():
                w[:, :, halo] = rows_in
            return window

        @staticmethod
        def backward(ctx, grad):
            g = grad.numpy()
            back = np.array(g[:, :, 1:-1])
            received = {}
            requests = []
            for peer, halo, edge in ((up, 0, 0), (down, -1, -1)):
                if 0 <= peer < SIZE:
                    received[edge] = np.empty(g.shape[:2] + g.shape[3:])
                    requests.append(comm.Irecv(received[edge], source=peer))
                    requests.append(comm.Isend(np.ascontiguousarray(g[:, :, halo]), dest=peer))
            MPI.Request.Waitall(requests)
            for edge, rows_in in received.items():
                back[:, :, edge] += rows_in
            return torch.from_numpy(back)

    def step(x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, ...]:
        w, b = weight.detach().requires_grad_(), bias.detach().requires_grad_()
        x = x.detach().requires_grad_()
        y = torch.nn.functional.conv2d(Halo.apply(x), w, b, padding=(0, 1))
        (y * dy).sum().backward()
        for grad in (w.grad, b.grad):
            comm.Allreduce(MPI.IN_PLACE, grad.numpy())
        return y.detach(), x.grad, w.grad, b.grad

    return step


def conv_main() -> None:
    from linop.frameworks.torch_layers import LayerModule
    from linop.layers import Convolution

    if RANK == 0:
        print(f"{SIZE} ranks, convolution 3 x 3 (padding 1), forward + backward:")
        print(
            f"  {'x (N, C, H, W)':>20} {'hand':>10} {'linop owners':>13} {'ratio':>6}"
            f" {'linop replicated':>17} {'ratio':>6}"
        )
    for shape, out_channels, samples in (
        ((2, 4, 16 * SIZE, 32), 4, 41),
        ((4, 8, 32 * SIZE, 64), 8, 21),
        ((8, 16, 64 * SIZE, 128), 16, 9),
    ):
        x = DistributedTensor("x", shape, Partition((1, 1, SIZE, 1)))
        layer = Convolution(x, out_channels, Kernel(3, padding=1))
        rng = np.random.default_rng(0)
        w, b = rng.standard_normal(layer.weights.global_shape), rng.standard_normal(layer.bias.global_shape)
        modules = [LayerModule(layer, weights=w, bias=b, comm=COMM, replicate=r) for r in (False, True)]
        data, dy = rng.standard_normal(shape), rng.standard_normal(layer.y.global_shape)
        (x_name,), (y_name,) = modules[0].input_names, modules[0].output_names
        strip = torch.from_numpy(x.scatter(data)[x_name])
        dy_strip = torch.from_numpy(layer.y.scatter(dy)[y_name])
        hand = hand_conv(COMM, torch.from_numpy(w), torch.from_numpy(b))

        def ours(module, strip=strip, dy_strip=dy_strip, x_name=x_name, y_name=y_name):
            module.zero_grad()
            x = strip.detach().requires_grad_()
            y = module({x_name: x})[y_name]
            ((y * dy_strip).sum() + module.token.sum()).backward()
            return y.detach(), x.grad, [p.grad for p in module.parameters()]

        def theirs(hand=hand, strip=strip, dy_strip=dy_strip):
            return hand(strip, dy_strip)

        y2, g2, w2, b2 = theirs()
        same = True
        for module in modules:  # outputs and input gradients; the weight gradients where held
            y1, g1, grads = ours(module)
            same &= bool(torch.allclose(y1, y2) and torch.allclose(g1, g2))
            same &= all(torch.allclose(g, w2 if g.ndim == 4 else b2) for g in grads)
        if not COMM.allreduce(same, op=MPI.LAND):
            raise SystemExit("bench_mpi_torch: the linop layer and the hand-written convolution differ")
        times: list[list[float]] = [[], [], []]
        for _ in range(samples):
            times[0].append(timed(theirs))
            for column, module in zip(times[1:], modules):
                column.append(timed(lambda module=module: ours(module)))
        hand_time, owners, replicated = (median(column) for column in times)
        ratio_owners = median(a / h for a, h in zip(times[1], times[0]))
        ratio_replicated = median(a / h for a, h in zip(times[2], times[0]))
        if RANK == 0:
            print(
                f"  {shape!s:>20} {hand_time * 1e3:>7.2f} ms {owners * 1e3:>10.2f} ms {ratio_owners:>5.2f}x"
                f" {replicated * 1e3:>14.2f} ms {ratio_replicated:>5.2f}x"
            )


if __name__ == "__main__":
    if "--convolution" not in sys.argv[1:]:  # the convolution table alone: --convolution
        main()
    else:
        torch.set_num_threads(1)
    conv_main()
