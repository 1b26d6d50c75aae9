"""Metric curves of one or more runs: in the terminal (plotext, one chart per metric, one colour,
marker and legend entry per run) or to a PNG (matplotlib, optional)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Mapping, Sequence

from baseten_loops_cli.errors import LoopsError

# One marker per run, so overlaid runs stay distinguishable without colour (NO_COLOR, pipes).
MARKERS = "•x+o*#@%"

Runs = Mapping[str, Sequence[dict]]  # label (a run directory) -> its metric records


def _series(records: Sequence[dict], name: str) -> list[tuple[int, float]]:
    return [
        (int(r["step"]), float(r[name]))
        for r in records
        if isinstance(r.get(name), (int, float)) and not math.isnan(float(r[name]))
    ]


def _as_runs(runs: Runs | Sequence[dict]) -> Runs:
    return runs if isinstance(runs, Mapping) else {"run": runs}


def summary(points: list[tuple[int, float]]) -> str:
    return f"steps {points[0][0]}-{points[-1][0]}, first {points[0][1]:.4g}, last {points[-1][1]:.4g}"


def plot_terminal(runs: Runs | Sequence[dict], names: list[str], width: int = 72, height: int = 16,
                  color: bool = False) -> str:
    """One chart per metric with every run overlaid, each chart under a summary line per run."""
    import plotext

    runs = _as_runs(runs)
    blocks = []
    for name in names:
        series = {label: _series(records, name) for label, records in runs.items()}
        drawn = {label: points for label, points in series.items() if points}
        if not drawn:
            blocks.append(f"{name}: no values")
            continue
        if len(runs) == 1:
            header = [f"{name}  ({summary(next(iter(drawn.values())))})"]
        else:
            header = [name] + [
                f"  {MARKERS[i % len(MARKERS)]} {label}: " + (summary(series[label]) if series[label] else "no values")
                for i, label in enumerate(runs)
            ]
        figure = plotext.figure
        figure.clear()
        figure.plot_size(width, height)
        figure.theme("default" if color else "colorless")
        for i, label in enumerate(runs):
            points = series[label]
            if points:
                figure.draw(figure.signal([s for s, _ in points], [v for _, v in points], marker=MARKERS[i % len(MARKERS)]))
        figure.label("step")
        chart = figure.build().string(colorless=not color).rstrip("\n")
        # The legend goes under the chart, outside the plot area: inside, wherever it sits, it
        # hides the curves that pass there (a flat loss curve runs along the top right).
        legend = _legend([(MARKERS[i % len(MARKERS)], Path(label).name or label) for i, label in enumerate(runs)],
                         width) if len(runs) > 1 else []
        blocks.append("\n".join(header + [chart] + legend))
    return "\n\n".join(blocks)


def _legend(entries: list[tuple[str, str]], width: int) -> list[str]:
    """A boxed legend, ``│ • run-a │ x run-b │``: one row while it fits ``width``, else one
    entry per row (the chart is narrow; the header lines above it have each run's path)."""
    cells = [f" {marker} {name} " for marker, name in entries]
    if sum(len(c) + 1 for c in cells) + 1 <= width:
        rules = ["─" * len(c) for c in cells]
        return ["┌" + "┬".join(rules) + "┐", "│" + "│".join(cells) + "│", "└" + "┴".join(rules) + "┘"]
    wide = max(len(c) for c in cells)
    return ["┌" + "─" * wide + "┐", *("│" + c.ljust(wide) + "│" for c in cells), "└" + "─" * wide + "┘"]


def plot_png(runs: Runs | Sequence[dict], names: list[str], out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise LoopsError(
            "--out needs matplotlib, which is not installed",
            hint="Install it with `pip install matplotlib`, or drop --out to plot in the terminal.",
        ) from None
    runs = _as_runs(runs)
    fig, axes = plt.subplots(len(names), 1, figsize=(8, 3 * len(names)), squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        for label, records in runs.items():
            points = _series(records, name)
            ax.plot([s for s, _ in points], [v for _, v in points], marker=".", label=label)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        if len(runs) > 1:
            ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
