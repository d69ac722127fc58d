"""Operator trees as differentiable functions of other frameworks.

- :mod:`linop.frameworks.torch_function`: a tree as a ``torch.autograd.Function`` and an
  ``nn.Module`` (needs the ``torch`` extra);
- :mod:`linop.frameworks.torch_resample`, :mod:`linop.frameworks.torch_pooling`,
  :mod:`linop.frameworks.torch_repartition`: the ``Interpolate`` / ``Upsample``, ``MaxPool``
  and ``Repartition`` modules between distributed layers (torch);
- :mod:`linop.frameworks.jax_function`: a tree as a JAX primitive with its transpose
  registered (needs the ``jax`` extra).

Forward is an interpreter (numpy in one process, MPI across ranks); backward is the adjoint
tree ``op.H``, derived by rules and proven exactly, never a numerical approximation. Nothing
here is imported by ``import linop``.
"""
