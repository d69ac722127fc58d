"""Catalogue, ``docs/theory.md#local-operators``, ``#layers`` and ``#outer-product-gradients``:
local operators, distributed layers and the dAD gradient identity.

Every layer identity is proven on small integer data, so the matrices are exact: a distributed
layer equals the sequential one (both sides mapped between the same single-worker tensors by
repartitions), its adjoint (the input gradient) is exact, and so is the adjoint of the tree
linear in the parameters (the weight gradient). The kernels are callables (numpy
``sliding_window_view`` + ``tensordot``), which the sparse interpreter probes; they have no
matrix for the symbolic level, which these entries therefore skip.
"""

from __future__ import annotations

import numpy as np

from linop import Block, DistributedTensor, Kernel, LinearOperator, Partition, Repartition, Space
from linop.layers import Affine, AveragePool, Convolution, Interpolate, MaxPoolJacobian, dad
from linop.local import local_operator

from .catalogue import Entry, adjoint_entry, equal_entry

__all__ = ["ENTRIES"]

LOCAL, LAYERS, DAD = "local-operators", "layers", "outer-product-gradients"


def _rng() -> np.random.Generator:
    return np.random.default_rng(2024)


def _local() -> LinearOperator:
    space = Space([Block("u", (3,), 1), Block("v", (2,), 0)])
    return local_operator(space, "u", Block("w", (2,), 1), np.array([[1, 0, -2], [3, 1, 0]]), name="K")


def _x(partition: tuple[int, ...], shape=(1, 2, 6, 5), name: str = "x") -> DistributedTensor:
    return DistributedTensor(name, shape, Partition(partition))


def _conv(px: tuple[int, ...], workers: Partition | None, kernel: Kernel) -> Convolution:
    return Convolution(_x(px), 2, kernel, workers=workers)


def _weights(layer: Convolution | Affine) -> np.ndarray:
    return _rng().integers(-2, 3, layer.weights.global_shape)


def _sequential_pair(layer: Convolution, px: tuple[int, ...]) -> tuple[LinearOperator, LinearOperator]:
    """(distributed layer between single-worker tensors, the sequential layer)."""
    ones = (1,) * len(px)
    xs = _x(ones, layer.x.global_shape, name="xs")
    sequential = Convolution(xs, layer.out_channels, layer.spatial_kernel, name="ys")
    w = _weights(layer)
    into = Repartition(sequential.x, layer.x)
    out = Repartition(layer.y, sequential.y)
    return out @ layer.input_operator(w) @ into, sequential.input_operator(w)


FEATURE, FEATURE_KERNEL = (1, 1, 2, 2), Kernel(3, padding=1)
GENERAL, GENERAL_WORKERS, GENERAL_KERNEL = (
    (1, 2, 1, 1),
    Partition((1, 2, 2, 1, 1)),
    Kernel(3, stride=2, padding=(1, 0)),
)


UNBALANCED, UNBALANCED_WORKERS = (1, 2, 1, 1), Partition((1, 2, 2, 1, 1))


def _unbalanced() -> Convolution:
    """5 input channels over 2 workers (3, 2) and 3 output channels over 2 (2, 1)."""
    return Convolution(_x(UNBALANCED, (1, 5, 6, 5)), 3, FEATURE_KERNEL, workers=UNBALANCED_WORKERS)


def _feature() -> Convolution:
    return _conv(FEATURE, None, FEATURE_KERNEL)


def _general() -> Convolution:
    return _conv(GENERAL, GENERAL_WORKERS, GENERAL_KERNEL)


def _parameters(layer: Convolution | Affine) -> LinearOperator:
    data = _rng().integers(-3, 4, layer.x.global_shape)
    return layer.parameter_operator(layer.window_operator(layer.x.scatter(data)))


def _affine() -> Affine:
    return Affine(DistributedTensor("x", (3, 4), Partition((1, 2))), 4, workers=Partition((2, 2)))


def _max_pool() -> LinearOperator:
    pool = MaxPoolJacobian(_x((1, 1, 2, 1)), Kernel(2, stride=2, padding=(1, 0)))
    x0 = _rng().permutation(60).reshape(1, 2, 6, 5).astype(float)
    return pool.at(pool.window_operator(pool.x.scatter(x0)))


def _interpolation(x: DistributedTensor, name: str = "y") -> Interpolate:
    return Interpolate(x, size=(11, 4), mode="bilinear", align_corners=True, name=name)


def _interpolation_pair() -> tuple[LinearOperator, LinearOperator]:
    """(the integer interpolation on 1 x 1 x 3 x 2 between single-worker tensors, the
    sequential one): output-driven windows with uneven halos against no halo at all."""
    layer = _interpolation(
        DistributedTensor("x", (1, 2, 7, 5), Partition((1, 1, 3, 2)), sizes=((1,), (2,), (1, 4, 2), (4, 1)))
    )
    sequential = _interpolation(_x((1, 1, 1, 1), (1, 2, 7, 5), name="xs"), name="ys")
    into, out = Repartition(sequential.x, layer.x), Repartition(layer.y, sequential.y)
    return out @ layer.integer_operator()[0] @ into, sequential.integer_operator()[0]


