"""Preference tuning (``kind: dpo``): pairs of a chosen and a rejected reply, trained with one of
the paired preference losses (``loss: dpo | ipo | simpo | orpo``, training/preference_losses.py).

Before step 1, every sequence (each pair's chosen and rejected conversation, train and eval) is
scored once by the reference policy, the way the SDK's ``helpers.datum.attach_reference_logprobs``
does it: a sampler's prompt logprobs, shifted onto the trainer's positions. The reference is
the policy as the run starts (``reference: base``; published to the run's sampler as
``dpo-reference`` before any optimizer step, the SDK's recipe) or a sampler checkpoint. The
scores go to ``reference_logprobs.jsonl`` in the run directory as they arrive, keyed by the
sequence's tokens, so a resumed run reuses them and trains on exactly the same numbers.

The reference-free losses (``simpo``, ``orpo``: not in ``NEEDS_REFERENCE``) skip that pass.

Per step: the batch's pairs as interleaved (chosen, rejected) datums and ``optim_step`` pipelined
as in SFT. ``loss: dpo`` sends them to ``forward_backward`` with the protocol's ``dpo`` loss
(``beta``, ``label_smoothing``); the other losses take the SDK's custom-loss path
(``preference_losses.submit_custom_loss``: ``/forward`` for the logprobs, the loss and its
gradient in closed form here, then a weighted ``cross_entropy`` ``/forward_backward``), so every
loss runs on Baseten through the protocol alone. The step's loss, reward margin and preference
accuracy are computed here from the logprobs the trainer returns, so they mean the same on every
backend. The eval split is scored with ``forward`` (no gradient) before training, every
``eval_every`` steps and at the end.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from baseten_loops_cli.errors import ConfigError, LoopsError
from baseten_loops_cli.training import preference_losses as pl
from baseten_loops_cli.training.config import CommonConfig, Section, config_error
from baseten_loops_cli.training.data import PreferencePair, batches_for_step, dpo_datum, reference_logprobs_field
from baseten_loops_cli.training.formats.spec import EvalSources, FormatOptions, Sources
from baseten_loops_cli.training.kinds import Estimate, Kind, LoadedData, StepField
from baseten_loops_cli.training.pipeline import StepClock, StepPipeline, step_record
from baseten_loops_cli.training.session import (
    StopRequested, TrainingSession, adam_params, learning_rate, save_checkpoint, save_if_stopped,
    submit_checkpoint,
)  # fmt: skip
from baseten_loops_cli.training.kinds.sft import total_steps
from baseten_loops_cli.training.templates import COMMON

# A pair whose policy-vs-reference log-ratio gap is within this many nats is a tie and counts
# half: an untrained policy scores 0.5 whatever the float noise between trainer and sampler.
# (The local engine's dpo loss uses the same rule: local/engine/losses.py DPO_TIE_NATS.)
TIE_NATS = pl.TIE_NATS
REFERENCE_CHECKPOINT = "dpo-reference"
_SCORES_IN_FLIGHT = 32  # reference-scoring requests at once (a local sampler batches them)
_SCORES_PER_APPEND = 64  # and made durable in chunks of this many

__all__ = ["KIND", "DPOConfig", "check_reference", "evaluate", "param_error", "preference_metrics", "reference_logprobs", "rows_to_train",
           "run_dpo", "sequence_datum", "sequence_key", "total_steps"]


class DPOData(Section, FormatOptions):
    train: Sources
    eval: EvalSources | None = None
    shuffle: bool = True


def reference_value(value: str) -> str:
    """A config's ``reference``: ``base`` or a sampler checkpoint's URI (ValueError otherwise)."""
    if value == "base":
        return value
    from baseten_loops_cli.api.uri import CheckpointUri

    if not CheckpointUri.is_uri(value):
        raise ValueError(f"expected 'base' or bt://loops:<run_id>/sampler_weights/<name>, not {value!r}")
    uri = CheckpointUri.parse(value)
    if uri.target != "sampler":
        raise ValueError(
            f"{value} is trainer state; the reference is scored by a sampler, so name its sampler checkpoint "
            f"bt://loops:{uri.run_id}/sampler_weights/{uri.name}"
        )
    return value


def param_error(loss: str, key: str, value: Any) -> Exception | None:
    """The config error for one loss parameter ``key: value`` under ``loss`` (a parameter of
    another loss, not a number, out of bounds), or None: ``preference_losses.param_problems``
    as a config model's validator raises it (the file:line of the key comes with it)."""
    problems = pl.param_problems(loss, {key: value})
    if not problems:
        return None
    message = problems[0].message
    for prefix in (f"{key}: ", f"{key} "):
        message = message.removeprefix(prefix)
    return config_error(message, problems[0].fix)


