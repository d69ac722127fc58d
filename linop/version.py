"""The installed version of linop, read from the package metadata (defined once, in pyproject.toml).

``linop.__version__`` calls :func:`package_version` on first access only, so ``import linop``
does not pay for :mod:`importlib.metadata` (about 30 ms).
"""

from __future__ import annotations

from functools import cache

__all__ = ["DISTRIBUTION", "UNKNOWN_VERSION", "package_version"]

DISTRIBUTION = "linop-adjoint"
"""The distribution name on the package index (``pip install linop-adjoint``); the import names
are ``linop`` and ``verify``. (``linop`` on PyPI is an unrelated project.)"""

UNKNOWN_VERSION = "0+unknown"
"""The version reported when linop runs from a source tree that is not installed."""


@cache
def package_version(distribution: str = DISTRIBUTION) -> str:
    """The version of the installed ``distribution``, or :data:`UNKNOWN_VERSION` if it is not
    installed.

    Parameters
    ----------
    distribution : str
        The distribution name, :data:`DISTRIBUTION` (``"linop-adjoint"``) by default.

    Returns
    -------
    str
        The version string from the distribution's metadata.

    Examples
    --------
    >>> import linop
    >>> package_version() == linop.__version__
    True
    >>> package_version("no-such-distribution-linop")
    '0+unknown'
    """
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return UNKNOWN_VERSION
