"""Checks of the torch.distributed executor, run on every process of one gloo launch.

Launched by ``tests/test_torch_distributed.py`` under ``torch.distributed.run`` (torchrun) or
``torch.multiprocessing.spawn`` (``spawn.py``). Every process builds the same trees and runs
every check; each check's pass or fail is agreed over the group (:func:`agree`), so every
process takes the same path and a failure on one fails all. The process prints ``CHECKS OK
<n>`` at the end, or raises with the failures of every rank.

Exact first: data movement on integer arrays, compared entry by entry with the numpy
interpreter.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "mpi"))  # the tree strategies (tests/mpi/strategies.py)

from linop import (  # noqa: E402
    Block,
    DistributedTensor,
    HaloExchange,
    Kernel,
    Partition,
    SendRecv,
    Space,
    halo_geometry,
    halo_windows,
)
from linop.backends import torch_distributed as td  # noqa: E402
from linop.collectives import AllGather, AllReduce, BlockGrid, Broadcast, SumReduce  # noqa: E402
from linop.errors import (  # noqa: E402
    DistributedStateError,
    ProcessGroupArgumentError,
    ProcessGroupError,
    TreeMismatchError,
)
from linop.repartition import Gather, Repartition, Scatter  # noqa: E402

LONG = os.environ.get("LINOP_LONG") == "1"
TIMEOUT = datetime.timedelta(seconds=300)  # generous: a loaded machine skews the ranks


DTYPE_CHANGES = (torch.float64, torch.float64, torch.float32, torch.float32, torch.float64)
"""The dtypes of consecutive calls: a change after a kept binding, twice."""


class _AgreementCount:
    """``count_agreements()``: the list of the torch wrappers' per-call agreements on dtypes
    (:meth:`linop.frameworks.torch_function._Runner.agree`) this process makes from now on,
    each by its tree's name (a binding's own reduction not counted), until ``.stop()``."""

    def __call__(self) -> list[str]:
        from linop.frameworks import torch_function

        sent: list[str] = []
        self.original = original = torch_function._group_max

        def counted(plan: Any, value: int, doing: str) -> int:
            if doing.startswith("agreeing"):
                sent.append(str(plan.op))
            return original(plan, value, doing)

        torch_function._group_max = counted
        return sent

    def stop(self) -> None:
        from linop.frameworks import torch_function

        torch_function._group_max = self.original


count_agreements = _AgreementCount()


def agree(ok: bool, message: str) -> list[str]:
    """Every rank's failure messages (empty when the check passed everywhere)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, None if ok else f"rank {dist.get_rank()}: {message}")
    return [m for m in gathered if m is not None]


def local(space: Space, state: dict, rank: int, *, as_torch: bool = True) -> dict:
    """The blocks of ``state`` that ``rank`` owns, as fresh tensors (or arrays)."""
    out = {b.name: np.array(state[b.name]) for b in space if b.worker == rank}
    return {k: on_device(torch.from_numpy(v)) for k, v in out.items()} if as_torch else out


DEVICE = os.environ.get("LINOP_CHECKS_DEVICE")  # "cuda:K" under NCCL (spawn.py --nccl)


