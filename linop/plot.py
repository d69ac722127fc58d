"""Pictures of operators, decompositions and schedules (matplotlib, the ``plot`` extra).

:func:`spy`
    The exact matrix of an operator next to the matrix of its adjoint, with the block boundaries
    drawn and the blocks named; entries where ``op.H`` differs from ``conj(op)^T`` are marked,
    so a wrong backward pass shows *where* it is wrong (``docs/theory.md#adjoint-test``).
:func:`decomposition`
    A distributed tensor's decomposition per dimension: each grid coordinate's bulk, and for a
    halo geometry its halo (coloured by the worker it comes from), pads, trims and window
    (``docs/theory.md#halo-geometry``). Unbalanced shares and halos that reach past the nearest
    neighbour (several hops away) are visible as such.
:func:`messages`
    Who sends to whom in each communication phase of the MPI schedule
    (:func:`linop.program.compile_program`), with the entries each message moves;
    a native collective is drawn as one band over its workers. :func:`schedule_messages` gives
    the same as data.

Every function returns a :class:`matplotlib.figure.Figure` (shown as a PNG in Jupyter) and
draws nothing on screen by itself, nor touches pyplot's global state; the artists carry a ``gid`` naming what they show (``"block-boundary"``,
``"wrong-entry"``, ``"bulk"``, ``"halo"``, ``"pad"``, ``"trim"``, ``"window"``,
``"message"``, ``"collective"``), so a figure can be inspected as well as looked at.
"""

from __future__ import annotations

import functools
import io
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import OperandError, PlotError
from .halo_geometry import HaloGeometry
from .operator import LinearOperator
from .partition import DistributedTensor

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "DENSE_LIMIT",
    "SPY_LIMIT",
    "Communication",
    "PlotError",
    "decomposition",
    "messages",
    "schedule_messages",
    "spy",
]

DENSE_LIMIT = 600
"""Largest matrix side drawn entry by entry as an image; larger matrices are drawn as markers."""

SPY_LIMIT = 1_000_000
"""Largest matrix side :func:`spy` draws: beyond it the exact matrix takes seconds to minutes to
build and its markers cover the picture. The size is checked before anything is built."""


@functools.cache
def _pyplot() -> Any:
    """The figure class: a matplotlib Figure that Jupyter shows as a PNG (``_repr_png_``) without
    pyplot's global state (no figure is left open, no backend is chosen)."""
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:  # pragma: no cover - the plot extra is installed by make
        raise ImportError("linop.plot needs matplotlib: pip install 'linop-adjoint[plot]'") from exc

    class Picture(Figure):
        """A Figure with a PNG repr for Jupyter."""

        def _repr_png_(self) -> bytes:
            buffer = io.BytesIO()
            self.savefig(buffer, format="png", dpi=100)
            return buffer.getvalue()

    return Picture


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _fitted(text: str, width: float, fontsize: float = 9) -> str:
    """``text`` with each line wrapped to a figure ``width`` inches wide at ``fontsize``
    points (a character is about 0.6 em wide), so that a title is never cut at the edges."""
    columns = max(20, int(width * 72 / (0.62 * fontsize)) - 2)
    return "\n".join(textwrap.fill(line, columns) for line in text.split("\n"))


def _colour(index: int) -> Any:
    from matplotlib import colormaps

    return colormaps["tab10"](index % 10)


# -- spy plots -----------------------------------------------------------------------------------
def _draw_matrix(ax: Axes, matrix: Any, rows: Sequence[Any], columns: Sequence[Any], title: str) -> None:
    """One matrix with block boundaries (lines) and block names (ticks at block centres)."""
    m, n = matrix.shape
    if max(m, n) <= DENSE_LIMIT:
        dense = matrix.toarray()
        if np.iscomplexobj(dense):
            dense = np.abs(dense)
        top = float(np.abs(dense).max()) or 1.0
        image = ax.imshow(
            dense.real, cmap="RdBu_r", vmin=-top, vmax=top, interpolation="nearest", aspect="equal"
        )
        _colour_key(ax, image, dense, top)
    else:
        ax.spy(matrix, markersize=max(0.5, 200 / max(m, n)), color="black")
    ax.set_xlim(-0.5, n - 0.5)
    ax.set_ylim(m - 0.5, -0.5)
    for offsets, horizontal in (
        (np.cumsum([b.size for b in rows]), True),
        (np.cumsum([b.size for b in columns]), False),
    ):
        for edge in offsets[:-1]:
            line = (ax.axhline if horizontal else ax.axvline)(edge - 0.5, color="0.35", linewidth=0.8)
            line.set_gid("block-boundary")
    for blocks, setter, labeller in (
        (rows, ax.set_yticks, ax.set_yticklabels),
        (columns, ax.set_xticks, ax.set_xticklabels),
    ):
        starts = np.cumsum([0] + [b.size for b in blocks])
        setter([(a + b - 1) / 2 for a, b in zip(starts[:-1], starts[1:])])
        labeller([b.name for b in blocks], fontsize=8)
    for label in ax.get_xticklabels():
        label.set_rotation(60 if len(columns) > 3 else 0)
    ax.set_title(title, fontsize=9)