def _dad_pair() -> tuple[LinearOperator, LinearOperator]:
    activations = [_rng().integers(-3, 4, (2, 3)) + s for s in range(3)]
    d = dad.deltas(3, 2, 4)
    return dad.allreduce_gradient(activations, d), dad.gathered_gradient(activations, d)


ENTRIES: list[Entry] = [
    adjoint_entry(
        "local-operator-adjoint", LOCAL, "L = K on u (worker 1), v passed through: L* = K^T on w", _local
    ),
    adjoint_entry(
        "conv-feature-input-adjoint",
        LAYERS,
        "y = L_w H x on 1 x 1 x 2 x 2, kernel 3, padding 1: (L_w H)* = H* L_w* is the input gradient",
        lambda: _feature().input_operator(_weights(_feature())),
        symbolic=False,
    ),
    equal_entry(
        "conv-feature-equals-sequential",
        LAYERS,
        "Repartition(y -> 1 worker) L_w H Repartition(1 worker -> x) = the sequential convolution",
        lambda: _sequential_pair(_feature(), FEATURE),
        symbolic=False,
    ),
    adjoint_entry(
        "conv-feature-parameter-adjoint",
        LAYERS,
        "y = L_x B (w, b): its adjoint is the weight and bias gradient (B* = R sums the workers' parts)",
        lambda: _parameters(_feature()),
        symbolic=False,
    ),
    adjoint_entry(
        "conv-general-input-adjoint",
        LAYERS,
        "y = R L_w B H x on P_w = 1 x 2 x 2 x 1 x 1: the input gradient H* B* L_w* R* = H* R L_w* B",
        lambda: _general().input_operator(_weights(_general())),
        symbolic=False,
    ),
    equal_entry(
        "conv-general-equals-sequential",
        LAYERS,
        "the channel-and-feature partitioned convolution equals the sequential one",
        lambda: _sequential_pair(_general(), GENERAL),
        symbolic=False,
    ),
    adjoint_entry(
        "conv-general-parameter-adjoint",
        LAYERS,
        "y = R L_x (B_w w, B_b b) with the bias on one P_co x 1 sub-partition: exact weight gradient",
        lambda: _parameters(_general()),
        symbolic=False,
    ),
    equal_entry(
        "conv-unbalanced-channels-equals-sequential",
        LAYERS,
        "channels that do not divide (5 in as 3, 2; 3 out as 2, 1 on P_w = 1 x 2 x 2 x 1 x 1): the "
        "sequential convolution",
        lambda: _sequential_pair(_unbalanced(), UNBALANCED),
        symbolic=False,
    ),
    adjoint_entry(
        "avgpool-adjoint",
        LAYERS,
        "y = L_mean H x (2 x 2 windows, stride 2): (L_mean H)* = H* L_mean*",
        lambda: AveragePool(_x((1, 2, 2, 1)), Kernel(2, stride=2)).operator,
        symbolic=False,
    ),
    adjoint_entry(
        "maxpool-jacobian-adjoint",
        LAYERS,
        "J = S_{x0} H (selection of each window's maximum of x0): J* = H* S*, a 0/1 matrix",
        _max_pool,
        symbolic=False,
    ),
    adjoint_entry(
        "affine-input-adjoint",
        LAYERS,
        "y = R L_W B x on P_w = 2 x 2: the input gradient B* L_W* R* = R L_W^T B",
        lambda: _affine().input_operator(_weights(_affine())),
        symbolic=False,
    ),
    adjoint_entry(
        "affine-parameter-adjoint",
        LAYERS,
        "y = R L_x (W, b), bias on P_fo x 1: exact dW = x^T dy, db = sum dy",
        lambda: _parameters(_affine()),
        symbolic=False,
    ),
    adjoint_entry(
        "interpolate-bilinear-adjoint",
        LAYERS,
        "y = L_W T H E x (bilinear 7 x 5 -> 11 x 4, align_corners, on uneven shares 1, 4, 2 and 4, 1; "
        "weights times their denominators 5 and 3): (L_W T H E)* = E* H* T* L_W^T",
        lambda: _interpolation_pair()[0],
        symbolic=False,
    ),
    equal_entry(
        "interpolate-equals-sequential",
        LAYERS,
        "the output-driven distributed interpolation (uneven halos) equals the sequential one",
        _interpolation_pair,
        symbolic=False,
    ),
    equal_entry(
        "dad-gradient-identity",
        DAD,
        "AllReduce_s(A_s^T D_s) = [A_1; ...; A_S]^T AllGather(D) (3 sites, integer activations)",
        _dad_pair,
        symbolic=False,
    ),
]
