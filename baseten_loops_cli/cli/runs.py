"""`loops runs`: create, list, describe, follow the logs of, watch and deactivate Loops runs.

A run is a trainer (a LoRA adapter being trained on a base model) plus, usually, a paired
sampler serving its latest weights. Names, columns, messages and JSON shapes follow the Go
`baseten loops run` commands (loops-protocol.md §4.2): `runs list -o json` is `{"runs": [...]}`
of LoopsRun objects, `runs describe -o json` is the LoopsRun with `deployment`,
`latest_checkpoints` and `usage` added. The work is done by :mod:`baseten_loops_cli.services.runs`.
"""

import re
import time
from datetime import datetime, timezone
from typing import Annotated, Optional

import typer

from baseten_loops_cli.cli import _complete
from baseten_loops_cli.cli._args import YesOpt, id_argument
from baseten_loops_cli.cli._state import get_state

app = typer.Typer(
    help="Create, list, inspect, follow and deactivate Loops runs (a trainer plus its paired sampler).",
    no_args_is_help=True,
)

RunArg = Annotated[str, id_argument("Run id (see `loops runs list`).", _complete.complete_run)]

SORT_KEYS = ("created", "name", "base-model", "status")
LOG_LEVELS = ("debug", "info", "warning", "error")
MAX_LOG_WINDOW_S = 7 * 24 * 3600
DEFAULT_LOG_WINDOW_S = 30 * 60


def run_columns(org: bool, named: bool) -> list:
    cols: list = [("ID", "id")]
    if named:
        cols.append(("NAME", "name"))
    if org:
        cols.append(("OWNER", "user.email"))
    cols += [("BASE MODEL", "base_model"), ("STATUS", "status.name"), ("CREATED", "created_at")]
    return cols


def hidden_hint(hidden: int, what: str, *, recent: bool = False) -> str:
    """``N inactive runs hidden; pass --all to show them.``"""
    plural = hidden != 1
    older = "older " if recent else ""
    return f"{hidden} {older}{what}{'s' if plural else ''} hidden; pass --all to show {'them' if plural else 'it'}."


# ── create ────────────────────────────────────────────────────────────────────────────────


@app.command("create")
def create(
    ctx: typer.Context,
    base_model: Annotated[str, typer.Option("--base-model", "-m", help="Base model to train a LoRA adapter on (see `loops models`).", show_default=False, autocompletion=_complete.complete_model)],
    name: Annotated[Optional[str], typer.Option("--name", help="A name for the run (default: the base model).")] = None,
    lora_rank: Annotated[Optional[int], typer.Option("--lora-rank", min=1, help="LoRA rank (backend default: 64).")] = None,
    max_seq_len: Annotated[
        Optional[int], typer.Option("--max-seq-len", min=1, help="Longest example you will send (default: the model's maximum).")
    ] = None,
    replicas: Annotated[Optional[int], typer.Option("--replicas", min=1, help="Trainer data-parallel replicas.")] = None,
    from_checkpoint: Annotated[
        Optional[str],
        typer.Option(
            "--from",
            help="Start from this trainer checkpoint (bt://loops:RUN/weights/NAME, RUN:NAME or an id).",
            autocompletion=_complete.complete_checkpoint,
        ),
    ] = None,
    reuse_from: Annotated[
        Optional[str],
        typer.Option("--reuse-from", help="Reuse this earlier run's warm trainer and sampler (same base model).", autocompletion=_complete.complete_run),
    ] = None,
    wait: Annotated[bool, typer.Option("--wait", help="Wait until the trainer is running.")] = False,
) -> None:
    """Create a run: a trainer on BASE_MODEL plus its paired sampler.

    The trainer and sampler finish coming up in the background; --wait blocks until the trainer
    is running (exit 5 if it fails). Prints the run (-o json: the LoopsRun object).

    Examples:

      loops runs create --base-model Qwen/Qwen3-8B --name sft-v2

      loops runs create -m loops-local/tiny --lora-rank 8 --wait -q

      loops runs create -m Qwen/Qwen3-8B --from abc1234:step-400
    """
    from baseten_loops_cli.services.runs import CreateRun, create_run, trainer_deployment, wait_for_trainer

    state = get_state(ctx)
    out = state.output
    client = state.backend().client
    run = create_run(
        client,
        CreateRun(base_model=base_model, name=name, lora_rank=lora_rank, max_seq_len=max_seq_len, replicas=replicas,
                  from_checkpoint=from_checkpoint, reuse_from=reuse_from),
        on_status=out.info,
        on_warning=out.warn,
    )
    _complete.invalidate("runs")
    if wait:
        out.info(f"Created Loops run {run.id} for {base_model}. Waiting for its trainer...")
        try:
            run = wait_for_trainer(client, run, on_status=lambda status: out.info(f"Trainer {status}..."))
        except KeyboardInterrupt:
            out.info(f"Stopped waiting. Run {run.id} keeps coming up; follow it with `loops runs watch {run.id}`.")
            raise typer.Exit(130) from None
        out.success(f"Run {run.id} is ready.")
    else:
        out.success(f"Created Loops run {run.id} for {base_model}. The trainer and sampler finish coming up in the background.")
        out.hint(f"Follow it with `loops runs watch {run.id}`.")
    out.emit(run, fields=describe_fields(run, trainer_deployment(client, run.deployment_id), [], None, None))


