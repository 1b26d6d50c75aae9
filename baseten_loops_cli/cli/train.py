"""`loops train`: write, check and run YAML-defined training loops (every kind of the registry); resume and plot them."""

from pathlib import Path
from typing import Annotated, Optional

import typer

from baseten_loops_cli.cli import _help, train_samples
from baseten_loops_cli.cli._state import get_state

app = typer.Typer(
    help=f"Run YAML-defined training loops ({_help.kinds_text()}) on Baseten or the local backend.",
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
        + (f"-{human_duration(plan.est_range[1])} (busy machine: see the note)" if plan.est_range else "")
        + (f", estimated cost: ${plan.est_cost_usd:,.2f}" if plan.est_cost_usd is not None else ""),
    ]
    lines += [f"  note: {n}" for n in plan.notes]
    return lines


@app.command("init")
def init(
    ctx: typer.Context,
    kind: Annotated[str, typer.Option("--kind", help=f"{_help.kinds_text()}.")] = "sft",
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

      loops train init --kind kto -O my-kto.yaml
    """
    from baseten_loops_cli.errors import UsageError
    from baseten_loops_cli.training import kinds
    from baseten_loops_cli.training.templates import template

    state = get_state(ctx)
    if kind not in kinds.names():
        raise UsageError(f"--kind must be {kinds.names_text()}, not {kind!r}")
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
        + (" (run deactivated; checkpoints kept)" if summary.deactivated else "")
        + (f"\n{summary.judge_line()}" if summary.judge is not None else ""),
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
    run_dir: Annotated[Path, typer.Argument(help="The run directory of an interrupted run, or a sweep folder.")],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask before provisioning remote capacity.")] = False,
    keep_run: Annotated[bool, typer.Option("--keep-run", help="Leave the run active when training ends.")] = False,
) -> None:
    """Continue an interrupted run (or finish a sweep) from its last checkpoint: no step repeated or skipped.

    Given a sweep folder, it starts the sweep's runs that never started and resumes those that
    stopped or failed; completed runs are left as they are, so each run trains exactly once.

    A run that `loops train run` deactivated when it stopped cannot take more steps, so training
    continues in a new run from the saved state; the output says so, state.json lists the earlier
    runs under resumed_from, and `loops runs describe` shows "Resumed From".

    Examples:

      loops train resume runs/tiny-sft-20261203-091500

      loops train resume runs/sweep-tiny-sft-20261204-101500
    """
    from baseten_loops_cli.training import service
    from baseten_loops_cli.training.experiments.rundir import is_sweep_dir

    state = get_state(ctx)
    out = state.output
    if is_sweep_dir(run_dir):
        _resume_sweep(state, run_dir, yes=yes)
        return
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
    run_dirs: Annotated[list[Path], typer.Argument(help="One or more run directories or sweep folders (overlaid, one colour and legend entry each).")],
    metric: Annotated[Optional[list[str]], typer.Option("--metric", "-m", help="Metric(s) to plot (default: the kind's main metric: loss, or reward for RL).")] = None,
    out_file: Annotated[Optional[Path], typer.Option("--out", help="Write a PNG here (needs matplotlib).")] = None,
) -> None:
    """Draw runs' metric curves in the terminal, or to a PNG; several runs are overlaid.

    Examples:

      loops train plot runs/tiny-sft-20261203-091500

      loops train plot runs/tiny-sft-*/

      loops train plot runs/my-rl --metric reward --metric pass_rate --out curves.png
    """

    from baseten_loops_cli.errors import UsageError
    from baseten_loops_cli.training.experiments.rundir import RunRecord, run_dirs as expand

    state = get_state(ctx)
    records = []
    for run_dir in expand(run_dirs, started_only=True):
        record = RunRecord(run_dir)
        if not record.metrics:
            raise UsageError(f"{run_dir}: no metrics.jsonl records to plot", hint="Pass run directories of `loops train run`.")
        records.append(record)
    _plot(state, records, metric, out_file)


def _plot(state, records, metric, out_file) -> None:
    """Draw ``records`` (rundir.RunRecord) overlaid: `train plot` and `train compare --plot`."""
    import shutil

    from baseten_loops_cli.errors import UsageError
    from baseten_loops_cli.training.experiments.plot import plot_png, plot_terminal

    if not records:
        raise UsageError("no run has metrics to plot yet", hint="Plot runs that have taken a step.")
    runs = {r.label: r.metrics for r in records}
    from baseten_loops_cli.training.service import main_metric

    names = metric or [main_metric(records[0].kind)]
    available = sorted({n for r in records for n in r.numeric_names()})
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


def sweep_child_command(loops_args: list[str]):
    """A sweep point's process (training.experiments.sweep.ChildCommand): `loops train run CONFIG --set ...
    --run-dir DIR --yes`, or `loops train resume DIR --yes`, with ``loops_args`` (the global
    options that reach the same backend) and plain table output for its train.log."""
    import sys

    base = [sys.executable, "-m", "baseten_loops_cli", *loops_args, "--output", "table", "train"]

    def command(job) -> list[str]:
        if job.resume:
            return [*base, "resume", str(job.run_dir), "--yes"]
        return [*base, "run", str(job.config), *(a for o in job.overrides for a in ("--set", o)),
                "--run-dir", str(job.run_dir), "--yes"]

    return command


def _loops_args(state) -> list[str]:
    """The global options a sweep's run processes need to reach the same backend."""
    return ["--profile", state.profile] if state.profile else []


def _sweep_plan_lines(sweep, prepared, parallel: int, backend_desc: str) -> list[str]:
    from baseten_loops_cli.output.format import human_duration

    plans = [p.plan for p in prepared]
    config = prepared[0].loaded.config
    lines = [f"Sweep of {len(plans)} runs of {config.name!r} ({plans[0].title}) on {config.base_model}, "
             f"{backend_desc}, {parallel} at a time, into {sweep.path}:"]
    for point, plan in zip(sweep.points, plans):
        lines.append(f"  {point.name}: {plan.steps} steps, ~{plan.train_tokens:,} tokens"
                     + (f", ~{plan.sample_tokens:,} sampled" if plan.sample_tokens else "")
                     + f", {human_duration(plan.est_seconds)}"
                     + (f", ${plan.est_cost_usd:,.2f}" if plan.est_cost_usd is not None else ""))
    costs = [p.est_cost_usd for p in plans]
    seconds = sum(p.est_seconds or 0.0 for p in plans)
    lines.append(f"  total: {sum(p.steps for p in plans)} steps, ~{sum(p.train_tokens for p in plans):,} tokens trained"
                 + (f", ~{sum(p.sample_tokens for p in plans):,} sampled" if any(p.sample_tokens for p in plans) else ""))
    lines.append(f"  estimated time: {human_duration(seconds)} of training"
                 + (f" (~{human_duration(seconds / parallel)} with {parallel} at a time)" if parallel > 1 else "")
                 + (f", estimated cost: ${sum(costs):,.2f}" if all(c is not None for c in costs) else ""))
    lines += [f"  note: {n}" for n in dict.fromkeys(n for p in plans for n in p.notes)]
    return lines


def _sweep_rows(result):
    from baseten_loops_cli.training.experiments.rundir import RunRecord

    rows = []
    for outcome in result.outcomes:
        rundir = result.sweep.rundir(outcome.point)
        record = RunRecord(rundir.path) if rundir.exists() else None
        rows.append({"run": outcome.point.name, "run_dir": str(rundir.path), "status": outcome.status,
                     "steps": record.steps if record else 0, "params": outcome.point.params,
                     "error": outcome.error})
    return rows


def _run_sweep(state, sweep, parallel: int) -> None:
    """Train the sweep's runs and render how they ended: a table (or -o json|csv), exit 130 after
    Ctrl-C, exit 1 naming the failed runs."""
    from baseten_loops_cli.errors import LoopsError
    from baseten_loops_cli.training.experiments import sweep as sweeps

    out = state.output
    columns = [("RUN", "run"), ("STATUS", "status"), ("STEPS", "steps"), ("RUN DIR", "run_dir")]

    def render(result) -> None:
        rows = _sweep_rows(result)
        out.emit({"sweep_dir": str(sweep.path), "runs": rows}, rows=rows, columns=columns, id_key="run_dir")

    try:
        result = sweeps.run(sweep, parallel=parallel, command=sweep_child_command(_loops_args(state)), on_event=out.info)
    except sweeps.SweepInterrupted as stopped:
        render(stopped.result)
        raise
    render(result)
    if result.failed:
        names = ", ".join(o.point.name for o in result.failed)
        raise LoopsError(f"{len(result.failed)} of {len(result.outcomes)} runs failed: {names}",
                         hint=f"Each run's output is in its {sweeps.LOG_NAME}; retry them with "
                              f"`loops train resume {sweep.path}`.")
    out.success(f"Done: {len(result.outcomes)} runs in {sweep.path}. Compare them: loops train compare {sweep.path}")


def _resume_sweep(state, sweep_dir: Path, *, yes: bool) -> None:
    from baseten_loops_cli.training import service
    from baseten_loops_cli.training.experiments import sweep as sweeps

    out = state.output
    sweep = sweeps.open_sweep(sweep_dir)
    loaded = sweeps.loaded_points(sweep)
    backend = state.backend(_profile_for(state, loaded[0]))
    left = [p for p in sweep.points if sweep.status(p) != "completed"]
    parallel = int(sweep.index.get("parallel") or 1)
    if backend.capabilities.billable and left:
        for line in _sweep_plan_lines(sweep, [service.prepare(one, sweep.rundir(p), backend) for p, one in zip(sweep.points, loaded)],
                                      parallel, f"profile {backend.profile_name!r} ({backend.base_url})"):
            out.note(line)
        out.confirm(f"Resume {len(left)} runs on {backend.base_url} (may provision new runs)?", yes=yes)
    _run_sweep(state, sweep, parallel)


@app.command("sweep")
def sweep(
    ctx: typer.Context,
    config: Annotated[Path, typer.Argument(help="The YAML config.")],
    grid: Annotated[Optional[list[str]], typer.Option("--grid", help="key.path=v1,v2: sweep these values (repeatable; the product is run).")] = None,
    overrides: SetOpt = None,
    random_n: Annotated[Optional[int], typer.Option("--random", help="Run N points drawn at random from the grid instead of all.")] = None,
    seed: Annotated[Optional[int], typer.Option("--seed", help="The seed of --random's draw (default 0).")] = None,
    parallel: Annotated[Optional[int], typer.Option("--parallel", help="Runs at a time (default: 1 locally, all of them on a billable backend).")] = None,
    max_runs: Annotated[Optional[int], typer.Option("--max-runs", help="Refuse a sweep of more runs than this (default 64).")] = None,
    sweep_dir: Annotated[Optional[Path], typer.Option("--sweep-dir", help="The sweep folder (default runs/sweep-NAME-TIME); one run directory per point inside.")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Check and show the summed plan; provision nothing.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask before provisioning remote capacity.")] = False,
) -> None:
    """Train one config at every point of a grid of --set values, each in its own run directory.

    The runs go under one sweep folder with a sweep.json index; each is a `loops train run`
    process of its own, its output in RUN_DIR/train.log. Without --grid, the config's `sweep:`
    block says what to vary. One confirmation on a billable backend shows the summed plan and
    cost. Ctrl-C stops every run after its step in flight (exit 130); `loops train resume
    SWEEP_DIR` finishes what is left, each run exactly once. A failed run does not stop the
    others: the sweep exits 1 naming it.

    Examples:

      loops train sweep examples/tiny-sft.yaml --grid optimizer.learning_rate=1e-3,3e-3 --grid lora_rank=4,16

      loops train sweep my.yaml --grid seed=0,1,2,3 --grid batch_size=8,16 --random 4 --seed 7

      loops train sweep my.yaml --grid optimizer.learning_rate=1e-4,3e-4 --parallel 2 --yes
    """
    from baseten_loops_cli.training.experiments import sweep as sweeps

    state = get_state(ctx)
    out = state.output
    plan = sweeps.plan_sweep(config, list(overrides or []), grid or [], random_n=random_n, seed=seed, max_runs=max_runs,
                             parallel=parallel, sweep_dir=sweep_dir,
                             open_backend=lambda loaded: state.backend(_profile_for(state, loaded)))
    backend, target, points, at_once = plan.backend, plan.path, plan.points, plan.parallel
    desc = f"profile {backend.profile_name!r} ({backend.base_url})"
    lines = _sweep_plan_lines(sweeps.Sweep(target, {}, points), plan.prepared, at_once, desc)
    if dry_run:
        out.report({"dry_run": True, "sweep_dir": str(target), "parallel": at_once,
                    "runs": [{"run": p.name, "params": p.params, "plan": pr.plan.as_dict()} for p, pr in zip(points, plan.prepared)]},
                   id_key="sweep_dir", lines=[*lines, f"Dry run: nothing provisioned (sweep folder would be {target})."])
        return
    for line in lines:
        out.note(line)
    if backend.capabilities.billable:
        config_of = plan.prepared[0].loaded.config
        out.confirm(f"Provision {len(points)} {config_of.base_model} runs on {backend.base_url}, {at_once} at a time?", yes=yes)
    _run_sweep(state, plan.create(), at_once)


@app.command("compare")
def compare(
    ctx: typer.Context,
    run_dirs: Annotated[list[Path], typer.Argument(help="Run directories and/or sweep folders.")],
    sort: Annotated[Optional[str], typer.Option("--sort", help="Sort by this column, best first (e.g. final_loss, best_eval_loss, wall_s).")] = None,
    plot_metric: Annotated[Optional[list[str]], typer.Option("--plot", help="Also draw this metric of every run, overlaid (repeatable).")] = None,
    out_file: Annotated[Optional[Path], typer.Option("--out", help="With --plot: write a PNG here (needs matplotlib).")] = None,
) -> None:
    """Compare runs side by side: one row per run, the best value of each column marked (*).

    Columns: the config keys that differ between the runs, steps, the final and best value of
    the train metric and of each eval metric, the `eval:` table's figures (eval.json), wall
    time, tokens and cost (from the config's pricing.*). -o json and -o csv give the same rows
    and a "best" list per row.

    Examples:

      loops train compare runs/sweep-tiny-sft-20261204-101500

      loops train compare runs/a runs/b --sort best_eval_loss -o csv > runs.csv

      loops train compare runs/sweep-x --plot loss --out loss.png
    """
    from baseten_loops_cli.errors import UsageError
    from baseten_loops_cli.training import kinds
    from baseten_loops_cli.training.experiments.compare import compare as compare_runs
    from baseten_loops_cli.training.experiments.rundir import RunRecord, run_dirs as expand

    state = get_state(ctx)
    out = state.output
    if out_file is not None and not plot_metric:
        raise UsageError("--out needs --plot METRIC", hint="e.g. loops train compare DIR --plot loss --out loss.png")
    records = [RunRecord(p) for p in expand(run_dirs, started_only=True)]
    if not records:
        raise UsageError(f"no run has started in {', '.join(map(str, run_dirs))}", hint="Start it with `loops train resume SWEEP_DIR`.")
    main_metrics = {name: kinds.get(name).main_metric for name in kinds.names()}
    result = compare_runs(records, main_metrics=main_metrics, sort=sort)

    def plain(column: str):
        return lambda row: row.get(column)  # a column name like optimizer.learning_rate is no path

    columns = [("run", "run"), ("status", "status"), *[(k, plain(k)) for k in result.key_columns], ("steps", "steps"),
               *[(c, plain(c)) for c in result.metric_columns if any(r.get(c) is not None for r in result.rows)],
               ("best", "best")]
    out.emit(result.as_dict(), rows=result.rows, columns=columns, id_key="run",
             marked=lambda row, column: column in row.get("best", ()),
             hint="* marks the best value of a column." if result.best else None)
    if plot_metric:
        _plot(state, records, plot_metric, out_file)


app.command("samples")(train_samples.samples)
