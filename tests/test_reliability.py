"""Reliability: every reproducer of the hostile-user review gives a typed error naming the
culprit, or the right answer (the sparse interpreter's). Each case failed on the code before."""

from __future__ import annotations

from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest

import verify
from linop import (
    Add,
    AllGather,
    Allocate,
    AllReduce,
    Block,
    Clear,
    Composition,
    Copy,
    Deallocate,
    DistributedTensor,
    HaloExchange,
    Identity,
    Kernel,
    Move,
    Partition,
    Region,
    Space,
    Sum,
    Zero,
    balanced_sizes,
    broadcast_map,
    halo_geometry,
    output_length,
    pad_shim,
    window_space,
)
from linop.backends.sparse.scipy_interop import aslinearoperator
from linop.errors import (
    BlockError,
    DecompositionError,
    DtypeError,
    IntegerOverflowError,
    KernelError,
    LinopError,
    OperandError,
    PartitionError,
    RegionError,
    ScalarError,
    StateError,
)

SPACE = Space([("a", (4,)), ("b", (4,))])
I = Identity(SPACE)  # noqa: E741 - the identity's conventional name
A = Add(SPACE["a"], SPACE["b"])
STATE = SPACE.random(0)
_TENSOR = DistributedTensor("x", (4,), Partition((2,)))


def _by_matrix(op, state):
    """The sparse interpreter's answer: the matrix times the flattened state, exactly."""
    vector = op.domain.flatten({n: np.asarray(v).astype(object) for n, v in state.items()})
    matrix = op.to_sparse().toarray().astype(object)
    return op.range.unflatten(matrix.dot(vector))


