"""Hypothesis strategies for framework users: linop's types for ``st.from_type``, shard layouts,
and property tests of a framework's function and backward by lifting (:mod:`verify.lift`).

Importing this module (``verify.strategies`` does) registers a strategy for each of linop's
value types with ``st.register_type_strategy``, so ``st.from_type(Space)``, ``st.builds`` of a
function annotated with linop types and ``@given(op=...)`` from type hints all work:

==============================  ===========================================================
type                            strategy
==============================  ===========================================================
:class:`~linop.Block`           ``blocks()``
:class:`~linop.Space`           ``spaces()``
:class:`~linop.Region`          a region of a drawn space
:class:`~linop.LinearOperator`  ``operators()``: trees of primitives, sums and scalings
:class:`~linop.Partition`       ``partitions()``
:class:`~linop.DistributedTensor`  ``distributed_tensors()``
:class:`~verify.lift.Lifted`    lifted integer matrices with a correct claimed adjoint
==============================  ===========================================================

To property-test your own ``torch.autograd.Function`` (or any framework function with a
backward) over random shapes and partitions, draw its parameters and lift it::

    @given(lifted_cases(make_all_gather, shard_sizes(), framework="torch"))
    def test_backward(lifted):
        verify.exact_adjoint(lifted).check()

where ``make_all_gather(sizes)`` returns ``(forward, domain, range)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import scipy.sparse as sp
from hypothesis import strategies as st

from linop import Block, DistributedTensor, LinearOperator, Partition, Region, Space

from .lift import Lifted, lift
from .node_examples import examples_for
from .strategies import blocks as _blocks
from .strategies import operators, regions, spaces
from .strategies_distributed import distributed_tensors, partitions
from .strategies_local import integer_matrices

__all__ = ["lifted_cases", "lifted_operators", "shard_sizes", "shard_spaces"]


def shard_sizes(
    *, min_total: int = 0, max_total: int = 12, min_ranks: int = 1, max_ranks: int = 4
) -> st.SearchStrategy[tuple[int, ...]]:
    """Row counts of a 1-D array split over ranks, uneven and possibly empty: ``(3, 3, 2)``,
    ``(0, 5)``, ``(4,)`` (the layouts on which hand-written backward passes break)."""

    @st.composite
    def draw_sizes(draw: st.DrawFn) -> tuple[int, ...]:
        ranks = draw(st.integers(min_ranks, max_ranks))
        total = draw(st.integers(min_total, max_total))
        cuts = sorted(draw(st.lists(st.integers(0, total), min_size=ranks - 1, max_size=ranks - 1)))
        bounds = [0, *cuts, total]
        return tuple(b - a for a, b in zip(bounds, bounds[1:]))

    return draw_sizes()


def shard_spaces(sizes: tuple[int, ...], name: str = "x", *, trailing: tuple[int, ...] = ()) -> Space:
    """One block ``name{r}`` of shape ``(sizes[r], *trailing)`` on worker ``r`` per rank."""
    return Space([Block(f"{name}{r}", (size, *trailing), worker=r) for r, size in enumerate(sizes)])


def lifted_cases(
    make: Callable[..., tuple[Any, ...]],
    *parameters: st.SearchStrategy[Any],
    framework: str = "torch",
    adjoint: bool = False,
) -> st.SearchStrategy[Lifted]:
    """Lifted operators of a user's function, one per drawn set of parameters.

    Parameters
    ----------
    make : callable
        ``make(*drawn)`` returns ``(forward, domain, range)`` (or ``(forward, adjoint, domain,
        range)`` with ``adjoint=True``): the function under test for those parameters (shapes,
        shard sizes, shifts ...), e.g. ``(MyAllGather.apply, shard_spaces(sizes), ...)``.
    *parameters : strategies
        What ``make`` takes.
    framework : {"numpy", "torch", "jax"}
        See :func:`verify.lift.lift`; the claimed backward is the framework's autograd unless
        ``adjoint=True``.
    """

    def build(drawn: tuple[Any, ...]) -> Lifted:
        made = make(*drawn)
        if adjoint:
            forward, backward, domain, range_ = made
            return lift(forward, domain, range_, adjoint=backward, framework=framework)
        forward, domain, range_ = made
        return lift(forward, domain, range_, framework=framework)

    return st.tuples(*parameters).map(build)


@st.composite
def lifted_operators(draw: st.DrawFn) -> Lifted:
    """Lifted integer matrices between drawn spaces whose claimed adjoint is the transpose."""
    domain = draw(spaces(max_blocks=2, max_side=3))
    range_ = draw(spaces(max_blocks=2, max_side=3))
    dense = draw(integer_matrices(range_.size, domain.size))
    matrix = sp.csr_array(dense)
    return Lifted(domain, range_, matrix, sp.csr_array(dense.T), "M")


@examples_for(Lifted)
def _lifted_examples() -> st.SearchStrategy[LinearOperator]:
    return st.one_of(lifted_operators(), lifted_operators().map(lambda op: op.H))


@st.composite
def _regions(draw: st.DrawFn) -> Region:
    return draw(regions(draw(spaces())))


def _register() -> None:
    st.register_type_strategy(Block, _blocks())
    st.register_type_strategy(Space, spaces())
    st.register_type_strategy(Region, _regions())
    st.register_type_strategy(LinearOperator, operators())
    st.register_type_strategy(Partition, partitions())
    st.register_type_strategy(DistributedTensor, distributed_tensors())
    st.register_type_strategy(Lifted, lifted_operators())


_register()
