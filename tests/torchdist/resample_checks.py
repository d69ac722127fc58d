"""Checks of the resampling modules (Interpolate / Upsample, MaxPool, Repartition) on a
torch.distributed group: ``python resample_checks.py K`` forks K gloo processes
(rendezvous on 127.0.0.1 at a port this launcher holds, ``rendezvous.py``; 120 s timeout). Every process builds the same modules with
``group=True``, passes its own blocks, and compares its outputs and input gradients with
torch's layers run on the whole tensor in that process; the verdicts are agreed over the group
and each process prints ``RESAMPLE OK rank <r>`` when every check passed everywhere.
Launched by ``tests/test_torch_resample.py``."""

from __future__ import annotations

import datetime
import os
import sys
import traceback

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from linop import DistributedTensor, LinopError, Partition
from linop.frameworks.torch_pooling import MaxPool
from linop.frameworks.torch_repartition import Repartition
from linop.frameworks.torch_resample import Interpolate, Upsample

TIMEOUT = datetime.timedelta(seconds=120)


def _run(module, x, y, data, dy, rank, dtype=torch.float64, mapping=None):
    """This rank's blocks (``mapping``: worker -> rank, else worker w on rank w) through the
    module and back twice (the second call on the bound plans); the gathered-by-reference
    comparison data: (my y blocks, my x gradients)."""
    for _ in range(2):
        mine = {
            b.name: torch.from_numpy(x.scatter(data)[b.name]).to(dtype).requires_grad_()
            for b in x.space
            if (b.worker if mapping is None else mapping[b.worker]) == rank
        }
        out = module(mine)
        cotangent = y.scatter(dy)
        loss = sum((out[k] * torch.from_numpy(cotangent[k]).to(dtype)).sum() for k in out)
        (loss + module.token.sum()).backward()
    grads = {k: (torch.zeros_like(v) if v.grad is None else v.grad) for k, v in mine.items()}
    return {k: v.detach() for k, v in out.items()}, grads


def _differs(y, grads, x, yt, expected_y, expected_dx, **tolerance) -> str | None:
    full_y, full_dx = yt.scatter(expected_y), x.scatter(expected_dx)
    wrong = [k for k, v in y.items() if not np.allclose(v.numpy(), full_y[k], **tolerance)]
    wrong += [k for k, v in grads.items() if not np.allclose(v.numpy(), full_dx[k], **tolerance)]
    return f"blocks differ from torch's: {wrong}" if wrong else None


def _reference(layer, data, dy, dtype=torch.float64):
    t = torch.from_numpy(data).to(dtype).requires_grad_()
    out = layer(t)
    out.backward(torch.from_numpy(dy).to(dtype))
    return out.detach().numpy(), t.grad.numpy()


def _layout(shape, grid, sizes) -> DistributedTensor:
    if sizes is None:
        return DistributedTensor("x", shape, Partition(grid))
    return DistributedTensor("x", shape, Partition(grid), sizes=sizes)