def _colour_key(ax: Axes, image: Any, dense: np.ndarray, top: float) -> None:
    """A colour bar beside ``ax`` (gid ``"colour-key"``); integer-valued matrices get integer
    ticks (every value from -top to top when there are few, else a handful)."""
    from matplotlib.ticker import MaxNLocator

    bar = ax.figure.colorbar(image, ax=ax, shrink=0.6, pad=0.02)
    bar.ax.set_gid("colour-key")
    bar.ax.tick_params(labelsize=7)
    if np.array_equal(dense, np.round(dense)):
        bar.locator = MaxNLocator(nbins=min(int(2 * top), 8), integer=True)
        bar.update_ticks()


def spy(op: LinearOperator, *, adjoint: bool = True, figsize: tuple[float, float] | None = None) -> Figure:
    r"""Spy plot of ``op``'s exact matrix, next to that of ``op.H`` (``adjoint=True``).

    Rows of the forward matrix are the range's blocks, columns the domain's; the adjoint's are
    the other way round. Entries are coloured by value (red positive, blue negative, white
    zero). On the adjoint panel, every entry where ``op.H`` differs from
    :math:`\overline{A}^T` is marked with a cross (gid ``"wrong-entry"``) and counted in the
    title: none for a correct rule.

    Integer matrices (data movement) get a colour key with integer ticks.

    Raises
    ------
    PlotError
        If the operator has an empty domain or range, or a side longer than :data:`SPY_LIMIT`
        (checked from its shape, before its matrix is built).
    """
    new_figure = _pyplot()
    if op.shape[0] == 0 or op.shape[1] == 0:
        raise PlotError(f"spy: {_short(str(op))} has an empty domain or range ({op.shape})")
    if max(op.shape) > SPY_LIMIT:
        raise PlotError(
            f"spy: the matrix of {_short(str(op))} is {op.shape[0]} x {op.shape[1]}, larger than "
            f"SPY_LIMIT ({SPY_LIMIT}) on a side: too large to draw; plot a smaller instance of it"
        )
    forward = op.to_sparse().tocsr()
    panels = 2 if adjoint else 1
    if figsize is None:
        figsize = (4.2 * panels, 4.2)
    figure = new_figure(figsize=figsize, layout="constrained")
    axes = figure.subplots(1, panels, squeeze=False)[0]
    _draw_matrix(axes[0], forward, op.range.blocks, op.domain.blocks, f"$A$ = {_short(str(op), 40)}")
    if adjoint:
        claimed = op.H.to_sparse().tocsr()
        expected = forward.conj().T.tocsr()
        if claimed.shape != expected.shape:
            raise PlotError(
                f"spy: op.H has shape {claimed.shape} but conj(op)^T has {expected.shape}; the spaces differ"
            )
        wrong = (claimed - expected).tocoo()
        keep = wrong.data != 0
        rows, cols = wrong.row[keep], wrong.col[keep]
        title = f"$A^*$ = {_short(str(op.H), 40)}\n" + (
            "equal to conj(A)^T" if not len(rows) else f"{len(rows)} entries differ from conj(A)^T"
        )
        _draw_matrix(axes[1], claimed, op.domain.blocks, op.range.blocks, title)
        if len(rows):
            marks = axes[1].scatter(cols, rows, marker="x", color="orange", s=40, linewidths=1.5, zorder=3)
            marks.set_gid("wrong-entry")
    return figure


# -- decompositions ------------------------------------------------------------------------------
def _rect(ax: Axes, x0: float, width: float, y: float, gid: str, **style: Any) -> None:
    from matplotlib.patches import Rectangle

    if width <= 0:
        return
    patch = Rectangle((x0 - 0.5, y - 0.35), width, 0.7, **style)
    patch.set_gid(gid)
    ax.add_patch(patch)


