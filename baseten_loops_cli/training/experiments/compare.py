"""`loops train compare`: finished (or stopped) runs side by side, one row each.

The runs are read by the one reader of run directories (rundir.RunRecord); this module only
picks the columns: the config keys whose values differ between the runs, steps, the final and
best value of each train and eval metric, the `eval:` table's figures (eval.json), wall time,
tokens and cost. Nothing is rendered here: the command hands :class:`Comparison` to the output
sink (table, JSON, CSV).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from baseten_loops_cli.errors import UsageError
from baseten_loops_cli.training.config import dotted_keys
from baseten_loops_cli.training.experiments.rundir import RunRecord

# Keys that differ between any two runs and say nothing about the training.
_IGNORED_KEYS = ("name", "logging.run_dir", "logging.wandb_name", "logging.tracker_dir")
_HIGHER_IS_BETTER_HINTS = ("reward", "accuracy", "pass", "margin", "score", "exact", "win", "f1", "chosen")


def higher_is_better(column: str) -> bool:
    name = column.lower()
    if "loss" in name or "kl" in name or "error" in name or "perplexity" in name:
        return False
    return any(h in name for h in _HIGHER_IS_BETTER_HINTS)


@dataclass
class Comparison:
    rows: list[dict]  # one per run; the keys below, a "best" list of the columns it wins
    key_columns: list[str]  # the config keys that differ
    metric_columns: list[str]  # numeric columns a best value is marked in
    best: dict[str, list[str]] = field(default_factory=dict)  # column -> run labels holding the best

    @property
    def columns(self) -> list[str]:
        return ["run", "status", *self.key_columns, "steps", *self.metric_columns]

    def as_dict(self) -> dict:
        return {"runs": self.rows, "keys": self.key_columns, "metrics": self.metric_columns, "best": self.best}


def _num(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(float(value)):
        return float(value)
    return None


def compare(runs: list[RunRecord], *, main_metrics: dict[str, str] | None = None, sort: str | None = None) -> Comparison:
    """One row per run. ``main_metrics`` maps a kind to its main metric (the registry's), the
    train metric compared; every ``eval_*`` metric of the step records is compared too."""
    main_metrics = main_metrics or {}
    flats = [dotted_keys(r.config) for r in runs]
    all_keys = sorted({k for f in flats for k in f})
    key_columns = [k for k in all_keys if k not in _IGNORED_KEYS and not k.startswith("sweep.")
                   and len({repr(f.get(k)) for f in flats}) > 1]
    train_names: list[str] = []
    for r in runs:
        main = main_metrics.get(r.kind or "", "loss")
        if main not in train_names:
            train_names.append(main)
    eval_names = sorted({n for r in runs for n in r.numeric_names() if n.startswith("eval_")}
                        | {k for r in runs for k in r.final if k.startswith("eval_") and _num(r.final[k]) is not None})
    figure_names = sorted({k for r in runs for k in r.eval_figures()})
    rows = []
    for r, flat in zip(runs, flats):
        row: dict[str, Any] = {"run": r.label, "status": r.status}
        row.update({k: flat.get(k) for k in key_columns})
        row["steps"] = r.steps
        for name in [*train_names, *eval_names]:
            values = r.values(name)
            last = _num(r.final.get(name)) if name in r.final else (values[-1] if values else None)
            if name in r.final and _num(r.final.get(name)) is not None:
                values = [*values, float(r.final[name])]
            row[f"final_{name}"] = last
            row[f"best_{name}"] = (max(values) if higher_is_better(name) else min(values)) if values else None
        row.update({name: r.eval_figures().get(name) for name in figure_names})
        row["wall_s"] = r.wall_seconds()
        row["tokens"] = r.tokens()
        row["cost_usd"] = _cost(r)
        rows.append(row)
    metric_columns = [f"{p}_{n}" for n in [*train_names, *eval_names] for p in ("final", "best")]
    metric_columns += [*figure_names, "wall_s", "tokens", "cost_usd"]
    best: dict[str, list[str]] = {}
    for column in metric_columns:
        scored = [(str(row["run"]), v) for row in rows if (v := _num(row.get(column))) is not None]
        if len(scored) < 2 or len({v for _, v in scored}) == 1:
            continue  # nothing to choose between
        lower_wins = column in ("wall_s", "tokens", "cost_usd") or not higher_is_better(column)
        target = (min if lower_wins else max)(v for _, v in scored)
        best[column] = [label for label, v in scored if v == target]
    for row in rows:
        row["best"] = [c for c, labels in best.items() if row["run"] in labels]
    if sort is not None:
        columns = ["steps", *metric_columns]
        if sort not in columns:
            plain = {c.removeprefix("final_"): c for c in columns if c.startswith("final_")}
            if sort not in plain:
                raise UsageError(f"--sort {sort!r}: no such column",
                                 hint=f"Sort by one of: {', '.join(columns)}.")
            sort = plain[sort]
        lower_wins = sort in ("wall_s", "tokens", "cost_usd") or not higher_is_better(sort)
        present = [r for r in rows if _num(r.get(sort)) is not None]
        missing = [r for r in rows if _num(r.get(sort)) is None]
        present.sort(key=lambda r: float(r[sort]), reverse=not lower_wins)
        rows = present + missing
    return Comparison(rows, key_columns, metric_columns, best)


def _cost(r: RunRecord) -> float | None:
    """What the config's prices make of the run's trained tokens and wall time (None unpriced)."""
    raw = r.config.get("pricing")
    pricing: dict = raw if isinstance(raw, dict) else {}
    per_train = _num(pricing.get("usd_per_million_train_tokens"))
    per_hour = _num(pricing.get("usd_per_hour"))
    if per_train is None and per_hour is None:
        return None
    return (r.tokens() or 0) / 1e6 * (per_train or 0.0) + (r.wall_seconds() or 0.0) / 3600 * (per_hour or 0.0)
