"""`loops train`: write, check and run YAML-defined SFT, RL and DPO loops; resume and plot them."""

from pathlib import Path
from typing import Annotated, Optional

import typer

from baseten_loops_cli.cli._state import get_state

app = typer.Typer(
    help="Run YAML-defined SFT, RL and DPO loops on Baseten or the local backend.",
    no_args_is_help=True,
)

SetOpt = Annotated[
    Optional[list[str]],
    typer.Option("--set", help="Override a config field: key.path=value (repeatable)."),
]


def _profile_for(state, loaded) -> str | None:
    # --profile on the command line > the config's `profile` > LOOPS_PROFILE > the active one.
    return state.profile or loaded.config.profile


def _plan_lines(plan, loaded, backend_desc: str) -> list[str]:
    from baseten_loops_cli.output.format import human_duration

    config = loaded.config
    lines = [
        f"Plan for {config.name!r} ({plan.title}) on {config.base_model}, {backend_desc}:",
        f"  {plan.examples} {plan.noun}"
        + (f" (+{plan.eval_examples} eval)" if plan.eval_examples else "")
        + f", {plan.steps} steps",
        f"  ~{plan.train_tokens:,} tokens trained" + (f", ~{plan.sample_tokens:,} sampled" if plan.sample_tokens else ""),
        f"  estimated time: {human_duration(plan.est_seconds)}"
        + (f", estimated cost: ${plan.est_cost_usd:,.2f}" if plan.est_cost_usd is not None else ""),
    ]
    lines += [f"  note: {n}" for n in plan.notes]
    return lines