def _workers_along(tensor: DistributedTensor, dim: int, g: int) -> list[int]:
    partition = tensor.partition
    return [partition.worker(i) for i in partition.indices() if i[dim] == g]


def decomposition(
    layout: HaloGeometry | DistributedTensor, *, figsize: tuple[float, float] | None = None
) -> Figure:
    """Picture of a decomposition, one panel per tensor dimension, one row per grid coordinate.

    For a :class:`~linop.partition.DistributedTensor`, each row shows the bulk that coordinate
    owns along that dimension (unbalanced shares have unequal bars). For a
    :class:`~linop.halo_geometry.HaloGeometry`, each row also shows, in global padded
    coordinates:

    - the **halo** entries its window receives, coloured by the grid coordinate that owns them
      (a run from an owner more than one coordinate away is labelled with its hop count, the
      distance in grid coordinates);
    - the **pads** outside the global array (grey for a zero boundary; filled from the owners
      for periodic and reflecting boundaries);
    - the **trims**: entries of the local layout outside the window (cross-hatched);
    - the **window** the kernel reads (black outline).

    Raises
    ------
    OperandError
        (a ``TypeError``) If ``layout`` is neither a HaloGeometry nor a DistributedTensor.
    """
    new_figure = _pyplot()
    if isinstance(layout, HaloGeometry):
        tensor, geometry = layout.tensor, layout
    elif isinstance(layout, DistributedTensor):
        tensor, geometry = layout, None
    else:
        raise OperandError(  # a LinopError and a TypeError
            f"decomposition needs a HaloGeometry or a DistributedTensor, not {type(layout).__name__}"
        )
    from matplotlib.ticker import MaxNLocator

    ndim = tensor.ndim
    drawn = [d for d in range(ndim) if not _trivial_dimension(tensor, geometry, d)] or list(range(ndim))[:1]
    rows = max(tensor.partition.shape, default=1)
    if figsize is None:
        figsize = (8.0, 0.8 + (0.55 * rows + 0.6) * max(len(drawn), 1))
    figure = new_figure(figsize=figsize, layout="constrained")
    axes = figure.subplots(max(len(drawn), 1), 1, squeeze=False)[:, 0]
    for ax, dim in zip(axes, drawn):
        sizes = tensor.sizes[dim]
        offsets = np.cumsum((0, *sizes))
        m = tensor.global_shape[dim]
        low, high = 0, m
        for g, size in enumerate(sizes):
            _rect(ax, offsets[g], size, g, "bulk", facecolor=_colour(g), edgecolor="black", linewidth=0.8)
            if geometry is not None:
                low, high = (
                    min(low, geometry.rows[dim][g].local_start),
                    max(high, geometry.rows[dim][g].local_stop),
                )
                _draw_halo_row(ax, geometry, dim, g)
        for edge in offsets[1:-1]:
            ax.axvline(edge - 0.5, color="0.6", linestyle=":", linewidth=0.8)
        for edge in (0, m):
            ax.axvline(edge - 0.5, color="black", linewidth=1.0)
        ax.set_xlim(low - 1, high)
        ax.set_ylim(len(sizes) - 0.4, -0.6)
        ax.set_yticks(range(len(sizes)))
        ax.set_yticklabels(
            [f"{g}: workers {','.join(map(str, _workers_along(tensor, dim, g)))}" for g in range(len(sizes))],
            fontsize=8,
        )
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel(f"dimension {dim}: global index (0..{m - 1}; pads outside)", fontsize=8)
    what = f"halo geometry of {geometry.kernel}" if geometry is not None else "decomposition"
    skipped = [d for d in range(ndim) if d not in drawn]
    if skipped:
        what += f" (dimension{'s' * (len(skipped) > 1)} {', '.join(map(str, skipped))}: extent 1, undivided)"
    figure.suptitle(_fitted(f"{what} over {tensor}", figsize[0]), fontsize=9)
    if geometry is not None:
        _legend(axes[0])
    return figure


