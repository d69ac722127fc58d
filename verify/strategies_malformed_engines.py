"""The fuzz campaign on the engines' surface (issue 41): DTensor layouts, black-box linearity
and the command line, in this process; the strategies of the torch.distributed executor on 2
gloo processes and of the JAX lowering are in :mod:`verify.strategies_malformed_launched`
(their launches are in ``tests/fuzz_engines/``).

Each strategy draws one :class:`~verify.strategies_malformed.Call`; :func:`classify` runs it
and returns its verdict class with the evidence:

- ``"ok"``: it succeeded, and its result is the numpy interpreter's (exactly, for integers);
- ``"typed"``: it raised a :class:`~linop.LinopError` whose message is not empty;
- ``"refuted"``: a check returned a failed verdict (a map that is not linear, a wrong adjoint).

Anything else raises :class:`~verify.strategies_malformed.FuzzFailure`: a wrong answer, a raw
(non-LinopError) exception, a typed error with an empty message, a map known not to be linear
accepted (silent acceptance), a linear map refuted, a caller's array changed.
"""

from __future__ import annotations

import contextlib
import io
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

import linop
from linop import Block, LinopError, Space

from .strategies_malformed import Call, FuzzFailure, check_against_matrix, junk, maybe, show_arguments

__all__ = ["ENGINE_ENTRY_POINTS", "MAPS", "Outcome", "UsageStatusError", "campaign", "classify", "linear_map"]


def classify(call: Call) -> tuple[str, str]:
    """Run ``call``: its verdict class (``"ok"``, ``"typed"``, ``"refuted"``) and the evidence
    (the error's class and message, or the failed verdict's detail).

    Raises
    ------
    FuzzFailure
        A wrong, silent or bare outcome (see the module docstring).
    """
    try:
        result = call.function()
    except LinopError as error:
        message = str(error).strip()
        if not message:
            raise FuzzFailure(f"{call!r}: {type(error).__name__} with an empty message") from error
        return "typed", f"{type(error).__name__}: {message}"
    except FuzzFailure:
        raise
    except Exception as error:  # the point: nothing else may escape
        raise FuzzFailure(f"{call!r} raised {type(error).__name__}: {error}") from error
    if hasattr(result, "passed") and not result.passed:
        detail = str(getattr(result, "detail", "")).strip()
        if not detail:
            raise FuzzFailure(f"{call!r}: a failed verdict with no detail")
        return "refuted", f"{type(result).__name__}: {detail}"
    return "ok", ""


@dataclass(frozen=True)
class Outcome:
    """One drawn call and its verdict: ``"ok"``, ``"typed"``, ``"refuted"`` or ``"FAILED"``
    (a wrong, silent or bare outcome: ``evidence`` says which)."""

    entry: str
    description: str
    verdict: str
    evidence: str


def campaign(
    strategy: st.SearchStrategy[Call],
    examples: int,
    *,
    seed: int | None = None,
    judge: Callable[[Call], tuple[str, str]] = classify,
) -> list[Outcome]:
    """``examples`` calls drawn from ``strategy`` (derandomized, or from ``seed``), each judged by
    ``judge`` (default :func:`classify`); a :class:`FuzzFailure` is recorded as ``"FAILED"``,
    not raised, so that every call runs (and every rank of a launch draws the same ones: no
    shrinking, which would follow one rank's failures only)."""
    outcomes: list[Outcome] = []

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=seed is None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def run(call: Call) -> None:
        try:
            verdict, evidence = judge(call)
        except FuzzFailure as failure:
            verdict, evidence = "FAILED", str(failure)
        outcomes.append(Outcome(call.entry, call.description, verdict, evidence))

    if seed is not None:
        run = hypothesis_seed(seed)(run)
    run()
    return outcomes


# -- black-box linearity -------------------------------------------------------------------------
def _clip(y: np.ndarray, bound: float) -> np.ndarray:
    if np.iscomplexobj(y):
        raise TypeError("clip takes real values")  # as np.clip would: judged on real states
    return np.clip(y, -bound, bound)


MAPS: dict[str, tuple[bool, Callable[[np.ndarray, float], np.ndarray]]] = {
    "linear": (True, lambda y, p: y),
    "affine": (False, lambda y, p: y + p),
    "saturating": (False, _clip),
    "vanishing above": (False, lambda y, p: np.where(np.abs(y) > p, 0, y)),
    "vanishing below": (False, lambda y, p: np.where(np.abs(y) < p, 0, y)),
    "quadratic": (False, lambda y, p: y + p * y * y),
    "abs": (False, lambda y, p: np.abs(y)),
    "relu": (False, lambda y, p: np.maximum(y, 0) if not np.iscomplexobj(y) else y * 0),
}
"""What a map does to ``y = K x``, with a drawn parameter ``p``: whether it is linear, and the
function. Bounds ``p`` are drawn inside the probes' reach (|K x| from about 1e-12 to 1e12)."""

