"""A sliding window's padding as strips (:class:`PaddingStrips`): what the window modules
(:class:`~linop.frameworks.torch_pooling.MaxPool`, :class:`~linop.frameworks.torch_chain.ChainModule`)
set in place on every call, worked out once from a window's real entries (:func:`padding_strips`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import LayerError

__all__ = ["PaddingStrips", "padding_strips"]


@dataclass(frozen=True)
class PaddingStrips:
    """A window's padding as strips: per spatial axis, the number of padded entries before and
    after its real entries."""

    before: tuple[int, ...]
    after: tuple[int, ...]

    def fill_(self, window: torch.Tensor, value: float = float("-inf")) -> torch.Tensor:
        """Set ``window``'s strips to ``value`` (default ``-inf``) in place and return it."""
        spatial = len(self.before)
        for d, (low, high) in enumerate(zip(self.before, self.after)):
            axis = window.ndim - spatial + d
            if low:
                window.narrow(axis, 0, low).fill_(value)
            if high:
                window.narrow(axis, window.shape[axis] - high, high).fill_(value)
        return window


def padding_strips(real: np.ndarray, g: Sequence[int], what: str, *, empty: bool = False) -> PaddingStrips:
    """The strips of a window whose real spatial entries are ``real`` (a box: one range of
    entries per axis, the padding before and after it). ``empty``: a window with no real entry
    is all padding (a strip over all of it), as a chain's later stage with a wide padding can
    give an edge worker; else such a window is refused (a max over padding alone).

    Raises
    ------
    LayerError
        If the real entries are not a box (worker ``g``'s geometry would be inconsistent), or
        there are none and not ``empty``; the message starts with ``what`` (the module's name).
    """
    if empty and not real.any():
        return PaddingStrips((real.shape[0], *(0,) * (real.ndim - 1)), (0,) * real.ndim)
    before, after = [], []
    for d in range(real.ndim):
        along = real.any(axis=tuple(k for k in range(real.ndim) if k != d))
        entries = np.flatnonzero(along)
        if entries.size == 0:
            raise LayerError(f"{what}: worker {tuple(g)}'s window has no real entry along spatial axis {d}")
        before.append(int(entries[0]))
        after.append(real.shape[d] - int(entries[-1]) - 1)
    box = tuple(slice(low, n - high) for low, high, n in zip(before, after, real.shape))
    expected = np.zeros(real.shape, dtype=bool)
    expected[box] = True
    if not np.array_equal(real, expected):
        raise LayerError(f"{what}: worker {tuple(g)}'s real window entries are not a box")
    return PaddingStrips(tuple(before), tuple(after))
