"""Operator trees: the :class:`LinearOperator` base and the algebra nodes.

An operator is an immutable *description* of a linear map from one :class:`~linop.Space` (its
domain) to another (its range); it holds no data. Operators compose into trees with ``@``,
``+``, ``-`` and scalar ``*``, and every node carries its own adjoint rule next to its
definition, so ``op.H`` is derived by rules, never numerically. Interpreters (``linop.backends``)
run a tree: ``op(state)`` with numpy, ``op.to_sparse()`` as an exact scipy.sparse matrix.

Nodes that are not interpreted directly define :meth:`LinearOperator.expand`, their definition
in terms of simpler nodes, down to the four trusted primitives (allocate, deallocate, clear,
add; ``docs/theory.md#primitives``).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import numpy.typing as npt

from .errors import OperandError, ScalarError
from .space import Space, State

if TYPE_CHECKING:
    import scipy.sparse
    import scipy.sparse.linalg

__all__ = [
    "LinearOperator",
    "SameSpace",
    "OperandSpaces",
    "StoredSpaces",
    "Identity",
    "Zero",
    "Composition",
    "Sum",
    "Scaled",
    "expand_all",
    "walk",
]


def _short(op: object, limit: int = 70) -> str:
    text = str(op)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class LinearOperator(ABC):
    """Base class of every operator node.

    A subclass is a frozen dataclass that defines ``domain``, ``range`` and :meth:`adjoint`,
    and either has an interpreter handler or defines :meth:`expand`. Equality and hashing are
    structural, so ``A.H.H == A``.

    The algebra follows the mathematics: ``(A @ B)(x) == A(B(x))``, ``(A + B)(x) == A(x) +
    B(x)``, ``(alpha * A)(x) == alpha * A(x)``.

    Examples
    --------
    >>> import numpy as np
    >>> from linop import Add, Block, Clear, Copy, Space
    >>> space = Space([Block("a", (2,)), Block("b", (2,))])
    >>> tree = 2 * Copy(space["a"], space["b"]) - Clear(space["a"])
    >>> print(tree)
    2 * C[a -> b] - K[a]
    >>> print(tree.H)
    2 * C*[a -> b] - K[a]
    >>> tree({"a": np.array([1.0, 2.0]), "b": np.zeros(2)})
    {'a': array([2., 4.]), 'b': array([2., 4.])}
    >>> tree.shape, tree.H.H == tree
    ((4, 4), True)
    """

    if TYPE_CHECKING:  # read-only to type checkers; a subclass gives a property or a field

        @property
        def domain(self) -> Space:
            """The space the operator maps from."""

        @property
        def range(self) -> Space:
            """The space the operator maps to."""

    __array_ufunc__ = None  # numpy defers to us: ``array * op`` is a ScalarError, not an object array

    # -- rules every node provides ------------------------------------------------------
    @abstractmethod
    def adjoint(self) -> LinearOperator:
        """The adjoint operator: <A x, y> == <x, A* y> for all x, y."""

    def expand(self) -> LinearOperator:
        """This node's definition in simpler nodes (primitives return themselves)."""
        return self

    def children(self) -> tuple[LinearOperator, ...]:
        """The operator's direct sub-operators (empty for leaves)."""
        return ()

    @property
    def H(self) -> LinearOperator:  # noqa: N802 - the conventional name
        """The adjoint, ``self.adjoint()``."""
        return self.adjoint()

    # -- algebra ---------------------------------------------------------------------------
    def __matmul__(self, other: object) -> LinearOperator:
        return Composition((self, _operand(other, "@")))

    def __rmatmul__(self, other: object) -> LinearOperator:
        return Composition((_operand(other, "@"), self))

    def __add__(self, other: object) -> LinearOperator:
        return Sum((self, _operand(other, "+")))

    def __radd__(self, other: object) -> LinearOperator:
        return Sum((_operand(other, "+"), self))

    def __sub__(self, other: object) -> LinearOperator:
        return Sum((self, -_operand(other, "-")))

    def __rsub__(self, other: object) -> LinearOperator:
        return Sum((_operand(other, "-"), -self))

    def __neg__(self) -> LinearOperator:
        return Scaled(-1, self)

    def __mul__(self, alpha: object) -> LinearOperator:
        if isinstance(alpha, LinearOperator):
            raise ScalarError("use A @ B to compose operators; * multiplies by a scalar")
        return Scaled(alpha, self)

    __rmul__ = __mul__

    # -- interpreters ------------------------------------------------------------------
    def __call__(self, state: Mapping[str, Any]) -> State:
        """Apply the operator to a state with the numpy interpreter (never mutates it)."""
        return self.apply(state)

    def apply(
        self,
        state: Mapping[str, Any],
        *,
        inplace: bool = False,
        dtype: npt.DTypeLike | None = None,
    ) -> State:
        """Apply the operator with the numpy interpreter.

        Parameters
        ----------
        state : dict of str to array
            A state of ``self.domain``.
        inplace : bool, optional
            If True (only when domain equals range), write the result into the caller's
            arrays and return the same dict; otherwise the caller's arrays are never changed
            (blocks passed through unchanged come back as read-only views of them).
        dtype : dtype, optional
            Dtype of newly allocated blocks; default the common dtype of the input blocks.
        """
        from .entry import apply

        return apply(self, state, inplace=inplace, dtype=dtype)

    def apply_mpi(
        self,
        local_state: Mapping[str, Any],
        *,
        comm: Any = None,
        inplace: bool = False,
        dtype: npt.DTypeLike | None = None,
        mapping: Any = None,
        timeout: Any = None,
    ) -> State:
        """Apply the operator across MPI ranks; see :func:`linop.backends.mpi.apply`.

        Every rank calls this with the same tree and only the blocks its rank owns (worker w is
        rank w of ``comm``, default ``MPI.COMM_WORLD``, unless ``mapping`` places the workers:
        a :class:`~linop.program.WorkerMap`); it returns this rank's blocks of the
        range. ``timeout`` (seconds, default ``LINOP_TIMEOUT``) bounds the wait for every rank
        to arrive. Needs mpi4py (the ``mpi`` extra).
        """
        from .backends.mpi import apply

        return apply(
            self, local_state, comm=comm, inplace=inplace, dtype=dtype, mapping=mapping, timeout=timeout
        )

    def to_sparse(self, dtype: npt.DTypeLike | None = None) -> scipy.sparse.csr_array:
        """The exact matrix over the canonical flattening (integer for pure data movement)."""
        from .backends.sparse import to_sparse

        return to_sparse(self, dtype=dtype)

    @property
    def shape(self) -> tuple[int, int]:
        """(range size, domain size): the shape of the matrix."""
        return (self.range.size, self.domain.size)

    def __repr__(self) -> str:
        """The constructor call, keyword by keyword (fields left at their defaults are
        omitted); ``str`` gives the mathematical notation instead."""
        if not dataclasses.is_dataclass(self):
            return f"{type(self).__name__}()"
        arguments = []
        for field in dataclasses.fields(self):
            if not field.init or not field.repr:
                continue
            value = getattr(self, field.name)
            if field.default is not dataclasses.MISSING and value == field.default:
                continue
            arguments.append(f"{field.name}={value!r}")
        return f"{type(self).__name__}({', '.join(arguments)})"

    def _repr_latex_(self) -> str:
        """Jupyter: the block matrix over the named blocks (see :mod:`linop.display`)."""
        from .display import operator_latex

        return operator_latex(self)

    def _repr_html_(self) -> str:
        """Jupyter: shape, spaces, block matrix and the tree with each node's adjoint rule."""
        from .display import operator_html

        return operator_html(self)