_PARAMETERS = {
    "linear": (0, 0),
    "affine": (-12, 3),
    "saturating": (-6, 10),
    "vanishing above": (-3, 10),
    "vanishing below": (-10, 0),
    "quadratic": (-9, 0),
    "abs": (0, 0),
    "relu": (0, 0),
}
"""The decimal exponents the parameter ``p`` of each map is drawn between."""

_FLOAT16_PARAMETERS = {"saturating": (-6, 1), "quadratic": (-2, 0)}
"""Narrower ranges for a map computed in float16: images beyond its largest value (65504) are
not compared (``linop.linearity``), so a bound out there is invisible, as it is to any float16
computation; ``vanishing above`` is not drawn. Nor is ``vanishing below``: float16's tolerance
(64 units of roundoff of the state's largest image, 6 %, plus 64 smallest normals, 0.004) hides
the smallest images of a state, so that a map zeroing them is accepted (docs/reliability.md)."""

_FIELDS = ("float64", "float32", "float16", "antilinear", "floor")
"""How ``K x`` is computed: in float64, float32 or float16 (returned in float64; linear), on
``conj(x)`` (antilinear) or floored (linear on integers only)."""


def linear_map(matrix: np.ndarray, field: str, shape: str, parameter: float) -> Callable[[Any], np.ndarray]:
    """``x -> MAPS[shape](K x computed as field, parameter)`` on one flat state."""
    narrow = {"float32": np.float32, "float16": np.float16}.get(field)
    act = MAPS[shape][1]

    def apply(x: Any) -> np.ndarray:
        with np.errstate(all="ignore"):  # float16 overflows on the probes of magnitude 2**20
            return act(_product(np.asarray(x)), parameter)

    def _product(x: np.ndarray) -> np.ndarray:
        if narrow is not None:
            y = (matrix.astype(narrow) @ x.real.astype(narrow)).astype(np.float64)
        elif field == "antilinear":
            y = matrix @ np.conj(x)
        elif field == "floor":
            y = np.floor(matrix @ x.real) if not np.iscomplexobj(x) else matrix @ x * 0.5
        else:
            y = matrix @ x
        return y

    return apply


def _is_linear(field: str, shape: str) -> bool:
    return MAPS[shape][0] and field in ("float64", "float32", "float16")


@st.composite
def _matrices(draw: st.DrawFn) -> np.ndarray:
    rows, columns = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    entries = draw(st.lists(st.integers(-3, 3), min_size=rows * columns, max_size=rows * columns))
    matrix = np.array(entries, dtype=np.float64).reshape(rows, columns)
    if not matrix.any():
        matrix[0, 0] = 1
    if draw(st.booleans()):
        matrix = matrix / 4  # dyadic: float32 and float16 hold it exactly
    return matrix


def _probed(function: Callable[[Any], np.ndarray], columns: int) -> np.ndarray:
    """The map's matrix, probed by unit vectors (what every checker builds first)."""
    return np.stack([np.asarray(function(np.eye(columns)[j]), dtype=np.float64) for j in range(columns)], 1)