class DPOConfig(CommonConfig):
    EVAL_SUPPORTED = False
    kind: Literal["dpo"]
    data: DPOData
    # `loss` comes before its parameters: their validators read it (a bad loss: they are skipped).
    loss: str = Field("dpo", description="dpo | ipo | simpo | orpo (training/preference_losses.py).")
    beta: float | None = Field(None, description="dpo, ipo: how far the policy may move from the reference (default 0.1); simpo: the reward scale (default 2.0).")
    label_smoothing: float | None = Field(None, description="dpo: assumed fraction of flipped labels, in [0, 0.5) (default 0).")
    gamma: float | None = Field(None, description="simpo: the target reward margin (default 1.0).")
    lambda_: float | None = Field(None, alias="lambda", description="orpo: the weight of the odds-ratio term (default 0.1).")
    reference: str = Field(
        "base",
        description="The reference policy (dpo, ipo): 'base' (the base model, as the run starts) or a sampler checkpoint bt://loops:<run>/sampler_weights/<name>.",
    )

    @field_validator("loss")
    @classmethod
    def _known_loss(cls, value: str) -> str:
        if value in pl.UNPAIRED_LOSSES:
            raise config_error(f"{value} trains on unpaired rows (a completion and a label), not on pairs",
                               f"Use `kind: {value}` for unpaired rows, or a paired loss: {', '.join(pl.PAIRED_LOSSES)}.")
        if value not in pl.PAIRED_LOSSES:
            raise config_error(f"unknown loss {value!r} (one of {', '.join(pl.PAIRED_LOSSES)})",
                               f"Set loss to one of {', '.join(pl.PAIRED_LOSSES)} (unpaired rows: kind: kto).")
        return value

    @field_validator("beta", "label_smoothing", "gamma", "lambda_")
    @classmethod
    def _loss_parameter(cls, value: float | None, info: ValidationInfo) -> float | None:
        loss = info.data.get("loss")
        if value is None or loss is None:
            return value
        error = param_error(loss, "lambda" if info.field_name == "lambda_" else info.field_name, value)
        if error is not None:
            raise error
        return value

    @property
    def loss_params(self) -> dict[str, float]:
        """The loss's parameters: those given over the loss's defaults."""
        given = {"beta": self.beta, "label_smoothing": self.label_smoothing, "gamma": self.gamma, "lambda": self.lambda_}
        return pl.resolve_params(self.loss, {k: v for k, v in given.items() if v is not None})

    @property
    def needs_reference(self) -> bool:
        return self.loss in pl.NEEDS_REFERENCE

    @field_validator("reference")
    @classmethod
    def _reference_checkpoint(cls, value: str, info: ValidationInfo) -> str:
        if value == "base":
            return value
        loss = info.data.get("loss")
        if loss is not None and loss not in pl.NEEDS_REFERENCE:
            raise config_error(f"loss {loss} is reference-free: it has no reference policy",
                               f"Remove `reference`, or use a loss with a reference: {', '.join(sorted(pl.NEEDS_REFERENCE - set(pl.UNPAIRED_LOSSES)))}.")
        return reference_value(value)


def load_data(loaded, tokenizer: Any) -> LoadedData:
    """Rows of any preference format and source (the data layer reads them), as chosen/rejected
    pairs (``data.load_preference_pairs``: every row checked, an unpaired KTO row named as such)."""
    from baseten_loops_cli.training import kinds
    from baseten_loops_cli.training.data import load_preference_pairs
    from baseten_loops_cli.training.formats import data_notes

    config = loaded.config
    train_spec, eval_spec = kinds.data_specs(loaded)
    train = load_preference_pairs(train_spec, tokenizer, max_seq_len=config.max_seq_len)
    evals = load_preference_pairs(eval_spec, tokenizer, max_seq_len=config.max_seq_len) if eval_spec else None
    return LoadedData(tokenizer, train, evals, notes=data_notes(train_spec, eval_spec))