# ── list ──────────────────────────────────────────────────────────────────────────────────


@app.command("list")
def list_runs(
    ctx: typer.Context,
    all_: Annotated[bool, typer.Option("--all", "-a", help="Every run, INACTIVE ones included.")] = False,
    org: Annotated[bool, typer.Option("--org", help="Runs of the whole organization (adds OWNER).")] = False,
    base_model: Annotated[Optional[str], typer.Option("--base-model", "-m", help="Only runs of this base model.")] = None,
    sort: Annotated[str, typer.Option("--sort", help=f"Sort by {', '.join(SORT_KEYS)}.")] = "created",
    reverse: Annotated[bool, typer.Option("--reverse", "-r", help="Reverse the order (default: newest first).")] = False,
    limit: Annotated[int, typer.Option("--limit", "-n", min=0, help="Show at most N runs (0 = all).")] = 0,
) -> None:
    """List your Loops runs, newest first: the active ones, or every run with --all.

    When none of your runs is active (`loops train run` deactivates its run when it ends), the runs created in the last 24 hours are listed instead, whatever their status, so the runs you just made show up. Whenever runs were left out, a hint on stderr says how many and names --all (in every output format; -q prints no hints).

    -o json prints {"runs": [...], "filter": ...} (LoopsRun objects, filtered and sorted, as `baseten loops run list` prints them; "filter" says which rule chose them: "active", "recent" (none active: the last 24 hours') or "all" (--all)); -q prints the ids.

    Examples:

      loops runs list

      loops runs list --all --org --sort base-model

      loops runs list -q --limit 1          # the newest active run's id
    """
    from baseten_loops_cli.errors import UsageError
    from baseten_loops_cli.services.runs import list_runs as list_service

    if sort not in SORT_KEYS:
        raise UsageError(f"--sort must be one of {', '.join(SORT_KEYS)}, got {sort!r}")
    state = get_state(ctx)
    out = state.output
    listing = list_service(
        state.backend().client, include_inactive=all_, base_model=base_model, org=org, sort=sort, reverse=reverse, limit=limit
    )
    runs = listing.runs
    empty = "No Loops runs found." if all_ else "No active Loops runs found. Pass --all to include inactive runs."
    if base_model:
        empty = empty.replace("runs found", f"runs of {base_model} found")
    if listing.recent:
        out.info("No active Loops runs; showing the ones created in the last 24 hours.")
    named = any(r.name and r.name != r.base_model for r in runs)
    out.emit(
        {"runs": runs, "filter": "all" if all_ else ("recent" if listing.recent else "active")},
        rows=runs,
        columns=run_columns(org, named),
        empty=empty,
        hint=f"Showing {len(runs)} of {listing.total} runs; pass --limit 0 to see all." if listing.total > len(runs) else None,
    )
    if runs and listing.hidden:
        out.hint(hidden_hint(listing.hidden, "inactive run", recent=listing.recent))

