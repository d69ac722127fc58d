"""Interpreters of operator trees: numpy (apply), sparse (exact matrix), mpi (real ranks)."""
