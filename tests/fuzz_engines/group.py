"""The fuzz campaign on a gloo group of 2 processes forked by ``torch.multiprocessing``:
``python group.py EXAMPLES [SEED]`` (run by ``tests/test_fuzz_engines.py``, which bounds the
launch). Both processes draw the same calls of
:func:`verify.strategies_malformed_launched.group_cases` (the torch.distributed executor and
the DTensor bridge with hostile inputs), judge each with
:func:`verify.strategies_malformed_engines.classify`, and check that both reached the same
verdict (the same error class when typed: no rank refuses what its peer accepts). Rank 0 prints
the outcomes (:mod:`report`); a rank whose peer disagreed records it as ``FAILED``.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parents[1] / "torchdist"))  # rendezvous, last: no shadowing

from rendezvous import held_port
from report import emit

from verify.strategies_malformed import Call
from verify.strategies_malformed_engines import campaign, classify
from verify.strategies_malformed_launched import group_cases


def _agreed(call: Call) -> tuple[str, str]:
    """The call's verdict, checked against the peer's: the same description drawn (else the
    ranks are out of step), the same verdict and error class."""
    rank = dist.get_rank()
    described: list[Any] = [None, None]
    dist.all_gather_object(described, ("case", call.description))
    if described[0] != described[1]:
        raise SystemExit(f"rank {rank}: the ranks drew different calls or are out of step: {described}")
    began, cpu = time.perf_counter(), time.process_time()
    verdict, evidence = _judged(call)
    if rank == 0 and time.perf_counter() - began > 5:
        print(
            f"SLOW {time.perf_counter() - began:.1f} s cpu {time.process_time() - cpu:.2f} s {call!r} {verdict} {evidence[:100]}",
            flush=True,
        )
    verdicts: list[Any] = [None, None]
    dist.all_gather_object(verdicts, ("verdict", verdict, evidence.split(":", 1)[0]))
    if verdicts[0][0] != "verdict" or verdicts[1][0] != "verdict":
        raise SystemExit(f"rank {rank}: the ranks are out of step: {verdicts}")
    if verdicts[0][1:] != verdicts[1][1:] and "FAILED" not in (verdicts[0][1], verdicts[1][1]):
        return (
            "FAILED",
            f"the ranks disagree: rank 0 {verdicts[0][1:]}, rank 1 {verdicts[1][1:]}; here: {evidence}",
        )
    if verdict != "FAILED" and any(v[1] == "FAILED" for v in verdicts):
        return "FAILED", f"the peer failed; here: {verdict} {evidence}"
    return verdict, evidence


def _judged(call: Call) -> tuple[str, str]:
    from verify.strategies_malformed import FuzzFailure

    try:
        return classify(call)
    except FuzzFailure as failure:
        return "FAILED", str(failure)


def process(rank: int, port: int, examples: int, seed: int | None) -> None:
    os.environ["LINOP_TIMEOUT"] = "20"  # a rank left alone in a collective raises, not waits
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=60),
    )
    start = time.perf_counter()
    dtensors = os.environ.get("LINOP_LONG") == "1"  # the suite's 4-process launch has DTensors
    outcomes = campaign(group_cases(dtensors), examples, seed=seed, judge=_agreed)
    if rank == 0:
        print(f"CPU rank 0: {time.process_time():.2f} s", flush=True)
        emit("torch.distributed 2 ranks", outcomes, time.perf_counter() - start)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    count = int(sys.argv[1])
    chosen = int(sys.argv[2]) if len(sys.argv) > 2 else None
    mp.start_processes(process, args=(held_port(), count, chosen), nprocs=2, start_method="fork")
