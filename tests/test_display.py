"""Rich displays (linop.display, verify.display): block structures, tables and states.

The block structure is a specification of the matrix: it is checked against the size-free
block forms of verify on random whole-block trees, and against hand-derived forms of the
primitives; the tables are checked cell by cell against the text the objects print.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pytest
import sympy
from hypothesis import given, settings

import verify
from linop import (
    Add,
    Block,
    Broadcast,
    Clear,
    Copy,
    DistributedTensor,
    Identity,
    Kernel,
    LinearOperator,
    Move,
    Partition,
    Space,
    display,
    halo_geometry,
)
from verify import strategies, symbolic

SPACE = Space([Block("a", (3,)), Block("b", (3,))])
W = DistributedTensor("w", (3, 4), Partition.grid((1, 1)))
BCAST = Broadcast(W, Partition.grid((2, 2)), "w_copy")

FORMS = [
    ("copy", Copy(SPACE["a"], SPACE["b"]), [["I", "O"], ["I", "O"]]),
    ("copy-adjoint", Copy(SPACE["a"], SPACE["b"]).H, [["I", "I"], ["O", "O"]]),
    ("add", Add(SPACE["a"], SPACE["b"]), [["I", "O"], ["I", "I"]]),
    ("move", Move(SPACE["a"], SPACE["b"]), [["O", "O"], ["I", "O"]]),
    ("clear-box", Clear(SPACE["b"][1:]), [["I", "O"], ["O", "*"]]),
    ("copy-part", Copy(SPACE["a"][0:2], SPACE["b"][1:3]), [["I", "O"], ["*", "*"]]),
    ("scaled", 2 * Identity(SPACE), [["2I", "O"], ["O", "2I"]]),
    ("negated", -Copy(SPACE["a"], SPACE["b"]), [["-1I", "O"], ["-1I", "O"]]),
    ("reduce-broadcast", BCAST.H @ BCAST, [["4I"]]),
]


@pytest.mark.parametrize("op, expected", [(op, e) for _, op, e in FORMS], ids=[i for i, _, _ in FORMS])
def test_block_structure_of_known_operators(op, expected):
    structure = display.block_structure(op)
    assert structure.text() == expected
    assert structure.range_names == op.range.names and structure.domain_names == op.domain.names


def test_scaled_identity_needs_equal_diagonal_entries():
    # diag(1, 0, 0) is square and diagonal but not a multiple of I: a general block
    cell = display.block_structure(Clear(SPACE["b"][1:]))["b", "b"]
    assert cell.kind == "general" and cell.nnz == 1
    assert cell.entries.tolist() == [[1, 0, 0], [0, 0, 0], [0, 0, 0]]


def test_permutation_block_is_general_not_identity():
    # swap a[0] and a[1] through b: full-rank square block, nonzero only off the diagonal
    swap = (
        Copy(SPACE["b"][0:1], SPACE["a"][1:2])
        @ Copy(SPACE["a"][1:2], SPACE["a"][0:1])
        @ Copy(SPACE["a"][0:1], SPACE["b"][0:1])
    )
    cell = display.block_structure(swap)["a", "a"]
    assert cell.kind == "general"


@settings(max_examples=40, deadline=None)
@given(strategies.operators(whole=True, complex=False))
def test_block_structure_agrees_with_size_free_block_form(op):
    form = symbolic.block_form(op)
    structure = display.block_structure(op)
    for r in op.range.blocks:
        for c in op.domain.blocks:
            if r.size == 0 or c.size == 0:
                continue
            coefficient = complex(form.coefficients.get((r.name, c.name), 0))
            cell = structure[r.name, c.name]
            if coefficient == 0:
                assert cell.kind == "zero", (r.name, c.name)
            elif coefficient == 1:
                assert cell.kind == "identity", (r.name, c.name)
            else:
                assert cell.kind == "scaled" and complex(cell.scalar) == coefficient, (r.name, c.name)


def test_latex_labels_rows_and_columns_with_block_names():
    space = Space([Block("x_0", (2,)), Block("y", (2,), worker=1)])
    latex = Copy(space["x_0"], space["y"])._repr_latex_()
    assert latex.startswith("$$") and latex.endswith("$$")
    assert latex.count(r"\texttt{x}\mathtt{\_}\texttt{0}") == 2 and latex.count(r"\texttt{y}") == 2
    assert latex.count(r"I_{2}") == 2 and latex.count(" O ") + latex.count("& O") >= 2
    assert r"\hline" in latex


def test_operator_html_draws_the_block_matrix_as_a_table():
    space = Space([Block("a", (3,)), Block("b", (3,))])
    page = (2 * Copy(space["a"], space["b"]))._repr_html_()
    matrix = page.split("<details")[0]
    assert "$" not in matrix and "<th><code>a</code></th><th><code>b</code></th>" in matrix
    cells = re.findall(r"<tr><td><code>(\w)</code></td><td>(.*?)</td><td>(.*?)</td></tr>", matrix)
    zero = '<span style="color:#999">O</span>'
    assert cells == [("a", "2&#8239;I<sub>3</sub>", zero), ("b", "2&#8239;I<sub>3</sub>", zero)]


@dataclass(frozen=True, eq=True, repr=False)
class Opaque(LinearOperator):
    """A node that no interpreter runs and that does not expand: it has no matrix."""

    space: Space

    @property
    def domain(self):
        return self.space

    @property
    def range(self):
        return self.space

    def adjoint(self):
        return self

    def __str__(self):
        return "Opaque"


def test_an_operator_without_a_matrix_displays_a_summary():
    op = Opaque(SPACE)
    assert "no matrix: UnsupportedNodeError" in op._repr_latex_()
    assert "no matrix: UnsupportedNodeError" in op._repr_html_()


def test_large_operators_fall_back_to_a_summary():
    space = Space([Block(f"b{i}", (1,)) for i in range(display.MAX_BLOCKS + 1)])
    latex = Identity(space)._repr_latex_()
    assert "summary" in latex and r"\begin{array}" not in latex
    big = Space([Block("a", (display.MAX_ENTRIES,)), Block("b", (1,))])
    assert "summary" in Clear(big["b"])._repr_latex_()


def test_operator_html_lists_every_node_with_its_adjoint_rule():
    tree = Copy(SPACE["a"], SPACE["b"]) @ Clear(SPACE["a"]) + Add(SPACE["b"], SPACE["a"])
    page = tree._repr_html_()
    nodes = list(_nodes(tree))
    tree_table = page.split("<details")[1]
    assert tree_table.count("<tr>") - 1 == len(nodes)  # one header row
    assert "(A + B)* = A* + B*." in page and "(A B)* = B* A*." in page
    assert "C_{a-&gt;b}* = K_b S_{b-&gt;a}" in page and "K_b* = K_b." in page
    assert display.adjoint_rule(Clear(SPACE["a"])) == "K_b* = K_b."


def _nodes(op):
    yield op
    for child in op.children():
        yield from _nodes(child)


def test_tree_html_is_truncated_for_large_trees():
    tree = Clear(SPACE["a"])
    for _ in range(10):
        tree = tree @ Clear(SPACE["a"]) + Clear(SPACE["b"])
    page = display.tree_html(tree, limit=5)
    assert page.count("<tr>") == 1 + 5 + 1 and "more</td>" in page


def test_space_html_has_one_row_per_block():
    space = Space([Block("x", (2, 3), worker=1), Block("s", ())])
    page = space._repr_html_()
    rows = re.findall(r"<tr><td>(.*?)</td><td>(.*?)</td><td>(.*?)</td><td>(.*?)</td></tr>", page)
    assert rows == [("s", "scalar", "1", "0"), ("x", "2x3", "6", "1")]


@pytest.mark.parametrize(
    "tensor, kernel",
    [
        (DistributedTensor("u", (10, 10), Partition.grid((2, 2))), Kernel(3, padding=1)),
        (DistributedTensor("v", (9,), Partition.grid((3,)), sizes=((1, 2, 6),)), Kernel(5, padding=2)),
    ],
    ids=["2x2-balanced", "1d-unbalanced"],
)
def test_geometry_html_matches_the_printed_table(tensor, kernel):
    geometry = halo_geometry(tensor, kernel)
    page = geometry._repr_html_()
    html_rows = [re.findall(r"<td>(.*?)</td>", row) for row in re.findall(r"<tr>(<td>.*?)</tr>", page)]
    text_rows = [line.split() for line in geometry.table().splitlines()[2:]]
    assert len(html_rows) == len(text_rows) == tensor.partition.size * tensor.ndim
    for cells, words in zip(html_rows, text_rows):
        assert [cells[0], *cells[2:]] == words


def test_show_state_renders_symbols_and_titles():
    copy = Copy(SPACE["a"], SPACE["b"])
    view = display.show_state(forward=symbolic.apply(copy), adjoint=symbolic.apply(copy.H))
    latex = view._repr_latex_()
    assert r"\text{forward}" in latex and r"\text{adjoint}" in latex
    assert "a_{0} + b_{0}" in latex and "Matrix" not in latex
    assert not hasattr(view, "_repr_html_")  # LaTeX only: HTML front ends would not typeset it
    assert "a: [a_0 + b_0, a_1 + b_1, a_2 + b_2]" in repr(view)
    numbers = display.show_state({"m": np.arange(4).reshape(2, 2)})._repr_latex_()
    assert r"0 & 1 \\ 2 & 3" in numbers


def test_show_state_abbreviates_large_blocks():
    latex = display.show_state({"big": np.arange(100).reshape(10, 10)})._repr_latex_()
    assert r"[0, 1, 2" in latex and r"15, \dots]" in latex and "16" not in latex.split("dots")[0]
    assert r"\text{shape } 10\times 10" in latex


def test_show_state_rejects_what_is_not_a_state():
    with pytest.raises(TypeError, match="dict of arrays"):
        display.show_state([1, 2])
    with pytest.raises(TypeError, match="at least one"):
        display.show_state()


def test_tex_text_escapes_specials():
    assert display.tex_text("x_window[0]") == r"\texttt{x}\mathtt{\_}\texttt{window[0]}"
    assert display.tex_text("a&b%") == r"\texttt{a}\mathtt{\&}\texttt{b}\mathtt{\%}"


@dataclass(frozen=True, eq=True, repr=False)
class CopyForgetsClear(Copy):
    def adjoint(self):
        return Add(self.dst, self.src)  # wrong: should be K_b S_{b->a}


def test_failed_proof_shows_its_wrong_entries():
    proof = verify.exact_adjoint(CopyForgetsClear(SPACE["a"], SPACE["b"]))
    page = proof._repr_html_()
    assert "FAILED" in page and "proven" not in page
    assert "<td>b[0]</td><td>b[0]</td><td>1</td><td>0</td>" in page
    good = verify.exact_adjoint(Copy(SPACE["a"], SPACE["b"]))._repr_html_()
    assert "proven" in good and "wrong entries" in good and "<td>row</td>" not in good


def test_numeric_and_symbolic_results_display():
    numeric = verify.adjoint_test(Copy(SPACE["a"], SPACE["b"]))._repr_html_()
    assert "passed" in numeric and "threshold" in numeric and "float64" in numeric
    dot = symbolic.dot_test(CopyForgetsClear(SPACE["a"], SPACE["b"]))._repr_html_()
    assert "FAILED" in dot and "row b[0], column b[0]" in dot
    assert "proven" in symbolic.prove_adjoint(Copy(SPACE["a"], SPACE["b"]))._repr_html_()


def test_report_html_has_one_row_per_check():
    from verify import identities, report

    entries = identities.select("copy-*")[:2]
    result = report.run(entries, levels=("exact", "float64"))
    page = result._repr_html_()
    body = page.split("<tbody>")[1].split("</tbody>")[0]
    assert body.count("<tr>") == len(result.results) > 0
    assert f"{len(result.results)} checks" in page


def test_symbols_render_through_sympy():
    x = sympy.Symbol("a_1", real=True)
    assert display.show_state({"a": np.array([x], dtype=object)})._repr_latex_().count("a_{1}") == 1
