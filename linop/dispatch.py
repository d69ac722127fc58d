"""One dispatch registry for every interpreter: (interpreter, node type) -> handler.

An interpreter runs a node through the handler registered for the node's type (the nearest
class in its method resolution order) and, when there is none, through the node's
:meth:`~linop.LinearOperator.expand`, repeatedly, until a handled node is reached. A node that
has no handler and does not expand raises :class:`~linop.errors.UnsupportedNodeError`. A
handler may *decline* a particular node (return :data:`DECLINE`, e.g. an MPI fast path for a
layout it does not cover); the node is then run through its expansion.

Handlers live beside their interpreter, in the modules and packages that
:data:`HANDLER_MODULES` lists for it (a package: every module in it), and register themselves
with :func:`register` when imported. The first lookup for an interpreter imports *all* of
them, so no result depends on which module a program happened to import first, and
``import linop`` itself loads no interpreter. The interpreter ``"program"`` is the lowering of
a tree into the distributed program (:mod:`linop.program`): the generic lowerings and the
fast paths, which emit engine-neutral parts (:mod:`linop.program.parts`) that each executor
runs through its own table of calls, so no executor fills the program's registry. Interpreters defined outside linop (``verify``'s size-free block forms) register
their handlers when their own module is imported.

Every handler of a node that expands is a *fast path*: it must give the same result as the
node's full expansion into the four primitives. ``tests/test_registry.py`` walks this registry
and proves that for every registered pair, on examples drawn per node type
(``verify.node_examples``).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType
from typing import Any, Final, TypeVar

from .errors import UnsupportedNodeError

__all__ = [
    "DECLINE",
    "BUILTIN_INTERPRETERS",
    "HANDLER_MODULES",
    "register",
    "lookup",
    "dispatch",
    "registered",
    "load",
]

HANDLER_MODULES: Final[Mapping[str, tuple[str, ...]]] = MappingProxyType(
    {
        "numpy": ("linop.backends.numpy",),
        "sparse": ("linop.backends.sparse",),
        "program": ("linop.program",),
        # the torch.distributed executor's local steps on a device (CUDA under NCCL)
        "torch-device": ("linop.backends.torch_distributed.device",),
    }
)
"""The modules and packages holding each built-in interpreter's handlers (names only: nothing
is imported before the interpreter's first lookup). ``tests/test_registry.py`` proves the list
complete: importing every module of linop registers no handler that loading it missed."""

BUILTIN_INTERPRETERS: Final = tuple(HANDLER_MODULES)
"""The interpreters whose handlers :data:`HANDLER_MODULES` lists."""


class _Decline:
    """The type of :data:`DECLINE`."""

    _instance: _Decline | None = None

    def __new__(cls) -> _Decline:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "DECLINE"


DECLINE: Final = _Decline()
"""Returned by a handler that does not cover this particular node: use its expansion."""

Handler = Callable[..., Any]
H = TypeVar("H", bound=Handler)

_HANDLERS: dict[str, dict[type, Handler]] = {}
_LOADED: set[str] = set()


def register(interpreter: str, node_type: type) -> Callable[[H], H]:
    """Register ``function`` as the handler of ``node_type`` for ``interpreter`` (a decorator).

    Raises
    ------
    ValueError
        If the pair already has a handler (two fast paths for one node would make the result
        depend on import order).
    """

    def decorate(function: H) -> H:
        table = _HANDLERS.setdefault(interpreter, {})
        previous = table.get(node_type)
        if previous is not None and previous is not function:
            raise ValueError(
                f"{interpreter} already has a handler for {node_type.__name__}: "
                f"{previous.__module__}.{previous.__qualname__}"
            )
        table[node_type] = function
        return function

    return decorate


def _handler_modules(interpreter: str) -> Iterator[str]:
    """The modules of ``interpreter`` (a listed package: it and every module inside it)."""
    for name in HANDLER_MODULES[interpreter]:
        yield name
        module = importlib.import_module(name)
        path = getattr(module, "__path__", None)
        if path is not None:
            for found in pkgutil.walk_packages(path, prefix=f"{name}."):
                yield found.name


def load(interpreter: str) -> None:
    """Import every handler module of a built-in interpreter (once)."""
    if interpreter in _LOADED:
        return
    _LOADED.add(interpreter)
    if interpreter in HANDLER_MODULES:
        for name in _handler_modules(interpreter):
            importlib.import_module(name)


def lookup(interpreter: str, node_type: type) -> Handler | None:
    """The handler of ``node_type`` (or of its nearest registered base class), or None."""
    load(interpreter)
    table = _HANDLERS.get(interpreter, {})
    for cls in node_type.__mro__:
        function = table.get(cls)
        if function is not None:
            return function
    return None


def dispatch(interpreter: str, op: Any, *args: Any) -> Any:
    """Run ``op`` with ``interpreter``: ``handler(node, *args)`` for the first node of the
    chain ``op, op.expand(), op.expand().expand(), ...`` that has a handler which does not
    decline, and return its result.

    Raises
    ------
    UnsupportedNodeError
        If a node of the chain has no (accepting) handler and does not expand.
    """
    node = op
    while True:
        function = lookup(interpreter, type(node))
        if function is not None:
            result = function(node, *args)
            if result is not DECLINE:
                return result
        expanded = node.expand()
        if expanded is node:
            declined = " (its handler declined it)" if function is not None else ""
            raise UnsupportedNodeError(
                f"the {interpreter} interpreter has no handler for {type(node).__name__} ({node})"
                f"{declined} and it does not expand"
            )
        node = expanded


def registered(interpreter: str | None = None) -> dict[tuple[str, type], Handler]:
    """Every registered (interpreter, node type) pair and its handler, built-in interpreters
    loaded first. With ``interpreter``, only that interpreter's pairs."""
    names = BUILTIN_INTERPRETERS if interpreter is None else (interpreter,)
    for name in names:
        load(name)
    return {
        (name, node_type): function
        for name, table in sorted(_HANDLERS.items())
        if interpreter is None or name == interpreter
        for node_type, function in table.items()
    }
