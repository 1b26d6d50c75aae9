"""The training service: check and plan a config, run it, resume a run directory.

`loops train validate|run|resume` parse their options, call these and render what they return
(cli/train.py); a sweep will call them once per point. Everything between "the config is
loaded" and "the run has ended" is here: the run directory, the plan, the session on the
backend (training/session.py), the metrics sink and W&B, the kind's loop (training/kinds), the
checkpoint saved when a reward breaks, state.json, deactivation, the summary and the local
calibration record.

Nothing here prints or imports ``cli``/``output``: people hear about a run through the
``announce`` callable (one line each) and the :class:`~training.experiments.metrics.TrainingView` the caller
supplies (the steps); asking before billable capacity is provisioned is the caller's
(``backend.capabilities.billable``).

``backend`` is anything with ``client``, ``api_key``, ``base_url``, ``profile_name`` and
``capabilities`` (settings.connection.Capabilities); cli/_backend.Backend is one.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from baseten_loops_cli.services import Connected  # the backend: cli._backend.Backend is one

from baseten_loops_cli.errors import InterruptedByUser, LoopsError, UsageError
from baseten_loops_cli.training.config import LoadedConfig
from baseten_loops_cli.training.kinds import LoadedData
from baseten_loops_cli.training.plan import Plan
from baseten_loops_cli.training.experiments.rundir import RunDir

Announce = Callable[[str], None]


@dataclass
class TrainingSummary:
    """How training ended: what `train run|resume -o json` prints (:meth:`as_dict`).

    ``status`` is state.json's: ``completed``, or ``interrupted`` by Ctrl-C (then `loops train
    resume RUN_DIR` continues)."""

    run_id: str | None
    run_dir: str
    status: str
    steps: int
    main_metric: str
    first: float | None
    last: float | None
    final_checkpoint: str | None
    deactivated: bool = False  # the run this command created was deactivated at the end
    # A judge reward's totals over the run (every step once, across resumes): requests,
    # prompt_tokens, completion_tokens, tokens, and who served it (a URL, or the run's backend).
    judge: dict | None = None

    def as_dict(self) -> dict:
        out: dict[str, Any] = {
            "run_id": self.run_id,
            "run_dir": self.run_dir,
            "status": self.status,
            "steps": self.steps,
            f"first_{self.main_metric}": self.first,
            f"last_{self.main_metric}": self.last,
            "final_checkpoint": self.final_checkpoint,
        }
        if self.judge is not None:
            out["judge"] = self.judge
        return out

    def judge_line(self) -> str | None:
        """For people: what the judge used (a URL judge is billed by its provider)."""
        if self.judge is None:
            return None
        j = self.judge
        where = f"billed by {j['served_by']}" if j.get("served_by", "").startswith("http") else f"sampled on {j.get('served_by')}"
        return (f"Judge: {j['requests']:,} requests, {j['prompt_tokens']:,} prompt + {j['completion_tokens']:,} "
                f"completion tokens ({where})")


class TrainingInterrupted(InterruptedByUser):
    """Ctrl-C ended training; state is saved and ``summary`` says where it stopped (a script
    reading -o json gets it too, then exit 130)."""

    def __init__(self, message: str, summary: TrainingSummary, hint: str):
        super().__init__(message, hint=hint)
        self.summary = summary


@dataclass
class PreparedRun:
    """A config checked against its backend, with its data loaded and its plan: what `train run`
    shows (and confirms) before anything is provisioned."""

    loaded: LoadedConfig
    rundir: RunDir
    data: LoadedData
    plan: Plan
    started: float = field(default_factory=time.monotonic)


@dataclass
class ResumeTarget:
    """A run directory to resume: its config (as saved there) and its last state."""

    rundir: RunDir
    loaded: LoadedConfig
    state: dict

    @property
    def completed(self) -> bool:
        return self.state.get("status") == "completed"


# ------------------------------------------------------------------ checks and plans
def load(config: Path, overrides: list[str] | None = None) -> LoadedConfig:
    """Load and validate a config, including that its data files exist."""
    from baseten_loops_cli.training.config import load_config
    from baseten_loops_cli.training.experiments.trackers import check_installed

    loaded = load_config(config, overrides or [], check_files=True)
    check_installed(loaded.config.logging.trackers)
    return loaded


def check_on_backend(client: Any, loaded: LoadedConfig) -> list[str]:
    """What the backend must say yes to before anything is provisioned: the base model (and
    max_seq_len) is offered, and the kind's own checks (a DPO checkpoint reference exists).
    Returns notes for the plan."""
    from baseten_loops_cli.training import kinds
    from baseten_loops_cli.training.plan import check_base_model

    notes = check_base_model(client, loaded)
    kind = kinds.of(loaded.config)
    if kind.check is not None:
        kind.check(client, loaded)
    reward = getattr(loaded.config, kind.reward_key) if kind.reward_key else None
    for index, spec in enumerate(reward if isinstance(reward, list) else [reward]):
        if getattr(spec, "judge", None) is None:
            continue
        # A grader must answer and take its key (a URL), or exist on the backend (a checkpoint,
        # a base model it serves), before capacity is provisioned.
        from baseten_loops_cli.training.rewards.judge import Judge

        keys = (kind.reward_key, index, "judge") if isinstance(reward, list) else (kind.reward_key, "judge")
        Judge(spec.judge, where=f"{loaded.where(*keys)}: {kind.reward_key}.judge").check(client)
    return notes


def validate(loaded: LoadedConfig, backend: "Connected | None", *, offline: bool = False) -> Plan:
    """Check a config (every row, and against ``backend`` when one is given) and plan it. An
    unreachable backend is a note, not an error (none when ``offline``: not asked); without
    one the plan is this machine's."""
    from baseten_loops_cli.api.errors import ConnectionFailedError
    from baseten_loops_cli.settings.connection import CAPABILITIES
    from baseten_loops_cli.errors import ConfigError
    from baseten_loops_cli.training.plan import load_data, make_plan, problems_together

    notes: list[str] = []
    problems: list[ConfigError] = []  # the backend's and the data's, listed together
    if backend is None:
        if not offline:
            notes.append("base model not checked: the backend is not running (start it with `loops server start`)")
        capabilities = CAPABILITIES["local"]  # what a config runs on when no profile is set up
    else:
        capabilities = backend.capabilities
        try:
            notes += check_on_backend(backend.client, loaded)
        except ConnectionFailedError:
            notes.append(f"base model not checked: {backend.base_url} is not reachable")
        except ConfigError as exc:
            problems.append(exc)
    try:
        data = load_data(loaded)
    except ConfigError as exc:
        problems.append(exc)
    if problems:
        raise problems_together(problems)
    plan = make_plan(loaded, data, capabilities)
    plan.notes += notes
    return plan


def new_run_dir(loaded: LoadedConfig, run_dir: Path | None) -> RunDir:
    """Where `train run` writes: --run-dir, else the config's logging.run_dir (relative to the
    working directory), else runs/NAME-TIME. It must not hold a run already."""
    if run_dir is None and loaded.config.logging.run_dir:
        run_dir = Path(loaded.config.logging.run_dir).expanduser()
    rundir = RunDir(run_dir or default_run_dir(loaded.config.name))
    if rundir.exists():
        raise UsageError(
            f"{rundir.path} already holds a run",
            hint=f"Resume it with `loops train resume {rundir.path}`, or pass another --run-dir.",
        )
    rundir.check_target()
    return rundir


def default_run_dir(name: str) -> Path:
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-") or "run"
    return Path("runs") / f"{slug}-{time.strftime('%Y%m%d-%H%M%S')}"


def prepare(loaded: LoadedConfig, rundir: RunDir, backend: "Connected", *, started: float | None = None) -> PreparedRun:
    """Check the config against ``backend``, load its data and plan it (nothing provisioned).
    ``started`` (monotonic) is when the command began, for the calibration of local plans."""
    from baseten_loops_cli.training.plan import load_data, make_plan

    check_on_backend(backend.client, loaded)
    data = load_data(loaded)
    plan = make_plan(loaded, data, backend.capabilities)
    return PreparedRun(loaded, rundir, data, plan, time.monotonic() if started is None else started)


# ------------------------------------------------------------------ run and resume
def run(prepared: PreparedRun, backend: "Connected", *, view: Any, announce: Announce, keep_run: bool = False) -> TrainingSummary:
    """Create the run directory and train the prepared config to the end.

    Raises :class:`TrainingInterrupted` on Ctrl-C (state saved; the summary is on it) and
    LoopsError with the resume command in its hint when training fails."""
    from baseten_loops_cli.training import calibration

    loaded, rundir = prepared.loaded, prepared.rundir
    rundir.create(absolute_raw(loaded), loaded.path)
    announce(f"Run directory: {rundir.path}")
    summary = _execute(backend, loaded, prepared.data, rundir, resume=False, keep_run=keep_run,
                       view=view, announce=announce)
    if backend.capabilities.calibrated_plans:
        # The next plan of this model on this machine is calibrated by this run's measured speed.
        step_seconds = sum(float(r.get("step_time_s") or 0.0) for r in rundir.metrics() if not r.get("final"))
        plan = prepared.plan
        calibration.record(loaded.config.kind, loaded.config.base_model, seconds=time.monotonic() - prepared.started,
                           step_seconds=step_seconds, tokens=plan.train_tokens + plan.sample_tokens)
    return summary


def open_run_dir(run_dir: Path) -> ResumeTarget:
    """A run directory of `train run`, with the config saved in it (paths made absolute)."""
    from baseten_loops_cli.training.config import load_config

    rundir = RunDir(run_dir)
    if not rundir.exists():
        what = "no state.json" if run_dir.is_dir() else ("a file" if run_dir.exists() else "no such folder")
        raise UsageError(f"{run_dir} is not a run directory ({what})", hint="Pass the --run-dir of `loops train run`.")
    state = rundir.read_state()
    loaded = load_config(rundir.config_file)
    from baseten_loops_cli.training.experiments.trackers import check_installed

    check_installed(loaded.config.logging.trackers)
    return ResumeTarget(rundir, loaded, state)


def load_data(loaded: LoadedConfig) -> LoadedData:
    """The config's data, every row checked (the kind's loading)."""
    from baseten_loops_cli.training.plan import load_data as load

    return load(loaded)


def resume(target: ResumeTarget, data: LoadedData, backend: "Connected", *, view: Any, announce: Announce,
           keep_run: bool = False) -> TrainingSummary:
    """Continue an interrupted run from its last checkpoint (see :func:`run` for what it raises)."""
    return _execute(backend, target.loaded, data, target.rundir, resume=True, keep_run=keep_run,
                    view=view, announce=announce)


def summary_of(rundir: RunDir, run_id: str | None, kind: str, status: str, *, deactivated: bool = False) -> TrainingSummary:
    """The summary of a run directory as its metrics and checkpoints record it."""
    from baseten_loops_cli.training import kinds

    from baseten_loops_cli.training.rewards.judge import usage_of_records

    records = rundir.metrics()
    metrics = [r for r in records if not r.get("final")]
    main = kinds.get(kind).main_metric
    judge = usage_of_records(records)
    if judge is not None:
        judge["served_by"] = _judge_label(rundir)
    values = [r[main] for r in metrics if isinstance(r.get(main), (int, float))]
    last_ckpt = rundir.last_checkpoint() or {}
    return TrainingSummary(
        run_id=run_id,
        run_dir=str(rundir.path),
        status=status,
        steps=metrics[-1]["step"] if metrics else 0,
        main_metric=main,
        first=values[0] if values else None,
        last=values[-1] if values else None,
        final_checkpoint=last_ckpt.get("sampler_path") or last_ckpt.get("path"),
        deactivated=deactivated,
        judge=judge,
    )


def _judge_label(rundir: RunDir) -> str:
    """Who served the run's judge(s), from its config.yaml: the URL, else "the run's backend (MODEL)"."""
    import yaml

    try:
        raw = yaml.safe_load((rundir.path / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        return "?"
    rewards = raw.get("reward")
    specs = [r.get("judge") for r in (rewards if isinstance(rewards, list) else [rewards]) if isinstance(r, dict)]
    labels = [s.get("url") or f"the run's backend ({s.get('model')})" for s in specs if isinstance(s, dict)]
    return ", ".join(labels) or "?"


def main_metric(kind: str | None) -> str:
    """The main metric of the kind a run directory's config names (``loss`` when it names no
    registered kind): `train plot`'s default, the train metric `train compare` shows."""
    from baseten_loops_cli.training import kinds

    return kinds.get(kind).main_metric if isinstance(kind, str) and kind in kinds.names() else "loss"


def absolute_raw(loaded: LoadedConfig) -> dict:
    """The config as the run directory keeps it: the kind's data paths (each local source of a
    mixture too), a base_model folder and code files (``file.py:function``) made absolute, so `loops train resume` works from anywhere."""
    import copy

    from baseten_loops_cli.training import kinds
    from baseten_loops_cli.training.config import data_path_keys
    from baseten_loops_cli.training.data.formats.spec import absolute_sources

    raw = copy.deepcopy(loaded.raw)
    for section, key in data_path_keys(loaded.config.kind):
        value = raw[section].get(key) if isinstance(raw.get(section), dict) else None
        if value is not None:  # a path, a source or a list of them (hub names stay as they are)
            raw[section][key] = absolute_sources(value, loaded.resolve_path)
    if loaded.config.base_model != raw.get("base_model") and Path(loaded.config.base_model).is_absolute():
        raw["base_model"] = loaded.config.base_model  # a model folder, made absolute by load_config

    def absolute(parent: Any, keys: tuple) -> None:
        """Make the code reference at ``keys`` under ``parent`` absolute ("*": every list item)."""
        head, rest = keys[0], keys[1:]
        if head == "*":
            for index in range(len(parent) if isinstance(parent, list) else 0):
                (absolute(parent[index], rest) if rest else set_absolute(parent, index))
        elif isinstance(parent, dict) and head in parent:
            absolute(parent[head], rest) if rest else set_absolute(parent, head)

    def set_absolute(parent: Any, key: Any) -> None:
        value = parent[key]
        if isinstance(value, str) and ":" in value and value.split(":", 1)[0].endswith(".py"):
            file_part, func = value.rsplit(":", 1)
            parent[key] = f"{loaded.resolve_path(file_part).resolve()}:{func}"

    for keys in kinds.of(loaded.config).code_keys:
        absolute(raw, keys)
    return raw


def _execute(backend: "Connected", loaded: LoadedConfig, data: LoadedData, rundir: RunDir, **options: Any) -> TrainingSummary:
    """:func:`_train` with the run directory held by this process (its .lock): a second `train
    resume` of the same directory (a sweep's resume while a killed sweep's run still stops) is
    refused instead of replaying the other's steps."""
    from baseten_loops_cli.training.experiments.rundir import RunDirBusy

    try:
        rundir.acquire()
    except RunDirBusy as busy:
        raise UsageError(str(busy), hint="Wait for that process to stop (or stop it), then run this again.") from None
    try:
        return _train(backend, loaded, data, rundir, **options)
    finally:
        rundir.release()


def _train(backend: "Connected", loaded: LoadedConfig, data: LoadedData, rundir: RunDir, *, resume: bool, keep_run: bool,
           view: Any, announce: Announce) -> TrainingSummary:
    """Connect, train, and leave the run directory and the backend in a clean state.

    Whatever ends the loop (done, Ctrl-C, a broken reward, a backend error, a bug), state.json
    says so and a run this call created is deactivated unless ``keep_run``: no idle capacity
    is left billing.
    """
    from baseten_loops_cli.training import kinds
    from baseten_loops_cli.training.loop import core as train_loop
    from baseten_loops_cli.training.experiments.metrics import MetricsSink, open_wandb
    from baseten_loops_cli.training.rewards.builtins import RewardError
    from baseten_loops_cli.training.session import StopRequested, open_session, save_checkpoint
    from baseten_loops_cli.training.experiments.trackers import open_trackers

    kind = kinds.of(loaded.config)
    resume_cmd = f"loops train resume {rundir.path}"
    session = None
    sink = None

    def finish(status: str, **fields: Any) -> None:
        rundir.update_state(status=status, **fields)
        if sink is not None:
            sink.close()
        if session is not None:
            session.close(deactivate=session.created_run and not keep_run)
            # `status` is how training ended (completed, interrupted, failed); `run_status` is
            # the run's own status on the backend, in the backend's words (what `loops runs
            # list` shows: ACTIVE, INACTIVE, ...), read back rather than assumed.
            try:
                rundir.update_state(run_status=session.client.runs.get(session.run_id).status_name)
            except LoopsError:
                pass

    status = "failed"
    try:
        with StopRequested() as stop:
            # Inside StopRequested: a Ctrl-C while the run is being created still ends cleanly
            # (the loop sees the request before its first step, saves and stops).
            session = open_session(loaded, rundir, backend, resume=resume, announce=announce)
            wandb, note = open_wandb(loaded.config, rundir, run_id=session.run_id, raw_config=loaded.raw)
            if note:
                announce(note)
            trackers, notes = open_trackers(loaded.config, rundir, raw_config=absolute_raw(loaded),
                                            start_step=session.start_step)  # the config as config.yaml keeps it
            for note in notes:
                announce(note)
            sink = MetricsSink(rundir, view, wandb=wandb, trackers=trackers, step_fields=kind.step_fields)
            try:
                status = train_loop.run(kind.hooks(session, data), sink, stop)
            except RewardError:
                # The run stops on a broken reward, but keeps what it learned so far: the
                # trainer is at the last step recorded in metrics.jsonl.
                done = [int(r.get("step", 0)) for r in rundir.metrics() if not r.get("final")]
                step = max([int(rundir.read_state().get("step", 0))] + done)
                try:
                    save_checkpoint(session, step)
                except LoopsError:
                    pass
                raise
    except KeyboardInterrupt:
        finish("interrupted")
        run_id = session.run_id if session else rundir.read_state().get("run_id")
        raise TrainingInterrupted("interrupted before the step finished", summary_of(rundir, run_id, kind.name, "interrupted"),
                                  hint=f"Resume with `{resume_cmd}`.") from None
    except LoopsError as exc:
        finish("failed", error=exc.message)
        exc.hint = (exc.hint + " " if exc.hint else "") + f"Resume with `{resume_cmd}`."
        raise
    except BaseException as exc:
        finish("failed", error=f"{type(exc).__name__}: {exc}")
        raise
    deactivated = session.created_run and not keep_run
    finish(status)
    summary = summary_of(rundir, session.run_id, kind.name, status, deactivated=deactivated)
    if status == "interrupted":
        raise TrainingInterrupted("stopped after the step in flight; state saved", summary, hint=f"Resume with `{resume_cmd}`.")
    return summary
