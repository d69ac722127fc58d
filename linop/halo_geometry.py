"""Halo geometry of sliding-window kernels over distributed tensors (``docs/theory.md#halo-geometry``).

One function, :func:`halo_geometry`, serves every sliding-window kernel (convolution, pooling,
any stencil): it takes a :class:`~linop.partition.DistributedTensor` (balanced or not) and a
:class:`Kernel` (size, stride, padding, dilation and boundary mode per dimension) and returns,
for every worker and every dimension, a :class:`DimGeometry` row: the worker's output share, the
input range it needs, and how that range relates to the bulk it owns (halo, pad and trim widths).

Coordinates
-----------
For one dimension with global input length m, kernel size k, stride s, padding p and dilation d,
the output length is ``n = floor((m + 2p - d(k-1) - 1) / s) + 1``. Outputs are decomposed in
balanced blocks over the workers of that dimension (:func:`~linop.partition.balanced_sizes`). A
worker owning outputs ``[o0, o1)`` needs the input range (in unpadded global coordinates,
negative or >= m inside the padding)::

    need = [o0*s - p, (o1-1)*s - p + d(k-1) + 1)       (empty when o1 == o0)

Against its bulk ``[i0, i1)``::

    left halo  = max(0, i0 - max(need0, 0))     right halo = max(0, min(need1, m) - i1)
    left pad   = max(0, -need0)                 right pad  = max(0, need1 - m)
    left trim  = max(0, need0 - i0)             right trim = max(0, i1 - need1)

A worker without output gets the empty range ``need = [i0, i0)``: no halo, no pad, and its whole
bulk is trimmed (``right trim = i1 - i0``).

Local layout
------------
Each worker's *local* block spans, per dimension, the hull of its bulk and its needed range::

    local = [min(i0, need0), max(i1, need1))
          = [left pad | left halo | bulk | right halo | right pad]

and its *window* is the needed range, ``local[left trim : local size - right trim]``. A halo
exchange fills the halo (and, for the periodic and reflecting boundary modes, the pad) entries
that the window contains; entries of the layout that the window trims away are not exchanged.
With unbalanced shares the needed range may miss the bulk altogether (bulk ``[1, 3)``, need
``[4, 9)``): the halo on that side then also spans the entries between them (right halo 6), which
the trim on the other side drops again (left trim 3), so 5 entries are exchanged.

Boundary modes
--------------
``"zero"`` (default)
    Pad entries are zeros (numpy's ``mode="constant"``).
``"periodic"``
    Entry x is global entry ``x mod m`` (numpy's ``"wrap"``).
``"reflect"``
    Mirror about the edge entries, which are *not* repeated: ``-1 -> 1``, ``m -> m-2``; repeated
    for pads wider than the input (numpy's ``"reflect"``; PyTorch's ``"reflect"``).
``"symmetric"``
    Mirror about the edges, which *are* repeated: ``-1 -> 0``, ``m -> m-1`` (numpy's
    ``"symmetric"``).
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from .described import DescribedSequence, Offsets, TupleLike
from .errors import DecompositionError, HaloError, KernelError, OperandError
from .partition import DistributedTensor, balanced_sizes

__all__ = [
    "BOUNDARY_MODES",
    "Boundary",
    "DimGeometry",
    "HaloError",
    "HaloGeometry",
    "Kernel",
    "KernelError",
    "Fills",
    "Column",
    "GeometryRows",
    "Segment",
    "halo_geometry",
    "output_length",
    "source_index",
]

Boundary = Literal["zero", "periodic", "reflect", "symmetric"]
BOUNDARY_MODES: tuple[str, ...] = ("zero", "periodic", "reflect", "symmetric")
"""The boundary (padding) modes: zeros, numpy's "wrap", "reflect" and "symmetric"."""


# -- kernel parameters ------------------------------------------------------------------------
def _is_scalar(value: object) -> bool:
    """A kernel parameter given once for every dimension: a string or anything not iterable
    (valid or not; the entries are validated per dimension)."""
    if isinstance(value, str):
        return True
    try:
        iter(value)  # type: ignore[call-overload]
    except TypeError:
        return True
    return False


def _entries(value: object) -> tuple:
    """The entries of a kernel parameter: a scalar's one entry or a sequence's items."""
    return (value,) if _is_scalar(value) else tuple(value)  # type: ignore[arg-type]


def _per_dimension(value: object, ndim: int, what: str, leading: int) -> tuple:
    """Broadcast a scalar to ``ndim - leading`` dimensions or check a per-dimension list."""
    count = ndim - leading
    if _is_scalar(value):
        return (value,) * count
    values: tuple[object, ...] = tuple(value)  # type: ignore[arg-type]
    if len(values) != count:
        where = f" (after {leading} leading dimensions)" if leading else ""
        raise KernelError(f"kernel {what} has {len(values)} entries for {count} dimensions{where}: {values}")
    return values