def render_rows(spec, tokenizer: Any, *, max_seq_len: int, train_on: str | None = None) -> list[list[Any]]:
    """Each row as the loop trains it (`loops data check|preview`): its chosen and rejected sequences."""
    from baseten_loops_cli.training.data import load_preference_pairs

    return [[p.chosen, p.rejected] for p in load_preference_pairs(spec, tokenizer, max_seq_len=max_seq_len)]


def rows_to_train(n_train: int, config: Any, start_step: int = 0) -> list[int]:
    """The train rows that steps ``start_step``.. of the run use, each once, in order of first
    use: what the reference pass scores. A run cut short by ``max_steps`` (or resumed near
    its end) scores its own batches only, not the whole split."""
    used: dict[int, None] = {}
    for step in range(start_step, total_steps(n_train, config)):
        used.update(dict.fromkeys(batches_for_step(n_train, config.batch_size, step, seed=config.seed,
                                                   shuffle=config.data.shuffle)))
    return list(used)


def estimate(config, data: LoadedData) -> Estimate:
    """Exact: each step's pairs, chosen + rejected (whole sequences); before step 1 the reference
    (dpo, ipo) scores the sequences the run uses once (a prefill each, no backward): every train
    pair some step trains (:func:`rows_to_train`) and the eval split. The custom-loss path (every
    loss but dpo) also scores each step's batch with a ``/forward`` before its ``/forward_backward``."""
    steps = total_steps(len(data.train), config)
    train_tokens = sum(
        len(data.train[i].chosen.tokens) + len(data.train[i].rejected.tokens)
        for step in range(steps)
        for i in batches_for_step(len(data.train), config.batch_size, step, seed=config.seed, shuffle=config.data.shuffle)
    )
    pairs = [data.train[i] for i in rows_to_train(len(data.train), config)] + (data.eval or [])
    scored, notes = 0, []
    if config.needs_reference:
        scored = sum(len(p.chosen.tokens) + len(p.rejected.tokens) for p in pairs)
        notes.append(f"before step 1 the reference ({config.reference}) scores {2 * len(pairs)} sequences (~{scored:,} tokens) once")
    else:
        notes.append(f"loss {config.loss} is reference-free: no reference pass")
    if config.loss not in pl.PROTOCOL_LOSS:
        scored += train_tokens  # the custom-loss path's /forward of each step
        notes.append(f"loss {config.loss} runs on the custom-loss path: each step is a forward, then a weighted "
                     "cross_entropy forward_backward (the SDK's forward_backward_custom)")
    return Estimate(steps, train_tokens, 0, scored_tokens=scored, notes=notes)


def sequence_key(tokens: list[int]) -> str:
    """What a reference score is filed under: the sequence's tokens, so edits to the data
    never pair a sequence with another one's logprobs."""
    return hashlib.sha256(",".join(map(str, tokens)).encode()).hexdigest()[:32]


def loss_config(config: Any) -> dict:
    """The protocol's ``dpo`` loss config (``loss: dpo``)."""
    params = config.loss_params
    return {"beta": params["beta"], "label_smoothing": params["label_smoothing"]}


def check_reference(client: Any, loaded: Any) -> None:
    """A checkpoint reference must exist and share the base model: checked before provisioning."""
    config = loaded.config
    if config.reference == "base" or not config.needs_reference:
        return
    found = [c for c in client.checkpoints.list(checkpoint_path=config.reference) if c.target in (None, "sampler")]
    where = loaded.where("reference")
    if not found:
        run_id = config.reference.split("bt://loops:", 1)[-1].split("/", 1)[0]
        raise ConfigError(
            f"{where}: reference: no checkpoint {config.reference}",
            hint=f"List that run's checkpoints with `loops checkpoints list --run-id {run_id}`, or use `reference: base`.",
        )
    if found[0].base_model and found[0].base_model != config.base_model:
        raise ConfigError(
            f"{where}: reference: {config.reference} was trained on {found[0].base_model}, not on base_model {config.base_model}"
        )


# ------------------------------------------------------------------ the reference's logprobs
def _reference_sampler(session: TrainingSession) -> tuple[Any, str | None]:
    """The sampler client that scores the reference, and the checkpoint to pin on it."""
    config = session.config
    if config.reference != "base":
        return session.new_sampler_client(), config.reference
    if session.start_step == 0:
        # The SDK's recipe: snapshot the policy before any optimizer step (a fresh LoRA adds
        # exactly zero, so this is the base model) and score with the run's own sampler.
        saved = session.trainer.save_weights_for_sampler(
            REFERENCE_CHECKPOINT, ttl_seconds=config.checkpointing.ttl_seconds
        ).result()
        return session.new_sampler_client(), saved["path"]
    # Scores lost after training began (reference_logprobs.jsonl deleted): the base model.
    return session.new_base_sampler_client(), None


