"""Reading an RL run's samples.jsonl: the rollouts of one step, or the worst ones (`loops train
samples`)."""

from __future__ import annotations

import json
from pathlib import Path

from baseten_loops_cli.errors import UsageError


def read_samples(run_dir: Path, *, step: int | None = None, worst: int | None = None) -> list[dict]:
    """The rollouts of ``step`` (default: the last step recorded), lowest reward first and cut to
    ``worst`` when given (failed rollouts count as the worst)."""
    path = Path(run_dir) / "samples.jsonl"
    if not path.is_file():
        raise UsageError(f"{run_dir}: no samples.jsonl", hint="Pass the run directory of an RL `loops train run`.")
    rows = []
    with path.open(encoding="utf-8") as handle:
        for line in handle:
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue  # a line cut by a kill: the rest are whole
    if not rows:
        raise UsageError(f"{path}: no samples yet")
    steps = sorted({int(r.get("step", 0)) for r in rows})
    chosen = steps[-1] if step is None else step
    if chosen not in steps:
        raise UsageError(f"{path}: no samples of step {chosen}", hint=f"Steps recorded: {steps[0]} to {steps[-1]}.")
    picked = [r for r in rows if int(r.get("step", 0)) == chosen]
    if worst is not None:
        picked = sorted(picked, key=lambda r: (not r.get("failed"), r.get("reward", 0.0)))[:worst]
    return picked


def sample_lines(record: dict) -> list[str]:
    """A rollout for people: its reward, then the transcript (each reply with its turn's reward)
    or the prompt and completion, then its failure."""
    head = f"{record.get('source') or ''} reward {record.get('reward', 0.0):.3f}".strip()
    if record.get("rewards"):
        head += " (" + ", ".join(f"{k} {v:.3f}" for k, v in record["rewards"].items()) + ")"
    if "turns" in record:
        head += f", {record['turns']} turn{'s' if record['turns'] != 1 else ''}" + ("" if record.get("done") else ", not ended")
    lines = [head]
    if record.get("transcript"):
        for message in record["transcript"]:
            reward = f"  [reward {message['reward']:.3f}]" if "reward" in message else ""
            lines.append(f"  {message['role']}: {message['content']!r}{reward}")
    else:
        lines.append(f"  prompt: {record.get('prompt', '')!r}")
        lines.append(f"  completion: {record.get('completion', '')!r}")
    if record.get("failed"):
        lines.append(f"  FAILED: {record.get('error')}")
    return lines
