"""The part every `loops train init` template shares; each kind (training/kinds) writes the
rest around it (``Kind.template``)."""

from __future__ import annotations

COMMON = """\
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
# max_steps: 100                # train exactly this many steps (wins over epochs; cycles the data)
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


# The batch of the kinds that sample groups from prompts (rl, distill), after COMMON.
GROUPS = """\
batch_size: 8                   # unused: groups_per_batch sets the batch
group_size: 4                   # completions sampled per prompt
groups_per_batch: 8             # prompts per step
"""

def template(kind: str) -> str:
    """The commented config `loops train init --kind KIND` writes."""
    from baseten_loops_cli.training import kinds

    return kinds.get(kind).template()
