"""Per-rank planning cost of the layers as the job grows: what one rank spends on a layer
before moving a byte.

:mod:`bench_scale` measures the movement trees (halo exchanges, collectives, repartitions);
this script measures the layers of :mod:`linop.layers` the same way: in one process, without
MPI, for one interior rank of a ``s x s`` spatial grid of ``P = s**2`` workers (x of shape
``(2, 4, 8s, 8s)`` on ``1 x 1 x s x s``; Affine: ``(2, 8P)`` on ``1 x P``), the stages

``layer``
    the layer's description (its constructor: partitions, shares, halo geometry, tensors);
``tree``
    its operator tree (``input_operator(weights)``, ``operator``, ``at(windows)`` or
    ``reduction_operator``; for the adjoint rows, then ``.H``);
``fingerprint``
    :func:`linop.program.fingerprint` of the tree (the digest every rank checks);
``lower``
    :func:`linop.program.lower_for` (the steps the rank takes part in);
``batch``
    :func:`linop.program.batch` of those steps;
``project``
    :func:`linop.program.project` onto the interior rank ``(s//2) * s + s//2``.

The cases: ``Convolution`` (``Convolution(x, 4, Kernel(3, padding=1))``, feature
partition), ``Convolution P_co=2`` (its work partition ``1 x 2 x 1 x s x s``, twice the
workers: the input broadcast over the output channels), ``Affine`` (4 output features, the
input features cut over P: a sum-reduce of the partial outputs; ``Affine replicate``: the same
layer, its module with ``replicate=True``), ``Interpolate``
(``scale_factor=2``, nearest), ``AveragePool`` (kernel 3, padding 1), ``MaxPool``
(:class:`~linop.layers.MaxPoolJacobian`, kernel 2 stride 2, at the interior rank's window
only, as a rank builds it under MPI), ``Loss`` (``mse``, mean), ``WindowChain`` (a
convolution, kernel 3 padding 1, then an average pool of 2) and ``Repartition`` (x to
``1 x 1 x 2s x s/2``; its tree is the layer itself, :mod:`bench_scale` has its stages alone). For every stage it prints the
seconds and the peak of traced memory (``tracemalloc``, a second pass) and the growth
exponent ``k`` of ``time ~ P**k`` over the two largest P (least squares over all with
``--fit all``), as :mod:`bench_scale` does (its :func:`~bench_scale.exponent`).

``--module`` adds a stage ``module``: the torch module of the layer
(:class:`~linop.frameworks.torch_layers.LayerModule` for Convolution and Affine,
:class:`~linop.frameworks.torch_pooling.MaxPool`, :class:`~linop.frameworks.
torch_resample.Upsample`, :class:`~linop.frameworks.torch_losses.LossModule`,
:class:`~linop.frameworks.torch_chain.ChainModule`,
:class:`~linop.frameworks.torch_repartition.Repartition`) built on :class:`bench_scale.RankOfP`,
a test communicator answering as the interior rank of P would (needs torch and mpi4py).

Usage::

    python benchmarks/bench_scale_layers.py                    # P = 64 ... 4096
    python benchmarks/bench_scale_layers.py --max 16384        # P = 64 ... 16,384
    python benchmarks/bench_scale_layers.py --min 16384 --max 262144 --no-memory
    python benchmarks/bench_scale_layers.py --case Conv --no-adjoint --cpu
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from bench_scale import BLOCK, exponent

from linop import DistributedTensor, Kernel, LinearOperator, Partition, Repartition
from linop.layers import (
    Affine,
    AveragePool,
    ChainStage,
    Convolution,
    Interpolate,
    Loss,
    MaxPoolJacobian,
    WindowChain,
)
from linop.program import batch, fingerprint, lower_for, project

STAGES = ("layer", "tree", "fingerprint", "lower", "batch", "project")
BATCH, CHANNELS = 2, 4

CLOCK: Callable[[], float] = time.perf_counter
"""The clock of the timings: the wall clock, or the process's CPU time (``--cpu``)."""


def _x(s: int) -> DistributedTensor:
    return DistributedTensor("x", (BATCH, CHANNELS, BLOCK * s, BLOCK * s), Partition((1, 1, s, s)))