class SameSpace(LinearOperator):
    """Base of the nodes that map one space to itself: domain and range are ``space``.

    A subclass gives ``space`` (a dataclass field, or a property computed from its fields).
    """

    if TYPE_CHECKING:  # read-only to type checkers; a subclass gives a field or a property

        @property
        def space(self) -> Space:
            """The domain and range."""

    @property
    def domain(self) -> Space:
        return self.space

    range = domain


class StoredSpaces(LinearOperator):
    """Base of the nodes whose domain and range are computed once, when the node is built, and
    kept: ``_domain`` and ``_range``, set by the subclass's ``__post_init__``."""

    _domain: Space
    _range: Space

    @property
    def domain(self) -> Space:
        return self._domain

    @property
    def range(self) -> Space:
        return self._range


class OperandSpaces(LinearOperator):
    """Base of the nodes whose domain and range are those of one operand, :meth:`_spaces_from`
    (a scaled operator, a sum of terms that share their spaces), or, with ``SWAPPED``, its
    range and domain (a node that runs the operand's adjoint)."""

    SWAPPED: ClassVar[bool] = False

    @abstractmethod
    def _spaces_from(self) -> LinearOperator:
        """The operand whose domain and range the node has."""

    @property
    def domain(self) -> Space:
        operand = self._spaces_from()
        return operand.range if self.SWAPPED else operand.domain

    @property
    def range(self) -> Space:
        operand = self._spaces_from()
        return operand.domain if self.SWAPPED else operand.range


