"""How a training run shows itself: a Rich live view on a TTY, one plain line per step off a
TTY, JSON Lines on stdout with ``-o jsonl``. All human output goes to stderr.

:meth:`Output.training_view` picks one (the sink owns every terminal decision); the training
service drives it through ``training.experiments.metrics.MetricsSink`` (``start``, ``step``, ``message``,
``close``). What a step line shows besides the common columns is the kind's: ``fields`` are its
``training.kinds.StepField`` entries (key, label, spec, of, optional), read by attribute.
"""

from __future__ import annotations

import json
import math
import sys
import time
from typing import Any, Sequence, TextIO

SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], width: int = 30) -> str:
    """The last ``width`` values, scaled to the range of ALL values: a flat tail after a big drop
    stays flat instead of being stretched into noise."""
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not values:
        return ""
    lo, hi = min(values), max(values)
    span = hi - lo or 1.0
    return "".join(SPARK[min(len(SPARK) - 1, int((v - lo) / span * (len(SPARK) - 1)))] for v in values[-width:])


class EtaEstimator:
    """Seconds left, from the mean step time of this session (steps resumed from are not timed).

    The mean over all steps so far, not the last few, so one slow step (an eval, a checkpoint)
    moves it a little; after the first 10% of steps each new estimate is also kept within 2x of
    the previous one, so the live view never jumps."""

    WARMUP = 0.1
    MAX_RATIO = 2.0

    def __init__(self, total_steps: int, start_step: int = 0, now: float | None = None) -> None:
        self.total = total_steps
        self.start_step = start_step
        self.started = time.monotonic() if now is None else now
        self.seconds: float | None = None

    def update(self, step: int, now: float | None = None) -> float | None:
        now = time.monotonic() if now is None else now
        done = step - self.start_step
        if done <= 0:
            return self.seconds
        estimate = (now - self.started) / done * max(0, self.total - step)
        if self.seconds is not None and step >= self.WARMUP * self.total and estimate > 0:
            estimate = min(max(estimate, self.seconds / self.MAX_RATIO), self.seconds * self.MAX_RATIO)
        self.seconds = estimate
        return estimate


def _fmt(value: Any, spec: str = ".4f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def table_text(rows: list[dict], columns: list[tuple[str, Any]]) -> str:
    """A table as plain text, as the sink prints one off a terminal (a run directory's eval.txt)."""
    import io

    from baseten_loops_cli.output.sink import Output, Streams

    buffer = io.StringIO()
    out = Output("table", streams=Streams(stdout=buffer, stderr=io.StringIO(), stdin_tty=False, stdout_tty=False, stderr_tty=False))
    out.emit(rows, rows=rows, columns=columns)
    return buffer.getvalue()


def _field_text(record: dict, field: Any) -> str | None:
    if field.optional and field.key not in record:
        return None
    if field.of is not None:  # "groups 2/4"
        return f"{field.label} {record.get(field.key, 0)}/{record.get(field.of, 0)}"
    return f"{field.label} {_fmt(record.get(field.key), field.spec)}"


def step_line(record: dict, total: int, fields: Sequence[Any]) -> str:
    """``step 3/10``, the kind's ``fields``, then learning rate, tokens/s and policy version."""
    parts = [f"step {record['step']}/{total}"]
    parts += [text for text in (_field_text(record, f) for f in fields) if text is not None]
    parts.append(f"lr {_fmt(record.get('learning_rate'), '.2e')}")
    parts.append(f"tok/s {_fmt(record.get('tokens_per_s'), '.0f')}")
    parts.append(f"v{record.get('policy_version', '-')}")
    return "  ".join(parts)


class PlainTrainingView:
    """One line per step on stderr; with ``jsonl`` also each record on stdout."""

    def __init__(self, *, jsonl: bool = False, quiet: bool = False, out: TextIO | None = None, err: TextIO | None = None):
        self.jsonl = jsonl
        self.quiet = quiet
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.total = 0
        self.fields: Sequence[Any] = ()

    def start(self, total_steps: int, start_step: int, main_metric: str, fields: Sequence[Any]) -> None:
        self.total = total_steps
        self.fields = fields

    def step(self, record: dict) -> None:
        if self.jsonl:
            self.out.write(json.dumps(record, separators=(",", ":")) + "\n")
            self.out.flush()
        if not self.quiet:
            print(step_line(record, self.total, self.fields), file=self.err, flush=True)

    def message(self, text: str) -> None:
        if not self.quiet:
            print(text, file=self.err, flush=True)

    def close(self) -> None:
        pass

    table_text = staticmethod(table_text)


class LiveTrainingView:
    """A Rich live view: progress bar with ETA, the main metric, LR, tokens/s, policy version,
    and a sparkline of the main metric."""

    def __init__(self, console) -> None:
        self.console = console
        self.history: list[float] = []
        self.total = 0
        self.main_metric = "loss"
        self.fields: Sequence[Any] = ()
        self.last: dict = {}
        self._live: Any = None  # rich.live.Live once started
        self._progress: Any = None  # rich.progress.Progress once started
        self._task: Any = None

    def start(self, total_steps: int, start_step: int, main_metric: str, fields: Sequence[Any]) -> None:
        from rich.live import Live
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.total = total_steps
        self.main_metric = main_metric
        self.fields = fields
        self.eta = EtaEstimator(total_steps, start_step)
        self._progress = Progress(
            TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), TextColumn("eta {task.fields[eta]}"), console=self.console,
        )  # fmt: skip
        self._task = self._progress.add_task("train", total=total_steps, completed=start_step, eta="-:--:--")
        self._live = Live(self._render(), console=self.console, refresh_per_second=4, transient=False)
        self._live.start()

    def _render(self):
        from rich.console import Group
        from rich.text import Text

        record = self.last
        if record:
            line = step_line(record, self.total, self.fields)
        else:
            line = "waiting for the first step..."
        spark = sparkline(self.history)
        return Group(self._progress, Text(line), Text(f"{self.main_metric} {spark}", style="cyan"))

    def step(self, record: dict) -> None:
        self.last = record
        value = record.get(self.main_metric)
        if isinstance(value, (int, float)):
            self.history.append(float(value))
        seconds = self.eta.update(int(record["step"]))
        eta = "-:--:--" if seconds is None else time.strftime("%H:%M:%S", time.gmtime(seconds))
        self._progress.update(self._task, completed=record["step"], eta=eta)
        self._live.update(self._render())

    def message(self, text: str) -> None:
        self.console.print(text)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    table_text = staticmethod(table_text)
