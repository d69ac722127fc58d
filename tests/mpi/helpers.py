"""Shared helpers of the MPI tests: hypothesis examples drawn once and shared by every rank,
local parts of states and collective assertions."""

from __future__ import annotations

import functools
import inspect
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import UnsatisfiedAssumption
from mpi4py import MPI

from linop import LinearOperator, Space

LONG = os.environ.get("LINOP_LONG") == "1"


def spmd(max_examples: int, *, long: int | None = None) -> settings:
    """Hypothesis settings of rank 0's drawing in :func:`spmd_given`: derandomized (the same
    examples on every run), no database, and no timing-based health check (under load it could
    fail on rank 0 alone). ``long``: the number of examples with ``LINOP_LONG=1`` (default
    ``max_examples``)."""
    if LONG and long is not None:
        max_examples = long
    return settings(
        derandomize=True,
        database=None,
        deadline=None,
        max_examples=max_examples,
        suppress_health_check=list(HealthCheck),
    )


_CALL, _DONE, _FAILED, _DRAWN, _ABORTED = "call", "done", "failed", "drawn", "aborted"


class _Examples:
    """Rank 0's examples sent to the other ranks, on a communicator of their own. A rank waiting
    for the next example sleeps between probes: the ranks outnumber the cores, and one waiting
    inside MPI would take the processor from rank 0, which is drawing."""

    TAG = 31
    PAUSE = 0.0005
    """Seconds a waiting rank sleeps between two probes."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm.Dup()  # collective: every rank starts the test together

    def free(self) -> None:
        self.comm.Free()

    def send(self, message: Any) -> Any:
        for rank in range(1, self.comm.size):
            self.comm.send(message, dest=rank, tag=self.TAG)
        return message

    def receive(self) -> Any:
        while not self.comm.iprobe(source=0, tag=self.TAG):
            time.sleep(self.PAUSE)
        return self.comm.recv(source=0, tag=self.TAG)


class _LeadingData:
    """``st.data()`` on rank 0: every value drawn is sent to the other ranks."""

    def __init__(self, data: Any, examples: _Examples) -> None:
        self._data, self._examples = data, examples

    def draw(self, strategy: st.SearchStrategy, label: Any = None) -> Any:
        try:
            value = self._data.draw(strategy, label)
        except BaseException:  # hypothesis gave up on this example (or the strategy failed)
            self._examples.send((_ABORTED, None))
            raise
        return self._examples.send((_DRAWN, value))[1]


class _FollowingData:
    """``st.data()`` on the other ranks: each draw is the value rank 0 drew."""

    def __init__(self, examples: _Examples) -> None:
        self._examples = examples

    def draw(self, strategy: st.SearchStrategy, label: Any = None) -> Any:
        kind, value = self._examples.receive()
        if kind == _ABORTED:
            raise _AbandonedError
        return value


class _AbandonedError(Exception):
    """Rank 0's hypothesis gave up the example under way: the other ranks leave it too."""


def spmd_given(
    *strategies: st.SearchStrategy,
    max_examples: int,
    long: int | None = None,
    comm: Any = MPI.COMM_WORLD,
) -> Callable[[Callable[..., None]], Callable[[], None]]:
    """``@given(*strategies)`` under :func:`spmd` settings, with the examples drawn on rank 0
    alone and sent to every rank (hypothesis's generation is most of the cost of these tests,
    and would otherwise be repeated on every rank). Each rank runs the test on the same
    arguments; operators arrive as pickled copies of rank 0's, which the MPI interpreter's
    entry check compares across ranks as it does for trees each rank built. An ``st.data()``
    argument draws on rank 0 and hands the value to every rank.

    Failures stay collective: when rank 0's hypothesis reports a failing example (after
    shrinking, every call of which the other ranks follow), every rank fails; a rank that
    failed on an example rank 0 passed fails at the end with its own error."""

    def decorate(test: Callable[..., None]) -> Callable[[], None]:
        is_data = [isinstance(s, type(st.data())) for s in strategies]
        names = [f"drawn_{i}" for i in range(len(strategies))]

        def follow(examples: _Examples) -> None:
            failure: BaseException | None = None
            while True:
                kind, payload = examples.receive()
                if kind == _DONE:
                    break
                if kind == _FAILED:
                    raise AssertionError(f"rank 0 found a failing example: {payload}")
                try:
                    test(*(_FollowingData(examples) if data else a for a, data in zip(payload, is_data)))
                except (_AbandonedError, UnsatisfiedAssumption):
                    pass
                except Exception as error:  # rank 0's hypothesis decides; kept for the end
                    failure = error
            if failure is not None:
                raise AssertionError(
                    f"rank {comm.rank} failed on an example that rank 0 passed: {failure!r}"
                ) from failure

        @functools.wraps(test, assigned=("__module__", "__name__", "__qualname__", "__doc__"), updated=())
        def run() -> None:
            examples = _Examples(comm)
            try:
                if comm.rank == 0:
                    lead(examples)
                else:
                    follow(examples)
            finally:
                examples.free()

        def lead(examples: _Examples) -> None:
            def drawn(**values: Any) -> None:
                args = [values[name] for name in names]
                # an st.data() argument is sent as None: every rank knows which are draws
                examples.send((_CALL, tuple(None if data else a for a, data in zip(args, is_data))))
                test(*(_LeadingData(a, examples) if data else a for a, data in zip(args, is_data)))

            # @given wants named parameters: a signature of its own names them

            parameters = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY) for n in names]
            drawn.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
            try:
                spmd(max_examples, long=long)(given(**dict(zip(names, strategies)))(drawn))()
            except BaseException as error:
                examples.send((_FAILED, f"{type(error).__name__}: {error}"[:2000]))
                raise
            examples.send((_DONE, None))

        del run.__wrapped__  # type: ignore[attr-defined]  # pytest would ask for its arguments as fixtures
        return run

    return decorate