def reference_logprobs(
    session: TrainingSession, pairs: list[PreferencePair], sink: Any, stop: StopRequested | None = None
) -> dict[str, list[float]]:
    """Every sequence's ``ref_logprobs`` by :func:`sequence_key`: those in the run directory,
    plus any missing ones, scored now and appended as they arrive (a Ctrl-C stops after the
    chunk in flight, keeping what was scored)."""
    return reference_scores(session, [e for pair in pairs for e in (pair.chosen, pair.rejected)], sink, stop)


def reference_scores(session: TrainingSession, sequences: list[Any], sink: Any,
                     stop: StopRequested | None = None) -> dict[str, list[float]]:
    """:func:`reference_logprobs` for any rendered sequences (``data.Example``: KTO's examples
    and their KL sequences too)."""
    config = session.config
    rundir = session.rundir
    scores = {r["key"]: r["ref_logprobs"] for r in rundir.references()}
    todo: dict[str, list[int]] = {}
    for example in sequences:
        key = sequence_key(example.tokens)
        if key not in scores:
            todo.setdefault(key, example.tokens)
    if not todo:
        return scores
    sink.message(f"Scoring {len(todo)} sequences with the reference policy ({config.reference})...")
    started = time.monotonic()
    sampler, pin = _reference_sampler(session)
    items = list(todo.items())

    async def score_all() -> None:
        gate = asyncio.Semaphore(_SCORES_IN_FLIGHT)

        async def score(tokens: list[int]) -> list[float]:
            async with gate:
                result = await sampler.asample(
                    tokens, n=1, max_tokens=1, temperature=0.0, prompt_logprobs=True, checkpoint_path=pin
                )  # the SDK's SamplingClient.compute_logprobs
            logprobs = result.prompt_logprobs or []
            if len(logprobs) != len(tokens):
                raise LoopsError(
                    f"the reference sampler returned {len(logprobs)} prompt logprobs for a {len(tokens)}-token sequence"
                )
            return reference_logprobs_field(logprobs)

        try:
            for start in range(0, len(items), _SCORES_PER_APPEND):
                if stop is not None and stop.requested:
                    return
                chunk = items[start : start + _SCORES_PER_APPEND]
                results = await asyncio.gather(*(score(tokens) for _, tokens in chunk))
                records = [{"key": key, "ref_logprobs": lps} for (key, _), lps in zip(chunk, results)]
                rundir.append_references(records)
                scores.update((r["key"], r["ref_logprobs"]) for r in records)
                if len(items) > _SCORES_PER_APPEND:
                    sink.message(f"Reference: {min(start + _SCORES_PER_APPEND, len(items))}/{len(items)} sequences scored")
        finally:
            await sampler.aclose()
            sampler.close()

    asyncio.run(score_all())
    sink.message(f"Scored the reference in {time.monotonic() - started:.1f}s.")
    return scores


def sequence_datum(example: Any, scores: dict[str, list[float]] | None) -> dict:
    """The SDK's DPO row of one sequence (``data.dpo_datum``), with its reference logprobs from
    ``scores`` or, for a reference-free loss (``scores`` None), without any."""
    if scores is None:
        datum = dpo_datum(example, [0.0] * len(example.tokens))
        del datum["loss_fn_inputs"]["ref_logprobs"]
        return datum
    return dpo_datum(example, scores[sequence_key(example.tokens)])


def pair_datums(pairs: list[PreferencePair], scores: dict[str, list[float]] | None) -> list[dict]:
    """The interleaved rows the paired losses pair positionally: chosen even, rejected odd."""
    return [sequence_datum(example, scores) for pair in pairs for example in (pair.chosen, pair.rejected)]


