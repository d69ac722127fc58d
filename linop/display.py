r"""Rich displays for Jupyter: operators, trees, spaces, states and halo geometries.

Jupyter shows an object through its ``_repr_latex_`` / ``_repr_html_`` hooks; the classes of
linop define those hooks as one-line methods that call the functions of this module, so that
the rendering lives in one place and the plain ``str`` / ``repr`` stay what a terminal shows.
The HTML needs no math typesetting (front ends that show HTML do not all typeset LaTeX inside
it): an operator's HTML draws its block matrix as a table, and its ``text/latex`` carries the
same matrix for LaTeX-aware front ends and exporters. States show as LaTeX only.

Block structure
---------------
:func:`block_structure` cuts an operator's exact matrix (``op.to_sparse()``) along the blocks of
its range (rows) and domain (columns) and classifies each (range block, domain block) pair as

==========  ================================================================================
kind        meaning
==========  ================================================================================
zero        no nonzero entry: :math:`O`
identity    square, and exactly the identity: :math:`I_n`
scaled      square, and exactly :math:`c\,I_n` for a scalar :math:`c \ne 0, 1`
general     anything else (a part of a block moved, a permutation, a sum of pieces)
==========  ================================================================================

so an in-place copy :math:`C_{a\to b}` shows as :math:`\begin{bmatrix} I & O \\ I & O
\end{bmatrix}` with ``a`` and ``b`` as its row and column labels. The classification is exact
(the matrix of pure data movement is an integer matrix); it needs no symbolic block sizes, so
it also covers trees that cut blocks into pieces (see ``docs/theory.md#memory-and-blocks``).
Operators with too many blocks or entries fall back to a one-line summary.
"""

from __future__ import annotations

import functools
import html
import inspect
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import OperandError

if TYPE_CHECKING:
    from .halo_geometry import HaloGeometry
    from .operator import LinearOperator
    from .space import Space

__all__ = [
    "MAX_BLOCKS",
    "MAX_ENTRIES",
    "MAX_NODES",
    "MAX_STATE_ENTRIES",
    "MAX_ROWS",
    "BlockCell",
    "BlockStructure",
    "StateView",
    "adjoint_rule",
    "block_structure",
    "geometry_html",
    "operator_html",
    "operator_latex",
    "show_state",
    "space_html",
    "table_html",
    "tex_text",
    "tex_words",
    "tree_html",
]

MAX_BLOCKS = 12
"""Most blocks in the range or the domain for which the block matrix is shown."""

MAX_ENTRIES = 40_000
"""Most entries (domain size + range size) for which the matrix is materialized for display."""

MAX_NODES = 60
"""Most nodes the tree view lists."""

MAX_ROWS = 64
"""Most rows of a space or geometry table."""

MAX_EXPLICIT = 6

MAX_STATE_ENTRIES = 64
"""A state's block with more entries shows its first ``MAX_STATE_ENTRIES // 4`` and its shape."""
"""A general block with at most this many rows and columns is shown entry by entry."""


# -- text helpers --------------------------------------------------------------------------------
# Characters that TeX text mode does not take literally. KaTeX reads macros such as ``\_``
# inside ``\text{}``/``\texttt{}``, but MathJax 2 (and MathJax 3 without its textmacros
# extension) shows text-mode content verbatim, so ``\texttt{u\_local}`` reads "u\_local"
# there. Every renderer agrees on math mode: these characters are written as math macros
# between text runs (``\texttt{u}\mathtt{\_}\texttt{local}``).
_TEX_MATH = {
    "\\": r"\backslash",
    "_": r"\mathtt{\_}",
    "{": r"\{",
    "}": r"\}",
    "#": r"\mathtt{\#}",
    "%": r"\mathtt{\%}",
    "&": r"\mathtt{\&}",
    "$": r"\mathtt{\$}",
    "^": r"\hat{}",
    "~": r"\tilde{}",
}


