"""What to install when a framework adapter's library is missing: :func:`missing_extra`.

Each adapter imports its library first, as::

    try:
        import torch
    except ModuleNotFoundError as error:
        raise missing_extra(error, "torch", __name__) from error

or, the same in two lines, ``with importing("jax", __name__): import jax``,
so that ``import linop.frameworks.torch_function`` without torch says which extra installs it,
as :mod:`linop.plot` and the MPI interpreter do, instead of a bare ``ModuleNotFoundError``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["importing", "missing_extra"]


def missing_extra(error: ModuleNotFoundError, extra: str, module: str) -> ModuleNotFoundError:
    """The error to raise when importing ``module`` failed with ``error`` because the library
    of ``extra`` is missing (``error`` itself, unchanged, when something else is missing: a
    broken installation of the library is reported as it is).

    Parameters
    ----------
    error : ModuleNotFoundError
        The failed import's error.
    extra : str
        The optional dependency group of ``pyproject.toml`` that installs the library (``torch``,
        ``jax``), also the library's import name.
    module : str
        The adapter module being imported (``__name__``).
    """
    if error.name is None or error.name.split(".")[0] != extra:
        return error
    return ModuleNotFoundError(
        f"{module} needs {extra}, which is not installed: from a clone of linop run "
        f"pip install -e '.[{extra}]' (once linop-adjoint is on the package index: "
        f"pip install 'linop-adjoint[{extra}]')",
        name=error.name,
    )


@contextmanager
def importing(extra: str, module: str) -> Iterator[None]:
    """The imports of ``module`` inside this block that fail because the library of ``extra``
    is missing raise :func:`missing_extra`'s error (any other failure as it is)."""
    try:
        yield
    except ModuleNotFoundError as error:
        hint = missing_extra(error, extra, module)
        if hint is error:
            raise
        raise hint from error