def _operand(other: object, symbol: str) -> LinearOperator:
    """``other`` if it is an operator, else an :class:`OperandError` naming it."""
    if not isinstance(other, LinearOperator):
        hint = " (use * to scale by a number)" if symbol in "@" and _is_number(other) else ""
        raise OperandError(f"operand of {symbol} must be a LinearOperator, not {type(other).__name__}{hint}")
    return other


def _require_space(value: object, what: str) -> None:
    if not isinstance(value, Space):
        raise OperandError(f"{what} must be a Space, not {type(value).__name__} {_short(repr(value), 40)}")


def _is_number(alpha: object) -> bool:
    return isinstance(alpha, (int, float, complex, np.number)) and not isinstance(alpha, (bool, np.bool_))


def _factors(kind: str, items: object) -> tuple[LinearOperator, ...]:
    """The operators of a composition or a sum, each checked to be an operator."""
    if isinstance(items, LinearOperator) or not isinstance(items, (tuple, list)):
        raise OperandError(f"{kind} takes a tuple of operators, not {type(items).__name__}")
    for i, item in enumerate(items):
        if not isinstance(item, LinearOperator):
            raise OperandError(f"{kind}: item {i} is a {type(item).__name__}, not a LinearOperator")
    return tuple(items)


def walk(op: LinearOperator):
    """Yield every node of a tree, parents before children."""
    stack = [op]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(reversed(node.children()))


def expand_all(op: LinearOperator) -> LinearOperator:
    """Expand every node of a tree until only primitives and algebra nodes remain."""
    expanded = op.expand()
    if expanded is not op:
        return expand_all(expanded)
    if isinstance(op, Composition):
        return Composition(tuple(expand_all(f) for f in op.factors))
    if isinstance(op, Sum):
        return Sum(tuple(expand_all(t) for t in op.terms))
    if isinstance(op, Scaled):
        return Scaled(op.alpha, expand_all(op.operator))
    return op


@dataclass(frozen=True, eq=True, repr=False)
class Identity(SameSpace):
    """The identity I on a space: I x = x. Self-adjoint.

    Parameters
    ----------
    space : Space
        Domain and range.

    Raises
    ------
    TypeError
        If ``space`` is not a :class:`~linop.Space`.

    Examples
    --------
    >>> from linop import Identity, Space
    >>> identity = Identity(Space([("a", (3,))]))
    >>> identity.H == identity, identity.to_sparse().toarray().tolist()
    (True, [[1, 0, 0], [0, 1, 0], [0, 0, 1]])
    """

    space: Space

    def __post_init__(self) -> None:
        _require_space(self.space, "Identity: the space")

    def adjoint(self) -> LinearOperator:
        """I* = I."""
        return self

    def __str__(self) -> str:
        return "I"