def _tex_runs(text: str, font: str) -> str:
    r"""``text`` as LaTeX that KaTeX, MathJax 2 and MathJax 3 render alike (inside math): runs
    of ordinary characters in ``font`` (``\texttt`` or ``\text``), each special character as
    a math macro between them."""
    parts: list[str] = []
    run: list[str] = []
    for ch in str(text):
        special = _TEX_MATH.get(ch)
        if special is None:
            run.append(ch)
            continue
        if run:
            parts.append(f"{font}{{{''.join(run)}}}")
            run = []
        parts.append(special)
    if run or not parts:
        parts.append(f"{font}{{{''.join(run)}}}")
    return "".join(parts)


def tex_text(text: str) -> str:
    r"""``text`` as typewriter LaTeX that renders the same in KaTeX, MathJax 2 and MathJax 3:
    ``tex_text("x_window[0]") == r"\texttt{x}\mathtt{\_}\texttt{window[0]}"`` (special
    characters as math macros between text runs, which every renderer reads alike)."""
    return _tex_runs(text, r"\texttt")


def tex_words(text: str) -> str:
    r"""``text`` (any message, an exception's included) as upright LaTeX text, escaped as
    :func:`tex_text` escapes: ``tex_words("no {matrix}") == r"\text{no }\{\text{matrix}\}"``."""
    return _tex_runs(text, r"\text")


def _esc(value: object) -> str:
    return html.escape(str(value))


def _short(text: str, limit: int = 90) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def table_html(
    header: Sequence[str],
    rows: Iterable[Sequence[object]],
    *,
    caption: str = "",
    raw: Sequence[int] = (),
    more: int = 0,
    header_raw: bool = False,
) -> str:
    """An HTML table; cells are escaped except the columns listed in ``raw`` (already HTML), and
    the header unless ``header_raw``.

    ``more`` adds a last line saying how many rows were left out.
    """
    parts = ['<table class="linop">']
    if caption:
        parts.append(f'<caption style="text-align:left">{caption}</caption>')
    heads = "".join(f"<th>{h if header_raw else _esc(h)}</th>" for h in header)
    parts.append("<thead><tr>" + heads + "</tr></thead><tbody>")
    for row in rows:
        cells = (str(c) if i in raw else _esc(c) for i, c in enumerate(row))
        parts.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    if more:
        parts.append(f'<tr><td colspan="{len(header)}">... and {more} more</td></tr>')
    parts.append("</tbody></table>")
    return "".join(parts)


# -- block structure -----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class BlockCell:
    """One (range block, domain block) piece of an operator's matrix.

    Attributes
    ----------
    kind : str
        ``"zero"``, ``"identity"``, ``"scaled"`` (``scalar`` times the identity) or ``"general"``.
    shape : tuple of int
        (range block size, domain block size).
    nnz : int
        Number of nonzero entries.
    scalar : number or None
        The c of :math:`c\\,I` for ``"identity"`` (1) and ``"scaled"``; None otherwise.
    entries : numpy.ndarray or None
        The dense piece for a small general block (at most :data:`MAX_EXPLICIT` per side).
    """

    kind: str
    shape: tuple[int, int]
    nnz: int
    scalar: Any = None
    entries: np.ndarray | None = None

    def _render(
        self,
        zero: str,
        identity: Callable[[int], str],
        scaled: Callable[[str, int], str],
        entries: Callable[[np.ndarray], str] | None,
        general: Callable[[int, int], str],
    ) -> str:
        """The piece in one notation, by kind: ``zero``; ``identity(rows)``; ``scaled(c, rows)``
        with c as :func:`_number_tex` writes it; ``entries(matrix)`` for a small general block
        (when the notation shows entries); ``general(rows, cols)`` otherwise."""
        rows, cols = self.shape
        if self.kind == "zero":
            return zero
        if self.kind == "identity":
            return identity(rows)
        if self.kind == "scaled":
            return scaled(_number_tex(self.scalar), rows)
        if entries is not None and self.entries is not None:
            return entries(self.entries)
        return general(rows, cols)

    def latex(self) -> str:
        """The piece in LaTeX: ``O``, ``I_{3}``, ``2\\,I_{3}``, the entries, or ``\\ast``."""
        return self._render(
            "O",
            lambda rows: f"I_{{{rows}}}",
            lambda text, rows: f"-I_{{{rows}}}" if text == "-1" else f"{text}\\,I_{{{rows}}}",
            _latex_entries,
            lambda rows, cols: rf"\ast_{{{rows}\times {cols}}}",
        )

    def html(self) -> str:
        """The piece in HTML (no math typesetting needed): O, I with its size, c I, the entries
        of a small general block as a small table, or * with its shape."""
        return self._render(
            '<span style="color:#999">O</span>',
            lambda rows: f"I<sub>{rows}</sub>",
            lambda text, rows: f"{_esc(text)}&#8239;I<sub>{rows}</sub>",
            _html_entries,
            lambda rows, cols: f"&#8727;<sub>{rows}&#215;{cols}</sub>",
        )

    def text(self) -> str:
        """The piece as plain text: ``O``, ``I``, ``2I`` or ``*``."""
        return self._render(
            "O", lambda rows: "I", lambda text, rows: f"{text}I", None, lambda rows, cols: "*"
        )