def checks(rank: int, size: int) -> list[tuple[str, str | None]]:
    rng = np.random.default_rng(11)
    results = []
    tight = dict(rtol=0, atol=1e-10)

    def interpolation(shape, grid, sizes, kwargs, dtype=torch.float64):
        x = _layout(shape, grid, sizes)
        cls = Upsample if dtype == torch.float32 else Interpolate
        module = cls(x, **kwargs, dtype=dtype, group=True)
        data, dy = rng.standard_normal(shape), rng.standard_normal(module.y.global_shape)
        y, grads = _run(module, x, module.y, data, dy, rank, dtype)
        expected = _reference(lambda t: torch.nn.functional.interpolate(t, **kwargs), data, dy, dtype)
        tolerance = tight if dtype == torch.float64 else dict(rtol=1.3e-6, atol=1e-5)
        return _differs(y, grads, x, module.y, *expected, **tolerance)

    def pool(shape, grid, sizes, kwargs, dtypes=(torch.float64,), mapping=None):
        x = _layout(shape, grid, sizes)
        module = MaxPool(x, **kwargs, group=True, mapping=mapping)
        reference = {1: torch.nn.MaxPool1d, 2: torch.nn.MaxPool2d}[len(shape) - 2](**kwargs)
        # the same module on new data each time (a new dtype: new local blocks, bound again):
        # what a call keeps for the next (its local blocks, the padding's -inf) must not leak
        for dtype in dtypes:
            data, dy = rng.standard_normal(shape), rng.standard_normal(module.y.global_shape)
            y, grads = _run(module, x, module.y, data, dy, rank, dtype, mapping)
            tolerance = tight if dtype == torch.float64 else dict(rtol=1e-6, atol=1e-6)
            problem = _differs(y, grads, x, module.y, *_reference(reference, data, dy, dtype), **tolerance)
            if problem:
                return f"{dtype}: {problem}"
        return None

    def pool_refusal():
        """The last rank's block of a wrong shape in the first call: every rank raises the
        agreed error naming it (the exchange's entry check), and the group stays usable."""
        x = _layout((1, 1, 6, 4), (1, 1, size, 1), None)
        module = MaxPool(x, 2, group=True)
        mine = {b.name: torch.zeros(b.shape) for b in x.space if b.worker == rank}
        if rank == size - 1:
            mine[next(iter(mine))] = torch.zeros((1, 1, 1, 1))
        try:
            module(mine)
        except LinopError as error:
            named = f"rank {size - 1}" in str(error) and "(1, 1, 1, 1)" in str(error)
            return None if named else f"{type(error).__name__} names another fault: {error}"
        return "no error"

    def repartition():
        x = DistributedTensor("x", (2, 3, 7, 5), Partition((1, 1, size, 1)))
        z = DistributedTensor("z", (2, 3, 7, 5), Partition((1, 1, 1, size)), sizes=((2,), (3,), (7,), (4, 1)))
        module = Repartition(x, z, group=True)
        data, dy = rng.standard_normal(x.global_shape), rng.standard_normal(x.global_shape)
        y, grads = _run(module, x, z, data, dy, rank)
        return _differs(y, grads, x, z, data, dy, rtol=0, atol=0)

    cases = {
        "nearest x2, uneven shares": lambda: interpolation(
            (1, 2, 9), (1, 1, size), ((1,), (2,), (7, 2)) if size == 2 else None, dict(scale_factor=2)
        ),
        "bilinear to 11x4, corners": lambda: interpolation(
            (2, 2, 7, 5), (1, 1, size, 1), None, dict(size=(11, 4), mode="bilinear", align_corners=True)
        ),
        "bilinear x0.5 over channels and width": lambda: interpolation(
            (1, 2, 6, 8), (1, size, 1, 1), None, dict(scale_factor=0.5, mode="bilinear")
        ),
        "trilinear x2, float32": lambda: interpolation(
            (1, 1, 4, 3, 3), (1, 1, 1, size, 1), None, dict(scale_factor=2, mode="trilinear"), torch.float32
        ),
        "max pool 3/2/1, new data, float32": lambda: pool(
            (2, 2, 9, 6),
            (1, 1, size, 1),
            None,
            dict(kernel_size=3, stride=2, padding=1),
            (torch.float64, torch.float64, torch.float32),
        ),
        "max pool 3/3, trimmed windows": lambda: pool(
            (2, 2, 10, 4), (1, 1, size, 1), None, dict(kernel_size=3, stride=3, padding=(0, 1))
        ),
        "max pool 2, workers without output": lambda: pool(
            (1, 1, 3), (1, 1, size), None, dict(kernel_size=2)
        ),
        # both workers on rank 0: the others hold no block and cannot see the dtype change,
        # so every call agrees on it (before, rank 0 bound again alone and the group failed)
        "max pool 3/2/1, dtypes change, ranks without blocks": lambda: pool(
            (1, 2, 8, 4),
            (1, 1, 2, 1),
            None,
            dict(kernel_size=3, stride=2, padding=1),
            (torch.float64, torch.float64, torch.float32, torch.float32, torch.float64),
            [0, 0],
        ),
        "max pool refuses a wrong block on every rank": pool_refusal,
        "repartition": repartition,
    }
    for name, case in cases.items():
        try:
            problem = case()
        except Exception:  # reported with the others
            problem = traceback.format_exc(limit=4)
        results.append((name, problem))
    return results


def process(rank: int, size: int, port: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size, timeout=TIMEOUT
    )
    try:
        results = checks(rank, size)
        gathered: list = [None] * size
        dist.all_gather_object(gathered, [(name, problem) for name, problem in results if problem])
        failures = [
            f"rank {r}: {name}: {problem}" for r, found in enumerate(gathered) for name, problem in found
        ]
        if failures:
            print("\n".join(failures), flush=True)
            raise SystemExit(1)
        print(f"RESAMPLE OK rank {rank} ({len(results)} checks)", flush=True)
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    from rendezvous import held_port

    mp.start_processes(
        process, args=(int(sys.argv[1]), held_port()), nprocs=int(sys.argv[1]), start_method="fork"
    )
