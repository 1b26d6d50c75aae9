"""`loops train samples`: an RL run's rollouts (transcripts, per-turn rewards, failures)."""

from pathlib import Path
from typing import Annotated, Optional

import typer

from baseten_loops_cli.cli._state import get_state


def samples(
    ctx: typer.Context,
    run_dir: Annotated[Path, typer.Argument(help="The run directory of an RL `loops train run`.")],
    step: Annotated[Optional[int], typer.Option("--step", min=1, help="The step (default: the last one recorded).", show_default=False)] = None,
    worst: Annotated[Optional[int], typer.Option("--worst", min=1, help="Only the K lowest-reward rollouts (failed ones first).", show_default=False)] = None,
) -> None:
    """Show a step's rollouts from samples.jsonl: reward, transcript with per-turn rewards, failures.

    Examples:

      loops train samples runs/tiny-guess-20261204-101500

      loops train samples runs/my-rl --step 3 --worst 5

      loops train samples runs/my-rl -o json
    """
    from baseten_loops_cli.training.experiments.samples import read_samples, sample_lines

    records = read_samples(run_dir, step=step, worst=worst)
    get_state(ctx).output.emit(records, text=[line for r in records for line in sample_lines(r)])
