"""Operator trees as differentiable functions of other frameworks.

- :mod:`linop.frameworks.torch_function`: a tree as a ``torch.autograd.Function`` and an
  ``nn.Module``; :mod:`linop.frameworks.torch_layers`: a distributed layer as an
  ``nn.Module``; :mod:`linop.frameworks.dtensor`: DTensor layouts and an exact redistribute
  (the ``torch`` extra: ``pip install -e '.[torch]'``);
- :mod:`linop.frameworks.torch_norm`, :mod:`linop.frameworks.torch_losses`: the
  ``BatchNormModule`` and ``LossModule`` (torch);
- :mod:`linop.frameworks.torch_resample`, :mod:`linop.frameworks.torch_pooling`,
  :mod:`linop.frameworks.torch_repartition`: the ``Interpolate`` / ``Upsample``, ``MaxPool``
  and ``Repartition`` modules between distributed layers (torch);
  :mod:`linop.frameworks.torch_chain`: ``ChainModule``, a chain of sliding-window layers with
  one fused halo exchange (torch);
- :mod:`linop.frameworks.jax_function`: a tree as a JAX primitive with its transpose
  registered; :mod:`linop.frameworks.jax_sharded`: a tree inside ``jit`` on a device mesh
  (the ``jax`` extra: ``pip install -e '.[jax]'``).

Importing a torch adapter without torch says which extra to install
(:func:`linop.frameworks.extras.missing_extra`).

Forward is an interpreter (numpy in one process, MPI across ranks); backward is the adjoint
tree ``op.H``, derived by rules and proven exactly, never a numerical approximation. Nothing
here is imported by ``import linop``.
"""
