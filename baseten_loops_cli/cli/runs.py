"""`loops runs`: create, list, describe, follow the logs of, watch and deactivate Loops runs.

A run is a trainer (a LoRA adapter being trained on a base model) plus, usually, a paired
sampler serving its latest weights. Names, columns, messages and JSON shapes follow the Go
`baseten loops run` commands (loops-protocol.md §4.2): `runs list -o json` is `{"runs": [...]}`
of LoopsRun objects, `runs describe -o json` is the LoopsRun with `deployment`,
`latest_checkpoints` and `usage` added.
"""

from __future__ import annotations

import re
import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Annotated, Any, Callable, Optional

import typer

from baseten_loops_cli.cli import _complete
from baseten_loops_cli.cli._state import get_state

if TYPE_CHECKING:
    from baseten_loops_cli.output.sink import Output

app = typer.Typer(
    help="Create, list, inspect, follow and deactivate Loops runs (a trainer plus its paired sampler).",
    no_args_is_help=True,
)

RunArg = Annotated[
    str,
    typer.Argument(help="Run id (see `loops runs list`).", autocompletion=_complete.complete_run, show_default=False),
]

SORT_KEYS = ("created", "name", "base-model", "status")
LOG_LEVELS = ("debug", "info", "warning", "error")
MAX_LOG_WINDOW_S = 7 * 24 * 3600
DEFAULT_LOG_WINDOW_S = 30 * 60
LOG_PAGE_SIZE = 1000
TAIL_POLL_S = 2.0
STATUS_POLL_S = 5.0


# ── shared helpers ────────────────────────────────────────────────────────────────────────


def run_columns(org: bool, named: bool) -> list:
    from baseten_loops_cli.cli._resolve import status_name

    cols: list = [("ID", "id")]
    if named:
        cols.append(("NAME", "name"))
    if org:
        cols.append(("OWNER", "user.email"))
    cols += [("BASE MODEL", "base_model"), ("STATUS", lambda r: status_name(r)), ("CREATED", "created_at")]
    return cols


def _sort_runs(runs: list[dict], sort: str, reverse: bool) -> list[dict]:
    from baseten_loops_cli.cli._resolve import status_name

    keys: dict[str, Callable[[dict], Any]] = {
        "created": lambda r: r.get("created_at") or "",
        "name": lambda r: (r.get("name") or "").lower(),
        "base-model": lambda r: (r.get("base_model") or "").lower(),
        "status": lambda r: status_name(r) or "",
    }
    # Newest first by default (the Go CLI's --direction desc); names and models A→Z.
    descending = sort == "created"
    ordered = sorted(runs, key=lambda r: r.get("created_at") or "", reverse=True)
    ordered = sorted(ordered, key=keys[sort], reverse=descending)
    return list(reversed(ordered)) if reverse else ordered


def _deployment(client, deployment_id: str | None) -> dict | None:
    """The run's trainer deployment, or None (serverless runs have none; older backends may
    not know the route)."""
    from baseten_loops_cli.api.errors import ApiError
    from baseten_loops_cli.cli._resolve import as_dict

    if not deployment_id:
        return None
    try:
        return as_dict(client.deployments.get(deployment_id))
    except ApiError:
        return None


def _run_usage(backend, run_id: str) -> dict | None:
    """Tokens and compute the backend reports for a run (the local backend does), or None."""
    if backend.kind != "local":
        return None
    client = backend.client
    try:
        rows = client.local_usage(run_id=run_id)
    except Exception:  # noqa: BLE001 - a backend without the route reports nothing
        return None
    from baseten_loops_cli.cli._resolve import as_dict

    for row in as_dict(rows) or []:
        if row.get("owner_id") == run_id:
            return row
    return None


def _policy_version(client_state, run: dict) -> int | None:
    """The trainer's policy version (= optimizer steps): from the run when the backend reports
    it, else from a dedicated trainer's ``/policy_version``."""
    if isinstance(run.get("policy_version"), int):
        return run["policy_version"]
    if not run.get("deployment_id") or not run.get("base_url"):
        return None
    from baseten_loops_cli.errors import LoopsError
    from baseten_loops_cli.workers.trainer import TrainerClient

    backend = client_state.backend()
    try:
        with TrainerClient(
            run["base_url"], api_key=backend.api_key, run_id=run["id"], base_model=run.get("base_model")
        ) as tc:
            return tc.policy_version()
    except LoopsError:
        return None