def on_device(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor on the launch's device (the CPU unless NCCL)."""
    return tensor if DEVICE is None else tensor.to(DEVICE)


def differs(result: dict, expected: dict, names: tuple[str, ...], *, exact: bool = True) -> str | None:
    if sorted(result) != sorted(names):
        return f"blocks {sorted(result)} instead of {sorted(names)}"
    for name in names:
        value = result[name]
        got = np.asarray(value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else value)
        want = np.asarray(expected[name])
        if got.shape != want.shape:
            return f"{name}: shape {got.shape} versus {want.shape}"
        if exact:
            same = np.array_equal(got, want)
        else:  # sums in another order: a few units of the dtype's precision
            eps = 64 * float(np.finfo(np.result_type(got.dtype, np.float16)).eps)
            same = np.allclose(got, want, rtol=eps, atol=eps * max(1.0, float(np.abs(want).max(initial=0))))
        if not same:
            wrong = int(np.sum(got != want))
            return f"{name}: {wrong} wrong entries"
    return None


def bound_calls_differ(bound: Any, op: Any, mine: dict, seed: int, names: tuple[str, ...]) -> str | None:
    """Two calls of a bound plan on new values written into the bound tensors ``mine``, each
    compared with the numpy interpreter (then the plan is freed); the first difference."""
    try:
        for call in range(2):
            again = op.domain.random(seed + 1 + call, dtype=np.int64)
            for name, tensor in mine.items():
                tensor.copy_(torch.from_numpy(again[name]))
            problem = differs(bound(), op(again), names)
            if problem is not None:
                return f"bound call {call}: {problem}"
        return None
    finally:
        bound.free()


def against_numpy(
    op: Any, seed: int, *, dtype: Any = np.int64, inplace: bool = False, **kw: Any
) -> str | None:
    """Apply ``op`` with the executor on this rank's blocks; compare with the numpy interpreter;
    also that the caller's tensors are unchanged (out of place)."""
    rank = dist.get_rank()
    mapping = td.WorkerMap.of(kw["mapping"]) if kw.get("mapping") is not None else None
    group = kw.get("group")
    place = rank if group is None else dist.get_rank(group)  # this process's rank in the group

    def mine_in(space: Space) -> tuple[str, ...]:
        where = (lambda w: w) if mapping is None else mapping.rank_of
        return tuple(b.name for b in space if where(b.worker) == place)

    full = op.domain.random(seed, dtype=dtype)
    expected = op(full)
    held = mine_in(op.domain)
    mine = {k: on_device(torch.from_numpy(np.array(full[k]))) for k in held}
    before = {k: v.clone() for k, v in mine.items()}
    result = td.apply(op, mine, inplace=inplace, **kw)
    names = mine_in(op.range)
    problem = differs(result, expected, names, exact=np.dtype(dtype).kind in "iu")
    if problem is None and not inplace and any(not torch.equal(before[k], mine[k]) for k in mine):
        problem = "the caller's tensors were changed"
    if problem is None and mine and any(not isinstance(v, torch.Tensor) for v in result.values()):
        problem = "results are not tensors"
    return problem


def _against_plain(op: Any, plain: Any, seed: int) -> str | None:
    """``op`` under the executor against the numpy interpreter's ``plain`` (the same operator)."""
    rank = dist.get_rank()
    full = op.domain.random(seed, dtype=np.int64)
    mine = {
        b.name: on_device(torch.from_numpy(np.array(full[b.name]))) for b in op.domain if b.worker == rank
    }
    result = td.apply(op, mine)
    return differs(result, plain(full), tuple(b.name for b in op.range if b.worker == rank))


def grid_2d(size: int) -> tuple[int, int]:
    return {1: (1, 1), 2: (2, 1), 3: (3, 1), 4: (2, 2)}[size]


class Checks:
    """The checks, collected; :meth:`run` agrees on each one over the group."""

    def __init__(self) -> None:
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.failures: list[str] = []
        self.count = 0

    def run(self, name: str, check: Callable[[], str | None]) -> None:
        if os.environ.get("LINOP_CHECK_TRACE") == "1":
            print(f"rank {self.rank}: {name}", flush=True)
        try:
            problem = check()
        except Exception as error:
            problem = f"raised {type(error).__name__}: {error}"
        self.count += 1
        self.failures += [f"{name}: {m}" for m in agree(problem is None, str(problem))]

    # -- halo exchanges ----------------------------------------------------------------------
    def halos(self) -> None:
        size = self.size
        cases = {
            "halo 1-d width 1": (
                DistributedTensor("x", (4 * size + 1,), Partition((size,))),
                Kernel(3, padding=1),
            ),
            "halo 1-d width 3": (
                DistributedTensor("x", (4 * size + 1,), Partition((size,))),
                Kernel(7, padding=3),
            ),
            "halo 2-d width 1": (
                DistributedTensor("x", (9, 8), Partition(grid_2d(size))),
                Kernel(3, padding=1),
            ),
            "halo 2-d width 3": (
                DistributedTensor("x", (13, 12), Partition(grid_2d(size))),
                Kernel(7, padding=3),
            ),
            "halo unbalanced": (
                DistributedTensor(
                    "x", (3 * size + 2,), Partition((size,)), sizes=[[1] * (size - 1) + [2 * size + 3]]
                )
                if size > 1
                else DistributedTensor("x", (5,), Partition((1,))),
                Kernel(3, padding=1),
            ),
            "halo multi-hop": (DistributedTensor("x", (2 * size,), Partition((size,))), Kernel(7, padding=3)),
            "halo periodic": (
                DistributedTensor("x", (3 * size, 4), Partition((size, 1))),
                Kernel(3, padding=1, boundary="periodic"),
            ),
        }
        for name, (tensor, kernel) in cases.items():
            op = HaloExchange(halo_geometry(tensor, kernel))
            self.run(name, lambda op=op: against_numpy(op, 1))
            self.run(name + " adjoint", lambda op=op: against_numpy(op.H, 2))
            self.run(name + " in place", lambda op=op: against_numpy(op, 3, inplace=True))
            self.run(name + " float64", lambda op=op: against_numpy(op, 4, dtype=np.float64))
        windows = halo_windows(DistributedTensor("u", (7, 5), Partition(grid_2d(size))), Kernel(3, padding=1))
        self.run("halo windows", lambda: against_numpy(windows, 5))
        self.run("halo windows adjoint", lambda: against_numpy(windows.H, 6))

    # -- the same tensors again (linop.backends.entry_check.repeat) -----------------------------
    def repeats(self) -> None:
        """In-place calls passing the same tensor again run the check's collective on the kept
        vector and the kept phases: exact, and served by the repeat. A change to the same
        tensor object (new storage, a reshape, ``requires_grad`` under grad mode) is a miss:
        exact, or the typed error on every rank. Each has a control: a stale repeat (the
        object compared only) gives a wrong answer or misses the error."""
        if DEVICE is not None or os.environ.get("LINOP_TORCH_DEVICE_PATH") == "1":  # the host path's
            return
        self.run("repeat: the same tensor again", self._repeated)
        self.run("repeat: the check's reduction started on the group", self._reduced_on_the_group)
        for change in ("set_", "resize_", "requires_grad_"):
            for stale in (False, True):
                name = f"repeat: {change} on the same tensor" + (" (control: stale)" if stale else "")
                self.run(name, lambda change=change, stale=stale: self._changed(change, stale))
        self.run("repeat: a collected tensor", self._collected)

    def _repeat_halo(self) -> HaloExchange:
        tensor = DistributedTensor("x", (4 * self.size, 6), Partition((self.size, 1)))
        return HaloExchange(halo_geometry(tensor, Kernel(3, padding=1)))

    def _repeated(self) -> str | None:
        op = self._repeat_halo().H  # the adjoint adds: a stale run would show
        state = op.domain.random(31, dtype=np.int64).copy()
        state = {n: a.astype(np.float64) for n, a in state.items()}
        mine = local(op.domain, state, self.rank)
        names = tuple(mine)
        for call in range(4):
            state = op(state)
            problem = differs(td.apply(op, mine, inplace=True), state, names)
            if problem is not None:
                return f"call {call}: {problem}"
        plan = td.plan_for(op)
        hits = plan.entry.last.hits if plan.entry.last is not None else -1
        if plan._again is None or hits < 2:
            return f"the repeat served {hits} of 3 repeated calls"
        return None

    def _reduced_on_the_group(self) -> str | None:
        """A repeated call's check starts its reduction on the group, with none of
        ``torch.distributed.all_reduce``'s per-call work (counted); control: the reducer's
        general path (its options dropped) goes through ``all_reduce`` once per call."""
        if self.size == 1:
            return None
        op = self._repeat_halo()
        state = {n: a.astype(np.float64) for n, a in op.domain.random(35, dtype=np.int64).items()}
        mine = local(op.domain, state, self.rank)
        td.apply(op, mine, inplace=True)
        reducer = td.plan_for(op).context.reducer
        counted = [0]
        all_reduce = dist.all_reduce

        def counting(*args: Any, **kwargs: Any) -> Any:
            counted[0] += 1
            return all_reduce(*args, **kwargs)

        maximum = reducer._maximum
        dist.all_reduce = counting
        try:
            for _ in range(2):
                state = op(state)
                problem = differs(td.apply(op, mine, inplace=True), state, tuple(mine))
                if problem is not None:
                    return problem
            direct = counted[0]
            reducer._maximum = None  # control: the general path, every rank alike
            td.apply(op, mine, inplace=True)
        finally:
            dist.all_reduce = all_reduce
            reducer._maximum = maximum
        if direct != 0:
            return f"{direct} torch.distributed.all_reduce call(s) in 2 repeated calls"
        return None if counted[0] == 1 else f"control: {counted[0]} all_reduce call(s) on the general path"

    def _changed(self, change: str, stale: bool) -> str | None:
        from linop.backends.torch_distributed import plan as td_plan

        op = self._repeat_halo()
        state = {n: a.astype(np.float64) for n, a in op.domain.random(32, dtype=np.int64).items()}
        mine = local(op.domain, state, self.rank)
        for _ in range(2):
            td.apply(op, mine, inplace=True)
        fresh = {n: a.astype(np.float64) for n, a in op.domain.random(33, dtype=np.int64).items()}
        (name,) = mine
        tensor = mine[name]
        tensor.copy_(torch.from_numpy(fresh[name]))
        last = self.rank == self.size - 1
        if change == "set_":  # every rank: new storage under the same object
            tensor.set_(torch.from_numpy(fresh[name].copy()))
        elif change == "resize_" and last:  # same memory, another shape
            tensor.resize_(tensor.shape[1], tensor.shape[0])
        elif change == "requires_grad_" and last:
            tensor.requires_grad_()
        same = td_plan._SameTensors.same
        if stale:
            td_plan._SameTensors.same = lambda self, state: state.get(self.name) is self.ref()  # type: ignore
        try:
            result = td.apply(op, mine, inplace=True)
        except DistributedStateError as error:
            raised = str(error)
        else:
            raised = None
        finally:
            td_plan._SameTensors.same = same  # type: ignore[method-assign]
        if change == "set_":
            problem = differs(result, op(fresh), (name,))
            if stale:  # the stale phases wrote the old storage: wrong on a rank that receives
                gathered: list[Any] = [None] * self.size
                dist.all_gather_object(gathered, problem)
                return None if self.size == 1 or any(gathered) else "the stale repeat gave numpy's answer"
            return problem
        if stale:
            return None if raised is None else f"the stale repeat raised: {raised}"
        if raised is None:
            return "no DistributedStateError"
        return None if ("shape" in raised or "gradient" in raised) else raised

    def _collected(self) -> str | None:
        import gc

        op = self._repeat_halo().H
        state = {n: a.astype(np.float64) for n, a in op.domain.random(34, dtype=np.int64).items()}
        mine = local(op.domain, state, self.rank)
        for _ in range(2):
            td.apply(op, mine, inplace=True)
        (name,) = mine
        del mine[name]
        gc.collect()
        mine[name] = torch.from_numpy(np.array(state[name]))
        return differs(td.apply(op, mine, inplace=True), op(state), (name,))

    # -- the overlapped halo exchange -----------------------------------------------------------
    def overlap(self) -> None:
        """The overlapped convolution (interior run while the exchange's messages are in
        flight) equals the plain tree's numpy result, forward and adjoint, integers."""
        from linop.layers import Convolution

        if DEVICE is not None or os.environ.get("LINOP_TORCH_DEVICE_PATH") == "1":  # no local operators there
            return
        size = self.size
        cases = {
            "overlap 1-d": (
                DistributedTensor("x", (1, 2, 4 * size + 1), Partition((1, 1, size))),
                Kernel(3, padding=1),
            ),
            "overlap 2-d": (
                DistributedTensor("x", (1, 1, 9, 8), Partition((1, 1, *grid_2d(size)))),
                Kernel(5, padding=2),
            ),
        }
        for name, (tensor, kernel) in cases.items():
            layer = Convolution(tensor, 2, kernel, bias=False)
            w = np.random.default_rng(3).integers(-2, 3, layer.weights.global_shape)
            plain, overlapped = layer.input_operator(w), layer.input_operator(w, overlap=True)
            self.run(name, lambda a=overlapped, b=plain: _against_plain(a, b, 7))
            self.run(name + " adjoint", lambda a=overlapped.H, b=plain.H: _against_plain(a, b, 8))
        self.run("overlap LayerModule", self._overlapped_module)

    def _overlapped_module(self) -> str | None:
        """LayerModule(overlap=True) on the group gives the plain module's outputs and
        gradients exactly (integer-valued float64)."""
        from linop.frameworks.torch_layers import LayerModule
        from linop.layers import Convolution

        x = DistributedTensor("x", (1, 2, 9, 8), Partition((1, 1, *grid_2d(self.size))))
        conv = Convolution(x, 2, Kernel(3, padding=1))
        rng = np.random.default_rng(4)
        w = rng.integers(-2, 3, conv.weights.global_shape).astype(float)
        b = rng.integers(-2, 3, conv.bias.global_shape).astype(float)
        data = x.scatter(rng.integers(-3, 4, x.global_shape).astype(float))
        runs = []
        for overlap in (False, True):
            module = LayerModule(conv, weights=w, bias=b, group=True, overlap=overlap)
            inputs = {n: torch.from_numpy(data[n].copy()).requires_grad_() for n in module.input_names}
            out = module(inputs)
            (sum((v * v).sum() for v in out.values()) + module.token.sum()).backward()
            grads = {n: p.grad for n, p in module.parameter_state().items()}
            runs.append(({**out, **{n + ".grad": t.grad for n, t in inputs.items()}}, grads))
        for a, c in zip(*runs):
            if sorted(a) != sorted(c) or any(not torch.equal(a[n], c[n]) for n in a):
                return f"the overlapped module differs from the plain one: {sorted(a)}"
        return None

    # -- collectives and repartitions ----------------------------------------------------------
    def collectives(self) -> None:
        size = self.size
        tensor = DistributedTensor("x", (7, 6), Partition((size, 1)))
        other = DistributedTensor("z", (7, 6), Partition((1, size)))
        w = DistributedTensor("w", (3, 4), Partition.grid((1, 1)))
        layout = BlockGrid.uniform("a", Partition(grid_2d(size)), (6, 5))
        root = Block("r", (6, 5), size - 1)
        scattered = DistributedTensor("s", (6, 5), Partition((size, 1)))
        trees = {
            "repartition rows to columns": Repartition(tensor, other),
            "broadcast": Broadcast(w, Partition.grid((size, 1)), "w_copy"),
            "sum-reduce": SumReduce(w, Partition.grid((size, 1)), "w_copy"),
            "all-reduce axis 0": AllReduce(layout, (0,)),
            "all-reduce axes 0 1": AllReduce(layout, (0, 1)),
            "scatter": Scatter(root, scattered),
            "gather": Gather(root, scattered),
        }
        for name, op in trees.items():
            self.run(name, lambda op=op: against_numpy(op, 7))
            self.run(name + " adjoint", lambda op=op: against_numpy(op.H, 8))
            self.run(name + " float32", lambda op=op: against_numpy(op, 9, dtype=np.float32))
        for name in ("broadcast", "sum-reduce", "all-reduce axis 0"):
            op = trees[name]
            self.run(
                name + " is native on the world group",
                lambda op=op: None if td.plan_for(op).native or self.size == 1 else "portable",
            )
            self.run(name + " float64 native", lambda op=op: against_numpy(op, 10, dtype=np.float64))
            self.run(name + " uint16 portable", lambda op=op: against_numpy(op, 11, dtype=np.uint16))
        for name in ("repartition rows to columns", "scatter", "gather"):
            self.run(
                name + " is native on the world group",
                lambda op=trees[name]: None if td.plan_for(op).native or self.size == 1 else "portable",
            )

    def native_moves(self) -> None:
        """Repartitions (even, uneven, empty shares, 2-d grids), scatters, gathers and
        all-gathers run as one ``all_to_all_single`` (native; their adjoints too, but the
        reduce-scatters, which add, run their own rank's point-to-point phases): equal entry by entry, in
        integers, to the point-to-point program (the same tree under the identity worker map)
        and to the numpy interpreter, forward and adjoint, unbound and bound (two calls on new
        values). Control: a native step with two peers' boxes swapped is caught."""
        from linop.collectives import AllGather

        size = self.size
        uneven = [1] * (size - 1) + [9 - (size - 1)] if size > 1 else [9]
        zero = [0] + [3] * (size - 1) if size > 1 else [3]
        trees = {
            "rows to columns": Repartition(
                DistributedTensor("p", (9, 7), Partition((size, 1))),
                DistributedTensor("q", (9, 7), Partition((1, size))),
            ),
            "uneven rows to even rows": Repartition(
                DistributedTensor("p", (9, 5), Partition((size, 1)), sizes=[uneven, [5]]),
                DistributedTensor("q", (9, 5), Partition((size, 1))),
            ),
            "an empty share": Repartition(
                DistributedTensor(
                    "p", (3 * (size - 1) if size > 1 else 3, 4), Partition((size, 1)), sizes=[zero, [4]]
                ),
                DistributedTensor("q", (3 * (size - 1) if size > 1 else 3, 4), Partition((1, size))),
            ),
            "grid to columns 3-d": Repartition(
                DistributedTensor("p", (5, 6, 3), Partition((*grid_2d(size), 1))),
                DistributedTensor(
                    "q", (5, 6, 3), Partition((1, 1, size)) if size <= 3 else Partition((1, 2, 2))
                ),
            ),
            "scatter": Scatter(Block("r", (7, 3), 0), DistributedTensor("s", (7, 3), Partition((size, 1)))),
            "gather": Gather(
                Block("r", (5, 6), size - 1), DistributedTensor("s", (5, 6), Partition((1, size)))
            ),
            "all-gather": AllGather(DistributedTensor("a", (7, 4), Partition((size, 1))), 0, "g"),
            "all-gather 2-d": AllGather(DistributedTensor("a", (6, 5), Partition(grid_2d(size))), 1, "g"),
        }
        identity = td.WorkerMap(list(range(size)))

        def compare(op: Any, seed: int) -> str | None:
            plan = td.plan_for(op)
            if size > 1 and not plan.native:
                return "not native"
            full = op.domain.random(seed, dtype=np.int64)
            mine = local(op.domain, full, self.rank)
            native = plan.apply(mine)
            portable = td.apply(op, local(op.domain, full, self.rank), mapping=identity)
            names = tuple(b.name for b in op.range if b.worker == self.rank)
            problem = differs(native, op(full), names) or differs(native, portable, names)
            if problem is not None:
                return problem
            bound = plan.bind(mine, inplace=False)
            one_exchange = [type(s).__name__ for s in plan.schedule_for(np.dtype(np.int64))] == [
                "AllToAllStep"
            ]
            host = DEVICE is None and os.environ.get("LINOP_TORCH_DEVICE_PATH") != "1"
            if host and one_exchange != bound.prepared:
                return f"one all-to-all: {one_exchange}, bound and prepared: {bound.prepared}"
            return bound_calls_differ(bound, op, mine, seed, names)

        for name, op in trees.items():
            self.run(f"native {name}", lambda op=op: compare(op, 31))
            self.run(f"native {name} adjoint", lambda op=op: compare(op.H, 32))

        def control() -> str | None:
            """A native step whose receive boxes are shifted one row up (the same split sizes)
            gives wrong entries that the comparison finds on every rank (so the comparisons
            above can fail)."""
            from linop.backends.torch_distributed.plan import TorchDistributedPlan
            from linop.program import RankProgram

            if size == 1:
                return None
            op = trees["rows to columns"]
            plan = TorchDistributedPlan(op, td.plan_context())
            native = plan._compiled.native
            (step,) = native.schedule
            shifted = tuple(
                (peer, (start[0] - 1, *start[1:]) if start[0] > 0 else start, shape)
                for peer, start, shape in step.receives
            )
            wrong = type(step)(step.source, step.target, step.sends, shifted)
            plan._compiled.native = RankProgram((wrong,), native.max_worker)
            full = op.domain.random(33, dtype=np.int64)
            result = plan.apply(local(op.domain, full, self.rank))
            names = tuple(b.name for b in op.range if b.worker == self.rank)
            return (
                None if differs(result, op(full), names) is not None else "the shifted boxes were not caught"
            )

        self.run("control: a wrong native all-to-all is caught", control)

    def native_gathers(self) -> None:
        """All-gathers along one axis of equal shares run as ``all_gather_into_tensor`` on each
        line's sub-group and their adjoints, the reduce-scatters, as ``reduce_scatter_tensor``
        (``$LINOP_TORCH_GATHERS=native``; by default small gloo groups run the nodes'
        point-to-point programs instead) (shares leading or not, the line in rank order or reversed, one line or two): native, and equal entry by
        entry, in integers, to the numpy interpreter and to the point-to-point program,
        unbound and bound; in float32 too, and a uint16 run takes the portable program.
        Control: a step whose members' order is rotated is caught."""
        from linop.backends.torch_distributed.schedule import GatherStep
        from linop.collectives import AllGather

        size = self.size
        trees = {
            "rows": AllGather(DistributedTensor("a", (2 * size, 3), Partition((size, 1))), 0, "g"),
            "a middle axis": AllGather(
                DistributedTensor("a", (3, 2 * size, 2), Partition((1, size, 1))), 1, "g"
            ),
            "reversed workers": AllGather(
                DistributedTensor("a", (2, 3 * size), Partition((1, size), workers=tuple(range(size))[::-1])),
                1,
                "g",
            ),
        }
        if size == 4:  # two lines, each on its own sub-group
            trees["the lines of a grid"] = AllGather(
                DistributedTensor("a", (3, 4, 2), Partition((2, 2, 1))), 1, "g"
            )
        identity = td.WorkerMap(list(range(size)))

        def compare(op: Any, seed: int, dtype: Any = np.int64) -> str | None:
            plan = td.plan_for(op)
            steps = [type(s) for s in plan.schedule_for(np.dtype(dtype))]
            native = np.dtype(dtype).char in "bBhilqfdFD"
            if size > 1 and native and (not plan.native or steps != [GatherStep]):
                return f"not one native gather step: {[s.__name__ for s in steps]}"
            if not native and GatherStep in steps:
                return "a native gather step for a dtype gloo does not sum"
            full = op.domain.random(seed, dtype=dtype)
            mine = local(op.domain, full, self.rank)
            before = {k: v.clone() for k, v in mine.items()}
            result = plan.apply(mine)
            if any(not torch.equal(before[k], mine[k]) for k in mine):
                return "the caller's tensors were changed"
            portable = td.apply(op, local(op.domain, full, self.rank), mapping=identity)
            names = tuple(b.name for b in op.range if b.worker == self.rank)
            exact = np.dtype(dtype).kind in "iu"  # float32: sums in another order
            problem = differs(result, op(full), names, exact=exact) or differs(
                result, portable, names, exact=exact
            )
            if problem is not None or np.dtype(dtype) != np.int64:
                return problem
            bound = plan.bind(mine, inplace=False)
            return bound_calls_differ(bound, op, mine, seed, names)

        for name, op in trees.items():
            self.run(f"native all-gather {name}", lambda op=op: compare(op, 41))
            self.run(f"native reduce-scatter {name} (the adjoint)", lambda op=op: compare(op.H, 42))
            self.run(f"native reduce-scatter {name} float32", lambda op=op: compare(op.H, 43, np.float32))
            self.run(f"reduce-scatter {name} uint16 portable", lambda op=op: compare(op.H, 44, np.uint16))

        def control() -> str | None:
            """The same steps with the members' ranks rotated by one give wrong entries on
            every rank, which the comparison finds (so the comparisons above can fail)."""
            from linop.backends.torch_distributed.plan import TorchDistributedPlan
            from linop.program import RankProgram

            if size == 1 or not td.plan_context().native_gathers:  # point-to-point gathers
                return None
            caught = []
            for op in (trees["rows"], trees["rows"].H):
                plan = TorchDistributedPlan(op, td.plan_context())
                native = plan._compiled.native
                (step,) = native.schedule
                wrong = dataclasses.replace(step, positions=(*step.positions[1:], step.positions[0]))
                plan._compiled.native = RankProgram((wrong,), native.max_worker)
                full = op.domain.random(45, dtype=np.int64)
                result = plan.apply(local(op.domain, full, self.rank))
                names = tuple(b.name for b in op.range if b.worker == self.rank)
                caught.append(differs(result, op(full), names) is not None)
            return None if all(caught) else f"a rotated order was not caught: {caught}"

        self.run("control: a native gather in the wrong order is caught", control)

    def uneven_reduce_scatters(self) -> None:
        """Reduce-scatters along one axis of uneven shares (some empty at 3-4 processes) run as
        one ``reduce_scatter`` of a list of uneven shares on each line's sub-group
        (``$LINOP_TORCH_GATHERS=native``; by default small gloo groups run the node's
        point-to-point program): native where more than one process holds the line, and equal
        entry by entry, in integers, to the numpy interpreter and to the portable program
        (shares leading or not, the line in rank order or reversed, two lines), the adjoint (an
        all-gather of the same shares, one all-to-all) too; a uint16 run takes the portable
        program. Control: a step whose shares are listed in the wrong order is caught."""
        from linop.backends.torch_distributed.schedule import ReduceScatterStep
        from linop.collectives import ReduceScatter

        size = self.size
        trees = {
            "rows": ReduceScatter(DistributedTensor("u", (2 * size + 1, 3), Partition((size, 1))), 0, "g"),
            "a middle axis, empty shares": ReduceScatter(
                DistributedTensor("u", (2, size - 1 if size > 2 else size + 1, 3), Partition((1, size, 1))),
                1,
                "g",
            ),
            "reversed workers": ReduceScatter(
                DistributedTensor(
                    "u", (2, 2 * size + 1), Partition((1, size), workers=tuple(range(size))[::-1])
                ),
                1,
                "g",
            ),
        }
        if size == 4:  # two lines, each on its own sub-group
            trees["the lines of a grid"] = ReduceScatter(
                DistributedTensor("u", (3, 5, 2), Partition((2, 2, 1))), 1, "g"
            )
        identity = td.WorkerMap(list(range(size)))
        native_gathers = td.plan_context().native_gathers

        def compare(op: Any, seed: int, dtype: Any = np.int64) -> str | None:
            plan = td.plan_for(op)
            steps = [type(s) for s in plan.schedule_for(np.dtype(dtype))]
            native = np.dtype(dtype).char in "bBhilqfdFD"
            reduce_scatter = isinstance(op, ReduceScatter)
            if size > 1 and native and reduce_scatter and (not plan.native or steps != [ReduceScatterStep]):
                return f"not one native reduce-scatter step: {[s.__name__ for s in steps]}"
            if not native and ReduceScatterStep in steps:
                return "a native reduce-scatter step for a dtype gloo does not sum"
            full = op.domain.random(seed, dtype=dtype)
            mine = local(op.domain, full, self.rank)
            before = {k: v.clone() for k, v in mine.items()}
            result = plan.apply(mine)
            if any(not torch.equal(before[k], mine[k]) for k in mine):
                return "the caller's tensors were changed"
            portable = td.apply(op, local(op.domain, full, self.rank), mapping=identity)
            names = tuple(b.name for b in op.range if b.worker == self.rank)
            return differs(result, op(full), names) or differs(result, portable, names)

        for name, op in trees.items():
            self.run(f"native uneven reduce-scatter {name}", lambda op=op: compare(op, 51))
            self.run(f"uneven reduce-scatter {name}: the adjoint", lambda op=op: compare(op.H, 52))
            self.run(
                f"uneven reduce-scatter {name} uint16 portable", lambda op=op: compare(op, 53, np.uint16)
            )

        def control() -> str | None:
            """The same step with the places of the members of equal shares rotated (so that
            every list still fits: a misfit would fail inside gloo on some ranks only) gives
            wrong entries, which the comparison finds (so the comparisons above can fail)."""
            from linop.backends.torch_distributed.plan import TorchDistributedPlan
            from linop.program import RankProgram

            op = trees["rows"]  # shares (3, 2, ..., 2): members 1 .. size - 1 share alike
            if size < 3 or not native_gathers:  # fewer than two equal shares: nothing to rotate
                return None
            plan = TorchDistributedPlan(op, td.plan_context())
            native = plan._compiled.native
            (step,) = native.schedule
            places = step.positions
            wrong = dataclasses.replace(step, positions=(places[0], *places[2:], places[1]))
            plan._compiled.native = RankProgram((wrong,), native.max_worker)
            full = op.domain.random(55, dtype=np.int64)
            names = tuple(b.name for b in op.range if b.worker == self.rank)
            result = plan.apply(local(op.domain, full, self.rank))
            wrong_here = differs(result, op(full), names) is not None
            return None if self.rank == 0 or wrong_here else "a rotated order was not caught"

        self.run("control: a native uneven reduce-scatter in the wrong order is caught", control)

    def table(self) -> None:
        """A part type without a row in torch.distributed's table of calls (the row removed on
        every rank alike, while the plan compiles): the plan runs the portable program and is
        exact, forward and adjoint; the same tree with the whole table (the control) is native
        on more than one rank, and exact too (one rank runs no collective: both are exact)."""
        from types import MappingProxyType

        from linop.backends.torch_distributed import schedule
        from linop.backends.torch_distributed.plan import TorchDistributedPlan
        from linop.program.parts import AllReducePart, LineGatherPart, RootedPart

        size = self.size
        layout = BlockGrid.uniform("tbl", Partition(grid_2d(size)), (6, 5))
        w = DistributedTensor("tbw", (3, 4), Partition.grid((1, 1)))
        line = DistributedTensor("tbg", (4, 2 * size), Partition((1, size)))
        trees = {
            "all-reduce": (AllReduce(layout, (0,)), AllReducePart),
            "broadcast": (Broadcast(w, Partition.grid((size, 1)), "tbw_copy"), RootedPart),
            "all-gather": (AllGather(line, 1, "tbg_all"), LineGatherPart),
        }

        def run(op: Any, plan: Any, seed: int) -> str | None:
            full = op.domain.random(seed, dtype=np.int64)
            result = plan.apply(local(op.domain, full, self.rank))
            return differs(result, op(full), tuple(b.name for b in op.range if b.worker == self.rank))

        for name, (tree, kind) in trees.items():
            for op in (tree, tree.H):

                def check(op: Any = op, kind: type = kind) -> str | None:
                    whole = schedule.CALLS
                    schedule.CALLS = MappingProxyType({k: v for k, v in whole.items() if k is not kind})
                    try:
                        without = TorchDistributedPlan(op, td.plan_context())
                    finally:
                        schedule.CALLS = whole
                    control = TorchDistributedPlan(op, td.plan_context())
                    problem = run(op, without, 31) or run(op, control, 32)
                    if size == 1:  # one rank: its groups are itself, no part to look up
                        return problem
                    if problem is None and without.native:
                        problem = f"native without the row of {kind.__name__}"
                    if problem is None and not control.native:
                        problem = "the control (the whole table) is not native"
                    return problem

                self.run(
                    f"table without {kind.__name__}: {name}{' adjoint' if op is not tree else ''}", check
                )

    def mapped(self) -> None:
        workers = 2 * self.size
        tensor = DistributedTensor("m", (3 * workers,), Partition((workers,)))
        op = HaloExchange(halo_geometry(tensor, Kernel(3, padding=1)))
        for name, mapping in (
            ("blocked", td.WorkerMap.blocked(workers, self.size)),
            ("round robin", td.WorkerMap.round_robin(workers, self.size)),
        ):
            self.run(f"worker map {name}", lambda m=mapping: against_numpy(op, 12, mapping=m))
            self.run(f"worker map {name} adjoint", lambda m=mapping: against_numpy(op.H, 13, mapping=m))

    def subgroup(self) -> None:
        """A group of the first size - 1 ranks (created by every rank, in order): its members
        run a tree on it (the portable program); the others take no part."""
        if self.size < 3:
            return
        members = list(range(self.size - 1))
        group = dist.new_group(members)
        tensor = DistributedTensor("g", (3 * len(members),), Partition((len(members),)))
        op = HaloExchange(halo_geometry(tensor, Kernel(3, padding=1)))

        def check() -> str | None:
            if self.rank not in members:
                return None
            return against_numpy(op, 14, group=group)

        self.run("sub-group", check)

    def random_trees(self) -> None:
        from hypothesis import HealthCheck, given, settings
        from strategies import movement_trees

        count = 60 if LONG else 12

        @settings(
            derandomize=True,
            database=None,
            deadline=None,
            max_examples=count,
            suppress_health_check=list(HealthCheck),
        )
        @given(movement_trees(self.size))
        def trees(op: Any) -> None:
            problem = None
            try:
                problem = against_numpy(op, 15)
                if problem is None:
                    problem = against_numpy(op.H, 16)
                if problem is None and op.domain == op.range:
                    problem = against_numpy(op, 17, inplace=True)
            except Exception as error:
                problem = f"{type(error).__name__}: {error}"
            failures = agree(problem is None, f"{op}: {problem}")
            assert not failures, failures

        self.run("random trees", lambda: trees())

    # -- bound plans ----------------------------------------------------------------------------
    def bound(self) -> None:
        tensor = DistributedTensor("b", (9, 8), Partition(grid_2d(self.size)))
        op = HaloExchange(halo_geometry(tensor, Kernel(5, padding=2)))
        full = op.domain.random(18, dtype=np.int64)

        def in_place() -> str | None:
            mine = local(op.domain, full, self.rank)
            step = td.plan_for(op).bind(mine)
            if not step.prepared and os.environ.get("LINOP_TORCH_DEVICE_PATH") != "1":
                return "the in-place halo exchange is not prepared"
            state = full
            for _ in range(3):  # three calls: the exchange applied three times
                result = step()
                state = op(state)
                if any(result[k] is not mine[k] for k in mine):
                    return "in place: not the caller's tensors"
                problem = differs(mine, state, tuple(mine))
                if problem:
                    return problem
            step.free()
            return None

        def out_of_place() -> str | None:
            adjoint = op.H
            mine = local(adjoint.domain, full, self.rank)
            step = td.plan_for(adjoint).bind(mine, inplace=False)
            expected = adjoint(full)
            names = tuple(b.name for b in adjoint.range if b.worker == self.rank)
            problem = differs(step(), expected, names)
            other = adjoint.domain.random(19, dtype=np.int64)
            problem = problem or differs(
                step.run_on(local(adjoint.domain, other, self.rank)), adjoint(other), names
            )
            step.free()
            return problem

        self.run("bound in place", in_place)
        self.run("bound out of place", out_of_place)

    def prepared_once(self) -> None:
        """A bound plan's calls (``run_on``, as the layer modules make them) do the collectives
        and the copies only: the steps' groups, sub-group ranks and phase recipes are prepared by
        the first call (the control: it prepares) and never again; a layer's weight and bias
        movements over the whole group run packed into one collective (agreed at binding); every
        call exact against the numpy interpreter, in integers."""
        from linop.backends.torch_distributed import runtime
        from linop.layers import Convolution

        x = DistributedTensor("prep", (2, 3, 3 * self.size + 1, 5), Partition((1, 1, self.size, 1)))
        conv = Convolution(x, 2, Kernel(3, padding=1))
        host = os.environ.get("LINOP_TORCH_DEVICE_PATH") != "1" and self.size > 1
        trees = {
            "halo windows": (conv.window_operator, "recipe"),
            "weight and bias broadcasts": (conv.parameter_movement, "prepare"),
            "their sum-reduces": (conv.parameter_movement.H, "prepare"),
            "their all-reduces": (conv.copy_gradient_sum, None),  # packed: nothing to prepare per step
            # two packed steps side by side (the broadcasts', then the sum-reduces'): run together
            "broadcasts then sum-reduces": (conv.parameter_movement.H @ conv.parameter_movement, "prepare"),
        }
        for name, (op, counter) in trees.items():

            def check(
                op: Any = op, counter: str | None = counter, packs: bool = counter != "recipe"
            ) -> str | None:
                counts = {"prepare": 0, "recipe": 0}
                originals = {
                    "_prepare_rooted": runtime._prepare_rooted,
                    "_prepare_all_reduce": runtime._prepare_all_reduce,
                    "phase_recipe": runtime.phase_recipe,
                }

                def counted(kind: str, function: Any) -> Any:
                    def call(*args: Any, **kwargs: Any) -> Any:
                        counts[kind] += 1
                        return function(*args, **kwargs)

                    return call

                names = tuple(b.name for b in op.range if b.worker == self.rank)
                values = [op.domain.random(seed, dtype=np.int64) for seed in (23, 24, 25)]
                try:
                    for attribute, function in originals.items():
                        kind = "recipe" if attribute == "phase_recipe" else "prepare"
                        setattr(runtime, attribute, counted(kind, function))
                    step = td.plan_for(op).bind(local(op.domain, values[0], self.rank), inplace=False)
                    seen = []
                    for full in values:
                        problem = differs(step.run_on(local(op.domain, full, self.rank)), op(full), names)
                        if problem:
                            return problem
                        seen.append(dict(counts))
                finally:
                    for attribute, function in originals.items():
                        setattr(runtime, attribute, function)
                step.free()
                if host and counter is not None and seen[0][counter] == 0:
                    return f"the control failed: the first call prepared nothing ({seen[0]})"
                if seen[1:] != [seen[0], seen[0]]:
                    return f"a later call prepared again: {seen}"
                if host and packs and not any(type(s) is runtime.PackedStep for s in step._steps or ()):
                    return "the weight and bias collectives are not packed into one"
                return None

            self.run(f"bound {name} prepared once", check)

    # -- autograd -------------------------------------------------------------------------------
    def autograd(self) -> None:
        """Trees as autograd functions, called at float64, float64, float32, float32, float64
        (:data:`DTYPE_CHANGES`): a broadcast's ranks other than its root, and those a
        Repartition from one worker reaches, have no input blocks and cannot see the change;
        the ranks agree on it at each call of such a tree from the second (counted: one
        all-reduce, the forward's only; none for the windows, where every rank has inputs)."""
        from linop.frameworks.torch_function import OperatorModule, function
        from linop.frameworks.torch_repartition import Repartition as RepartitionModule

        u = DistributedTensor("u", (7, 5), Partition(grid_2d(self.size)))
        source = DistributedTensor("a", (5, 3), Partition((1, 1)))
        destination = DistributedTensor("b", (5, 3), Partition((self.size, 1)))
        trees = {
            "windows": halo_windows(u, Kernel(3, padding=1)),
            "broadcast": Broadcast(
                DistributedTensor("w", (2, 3), Partition.grid((1, 1))), Partition.grid((self.size, 1)), "c"
            ),
            "repartition onto more workers": Repartition(source, destination),
        }
        for name, op in trees.items():

            def check(name: str = name, op: Any = op) -> str | None:
                if name.startswith("repartition"):
                    f: Any = RepartitionModule(source, destination, group=True)
                else:
                    f = function(op, group=True)
                sent = count_agreements()
                try:
                    for call, dtype in enumerate(DTYPE_CHANGES):  # then the bound plans, no checks
                        full = op.domain.random(20 + call, dtype=np.int64)
                        cotangent = op.range.random(30 + call, dtype=np.int64)
                        forward = op({k: v.astype(np.float64) for k, v in full.items()})
                        backward = op.H({k: v.astype(np.float64) for k, v in cotangent.items()})
                        x = {
                            k: v.to(dtype).requires_grad_()
                            for k, v in local(op.domain, full, self.rank).items()
                        }
                        y = f(x)
                        weights = {k: v.to(dtype) for k, v in local(op.range, cotangent, self.rank).items()}
                        loss = sum((y[k] * weights[k]).sum() for k in y) + f.token.sum()
                        loss.backward()
                        grads = {k: (torch.zeros_like(v) if v.grad is None else v.grad) for k, v in x.items()}
                        problem = differs(
                            {k: v.detach() for k, v in y.items()}, forward, tuple(y)
                        ) or differs(grads, backward, tuple(x))
                        wrong = [k for k, v in (*y.items(), *grads.items()) if v.dtype != dtype]
                        if problem or wrong:
                            return f"call {call}: {problem or ''} dtypes of {wrong}"
                finally:
                    count_agreements.stop()
                agreed = 4 if self.size > 1 and name != "windows" else 0
                if sent != [str(op)] * agreed:
                    return f"agreements on dtypes {sent}, expected {agreed}"
                if name.startswith("repartition"):
                    return None
                module = OperatorModule(op, group=True)
                return None if module(x).keys() == y.keys() else "OperatorModule outputs differ"

            self.run(f"autograd {name}", check)

    def layer(self) -> None:
        """A convolution held by its owners (the forward broadcasts the parameters, the backward
        sums their gradients back: the native broadcast and reduce) against torch's Conv2d."""
        from linop.frameworks.torch_layers import LayerModule
        from linop.layers import Convolution

        def check() -> str | None:
            x = DistributedTensor("x", (2, 3, 3 * self.size + 1, 5), Partition((1, 1, self.size, 1)))
            conv = Convolution(x, 2, Kernel(3, padding=1))
            rng = np.random.default_rng(3)
            weights = rng.standard_normal(conv.weights.global_shape)
            bias = rng.standard_normal(conv.bias.global_shape)
            layer = LayerModule(conv, weights=weights, bias=bias, group=True)
            twin = torch.nn.Conv2d(3, 2, 3, padding=1, dtype=torch.float64)
            with torch.no_grad():
                twin.weight.copy_(torch.from_numpy(weights))
                twin.bias.copy_(torch.from_numpy(bias))
            image = torch.from_numpy(rng.standard_normal(x.global_shape)).requires_grad_()
            blocks = x.scatter(image.detach().numpy())
            mine = {
                b.name: torch.from_numpy(blocks[b.name]).requires_grad_()
                for b in x.space
                if b.worker == self.rank
            }
            for _ in range(2):  # the second call on the bound plans
                for tensor in (image, *mine.values(), *layer.parameters(), *twin.parameters()):
                    tensor.grad = None
                out = layer(mine)
                (sum((v * v).sum() for v in out.values()) + layer.token.sum()).backward()
                (twin(image) ** 2).sum().backward()
                whole = {
                    **conv.weights.scatter(twin.weight.grad.numpy()),
                    **conv.bias.scatter(twin.bias.grad.numpy()),
                }
                wrong = [n for n, p in layer.parameter_state().items() if not np.allclose(p.grad, whole[n])]
                expected = x.scatter(image.grad.numpy())
                wrong += [n for n, t in mine.items() if not np.allclose(t.grad, expected[n])]
                if wrong:
                    return f"gradients differ from Conv2d's: {wrong}"
            return None

        self.run("LayerModule owners against Conv2d", check)
        for replicate in (False, True):
            self.run(
                f"LayerModule input gradient skipped alike (replicate={replicate})",
                lambda replicate=replicate: self._input_gradient_skip(replicate),
            )

    def _input_gradient_skip(self, replicate: bool) -> str | None:
        """No rank's input needs a gradient: no rank runs the adjoint window movement; rank 0's
        alone does: every rank runs it (the last rank holds no input block), rank 0 gets the
        full path's input gradient, and every later call computes it without asking; the
        parameters' gradients equal the full path's exactly."""
        from linop.frameworks.torch_layers import LayerModule
        from linop.layers import Convolution

        x = DistributedTensor("x", (2, 2, 3 * self.size + 1, 4), Partition((1, 1, max(self.size - 1, 1), 1)))
        conv = Convolution(x, 3, Kernel(3, padding=1))
        rng = np.random.default_rng(9)
        weights, bias = rng.standard_normal(conv.weights.global_shape), rng.standard_normal(3)
        layer = LayerModule(conv, weights=weights, bias=bias, group=True, replicate=replicate)
        blocks = x.scatter(rng.standard_normal(x.global_shape))
        adjoints: list[bool] = []
        run = layer.windows.run

        def counted(tensors: Any, *, adjoint: bool = False) -> Any:
            adjoints.append(adjoint)
            return run(tensors, adjoint=adjoint)

        layer.windows.run = counted  # type: ignore[method-assign]
        found = {}
        for pattern in ("none", "first", "all", "none after"):
            layer.zero_grad()
            adjoints.clear()
            wanted = pattern == "all" or (pattern == "first" and self.rank == 0)
            mine = {
                b.name: torch.from_numpy(blocks[b.name]).requires_grad_(wanted)
                for b in x.space
                if b.worker == self.rank
            }
            out = layer(mine)
            (sum((v * v).sum() for v in out.values()) + layer.token.sum()).backward()
            grads = [p.grad.clone() for p in layer.parameters()]
            found[pattern] = (grads, {n: t.grad for n, t in mine.items()}, adjoints.count(True))
        full, full_x, _ = found["all"]
        counts = [found[p][2] for p in ("none", "first", "all", "none after")]
        if counts != [0, 1, 1, 1]:  # once needed, computed on every later call
            return f"adjoint window movements {counts}, not [0, 1, 1, 1]"
        for pattern in ("none", "first", "none after"):
            if not all(torch.equal(a, b) for a, b in zip(found[pattern][0], full)):
                return f"{pattern}: parameter gradients differ from the full path's"
        if any(g is not None for g in found["none"][1].values()):
            return "none: an input gradient was given"
        if self.rank == 0 and not all(torch.equal(found["first"][1][n], g) for n, g in full_x.items()):
            return "first: rank 0's input gradient differs from the full path's"
        return None

    def kernel_dtypes(self) -> None:
        """Integers averaged by a local kernel travel as floats (the run dtype holds what the
        kernels produce, docs/theory.md#dtypes): the average pooling's adjoint of int64 blocks
        equals the numpy interpreter exactly, in float64 (it was off by 0.5 where halos are
        summed back across ranks). The host path only: the device path has no handler for
        local operators."""
        from linop.backends.torch_distributed.device import FORCE_VARIABLE
        from linop.layers import AveragePool

        if DEVICE is not None or os.environ.get(FORCE_VARIABLE) == "1":
            return

        def check() -> str | None:
            x = DistributedTensor("x", (1, 1, 4 * self.size, 4), Partition((1, 1, self.size, 1)))
            op = AveragePool(x, Kernel(2, padding=1)).operator.H
            rng = np.random.default_rng(7)
            full = {b.name: rng.integers(0, 100, b.shape) for b in op.domain}
            expected = op(full)
            result = td.apply(op, local(op.domain, full, self.rank))
            names = tuple(b.name for b in op.range if b.worker == self.rank)
            wrong = [(n, result[n].dtype) for n in names if result[n].dtype != torch.float64]
            return f"dtypes {wrong}" if wrong else differs(result, expected, names)

        self.run("average pooling's adjoint of integers, exactly", check)

    def norm_losses(self) -> None:
        """BatchNormModule and LossModule against torch's (tests/torchdist/norm_loss_checks.py);
        CPU tensors (not under NCCL)."""
        import norm_loss_checks

        if DEVICE is not None:
            return
        self.run(
            "BatchNormModule against BatchNorm2d", lambda: norm_loss_checks.batchnorm(self.rank, self.size)
        )
        self.run("LossModule against torch losses", lambda: norm_loss_checks.losses(self.rank, self.size))
        self.run(
            "LossModule across dtype changes",
            lambda: norm_loss_checks.dtype_changes(self.rank, self.size, DTYPE_CHANGES, count_agreements),
        )

    # -- typed errors on every rank ----------------------------------------------------------------
    def same_error(self, kind: type, call: Callable[[], Any]) -> str | None:
        try:
            call()
            message = "no error"
        except kind as error:
            message = f"{type(error).__name__}: {error}"
        except Exception as error:
            message = f"UNEXPECTED {type(error).__name__}: {error}"
        gathered: list[Any] = [None] * self.size
        dist.all_gather_object(gathered, message)
        if message.startswith(("no error", "UNEXPECTED")):
            return message
        return None if len(set(gathered)) == 1 else f"messages differ: {gathered}"

    def errors(self) -> None:
        size = self.size
        tensor = DistributedTensor("e", (4 * size,), Partition((size,)))
        op = HaloExchange(halo_geometry(tensor, Kernel(3, padding=1)))
        full = op.domain.random(22, dtype=np.int64)

        def mismatched() -> Any:
            other = HaloExchange(
                halo_geometry(
                    DistributedTensor("e", (4 * size + 1,), Partition((size,))), Kernel(3, padding=1)
                )
            )
            tree = other if self.rank == size - 1 and size > 1 else op
            return td.apply(tree, local(tree.domain, tree.domain.random(0, dtype=np.int64), self.rank))

        def wrong_shape() -> Any:
            mine = local(op.domain, full, self.rank)
            if self.rank == 0:
                name = next(iter(mine))
                mine[name] = torch.zeros(tuple(n + 1 for n in mine[name].shape), dtype=torch.int64)
            return td.apply(op, mine)

        def missing_block() -> Any:
            mine = local(op.domain, full, self.rank)
            if self.rank == size - 1:
                mine.pop(next(iter(mine)))
            return td.apply(op, mine)

        def group_too_small() -> Any:
            big = SendRecv(Space([Block("a", (2,), 0)])["a"], Block("b", (2,), size))
            return td.apply(big, local(big.domain, big.domain.random(0, dtype=np.int64), self.rank))

        def bad_group() -> Any:
            return td.apply(op, local(op.domain, full, self.rank), group="world")

        def both_engines() -> Any:
            from linop.frameworks.torch_function import function

            return function(op, comm=object(), group=True)

        def control() -> str | None:
            """A wrong entry in one rank's result is caught by the comparison (the checks above
            can fail)."""
            mine = local(op.domain, full, self.rank)
            result = td.apply(op, mine)
            names = tuple(b.name for b in op.range if b.worker == self.rank)
            if self.rank != size - 1:
                return differs(result, op(full), names)
            name = next(n for n in names if result[n].numel())
            wrong = dict(result)
            wrong[name] = result[name].clone()
            wrong[name].view(-1)[0] += 1
            return None if differs(wrong, op(full), names) is not None else "a wrong entry was not caught"

        self.run("control: a wrong entry is caught", control)
        if size > 1:
            self.run("error: mismatched tree", lambda: self.same_error(TreeMismatchError, mismatched))
        self.run("error: wrong block shape", lambda: self.same_error(DistributedStateError, wrong_shape))
        self.run("error: missing block", lambda: self.same_error(DistributedStateError, missing_block))
        self.run("error: group too small", lambda: self.same_error(ProcessGroupError, group_too_small))
        self.run("error: bad group argument", lambda: self.same_error(ProcessGroupArgumentError, bad_group))
        self.run("error: comm and group", lambda: self.same_error(ProcessGroupArgumentError, both_engines))
        # the group still works after the errors
        self.run("after the errors", lambda: against_numpy(op, 23))


MARKERS = "LINOP_CHECKS_MARKERS"
"""Environment variable: a directory the launcher test made for this launch, where each rank of
a finale leaves a file once it has raised the error it must raise."""
HANG_BOUND = 240.0
"""Seconds a rank of a finale waits for its peers' files before it reports that they never came
(a hang detector well inside the group's 300 s timeout, not a measure of speed)."""


def _mark(rank: int) -> None:
    """Leave this rank's file: it has raised what it must raise."""
    Path(os.environ[MARKERS], f"rank{rank}").write_text("raised")


def _wait_for_marks(ranks: list[int]) -> bool:
    """Wait until every rank in ``ranks`` has left its file (True), or HANG_BOUND has passed (False)."""
    import time

    directory = Path(os.environ[MARKERS])
    give_up = time.monotonic() + HANG_BOUND
    while not all((directory / f"rank{r}").exists() for r in ranks):
        if time.monotonic() > give_up:
            return False
        time.sleep(0.05)
    return True


def _stay_until_the_others_raised(rank: int, size: int, label: str) -> None:
    """The rank that never arrives stays alive until every other rank has raised: their errors
    then come from their deadline, not from this process ending. Prints ``<label> ABSENT``."""
    if _wait_for_marks([r for r in range(size) if r != rank]):
        print(f"{label} ABSENT rank {rank}", flush=True)
    else:
        print(f"{label} NEVER RAISED: the others still waited after {HANG_BOUND:g} s", flush=True)


def _assert_names_the_deadline(error: Exception, rank: int, size: int, seconds: float) -> None:
    message = str(error)
    for part in (f"rank {rank}", f"group of {size}", f"within {seconds:g} s"):
        if part not in message:
            raise AssertionError(f"the PeerTimeoutError does not say {part!r}: {message}") from error


def missing_peer(seconds: float = 3.0) -> None:
    """The last check of a launch (the group is unusable afterwards): every rank but the last
    calls the executor with ``timeout=seconds``; the last never arrives, and stays alive until
    every other rank has raised (so that only the deadline can have ended their wait). Each rank
    that called must raise a PeerTimeoutError naming itself, the group and the deadline. Prints
    ``TIMEOUT OK`` on each such rank and ``TIMEOUT ABSENT`` on the last; the launcher test looks
    for both."""
    from linop.errors import PeerTimeoutError

    rank, size = dist.get_rank(), dist.get_world_size()
    tensor = DistributedTensor("t", (4 * size,), Partition((size,)))
    op = HaloExchange(halo_geometry(tensor, Kernel(3, padding=1)))
    if rank == size - 1:
        _stay_until_the_others_raised(rank, size, "TIMEOUT")
        return
    try:
        td.apply(op, local(op.domain, op.domain.random(0, dtype=np.int64), rank), timeout=seconds)
    except PeerTimeoutError as error:
        _assert_names_the_deadline(error, rank, size, seconds)
        _mark(rank)
        print(f"TIMEOUT OK rank {rank}: {error}", flush=True)
        return
    raise AssertionError("no PeerTimeoutError without the last rank")


def _causes(error: BaseException) -> str:
    """The messages of ``error`` and every error it was raised from."""
    parts = []
    while error is not None:
        parts.append(f"{type(error).__name__}: {error}")
        error = error.__cause__ or error.__context__
    return " <- ".join(parts)


def failing_rank() -> None:
    """A last check of a launch (the group is unusable afterwards): a call after the entry
    check in which the last rank fails (its run raises). Every rank must raise RankFailedError:
    the failing rank from its own error (chained), and then ends its process, as an uncaught
    error would; its peers then, because its connections closed (their chain says so: gloo
    reports a connection closed or reset by the peer), not from the group's 300 s timeout (no
    error in their chain may speak of a timeout). Gloo cannot
    close a group's connections while the process lives (``destroy_process_group``, ``abort``
    and ``shutdown`` leave a peer waiting; measured with torch 2.13): the process ending is
    what frees the peers. Prints ``FAILURE OK`` on each rank; the launcher test looks for it."""
    from linop.backends.torch_distributed import runtime
    from linop.errors import RankFailedError

    rank, size = dist.get_rank(), dist.get_world_size()
    op = Repartition(
        DistributedTensor("f", (4 * size, 3), Partition((size, 1))),
        DistributedTensor("h", (4 * size, 3), Partition((1, size))),
    )
    mine = local(op.domain, op.domain.random(0, dtype=np.int64), rank, as_torch=False)
    td.apply(op, mine)  # a first call that works
    failing = rank == size - 1
    if failing:

        def fails(*args: Any) -> None:
            raise ValueError(f"rank {rank} fails on purpose")

        from types import MappingProxyType

        from linop.backends.torch_distributed.schedule import AllToAllStep

        runtime.RUNS = MappingProxyType({**runtime.RUNS, AllToAllStep: fails})  # type: ignore[misc]
    try:
        td.apply(op, mine)
    except RankFailedError as error:
        chain = _causes(error)
        if failing and f"rank {rank} fails on purpose" not in chain:
            raise AssertionError(f"the failing rank's error does not chain its own: {chain}") from error
        lost = any(f"connection {how}" in chain.lower() for how in ("closed", "reset"))  # gloo says either
        if not failing and ("timed out" in chain.lower() or not lost):
            raise AssertionError(
                f"a peer was not freed by the failing rank's closed connections: {chain}"
            ) from error
        print(f"FAILURE OK rank {rank}: {error}", flush=True)
        return
    raise AssertionError("no RankFailedError")


def absent_from_bound_call(seconds: float = 3.0) -> None:
    """A last check of a launch of 2 or 3 processes: every rank binds an in-place periodic halo
    exchange (the check passes, its phases are prepared) with ``timeout=seconds``; the last rank
    never makes the first call and stays alive until the others have raised. Every other rank
    must raise a PeerTimeoutError naming itself, the group and the deadline. Prints
    ``BOUND TIMEOUT OK`` on each such rank and ``BOUND TIMEOUT ABSENT`` on the last."""
    from linop.errors import PeerTimeoutError

    rank, size = dist.get_rank(), dist.get_world_size()
    tensor = DistributedTensor("t", (4 * size,), Partition((size,)))
    # periodic: at 2 or 3 ranks every rank exchanges with the last one
    op = HaloExchange(halo_geometry(tensor, Kernel(3, padding=1, boundary="periodic")))
    mine = local(op.domain, op.domain.random(0, dtype=np.int64), rank, as_torch=False)
    step = td.plan_for(op).bind(mine, timeout=seconds)
    if not step.prepared:
        raise AssertionError("the bound halo exchange is not prepared")
    if rank == size - 1:
        _stay_until_the_others_raised(rank, size, "BOUND TIMEOUT")
        return
    try:
        step()
    except PeerTimeoutError as error:
        _assert_names_the_deadline(error, rank, size, seconds)
        _mark(rank)
        print(f"BOUND TIMEOUT OK rank {rank}: {error}", flush=True)
        return
    raise AssertionError("no PeerTimeoutError without the last rank")


FINALES = {"failure": failing_rank, "bound-timeout": absent_from_bound_call}
"""The last case of a spawn launch, chosen by ``$LINOP_CHECKS_FINALE`` (each leaves the group
unusable)."""


def main(readme: str | None = None, *, timeout_case: bool = False) -> None:
    checks = Checks()
    for part in (
        checks.halos,
        checks.repeats,
        checks.overlap,
        checks.collectives,
        checks.native_moves,
        checks.native_gathers,
        checks.uneven_reduce_scatters,
        checks.table,
        checks.mapped,
        checks.subgroup,
        checks.bound,
        checks.prepared_once,
        checks.autograd,
        checks.layer,
        checks.kernel_dtypes,
        checks.norm_losses,
        checks.errors,
        checks.random_trees,
    ):
        only = os.environ.get("LINOP_CHECKS_ONLY")  # a comma-separated list of parts, for a quick rerun
        if only is None or part.__name__ in only.split(","):
            part()
    if readme is not None:
        checks.run("README block", lambda: _readme(readme))
    if checks.failures:
        raise AssertionError(f"{len(checks.failures)} check(s) failed:\n" + "\n".join(checks.failures))
    print(f"CHECKS OK {checks.count} rank {checks.rank}", flush=True)
    if timeout_case:
        missing_peer()


def _readme(path: str) -> str | None:
    exec(compile(Path(path).read_text(), path, "exec"), {"__name__": "__main__"})
    return None


if __name__ == "__main__":  # under torchrun: the environment gives the rank and the rendezvous
    # python checks.py [README_BLOCK.py] [--timeout-case]
    arguments = [a for a in sys.argv[1:] if not a.startswith("--")]
    dist.init_process_group("gloo", timeout=TIMEOUT)
    main(arguments[0] if arguments else None, timeout_case="--timeout-case" in sys.argv)
    sys.stdout.flush()
    os._exit(0)  # after the timeout case the group cannot be shut down cleanly
