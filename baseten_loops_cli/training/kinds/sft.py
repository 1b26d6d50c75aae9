"""Supervised fine-tuning (``kind: sft``): chat or prompt/completion rows, cross-entropy on the
trained tokens.

Per step: build the batch's datums (order is a pure function of seed and epoch, so a resumed
run sees the same batches), submit ``forward_backward`` and ``optim_step`` (and, on schedule,
the eval's ``forward`` passes and a checkpoint save), then collect the *previous* step's results
and record them (``training/pipeline.py``): the trainer never waits for the client.
"""

from __future__ import annotations

from typing import Any, Callable, Literal

from baseten_loops_cli.training.config import CommonConfig, Section
from baseten_loops_cli.training.data import Example, batches_for_step, sft_datum, weighted_nll
from baseten_loops_cli.training.formats.spec import EvalSources, FormatOptions, Sources
from baseten_loops_cli.training.kinds import Estimate, Kind, LoadedData, StepField
from baseten_loops_cli.training.pipeline import StepClock, StepPipeline, step_record
from baseten_loops_cli.training.templates import COMMON
from baseten_loops_cli.training.session import (
    StopRequested, TrainingSession, adam_params, learning_rate, save_checkpoint, save_if_stopped,
    submit_checkpoint,
)  # fmt: skip


class SFTData(Section, FormatOptions):
    train: Sources
    eval: EvalSources | None = None
    train_on: Literal["last_assistant", "all_assistant", "all"] = "last_assistant"
    shuffle: bool = True


class SFTConfig(CommonConfig):
    kind: Literal["sft"]
    data: SFTData


def load_data(loaded, tokenizer: Any) -> LoadedData:
    """Rows of any format and source (the data layer reads them), as chat/prompt-completion examples."""
    from baseten_loops_cli.training import kinds
    from baseten_loops_cli.training.data import load_sft_examples
    from baseten_loops_cli.training.formats import data_notes

    config = loaded.config
    train_spec, eval_spec = kinds.data_specs(loaded)
    kwargs = {"train_on": config.data.train_on, "max_seq_len": config.max_seq_len}
    train = load_sft_examples(train_spec, tokenizer, **kwargs)
    evals = load_sft_examples(eval_spec, tokenizer, **kwargs) if eval_spec else None
    return LoadedData(tokenizer, train, evals, notes=data_notes(train_spec, eval_spec))


def render_rows(spec, tokenizer: Any, *, max_seq_len: int, train_on: str = "last_assistant") -> list[list[Any]]:
    """Each row as the loop trains it (`loops data check|preview`): one Example (tokens, weights)."""
    from baseten_loops_cli.training.data import load_sft_examples

    return [[e] for e in load_sft_examples(spec, tokenizer, train_on=train_on, max_seq_len=max_seq_len)]


def estimate(config, data: LoadedData) -> Estimate:
    """Exact: the datums' input tokens of each step's batch, as the loop builds them."""
    steps = total_steps(len(data.train), config)
    train_tokens = sum(
        len(data.train[i].tokens) - 1
        for step in range(steps)
        for i in batches_for_step(len(data.train), config.batch_size, step, seed=config.seed, shuffle=config.data.shuffle)
    )
    return Estimate(steps, train_tokens)


def eval_task(loaded, data, *, limit=None, seed=None, samples=None, k=None) -> Any:
    """SFT rows scored by likelihood (the config brings the rendering and max_seq_len)."""
    from baseten_loops_cli.training.evaluation import SFTTask

    config = loaded.config
    return SFTTask(data, config.data.train_on, config.max_seq_len, limit)


def total_steps(n_examples: int, config) -> int:
    per_epoch = max(1, n_examples // config.batch_size)
    steps = per_epoch * config.epochs
    return min(steps, config.max_steps) if config.max_steps else steps


def evaluate(session: TrainingSession, eval_examples: list[Example], batch_size: int) -> float:
    return submit_eval(session, eval_examples, batch_size)()


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


def run_sft(
    session: TrainingSession,
    train: list[Example],
    eval_examples: list[Example] | None,
    sink,
    stop: StopRequested,
) -> str:
    """Train to the end (returns "completed") or until Ctrl-C (returns "interrupted").

    ``sink`` is a :class:`~baseten_loops_cli.training.metrics.MetricsSink`: every record goes
    through it (metrics.jsonl, the display, W&B)."""

    config = session.config
    steps = total_steps(len(train), config)
    opt = config.optimizer
    sink.start(steps, session.start_step, "loss")
    clock = StepClock()
    pipeline = StepPipeline()
    step = session.start_step
    while step < steps:
        if save_if_stopped(session, stop, step, pipeline):
            return "interrupted"
        batch = [train[i] for i in batches_for_step(len(train), config.batch_size, step, seed=config.seed, shuffle=config.data.shuffle)]
        datums = [sft_datum(e) for e in batch]
        lr = learning_rate(opt, step, steps)
        fb = session.trainer.forward_backward(datums, "cross_entropy")
        optim = session.trainer.optim_step(adam_params(opt, lr))
        step += 1
        # Submitted right behind this step's optim_step, so they see exactly its weights.
        eval_loss = (submit_eval(session, eval_examples, config.batch_size)
                     if eval_examples and config.eval_every and step % config.eval_every == 0 else None)
        checkpoint = (submit_checkpoint(session, step)
                      if config.checkpointing.save_every and step % config.checkpointing.save_every == 0
                      and step < steps else None)  # fmt: skip

        def collect(step=step, datums=datums, lr=lr, fb=fb, optim=optim, eval_loss=eval_loss,
                    checkpoint=checkpoint) -> None:
            fb_result = fb.result()
            optim_result = optim.result()
            nll, trained = weighted_nll(datums, fb_result["loss_fn_outputs"])
            tokens = sum(len(d["model_input"]["chunks"][0]["tokens"]) for d in datums)
            record = step_record(step, steps, clock, learning_rate=lr, tokens=tokens, optim_result=optim_result,
                                 loss=nll, trained_tokens=trained)
            if eval_loss is not None:
                record["eval_loss"] = eval_loss()
            sink.step(record)
            if checkpoint is not None:
                checkpoint()

        pipeline.push(collect)
    pipeline.drain()
    if save_if_stopped(session, stop, step):  # Ctrl-C during the last step
        return "interrupted"
    if eval_examples and (not config.eval_every or steps % config.eval_every):
        final_eval = evaluate(session, eval_examples, config.batch_size)
        sink.message(f"Final eval loss: {final_eval:.4f}")
        sink.final({"step": steps, "eval_loss": final_eval})
    record = save_checkpoint(session, steps, final=True)
    sink.message(f"Saved final checkpoint: {record.get('sampler_path') or record['path']}")
    if config.eval is not None:
        from baseten_loops_cli.training.final_eval import evaluate_final

        evaluate_final(session, record, sink)
    return "completed"


def _run(session: TrainingSession, data: LoadedData, sink, stop: StopRequested) -> str:
    return run_sft(session, data.train, data.eval, sink, stop)


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
    data_path_keys=(("data", "train"), ("data", "eval")),
    template=lambda: TEMPLATE.format(name="my-sft", lr="2.0e-4", schedule="linear"),
    load_data=load_data,
    estimate=estimate,
    run=_run,
    eval_data_key=("data", "eval"),
    eval_task=eval_task,
    capabilities_use_case="sft",
    row_purpose="sft",
    render_rows=render_rows,
)