def wait_for_trainer(out: "Output", client, run: dict, *, timeout: float | None = None, interval: float = 2.0) -> dict:
    """Poll until the run's trainer is RUNNING; :class:`RunFailedError` if it fails first."""
    from baseten_loops_cli.cli._resolve import TRAINER_FAILED, TRAINER_TERMINAL, get_run, status_name
    from baseten_loops_cli.errors import LoopsError, RunFailedError

    deadline = None if timeout is None else time.monotonic() + timeout
    last = None
    while True:
        run = get_run(client, run["id"])
        if status_name(run) != "ACTIVE":
            raise RunFailedError(f"run {run['id']} was deactivated while waiting for its trainer")
        dep = _deployment(client, run.get("deployment_id"))
        status = status_name(dep) if dep else None
        if status != last and status:
            out.info(f"Trainer {status}...")
            last = status
        if dep is None and not run.get("deployment_id"):
            return run  # serverless: nothing to provision
        if status in ("RUNNING", "SCALED_TO_ZERO"):
            return run
        if status in TRAINER_TERMINAL:
            reason = (dep or {}).get("status_reason")
            exc = RunFailedError if status in TRAINER_FAILED else LoopsError
            raise exc(
                f"run {run['id']}'s trainer is {status}" + (f": {reason}" if reason else ""),
                hint=f"See its logs: loops runs logs {run['id']}",
            )
        if deadline is not None and time.monotonic() > deadline:
            raise LoopsError(
                f"run {run['id']}'s trainer is still {status or 'starting'} after {timeout:.0f}s",
                hint=f"It keeps coming up in the background; check with `loops runs watch {run['id']}`.",
            )
        time.sleep(interval)


# ── create ────────────────────────────────────────────────────────────────────────────────


