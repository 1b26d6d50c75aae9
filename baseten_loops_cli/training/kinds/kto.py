"""Unpaired preference tuning (``kind: kto``): one completion per row with a thumbs up or down
(``label: true | false``), the KTO loss (Ethayarajh et al. 2024) against a frozen reference.

Rows come from the data layer in any format and source it reads (JSONL, JSON, CSV, Parquet,
Arrow, folders, hub datasets; ``data.columns``, mixtures, ``eval: {from_train: ...}``) as its
``unpaired`` rows, through :func:`read_examples` (the one place this kind reads data;
``kto_rows``' row checks). Each example's KL sequence (its prompt with
another example's completion, ``kto_rows.kl_examples``) gives the batch's KL estimate ``z0``.

Before step 1 the reference scores every example and KL sequence of both splits once, as DPO's
sequences (``preference.reference_scores``: kept in ``reference_logprobs.jsonl``, reused on resume).
Per step, the SDK's custom-loss path (``preference_losses.submit_custom_loss``): one ``/forward``
of the batch's examples and their KL sequences, the KTO loss and its gradient in closed form on
the client, then a weighted ``cross_entropy`` ``/forward_backward`` of the examples only (no
gradient through ``z0``), and ``optim_step``, in the one loop of training/loop/core.py (:class:`KTOSteps`). Metrics: ``loss``, ``desirable_reward`` / ``undesirable_reward``
(``beta`` times the log-ratio, means over each label), ``reward_margin`` (their difference) and
``kl_estimate``, with ``eval_`` twins on ``data.eval``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from baseten_loops_cli.training.losses import preference_losses as pl
from baseten_loops_cli.training.config import CommonConfig, TrainData, config_error
from baseten_loops_cli.training.data.datums import Example, batches_for_step
from baseten_loops_cli.training.kinds import Estimate, LoadedData, StepField
from baseten_loops_cli.training.loop.core import CustomLoss, StepWork, Waiter, total_steps
from baseten_loops_cli.training.loop.preference import (
    PreferenceSteps, preference_kind, param_error, param_key, reference_value, rows_to_train, sequence_datum,
)  # fmt: skip
from baseten_loops_cli.training.session import TrainingSession
from baseten_loops_cli.training.templates import COMMON

__all__ = ["KIND", "KTOConfig", "KTOItem", "KTOSteps", "read_examples"]


class KTOConfig(CommonConfig):
    kind: Literal["kto"]
    data: TrainData
    loss: str = Field("kto", description="Always kto (the paired losses are kind: dpo's).")
    beta: float | None = Field(None, description="How far the policy may move from the reference (default 0.1).")
    desirable_weight: float | None = Field(None, description="lambda_D: the weight of desirable (label true) rows (default 1.0).")
    undesirable_weight: float | None = Field(None, description="lambda_U: the weight of undesirable (label false) rows (default 1.0).")
    reference: str = Field(
        "base",
        description="The reference policy: 'base' (the base model, as the run starts) or a sampler checkpoint bt://loops:<run>/sampler_weights/<name>.",
    )
    # The paired losses' parameters, declared only to be refused with their owner's name (not
    # as an unknown key): "gamma belongs to loss simpo, not to kto".
    label_smoothing: float | None = None
    gamma: float | None = None
    lambda_: float | None = Field(None, alias="lambda")

    @field_validator("loss")
    @classmethod
    def _kto_loss(cls, value: str) -> str:
        if value != "kto":
            paired = value in pl.PAIRED_LOSSES
            raise config_error(f"kind: kto trains with the kto loss, not {value!r}",
                               f"Use kind: dpo for loss {value} (paired rows)." if paired else "Remove `loss`, or set it to kto.")
        return value

    @field_validator("beta", "desirable_weight", "undesirable_weight", "label_smoothing", "gamma", "lambda_")
    @classmethod
    def _loss_parameter(cls, value: float | None, info: ValidationInfo) -> float | None:
        error = param_error("kto", param_key(info), value) if value is not None else None
        if error is not None:
            raise error
        return value

    @field_validator("reference")
    @classmethod
    def _reference_checkpoint(cls, value: str) -> str:
        return reference_value(value)

    @property
    def needs_reference(self) -> bool:
        return True

    @property
    def loss_params(self) -> dict[str, float]:
        given = {"beta": self.beta, "desirable_weight": self.desirable_weight, "undesirable_weight": self.undesirable_weight}
        return pl.resolve_params("kto", {k: v for k, v in given.items() if v is not None})


@dataclass
class KTOItem:
    """One row of a split: its rendered completion, its label, and its KL sequence."""

    example: Example
    label: bool
    kl: Example
    source: str


def read_examples(spec: Any, tokenizer: Any, *, max_seq_len: int) -> list[KTOItem]:
    """Every row of a KTO data spec (``formats.DataSpec``, or a plain path), in any format the
    data layer reads, checked (file:line: a paired row, a missing or non-boolean label, only one
    label in the split, too long) and rendered, each with its KL sequence. The one function of
    this kind that reads data."""
    from baseten_loops_cli.training.data.kto_rows import kl_examples, load_kto_examples

    examples = load_kto_examples(spec, tokenizer, max_seq_len=max_seq_len)
    kls = kl_examples(examples, tokenizer, max_seq_len=max_seq_len)
    return [KTOItem(e.example, e.label, kl, e.row.source) for e, kl in zip(examples, kls)]


def load_data(loaded, tokenizer: Any) -> LoadedData:
    from baseten_loops_cli.training import kinds
    from baseten_loops_cli.training.data.formats import data_notes

    config = loaded.config
    train_spec, eval_spec = kinds.data_specs(loaded)
    train = read_examples(train_spec, tokenizer, max_seq_len=config.max_seq_len)
    evals = read_examples(eval_spec, tokenizer, max_seq_len=config.max_seq_len) if eval_spec else None
    return LoadedData(tokenizer, train, evals, notes=data_notes(train_spec, eval_spec))


def render_rows(spec, tokenizer: Any, *, max_seq_len: int, train_on: str | None = None) -> list[list[Any]]:
    """Each row as the loop trains it (`loops data check|preview`): its completion with its
    prompt (the KL sequences pair rows with each other, so a row alone has none)."""
    from baseten_loops_cli.training.data.kto_rows import load_kto_examples

    return [[e.example] for e in load_kto_examples(spec, tokenizer, max_seq_len=max_seq_len, check_labels=False)]


def estimate(config, data: LoadedData) -> Estimate:
    """Exact: each step's examples are trained; their KL sequences are only scored (the step's
    ``/forward`` scores both); before step 1 the reference scores every example and KL sequence
    the run uses once (preference.rows_to_train and the eval split)."""
    steps = total_steps(len(data.train), config.batch_size, config.epochs, config.max_steps)
    batches = [batches_for_step(len(data.train), config.batch_size, step, seed=config.seed, shuffle=config.data.shuffle)
               for step in range(steps)]
    train_tokens = sum(len(data.train[i].example.tokens) for batch in batches for i in batch)
    step_forward = sum(len(data.train[i].example.tokens) + len(data.train[i].kl.tokens) for batch in batches for i in batch)
    items = [data.train[i] for i in rows_to_train(len(data.train), config)] + (data.eval or [])
    reference = sum(len(item.example.tokens) + len(item.kl.tokens) for item in items)
    desirable = sum(1 for item in data.train if item.label)
    params = config.loss_params
    notes = [f"{desirable} desirable and {len(data.train) - desirable} undesirable examples",
             f"before step 1 the reference ({config.reference}) scores {2 * len(items)} sequences "
             f"(examples and their KL sequences, ~{reference:,} tokens) once",
             "each step is a forward (examples + KL sequences), then a weighted cross_entropy forward_backward "
             "(the SDK's forward_backward_custom)"]
    advice = pl.kto_weight_advice(desirable, len(data.train) - desirable, params["desirable_weight"],
                                  params["undesirable_weight"])
    if advice:
        notes.append(advice)
    return Estimate(steps, train_tokens, 0, scored_tokens=reference + step_forward, notes=notes)


def _datums(items: list[KTOItem], scores: dict[str, list[float]] | None) -> tuple[list[dict], list[dict], list[bool]]:
    """The examples' datums, their KL sequences' datums (scored, never trained) and labels."""
    return ([sequence_datum(item.example, scores) for item in items], [sequence_datum(item.kl, scores) for item in items],
            [item.label for item in items])


def submit_eval(session: TrainingSession[KTOConfig], items: list[KTOItem], scores: dict[str, list[float]] | None) -> Waiter:
    """Submit the eval split's ``/forward`` passes (examples and KL sequences) now; the returned
    function waits for them and gives the KTO metrics of the whole split, prefixed ``eval_``."""
    config = session.config
    batches = []
    for start in range(0, len(items), config.batch_size):
        datums, kls, labels = _datums(items[start : start + config.batch_size], scores)
        future = session.trainer.forward([pl.forward_datum(d) for d in datums + kls], pl.CUSTOM_LOSS_FN,
                                         dict(pl.CUSTOM_LOSS_CONFIG))
        batches.append((datums, kls, labels, future))

    def metrics() -> dict:
        sequences, kl_sequences, labels = [], [], []
        for datums, kls, batch_labels, future in batches:
            scored = pl.scores_from_forward(datums + kls, future.result())
            sequences += scored[: len(datums)]
            kl_sequences += scored[len(datums):]
            labels += batch_labels
        values = pl.kto_loss(sequences, labels, kl_sequences, config.loss_params).metrics
        return {f"eval_{k}": v for k, v in values.items()}

    return metrics


class KTOSteps(PreferenceSteps[KTOConfig]):
    """Per step, the custom-loss path: the batch's examples trained, their KL sequences scored
    in the same ``/forward`` (no gradient through ``z0``)."""

    def reference(self) -> str | None:
        return self.config.reference if self.config.needs_reference else None

    def sequences(self, row: KTOItem) -> list:
        return [row.example, row.kl]

    def step(self, step: int, rows: list[int], version: int) -> StepWork:
        params = self.config.loss_params
        datums, kls, labels = _datums([self.data.train[i] for i in rows], self.scores)
        n = len(datums)
        loss = CustomLoss(lambda seqs: pl.kto_loss(seqs[:n], labels, seqs[n:], params), extra=kls)
        return StepWork(datums, loss, {"examples": n, "desirable": sum(labels)})

    def submit_eval(self, version: int) -> Waiter | None:
        return submit_eval(self.session, self.data.eval, self.scores) if self.data.eval else None

    def final_line(self, baseline: dict | None, last: dict) -> str | None:
        margin = "eval_reward_margin"
        # round(...) + 0.0: a baseline of float noise (-1e-7) reads 0.000, not -0.000
        start = f"{round(baseline[margin], 3) + 0.0:.3f} -> " if baseline and margin in baseline else ""
        return (f"Eval: desirable-vs-undesirable reward margin {start}{last.get(margin, float('nan')):.3f}, "
                f"KL estimate {last['eval_kl_estimate']:.3f}, loss {last['eval_loss']:.4f}")


TEMPLATE = """\
# loops KTO config (unpaired preferences: one completion per row, labelled good or bad).
# Check it with `loops train validate FILE`.
kind: kto
""" + COMMON + """
batch_size: 8                   # examples per step (mix both labels)