@pytest.mark.parametrize(
    ("call", "error", "fragment"),
    [
        (lambda: Region(SPACE, "a", (-2,), (2,)), RegionError, r"range -2:2 is not inside 0:4"),
        (lambda: Region(SPACE, "a", (2,), (9,)), RegionError, r"range 2:9 is not inside 0:4"),
        (lambda: Region(SPACE, "a", (3,), (1,)), RegionError, r"range 3:1"),
        (lambda: Region(SPACE, "a", (0, 0), (1, 1)), RegionError, "need 1 entries"),
        (lambda: Region(SPACE, "zz", (0,), (1,)), LinopError, "unknown block 'zz'"),
        (lambda: Region(SPACE, "a", (0,), (2,), (0,)), RegionError, "extent 1"),
        (lambda: SPACE["a"][np.array([1, 2])], RegionError, "only integers and slices"),
        (lambda: SPACE["a"][True], RegionError, "not True"),
        (lambda: SPACE["a"][0 : 2 : np.int64(2)], RegionError, "step 2"),
        (lambda: Block("a", (-1,)), BlockError, r"block 'a': negative extent"),
        (lambda: Block("a", (2,), 1.5), BlockError, r"block 'a': worker must be an int, not 1.5"),
        (lambda: Block("a", True), BlockError, "block 'a': shape must be a tuple of ints, not True"),
        (lambda: Block("a", (2, True)), BlockError, "block 'a': shape"),
        (lambda: Block("a", (2,), True), BlockError, "worker must be an int, not True"),
        (lambda: Block("", (2,)), BlockError, "non-empty string"),
        (lambda: Block("a", (2**40, 2**40)), BlockError, "more than int64"),
        (lambda: Block("a", (2,), 2**31), BlockError, "worker must be in 0"),
        (lambda: Partition((2**32, 2**32)), PartitionError, "18446744073709551616 workers"),
        (lambda: Partition((2**63,)), PartitionError, "9223372036854775808 workers"),
        (lambda: Partition((True, 2)), PartitionError, "not bools"),
        (lambda: Partition.grid((2,), first=1.5), PartitionError, "first worker"),
        (lambda: DistributedTensor("", (4,), Partition((2,))), DecompositionError, "non-empty string"),
        (lambda: DistributedTensor(None, (4,), Partition((2,))), DecompositionError, "non-empty string"),
        (lambda: DistributedTensor("x", (True,), Partition((1,))), DecompositionError, "global shape"),
        (lambda: DistributedTensor("x", (2**40, 2**40), Partition((1, 1))), DecompositionError, "int64"),
        (lambda: DistributedTensor("x", (4,), Partition((2,)), 7), DecompositionError, "sizes must be"),
        (lambda: DistributedTensor("x", (4,), (2,)), OperandError, "must be a Partition"),
        (lambda: Kernel(True).resolve(1), KernelError, "size in dimension 0 must be an integer, not True"),
        (lambda: Kernel(3, leading=True).resolve(2), KernelError, "leading dimensions must be an integer"),
        (lambda: Kernel(3, boundary=1).resolve(1), KernelError, "boundary mode 1"),
        (lambda: Identity("abc") @ I, OperandError, "Identity: the space must be a Space, not str"),
        (lambda: Zero(SPACE, 5), OperandError, "Zero: the range must be a Space, not int"),
        (lambda: I @ 5, OperandError, "operand of @ must be a LinearOperator, not int"),
        (lambda: 5 @ I, OperandError, "operand of @"),
        (lambda: I + 5, OperandError, "operand of \\+ must be a LinearOperator, not int"),
        (lambda: 5 + I, OperandError, "operand of \\+"),
        (lambda: I - "x", OperandError, "operand of -"),
        (lambda: Composition(("x",)), OperandError, "Composition: item 0 is a str"),
        (lambda: Composition(()), OperandError, "at least one factor"),
        (lambda: Composition(I), OperandError, "tuple of operators"),
        (lambda: Sum((I, None)), OperandError, "Sum: item 1 is a NoneType"),
        (lambda: Fraction(1, 3) * I, ScalarError, "not Fraction"),
        (lambda: Decimal(1) * I, ScalarError, "not Decimal"),
        (lambda: np.array([1, 2]) * I, ScalarError, "not ndarray"),
        (lambda: I * np.array([1, 2]), ScalarError, "not ndarray"),
        (lambda: True * I, ScalarError, "not bool"),
        (lambda: np.timedelta64(1) * I, ScalarError, "not numeric"),
        (lambda: I.apply(STATE, dtype="foo"), DtypeError, "dtype 'foo' is not a numpy dtype"),
        (lambda: I.apply(STATE, dtype=bool), DtypeError, "dtype bool"),
        (lambda: I.to_sparse(dtype="foo"), DtypeError, "to_sparse: dtype 'foo'"),
        (lambda: I.to_sparse(dtype=np.float16), DtypeError, "cannot hold dtype float16"),
        (lambda: (200 * I).to_sparse(dtype=np.int8), DtypeError, "cannot hold exactly"),
        (lambda: I({"a": [[1, 2], [3]], "b": np.zeros(4)}), StateError, "block 'a' is not an array"),
        (lambda: aslinearoperator(I).matvec(np.zeros(3)), StateError, "length 8"),
        (lambda: aslinearoperator(I).rmatvec(np.zeros(9)), StateError, "length 8"),
        (lambda: aslinearoperator("x"), OperandError, "aslinearoperator"),
        (lambda: aslinearoperator(I, dtype="foo"), DtypeError, "aslinearoperator: dtype"),
        (lambda: verify.exact_adjoint("x"), OperandError, "exact_adjoint: op must be a LinearOperator"),
        (lambda: verify.equal(I, "x"), OperandError, "equal: the right operand"),
        (lambda: verify.adjoint_test("x"), OperandError, "adjoint_test: op"),
        (lambda: verify.adjoint_test(I, dtype="foo"), LinopError, "'foo' is not a dtype"),
        (lambda: verify.adjoint_test(I, trials="3"), LinopError, "trials must be an int"),
        (lambda: verify.numeric_equal(I, 3), OperandError, "numeric_equal: the right operand"),
        (lambda: Space(-2), BlockError, "iterable of blocks, not int"),
        (lambda: Space(np.array(3)), BlockError, "iterable of blocks, not ndarray"),
        (lambda: Space([[[2], []]]), BlockError, "expected a Block"),
        (lambda: SPACE[["a"]], LinopError, "unknown block"),
        (lambda: Allocate(b"x", Block("c", (1,))), OperandError, "Allocate: the space must be a Space"),
        (lambda: Allocate(SPACE, ("c", (1,))), OperandError, "Allocate: the new block must be a Block"),
        (lambda: Deallocate(b"x", "a"), OperandError, "Deallocate: the space must be a Space"),
        (lambda: Clear(np.datetime64(1, "s")), OperandError, "Clear needs a region"),
        (lambda: Add("a", [1]), OperandError, "Add relates two regions"),
        (lambda: Copy(b"=", SPACE["b"]), OperandError, "Copy needs a source region"),
        (lambda: Move(SPACE["a"], 3.5), OperandError, "destination must be a Region"),
        (lambda: halo_geometry(1.5, Kernel(1)), OperandError, "tensor must be a DistributedTensor"),
        (lambda: HaloExchange("g"), OperandError, "geometry must be a HaloGeometry"),
        (lambda: AllGather(1.5, (0,), "y"), OperandError, "AllGather: tensor must be a DistributedTensor"),
        (lambda: AllReduce(3), OperandError, "AllReduce: tensor must be a DistributedTensor or a BlockGrid"),
        (lambda: AllGather(_TENSOR, (0,), ()), OperandError, "AllGather: name must be a non-empty string"),
        (lambda: Partition.grid(-3, first=[]), PartitionError, "first worker must be an int"),
        (lambda: aslinearoperator(I).matvec(None), StateError, "numeric vector"),
        (lambda: aslinearoperator(I).matvec([[], [0]]), StateError, "matvec needs a vector of length 8"),
        (lambda: aslinearoperator(I).matvec(np.array(["a"] * 8)), StateError, "numeric vector"),
        (lambda: (1j * I).to_sparse(dtype=float), DtypeError, "complex entries; dtype float64 is real"),
        (lambda: SPACE.zeros("foo"), DtypeError, "zeros: 'foo' is not a numpy dtype"),
        (lambda: SPACE.zeros("U2"), DtypeError, "zeros: dtype <U2 is not numeric"),
        (lambda: SPACE.random(0, bool), DtypeError, "random: dtype bool is not numeric"),
        (lambda: SPACE.random(0, object), DtypeError, "cannot draw random entries of dtype object"),
        (lambda: SPACE.unflatten([[], [0], []]), StateError, "expected a vector of length 8"),
        (lambda: _TENSOR.scatter([[], [0]]), DecompositionError, "tensor 'x': cannot scatter"),
        (lambda: Partition((2, 2)).worker(1.5), PartitionError, "index 1.5 must be integers"),
        (lambda: Partition((2, 2)).worker(("a", 0)), PartitionError, "must be integers"),
        (lambda: _TENSOR.box(np.False_), PartitionError, "must be integers"),
        (lambda: _TENSOR.region((0,), "x"), RegionError, "box corner 'x' must be integers"),
        (lambda: _TENSOR.region((0,), (("a",), (1,))), RegionError, "box corner"),
        (lambda: balanced_sizes(Decimal("nan"), 2), DecompositionError, "balanced_sizes: length"),
        (lambda: balanced_sizes(5, (True, 1.0)), DecompositionError, "balanced_sizes: parts"),
        (lambda: output_length((1, 2), 3), KernelError, "output_length: length must be an integer"),
        (lambda: output_length(5, 3, 0), KernelError, "stride must be >= 1"),
        (lambda: pad_shim(-3), OperandError, "a halo geometry is needed"),
        (lambda: window_space("g"), OperandError, "a halo geometry is needed"),
        (lambda: broadcast_map(Partition((2,)), b"$"), OperandError, "destination must be a Partition"),
    ],
    ids=[
        "region-negative-start",
        "region-stop-past-end",
        "region-start-after-stop",
        "region-wrong-rank",
        "region-unknown-block",
        "region-dropped-wide",
        "index-array",
        "index-bool",
        "index-numpy-step",
        "block-negative",
        "block-float-worker",
        "block-bool-shape",
        "block-bool-extent",
        "block-bool-worker",
        "block-empty-name",
        "block-size-overflow",
        "block-worker-beyond-int32",
        "partition-2**64-workers",
        "partition-2**63",
        "partition-bool-extent",
        "partition-float-first",
        "tensor-empty-name",
        "tensor-none-name",
        "tensor-bool-shape",
        "tensor-size-overflow",
        "tensor-int-sizes",
        "tensor-tuple-partition",
        "kernel-bool-size",
        "kernel-bool-leading",
        "kernel-int-boundary",
        "identity-of-str",
        "zero-int-range",
        "matmul-int",
        "rmatmul-int",
        "add-int",
        "radd-int",
        "sub-str",
        "composition-of-str",
        "composition-empty",
        "composition-not-tuple",
        "sum-of-none",
        "fraction-scalar",
        "decimal-scalar",
        "array-times-op",
        "op-times-array",
        "bool-scalar",
        "timedelta-scalar",
        "apply-dtype-foo",
        "apply-dtype-bool",
        "to-sparse-dtype-foo",
        "to-sparse-float16",
        "to-sparse-narrowing",
        "ragged-block",
        "matvec-wrong-length",
        "rmatvec-wrong-length",
        "aslinearoperator-str",
        "aslinearoperator-dtype",
        "exact-adjoint-str",
        "equal-str",
        "adjoint-test-str",
        "adjoint-test-dtype",
        "adjoint-test-trials",
        "numeric-equal-int",
        "space-of-int",
        "space-of-0d-array",
        "space-of-list",
        "space-unhashable-name",
        "allocate-bytes-space",
        "allocate-tuple-block",
        "deallocate-bytes-space",
        "clear-datetime",
        "add-str-list",
        "copy-bytes",
        "move-float-destination",
        "halo-geometry-float",
        "halo-exchange-str",
        "all-gather-float",
        "all-reduce-int",
        "all-gather-tuple-name",
        "grid-list-first",
        "matvec-none",
        "matvec-ragged",
        "matvec-strings",
        "to-sparse-complex-to-real",
        "zeros-foo",
        "zeros-str",
        "random-bool",
        "random-object",
        "unflatten-ragged",
        "scatter-ragged",
        "worker-float-index",
        "worker-str-index",
        "box-bool-index",
        "region-str-box",
        "region-str-corner",
        "balanced-sizes-decimal",
        "balanced-sizes-tuple",
        "output-length-tuple",
        "output-length-zero-stride",
        "pad-shim-int",
        "window-space-str",
        "broadcast-map-bytes",
    ],
)
def test_bad_input_gets_a_typed_error_naming_the_culprit(call, error, fragment):
    with pytest.raises(error, match=fragment):
        call()


