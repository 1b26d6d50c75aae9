"""Preference tuning (``kind: dpo``): pairs of a chosen and a rejected reply, the ``dpo`` loss
against a frozen reference.

Before step 1, every sequence (each pair's chosen and rejected conversation, train and eval) is
scored once by the reference policy, the way the SDK's ``helpers.datum.attach_reference_logprobs``
does it: a sampler's prompt logprobs, shifted onto the trainer's positions. The reference is
the policy as the run starts (``reference: base``; published to the run's sampler as
``dpo-reference`` before any optimizer step, the SDK's recipe) or a sampler checkpoint. The
scores go to ``reference_logprobs.jsonl`` in the run directory as they arrive, keyed by the
sequence's tokens, so a resumed run reuses them and trains on exactly the same numbers.

Per step: the batch's pairs as interleaved (chosen, rejected) datums, ``forward_backward`` with
the ``dpo`` loss (``beta``, ``label_smoothing``) and ``optim_step`` pipelined as in SFT. The
step's DPO loss, reward margin and preference accuracy are computed here from the logprobs the
trainer returns, so they mean the same on every backend. The eval split is scored with
``forward`` (no gradient) before training, every ``eval_every`` steps and at the end.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from typing import Any, Literal

from pydantic import Field, field_validator

from baseten_loops_cli.errors import ConfigError, LoopsError
from baseten_loops_cli.training.config import CommonConfig, Section
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
TIE_NATS = 1e-3
REFERENCE_CHECKPOINT = "dpo-reference"
_SCORES_IN_FLIGHT = 32  # reference-scoring requests at once (a local sampler batches them)
_SCORES_PER_APPEND = 64  # and made durable in chunks of this many

__all__ = ["KIND", "DPOConfig", "check_reference", "evaluate", "preference_metrics", "run_dpo", "total_steps"]


class DPOData(Section, FormatOptions):
    train: Sources
    eval: EvalSources | None = None
    shuffle: bool = True


class DPOConfig(CommonConfig):
    EVAL_SUPPORTED = False
    kind: Literal["dpo"]
    data: DPOData
    beta: float = Field(0.1, gt=0, description="DPO temperature: how far the policy may move from the reference.")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="Assumed fraction of flipped labels (conservative DPO).")
    reference: str = Field(
        "base",
        description="The reference policy: 'base' (the base model, as the run starts) or a sampler checkpoint bt://loops:<run>/sampler_weights/<name>.",
    )

    @field_validator("reference")
    @classmethod
    def _reference_checkpoint(cls, value: str) -> str:
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


def load_data(loaded, tokenizer: Any) -> LoadedData:
    """Rows of any preference format and source (the data layer reads them), as chosen/rejected pairs."""
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


def estimate(config, data: LoadedData) -> Estimate:
    """Exact: each step's pairs, chosen + rejected (whole sequences); before step 1 the reference
    scores every sequence of both splits once (a prefill each, no backward)."""
    steps = total_steps(len(data.train), config)
    train_tokens = sum(
        len(data.train[i].chosen.tokens) + len(data.train[i].rejected.tokens)
        for step in range(steps)
        for i in batches_for_step(len(data.train), config.batch_size, step, seed=config.seed, shuffle=config.data.shuffle)
    )
    pairs = data.train + (data.eval or [])
    scored = sum(len(p.chosen.tokens) + len(p.rejected.tokens) for p in pairs)
    note = f"before step 1 the reference ({config.reference}) scores {2 * len(pairs)} sequences (~{scored:,} tokens) once"
    return Estimate(steps, train_tokens, 0, scored_tokens=scored, notes=[note])


def sequence_key(tokens: list[int]) -> str:
    """What a reference score is filed under: the sequence's tokens, so edits to the data
    never pair a sequence with another one's logprobs."""
    return hashlib.sha256(",".join(map(str, tokens)).encode()).hexdigest()[:32]


def loss_config(config: Any) -> dict:
    return {"beta": config.beta, "label_smoothing": config.label_smoothing}


def check_reference(client: Any, loaded: Any) -> None:
    """A checkpoint reference must exist and share the base model: checked before provisioning."""
    config = loaded.config
    if config.reference == "base":
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
    config = session.config
    rundir = session.rundir
    scores = {r["key"]: r["ref_logprobs"] for r in rundir.references()}
    todo: dict[str, list[int]] = {}
    for pair in pairs:
        for example in (pair.chosen, pair.rejected):
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


def pair_datums(pairs: list[PreferencePair], scores: dict[str, list[float]]) -> list[dict]:
    """The interleaved rows the ``dpo`` loss pairs positionally: chosen even, rejected odd."""
    return [
        dpo_datum(example, scores[sequence_key(example.tokens)])
        for pair in pairs
        for example in (pair.chosen, pair.rejected)
    ]


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


def evaluate(session: TrainingSession, pairs: list[PreferencePair], scores: dict[str, list[float]]) -> dict:
    """The eval split's DPO metrics under the current policy (``forward``: no gradient),
    prefixed ``eval_``."""
    return submit_eval(session, pairs, scores)()