def _latex_entries(entries: np.ndarray) -> str:
    body = r" \\ ".join(" & ".join(_number_tex(v) for v in row) for row in entries)
    return r"\left[\begin{smallmatrix}" + body + r"\end{smallmatrix}\right]"


def _html_entries(entries: np.ndarray) -> str:
    body = "".join(
        "<tr>" + "".join(f'<td style="padding:0 3px">{_esc(_number_tex(v))}</td>' for v in row) + "</tr>"
        for row in entries
    )
    return f'<table style="font-size:75%;border:1px solid #bbb">{body}</table>'


def _number_tex(value: Any) -> str:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):
        value = float(value)
        return str(int(value)) if value.is_integer() else f"{value:.4g}"
    if isinstance(value, numbers.Complex):
        value = complex(value)
        return f"({value.real:.4g}{value.imag:+.4g}i)"
    return str(value)


@dataclass(frozen=True)
class BlockStructure:
    """An operator's matrix cut along its blocks: ``cells[row name, column name]``.

    Rows follow the range's blocks and columns the domain's, in canonical order.
    """

    range_names: tuple[str, ...]
    domain_names: tuple[str, ...]
    cells: Mapping[tuple[str, str], BlockCell] = field(default_factory=dict)

    def __getitem__(self, key: tuple[str, str]) -> BlockCell:
        return self.cells[key]

    def kinds(self) -> list[list[str]]:
        """The kind of every cell, row by row."""
        return [[self.cells[r, c].kind for c in self.domain_names] for r in self.range_names]

    def text(self) -> list[list[str]]:
        """Every cell as plain text (``O``, ``I``, ``2I``, ``*``), row by row."""
        return [[self.cells[r, c].text() for c in self.domain_names] for r in self.range_names]

    def html(self) -> str:
        """The block matrix as an HTML table with the block names as row and column labels."""
        header = ["", *(f"<code>{_esc(c)}</code>" for c in self.domain_names)]
        rows = [
            (f"<code>{_esc(r)}</code>", *(self.cells[r, c].html() for c in self.domain_names))
            for r in self.range_names
        ]
        return table_html(
            header,
            rows,
            caption="block matrix (rows: range blocks, columns: domain blocks)",
            raw=tuple(range(len(header))),
            header_raw=True,
        )

    def latex(self) -> str:
        """The block matrix as a LaTeX array with the block names as row and column labels."""
        columns = "c" * len(self.domain_names)
        head = " & ".join(tex_text(c) for c in self.domain_names)
        lines = [rf"\begin{{array}}{{r|{columns}}}", rf" & {head} \\ \hline"]
        for r in self.range_names:
            cells = " & ".join(self.cells[r, c].latex() for c in self.domain_names)
            lines.append(rf"{tex_text(r)} & {cells} \\")
        lines.append(r"\end{array}")
        return "\n".join(lines)