# ── describe ──────────────────────────────────────────────────────────────────────────────


def _resumed_from(name: str | None) -> str | None:
    """The run a `loops train resume` continued, from the suffix its run name carries."""
    import re

    match = re.search(r" \(resumed from ([A-Za-z0-9_-]+)\)$", name or "")
    return match.group(1) if match else None


def describe_fields(run, dep, checkpoints: list, usage: dict | None, policy_version: int | None) -> list:
    """The key/value view of a run (``runs create`` and ``runs describe``)."""
    from baseten_loops_cli.output.format import human_duration, human_size, human_time

    fields: list = [
        ("ID", "id"),
        ("Name", "name"),
        ("Base Model", "base_model"),
        ("Status", "status.name"),
        ("Owner", "user.email"),
        ("Session", "session_id"),
        ("Created", "created_at"),
        ("#Trainer", None),
        ("Deployment", lambda r: run.deployment_id or "serverless (none)"),
        ("Status", lambda r: dep.status_name if dep else None),
        ("Instance", lambda r: _instance_text(dep)),
        ("Base URL", "base_url"),
        ("LoRA Rank", "lora_rank"),
        ("Max Seq Len", "max_seq_len"),
        ("Step", lambda r: policy_version),
    ]
    if _resumed_from(run.name):
        fields.insert(2, ("Resumed From", lambda r: _resumed_from(run.name)))
    sampler = run.sampler
    fields.append(("#Sampler", None))
    if sampler:
        fields += [
            ("ID", lambda r: sampler.id),
            ("Status", lambda r: sampler.status_name),
            ("Model", lambda r: sampler.model_id or "serverless"),
            ("Deployment", lambda r: sampler.deployment_id),
            ("Base URL", lambda r: sampler.base_url),
            ("Policy Version", lambda r: sampler_version_text(sampler.policy_version, policy_version)),
        ]
    else:
        fields.append(("ID", lambda r: "none yet (created on the first sampling call)"))
    if usage:
        fields += [
            ("#Usage", None),
            ("Tokens Trained", lambda r: f"{usage.get('tokens_trained', 0):,}"),
            ("Tokens Sampled", lambda r: f"{usage.get('tokens_sampled', 0):,}"),
            ("Compute Time", lambda r: human_duration(usage.get("compute_seconds"))),
        ]
    if checkpoints:
        fields.append(("#Latest Checkpoints", None))
        for cp in checkpoints:
            created = human_time(cp.created_at) if cp.created_at else "-"
            text = f"{cp.target} · {human_size(cp.size_bytes)} · {created} · {cp.id}"
            fields.append((cp.checkpoint_id, lambda r, text=text: text))
    return [(label, key) if key is not None else (label, "id") for label, key in fields]


def sampler_version_text(sampler_version: int | None, trainer_step: int | None) -> str | None:
    """The sampler's policy version, and why it is behind the trainer when it is: a sampler
    serves what the run last *published* (``save_weights_for_sampler(bump_version=True)``);
    saving sampler weights as a checkpoint (SFT's ``final``) does not move it."""
    if sampler_version is None:
        return None
    if trainer_step is None or sampler_version >= trainer_step:
        return str(sampler_version)
    served = "the base model" if sampler_version == 0 else f"the weights published at step {sampler_version}"
    return (f"{sampler_version} (serves {served}; the trainer is at step {trainer_step}: "
            "sample one of the run's checkpoints for its trained weights)")


