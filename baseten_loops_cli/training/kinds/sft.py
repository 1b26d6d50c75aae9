"""Supervised fine-tuning (``kind: sft``): chat or prompt/completion rows, cross-entropy on the
trained tokens.

Per step (:class:`SFTSteps`, in the one loop of training/loop/core.py): the batch's examples as
cross-entropy datums; on schedule the eval's ``forward`` passes give ``eval_loss``.
"""

from __future__ import annotations

from typing import Any, Callable, Literal

from baseten_loops_cli.training.config import CommonConfig, TrainData
from baseten_loops_cli.training.data.datums import Example, batches_for_step, sft_datum, weighted_nll
from baseten_loops_cli.training.kinds import Estimate, Kind, LoadedData, StepField
from baseten_loops_cli.training.loop.core import ProtocolLoss, StepHooks, StepWork, Waiter, total_steps
from baseten_loops_cli.training.session import TrainingSession
from baseten_loops_cli.training.templates import COMMON


class SFTData(TrainData):
    train_on: Literal["last_assistant", "all_assistant", "all"] = "last_assistant"


class SFTConfig(CommonConfig):
    kind: Literal["sft"]
    data: SFTData


def load_data(loaded, tokenizer: Any) -> LoadedData:
    """Rows of any format and source (the data layer reads them), as chat/prompt-completion examples."""
    from baseten_loops_cli.training import kinds
    from baseten_loops_cli.training.data.datums import load_sft_examples
    from baseten_loops_cli.training.data.formats import data_notes

    config = loaded.config
    train_spec, eval_spec = kinds.data_specs(loaded)
    kwargs = {"train_on": config.data.train_on, "max_seq_len": config.max_seq_len}
    train = load_sft_examples(train_spec, tokenizer, **kwargs)
    evals = load_sft_examples(eval_spec, tokenizer, **kwargs) if eval_spec else None
    return LoadedData(tokenizer, train, evals, notes=data_notes(train_spec, eval_spec))


def render_rows(spec, tokenizer: Any, *, max_seq_len: int, train_on: str = "last_assistant") -> list[list[Any]]:
    """Each row as the loop trains it (`loops data check|preview`): one Example (tokens, weights)."""
    from baseten_loops_cli.training.data.datums import load_sft_examples

    return [[e] for e in load_sft_examples(spec, tokenizer, train_on=train_on, max_seq_len=max_seq_len)]


def estimate(config, data: LoadedData) -> Estimate:
    """Exact: the datums' input tokens of each step's batch, as the loop builds them."""
    steps = total_steps(len(data.train), config.batch_size, config.epochs, config.max_steps)
    train_tokens = sum(
        len(data.train[i].tokens) - 1
        for step in range(steps)
        for i in batches_for_step(len(data.train), config.batch_size, step, seed=config.seed, shuffle=config.data.shuffle)
    )
    return Estimate(steps, train_tokens)


def eval_task(loaded, data, *, limit=None, seed=None, samples=None, k=None) -> Any:
    """SFT rows scored by likelihood (the config brings the rendering and max_seq_len)."""
    from baseten_loops_cli.training.evaluation.scoring import SFTTask

    config = loaded.config
    return SFTTask(data, config.data.train_on, config.max_seq_len, limit)


def submit_eval(session: TrainingSession, eval_examples: list[Example], batch_size: int) -> Callable[[], float]:
    """Submit the eval's ``forward`` passes now; the returned function waits for them and gives
    the mean per-token NLL (of the policy as it was when they were submitted)."""
    batches = []
    for start in range(0, len(eval_examples), batch_size):
        datums = [sft_datum(e) for e in eval_examples[start : start + batch_size]]
        batches.append((datums, session.trainer.forward(datums, "cross_entropy")))

    def mean_nll() -> float:
        total, count = 0.0, 0
        for datums, future in batches:
            nll, n = weighted_nll(datums, future.result()["loss_fn_outputs"])
            total += nll * n
            count += n
        return total / count if count else float("nan")

    return mean_nll


class SFTSteps(StepHooks[SFTConfig]):
    """Per step: the batch's examples as cross-entropy datums; ``eval_loss`` on ``data.eval``."""

    def step(self, step: int, rows: list[int], version: int) -> StepWork:
        datums = [sft_datum(self.data.train[i]) for i in rows]

        def fields(result: dict | None) -> dict:
            nll, trained = weighted_nll(datums, result["loss_fn_outputs"]) if result else (float("nan"), 0)
            return {"loss": nll, "trained_tokens": trained}

        return StepWork(datums, ProtocolLoss("cross_entropy"), fields_from=fields)

    def submit_eval(self, version: int) -> Waiter | None:
        if not self.data.eval:
            return None
        mean_nll = submit_eval(self.session, self.data.eval, self.config.batch_size)
        return lambda: {"eval_loss": mean_nll()}

    def final_line(self, baseline: dict | None, last: dict) -> str | None:
        return f"Final eval loss: {last['eval_loss']:.4f}"


TEMPLATE = """\
# loops SFT config. Check it with `loops train validate FILE`, run it with `loops train run FILE`.
kind: sft
""" + COMMON + """
batch_size: 8

data:
  train: data/train.jsonl       # JSONL: {{"messages": [{{"role": "user", ...}}, {{"role": "assistant", ...}}]}}
  # eval: data/eval.jsonl       #    or: {{"prompt": "...", "completion": "..."}}
  train_on: last_assistant      # last_assistant | all_assistant | all
  shuffle: true
# eval:                         # optional: when training ends, score the final checkpoint as `loops eval` does
#   base: true                  # also score the base model (eval.json + eval.txt in the run directory)
#   # data: data/eval.jsonl     # default: data.eval (SFT) or data.eval_prompts (RL)
"""

KIND = Kind(
    name="sft",
    config_model=SFTConfig,
    noun="examples",
    main_metric="loss",
    metric_names=("loss", "trained_tokens", "eval_loss"),
    step_fields=(StepField("loss", "loss"), StepField("eval_loss", "eval_loss", optional=True)),
    template=lambda: TEMPLATE.format(name="my-sft", lr="2.0e-4", schedule="linear"),
    load_data=load_data,
    estimate=estimate,
    hooks=SFTSteps,
    eval_data_key=("data", "eval"),
    eval_task=eval_task,
    capabilities_use_case="sft",
    row_purpose="sft",
    render_rows=render_rows,
)