# ------------------------------------------------------------------ metrics
def _logsigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def preference_metrics(datums: list[dict], outputs: list[dict], beta: float, label_smoothing: float) -> dict:
    """The DPO loss and its diagnostics, means over pairs, from the trainer's per-row logprobs:

    - ``loss``: ``-(1 - eps) * logsigmoid(z) - eps * logsigmoid(-z)``, with
      ``z = beta * ((sum w*(lp - ref)) of chosen - (sum w*(lp - ref)) of rejected)``
    - ``reward_margin``: z, the chosen reply's implicit reward minus the rejected one's
    - ``chosen_reward`` / ``rejected_reward``: ``beta * sum w*(lp - ref)`` of each side
    - ``preference_accuracy``: the fraction of pairs with z > 0 (ties within TIE_NATS count half)
    """
    ratios = []  # per row: sum over the reply of w * (policy logprob - reference logprob)
    for datum, out in zip(datums, outputs):
        inputs = datum["loss_fn_inputs"]
        weights, refs = inputs["weights"]["data"], inputs["ref_logprobs"]["data"]
        logprobs = out["logprobs"]["data"]
        ratios.append(sum(w * (lp - ref) for w, lp, ref in zip(weights, logprobs, refs) if w and lp is not None))
    pairs = list(zip(ratios[0::2], ratios[1::2]))
    if not pairs:
        return {}
    losses, margins, wins = [], [], []
    for chosen, rejected in pairs:
        z = beta * (chosen - rejected)
        losses.append(-(1 - label_smoothing) * _logsigmoid(z) - label_smoothing * _logsigmoid(-z))
        margins.append(z)
        gap = chosen - rejected
        wins.append(1.0 if gap > TIE_NATS else 0.5 if abs(gap) <= TIE_NATS else 0.0)
    n = len(pairs)
    return {
        "loss": sum(losses) / n,
        "reward_margin": sum(margins) / n,
        "preference_accuracy": sum(wins) / n,
        "chosen_reward": beta * sum(c for c, _ in pairs) / n,
        "rejected_reward": beta * sum(r for _, r in pairs) / n,
    }


def evaluate(session: TrainingSession, pairs: list[PreferencePair], scores: dict[str, list[float]] | None) -> dict:
    """The eval split's metrics under the current policy (``forward``: no gradient), prefixed
    ``eval_``."""
    return submit_eval(session, pairs, scores)()


def submit_eval(session: TrainingSession, pairs: list[PreferencePair], scores: dict[str, list[float]] | None) -> Any:
    """Submit :func:`evaluate`'s ``forward`` passes now; the returned function waits for them
    (a pipelined loop submits them right behind a step's ``optim_step``). ``loss: dpo`` scores
    with the protocol's ``dpo`` loss, the others with the custom-loss path's ``/forward``
    (``submit_custom_loss(..., backward=False)``, unwaited)."""
    config = session.config
    params = config.loss_params
    batches = []
    for start in range(0, len(pairs), config.batch_size):
        batch = pair_datums(pairs[start : start + config.batch_size], scores)
        if config.loss in pl.PROTOCOL_LOSS:
            future = session.trainer.forward(batch, pl.PROTOCOL_LOSS[config.loss], loss_config(config))
        else:
            future = session.trainer.forward([pl.forward_datum(d) for d in batch], pl.CUSTOM_LOSS_FN,
                                             dict(pl.CUSTOM_LOSS_CONFIG))
        batches.append((batch, future))

    def metrics() -> dict:
        if config.loss in pl.PROTOCOL_LOSS:
            datums, outputs = [], []
            for batch, future in batches:
                datums += batch
                outputs += future.result()["loss_fn_outputs"]
            values = preference_metrics(datums, outputs, params["beta"], params["label_smoothing"])
        else:
            sequences = [s for batch, future in batches for s in pl.scores_from_forward(batch, future.result())]
            values = pl.paired_loss(config.loss, sequences, params).metrics
        return {f"eval_{k}": v for k, v in values.items()}

    return metrics


# ------------------------------------------------------------------ the loop
class StepSubmission:
    """One step's ops as a preference loop submits them: the ``forward_backward`` future, how to
    read the step's metrics from its result, the tokens trained and the record's row count."""

    def __init__(self, future: Any, metrics: Any, tokens: int, rows: dict[str, int]):
        self.future = future
        self.metrics = metrics  # (forward_backward result) -> dict
        self.tokens = tokens
        self.rows = rows  # e.g. {"pairs": 8}