data:
  train: data/feedback.jsonl    # {{"prompt": "...", "completion": "...", "label": true}}  (false = undesirable)
  # eval: data/eval_feedback.jsonl   or: {{"messages": [...], "completion": "...", "label": false}}
  # eval: {{from_train: 0.05}}      # or hold out a seeded 5% of the training rows
  # columns: {{prompt: question, completion: answer, label: thumbs_up}}   # CSV, Parquet, JSON, folders, hub datasets too
  shuffle: true

beta: 0.1                       # how far the policy may move from the reference (higher = closer)
desirable_weight: 1.0           # lambda_D; keep desirable_weight * #desirable / (undesirable_weight * #undesirable)
undesirable_weight: 1.0         #   in [1, 4/3] (the KTO paper; the plan notes it when it is not)
reference: base                 # base | bt://loops:<run_id>/sampler_weights/<name> (e.g. your SFT run's final)
"""

KIND = preference_kind(
    name="kto",
    config_model=KTOConfig,
    noun="examples",
    metric_names=("loss", "reward_margin", "desirable_reward", "undesirable_reward", "kl_estimate", "examples",
                  "desirable", "eval_loss", "eval_reward_margin", "eval_desirable_reward", "eval_undesirable_reward",
                  "eval_kl_estimate"),
    step_fields=(
        StepField("loss", "loss"),
        StepField("reward_margin", "margin", ".3f", optional=True),
        StepField("kl_estimate", "kl", ".3f", optional=True),
        StepField("eval_loss", "eval_loss", optional=True),
        StepField("eval_reward_margin", "eval_margin", ".3f", optional=True),
    ),
    template=lambda: TEMPLATE.format(name="my-kto", lr="5.0e-5", schedule="linear"),
    load_data=load_data,
    estimate=estimate,
    hooks=KTOSteps,
    row_purpose="unpaired",
    row_formats=("unpaired_preference",),
    render_rows=render_rows,
)
