"""The JAX executor: a tree's distributed program run inside ``shard_map`` under ``jit``.

:mod:`~linop.backends.jax.plan` compiles a tree into a static SPMD plan (no JAX needed there):
:mod:`~linop.backends.jax.layout` (slots), :mod:`~linop.backends.jax.ops` (the ops),
:mod:`~linop.backends.jax.colouring` (rounds of messages), :mod:`~linop.backends.jax.passes`
(passes over the ops). :mod:`~linop.backends.jax.shard` runs a plan on the devices of a mesh
(a linear primitive whose transpose runs the plan of the adjoint), on the per-device slots of
:mod:`~linop.backends.jax.slots`; :mod:`~linop.backends.jax.integers` decides the dtype of an
integer run (exact or refused, never wrapped). The user-facing functions are in
:mod:`linop.frameworks.jax_sharded`.
"""
