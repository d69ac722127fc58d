"""Interpreters of operator trees: numpy (apply), sparse (exact matrix), and the MPI executor
of the distributed program (:mod:`linop.program`) on real ranks. Backends never import
``linop.frameworks``."""
