"""Reliability of the error surface (issue 22): bad input to the worker maps, the chooser, the
accounting, the plots, local operators and layers gives a typed LinopError naming the culprit.
Every case raised a bare Python or numpy error (or was silently accepted) before."""

from __future__ import annotations

import numpy as np
import pytest

from linop import Block, DistributedTensor, Partition, Space, local_operator
from linop.accounting import CostModel, account, account_schedule
from linop.algorithms.chooser import choose, modeled_times
from linop.errors import (
    AccountingError,
    AlgorithmError,
    LayerError,
    LinopError,
    LocalOperatorError,
    OperandError,
    WorkerMapError,
)
from linop.layers import Affine, Convolution
from linop.program import WorkerMap

MODEL = CostModel(1e-6, 1e-9)
X4 = Space([Block("x", (4,))])


@pytest.mark.parametrize(
    ("call", "error", "fragment"),
    [
        (lambda: WorkerMap.round_robin(16, 0), WorkerMapError, "ranks must be a positive integer, not 0"),
        (lambda: WorkerMap.blocked(16, 0), WorkerMapError, "ranks must be a positive integer, not 0"),
        (lambda: WorkerMap.blocked(-4, 2), WorkerMapError, "workers must be a non-negative integer, not -4"),
        (lambda: WorkerMap.round_robin(2.5, 2), WorkerMapError, "workers"),
        (lambda: WorkerMap.blocked(4, True), WorkerMapError, "ranks"),
        (lambda: WorkerMap.of(np.array([[0, 1]])), WorkerMapError, "1-D"),
        (lambda: WorkerMap.of(np.array([0.5, 1])), WorkerMapError, "worker 0 maps to 0.5"),
        (lambda: choose("allreduce", 4, -5, MODEL), AlgorithmError, "nbytes must be a non-negative integer"),
        (lambda: choose("allreduce", 4, 2.5, MODEL), AlgorithmError, "nbytes"),
        (lambda: choose("allreduce", 4, 64, MODEL, itemsize=0), AccountingError, "itemsize"),
        (lambda: modeled_times("allreduce", 4, 64, "fast"), AlgorithmError, "model must be a CostModel"),
        (lambda: CostModel(alpha="abc", beta=1e-9), AccountingError, "alpha must be a finite number"),
        (lambda: CostModel(alpha=1e-6, beta=None), AccountingError, "beta"),
        (lambda: CostModel(alpha=True, beta=1e-9), AccountingError, "alpha"),
        (lambda: account("x"), OperandError, "needs a LinearOperator, not str"),
        (lambda: account_schedule(None), OperandError, "NoneType"),
        (lambda: local_operator(X4, "x", ("y", (2.5,)), np.ones((2, 4))), LocalOperatorError, "output 'y'"),
        (lambda: local_operator(X4, "x", ("y", "ab"), np.ones((2, 4))), LocalOperatorError, "output 'y'"),
        (lambda: local_operator(X4, "x", 3.5, np.ones((2, 4))), LinopError, "not 3.5"),
        (lambda: local_operator(X4, "x", ("y", (2,)), "abc"), LocalOperatorError, "2-D"),
        (lambda: local_operator(X4, "x", ("y", (2,)), [["a"] * 4] * 2), LocalOperatorError, "numeric"),
        (
            lambda: local_operator(X4, "x", ("y", (2,)), forward="f", adjoint="g"),
            LocalOperatorError,
            "callable",
        ),
    ],
)
def test_bad_input_raises_a_typed_error(call, error, fragment):
    with pytest.raises(error, match=fragment) as caught:
        call()
    assert isinstance(caught.value, LinopError)


def test_a_numpy_array_of_ranks_is_a_worker_map():
    assert WorkerMap.of(np.array([0, 1, 0, 1])) == WorkerMap([0, 1, 0, 1])
    assert WorkerMap.of(np.arange(4, dtype=np.int32)).workers_on(3) == (3,)
    assert WorkerMap.blocked(0, 3).pairs == () and WorkerMap.round_robin(5, 2).workers_on(1) == (1, 3)


def test_the_chooser_still_chooses():  # control
    assert choose("allreduce", 4, 0, MODEL).variant
    assert choose("allreduce", 4, np.int64(1 << 20), MODEL).nbytes == 1 << 20


