r"""Size-free proofs: block matrices with symbolic block sizes, for whole-block trees.

When every region of a tree is a whole block, the tree's matrix is a block matrix whose blocks
are :math:`c\,I_n` or :math:`O`, whatever the blocks' sizes: allocate, deallocate, clear and add
only ever place identities. So a tree has a *block form*: one scalar coefficient per (range
block, domain block) pair, and :math:`n` a symbol per block size. An identity proven on block
forms holds for every size at once. For example the in-place copy's adjoint is
:math:`K_b S_{b\to a}`:

.. math::

    C_{a\to b} = \begin{bmatrix} I_n & O \\ I_n & O \end{bmatrix}, \qquad
    C_{a\to b}^* = \begin{bmatrix} I_n & I_n \\ O & O \end{bmatrix} = K_b S_{b\to a}.

The rules, one per primitive, with sizes from the blocks the primitive relates:

==================  ==================================================
node                block form
==================  ==================================================
Allocate A_b        identity on the domain's blocks; row b is zero
Deallocate D_b      identity on the range's blocks; column b is zero
Clear K_b (whole)   identity except the (b, b) block, which is zero
Add S_{a->b}        identity plus I at (b, a)
Identity, Zero      I, O
A @ B, A + B, c A   block product, block sum, scalar multiple
other nodes         their ``expand()``
==================  ==================================================

Every block is kept in a canonical form (an expanded sympy scalar times :math:`I_n`, or
:math:`O`), so two forms are compared block by block without relying on ``simplify``.
:meth:`BlockForm.as_blockmatrix` gives the sympy ``BlockMatrix`` (``Identity(n)``,
``ZeroMatrix``) for display and for ``block_collapse``; :func:`canonical_block` reduces any
block expression built from those back to its coefficient.

A tree that cuts a block into pieces (a region that is not a whole block) has no size-free
form: :class:`~verify.errors.NotSizeFreeError` says which node and region.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import sympy

from linop import (
    Add,
    Allocate,
    Block,
    Clear,
    Composition,
    Deallocate,
    Identity,
    LinearOperator,
    Region,
    ScalarError,
    Scaled,
    Space,
    Sum,
    Zero,
    dispatch,
)

from ._text import short, space_problem
from .errors import NotSizeFreeError
from .verdict import Verdict

INTERPRETER = "sizefree"
"""The name of the block-form interpreter in the dispatch registry."""

__all__ = [
    "BlockForm",
    "SizeFreeProof",
    "block_form",
    "block_forms",
    "block_matrix",
    "canonical_block",
    "prove_adjoint",
    "prove_equal",
]

Key = tuple[str, str]


def exact_scalar(alpha: object) -> sympy.Expr:
    """A scalar as an exact sympy number (floats become the exact binary fraction)."""
    if isinstance(alpha, sympy.Basic):
        return alpha
    if hasattr(alpha, "item"):
        alpha = alpha.item()
    if isinstance(alpha, numbers.Integral):
        return sympy.Integer(int(alpha))
    if isinstance(alpha, numbers.Real):
        return sympy.Rational(float(alpha))
    if isinstance(alpha, numbers.Complex):
        value = complex(alpha)
        return sympy.Rational(value.real) + sympy.I * sympy.Rational(value.imag)
    raise ScalarError(f"not a scalar: {alpha!r}")


@dataclass
class _Sizes:
    """Union-find over blocks: blocks related by an add have the same size."""

    parent: dict[Block, Block] = field(default_factory=dict)

    def add(self, block: Block) -> None:
        self.parent.setdefault(block, block)

    def find(self, block: Block) -> Block:
        self.add(block)
        while self.parent[block] != block:
            self.parent[block] = self.parent[self.parent[block]]
            block = self.parent[block]
        return block

    def union(self, a: Block, b: Block) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:  # the block seen first names the class
            order = list(self.parent)
            first, second = sorted((ra, rb), key=order.index)
            self.parent[second] = first

    def symbols(self) -> dict[Block, sympy.Symbol]:
        """One nonnegative integer symbol per class, named after its first block: ``n_x``."""
        roots = sorted({self.find(b) for b in self.parent}, key=list(self.parent).index)
        names: dict[Block, sympy.Symbol] = {}
        used: set[str] = set()
        for root in roots:
            name, count = f"n_{root.name}", 1
            while name in used:
                count += 1
                name = f"n_{root.name}_{count}"
            used.add(name)
            names[root] = sympy.Symbol(name, integer=True, nonnegative=True)
        return {b: names[self.find(b)] for b in self.parent}


@dataclass(frozen=True)
class BlockForm:
    """The block matrix of a whole-block tree, in canonical form.

    Attributes
    ----------
    range, domain : Space
        Rows follow the range's blocks, columns the domain's, in canonical order.
    coefficients : dict of (row name, column name) to sympy.Expr
        The nonzero blocks: block (r, c) is ``coefficients[r, c] * Identity(n)``; a missing
        key is a zero block.
    sizes : dict of Block to sympy.Symbol
        The symbolic size of every block (filled in by :func:`block_form`).
    """

    range: Space
    domain: Space
    coefficients: Mapping[Key, sympy.Expr]
    sizes: Mapping[Block, sympy.Symbol] = field(default_factory=dict)

    # -- algebra on canonical forms ---------------------------------------------------------
    def __matmul__(self, other: BlockForm) -> BlockForm:
        product: dict[Key, sympy.Expr] = {}
        by_row: dict[str, list[tuple[str, sympy.Expr]]] = {}
        for (middle, column), value in other.coefficients.items():
            by_row.setdefault(middle, []).append((column, value))
        for (row, middle), left in self.coefficients.items():
            for column, right in by_row.get(middle, ()):
                product[row, column] = product.get((row, column), 0) + left * right
        return BlockForm(self.range, other.domain, _canonical(product))

    def __add__(self, other: BlockForm) -> BlockForm:
        total = dict(self.coefficients)
        for key, value in other.coefficients.items():
            total[key] = total.get(key, 0) + value
        return BlockForm(self.range, self.domain, _canonical(total))

    def scaled(self, alpha: sympy.Expr) -> BlockForm:
        """The form of ``alpha * self``."""
        return BlockForm(
            self.range, self.domain, _canonical({k: alpha * v for k, v in self.coefficients.items()})
        )

    def adjoint(self) -> BlockForm:
        """The conjugate transpose: block (c, r) becomes conj of block (r, c)."""
        return BlockForm(
            self.domain,
            self.range,
            _canonical({(c, r): sympy.conjugate(v) for (r, c), v in self.coefficients.items()}),
            self.sizes,
        )

    # -- sympy views --------------------------------------------------------------------
    def size(self, space: Space, name: str) -> sympy.Expr:
        """The symbolic size of block ``name`` of ``space``."""
        return self.sizes.get(space.block(name), sympy.Integer(space.block(name).size))

    def block(self, row: str, column: str) -> sympy.MatrixExpr:
        """Block (row, column) as a sympy matrix expression: ``c * Identity(n)`` or ``ZeroMatrix``."""
        value = self.coefficients.get((row, column), 0)
        if value == 0:
            return sympy.ZeroMatrix(self.size(self.range, row), self.size(self.domain, column))
        identity = sympy.Identity(self.size(self.range, row))
        return identity if value == 1 else sympy.MatMul(value, identity)

    def as_blockmatrix(self) -> sympy.BlockMatrix:
        """The sympy BlockMatrix (rows: range blocks, columns: domain blocks)."""
        if not self.range.names or not self.domain.names:
            raise NotSizeFreeError("a block matrix needs at least one block in the domain and the range")
        return sympy.BlockMatrix([[self.block(r, c) for c in self.domain.names] for r in self.range.names])

    def __str__(self) -> str:
        rows = []
        for r in self.range.names:
            cells = []
            for c in self.domain.names:
                value = self.coefficients.get((r, c), 0)
                cells.append("O" if value == 0 else ("I" if value == 1 else f"({value})I"))
            rows.append(f"{r}: [" + ", ".join(cells) + "]")
        return f"columns {list(self.domain.names)}; " + "; ".join(rows)


def _canonical(coefficients: Mapping[Key, object]) -> dict[Key, sympy.Expr]:
    """Expand every coefficient and drop the zero blocks."""
    result = {}
    for key, value in coefficients.items():
        value = sympy.expand(sympy.sympify(value))
        if value != 0:
            result[key] = value
    return result


def _diagonal(space: Space, skip: str | None = None) -> dict[Key, sympy.Expr]:
    return {(n, n): sympy.Integer(1) for n in space.names if n != skip}


def _whole_block_name(node: LinearOperator, region: Region) -> str:
    if not region.is_whole:
        raise NotSizeFreeError(
            f"{node} acts on {region!r}, a part of block {region.name!r} {region.block.shape}; "
            "size-free proofs need trees whose every region is a whole block"
        )
    return region.name


def _form(op: LinearOperator, sizes: _Sizes, origin: LinearOperator | None = None) -> BlockForm:
    """The block form of ``op`` through its size-free handler in the dispatch registry, or
    of its expansion; ``origin`` is the node whose expansion is being formed (named in errors)."""
    function = dispatch.lookup(INTERPRETER, type(op))
    if function is not None:
        form: BlockForm = function(op, sizes, origin)
        return form
    expanded = op.expand()
    if expanded is op or expanded == op:
        raise NotSizeFreeError(
            f"{type(op).__name__} ({op}) neither is a primitive nor expands into primitives"
        )
    return _form(expanded, sizes, origin or op)


def _handler(node_type: type) -> Callable[[Callable[..., BlockForm]], Callable[..., BlockForm]]:
    """Register the size-free block form of a node type (primitives and algebra nodes; every
    other node is formed from its expansion)."""

    def register(function: Callable[..., BlockForm]) -> Callable[..., BlockForm]:
        def form(op: LinearOperator, sizes: _Sizes, origin: LinearOperator | None) -> BlockForm:
            for space in (op.domain, op.range):
                for b in space.blocks:
                    sizes.add(b)
            return function(op, sizes, origin)

        dispatch.register(INTERPRETER, node_type)(form)
        return function

    return register


@_handler(Composition)
def _composition(op: Composition, sizes: _Sizes, origin: LinearOperator | None) -> BlockForm:
    forms = [_form(f, sizes, origin) for f in op.factors]
    result = forms[-1]
    for form in reversed(forms[:-1]):
        result = form @ result
    return result


@_handler(Sum)
def _sum(op: Sum, sizes: _Sizes, origin: LinearOperator | None) -> BlockForm:
    forms = [_form(t, sizes, origin) for t in op.terms]
    result = forms[0]
    for form in forms[1:]:
        result = result + form
    return result


@_handler(Scaled)
def _scaled(op: Scaled, sizes: _Sizes, origin: LinearOperator | None) -> BlockForm:
    return _form(op.operator, sizes, origin).scaled(exact_scalar(op.alpha))


@_handler(Identity)
def _identity(op: Identity, sizes: _Sizes, origin: LinearOperator | None) -> BlockForm:
    return BlockForm(op.range, op.domain, _diagonal(op.space))


@_handler(Zero)
def _zero(op: Zero, sizes: _Sizes, origin: LinearOperator | None) -> BlockForm:
    return BlockForm(op.range, op.domain, {})


@_handler(Allocate)
def _allocate(op: Allocate, sizes: _Sizes, origin: LinearOperator | None) -> BlockForm:
    return BlockForm(op.range, op.domain, _diagonal(op.domain))


@_handler(Deallocate)
def _deallocate(op: Deallocate, sizes: _Sizes, origin: LinearOperator | None) -> BlockForm:
    return BlockForm(op.range, op.domain, _diagonal(op.range))


@_handler(Clear)
def _clear(op: Clear, sizes: _Sizes, origin: LinearOperator | None) -> BlockForm:
    return BlockForm(
        op.range, op.domain, _diagonal(op.domain, skip=_whole_block_name(origin or op, op.region))
    )


@_handler(Add)
def _add(op: Add, sizes: _Sizes, origin: LinearOperator | None) -> BlockForm:
    src, dst = _whole_block_name(origin or op, op.src), _whole_block_name(origin or op, op.dst)
    sizes.union(op.src.block, op.dst.block)
    coefficients = _diagonal(op.domain)
    coefficients[dst, src] = sympy.Integer(1)
    return BlockForm(op.range, op.domain, coefficients)


def _with_sizes(form: BlockForm, sizes: _Sizes) -> BlockForm:
    return BlockForm(form.range, form.domain, form.coefficients, sizes.symbols())


def block_form(op: LinearOperator) -> BlockForm:
    """The canonical block form of a whole-block tree, with symbolic block sizes.

    Raises
    ------
    NotSizeFreeError
        If a node acts on part of a block, or does not expand into the primitives.
    """
    sizes = _Sizes()
    return _with_sizes(_form(op, sizes), sizes)


def block_forms(*ops: LinearOperator) -> tuple[BlockForm, ...]:
    """The block forms of several trees with shared size symbols (a block has the same
    symbol in all of them), so that their BlockMatrices can be multiplied and compared."""
    sizes = _Sizes()
    forms = [_form(op, sizes) for op in ops]
    return tuple(_with_sizes(form, sizes) for form in forms)


def block_matrix(op: LinearOperator) -> sympy.BlockMatrix:
    """The sympy BlockMatrix of a whole-block tree: ``Identity(n)`` and ``ZeroMatrix`` blocks
    with symbolic sizes ``n_<block>``."""
    return block_form(op).as_blockmatrix()


def canonical_block(expr: sympy.Expr) -> sympy.Expr:
    """Reduce a block expression built from ``Identity``, ``ZeroMatrix`` and scalars (as
    ``block_collapse`` returns it) to its coefficient: the c of ``c * Identity(n)``, 0 for O.

    Raises
    ------
    NotSizeFreeError
        For any other matrix expression (a general MatrixSymbol has no such form).
    """
    if isinstance(expr, sympy.ZeroMatrix):
        return sympy.Integer(0)
    if isinstance(expr, sympy.Identity):
        return sympy.Integer(1)
    if isinstance(expr, sympy.MatAdd):
        return sympy.expand(sympy.Add(*(canonical_block(a) for a in expr.args)))
    if isinstance(expr, sympy.MatMul):
        return sympy.expand(sympy.Mul(*(canonical_block(a) for a in expr.args)))
    if isinstance(expr, sympy.MatPow) and expr.exp.is_Integer and expr.exp >= 0:
        return sympy.expand(canonical_block(expr.base) ** expr.exp)
    if isinstance(expr, sympy.Transpose):
        return canonical_block(expr.arg)
    if isinstance(expr, sympy.Adjoint):
        return sympy.conjugate(canonical_block(expr.arg))
    if isinstance(expr, sympy.MatrixExpr):
        raise NotSizeFreeError(f"{expr} is not a multiple of an identity block")
    return sympy.expand(expr)


@dataclass(frozen=True)
class SizeFreeProof(Verdict):
    """Outcome of a size-free proof; true when the block forms agree for every block size.

    Attributes
    ----------
    claim : str
    passed : bool
    left, right : BlockForm
        The two canonical block forms compared.
    detail : str
        The sizes the proof holds for, or the first differing blocks.
    """

    claim: str
    passed: bool
    left: BlockForm
    right: BlockForm
    detail: str

    def __repr__(self) -> str:
        verdict = "proven" if self.passed else "FAILED"
        return f"SizeFreeProof({verdict}: {self.claim}; {self.detail})"


def _compare(claim: str, left: BlockForm, right: BlockForm, names: tuple[str, str]) -> SizeFreeProof:
    problem = space_problem("ranges differ", left.range, right.range) or space_problem(
        "domains differ", left.domain, right.domain
    )
    if problem:
        return SizeFreeProof(claim, False, left, right, problem)
    wrong = []
    for row in left.range.names:
        for column in left.domain.names:
            a = left.coefficients.get((row, column), sympy.Integer(0))
            b = right.coefficients.get((row, column), sympy.Integer(0))
            if sympy.expand(a - b) != 0:
                wrong.append(
                    f"block (row {row}, column {column}): {names[0]} has {left.block(row, column)}, "
                    f"{names[1]} has {right.block(row, column)}"
                )
    symbols = sorted({str(s) for s in left.sizes.values()})
    if not wrong:
        sizes = ", ".join(symbols) if symbols else "no blocks"
        return SizeFreeProof(
            claim, True, left, right, f"equal block by block for all sizes {sizes} (rows: range blocks)"
        )
    more = f" (and {len(wrong) - 3} more)" if len(wrong) > 3 else ""
    return SizeFreeProof(
        claim,
        False,
        left,
        right,
        f"{len(wrong)} blocks differ (rows are blocks of the range, columns of the domain); "
        f"first: {'; '.join(wrong[:3])}{more}",
    )


def prove_adjoint(op: LinearOperator) -> SizeFreeProof:
    """Prove, for every block size, that ``op.H``'s block form is the conjugate transpose of
    ``op``'s.

    The conjugate transpose is taken by sympy on the BlockMatrix when it has blocks (each
    block reduced by :func:`canonical_block`), and by the rule (c, r) = conj (r, c) otherwise.

    Raises
    ------
    NotSizeFreeError
        If the tree (or its adjoint) acts on part of a block.
    """
    forward, backward = block_forms(op, op.H)
    expected = forward.adjoint()
    if forward.range.names and forward.domain.names:
        conjugate = forward.as_blockmatrix().adjoint()
        blocks = conjugate.blocks if isinstance(conjugate, sympy.BlockMatrix) else None
        if blocks is not None:
            expected = BlockForm(
                forward.domain,
                forward.range,
                _canonical(
                    {
                        (r, c): canonical_block(blocks[i, j])
                        for i, r in enumerate(forward.domain.names)
                        for j, c in enumerate(forward.range.names)
                    }
                ),
                forward.sizes,
            )
    return _compare(f"{short(op)}: op.H == op^H for all sizes", backward, expected, ("op.H", "op^H"))


def prove_equal(a: LinearOperator, b: LinearOperator) -> SizeFreeProof:
    """Prove, for every block size, that two whole-block trees are the same operator.

    Raises
    ------
    NotSizeFreeError
        If either tree acts on part of a block.
    """
    left, right = block_forms(a, b)
    return _compare(f"{short(a)} == {short(b)} for all sizes", left, right, ("left", "right"))
