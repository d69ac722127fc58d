r"""Symbolic verification with sympy: actions on named symbols, the symbolic dot test, and
size-free proofs.

Entry-wise (any tree, any regions)
    :func:`symbols` makes a state whose every entry is its own real symbol, named after its
    block and index (``x_0_1`` is entry (0, 1) of block ``x``); :func:`apply` runs a tree on it
    with the numpy interpreter over object arrays, so the result shows exactly which inputs
    land where (an adjoint adding a halo into a neighbour's bulk reads ``x_3 + h_0``).
    :func:`dot_test` is the adjoint test on two symbolic vectors:
    :math:`\langle F x, y\rangle - \langle x, F^* y\rangle` must expand to exactly 0, and any
    leftover term :math:`c\, x_j\, y_i` points at the entry (j, i) of ``op.H`` that is wrong.
    :func:`equal` compares two trees on the same symbols.

Size-free (whole-block trees)
    :func:`block_matrix`, :func:`prove_adjoint` and :func:`prove_equal` come from
    :mod:`verify.sizefree`: block matrices with symbolic block sizes, proofs for every size.

The symbols are real: a complex-linear map is determined by its action on real vectors, and
real symbols keep conjugates readable.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import sympy

from linop import LinearOperator, Space

from ._text import short, space_problem
from .errors import SymbolicError
from .locate import Location
from .sizefree import (
    BlockForm,
    SizeFreeProof,
    block_form,
    block_forms,
    block_matrix,
    prove_adjoint,
    prove_equal,
)
from .verdict import Verdict

__all__ = [
    "symbols",
    "symbol_name",
    "apply",
    "dot_test",
    "equal",
    "SymbolicResult",
    "block_matrix",
    "block_form",
    "block_forms",
    "BlockForm",
    "prove_adjoint",
    "prove_equal",
    "SizeFreeProof",
]

MAX_REPORTED = 5
"""How many wrong entries a failed symbolic test lists."""


def symbol_name(block: str, index: tuple[int, ...], prefix: str = "") -> str:
    """The name of the symbol of one entry: ``x_0_1`` for block ``x``, index (0, 1)."""
    return "_".join((f"{prefix}{block}", *map(str, index)))


def symbols(space: Space, prefix: str = "") -> dict[str, np.ndarray]:
    """A state of ``space`` whose entries are distinct real sympy symbols.

    Parameters
    ----------
    space : Space
    prefix : str, optional
        Put before every block name (the dot test names its second vector ``d...``).

    Returns
    -------
    dict of str to numpy object array
        Block ``x`` of shape (2, 3) holds the symbols ``x_0_0`` ... ``x_1_2``.

    Raises
    ------
    SymbolicError
        If two entries would get one name (entry (0, 1) of a block ``x`` and entry 1 of a
        block ``x_0`` are both ``x_0_1``): one symbol for two entries would let a wrong
        operator that mixes them up pass.
    """
    state: dict[str, np.ndarray] = {}
    owners: dict[str, Location] = {}
    for block in space.blocks:
        array = np.empty(block.shape, dtype=object)
        for index in np.ndindex(*block.shape):
            name = symbol_name(block.name, index, prefix)
            owner = owners.setdefault(name, Location(block.name, tuple(index)))
            if owner != Location(block.name, tuple(index)):
                raise SymbolicError(
                    f"entries {owner} and {Location(block.name, tuple(index))} would both be the "
                    f"symbol {name!r}; rename one of the blocks {owner.block!r}, {block.name!r}"
                )
            array[index] = sympy.Symbol(name, real=True)
        state[block.name] = array
    return state


def _symbol_table(space: Space, state: Mapping[str, np.ndarray]) -> dict[sympy.Symbol, Location]:
    table = {}
    for block in space.blocks:
        for index in np.ndindex(*block.shape):
            table[state[block.name][index]] = Location(block.name, tuple(index))
    return table


def apply(op: LinearOperator, state: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Apply ``op`` to a state of symbols (default :func:`symbols` of ``op.domain``).

    Returns one object array of sympy expressions per block of ``op.range``; every entry is
    expanded, so equal expressions look equal.
    """
    if state is None:
        state = symbols(op.domain)
    arrays = {name: np.asarray(value, dtype=object) for name, value in state.items()}
    result = op.apply(arrays, dtype=object)
    expanded: dict[str, np.ndarray] = {}
    for name, array in result.items():
        out = np.empty(array.shape, dtype=object)
        for index in np.ndindex(*array.shape):
            out[index] = sympy.expand(sympy.sympify(array[index]))
        expanded[name] = out
    return expanded


@dataclass(frozen=True)
class SymbolicResult(Verdict):
    """Outcome of a symbolic test; true when the residual is exactly zero.

    Attributes
    ----------
    claim : str
    passed : bool
    residual : sympy.Expr
        What should be zero (the whole dot-test residual, or the first differing entry).
    detail : str
        On failure, the wrong entries as (block, index) pairs.
    """

    claim: str
    passed: bool
    residual: sympy.Expr
    detail: str = ""

    def __repr__(self) -> str:
        if self.passed:
            return f"SymbolicResult(proven: {self.claim}; the residual expands to 0)"
        return f"SymbolicResult(FAILED: {self.claim}; {self.detail})"