def _instance_text(dep) -> str | None:
    if not dep or not dep.instance_type:
        return None
    it = dep.instance_type
    name = it.name or it.id
    nodes = dep.node_count or 1
    gpus = (it.gpu_count or 0) * nodes
    if not name:
        return None
    if gpus:
        return f"{name} ({gpus} GPUs" + (f" across {nodes} nodes)" if nodes > 1 else ")")
    return name


@app.command("describe")
def describe(
    ctx: typer.Context,
    run_id: RunArg,
    checkpoints: Annotated[int, typer.Option("--checkpoints", min=0, help="How many of the latest checkpoints to show.")] = 5,
) -> None:
    """Show a run: trainer, paired sampler, deployment, latest checkpoints, tokens and time used.

    Tokens and compute time appear where the backend reports them (the local backend does).

    -o json prints the LoopsRun object with `deployment`, `policy_version`,
    `latest_checkpoints` and `usage` added.

    Examples:

      loops runs describe abc1234

      loops runs describe abc1234 -o json --jq .sampler.base_url
    """
    from baseten_loops_cli.services.runs import describe_run

    state = get_state(ctx)
    doc = describe_run(state.backend(), run_id, checkpoints=checkpoints)
    latest = doc.latest_checkpoints
    state.output.emit(
        doc,
        fields=describe_fields(doc, doc.deployment, latest, doc.usage, doc.policy_version),
        hint=f"{doc.checkpoint_count} checkpoints in all: loops checkpoints list --run-id {doc.id}"
        if doc.checkpoint_count > len(latest) else None,
    )


# ── logs ──────────────────────────────────────────────────────────────────────────────────

_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h|d)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> float:
    """Go-style durations (``90s``, ``1h30m``, ``2d``) -> seconds."""
    from baseten_loops_cli.errors import UsageError

    value = text.strip().replace(" ", "")
    pos = 0
    total = 0.0
    for m in _DURATION_RE.finditer(value):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _UNIT_S[m.group(2)]
        pos = m.end()
    if not value or pos != len(value):
        raise UsageError(f"invalid duration {text!r}", hint="Use e.g. 30s, 15m, 2h, 1h30m or 3d.")
    return total


def parse_when(text: str, flag: str) -> datetime:
    """ISO 8601 (``2026-01-02T10:00``, ``2026-01-02 10:00:00Z``); local time when no zone."""
    from baseten_loops_cli.errors import UsageError

    try:
        dt = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise UsageError(f"{flag}: invalid time {text!r}", hint="Use ISO 8601, e.g. 2026-01-02T10:00 or 2026-01-02T10:00:00Z.") from None
    if dt.tzinfo is None:
        dt = dt.astimezone()  # naive = local time
    return dt


def format_log(entry) -> str:
    """``[YYYY-MM-DD HH:MM:SS]: (replica) message`` (the Go CLI's line format; local time)."""
    from baseten_loops_cli.services.runs import log_ns

    when = datetime.fromtimestamp(log_ns(entry) / 1e9, tz=timezone.utc).astimezone().strftime("%Y-%m-%d %H:%M:%S")
    replica = f"({entry.replica}) " if entry.replica else ""
    prefix = f"{entry.level} " if entry.level and entry.level != "INFO" else ""
    return f"[{when}]: {replica}{prefix}{entry.message}"


def _print_log(out, entry) -> None:
    out.stream(entry, text=format_log(entry), quiet_text=entry.message)