@st.composite
def _linearity(draw: st.DrawFn) -> Call:
    """A black-box map drawn from :data:`MAPS` x :data:`_FIELDS` (linear, affine, saturating,
    vanishing, quadratic, abs, relu; computed in float64, float32, float16, antilinear, floored)
    with a true or a wrong adjoint, given to one checker: ``local_operator`` (then
    ``verify.exact_adjoint``), ``prove_backward``, ``lift`` (then its matrix) or
    ``linearity_problem``; sometimes with a junk option. A linear map must be accepted with its
    matrix, any other refused (typed or a failed verdict); a wrong adjoint refuted."""
    import verify
    from linop.linearity import linearity_problem
    from verify.lift import lift, prove_backward

    matrix = draw(_matrices())
    rows, columns = matrix.shape
    field = draw(st.sampled_from(_FIELDS))
    shapes = sorted(MAPS) if field in ("float64", "float32") else sorted(_FLOAT16_PARAMETERS)
    # antilinear and floored maps alone: floored then vanishing above 1 is the zero map, linear
    shape = draw(st.sampled_from(["linear"] if field in ("antilinear", "floor") else ["linear", *shapes]))
    if field == "float16" and shape not in ("linear", "affine", "abs", "relu"):
        shape = draw(st.sampled_from(sorted(_FLOAT16_PARAMETERS)))
    low, high = (_FLOAT16_PARAMETERS if field == "float16" else _PARAMETERS).get(shape, _PARAMETERS[shape])
    parameter = 10.0 ** draw(st.floats(low, high)) if high > low else 0.0
    forward = linear_map(matrix, field, shape, parameter)
    wrong_adjoint = draw(st.integers(0, 4)) == 0
    transpose = matrix.T.copy()
    if wrong_adjoint:
        transpose[draw(st.integers(0, columns - 1)), draw(st.integers(0, rows - 1))] += 1

    def adjoint(y: Any) -> np.ndarray:
        return transpose @ np.asarray(y)

    linear = _is_linear(field, shape)
    checker = draw(st.sampled_from(["local_operator", "prove_backward", "lift", "linearity_problem"]))
    junk_option = draw(st.integers(0, 5)) == 0
    option = draw(junk()) if junk_option else None
    description = show_arguments(
        matrix.tolist(), field, shape, p=f"{parameter:.3g}", wrong_adjoint=wrong_adjoint, option=option
    )
    domain, range_ = {"x": (columns,)}, {"y": (rows,)}

    def judge(accepted: bool, evidence: Any) -> None:
        if accepted and not linear:
            raise FuzzFailure(f"a map that is not linear ({field}, {shape}) was accepted: {evidence!r}")
        if not accepted and linear and not wrong_adjoint and not junk_option:
            raise FuzzFailure(f"a linear map ({field}) was refused: {evidence!r}")

    def run() -> Any:
        if checker == "linearity_problem":
            probed = _probed(forward, columns)
            problem = linearity_problem(
                lambda states: np.stack([forward(s) for s in states]), probed, columns
            )
            judge(problem is None, problem)
            if problem is not None:
                raise linop.errors.NotLinearError(f"linearity_problem: {problem}")
            return None
        if checker == "local_operator":
            space = Space([Block("x", (columns,))])
            options: dict[str, Any] = {"name": option} if junk_option else {}
            op = linop.local_operator(space, "x", ("y", (rows,)), forward=forward, adjoint=adjoint, **options)
            try:
                proof = verify.exact_adjoint(op)
            except linop.errors.NotLinearError:
                judge(False, "NotLinearError")
                raise
            judge(bool(proof) or wrong_adjoint, proof)
            if wrong_adjoint and proof:
                raise FuzzFailure(f"a wrong adjoint was proven: {proof!r}")
            if proof and field == "float64":
                got = op({"x": np.arange(columns, dtype=np.int64) - 1})["y"]
                if not np.array_equal(got, matrix @ (np.arange(columns) - 1)):
                    raise FuzzFailure(f"local operator {got} differs from K x")
            return proof
        options = {"batch": option} if junk_option else {}
        try:
            if checker == "prove_backward":
                proof = prove_backward(forward, domain, range_, adjoint=adjoint, **options)
                judge(bool(proof) or wrong_adjoint, proof)
                if wrong_adjoint and proof:
                    raise FuzzFailure(f"a wrong adjoint was proven: {proof!r}")
                return proof
            lifted = lift(forward, domain, range_, adjoint=adjoint, **options)
            got = lifted.to_sparse().toarray()
        except LinopError as error:
            judge(False, error)
            raise
        judge(True, got)
        wanted = _probed(forward, columns)
        if not np.array_equal(got, wanted):
            raise FuzzFailure(f"lift's matrix {got.tolist()} differs from the probed {wanted.tolist()}")
        return lifted

    return Call(f"linearity ({checker})", run, description)


# -- DTensor layouts ------------------------------------------------------------------------------
def _placements() -> st.SearchStrategy[Any]:
    from linop.mesh_layout import Partial, Replicate, Shard

    return st.one_of(
        st.builds(Shard, st.integers(-2, 3)),
        st.just(Replicate()),
        st.just(Partial()),
        st.sampled_from(["Shard(0)", "S", 0]),
    )


_MESHES = [(1,), (2,), (3,), (4,), (2, 2), (1, 2), (2, 1, 2)]