def local_part(space: Space, state: Mapping[str, np.ndarray], rank: int) -> dict[str, np.ndarray]:
    """The blocks of ``state`` that ``rank`` owns (copies, so tests can detect mutation)."""
    return {b.name: np.array(state[b.name]) for b in space if b.worker == rank}


def collective_assert(condition: bool, message: str = "", comm: Any = MPI.COMM_WORLD) -> None:
    """Fail on every rank when ``condition`` is false on any rank."""
    failed = comm.allgather(None if condition else f"rank {comm.rank}: {message}")
    failures = [f for f in failed if f is not None]
    assert not failures, "; ".join(failures)


def same_blocks(
    result: Mapping[str, np.ndarray],
    expected: Mapping[str, np.ndarray],
    names: tuple[str, ...],
    *,
    exact: bool = True,
) -> str | None:
    """None when ``result`` holds exactly ``names`` with the expected values, else why not."""
    if sorted(result) != sorted(names):
        return f"blocks {sorted(result)} instead of {sorted(names)}"
    for name in names:
        got, want = np.asarray(result[name]), np.asarray(expected[name])
        if got.shape != want.shape:
            return f"block {name!r} has shape {got.shape}, expected {want.shape}"
        if exact:
            ok = np.array_equal(got, want)
        else:  # sums in another order: a few units of the dtype's precision
            eps = np.finfo(np.result_type(got.dtype, np.float16)).eps
            ok = np.allclose(
                got, want, rtol=64 * eps, atol=64 * eps * max(1.0, float(np.abs(want).max(initial=0)))
            )
        if not ok:
            return f"block {name!r} differs: {got!r} versus {want!r}"
    return None


def expect_collective_error(error_type: type, call: Callable[[], Any], comm: Any = MPI.COMM_WORLD) -> str:
    """Run ``call`` on every rank; every rank must raise ``error_type`` with the same message."""
    try:
        call()
    except error_type as error:
        message = str(error)
    except Exception as error:
        message = f"UNEXPECTED {type(error).__name__}: {error}"
    else:
        message = "NO ERROR"
    messages = comm.allgather(message)
    collective_assert(
        all(m == messages[0] for m in messages) and not messages[0].startswith(("UNEXPECTED", "NO ERROR")),
        f"expected the same {error_type.__name__} on every rank, got {messages}",
        comm,
    )
    return messages[0]


def compare_with_numpy(
    op: LinearOperator, state: Mapping[str, np.ndarray], comm: Any = MPI.COMM_WORLD, *, exact: bool = True
) -> None:
    """Apply ``op`` under MPI and with numpy; each rank's blocks must agree, inputs unchanged."""
    from linop.backends import mpi as mpi_backend

    rank = comm.rank
    expected = op(state)
    local = local_part(op.domain, state, rank)
    before = {n: a.copy() for n, a in local.items()}
    result = mpi_backend.apply(op, local, comm=comm)
    names = tuple(b.name for b in op.range if b.worker == rank)
    problem = same_blocks(result, expected, names, exact=exact)
    if problem is None:
        if any(not np.array_equal(before[n], local[n]) for n in local):
            problem = "the caller's arrays were mutated"
    if problem is None:
        dtypes = [(n, result[n].dtype, np.asarray(expected[n]).dtype) for n in names]
        wrong = [d for d in dtypes if d[1] != d[2] and not np.can_cast(d[2], d[1], "same_kind")]
        if wrong:
            problem = f"dtypes differ: {wrong}"
    collective_assert(problem is None, f"{op}: {problem}", comm)


@dataclass(frozen=True, eq=True, repr=False)
class Opaque(LinearOperator):
    """A self-adjoint test node on a space with neither an interpreter handler nor an
    expansion: what an interpreter does with a node it does not know."""

    space: Space

    @property
    def domain(self) -> Space:
        return self.space

    @property
    def range(self) -> Space:
        return self.space

    def adjoint(self) -> LinearOperator:
        return self

    def __str__(self) -> str:
        return type(self).__name__


def count_agreements(monkeypatch: Any) -> list[str]:
    """The torch wrappers' per-call agreements on dtypes under MPI
    (:meth:`linop.frameworks.torch_function._Runner.agree`) this rank makes from now on (until
    ``monkeypatch`` is undone), each by its tree's name (a binding's own reduction not counted)."""
    from linop.frameworks import torch_function

    sent: list[str] = []
    original = torch_function._comm_max

    def counted(plan: Any, value: int, doing: str) -> int:
        if doing.startswith("agreeing"):
            sent.append(str(plan.op))
        return original(plan, value, doing)

    monkeypatch.setattr(torch_function, "_comm_max", counted)
    return sent