def _log_window(tail: bool, since: str | None, start: str | None, end: str | None,
                min_level: str | None) -> tuple[float, float, str | None]:
    """(start, end) in epoch seconds and the minimum level, from the logs options."""
    from baseten_loops_cli.errors import UsageError

    if tail and (since or start or end):
        raise UsageError("--tail cannot be combined with --since, --start or --end", hint="--tail starts from the last 30 minutes.")
    if since and (start or end):
        raise UsageError("--since cannot be combined with --start or --end")
    level = None
    if min_level is not None:
        if min_level.lower() not in LOG_LEVELS:
            raise UsageError(f"--min-level must be one of {', '.join(LOG_LEVELS)}, got {min_level!r}",
                             hint=f"e.g. --min-level {LOG_LEVELS[-1]}")
        level = min_level.upper()
    now = time.time()
    end_s = parse_when(end, "--end").timestamp() if end else now
    if since:
        window = parse_duration(since)
        if window > MAX_LOG_WINDOW_S:
            raise UsageError(f"--since {since} is longer than 7 days", hint="Logs can be fetched 7 days at a time.")
        start_s = end_s - window
    elif start:
        start_s = parse_when(start, "--start").timestamp()
    else:
        start_s = end_s - DEFAULT_LOG_WINDOW_S
    if start_s > end_s:
        raise UsageError("--start is after --end")
    if end_s - start_s > MAX_LOG_WINDOW_S:
        raise UsageError("the log window is longer than 7 days", hint="Narrow --start/--end; logs are fetched 7 days at a time.")
    return start_s, end_s, level


@app.command("logs")
def logs(
    ctx: typer.Context,
    run_id: RunArg,
    sampler: Annotated[bool, typer.Option("--sampler", help="The paired sampler's logs instead of the trainer's.")] = False,
    tail: Annotated[bool, typer.Option("--tail", "-f", help="Keep printing new lines until the trainer stops (Ctrl-C stops following, not the run).")] = False,
    since: Annotated[Optional[str], typer.Option("--since", help="Window ending now: 30s, 15m, 2h, 1h30m, 3d (at most 7d).")] = None,
    start: Annotated[Optional[str], typer.Option("--start", help="Window start, ISO 8601 (local time unless a zone is given).")] = None,
    end: Annotated[Optional[str], typer.Option("--end", help="Window end, ISO 8601 (default: now).")] = None,
    limit: Annotated[int, typer.Option("--limit", "-n", min=0, help="At most N lines, the newest (0 = all).")] = 5000,
    min_level: Annotated[Optional[str], typer.Option("--min-level", help="debug, info, warning or error.")] = None,
) -> None:
    """Print a run's trainer logs (or its sampler's with --sampler), oldest first.

    The default window is the last 30 minutes. Lines look like
    `[2026-01-02 10:00:00]: (replica) message`; -o json prints {"logs": [...]}, -o jsonl one Log
    object per line (also while tailing).

    Examples:

      loops runs logs abc1234 --since 2h --min-level warning

      loops runs logs abc1234 --tail

      loops runs logs abc1234 --start 2026-01-02T09:00 --end 2026-01-02T10:00 -o jsonl
    """
    from baseten_loops_cli.services.resolve import get_run
    from baseten_loops_cli.services.runs import LogFollower, LogSource, fetch_logs

    start_s, end_s, level = _log_window(tail, since, start, end, min_level)
    state = get_state(ctx)
    out = state.output
    client = state.backend().client
    source = LogSource(client, get_run(client, run_id), sampler)
    entries = fetch_logs(source.page, int(start_s * 1000), int(end_s * 1000), 0 if tail else limit, level)
    if not tail:
        out.emit(
            {"logs": entries},
            rows=entries,
            id_key="message",
            text=[format_log(e) for e in entries],
            empty=f"No logs from {source.label} in this window.",
            empty_hint="Widen it with --since 1d, or lower --min-level.",
            hint=f"Showing the newest {limit} lines; pass --limit 0 for all of them." if limit and len(entries) >= limit else None,
        )
        return
    entries = entries[-100:]
    for entry in entries:
        _print_log(out, entry)
    follower = LogFollower(source, int(start_s * 1000), level, printed=entries)
    try:  # from the line that says so on, Ctrl-C stops the following
        out.hint(f"Following {source.label} (Ctrl-C stops following; the run keeps running)...")
        for entry in follower:
            _print_log(out, entry)
    except KeyboardInterrupt:
        out.info(f"Stopped following logs. Run {run_id} keeps running.")
        raise typer.Exit(130) from None
    out.info(f"The {'sampler' if sampler else 'trainer'} is {follower.end_status or 'gone'}; no more logs will come.")