@st.composite
def _sizes(draw: st.DrawFn, shape: Any, mesh: Any) -> Any:
    kind = draw(st.sampled_from(["none", "none", "right", "wrong sum", "negative", "junk"]))
    if kind == "none":
        return None
    if kind == "junk":
        return draw(junk())
    parts = math.prod(mesh) if isinstance(mesh, tuple) and all(isinstance(m, int) for m in mesh) else 2
    length = shape[0] if isinstance(shape, tuple) and shape and isinstance(shape[0], int) else 4
    parts = max(1, min(parts, 8))
    cuts = sorted(draw(st.lists(st.integers(0, max(length, 0)), min_size=parts - 1, max_size=parts - 1)))
    pieces = [b - a for a, b in zip([0, *cuts], [*cuts, max(length, 0)])]
    if kind == "wrong sum":
        pieces[-1] += 1
    if kind == "negative" and len(pieces) > 1:
        pieces[0], pieces[1] = pieces[0] - 1 - pieces[1], pieces[1] + pieces[0] + 1 + pieces[1]
    return {0: tuple(pieces)}


@st.composite
def _layouts(draw: st.DrawFn) -> Call:
    """Two layouts of one global array on a mesh (placements ``Shard(d)`` for any ``d``,
    ``Replicate``, ``Partial``, junk; uneven ``sizes`` right, of the wrong sum, negative or
    junk; a permuted, repeated or junk ``ranks``), and the redistribute between them applied by
    the numpy interpreter to integer pieces (random partial terms): the gathered destination
    must be the source's global array exactly, and its adjoint the matrix's transpose."""
    from linop.mesh_layout import MeshLayout, Partial, Replicate, Shard
    from linop.redistribute import Redistribute

    honest = draw(st.booleans())
    mesh = draw(st.sampled_from(_MESHES) if honest else maybe(st.sampled_from(_MESHES)))
    count = len(mesh) if isinstance(mesh, tuple) else 1
    global_shape = draw(
        st.tuples(st.integers(0, 6), st.integers(1, 3))
        if honest
        else maybe(st.lists(st.integers(-1, 6), min_size=0, max_size=3).map(tuple))
    )
    wrong_count = st.lists(_placements(), min_size=0, max_size=3)

    def placements() -> Any:
        if honest:
            valid = st.sampled_from([Shard(0), Shard(1), Shard(-1), Replicate(), Partial()])
            return draw(st.lists(valid, min_size=count, max_size=count))
        return draw(st.lists(_placements(), min_size=count, max_size=count) | wrong_count)

    def sizes(chosen: Any) -> Any:
        if not honest:
            return draw(_sizes(global_shape, mesh))
        parts = math.prod(m for m, p in zip(mesh, chosen) if isinstance(p, Shard) and p.dim == 0)
        if parts == 1 or draw(st.booleans()):
            return None
        cuts = sorted(draw(st.lists(st.integers(0, global_shape[0]), min_size=parts - 1, max_size=parts - 1)))
        return {0: tuple(b - a for a, b in zip([0, *cuts], [*cuts, global_shape[0]]))}

    source_placements, destination_placements = placements(), placements()
    source_sizes, destination_sizes = sizes(source_placements), sizes(destination_placements)
    size = math.prod(mesh) if isinstance(mesh, tuple) and all(isinstance(m, int) for m in mesh) else 1
    ranks_kind = draw(st.sampled_from(["default", "permuted"] + ([] if honest else ["repeated", "junk"])))
    ranks: Any = ()
    if ranks_kind == "permuted":
        ranks = tuple(draw(st.permutations(range(min(size, 8)))))
    elif ranks_kind == "repeated":
        ranks = (0,) * min(size, 8)
    elif ranks_kind == "junk":
        ranks = draw(junk())
    seed = draw(st.integers(0, 99))

    def run() -> Any:
        source = MeshLayout.from_placements(
            mesh, source_placements, global_shape, source_sizes, ranks=ranks, name="a"
        )
        destination = MeshLayout.from_placements(
            mesh, destination_placements, global_shape, destination_sizes, ranks=ranks, name="b"
        )
        tree = Redistribute(source, destination)
        rng = np.random.default_rng(seed)
        data = rng.integers(-9, 10, source.global_shape)
        state = source.scatter(data, rng=rng)
        kept = {name: array.copy() for name, array in state.items()}
        result = tree(state)
        for name, array in state.items():
            if not np.array_equal(array, kept[name]):
                raise FuzzFailure(f"block {name!r} of the caller changed")
        gathered = destination.gather(result)
        if not np.array_equal(gathered, data):
            raise FuzzFailure(f"redistributed {gathered.tolist()} is not the source's {data.tolist()}")
        if tree.domain.size <= 256 and tree.range.size <= 256:
            check_against_matrix(tree, state, result, None)
            back = tree.H(result)
            check_against_matrix(tree.H, result, back, None)
        return result

    arguments = show_arguments(
        mesh,
        [str(p) for p in source_placements] if isinstance(source_placements, list) else source_placements,
        [str(p) for p in destination_placements]
        if isinstance(destination_placements, list)
        else destination_placements,
        global_shape,
        sizes=(source_sizes, destination_sizes),
        ranks=ranks,
    )
    return Call("DTensor layouts (redistribute)", run, arguments)


