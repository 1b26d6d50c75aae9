"""What every training loop shares: the run on the backend, the worker clients, the learning-rate
schedule, graceful Ctrl-C, and the exactly-once resume point.

The loops (training/kinds) know nothing about the CLI; they take a ``TrainingSession`` and a
``MetricsSink`` and write only through the run directory.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Generic

if TYPE_CHECKING:
    from baseten_loops_cli.services import Connected  # the backend: cli._backend.Backend is one

from baseten_loops_cli.errors import LoopsError
from baseten_loops_cli.training.config import CommonConfig, ConfigT, LoadedConfig
from baseten_loops_cli.training.experiments.rundir import RunDir


def learning_rate(opt: Any, step: int, total_steps: int) -> float:
    """LR at 0-based ``step``: linear warmup, then constant, linear or cosine decay to the floor."""
    base = opt.learning_rate
    if opt.warmup_steps and step < opt.warmup_steps:
        return base * (step + 1) / opt.warmup_steps
    if opt.schedule == "constant":
        return base
    decay_steps = max(1, total_steps - opt.warmup_steps)
    progress = min(1.0, (step - opt.warmup_steps) / decay_steps)
    floor = base * opt.min_lr_ratio
    if opt.schedule == "linear":
        return floor + (base - floor) * (1.0 - progress)
    return floor + (base - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def adam_params(opt: Any, lr: float) -> Any:
    """The AdamParams of one optimizer step: the config's AdamW settings at this step's LR."""
    from baseten_loops_cli.workers.types import AdamParams

    return AdamParams(
        learning_rate=lr, beta1=opt.beta1, beta2=opt.beta2, eps=opt.eps,
        weight_decay=opt.weight_decay, grad_clip_norm=opt.grad_clip_norm,
    )  # fmt: skip


class StopRequested:
    """Ctrl-C handling: the first SIGINT asks the loop to stop after the step in flight; a second
    one interrupts at once."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None

    def __enter__(self) -> "StopRequested":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.getsignal(signal.SIGINT)
            signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc: Any) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)



@dataclass
class TrainingSession(Generic[ConfigT]):
    """A connected run: control-plane client, trainer, sampler, and where to resume from."""

    loaded: LoadedConfig[ConfigT]
    rundir: RunDir
    client: Any  # api.client.LoopsClient
    api_key: str
    run: Any  # api.models.LoopsRun
    trainer: Any  # workers.trainer.TrainerClient
    created_run: bool
    start_step: int = 0
    _sampler: Any = field(default=None, repr=False)
    _model_samplers: dict = field(default_factory=dict, repr=False)  # base model -> standalone sampler

    @property
    def config(self) -> ConfigT:
        return self.loaded.config

    @property
    def run_id(self) -> str:
        return self.run.id

    def new_sampler_client(self) -> Any:
        """A client of the run's paired sampler (created on first use if the run has none)."""
        from baseten_loops_cli.workers.sampler import TRAINING_SAMPLE_TIMEOUT_S, SamplerClient

        if self._sampler is None:
            sampler = self.run.sampler
            if sampler is None or not sampler.base_url:
                sampler = self.client.samplers.create({"session_id": self.run.session_id, "run_id": self.run.id})
            self._sampler = sampler
        return SamplerClient(self._sampler.base_url, api_key=self.api_key, run_id=self.run.id,
                             timeout=TRAINING_SAMPLE_TIMEOUT_S)

    def new_base_sampler_client(self) -> Any:
        """A client of a standalone sampler on the frozen base model (for the KL penalty)."""
        return self.new_model_sampler_client(self.config.base_model)

    def new_model_sampler_client(self, base_model: str) -> Any:
        """A client of a standalone sampler on ``base_model`` (the frozen base model, or another
        model a kind scores with, e.g. a distillation teacher): created in the run's session on
        first use, deactivated by :meth:`close`."""
        from baseten_loops_cli.workers.sampler import TRAINING_SAMPLE_TIMEOUT_S, SamplerClient

        sampler = self._model_samplers.get(base_model)
        if sampler is None:
            sampler = self.client.samplers.create({"session_id": self.run.session_id, "base_model": base_model})
            self._model_samplers[base_model] = sampler
        return SamplerClient(sampler.base_url, api_key=self.api_key, sampler_id=sampler.id,
                             timeout=TRAINING_SAMPLE_TIMEOUT_S)

    def close(self, *, deactivate: bool) -> None:
        self.trainer.close()
        for sampler in self._model_samplers.values():
            try:
                self.client.samplers.deactivate(sampler.id)
            except LoopsError:
                pass
        if deactivate:
            try:
                self.client.runs.deactivate(self.run.id)
            except LoopsError:
                pass  # best effort: the run may already be gone


RESUMED_FROM = " (resumed from {run_id})"


def run_name(name: str, resumed_from: str | None = None) -> str:
    """The run's name on the control plane. A resumed run's name says which run it continues:
    the name is the one free-text field every backend keeps, so `loops runs describe` can show
    the lineage without the run directory (which keeps it too: state.json ``resumed_from``)."""
    if not resumed_from:
        return name
    suffix = RESUMED_FROM.format(run_id=resumed_from)
    return name[: 255 - len(suffix)] + suffix


# How long a run keeps retrying a trainer it cannot reach before it stops with the resume
# command (seconds; default the worker client's 45 s, long enough to ride out a gateway's
# restart). A script that would rather fail fast, or a test, sets it lower.
UNREACHABLE_TIMEOUT_ENV = "LOOPS_UNREACHABLE_TIMEOUT"