def submit_preference_step(session: TrainingSession, datums: list[dict], extra: list[dict], compute: Any,
                           protocol: tuple[str, dict, Any] | None, rows: dict[str, int]) -> StepSubmission:
    """A step's ``forward_backward``: the protocol's own loss (``protocol`` = (loss_fn, config,
    metrics of (datums, outputs))) or the SDK's custom-loss path (``compute`` on the scores of
    ``datums`` + ``extra``; the ``/forward`` is waited for, the backward is not)."""
    tokens = sum(len(d["model_input"]["chunks"][0]["tokens"]) for d in datums)
    if protocol is not None:
        loss_fn, loss_fn_config, metrics_of = protocol
        future = session.trainer.forward_backward(datums, loss_fn, loss_fn_config)
        return StepSubmission(future, lambda result: metrics_of(datums, result["loss_fn_outputs"]), tokens, rows)
    future, custom = pl.submit_custom_loss(session.trainer, datums, compute, extra=extra)

    def metrics(result: dict) -> dict:
        pl.check_unnormalized(result.get("metrics") or {})
        return custom.metrics

    return StepSubmission(future, metrics, tokens, rows)


def preference_loop(session: TrainingSession, n_train: int, sink: Any, stop: StopRequested, *,
                    submit_step: Any, submit_eval: Any | None, summary: Any) -> str:
    """The loop the preference kinds (dpo, kto) share, after their reference pass: the step-0
    eval baseline, then per step ``submit_step(indices) -> StepSubmission`` and ``optim_step``
    pipelined (training/pipeline.py), ``submit_eval()`` (a function that waits for the eval's
    metrics, ``eval_``-prefixed) every ``eval_every`` steps and at the end, resume points, and
    the final checkpoint. ``summary(baseline, last)`` is the closing eval line."""
    config = session.config
    steps = total_steps(n_train, config)
    opt = config.optimizer
    baseline = None
    if submit_eval is not None:
        before = [r for r in session.rundir.metrics() if r.get("step") == 0 and "eval_loss" in r]
        if before:
            baseline = before[0]
        elif session.start_step == 0:
            # Where the policy starts (with a reference: it is the reference, every margin 0).
            baseline = {"step": 0, **submit_eval()()}
            sink.step(baseline)
    clock = StepClock()
    pipeline = StepPipeline()  # see training/pipeline.py and run_sft
    step = session.start_step
    while step < steps:
        if save_if_stopped(session, stop, step, pipeline):
            return "interrupted"
        indices = batches_for_step(n_train, config.batch_size, step, seed=config.seed, shuffle=config.data.shuffle)
        lr = learning_rate(opt, step, steps)
        submitted = submit_step(indices)
        optim = session.trainer.optim_step(adam_params(opt, lr))
        step += 1
        eval_metrics = (submit_eval() if submit_eval is not None and config.eval_every and step % config.eval_every == 0
                        else None)
        checkpoint = (submit_checkpoint(session, step)
                      if config.checkpointing.save_every and step % config.checkpointing.save_every == 0
                      and step < steps else None)  # fmt: skip

        def collect(step=step, lr=lr, submitted=submitted, optim=optim, eval_metrics=eval_metrics,
                    checkpoint=checkpoint) -> None:
            values = submitted.metrics(submitted.future.result())
            optim_result = optim.result()
            record = step_record(step, steps, clock, learning_rate=lr, tokens=submitted.tokens,
                                 optim_result=optim_result, **values, **submitted.rows)
            if eval_metrics is not None:
                record.update(eval_metrics())
            sink.step(record)
            if checkpoint is not None:
                checkpoint()

        pipeline.push(collect)
    pipeline.drain()
    if save_if_stopped(session, stop, step):  # Ctrl-C during the last step
        return "interrupted"
    if submit_eval is not None:
        last = next((r for r in reversed(session.rundir.metrics()) if r.get("step") == steps and "eval_loss" in r), None)
        if last is None:
            last = {"step": steps, **submit_eval()()}
            sink.final(last)
        sink.message(summary(baseline, last))
    record = save_checkpoint(session, steps, final=True)
    sink.message(f"Saved final checkpoint: {record.get('sampler_path') or record['path']}")
    return "completed"


