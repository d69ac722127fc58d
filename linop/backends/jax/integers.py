r"""Integer runs on JAX: exact or refused, never wrapped (``docs/theory.md#dtypes``).

The numpy, sparse and MPI interpreters decide an integer run's dtype from :math:`G M`, the
tree's largest absolute row sum :math:`G` times the largest magnitude :math:`M` of an input
entry (:func:`linop.dtypes.cast_dtype`). JAX fixes a program's dtypes when it traces it,
before it sees a value, so here :math:`M` is the largest magnitude the input dtypes hold
(for a tree that only copies entries, :math:`G \le 1` with no negative coefficient, the
largest positive entry: a copy of int32's :math:`-2^{31}` fits int32): the run is exact for
every value those dtypes can take. The rule of :mod:`linop.dtypes` then applies as it is:

- :math:`G M` fits the narrowest integer dtype (a tree that only copies, :math:`G = 1`): the
  blocks' own dtype;
- otherwise the run dtype or int64 if :math:`G M` fits it (``uint8`` summed over 4 devices:
  int64), and :class:`~linop.errors.IntegerOverflowError` from :math:`2^{62}` on (an int64
  all-reduce);
- with ``jax_enable_x64`` off JAX holds no 64-bit integer, so int64 becomes int32 where
  :math:`G M` fits int32 (``int16`` summed over 4 devices), and the run is refused otherwise
  (``int32`` summed over 4 devices): enable x64, or pass floats.

The host-callback adapter (:mod:`linop.frameworks.jax_function`) and the lowering onto devices
(:mod:`linop.backends.jax.shard`) both call :func:`integer_cast`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax
import numpy as np

from ...dtypes import cast_dtype, growth, scalars
from ...errors import IntegerOverflowError
from ...operator import LinearOperator

__all__ = ["dtype_bound", "integer_cast"]


def dtype_bound(dtypes: Iterable[Any], signs: bool = True) -> int:
    r"""The largest magnitude an entry of the integer ``dtypes`` can have (0 for none); with
    ``signs`` False the largest positive entry (int32: 2**31 - 1, not 2**31), enough for a
    tree that only copies entries (:math:`G \le 1`, no negative coefficient), whose every
    result entry is an input entry or zero."""
    infos = [np.iinfo(d) for d in map(np.dtype, dtypes) if d.kind in "iu"]  # type: ignore[type-var]
    return max((max(-int(i.min), int(i.max)) if signs else int(i.max) for i in infos), default=0)


def integer_cast(op: LinearOperator, dtypes: Iterable[Any]) -> np.dtype | None:
    """The dtype an integer run of ``op`` on blocks of ``dtypes`` computes in, as JAX holds it,
    or None when the blocks' own dtype is exact (or no block is an integer).

    Raises
    ------
    IntegerOverflowError
        If a result may not fit int64 (int32 with ``jax_enable_x64`` off) for some value of the
        input dtypes.
    """
    dtypes = [np.dtype(d) for d in dtypes]
    if not any(d.kind in "iu" for d in dtypes):
        return None
    g, negative = growth(op)
    negative = negative or any(np.real(alpha) < 0 for alpha in scalars(op))
    largest = dtype_bound(dtypes, signs=g > 1 or negative)
    try:
        cast = cast_dtype(op, dtypes, largest)
    except IntegerOverflowError as error:
        raise IntegerOverflowError(
            f"{error} (JAX fixes the dtypes before it sees the values, so the largest entry is the "
            f"largest the input dtype {_names(dtypes)} holds)"
        ) from None
    if cast is None or cast.kind not in "iu":
        return cast
    held = np.dtype(jax.dtypes.canonicalize_dtype(cast))
    if held != cast:  # x64 off: no 64-bit integers
        if g * largest > np.iinfo(held).max:
            raise IntegerOverflowError(
                f"integer result of {_short(op)} on {_names(dtypes)} may reach {float(g * largest):.3g} "
                f"(row sum {g} times the largest entry {largest} of the dtype: JAX fixes the dtypes before "
                f"it sees the values), beyond {held}, the widest integer JAX holds with jax_enable_x64 "
                f"off; enable x64 (jax.config.update('jax_enable_x64', True)) for an exact {cast} sum, "
                "pass narrower integers, or pass floats to accept rounding"
            )
    return held


def _names(dtypes: list[np.dtype]) -> str:
    return "/".join(sorted({str(d) for d in dtypes}))


def _short(op: LinearOperator, limit: int = 60) -> str:
    text = str(op)
    return text if len(text) <= limit else text[: limit - 3] + "..."