@dataclass(frozen=True, eq=True, repr=False)
class Zero(LinearOperator):
    """The zero map O from ``domain`` to ``range``; its adjoint is O from range to domain.

    Parameters
    ----------
    domain, range : Space
        The spaces it maps between.

    Raises
    ------
    TypeError
        If either is not a :class:`~linop.Space`.

    Examples
    --------
    >>> from linop import Space, Zero
    >>> zero = Zero(Space([("a", (3,))]), Space([("b", (2,))]))
    >>> zero.shape, zero.H.shape, zero.to_sparse().nnz
    ((2, 3), (3, 2), 0)
    """

    domain: Space
    range: Space

    def __post_init__(self) -> None:
        _require_space(self.domain, "Zero: the domain")
        _require_space(self.range, "Zero: the range")

    def adjoint(self) -> LinearOperator:
        """O* = O (with domain and range swapped)."""
        return Zero(self.range, self.domain)

    def __str__(self) -> str:
        return "O"


@dataclass(frozen=True, eq=True, repr=False)
class Composition(LinearOperator):
    """Product of operators: ``Composition((A, B, C))(x) == A(B(C(x)))``.

    Adjoint: (A B C)* = C* B* A*. Nested compositions are flattened, so ``(A @ B) @ C`` and
    ``A @ (B @ C)`` are the same tree. ``A @ B`` builds one.

    Parameters
    ----------
    factors : tuple of LinearOperator
        The factors, leftmost (applied last) first.

    Raises
    ------
    SpaceMismatchError
        If a factor's domain differs from the range of the factor to its right; the message
        names the first differing block.

    Examples
    --------
    >>> from linop import Add, Block, Clear, Composition, Copy, Space
    >>> space = Space([Block("a", (2,)), Block("b", (2,))])
    >>> copy = Composition((Add(space["a"], space["b"]), Clear(space["b"])))
    >>> print(copy, "   adjoint:", copy.H)
    S[a -> b] @ K[b]    adjoint: K[b] @ S[b -> a]
    >>> copy == Add(space["a"], space["b"]) @ Clear(space["b"]) == Copy(space["a"], space["b"]).expand()
    True
    """

    factors: tuple[LinearOperator, ...]

    def __post_init__(self) -> None:
        # Only the junctions between the items are checked (a nested composition's own were
        # checked when it was built), and the message is worded only on a mismatch: building
        # ``A1 @ (A2 @ (... @ An))`` one factor at a time costs O(n) checks in all, not O(n^2).
        flat: list[LinearOperator] = []
        for item in _factors("Composition", self.factors):
            parts = item.factors if isinstance(item, Composition) else (item,)
            if flat:
                left, right = flat[-1], parts[0]
                if left.domain != right.range:
                    left.domain.require_equal(
                        right.range,
                        f"cannot compose {_short(left)!s} @ {_short(right)!s}: "
                        "the left domain (left) and the right range (right) differ",
                    )
            flat.extend(parts)
        if not flat:
            raise OperandError("a composition needs at least one factor")
        object.__setattr__(self, "factors", tuple(flat))

    @property
    def domain(self) -> Space:
        return self.factors[-1].domain

    @property
    def range(self) -> Space:
        return self.factors[0].range

    def children(self) -> tuple[LinearOperator, ...]:
        return self.factors

    def adjoint(self) -> LinearOperator:
        """(A B)* = B* A*."""
        return Composition(tuple(f.H for f in reversed(self.factors)))

    def __str__(self) -> str:
        return " @ ".join(f"({f})" if isinstance(f, Sum) else str(f) for f in self.factors)


