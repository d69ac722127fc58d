"""The proof that every interpreter handler in the dispatch registry is right.

For every registered (interpreter, node type) pair, on examples drawn from that node type's
example strategy (``verify.node_examples``):

- a *fast path* (a handler of a node that expands) gives exactly what the node's full
  expansion into primitives gives through the same interpreter: the same integers, the same
  dtypes, the input unchanged (numpy); the same matrix entry by entry (sparse);
- a handler of a *leaf* (a primitive, an algebra node, a user kernel: nothing to expand into)
  agrees with the other interpreters: numpy's result is the sparse matrix times the state, and
  the size-free block form, at the blocks' actual sizes, is the sparse matrix.

The lowerings into the distributed program (``"program"``) are proven the same way under mpiexec (tests/mpi/test_registry.py). A node
type with a handler but no example strategy fails here, so no handler lands unproven.
"""

from __future__ import annotations

import importlib
import inspect
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import linop
import verify.sizefree
import verify.strategies
from linop import Copy, LinearOperator, dispatch, expand_all
from linop.backends.numpy import apply
from linop.backends.sparse import matrix_of
from verify.errors import NotSizeFreeError
from verify.node_examples import example_strategy, examples_of, registered_examples

try:  # the torch.distributed executor's device handlers (interpreter "torch-device"), with torch
    import linop.backends.torch_distributed.device
except ImportError:  # pragma: no cover - torch is an optional extra
    pass

PAIRS = sorted(dispatch.registered(), key=lambda pair: (pair[0], pair[1].__name__))
EXAMPLES = settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow]
)


def _id(pair: tuple[str, type]) -> str:
    return f"{pair[0]}-{pair[1].__name__}"


def _integer_state(op: LinearOperator, seed: int) -> dict[str, np.ndarray]:
    """Distinct integers, so that every misplaced entry shows."""
    values = np.random.default_rng(seed).permutation(op.domain.size).astype(np.int64) + 1
    return op.domain.unflatten(values)


def _is_leaf(op: LinearOperator) -> bool:
    return op.expand() is op


def test_registry_holds_every_interpreter():
    assert {interpreter for interpreter, _ in PAIRS} >= {"numpy", "sparse", "program", "sizefree"}


@pytest.mark.parametrize("pair", PAIRS, ids=_id)
def test_every_handled_node_type_has_examples(pair):
    _, node_type = pair
    assert example_strategy(node_type) is not None, (
        f"{node_type.__name__} has a handler but no example strategy: register one with "
        "verify.node_examples.examples_for"
    )


def concrete_node_types(prefix: str = "linop.") -> list[type]:
    """Every concrete subclass of LinearOperator defined in a module under ``prefix`` (every
    module of linop imported first, the framework adapters excepted: they define no node)."""
    for module in pkgutil.walk_packages(linop.__path__, "linop."):
        if not module.name.startswith("linop.frameworks"):
            importlib.import_module(module.name)
    found: set[type] = set()
    queue = [LinearOperator]
    while queue:
        for cls in queue.pop().__subclasses__():
            if cls not in found:
                found.add(cls)
                queue.append(cls)
    return sorted(
        (c for c in found if c.__module__.startswith(prefix) and not inspect.isabstract(c)),
        key=lambda c: f"{c.__module__}.{c.__qualname__}",
    )


DRAW = settings(
    max_examples=100,
    deadline=None,
    database=None,
    phases=[Phase.generate],
    suppress_health_check=list(HealthCheck),
)


class _DrawnError(Exception):
    """Raised by the search as soon as it draws an instance of the node type it looks for."""


def _draws(strategy: st.SearchStrategy, node_type: type) -> bool:
    @DRAW
    @given(strategy)
    def search(op):
        if isinstance(op, node_type):
            raise _DrawnError

    try:
        search()
    except _DrawnError:
        return True
    return False


def without_examples(node_types: list[type]) -> list[str]:
    """The node types that no example factory draws (:func:`~verify.node_examples.examples_of`)."""
    missing = []
    for node_type in node_types:
        strategy = examples_of(node_type)
        if strategy is None or not _draws(strategy, node_type):
            missing.append(node_type.__name__)
    return missing


NODE_TYPES = concrete_node_types()


def test_the_walk_finds_the_node_types():
    names = {c.__name__ for c in NODE_TYPES}
    assert {
        "Copy",
        "SendRecv",
        "Allocate",
        "HaloExchange",
        "Repartition",
        "AllGather",
        "LocalOperator",
    } <= names
    assert "PieceMover" not in names  # abstract


@pytest.mark.parametrize("node_type", NODE_TYPES, ids=lambda c: c.__qualname__)
def test_every_node_type_of_linop_has_examples(node_type):
    """Every concrete node type, handled or not, is drawn by an example factory: a node that
    the registry proof and the catalogue never see cannot land."""
    assert not without_examples([node_type]), (
        f"{node_type.__module__}.{node_type.__qualname__} has no examples: register a factory "
        "with verify.node_examples.examples_for (or make a registered base class's factory draw it)"
    )