@pytest.mark.parametrize(
    ("dtype", "fragment"),
    [
        (bool, "bool"),
        ("U1", "string"),
        ("S1", "bytes"),
        ("datetime64[s]", "datetime"),
        ("timedelta64[s]", "timedelta"),
        ([("x", "f8")], "structured"),
    ],
    ids=["bool", "str", "bytes", "datetime", "timedelta", "structured"],
)
def test_non_numeric_states_are_refused_naming_the_block(dtype, fragment):
    state = {"a": np.zeros(4, dtype=dtype), "b": np.zeros(4, dtype=dtype)}
    with pytest.raises(DtypeError, match=f"block 'a' has dtype .*{fragment}"):
        A(state)
    with pytest.raises(TypeError):  # a builtin base stays catchable
        A(state)


@pytest.mark.parametrize(
    ("op", "dtype", "values"),
    [
        (A, np.uint8, (200, 100)),
        (A, np.int8, (100, 100)),
        (A, np.int8, (-100, -100)),
        (2**40 * (2**40 * A), np.int64, (1, 1)),
        (2**20 * (2**20 * A), np.int32, (3, 5)),
        (-1 * I, np.uint8, (7, 9)),
        (Sum((I, I, I)), np.uint8, (100, 100)),
        (Composition((A, A, A)), np.int16, (20000, 1)),
    ],
    ids=[
        "uint8-add",
        "int8-add",
        "int8-negative",
        "int64-scaled",
        "int32-scaled",
        "uint8-negated",
        "uint8-sum",
        "int16-adds",
    ],
)
def test_integer_runs_are_exact_or_refused(op, dtype, values):
    state = {"a": np.full(4, values[0], dtype=dtype), "b": np.full(4, values[1], dtype=dtype)}
    try:
        got = op(state)
    except IntegerOverflowError as error:
        assert "int64" in str(error)
        assert max(abs(int(v)) for v in _by_matrix(op, state)["b"]) >= 2**62
        return
    expected = _by_matrix(op, state)
    for name in ("a", "b"):
        assert [int(v) for v in got[name]] == [int(v) for v in expected[name]], name
    assert state["a"].dtype == dtype and int(state["a"][0]) == values[0]  # input untouched