def _trivial_dimension(tensor: DistributedTensor, geometry: HaloGeometry | None, dim: int) -> bool:
    """A dimension of extent 1 on one grid coordinate, with no pad, trim or halo: its panel
    would show one bar of width 1, so it is named in the title instead."""
    if tensor.global_shape[dim] != 1 or tensor.partition.shape[dim] != 1:
        return False
    if geometry is None:
        return True
    (row,) = geometry.rows[dim]
    return not geometry.fills[dim][0] and not (
        row.left_pad or row.right_pad or row.left_trim or row.right_trim
    )


def _draw_halo_row(ax: Axes, geometry: HaloGeometry, dim: int, g: int) -> None:
    row = geometry.rows[dim][g]
    zero = geometry.kernel.boundary[dim] == "zero"
    for segment in geometry.fills[dim][g]:
        x0 = row.local_start + segment.dst_start
        _rect(
            ax,
            x0,
            segment.size,
            g,
            "halo",
            facecolor=_colour(segment.owner),
            alpha=0.45,
            edgecolor=_colour(segment.owner),
        )
        hops = abs(segment.owner - g)
        if hops > 1:
            text = ax.text(
                x0 + segment.size / 2 - 0.5,
                g,
                str(hops),
                ha="center",
                va="center",
                fontsize=8,
                fontweight="bold",
            )
            text.set_gid("hops")
    if zero:
        for x0, width in ((row.need_start, row.left_pad), (row.length, row.right_pad)):
            _rect(ax, x0, width, g, "pad", facecolor="0.85", edgecolor="0.5", hatch="..")
    else:
        for x0, width in ((row.need_start, row.left_pad), (row.length, row.right_pad)):
            _rect(ax, x0, width, g, "pad", fill=False, edgecolor="0.3", linestyle="--")
    for x0, width in ((row.local_start, row.left_trim), (row.local_stop - row.right_trim, row.right_trim)):
        _rect(ax, x0, width, g, "trim", fill=False, edgecolor="black", hatch="xxx", linewidth=0.0)
    if row.has_output:
        _rect(ax, row.need_start, row.window_size, g, "window", fill=False, edgecolor="black", linewidth=1.6)


def _legend(ax: Axes) -> None:
    from matplotlib.patches import Patch

    handles = [
        Patch(facecolor=_colour(0), edgecolor="black", label="bulk (colour: owner)"),
        Patch(facecolor=_colour(1), alpha=0.45, label="halo (colour: owner;\nn: from n hops away)"),
        Patch(facecolor="0.85", edgecolor="0.5", hatch="..", label="zero pad"),
        Patch(fill=False, edgecolor="black", hatch="xxx", label="trim (not in the window)"),
        Patch(fill=False, edgecolor="black", linewidth=1.6, label="window"),
    ]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))


# -- message diagrams ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Communication:
    """One communication drawn in a message diagram: in ``phase`` (counted from 0), ``source``
    sends ``entries`` to ``target`` (point to point, ``kind == "send"``), or the workers of a
    native collective take part in it (``kind`` the node's type, ``source == target == -1``,
    ``workers`` its members, ``entries`` the size of the node's domain). ``adds``: the receiver
    adds the data into its own. (A message of the cost model is
    :class:`linop.accounting.Message`, counted in bytes and in dependent phases from 1.)"""

    phase: int
    source: int
    target: int
    entries: int
    kind: str = "send"
    workers: tuple[int, ...] = ()
    adds: bool = False


def schedule_messages(op: LinearOperator, *, of: str = "schedule") -> list[Communication]:
    """The messages of ``op``, phase by phase.

    ``of="schedule"``: the schedule the MPI interpreter runs (its phases; sums' branches one
    after the other; a native collective is one message of its kind). ``of="tree"``: the tree
    as built, each message in its *dependent phase* (the longest chain of messages it waits
    for, :func:`linop.accounting.account`), so an algorithm's rounds show as phases.
    Transfers that move no entries are left out; local steps (within one worker) send nothing.

    Raises
    ------
    PlotError
        If ``of`` is neither ``"schedule"`` nor ``"tree"``.
    """
    if of == "tree":
        from .accounting import account

        return [
            Communication(m.phase - 1, m.source, m.target, m.nbytes, adds=m.adds)
            for m in account(op, itemsize=1).messages
            if m.nbytes
        ]
    if of != "schedule":
        raise PlotError(f"schedule_messages: of must be 'schedule' or 'tree', not {of!r}")
    from .program import Branches, Phase, Transfer, compile_program

    found: list[Communication] = []
    phase = 0

    def walk(steps: Sequence[Any]) -> None:
        nonlocal phase
        for step in steps:
            if isinstance(step, (Phase, Transfer)):
                transfers = step.transfers if isinstance(step, Phase) else (step,)
                sent = [t for t in transfers if t.source.size]
                for t in sent:
                    found.append(
                        Communication(
                            phase, t.src_worker, t.dst_worker, int(t.source.size), adds=t.mode == "add"
                        )
                    )
                phase += bool(sent)
            elif isinstance(step, Branches):
                for term in step.terms:
                    walk(term)
            elif hasattr(step, "runner"):  # a fast path (a native collective) runs as one step
                node = getattr(step.runner, "op", None)
                kind = type(node).__name__ if node is not None else type(step.runner).__name__
                size = int(node.domain.size) if node is not None else 0
                found.append(
                    Communication(phase, -1, -1, size, kind, tuple(getattr(step.runner, "workers", ())))
                )
                phase += 1

    walk(compile_program(op).steps)
    return found


