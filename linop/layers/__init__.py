"""Distributed layers as verified operator trees (docs/theory.md#layers).

Each layer is a description holding its tensors and partitions, and builds two trees: one
linear in the input for fixed parameters (``input_operator``; its adjoint is the input
gradient) and one linear in the parameters for a fixed input (``parameter_operator``; its
adjoint is the weight gradient). The trees are made of collectives, halo exchanges and
:class:`~linop.local.LocalOperator` leaves running the numpy kernels of
:mod:`linop.layers.kernels`, so every interpreter (numpy, sparse, MPI) runs them and
``verify`` proves their adjoints.

=========================  =============================================================
layer                      tree (forward)
=========================  =============================================================
:class:`Convolution`       R_{P_w->P_y} L B_{P_x->P_w} H (feature, channel, general)
:class:`AveragePool`       L_mean H
:class:`MaxPoolJacobian`   S_{x0} H (a selection: exact)
:class:`Affine`            R_{P_w->P_y} L B_{P_x->P_w}
:class:`BatchNorm`         local kernels around AllReduce (statistics) and B (parameters)
:class:`Loss`              s R_{P_x->root} (local sums); backward B_{root->P_x}
:class:`Interpolate`       L_W H (output-driven windows, uneven halos; exact in integers)
:class:`WindowChain`       L_L M_L ... L_1 W (conv/pool chain, one fused halo exchange)
=========================  =============================================================

:mod:`linop.layers.dad` holds the outer-product gradient identity of dAD.
"""

from .affine import Affine
from .base import LayerError
from .batchnorm import BatchNorm
from .chain import ChainStage, WindowChain
from .conv import Convolution
from .interpolate import Interpolate
from .losses import Loss
from .pooling import AveragePool, MaxPoolJacobian

__all__ = [
    "Affine",
    "AveragePool",
    "BatchNorm",
    "ChainStage",
    "Convolution",
    "Interpolate",
    "LayerError",
    "Loss",
    "MaxPoolJacobian",
    "WindowChain",
]