@dataclass(frozen=True)
class Kernel:
    """Parameters of a sliding-window kernel: scalars apply to every dimension, or one per dimension.

    Parameters
    ----------
    size : int or sequence of int
        Kernel size k (>= 1).
    stride : int or sequence of int, optional
        Stride s (>= 1), default 1.
    padding : int or sequence of int, optional
        Padding p on both sides (>= 0), default 0.
    dilation : int or sequence of int, optional
        Dilation d (>= 1), default 1.
    boundary : str or sequence of str, optional
        How the padding is filled, one of :data:`BOUNDARY_MODES`; default ``"zero"``.
    leading : int, optional
        Number of leading dimensions (batch, channel) on which the kernel acts as the identity
        (size 1, stride 1, no padding); per-dimension lists then cover only the others.

    Raises
    ------
    KernelError
        When the kernel is resolved for a tensor rank (:meth:`resolve`, which
        :func:`halo_geometry` calls): a value out of range (size, stride or dilation below 1,
        negative padding), an unknown boundary mode, a per-dimension list of the wrong length,
        or more leading dimensions than the tensor has.

    Examples
    --------
    >>> Kernel(3, padding=1, leading=2).resolve(4).size
    (1, 1, 3, 3)
    >>> Kernel((3, 5), stride=2, boundary="periodic").resolve(2).padding
    (0, 0)
    >>> Kernel(0).resolve(1)
    Traceback (most recent call last):
    ...
    linop.errors.KernelError: kernel size in dimension 0 is 0; it must be >= 1
    """

    size: int | Sequence[int]
    stride: int | Sequence[int] = 1
    padding: int | Sequence[int] = 0
    dilation: int | Sequence[int] = 1
    boundary: str | Sequence[str] = "zero"
    leading: int = 0

    def resolve(self, ndim: int) -> Kernel:
        """The same kernel with one entry per dimension of a rank-``ndim`` tensor, validated.

        The leading dimensions become explicit identity entries (and ``leading`` 0), so resolving
        a resolved kernel again returns it unchanged.

        Raises
        ------
        KernelError
            If a per-dimension list has the wrong length, a size, stride or dilation is below 1,
            a padding is negative or a boundary mode is unknown (the message names the dimension).
        """
        try:
            if isinstance(self.leading, (bool, np.bool_)):
                raise TypeError
            leading = operator.index(self.leading)
        except TypeError:
            raise KernelError(
                f"the number of leading dimensions must be an integer, not {self.leading!r}"
            ) from None
        if not 0 <= leading <= ndim:
            raise KernelError(f"kernel has {leading} leading dimensions but the tensor has rank {ndim}")
        values = {}
        for what, identity in (
            ("size", 1),
            ("stride", 1),
            ("padding", 0),
            ("dilation", 1),
            ("boundary", "zero"),
        ):
            given = _per_dimension(getattr(self, what), ndim, what, leading)
            values[what] = (identity,) * leading + given
        for what, low in (("size", 1), ("stride", 1), ("dilation", 1), ("padding", 0)):
            checked = []
            for dim, v in enumerate(values[what]):
                try:
                    if isinstance(v, (bool, np.bool_)):
                        raise TypeError
                    v = operator.index(v)
                except TypeError:
                    raise KernelError(
                        f"kernel {what} in dimension {dim} must be an integer, not {v!r}"
                    ) from None
                if v < low:
                    raise KernelError(f"kernel {what} in dimension {dim} is {v}; it must be >= {low}")
                checked.append(v)
            values[what] = tuple(checked)
        for dim, mode in enumerate(values["boundary"]):
            if not isinstance(mode, str) or mode not in BOUNDARY_MODES:
                raise KernelError(f"boundary mode {mode!r} in dimension {dim} is not one of {BOUNDARY_MODES}")
        return Kernel(leading=0, **values)  # every dimension is now explicit

    @property
    def ndim(self) -> int:
        """Rank of the tensors the kernel fits: the leading dimensions plus the length of its
        per-dimension lists.

        Raises
        ------
        KernelError
            If every parameter is a scalar (the kernel fits any rank; see :meth:`resolve`).
        """
        for what in ("size", "stride", "padding", "dilation", "boundary"):
            value = getattr(self, what)
            if not _is_scalar(value):
                return operator.index(self.leading) + len(tuple(value))
        raise KernelError(f"{self} has no per-dimension list, so no rank; call resolve(ndim) first")

    def extent(self, dim: int) -> int:
        """Receptive field d(k-1)+1 of a resolved kernel in dimension ``dim``."""
        return self.dilation[dim] * (self.size[dim] - 1) + 1  # type: ignore[index]

    def __str__(self) -> str:
        parts = [f"size={self.size}"]
        for what, default in (
            ("stride", 1),
            ("padding", 0),
            ("dilation", 1),
            ("boundary", "zero"),
            ("leading", 0),
        ):
            value = getattr(self, what)
            if any(entry != default for entry in _entries(value)):
                parts.append(f"{what}={value}")
        return f"Kernel({', '.join(parts)})"


def output_length(length: int, size: int, stride: int = 1, padding: int = 0, dilation: int = 1) -> int:
    """Output length floor((m + 2p - d(k-1) - 1) / s) + 1 of a sliding window (0 if it does not fit).

    Raises
    ------
    KernelError
        If an argument is not an integer (bools are not), or the stride is below 1.
    """
    values = []
    for what, value in (
        ("length", length),
        ("size", size),
        ("stride", stride),
        ("padding", padding),
        ("dilation", dilation),
    ):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise KernelError(f"output_length: {what} must be an integer, not {value!r}")
        values.append(int(value))
    length, size, stride, padding, dilation = values
    if stride < 1:
        raise KernelError(f"output_length: stride must be >= 1, not {stride}")
    span = length + 2 * padding - dilation * (size - 1) - 1
    return span // stride + 1 if span >= 0 else 0


def source_index(x: int, length: int, boundary: str) -> int | None:
    """The global entry that padded coordinate ``x`` reads, or None for a zero pad entry.

    >>> [source_index(x, 3, "reflect") for x in range(-2, 5)]
    [2, 1, 0, 1, 2, 1, 0]
    """
    if 0 <= x < length:
        return x
    if boundary == "zero" or length == 0:
        return None
    if boundary == "periodic":
        return x % length
    if boundary == "reflect":
        if length == 1:
            return 0
        y = x % (2 * (length - 1))
        return y if y < length else 2 * (length - 1) - y
    if boundary == "symmetric":
        y = x % (2 * length)
        return y if y < length else 2 * length - 1 - y
    raise KernelError(f"unknown boundary mode {boundary!r}")


