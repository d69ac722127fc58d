"""Example strategies per node type, for the proof that every interpreter handler is right.

The dispatch registry (:mod:`linop.dispatch`) holds, for each node type and interpreter, the
handler that runs that node directly instead of through its expansion. Each such handler must be
proven equal to the node's full expansion into primitives. This module says *which examples* a
node type is proven on: a zero-argument factory returning a hypothesis strategy of instances.

Register one beside the strategies of its feature::

    from verify.node_examples import examples_for

    @examples_for(Copy)
    @examples_for(Move)
    def _movements():
        return spaces().flatmap(movements)  # drawn Copy, SendRecv and Move nodes

A node type with a registered handler but no example strategy fails the registry proof test
(``tests/test_registry.py``), so a new fast path cannot land unproven; so does any concrete
node type of linop that no factory draws (its own, or its nearest registered base class's:
:func:`examples_of`), so a new node cannot land without ever being drawn.
"""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import strategies as st

__all__ = ["examples_for", "example_strategy", "examples_of", "registered_examples"]

ExampleFactory = Callable[[], st.SearchStrategy]
_EXAMPLES: dict[type, ExampleFactory] = {}


def examples_for(node_type: type) -> Callable[[ExampleFactory], ExampleFactory]:
    """Register the example strategy of ``node_type`` (a decorator on a zero-argument factory)."""

    def register(factory: ExampleFactory) -> ExampleFactory:
        _EXAMPLES[node_type] = factory
        return factory

    return register


def example_strategy(node_type: type) -> st.SearchStrategy | None:
    """The strategy of examples of ``node_type`` (instances of it or of its subclasses), or
    None when none is registered. One factory may serve several node types: its draws are
    filtered to the type asked for."""
    factory = _EXAMPLES.get(node_type)
    if factory is None:
        return None
    return factory().filter(lambda op: isinstance(op, node_type))


def examples_of(node_type: type) -> st.SearchStrategy | None:
    """The strategy meant to draw ``node_type``: its own factory's or, without one, the factory
    of its nearest registered base class (``SendRecv`` is drawn by the factory of ``Copy``),
    unfiltered (it may draw other types too); None when no class of its method resolution
    order has a factory. Whether it really draws ``node_type`` is checked per node type by
    ``tests/test_registry.py``."""
    for cls in node_type.__mro__:
        factory = _EXAMPLES.get(cls)
        if factory is not None:
            return factory()
    return None


def registered_examples() -> dict[type, ExampleFactory]:
    """Every registered node type and its factory (a copy)."""
    return dict(_EXAMPLES)
