"""Experiment trackers besides W&B (metrics.open_wandb): ``logging.trackers: [tensorboard,
mlflow, trackio]``. Each is an optional extra, imported only when a config names it; each gets
the step records' numeric fields under the same names as metrics.jsonl (``loss``,
``eval_loss``, ...; the end-of-run eval record as ``final/NAME``) and the resolved config as
its parameters.

Where they write: TensorBoard event files in ``TRACKER_DIR/tensorboard/RUN``; MLflow in
``$MLFLOW_TRACKING_URI`` when set, else the local file store ``TRACKER_DIR/mlruns``; trackio
in ``TRACKER_DIR/trackio`` when ``logging.tracker_dir`` is set, else trackio's own folder
(``$TRACKIO_DIR``, default ~/.cache/huggingface/trackio), where `trackio show` looks.
``TRACKER_DIR`` is ``logging.tracker_dir``, else the run directory's ``trackers/``, or for a
run of a sweep the sweep folder's ``trackers/`` (one place for all its runs).

Resume continues the same tracker run: the ids are kept in state.json (``trackers``), the
TensorBoard writer marks a restart at the resumed step (TensorBoard drops what the replaced
steps wrote), MLflow reopens its run id, trackio resumes the run of the same name.

A sweep groups its runs: W&B ``group`` (metrics.open_wandb), an MLflow parent run (created by
the first run of the sweep that needs it; its id in SWEEP_DIR/trackers.json), a trackio
project named after the sweep.

Tracker trouble never stops training: a failure to open one is a note, a failure to log is
ignored (metrics.jsonl has everything).
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Sequence

from baseten_loops_cli.errors import ConfigError
from baseten_loops_cli.training.experiments.rundir import SWEEP_INDEX, RunDir, atomic_write

# name -> (module that must import, the extra that installs it)
TRACKERS = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "mlflow": ("mlflow", "mlflow"),
    "trackio": ("trackio", "trackio"),
}
PACKAGE = "baseten-loops-cli"


def check_installed(names: Sequence[str], *, where: str = "logging.trackers") -> None:
    """Every named tracker can be imported: one line naming the extra otherwise (before
    anything is provisioned)."""
    for name in names:
        module, extra = TRACKERS[name]
        try:
            importlib.import_module(module)  # imported for real: a broken install fails here, not mid-run
        except ImportError:
            raise ConfigError(f"{where} names {name!r}, but {module} is not installed",
                             hint=f"Install it: pip install '{PACKAGE}[{extra}]' (or remove {name!r} from {where}).") from None


def _numbers(record: dict, prefix: str = "") -> dict[str, float]:
    return {
        f"{prefix}{k}": float(v)
        for k, v in record.items()
        if k not in ("step", "final") and isinstance(v, (int, float)) and not isinstance(v, bool)
        and not math.isnan(float(v)) and not math.isinf(float(v))
    }


def flat_params(raw: dict) -> dict[str, str]:
    """The resolved config as ``dotted.key -> text`` (what MLflow and TensorBoard take)."""
    from baseten_loops_cli.training.config import dotted_keys

    return {key: str(value) for key, value in dotted_keys(raw).items()}


def sweep_of(rundir: RunDir) -> Path | None:
    """The sweep folder a run directory belongs to (its parent holds sweep.json), else None."""
    parent = rundir.path.resolve().parent
    return parent if (parent / SWEEP_INDEX).is_file() else None


def tracker_dir(config: Any, rundir: RunDir) -> Path:
    if config.logging.tracker_dir:
        return Path(config.logging.tracker_dir).expanduser().resolve()
    sweep = sweep_of(rundir)
    return (sweep if sweep is not None else rundir.path.resolve()) / "trackers"


class TrackerLogger:
    """One tracker run: ``log(record)`` per step record, ``final(record)``, ``finish()``."""

    name = "tracker"

    def log(self, record: dict) -> None: ...
    def final(self, record: dict) -> None:
        self.log({**_numbers(record, "final/"), "step": record.get("step", 0)})
    def finish(self) -> None: ...


class TensorBoardLogger(TrackerLogger):
    name = "tensorboard"

    def __init__(self, logdir: Path, params: dict[str, str], start_step: int) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = event_pb2, summary_pb2
        logdir.mkdir(parents=True, exist_ok=True)
        self.writer = EventFileWriter(str(logdir))
        self.logdir = logdir
        if start_step > 0:
            # A restart at start_step + 1: TensorBoard's readers drop the events of later steps
            # that an earlier attempt wrote (they are replayed now), as SummaryWriter(purge_step=).
            self.writer.add_event(event_pb2.Event(step=start_step + 1, session_log=event_pb2.SessionLog(
                status=event_pb2.SessionLog.START)))
        else:
            text = "\n".join(f"    {k} = {v}" for k, v in params.items())  # indented: markdown code
            self._add({"config": None}, 0, text=text)

    def _add(self, values: dict, step: int, *, text: str | None = None) -> None:
        summary = self._summary
        if text is not None:
            from tensorboard.compat.proto import tensor_pb2, tensor_shape_pb2

            tensor = tensor_pb2.TensorProto(dtype=7, string_val=[text.encode()],  # DT_STRING
                                            tensor_shape=tensor_shape_pb2.TensorShapeProto())
            meta = summary.SummaryMetadata(plugin_data=summary.SummaryMetadata.PluginData(plugin_name="text"))
            entries = [summary.Summary.Value(tag="config", metadata=meta, tensor=tensor)]
        else:
            entries = [summary.Summary.Value(tag=k, simple_value=v) for k, v in values.items()]
        import time

        self.writer.add_event(self._event.Event(wall_time=time.time(), step=step, summary=summary.Summary(value=entries)))

    def log(self, record: dict) -> None:
        self._add(_numbers(record), int(record.get("step", 0)))

    def finish(self) -> None:
        self.writer.close()


class MlflowLogger(TrackerLogger):
    name = "mlflow"

    def __init__(self, client: Any, run_id: str) -> None:
        self.client, self.run_id = client, run_id

    def log(self, record: dict) -> None:
        from mlflow.entities import Metric
        import time

        now = int(time.time() * 1000)
        step = int(record.get("step", 0))
        metrics = [Metric(k, v, now, step) for k, v in _numbers(record).items()]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def finish(self) -> None:
        self.client.set_terminated(self.run_id)


class TrackioLogger(TrackerLogger):
    name = "trackio"

    def __init__(self, run: Any) -> None:
        self.run = run

    def log(self, record: dict) -> None:
        self.run.log(_numbers(record), step=int(record.get("step", 0)))

    def finish(self) -> None:
        import sys

        from trackio import context_vars

        with contextlib.redirect_stdout(sys.stderr):
            self.run.finish()
        if context_vars.current_run.get() is self.run:
            context_vars.current_run.set(None)  # finished: trackio's exit hook must not finish it again on stdout


class Trackers:
    """The fan-out the MetricsSink calls; a tracker that raises is dropped with no effect on training."""

    def __init__(self, loggers: list[TrackerLogger]) -> None:
        self.loggers = loggers

    def _each(self, method: str, *args: Any) -> None:
        for logger in list(self.loggers):
            try:
                getattr(logger, method)(*args)
            except Exception:  # noqa: BLE001 - a tracker must never stop a (paid) training run
                if method != "finish":
                    self.loggers.remove(logger)

    def log(self, record: dict) -> None:
        self._each("log", record)

    def final(self, record: dict) -> None:
        self._each("final", record)

    def finish(self) -> None:
        self._each("finish")


def open_trackers(config: Any, rundir: RunDir, *, raw_config: dict, start_step: int) -> tuple[Trackers | None, list[str]]:
    """Open (or on resume, continue) every tracker ``logging.trackers`` names. Returns the
    fan-out (None when none is named) and a note per tracker for the user."""
    names = list(dict.fromkeys(config.logging.trackers or []))
    if not names:
        return None, []
    base = tracker_dir(config, rundir)
    sweep = sweep_of(rundir)
    run_name = rundir.path.resolve().name if sweep is not None else config.name
    params = flat_params(raw_config)
    state = rundir.read_state().get("trackers") or {}
    loggers: list[TrackerLogger] = []
    notes: list[str] = []
    for name in names:
        try:
            if name == "tensorboard":
                logdir = base / "tensorboard" / run_name
                loggers.append(TensorBoardLogger(logdir, params, start_step))
                notes.append(f"TensorBoard: {logdir} (tensorboard --logdir {logdir.parent})")
            elif name == "mlflow":
                logger, where = _open_mlflow(config, rundir, base, sweep, run_name, params, state.get("mlflow_run_id"))
                state["mlflow_run_id"] = logger.run_id
                loggers.append(logger)
                notes.append(f"MLflow run {logger.run_id} in {where}")
            elif name == "trackio":
                trackio_logger, where = _open_trackio(config, base, sweep, run_name, params)
                loggers.append(trackio_logger)
                notes.append(f"trackio run {run_name!r} in project {where}")
        except Exception as exc:  # noqa: BLE001 - a tracker outage is not a reason not to train
            notes.append(f"{name}: could not start ({type(exc).__name__}: {exc}); metrics go to metrics.jsonl")
    rundir.update_state(trackers=state)
    return Trackers(loggers), notes


def _open_mlflow(config: Any, rundir: RunDir, base: Path, sweep: Path | None, run_name: str, params: dict[str, str],
                 run_id: str | None) -> tuple[MlflowLogger, str]:
    from mlflow.tracking import MlflowClient

    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        # The local file store: plain files beside the run, no database package (mlflow-skinny
        # reads and writes it). MLflow 3 keeps it in "maintenance mode" behind this switch; a
        # database or server is MLFLOW_TRACKING_URI's.
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        uri = (base / "mlruns").as_uri()
    client = MlflowClient(tracking_uri=uri)
    if run_id:
        client.update_run(run_id, status="RUNNING")
        return MlflowLogger(client, run_id), uri
    tags = {"loops.run_dir": str(rundir.path.resolve())}
    # A sweep's parallel runs share one experiment and one parent run: whichever comes first
    # makes them, under a lock, since the file store lets two racing creates both succeed.
    base.mkdir(parents=True, exist_ok=True)
    with _locked((sweep if sweep is not None else base) / ".trackers.lock"):
        experiment_id = _mlflow_experiment(client, sweep.name if sweep is not None else config.name)
        if sweep is not None:
            tags["mlflow.parentRunId"] = _mlflow_parent(client, experiment_id, sweep)
    run = client.create_run(experiment_id, run_name=run_name, tags=tags)
    from mlflow.entities import Param

    items = [Param(k[:250], v[:6000]) for k, v in params.items()]
    for i in range(0, len(items), 100):  # MLflow takes at most 100 params a batch
        client.log_batch(run.info.run_id, params=items[i:i + 100])
    return MlflowLogger(client, run.info.run_id), uri


def _mlflow_experiment(client: Any, name: str) -> str:
    """The id of the experiment called ``name``, made if missing. Under the caller's lock for a
    local store; against a tracking server another machine's run can still win the create, and
    then this one reads the winner's instead of losing its MLflow run."""
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    try:
        return client.create_experiment(name)
    except Exception:  # noqa: BLE001 - MLflow raises its own error types per store for "already exists"
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            raise
        return experiment.experiment_id


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    import fcntl

    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _mlflow_parent(client: Any, experiment_id: str, sweep: Path) -> str:
    """The sweep's MLflow parent run, made once by whichever of its runs comes first (the sweep
    folder's trackers.json holds its id). The caller holds the sweep's lock."""
    import json

    record = sweep / "trackers.json"
    try:
        known = json.loads(record.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        known = {}
    parent = known.get("mlflow_parent_run_id")
    if not parent:
        run = client.create_run(experiment_id, run_name=sweep.name, tags={"loops.sweep_dir": str(sweep)})
        parent = run.info.run_id
        known["mlflow_parent_run_id"] = parent
        atomic_write(record, json.dumps(known, indent=2) + "\n")
    return parent


def _open_trackio(config: Any, base: Path, sweep: Path | None, run_name: str, params: dict[str, str]) -> tuple[TrackioLogger, str]:
    if config.logging.tracker_dir:
        os.environ["TRACKIO_DIR"] = str(base / "trackio")  # read when trackio is first imported
    import sys

    with contextlib.redirect_stdout(sys.stderr):  # trackio prints; stdout is for -o json
        import trackio

        project = sweep.name if sweep is not None else config.name
        run = trackio.init(project=project, name=run_name, config=params, resume="allow", embed=False)
    return TrackioLogger(run), repr(project)