def block_structure(op: LinearOperator, matrix: Any = None) -> BlockStructure:
    """Classify every (range block, domain block) piece of ``op``'s matrix (see the module doc).

    Parameters
    ----------
    op : LinearOperator
    matrix : scipy.sparse matrix, optional
        ``op.to_sparse()`` if already computed.

    Examples
    --------
    >>> from linop import Block, Copy, Space
    >>> space = Space([Block("a", (3,)), Block("b", (3,))])
    >>> block_structure(Copy(space["a"], space["b"])).text()
    [['I', 'O'], ['I', 'O']]
    >>> block_structure(Copy(space["a"], space["b"]).H).text()
    [['I', 'I'], ['O', 'O']]
    >>> block_structure(2 * Copy(space["a"][1:], space["b"][:2])).text()
    [['2I', 'O'], ['*', '*']]
    """
    if matrix is None:
        matrix = op.to_sparse()
    coo = matrix.tocoo()
    keep = coo.data != 0
    rows, cols, data = coo.row[keep], coo.col[keep], coo.data[keep]
    range_blocks, domain_blocks = op.range.blocks, op.domain.blocks
    row_starts = np.cumsum([0] + [b.size for b in range_blocks])
    col_starts = np.cumsum([0] + [b.size for b in domain_blocks])
    row_block = np.searchsorted(row_starts, rows, side="right") - 1
    col_block = np.searchsorted(col_starts, cols, side="right") - 1
    order = np.lexsort((col_block, row_block))
    rows, cols, data, row_block, col_block = (a[order] for a in (rows, cols, data, row_block, col_block))
    pair = row_block * max(len(domain_blocks), 1) + col_block
    cuts = np.flatnonzero(np.diff(pair)) + 1
    groups: dict[tuple[int, int], np.ndarray] = {}
    for run in np.split(np.arange(len(pair)), cuts):
        if len(run):
            groups[int(row_block[run[0]]), int(col_block[run[0]])] = run
    cells: dict[tuple[str, str], BlockCell] = {}
    for i, rb in enumerate(range_blocks):
        for j, db in enumerate(domain_blocks):
            shape = (rb.size, db.size)
            chunk = groups.get((i, j))
            if chunk is None:
                cells[rb.name, db.name] = BlockCell("zero", shape, 0)
                continue
            local_rows, local_cols = rows[chunk] - row_starts[i], cols[chunk] - col_starts[j]
            values = data[chunk]
            square = rb.size == db.size
            diagonal = square and len(chunk) == rb.size and bool(np.all(local_rows == local_cols))
            if diagonal and bool(np.all(values == values[0])):
                scalar = values[0].item()
                kind = "identity" if scalar == 1 else "scaled"
                cells[rb.name, db.name] = BlockCell(kind, shape, len(chunk), scalar)
                continue
            entries = None
            if rb.size <= MAX_EXPLICIT and db.size <= MAX_EXPLICIT:
                entries = np.zeros(shape, dtype=values.dtype)
                np.add.at(entries, (local_rows, local_cols), values)
            cells[rb.name, db.name] = BlockCell("general", shape, len(chunk), None, entries)
    return BlockStructure(op.range.names, op.domain.names, cells)


@functools.lru_cache(maxsize=32)
def _cached_structure(op: LinearOperator) -> BlockStructure:
    """One materialization per operator for its LaTeX and HTML displays (operators are
    immutable and hash structurally)."""
    return block_structure(op)


def _too_large(op: LinearOperator) -> str | None:
    """Why the block matrix of ``op`` is not shown, or None when it is."""
    blocks = max(len(op.range), len(op.domain))
    if blocks > MAX_BLOCKS:
        return f"{blocks} blocks (the block matrix is shown up to {MAX_BLOCKS})"
    entries = op.range.size + op.domain.size
    if entries > MAX_ENTRIES:
        return f"{entries} entries (the block matrix is shown up to {MAX_ENTRIES})"
    if not len(op.range) or not len(op.domain):
        return "an empty domain or range"
    return None


def _summary_latex(op: LinearOperator, reason: str) -> str:
    m, n = op.shape
    return (
        rf"{tex_text(_short(str(op), 80))}\colon \mathbb{{F}}^{{{n}}} \to \mathbb{{F}}^{{{m}}}"
        r"\quad "
        + tex_words(f"({len(op.domain)} domain blocks, {len(op.range)} range blocks; summary: {reason})")
    )


def operator_latex(op: LinearOperator) -> str:
    """``$$op = [block matrix]$$``, or a summary for operators with too many blocks or entries."""
    reason = _too_large(op)
    if reason is None:
        try:
            structure = _cached_structure(op)
        except Exception as exc:  # a display never raises: say why there is no matrix
            reason = f"no matrix: {type(exc).__name__}: {exc}"
        else:
            return f"$${tex_text(_short(str(op), 80))} = {structure.latex()}$$"
    return f"$${_summary_latex(op, reason)}$$"


