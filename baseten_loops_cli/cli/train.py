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

# Paths inside a config that are resolved relative to the config file; the run directory keeps
# absolute ones so `loops train resume` works from anywhere.
def _absolute_raw(loaded) -> dict:
    import copy

    from baseten_loops_cli.training.config import DATA_PATH_KEYS
    from baseten_loops_cli.training.formats.spec import absolute_sources

    raw = copy.deepcopy(loaded.raw)
    for section, key in DATA_PATH_KEYS:
        value = raw[section].get(key) if isinstance(raw.get(section), dict) else None
        if value is not None:
            raw[section][key] = absolute_sources(value, loaded.resolve_path)
    if loaded.config.base_model != raw.get("base_model") and Path(loaded.config.base_model).is_absolute():
        raw["base_model"] = loaded.config.base_model  # a model folder, made absolute by load_config
    reward = raw.get("reward")
    fn = reward if isinstance(reward, str) else (reward or {}).get("fn") if isinstance(reward, dict) else None
    if isinstance(fn, str) and ":" in fn and fn.split(":", 1)[0].endswith(".py"):
        file_part, func = fn.rsplit(":", 1)
        absolute = f"{loaded.resolve_path(file_part).resolve()}:{func}"
        if isinstance(reward, str):
            raw["reward"] = absolute
        else:
            raw["reward"]["fn"] = absolute
    return raw


def _load_config(config: Path, overrides: list[str] | None):
    from baseten_loops_cli.training.config import load_config

    return load_config(config, overrides or [], check_files=True)


def _load_data(loaded):
    from baseten_loops_cli.training.plan import load_data

    return load_data(loaded)


def _check_reference(client, loaded) -> None:
    """DPO with a checkpoint reference: it must exist (checked before anything is provisioned)."""
    if loaded.config.kind == "dpo":
        from baseten_loops_cli.training.dpo import check_reference

        check_reference(client, loaded)


def _profile_for(state, loaded) -> str | None:
    # --profile on the command line > the config's `profile` > LOOPS_PROFILE > the active one.
    return state.profile or loaded.config.profile