# -- geometry rows ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class DimGeometry:
    """One worker's halo geometry along one dimension (global coordinates, stops exclusive).

    Attributes
    ----------
    dim, index : int
        The tensor dimension and the worker's grid coordinate along it.
    length : int
        Global input length m of the dimension.
    output_start, output_stop : int
        The worker's share of the output, balanced over the dimension's workers.
    bulk_start, bulk_stop : int
        The input entries the worker owns.
    need_start, need_stop : int
        Input entries the worker's outputs read, padded coordinates (``[i0, i0)`` without output).
    left_halo, right_halo, left_pad, right_pad, left_trim, right_trim : int
        The widths of ``docs/theory.md#halo-geometry`` (see the module docstring; a halo counts
        the entries between the bulk and a needed range that misses it, which are trimmed, not
        exchanged).

    Examples
    --------
    >>> from linop import DistributedTensor, Kernel, Partition, halo_geometry
    >>> tensor = DistributedTensor("x", (11,), Partition((2,)))
    >>> row = halo_geometry(tensor, Kernel(5, stride=2, padding=1)).row((0,), 0)
    >>> (row.need_start, row.need_stop), (row.left_pad, row.right_halo)
    ((-1, 8), (1, 2))
    """

    dim: int
    index: int
    length: int
    output_start: int
    output_stop: int
    bulk_start: int
    bulk_stop: int
    need_start: int
    need_stop: int
    left_halo: int
    right_halo: int
    left_pad: int
    right_pad: int
    left_trim: int
    right_trim: int

    @property
    def has_output(self) -> bool:
        """True when the worker owns at least one output entry along this dimension."""
        return self.output_stop > self.output_start

    @property
    def local_start(self) -> int:
        """First padded coordinate of the local layout (hull of bulk and need)."""
        return min(self.bulk_start, self.need_start)

    @property
    def local_stop(self) -> int:
        """End of the local layout."""
        return max(self.bulk_stop, self.need_stop)

    @property
    def local_size(self) -> int:
        """left pad + left halo + bulk + right halo + right pad."""
        return self.local_stop - self.local_start

    @property
    def bulk_size(self) -> int:
        return self.bulk_stop - self.bulk_start

    @property
    def window_size(self) -> int:
        """Length of the window: local size minus both trims."""
        return self.need_stop - self.need_start

    def cells(self) -> tuple[str | int, ...]:
        """The row as the geometry's table shows it after the worker and the dimension: the
        output, bulk and need ranges, the halos, pads and trims (left, right), the local and
        window sizes."""
        return (
            f"[{self.output_start},{self.output_stop})",
            f"[{self.bulk_start},{self.bulk_stop})",
            f"[{self.need_start},{self.need_stop})" if self.has_output else "-",
            f"{self.left_halo},{self.right_halo}",
            f"{self.left_pad},{self.right_pad}",
            f"{self.left_trim},{self.right_trim}",
            self.local_size,
            self.window_size,
        )

    def local(self, start: int, stop: int) -> slice:
        """Local positions of the global (padded) range [start, stop)."""
        return slice(start - self.local_start, stop - self.local_start)

    @property
    def bulk(self) -> slice:
        """Local positions of the bulk."""
        return self.local(self.bulk_start, self.bulk_stop)

    @property
    def window(self) -> slice:
        """Local positions of the window: ``left_trim : local_size - right_trim``."""
        return self.local(self.need_start, self.need_stop)

    @classmethod
    def build(
        cls, dim: int, index: int, length: int, output: tuple[int, int], bulk: tuple[int, int], kernel: Kernel
    ) -> DimGeometry:
        """The row of ``docs/theory.md#halo-geometry`` for one worker and dimension of a resolved kernel."""
        (o0, o1), i0 = output, bulk[0]
        s, p = kernel.stride[dim], kernel.padding[dim]  # type: ignore[index]
        if o1 > o0:
            n0, n1 = o0 * s - p, (o1 - 1) * s - p + kernel.extent(dim)
        else:
            n0 = n1 = i0
        return cls.of_need(dim, index, length, output, bulk, (n0, n1))

    @classmethod
    def of_need(
        cls,
        dim: int,
        index: int,
        length: int,
        output: tuple[int, int],
        bulk: tuple[int, int],
        need: tuple[int, int],
    ) -> DimGeometry:
        """The row of a worker owning the inputs ``bulk`` and the outputs ``output`` that needs
        the global (padded) range ``need`` (``[i0, i0)`` when the output is empty): its halos,
        pads and trims, the widths of ``docs/theory.md#halo-geometry``."""
        (o0, o1), (i0, i1), (n0, n1) = output, bulk, need
        m = length
        return cls(
            dim=dim,
            index=index,
            length=m,
            output_start=o0,
            output_stop=o1,
            bulk_start=i0,
            bulk_stop=i1,
            need_start=n0,
            need_stop=n1,
            left_halo=max(0, i0 - max(n0, 0)) if o1 > o0 else 0,
            right_halo=max(0, min(n1, m) - i1) if o1 > o0 else 0,
            left_pad=max(0, -n0),
            right_pad=max(0, n1 - m),
            left_trim=max(0, n0 - i0),
            right_trim=max(0, i1 - n1),
        )