def _unreachable_timeout() -> float:
    from baseten_loops_cli.errors import UsageError
    from baseten_loops_cli.workers.trainer import DEFAULT_UNREACHABLE_TIMEOUT

    raw = os.environ.get(UNREACHABLE_TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_UNREACHABLE_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise UsageError(f"{UNREACHABLE_TIMEOUT_ENV}={raw!r} is not a number of seconds above 0; "
                         f"unset it for the default ({DEFAULT_UNREACHABLE_TIMEOUT:.0f}).")
    return value


def _create_run(client: Any, config: CommonConfig, resumed_from: str | None = None) -> Any:
    """Create the run in a session of its own. Creating is not idempotent: the client never
    re-sends it blindly but looks for it in this session after a lost answer, and deactivates
    a duplicate (``HttpClient.create``)."""
    session = client.sessions.create()
    return client.runs.create({
        "session_id": session.id,
        "base_model": config.base_model,
        "name": run_name(config.name, resumed_from),
        "lora_rank": config.lora_rank,
        "max_seq_len": config.max_seq_len,
        "seed": config.seed,
    })  # fmt: skip


def open_session(
    loaded: LoadedConfig,
    rundir: RunDir,
    backend: "Connected",
    *,
    resume: bool,
    announce: Callable[[str], None],
) -> TrainingSession:
    """Create the run (or, on resume, reattach to it or start a new one from the last checkpoint)."""
    from baseten_loops_cli.workers.trainer import TrainerClient

    unreachable_timeout = _unreachable_timeout()  # before anything is created
    client = backend.client
    config = loaded.config
    state = rundir.read_state()
    checkpoint = rundir.last_checkpoint() if resume else None
    run = None
    created = False
    if resume and state.get("run_id"):
        try:
            existing = client.runs.get(state["run_id"])
        except LoopsError:
            existing = None
        if existing is not None and existing.is_active:
            if checkpoint is not None:
                run = existing
                created = bool(state.get("created_run"))
            elif state.get("created_run"):
                # No resume point: its trainer took steps nothing recorded can reproduce. Start
                # afresh on a new run, and don't leave this one billing.
                try:
                    client.runs.deactivate(existing.id)
                    announce(f"Deactivated run {existing.id}: no checkpoint to resume it from; starting over.")
                except LoopsError:
                    pass
    lineage = list(state.get("resumed_from") or [])
    if run is None:
        previous = state.get("run_id") if resume else None
        run = _create_run(client, config, resumed_from=previous)
        created = True
        announce(f"Created run {run.id} ({config.base_model}, LoRA rank {config.lora_rank}).")
        if previous and previous != run.id:
            # The old run is gone (deactivated at the end of the last attempt, or never
            # resumable): training continues in a new run, and state.json keeps the lineage.
            lineage.append(previous)
            announce(f"Run {previous} is no longer active: continuing in the new run {run.id} "
                     f"(state.json records resumed_from).")
    else:
        announce(f"Reattached to run {run.id}.")
    trainer = TrainerClient(run.base_url, api_key=backend.api_key, run_id=run.id, base_model=config.base_model,
                            unreachable_timeout=unreachable_timeout)
    start_step = 0
    if checkpoint is not None:
        # Loading the trainer state rolls the adapter, optimizer and step back to the checkpoint,
        # whatever happened after it: that is what makes resume exactly-once.
        trainer.load_state_with_optimizer(checkpoint["path"]).result()
        start_step = int(checkpoint["step"])
        rundir.trim_after(start_step)
        announce(f"Resuming at step {start_step + 1} from {checkpoint['path']}.")
    elif resume:
        rundir.trim_after(0)  # nothing was saved: every recorded step will be redone
        announce("No checkpoint yet: starting from step 1.")
    rundir.update_state(
        run_id=run.id,
        created_run=created,
        profile=backend.profile_name,
        base_url=backend.base_url,
        status="running",
        step=start_step,
        **({"resumed_from": lineage} if lineage else {}),
    )
    return TrainingSession(loaded, rundir, client, backend.api_key, run, trainer, created, start_step)


def save_if_stopped(session: TrainingSession, stop: StopRequested, step: int, pipeline: Any = None) -> bool:
    """Ctrl-C, checked between steps and after the last one: once a stop is requested, collect
    the steps in flight (``pipeline``, a training.loop.pipeline.StepPipeline) and save the resume
    point at ``step``. True: the loop returns "interrupted" (exit 130; ``loops train resume``
    continues exactly once, after the last step only with the final eval and checkpoint)."""
    if not stop.requested:
        return False
    if pipeline is not None:
        pipeline.drain()
    save_checkpoint(session, step)
    return True


def save_checkpoint(session: TrainingSession, step: int, *, final: bool = False) -> dict:
    """Save trainer state (the resume point) and sampler weights of the same name, and record
    them. Sampler weights are what can be sampled, deployed and compared (`loops eval RUN:*`);
    a LoRA adapter is small, so every checkpoint gets them."""
    return submit_checkpoint(session, step, final=final)()


def submit_checkpoint(session: TrainingSession, step: int, *, final: bool = False) -> Callable[[], dict]:
    """Submit the saves of :func:`save_checkpoint` now; the returned function waits for them and
    records the checkpoint (a pipelined loop calls it once the step's results are in)."""
    config = session.config
    name = "final" if final else f"step-{step:06d}"
    ttl = None if final and config.checkpointing.keep_final else config.checkpointing.ttl_seconds
    state_future = session.trainer.save_state(name, ttl_seconds=ttl)
    sampler_future = session.trainer.save_weights_for_sampler(name, ttl_seconds=ttl)

    def record_checkpoint() -> dict:
        saved = state_future.result()
        record = {"step": step, "name": name, "path": saved["path"], "time": time.time()}
        record["sampler_path"] = sampler_future.result()["path"]
        session.rundir.append_checkpoint(record)
        session.rundir.update_state(step=step)
        return record

    return record_checkpoint
