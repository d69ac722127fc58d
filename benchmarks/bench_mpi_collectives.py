"""MPI collectives benchmark: linop's broadcast, sum-reduce and all-reduce of 8 MB against the
fastest native MPI call that gives the same result, in the same run.

Run: ``mpiexec -n 2 python benchmarks/bench_mpi_collectives.py`` (or ``-n 4``).

- broadcast of rank 0's 1M float64 block to every rank (``Broadcast`` from a one-worker
  partition): against ``Bcast`` into a preallocated buffer, typed as doubles or as raw bytes
  (MPICH may pick another algorithm for each), and a persistent ``Bcast_init`` typed and as
  bytes (linop's bound broadcast is a persistent ``Bcast_init`` typed by entry);
- sum-reduce of every rank's copy onto rank 0 (``SumReduce``, the broadcast's adjoint): against
  ``Reduce`` and ``Allreduce`` out of place (on this MPICH ``Reduce`` can be the slower way to
  the same sum) and in place (``Reduce(IN_PLACE)`` at the root, ``Allreduce(IN_PLACE)``: no
  copy of the block to make, the fastest here, though they overwrite a copy the operator must
  leave alone; blocking and a persistent ``Allreduce_init``);
- all-reduce in place (``AllReduce``): against ``Allreduce(IN_PLACE)`` and a persistent
  ``Allreduce_init``;
- reduce-scatter of uneven shares (``ReduceScatter`` along one axis of ``COUNT + 1`` entries,
  its one fast path, ``Reduce_scatter`` with the line's counts): against ``Reduce_scatter``
  into a preallocated buffer, and linop's portable program (the node's expansion: point-to-point
  messages, ``P - 1`` sends and receives per rank where the native call is one).

``python benchmarks/bench_mpi_collectives.py [entries] [samples]`` runs other sizes (default
1M entries, 31 samples): small ones show that every row runs, not how fast.

linop runs ``apply`` (the collective check and the schedule on every call, new result blocks as
an out-of-place operator must return) and a bound plan (``Plan.bind``: checked once, then
persistent collectives; out of place, into result arrays prebuilt once and overwritten by each
call, as hand-written code reuses its buffers). Each sample times a batch of calls; a sample's time is the
maximum over ranks; medians (and the best sample) are printed, and for linop's rows the median
over samples of the ratio to the fastest native row (by median), and to the native row on the
same memory where there is one. Results are checked equal to the native ones before timing.

The memory matters for the broadcast: an 8 MB ``Bcast`` from a root buffer not backed by huge
pages took 1.10-1.33x of one from a buffer partly backed (3 huge pages, what an 8 MB
``np.empty`` gets), and one from a buffer wholly backed 0.91-1.03x, while the receivers'
backing and alignment changed nothing beyond the noise (0.80-1.06x, no trend; no page faults
per call on either side; 2 ranks, the loaded machine, interleaved:
``benchmarks/bench_mpi_buffer_placement.py``, figures in
:func:`linop.backends.mpi.memory.lasting_array`'s notes). Which of the root's 2 MB pages are
huge is up to the kernel for each allocation, so two ``np.empty`` buffers of the same size
need not be alike. So the broadcast has two bound rows: on linop's own arrays (the root's
input and the result array linop builds on the others), and "into the benchmark's buffer":
bound on the very buffer of the native rows on every rank (the root's input, and
``bind(..., out=)`` elsewhere, written by the ``Bcast`` itself), which compares the calls
alone. On the loaded machine (load average 7-10, 2 ranks, three runs) the first took
1.03-1.15x of the fastest native row and 0.94-1.05x of the native call on its arrays, the
second 0.83-1.03x of the fastest and 0.88-0.95x of ``Bcast_init`` on the same buffer.
The sum-reduce has the same two rows (into the benchmark's buffer: the root's sum lands in the
native rows' result buffer); the native calls on the same memory are out of place there
(``Reduce`` and ``Allreduce`` into that buffer), and the fastest native row, ``Allreduce`` in
place, works on a buffer of its own.

The rows are fair to one another only when every timed batch starts on buffers its own calls have
just used. On this machine the first two or three 8 MB calls on buffers that other calls used
last run slower, for linop and the native calls alike: five calls timed right after five on
other buffers took 1.3-1.6x (2 ranks) and 1.2-1.6x (4 ranks) of the same five right after
themselves, and rewriting the buffers with numpy first took most of that away
(``benchmarks/bench_mpi_buffer_switch.py``: the buffers' memory gone cold). With the rows in one
fixed order, a row that follows rows on other buffers paid it and one that follows a row on its
own buffers did not: the bound broadcast at 1.10-1.25x and the sum-reduce at 1.09-1.21x of the
earlier figures, "Bcast" slower than "Bcast as bytes" and the bytes slower on linop's arrays
than on the benchmark's were that order (linop's bound rows come first, after the previous
sample's last row; ``benchmarks/results/mpi_collectives_order_2026-12-06.txt``). So each
sample runs the rows in an order drawn afresh (alike on every rank), each timed batch after
:data:`WARMUPS` untimed calls of its own.

The huge pages matter for every row. Most of an 8 MB call's time here is system time (the
kernel copying between the processes, it seems), and it grows with the 4 KB pages of the
memory: measured on the idle 2-core machine (2 ranks, 8 MB, interleaved, huge pages read from
``/proc/self/pagemap`` and ``/proc/kpageflags``), ``Allreduce(IN_PLACE)`` took 0.69-0.83 ms on
a buffer wholly in huge pages and 1.32-1.64 ms on one with none (``MADV_NOHUGEPAGE``); linop's
bound sum-reduce 0.59-0.71 ms from copies wholly in huge pages, 0.89-1.03 ms from copies with
three of four (an ``np.empty`` of 8 MB starts anywhere: its first and last 2 MB are partial)
and 1.11-1.34 ms from copies with none (``benchmarks/bench_mpi_buffer_placement.py``). Which
pages of an allocation are huge is the kernel's choice at the time, and an 8 MB array from the
heap (glibc reuses freed blocks once it has given one back) had none in one run: so by default
the rows compare arrays alike, every array of the benchmark (linop's inputs and the native
calls' buffers) starting on a 2 MB boundary (``placement`` ``aligned``, the third argument;
``plain`` for arrays as ``np.empty`` gives them). Each section's title gives the share of its
arrays' pages that are huge, the smallest over the arrays and ranks, where the page flags are
readable (as root).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import numpy as np
from _pages import huge_share
from _timing import interleaved_over_ranks
from mpi4py import MPI

from linop import expand_all
from linop.backends import mpi as mpi_backend
from linop.backends.mpi.memory import lasting_array
from linop.collectives import AllReduce, BlockGrid, Broadcast, ReduceScatter
from linop.partition import DistributedTensor, Partition

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size
COUNT = int(sys.argv[1]) if len(sys.argv) > 1 else 1 << 20  # 8 MB of float64
SAMPLES = int(sys.argv[2]) if len(sys.argv) > 2 else 31
PLACEMENT = sys.argv[3] if len(sys.argv) > 3 else "aligned"
"""``aligned``: every array of the benchmark on a 2 MB boundary; ``plain``: as ``np.empty``."""
if PLACEMENT not in ("aligned", "plain"):
    sys.exit(f"placement must be aligned or plain, not {PLACEMENT!r}")
BATCH = 5
WARMUPS = 3
"""Untimed calls of a row right before each of its timed batches (see the module docstring)."""


PLACED: list[np.ndarray] = []
"""The arrays of the benchmark, for :func:`huge_share`."""


def placed(values: np.ndarray) -> np.ndarray:
    """A new array equal to ``values``, placed as :data:`PLACEMENT` says."""
    if PLACEMENT == "plain":
        array = np.empty_like(values)
    else:
        array = lasting_array(values.shape, values.dtype)
    array[...] = values
    PLACED.append(array)
    return array


def placement_note(arrays: list[np.ndarray]) -> str:
    """Collective: the placement of ``arrays`` and their smallest huge-page share over ranks."""
    share = huge_share(arrays)
    least = COMM.allreduce(-1.0 if share is None else share, op=MPI.MIN)
    return f"{PLACEMENT} arrays, " + (
        "huge pages unknown" if least < 0 else f"at least {least:.0%} in huge pages"
    )


def bench(methods: dict[str, Callable[[], object]]) -> dict[str, np.ndarray]:
    """Per row, the time of one call in each sample: the maximum over ranks of a batch's mean.
    Each sample runs every row once, in an order drawn per sample (the same seed on every
    rank), each batch after :data:`WARMUPS` untimed calls of its own and a barrier
    (:func:`_timing.interleaved_over_ranks`)."""
    return interleaved_over_ranks(methods, COMM, SAMPLES, BATCH, warmups=0, settle=WARMUPS)


def start_and_wait(request: MPI.Prequest) -> None:
    """One call of a persistent collective."""
    request.Start()
    request.Wait()


def report(
    title: str, times: dict[str, np.ndarray], same_memory: dict[str, str] | None = None, note: str = ""
) -> None:
    """The rows' medians and best samples; for linop's rows, the median of the per-sample
    ratios to the native row of the smallest median, and to the native row on the same memory
    (``same_memory``: linop's row to the native one) where given."""
    if RANK:
        return
    native = [name for name in times if not name.startswith("linop")]
    fastest = min(native, key=lambda name: float(np.median(times[name])))
    print(f"  {title}:" + (f" ({note})" if note else ""))
    for name, values in times.items():
        note = ""
        if name.startswith("linop"):
            note = f"ratio {float(np.median(values / times[fastest])):5.2f}x vs {fastest}"
            twin = (same_memory or {}).get(name)
            if twin is not None and twin != fastest:
                note += f"; {float(np.median(values / times[twin])):5.2f}x vs {twin}"
        print(f"    {name:38s} {np.median(values) * 1e3:8.3f} ms  (best {values.min() * 1e3:7.3f})   {note}")


def main() -> int:
    if RANK == 0:
        print(
            f"collectives of {COUNT * 8 / 2**20:.0f} MB float64 on {SIZE} rank(s); median of {SAMPLES} samples x "
            f"{BATCH} calls, max over ranks"
        )
    rng = np.random.default_rng(RANK)
    ok = True

    # broadcast and its adjoint, sum-reduce
    source = DistributedTensor("s", (COUNT,), Partition((1,)))
    broadcast = Broadcast(source, Partition((SIZE,)), "c")
    root_state = {"s[0]": placed(rng.standard_normal(COUNT))} if RANK == 0 else {}
    buffer = placed(root_state["s[0]"] if RANK == 0 else np.zeros(COUNT))
    COMM.Bcast(buffer, root=0)
    result = mpi_backend.apply(broadcast, root_state, comm=COMM)
    ok &= np.array_equal(result[f"c[{RANK}]"], buffer)
    bound_broadcast = mpi_backend.plan_for(broadcast, comm=COMM).bind(root_state)
    ok &= np.array_equal(bound_broadcast()[f"c[{RANK}]"], buffer)
    # the very arrays the bound plan uses: the same memory (placement and alignment change
    # the time of an 8 MB broadcast by up to a third here)
    outputs = bound_broadcast()  # collective: every rank calls it
    same_memory = root_state["s[0]"] if RANK == 0 else outputs[f"c[{RANK}]"]
    # bound on the benchmark's own buffer on every rank: the root's input, the others' out
    into_buffer = mpi_backend.plan_for(broadcast, comm=COMM).bind(
        {"s[0]": buffer} if RANK == 0 else {}, out={} if RANK == 0 else {f"c[{RANK}]": buffer}
    )
    ok &= np.shares_memory(into_buffer()[f"c[{RANK}]"], buffer)
    ok &= RANK == 0 or f"c[{RANK}]" in into_buffer.straight  # written by the Bcast, no copy after it
    persistent_broadcast = COMM.Bcast_init([buffer, buffer.nbytes, MPI.BYTE], root=0)
    persistent_typed = COMM.Bcast_init(buffer, root=0)
    note = placement_note([*PLACED, same_memory])
    report(
        "broadcast",
        bench(
            {
                "linop bound (prebuilt)": bound_broadcast,
                "linop bound into the benchmark's buffer": into_buffer,
                "linop apply (new blocks)": lambda: mpi_backend.apply(broadcast, root_state, comm=COMM),
                "Bcast, preallocated": lambda: COMM.Bcast(buffer, root=0),
                "Bcast as bytes, preallocated": lambda: COMM.Bcast([buffer, buffer.nbytes, MPI.BYTE], root=0),
                "Bcast as bytes, linop's arrays": lambda: COMM.Bcast(
                    [same_memory, same_memory.nbytes, MPI.BYTE], root=0
                ),
                "Bcast into a new array": lambda: COMM.Bcast(
                    buffer if RANK == 0 else np.empty(COUNT), root=0
                ),
                "Bcast_init (persistent)": lambda: start_and_wait(persistent_typed),
                "Bcast_init as bytes (persistent)": lambda: start_and_wait(persistent_broadcast),
            }
        ),
        {
            "linop bound (prebuilt)": "Bcast as bytes, linop's arrays",
            "linop bound into the benchmark's buffer": "Bcast_init (persistent)",
        },
        note,
    )
    reduce = broadcast.H
    mark = len(PLACED)
    copies = {f"c[{RANK}]": placed(rng.standard_normal(COUNT))}
    total = placed(np.zeros(COUNT))
    # the in-place calls' buffers, of zeros: a sum in place of values grows P-fold per call and
    # would pass the largest float64 within a few hundred calls (zeros add as fast as any)
    overwritten = placed(np.zeros(COUNT))
    overwritten_too = placed(np.zeros(COUNT))
    persistent_sum = COMM.Allreduce_init(MPI.IN_PLACE, overwritten_too)
    COMM.Allreduce(copies[f"c[{RANK}]"], total)
    result = mpi_backend.apply(reduce, copies, comm=COMM)
    if RANK == 0:
        ok &= np.allclose(result["s[0]"], total, rtol=1e-13, atol=1e-13)
    bound_reduce = mpi_backend.plan_for(reduce, comm=COMM).bind(copies)
    if RANK == 0:
        ok &= np.allclose(bound_reduce()["s[0]"], total, rtol=1e-13, atol=1e-13)
    else:
        bound_reduce()
    # bound into the native rows' own result buffer at the root (bind(..., out=)): the sum lands
    # in ``total``, as "Reduce, preallocated" and "Allreduce, preallocated" put it there
    reduce_into = mpi_backend.plan_for(reduce, comm=COMM).bind(
        copies, out={"s[0]": total} if RANK == 0 else None
    )
    if RANK == 0:
        # written by the sum itself (on one rank the sum is a copy, made into ``total`` after it)
        ok &= reduce_into()["s[0]"] is total and (SIZE == 1 or "s[0]" in reduce_into.straight)
        ok &= np.allclose(total, result["s[0]"], rtol=1e-13, atol=1e-13)
    else:
        reduce_into()
    note = placement_note(PLACED[mark:])
    report(
        "sum-reduce",
        bench(
            {
                "linop bound (prebuilt)": bound_reduce,
                "linop bound into the benchmark's buffer": reduce_into,
                "linop apply (new block)": lambda: mpi_backend.apply(reduce, copies, comm=COMM),
                "Reduce, preallocated": lambda: COMM.Reduce(copies[f"c[{RANK}]"], total, root=0),
                "Allreduce, preallocated": lambda: COMM.Allreduce(copies[f"c[{RANK}]"], total),
                # in place: no copy of the block to make, but the caller's copy is overwritten
                # (what an out-of-place operator may not do)
                "Reduce(IN_PLACE) at the root": lambda: COMM.Reduce(
                    MPI.IN_PLACE if RANK == 0 else overwritten, overwritten if RANK == 0 else None, root=0
                ),
                "Allreduce(IN_PLACE)": lambda: COMM.Allreduce(MPI.IN_PLACE, overwritten),
                "Allreduce_init(IN_PLACE)": lambda: start_and_wait(persistent_sum),
            }
        ),
        {"linop bound into the benchmark's buffer": "Allreduce, preallocated"},
        note,
    )

    # all-reduce in place
    mark = len(PLACED)
    layout = BlockGrid.uniform("a", Partition((SIZE,)), (COUNT,))
    all_reduce = AllReduce(layout, (0,))
    start = rng.standard_normal(COUNT)
    mine = {f"a[{RANK}]": placed(start)}
    bound_state = {f"a[{RANK}]": placed(start)}
    native = placed(start)
    persistent_buffer = placed(start)
    mpi_backend.apply(all_reduce, mine, comm=COMM, inplace=True)
    COMM.Allreduce(MPI.IN_PLACE, native)
    ok &= np.allclose(mine[f"a[{RANK}]"], native, rtol=1e-13, atol=1e-13)
    bound = mpi_backend.plan_for(all_reduce, comm=COMM).bind(bound_state)
    persistent = COMM.Allreduce_init(MPI.IN_PLACE, persistent_buffer)

    note = placement_note(PLACED[mark:])
    report(
        "all-reduce (in place)",
        bench(
            {
                "linop bound (persistent)": bound,
                "linop apply": lambda: mpi_backend.apply(all_reduce, mine, comm=COMM, inplace=True),
                "Allreduce(IN_PLACE)": lambda: COMM.Allreduce(MPI.IN_PLACE, native),
                "Allreduce_init (persistent)": lambda: start_and_wait(persistent),
            }
        ),
        None,
        note,
    )
    # reduce-scatter of uneven shares: every rank's gathered block of COUNT + 1 entries
    tensor = DistributedTensor("r", (COUNT + 1,), Partition((SIZE,)))
    scatter = ReduceScatter(tensor, (0,), "g")
    shares = tensor.sizes[0]
    gathered = {f"g[{RANK}]": rng.standard_normal(COUNT + 1)}
    own = np.empty(shares[RANK])
    COMM.Reduce_scatter(gathered[f"g[{RANK}]"], own, recvcounts=list(shares))
    expansion = expand_all(scatter)
    for tree in (scatter, expansion):
        result = mpi_backend.apply(tree, gathered, comm=COMM)
        ok &= np.allclose(result[f"r[{RANK}]"], own, rtol=1e-13, atol=1e-13)
    report(
        f"reduce-scatter of uneven shares {tuple(shares)[:4]}",
        bench(
            {
                "linop apply (Reduce_scatter)": lambda: mpi_backend.apply(scatter, gathered, comm=COMM),
                "linop portable (point to point)": lambda: mpi_backend.apply(expansion, gathered, comm=COMM),
                "Reduce_scatter, preallocated": lambda: COMM.Reduce_scatter(
                    gathered[f"g[{RANK}]"], own, recvcounts=list(shares)
                ),
            }
        ),
    )
    for plan in (bound, bound_broadcast, into_buffer, bound_reduce):
        plan.free()
    persistent.Free()
    for request in (persistent_broadcast, persistent_typed, persistent_sum):
        request.Free()
    ok = COMM.allreduce(ok, op=MPI.LAND)
    if RANK == 0 and not ok:
        print("  RESULTS DIFFER from the native calls")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