def submit_eval(session: TrainingSession, pairs: list[PreferencePair], scores: dict[str, list[float]]) -> Any:
    """Submit :func:`evaluate`'s ``forward`` passes now; the returned function waits for them
    (a pipelined loop submits them right behind a step's ``optim_step``)."""
    config = session.config
    batches = []
    for start in range(0, len(pairs), config.batch_size):
        batch = pair_datums(pairs[start : start + config.batch_size], scores)
        batches.append((batch, session.trainer.forward(batch, "dpo", loss_config(config))))

    def metrics() -> dict:
        datums, outputs = [], []
        for batch, future in batches:
            datums += batch
            outputs += future.result()["loss_fn_outputs"]
        values = preference_metrics(datums, outputs, config.beta, config.label_smoothing)
        return {f"eval_{k}": v for k, v in values.items()}

    return metrics


# ------------------------------------------------------------------ the loop
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
    steps = total_steps(len(train), config)
    opt = config.optimizer
    sink.start(steps, session.start_step, "loss")
    scores = reference_logprobs(session, train + (eval_pairs or []), sink, stop)
    if save_if_stopped(session, stop, session.start_step):
        return "interrupted"
    baseline = None
    if eval_pairs:
        before = [r for r in session.rundir.metrics() if r.get("step") == 0 and "eval_loss" in r]
        if before:
            baseline = before[0]
        elif session.start_step == 0:
            # Where the policy starts (0.5 accuracy: it is the reference), for the final comparison.
            baseline = {"step": 0, **evaluate(session, eval_pairs, scores)}
            sink.step(baseline)
    clock = StepClock()
    pipeline = StepPipeline()  # see training/pipeline.py and run_sft
    step = session.start_step
    while step < steps:
        if save_if_stopped(session, stop, step, pipeline):
            return "interrupted"
        indices = batches_for_step(len(train), config.batch_size, step, seed=config.seed, shuffle=config.data.shuffle)
        datums = pair_datums([train[i] for i in indices], scores)
        lr = learning_rate(opt, step, steps)
        fb = session.trainer.forward_backward(datums, "dpo", loss_config(config))
        optim = session.trainer.optim_step(adam_params(opt, lr))
        step += 1
        eval_metrics = (submit_eval(session, eval_pairs, scores)
                        if eval_pairs and config.eval_every and step % config.eval_every == 0 else None)
        checkpoint = (submit_checkpoint(session, step)
                      if config.checkpointing.save_every and step % config.checkpointing.save_every == 0
                      and step < steps else None)  # fmt: skip

        def collect(step=step, datums=datums, indices=indices, lr=lr, fb=fb, optim=optim,
                    eval_metrics=eval_metrics, checkpoint=checkpoint) -> None:
            fb_result = fb.result()
            optim_result = optim.result()
            tokens = sum(len(d["model_input"]["chunks"][0]["tokens"]) for d in datums)
            record = step_record(step, steps, clock, learning_rate=lr, tokens=tokens, optim_result=optim_result,
                                 **preference_metrics(datums, fb_result["loss_fn_outputs"], config.beta,
                                                      config.label_smoothing),
                                 pairs=len(indices))
            if eval_metrics is not None:
                record.update(eval_metrics())
            sink.step(record)
            if checkpoint is not None:
                checkpoint()

        pipeline.push(collect)
    pipeline.drain()
    if save_if_stopped(session, stop, step):  # Ctrl-C during the last step
        return "interrupted"
    if eval_pairs:
        last = next((r for r in reversed(session.rundir.metrics()) if r.get("step") == steps and "eval_loss" in r), None)
        if last is None:
            last = {"step": steps, **evaluate(session, eval_pairs, scores)}
            sink.final(last)
        start = f"{baseline['eval_preference_accuracy']:.0%} -> " if baseline else ""
        sink.message(
            f"Eval: preference accuracy {start}{last['eval_preference_accuracy']:.0%}, "
            f"reward margin {last['eval_reward_margin']:.3f}, loss {last['eval_loss']:.4f}"
        )
    record = save_checkpoint(session, steps, final=True)
    sink.message(f"Saved final checkpoint: {record.get('sampler_path') or record['path']}")
    return "completed"


def _run(session: TrainingSession, data: LoadedData, sink: Any, stop: StopRequested) -> str:
    return run_dpo(session, data.train, data.eval, sink, stop)


TEMPLATE = """\
# loops DPO config (preference pairs). Check it with `loops train validate FILE`.
kind: dpo
""" + COMMON + """
batch_size: 8                   # preference pairs per step

data:
  train: data/pairs.jsonl       # JSONL: {{"prompt": "...", "chosen": "...", "rejected": "..."}}
  # eval: data/eval_pairs.jsonl #    or: {{"messages": [...], "chosen": "...", "rejected": "..."}}
  shuffle: true                 #    or: {{"chosen": [messages], "rejected": [messages]}}

beta: 0.1                       # how far the policy may move from the reference (higher = closer)
label_smoothing: 0.0            # assumed fraction of mislabelled pairs (conservative DPO)
reference: base                 # base | bt://loops:<run_id>/sampler_weights/<name> (e.g. your SFT run's final)
"""

KIND = Kind(
    name="dpo",
    config_model=DPOConfig,
    noun="pairs",
    main_metric="loss",
    metric_names=("loss", "reward_margin", "preference_accuracy", "chosen_reward", "rejected_reward", "pairs",
                  "eval_loss", "eval_reward_margin", "eval_preference_accuracy"),
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
    row_formats=("preference", "unpaired_preference"),
    row_sides=("chosen", "rejected"),
    render_rows=render_rows,
)
