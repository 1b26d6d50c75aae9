"""`loops reward`: check a config's reward or environment before a run."""

from pathlib import Path
from typing import Annotated, Optional

import typer

from baseten_loops_cli.cli._state import get_state

app = typer.Typer(help="Check an RL config's reward or environment before a run.", no_args_is_help=True)


@app.command("test")
def test(
    ctx: typer.Context,
    config: Annotated[Path, typer.Argument(help="The RL config (kind: rl, with reward: or env:).")],
    rows: Annotated[int, typer.Option("--rows", "-n", min=1, help="Score the first N data rows.")] = 4,
    overrides: Annotated[Optional[list[str]], typer.Option("--set", help="Override a config field: key.path=value (repeatable).")] = None,
) -> None:
    """Sample one reply (or play one episode) per row from the base model and print each score.

    The reward or environment runs exactly as in training (isolated, reward_timeout_s), so a
    reward that raises, hangs or returns a non-number shows up here with its traceback, before
    any capacity is provisioned for a run. Exit 1 when any row failed.

    Examples:

      loops reward test examples/tiny-rl.yaml

      loops reward test examples/tiny-guess.yaml --rows 2 -o json
    """
    from baseten_loops_cli.errors import LoopsError
    from baseten_loops_cli.training.reward_test import test_rewards
    from baseten_loops_cli.training import service
    from baseten_loops_cli.training.experiments.samples import sample_lines

    state = get_state(ctx)
    out = state.output
    loaded = service.load(config, overrides)
    backend = state.backend()
    results = test_rewards(backend, loaded, rows=rows,
                           on_started=lambda sampler_id, what: out.info(f"Started sampler {sampler_id} for {what}."))
    failed = [r for r in results if r.get("failed")]
    text = []
    for r in results:
        text += sample_lines(r)
        if r.get("failed") and r.get("traceback"):  # what the hint below points at
            text += ["  " + line for line in str(r["traceback"]).rstrip("\n").splitlines()]
    out.emit({"config": str(config), "rows": results}, text=text,
             hint=None if failed else "Every row scored; the reward runs as it will in training.")
    if failed:
        raise LoopsError(f"{len(failed)} of {len(results)} rows failed: {failed[0]['error']}",
                         hint="Each failed row's traceback is printed above, under its FAILED line (-o json: rows[].traceback).")
