"""Where a training loop's records go: the run directory (always), the display, and W&B.

The loops call a :class:`MetricsSink` and never know which of these are on:

- ``step(record)``: one record per optimizer step -> metrics.jsonl (appended; fsynced before
  the checkpoint that covers it), the view (live view / plain lines / JSON Lines: a
  :class:`TrainingView` the command supplies, ``output.training_view``), and W&B
  when ``logging.wandb_project`` is set and ``wandb`` is installed;
- ``final(record)``: the end-of-run eval record (``"final": true`` in metrics.jsonl);
- ``samples(records)``: RL rollouts -> samples.jsonl;
- ``message(text)``: a human line on stderr (or the live view).

TensorBoard, MLflow and trackio (``logging.trackers``) get the same records through
training/experiments/trackers.py (``trackers=``).

W&B is optional: when the config asks for it and the package is missing, the run says so once
and carries on with metrics.jsonl. The W&B run id is kept in state.json, so ``loops train
resume`` continues the same W&B run instead of starting a second one.
"""

from __future__ import annotations

import math
from typing import Any, Protocol, Sequence

from baseten_loops_cli.training.experiments.rundir import RunDir


class TrainingView(Protocol):
    """How a run shows itself to whoever started it (``output.training_view`` draws one for
    the CLI). ``fields`` are the kind's ``StepField`` entries for the step line."""

    def start(self, total_steps: int, start_step: int, main_metric: str, fields: Sequence[Any]) -> None: ...
    def step(self, record: dict) -> None: ...
    def message(self, text: str) -> None: ...
    def close(self) -> None: ...
    def table_text(self, rows: list[dict], columns: list[tuple[str, Any]]) -> str | None:
        """A table as plain text (what a run directory's eval.txt holds)."""


class _NoView:
    def start(self, total_steps: int, start_step: int, main_metric: str, fields: Sequence[Any]) -> None:
        pass

    def step(self, record: dict) -> None:
        pass

    def message(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass

    def table_text(self, rows: list[dict], columns: list[tuple[str, Any]]) -> str | None:
        return None


def _wandb_safe(record: dict) -> dict:
    """Numbers only, NaN/None dropped: what W&B charts."""
    return {
        k: v
        for k, v in record.items()
        if k not in ("step", "final") and isinstance(v, (int, float)) and not isinstance(v, bool)
        and not (isinstance(v, float) and math.isnan(v))
    }


class WandbLogger:
    """A thin wrapper over a ``wandb`` run (or anything with ``.log`` and ``.finish``)."""

    def __init__(self, run: Any) -> None:
        self.run = run

    def log(self, record: dict) -> None:
        try:
            self.run.log(_wandb_safe(record), step=int(record.get("step", 0)))
        except Exception:  # noqa: BLE001 - W&B trouble must never stop a paid training run
            pass

    def finish(self) -> None:
        try:
            self.run.finish()
        except Exception:  # noqa: BLE001
            pass


def open_wandb(config: Any, rundir: RunDir, *, run_id: str, raw_config: dict | None = None) -> tuple[WandbLogger | None, str | None]:
    """Start (or, on resume, continue) the W&B run a config asks for.

    Returns (logger or None, a note for the user or None).
    """
    project = config.logging.wandb_project
    if not project:
        return None, None
    try:
        import wandb
    except ImportError:
        return None, (
            f"logging.wandb_project is {project!r} but wandb is not installed; "
            "metrics go to metrics.jsonl only (pip install wandb to enable)"
        )
    state = rundir.read_state()
    wandb_id = state.get("wandb_id")
    if not wandb_id:
        try:
            wandb_id = str(wandb.util.generate_id())
        except Exception:  # noqa: BLE001 - an old or stub wandb
            wandb_id = f"loops-{run_id}"
        rundir.update_state(wandb_id=wandb_id)
    from baseten_loops_cli.training.experiments.trackers import sweep_of

    sweep = sweep_of(rundir)  # a sweep's runs are one W&B group, named after its folder
    try:
        run = wandb.init(
            project=project,
            name=config.logging.wandb_name or (rundir.path.resolve().name if sweep else config.name),
            group=sweep.name if sweep else None,
            id=wandb_id,
            resume="allow",
            config=raw_config or {},
            dir=str(rundir.path),
        )
    except Exception as exc:  # noqa: BLE001 - a W&B outage is not a reason to not train
        return None, f"W&B init failed ({type(exc).__name__}: {exc}); metrics go to metrics.jsonl only"
    return WandbLogger(run), f"W&B run {wandb_id} in project {project!r}"


class MetricsSink:
    """Fan-out of a loop's records; see the module docstring."""

    def __init__(self, rundir: RunDir, view: TrainingView | None = None, *, wandb: WandbLogger | None = None,
                 trackers: Any = None, step_fields: Sequence[Any] = ()) -> None:
        self.rundir = rundir
        self.view = view or _NoView()
        self.wandb = wandb
        self.trackers = trackers  # training.experiments.trackers.Trackers: TensorBoard, MLflow, trackio
        self.step_fields = tuple(step_fields)  # the kind's (training.kinds.Kind.step_fields)
        self.records: list[dict] = []

    def start(self, total_steps: int, start_step: int, main_metric: str) -> None:
        from baseten_loops_cli.training.kinds import StepField

        self.view.start(total_steps, start_step, main_metric, self.step_fields or (StepField(main_metric, main_metric),))

    def step(self, record: dict) -> None:
        self.rundir.append_metrics(record)  # recorded first: the display is only a view of it
        self.records.append(record)
        self.view.step(record)
        if self.wandb is not None:
            self.wandb.log(record)
        if self.trackers is not None:
            self.trackers.log(record)

    def final(self, record: dict) -> None:
        record = {**record, "final": True}
        self.rundir.append_metrics(record)
        if self.wandb is not None:
            self.wandb.log(record)
        if self.trackers is not None:
            self.trackers.final(record)

    def samples(self, records: list[dict]) -> None:
        self.rundir.append_samples(records)

    def message(self, text: str) -> None:
        self.view.message(text)

    def table_text(self, rows: list[dict], columns: list[tuple[str, Any]]) -> str | None:
        """The view's plain-text table of ``rows`` (None when the view draws none)."""
        return self.view.table_text(rows, columns)

    def close(self) -> None:
        self.view.close()
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
        if self.trackers is not None:
            self.trackers.finish()
            self.trackers = None