def _plan_lines(plan, loaded, backend_desc: str) -> list[str]:
    from baseten_loops_cli.output.format import human_duration

    config = loaded.config
    lines = [
        f"Plan for {config.name!r} ({config.kind.upper()}) on {config.base_model}, {backend_desc}:",
        f"  {plan.examples} {({'rl': 'prompts', 'dpo': 'pairs'}).get(config.kind, 'examples')}"
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
    kind: Annotated[str, typer.Option("--kind", help="sft, rl or dpo.")] = "sft",
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
    from baseten_loops_cli.training.templates import template

    state = get_state(ctx)
    if kind not in ("sft", "rl", "dpo"):
        raise UsageError(f"--kind must be sft, rl or dpo, not {kind!r}")
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
    from baseten_loops_cli.training.plan import check_base_model, make_plan

    state = get_state(ctx)
    out = state.output
    loaded = _load_config(config, overrides)
    kind, backend_desc, notes = "local", "local backend", []
    if not offline:
        from baseten_loops_cli.cli._backend import open_backend_if_reachable

        backend = open_backend_if_reachable(_profile_for(state, loaded))
        if backend is None:
            notes.append("base model not checked: the backend is not running (start it with `loops server start`)")
        else:
            kind = backend.kind
            backend_desc = f"profile {backend.profile_name!r} ({backend.base_url})"
            from baseten_loops_cli.api.errors import ConnectionFailedError

            try:
                notes += check_base_model(backend.client, loaded)
                _check_reference(backend.client, loaded)
            except ConnectionFailedError:
                notes.append(f"base model not checked: {backend.base_url} is not reachable")
            finally:
                backend.close()
    data = _load_data(loaded)
    plan = make_plan(loaded, data, kind)
    plan.notes += notes
    out.report({"config": str(config), "valid": True, "plan": plan.as_dict()}, id_key="config",
               lines=_plan_lines(plan, loaded, backend_desc), done=f"{config}: OK")


def _reporter(state):
    from baseten_loops_cli.training.display import LiveReporter, PlainReporter

    out = state.output
    if out.animate:
        return LiveReporter(out.err_console)
    return PlainReporter(jsonl=out.format == "jsonl", quiet=out.quiet, out=out.streams.stdout, err=out.streams.stderr)


def _execute(state, backend, loaded, data, rundir, *, resume: bool, keep_run: bool) -> None:
    """Connect, train, and leave the run directory and the backend in a clean state.

    Whatever ends the loop (done, Ctrl-C, a broken reward, a backend error, a bug), state.json
    says so and a run this command created is deactivated unless --keep-run: no idle capacity
    is left billing.
    """
    from baseten_loops_cli.errors import InterruptedByUser, LoopsError
    from baseten_loops_cli.training.config import DPOConfig, RLConfig
    from baseten_loops_cli.training.metrics import MetricsSink, open_wandb
    from baseten_loops_cli.training.rewards import RewardError
    from baseten_loops_cli.training.session import StopRequested, open_session, save_checkpoint

    out = state.output
    resume_cmd = f"loops train resume {rundir.path}"
    session = None
    sink = None

    def finish(status: str, **fields) -> None:
        rundir.update_state(status=status, **fields)
        if sink is not None:
            sink.close()
        if session is not None:
            session.close(deactivate=session.created_run and not keep_run)
            # `status` is how training ended (completed, interrupted, failed); `run_status` is
            # the run's own status on the backend, in the backend's words (what `loops runs
            # list` shows: ACTIVE, INACTIVE, ...), read back rather than assumed.
            try:
                rundir.update_state(run_status=session.client.runs.get(session.run_id).status_name)
            except LoopsError:
                pass

    status = "failed"
    try:
        with StopRequested() as stop:
            # Inside StopRequested: a Ctrl-C while the run is being created still ends cleanly
            # (the loop sees the request before its first step, saves and stops).
            session = open_session(loaded, rundir, backend, resume=resume, announce=out.info)
            wandb, note = open_wandb(loaded.config, rundir, run_id=session.run_id, raw_config=loaded.raw)
            if note:
                out.info(note)
            sink = MetricsSink(rundir, _reporter(state), wandb=wandb)
            try:
                if isinstance(loaded.config, RLConfig):
                    from baseten_loops_cli.training.rl import run_rl

                    status = run_rl(session, data.train, data.eval, data.tokenizer, data.reward, sink, stop)
                elif isinstance(loaded.config, DPOConfig):
                    from baseten_loops_cli.training.dpo import run_dpo

                    status = run_dpo(session, data.train, data.eval, sink, stop)
                else:
                    from baseten_loops_cli.training.sft import run_sft

                    status = run_sft(session, data.train, data.eval, sink, stop)
            except RewardError:
                # The run stops on a broken reward, but keeps what it learned so far: the
                # trainer is at the last step recorded in metrics.jsonl.
                done = [int(r.get("step", 0)) for r in rundir.metrics() if not r.get("final")]
                step = max([int(rundir.read_state().get("step", 0))] + done)
                try:
                    save_checkpoint(session, step)
                except LoopsError:
                    pass
                raise
    except KeyboardInterrupt:
        finish("interrupted")
        out.summary(_summary(rundir, session.run_id if session else rundir.read_state().get("run_id"),
                             loaded.config.kind, "interrupted"), id_key="run_id")
        raise InterruptedByUser("interrupted before the step finished", hint=f"Resume with `{resume_cmd}`.") from None
    except LoopsError as exc:
        finish("failed", error=exc.message)
        exc.hint = (exc.hint + " " if exc.hint else "") + f"Resume with `{resume_cmd}`."
        raise
    except BaseException as exc:
        finish("failed", error=f"{type(exc).__name__}: {exc}")
        raise
    deactivate = session.created_run and not keep_run
    finish(status)
    summary = _summary(rundir, session.run_id, loaded.config.kind, status)
    if status == "interrupted":
        out.summary(summary, id_key="run_id")  # scripts get the summary of a stopped run too (then exit 130)
        raise InterruptedByUser("stopped after the step in flight; state saved", hint=f"Resume with `{resume_cmd}`.")
    out.summary(
        summary,
        id_key="run_id",
        done=f"Done: run {session.run_id}, {summary['steps']} steps. Run directory: {rundir.path}"
        + ("" if not deactivate else " (run deactivated; checkpoints kept)"),
        hint=f"Try it: loops sample {summary['final_checkpoint']} --chat --prompt 'Hello'" if summary.get("final_checkpoint") else None,
    )


def _summary(rundir, run_id: str | None, kind: str, status: str) -> dict:
    """What `train run|resume -o json` prints when training ends: ``status`` is state.json's
    (``completed``, or ``interrupted`` by Ctrl-C: then `loops train resume RUN_DIR` continues)."""
    metrics = [r for r in rundir.metrics() if not r.get("final")]
    main = "reward" if kind == "rl" else "loss"
    values = [r[main] for r in metrics if isinstance(r.get(main), (int, float))]
    last_ckpt = rundir.last_checkpoint() or {}
    return {
        "run_id": run_id,
        "run_dir": str(rundir.path),
        "status": status,
        "steps": metrics[-1]["step"] if metrics else 0,
        f"first_{main}": values[0] if values else None,
        f"last_{main}": values[-1] if values else None,
        "final_checkpoint": last_ckpt.get("sampler_path") or last_ckpt.get("path"),
    }


def _default_run_dir(name: str) -> Path:
    import re
    import time

    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-") or "run"
    return Path("runs") / f"{slug}-{time.strftime('%Y%m%d-%H%M%S')}"


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

    from baseten_loops_cli.errors import UsageError
    from baseten_loops_cli.training.plan import check_base_model, make_plan
    from baseten_loops_cli.training.rundir import RunDir

    started = time.monotonic()
    state = get_state(ctx)
    out = state.output
    loaded = _load_config(config, overrides)
    if run_dir is None and loaded.config.logging.run_dir:
        run_dir = Path(loaded.config.logging.run_dir).expanduser()  # relative to the working directory
    rundir = RunDir(run_dir or _default_run_dir(loaded.config.name))
    if rundir.exists():
        raise UsageError(
            f"{rundir.path} already holds a run",
            hint=f"Resume it with `loops train resume {rundir.path}`, or pass another --run-dir.",
        )
    rundir.check_target()
    backend = state.backend(_profile_for(state, loaded))
    check_base_model(backend.client, loaded)
    _check_reference(backend.client, loaded)
    data = _load_data(loaded)
    plan = make_plan(loaded, data, backend.kind)
    desc = f"profile {backend.profile_name!r} ({backend.base_url})"
    if dry_run:
        out.report({"dry_run": True, "run_dir": str(rundir.path), "plan": plan.as_dict()}, id_key="kind",
                   lines=[*_plan_lines(plan, loaded, desc),
                          f"Dry run: nothing provisioned (run directory would be {rundir.path})."])
        return
    for line in _plan_lines(plan, loaded, desc):
        out.note(line)
    if backend.kind != "local":
        out.confirm(f"Provision a {loaded.config.base_model} run on {backend.base_url}?", yes=yes)
    rundir.create(_absolute_raw(loaded), loaded.path)
    out.info(f"Run directory: {rundir.path}")
    _execute(state, backend, loaded, data, rundir, resume=False, keep_run=keep_run)
    if backend.kind == "local":
        # The next plan of this model on this machine is calibrated by this run's measured speed.
        from baseten_loops_cli.training import calibration

        step_seconds = sum(float(r.get("step_time_s") or 0.0) for r in rundir.metrics() if not r.get("final"))
        calibration.record(loaded.config.kind, loaded.config.base_model, seconds=time.monotonic() - started,
                           step_seconds=step_seconds, tokens=plan.train_tokens + plan.sample_tokens)


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
    from baseten_loops_cli.errors import UsageError
    from baseten_loops_cli.training.config import load_config
    from baseten_loops_cli.training.plan import load_data
    from baseten_loops_cli.training.rundir import RunDir

    state = get_state(ctx)
    out = state.output
    rundir = RunDir(run_dir)
    if not rundir.exists():
        what = "no state.json" if run_dir.is_dir() else ("a file" if run_dir.exists() else "no such folder")
        raise UsageError(f"{run_dir} is not a run directory ({what})", hint="Pass the --run-dir of `loops train run`.")
    previous = rundir.read_state()
    loaded = load_config(rundir.config_file)
    if previous.get("status") == "completed":
        out.info(f"{run_dir}: already completed ({previous.get('step')} steps); nothing to resume.")
        out.summary(_summary(rundir, previous.get("run_id"), loaded.config.kind, "completed"), id_key="run_id")
        return
    backend = state.backend(_profile_for(state, loaded))
    data = load_data(loaded)
    if backend.kind != "local":
        out.confirm(f"Resume on {backend.base_url} (may provision a new run)?", yes=yes)
    _execute(state, backend, loaded, data, rundir, resume=True, keep_run=keep_run)


@app.command("plot")
def plot(
    ctx: typer.Context,
    run_dirs: Annotated[list[Path], typer.Argument(help="One or more run directories (overlaid, one colour and legend entry each).")],
    metric: Annotated[Optional[list[str]], typer.Option("--metric", "-m", help="Metric(s) to plot (default: loss or reward).")] = None,
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
    from baseten_loops_cli.training.plot import plot_png, plot_terminal
    from baseten_loops_cli.training.rundir import RunDir

    state = get_state(ctx)
    runs: dict[str, list[dict]] = {}
    for run_dir in run_dirs:
        records = [r for r in RunDir(run_dir).metrics() if not r.get("final")]
        if not records:
            raise UsageError(f"{run_dir}: no metrics.jsonl records to plot", hint="Pass run directories of `loops train run`.")
        runs[str(run_dir).rstrip("/") or str(run_dir)] = records
    first = next(iter(runs.values()))
    names = metric or (["reward"] if "reward" in first[0] else ["loss"])
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
