"""Metric curves: in the terminal (a small character chart per metric) or to a PNG."""

from __future__ import annotations

import math
from pathlib import Path

from baseten_loops_cli.errors import LoopsError


def _series(records: list[dict], name: str) -> list[tuple[int, float]]:
    return [
        (int(r["step"]), float(r[name]))
        for r in records
        if isinstance(r.get(name), (int, float)) and not math.isnan(float(r[name]))
    ]


def plot_terminal(records: list[dict], names: list[str], width: int = 60, height: int = 10) -> str:
    blocks = []
    for name in names:
        points = _series(records, name)
        if not points:
            blocks.append(f"{name}: no values")
            continue
        steps = [s for s, _ in points]
        values = [v for _, v in points]
        lo, hi = min(values), max(values)
        span = (hi - lo) or 1.0
        columns = min(width, len(values))
        # Average the points falling in each column.
        buckets: list[list[float]] = [[] for _ in range(columns)]
        for i, v in enumerate(values):
            buckets[min(columns - 1, i * columns // len(values))].append(v)
        col_values = [sum(b) / len(b) for b in buckets if b]
        grid = [[" "] * len(col_values) for _ in range(height)]
        for x, v in enumerate(col_values):
            y = int(round((v - lo) / span * (height - 1)))
            grid[height - 1 - y][x] = "•"
        lines = [f"{name}  (steps {steps[0]}-{steps[-1]}, first {values[0]:.4g}, last {values[-1]:.4g})"]
        for row_index, row in enumerate(grid):
            label = hi - (hi - lo) * row_index / (height - 1) if height > 1 else hi
            lines.append(f"{label:>10.4g} │{''.join(row)}")
        lines.append(" " * 11 + "└" + "─" * len(col_values))
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def plot_png(records: list[dict], names: list[str], out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise LoopsError(
            "--out needs matplotlib, which is not installed",
            hint="pip install matplotlib, or drop --out to plot in the terminal.",
        ) from None
    fig, axes = plt.subplots(len(names), 1, figsize=(8, 3 * len(names)), squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        points = _series(records, name)
        ax.plot([s for s, _ in points], [v for _, v in points], marker=".")
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