def test_a_new_node_type_without_examples_is_caught():
    """A new subclass (of a node whose factory exists, and of no node at all) is caught."""

    class UnprovenCopy(Copy):
        pass

    class UnprovenLeaf(LinearOperator):
        def expand(self) -> LinearOperator:
            return self

        def adjoint(self) -> LinearOperator:
            return self

    walked = concrete_node_types(prefix=__name__)
    assert {UnprovenCopy, UnprovenLeaf} <= set(walked)
    assert set(without_examples([UnprovenCopy, UnprovenLeaf])) == {"UnprovenCopy", "UnprovenLeaf"}
    assert not without_examples([Copy])


def _check_numpy(op: LinearOperator, seed: int) -> bool:
    state = _integer_state(op, seed)
    before = {name: array.copy() for name, array in state.items()}
    result = apply(op, state)
    leaf = _is_leaf(op)
    if leaf:  # values as the exact matrix gives them (its dtype is the entries', not the state's)
        expected = op.range.unflatten(matrix_of(op) @ op.domain.flatten(state))
    else:  # a fast path: the expansion's values and dtypes
        expected = apply(expand_all(op), state)
    assert set(result) == set(expected) == set(op.range.names)
    for name in op.range.names:
        if not leaf:
            assert result[name].dtype == expected[name].dtype, f"{op}: dtype of block {name!r}"
        assert np.array_equal(result[name], expected[name]), f"{op}: block {name!r}"
    for name, array in state.items():
        assert np.array_equal(array, before[name]), f"{op} changed its input block {name!r}"
    if not leaf:  # in floating point too: the same dtypes, values up to the order of additions
        floats = op.domain.random(seed, dtype=np.complex64 if seed % 2 else np.float32)
        fast, slow = apply(op, floats), apply(expand_all(op), floats)
        for name in op.range.names:
            assert fast[name].dtype == slow[name].dtype, f"{op}: dtype of block {name!r} in floats"
            assert np.allclose(fast[name], slow[name], rtol=1e-5, atol=1e-5), (
                f"{op}: block {name!r} in floats"
            )
    return True


def _check_sparse(op: LinearOperator, seed: int) -> bool:
    matrix = matrix_of(op)
    assert matrix.shape == op.shape
    if _is_leaf(op):
        state = _integer_state(op, seed)
        expected = op.range.flatten(apply(op, state))
        assert np.array_equal(matrix @ op.domain.flatten(state), expected), str(op)
        return True
    expansion = matrix_of(expand_all(op))
    assert (matrix != expansion).nnz == 0, f"{op}: the fast path's matrix differs from its expansion's"
    return True


def _check_sizefree(op: LinearOperator, seed: int) -> bool:
    """The block form at the blocks' sizes is the exact matrix; False when ``op`` acts on
    part of a block (it has no size-free form)."""
    try:
        form = verify.sizefree.block_form(op)
    except NotSizeFreeError:
        return False
    dense = np.zeros(op.shape, dtype=complex)
    for (row, column), value in form.coefficients.items():
        r0, c0 = op.range.offset(row), op.domain.offset(column)
        n = op.range.block(row).size
        assert n == op.domain.block(column).size, f"{op}: block ({row}, {column}) is not square"
        dense[r0 + np.arange(n), c0 + np.arange(n)] = complex(value)
    exact = matrix_of(op).toarray()
    assert np.array_equal(dense, exact), f"{op}: the size-free form differs from the exact matrix"
    return True


def _check_torch_device(op: LinearOperator, seed: int) -> bool:
    """The device path's handler (torch operations on tensors, here on the CPU) gives exactly
    the numpy interpreter's blocks and dtypes, and leaves the input tensors unchanged."""
    import torch

    from linop.backends.torch_distributed.device import INTERPRETER, DeviceWorkspace

    state = _integer_state(op, seed)
    expected = apply(op, state)
    tensors = {name: torch.from_numpy(array.copy()) for name, array in state.items()}
    work = DeviceWorkspace(dict(tensors), set(), torch.int64, torch.device("cpu"))
    dispatch.dispatch(INTERPRETER, op, work)
    assert sorted(work.arrays) == sorted(expected), f"{op}: blocks {sorted(work.arrays)}"
    for name, array in expected.items():
        assert np.array_equal(work.arrays[name].numpy(), array), f"{op}: block {name!r} differs"
    assert all(np.array_equal(tensors[name].numpy(), state[name]) for name in state), f"{op}: input changed"
    return True


CHECKS = {
    "numpy": _check_numpy,
    "sparse": _check_sparse,
    "sizefree": _check_sizefree,
    "torch-device": _check_torch_device,
}


@pytest.mark.parametrize("pair", [p for p in PAIRS if p[0] in CHECKS], ids=_id)
def test_handler_equals_expansion(pair):
    interpreter, node_type = pair
    strategy = example_strategy(node_type)
    assert strategy is not None
    check = CHECKS[interpreter]
    checked = 0

    @EXAMPLES
    @given(strategy, st.integers(0, 2**31))
    def run(op, seed):
        nonlocal checked
        assert isinstance(op, node_type)
        assert dispatch.lookup(interpreter, type(op)) is not None
        if check(op, seed) is not False:
            checked += 1

    run()
    assert checked > 0, (
        f"no example of {node_type.__name__} could be checked by the {interpreter} interpreter"
    )