# -- the command line -----------------------------------------------------------------------------
_CHEAP = ("add-adjoint", "clear-adjoint", "clear-box-adjoint", "allocate-adjoint", "deallocate-adjoint")
"""Patterns of the catalogue that check in well under a second (the campaign runs them)."""


def _tokens() -> st.SearchStrategy[list[str]]:
    pattern = st.sampled_from(
        [*_CHEAP, "zzz-typo", "section:nope", "", ",", "section:", "*[", "add-adjoint,zzz"]
    ) | st.text(alphabet="az-*,:[]", max_size=6)
    levels = st.sampled_from(["exact", "exact,float32", "symbolic", "bogus", "", ",", "exact,exact", "EXACT"])
    single = st.sampled_from(["--json", "--list", "-v", "--verbose", "--no-progress", "--mpi", "--help"])
    junk_token = st.sampled_from(["--onl", "-x", "--", "--levels=", "--only=", "é", "-", "--json=1"])
    return st.lists(
        st.one_of(
            st.tuples(st.just("--only"), pattern).map(list),
            st.tuples(st.just("--levels"), levels).map(list),
            single.map(lambda s: [s]),
            junk_token.map(lambda s: [s]),
            st.just(["--only"]),  # a missing value
        ),
        max_size=4,
    ).map(lambda parts: [token for part in parts for token in part])


def _selects_cheaply(argv: Sequence[str]) -> bool:
    """Whether ``argv`` runs checks (not a listing, help, usage error or ``--mpi``) on a pattern
    that is not one of :data:`_CHEAP`: a run the campaign does not pay for."""
    if any(t in argv for t in ("--list", "--help", "--mpi")):
        return True
    patterns = [argv[i + 1] for i, t in enumerate(argv[:-1]) if t == "--only"]
    patterns += [t.split("=", 1)[1] for t in argv if t.startswith("--only=")]
    typos = ("zzz-typo", "section:nope", ",", "section:", "*[")
    return bool(patterns) and all(p in _CHEAP or p in typos for p in patterns)


@st.composite
def _command_lines(draw: st.DrawFn) -> Call:
    """``python -m verify`` (its :func:`verify.__main__.main`, as the shell runs it) with
    drawn arguments: options valid, repeated, misspelt or missing their value, patterns that
    select nothing, unknown levels. The status must be 0 (a listing, help, or every check
    passed), 2 with a one-line reason on stderr (a usage error), never 1 (no catalogue check
    fails), never a traceback or an exception; ``--list`` prints one line per identity."""
    from .__main__ import main

    argv = draw(_tokens().filter(_selects_cheaply))
    if "--mpi" in argv and "--list" not in argv and "--json" not in argv and "-v" not in argv:
        argv = [*argv, "--verbose"]  # --mpi alone would start MPI in this process: a usage error instead

    def run() -> Any:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status = main(list(argv))
            except SystemExit as leaving:
                status = leaving.code if isinstance(leaving.code, int) else 2
        stdout, stderr = out.getvalue(), err.getvalue()
        if "Traceback" in stdout + stderr:
            raise FuzzFailure(f"a traceback: {stderr[-400:]}")
        if status == 2:
            if "python -m verify" not in stderr or not stderr.strip().splitlines()[-1].strip():
                raise FuzzFailure(f"status 2 without a reason on stderr: {stderr!r}")
            raise UsageStatusError(f"status 2: {stderr.strip().splitlines()[-1]}")
        if status != 0:
            raise FuzzFailure(f"status {status}: {stdout[-400:]} {stderr[-400:]}")
        if "--help" not in argv and not stdout.strip():
            raise FuzzFailure("status 0 with nothing printed")
        return status

    return Call("python -m verify", run, show_arguments(argv))


class UsageStatusError(LinopError):
    """The command line ended with status 2 and a reason on stderr (a usage error): the typed
    outcome of :func:`_command_lines`, which :func:`classify` records with the reason."""


ENGINE_ENTRY_POINTS: dict[str, Callable[[], st.SearchStrategy[Call]]] = {
    "linearity": _linearity,
    "DTensor layouts": _layouts,
    "command line": _command_lines,
}
"""The strategies of this module (no process group, no device): one campaign each."""