def run_dpo(
    session: TrainingSession,
    train: list[PreferencePair],
    eval_pairs: list[PreferencePair] | None,
    sink: Any,
    stop: StopRequested,
) -> str:
    """Train to the end ("completed") or until Ctrl-C ("interrupted"); records go to ``sink``
    (see :func:`baseten_loops_cli.training.kinds.sft.run_sft`)."""
    config = session.config
    sink.start(total_steps(len(train), config), session.start_step, "loss")
    params = config.loss_params
    used = [train[i] for i in rows_to_train(len(train), config, session.start_step)]
    scores = reference_logprobs(session, used + (eval_pairs or []), sink, stop) if config.needs_reference else None
    if save_if_stopped(session, stop, session.start_step):
        return "interrupted"
    protocol = None
    if config.loss in pl.PROTOCOL_LOSS:
        protocol = (pl.PROTOCOL_LOSS[config.loss], loss_config(config),
                    lambda datums, outputs: preference_metrics(datums, outputs, params["beta"], params["label_smoothing"]))

    def submit_step(indices: list[int]) -> StepSubmission:
        datums = pair_datums([train[i] for i in indices], scores)
        return submit_preference_step(session, datums, [], lambda seqs: pl.paired_loss(config.loss, seqs, params),
                                      protocol, {"pairs": len(indices)})

    def summary(baseline: dict | None, last: dict) -> str:
        start = f"{baseline['eval_preference_accuracy']:.0%} -> " if baseline else ""
        return (f"Eval: preference accuracy {start}{last['eval_preference_accuracy']:.0%}, "
                f"reward margin {last['eval_reward_margin']:.3f}, loss {last['eval_loss']:.4f}")

    return preference_loop(session, len(train), sink, stop, submit_step=submit_step,
                           submit_eval=(lambda: submit_eval(session, eval_pairs, scores)) if eval_pairs else None,
                           summary=summary)


def _run(session: TrainingSession, data: LoadedData, sink: Any, stop: StopRequested) -> str:
    return run_dpo(session, data.train, data.eval, sink, stop)


TEMPLATE = """\
# loops preference config (pairs: DPO, IPO, SimPO, ORPO). Check it with `loops train validate FILE`.
kind: dpo
""" + COMMON + """
batch_size: 8                   # preference pairs per step

data:
  train: data/pairs.jsonl       # JSONL: {{"prompt": "...", "chosen": "...", "rejected": "..."}}
  # eval: data/eval_pairs.jsonl #    or: {{"messages": [...], "chosen": "...", "rejected": "..."}}
  shuffle: true                 #    or: {{"chosen": [messages], "rejected": [messages]}}

loss: dpo                       # dpo | ipo (noisy labels) | simpo | orpo (both reference-free: no reference pass)
# Each loss takes only its own parameters (defaults shown); a parameter of another loss is an error.
# beta: 0.1                     # dpo, ipo: how far the policy may move from the reference (higher = closer); simpo: 2.0
# label_smoothing: 0.0          # dpo: assumed fraction of mislabelled pairs (conservative DPO), in [0, 0.5)
# gamma: 1.0                    # simpo: the target reward margin
# lambda: 0.1                   # orpo: the weight of the odds-ratio term (TRL calls it beta)
reference: base                 # dpo, ipo: base | bt://loops:<run_id>/sampler_weights/<name> (e.g. your SFT run's final)
"""

KIND = Kind(
    name="dpo",
    config_model=DPOConfig,
    noun="pairs",
    main_metric="loss",
    metric_names=("loss", "reward_margin", "preference_accuracy", "chosen_reward", "rejected_reward", "pairs",
                  "nll_loss", "log_odds_ratio",  # orpo
                  "eval_loss", "eval_reward_margin", "eval_preference_accuracy", "eval_chosen_reward",
                  "eval_rejected_reward", "eval_nll_loss", "eval_log_odds_ratio"),
    step_fields=(
        StepField("loss", "loss"),
        StepField("preference_accuracy", "pref_acc", ".0%", optional=True),
        StepField("reward_margin", "margin", ".3f", optional=True),
        StepField("eval_loss", "eval_loss", optional=True),
        StepField("eval_preference_accuracy", "eval_pref_acc", ".0%", optional=True),
    ),
    data_path_keys=(("data", "train"), ("data", "eval")),
    template=lambda: TEMPLATE.format(name="my-dpo", lr="5.0e-5", schedule="linear"),
    load_data=load_data,
    estimate=estimate,
    run=_run,
    eval_data_key=("data", "eval"),
    eval_task=None,  # pairs are not rows `loops eval` scores (EVAL_SUPPORTED is False: no `eval:` block)
    capabilities_use_case="rl",  # the capabilities API knows sft and rl; DPO needs a sampler as RL does
    check=check_reference,
    row_purpose="preference",
    row_formats=("preference",),
    row_sides=("chosen", "rejected"),
    render_rows=render_rows,
)