def test_a_scalar_beyond_int64_computes_integer_states_in_float64_like_the_sparse_interpreter():
    state = {"a": np.ones(4, dtype=np.int64), "b": np.zeros(4, dtype=np.int64)}
    got = (2**70 * A)(state)
    assert got["b"].dtype == np.float64 and list(got["b"]) == [2.0**70] * 4


def test_a_scalar_beyond_int64_scales_a_matrix_without_entries():
    """Found by the long fuzz campaign: the exact matrix of ``10**30 * Deallocate(...)`` (no
    stored entry) raised a bare OverflowError."""
    space = Space([("v", (4, 3))])
    freed = 10**30 * Deallocate(space, "v")
    assert freed.to_sparse().nnz == 0 and freed.to_sparse().shape == (0, 12)
    assert verify.exact_adjoint(freed)


def test_integer_run_keeps_the_dtype_when_nothing_can_overflow():
    state = {"a": np.full(4, 3, dtype=np.uint8), "b": np.full(4, 4, dtype=np.uint8)}
    assert A(state)["b"].dtype == np.uint8 and list(A(state)["b"]) == [7] * 4


def test_in_place_integer_run_checks_the_result_fits_the_callers_array():
    state = {"a": np.full(4, 200, dtype=np.uint8), "b": np.full(4, 100, dtype=np.uint8)}
    with pytest.raises(IntegerOverflowError, match=r"block 'b' spans \[300, 300\].*uint8"):
        A.apply(state, inplace=True)
    assert list(state["b"]) == [100] * 4  # nothing written
    state = {"a": np.full(4, 20, dtype=np.uint8), "b": np.full(4, 30, dtype=np.uint8)}
    (A @ (-1 * I) @ (-1 * I)).apply(state, inplace=True)  # negative scalars, but the result fits
    assert state["b"].dtype == np.uint8 and list(state["b"]) == [50] * 4


