"""The supervised fine-tuning loop.

Per step: build the batch's datums (order is a pure function of seed and epoch, so a resumed
run sees the same batches), submit ``forward_backward`` and ``optim_step`` before awaiting
either (the trainer pipelines them), record metrics, evaluate and checkpoint on schedule.
"""

from __future__ import annotations

import time

from baseten_loops_cli.training.data import Example, batches_for_step, sft_datum, weighted_nll
from baseten_loops_cli.training.session import StopRequested, TrainingSession, adam_params, learning_rate, save_checkpoint


def total_steps(n_examples: int, config) -> int:
    per_epoch = max(1, n_examples // config.batch_size)
    steps = per_epoch * config.epochs
    return min(steps, config.max_steps) if config.max_steps else steps


def evaluate(session: TrainingSession, eval_examples: list[Example], batch_size: int) -> float:
    total, count = 0.0, 0
    for start in range(0, len(eval_examples), batch_size):
        datums = [sft_datum(e) for e in eval_examples[start : start + batch_size]]
        out = session.trainer.forward(datums, "cross_entropy").result()
        nll, n = weighted_nll(datums, out["loss_fn_outputs"])
        total += nll * n
        count += n
    return total / count if count else float("nan")


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
    started = time.monotonic()
    tokens_total = 0
    step = session.start_step
    while step < steps:
        if stop.requested:
            save_checkpoint(session, step)
            return "interrupted"
        step_started = time.monotonic()
        batch = [train[i] for i in batches_for_step(len(train), config.batch_size, step, seed=config.seed, shuffle=config.data.shuffle)]
        datums = [sft_datum(e) for e in batch]
        lr = learning_rate(opt, step, steps)
        adam = adam_params(opt, lr)
        fb = session.trainer.forward_backward(datums, "cross_entropy")
        optim = session.trainer.optim_step(adam)
        fb_result = fb.result()
        optim_result = optim.result()
        nll, trained = weighted_nll(datums, fb_result["loss_fn_outputs"])
        tokens = sum(len(d["model_input"]["chunks"][0]["tokens"]) for d in datums)
        tokens_total += tokens
        step += 1
        elapsed = time.monotonic() - step_started
        record = {
            "step": step,
            "loss": nll,
            "learning_rate": lr,
            "tokens": tokens,
            "trained_tokens": trained,
            "tokens_per_s": tokens / elapsed if elapsed > 0 else None,
            "step_time_s": elapsed,
            "time_s": time.monotonic() - started,
            "policy_version": step,
            "progress": step / steps,
        }
        grad_norm = (optim_result.get("metrics") or {}).get("grad_norm")
        if grad_norm is not None:
            record["grad_norm"] = grad_norm
        if eval_examples and config.eval_every and step % config.eval_every == 0:
            record["eval_loss"] = evaluate(session, eval_examples, config.batch_size)
        sink.step(record)
        if config.checkpointing.save_every and step % config.checkpointing.save_every == 0 and step < steps:
            save_checkpoint(session, step)
    if stop.requested:
        # Ctrl-C during the last step is honoured like any other: saved, resumable, exit 130
        # (resume then only runs the final eval and checkpoint).
        save_checkpoint(session, step)
        return "interrupted"
    if eval_examples and (not config.eval_every or steps % config.eval_every):
        final_eval = evaluate(session, eval_examples, config.batch_size)
        sink.message(f"Final eval loss: {final_eval:.4f}")
        sink.final({"step": steps, "eval_loss": final_eval})
    record = save_checkpoint(session, steps, final=True)
    sink.message(f"Saved final checkpoint: {record.get('sampler_path') or record['path']}")
    if config.eval is not None:
        from baseten_loops_cli.training.evaluation import evaluate_final

        evaluate_final(session, record, sink)
    return "completed"
