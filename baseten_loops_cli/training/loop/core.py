"""The one training loop: every kind of training runs through :func:`run`.

The loop owns what every kind shares: step and epoch accounting (``max_steps`` wins over
``epochs`` and cycles the data, as HF Trainer and TRL do), Ctrl-C and the resume point, the
learning-rate schedule, ``forward_backward`` (the protocol's loss or the SDK's custom-loss
path) and ``optim_step``, the submit-ahead pipeline (training/loop/pipeline.py), publishing the
weights to the sampler after each step (kinds that sample: RL, distill), eval-every,
checkpoint-every, the final eval and the config's ``eval:`` block, the final checkpoint, and
every record (the :class:`~training.experiments.metrics.MetricsSink`: metrics.jsonl, the view, trackers).

A kind supplies only what differs, as a subclass of :class:`StepHooks` (its registry entry's
``hooks``): the rows of a step, the step's datums and loss (:class:`StepWork`), its record
fields, its eval, and what it opens before step 1 and closes at the end (a reference pass,
a teacher, judges). The toy kind of tests/test_training_kinds.py is the smallest example.

Ctrl-C (``StopRequested``): no step is submitted once a stop is requested. A step already
submitted cannot be taken back (the trainer runs a run's ops in order, and the protocol has
no cancel for them), so the loop submits a step ahead only while steps are short
(:data:`AHEAD_MAX_STEP_S`): a long step is submitted once the previous one is collected, and
Ctrl-C then stops after the step in flight without another starting.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Generic, Union

from baseten_loops_cli.training.config import ConfigT
from baseten_loops_cli.training.loop.pipeline import StepClock, StepPipeline, step_record
from baseten_loops_cli.training.session import (
    StopRequested, TrainingSession, adam_params, learning_rate, save_checkpoint, save_if_stopped, submit_checkpoint,
)  # fmt: skip

if TYPE_CHECKING:
    from baseten_loops_cli.training.kinds import LoadedData
    from baseten_loops_cli.training.experiments.metrics import MetricsSink
    from baseten_loops_cli.training.losses.preference_losses import LossResult, SequenceScore

Metrics = dict[str, Any]
Waiter = Callable[[], Metrics]  # waits for results already submitted and gives record fields

# A step is submitted before the previous one is collected (hiding the client's round trip)
# only while the last step took less than this. Past it the round trip is under 1% of a step,
# and a step submitted ahead would make Ctrl-C wait for one more whole step.
AHEAD_MAX_STEP_S = 10.0


def total_steps(n_rows: int, rows_per_step: int, epochs: int, max_steps: int | None) -> int:
    """The steps of a run: ``max_steps`` when set (it wins over ``epochs`` and cycles the data,
    the HF Trainer / TRL convention), else ``epochs`` passes over the full batches."""
    if max_steps:
        return max_steps
    return max(1, n_rows // rows_per_step) * epochs


def step_rows(n_rows: int, rows_per_step: int, step: int, config: Any, *, shuffle: bool = True) -> list[int]:
    """Indices of the train rows of 0-based ``step`` (past the data: the next epoch's order):
    a pure function of seed and epoch, so a resumed run and the plan see the same batches."""
    from baseten_loops_cli.training.data.datums import batches_for_step

    return batches_for_step(n_rows, rows_per_step, step, seed=config.seed, shuffle=shuffle)


@dataclass(frozen=True)
class ProtocolLoss:
    """A loss the trainer computes: ``cross_entropy``, ``dpo``, ``importance_sampling``, ..."""

    name: str
    config: dict | None = None


@dataclass(frozen=True)
class CustomLoss:
    """The SDK's custom-loss path (``preference_losses.submit_custom_loss``): ``compute`` on the
    scores of the datums and of ``extra`` (scored, never trained); its metrics are the step's."""

    compute: Callable[[list["SequenceScore"]], "LossResult"]
    extra: list[dict] = field(default_factory=list)
    ref_key: str = "ref_logprobs"  # the datums' input scored as each sequence's reference (GSPO: the sampler's "logprobs")


@dataclass
class StepWork:
    """One step as its kind builds it: the datums and loss to train (no datums: an empty step,
    so the step stays the policy version), record fields known before training, the samples
    to keep (samples.jsonl), and ``fields_from`` the trainer's ``forward_backward`` result
    (None for an empty step). ``tokens``: the step's tokens for ``tokens_per_s`` (default:
    the datums' input tokens)."""

    datums: list[dict]
    loss: Union[ProtocolLoss, CustomLoss]
    fields: Metrics = field(default_factory=dict)
    fields_from: Callable[[dict | None], Metrics] | None = None
    samples: list[dict] = field(default_factory=list)
    tokens: int | None = None


class StepHooks(Generic[ConfigT]):
    """A kind's part of the loop. Subclass it and override what the kind does; the defaults
    are a supervised kind's (``batch_size`` rows a step, ``epochs``, no eval)."""

    main_metric = "loss"
    on_policy = False  # samples with its own weights: publish them after every step (no submit-ahead)
    baseline_eval = False  # an eval record at step 0, before training (the "before" of before/after)

    def __init__(self, session: TrainingSession[ConfigT], data: "LoadedData") -> None:
        self.session = session
        self.data = data
        self.config: ConfigT = session.config  # the kind's own config model

    # ---- accounting
    def rows_per_step(self) -> int:
        return self.config.batch_size

    def epochs(self) -> int:
        return self.config.epochs

    def shuffle(self) -> bool:
        return getattr(getattr(self.config, "data", None), "shuffle", True)

    def total_steps(self) -> int:
        return total_steps(len(self.data.train), self.rows_per_step(), self.epochs(), self.config.max_steps)

    def rows(self, step: int) -> list[int]:
        return step_rows(len(self.data.train), self.rows_per_step(), step, self.config, shuffle=self.shuffle())

    # ---- the kind's work
    def begin(self, loop: "Loop") -> None:
        """Before step 1 (a reference pass, a teacher, judges); may honour ``loop.stop``."""

    def step(self, step: int, rows: list[int], version: int) -> StepWork:
        """The datums and loss of 0-based ``step`` (``version``: the policy the sampler serves)."""
        raise NotImplementedError

    def submit_eval(self, version: int) -> Waiter | None:
        """Submit an eval of the current policy (None: the kind has no eval split)."""
        return None

    def record_extras(self) -> Metrics:
        """Fields every record gets, the final one too (a judge's requests since the last)."""
        return {}

    def baseline_line(self, baseline: Metrics) -> str | None:
        return None

    def final_line(self, baseline: Metrics | None, last: Metrics) -> str | None:
        return None

    def close(self) -> None:
        """At the end, however it ends."""


def run(hooks: StepHooks, sink: "MetricsSink", stop: StopRequested) -> str:
    """Train to the end ("completed") or until Ctrl-C ("interrupted")."""
    loop = Loop(hooks, sink, stop)
    try:
        return loop.run()
    finally:
        hooks.close()


class Loop:
    """One run of the loop; :meth:`run` is the whole of it."""

    def __init__(self, hooks: StepHooks, sink: "MetricsSink", stop: StopRequested) -> None:
        self.hooks, self.sink, self.stop = hooks, sink, stop
        self.session = hooks.session
        self.config: Any = self.session.config
        self.trainer = self.session.trainer
        self.steps = hooks.total_steps()
        self.version = self.session.start_step
        self.clock = StepClock()
        self.pipeline = StepPipeline()
        self.last_step_s = 0.0

    def run(self) -> str:
        session, hooks = self.session, self.hooks
        self.sink.start(self.steps, session.start_step, hooks.main_metric)
        hooks.begin(self)
        if save_if_stopped(session, self.stop, session.start_step):
            return "interrupted"
        if hooks.on_policy:
            self.version = self.publish(session.start_step).result_version()
        baseline = self.baseline()
        step = session.start_step
        while step < self.steps:
            if save_if_stopped(session, self.stop, step, self.pipeline):
                return "interrupted"
            step = self.submit_step(step)
        self.pipeline.drain()
        if save_if_stopped(session, self.stop, step):  # Ctrl-C during the last step
            return "interrupted"
        self.final_eval(baseline)
        record = save_checkpoint(session, self.steps, final=True)
        self.sink.message(f"Saved final checkpoint: {record.get('sampler_path') or record['path']}")
        if self.config.eval is not None:
            from baseten_loops_cli.training.evaluation.final_eval import evaluate_final

            evaluate_final(session, record, self.sink)
        return "completed"

    # ---- steps
    def publish(self, step: int) -> "Published":
        """Publish the current adapter to the sampler (a new policy version)."""
        future = self.trainer.save_weights_for_sampler(f"{self.config.kind}-{step:06d}", bump_version=True)
        return Published(future, step)

    def submit_step(self, step: int) -> int:
        """Submit 0-based ``step`` (and, on schedule, its eval and checkpoint right behind it,
        so they see exactly its weights); collect it now or, pipelined, once the next one is
        submitted. Returns the step count after it."""
        hooks, config = self.hooks, self.config
        lr = learning_rate(config.optimizer, step, self.steps)
        work = hooks.step(step, hooks.rows(step), self.version)
        trained = self.submit_train(work)
        optim = self.trainer.optim_step(adam_params(config.optimizer, lr if work.datums else 0.0))
        step += 1
        published = None
        if hooks.on_policy and (step < self.steps or self.data_has_eval()):
            published = self.publish(step)
        eval_due = bool(config.eval_every) and step % config.eval_every == 0
        evals = hooks.submit_eval(self.version) if eval_due and not hooks.on_policy else None
        save_every = config.checkpointing.save_every
        checkpoint = submit_checkpoint(self.session, step) if save_every and step % save_every == 0 and step < self.steps else None

        def collect() -> None:
            fb_result = trained()
            record = step_record(step, self.steps, self.clock, learning_rate=lr, tokens=self.tokens(work),
                                 optim_result=optim.result(), **work.fields)
            self.last_step_s = record["step_time_s"]
            if work.fields_from is not None:
                record.update(work.fields_from(fb_result))
            if work.samples:
                self.sink.samples(work.samples)
            waiter = evals
            if published is not None:
                self.version = published.result_version()
                waiter = hooks.submit_eval(self.version) if eval_due else None
            self.record(record, waiter)
            if checkpoint is not None:
                checkpoint()

        if hooks.on_policy or self.last_step_s >= AHEAD_MAX_STEP_S:
            self.pipeline.drain()
            collect()
        else:
            self.pipeline.push(collect)
        return step

    def submit_train(self, work: StepWork) -> Callable[[], dict | None]:
        """Submit the step's ``forward_backward``; the returned function waits for its result
        and adds a custom loss's metrics to the step's fields."""
        if not work.datums:
            return lambda: None
        if isinstance(work.loss, ProtocolLoss):
            future = self.trainer.forward_backward(work.datums, work.loss.name, work.loss.config)
            return future.result
        from baseten_loops_cli.training.losses import preference_losses as pl

        future, custom = pl.submit_custom_loss(self.trainer, work.datums, work.loss.compute, extra=work.loss.extra,
                                               ref_key=work.loss.ref_key)

        def wait() -> dict:
            result = future.result()
            pl.check_unnormalized(result.get("metrics") or {})
            work.fields.update(custom.metrics)
            return result

        return wait

    @staticmethod
    def tokens(work: StepWork) -> int:
        if work.tokens is not None:
            return work.tokens
        return sum(len(d["model_input"]["chunks"][0]["tokens"]) for d in work.datums)

    def data_has_eval(self) -> bool:
        return bool(self.hooks.data.eval)

    def record(self, record: Metrics, evals: Waiter | None) -> None:
        """Record a step, with its eval when one is due. The step is trained whatever the eval
        does: it is recorded even when the eval fails, so a checkpoint taken then matches
        metrics.jsonl (resume neither repeats nor skips it)."""
        try:
            if evals is not None:
                record.update(evals())
        finally:
            record.update(self.hooks.record_extras())
            self.sink.step(record)

    # ---- evals
    def baseline(self) -> Metrics | None:
        """The step-0 eval (kinds with ``baseline_eval``): recorded once, reused on resume."""
        hooks = self.hooks
        if not hooks.baseline_eval:
            return None
        before = next((r for r in self.session.rundir.metrics() if r.get("step") == 0 and _has_eval(r)), None)
        if before is not None or self.session.start_step != 0:
            return before
        evals = hooks.submit_eval(self.version)
        if evals is None:
            return None
        baseline = {"step": 0, **evals()}
        self.sink.step(baseline)
        line = hooks.baseline_line(baseline)
        if line:
            self.sink.message(line)
        return baseline

    def final_eval(self, baseline: Metrics | None) -> None:
        """The eval of the final weights: the last step's when it had one, else one now."""
        steps = self.steps
        last = next((r for r in reversed(self.session.rundir.metrics()) if r.get("step") == steps and _has_eval(r)), None)
        if last is None:
            evals = self.hooks.submit_eval(self.version)
            if evals is None:
                return
            last = {"step": steps, **evals(), **self.hooks.record_extras()}
            self.sink.final(last)
        line = self.hooks.final_line(baseline, last)
        if line:
            self.sink.message(line)


@dataclass
class Published:
    """A publish in flight: the sampler serves the new weights once it is done."""

    future: Any
    step: int

    def result_version(self) -> int:
        return int(self.future.result().get("version") or self.step)


def _has_eval(record: Metrics) -> bool:
    return any(key.startswith("eval_") for key in record)


def run_kind(session: TrainingSession, data: "LoadedData", sink: "MetricsSink", stop: StopRequested) -> str:
    """Train ``session``'s config with its kind's hooks (the registry's ``hooks``)."""
    from baseten_loops_cli.training import kinds

    return run(kinds.of(session.config).hooks(session, data), sink, stop)
