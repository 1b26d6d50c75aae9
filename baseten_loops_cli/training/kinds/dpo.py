"""Preference tuning (``kind: dpo``): pairs of a chosen and a rejected reply, trained with one of
the paired preference losses (``loss: dpo | ipo | simpo | orpo``, training/losses/preference_losses.py).

Before step 1, every sequence (each pair's chosen and rejected conversation, train and eval) is
scored once by the reference policy (training/loop/preference.py, shared with KTO: kept in
``reference_logprobs.jsonl`` and reused on resume).

The reference-free losses (``simpo``, ``orpo``: not in ``NEEDS_REFERENCE``) skip that pass.

Per step (:class:`DPOSteps`, in the one loop of training/loop/core.py): the batch's pairs as
interleaved (chosen, rejected) datums. ``loss: dpo`` sends them to ``forward_backward`` with the protocol's ``dpo`` loss
(``beta``, ``label_smoothing``); the other losses take the SDK's custom-loss path
(``preference_losses.submit_custom_loss``: ``/forward`` for the logprobs, the loss and its
gradient in closed form here, then a weighted ``cross_entropy`` ``/forward_backward``), so every
loss runs on Baseten through the protocol alone. The step's loss, reward margin and preference
accuracy are computed here from the logprobs the trainer returns, so they mean the same on every
backend. The eval split is scored with ``forward`` (no gradient) before training, every
``eval_every`` steps and at the end.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from baseten_loops_cli.training.losses import preference_losses as pl
from baseten_loops_cli.training.config import CommonConfig, TrainData, config_error
from baseten_loops_cli.training.data.datums import PreferencePair, batches_for_step
from baseten_loops_cli.training.kinds import Estimate, LoadedData, StepField
from baseten_loops_cli.training.loop.core import CustomLoss, ProtocolLoss, StepWork, Waiter, total_steps
from baseten_loops_cli.training.loop.preference import (
    PreferenceSteps, preference_kind, param_error, param_key, reference_value, rows_to_train, sequence_datum, sequence_key,
)  # fmt: skip
from baseten_loops_cli.training.session import TrainingSession
from baseten_loops_cli.training.templates import COMMON

# A pair whose policy-vs-reference log-ratio gap is within this many nats is a tie and counts
# half: an untrained policy scores 0.5 whatever the float noise between trainer and sampler.
# (The local engine's dpo loss uses the same rule: local/engine/losses.py DPO_TIE_NATS.)
TIE_NATS = pl.TIE_NATS

__all__ = ["KIND", "DPOConfig", "DPOSteps", "evaluate", "preference_metrics", "rows_to_train", "sequence_key"]


class DPOConfig(CommonConfig):
    kind: Literal["dpo"]
    data: TrainData
    # `loss` comes before its parameters: their validators read it (a bad loss: they are skipped).
    loss: str = Field("dpo", description="dpo | ipo | simpo | orpo (training/losses/preference_losses.py).")
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
        error = param_error(loss, param_key(info), value)
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
    from baseten_loops_cli.training.data.datums import load_preference_pairs
    from baseten_loops_cli.training.data.formats import data_notes

    config = loaded.config
    train_spec, eval_spec = kinds.data_specs(loaded)
    train = load_preference_pairs(train_spec, tokenizer, max_seq_len=config.max_seq_len)
    evals = load_preference_pairs(eval_spec, tokenizer, max_seq_len=config.max_seq_len) if eval_spec else None
    return LoadedData(tokenizer, train, evals, notes=data_notes(train_spec, eval_spec))


def render_rows(spec, tokenizer: Any, *, max_seq_len: int, train_on: str | None = None) -> list[list[Any]]:
    """Each row as the loop trains it (`loops data check|preview`): its chosen and rejected sequences."""
    from baseten_loops_cli.training.data.datums import load_preference_pairs

    return [[p.chosen, p.rejected] for p in load_preference_pairs(spec, tokenizer, max_seq_len=max_seq_len)]


def estimate(config, data: LoadedData) -> Estimate:
    """Exact: each step's pairs, chosen + rejected (whole sequences); before step 1 the reference
    (dpo, ipo) scores the sequences the run uses once (a prefill each, no backward): every train
    pair some step trains (:func:`rows_to_train`) and the eval split. The custom-loss path (every
    loss but dpo) also scores each step's batch with a ``/forward`` before its ``/forward_backward``."""
    steps = total_steps(len(data.train), config.batch_size, config.epochs, config.max_steps)
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


def loss_config(config: Any) -> dict:
    """The protocol's ``dpo`` loss config (``loss: dpo``)."""
    params = config.loss_params
    return {"beta": params["beta"], "label_smoothing": params["label_smoothing"]}


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


def evaluate(session: TrainingSession[DPOConfig], pairs: list[PreferencePair], scores: dict[str, list[float]] | None) -> dict:
    """The eval split's metrics under the current policy (``forward``: no gradient), prefixed
    ``eval_``."""
    return submit_eval(session, pairs, scores)()


def submit_eval(session: TrainingSession[DPOConfig], pairs: list[PreferencePair], scores: dict[str, list[float]] | None) -> Waiter:
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


# ------------------------------------------------------------------ the kind's part of the loop
class DPOSteps(PreferenceSteps[DPOConfig]):
    """Per step: the batch's pairs as interleaved (chosen, rejected) datums, trained with the
    protocol's ``dpo`` loss or on the custom-loss path (every other paired loss)."""

    def reference(self) -> str | None:
        return self.config.reference if self.config.needs_reference else None

    def sequences(self, row: PreferencePair) -> list:
        return [row.chosen, row.rejected]

    def step(self, step: int, rows: list[int], version: int) -> StepWork:
        config = self.config
        params = config.loss_params
        datums = pair_datums([self.data.train[i] for i in rows], self.scores)
        fields = {"pairs": len(rows)}
        if config.loss not in pl.PROTOCOL_LOSS:
            return StepWork(datums, CustomLoss(lambda seqs: pl.paired_loss(config.loss, seqs, params)), fields)

        def metrics(result: dict | None) -> dict:
            outputs = result["loss_fn_outputs"] if result else []
            return preference_metrics(datums, outputs, params["beta"], params["label_smoothing"])

        return StepWork(datums, ProtocolLoss(pl.PROTOCOL_LOSS[config.loss], loss_config(config)), fields,
                        fields_from=metrics)

    def submit_eval(self, version: int) -> Waiter | None:
        return submit_eval(self.session, self.data.eval, self.scores) if self.data.eval else None

    def final_line(self, baseline: dict | None, last: dict) -> str | None:
        start = f"{baseline['eval_preference_accuracy']:.0%} -> " if baseline else ""
        return (f"Eval: preference accuracy {start}{last['eval_preference_accuracy']:.0%}, "
                f"reward margin {last['eval_reward_margin']:.3f}, loss {last['eval_loss']:.4f}")


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

KIND = preference_kind(
    name="dpo",
    config_model=DPOConfig,
    noun="pairs",
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
    template=lambda: TEMPLATE.format(name="my-dpo", lr="5.0e-5", schedule="linear"),
    load_data=load_data,
    estimate=estimate,
    hooks=DPOSteps,
    row_purpose="preference",
    row_formats=("preference",),
    row_sides=("chosen", "rejected"),
    render_rows=render_rows,
)
