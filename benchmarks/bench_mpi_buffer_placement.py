"""Which buffer makes an 8 MB ``Bcast`` slower: the root's or the receivers', aligned or not,
in huge pages or not; and the same buffers under an in-place ``Allreduce`` and linop's bound
sum-reduce.

Run: ``mpiexec -n 2 python benchmarks/bench_mpi_buffer_placement.py [samples] [kinds] [op]``
(default 41 samples; kinds a comma-separated list of those below, the first the reference;
op ``bcast``, the default, ``allreduce``: ``Allreduce(IN_PLACE)`` on the buffer, of zeros, or
``sumreduce``: linop's bound ``SumReduce`` onto rank 0 with the buffer as every rank's copy,
into linop's own result array; for these two each row is one kind on every rank).

Every rank builds one 8 MB buffer of each kind, written once (no page faults left to take):

- ``np16``: ``np.empty`` (malloc's mmap: 16 bytes past a page boundary; 3 of the 2 MB pages it
  spans whole are huge pages, 4 by chance);
- ``np16nh``: the same with ``MADV_NOHUGEPAGE`` before it is written (no huge page);
- ``al0``: on a 2 MB boundary inside a longer allocation (4 huge pages; linop's
  :func:`~linop.backends.mpi.memory.lasting_array`);
- ``al0nh``: the same with no huge page;
- ``pg4k``: one 4 KB page past a 2 MB boundary (page-aligned, not huge-page-aligned, its memory
  all in huge pages);
- ``zeros``: ``np.zeros``, never written on the root (it reads the kernel's one zero page:
  faster, 0.63-0.73x in a trial run, and no buffer a caller sends).

The rows are the reference kind on both sides, then each other kind on the receivers (the root
sending from the reference), then on the root (the receivers receiving into the reference). Each
sample runs the rows in an order drawn afresh, each batch of 5 calls after 3 of its own (see
``benchmarks/bench_mpi_collectives.py``). Printed per row: the median wall time (the maximum
over ranks), the median over samples of the ratio to the reference row, the same for the CPU
time of the process, and the minor page faults per call on the root and on rank 1. The first
lines give each buffer's offset from a 2 MB boundary and the huge pages (kB) of the mappings
it lies in (``/proc/self/smaps``), per rank, and the share of its 4 KB pages that lie in a huge
page (``/proc/kpageflags``, where readable: as root).
"""

from __future__ import annotations

import ctypes
import re
import resource
import sys
import time

import numpy as np
from _pages import huge_share
from mpi4py import MPI

COMM = MPI.COMM_WORLD
RANK = COMM.rank
COUNT = 1 << 20
NBYTES = COUNT * 8
HUGE = 1 << 21
SAMPLES = int(sys.argv[1]) if len(sys.argv) > 1 else 41
KINDS = (
    sys.argv[2].split(",")
    if len(sys.argv) > 2 and sys.argv[2]
    else ["np16", "al0", "al0nh", "np16nh", "pg4k"]
)
OP = sys.argv[3] if len(sys.argv) > 3 else "bcast"
BATCH, WARMUPS = 5, 3
MADV_NOHUGEPAGE = 15
_KEPT: list[np.ndarray] = []  # the allocations the offset buffers are views into