# -- trees ---------------------------------------------------------------------------------------
def adjoint_rule(node: LinearOperator) -> str:
    """The adjoint rule a node states: the first line of its ``adjoint`` docstring."""
    doc = inspect.getdoc(type(node).adjoint) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def _tree_rows(op: LinearOperator, limit: int) -> tuple[list[tuple[int, LinearOperator]], int]:
    rows: list[tuple[int, LinearOperator]] = []
    total = 0
    stack = [(0, op)]
    while stack:
        depth, node = stack.pop()
        total += 1
        if len(rows) < limit:
            rows.append((depth, node))
        stack.extend((depth + 1, child) for child in reversed(node.children()))
    return rows, total - len(rows)


def tree_html(op: LinearOperator, *, limit: int = MAX_NODES) -> str:
    """The tree as an HTML table: each node (indented by depth), its shape, its adjoint and the
    rule that derives it."""
    rows, more = _tree_rows(op, limit)
    table = []
    for depth, node in rows:
        indent = "&nbsp;" * (4 * depth)
        try:
            adjoint = _short(str(node.H), 60)
        except Exception as exc:  # pragma: no cover - a display never raises
            adjoint = f"({type(exc).__name__})"
        table.append(
            (
                indent + f"<code>{_esc(_short(str(node), 70))}</code>",
                type(node).__name__,
                f"{node.shape[0]} x {node.shape[1]}",
                f"<code>{_esc(adjoint)}</code>",
                adjoint_rule(node),
            )
        )
    return table_html(("node", "type", "shape", "adjoint", "rule"), table, raw=(0, 3), more=more)


def _blocks(space: Space) -> str:
    count = len(space)
    workers = ", ".join(map(str, space.workers))
    return f"{count} block{'s' if count != 1 else ''} on worker{'s' if len(space.workers) != 1 else ''} {workers}"


def operator_html(op: LinearOperator) -> str:
    """The operator's header (text, shape, spaces), block matrix and tree."""
    m, n = op.shape
    header = (
        f"<p><code>{_esc(_short(str(op), 200))}</code> &nbsp; {type(op).__name__}, {m} x {n}: "
        f"domain {_blocks(op.domain)}, range {_blocks(op.range)}</p>"
    )
    reason = _too_large(op)
    matrix = ""
    if reason is None:
        try:
            matrix = _cached_structure(op).html()
        except Exception as exc:  # a display never raises: say why there is no matrix
            reason = f"no matrix: {type(exc).__name__}: {exc}"
    if reason is not None:
        matrix = f"<p>block matrix not shown: {_esc(reason)}</p>"
    return (
        '<div class="linop-operator">'
        + header
        + matrix
        + "<details open><summary>tree, with each node's adjoint rule</summary>"
        + tree_html(op)
        + "</details></div>"
    )


# -- spaces and geometries -----------------------------------------------------------------------
def space_html(space: Space, *, limit: int = MAX_ROWS) -> str:
    """The blocks of a space: name, shape, size and worker."""
    rows = [(b.name, "x".join(map(str, b.shape)) or "scalar", b.size, b.worker) for b in space.blocks]
    caption = f"space of {len(space)} blocks, {space.size} entries, workers {list(space.workers)}"
    return table_html(
        ("block", "shape", "size", "worker"), rows[:limit], caption=caption, more=max(0, len(rows) - limit)
    )


def geometry_html(geometry: HaloGeometry, *, limit: int = MAX_ROWS) -> str:
    """The halo geometry's table (as ``print(geometry)``): one row per worker and dimension."""
    partition = geometry.tensor.partition
    rows = []
    for index in partition.indices():
        worker = partition.worker(index)
        for r in geometry.worker_rows(index):
            rows.append(
                (
                    worker,
                    ",".join(map(str, index)),
                    r.dim,
                    *r.cells(),
                )
            )
    caption = (
        f"halo geometry of <code>{_esc(geometry.kernel)}</code> over <code>{_esc(geometry.tensor)}</code>"
    )
    header = ("worker", "grid", "dim", "output", "bulk", "need", "halo", "pad", "trim", "local", "window")
    return table_html(header, rows[:limit], caption=caption, more=max(0, len(rows) - limit))