def messages(
    op: LinearOperator,
    *,
    of: str = "schedule",
    title: str | None = None,
    figsize: tuple[float, float] | None = None,
) -> Figure:
    """Message diagram of ``op``: one column per phase, one lane per worker.

    ``of`` chooses the phases as in :func:`schedule_messages`: the MPI schedule's (default) or
    the tree's dependent phases (``"tree"``: an algorithm's rounds). ``title`` names what is
    drawn (an algorithm: ``"ring all-reduce"``); by default the operator's text when it is
    short, else its node type and workers (a long tree cut off says nothing).

    The messages of one phase from one sender to one receiver are one arrow from the sender's
    lane to the receiver's (gid ``"message"``), labelled with the entries they move: ``5`` for
    one message of 5 entries, ``2x5`` for two of 5, ``3: 12`` for three of 12 in total; a native collective (broadcast,
    sum-reduce, all-reduce, all-to-all fast paths) is a band over its workers labelled with
    the node's type (gid ``"collective"``). Messages whose receiver adds them (the
    reductions of a backward pass) are dashed, and a legend then says so.

    Raises
    ------
    PlotError
        If the schedule sends nothing (every step is local to one worker).
    """
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    new_figure = _pyplot()
    found = schedule_messages(op, of=of)
    if not found:
        raise PlotError(f"messages: the schedule of {_short(str(op))} sends nothing (every step is local)")
    workers = sorted(
        {w for msg in found for w in (msg.source, msg.target, *msg.workers) if w >= 0}
        | set(op.domain.workers)
        | set(op.range.workers)
    )
    lane = {w: i for i, w in enumerate(workers)}
    phases = max(msg.phase for msg in found) + 1
    if figsize is None:
        widest = max(len({(m.source, m.target) for m in found if m.phase == p}) for p in range(phases))
        figsize = (1.8 + phases * max(1.5, 0.32 * widest), 1.2 + 0.55 * len(workers))
    figure = new_figure(figsize=figsize, layout="constrained")
    ax = figure.subplots()
    for i in range(len(workers)):
        ax.axhline(i, color="0.85", linewidth=0.8, zorder=0)
    for p in range(phases):
        in_phase = [msg for msg in found if msg.phase == p]
        pairs: dict[tuple[int, int], list[int]] = {}
        adding: set[tuple[int, int]] = set()
        for msg in in_phase:
            if msg.kind == "send":
                pairs.setdefault((msg.source, msg.target), []).append(msg.entries)
                if msg.adds:
                    adding.add((msg.source, msg.target))
        for k, ((source, target), sizes) in enumerate(sorted(pairs.items())):
            shift = (k + 0.5) / len(pairs) * 0.8 - 0.4
            arrow = FancyArrowPatch(
                (p + shift - 0.04, lane[source]),
                (p + shift + 0.04, lane[target]),
                arrowstyle="-|>",
                mutation_scale=10,
                color=_colour(source),
                linewidth=1.2,
                linestyle="--" if (source, target) in adding else "-",
            )
            arrow.set_gid("message")
            ax.add_patch(arrow)
            text = (
                str(sizes[0])
                if len(sizes) == 1
                else (f"{len(sizes)}x{sizes[0]}" if len(set(sizes)) == 1 else f"{len(sizes)}: {sum(sizes)}")
            )
            label = ax.text(
                p + shift,
                (lane[source] + lane[target]) / 2,
                text,
                fontsize=7,
                ha="center",
                va="center",
                rotation=90,
                bbox={"boxstyle": "round,pad=0.1", "facecolor": "white", "edgecolor": "none"},
            )
            label.set_gid("message-label")
        for msg in in_phase:
            if msg.kind == "send":
                continue
            members = [lane[w] for w in msg.workers] or list(range(len(workers)))
            band = FancyBboxPatch(
                (p - 0.35, min(members) - 0.3),
                0.7,
                max(members) - min(members) + 0.6,
                boxstyle="round,pad=0.02",
                facecolor="0.9",
                edgecolor="0.4",
            )
            band.set_gid("collective")
            ax.add_patch(band)
            ax.text(
                p,
                (min(members) + max(members)) / 2,
                f"{msg.kind}\n(native)",
                fontsize=7,
                ha="center",
                va="center",
                rotation=90 if len(members) > 2 else 0,
            )
    ax.set_xlim(-0.6, phases - 0.4)
    ax.set_ylim(len(workers) - 0.5, -0.5)
    ax.set_xticks(range(phases))
    ax.set_xticklabels([f"phase {p}" for p in range(phases)], fontsize=8)
    ax.set_yticks(range(len(workers)))
    ax.set_yticklabels([f"worker {w}" for w in workers], fontsize=8)
    total = sum(msg.entries for msg in found if msg.kind == "send")
    count = sum(msg.kind == "send" for msg in found)
    collectives = len(found) - count
    parts = [f"{count} messages, {total} entries"] if count else []
    parts += [f"{collectives} native collective{'s' if collectives != 1 else ''}"] if collectives else []
    what = "MPI schedule" if of == "schedule" else "dependent phases"
    if title is None:
        title = str(op) if len(str(op)) <= 40 else f"a {type(op).__name__} over workers {_ranges(workers)}"
    ax.set_title(_fitted(f"{what} of {title}:\n{'; '.join(parts)}", figsize[0]), fontsize=9)
    if any(msg.adds for msg in found if msg.kind == "send"):
        _message_legend(ax)
    return figure