@app.command("init")
def init(
    ctx: typer.Context,
    kind: Annotated[str, typer.Option("--kind", help="sft, rl, dpo or distill.")] = "sft",
    output_file: Annotated[
        Optional[Path], typer.Option("-O", "--output-file", help="Write here instead of stdout.")
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing file.")] = False,
) -> None:
    """Write a commented config template.

    Examples:

      loops train init --kind sft -O my-sft.yaml

      loops train init --kind rl > my-rl.yaml

      loops train init --kind dpo -O my-dpo.yaml
    """
    from baseten_loops_cli.errors import UsageError
    from baseten_loops_cli.training import kinds
    from baseten_loops_cli.training.templates import template

    state = get_state(ctx)
    if kind not in kinds.names():
        names = list(kinds.names())
        raise UsageError(f"--kind must be {', '.join(names[:-1])} or {names[-1]}, not {kind!r}")
    text = template(kind)
    if output_file is None:
        typer.echo(text, nl=False)
        return
    if output_file.exists() and not force:
        raise UsageError(f"{output_file} already exists", hint="Pass --force to overwrite it.")
    output_file.write_text(text, encoding="utf-8")
    state.output.success(f"Wrote {output_file}. Check it with `loops train validate {output_file}`.")


@app.command("validate")
def validate(
    ctx: typer.Context,
    config: Annotated[Path, typer.Argument(help="The YAML config.")],
    overrides: SetOpt = None,
    offline: Annotated[bool, typer.Option("--offline", help="Do not ask the backend about the base model.")] = False,
) -> None:
    """Check a config (schema, files, every row, token lengths, base model) and print its plan.

    Examples:

      loops train validate examples/tiny-sft.yaml

      loops train validate my.yaml --set batch_size=16 -o json
    """
    from baseten_loops_cli.training import service

    state = get_state(ctx)
    out = state.output
    loaded = service.load(config, overrides)
    backend, backend_desc = None, "local backend"
    if not offline:
        from baseten_loops_cli.cli._backend import open_backend_if_reachable

        backend = open_backend_if_reachable(_profile_for(state, loaded))
    try:
        if backend is not None:
            backend_desc = f"profile {backend.profile_name!r} ({backend.base_url})"
        plan = service.validate(loaded, backend, offline=offline)
    finally:
        if backend is not None:
            backend.close()
    out.report({"config": str(config), "valid": True, "plan": plan.as_dict()}, id_key="config",
               lines=_plan_lines(plan, loaded, backend_desc), done=f"{config}: OK")


def _train(out, start):
    """Run ``start(view, announce)`` (a service call) with the run's progress on the sink, and
    render how it ended; Ctrl-C prints the summary too (scripts get it), then exits 130."""
    from baseten_loops_cli.training.service import TrainingInterrupted

    try:
        summary = start(out.training_view(), out.info)
    except TrainingInterrupted as stopped:
        out.summary(stopped.summary.as_dict(), id_key="run_id")
        raise
    out.summary(
        summary.as_dict(),
        id_key="run_id",
        done=f"Done: run {summary.run_id}, {summary.steps} steps. Run directory: {summary.run_dir}"
        + (" (run deactivated; checkpoints kept)" if summary.deactivated else ""),
        hint=f"Try it: loops sample {summary.final_checkpoint} --chat --prompt 'Hello'" if summary.final_checkpoint else None,
    )


@app.command("run")
def run(
    ctx: typer.Context,
    config: Annotated[Path, typer.Argument(help="The YAML config.")],
    overrides: SetOpt = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Check and show the plan; provision nothing.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask before provisioning remote capacity.")] = False,
    run_dir: Annotated[Optional[Path], typer.Option("--run-dir", help="Where to write metrics and state (default: the config's logging.run_dir, else runs/NAME-TIME).")] = None,
    keep_run: Annotated[bool, typer.Option("--keep-run", help="Leave the run active when training ends.")] = False,
) -> None:
    """Validate, show the plan, confirm (remote backends), then train.

    Ctrl-C stops after the step in flight, saves state and prints the resume command (exit 130;
    -o json still prints the summary, with "status": "interrupted"). The run this command
    creates is deactivated at the end unless --keep-run.

    Examples:

      loops train run examples/tiny-sft.yaml --yes

      loops train run my.yaml --set optimizer.learning_rate=3e-4 --run-dir runs/lr3e-4

      loops train run my.yaml -o jsonl > metrics.jsonl
    """
    import time

    from baseten_loops_cli.training import service

    started = time.monotonic()
    state = get_state(ctx)
    out = state.output
    loaded = service.load(config, overrides)
    rundir = service.new_run_dir(loaded, run_dir)
    backend = state.backend(_profile_for(state, loaded))
    prepared = service.prepare(loaded, rundir, backend, started=started)
    desc = f"profile {backend.profile_name!r} ({backend.base_url})"
    if dry_run:
        out.report({"dry_run": True, "run_dir": str(rundir.path), "plan": prepared.plan.as_dict()}, id_key="kind",
                   lines=[*_plan_lines(prepared.plan, loaded, desc),
                          f"Dry run: nothing provisioned (run directory would be {rundir.path})."])
        return
    for line in _plan_lines(prepared.plan, loaded, desc):
        out.note(line)
    if backend.capabilities.billable:
        out.confirm(f"Provision a {loaded.config.base_model} run on {backend.base_url}?", yes=yes)
    _train(out, lambda view, announce: service.run(prepared, backend, view=view, announce=announce, keep_run=keep_run))


@app.command("resume")
def resume(
    ctx: typer.Context,
    run_dir: Annotated[Path, typer.Argument(help="The run directory of an interrupted run.")],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask before provisioning remote capacity.")] = False,
    keep_run: Annotated[bool, typer.Option("--keep-run", help="Leave the run active when training ends.")] = False,
) -> None:
    """Continue an interrupted run from its last checkpoint: no step repeated or skipped.

    A run that `loops train run` deactivated when it stopped cannot take more steps, so training
    continues in a new run from the saved state; the output says so, state.json lists the earlier
    runs under resumed_from, and `loops runs describe` shows "Resumed From".

    Examples:

      loops train resume runs/tiny-sft-20261203-091500
    """
    from baseten_loops_cli.training import service

    state = get_state(ctx)
    out = state.output
    target = service.open_run_dir(run_dir)
    if target.completed:
        out.info(f"{run_dir}: already completed ({target.state.get('step')} steps); nothing to resume.")
        summary = service.summary_of(target.rundir, target.state.get("run_id"), target.loaded.config.kind, "completed")
        out.summary(summary.as_dict(), id_key="run_id")
        return
    backend = state.backend(_profile_for(state, target.loaded))
    data = service.load_data(target.loaded)
    if backend.capabilities.billable:
        out.confirm(f"Resume on {backend.base_url} (may provision a new run)?", yes=yes)
    _train(out, lambda view, announce: service.resume(target, data, backend, view=view, announce=announce,
                                                      keep_run=keep_run))


@app.command("plot")
def plot(
    ctx: typer.Context,
    run_dirs: Annotated[list[Path], typer.Argument(help="One or more run directories (overlaid, one colour and legend entry each).")],
    metric: Annotated[Optional[list[str]], typer.Option("--metric", "-m", help="Metric(s) to plot (default: the kind's main metric: loss, or reward for RL).")] = None,
    out_file: Annotated[Optional[Path], typer.Option("--out", help="Write a PNG here (needs matplotlib).")] = None,
) -> None:
    """Draw runs' metric curves in the terminal, or to a PNG; several runs are overlaid.

    Examples:

      loops train plot runs/tiny-sft-20261203-091500

      loops train plot runs/tiny-sft-*/

      loops train plot runs/my-rl --metric reward --metric pass_rate --out curves.png
    """
    import shutil

    from baseten_loops_cli.errors import UsageError
    from baseten_loops_cli.training import service
    from baseten_loops_cli.training.plot import plot_png, plot_terminal
    from baseten_loops_cli.training.rundir import RunDir

    state = get_state(ctx)
    runs: dict[str, list[dict]] = {}
    for run_dir in run_dirs:
        records = [r for r in RunDir(run_dir).metrics() if not r.get("final")]
        if not records:
            raise UsageError(f"{run_dir}: no metrics.jsonl records to plot", hint="Pass run directories of `loops train run`.")
        runs[str(run_dir).rstrip("/") or str(run_dir)] = records
    names = metric or [service.main_metric_of(RunDir(run_dirs[0]))]
    available = sorted({k for rs in runs.values() for r in rs for k, v in r.items() if isinstance(v, (int, float)) and k != "step"})
    for name in names:
        if name not in available:
            raise UsageError(f"no metric {name!r} in {', '.join(runs)}", hint=f"Available: {', '.join(available)}.")
    if out_file is not None:
        plot_png(runs, names, out_file)
        state.output.success(f"Wrote {out_file}.")
        return
    color = state.output.streams.stdout_color
    width = max(40, min(120, shutil.get_terminal_size((80, 24)).columns - 2))
    typer.echo(plot_terminal(runs, names, width=width, color=color))