def test_program_lowerings_are_proven_under_mpi():
    """The lowerings into the distributed program (the generic ones and the MPI fast paths)
    are proven by tests/mpi/test_registry.py (run by tests/test_mpi.py under mpiexec), which
    walks the same registry."""
    proof = Path(__file__).parent / "mpi" / "test_registry.py"
    assert 'dispatch.registered("program")' in proof.read_text()
    assert any(interpreter == "program" for interpreter, _ in PAIRS), "the program registers lowerings"


def test_examples_exist_only_for_real_node_types():
    for node_type in registered_examples():
        assert issubclass(node_type, LinearOperator), node_type


def test_a_wrong_fast_path_is_caught():
    """A numpy handler that forgets to clear the destination's old values (an in-place copy
    done as an add) fails the proof."""
    from linop import Copy

    examples = example_strategy(Copy)
    assert examples is not None
    original = dispatch.lookup("numpy", Copy)

    def wrong(op, work):
        source = work.arrays[op.src.name][op.src.index]
        if op.out_of_place:
            original(op, work)
        else:
            work.writable(op.dst.name, source.dtype)[op.dst.index] += source

    table = dispatch._HANDLERS["numpy"]
    table[Copy] = wrong
    failures = 0
    try:

        @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
        @given(examples.filter(lambda op: isinstance(op, Copy) and not op.out_of_place), st.integers(0, 9))
        def run(op, seed):
            nonlocal failures
            try:
                _check_numpy(op, seed)
            except AssertionError:
                failures += 1

        run()
    finally:
        table[Copy] = original
    assert failures > 0


MISSING_HALO = "dispatch.HANDLER_MODULES = {{**dispatch.HANDLER_MODULES, 'numpy': ({},)}}".format(
    ", ".join(repr(f"linop.backends.numpy.{m}") for m in ("collectives", "local", "shims"))
)
"""A defective list: the numpy package's modules listed one by one (not the package, whose walk
finds them all), with its halo module left out."""

_UNLISTED = """
import importlib, json, pkgutil, sys

def unlisted(setup):
    for name in [n for n in sys.modules if n == 'linop' or n.startswith('linop.')]:
        del sys.modules[name]  # linop afresh (the packages it imported stay loaded)
    import linop
    from linop import dispatch
    exec(setup, {'dispatch': dispatch})
    listed = set(dispatch.registered())
    for m in pkgutil.walk_packages(linop.__path__, 'linop.'):
        if not m.name.startswith('linop.frameworks'):
            importlib.import_module(m.name)
    return sorted(f'{i}:{t.__name__}' for i, t in set(dispatch.registered()) - listed)

fresh = not any(n == 'linop' or n.startswith('linop.') for n in sys.modules)
print(json.dumps([fresh] + [unlisted(setup) for setup in json.loads(sys.argv[1])]))
"""


def _unlisted_handlers(*setups: str) -> tuple[bool, list[list[str]]]:
    """In one fresh process, for each of ``setups`` in turn (code run on ``dispatch`` before
    the first lookup): the handlers that importing every module of linop registers beyond
    those that loading ``dispatch.HANDLER_MODULES`` registered. Whether linop was unloaded when
    the first began (a fresh process), and each one's list. After the first, linop's modules are
    dropped from ``sys.modules`` and imported afresh, the other packages they import (torch,
    JAX, scipy) left loaded: one process pays for those imports once."""
    done = subprocess.run(
        [sys.executable, "-c", _UNLISTED, json.dumps(setups)], capture_output=True, text=True, check=True
    )
    fresh, *results = json.loads(done.stdout)
    return fresh, results


@pytest.fixture(scope="module")
def unlisted() -> dict[str, list[str]]:
    """The unlisted handlers with the real list (``"complete"``: the first pass, in a process
    that had not imported linop) and with :data:`MISSING_HALO` (``"missing-halo"``), from one
    process."""
    fresh, (complete, missing) = _unlisted_handlers("", MISSING_HALO)
    assert fresh, "linop was imported before the first pass"
    return {"complete": complete, "missing-halo": missing}


def test_the_handler_module_list_is_complete(unlisted):
    assert unlisted["complete"] == []


def test_a_handler_module_missing_from_the_list_is_caught(unlisted):
    assert "numpy:HaloStage" in unlisted["missing-halo"]


def test_results_do_not_depend_on_import_order():
    """Compiling a halo exchange for MPI in a fresh process that never imports the MPI
    backend gives the fast path's program (2 steps), as it does after that import."""
    code = (
        "from linop import DistributedTensor, HaloExchange, Kernel, Partition, halo_geometry\n"
        "from linop import program\n"
        "t = DistributedTensor('x', (16, 16), Partition.grid((2, 2)))\n"
        "op = HaloExchange(halo_geometry(t, Kernel(3, padding=1)))\n"
        "print(len(program.compile_program(op).steps))\n"
    )
    fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert fresh.stdout.strip() == "2"