def _inner(space: Space, u: Mapping[str, np.ndarray], v: Mapping[str, np.ndarray]) -> sympy.Expr:
    total = sympy.Integer(0)
    for name in space.names:
        for a, b in zip(u[name].ravel(), v[name].ravel()):
            total += sympy.conjugate(a) * b
    return total


def _second_prefix(first: Space, second: Space) -> str:
    """A prefix for the second vector's symbols that clashes with none of the first's."""
    taken = {symbol_name(b.name, i) for b in first.blocks for i in np.ndindex(*b.shape)}
    for prefix in ("d", "dd", "d_", "cotangent_"):
        names = {symbol_name(b.name, i, prefix) for b in second.blocks for i in np.ndindex(*b.shape)}
        if not names & taken:
            return prefix
    raise SymbolicError("cannot name the dot test's symbols without a clash; rename the blocks")


def dot_test(op: LinearOperator) -> SymbolicResult:
    r"""The adjoint test on symbolic vectors: :math:`\langle F x, y\rangle - \langle x, F^* y\rangle`
    must expand to exactly 0.

    ``x`` holds the symbols of ``op.domain`` (``x_0``...), ``y`` those of ``op.range`` with the
    prefix ``d`` (``dy_0``...). The residual is bilinear: a leftover term
    :math:`c\, x_j\, dy_i` means that ``op.H``'s entry at row ``x[j]`` (of the domain), column
    ``y[i]`` (of the range) is off by :math:`-c` from ``conj(op)``'s transpose.

    Raises
    ------
    SymbolicError
        If two entries of a space would share a symbol name (see :func:`symbols`).
    """
    adjoint = op.H
    claim = f"symbolic dot test of {short(op)}"
    problem = space_problem("op.H's domain is not op's range", adjoint.domain, op.range) or space_problem(
        "op.H's range is not op's domain", adjoint.range, op.domain
    )
    if problem:
        return SymbolicResult(claim, False, sympy.nan, problem)
    x = symbols(op.domain)
    y = symbols(op.range, _second_prefix(op.domain, op.range))
    residual = sympy.expand(_inner(op.range, apply(op, x), y) - _inner(op.domain, x, apply(adjoint, y)))
    if residual == 0:
        return SymbolicResult(claim, True, residual)
    domain_symbols, range_symbols = _symbol_table(op.domain, x), _symbol_table(op.range, y)
    wrong: list[tuple[tuple[str | tuple[int, ...], ...], str]] = []
    for term in sympy.Add.make_args(residual):
        coefficient, factors = term.as_coeff_mul()
        found_x = [domain_symbols[f] for f in factors if f in domain_symbols]
        found_y = [range_symbols[f] for f in factors if f in range_symbols]
        rest = [f for f in factors if f not in domain_symbols and f not in range_symbols]
        if len(found_x) == 1 and len(found_y) == 1:
            off = -sympy.Mul(coefficient, *rest)
            wrong.append(
                (
                    (found_x[0].block, found_x[0].index, found_y[0].block, found_y[0].index),
                    f"row {found_x[0]}, column {found_y[0]}: op.H is off by {off}",
                )
            )
        else:
            wrong.append((("~",), f"term {term} is not bilinear in (x, y)"))
    wrong.sort(key=lambda item: item[0])
    listed = "; ".join(text for _, text in wrong[:MAX_REPORTED])
    more = f" (and {len(wrong) - MAX_REPORTED} more)" if len(wrong) > MAX_REPORTED else ""
    detail = (
        f"<F x, y> - <x, F* y> = {short(residual, 200)} != 0; {len(wrong)} wrong entries of op.H "
        f"(rows are entries of op.domain, columns of op.range); first: {listed}{more}"
    )
    return SymbolicResult(claim, False, residual, detail)


def equal(a: LinearOperator, b: LinearOperator) -> SymbolicResult:
    """Apply two trees to the same symbols and compare every entry of the result exactly.

    On failure, names the first differing (block, index) entries of the range with both
    expressions. Raises :class:`SymbolicError` if two entries of the domain would share a
    symbol name (see :func:`symbols`).
    """
    claim = f"{short(a)} == {short(b)} on symbols"
    problem = space_problem("domains differ", a.domain, b.domain) or space_problem(
        "ranges differ", a.range, b.range
    )
    if problem:
        return SymbolicResult(claim, False, sympy.nan, problem)
    x = symbols(a.domain)
    left, right = apply(a, x), apply(b, x)
    wrong = []
    for name in a.range.names:
        for index in np.ndindex(*a.range.block(name).shape):
            if sympy.expand(left[name][index] - right[name][index]) != 0:
                wrong.append((Location(name, tuple(index)), left[name][index], right[name][index]))
    if not wrong:
        return SymbolicResult(claim, True, sympy.Integer(0))
    listed = "; ".join(f"{where}: {p} versus {q}" for where, p, q in wrong[:MAX_REPORTED])
    more = f" (and {len(wrong) - MAX_REPORTED} more)" if len(wrong) > MAX_REPORTED else ""
    first = wrong[0]
    return SymbolicResult(
        claim, False, sympy.expand(first[1] - first[2]), f"{len(wrong)} entries differ; first: {listed}{more}"
    )
