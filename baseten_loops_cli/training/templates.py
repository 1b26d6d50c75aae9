"""Commented config templates written by `loops train init`."""

from __future__ import annotations

_COMMON = """\
name: {name}
base_model: loops-local/tiny   # or HuggingFaceTB/SmolLM2-135M-Instruct, or a Baseten model (Qwen/Qwen3-8B ...)
# profile: prod                 # backend profile; default: the active one (local when none is set up)
lora_rank: 16
max_seq_len: 512                # longest example, in tokens; validate checks every row against it
seed: 0                         # same seed + same data = same run (and the same resume)

optimizer:
  learning_rate: {lr}
  schedule: {schedule}          # constant | linear | cosine
  warmup_steps: 0
  # beta1: 0.9
  # beta2: 0.95
  # eps: 1.0e-8
  # weight_decay: 0.0
  # grad_clip_norm: 1.0         # 0 = off

epochs: 1
# max_steps: 100                # stop early
eval_every: 0                   # steps between evals (0 = only at the end)

checkpointing:
  save_every: 5                 # trainer state every N steps: the resume points
  # ttl_seconds: 604800
  keep_final: true

logging:
  # run_dir: runs/my-run        # relative to the working directory; default: runs/<name>-<time>; --run-dir wins
  # wandb_project: my-project   # when wandb is installed

# pricing:                      # optional: a cost line in the plan
#   usd_per_million_train_tokens: 1.0
#   usd_per_hour: 0.0
"""

SFT = """\
# loops SFT config. Check it with `loops train validate FILE`, run it with `loops train run FILE`.
kind: sft
""" + _COMMON + """
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

RL = """\
# loops RL config (GRPO-style group advantages). Check it with `loops train validate FILE`.
kind: rl
""" + _COMMON + """
batch_size: 8                   # unused by RL; groups_per_batch sets the batch
group_size: 4                   # completions sampled per prompt
groups_per_batch: 8             # prompts per step

data:
  prompts: data/prompts.jsonl   # JSONL: {{"prompt": "...", "answer": "..."}} (or "messages")
  # eval_prompts: data/eval_prompts.jsonl

reward: exact_match             # exact_match | numeric_match | contains | starts_with | regex | path/to/file.py:function
# reward:
#   fn: regex
#   pattern: "^ANSWER: \\\\d+$"

loss:
  name: importance_sampling     # importance_sampling | ppo | cispo | dro
  # config: {{clip_low_threshold: 0.8, clip_high_threshold: 1.2}}

sampling:
  max_tokens: 32
  temperature: 1.0

max_steps_off_policy: 0         # 0 = synchronous; N >= 1 = sample the next batch while training this one
# kl_penalty_coef: 0.0          # per-token KL penalty against the base model
# eval:                         # optional: when training ends, score the final checkpoint as `loops eval` does
#   base: true                  # also score the base model (eval.json + eval.txt in the run directory)
#   # data: data/eval.jsonl     # default: data.eval (SFT) or data.eval_prompts (RL)
"""

DPO = """\
# loops DPO config (preference pairs). Check it with `loops train validate FILE`.
kind: dpo
""" + _COMMON + """
batch_size: 8                   # preference pairs per step

data:
  train: data/pairs.jsonl       # JSONL: {{"prompt": "...", "chosen": "...", "rejected": "..."}}
  # eval: data/eval_pairs.jsonl #    or: {{"messages": [...], "chosen": "...", "rejected": "..."}}
  shuffle: true                 #    or: {{"chosen": [messages], "rejected": [messages]}}

beta: 0.1                       # how far the policy may move from the reference (higher = closer)
label_smoothing: 0.0            # assumed fraction of mislabelled pairs (conservative DPO)
reference: base                 # base | bt://loops:<run_id>/sampler_weights/<name> (e.g. your SFT run's final)
"""


def template(kind: str) -> str:
    if kind == "rl":
        return RL.format(name="my-rl", lr="4.0e-5", schedule="constant")
    if kind == "dpo":
        return DPO.format(name="my-dpo", lr="5.0e-5", schedule="linear")
    return SFT.format(name="my-sft", lr="2.0e-4", schedule="linear")
