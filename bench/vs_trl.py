#!/usr/bin/env python
"""loops against Hugging Face TRL on the same SFT work: tokens/s side by side.

    python bench/vs_trl.py [--quick] [--json] [--steps N] [--batch B] [--seq-len L]

One invocation runs both sides on SmolLM2-135M-Instruct with the same data (the same
token sequences, every token trained), LoRA rank 16 on every projection, AdamW with the same
hyperparameters and a constant learning rate, after a warm-up step on each side: loops
through ``loops``' own trainer client over HTTP against a private local server (its default
dtype policy, ``LOOPS_BENCH_DTYPE`` or auto), TRL's ``SFTTrainer`` in this process in each
configuration of bf16 on/off x ``padding_free`` on/off x gradient checkpointing on/off
(``--quick``: TRL's defaults and bf16 without checkpointing). The ratio is loops' tokens/s
over TRL's fastest configuration's (target >= 1.3, issue 33); both sides' first and last
losses are printed, since the same curve is the evidence of the same work.

Needs TRL (``pip install trl==1.16.0``, the bench extra; it keeps torch 2.13.0) and the
SmolLM2 wheel (tests/external.py). Not in issue 33's scope yet: DPO (pairs/s, reference
precomputed) and GRPO (s/step) side by side, and the model-FLOPs utilisation figure.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import sys
import tempfile
import time
from typing import Any

from _common import ROOT
from train_throughput import SMOLLM2, bench_env, bench_server, emit, load_local_model, make_batch, wire_data

TARGET = 1.3
RANK, ALPHA = 16, 32
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAM = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0,
        "grad_clip_norm": 1.0}


def loops_side(seqs: list[list[int]], steps: int) -> dict:
    from baseten_loops_cli.api.client import LoopsClient
    from baseten_loops_cli.workers.trainer import TrainerClient

    with bench_server() as server:
        api = LoopsClient(server.url, server.token)
        session = api.sessions.create()
        run = api.runs.create({"session_id": session.id, "base_model": SMOLLM2, "lora_rank": RANK,
                               "seed": 0})
        client = TrainerClient(run.base_url, api_key=server.token, run_id=run.id, base_model=SMOLLM2)
        data = wire_data(seqs)
        losses: list[float] = []

        def step() -> None:
            fb = client.forward_backward(data, "cross_entropy")
            client.optim_step(ADAM).result(timeout=900)
            losses.append(float(fb.result(timeout=900)["loss"]))

        try:
            step()  # warm-up: model load, first allocations
            started = time.monotonic()
            for _ in range(steps):
                step()
            elapsed = time.monotonic() - started
            compute = api.http.request_json("GET", "/v1/local/status").get("compute") or {}
        finally:
            client.close()
            api.close()
    return {"seconds": elapsed, "losses": losses, "dtype": compute.get("dtype")}


def trl_side(seqs: list[list[int]], steps: int, bf16: bool, padding_free: bool,
             checkpointing: bool) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from baseten_loops_cli.local.engine import model_zoo

    torch.manual_seed(0)
    marks: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            marks.append(time.monotonic())

    with tempfile.TemporaryDirectory(prefix="loops-vs-trl-") as out:
        config = SFTConfig(
            output_dir=out, per_device_train_batch_size=len(seqs), max_steps=steps + 1,
            learning_rate=ADAM["learning_rate"], lr_scheduler_type="constant", warmup_steps=0,
            adam_beta1=ADAM["beta1"], adam_beta2=ADAM["beta2"], adam_epsilon=ADAM["eps"],
            weight_decay=0.0, max_grad_norm=ADAM["grad_clip_norm"], optim="adamw_torch",
            logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, bf16=bf16,
            padding_free=padding_free, gradient_checkpointing=checkpointing, max_length=None,
            dataloader_num_workers=0, disable_tqdm=True, seed=0)
        trainer = SFTTrainer(
            model=load_local_model(SMOLLM2).requires_grad_(True), args=config,
            train_dataset=Dataset.from_dict({"input_ids": seqs}),
            processing_class=AutoTokenizer.from_pretrained(model_zoo.require_model_dir(SMOLLM2)),
            peft_config=LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                                   target_modules=MODULES, bias="none", task_type="CAUSAL_LM"),
            callbacks=[Clock()])
        with contextlib.redirect_stdout(sys.stderr):  # TRL prints its logs: stdout is the result's
            trainer.train()
        losses = [float(e["loss"]) for e in trainer.state.log_history if "loss" in e]
    return {"seconds": marks[-1] - marks[0], "losses": losses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, help="timed steps per side, after one warm-up step")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: one per core)")
    parser.add_argument("--quick", action="store_true", help="2 steps, two TRL configurations")
    parser.add_argument("--json", action="store_true", help="one JSON object for run_all.py")
    args = parser.parse_args()
    try:
        import trl  # noqa: F401
    except ImportError:
        raise SystemExit("bench/vs_trl.py needs TRL: pip install trl==1.16.0 (it keeps torch 2.13.0)")
    bench_env(args.threads or None)
    steps = args.steps or (2 if args.quick else 20)
    from baseten_loops_cli.local.engine.model_zoo import model_info

    seqs = make_batch(int(model_info(SMOLLM2).vocab_size), args.batch, args.seq_len)
    tokens = sum(len(s) - 1 for s in seqs)
    ours = loops_side(seqs, steps)
    configs = ([(True, False, True), (True, False, False)] if args.quick
               else list(itertools.product((False, True), repeat=3)))
    theirs = []
    for bf16, padding_free, checkpointing in configs:
        name = f"bf16={'on' if bf16 else 'off'} padding_free={'on' if padding_free else 'off'} " \
               f"checkpointing={'on' if checkpointing else 'off'}"
        try:
            theirs.append((name, trl_side(seqs, steps, bf16, padding_free, checkpointing)))
        except Exception as exc:  # a configuration TRL refuses here is reported, not fatal
            print(f"TRL {name}: not run ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})",
                  file=sys.stderr)
    if not theirs:
        raise SystemExit("no TRL configuration ran")
    rate = lambda side: tokens * (len(side["losses"]) - 1) / side["seconds"]  # noqa: E731
    best_name, best = max(theirs, key=lambda item: rate(item[1]))
    ratio = rate(ours) / rate(best)
    table = "; ".join(f"TRL {n}: {rate(s):.0f} tok/s, loss {s['losses'][0]:.4f}->{s['losses'][-1]:.4f}"
                      for n, s in theirs)
    detail = (f"SmolLM2 SFT, {args.batch} x <= {args.seq_len} tokens, LoRA r{RANK}, {steps} steps after "
              f"a warm-up: loops ({ours['dtype']}) {rate(ours):.0f} tok/s, loss "
              f"{ours['losses'][0]:.4f}->{ours['losses'][-1]:.4f}; fastest TRL ({best_name}) "
              f"{rate(best):.0f} tok/s; {table}")
    emit("vs_trl[SFT tokens/s, loops / TRL fastest]", ratio, TARGET, detail, args.json,
         {"value": round(rate(ours), 1), "unit": "tok/s"})


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