@app.command("create")
def create(
    ctx: typer.Context,
    base_model: Annotated[str, typer.Option("--base-model", "-m", help="Base model to train a LoRA adapter on.", show_default=False)],
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
    from baseten_loops_cli.cli._resolve import as_dict, get_run, resolve_checkpoint, uri_of
    from baseten_loops_cli.errors import UsageError

    state = get_state(ctx)
    out = state.output
    client = state.backend().client
    path = None
    if from_checkpoint:
        cp = resolve_checkpoint(client, from_checkpoint, prefer="trainer")
        if cp.get("target") != "trainer":
            raise UsageError(
                f"{from_checkpoint} holds sampler weights; --from needs trainer state (a weights/ checkpoint)",
                hint="Use a checkpoint saved with save_state; list them with "
                f"`loops checkpoints list --run-id {cp.get('run_id')} --target trainer`.",
            )
        if cp.get("base_model") and cp["base_model"] != base_model:
            raise UsageError(
                f"{from_checkpoint} was trained on {cp['base_model']}, not {base_model}",
                hint=f"Pass --base-model {cp['base_model']}.",
            )
        path = uri_of(cp)
        rank = (cp.get("lora_adapter_config") or {}).get("r")
        if isinstance(rank, int):
            if lora_rank is None:
                lora_rank = rank  # the run must match the checkpoint's adapter
            elif lora_rank != rank:
                raise UsageError(
                    f"{from_checkpoint} has LoRA rank {rank}, not {lora_rank}",
                    hint=f"Drop --lora-rank (it defaults to the checkpoint's) or pass --lora-rank {rank}.",
                )
    if reuse_from:
        prior = get_run(client, reuse_from)
        if prior.get("base_model") != base_model:
            raise UsageError(
                f"--reuse-from {reuse_from} runs {prior.get('base_model')}, not {base_model}",
                hint="Warm reuse needs the same base model.",
            )
        if replicas and replicas > 1:
            out.warn("--replicas > 1 always provisions fresh capacity; --reuse-from is ignored by the backend.")
    out.info(f"Provisioning Loops run and sampler for {base_model}...")
    session = client.sessions.create()
    request = {
        "session_id": session.id,
        "base_model": base_model,
        "name": name,
        "lora_rank": lora_rank,
        "max_seq_len": max_seq_len,
        "replicas": replicas,
        "path": path,
        "reuse_from_run_id": reuse_from,
    }
    run = as_dict(client.runs.create({k: v for k, v in request.items() if v is not None}))
    _complete.invalidate("runs")
    if wait:
        out.info(f"Created Loops run {run['id']} for {base_model}. Waiting for its trainer...")
        try:
            run = wait_for_trainer(out, client, run)
        except KeyboardInterrupt:
            out.info(f"Stopped waiting. Run {run['id']} keeps coming up; follow it with `loops runs watch {run['id']}`.")
            raise typer.Exit(130) from None
        out.success(f"Run {run['id']} is ready.")
    else:
        out.success(
            f"Created Loops run {run['id']} for {base_model}. "
            "The trainer and sampler finish coming up in the background."
        )
        out.hint(f"Follow it with `loops runs watch {run['id']}`.")
    if out.human:
        dep = _deployment(client, run.get("deployment_id"))
        out.emit(run, fields=_describe_fields(run, dep, [], None, None))
    else:
        out.emit(run)


# ── list ──────────────────────────────────────────────────────────────────────────────────


@app.command("list")
def list_runs(
    ctx: typer.Context,
    all_: Annotated[bool, typer.Option("--all", "-a", help="Include INACTIVE runs.")] = False,
    org: Annotated[bool, typer.Option("--org", help="Runs of the whole organization (adds OWNER).")] = False,
    base_model: Annotated[Optional[str], typer.Option("--base-model", "-m", help="Only runs of this base model.")] = None,
    sort: Annotated[str, typer.Option("--sort", help=f"Sort by {', '.join(SORT_KEYS)}.")] = "created",
    reverse: Annotated[bool, typer.Option("--reverse", "-r", help="Reverse the order (default: newest first).")] = False,
    limit: Annotated[int, typer.Option("--limit", "-n", min=0, help="Show at most N runs (0 = all).")] = 0,
) -> None:
    """List your Loops runs, newest first. INACTIVE runs are hidden unless --all.

    -o json prints {"runs": [...]} (LoopsRun objects, filtered and sorted), as `baseten loops
    run list` does; -q prints the ids.

    Examples:

      loops runs list

      loops runs list --all --org --sort base-model

      loops runs list -q --limit 1          # the newest active run's id
    """
    from baseten_loops_cli.cli._resolve import as_dict, status_name
    from baseten_loops_cli.errors import UsageError

    if sort not in SORT_KEYS:
        raise UsageError(f"--sort must be one of {', '.join(SORT_KEYS)}, got {sort!r}")
    state = get_state(ctx)
    out = state.output
    client = state.backend().client
    runs = as_dict(client.runs.list(base_model=base_model, scope="org" if org else None)) or []
    hidden = 0
    if not all_:
        shown = [r for r in runs if status_name(r) == "ACTIVE"]
        hidden = len(runs) - len(shown)
        runs = shown
    runs = _sort_runs(runs, sort, reverse)
    total = len(runs)
    if limit:
        runs = runs[:limit]
    named = any(r.get("name") and r.get("name") != r.get("base_model") for r in runs)
    if all_:
        empty = "No Loops runs found."
        empty_hint = None
    else:
        empty = "No active Loops runs found. Pass --all to include inactive runs."
        empty_hint = None
    if not runs and base_model:
        empty = empty.replace("runs found", f"runs of {base_model} found")
    out.emit({"runs": runs}, rows=runs, columns=run_columns(org, named), empty=empty, empty_hint=empty_hint)
    if out.human and runs:
        if total > len(runs):
            out.hint(f"Showing {len(runs)} of {total} runs; pass --limit 0 to see all.")
        if hidden:
            out.hint(f"{hidden} inactive run{'s' if hidden != 1 else ''} hidden; pass --all to show {'them' if hidden != 1 else 'it'}.")


# ── describe ──────────────────────────────────────────────────────────────────────────────


def _resumed_from(name: str | None) -> str | None:
    """The run a `loops train resume` continued, from the suffix its run name carries."""
    import re

    match = re.search(r" \(resumed from ([A-Za-z0-9_-]+)\)$", name or "")
    return match.group(1) if match else None


def _describe_fields(run: dict, dep: dict | None, checkpoints: list[dict], usage: dict | None, policy_version: int | None) -> list:
    from baseten_loops_cli.cli._resolve import status_name
    from baseten_loops_cli.output.format import human_duration, human_size, human_time

    fields: list = [
        ("ID", "id"),
        ("Name", "name"),
        ("Base Model", "base_model"),
        ("Status", lambda r: status_name(r)),
        ("Owner", "user.email"),
        ("Session", "session_id"),
        ("Created", "created_at"),
        ("#Trainer", None),
        ("Deployment", lambda r: r.get("deployment_id") or "serverless (none)"),
        ("Status", lambda r: status_name(dep) if dep else None),
        ("Instance", lambda r: _instance_text(dep) if dep else None),
        ("Base URL", "base_url"),
        ("LoRA Rank", lambda r: r.get("lora_rank")),
        ("Max Seq Len", lambda r: r.get("max_seq_len")),
        ("Step", lambda r: policy_version),
    ]
    if _resumed_from(run.get("name")):
        fields.insert(2, ("Resumed From", lambda r: _resumed_from(r.get("name"))))
    sampler = run.get("sampler")
    fields.append(("#Sampler", None))
    if sampler:
        fields += [
            ("ID", lambda r: sampler.get("id")),
            ("Status", lambda r: status_name(sampler)),
            ("Model", lambda r: sampler.get("model_id") or "serverless"),
            ("Deployment", lambda r: sampler.get("deployment_id")),
            ("Base URL", lambda r: sampler.get("base_url")),
            ("Policy Version", lambda r: sampler.get("policy_version")),
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
            text = f"{cp.get('target')} · {human_size(cp.get('size_bytes'))} · {human_time(cp.get('created_at') or '')} · {cp.get('id')}"
            fields.append((str(cp.get("checkpoint_id")), lambda r, text=text: text))
    return [(label, key) if key is not None else (label, "id") for label, key in fields]


def _instance_text(dep: dict | None) -> str | None:
    if not dep:
        return None
    it = dep.get("instance_type") or {}
    name = it.get("name") or it.get("id")
    nodes = dep.get("node_count") or 1
    gpus = (it.get("gpu_count") or 0) * nodes
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
    from baseten_loops_cli.cli._resolve import get_run, list_checkpoints

    state = get_state(ctx)
    out = state.output
    client = state.backend().client
    run = get_run(client, run_id)
    dep = _deployment(client, run.get("deployment_id"))
    cps = sorted(list_checkpoints(client, run_id=run["id"]), key=lambda c: c.get("created_at") or "", reverse=True)
    latest = cps[:checkpoints] if checkpoints else []
    usage = _run_usage(state.backend(), run["id"])
    version = _policy_version(state, run)
    doc = {**run, "deployment": dep, "policy_version": version, "latest_checkpoints": latest,
           "checkpoint_count": len(cps), "usage": usage}
    out.emit(doc, fields=_describe_fields(run, dep, latest, usage, version))
    if out.human and len(cps) > len(latest):
        out.hint(f"{len(cps)} checkpoints in all: loops checkpoints list --run-id {run['id']}")


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


def _log_key(entry: dict) -> tuple:
    return (str(entry.get("timestamp")), entry.get("replica"), entry.get("message"))


def _ts_ns(entry: dict) -> int:
    try:
        return int(entry.get("timestamp") or 0)
    except (TypeError, ValueError):
        return 0


def format_log(entry: dict) -> str:
    """``[YYYY-MM-DD HH:MM:SS]: (replica) message`` (the Go CLI's line format; local time)."""
    ns = _ts_ns(entry)
    when = datetime.fromtimestamp(ns / 1e9, tz=timezone.utc).astimezone().strftime("%Y-%m-%d %H:%M:%S")
    replica = f"({entry['replica']}) " if entry.get("replica") else ""
    level = entry.get("level")
    prefix = f"{level} " if level and level not in ("INFO",) else ""
    return f"[{when}]: {replica}{prefix}{entry.get('message', '')}"


def _log_source(client, run: dict, sampler: bool) -> tuple[Callable[..., list[dict]], str]:
    """A function fetching one page of logs for the run's trainer (or sampler), and a label."""
    from baseten_loops_cli.cli._resolve import as_dict
    from baseten_loops_cli.errors import LoopsError

    if sampler:
        s = run.get("sampler") or {}
        if not s:
            raise LoopsError(
                f"Loops run '{run['id']}' has no paired sampler to fetch logs from",
                hint="The sampler is created on the first sampling call.",
            )
        if not (s.get("model_id") and s.get("deployment_id")):
            raise LoopsError(f"Loops run '{run['id']}' has a serverless sampler; it has no logs to fetch")

        def fetch(**params: Any) -> list[dict]:
            return _logs_of(as_dict(client.models.logs(s["model_id"], s["deployment_id"], **params)))

        return fetch, f"sampler {s['id']}"
    if not run.get("deployment_id"):
        raise LoopsError(
            f"Loops run '{run['id']}' has no trainer logs to fetch",
            hint="Serverless runs have no trainer deployment; try --sampler.",
        )

    def fetch_trainer(**params: Any) -> list[dict]:
        return _logs_of(as_dict(client.deployments.logs(run["deployment_id"], **params)))

    return fetch_trainer, f"trainer deployment {run['deployment_id']}"


def _logs_of(page: Any) -> list[dict]:
    if isinstance(page, dict):
        return list(page.get("logs") or [])
    return list(page or [])


def fetch_logs(fetch: Callable[..., list[dict]], start_ms: int, end_ms: int, limit: int, min_level: str | None) -> list[dict]:
    """Up to ``limit`` (0 = all) log lines in [start, end], newest pages first, returned oldest
    first. Pages of at most 1000 walk backwards in time; duplicates at page edges are dropped."""
    seen: set = set()
    collected: list[dict] = []
    end = end_ms
    while True:
        want = LOG_PAGE_SIZE if not limit else min(LOG_PAGE_SIZE, limit - len(collected))
        if want <= 0:
            break
        page = fetch(start_epoch_millis=start_ms, end_epoch_millis=end, direction="desc", limit=want, min_level=min_level)
        fresh = [e for e in page if _log_key(e) not in seen]
        for e in fresh:
            seen.add(_log_key(e))
        collected.extend(fresh)
        if len(page) < want or not fresh:
            break
        oldest_ms = min(_ts_ns(e) for e in page) // 1_000_000
        end = oldest_ms if oldest_ms < end else end - 1
        if end < start_ms:
            break
    if limit:
        collected = sorted(collected, key=_ts_ns, reverse=True)[:limit]
    return sorted(collected, key=_ts_ns)


def _tail(out: "Output", client, run: dict, fetch: Callable[..., list[dict]], since_ms: int, min_level: str | None, sampler: bool) -> None:
    """Print new lines every few seconds until the trainer (or sampler) stops. Ctrl-C stops
    following (exit 130); the run itself is never touched."""
    from baseten_loops_cli.cli._resolve import SAMPLER_TERMINAL, TRAINER_TERMINAL, get_run, status_name

    seen: set = set()
    cursor = since_ms
    last_status_check = 0.0
    try:
        while True:
            now_ms = int(time.time() * 1000)
            page = fetch(start_epoch_millis=cursor, end_epoch_millis=now_ms, direction="asc", limit=LOG_PAGE_SIZE, min_level=min_level)
            fresh = [e for e in sorted(page, key=_ts_ns) if _log_key(e) not in seen]
            for entry in fresh:
                seen.add(_log_key(entry))
                _print_log(out, entry)
            if fresh:
                newest_ms = _ts_ns(fresh[-1]) // 1_000_000
                if newest_ms > cursor:
                    # keep only the keys of the boundary millisecond (the next query starts there)
                    seen = {k for k in seen if int(k[0] or 0) // 1_000_000 >= newest_ms}
                    cursor = newest_ms
            if len(page) >= LOG_PAGE_SIZE:
                continue  # more is waiting: fetch again right away
            if time.monotonic() - last_status_check >= STATUS_POLL_S:
                last_status_check = time.monotonic()
                current = get_run(client, run["id"])
                if sampler:
                    status = status_name(current.get("sampler") or {})
                    ended = status in SAMPLER_TERMINAL or not current.get("sampler")
                else:
                    dep = _deployment(client, current.get("deployment_id"))
                    status = status_name(dep) if dep else None
                    ended = status in TRAINER_TERMINAL or status_name(current) != "ACTIVE"
                if ended:
                    out.info(f"The {'sampler' if sampler else 'trainer'} is {status or 'gone'}; no more logs will come.")
                    return
            time.sleep(TAIL_POLL_S)
    except KeyboardInterrupt:
        out.info(f"Stopped following logs. Run {run['id']} keeps running.")
        raise typer.Exit(130) from None


def _print_log(out: "Output", entry: dict) -> None:
    if out.format in ("json", "jsonl"):
        out.emit_record(entry)
    elif out.format == "table" and not out.quiet:
        out.streams.stdout.write(format_log(entry) + "\n")
        out.streams.stdout.flush()
    elif out.quiet:
        out.streams.stdout.write(str(entry.get("message", "")) + "\n")
        out.streams.stdout.flush()


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
    from baseten_loops_cli.cli._resolve import get_run
    from baseten_loops_cli.errors import UsageError

    if tail and (since or start or end):
        raise UsageError("--tail cannot be combined with --since, --start or --end", hint="--tail starts from the last 30 minutes.")
    if since and (start or end):
        raise UsageError("--since cannot be combined with --start or --end")
    level = None
    if min_level is not None:
        if min_level.lower() not in LOG_LEVELS:
            raise UsageError(f"--min-level must be one of {', '.join(LOG_LEVELS)}, got {min_level!r}")
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

    state = get_state(ctx)
    out = state.output
    client = state.backend().client
    run = get_run(client, run_id)
    fetch, label = _log_source(client, run, sampler)
    entries = fetch_logs(fetch, int(start_s * 1000), int(end_s * 1000), 0 if tail else limit, level)
    if tail:
        entries = entries[-100:]
    if tail or out.format in ("jsonl",) or out.quiet:
        for entry in entries:
            _print_log(out, entry)
        if tail:
            since_ms = (_ts_ns(entries[-1]) // 1_000_000) if entries else int(start_s * 1000)
            if out.human:
                out.hint(f"Following {label} (Ctrl-C stops following; the run keeps running)...")
            _tail(out, client, run, fetch, since_ms, level, sampler)
        return
    if out.format == "table":
        if not entries:
            out.info(f"No logs from {label} in this window.")
            out.hint("Widen it with --since 1d, or lower --min-level.")
            return
        for entry in entries:
            out.streams.stdout.write(format_log(entry) + "\n")
        out.streams.stdout.flush()
        if limit and len(entries) >= limit:
            out.hint(f"Showing the newest {limit} lines; pass --limit 0 for all of them.")
        return
    out.emit({"logs": entries}, rows=entries)


# ── deactivate ────────────────────────────────────────────────────────────────────────────


@app.command("deactivate")
def deactivate(
    ctx: typer.Context,
    run_ids: Annotated[
        list[str],
        typer.Argument(help="Run ids.", autocompletion=_complete.complete_run, show_default=False),
    ],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation (needed without a terminal).")] = False,
) -> None:
    """Deactivate runs: stop their trainers and paired samplers. Saved checkpoints stay.

    Asks first (pass --yes in scripts; without a terminal and without --yes it exits 3).
    -o json prints one DeactivateLoopsRunResponse ({id, base_model, user}) per run, as a list.

    Examples:

      loops runs deactivate abc1234

      loops runs list -q | xargs loops runs deactivate --yes
    """
    from baseten_loops_cli.cli._resolve import as_dict, confirm, get_run, status_name

    state = get_state(ctx)
    out = state.output
    client = state.backend().client
    unique = list(dict.fromkeys(r.strip() for r in run_ids if r.strip()))
    runs = [get_run(client, rid) for rid in unique]  # every id is checked before anything stops
    todo = []
    for run in runs:
        if status_name(run) != "ACTIVE":
            out.info(f"Loops run {run['id']} is already {status_name(run) or 'inactive'}; skipping it.")
        else:
            todo.append(run)
    if not todo:
        if not out.human:
            out.emit([], rows=[], columns=[("ID", "id")])
        return
    if len(todo) == 1:
        run = todo[0]
        what = "its trainer and paired sampler" if run.get("sampler") else "its trainer"
        question = f"Deactivate Loops run {run['id']} ({run.get('base_model')})? This stops {what}; saved checkpoints stay available."
    else:
        ids = ", ".join(r["id"] for r in todo)
        question = f"Deactivate {len(todo)} Loops runs ({ids})? This stops their trainers and paired samplers; saved checkpoints stay available."
    confirm(out, question, yes=yes, action="deactivating " + (f"run {todo[0]['id']}" if len(todo) == 1 else f"{len(todo)} runs"))
    results = []
    for run in todo:
        results.append(as_dict(client.runs.deactivate(run["id"])) or {"id": run["id"]})
        out.success(f"Deactivated Loops run {run['id']}. Saved checkpoints remain accessible.")
    _complete.invalidate("runs")
    if not out.human:
        out.emit(results, rows=results, columns=[("ID", "id"), ("BASE MODEL", "base_model")])


# ── watch ─────────────────────────────────────────────────────────────────────────────────


def _snapshot(state, client, run_id: str) -> dict:
    from baseten_loops_cli.cli._resolve import get_run, status_name

    run = get_run(client, run_id)
    dep = _deployment(client, run.get("deployment_id"))
    version = _policy_version(state, run)
    sampler = run.get("sampler") or {}
    return {
        "time": datetime.now(timezone.utc).isoformat().replace("+00:00", "Z"),
        "run_id": run["id"],
        "run_status": status_name(run),
        "trainer_status": status_name(dep) if dep else None,
        "trainer_status_reason": (dep or {}).get("status_reason"),
        "sampler_status": status_name(sampler) if sampler else None,
        "step": version,
        "policy_version": version,
        "sampler_policy_version": sampler.get("policy_version") if sampler else None,
    }


def _watch_line(s: dict) -> str:
    parts = [f"run {s['run_status']}"]
    if s["trainer_status"]:
        parts.append(f"trainer {s['trainer_status']}")
    if s["step"] is not None:
        parts.append(f"step {s['step']}")
    if s["sampler_status"]:
        parts.append(f"sampler {s['sampler_status']}")
    if s["sampler_policy_version"] is not None:
        parts.append(f"v{s['sampler_policy_version']}")
    return " · ".join(parts)


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
    from baseten_loops_cli.cli._resolve import TRAINER_FAILED, TRAINER_TERMINAL
    from baseten_loops_cli.errors import RunFailedError

    state = get_state(ctx)
    out = state.output
    client = state.backend().client
    live = None
    last_key = None
    snap: dict = {}
    try:
        if out.human and out.streams.stderr_tty:
            from rich.live import Live
            from rich.text import Text

            live = Live(Text(""), console=out.err_console, refresh_per_second=4, transient=False)
            live.start()
        while True:
            snap = _snapshot(state, client, run_id)
            key = {k: v for k, v in snap.items() if k != "time"}
            if key != last_key:
                last_key = key
                line = _watch_line(snap)
                if live is not None:
                    from rich.text import Text

                    live.update(Text(f"{snap['run_id']}: {line}"))
                elif out.format in ("json", "jsonl"):
                    out.emit_record(snap)
                elif not out.quiet and out.format != "none":
                    stamp = datetime.now().strftime("%H:%M:%S")
                    out.streams.stdout.write(f"[{stamp}] {snap['run_id']}: {line}\n")
                    out.streams.stdout.flush()
            if snap["run_status"] != "ACTIVE" or snap["trainer_status"] in TRAINER_TERMINAL:
                break
            time.sleep(interval)
    except KeyboardInterrupt:
        if live is not None:
            live.stop()
        out.info(f"Stopped watching. Run {run_id} keeps running.")
        raise typer.Exit(130) from None
    finally:
        if live is not None:
            live.stop()
    failed = snap.get("trainer_status") in TRAINER_FAILED
    if failed:
        reason = snap.get("trainer_status_reason")
        message = f"run {snap['run_id']}'s trainer {snap['trainer_status']}" + (f": {reason}" if reason else "")
        if exit_status:
            raise RunFailedError(message, hint=f"See its logs: loops runs logs {snap['run_id']}")
        out.warn(message)
    elif snap.get("run_status") != "ACTIVE":
        out.info(f"Run {snap['run_id']} was deactivated.")
    else:
        out.info(f"Run {snap['run_id']}'s trainer is {snap['trainer_status']}.")