def _interior(s: int) -> tuple[int, ...]:
    return (0, 0, s // 2, s // 2)


@dataclass
class Case:
    """A layer: ``make(s)`` builds it, ``tree(layer, s)`` its tree, ``module(layer, comm)``
    its torch module (None where there is none)."""

    make: Callable[[int], Any]
    tree: Callable[[Any, int], LinearOperator]
    module: Callable[[Any, Any], Any] | None = None


def _conv_weights(layer: Convolution) -> np.ndarray:
    return np.ones(layer.weights.global_shape)


def _conv(s: int) -> Convolution:
    return Convolution(_x(s), CHANNELS, Kernel(3, padding=1))


def _conv_co(s: int) -> Convolution:
    return Convolution(_x(s), CHANNELS, Kernel(3, padding=1), workers=Partition((1, 2, 1, s, s)))


def _affine(s: int) -> Affine:
    x = DistributedTensor("x", (BATCH, BLOCK * s * s), Partition((1, s * s)))
    return Affine(x, CHANNELS)


def _max_tree(layer: MaxPoolJacobian, s: int) -> LinearOperator:
    g = _interior(s)
    window = np.zeros(layer.geometry.window_shape(g))
    return layer.at({layer.window_name(g): window})


def _chain(s: int) -> WindowChain:
    weights = np.ones((CHANNELS, CHANNELS, 3, 3))
    return WindowChain(_x(s), [ChainStage.conv(weights, padding=1), ChainStage.avg(2)])


def _repartition(s: int) -> Repartition:
    y = DistributedTensor(
        "y", (BATCH, CHANNELS, BLOCK * s, BLOCK * s), Partition((1, 1, 2 * s, max(s // 2, 1)))
    )
    return Repartition(_x(s), y)


def _repartition_module(layer: Repartition, comm: Any) -> Any:
    from linop.frameworks.torch_repartition import Repartition as RepartitionModule

    return RepartitionModule(layer.source, layer.destination, comm=comm)


def _layer_module(layer: Any, comm: Any) -> Any:
    from linop.frameworks.torch_layers import LayerModule

    return LayerModule(layer, comm=comm)


def _replicated_module(layer: Any, comm: Any) -> Any:
    from linop.frameworks.torch_layers import LayerModule

    return LayerModule(layer, comm=comm, replicate=True)


def _pool_module(layer: MaxPoolJacobian, comm: Any) -> Any:
    from linop.frameworks.torch_pooling import MaxPool

    return MaxPool(layer.x, 2, 2, comm=comm)


def _upsample_module(layer: Interpolate, comm: Any) -> Any:
    from linop.frameworks.torch_resample import Upsample

    return Upsample(layer.x, scale_factor=2, comm=comm)


def _loss_module(layer: Loss, comm: Any) -> Any:
    from linop.frameworks.torch_losses import LossModule

    return LossModule(layer, comm=comm)


def _chain_module(layer: WindowChain, comm: Any) -> Any:
    from linop.frameworks.torch_chain import ChainModule

    return ChainModule(layer, comm=comm)


CASES: dict[str, Case] = {
    "Convolution": Case(_conv, lambda c, s: c.input_operator(_conv_weights(c)), _layer_module),
    "Convolution P_co=2": Case(_conv_co, lambda c, s: c.input_operator(_conv_weights(c)), _layer_module),
    "Affine": Case(_affine, lambda a, s: a.input_operator(np.ones(a.weights.global_shape)), _layer_module),
    "Affine replicate": Case(
        _affine, lambda a, s: a.input_operator(np.ones(a.weights.global_shape)), _replicated_module
    ),
    "Interpolate": Case(
        lambda s: Interpolate(_x(s), scale_factor=2), lambda i, s: i.operator, _upsample_module
    ),
    "AveragePool": Case(lambda s: AveragePool(_x(s), Kernel(3, padding=1)), lambda p, s: p.operator),
    "MaxPool": Case(lambda s: MaxPoolJacobian(_x(s), Kernel(2, stride=2)), _max_tree, _pool_module),
    "Loss": Case(lambda s: Loss(_x(s), "mse"), lambda loss, s: loss.reduction_operator, _loss_module),
    "WindowChain": Case(_chain, lambda c, s: c.operator, _chain_module),
    "Repartition": Case(_repartition, lambda r, s: r, _repartition_module),
}

MODULE = False
"""Also build the layer's torch module on a test communicator (``--module``)."""

UPTO = "project"
"""The last stage run (``--upto``): ``layer`` measures the descriptions alone at large P."""


def rank_of_p(rank: int, size: int) -> Any:
    """A :class:`bench_scale.RankOfP` test communicator that :func:`linop.backends.mpi.plan_for`
    takes: its context made here and kept as the last one :func:`~linop.backends.mpi.context.
    context_for` made (the route a rank's repeated calls with one communicator take), since the
    context's own check wants an mpi4py communicator."""
    from bench_scale import RankOfP

    from linop.backends.mpi import context

    comm = RankOfP(rank, size)
    context._remember_last(comm, context.CommContext(comm))  # type: ignore[arg-type]
    return comm


@dataclass
class Measured:
    seconds: dict[str, float]
    peak_mb: dict[str, float]
    steps: int


def _stages(case: Case, s: int, adjoint: bool) -> tuple[list[tuple[str, Callable[[], None]]], dict[str, Any]]:
    """The stages as thunks sharing one dict of intermediate results."""
    found: dict[str, Any] = {"rank": (s // 2) * s + s // 2}

    def layer() -> None:
        found["layer"] = case.make(s)

    def tree() -> None:
        op = case.tree(found["layer"], s)
        found["op"] = op.H if adjoint else op

    def module() -> None:
        assert case.module is not None
        found["module"] = case.module(found["layer"], rank_of_p(found["rank"], s * s))

    stages: list[tuple[str, Callable[[], None]]] = [
        ("layer", layer),
        ("tree", tree),
        ("fingerprint", lambda: found.__setitem__("fp", fingerprint(found["op"]))),
        ("lower", lambda: found.__setitem__("lowered", lower_for(found["op"], found["rank"])[0])),
        ("batch", lambda: found.__setitem__("batched", batch(found["lowered"]))),
        ("project", lambda: found.__setitem__("schedule", project(found["batched"], found["rank"]))),
    ]
    stages = stages[: STAGES.index(UPTO) + 1]
    if MODULE and case.module is not None and not adjoint:
        stages.append(("module", module))
    return stages, found


def measure(case: Case, s: int, adjoint: bool, memory: bool) -> Measured:
    seconds: dict[str, float] = {}
    stages, found = _stages(case, s, adjoint)
    gc.collect()
    for name, run in stages:
        start = CLOCK()
        run()
        seconds[name] = CLOCK() - start
    steps = len(found.get("schedule", ()))
    peaks: dict[str, float] = {}
    if memory:
        del found
        stages, found = _stages(case, s, adjoint)
        gc.collect()
        tracemalloc.start()
        for name, run in stages:
            tracemalloc.reset_peak()
            run()
            peaks[name] = tracemalloc.get_traced_memory()[1] / 1e6
        tracemalloc.stop()
    return Measured(seconds, peaks, steps)


def _row(p: int, names: tuple[str, ...], m: Measured, memory: bool) -> str:
    cells = "".join(
        f"{m.seconds.get(n, float('nan')):8.4f}s/{m.peak_mb.get(n, float('nan')):3.0f}M"
        if memory
        else f"{m.seconds.get(n, float('nan')):12.4f}s"
        for n in names
    )
    total = sum(m.seconds.values())
    peak = max(m.peak_mb.values(), default=float("nan"))
    return f"{p:7d} {cells} {total:9.3f}s {peak:9.1f} {m.steps:6d}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--max", type=int, default=4096, help="largest P (a power of 4); default 4096")
    parser.add_argument("--min", type=int, default=64, help="smallest P; default 64")
    parser.add_argument("--case", action="append", help="run only these cases (repeatable; substring)")
    parser.add_argument("--no-adjoint", action="store_true", help="forward trees only")
    parser.add_argument("--no-memory", action="store_true", help="skip the traced-memory pass")
    parser.add_argument("--fit", choices=("last", "all"), default="last")
    parser.add_argument("--module", action="store_true", help="also build the torch module (torch, mpi4py)")
    parser.add_argument(
        "--upto", choices=STAGES, default="project", help="run the stages up to this one (e.g. layer alone)"
    )
    parser.add_argument(
        "--cpu", action="store_true", help="time by the process's CPU time, not the wall clock"
    )
    args = parser.parse_args()
    global CLOCK, MODULE, UPTO
    CLOCK = time.process_time if args.cpu else time.perf_counter
    MODULE, UPTO = args.module, args.upto
    sides = [s for s in (2**k for k in range(1, 11)) if args.min <= s * s <= args.max]
    cases = {n: c for n, c in CASES.items() if not args.case or any(c_ in n for c_ in args.case)}
    for case in cases.values():  # warm-up: imports and the interpreters' first use
        measure(case, 2, False, memory=False)
    summary: list[tuple[str, float, float]] = []
    for label, case in cases.items():
        for adjoint in (False,) if args.no_adjoint else (False, True):
            title = f"{label}{' (adjoint)' if adjoint else ''}"
            names = tuple(n for n, _ in _stages(case, 2, adjoint)[0])
            print(f"\n{title}")
            print("      P " + "".join(f"{n:>13}" for n in names) + "      total   peak MB  steps")
            sizes: list[int] = []
            totals: list[float] = []
            per_stage: dict[str, list[float]] = {n: [] for n in names}
            for s in sides:
                m = measure(case, s, adjoint, not args.no_memory)
                print(_row(s * s, names, m, not args.no_memory), flush=True)
                sizes.append(s * s)
                totals.append(sum(m.seconds.values()))
                for n in names:
                    per_stage[n].append(m.seconds[n])
            fits = "".join(f"{exponent(sizes, per_stage[n], args.fit):13.2f}" for n in names)
            print(f"      k {fits} {exponent(sizes, totals, args.fit):9.2f}   (time ~ P**k)")
            summary.append((title, totals[-1], exponent(sizes, totals, args.fit)))
    print(f"\nsummary at P = {sides[-1] ** 2}: seconds per rank (the stages run), exponent k")
    for title, total, k in summary:
        print(f"  {title:32s} {total:9.3f} s   k = {k:5.2f}")


if __name__ == "__main__":
    try:
        main()  # each row is printed (flushed) as soon as it is measured
    except KeyboardInterrupt:
        print("\nbench_scale_layers: interrupted (Ctrl-C); the rows above are complete", file=sys.stderr)
        sys.exit(130)
