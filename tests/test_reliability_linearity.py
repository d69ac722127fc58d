"""Linearity that cannot be fooled by range or field (issue 41, item 3): one rule
(:func:`linop.linearity.linearity_problem`) behind every checker, tried on a table of maps
with the verdict each must get.

The maps are given as numpy functions of one block and its matrix ``K``; each checker sees
them in its own clothes: a :class:`~linop.local.LocalOperator`'s callables (through
``verify.exact_adjoint``), ``verify.prove_backward`` on numpy, and ``verify.lift`` on torch.
Before the fix, every non-linear row below but ``affine`` and ``floor`` was proven linear
(the probe states were real and of magnitude at most 27), and ``float32`` and ``float16``
rows computed in a narrow dtype but returned in float64 were called not linear."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import verify
from linop import Block, Space, local_operator
from linop.errors import NotLinearError
from linop.linearity import computed_precision, linearity_problem
from verify.lift import LiftError, lift, prove_backward

K = np.array([[0.5, -1.25, 2.0, 0.1], [3.0, 0.0, -0.75, 1.5], [-2.0, 1.0, 0.3, 0.0]])
X = Space([Block("x", (4,))])


def _float32(x):
    return (K.astype(np.float32) @ np.asarray(x).astype(np.float32)).astype(np.float64)


def _float16(x):
    return (K.astype(np.float16) @ np.asarray(x).astype(np.float16)).astype(np.float64)


def _zero_beyond(x):
    y = K @ x
    return np.where(np.abs(y) > 1e6, 0, y)


def _zero_below(x):
    y = K @ x
    return np.where(np.abs(y) < 1e-6, 0, y)


def _complex_refused(x):
    if np.iscomplexobj(x):
        raise TypeError("this kernel computes over the reals")
    return K @ x


def _float32_adjoint(y):
    return (K.T.astype(np.float32) @ np.asarray(y).astype(np.float32)).astype(np.float64)


def _float16_adjoint(y):
    return (K.T.astype(np.float16) @ np.asarray(y).astype(np.float16)).astype(np.float64)


def _adjoint(y):
    return K.T @ y


LINEAR, NOT_LINEAR = True, False
TABLE = [
    pytest.param(lambda x: K @ x, _adjoint, LINEAR, id="linear"),
    pytest.param(lambda x: (K @ x) * 2.0**-30, lambda y: _adjoint(y) * 2.0**-30, LINEAR, id="linear-tiny"),
    pytest.param(_float32, _float32_adjoint, LINEAR, id="float32-computed-returned-float64"),
    pytest.param(
        lambda x: K.astype(np.float32) @ np.asarray(x).astype(np.float32),
        lambda y: K.T.astype(np.float32) @ np.asarray(y).astype(np.float32),
        LINEAR,
        id="float32",
    ),
    pytest.param(_float16, _float16_adjoint, LINEAR, id="float16-computed"),
    pytest.param(_complex_refused, _adjoint, LINEAR, id="real-only-refuses-complex"),
    pytest.param(lambda x: K @ np.real(x), _adjoint, LINEAR, id="real-only-casts-complex"),
    pytest.param(lambda x: K @ x + 1, _adjoint, NOT_LINEAR, id="affine"),
    pytest.param(lambda x: np.floor(K @ x), _adjoint, NOT_LINEAR, id="floor"),
    pytest.param(lambda x: np.clip(K @ x / 10, -30, 30), _adjoint, NOT_LINEAR, id="saturating-clip-30"),
    pytest.param(lambda x: np.clip(K @ x, -1e9, 1e9), _adjoint, NOT_LINEAR, id="saturating-clip-1e9"),
    pytest.param(_zero_beyond, _adjoint, NOT_LINEAR, id="zero-beyond-1e6"),
    pytest.param(_zero_below, _adjoint, NOT_LINEAR, id="zero-below-1e-6"),
    pytest.param(lambda x: K @ np.conj(x), _adjoint, NOT_LINEAR, id="antilinear-conj"),
    pytest.param(lambda x: np.conj(K @ x) * 1j, _adjoint, NOT_LINEAR, id="antilinear-times-i"),
]


@pytest.mark.parametrize(("forward", "adjoint", "linear"), TABLE)
def test_a_local_operator_gets_the_verdict_of_the_table(forward, adjoint, linear):
    op = local_operator(X, "x", ("y", (3,)), forward=forward, adjoint=adjoint)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # float16 overflow at 2**20
        if linear:
            assert verify.exact_adjoint(op)
        else:
            with pytest.raises(NotLinearError, match="not linear"):
                verify.exact_adjoint(op)


@pytest.mark.parametrize(("forward", "adjoint", "linear"), TABLE)
def test_prove_backward_gets_the_verdict_of_the_table(forward, adjoint, linear):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        if linear:
            assert prove_backward(forward, {"x": (4,)}, {"y": (3,)}, adjoint=adjoint)
        else:
            with pytest.raises(LiftError, match="not linear"):
                prove_backward(forward, {"x": (4,)}, {"y": (3,)}, adjoint=adjoint)


@pytest.mark.parametrize(
    ("name", "linear"),
    [
        ("linear", LINEAR),
        ("float32", LINEAR),
        ("conj", NOT_LINEAR),
        ("clamp", NOT_LINEAR),
        ("zero-beyond", NOT_LINEAR),
    ],
)
def test_a_torch_function_and_its_autograd_backward_get_the_verdict(name, linear):
    torch = pytest.importorskip("torch")
    functions = {
        "linear": lambda x: torch.flip(x, (0,)) * 3,
        "float32": lambda x: (torch.flip(x, (0,)).to(torch.float32) * 3).to(torch.float64),
        "conj": lambda x: torch.conj(x) * 2,
        "clamp": lambda x: torch.clamp(x * 2, -30, 30),
        "zero-beyond": lambda x: torch.where(x.abs() > 1e6, 0 * x, x),
    }
    forward = functions[name]
    if linear:
        assert verify.exact_adjoint(lift(forward, {"x": (4,)}, {"y": (4,)}, framework="torch"))
    else:
        with pytest.raises(LiftError, match="not linear"):
            lift(forward, {"x": (4,)}, {"y": (4,)}, framework="torch")


def test_the_antilinear_message_says_conjugate():
    op = local_operator(X, "x", ("y", (3,)), forward=lambda x: K @ np.conj(x), adjoint=_adjoint)
    with pytest.raises(NotLinearError, match=r"complex state .* conjugate: the map is antilinear"):
        op.to_sparse()


def test_the_computed_precision_is_read_from_the_values():
    values = np.random.default_rng(1).uniform(-1, 1, 50)
    assert computed_precision(values)[0] == "float64"
    assert computed_precision(values.astype(np.float32).astype(np.float64))[0] == "float32"
    assert computed_precision(values.astype(np.float32))[0] == "float32"
    assert computed_precision(values.astype(np.float16).astype(np.float64))[0] in ("float16", "bfloat16")
    assert computed_precision(np.array([np.inf, np.nan, 0.5]))[0] == "bfloat16"  # only finite values count


def test_ranks_compare_only_their_rows_and_agree_on_complex_input():
    """The distributed checkers' hooks: ``rows`` limits the comparison, ``agree`` decides the
    complex verdict for every rank alike (here: another rank refused complex input)."""
    matrix = np.eye(4)

    def conj_on_row_3(states):
        out = np.array(states)
        out[:, 3] = np.conj(out[:, 3])
        return out

    assert linearity_problem(conj_on_row_3, matrix, 4, rows=[0, 1, 2]) is None
    assert linearity_problem(conj_on_row_3, matrix, 4, rows=[3]).index == 3
    assert linearity_problem(conj_on_row_3, matrix, 4, agree=lambda accepted: False) is None
