"""Pictures (linop.plot): the figures are inspected, not only produced.

Spy plots: block boundary lines and block labels per panel, the drawn image equal to the
matrix, and the wrong entries of a deliberately wrong adjoint marked where they are.
Decompositions: one patch per bulk, halo run, pad and trim with the widths of the geometry,
and the multi-hop runs of an unbalanced decomposition labelled. Message diagrams: the messages
of hand-derived schedules (a 2 x 2 halo exchange, a send-receive, a native broadcast).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

from linop import (  # noqa: E402
    Add,
    Block,
    Broadcast,
    Clear,
    Copy,
    DistributedTensor,
    HaloExchange,
    Kernel,
    LinopError,
    Partition,
    SendRecv,
    Space,
    halo_geometry,
    plot,
)

SPACE = Space([Block("a", (3,)), Block("b", (3,)), Block("c", (2,), worker=1)])


def _gids(artists, gid):
    return [a for a in artists if a.get_gid() == gid]


def _labels(texts):
    return [t.get_text() for t in texts]


@pytest.mark.parametrize(
    "op",
    [
        Copy(SPACE["a"], SPACE["b"]),
        Copy(SPACE["a"][0:2], "d"),  # out of place: range has one more block than the domain
        2 * Clear(SPACE["c"]) + Add(SPACE["a"], SPACE["b"]),
    ],
    ids=["copy", "copy-out-of-place", "sum"],
)
def test_spy_draws_block_boundaries_and_labels(op):
    figure = plot.spy(op)
    forward, adjoint, *keys = figure.axes
    assert [key.get_gid() for key in keys] == ["colour-key", "colour-key"]
    for ax, rows, columns in ((forward, op.range, op.domain), (adjoint, op.domain, op.range)):
        assert len(_gids(ax.lines, "block-boundary")) == (len(rows) - 1) + (len(columns) - 1)
        assert _labels(ax.get_yticklabels()) == list(rows.names)
        assert _labels(ax.get_xticklabels()) == list(columns.names)
        assert not _gids(ax.collections, "wrong-entry")
    assert np.array_equal(forward.images[0].get_array(), op.to_sparse().toarray())
    assert np.array_equal(adjoint.images[0].get_array(), op.H.to_sparse().toarray())
    assert "equal to conj(A)^T" in adjoint.get_title()


def test_figures_show_as_png_in_jupyter():
    png = plot.spy(Copy(SPACE["a"], SPACE["b"]))._repr_png_()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 1000


def test_spy_without_adjoint_has_one_panel():
    figure = plot.spy(Copy(SPACE["a"], SPACE["b"]), adjoint=False)
    assert [ax.get_gid() for ax in figure.axes] == [None, "colour-key"]


@dataclass(frozen=True, eq=True, repr=False)
class CopyForgetsClear(Copy):
    def adjoint(self):
        return Add(self.dst, self.src)  # wrong: should be K_b S_{b->a}


def test_spy_marks_the_wrong_entries_of_a_wrong_adjoint():
    figure = plot.spy(CopyForgetsClear(SPACE["a"], SPACE["b"]))
    adjoint = figure.axes[1]
    (marks,) = _gids(adjoint.collections, "wrong-entry")
    # op.H claims 1 at (row b[i], column b[i]); the truth is 0: flat positions 3+i, 3+i
    assert sorted(map(tuple, marks.get_offsets().tolist())) == [(3.0, 3.0), (4.0, 4.0), (5.0, 5.0)]
    assert "3 entries differ" in adjoint.get_title()


def test_spy_refuses_an_empty_operator():
    with pytest.raises(plot.PlotError, match="empty"):
        plot.spy(Clear(Space([Block("e", (0,))])["e"]))


UNBALANCED = DistributedTensor("v", (12,), Partition.grid((4,)), sizes=((1, 1, 1, 9),))
CASES = [
    ("unbalanced-1d", halo_geometry(UNBALANCED, Kernel(5, padding=2))),
    (
        "balanced-2x2",
        halo_geometry(DistributedTensor("u", (10, 10), Partition.grid((2, 2))), Kernel(3, padding=1)),
    ),
    (
        "periodic-1d",
        halo_geometry(
            DistributedTensor("p", (7,), Partition.grid((2,))), Kernel(3, padding=1, boundary="periodic")
        ),
    ),
]


def _widths(ax, gid, g):
    return sum(p.get_width() for p in _gids(ax.patches, gid) if round(p.get_y() + 0.35) == g)


@pytest.mark.parametrize("geometry", [c for _, c in CASES], ids=[i for i, _ in CASES])
def test_decomposition_patches_have_the_geometry_widths(geometry):
    figure = plot.decomposition(geometry)
    panels = [ax for ax in figure.axes if ax.get_yticklabels()]
    assert len(panels) == geometry.ndim
    for dim, ax in enumerate(panels):
        rows = geometry.rows[dim]
        assert len(ax.get_yticklabels()) == len(rows)
        for g, row in enumerate(rows):
            assert _widths(ax, "bulk", g) == row.bulk_size
            assert _widths(ax, "halo", g) == sum(s.size for s in geometry.fills[dim][g])
            assert _widths(ax, "pad", g) == row.left_pad + row.right_pad
            assert _widths(ax, "trim", g) == row.left_trim + row.right_trim
            assert _widths(ax, "window", g) == (row.window_size if row.has_output else 0)


def test_decomposition_labels_multi_hop_halos():
    figure = plot.decomposition(CASES[0][1])
    hops = sorted(_labels(t for t in figure.axes[0].texts if t.get_gid() == "hops"))
    # worker 0 reads from coordinates 2 and 3, worker 1 from 3 (geometry.fills)
    assert hops == ["2", "2", "3"]


def test_decomposition_of_a_tensor_shows_only_bulks():
    figure = plot.decomposition(UNBALANCED)
    ax = figure.axes[0]
    assert [p.get_width() for p in _gids(ax.patches, "bulk")] == [1, 1, 1, 9]
    assert not _gids(ax.patches, "halo")
    with pytest.raises(TypeError, match="HaloGeometry or a DistributedTensor"):
        plot.decomposition(SPACE)


def test_messages_of_a_2x2_halo_exchange():
    u = DistributedTensor("u", (10, 10), Partition.grid((2, 2)))
    exchange = HaloExchange(halo_geometry(u, Kernel(3, padding=1)))
    found = plot.schedule_messages(exchange)
    # nested: dimension 0 first (a row of 5 to the vertical neighbour), then dimension 1
    # (a column of 5 plus the corner just received: 6)
    assert sorted((m.phase, m.source, m.target, m.entries) for m in found) == [
        (0, 0, 2, 5), (0, 1, 3, 5), (0, 2, 0, 5), (0, 3, 1, 5),
        (1, 0, 1, 6), (1, 1, 0, 6), (1, 2, 3, 6), (1, 3, 2, 6),
    ]  # fmt: skip
    figure = plot.messages(exchange)
    ax = figure.axes[0]
    assert len(_gids(ax.patches, "message")) == 8
    assert sorted(_labels(t for t in ax.texts if t.get_gid() == "message-label")) == ["5"] * 4 + ["6"] * 4
    assert _labels(ax.get_yticklabels()) == [f"worker {w}" for w in range(4)]
    assert _labels(ax.get_xticklabels()) == ["phase 0", "phase 1"]


def test_messages_of_a_send_receive_and_its_adjoint():
    send = SendRecv(SPACE["a"][0:2], SPACE["c"])
    assert [(m.source, m.target, m.entries) for m in plot.schedule_messages(send)] == [(0, 1, 2)]
    assert [(m.source, m.target, m.entries) for m in plot.schedule_messages(send.H)] == [(1, 0, 2)]


def test_messages_draw_a_native_collective_as_a_band():
    w = DistributedTensor("w", (3, 4), Partition.grid((1, 1)))
    bcast = Broadcast(w, Partition.grid((2, 2)), "w_copy")
    (message,) = plot.schedule_messages(bcast)
    assert message.kind == "Broadcast" and message.workers == (0, 1, 2, 3)
    ax = plot.messages(bcast).axes[0]
    assert len(_gids(ax.patches, "collective")) == 1 and not _gids(ax.patches, "message")
    assert ax.get_title().endswith("1 native collective")


def test_messages_refuse_a_local_schedule():
    with pytest.raises(plot.PlotError, match="sends nothing") as caught:
        plot.messages(Copy(SPACE["a"], SPACE["b"]))
    assert isinstance(caught.value, LinopError)


def test_readme_picture_is_regenerated_by_the_module(tmp_path):
    # ``python -m linop.plot PATH`` calls exactly this
    target = tmp_path / "halo.png"
    figure = plot.readme_picture(str(target))
    assert target.read_bytes().startswith(b"\x89PNG")
    assert sorted(t.get_text() for t in figure.axes[0].texts if t.get_gid() == "hops") == ["2", "2", "3"]


def test_messages_of_the_tree_show_an_algorithms_rounds():
    from linop import algorithms

    ring = algorithms.problem("allreduce", 4, 8).variant("ring")
    found = plot.schedule_messages(ring, of="tree")
    # ring all-reduce on P = 4: P - 1 rounds of reduce-scatter (adding), P - 1 of all-gather,
    # every worker sending one chunk of 8 / 4 entries to the next one in each round
    assert sorted({m.phase for m in found}) == list(range(6))
    for phase in range(6):
        sent = sorted((m.source, m.target, m.entries, m.adds) for m in found if m.phase == phase)
        assert sent == [(w, (w + 1) % 4, 2, phase < 3) for w in range(4)]
    ax = plot.messages(ring, of="tree").axes[0]
    arrows = _gids(ax.patches, "message")
    assert len(arrows) == 24 and sum(a.get_linestyle() == "--" for a in arrows) == 12
    assert ax.get_title().startswith("dependent phases")
    with pytest.raises(plot.PlotError, match="'schedule' or 'tree'"):
        plot.schedule_messages(ring, of="rounds")


def test_spy_of_a_large_operator_draws_markers():
    space = Space([Block("a", (plot.DENSE_LIMIT,)), Block("b", (plot.DENSE_LIMIT,))])
    figure = plot.spy(Copy(space["a"][:10], space["b"][5:15]))
    forward = figure.axes[0]
    assert not forward.images  # too large for an image: the nonzeros as markers
    (markers,) = [line for line in forward.lines if line.get_gid() != "block-boundary"]
    assert len(markers.get_xdata()) == (2 * plot.DENSE_LIMIT - 10) + 10  # I but rows b[5:15], and the copy
    assert len(_gids(forward.lines, "block-boundary")) == 2


def test_spy_refuses_a_too_large_operator_before_building_it(monkeypatch):
    huge = Space([Block("a", (10**7,)), Block("b", (10**7,))])  # a 2e7 x 2e7 matrix
    op = Copy(huge["a"], huge["b"])

    def never(self):
        raise AssertionError("spy built the matrix before checking its size")

    monkeypatch.setattr(type(op), "to_sparse", never)
    with pytest.raises(plot.PlotError, match=r"20000000 x 20000000, larger than SPY_LIMIT") as caught:
        plot.spy(op)
    assert isinstance(caught.value, LinopError)


def test_an_integer_spy_plot_has_a_colour_key_with_integer_ticks():
    op = 2 * Clear(SPACE["c"]) + Add(SPACE["a"], SPACE["b"])  # entries -1 .. 2 (K = I - P)
    figure = plot.spy(op)
    keys = [ax for ax in figure.axes if ax.get_gid() == "colour-key"]
    assert len(keys) == 2, "one colour key per panel"
    for key in keys:
        ticks = [t for t in key.get_yticks() if key.get_ylim()[0] <= t <= key.get_ylim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks


def test_decomposition_axes_are_honest():
    figure = plot.decomposition(UNBALANCED)
    ax = figure.axes[0]
    assert "global index (0..11;" in ax.get_xlabel()  # 12 entries: indices 0 .. 11
    assert all(float(t).is_integer() for t in ax.get_xticks())


def test_a_size_one_dimension_gets_no_panel():
    thin = DistributedTensor("x", (1, 8), Partition.grid((1, 2)))
    figure = plot.decomposition(thin)
    (ax,) = figure.axes
    assert "dimension 1" in ax.get_xlabel()
    assert "dimension 0: extent 1, undivided" in figure.get_suptitle()
    assert all(float(t).is_integer() for t in ax.get_xticks())
    # a halo along the size-1 dimension (zero pads) is worth its panel
    padded = halo_geometry(thin, Kernel((3, 1), padding=(1, 0)))
    assert len([a for a in plot.decomposition(padded).axes if a.get_yticklabels()]) == 2


def test_messages_are_titled_by_name_with_a_legend_for_adding_arrows():
    from linop import algorithms

    ring = algorithms.problem("allreduce", 4, 8).variant("ring")
    ax = plot.messages(ring, of="tree", title="ring all-reduce").axes[0]
    assert ax.get_title().startswith("dependent phases of ring all-reduce:")
    legend = ax.get_legend()
    assert legend is not None and legend.get_gid() == "message-legend"
    texts = [t.get_text() for t in legend.get_texts()]
    assert texts == ["message: the receiver stores it", "message: the receiver adds it"]
    assert [h.get_linestyle() for h in legend.legend_handles] == ["-", "--"]
    default = plot.messages(ring, of="tree").axes[0].get_title()
    assert "..." not in default and default.startswith("dependent phases of a Composition over workers 0..3")
    send = plot.messages(SendRecv(SPACE["a"][0:2], SPACE["c"])).axes[0]
    assert send.get_legend() is None, "nothing is added: no legend needed"


def test_the_module_needs_an_output_path(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as done:
        plot.main([])
    assert done.value.code == 2 and "OUTPUT.png" in capsys.readouterr().err
    with pytest.raises(SystemExit) as done:
        plot.main(["--help"])
    assert done.value.code == 0 and "usage: python -m linop.plot" in capsys.readouterr().out
    assert not list(tmp_path.iterdir()), "neither a missing path nor --help writes a file"
    assert plot.main([str(tmp_path / "halo.png")]) == 0
    assert f"wrote {tmp_path / 'halo.png'}" in capsys.readouterr().out
    assert (tmp_path / "halo.png").read_bytes().startswith(b"\x89PNG")