# ── deactivate ────────────────────────────────────────────────────────────────────────────


@app.command("deactivate")
def deactivate(
    ctx: typer.Context,
    run_ids: Annotated[list[str], id_argument("Run ids.", _complete.complete_run)],
    yes: YesOpt = False,
) -> None:
    """Deactivate runs: stop their trainers and paired samplers. Saved checkpoints stay.

    Asks first (pass --yes in scripts; without a terminal and without --yes it exits 3).
    -o json prints one DeactivateLoopsRunResponse ({id, base_model, user}) per run, as a list.

    Examples:

      loops runs deactivate abc1234

      loops runs list -q | xargs loops runs deactivate --yes
    """
    from baseten_loops_cli.cli._deactivate import deactivate_command
    from baseten_loops_cli.services.runs import deactivate_runs

    def question(todo: list) -> str:
        if len(todo) == 1:
            run = todo[0]
            what = "its trainer and paired sampler" if run.sampler else "its trainer"
            return f"Deactivate Loops run {run.id} ({run.base_model})? This stops {what}; saved checkpoints stay available."
        return (f"Deactivate {len(todo)} Loops runs ({', '.join(r.id for r in todo)})? This stops their trainers "
                "and paired samplers; saved checkpoints stay available.")

    deactivate_command(ctx, run_ids, yes=yes, noun="run", deactivate_many=deactivate_runs, question=question,
                       skipped=lambda r: f"Loops run {r.id} is already {r.status_name or 'inactive'}; skipping it.",
                       done=lambda r: f"Deactivated Loops run {r.id}. Saved checkpoints remain accessible.")


# ── watch ─────────────────────────────────────────────────────────────────────────────────


@app.command("watch")
def watch(
    ctx: typer.Context,
    run_id: RunArg,
    exit_status: Annotated[bool, typer.Option("--exit-status", help="Exit 5 if the run's trainer fails.")] = False,
    interval: Annotated[float, typer.Option("--interval", "-i", min=0.2, help="Seconds between refreshes.")] = 3.0,
) -> None:
    """Watch a run's status, step and policy version live until it stops.

    Ends when the run is deactivated or its trainer stops. A failed (or preempted) trainer
    exits 5 with --exit-status. Ctrl-C stops watching (exit 130), never the run. -o jsonl
    prints one record per change.

    Examples:

      loops runs watch abc1234

      loops runs watch abc1234 --exit-status && echo "ended cleanly"
    """
    from baseten_loops_cli.errors import RunFailedError
    from baseten_loops_cli.services.runs import watch_run

    state = get_state(ctx)
    out = state.output
    snap = None
    try:
        with out.live() as live:
            for snap in watch_run(state.backend(), run_id, interval=interval):
                live.update(snap, f"{snap.run_id}: {snap.line()}")
    except KeyboardInterrupt:
        out.info(f"Stopped watching. Run {run_id} keeps running.")
        raise typer.Exit(130) from None
    assert snap is not None  # watch_run yields at least once
    if snap.failed:
        reason = snap.trainer_status_reason
        message = f"run {snap.run_id}'s trainer {snap.trainer_status}" + (f": {reason}" if reason else "")
        if exit_status:
            raise RunFailedError(message, hint=f"See its logs: loops runs logs {snap.run_id}")
        out.warn(message)
    elif snap.run_status != "ACTIVE":
        out.info(f"Run {snap.run_id} was deactivated.")
    else:
        out.info(f"Run {snap.run_id}'s trainer is {snap.trainer_status}.")
