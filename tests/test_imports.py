"""Import hygiene: ``import linop`` is cheap and loads no interpreter, and no module of the
project imports another module's private names."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("linop", "verify")


def _fresh(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout


def test_import_linop_loads_no_backend_and_no_scipy_linalg():
    loaded = _fresh(
        "import sys, linop\n"
        "print(sorted(m for m in sys.modules\n"
        "             if m.startswith('linop.backends.') or m in ('scipy.sparse.linalg', 'mpi4py')))\n"
    )
    assert loaded.strip() == "[]", loaded


def test_scipy_adapter_still_reachable_from_the_package():
    assert _fresh("import linop; print(linop.aslinearoperator.__module__)").strip() == (
        "linop.backends.sparse.scipy_interop"
    )


def third_party(modules: list[str]) -> list[str]:
    """The top-level names of ``modules`` that are neither the standard library, numpy nor
    linop itself."""
    tops = {m.split(".")[0] for m in modules if not m.startswith("_")}
    return sorted(tops - {"linop", "numpy"} - set(sys.stdlib_module_names))


def test_import_linop_is_cheap():
    """``import linop`` loads nothing but numpy and the standard library (no scipy, sympy,
    hypothesis, array-api-compat): what keeps it at about 45 ms of its own on the idle
    development machine. The time itself is not asserted (a loaded machine takes seconds)."""
    loaded = _fresh(
        "import sys, numpy\nbefore = set(sys.modules)\nimport linop\nprint(sorted(set(sys.modules) - before))"
    )
    modules = ast.literal_eval(loaded.strip())
    assert "linop" in modules
    assert third_party(modules) == [], f"import linop loads {third_party(modules)}"
    assert third_party(["linop.space", "heapq", "_heapq", "scipy.sparse", "numpy.linalg"]) == ["scipy"]


def _private_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(
                        f"{path.relative_to(ROOT)}:{node.lineno} imports {alias.name} from {node.module}"
                    )
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_imports_private_names_of_another(package):
    offenders = [line for path in sorted((ROOT / package).rglob("*.py")) for line in _private_imports(path)]
    assert not offenders, "\n".join(offenders)


# -- layering: which package may import which ------------------------------------------------
ENGINES = ("mpi4py", "torch", "jax", "jaxlib")
EXECUTOR_PACKAGES = ("linop.backends.mpi", "linop.backends.torch_distributed", "linop.backends.jax")
"""The executors' packages: none imports another (what they share lives in linop.program and the
host kit, linop/backends/host_*.py)."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    """The absolute module an ``ImportFrom`` reads from (relative levels resolved)."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(source: str, module: str, *, is_package: bool = False) -> list[tuple[str, int, bool]]:
    """Every module ``source`` (the text of ``module``) imports: (absolute name, line, whether
    the import runs when the module is imported). Imports inside functions run later (lazy);
    imports under ``if TYPE_CHECKING:`` never run. ``from a import b`` yields both ``a`` and
    ``a.b`` (``b`` may be a submodule)."""
    found: list[tuple[str, int, bool]] = []

    def visit(nodes: list[ast.stmt], eager: bool) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                found.extend((alias.name, node.lineno, eager) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(module, node, is_package)
                found.append((base, node.lineno, eager))
                found.extend((f"{base}.{alias.name}", node.lineno, eager) for alias in node.names)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(node.body, False)
            elif isinstance(node, ast.If):
                visit(node.body, eager and not _is_type_checking(node.test))
                visit(node.orelse, eager)
            else:
                for field in ("body", "orelse", "finalbody", "handlers"):
                    children = getattr(node, field, None)
                    if isinstance(children, list):
                        visit([c for c in children if isinstance(c, ast.stmt)], eager)
                        for handler in children:
                            if isinstance(handler, ast.ExceptHandler):
                                visit(handler.body, eager)

    visit(ast.parse(source).body, True)
    return found


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def layering_violations(source: str, module: str, *, is_package: bool = False) -> list[str]:
    """The import rules of docs/design.md that ``module`` (its text ``source``) breaks."""
    out = []
    for name, line, eager in imports_of(source, module, is_package=is_package):
        where = f"{module}:{line} imports {name}"
        if _within(module, ("linop.backends",)) and _within(name, ("linop.frameworks",)):
            out.append(f"{where}: backends never import frameworks")
        core = _within(module, ("linop",)) and not _within(module, ("linop.backends", "linop.frameworks"))
        if core and eager and _within(name, ("linop.backends",)):
            out.append(f"{where}: the core imports no backend at module level")
        if _within(module, ("linop.program",)) and _within(
            name, (*ENGINES, "linop.backends", "linop.frameworks")
        ):
            out.append(f"{where}: linop.program imports no engine, backend or framework, not even lazily")
        if module in ("linop.accounting", "linop.plot") and _within(name, ("linop.backends",)):
            out.append(f"{where}: accounting and plots read linop.program, never a backend")
        for package in EXECUTOR_PACKAGES:
            others = tuple(p for p in EXECUTOR_PACKAGES if p != package)
            if _within(module, (package,)) and _within(name, others):
                out.append(f"{where}: no executor imports another executor, not even lazily")
    return out


def test_the_layering_holds():
    offenders = [
        line
        for path in sorted((ROOT / "linop").rglob("*.py"))
        for line in layering_violations(
            path.read_text(), _module_name(path), is_package=path.name == "__init__.py"
        )
    ]
    assert not offenders, "\n".join(offenders)


@pytest.mark.parametrize(
    ("module", "source", "rule"),
    [
        (
            "linop.backends.numpy_x",
            "def f():\n    from ..frameworks import torch_function\n",
            "never import frameworks",
        ),
        ("linop.backends.numpy_x", "import linop.frameworks.jax_function\n", "never import frameworks"),
        ("linop.halo", "from .backends import numpy\n", "no backend at module level"),
        (
            "linop.layers.conv",
            "try:\n    from ..backends.mpi import apply\nexcept ImportError:\n    pass\n",
            "no backend at module level",
        ),
        ("linop.program.steps", "def f():\n    import torch\n", "imports no engine"),
        ("linop.program.lowering", "from mpi4py import MPI\n", "imports no engine"),
        (
            "linop.program.compile",
            "def f():\n    from ..backends.mpi import native\n",
            "imports no engine",
        ),
        ("linop.accounting", "def f():\n    from .backends.mpi.plan import Compiled\n", "never a backend"),
        ("linop.plot", "def f():\n    from .backends import sparse\n", "never a backend"),
        (
            "linop.backends.torch_distributed.plan",
            "def f():\n    from ..mpi.plan import read_only\n",
            "no executor imports another",
        ),
        (
            "linop.backends.jax.plan",
            "from ..torch_distributed import schedule\n",
            "no executor imports another",
        ),
        ("linop.backends.mpi.context", "import linop.backends.jax.ops\n", "no executor imports another"),
    ],
)
def test_the_layering_check_catches_a_violation(module, source, rule):
    found = layering_violations(source, module)
    assert any(rule in line for line in found), found


def test_the_layering_check_allows_what_the_rules_allow():
    """Lazy backend imports in the core, TYPE_CHECKING imports, frameworks importing backends."""
    assert not layering_violations("def f():\n    from .backends import numpy\n", "linop.operator")
    assert not layering_violations(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .backends.numpy import Workspace\n",
        "linop.local",
    )
    assert not layering_violations("from ..backends import mpi\n", "linop.frameworks.torch_function")
    assert not layering_violations("from . import steps\n", "linop.program", is_package=True)
    assert not layering_violations("from ..host_schedule import outputs\n", "linop.backends.mpi.plan")
    assert not layering_violations("from ...program.mapped import compiled_for\n", "linop.backends.jax.plan")


def test_compiling_a_program_loads_no_engine():
    """The whole compilation (lowering through the registry, batching, projection) in a fresh
    process imports neither mpi4py, torch nor jax."""
    loaded = _fresh(
        "import sys\n"
        "from linop import DistributedTensor, HaloExchange, Kernel, Partition, halo_geometry\n"
        "from linop.program import compile_for_rank, compile_program\n"
        "t = DistributedTensor('x', (16, 16), Partition.grid((2, 2)))\n"
        "op = HaloExchange(halo_geometry(t, Kernel(3, padding=1)))\n"
        "compile_program(op).for_rank(1); compile_for_rank(op, 2)\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {ENGINES!r}))\n"
    )
    assert loaded.strip() == "[]", loaded


# -- layering at run time: what a fresh interpreter holds after compiling -------------------------
# The import rules above read the source; the registry imports its handler modules by string
# (linop.dispatch.HANDLER_MODULES), which no source scan sees. These checks run the compilation in
# a fresh interpreter and read its sys.modules.
EXECUTORS = {
    "mpi": ("linop.backends.mpi",),
    "torch.distributed": ("linop.backends.torch_distributed",),
    "jax": ("linop.backends.jax",),
}
"""Each executor's modules (its package)."""

TREES = (
    "from linop import AllGather, AllReduce, Broadcast, DistributedTensor, HaloExchange, Kernel\n"
    "from linop import Partition, ReduceScatter, Repartition, Scatter, halo_geometry\n"
    "from linop.space import Block\n"
    "t = DistributedTensor('x', (8, 8), Partition((2, 2)))\n"
    "u = DistributedTensor('u', (8, 8), Partition((4, 1)))\n"
    "trees = [HaloExchange(halo_geometry(t, Kernel(3, padding=1))), AllReduce(t, (0,)),\n"
    "         Repartition(t, u), AllGather(t, 1, 'g'), AllGather(t, 1, 'g').H,\n"
    "         Broadcast(DistributedTensor('b', (3,), Partition((1,))), Partition((4,)), 'c'),\n"
    "         Scatter(Block('r', (8, 8), 0), t),\n"
    "         ReduceScatter(DistributedTensor('v', (7, 3), Partition((4, 1))), 0, 'g')]\n"
    "trees += [tree.H for tree in trees]\n"
)
"""Trees of every fast-path family (halo, all-reduce, rooted, all-to-all, gather along a line,
reduce-scatter of equal or uneven shares), forward and adjoint, on four workers."""

COMPILATIONS = {
    "program": (
        None,
        "from linop.program import WorkerMap, compile_for_rank, compile_program\n"
        "for tree in trees:\n"
        "    compile_for_rank(tree, 1); compile_program(tree).for_rank(2)\n"
        "    compile_for_rank(tree, 0, WorkerMap([0, 0, 1, 1]))\n",
    ),
    "jax": (
        "jax",
        "from linop.backends.jax.plan import compile_plan\nfor tree in trees:\n    compile_plan(tree, 4)\n",
    ),
    "torch.distributed": (
        "torch.distributed",
        "from linop.backends.torch_distributed.schedule import identity_map, native_program\n"
        "from linop.backends.torch_distributed.schedule import portable_program\n"
        "for tree in trees:\n"
        "    native_program(tree, 1); portable_program(tree, identity_map(4), 1, 4)\n",
    ),
}
"""Per case: the executor it compiles for (None: the program alone) and the code that does."""


def foreign_modules(loaded: list[str], executor: str | None) -> list[str]:
    """The modules of ``loaded`` that belong to an executor other than ``executor`` (None: the
    program's own compilation, which may load no executor's module)."""
    others = tuple(p for name, prefixes in EXECUTORS.items() if name != executor for p in prefixes)
    return sorted(m for m in loaded if _within(m, others))


def _loaded_after(code: str) -> list[str]:
    """The linop modules a fresh interpreter holds after running ``code``."""
    out = _fresh(f"{code}\nimport sys\nprint(sorted(m for m in sys.modules if m.startswith('linop')))\n")
    return ast.literal_eval(out.strip().splitlines()[-1])


@pytest.mark.parametrize("case", ["program", "jax", "torch.distributed"])
def test_compiling_loads_no_module_of_another_executor(case):
    """A fresh interpreter that compiles trees of every fast-path family for a rank (the
    program's own compile_for_rank, with and without a worker map; JAX's compile_plan;
    torch.distributed's native and portable programs) holds no module of another executor: the
    program's registry is filled by linop.program alone, and no executor imports another."""
    executor, code = COMPILATIONS[case]
    loaded = _loaded_after(TREES + code)
    if executor is not None:
        assert any(_within(m, EXECUTORS[executor]) for m in loaded), "the executor never loaded"
    assert foreign_modules(loaded, executor) == [], foreign_modules(loaded, executor)


@pytest.mark.parametrize(("case", "extra"), [
    ("program", "import linop.backends.mpi.steps"),
    ("program", "import linop.backends.jax.ops"),
    ("jax", "from linop.backends.mpi.native import CALLS"),
])  # fmt: skip
def test_the_run_time_check_catches_a_module_of_another_executor(case, extra):  # control
    """The same check on the same compilation with one foreign module imported on purpose
    names that module (and the fresh interpreter is what makes it see one: the test process
    itself has loaded every executor)."""
    executor, code = COMPILATIONS[case]
    found = foreign_modules(_loaded_after(f"{TREES}{code}{extra}\n"), executor)
    assert extra.split()[1] in found, found


def test_the_run_time_check_allows_an_executor_its_own_modules():  # control
    """An executor's own modules and the shared host modules are not foreign to it."""
    loaded = ["linop.backends.mpi.native.all_reduce", "linop.backends.host_schedule", "linop.program"]
    assert foreign_modules(loaded, "mpi") == []
    assert foreign_modules(loaded, None) == ["linop.backends.mpi.native.all_reduce"]
    assert foreign_modules(loaded, "jax") == ["linop.backends.mpi.native.all_reduce"]