@dataclass(frozen=True, eq=True, repr=False)
class Sum(OperandSpaces):
    """Sum of operators with the same domain and range: ``(A + B)(x) == A(x) + B(x)``.

    Adjoint: (A + B)* = A* + B*. ``A + B`` and ``A - B`` build one; nested sums are flattened.

    Parameters
    ----------
    terms : tuple of LinearOperator
        The terms, all with one domain and one range.

    Raises
    ------
    SpaceMismatchError
        If two terms' domains or ranges differ.

    Examples
    --------
    >>> from linop import Block, Clear, Identity, Space, Sum
    >>> space = Space([Block("a", (2,))])
    >>> total = Sum((Identity(space), Clear(space["a"])))
    >>> print(total, "|", total.H)
    I + K[a] | I + K[a]
    >>> total.to_sparse().toarray().tolist()
    [[1, 0], [0, 1]]
    """

    terms: tuple[LinearOperator, ...]

    def __post_init__(self) -> None:
        flat: list[LinearOperator] = []
        for t in _factors("Sum", self.terms):
            flat.extend(t.terms if isinstance(t, Sum) else (t,))
        if not flat:
            raise OperandError("a sum needs at least one term")
        first = flat[0]
        for other in flat[1:]:  # worded only on a mismatch (see Composition)
            if first.domain != other.domain:
                first.domain.require_equal(
                    other.domain, f"cannot add {_short(first)} and {_short(other)}: domains differ"
                )
            if first.range != other.range:
                first.range.require_equal(
                    other.range, f"cannot add {_short(first)} and {_short(other)}: ranges differ"
                )
        object.__setattr__(self, "terms", tuple(flat))

    def _spaces_from(self) -> LinearOperator:
        return self.terms[0]

    def children(self) -> tuple[LinearOperator, ...]:
        return self.terms

    def adjoint(self) -> LinearOperator:
        """(A + B)* = A* + B*."""
        return Sum(tuple(t.H for t in self.terms))

    def __str__(self) -> str:
        text = str(self.terms[0])
        for term in self.terms[1:]:
            negated = isinstance(term, Scaled) and term.alpha == -1
            text += f" - {str(term)[1:]}" if negated else f" + {term}"
        return text


@dataclass(frozen=True, eq=True, repr=False)
class Scaled(OperandSpaces):
    """A scalar multiple: ``Scaled(alpha, A)(x) == alpha * A(x)``; adjoint conj(alpha) A*.

    ``alpha * A`` and ``-A`` build one.

    Parameters
    ----------
    alpha : int, float, complex or numpy scalar
        The factor.
    operator : LinearOperator
        The operator scaled.

    Raises
    ------
    ScalarError
        If ``alpha`` is not a number (int, float, complex or a numpy scalar).

    Examples
    --------
    >>> from linop import Block, Copy, Space
    >>> space = Space([Block("a", (1,)), Block("b", (1,))])
    >>> scaled = 2j * Copy(space["a"], space["b"])
    >>> print(scaled, "|", scaled.H)
    2j * C[a -> b] | -2j * C*[a -> b]
    """

    alpha: Any
    operator: LinearOperator

    def __post_init__(self) -> None:
        alpha = self.alpha
        if isinstance(alpha, np.ndarray) and alpha.ndim == 0:
            alpha = alpha[()]
        if not _is_number(alpha):
            kind = "a Python or numpy int, float or complex"
            raise ScalarError(
                f"an operator can be multiplied only by {kind}, not {type(self.alpha).__name__} "
                f"{_short(repr(self.alpha), 40)}"
            )
        if isinstance(alpha, np.number) and alpha.dtype.kind not in "iufc":
            raise ScalarError(f"the scalar {alpha!r} has dtype {alpha.dtype}, which is not numeric")
        if not isinstance(alpha, (int, np.integer)) and not np.isfinite(alpha):
            # inf * 0 is NaN in numpy but 0 in the exact matrix (structural zeros): no agreement
            raise ScalarError(f"the scalar {alpha!r} is not finite; an operator is scaled by finite numbers")
        object.__setattr__(self, "alpha", alpha)
        if not isinstance(self.operator, LinearOperator):
            raise OperandError(f"Scaled needs an operator, not {type(self.operator).__name__}")

    def _spaces_from(self) -> LinearOperator:
        return self.operator

    def children(self) -> tuple[LinearOperator, ...]:
        return (self.operator,)

    def adjoint(self) -> LinearOperator:
        """(alpha A)* = conj(alpha) A*."""
        return Scaled(self.alpha.conjugate(), self.operator.H)

    def __str__(self) -> str:
        inner = f"({self.operator})" if isinstance(self.operator, (Sum, Composition)) else str(self.operator)
        if self.alpha == -1:
            return f"-{inner}"
        return f"{self.alpha} * {inner}"