@pytest.mark.parametrize("weights", ["string", "object-strings"])
def test_layers_refuse_weights_that_are_not_numbers(weights):
    x = DistributedTensor("x", (1, 2, 6), Partition((1, 1, 2)))
    conv = Convolution(x, 2, 3)
    shape = conv.weights.global_shape
    bad = np.full(shape, "a") if weights == "string" else np.full(shape, "a", dtype="U1").astype("S1")
    with pytest.raises(LayerError, match="weights has dtype"):
        conv.input_operator(bad)
    with pytest.raises(LayerError, match="weights has dtype"):
        conv.scatter_parameters(bad, np.zeros(2))
    affine = Affine(DistributedTensor("x", (1, 4), Partition((1, 2))), 3)
    with pytest.raises(LayerError, match="weights has dtype"):
        affine.scatter_parameters(np.full(affine.weights.global_shape, "w"), np.zeros(3))
    with pytest.raises(LayerError, match="not an array"):
        conv.input_operator([[1, 2], [3]])
    assert conv.input_operator(np.ones(shape))  # control


def test_plot_and_display_argument_errors_are_typed():
    from linop import display

    with pytest.raises(OperandError, match="show_state: the state must be a dict"):
        display.show_state([1, 2])
    with pytest.raises(OperandError, match="at least one state"):
        display.show_state()
    pytest.importorskip("matplotlib")
    from linop import plot

    with pytest.raises(OperandError, match="not str") as caught:
        plot.decomposition("x")
    assert isinstance(caught.value, TypeError)  # as before, for callers catching TypeError


# -- display: LaTeX that KaTeX, MathJax 2 and MathJax 3 render alike ---------------------------------
def _text_runs(latex: str) -> list[str]:
    """The contents of every \\text{...} / \\texttt{...} run (no nesting in what we emit)."""
    import re

    return re.findall(r"\\text(?:tt)?\{([^{}]*)\}", latex)


def test_block_names_with_specials_leave_no_macro_inside_text_runs():
    """MathJax 2 (and 3 without textmacros) shows text-mode content verbatim: a \\_ there reads
    as a backslash and an underscore. Nothing that needs a macro may stay inside a text run."""
    from linop import Copy, display

    space = Space([Block("u_local", (2,)), Block("v#1", (2,), worker=1)])
    latex = Copy(space["u_local"], space["v#1"])._repr_latex_()
    assert r"\texttt{u}\mathtt{\_}\texttt{local}" in latex
    for run in _text_runs(latex):
        assert not set(run) & set("\\_{}#%&$^~"), run
    words = display.tex_words("no {matrix}: 50% of a_b & $x$ \\ ^~")
    for run in _text_runs(words):
        assert not set(run) & set("\\_{}#%&$^~"), run
    assert words.count(r"\{") == 1 and words.count(r"\}") == 1 and r"\backslash" in words


def test_the_latex_of_an_operator_without_a_matrix_escapes_the_exception_text():
    from linop import display

    def forward(x):
        raise ValueError("bad {kernel}_1 $5 & 10% \\end")

    op = local_operator(X4, "x", ("y", (2,)), forward=forward, adjoint=lambda y: np.zeros(4))
    latex = display.operator_latex(op)
    assert "no matrix" in latex and "ValueError" in latex
    assert latex.count("{") == latex.count("}") + 0  # balanced braces: the message is escaped
    for run in _text_runs(latex):
        assert not set(run) & set("\\_{}#%&$^~"), run
    assert r"\end" not in latex.replace(r"\end{array}", "")
    assert r"\mathtt{\$}" in latex and r"\{" in latex


def test_state_titles_are_escaped():
    from linop import display

    latex = display.show_state(my_state={"a_b": np.arange(2)})._repr_latex_()
    assert r"\text{my}\mathtt{\_}\text{state}" in latex
    for run in _text_runs(latex):
        assert not set(run) & set("\\_{}#%&$^~"), run


@pytest.mark.parametrize("dtype", [b",", ",", "i4,"])
def test_a_dtype_string_numpy_cannot_parse_is_a_typed_error(dtype):
    """Found by the long fuzz run: numpy parses such strings as structured dtypes and raises
    SyntaxError from inside."""
    from linop import Identity
    from linop.errors import DtypeError

    op = Identity(X4)
    with pytest.raises(DtypeError, match=r"not a numpy dtype|not numeric"):  # "i4," is a structured dtype
        op.to_sparse(dtype)
    with pytest.raises(DtypeError):
        op.apply({"x": np.arange(4.0)}, dtype=dtype)