def _ranges(workers: Sequence[int]) -> str:
    """``0..3`` for consecutive workers, else the list."""
    consecutive = list(workers) == list(range(workers[0], workers[-1] + 1)) if workers else False
    return (
        f"{workers[0]}..{workers[-1]}" if consecutive and len(workers) > 2 else ", ".join(map(str, workers))
    )


def _message_legend(ax: Axes) -> None:
    from matplotlib.lines import Line2D

    handles = [
        Line2D([], [], color="0.3", linewidth=1.2, label="message: the receiver stores it"),
        Line2D([], [], color="0.3", linewidth=1.2, linestyle="--", label="message: the receiver adds it"),
    ]
    legend = ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    legend.set_gid("message-legend")


# -- the README's picture --------------------------------------------------------------------------
def readme_picture(path: str) -> Figure:
    """Draw the README's picture into ``path`` (a PNG): the halo geometry of a size-5 kernel with
    padding 2 over 12 entries cut 1, 1, 1, 9 over four workers, where worker 0's halo comes from
    two and three hops away. Regenerate with ``python -m linop.plot docs/images/halo_unbalanced.png``
    (:func:`main`).
    """
    from .halo_geometry import Kernel, halo_geometry
    from .partition import Partition

    tensor = DistributedTensor("v", (12,), Partition((4,)), sizes=((1, 1, 1, 9),))
    figure = decomposition(halo_geometry(tensor, Kernel(5, padding=2)), figsize=(7.5, 2.6))
    figure.savefig(path, dpi=80)
    return figure


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m linop.plot OUTPUT.png``: draw the README's picture (:func:`readme_picture`)
    into ``OUTPUT.png``. The path is required, so nothing is overwritten by accident; the
    README's copy is ``docs/images/halo_unbalanced.png``."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m linop.plot",
        description="Draw the README's picture: the halo geometry of a size-5 kernel with padding 2 "
        "over 12 entries cut 1, 1, 1, 9 over four workers.",
        epilog="The README's copy: python -m linop.plot docs/images/halo_unbalanced.png",
    )
    parser.add_argument("output", metavar="OUTPUT.png", help="the PNG file to write (replaced if it exists)")
    args = parser.parse_args(argv)
    readme_picture(args.output)
    print(f"linop.plot: wrote {args.output}")
    return 0


if __name__ == "__main__":  # pragma: no cover - main is tested directly
    raise SystemExit(main())