def test_mixed_integer_and_float_blocks_compute_in_the_float_dtype():
    space = Space([("a", (2,)), ("b", (2,)), ("c", (2,))])
    op = Add(space["a"], space["b"]) @ Add(space["c"], space["a"])
    state = {"a": np.full(2, 200, np.uint8), "b": np.full(2, 100, np.uint8), "c": np.ones(2)}
    got = op(state)
    assert list(got["b"]) == [301.0, 301.0] and list(got["a"]) == [201.0, 201.0]


def test_a_later_complex_term_of_a_sum_promotes_float_states():
    op = Sum((I, I, 1j * I))
    got = op(STATE)
    assert np.allclose(SPACE.flatten(got), (2 + 1j) * SPACE.flatten(STATE))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), np.float32("nan"), 1j * np.inf])
def test_a_non_finite_scalar_is_refused_at_construction(value):
    with pytest.raises(ScalarError, match="not finite"):
        value * A


OVERFLOWED = 1e200 * (1e200 * A)  # its matrix holds inf entries (the product overflows)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the overflow to inf/NaN is the point
def test_equal_does_not_drop_infinite_differences():
    proof = verify.equal(OVERFLOWED, 2 * A)
    assert not proof and proof.count == 12
    assert verify.equal(OVERFLOWED, 1e200 * (1e200 * A))  # equal infinities are equal


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the overflow to inf/NaN is the point
def test_equal_does_not_drop_nan_differences():
    nan_matrix = OVERFLOWED - OVERFLOWED  # inf - inf: NaN entries
    assert np.isnan(nan_matrix.to_sparse().data).any()
    assert not verify.equal(nan_matrix, Zero(SPACE, SPACE))
    assert not verify.equal(nan_matrix, nan_matrix)  # NaN equals nothing, itself included


def test_region_built_directly_agrees_in_both_interpreters():
    region = Region(SPACE, "a", (1,), (3,))
    assert region == SPACE["a"][1:3]
    op = Clear(region)
    assert np.array_equal(SPACE.flatten(op(STATE)), op.to_sparse() @ SPACE.flatten(STATE))


@pytest.mark.parametrize("variant", ["nested", "direct"])
def test_an_empty_dimension_with_zero_boundary_has_an_empty_exchange(variant):
    tensor = DistributedTensor("x", (0, 6), Partition((2, 2)))
    geometry = halo_geometry(tensor, Kernel(1))
    assert geometry.output_shape == (0, 6)
    op = HaloExchange(geometry, variant)
    assert verify.exact_adjoint(op)
    state = op.domain.random(1)
    assert np.array_equal(op.range.flatten(op(state)), op.to_sparse() @ op.domain.flatten(state))


def test_a_kernel_larger_than_a_non_empty_input_is_still_refused():
    with pytest.raises(KernelError, match="larger than the padded input"):
        halo_geometry(DistributedTensor("x", (2,), Partition((1,))), Kernel(3))