# -- states --------------------------------------------------------------------------------------
def _array_latex(array: np.ndarray) -> str:
    """A block's values in LaTeX: a row for 1-d, a matrix for 2-d, the raveled row otherwise."""
    import sympy

    array = np.asarray(array)
    if array.ndim == 0:
        return sympy.latex(sympy.sympify(array[()]))
    times = r"\times "
    shape = rf"\ (\text{{shape }} {times.join(map(str, array.shape))})"
    if array.size > MAX_STATE_ENTRIES:  # the first entries in C order, then the shape
        first = ", ".join(sympy.latex(sympy.sympify(v)) for v in array.ravel()[: MAX_STATE_ENTRIES // 4])
        return rf"[{first}, \dots]{shape}"
    matrix = array.reshape(1, -1) if array.ndim != 2 else array
    if matrix.size == 0:
        return r"[\,]"
    body = r" \\ ".join(" & ".join(sympy.latex(sympy.sympify(v)) for v in row) for row in matrix)
    return r"\left[\begin{matrix}" + body + r"\end{matrix}\right]" + ("" if array.ndim <= 2 else shape)


@dataclass(frozen=True)
class StateView:
    """A display of one or more states (dicts of arrays), block by block.

    Made by :func:`show_state`; shows as LaTeX in Jupyter (no HTML: a front end that prefers
    HTML would not typeset the symbols), as text elsewhere.
    """

    states: tuple[tuple[str, Mapping[str, Any]], ...]

    def names(self) -> list[str]:
        """Every block name, in first-seen order."""
        seen: dict[str, None] = {}
        for _, state in self.states:
            seen.update(dict.fromkeys(state))
        return list(seen)

    def _cell(self, state: Mapping[str, Any], name: str) -> str:
        return _array_latex(state[name]) if name in state else r"\text{--}"

    def _repr_latex_(self) -> str:
        titled = any(title for title, _ in self.states)
        columns = "l" * len(self.states)
        lines = [rf"\begin{{array}}{{r{columns}}}"]
        if titled:
            lines.append(" & " + " & ".join(tex_words(t) for t, _ in self.states) + r" \\")
        for name in self.names():
            cells = " & ".join(self._cell(state, name) for _, state in self.states)
            lines.append(f"{tex_text(name)} & {cells}" + r" \\")
        lines.append(r"\end{array}")
        return "$$" + "\n".join(lines) + "$$"

    def __repr__(self) -> str:
        lines = []
        for title, state in self.states:
            if title:
                lines.append(f"{title}:")
            for name, value in state.items():
                lines.append(f"  {name}: {np.asarray(value).tolist()}")
        return "\n".join(lines)


def show_state(state: Mapping[str, Any] | None = None, /, **named: Mapping[str, Any]) -> StateView:
    r"""Display states block by block, symbols rendered by sympy (numbers as they are).

    ``show_state(x)`` shows one state; ``show_state(forward=y, adjoint=z)`` shows several side by
    side under those titles.

    Raises
    ------
    OperandError
        (a ``TypeError``) If no state is given, or a state is not a dict of arrays.

    Examples
    --------
    >>> import numpy as np
    >>> view = show_state(forward={"a": np.arange(2)}, adjoint={"a": np.zeros(2, int)})
    >>> view
    forward:
      a: [0, 1]
    adjoint:
      a: [0, 0]
    >>> print(view._repr_latex_())
    $$\begin{array}{rll}
     & \text{forward} & \text{adjoint} \\
    \texttt{a} & \left[\begin{matrix}0 & 1\end{matrix}\right] & \left[\begin{matrix}0 & 0\end{matrix}\right] \\
    \end{array}$$
    """
    states: list[tuple[str, Mapping[str, Any]]] = []
    if state is not None:
        states.append(("", state))
    states.extend(named.items())
    if not states:
        raise OperandError("show_state needs at least one state")  # a LinopError and a TypeError
    for title, s in states:
        if not isinstance(s, Mapping):
            raise OperandError(
                f"show_state: {title or 'the state'} must be a dict of arrays, not {type(s).__name__}"
            )
    return StateView(tuple(states))
