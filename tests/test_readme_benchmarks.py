"""README's benchmark figures that cite a recorded run (``benchmarks/results/*.txt``: a
benchmark's output as printed, with its date, commit and machine) are that run's figures: the
torch.distributed rows (the halo exchange's bound plan and checked ``apply``, the repartition's
bound plan, ``apply`` and DTensor) and the new layers' rows (CPU and wall ratio of each module at
each size) are recomputed from the file and compared with the prose."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "results"
CITED = re.compile(r"benchmarks/results/([\w.-]+\.txt)")


def readme_rows() -> list[str]:
    return [line for line in README.read_text().splitlines() if line.startswith("| ")]


def ratios(path: Path) -> dict[str, dict[str, float]]:
    """Per case of a ``bench_torch_distributed.py`` output, each method's ratio (``bound``,
    ``apply``, ``dtensor``: the number in brackets after its time)."""
    found: dict[str, dict[str, float]] = {}
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) < 4 or not re.match(r"(halo|repartition) ", cells[0]):
            continue
        found[cells[0]] = {
            m.group(1): float(m.group(2))
            for cell in cells[3:]
            if (m := re.match(r"(\w+)\s+[\d.]+ ms \(\s*([\d.]+)x\)", cell))
        }
    return found


def layer_ratios(path: Path) -> dict[str, list[tuple[float, float]]]:
    """Per case of a ``bench_new_layers.py`` output, its (wall, cpu) ratios in the order of the
    sizes run."""
    found: dict[str, list[tuple[float, float]]] = {}
    for line in path.read_text().splitlines():
        m = re.match(
            r"(\w+)\s+\d+x\d+x\d+x\d+\s+\| wall .*ratio\s+([\d.]+)x \| cpu .*ratio\s+([\d.]+)x \| equal$",
            line,
        )
        if m:
            found.setdefault(m.group(1), []).append((float(m.group(2)), float(m.group(3))))
    return found


def spread(values: list[float]) -> str:
    low, high = min(values), max(values)
    return f"{low:.2f}x" if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f}x - {high:.2f}x"


def test_every_cited_record_exists_and_says_when_and_where():
    cited = {name for row in readme_rows() for name in CITED.findall(row)}
    assert cited, "README cites no recorded benchmark run"
    for name in cited:
        text = (RESULTS / name).read_text()
        for field in ("# date: ", "# machine: ", "# command: "):
            assert field in text, f"{name} lacks {field!r}"


def test_torch_distributed_rows_are_the_recorded_runs_figures():
    rows = readme_rows()
    (halo,) = [r for r in rows if "in-place halo exchange of 4096 x 4096 float64" in r and "gloo" in r]
    (repartition,) = [r for r in rows if "repartition of 4096 x 4096 float32 rows -> columns" in r]
    (name,) = CITED.findall(halo)
    found = ratios(RESULTS / name)
    halos = [v for case, v in found.items() if case.startswith("halo ")]
    assert len(halos) == 4, found
    figures = halo.rsplit("|", 2)[1]
    assert f"bound {spread([v['bound'] for v in halos])}" in figures, figures
    assert f"apply {spread([v['apply'] for v in halos])}" in figures, figures
    (moved,) = [v for case, v in found.items() if case.startswith("repartition ")]
    figures = repartition.rsplit("|", 2)[1]
    for method, label in (("bound", "bound"), ("apply", "apply"), ("dtensor", "DTensor")):
        assert f"{label} {moved[method]:.2f}x" in figures, (method, figures)


LAYER_LABELS = {
    "bn": "BatchNorm",
    "loss": "loss (MSE)",
    "maxpool": "MaxPool",
    "upsample": "Upsample (bilinear x2)",
    "repartition": "Repartition",
    "chain": "ChainModule",
}


def layer_figures(ratios: dict[str, list[tuple[float, float]]]) -> list[str]:
    """The README's wording of each case: CPU ratios by size, then the wall ratios."""
    return [
        f"{LAYER_LABELS[case]} {' / '.join(f'{c:.2f}x' for _, c in pairs)} "
        f"(wall {' / '.join(f'{w:.2f}x' for w, _ in pairs)})"
        for case, pairs in ratios.items()
    ]


def test_new_layer_rows_are_the_recorded_runs_figures():
    rows = [r for r in readme_rows() if "bench_new_layers.py" in r]
    assert rows, "README has no row of bench_new_layers.py"
    for row in rows:  # one per recorded run (torch.distributed, MPI)
        (name,) = CITED.findall(row)
        found = layer_ratios(RESULTS / name)
        assert set(found) == set(LAYER_LABELS) and all(len(v) == 2 for v in found.values()), found
        figures = row.rsplit("|", 2)[1]
        for expected in layer_figures(found):
            assert expected in figures, (name, expected, figures)


def test_the_comparison_catches_a_figure_that_is_not_the_files(tmp_path):
    record = tmp_path / "run.txt"
    record.write_text(
        "halo 4x1 h=1 | 1 MB | 1.0 ms | bound 1.0 ms ( 0.97x) | apply 2.0 ms ( 2.78x) | equal\n"
        "halo 2x2 h=1 | 1 MB | 1.0 ms | bound 1.0 ms ( 1.22x) | apply 2.0 ms ( 2.26x) | equal\n"
    )
    halos = list(ratios(record).values())
    assert spread([v["bound"] for v in halos]) == "0.97x - 1.22x"
    assert spread([v["apply"] for v in halos]) != "2.0x - 3.2x"  # the old prose would be refused


def test_the_layer_comparison_catches_a_figure_that_is_not_the_files(tmp_path):
    record = tmp_path / "run.txt"
    record.write_text(
        "bn           4x16x32x32   | wall linop   92.433 ms  hand   47.280 ms  ratio  2.02x | cpu linop"
        "   14.719 ms  hand    7.945 ms  ratio  1.73x | equal\n"
        "bn           8x16x128x128 | wall linop  666.476 ms  hand  669.184 ms  ratio  0.91x | cpu linop"
        "   36.588 ms  hand   41.597 ms  ratio  0.92x | equal\n"
    )
    (figures,) = layer_figures(layer_ratios(record))
    assert figures == "BatchNorm 1.73x / 0.92x (wall 2.02x / 0.91x)"
    assert figures != "BatchNorm 1.73x / 0.91x (wall 2.02x / 0.92x)"  # cpu and wall not swapped


@pytest.mark.parametrize("name", sorted(p.name for p in RESULTS.glob("*.txt")))
def test_every_record_is_cited_by_the_readme(name):
    assert name in README.read_text(), f"benchmarks/results/{name} is cited nowhere"