class GeometryRows(DescribedSequence[DimGeometry]):
    """The rows of one dimension, ``rows[g]`` for every grid coordinate g along it, described
    by the dimension's input and output offsets rather than listed.

    A row is built (:meth:`DimGeometry.build`) when first asked for and kept, so that a rank
    planning its part of a grid of a million workers builds its own and its neighbours' rows
    only. Equal to another :class:`GeometryRows` of the same description, and to any sequence
    holding the same rows.

    Parameters
    ----------
    dim : int
        The tensor dimension.
    length : int
        Global input length m of the dimension.
    kernel : Kernel
        The resolved kernel.
    output_sizes, input_sizes : sequence of int
        The output's and the input's shares over the dimension's workers (as many of each).
    """

    __slots__ = (
        "_built",
        "_key",
        "_len",
        "dim",
        "input_offsets",
        "input_sizes",
        "kernel",
        "length",
        "output_offsets",
        "output_sizes",
    )
    _MISSING = "geometry row {position} of a dimension of {length} workers"

    def __init__(
        self, dim: int, length: int, kernel: Kernel, output_sizes: Sequence[int], input_sizes: Sequence[int]
    ) -> None:
        if len(output_sizes) != len(input_sizes):
            raise DecompositionError(
                f"dimension {dim}: {len(output_sizes)} output shares for {len(input_sizes)} input shares"
            )
        self.dim = dim
        self.length = length
        self.kernel = kernel
        self.output_sizes, self.input_sizes = tuple(output_sizes), tuple(input_sizes)
        self.output_offsets = Offsets(self.output_sizes, total=True)
        self.input_offsets = Offsets(self.input_sizes, total=True)
        self._len = len(input_sizes)
        self._built: dict[int, DimGeometry] = {}
        self._key: tuple | None = None

    def _at(self, position: int) -> DimGeometry:
        row = self._built.get(position)
        if row is None:
            out, inp = self.output_offsets, self.input_offsets
            row = self._built[position] = DimGeometry.build(
                self.dim,
                position,
                self.length,
                (out[position], out[position + 1]),
                (inp[position], inp[position + 1]),
                self.kernel,
            )
        return row

    @property
    def stride(self) -> int:
        return self.kernel.stride[self.dim]  # type: ignore[index]

    @property
    def padding(self) -> int:
        return self.kernel.padding[self.dim]  # type: ignore[index]

    @property
    def extent(self) -> int:
        return self.kernel.extent(self.dim)

    def key(self) -> tuple:
        """What the rows are built from: dimension, length, stride, padding, extent and the
        output's and input's shares (two rows objects with equal keys hold equal rows)."""
        if self._key is None:
            self._key = (
                self.dim,
                self.length,
                self.stride,
                self.padding,
                self.extent,
                self.output_sizes,
                self.input_sizes,
            )
        return self._key

    def description(self) -> bytes:
        """The key as bytes, for :func:`linop.program.fingerprint` (the shares as one buffer
        each; beyond int64 as text)."""
        head = f"GeometryRows{self.key()[:5]}".encode()
        try:
            outputs = np.asarray(self.output_sizes, dtype=np.int64).tobytes()
            inputs = np.asarray(self.input_sizes, dtype=np.int64).tobytes()
            return head + outputs + b"|" + inputs
        except OverflowError:
            return head + repr(self.key()[5:]).encode()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, GeometryRows):
            return self is other or self.key() == other.key()
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.key())

    def __repr__(self) -> str:
        return f"GeometryRows(dim={self.dim}, length={self.length}, {self._len} workers)"

    def __reduce__(self) -> tuple:
        return (GeometryRows, (self.dim, self.length, self.kernel, self.output_sizes, self.input_sizes))

    def width(self, position: int, name: str) -> int:
        """One width of the row at ``position`` (``"local_size"``, ``"window_size"`` or
        ``"output_size"``), from the offsets, without building the row."""
        out, inp = self.output_offsets, self.input_offsets
        o0, o1, i0, i1 = out[position], out[position + 1], inp[position], inp[position + 1]
        if name == "output_size":
            return o1 - o0
        s, p, e = self.stride, self.padding, self.extent
        n0, n1 = (o0 * s - p, (o1 - 1) * s - p + e) if o1 > o0 else (i0, i0)
        return max(i1, n1) - min(i0, n0) if name == "local_size" else n1 - n0

    def column(self, name: str) -> Sequence[int]:
        """One width of every row (``"local_size"``, ``"window_size"`` or ``"output_size"``):
        the output's shares, or a :class:`Column` computing each width when asked for."""
        if name == "output_size":
            return self.output_sizes
        if name not in ("local_size", "window_size"):
            raise HaloError(f"no column {name!r} of a halo geometry (local_size, window_size, output_size)")
        return Column(self, name)

    def owners(self) -> tuple[Sequence[int], Sequence[int]]:
        """The coordinates that own input (a non-empty bulk) and where their bulks start
        (described when every coordinate owns some: a range and the offsets)."""
        if 0 not in self.input_sizes:
            return range(self._len), Offsets(self.input_sizes)
        inp = self.input_offsets
        found = [h for h in range(self._len) if inp[h + 1] > inp[h]]
        return found, [inp[h] for h in found]

    def readers(self, start: int, stop: int, boundary: str) -> range | list[int]:
        """Coordinates whose window may read the global entries ``[start, stop)``: a superset
        of those whose fill segments read them (callers check each candidate's fills).

        A window ``[n0, n1)`` reads its in-range entries where they are, and (unless the
        boundary is zero) its pad entries, outside ``[0, m)``, from anywhere. The windows'
        starts and stops grow with the coordinate (``n0 = o0*s - p``, ``n1 = (o1-1)*s - p +
        e``), so the windows that meet ``[start, stop)`` are one range of coordinates, and so
        are those padding before 0 and those padding beyond m: found by bisection on the
        output offsets, at any number of workers.
        """
        s, p, e, m = self.stride, self.padding, self.extent, self.length
        out, n = self.output_offsets, self._len
        # n0(h) < stop   <=>  out[h] < ceil((stop + p) / s)
        # n1(h) > start  <=>  out[h + 1] > floor((start + p - e) / s) + 1
        # (each bound widened by one coordinate: the callers' check is exact)
        low = bisect.bisect_right(out, (start + p - e) // s + 1) - 1
        high = bisect.bisect_left(out, -(-(stop + p) // s))
        found = range(max(0, low - 1), min(n, high + 1))
        if boundary == "zero":
            return found
        before = range(0, min(n, bisect.bisect_left(out, -(-p // s)) + 1))  # n0(h) < 0
        after = range(max(0, bisect.bisect_right(out, (m + p - e) // s + 1) - 2), n)  # n1(h) > m
        return sorted(set(found) | set(before) | set(after))


class Column(TupleLike[int]):
    """One width of every row of a dimension (:meth:`GeometryRows.column`), each computed
    from the offsets when asked for: the extents of a halo's local and window spaces, in O(1)
    memory. Equal to, and hashed and printed as, the tuple of its entries."""

    __slots__ = ("_len", "_name", "_rows")
    _MISSING = "width {position} of a dimension of {length} workers"

    def __init__(self, rows: GeometryRows, name: str) -> None:
        self._rows, self._name, self._len = rows, name, len(rows)

    def _at(self, position: int) -> int:
        return self._rows.width(position, self._name)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Column) and other._name == self._name and other._rows == self._rows:
            return True  # the same widths of equal rows (compared by their shares, not listed)
        return super().__eq__(other)

    __hash__ = TupleLike.__hash__  # defining __eq__ resets it


class _DimFills(DescribedSequence["Fills"]):
    """``geometry.fills[dim]``: the fill segments of every coordinate along ``dim``, each
    computed when first asked for and kept."""

    __slots__ = ("_built", "_dim", "_geometry", "_len", "_owners")
    _MISSING = "fills of coordinate {position} of a dimension of {length} workers"

    def __init__(self, geometry: HaloGeometry, dim: int) -> None:
        self._geometry = geometry
        self._dim = dim
        self._len = len(geometry.rows[dim])
        self._built: dict[int, Fills] = {}
        self._owners: tuple[Sequence[int], Sequence[int]] | None = None

    def _at(self, position: int) -> Fills:
        fills = self._built.get(position)
        if fills is None:
            geometry, dim = self._geometry, self._dim
            rows = geometry.rows[dim]
            if self._owners is None:
                self._owners = rows.owners() if isinstance(rows, GeometryRows) else _owners(rows)
            fills = self._built[position] = _fill_segments(
                rows,
                position,
                geometry.kernel.boundary[dim],
                geometry.data_range(dim, position),
                self._owners,
            )
        return fills

    def __repr__(self) -> str:
        return f"fills of dimension {self._dim} ({self._len} workers)"


def _column(rows: Sequence[DimGeometry], name: str) -> Sequence[int]:
    """One width of every row of a dimension (see :meth:`GeometryRows.column`)."""
    if isinstance(rows, GeometryRows):
        return rows.column(name)
    if name == "output_size":
        return tuple(r.output_stop - r.output_start for r in rows)
    return tuple(getattr(r, name) for r in rows)


@dataclass(frozen=True, slots=True)
class Segment:
    """A run of local positions of a receiving worker, filled from one owner along one dimension.

    Positions ``[dst_start, dst_start + size)`` of the receiver's local layout read positions
    ``[src_start, src_start + size)`` of the local layout of the worker with grid coordinate
    ``owner`` along the same dimension (inside that owner's bulk).
    """

    dst_start: int
    size: int
    owner: int
    src_start: int


_COLUMNS = (
    ("worker", 6),
    ("dim", 3),
    ("output", 11),
    ("bulk", 11),
    ("need", 11),
    ("halo", 7),
    ("pad", 7),
    ("trim", 7),
    ("local", 5),
    ("window", 6),
)


@dataclass(frozen=True)
class HaloGeometry:
    """Halo geometry of a kernel over a distributed tensor: one :class:`DimGeometry` per worker
    and dimension. Build it with :func:`halo_geometry`; ``print(geometry)`` shows the table.

    Parameters
    ----------
    tensor, kernel, output_shape, rows
        As the attributes below; :func:`halo_geometry` computes them.

    Attributes
    ----------
    tensor : DistributedTensor
        The input tensor (its blocks are the bulks).
    kernel : Kernel
        The kernel, resolved to one entry per dimension.
    output_shape : tuple of int
        Global output shape.
    rows : tuple of GeometryRows
        ``rows[dim][g]``: the row of the workers with grid coordinate g along ``dim``
        (:class:`GeometryRows`: described by the dimension's offsets, each row built when
        asked for).
    fills : tuple of sequences of Fills
        ``fills[dim][g]`` (a sequence of :class:`Segment`, in closed form): the runs of the
        window outside the bulk that are filled from owners (halo entries, and pad entries
        unless the boundary is zero), along ``dim``; derived from the rows and the boundary
        modes, each computed when first asked for (a rank reads only its neighbours').
    """

    tensor: DistributedTensor
    kernel: Kernel
    output_shape: tuple[int, ...]
    rows: tuple[Sequence[DimGeometry], ...]
    fills: tuple[Sequence[Fills], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        fills = tuple(_DimFills(self, dim) for dim in range(len(self.rows)))
        object.__setattr__(self, "fills", fills)

    @property
    def ndim(self) -> int:
        return self.tensor.ndim

    def row(self, index: Sequence[int], dim: int) -> DimGeometry:
        """The row of the worker at grid ``index`` along ``dim``."""
        return self.rows[dim][index[dim]]

    def worker_rows(self, index: Sequence[int]) -> tuple[DimGeometry, ...]:
        """The rows of the worker at grid ``index``, one per dimension."""
        return tuple(self.rows[d][i] for d, i in enumerate(index))

    def local_shape(self, index: Sequence[int]) -> tuple[int, ...]:
        """Shape of the worker's local (pad + halo + bulk) block."""
        return tuple(r.local_size for r in self.worker_rows(index))

    def window_shape(self, index: Sequence[int]) -> tuple[int, ...]:
        """Shape of the worker's window (extent 0 along a dimension where it has no output)."""
        return tuple(r.window_size for r in self.worker_rows(index))

    @property
    def output_sizes(self) -> tuple[tuple[int, ...], ...]:
        """The output's shares per dimension, one per worker along it (the ``sizes`` of a
        :class:`~linop.partition.DistributedTensor` of the output on the input's partition)."""
        return tuple(tuple(self.column(dim, "output_size")) for dim in range(self.ndim))

    def column(self, dim: int, name: str) -> Sequence[int]:
        """One width of every row along ``dim``, in grid order: ``"local_size"``,
        ``"window_size"`` or ``"output_size"`` (computed from the offsets, no row built; a
        sequence equal to the tuple of the widths)."""
        return _column(self.rows[dim], name)

    def fill_readers(self, dim: int, owner: int) -> list[int]:
        """The coordinates along ``dim`` whose fill segments read from coordinate ``owner``
        (sorted): found among the candidates of :meth:`GeometryRows.readers`, so that the
        cost is the owner's neighbours, not the dimension's workers."""
        rows = self.rows[dim]
        if not isinstance(rows, GeometryRows):
            candidates: Sequence[int] = range(len(rows))
        else:
            row = rows[owner]
            if row.bulk_size == 0:
                return []
            candidates = rows.readers(row.bulk_start, row.bulk_stop, self.kernel.boundary[dim])
        fills = self.fills[dim]
        return [h for h in candidates if owner in fills[h].owners()]

    def output_box(self, index: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The worker's share of the global output."""
        rows = self.worker_rows(index)
        return tuple(r.output_start for r in rows), tuple(r.output_stop for r in rows)

    def data_range(self, dim: int, g: int) -> slice:
        """Local positions of the window that hold data after an exchange: the window, minus
        the zero pads when the boundary is zero; empty without output."""
        r = self.rows[dim][g]
        if not r.has_output:
            return slice(r.bulk.start, r.bulk.start)
        if self.kernel.boundary[dim] == "zero":
            start, stop = max(r.need_start, 0), min(r.need_stop, r.length)
            if stop <= start:
                return slice(r.bulk.start, r.bulk.start)
            return r.local(start, stop)
        return r.window

    def table(self) -> str:
        """The geometry as a text table: one line per worker and dimension."""
        header = "  ".join(name.rjust(width) for name, width in _COLUMNS)
        lines = [f"halo geometry of {self.kernel} over {self.tensor}", header]
        for index in self.tensor.partition.indices():
            worker = self.tensor.partition.worker(index)
            for r in self.worker_rows(index):
                cells = (worker, r.dim, *r.cells())
                lines.append("  ".join(str(c).rjust(w) for c, (_, w) in zip(cells, _COLUMNS)))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def _repr_html_(self) -> str:
        """Jupyter: :meth:`table` as HTML (see :mod:`linop.display`)."""
        from .display import geometry_html

        return geometry_html(self)


class Fills(Sequence[Segment]):
    """The fill segments of one receiver along one dimension, held in closed form.

    A periodic or reflecting boundary repeats the same runs every period of the padded
    coordinate (m for periodic, 2(m-1) for reflect, 2m for symmetric), so the runs are kept as
    ``(pattern, repeats, stride)`` parts: ``pattern`` (a tuple of segments) occurs ``repeats``
    times, each time ``stride`` positions further. Building costs O(m + owners) per part
    whatever the padding; iterating yields the segments one by one, and indexing finds one in
    O(parts). It compares equal to the tuple of its segments.
    """

    __slots__ = ("_length", "_parts")

    def __init__(self, parts: Sequence[tuple[tuple[Segment, ...], int, int]] = ()) -> None:
        self._parts = tuple(p for p in parts if p[0] and p[1] > 0)
        self._length = sum(len(pattern) * repeats for pattern, repeats, _ in self._parts)

    def __len__(self) -> int:
        return self._length

    def __iter__(self):
        for pattern, repeats, stride in self._parts:
            if stride == 0 or repeats == 1:
                for _ in range(repeats):
                    yield from pattern
                continue
            for k in range(repeats):
                shift = k * stride
                for seg in pattern:
                    yield Segment(seg.dst_start + shift, seg.size, seg.owner, seg.src_start)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return tuple(self)[index]
        i = operator.index(index)
        if i < 0:
            i += self._length
        if not 0 <= i < self._length:
            raise IndexError(f"fill segment {index} of {self._length}")
        for pattern, repeats, stride in self._parts:
            count = len(pattern) * repeats
            if i < count:
                k, j = divmod(i, len(pattern))
                seg = pattern[j]
                return Segment(seg.dst_start + k * stride, seg.size, seg.owner, seg.src_start)
            i -= count
        raise AssertionError("unreachable")  # pragma: no cover

    def owners(self) -> frozenset[int]:
        """The owners the segments read from (non-empty segments only), from the parts: a
        repeated pattern is read once."""
        return frozenset(seg.owner for pattern, _, _ in self._parts for seg in pattern if seg.size)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (Fills, tuple, list)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        if self._length <= 8:
            return f"Fills({tuple(self)!r})"
        return f"Fills({self._length} segments in {len(self._parts)} parts)"


def _period(length: int, boundary: str) -> int:
    """The period of :func:`source_index` in the padded coordinate (0: none, zero boundary)."""
    if boundary == "zero" or length == 0:
        return 0
    if boundary == "periodic":
        return length
    if boundary == "reflect":
        return 2 * (length - 1) if length > 1 else 1
    return 2 * length  # symmetric


class _Runs:
    """Builds segments from runs of sources, merging as the per-position rule did: a segment
    grows while the owner stays, and destinations and sources both advance by one."""

    def __init__(
        self,
        rows: Sequence[DimGeometry],
        local_start: int,
        owners: tuple[Sequence[int], Sequence[int]] | None = None,
    ) -> None:
        self.rows = rows
        self.owners, self.starts = _owners(rows) if owners is None else owners
        self.local_start = local_start
        self.out: list[Segment] = []

    def _push(self, position: int, size: int, h: int, src: int) -> None:
        if self.out:
            last = self.out[-1]
            if (
                last.owner == h
                and last.dst_start + last.size == position
                and last.src_start + last.size == src
            ):
                self.out[-1] = Segment(last.dst_start, last.size + size, h, last.src_start)
                return
        self.out.append(Segment(position, size, h, src))

    def increasing(self, x0: int, s0: int, count: int) -> None:
        """Padded coordinates x0 .. x0+count-1 read sources s0 .. s0+count-1, split by owner."""
        x, s, left = x0, s0, count
        while left > 0:
            at = bisect.bisect_right(self.starts, s) - 1
            h = self.owners[at]
            stop = self.rows[h].bulk_stop
            size = min(left, stop - s)
            self._push(x - self.local_start, size, h, s - self.rows[h].local_start)
            x, s, left = x + size, s + size, left - size

    def decreasing(self, x0: int, s0: int, count: int) -> None:
        """Padded coordinates x0 .. read sources s0, s0-1, ...: runs of one entry."""
        for j in range(count):
            s = s0 - j
            h = self.owners[bisect.bisect_right(self.starts, s) - 1]
            self._push(x0 + j - self.local_start, 1, h, s - self.rows[h].local_start)

    def interval(self, x0: int, x1: int, length: int, boundary: str) -> None:
        """The padded coordinates [x0, x1) (no period boundary inside for non-zero modes)."""
        if x1 <= x0:
            return
        period = _period(length, boundary)
        if period == 0:
            lo, hi = max(x0, 0), min(x1, length)
            if hi > lo:
                self.increasing(lo, lo, hi - lo)
            return
        base = (x0 // period) * period
        y0, y1 = x0 - base, x1 - base  # 0 <= y0 < y1 <= period
        up = min(y1, length)  # sources y for y < length
        if y0 < up:
            self.increasing(base + y0, y0, up - y0)
        if y1 > length:  # the mirrored half of reflect and symmetric
            first = max(y0, length)
            mirror = 2 * (length - 1) if boundary == "reflect" else 2 * length - 1
            self.decreasing(base + first, mirror - first, y1 - first)

    def span(self, x0: int, x1: int, length: int, boundary: str) -> None:
        """The padded coordinates [x0, x1), split at period boundaries (explicitly)."""
        period = _period(length, boundary)
        if period == 0:
            self.interval(x0, x1, length, boundary)
            return
        x = x0
        while x < x1:
            end = min(x1, (x // period + 1) * period)
            self.interval(x, end, length, boundary)
            x = end


def _owners(rows: Sequence[DimGeometry]) -> tuple[Sequence[int], Sequence[int]]:
    """The coordinates that own input along a dimension, and where their bulks start."""
    owners = [h for h, r in enumerate(rows) if r.bulk_size]
    return owners, [rows[h].bulk_start for h in owners]


def _fill_segments(
    rows: Sequence[DimGeometry],
    g: int,
    boundary: str,
    data: slice,
    owners: tuple[Sequence[int], Sequence[int]] | None = None,
) -> Fills:
    """Runs of the receiver's window positions outside its bulk, grouped by owner, with
    consecutive increasing sources (reflected runs become runs of one entry), in closed form:
    whole periods of a wrapping boundary become one repeated part."""
    me = rows[g]
    m, local = me.length, me.local_start
    bulk = me.bulk
    pieces = (
        (data.start + local, min(data.stop, bulk.start) + local),
        (max(data.start, bulk.stop) + local, data.stop + local),
    )
    period = _period(m, boundary)
    parts: list[tuple[tuple[Segment, ...], int, int]] = []
    owners = _owners(rows) if owners is None else owners
    runs = _Runs(rows, local, owners)
    for x0, x1 in pieces:
        if x1 <= x0:
            continue
        first_full = -(-x0 // period) * period if period else x1
        repeats = (x1 - first_full) // period if period and first_full < x1 else 0
        if repeats < 3:  # short: every period explicitly
            runs.span(x0, x1, m, boundary)
            continue
        runs.span(x0, first_full, m, boundary)
        head = tuple(runs.out)
        pattern_runs = _Runs(rows, local, owners)
        pattern_runs.span(first_full, first_full + period, m, boundary)
        pattern = tuple(pattern_runs.out)
        # No segment merges across a period boundary: the source jumps back there (periodic
        # m-1 -> 0, reflect 1 -> 0, symmetric 0 -> 0), so head, repeated pattern and tail are
        # independent runs.
        parts.append((head, 1, 0))
        parts.append((pattern, repeats, period))
        runs = _Runs(rows, local, owners)
        runs.span(first_full + repeats * period, x1, m, boundary)
    parts.append((tuple(runs.out), 1, 0))
    return Fills(parts)


def halo_geometry(
    tensor: DistributedTensor,
    kernel: Kernel | int,
    *,
    output_sizes: Sequence[Sequence[int] | None] | None = None,
) -> HaloGeometry:
    """The halo geometry of a sliding-window kernel over a distributed tensor.

    Parameters
    ----------
    tensor : DistributedTensor
        The input, balanced or not; its partition also carries the output, decomposed in
        balanced blocks unless ``output_sizes`` says otherwise.
    kernel : Kernel or int
        The kernel (an int is a kernel of that size, no padding, stride 1).
    output_sizes : sequence, optional
        One entry per dimension: None (the output's balanced shares) or the output's explicit
        shares over that dimension's workers (adding up to the output length). A layer passes
        the input's own shares for the dimensions its kernel leaves alone (the channels), so
        that an unbalanced channel decomposition stays where it is (no halo along it).

    Raises
    ------
    TypeError
        If ``tensor`` is not a :class:`~linop.partition.DistributedTensor`.
    KernelError
        If the kernel parameters are invalid, or the kernel's extent d(k-1)+1 exceeds the
        padded input m + 2p in some dimension (the message names it).
    HaloError
        If a periodic or reflecting boundary must wrap a dimension of length 0.
    DecompositionError
        If ``output_sizes`` has the wrong number of dimensions, or explicit shares that are
        not integers, have the wrong count, are negative or do not add up to the output length.

    Examples
    --------
    The worked example of ``docs/theory.md#halo-geometry``: 10 entries on 3 workers, a kernel
    of size 2 and stride 2 (5 outputs, split 2, 2, 1; inputs split 4, 3, 3).

    >>> from linop import DistributedTensor, Kernel, Partition, halo_geometry
    >>> tensor = DistributedTensor("x", (10,), Partition((3,)))
    >>> geometry = halo_geometry(tensor, Kernel(2, stride=2))
    >>> geometry.output_shape
    (5,)
    >>> row = geometry.row((1,), 0)
    >>> (row.need_start, row.need_stop), row.right_halo
    ((4, 8), 1)
    >>> last = geometry.row((2,), 0)
    >>> (last.need_start, last.need_stop), last.left_trim, geometry.local_shape((2,))
    ((8, 10), 1, (3,))
    >>> print(geometry)  # doctest: +NORMALIZE_WHITESPACE
    halo geometry of Kernel(size=(2,), stride=(2,)) over x[10] on P(3,)[0, 1, 2]
    worker  dim       output         bulk         need     halo      pad     trim  local  window
         0    0        [0,2)        [0,4)        [0,4)      0,0      0,0      0,0      4       4
         1    0        [2,4)        [4,7)        [4,8)      0,1      0,0      0,0      4       4
         2    0        [4,5)       [7,10)       [8,10)      0,0      0,0      1,0      3       2
    """
    if not isinstance(tensor, DistributedTensor):
        raise OperandError(f"halo_geometry: tensor must be a DistributedTensor, not {type(tensor).__name__}")
    if not isinstance(kernel, Kernel):
        kernel = Kernel(kernel)
    kernel = kernel.resolve(tensor.ndim)
    rows: list[GeometryRows] = []
    output_shape = []
    for dim, m in enumerate(tensor.global_shape):
        k, s, p, d = (getattr(kernel, a)[dim] for a in ("size", "stride", "padding", "dilation"))
        extent = kernel.extent(dim)
        if extent > m + 2 * p and m + 2 * p > 0:  # an empty padded input gives an empty output
            raise KernelError(
                f"dimension {dim}: the kernel's extent {extent} (size {k}, dilation {d}) is larger than "
                f"the padded input {m} + 2*{p} = {m + 2 * p}"
            )
        boundary = kernel.boundary[dim]
        if boundary != "zero" and m == 0 and p > 0:
            raise HaloError(f"dimension {dim}: the {boundary} boundary cannot pad an input of length 0")
        output_shape.append(output_length(m, k, s, p, d))
    shares = _output_shares(tensor, tuple(output_shape), output_sizes)
    for dim, (m, sizes) in enumerate(zip(tensor.global_shape, tensor.sizes)):
        rows.append(GeometryRows(dim, m, kernel, shares[dim], sizes))
    return HaloGeometry(tensor, kernel, tuple(output_shape), tuple(rows))


def _output_shares(
    tensor: DistributedTensor, lengths: tuple[int, ...], given: Sequence[Sequence[int] | None] | None
) -> tuple[tuple[int, ...], ...]:
    """The output's shares per dimension (``lengths`` the output shape): balanced, or the
    explicit ones of ``given`` (validated as a decomposition of the output over the tensor's
    partition)."""
    counts = tensor.partition.shape
    if given is None:
        return tuple(balanced_sizes(n, p) for n, p in zip(lengths, counts))
    if isinstance(given, (str, bytes)) or not isinstance(given, Sequence) or len(given) != tensor.ndim:
        raise DecompositionError(
            f"halo_geometry: output_sizes must give one entry (None or shares) for each of the "
            f"{tensor.ndim} dimensions of {tensor.name!r}, not {given!r}"
        )
    # validated by the decomposition below, whatever the caller gave
    sizes: Any = tuple(
        balanced_sizes(n, p) if entry is None else entry for n, p, entry in zip(lengths, counts, given)
    )
    # the checks of a decomposition (integers, one per worker, non-negative, adding up)
    return DistributedTensor(f"{tensor.name}_output", lengths, tensor.partition, sizes=sizes).sizes