def no_huge_pages(array: np.ndarray) -> None:
    """``madvise(MADV_NOHUGEPAGE)`` over the pages of ``array`` (before it is written)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    start = array.ctypes.data & ~4095
    if libc.madvise(start, array.ctypes.data + array.nbytes - start, MADV_NOHUGEPAGE) != 0:
        raise OSError(ctypes.get_errno(), "madvise")


def at_offset(offset: int, huge: bool) -> np.ndarray:
    """8 MB starting ``offset`` bytes past a 2 MB boundary, inside a longer allocation."""
    raw = np.empty(NBYTES + 2 * HUGE + 8192, dtype=np.uint8)
    if not huge:
        no_huge_pages(raw)
    _KEPT.append(raw)
    start = -raw.ctypes.data % HUGE + offset
    return raw[start : start + NBYTES].view(np.float64)


def make(kind: str) -> np.ndarray:
    if kind == "zeros":
        return np.zeros(COUNT)
    if kind in ("np16", "np16nh"):
        array = np.empty(COUNT)
        if kind == "np16nh":
            no_huge_pages(array)
    elif kind in ("al0", "al0nh"):
        array = at_offset(0, huge=kind == "al0")
    elif kind == "pg4k":
        array = at_offset(4096, huge=True)
    else:
        raise SystemExit(f"unknown kind {kind!r}")
    array[...] = 1.0
    return array


def huge_kb(array: np.ndarray) -> int:
    """The huge pages (kB) of the mappings ``array`` lies in."""
    low, high = array.ctypes.data, array.ctypes.data + array.nbytes
    total, mapping = 0, None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            found = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if found:
                mapping = (int(found[1], 16), int(found[2], 16))
            elif line.startswith("AnonHugePages") and mapping and mapping[0] < high and mapping[1] > low:
                total += int(line.split()[1])
    return total


def main() -> int:
    if OP not in ("bcast", "allreduce", "sumreduce"):
        raise SystemExit(f"unknown op {OP!r}")
    buffers = {kind: make(kind) for kind in KINDS}
    reference = KINDS[0]
    if OP == "bcast":
        rows = [(reference, kind) for kind in KINDS] + [(kind, reference) for kind in KINDS[1:]]
    else:
        rows = [(kind, kind) for kind in KINDS]
    bound = {}
    if OP == "allreduce":
        for buffer in buffers.values():
            buffer[...] = 0.0  # a sum in place of zeros stays finite
    elif OP == "sumreduce":
        from linop.backends import mpi as mpi_backend
        from linop.collectives import Broadcast
        from linop.partition import DistributedTensor, Partition

        source = DistributedTensor("s", (COUNT,), Partition((1,)))
        reduce = Broadcast(source, Partition((COMM.size,)), "c").H
        bound = {
            kind: mpi_backend.plan_for(reduce, comm=COMM).bind({f"c[{RANK}]": buffers[kind]})
            for kind in KINDS
        }

    def call(root_kind: str, receiver_kind: str) -> None:
        buffer = buffers[root_kind if RANK == 0 else receiver_kind]
        if OP == "bcast":
            COMM.Bcast([buffer, NBYTES, MPI.BYTE], root=0)
        elif OP == "allreduce":
            COMM.Allreduce(MPI.IN_PLACE, buffer)
        else:
            bound[root_kind]()

    for row in rows:
        call(*row)
    placement = COMM.gather(
        {k: (b.ctypes.data % HUGE, huge_kb(b), huge_share([b])) for k, b in buffers.items()}
    )
    wall = {row: np.empty(SAMPLES) for row in rows}
    cpu = {row: np.empty(SAMPLES) for row in rows}
    faults = dict.fromkeys(rows, 0)
    order = np.random.default_rng(SAMPLES)
    for sample in range(SAMPLES):
        for index in order.permutation(len(rows)):
            row = rows[index]
            for _ in range(WARMUPS):
                call(*row)
            COMM.Barrier()
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            started_cpu, started = time.process_time(), time.perf_counter()
            for _ in range(BATCH):
                call(*row)
            wall[row][sample] = (time.perf_counter() - started) / BATCH
            cpu[row][sample] = (time.process_time() - started_cpu) / BATCH
            faults[row] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    for values in (*wall.values(), *cpu.values()):
        COMM.Allreduce(MPI.IN_PLACE, values, op=MPI.MAX)
    all_faults = COMM.gather(faults)
    if RANK == 0:
        assert placement is not None and all_faults is not None
        what = {
            "bcast": "Bcast as bytes",
            "allreduce": "Allreduce(IN_PLACE)",
            "sumreduce": "linop bound sum-reduce",
        }
        print(f"8 MB {what[OP]} on {COMM.size} ranks; {SAMPLES} samples x {BATCH} calls")
        for kind in KINDS:
            print(f"  {kind:7s} offset, huge kB, huge share per rank: {[p[kind] for p in placement]}")
        print(f"  {'root':>7s} {'recv':>7s}  wall ms  ratio   cpu ms  ratio  faults/call (root, rank 1)")
        for row in rows:
            w, c = wall[row], cpu[row]
            ratio_w = np.median(w / wall[(reference, reference)])
            ratio_c = np.median(c / cpu[(reference, reference)])
            per_call = ", ".join(f"{f[row] / SAMPLES / BATCH:.2f}" for f in all_faults[:2])
            print(
                f"  {row[0]:>7s} {row[1]:>7s}  {np.median(w) * 1e3:7.3f}  {ratio_w:5.3f}  "
                f"{np.median(c) * 1e3:7.3f}  {ratio_c:5.3f}   {per_call}"
            )
    for plan in bound.values():
        plan.free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
